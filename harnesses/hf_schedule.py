"""The lr scheduler of the plain-PyTorch harnesses (torch_tp, fsdp2): HF ``get_scheduler``.

Both harnesses step a ``torch.optim.AdamW``; the scheduler their stack would use is
transformers' ``get_scheduler`` (what ``transformers.Trainer`` and TRL build), a
``torch.optim.lr_scheduler.LambdaLR`` that sets ``lr * lambda(0)`` at construction and is
stepped once after each optimizer step. The contract's schedule maps to:

- ``constant`` -> ``get_scheduler("constant")``;
- ``linear`` with ``min_lr_ratio = 0`` -> ``get_scheduler("linear")``
  (``get_linear_schedule_with_warmup``); with ``min_lr_ratio = r > 0`` ->
  ``get_scheduler("polynomial", power=1, lr_end=r * lr)``
  (``get_polynomial_decay_schedule_with_warmup``: HF's linear has no end lr);
- ``cosine`` -> ``get_scheduler("cosine_with_min_lr", min_lr_rate=r)``
  (``get_cosine_with_min_lr_schedule_with_warmup``, ``num_cycles = 0.5``).

The lr a step applied is read from the optimizer's ``param_groups`` just before
``optimizer.step()`` (:func:`applied_lr`, the harness SDK's
:func:`qualify_harness.optim.applied_lr`). Nothing here computes an lr itself.
"""

from __future__ import annotations

from typing import Any

import torch
from qualify_harness.optim import applied_lr

from qualify.contract import OptimizerSpec
from qualify.errors import HarnessError

__all__ = ["SCHEDULER_NOTE", "applied_lr", "hf_scheduler"]

SCHEDULER_NOTE = ("transformers.get_scheduler (torch.optim.lr_scheduler.LambdaLR), built before "
                  "step 1 and stepped after each optimizer step; lr read from "
                  "optimizer.param_groups before optimizer.step()")


def hf_scheduler(optimizer: torch.optim.Optimizer, spec: OptimizerSpec) -> Any:
    """The HF scheduler of the contract's schedule on ``optimizer`` (its lr is the base lr).

    Raises:
        HarnessError: an lr schedule this module does not map.
    """
    from transformers import get_scheduler

    name = spec.lr_schedule
    total = spec.total_steps
    warmup = spec.warmup_steps
    if name == "constant":
        return get_scheduler("constant", optimizer)
    if name == "linear" and spec.min_lr_ratio == 0.0:
        return get_scheduler("linear", optimizer, num_warmup_steps=warmup,
                             num_training_steps=total)
    if name == "linear":
        base = float(optimizer.defaults["lr"])
        return get_scheduler("polynomial", optimizer, num_warmup_steps=warmup,
                             num_training_steps=total,
                             scheduler_specific_kwargs={"power": 1.0,
                                                        "lr_end": spec.min_lr_ratio * base})
    if name == "cosine":
        return get_scheduler("cosine_with_min_lr", optimizer, num_warmup_steps=warmup,
                             num_training_steps=total,
                             scheduler_specific_kwargs={"min_lr_rate": spec.min_lr_ratio})
    raise HarnessError(f"optimizer.lr_schedule {name!r}: no HF scheduler mapped")
