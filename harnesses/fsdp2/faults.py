"""Deliberate bugs for the test suite: each must later be caught by the comparator.

Never active in a real run (``cell.faults`` is empty). The harness checks them at places
marked ``# FAULT(<name>)``. Names:

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
from typing import Final

import torch
from torch import Tensor

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


def divide_factor(active: bool) -> float | None:
    """FAULT ``grad_averaged_twice``: ``None`` (FSDP2's default, divide by dp) when active.

    Returns:
        The gradient divide factor to set on every FSDP unit: ``1.0`` (a sum), or ``None``
        to leave FSDP2's default.
    """
    return None if active else 1.0


def reset_step_counters(optimizer: torch.optim.Optimizer) -> None:
    """FAULT ``resume_drops_step_counter``: every parameter's AdamW ``step`` set to 0.

    The counter keeps its own type, dtype and device (a 0-d FP32 CPU tensor in
    ``torch.optim.AdamW``'s single-tensor path).
    """
    for st in optimizer.state.values():
        if "step" in st:
            st["step"] = torch.zeros_like(st["step"]) if isinstance(st["step"], Tensor) else 0
