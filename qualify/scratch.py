"""Where the reference stage writes a large temporary that must stay out of memory (issue #17).

The factored clip-branch Gram (:mod:`qualify.reference.gram_factors`) spills each sealed
token's output gradients to disk so that they do not count in the stage's memory: up to
:data:`qualify.reference.gram_factors.BUDGET_BYTES` on SmolLM2. A directory on a ``tmpfs``
or ``ramfs`` (``/tmp`` on many distributions and containers; ``$TMPDIR`` on some clusters'
compute nodes) keeps those files in RAM, where they cost what they were meant to save.
:func:`scratch_root` therefore chooses, in order:

1. ``$QUALIFY_SCRATCH_DIR`` (:data:`SCRATCH_ENV`) when set: an existing, writable directory,
   or :class:`~qualify.errors.UsageError`; taken as given, on any file system (the user
   chose it);
2. the temporary directory (``tempfile.gettempdir()``: ``$TMPDIR``, ``$TEMP``, ``$TMP``,
   then ``/tmp``) unless its file system keeps files in memory;
3. ``/var/tmp`` (kept on disk by the Filesystem Hierarchy Standard, section 5.15) when it
   is a writable directory whose file system does not;
4. else the temporary directory still, with a one-line note on stderr.

A file system's type is read from ``/proc/self/mountinfo`` (proc(5)): the mount whose mount
point is the longest prefix of the resolved path, the last such mount when several share it
(a later mount hides an earlier one). Without that file (not Linux) nothing is in memory.

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from qualify.errors import UsageError

__all__ = ["IN_MEMORY_TYPES", "SCRATCH_ENV", "check_setting", "filesystem_type", "scratch_root"]

SCRATCH_ENV: Final = "QUALIFY_SCRATCH_DIR"
"""The directory for large temporaries, overriding the choice of :func:`scratch_root`."""
IN_MEMORY_TYPES: Final = frozenset({"tmpfs", "ramfs"})
"""File system types whose files live in memory (``mount(8)``)."""
MOUNTINFO: Final = Path("/proc/self/mountinfo")
_FALLBACK: Final = Path("/var/tmp")


def _unescape(field: str) -> str:
    """A mountinfo path field decoded: a backslash and 3 octal digits are one character."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def filesystem_type(path: Path, mountinfo: str) -> str | None:
    """The type of the file system that holds ``path``, from a mountinfo text.

    Args:
        path: an absolute path (resolved by the caller: symbolic links followed).
        mountinfo: ``/proc/self/mountinfo``'s text (proc(5)): per line, the mount point is
            the 5th field, the type the first field after the `` - `` separator.

    Returns:
        The type (``ext4``, ``tmpfs``...), or ``None`` when no line's mount point holds
        ``path`` or the text has no well-formed line.
    """
    best: tuple[int, str] | None = None
    target = str(path)
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields = head.split()
        if not sep or len(fields) < 5 or not tail.split():
            continue
        point = _unescape(fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), tail.split()[0])
    return None if best is None else best[1]


def _in_memory(path: Path, mountinfo: str | None) -> bool:
    if mountinfo is None:
        return False
    return filesystem_type(path.resolve(), mountinfo) in IN_MEMORY_TYPES


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def check_setting(env: Mapping[str, str] | None = None) -> Path | None:
    """``$QUALIFY_SCRATCH_DIR`` checked (a stage checks it before its first step).

    Args:
        env: the environment (default ``os.environ``).

    Returns:
        The directory it names, or ``None`` when it is unset or empty.

    Raises:
        UsageError: it is set but not an existing, writable directory.
    """
    chosen = (os.environ if env is None else env).get(SCRATCH_ENV, "")
    if not chosen:
        return None
    path = Path(chosen)
    if not _writable_dir(path):
        raise UsageError(f"{SCRATCH_ENV}={chosen}: not an existing, writable directory")
    return path


def scratch_root(env: Mapping[str, str] | None = None, *,
                 mountinfo: str | None = None, fallback: Path = _FALLBACK) -> Path:
    """The directory for the stage's large temporaries (the module docstring's order).

    Args:
        env: the environment (default ``os.environ``).
        mountinfo: a mountinfo text (default: ``/proc/self/mountinfo`` read now; none off
            Linux).
        fallback: the on-disk directory tried when the temporary directory is in memory.

    Returns:
        An existing directory.

    Raises:
        UsageError: ``$QUALIFY_SCRATCH_DIR`` is set but not an existing, writable directory.
    """
    chosen = check_setting(env)
    if chosen is not None:
        return chosen
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_text(encoding="utf-8", errors="replace")
        except OSError:
            mountinfo = None
    temp = Path(tempfile.gettempdir())
    if not _in_memory(temp, mountinfo):
        return temp
    if _writable_dir(fallback) and not _in_memory(fallback, mountinfo):
        return fallback
    print(f"qualify: {temp} keeps files in memory and {fallback} is no on-disk alternative; "
          f"large temporaries go to {temp} (set {SCRATCH_ENV} to a directory on disk)",
          file=sys.stderr, flush=True)
    return temp
