"""fsdp2 layout -> Hugging Face layout: full FP32 tensors under HF parameter names.

``fully_shard`` replaces each parameter by a ``Shard(0)`` DTensor on the role's DP mesh
and keeps the HF module tree, so parameter names stay the HF names
(``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``, ``score.weight``). FSDP2
chunks dim 0 like ``torch.chunk`` (the last ranks' chunks may be shorter or empty, the
padding is FSDP's internal buffer, never the DTensor's): ``DTensor.full_tensor()`` (an
all-gather over the DP group) gives the HF tensor back with no permutation. The same holds
for the ``.grad`` of a parameter (FP32 after the reduce-scatter) and for AdamW's
``exp_avg`` / ``exp_avg_sq`` (DTensors placed like their parameter).

Every function here is collective over the role's DP group: all its ranks must call it
with the same module, in the same order, while the model is resharded (between steps).
"""

from __future__ import annotations

import torch
from qualify_harness import optim
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from qualify.errors import HarnessError


def sharded(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable ``(name, parameter)``; every one must be a DTensor (the model resharded)."""
    out = optim.trainable(model)
    plain = [n for n, p in out if not isinstance(p, DTensor)]
    if plain:
        raise HarnessError(f"parameters {plain[:3]} are not sharded DTensors here: gather "
                           f"only between steps, after reshard()")
    return out


def full_params(model: nn.Module) -> dict[str, Tensor]:
    """HF name -> full FP32 copy of every trainable parameter (the FP32 master weights)."""
    return optim.full_params(sharded(model))


def full_grads(model: nn.Module) -> dict[str, Tensor]:
    """HF name -> full FP32 copy of every trainable parameter's ``.grad`` (zeros if None)."""
    return optim.full_grads(sharded(model))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         key: str) -> dict[str, Tensor]:
    """HF name -> full FP32 copy of ``optimizer.state[param][key]`` (``exp_avg``...).

    Parameters without state (never stepped) are reported as zeros.
    """
    return optim.full_optimizer_state(sharded(model), optimizer, key)


def local_shapes(model: nn.Module) -> dict[str, list[int]]:
    """HF name -> this rank's local shard shape (``outputs.json``: how FSDP2 split it)."""
    return {n: list(p.to_local().shape) for n, p in sharded(model)
            if isinstance(p, DTensor)}
