"""The one child-process-tree runner of qualify: a command, a wall-clock limit, its whole tree.

:func:`run` starts a command (by default in a session of its own), waits for it up to a
wall-clock limit, and when the limit passes, or the waiting parent is interrupted
(``KeyboardInterrupt``, any exception), ends the command's **whole process tree**, not just
the direct child: torchrun's ranks, vLLM's engine workers and whatever else the child
started would otherwise survive it.

Ending a tree: every descendant is collected first (:mod:`psutil`, recursively), because a
descendant whose parent dies is re-parented and can no longer be found from the child;
then SIGTERM goes to the child's process group (when it has its own session: that also
reaches a re-parented member of the group), to the child and to every descendant
collected; after a grace period SIGKILL goes to every survivor (and the group), and they
are waited for. A zombie counts as ended (its parent, or init, reaps it).

Dying with the parent: a ``kill -9`` of qualify runs no ``except`` clause, and a child in
a session of its own gets no terminal Ctrl-C. So on Linux every child is started with
``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (``die_with_parent``): the kernel sends it SIGTERM the
moment the thread that started it dies, however it dies. torchrun ends its workers on
SIGTERM (SIGTERM to each worker, SIGKILL after its grace period), so no rank outlives
qualify; any other child is expected to end its own descendants on SIGTERM the same way.
The death signal is bound to the *thread* that called :func:`run` (it blocks there until
the child ends, so it outlives it). A child the fork server forked (``spawn``,
:mod:`qualify.candidate.forkserver`) is the server's child, not this process's: its death
signal is bound to the server, whose own is bound to the qualify thread that started it;
the chain ends the same way.

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final, Protocol

import psutil

__all__ = ["DEATH_SIGNAL", "KILL_GRACE_S", "Child", "ProcResult", "Spawn", "death_signal_hook",
           "end_group", "exit_text", "run"]

KILL_GRACE_S: Final = 5.0
"""Default seconds between SIGTERM and SIGKILL when a tree is ended (and after SIGKILL)."""
_POLL_S: Final = 0.05
_CANCEL_POLL_S: Final = 0.25
DEATH_SIGNAL: Final = signal.SIGTERM
"""What a child gets from the kernel when the qualify thread that started it dies (Linux)."""
_PR_SET_PDEATHSIG: Final = 1

Stream = int | IO[bytes] | None
"""What a child's stdin / stdout / stderr is: as :class:`subprocess.Popen` takes it
(``subprocess.PIPE``, ``subprocess.STDOUT``, ``subprocess.DEVNULL``, a binary file object
or ``None`` to inherit)."""


class Child(Protocol):
    """What :func:`run` needs of a started child: :class:`subprocess.Popen`'s calls it makes.

    A process not started by this one (a fork server's child,
    :class:`qualify.candidate.forkserver.Child`) provides the same.
    """

    @property
    def pid(self) -> int:
        """Its process id."""

    @property
    def returncode(self) -> int | None:
        """Its exit code once known (negative: killed by that signal)."""

    @property
    def stdout(self) -> IO[bytes] | None:
        """Its stdout pipe, if any."""

    @property
    def stderr(self) -> IO[bytes] | None:
        """Its stderr pipe, if any."""

    def poll(self) -> int | None:
        """Its exit code, or ``None`` while it runs."""

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it (``subprocess.TimeoutExpired`` after ``timeout``); its exit code."""

    def communicate(self, input: Any = None,
                    timeout: float | None = None) -> tuple[Any, Any]:
        """Wait for it and read its pipes (``subprocess.TimeoutExpired`` after ``timeout``)."""

    def send_signal(self, sig: int) -> None:
        """Send it ``sig``."""


