"""torch_tp layout -> Hugging Face layout: full tensors under HF parameter names.

``parallelize_module`` swaps parameters for DTensors in place, so parameter names stay the
HF names (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``, ``score.bias``)
and a column-parallel weight's ``Shard(0)`` chunks concatenate in HF row order (heads are
contiguous rows). Reassembly is therefore ``DTensor.full_tensor()`` (an all-gather over
the TP group for sharded tensors, a no-op for replicated ones) with no permutation.

Every function here is collective over the role's TP group: all its ranks must call it
with the same module, in the same order.
"""

from __future__ import annotations

import torch
from qualify_harness import optim
from torch import Tensor, nn


def full_params(model: nn.Module) -> dict[str, Tensor]:
    """HF name -> full FP32 copy of every trainable parameter (the master weights)."""
    return optim.full_params(optim.trainable(model))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         key: str) -> dict[str, Tensor]:
    """HF name -> full FP32 copy of ``optimizer.state[param][key]`` (``exp_avg``...).

    Parameters without state (never stepped) are reported as zeros.
    """
    return optim.full_optimizer_state(optim.trainable(model), optimizer, key)
