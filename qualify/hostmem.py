"""The host's memory as the kernel reports it: one field of ``/proc/meminfo``.

Linux's ``/proc/meminfo`` (``proc(5)``) has one ``Name:  value kB`` line per field; the plan
reads ``MemTotal`` (:func:`qualify.reference.plan_core.machine_defaults`) and the candidate
stage ``MemAvailable`` (:func:`qualify.candidate.ahead.mem_available`).

This module imports neither torch nor any engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

__all__ = ["MEMINFO", "meminfo_bytes"]

MEMINFO: Final = Path("/proc/meminfo")
"""Where Linux reports the host's memory."""


def meminfo_bytes(field: str, meminfo: Path = MEMINFO) -> int | None:
    """The ``field`` line of ``meminfo`` in bytes (its value is in KiB, ``kB``).

    Args:
        field: the field's name without its colon, e.g. ``MemTotal`` or ``MemAvailable``.
        meminfo: the file to read (default: :data:`MEMINFO`).

    Returns:
        ``1024 x`` the field's value; ``None`` where the file is unreadable (not Linux), the
        field is absent (``MemAvailable`` before Linux 3.14) or its value is not an integer.
    """
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
