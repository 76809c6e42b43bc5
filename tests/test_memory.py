"""qualify.memory.release_free_memory: the freed heap pages leave the resident set."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from qualify.memory import release_free_memory
from qualify.resources import repo_root


def test_freed_tensors_leave_the_resident_set() -> None:
    """In a fresh interpreter: after glibc's mmap threshold rose (one mmapped tensor freed),
    400 tensors of 1 MiB come from the heap; freed, they stay resident until the release
    (measured here: 621 -> 222 MB). Fails without the ``malloc_trim``."""
    code = textwrap.dedent("""
        import torch
        from qualify.memory import release_free_memory
        def rss_mb():
            with open("/proc/self/status") as f:
                return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) // 1024
        first = torch.empty(1 << 18)
        del first
        tensors = [torch.ones(1 << 18) for _ in range(400)]
        keep = tensors[-1]  # the heap's top stays in use: only a trim inside it helps
        del tensors
        before = rss_mb()
        trimmed = release_free_memory()
        print(trimmed, before, rss_mb())
    """)
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, cwd=repo_root(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trimmed, before, after = proc.stdout.split()
    assert trimmed == "True"
    assert int(before) - int(after) >= 300, (before, after)  # of the 399 MiB freed


def test_it_runs_here() -> None:
    assert release_free_memory() is sys.platform.startswith("linux")
