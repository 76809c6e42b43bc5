"""Give the memory a step freed back to the OS before the next step allocates (issue #17).

glibc serves an allocation below its mmap threshold from the heap, and after the first
free of an mmapped chunk it raises that threshold to the chunk's size (up to 32 MiB on
64-bit: ``mallopt(3)``, "M_MMAP_THRESHOLD"). So most of a model's parameter, gradient and
optimizer-state tensors (SmolLM2-135M's: 0.3-3.5 MiB each) come from the heap, and what a
step frees stays resident: the process's peak RSS then counts the earlier steps' freed
memory as well as the current step's live memory. ``malloc_trim(0)`` returns the free
heap pages (those at the top, and with glibc >= 2.8 the free pages inside the heap too)
and costs milliseconds. Measured here: 400 tensors of 1 MiB, freed: RSS 621 -> 222 MB
after the trim (tests/test_memory.py checks the same drop).

:func:`fix_mmap_threshold` (issue #47) keeps tensors of at least
:data:`MMAP_THRESHOLD_BYTES` out of the heap altogether: each is its own mapping, unmapped
when freed, also inside a step, where no trim runs. The reference stage does not call it:
each such allocation then costs an ``mmap`` and fresh zeroed pages, and the time that adds
to a step is weighed against the memory it saves in docs/scale.md (qwen3-500m).

This module imports neither torch nor any engine.
"""

from __future__ import annotations

from typing import Final

from qualify import libc

__all__ = ["MMAP_THRESHOLD_BYTES", "fix_mmap_threshold", "release_free_memory"]

M_MMAP_THRESHOLD: Final = -3
"""``mallopt``'s parameter number for the mmap threshold (glibc's ``<malloc.h>``)."""

MMAP_THRESHOLD_BYTES: Final = 1 << 20
"""The fixed mmap threshold, 1 MiB: every allocation of at least this many bytes is its own
``mmap`` and goes back to the OS when it is freed. Far below the 32 MiB the dynamic
threshold rises to, so a model's parameters, gradients, AdamW moments and per-layer
temporaries (megabytes each) never stay resident in the heap once freed (the heap gives
pages back only at its top, or at a ``malloc_trim``); far above the small objects (shapes,
autograd nodes, Python objects) the heap serves without a system call. The price: each
such allocation is an ``mmap`` and its pages are faulted in (zeroed) anew. glibc's default
before it adjusts is 128 KiB (``mallopt(3)``)."""

def release_free_memory() -> bool:
    """Return the free heap pages to the OS: glibc's ``malloc_trim(0)``.

    Nothing computed changes: only pages no allocation holds are released. No
    ``gc.collect()`` (0.2 s over torch's and transformers' objects, per call): what a
    garbage cycle holds stays until the collector runs.

    Returns:
        Whether ``malloc_trim`` ran (``False`` off Linux or without glibc, e.g. musl).
    """
    trim = libc.function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold: ``mallopt(M_MMAP_THRESHOLD, threshold)``.

    glibc's threshold is dynamic: the first free of an mmapped chunk raises it to that
    chunk's size, up to 32 MiB on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``), and the heap
    then serves every later allocation below it. Setting it (``mallopt(3)``,
    ``M_MMAP_THRESHOLD``: "Setting this parameter disables dynamic adjustment") keeps every
    allocation of at least ``threshold`` bytes in its own mapping, unmapped when it is
    freed, so what a step frees leaves the resident set whatever the heap around it still
    holds; :func:`release_free_memory` still returns the smaller ones. The process keeps the
    setting; the values computed do not change (only where the bytes live). It always
    calls ``mallopt``, so it replaces a threshold glibc read at start from
    ``$MALLOC_MMAP_THRESHOLD_`` or ``$GLIBC_TUNABLES`` (an environment set later is not read
    by glibc, and not here).

    Args:
        threshold: bytes; an allocation of at least this size is mmapped.

    Returns:
        Whether the threshold is fixed now (``False`` off Linux or without glibc's
        ``mallopt``, e.g. musl, or where glibc refused the value).

    Raises:
        ValueError: ``threshold`` is not positive.
    """
    if threshold <= 0:
        raise ValueError(f"mmap threshold {threshold}: must be a positive number of bytes")
    mallopt = libc.function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
