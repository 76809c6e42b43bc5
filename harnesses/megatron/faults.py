"""Deliberate resume bugs for the test suite (the Megatron harness's only faults).

Never active in a real run (``cell.faults`` is empty). :mod:`harnesses.megatron.resume`
checks them at the places marked ``# FAULT(<name>)``. Names (the same as
:mod:`harnesses.torch_tp.faults`'s, so one test shape serves every engine):

- ``resume_drops_optimizer_state``: a resumed launch restores the model only, as
  Megatron-LM's ``load_checkpoint`` does under ``--no-load-optim``: neither
  ``optimizer.load_state_dict`` nor ``opt_param_scheduler.load_state_dict`` runs, and
  ``optimizer.reload_model_params()`` refreshes the FP32 master copies of the BF16 model
  parameters from the loaded weights (NeMo-RL #3171's shape: no moments, no step counters,
  the scheduler at step 0).
- ``resume_drops_step_counter``: a resumed launch restores the optimizer, then resets the
  ``step`` of every parameter of every inner ``torch.optim.AdamW`` to 0, so the next step's
  bias correction is the first step's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

import torch

from qualify.errors import HarnessError

KNOWN: Final = ("resume_drops_optimizer_state", "resume_drops_step_counter")


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
            raise HarnessError(f"unknown fault(s) {unknown}; megatron knows {list(KNOWN)}")
        self.names = tuple(names)

    def __contains__(self, name: str) -> bool:
        assert name in KNOWN, name
        return name in self.names


def reset_step_counters(optimizers: Iterable[Any]) -> None:
    """Set ``step`` of every parameter's state to 0 (same type, dtype and device).

    Args:
        optimizers: the inner ``torch.optim`` optimizers (``MegatronOptimizer.optimizer``).
    """
    for opt in optimizers:
        for st in opt.state.values():
            if "step" in st:
                s = st["step"]
                st["step"] = torch.zeros_like(s) if isinstance(s, torch.Tensor) else 0
