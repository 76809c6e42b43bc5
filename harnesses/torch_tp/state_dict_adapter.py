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

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def full_fp32(x: Tensor) -> Tensor:
    """Full, unsharded FP32 CPU copy of ``x`` (all-gather for a sharded DTensor).

    Args:
        x: a DTensor on the TP mesh, or a plain tensor.

    Returns:
        A contiguous FP32 CPU tensor with the global shape (HF layout).
    """
    full = x.full_tensor() if isinstance(x, DTensor) else x
    return full.detach().to(device="cpu", dtype=torch.float32).contiguous().clone()


def dtype_name(dtypes: Iterable[torch.dtype]) -> str | list[str]:
    """``"torch.float32"`` when one dtype was observed, else the sorted list of names."""
    names = sorted({str(d) for d in dtypes})
    return names[0] if len(names) == 1 else names


def full_params(model: nn.Module) -> dict[str, Tensor]:
    """HF name -> full FP32 copy of every trainable parameter (the master weights)."""
    return {n: full_fp32(p) for n, p in model.named_parameters() if p.requires_grad}


def full_grads(model: nn.Module) -> dict[str, Tensor]:
    """HF name -> full FP32 copy of every trainable parameter's ``.grad`` (zeros if None)."""
    out: dict[str, Tensor] = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        out[n] = full_fp32(p.grad) if p.grad is not None else torch.zeros(p.shape)
    return out


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         key: str) -> dict[str, Tensor]:
    """HF name -> full FP32 copy of ``optimizer.state[param][key]`` (``exp_avg``...).

    Parameters without state (never stepped) are reported as zeros.
    """
    out: dict[str, Tensor] = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        st = optimizer.state.get(p, {})
        out[n] = full_fp32(st[key]) if key in st else torch.zeros(p.shape)
    return out


def state_dtypes(optimizer: torch.optim.Optimizer, key: str) -> set[torch.dtype]:
    """Dtypes of ``optimizer.state[*][key]`` actually held (empty before the first step)."""
    return {st[key].dtype for st in optimizer.state.values() if key in st}
