"""qualify.memory: the freed heap pages leave the resident set (release_free_memory), freed
large tensors without a trim (fix_mmap_threshold)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from qualify.memory import fix_mmap_threshold, release_free_memory
from qualify.resources import repo_root

_RSS_MB = """
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) // 1024
"""


def _python(snippet: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """The words ``snippet`` prints, run in a fresh interpreter with ``rss_mb()`` defined
    (this process's resident set, MiB)."""
    proc = subprocess.run([sys.executable, "-c", _RSS_MB + textwrap.dedent(snippet), *args],
                          check=False, capture_output=True, text=True, cwd=repo_root(),
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()


def test_freed_tensors_leave_the_resident_set() -> None:
    """In a fresh interpreter: after glibc's mmap threshold rose (one mmapped tensor freed),
    400 tensors of 1 MiB come from the heap; freed, they stay resident until the release
    (measured here: 621 -> 222 MB). Fails without the ``malloc_trim``."""
    trimmed, before, after = _python("""
        import torch
        from qualify.memory import release_free_memory
        first = torch.empty(1 << 18)
        del first
        tensors = [torch.ones(1 << 18) for _ in range(400)]
        keep = tensors[-1]  # the heap's top stays in use: only a trim inside it helps
        del tensors
        before = rss_mb()
        trimmed = release_free_memory()
        print(trimmed, before, rss_mb())
    """)
    assert trimmed == "True"
    assert int(before) - int(after) >= 300, (before, after)  # of the 399 MiB freed


def test_it_runs_here() -> None:
    assert release_free_memory() is sys.platform.startswith("linux")


_FREED_BIG_TENSORS = """
    import sys
    import torch
    from qualify.memory import fix_mmap_threshold
    # only "fix" looks the C library up: ctypes' lookup alone changed where glibc served the
    # 8 MiB tensors in some runs (17 MB kept instead of 402), the premise's failure
    fixed = fix_mmap_threshold() if sys.argv[1] == "fix" else False
    before = rss_mb()
    first = torch.empty(1 << 22)  # 16 MiB, mmapped: its free raises the dynamic threshold
    del first
    tensors = []
    for _ in range(50):  # 8 MiB each, with a small live object after each one
        tensors += [torch.ones(1 << 21), torch.ones(16)]
    small = tensors[1::2]
    del tensors
    print(fixed, rss_mb() - before, len(small))
"""


def _run_freed_big_tensors(mode: str, **malloc_env: str) -> tuple[str, int]:
    """``(fixed, MB kept)`` of :data:`_FREED_BIG_TENSORS`: this environment without its
    ``MALLOC_*`` settings, plus ``malloc_env``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | malloc_env
    fixed, kept_mb, _ = _python(_FREED_BIG_TENSORS, mode, env=env)
    return fixed, int(kept_mb)


def test_fixed_mmap_threshold_returns_freed_tensors_without_a_trim() -> None:
    """In fresh interpreters, 50 tensors of 8 MiB, each followed by a small live tensor, are
    freed with no ``malloc_trim``: after :func:`fix_mmap_threshold` each was its own mapping
    and the 400 MiB leave the resident set; without it (the dynamic threshold raised to
    16 MiB by the first free) the heap serves them and keeps their pages. The second half
    is the premise, and what the first fails to without the call."""
    fixed, kept_fixed = _run_freed_big_tensors("fix")
    default, kept_default = _run_freed_big_tensors("default")
    assert (fixed, default) == ("True", "False")
    assert kept_fixed < 50, kept_fixed  # MB still resident of the 400 MiB freed
    _premise(kept_default)


def test_fix_mmap_threshold_refuses_a_non_positive_threshold() -> None:
    with pytest.raises(ValueError, match="mmap threshold 0"):
        fix_mmap_threshold(0)


def test_the_call_replaces_a_threshold_glibc_read_from_the_environment() -> None:
    """``$MALLOC_MMAP_THRESHOLD_`` of 16 MiB (with ``$MALLOC_TRIM_THRESHOLD_`` of 1 GiB),
    read by glibc at start, keeps the 8 MiB tensors in the heap (the premise, second run);
    :func:`fix_mmap_threshold` replaces it (it always calls ``mallopt``), so they leave the
    resident set once freed."""
    # a threshold set this way leaves the trim threshold at 128 KiB, and the freed tensors
    # at the heap's top were trimmed (1 MB kept): a high one keeps them, as the heap would
    malloc_env = {"MALLOC_MMAP_THRESHOLD_": str(16 << 20),
                  "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
    fixed, kept_fixed = _run_freed_big_tensors("fix", **malloc_env)
    default, kept_env = _run_freed_big_tensors("default", **malloc_env)
    assert (fixed, default) == ("True", "False")
    assert kept_fixed < 50, kept_fixed
    _premise(kept_env)


def _premise(kept_mb: int) -> None:
    """The heap kept the freed tensors without the call (what makes the call's effect seen).

    Some runs on the CI machine's kernel returned them anyway (17-49 MB kept, with other
    large processes running); glibc's choice between brk and mmap for the heap is not under
    the test's control, so such a run is reported as skipped, never as passed.
    """
    if kept_mb < 300:
        pytest.skip(f"premise not met in this run: the heap returned the freed tensors "
                    f"itself ({kept_mb} MB of 400 kept without the call)")
