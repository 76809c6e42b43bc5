"""The candidate stage's one concurrency: the sampler cells beside the trainer launches.

The sampler cells need only the round-1 Actor weights that one trainer launch exports
(``sampler.weights_from``); the other trainer launches need nothing from them. So the
stage runs the exporting launch first, and the sampler cells from the start in a thread of
their own (:func:`running`, :meth:`Beside.go`: their engines start, then wait for the
weights, :mod:`qualify.candidate.sampler_stage`) while the main thread goes on with the
trainer launches: two launches at a time (``QUALIFY_JOBS``, :func:`jobs`). Every
read and write of the run document happens under one lock. No cell's numbers depend on
this: a trainer rank computes with one thread (``OMP_NUM_THREADS=1``) on frozen inputs, and
every tensor of a run was bitwise the same with the sampler cells beside the trainer
launches as after them (``docs/performance.md``).

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Final

from qualify.candidate.launch import check_launch_env
from qualify.errors import UsageError

JOBS_ENV: Final = "QUALIFY_JOBS"
"""Launches the candidate stage runs at once: ``1`` runs the sampler cells after every
trainer launch (before the resume cells, as with ``2``); ``2`` (the default on CPU) beside
them."""


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


AHEAD_ENV: Final = "QUALIFY_AHEAD"
"""``0`` turns launching ahead off (``1``, the default, leaves it to :func:`ahead`)."""


def ahead(*, cuda: bool, env: Mapping[str, str] | None = None) -> bool:
    """Whether the candidate stage starts trainer launches ahead (:mod:`qualify.candidate.ahead`).

    On CPU with the warm launcher (``QUALIFY_LAUNCHER`` unset or ``warm``), unless
    ``QUALIFY_AHEAD=0`` or ``QUALIFY_JOBS=1``. An engine given its own interpreter
    (``QUALIFY_LAUNCHER_<ENGINE>``) launches under torchrun: its gated launch waits for its
    turn in this process (:func:`qualify.candidate.launch.launch`).

    Raises:
        UsageError: ``QUALIFY_AHEAD`` is not ``0`` or ``1``, or ``QUALIFY_JOBS``,
            ``QUALIFY_LAUNCHER`` or ``QUALIFY_NNODES`` is bad (:func:`jobs`,
            :func:`qualify.candidate.launch.check_launch_env`).
    """
    e = os.environ if env is None else env
    raw = e.get(AHEAD_ENV, "")
    if raw not in ("", "0", "1"):
        raise UsageError(f"{AHEAD_ENV}={raw!r}: must be 0 or 1")
    return (not cuda and raw != "0" and jobs(cuda=cuda, env=dict(e)) >= 2
            and check_launch_env(e) == "warm")


def check_settings() -> None:
    """Refuse bad launch settings now, before the run directory exists.

    ``QUALIFY_JOBS``, ``QUALIFY_AHEAD``, ``QUALIFY_LAUNCHER``, ``QUALIFY_NNODES``.

    Raises:
        UsageError: the variable and its value (:func:`jobs`, :func:`ahead`,
            :func:`qualify.candidate.launch.check_launch_env`).
    """
    jobs(cuda=False)
    ahead(cuda=False)
    check_launch_env()


class Beside(threading.Thread):
    """Run ``fn(stop)`` in a daemon thread once :meth:`go` is called; :meth:`result` re-raises.

    ``stop`` is an event ``fn`` checks between its cells and hands to
    :func:`qualify.procs.run` (``cancel``): :meth:`stop` ends the running cell's process
    tree and starts no other. Daemon: if the whole process dies, the thread's child process
    still gets its death signal (:func:`qualify.procs.run` binds it to this thread).
    """

    def __init__(self, fn: Callable[[threading.Event], None]) -> None:
        super().__init__(name="qualify-sampler-cells", daemon=True)
        self._fn, self._ready, self._halt = fn, threading.Event(), threading.Event()
        self._error: BaseException | None = None

    def run(self) -> None:
        """Wait for :meth:`go`, then call ``fn`` (unless stopped), keeping what it raised."""
        self._ready.wait()
        if self._halt.is_set():
            return
        try:
            self._fn(self._halt)
        except BaseException as exc:  # re-raised in the main thread by result()
            self._error = exc

    def go(self) -> None:
        """Let ``fn`` start (the candidate stage: as soon as its launches begin)."""
        self._ready.set()

    def stop(self) -> BaseException | None:
        """Stop ``fn`` (the stage failed), wait for the thread; what ``fn`` raised, if any."""
        self._halt.set()
        self._ready.set()
        self.join()
        return self._error

    def result(self) -> None:
        """Let ``fn`` start if it has not, wait for it, and raise what it raised.

        Raises:
            BaseException: whatever ``fn`` raised.
        """
        self.go()
        self.join()
        if self._error is not None:
            raise self._error


@contextlib.contextmanager
def running(fn: Callable[[threading.Event], None], *, cuda: bool) -> Iterator[Beside | None]:
    """A started :class:`Beside` of ``fn`` when :func:`jobs` allows two, else ``None``.

    If the block raises, the thread is stopped and joined before the exception goes on
    (the run keeps one writer); an error of ``fn`` then is printed, not lost.
    """
    thread = None
    if jobs(cuda=cuda) >= 2:
        thread = Beside(fn)
        thread.start()
    try:
        yield thread
    except BaseException as exc:
        if thread is not None:
            error = thread.stop()
            if error is not None and error is not exc:
                print(f"qualify: the sampler cells beside the failed stage also failed: "
                      f"{type(error).__name__}: {error}", file=sys.stderr)
        raise
