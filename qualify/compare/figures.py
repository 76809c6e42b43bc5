"""The figures of one ``report.html``, drawn in parallel worker processes.

A page is built in two passes: its sections call :meth:`Figures.add` with a drawing function
of :mod:`qualify.compare.plots` and its arguments, and put the placeholder it returns where
the ``<svg>`` goes; :meth:`Figures.fill` then draws every figure and puts each SVG text in
its place. Each figure is a pure function of its arguments (the same data gives the same
bytes, :func:`qualify.compare.plots.svg`), so the page is the same text whether its figures
were drawn one after another or in parallel; ``tests/test_html_report.py`` compares the two.

A placeholder holds a random token drawn per page, so no text of the page (a cell id, a
module name from an unsigned ``diverge.json``) can pose as one, and :meth:`Figures.fill`
refuses a page whose placeholders are not each of its figures exactly once.

Parallel drawing forks the rendering process (the drawing modules are imported already, so
a worker starts at once), on Linux, with more than one usable CPU and figure (at most
:data:`MAX_WORKERS`), and only while the process runs a single Python thread: a lock another
Python thread held at the fork would stay held in the child. Native threads (OpenBLAS's,
torch's OpenMP pool) may run; a worker calls neither library's parallel code. Otherwise
every figure is drawn here, in order. A worker ignores SIGINT (Ctrl-C interrupts this
process only, which waits for the figures being drawn); a worker's exception is raised here,
as the drawing function would raise it.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import secrets
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Final

__all__ = ["MAX_WORKERS", "Figures", "default_workers"]

MAX_WORKERS: Final = 8
"""Most worker processes one page forks (a page has about 15 figures; each fork copies the
pages of the parent's heap that its garbage collector touches)."""

Draw = Callable[..., str]
"""A drawing function: arguments to the figure's SVG text (module-level, so picklable)."""


def _draw(job: tuple[Draw, tuple[Any, ...], dict[str, Any]]) -> str:
    fn, args, kwargs = job
    return fn(*args, **kwargs)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def default_workers(figures: int) -> int:
    """Worker processes for a page of ``figures`` figures.

    Args:
        figures: how many figures the page draws.

    Returns:
        One per usable CPU, at most one per figure and :data:`MAX_WORKERS`; 1 (draw in this
        process) off Linux or while this process runs another Python thread.
    """
    if sys.platform != "linux" or threading.active_count() > 1:
        return 1
    return max(1, min(figures, len(os.sched_getaffinity(0)), MAX_WORKERS))


class Figures:
    """The figure calls of one page, drawn when the page's text is complete."""

    def __init__(self) -> None:
        self._jobs: list[tuple[Draw, tuple[Any, ...], dict[str, Any]]] = []
        self._token = secrets.token_hex(16)
        self._found = re.compile(f"\x00figure-{self._token}-([0-9]+)\x00")

    def add(self, draw: Draw, /, *args: Any, **kwargs: Any) -> str:
        """Record ``draw(*args, **kwargs)``; the placeholder to put where its SVG goes."""
        self._jobs.append((draw, args, kwargs))
        return f"\x00figure-{self._token}-{len(self._jobs) - 1}\x00"

    def fill(self, text: str, *, workers: int | None = None) -> str:
        """``text`` with each placeholder replaced by its figure's SVG text.

        Args:
            text: the page holding each placeholder :meth:`add` returned, once.
            workers: processes that draw (default :func:`default_workers`); 1 draws here.

        Returns:
            The page with every figure in place.

        Raises:
            ValueError: ``text`` does not hold each placeholder exactly once (before
                anything is drawn).
            Exception: what a drawing function raised; ``BrokenProcessPool`` when a worker
                died.
        """
        found = [int(m.group(1)) for m in self._found.finditer(text)]
        if sorted(found) != list(range(len(self._jobs))):
            raise ValueError(f"the page holds figure placeholders {sorted(found)}, not each "
                             f"of its {len(self._jobs)} figures once")
        n = workers if workers is not None else default_workers(len(self._jobs))
        if n <= 1 or len(self._jobs) <= 1:
            svgs = [_draw(job) for job in self._jobs]
        else:
            gc.freeze()  # the parent's objects stay untouched (and shared) in the workers
            try:
                with warnings.catch_warnings():
                    # Python >= 3.12 warns on any fork of a process with native threads;
                    # the workers run no code of the libraries that own them (docstring)
                    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead",
                                            category=DeprecationWarning)
                    with ProcessPoolExecutor(max_workers=n, initializer=_ignore_sigint,
                                             mp_context=multiprocessing.get_context("fork"),
                                             ) as pool:
                        svgs = list(pool.map(_draw, self._jobs))
            finally:
                gc.unfreeze()
        return self._found.sub(lambda m: svgs[int(m.group(1))], text)
