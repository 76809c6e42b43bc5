"""Where a command writes, checked before it does any work.

Every command that writes takes its destination from the command line: a parent
directory (``reference --out``, ``candidate --out``, ``run --references / --evidence``,
``diverge --out``, ``keygen --public-dir``) or a file (``verify --json``, ``gate --json``,
``audit --output``, ``report --html``, ``keygen --private-key``, ``sbatch render -o``).
:func:`output_dir` and :func:`output_file` refuse, in one line naming the option and the
path (exit 2), a destination that is a file where a directory is needed or the reverse,
whose parent is missing, or that this user cannot write (a read-only mount, a directory
without write permission): tried, not asked, since ``os.access`` says yes to root on a
read-only mount. What cannot be checked ahead (the disk fills up while writing) is turned
into the same kind of line by :func:`qualify.cli.main.main`.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Final

from qualify.errors import UsageError

__all__ = ["MACHINE_ERRNOS", "output_dir", "output_file"]

MACHINE_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS,
                                   errno.EACCES, errno.EPERM, errno.EMFILE, errno.ENFILE})
"""``OSError`` numbers that describe the machine (a full disk or quota, a read-only mount,
permissions, open-file limits), not a bug: the CLI reports them in one line, exit 2."""


def _try_write(directory: Path, option: str, shown: Path) -> None:
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise UsageError(f"{shown}: {option}: cannot write in {directory}: "
                         f"{exc.strerror or exc}") from None


def _nearest_existing(path: Path) -> Path:
    return next((p for p in (path, *path.parents) if os.path.lexists(p)), Path("/"))


def output_dir(value: str | Path, option: str) -> Path:
    """``value`` as a directory this command may create files under.

    It is an existing, writable directory, or its nearest existing ancestor is one (the
    missing levels are made by the command).

    Args:
        value: the path the user gave.
        option: the option that named it (``--out``), for the message.

    Returns:
        ``value`` as a :class:`~pathlib.Path`.

    Raises:
        UsageError: it, or its nearest existing ancestor, is not a directory or not
            writable.
    """
    path = Path(value)
    base = _nearest_existing(path.absolute())
    try:
        st = base.stat()
    except OSError as exc:  # a dangling link, a loop
        raise UsageError(f"{path}: {option}: {base}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        what = "is" if base == path.absolute() else f"{base} is"
        raise UsageError(f"{path}: {option}: {what} not a directory")
    _try_write(base, option, path)
    return path


def output_file(value: str | Path, option: str) -> Path:
    """``value`` as a file this command may write (created or atomically replaced).

    Takes and returns what :func:`output_dir` does (``option``: ``--json``); the same write
    probe, in the file's directory.

    Raises:
        UsageError: it is a directory or a special file, or its directory does not exist
            or is not writable.
    """
    path = Path(value)
    if path.is_dir():
        raise UsageError(f"{path}: {option}: is a directory, not a file")
    if os.path.lexists(path) and path.exists() and not path.is_file():
        raise UsageError(f"{path}: {option}: not a regular file")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise UsageError(f"{path}: {option}: directory {parent} does not exist")
    _try_write(parent, option, path)
    return path
