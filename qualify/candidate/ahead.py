"""Start each trainer launch one turn ahead: its launcher imports while the launch before runs.

The candidate stage's trainer launches run one after another, and a warm launcher
(:mod:`qualify.candidate.warm`) spends its first seconds on one core importing torch,
transformers and its engine before it forks any rank. So the stage starts launch ``i``'s
launcher as soon as launch ``i - 1`` has started, with ``--wait-stdin``: it imports, then
waits; its :class:`Gate` opens (one byte down the pipe that is its stdin) as soon as launch
``i - 1``'s :func:`~qualify.candidate.launch.launch` has returned (its process tree ended,
its logs read), and only then does it fork its ranks. At most one
launch's ranks run at a time, as before; beside them run the sampler cells
(:mod:`qualify.candidate.beside`) and one importing interpreter.

A launch's wall-clock limit, ``wall_s`` and ``started`` count from its gate
(:func:`qualify.procs.run`'s ``clock_from``, :func:`qualify.candidate.launch.launch`), so a
launch started ahead has its imports outside them; ``result.json`` says so (``ahead``) and
records when its launcher started (``launcher_started``). No rank exists before the gate
opens, so no cell's numbers can depend on this (each rank computes on frozen inputs with one
thread).
Where the launcher is not the warm one (torchrun, srun, a foreign interpreter: every CUDA
launch), a gated launch waits for its gate in this process and starts its launcher then:
nothing runs ahead.

When it runs ahead (:func:`enabled`): on CPU under ``QUALIFY_JOBS`` 2 (the default there,
:func:`qualify.candidate.beside.jobs`); ``QUALIFY_AHEAD=0`` or ``QUALIFY_JOBS=1`` runs every
launch strictly after the one before. A launch starts ahead only while ``MemAvailable``
(``/proc/meminfo``) holds the planned host peak of the launch it waits for plus one
interpreter (:func:`room_ahead`, :func:`qualify.reference.plan.launch_host_peaks`); else it
starts in its turn.

If the stage stops (an exception, Ctrl-C), every gate is shut: a launcher before its gate
reads end of file and exits before any rank (:data:`qualify.candidate.warm.GATE_SHUT_EXIT`),
and a launch past its gate is cancelled (its process tree ended, as on a timeout). A launch
whose worker raised shuts the next gate instead of opening it (:meth:`Gate.open_after`).

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Final

from qualify.candidate.beside import jobs
from qualify.candidate.launch import check_launch_env
from qualify.errors import UsageError
from qualify.evidence.timestamps import utc_now_iso

__all__ = ["AHEAD_ENV", "START_BYTE", "Gate", "enabled", "mem_available", "room_ahead"]

AHEAD_ENV: Final = "QUALIFY_AHEAD"
"""``0`` turns launching ahead off (``1``, the default, leaves it to :func:`enabled`)."""
START_BYTE: Final = b"1"
"""What the stage writes down a gate's pipe to start its launch's ranks."""


class Gate:
    """The start gate of one launch: a pipe whose read end is its launcher's stdin.

    :meth:`open` writes :data:`START_BYTE` and closes the write end (the launcher forks its
    ranks); :meth:`shut` closes it without writing (the launcher exits before any rank) and
    sets :attr:`cancelled`, which also ends a launch already past its gate
    (:func:`qualify.procs.run`'s ``cancel``). Opening is final: :meth:`open` after either
    call does nothing, and :meth:`shut` after :meth:`open` only cancels. Both ends are
    created non-inheritable (PEP 446): only the launcher, which gets the read end as its
    stdin, holds a copy, so no other child keeps the pipe open. :meth:`release` closes this
    process's read end once the launcher has it. Every call is safe from any thread and
    more than once.
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        self._lock = threading.Lock()
        self.opened = threading.Event()
        """Set when the gate opened (the launch's wall-clock limit counts from here)."""
        self.cancelled = threading.Event()
        """Set when the gate was shut: the launch must not run, or must stop."""
        self.opened_at: float | None = None
        """``time.monotonic()`` when the gate opened."""
        self.opened_utc: str | None = None
        """The UTC time (ISO 8601, :func:`qualify.evidence.timestamps.utc_now_iso`) it opened."""

    @property
    def stdin(self) -> int:
        """The read end, for the launcher's stdin."""
        return self._read

    @property
    def decided(self) -> bool:
        """Whether the gate was opened or shut."""
        return self.opened.is_set() or self.cancelled.is_set()

    def wait(self) -> bool:
        """Block until the gate is opened or shut; whether it was opened (and not shut)."""
        while not self.decided:
            self.opened.wait(0.05)
        return self.opened.is_set() and not self.cancelled.is_set()

    def _close_write(self) -> None:
        """Close the write end once (the caller holds the lock)."""
        if self._write >= 0:
            fd, self._write = self._write, -1
            with contextlib.suppress(OSError):
                os.close(fd)

    def open(self) -> None:
        """Start the launch (no effect once opened or shut)."""
        with self._lock:
            if self.decided:
                return
            try:
                with contextlib.suppress(OSError):  # EPIPE: the launcher failed before it
                    os.write(self._write, START_BYTE)
            finally:
                self._close_write()
                self.opened_at, self.opened_utc = time.monotonic(), utc_now_iso()
                self.opened.set()

    def open_after(self, done: Future[Any]) -> None:
        """The done-callback of the launch before: :meth:`open`, or :meth:`shut` if it raised.

        A launch whose worker raised (rather than returned a result) stops the stage, so the
        launch after it must not start (``Future.add_done_callback``).
        """
        if done.cancelled() or done.exception() is not None:
            self.shut()
        else:
            self.open()

    def shut(self) -> None:
        """Stop the launch: before its gate it never starts; past it, it is cancelled."""
        with self._lock:
            try:
                self._close_write()
            finally:
                self.cancelled.set()

    def release(self) -> None:
        """Close this process's read end (after the launcher has started, or never will)."""
        with self._lock:
            if self._read >= 0:
                fd, self._read = self._read, -1
                with contextlib.suppress(OSError):
                    os.close(fd)


def enabled(*, cuda: bool, env: Mapping[str, str] | None = None) -> bool:
    """Whether the candidate stage starts trainer launches ahead (see the module docstring).

    On CPU with the warm launcher (``QUALIFY_LAUNCHER`` unset or ``warm``), unless
    ``QUALIFY_AHEAD=0`` or ``QUALIFY_JOBS=1``. An engine given its own interpreter
    (``QUALIFY_LAUNCHER_<ENGINE>``) launches under torchrun: its gated launch waits for its
    turn in this process (:func:`qualify.candidate.launch.launch`).

    Raises:
        UsageError: ``QUALIFY_AHEAD`` is not ``0`` or ``1``, or ``QUALIFY_JOBS``,
            ``QUALIFY_LAUNCHER`` or ``QUALIFY_NNODES`` is bad
            (:func:`qualify.candidate.beside.jobs`,
            :func:`qualify.candidate.launch.check_launch_env`).
    """
    e = os.environ if env is None else env
    raw = e.get(AHEAD_ENV, "")
    if raw not in ("", "0", "1"):
        raise UsageError(f"{AHEAD_ENV}={raw!r}: must be 0 or 1")
    return (not cuda and raw != "0" and jobs(cuda=cuda, env=dict(e)) >= 2
            and check_launch_env(e) == "warm")


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` in bytes; ``None`` where the kernel does not report it."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def room_ahead(planned_peak: int, interpreter: int, *, available: int | None) -> bool:
    """Whether a launcher may import beside a running launch.

    Args:
        planned_peak: host bytes the running launch is planned to peak at (its ranks, and
            the sampler cells beside it: :func:`qualify.reference.plan.launch_host_peaks`).
        interpreter: host bytes of the importing launcher
            (:data:`qualify.reference.plan.INTERPRETER_BYTES`).
        available: ``MemAvailable`` now (:func:`mem_available`); ``None`` (unknown) is no.
    """
    return available is not None and available >= planned_peak + interpreter
