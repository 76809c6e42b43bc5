"""Test-only fault injection: a process SIGKILLs itself at a named point of a write.

Some kill points of the recovery tests cannot be hit reliably from outside: the window
between an atomic write's temporary file and its rename lasts microseconds. With
``QUALIFY_CRASH_AT=<point>:<absolute path>`` in its environment, a qualify process that
reaches ``<point>`` for that exact destination path sends itself ``SIGKILL`` there; the
kernel ends it as an outside ``kill -9`` would (no ``finally``, no ``atexit``, the
temporary file left behind). Points:

- ``write``: :func:`qualify.atomic.write_with`, after the temporary file is written and
  ``fsync``-ed, before it is renamed over the destination;
- ``rename``: :func:`qualify.atomic.rename_noreplace`, before the no-replace rename (the
  attestation's last step);
- ``full``: :func:`qualify.atomic.write_with`, before the content is written: instead of a
  SIGKILL, the write raises ``OSError(ENOSPC)`` as on a full disk (the process goes on and
  handles it as it would a real one).

Unset (always, outside ``tests/test_kill_points.py``) the hook costs one environment
lookup. The path must be absolute and is compared after :func:`os.path.abspath`, so a
harness child that inherits the variable and writes elsewhere is not affected.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path
from typing import Final, Literal

__all__ = ["ENV_CRASH_AT", "POINTS", "CrashPoint", "crash_spec", "maybe_crash"]

ENV_CRASH_AT: Final = "QUALIFY_CRASH_AT"
"""Environment variable naming the crash point: ``<point>:<absolute path>``."""

CrashPoint = Literal["write", "rename", "full"]
POINTS: Final[tuple[CrashPoint, ...]] = ("write", "rename", "full")
"""The points that have a call site."""


def crash_spec(point: CrashPoint, path: str | Path) -> str:
    """The ``QUALIFY_CRASH_AT`` value that kills a process at ``point`` for ``path``.

    Args:
        point: one of :data:`POINTS`.
        path: the destination file (made absolute).

    Raises:
        ValueError: an unknown point.
    """
    if point not in POINTS:
        raise ValueError(f"crash point {point!r}: expected one of {', '.join(POINTS)}")
    return f"{point}:{os.path.abspath(path)}"


def maybe_crash(point: CrashPoint, path: str | Path) -> None:
    """SIGKILL this process if ``QUALIFY_CRASH_AT`` names ``point`` and ``path``.

    Args:
        point: the call site's point.
        path: the destination file of the write or rename at that call site.

    Raises:
        OSError: ``ENOSPC`` at the ``full`` point (a full disk) instead of the SIGKILL.
    """
    spec = os.environ.get(ENV_CRASH_AT)
    if not spec:
        return
    want, _, target = spec.partition(":")
    if want == point and target == os.path.abspath(path):
        if point == "full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        os.kill(os.getpid(), signal.SIGKILL)