Spawn = Callable[..., "Child | None"]
"""Another way to start a command: ``spawn(cmd, env=, cwd=, stdin=, stdout=, stderr=)``
with file descriptors, returning the started :class:`Child`, or ``None`` where it cannot
(:func:`run` then starts it with :class:`subprocess.Popen`)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ProcResult:
    """How one :func:`run` ended.

    Attributes:
        returncode: the child's exit status (negative: killed by that signal, as
            :mod:`subprocess` reports it); ``None`` when it ran past the limit and its tree
            was ended.
        timed_out: the wall-clock limit passed and the tree was ended.
        wall_s: wall-clock seconds from start to the end of the child (and, on timeout,
            of its tree).
        stdout: what the child wrote to a ``subprocess.PIPE`` stdout, else ``None``.
        stderr: what the child wrote to a ``subprocess.PIPE`` stderr, else ``None``.
        pid: the child's process id.
        cancelled: ``cancel`` was set and the tree was ended (``returncode`` is ``None``).
        spawned: ``spawn`` started the child (not :class:`subprocess.Popen`).
    """

    returncode: int | None
    timed_out: bool
    wall_s: float
    stdout: bytes | None
    stderr: bytes | None
    pid: int
    cancelled: bool = False
    spawned: bool = False

    def __bool__(self) -> bool:
        return self.returncode == 0


def exit_text(returncode: int) -> str:
    """How a process ended, from its :mod:`subprocess`-style return code, for a reason line.

    ``exited with code N`` for ``N >= 0``; ``was killed by SIGKILL (signal 9)`` for ``-9``
    (``was killed by signal N`` where the signal has no name here).
    """
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"was killed by signal {-returncode}"
    return f"was killed by {name} (signal {-returncode})"


def death_signal_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get :data:`DEATH_SIGNAL` when we die (Linux).

    libc is loaded here, in the parent, so the forked child only calls into it. If the
    parent died before the hook ran, the child signals itself at once.

    Returns:
        The hook, or ``None`` off Linux or without a loadable libc.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    sig = int(DEATH_SIGNAL)

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return hook


def run(cmd: Sequence[str], *, timeout_s: float, stdout: Stream = None,
        stderr: Stream = None, stdin: Stream = subprocess.DEVNULL,
        env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
        new_session: bool = True, grace_s: float = KILL_GRACE_S,
        die_with_parent: bool = True, cancel: threading.Event | None = None,
        clock_from: threading.Event | None = None, spawn: Spawn | None = None) -> ProcResult:
    """Run ``cmd`` with a wall-clock limit; on timeout or interruption end its whole tree.

    Args:
        cmd: program and arguments (no shell).
        timeout_s: wall-clock limit (> 0) in seconds.
        stdout: the child's stdout (:data:`Stream`); ``subprocess.PIPE`` captures it into
            :attr:`ProcResult.stdout`.
        stderr: the child's stderr (:data:`Stream`; ``subprocess.STDOUT`` merges it).
        stdin: the child's stdin (default ``/dev/null``: a child never waits on a terminal).
        env: the child's whole environment (default: this process's).
        cwd: the child's working directory (default: this process's).
        new_session: start the child in a session (and process group) of its own, so the
            terminal's Ctrl-C reaches only this process, which then ends the tree, and a
            re-parented descendant is still reached through the group.
        grace_s: seconds (>= 0) a tree is given after SIGTERM, and again after SIGKILL.
        die_with_parent: on Linux, the kernel sends the child :data:`DEATH_SIGNAL` when
            the calling thread dies (``kill -9`` of qualify included); see the module
            docstring.
        cancel: when set (by another thread), the tree is ended as on a timeout and the
            result says ``cancelled`` (the candidate stage's sampler thread, when the main
            thread fails).
        clock_from: when given, the wall-clock limit counts from when this event is set
            (seen within :data:`_CANCEL_POLL_S`), not from the start: the child may wait
            unlimited until then (a launch started ahead of its turn, whose launcher waits
            for its start signal, :mod:`qualify.candidate.ahead`).
        spawn: start the child this way when it can (:data:`Spawn`; the fork server,
            :mod:`qualify.candidate.forkserver`): only with ``new_session`` and
            ``die_with_parent`` (it must give both) and no ``subprocess.PIPE``; ``None`` or a
            refusal: :class:`subprocess.Popen`.

    Returns:
        The :class:`ProcResult`; a timeout is a result (``timed_out``), not an exception.

    Raises:
        ValueError: ``timeout_s`` is not positive or ``grace_s`` is negative.
        OSError: the program cannot be started.
        BaseException: whatever interrupted the wait (``KeyboardInterrupt``, ...), re-raised
            after the tree was ended.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if not grace_s >= 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    t0 = time.monotonic()
    forked: Child | None = None
    if spawn is not None and new_session and die_with_parent:
        forked = _spawned(spawn, cmd, stdin=stdin, stdout=stdout, stderr=stderr, env=env,
                          cwd=cwd)
    spawned = forked is not None
    proc: Child
    if forked is not None:
        proc = forked
    else:
        proc = subprocess.Popen(list(cmd), stdin=stdin, stdout=stdout, stderr=stderr,
                                env=None if env is None else dict(env), cwd=cwd,
                                start_new_session=new_session,
                                # the hook only calls prctl (libc loaded before the fork),
                                # getppid and kill: no lock a thread could hold is taken
                                preexec_fn=death_signal_hook()  # noqa: PLW1509
                                if die_with_parent else None)
    timed_out = cancelled = False
    out: bytes | None
    err: bytes | None
    try:
        try:
            out, err = (proc.communicate(timeout=timeout_s)
                        if cancel is None and clock_from is None
                        else _communicate(proc, timeout_s, cancel or threading.Event(),
                                          clock_from))
        except subprocess.TimeoutExpired:
            cancelled = cancel is not None and cancel.is_set()
            timed_out = not cancelled
            _end_tree(proc, group=new_session, grace_s=grace_s)
            out, err = _drain(proc, grace_s)
    except BaseException:
        _end_tree(proc, group=new_session, grace_s=grace_s)
        raise
    return ProcResult(returncode=None if timed_out or cancelled else proc.returncode,
                      timed_out=timed_out, wall_s=round(time.monotonic() - t0, 3), stdout=out,
                      stderr=err, pid=proc.pid, cancelled=cancelled, spawned=spawned)


