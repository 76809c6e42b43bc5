"""What the trainer harnesses' test-only fault plugins share (``harnesses/<engine>/faults.py``).

Never active in a real run (``cell.faults`` is empty): an engine's ``install`` patches the
parts a fault replaces in the launch's process only, and nothing here runs otherwise.

- :class:`Faults`: the set of faults a cell names, checked against the engine's list;
- :func:`plant`: each named fault's replacement set on the module it patches (the stack
  adapters', TRL and verl, whose faults each replace one translation function);
- :func:`shifted_response_mask`: the response mask one token late (the stack adapters'
  ``*_mask_shifted`` faults);
- :func:`reset_step_counters`: ``resume_drops_step_counter``'s reset of a ``torch.optim``
  optimizer's per-parameter ``step`` (every engine's resume fault of that name);
- :func:`restore_model_only` and :func:`plant_dcp_resume_faults`: the resume faults of the
  harnesses that checkpoint with ``torch.distributed.checkpoint`` (torch_tp, fsdp2), whose
  ``resume.restore(model, optimizer, ckpt, group)`` they replace.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from qualify.errors import HarnessError

Patch = tuple[Any, str, Callable[..., Any]]
"""``(owner, attribute, replacement)``: what :func:`plant` sets for one fault."""
DCP_RESUME_FAULTS: tuple[str, ...] = ("resume_drops_optimizer_state",
                                      "resume_drops_step_counter")
"""The resume faults :func:`plant_dcp_resume_faults` plants."""


class Faults:
    """The set of faults a cell asks for; a subclass names its engine and the faults it knows.

    Args:
        names: ``cell.faults``.

    Raises:
        HarnessError: an unknown fault name (a typo must not silently test nothing).
    """

    ENGINE: ClassVar[str]
    KNOWN: ClassVar[tuple[str, ...]]

    def __init__(self, names: Sequence[str]) -> None:
        unknown = sorted(set(names) - set(self.KNOWN))
        if unknown:
            raise HarnessError(f"unknown fault(s) {unknown}; {self.ENGINE} knows "
                               f"{list(self.KNOWN)}")
        self.names = tuple(names)

    def __contains__(self, name: str) -> bool:
        assert name in self.KNOWN, name
        return name in self.names


def plant(active: Faults, patches: Mapping[str, Patch]) -> None:
    """``setattr(owner, attribute, replacement)`` for every fault of ``active`` in ``patches``.

    Args:
        active: the cell's faults.
        patches: fault name (one of ``active.KNOWN``) -> :data:`Patch`; the owner is the
            running module whose function the fault replaces, in this process only.
    """
    for name, (owner, attr, replacement) in patches.items():
        if name in active:
            setattr(owner, attr, replacement)


def shifted_response_mask(response_mask: Tensor) -> Tensor:
    """FAULT: ``response_mask`` rolled right by one token, int64 ``[B, R]``.

    The off-by-one of a prompt / response boundary: each response's first token leaves the
    loss and the token after its last (or row ``i``'s last column, wrapped) enters it.
    """
    return torch.roll(response_mask.long(), 1, dims=1)


def reset_step_counters(optimizer: Any) -> None:
    """FAULT ``resume_drops_step_counter``: every parameter's ``step`` of ``optimizer`` set to 0.

    The counter keeps its own type, dtype and device (a 0-d FP32 CPU tensor in
    ``torch.optim.AdamW``'s single-tensor path, else the integer 0).
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


def plant_dcp_resume_faults(active: Faults, resume: Any) -> None:
    """Replace ``resume.restore`` for the resume faults in ``active`` (DCP harnesses).

    ``resume_drops_optimizer_state``: :func:`restore_model_only`;
    ``resume_drops_step_counter``: the restore, then :func:`reset_step_counters`.

    Args:
        active: the cell's faults (its engine knows :data:`DCP_RESUME_FAULTS`).
        resume: the engine's resume module (``restore(model, optimizer, ckpt, group)``).
    """
    if "resume_drops_optimizer_state" in active:
        resume.restore = restore_model_only
    if "resume_drops_step_counter" in active:
        restore = resume.restore

        def reset_steps(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: Path,
                        group: Any) -> None:
            restore(model, optimizer, ckpt, group)
            reset_step_counters(optimizer)

        resume.restore = reset_steps
