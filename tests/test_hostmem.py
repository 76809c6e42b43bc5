"""qualify.hostmem: one field of ``/proc/meminfo`` in bytes, ``None`` where it cannot be read.

A written file in the kernel's format (``proc(5)``), and this machine's own file where it
exists; :func:`qualify.reference.plan_core.machine_defaults` takes its host memory from it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qualify.hostmem import MEMINFO, meminfo_bytes
from qualify.reference.plan_core import machine_defaults

KERNEL_FORMAT = ("MemTotal:       24000000 kB\nMemFree:          512000 kB\n"
                 "MemAvailable:     1000 kB\nHugePages_Total:       0\n")


@pytest.mark.parametrize(("text", "field", "want"), [
    (KERNEL_FORMAT, "MemTotal", 24000000 * 1024),
    (KERNEL_FORMAT, "MemAvailable", 1000 * 1024),
    (KERNEL_FORMAT, "Mem", None),  # a prefix of a field's name is no field
    ("MemTotal:       24000000 kB\n", "MemAvailable", None),  # before Linux 3.14
    ("MemTotal:\n", "MemTotal", None),  # no value
    ("MemTotal:       many kB\n", "MemTotal", None),  # not an integer
])
def test_a_field_in_bytes_or_none(tmp_path: Path, text: str, field: str, want: int | None
                                  ) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(text)
    assert meminfo_bytes(field, meminfo) == want


def test_an_unreadable_file_is_none(tmp_path: Path) -> None:
    assert meminfo_bytes("MemTotal", tmp_path / "missing") is None


@pytest.mark.skipif(not MEMINFO.exists(), reason="no /proc/meminfo (not Linux)")
def test_the_plan_takes_this_machines_memtotal() -> None:
    total = meminfo_bytes("MemTotal")
    assert total is not None
    assert total > 0
    assert machine_defaults().host_bytes == total