def _fd_of(stream: Stream, *, fallback: int, opened: list[int]) -> int | None:
    """The fd a :class:`Child` gets for ``stream``; ``None`` for ``subprocess.PIPE``."""
    if stream == subprocess.PIPE:
        return None
    if stream == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        opened.append(fd)
        return fd
    if stream is None:
        return fallback
    if isinstance(stream, int):
        return stream
    return stream.fileno()


def _spawned(spawn: Spawn, cmd: Sequence[str], *, stdin: Stream, stdout: Stream,
             stderr: Stream, env: Mapping[str, str] | None,
             cwd: str | Path | None) -> Child | None:
    """``spawn`` of ``cmd`` with :func:`run`'s streams as fds; ``None`` where it cannot."""
    opened: list[int] = []
    try:
        fin = _fd_of(stdin, fallback=0, opened=opened)
        fout = _fd_of(stdout, fallback=1, opened=opened)
        ferr = (fout if stderr == subprocess.STDOUT
                else _fd_of(stderr, fallback=2, opened=opened))
        if fin is None or fout is None or ferr is None:
            return None
        return spawn(list(cmd), env=dict(os.environ if env is None else env), cwd=cwd,
                     stdin=fin, stdout=fout, stderr=ferr)
    finally:
        for fd in opened:
            os.close(fd)


def _communicate(proc: Child, timeout_s: float, cancel: threading.Event,
                 clock_from: threading.Event | None) -> tuple[bytes | None, bytes | None]:
    """``proc.communicate`` until ``timeout_s`` passed or ``cancel`` is set.

    The time counts from now, or with ``clock_from`` from when that event is first seen set.

    Raises:
        subprocess.TimeoutExpired: the limit passed or ``cancel`` was set first.
    """
    deadline = time.monotonic() + timeout_s if clock_from is None else None
    while True:
        if deadline is None and clock_from is not None and clock_from.is_set():
            deadline = time.monotonic() + timeout_s
        step = _CANCEL_POLL_S if deadline is None else min(deadline - time.monotonic(),
                                                           _CANCEL_POLL_S)
        try:
            return proc.communicate(timeout=max(step, 0.0))
        except subprocess.TimeoutExpired:
            if (deadline is not None and time.monotonic() >= deadline) or cancel.is_set():
                raise


def _drain(proc: Child, grace_s: float) -> tuple[bytes | None, bytes | None]:
    """What is left in the pipes of an ended child (nothing, if something still holds them)."""
    try:
        return proc.communicate(timeout=max(grace_s, _POLL_S))
    except subprocess.TimeoutExpired:  # an escaped descendant keeps the pipe open
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        return (b"" if proc.stdout is not None else None,
                b"" if proc.stderr is not None else None)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _running(procs: Sequence[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` that still run (a zombie or a reused pid does not)."""
    alive = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
    return alive


def _group_members(pgid: int) -> list[psutil.Process]:
    """The processes of group ``pgid`` that still run (a zombie does not)."""
    members = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                members.append(p)
    return members


def end_group(pgid: int, *, grace_s: float = KILL_GRACE_S) -> int:
    """End what is left of process group ``pgid`` after its leader exited; how many were left.

    A child :func:`run` started in a session of its own leads its group; whatever it left
    running there (a rank's own child, say) is re-parented when it exits and found only
    through the group. SIGTERM to the group, SIGKILL after ``grace_s`` to what still runs.

    Raises:
        ValueError: ``grace_s`` is negative.
    """
    if not grace_s >= 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    left = len(_group_members(pgid))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _group_members(pgid):
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + grace_s
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    return left


def _group_has_members(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _end_tree(proc: Child, *, group: bool, grace_s: float) -> None:
    """SIGTERM the child, its group and every descendant; SIGKILL survivors after ``grace_s``.

    Descendants are collected before any signal (they are re-parented once their parent
    dies). Returns once every one has ended or a second grace period after SIGKILL passed.
    """
    family = _descendants(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                p.send_signal(sig)
        deadline = time.monotonic() + grace_s
        while True:
            family = _running(family)
            if (not family and proc.poll() is not None) or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        if not family and proc.poll() is not None and not (
                sig == signal.SIGTERM and group and _group_has_members(proc.pid)):
            break
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=max(grace_s, _POLL_S))
