"""The one atomic write of qualify (and of its harnesses).

A file is written to a temporary file in the same directory
(``.tmp-<name>.<host>.<pid>.<random>.partial``), flushed, ``fsync``-ed and renamed over its
name with :func:`os.replace`, then the directory is ``fsync``-ed. A reader sees the old file
or the new one, never a part. A writer that fails removes its temporary file.

A writer killed between the temporary file and the rename (``kill -9``, a power loss)
cannot remove it: the temporary file's name says which process on which host wrote it,
so :func:`remove_stale_temporaries` can tell a dead writer's leftover (removed) from a
live writer's temporary file (never touched). Each write removes the stale temporaries of
its own destination first; sealing (:func:`qualify.evidence.store.seal`) removes every
stale one of the directory. A temporary file whose writer cannot be told (another host,
an older name without a pid) is kept.

The sealed-directory guard lives above this module (:mod:`qualify.evidence.store`); this
one knows nothing of evidence.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Final

import psutil

from qualify import libc
from qualify.crashpoints import maybe_crash
from qualify.display import printable

__all__ = ["TMP_PREFIX", "TMP_SUFFIX", "TempWriter", "fsync_dir", "host_tag", "is_temporary",
           "json_bytes", "remove_stale_temporaries", "rename_noreplace", "temp_prefix",
           "temp_writer", "write_bytes", "write_json", "write_with", "writer_alive"]

_log = logging.getLogger(__name__)

TMP_PREFIX: Final = ".tmp-"
"""Prefix of every temporary file of an atomic write."""
TMP_SUFFIX: Final = ".partial"
"""Suffix of every temporary file of an atomic write."""
_HOST_MAX: Final = 40
_TEMP_RE: Final = re.compile(
    rf"^{re.escape(TMP_PREFIX)}(?P<name>.+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>[1-9][0-9]*)"
    rf"\.[^.]+{re.escape(TMP_SUFFIX)}$")
_PID_SLACK_S: Final = 1.0
_AT_FDCWD: Final = -100
_RENAME_NOREPLACE: Final = 1


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TempWriter:
    """Who wrote a temporary file, as its name says.

    Attributes:
        name: the destination file name the temporary file was to become.
        host: :func:`host_tag` of the writer's host.
        pid: the writer's process id on that host.
    """

    name: str
    host: str
    pid: int


def host_tag(host: str | None = None) -> str:
    """``host`` (default: this host's name) as it appears in a temporary file's name.

    Every character outside ``[A-Za-z0-9-]`` becomes ``-`` and the tag is cut at 40
    characters, so the tag holds no dot and the name stays short.
    """
    raw = socket.gethostname() if host is None else host
    return (re.sub(r"[^A-Za-z0-9-]", "-", raw)[:_HOST_MAX]) or "host"


def temp_prefix(name: str) -> str:
    """The ``tempfile`` prefix of this process's temporaries for ``name``: files or directories.

    ``.tmp-<name>.<host>.<pid>.``; their suffix is :data:`TMP_SUFFIX`.
    """
    return f"{TMP_PREFIX}{name}.{host_tag()}.{os.getpid()}."


def is_temporary(name: str) -> bool:
    """True if ``name`` is the name of an atomic write's temporary file (any format)."""
    return name.startswith(TMP_PREFIX) and name.endswith(TMP_SUFFIX)


def temp_writer(name: str) -> TempWriter | None:
    """The writer a temporary file's name records; ``None`` if it records none.

    Args:
        name: a file name (no directory).
    """
    m = _TEMP_RE.match(name)
    if m is None:
        return None
    return TempWriter(name=m.group("name"), host=m.group("host"), pid=int(m.group("pid")))


def writer_alive(path: Path) -> bool | None:
    """Whether the writer of temporary file ``path`` still runs.

    A pid counts as the writer only if that process started no later than the file was
    last written (so a recycled pid is not mistaken for the writer); a zombie is dead.

    Returns:
        ``True`` / ``False``; ``None`` when it cannot be told: the name records no writer,
        or the writer ran on another host.
    """
    writer = temp_writer(path.name)
    if writer is None or writer.host != host_tag():
        return None
    if writer.pid == os.getpid():
        return True
    try:
        mtime = path.lstat().st_mtime
        proc = psutil.Process(writer.pid)
        alive = proc.status() != psutil.STATUS_ZOMBIE
        return alive and proc.create_time() <= mtime + _PID_SLACK_S
    except (FileNotFoundError, psutil.NoSuchProcess):
        return False
    except psutil.Error:  # AccessDenied: it exists; assume it writes
        return True


def remove_stale_temporaries(directory: str | Path, *, recursive: bool = False,
                             name: str | None = None) -> list[Path]:
    """Remove the temporary files of dead writers under ``directory``.

    A temporary file whose writer is alive, or cannot be told (:func:`writer_alive` is
    ``None``), is never touched. Symlinked directories are not followed. A temporary
    directory (named by :func:`temp_prefix` too: a spill of
    :mod:`qualify.reference.gram_factors`) is removed whole.

    Args:
        directory: where to look (a missing directory is empty).
        recursive: also look in every subdirectory.
        name: only the temporaries of this destination file name.

    Returns:
        The removed paths, sorted.

    Raises:
        OSError: a stale temporary file could not be removed (a read-only directory).
    """
    d = Path(directory)
    removed: list[Path] = []
    walker = os.walk(d, followlinks=False) if recursive else [(str(d), [], _names(d))]
    for root, dirs, files in walker:
        for fname in [*files, *dirs]:
            if not is_temporary(fname):
                continue
            writer = temp_writer(fname)
            if name is not None and (writer is None or writer.name != name):
                continue
            full = Path(root) / fname
            if writer_alive(full) is False:
                if full.is_dir() and not full.is_symlink():
                    with contextlib.suppress(FileNotFoundError):
                        shutil.rmtree(full)
                    if fname in dirs:
                        dirs.remove(fname)  # os.walk does not go into it
                else:
                    with contextlib.suppress(FileNotFoundError):
                        full.unlink()
                _log.warning("%s: removed the temporary file of a dead writer (pid %s)",
                             printable(full), writer.pid if writer else "?")
                removed.append(full)
    return sorted(removed)


def _names(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []


def fsync_dir(directory: Path) -> None:
    """``fsync`` a directory so a rename in it is durable (best effort off POSIX)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_with(path: str | Path, write: Callable[[IO[bytes]], object], *,
               mode: int = 0o644) -> None:
    """Write ``path`` atomically through ``write(f)`` on a binary temporary file.

    Parent directories are created; an existing file is replaced whole. Stale temporary
    files of the same destination left by dead writers are removed first
    (:func:`remove_stale_temporaries`).

    Args:
        path: destination file.
        write: writes the content to the open temporary file.
        mode: permission bits of the final file.

    Raises:
        OSError: the write failed (no temporary file is left behind; the old file, if
            any, is untouched); its ``filename`` is ``path`` when the failing call named
            none (a full disk surfaces in ``write`` or ``fsync``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent, name=path.name)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path.name),
                                    suffix=TMP_SUFFIX)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            maybe_crash("full", path)  # test-only fault injection (qualify.crashpoints)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        maybe_crash("write", path)  # test-only fault injection (qualify.crashpoints)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if exc.filename is None:  # write() and fsync() name no file: name the destination
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def rename_noreplace(src: str | Path, dst: str | Path) -> None:
    """Rename ``src`` to ``dst`` atomically, failing if ``dst`` exists (never overwrites).

    Linux ``renameat2(RENAME_NOREPLACE)``: no moment has both names, so a writer killed at
    any point leaves either its temporary file (no ``dst``) or ``dst`` alone. Where that
    call is missing (another OS, an old libc, a file system without it) ``dst`` is made a
    hard link of ``src`` and ``src`` removed: equally never overwriting, but a writer killed
    between the two leaves both.

    Raises:
        FileExistsError: ``dst`` exists.
        OSError: the rename failed otherwise.
    """
    maybe_crash("rename", dst)  # test-only fault injection (qualify.crashpoints)
    s, d = os.fsencode(src), os.fsencode(dst)
    renameat2 = libc.function("renameat2")
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, s, _AT_FDCWD, d, _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), os.fsdecode(d))
    os.link(s, d)
    os.unlink(s)


def write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically; see :func:`write_with`.

    Raises:
        OSError: the write failed.
    """
    write_with(path, lambda f: f.write(data))


def json_bytes(obj: Any) -> bytes:
    """``obj`` as qualify writes JSON: sorted keys, indent 2, UTF-8, trailing newline.

    Raises:
        ValueError: ``obj`` holds NaN or an infinity (not JSON).
        TypeError: ``obj`` is not JSON-serialisable.
    """
    text = json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False)
    return (text + "\n").encode("utf-8")


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as JSON (:func:`json_bytes`) to ``path`` atomically.

    Raises:
        ValueError: ``obj`` holds NaN or an infinity.
        TypeError: ``obj`` is not JSON-serialisable.
        OSError: the write failed.
    """
    write_bytes(path, json_bytes(obj))
