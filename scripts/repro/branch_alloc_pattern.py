"""The clip-branch token loop's allocation pattern at qwen3-34m's tensor sizes, no model.

Usage: ``python scripts/repro/branch_alloc_pattern.py [--trim]``

Per token: a ``J_t`` of per-parameter FP32 tensors (the qwen3-34m Actor's 91 shapes, 134 MB),
the FP64 products ``<g, J_t>`` of each, the sealed samples cloned and kept (as
:func:`qualify.reference.branches._rerun` keeps them: 256 elements per tensor and 81 whole
rows of the two vocab-indexed ones), then the ``J_t`` freed. Prints the resident memory over
the start after every 16 tokens of 64; ``--trim`` calls glibc's ``malloc_trim(0)`` at each
token's start (as the stage does, :func:`qualify.memory.release_free_memory`). Module-level
code on purpose: written as a ``main()`` function the same loop did not grow (not
understood; docs/scale.md section 6).
"""

import ctypes
import sys

import torch

trim = "--trim" in sys.argv
libc = ctypes.CDLL(None)


def rss() -> int:
    """``VmRSS`` in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


h, i, v, L = 512, 1536, 8192, 8
shapes = [(v, h)] + [s for _ in range(L) for s in [
    (512, h), (256, h), (256, h), (h, 512), (64,), (64,), (i, h), (i, h), (h, i), (h,), (h,)]
] + [(h,), (v, h)]
torch.manual_seed(0)
kept = []
g = [torch.randn(s) for s in shapes]  # the round's gradient
base = rss()
for tok in range(64):
    if trim:
        libc.malloc_trim(0)
    jt = [torch.randn(s) for s in shapes]  # the token's backward result
    dot = sum(float((a.double() * b.double()).sum()) for a, b in zip(g, jt))  # noqa: B905
    kept.append([t.reshape(-1)[:256].clone() for t in jt]
                + [jt[0][:81].clone(), jt[-1][:81].clone()])
    del jt
    if tok % 16 == 15:
        print(tok + 1, round((rss() - base) / 1e6, 1), "MB over the start", flush=True)
