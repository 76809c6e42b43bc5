"""The start gate of a launch started ahead of its turn (:mod:`qualify.candidate.ahead`).

A pipe whose read end is the warm launcher's stdin (``--wait-stdin``,
:func:`qualify.candidate.warm.wait_for_start`): one byte starts the launch's ranks, end of
file without one ends the launcher before any rank.

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Final

from qualify.evidence.timestamps import utc_now_iso

__all__ = ["START_BYTE", "Gate", "raised"]

START_BYTE: Final = b"1"
"""What the stage writes down a gate's pipe to start its launch's ranks."""


def raised(future: Future[Any]) -> bool:
    """Whether ``future`` is done and raised, or was cancelled.

    Its worker failed, not the launch it ran: a failed launch is a result.
    """
    return future.done() and (future.cancelled() or future.exception() is not None)


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
            # the time first: no rank can start before the moment recorded
            self.opened_at, self.opened_utc = time.monotonic(), utc_now_iso()
            try:
                with contextlib.suppress(OSError):  # EPIPE: the launcher failed before it
                    os.write(self._write, START_BYTE)
            finally:
                self._close_write()
                self.opened.set()

    def open_after(self, done: Future[Any]) -> None:
        """The done-callback of the launch before: :meth:`open`, or :meth:`shut` if it raised.

        A launch whose worker raised (rather than returned a result) stops the stage, so the
        launch after it must not start (``Future.add_done_callback``).
        """
        if raised(done):
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
