"""The candidate stage's one concurrency: the sampler cells beside the trainer launches.

The sampler cells need only the round-1 Actor weights that one trainer launch exports
(``sampler.weights_from``); the other trainer launches need nothing from them. So the
stage runs the exporting launch first and, once it is recorded, the sampler cells in a
thread of their own (:class:`Beside`, :meth:`Beside.go`) while the main thread goes on with
the other trainer launches: two launches at a time (``QUALIFY_JOBS``, :func:`jobs`). Every
read and write of the run document happens under one lock. No cell's numbers depend on
this: a trainer rank computes with one thread (``OMP_NUM_THREADS=1``) on frozen inputs, and
every tensor of a run was bitwise the same with the sampler cells beside the trainer
launches as after them (README.md "Speed").

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Final

from qualify.errors import UsageError

JOBS_ENV: Final = "QUALIFY_JOBS"
"""Processes the candidate stage runs at once: ``1`` runs the sampler cells after every
trainer launch; ``2`` (the default on CPU) beside them."""


def jobs(*, cuda: bool, env: dict[str, str] | None = None) -> int:
    """How many launches the candidate stage runs at once (1 or 2).

    ``QUALIFY_JOBS`` when set, else 2 on CPU and 1 on a CUDA machine (a vLLM engine and a
    trainer would share the GPU's memory).

    Raises:
        UsageError: ``QUALIFY_JOBS`` is not a positive integer.
    """
    raw = (os.environ if env is None else env).get(JOBS_ENV, "")
    if not raw:
        return 1 if cuda else 2
    if not raw.isdigit() or int(raw) < 1:
        raise UsageError(f"{JOBS_ENV}={raw!r}: must be a positive integer")
    return min(int(raw), 2)


class Beside(threading.Thread):
    """Run ``fn`` in a daemon thread once :meth:`go` is called; :meth:`result` re-raises.

    Daemon: if the main thread dies, the process exits and the thread's child process gets
    its death signal (:func:`qualify.procs.run` binds it to this thread).
    """

    def __init__(self, fn: Callable[[], None]) -> None:
        super().__init__(name="qualify-sampler-cells", daemon=True)
        self._fn, self._ready, self._cancelled = fn, threading.Event(), False
        self._error: BaseException | None = None

    def run(self) -> None:
        """Wait for :meth:`go`, then call ``fn`` (unless cancelled), keeping what it raised."""
        self._ready.wait()
        if self._cancelled:
            return
        try:
            self._fn()
        except BaseException as exc:  # re-raised in the main thread by result()
            self._error = exc

    def go(self) -> None:
        """Let ``fn`` start (the weights it needs are recorded)."""
        self._ready.set()

    def cancel(self) -> None:
        """Never start ``fn`` (the stage failed before :meth:`go`)."""
        self._cancelled = True
        self._ready.set()

    def result(self) -> None:
        """Let ``fn`` start if it has not, wait for it, and raise what it raised.

        Raises:
            BaseException: whatever ``fn`` raised.
        """
        self.go()
        self.join()
        if self._error is not None:
            raise self._error


def start(fn: Callable[[], None], *, cuda: bool) -> Beside | None:
    """A started :class:`Beside` of ``fn`` when :func:`jobs` allows two, else ``None``."""
    if jobs(cuda=cuda) < 2:
        return None
    thread = Beside(fn)
    thread.start()
    return thread


@contextlib.contextmanager
def cancelled_on_error(thread: Beside | None) -> Iterator[None]:
    """Cancel ``thread`` if the block raises (its ``fn`` never starts for a failed stage)."""
    try:
        yield
    except BaseException:
        if thread is not None:
            thread.cancel()
        raise
