"""The one atomic write of qualify (and of its harnesses).

A file is written to a temporary file in the same directory (``.tmp-<name>.<random>.partial``),
flushed, ``fsync``-ed and renamed over its name with :func:`os.replace`, then the
directory is ``fsync``-ed. A reader sees the old file or the new one, never a part. A
writer that fails removes its temporary file. The sealed-directory guard lives above this
module (:mod:`qualify.evidence.store`); this one knows nothing of evidence.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Final

__all__ = ["TMP_PREFIX", "TMP_SUFFIX", "fsync_dir", "json_bytes", "write_bytes", "write_json",
           "write_with"]

TMP_PREFIX: Final = ".tmp-"
"""Prefix of every temporary file of an atomic write."""
TMP_SUFFIX: Final = ".partial"
"""Suffix of every temporary file of an atomic write."""


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

    Parent directories are created; an existing file is replaced whole.

    Args:
        path: destination file.
        write: writes the content to the open temporary file.
        mode: permission bits of the final file.

    Raises:
        OSError: the write failed (no temporary file is left behind; the old file, if
            any, is untouched).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f"{TMP_PREFIX}{path.name}.",
                                    suffix=TMP_SUFFIX)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


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
