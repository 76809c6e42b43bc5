"""The one sha256 of qualify: of bytes and of a file's bytes (lowercase hex)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Final

__all__ = ["sha256_bytes", "sha256_file"]

_CHUNK: Final = 1 << 20


def sha256_bytes(data: bytes) -> str:
    """Return the lowercase hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    """Return the lowercase hex sha256 of a file's bytes, read in 1 MiB chunks.

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
