"""Fresh directories and append-only attempts of a stage.

- **Claiming.** :func:`claim_dir` creates the directory of a new stage (a reference, a
  candidate run) carrying the ``INCOMPLETE`` marker (JSON: pid, host, start time, kind);
  an unsealed leftover of an interrupted run is moved aside as
  ``<name>.incomplete-<UTC stamp>``, never deleted; a directory a live process on this
  host still writes (:func:`_live_writer`) is refused.
- **Writer lock.** :func:`hold_writer_lock` makes a directory's ``INCOMPLETE`` marker the
  lock of its one writer (``flock``, released by the kernel when the writer dies, even by
  ``kill -9``): a second writer is refused with the first one's pid and host
  (:class:`~qualify.errors.WriterBusyError`), a dead writer's lock is taken over, and
  sealing holds the lock (:func:`sealing_lock`) so a live writer's directory is never sealed.
- **Attempts.** ``attempt-1``, ``attempt-2``, ... under a cell directory, created with
  :func:`os.mkdir` (atomic), never reused or overwritten; a failed attempt is kept
  (docs/concepts.md). Each new attempt carries the marker until it is sealed.

Public through :mod:`qualify.evidence.store`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import logging
import os
import re
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import psutil

from qualify.atomic import json_bytes
from qualify.display import printable
from qualify.errors import EvidenceIntegrityError, ReferenceDataError, UsageError, WriterBusyError
from qualify.evidence.sealed import atomic_write_json, is_sealed, refuse_if_sealed
from qualify.evidence.timestamps import ISO_FORMAT, utc_now_iso, utc_stamp
from qualify.layout import ATTEMPT_PREFIX, INCOMPLETE_FILE, INCOMPLETE_INFIX

__all__ = ["INCOMPLETE_INFIX", "attempt_number", "attempts", "claim_dir", "hold_writer_lock",
           "latest_complete_attempt", "new_attempt", "next_free_dir", "refuse_if_locked",
           "sealing_lock"]

_log = logging.getLogger(__name__)

_ATTEMPT_RE: Final = re.compile(rf"^{re.escape(ATTEMPT_PREFIX)}([1-9][0-9]*)$")
_MAX_ATTEMPT_RACES: Final = 1000
_MAX_LOCK_RACES: Final = 100


def _marker(kind: str) -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": utc_now_iso(),
            "kind": kind}


def _write_marker(directory: Path, kind: str) -> None:
    atomic_write_json(directory / INCOMPLETE_FILE, _marker(kind))


def _describe_writer(marker: Path) -> str:
    """``process 123 on host h (since T)`` from a marker, as far as it can be read."""
    try:
        doc = json.loads(marker.read_bytes())
        return (f"process {int(doc['pid'])} on host {doc['host']} "
                f"(since {doc.get('started', '?')})")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its marker is unreadable)"


def _busy(directory: Path, marker: Path) -> WriterBusyError:
    return WriterBusyError(f"{directory}: being written by {_describe_writer(marker)}; wait "
                           "for it to finish, or use another --run-id")


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


@contextlib.contextmanager
def hold_writer_lock(directory: str | Path, *, kind: str) -> Iterator[Path]:
    """Be the one writer of ``directory`` while the ``with`` block runs.

    The directory's ``INCOMPLETE`` marker is created if missing, locked with an exclusive
    ``flock`` (non-blocking) and rewritten in place with this process's pid, host, start
    time and ``kind``. The marker stays after the block (the directory is unsealed until
    :func:`qualify.evidence.store.seal` removes it); the lock goes with the block or with
    the process, however it dies, so a dead writer's marker is taken over by the next one.
    The descriptor is not inherited by child processes.

    Args:
        directory: an existing, unsealed directory.
        kind: what it holds (``candidate-run``...), written in the marker.

    Yields:
        The marker's path.

    Raises:
        WriterBusyError: a live process holds the lock (the message names its pid and
            host, as its marker says).
        EvidenceIntegrityError: ``directory`` is sealed or lies under a sealed directory.
        OSError: the marker cannot be created or written.
    """
    d = Path(directory)
    marker = d / INCOMPLETE_FILE
    for _ in range(_MAX_LOCK_RACES):
        if is_sealed(d):
            raise EvidenceIntegrityError(f"{d}: sealed; a sealed directory is never written "
                                         "again")
        refuse_if_sealed(marker)
        fd = os.open(marker, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            if not _try_lock(fd):
                raise _busy(d, marker)
            if not _same_file(fd, marker):  # sealed or replaced between open and lock
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, json_bytes(_marker(kind)), 0)
            os.fsync(fd)
            yield marker
            return
        finally:
            os.close(fd)
    raise EvidenceIntegrityError(f"{marker}: replaced while locking it {_MAX_LOCK_RACES} times")


@contextlib.contextmanager
def sealing_lock(directory: str | Path) -> Iterator[None]:
    """Hold the writer lock of ``directory``'s ``INCOMPLETE`` marker, if any, while sealing.

    A directory without a marker needs no lock.

    Raises:
        WriterBusyError: a live process holds the lock (see :func:`hold_writer_lock`).
    """
    d = Path(directory)
    marker = d / INCOMPLETE_FILE
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # no marker (or not a plain file): nobody holds a lock
        yield
        return
    try:
        if not _try_lock(fd):
            raise _busy(d, marker)
        yield
    finally:
        os.close(fd)


def refuse_if_locked(directory: str | Path) -> None:
    """Refuse when a live process holds ``directory``'s writer lock.

    Raises:
        WriterBusyError: see :func:`hold_writer_lock`.
    """
    with sealing_lock(directory):
        pass


def next_free_dir(base: str | Path) -> Path:
    """``base`` if nothing exists there, else the first free ``base-2``, ``base-3``, ...

    Used for ``--new``. Checking is not reserving: :func:`claim_dir` creates it.
    """
    b = Path(base)
    if not os.path.lexists(b):
        return b
    n = 2
    while os.path.lexists(b.with_name(f"{b.name}-{n}")):
        n += 1
    return b.with_name(f"{b.name}-{n}")


def _live_writer(directory: Path) -> int | None:
    """Pid of a live process on this host that is writing ``directory``, per its marker.

    A pid is taken as alive only if a process with that pid exists and started no later
    than the marker (so a recycled pid does not count). Unreadable markers, other hosts
    and this very process give ``None``.
    """
    try:
        marker = json.loads((directory / INCOMPLETE_FILE).read_bytes())
        pid, host = int(marker["pid"]), str(marker["host"])
        started = _dt.datetime.strptime(marker["started"], ISO_FORMAT)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname() or pid == os.getpid() or pid <= 0:
        return None
    try:
        proc_start = psutil.Process(pid).create_time()
    except psutil.Error:  # NoSuchProcess, AccessDenied, ZombieProcess
        return None
    marker_ts = started.replace(tzinfo=_dt.UTC).timestamp()
    return pid if proc_start <= marker_ts + 1.0 else None


def _move_aside(path: Path) -> Path:
    stem = f"{path.name}{INCOMPLETE_INFIX}{utc_stamp()}"
    target = path.with_name(stem)
    n = 2
    while os.path.lexists(target):
        target = path.with_name(f"{stem}-{n}")
        n += 1
    os.rename(path, target)
    return target


def claim_dir(path: str | Path, *, kind: str) -> Path:
    """Create a fresh directory for a new stage and mark it ``INCOMPLETE``.

    If ``path`` exists unsealed (an interrupted run, or a non-directory), it is renamed
    to ``<path>.incomplete-<UTC timestamp>`` (kept, never deleted or overwritten) and a
    fresh directory is created.

    Args:
        path: the directory to claim; its parents are created.
        kind: what it will hold, written in the marker (``reference``, ``candidate-run``...).

    Returns:
        ``path``, now an empty directory holding only ``INCOMPLETE``.

    Raises:
        ReferenceDataError: ``path`` is sealed (exit code 2): pass ``--new`` to write a
            new directory instead.
        UsageError: a live process on this host is still writing ``path`` (its marker
            names it).
        EvidenceIntegrityError: ``path`` lies under a sealed directory, or another
            process created it at the same moment.
    """
    p = Path(path)
    if is_sealed(p):
        raise ReferenceDataError(
            f"{p}: already sealed and never written again; pass --new to write a new "
            f"directory ({next_free_dir(p)})"
        )
    refuse_if_sealed(p)
    if os.path.lexists(p):
        writer = _live_writer(p) if p.is_dir() else None
        if writer is not None:
            raise UsageError(f"{p}: still being written by process {writer} on this host; "
                             "wait for it, or pass --new to write a new directory "
                             f"({next_free_dir(p)})")
        aside = _move_aside(p)
        _log.warning("%s: unsealed (interrupted) directory moved aside to %s",
                     printable(p), printable(aside))
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(p)
    except FileExistsError:
        raise EvidenceIntegrityError(f"{p}: created by another process while claiming it") \
            from None
    _write_marker(p, kind)
    return p


def attempt_number(path: str | Path) -> int:
    """N of an ``attempt-N`` directory.

    Raises:
        ValueError: the name is not ``attempt-N`` with N >= 1.
    """
    m = _ATTEMPT_RE.match(Path(path).name)
    if m is None:
        raise ValueError(f"not an attempt directory name: {Path(path).name!r}")
    return int(m.group(1))


def attempts(cell_dir: str | Path) -> list[Path]:
    """Every ``attempt-N`` directory under ``cell_dir``, sorted by N (empty if none).

    ``cell_dir`` and its attempts are taken only as real directories: a missing path, a
    plain file, a FIFO, a socket or a symbolic link (to a directory or not) in their place
    has no attempts, so a walk over a run's ``cells/`` never follows a link out of the run
    nor fails on a notes file left there.
    """
    d = Path(cell_dir)
    try:
        if not stat.S_ISDIR(os.lstat(d).st_mode):
            return []
        with os.scandir(d) as it:
            found = [d / e.name for e in it
                     if _ATTEMPT_RE.match(e.name) and e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(found, key=attempt_number)


def new_attempt(cell_dir: str | Path) -> Path:
    """Create the next ``attempt-N`` under ``cell_dir`` (N = 1 + highest existing).

    Uses :func:`os.mkdir`, which fails if the name exists, and retries with the next N
    on a race, so concurrent callers get distinct directories and no attempt is reused
    or overwritten. The new attempt carries the ``INCOMPLETE`` marker (kind ``attempt``);
    seal it with ``seal(path, kind="attempt")``.

    Args:
        cell_dir: the cell directory (created if missing).

    Returns:
        The new attempt directory.

    Raises:
        EvidenceIntegrityError: ``cell_dir`` lies under a sealed directory, or a free
            number could not be taken after many races.
    """
    d = Path(cell_dir)
    refuse_if_sealed(d / f"{ATTEMPT_PREFIX}1")
    d.mkdir(parents=True, exist_ok=True)
    for _ in range(_MAX_ATTEMPT_RACES):
        existing = [attempt_number(a) for a in attempts(d)]
        n = max(existing, default=0) + 1
        # Any entry named attempt-N (even a stray file) blocks N: never overwrite.
        while os.path.lexists(d / f"{ATTEMPT_PREFIX}{n}"):
            n += 1
        target = d / f"{ATTEMPT_PREFIX}{n}"
        try:
            os.mkdir(target)
        except FileExistsError:
            continue
        _write_marker(target, "attempt")
        return target
    raise EvidenceIntegrityError(f"{d}: could not create a new attempt after "
                                 f"{_MAX_ATTEMPT_RACES} races")


def latest_complete_attempt(cell_dir: str | Path) -> Path | None:
    """The highest-numbered attempt that is sealed (valid manifest, no ``INCOMPLETE``).

    Checks the manifest's form, not file digests (use :func:`check_sealed` for that).

    Returns:
        The attempt directory, or ``None`` if no attempt is complete.
    """
    for attempt in reversed(attempts(cell_dir)):
        if is_sealed(attempt):
            return attempt
    return None
