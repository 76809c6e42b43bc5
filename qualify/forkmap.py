"""Map a function over items in forked worker processes (report figures, comparator cells).

The workers are forks of this process (whatever it loaded is there at once, nothing is
pickled but each item and each result), on Linux, with more than one usable CPU and item
(at most :data:`MAX_WORKERS`), and only while this process runs a single Python thread: a
lock another Python thread held at the fork would stay held in the child. Native threads
(OpenBLAS's, torch's OpenMP pool) may run; a worker's function must call neither
library's parallel code. Otherwise every item is mapped here, in order. The results are in
the items' order either way, so a caller whose function is pure gets the same results
serially and in parallel. A worker ignores SIGINT (Ctrl-C interrupts this process only,
which waits for the items being mapped); a worker's exception is raised here, as the
function would raise it.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Final, TypeVar

__all__ = ["MAX_WORKERS", "default_workers", "fork_map"]

MAX_WORKERS: Final = 8
"""Most worker processes one map forks (each fork copies the pages of this process's heap
that its garbage collector touches)."""

T = TypeVar("T")
R = TypeVar("R")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def default_workers(items: int) -> int:
    """Worker processes for ``items`` items.

    Args:
        items: how many items the map has.

    Returns:
        One per usable CPU, at most one per item and :data:`MAX_WORKERS`; 1 (map in this
        process) off Linux or while this process runs another Python thread.
    """
    if sys.platform != "linux" or threading.active_count() > 1:
        return 1
    return max(1, min(items, len(os.sched_getaffinity(0)), MAX_WORKERS))


def fork_map(fn: Callable[[T], R], items: Sequence[T], *, workers: int | None = None) -> list[R]:
    """``[fn(item) for item in items]``, the items shared among forked workers.

    Args:
        fn: a module-level function (it is sent to the workers by name) of one item.
        items: picklable items; each result must be picklable too.
        workers: processes that map (default :func:`default_workers`); 1 maps here.

    Returns:
        The results in the items' order.

    Raises:
        Exception: what ``fn`` raised; ``BrokenProcessPool`` when a worker died.
    """
    n = workers if workers is not None else default_workers(len(items))
    if n <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    gc.freeze()  # this process's objects stay untouched (and shared) in the workers
    try:
        with warnings.catch_warnings():
            # Python >= 3.12 warns on any fork of a process with native threads; the
            # workers run no code of the libraries that own them (module docstring)
            warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead",
                                    category=DeprecationWarning)
            with ProcessPoolExecutor(max_workers=n, initializer=_ignore_sigint,
                                     mp_context=multiprocessing.get_context("fork"),
                                     ) as pool:
                return list(pool.map(fn, items))
    finally:
        gc.unfreeze()
