"""Deliberate bugs for the test suite: each must later be caught by the comparator.

Never active in a real run (``cell.faults`` is empty). The harness's numerical path holds no
fault: a launch whose cell names faults calls :func:`install`, which patches the parts they
replace (the gradient divide factor, the checkpoint restore) in that process only. Names:

- ``grad_averaged_twice``: the classic FSDP data-parallel bug. The loss is already
  normalised by the global token count (each rank's share adds up to the whole), and the
  gradient reduction still averages over the DP group: FSDP2's default divide factor (the
  DP size) is left in place instead of ``set_gradient_divide_factor(1.0)``. Every gradient
  is then divided by ``dp`` once more (no change at DP 1).
- ``resume_drops_optimizer_state``: a resumed launch restores the model only (DCP of the
  model state dict) and starts a fresh AdamW: no moments, step counters, or checkpointed lr
  (NeMo-RL #3171).
- ``resume_drops_step_counter``: a resumed launch restores AdamW's moments but resets every
  parameter's ``step`` to 0, so the next step's bias correction is the first step's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from harnesses import faults as shared

KNOWN: Final = ("grad_averaged_twice", "resume_drops_optimizer_state",
                "resume_drops_step_counter")


class Faults(shared.Faults):
    """The fsdp2 faults a cell asks for (:data:`KNOWN`; an unknown name is refused)."""

    ENGINE = "fsdp2"
    KNOWN = KNOWN


def install(names: Sequence[str], harness: Any) -> Faults:
    """Patch the named faults into this process's harness (a test-only plugin).

    Args:
        names: ``cell.faults``.
        harness: the running harness module (unused: every fsdp2 fault patches a module
            the harness imports).

    Raises:
        HarnessError: an unknown fault name.
    """
    del harness
    from harnesses.fsdp2 import parallelize, resume

    active = Faults(names)
    if "grad_averaged_twice" in active:  # FSDP2's default divide-by-dp left in place
        set_sum = parallelize.set_sum_reduction
        parallelize.set_sum_reduction = (
            lambda model, *, divide_factor: set_sum(model, divide_factor=None))
    shared.plant_dcp_resume_faults(active, resume)
    return active
