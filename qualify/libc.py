"""C library functions the standard library does not wrap, each looked up once.

``ctypes.CDLL(None)`` is the set of symbols this process has loaded (the C library among
them); a function missing there (``renameat2`` before glibc 2.28, ``malloc_trim`` on musl)
is ``None`` and its caller takes its fallback. Loaded with ``use_errno=True``, so a caller
reads a failed call's ``errno`` with :func:`ctypes.get_errno`.

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["function"]


@functools.cache
def function(name: str) -> Any:
    """The C function ``name`` (a ``ctypes`` function pointer, ``int`` results), or ``None``.

    Args:
        name: the symbol (``renameat2``, ``malloc_trim``, ``statfs``).

    Returns:
        The function, looked up once per process; ``None`` when no loaded library has it or
        ``ctypes`` cannot open this process's symbols.
    """
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
