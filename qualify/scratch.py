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
3. ``/var/tmp`` (kept on disk, and across reboots, by the Filesystem Hierarchy Standard,
   section 5.15) when it is a writable directory whose file system does not;
4. else the temporary directory still, with a one-line note on stderr (once per process).

A file system's type is the ``f_type`` that ``statfs(2)`` reports for the path itself, so
symbolic links, bind mounts and mounts stacked over others give the file system that really
holds it. An ``overlay`` (a container's root) counts as on disk whatever its upper layer
lies on: set ``QUALIFY_SCRATCH_DIR`` there. Off Linux nothing counts as in memory.

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

from qualify import libc
from qualify.errors import UsageError

__all__ = ["IN_MEMORY_MAGIC", "SCRATCH_ENV", "check_setting", "filesystem_magic",
           "scratch_root"]

SCRATCH_ENV: Final = "QUALIFY_SCRATCH_DIR"
"""The directory for large temporaries, overriding the choice of :func:`scratch_root`."""
IN_MEMORY_MAGIC: Final = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
"""``statfs(2)`` ``f_type`` values of the file systems whose files live in memory
(``TMPFS_MAGIC``, ``RAMFS_MAGIC`` of ``linux/magic.h``)."""
_FALLBACK: Final = Path("/var/tmp")
_STATFS_BYTES: Final = 512
"""More than ``sizeof(struct statfs)`` on every Linux ABI (120 bytes on x86-64)."""


def filesystem_magic(path: Path) -> int | None:
    """The ``f_type`` of the file system holding ``path`` (``statfs(2)``).

    ``f_type`` is the struct's first field, a C ``long`` (``__fsword_t``) on glibc's
    64-bit and 32-bit Linux ABIs alike.

    Returns:
        The magic number (``0x01021994`` for tmpfs), or ``None`` off Linux, without a C
        library ``statfs`` or when the call fails (a missing path).
    """
    if not sys.platform.startswith("linux"):
        return None
    statfs = libc.function("statfs")
    if statfs is None:
        return None
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if statfs(os.fsencode(path), buf) != 0:
        return None
    return int(struct.unpack_from("l", buf.raw, 0)[0]) & 0xFFFFFFFF


def check_setting(env: Mapping[str, str] | None = None) -> Path | None:
    """``$QUALIFY_SCRATCH_DIR`` checked (a stage checks it before its first step).

    Args:
        env: the environment (default ``os.environ``).

    Returns:
        The directory it names, made absolute (``~`` expanded), or ``None`` when it is
        unset or empty.

    Raises:
        UsageError: it is set but not an existing, writable directory (one line: the
            value is quoted).
    """
    chosen = (os.environ if env is None else env).get(SCRATCH_ENV, "")
    if not chosen:
        return None
    path = Path(chosen).expanduser().absolute()
    if not _writable_dir(path):
        raise UsageError(f"{SCRATCH_ENV}={chosen!r}: not an existing, writable directory")
    return path


def _writable_dir(path: Path) -> bool:
    """Whether ``path`` is a directory a file can be created in.

    Tried, not asked: ``os.access`` says yes to root everywhere (``/sys/kernel``, a
    read-only mount).
    """
    if not path.is_dir():
        return False
    try:
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


def _in_memory(path: Path, magic: Callable[[Path], int | None]) -> bool:
    return magic(path) in IN_MEMORY_MAGIC


@functools.cache
def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def scratch_root(env: Mapping[str, str] | None = None, *,
                 magic: Callable[[Path], int | None] = filesystem_magic,
                 fallback: Path = _FALLBACK) -> Path:
    """The directory for the stage's large temporaries (the module docstring's order).

    Args:
        env: the environment (default ``os.environ``).
        magic: the file-system type of a path (default :func:`filesystem_magic`).
        fallback: the on-disk directory tried when the temporary directory is in memory.

    Returns:
        An existing directory.

    Raises:
        UsageError: ``$QUALIFY_SCRATCH_DIR`` is set but not an existing, writable directory.
    """
    chosen = check_setting(env)
    if chosen is not None:
        return chosen
    temp = Path(tempfile.gettempdir())
    if not _in_memory(temp, magic):
        return temp
    if _writable_dir(fallback) and not _in_memory(fallback, magic):
        return fallback
    _note(f"qualify: {temp} keeps files in memory and {fallback} is no on-disk alternative; "
          f"large temporaries go to {temp} (set {SCRATCH_ENV} to a directory on disk)")
    return temp
