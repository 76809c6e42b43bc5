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
from pathlib import Path
from typing import Any, Final

import torch
from torch import Tensor, nn

from qualify.errors import HarnessError

KNOWN: Final = ("grad_averaged_twice", "resume_drops_optimizer_state",
                "resume_drops_step_counter")


class Faults:
    """The set of faults a cell asks for.

    Args:
        names: ``cell.faults``.

    Raises:
        HarnessError: an unknown fault name (a typo must not silently test nothing).
    """

    def __init__(self, names: Sequence[str]) -> None:
        unknown = sorted(set(names) - set(KNOWN))
        if unknown:
            raise HarnessError(f"unknown fault(s) {unknown}; fsdp2 knows {list(KNOWN)}")
        self.names = tuple(names)

    def __contains__(self, name: str) -> bool:
        assert name in KNOWN, name
        return name in self.names


def reset_step_counters(optimizer: torch.optim.Optimizer) -> None:
    """FAULT ``resume_drops_step_counter``: every parameter's AdamW ``step`` set to 0.

    The counter keeps its own type, dtype and device (a 0-d FP32 CPU tensor in
    ``torch.optim.AdamW``'s single-tensor path).
    """
    for st in optimizer.state.values():
        if "step" in st:
            st["step"] = torch.zeros_like(st["step"]) if isinstance(st["step"], Tensor) else 0


def restore_model_only(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: Path,
                       group: Any) -> None:
    """FAULT ``resume_drops_optimizer_state``: load the model alone; AdamW stays fresh."""
    del optimizer
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    model_sd = get_model_state_dict(model)
    dcp.load({"model": model_sd}, checkpoint_id=str(ckpt), process_group=group)
    set_model_state_dict(model, model_sd)


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
    if "resume_drops_optimizer_state" in active:
        resume.restore = restore_model_only
    if "resume_drops_step_counter" in active:
        restore = resume.restore

        def reset_steps(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: Path,
                        group: Any) -> None:
            restore(model, optimizer, ckpt, group)
            reset_step_counters(optimizer)

        resume.restore = reset_steps
    return active
