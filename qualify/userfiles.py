"""The one bounded reader of files a user names: contracts, gate policies, prompts, keys.

Evidence is read by :mod:`qualify.jsonio` (no link followed, integrity errors). A file the
user names on the command line or in a contract is input: a symbolic link to it is fine,
but a FIFO, a device or a file of gigabytes named by mistake must be a one-line usage
error naming the file and the cap, never a hang or an unbounded read. This module imports
nothing of qualify but :mod:`qualify.errors`, so every loader may use it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Final

from qualify.errors import QualifyError, UsageError

__all__ = ["MAX_INPUT_BYTES", "read_input_bytes"]

MAX_INPUT_BYTES: Final = 4 * 1024 * 1024
"""User files read whole (a contract or gate policy TOML, a PEM key): far above any real
one (the committed contracts are under 8 KB), small enough that a wrong path to a huge
file costs a bounded read."""


def read_input_bytes(path: str | Path, *, what: str, max_bytes: int = MAX_INPUT_BYTES,
                     error: type[QualifyError] = UsageError) -> bytes:
    """The bytes of a file the user named, read whole but bounded.

    Unlike :func:`qualify.jsonio.read_bytes` (evidence), a symbolic link is followed (keys
    and contracts are often links); what it names must still be a regular file: a FIFO or a
    device such as ``/dev/zero`` is refused, never read (opened ``O_NONBLOCK``, checked by
    ``fstat``).
    At most ``max_bytes + 1`` bytes are read.

    Args:
        path: the file.
        what: what the file is, for the message (``contract file``).
        max_bytes: the size limit.
        error: the error class raised (exit 2 for the default :class:`UsageError`).

    Returns:
        The file's bytes.

    Raises:
        QualifyError: of class ``error``, one line naming the file: missing, a directory
            or special file, over ``max_bytes`` (the limit named), or unreadable.
    """
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{p}: {what} not found") from None
    except OSError as exc:
        raise error(f"{p}: cannot read the {what}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise error(f"{p}: cannot read the {what}: {exc.strerror or exc}") from None
    problem = ("is a directory, not a file" if stat.S_ISDIR(st.st_mode)
               else "not a regular file (a FIFO, socket or device; refused, not read)"
               if not stat.S_ISREG(st.st_mode)
               else f"{st.st_size} bytes, over the {max_bytes}-byte limit (refused, not read)"
               if st.st_size > max_bytes else None)
    if problem is not None:
        os.close(fd)
        raise error(f"{p}: cannot read the {what}: {problem}")
    return _read_fd_bounded(
        fd, max_bytes, error=error,
        unreadable=lambda exc: f"{p}: cannot read the {what}: {exc.strerror or exc}",
        too_large=f"{p}: cannot read the {what}: over the {max_bytes}-byte limit (it grew "
                  "while read)")


def _read_fd_bounded(fd: int, limit: int, *, error: type[QualifyError],
                     unreadable: Callable[[OSError], str], too_large: str) -> bytes:
    """Read an open file to its end, at most ``limit + 1`` bytes, 1 MiB a read; close it.

    The one bounded read loop of :func:`read_input_bytes` and
    :func:`qualify.jsonio.read_bytes` (each checks what ``fd`` is before, and names its own
    error class and messages).

    Args:
        fd: a file descriptor opened for reading (closed on return or error).
        limit: the size limit in bytes.
        error: the error class raised.
        unreadable: the message of a read that fails (given the ``OSError``).
        too_large: the message when the file holds more than ``limit`` bytes (it grew
            after its size was checked).

    Returns:
        The file's bytes.

    Raises:
        QualifyError: of class ``error``: a read failed, or more than ``limit`` bytes.
    """
    chunks: list[bytes] = []
    total = 0
    try:
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise error(unreadable(exc)) from None
    finally:
        os.close(fd)
    if total > limit:
        raise error(too_large)
    return b"".join(chunks)
