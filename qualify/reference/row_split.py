"""The opt-in ``row_split`` control: row-parallel projections as TP-many partial products.

Used by the reference update (:mod:`qualify.reference.update`) when a contract names the
``row_split`` control (:mod:`qualify.reference.controls`).
"""

from __future__ import annotations

from typing import Any, Final

import torch
from torch import nn

__all__ = ["ROW_PARALLEL_SUFFIXES", "split_row_parallel"]

ROW_PARALLEL_SUFFIXES: Final = ("o_proj", "down_proj")
"""The HF Qwen3 / Llama projections a tensor-parallel engine splits by input features
(Megatron's ``RowParallelLinear``: ``linear_proj``, ``linear_fc2``; torch ``RowwiseParallel``)."""


def split_row_parallel(model: nn.Module, parts: int) -> int:
    """Make every row-parallel projection compute as ``parts`` partial products.

    A TP = ``parts`` engine computes ``y = x W^T`` of a row-parallel layer as
    ``Σ_r x[:, K_r] W[:, K_r]^T`` over input-feature slices ``K_r``: each partial product is
    formed on its rank in the compute dtype (BF16: accumulated in FP32, rounded once to
    BF16) and the all-reduce sums the partials in that dtype (Megatron-Core
    ``RowParallelLinear`` then ``reduce_from_tensor_model_parallel_region``; the default
    contract's finding in ``harnesses/megatron/README.md``). This control computes the HF
    model the same way, on one process, so the distance between one rounding and a sum of
    rounded partials is measured rather than assumed away. At FP32 it is a split-K
    re-ordering of the same sums.

    Implemented as a forward hook on each ``nn.Linear`` whose name ends with
    :data:`ROW_PARALLEL_SUFFIXES` that recomputes the output from the slices (autograd
    flows through the recomputation; the bias, if any, is added once). The hooks travel
    with ``copy.deepcopy`` (the BF16 working copy of ``bf16_mode="params"``).

    Args:
        model: an HF Qwen3 / Llama model (modified in place).
        parts: slices, ``>= 2``; the last slice takes the remainder.

    Returns:
        The number of projections hooked.

    Raises:
        ValueError: ``parts < 2``, or no projection to split (another architecture).
    """
    if parts < 2:
        raise ValueError(f"parts must be >= 2, got {parts}")

    def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        assert isinstance(module, nn.Linear)
        w = module.weight
        k = x.shape[-1]
        step = k // parts
        total: torch.Tensor | None = None
        for i in range(parts):
            cols = slice(i * step, k if i == parts - 1 else (i + 1) * step)
            y = torch.nn.functional.linear(x[..., cols], w[:, cols])
            total = y if total is None else total + y
        assert total is not None
        return total if module.bias is None else total + module.bias

    n = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.endswith(ROW_PARALLEL_SUFFIXES):
            module.register_forward_hook(hook)
            n += 1
    if n == 0:
        raise ValueError(f"no row-parallel projection ({', '.join(ROW_PARALLEL_SUFFIXES)}) "
                         f"in {type(model).__name__}")
    return n
