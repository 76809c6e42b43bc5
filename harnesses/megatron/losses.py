"""The vocab-parallel log-softmax and entropy Megatron's sharded output layer dictates.

The PPO / GRPO / value losses are the harness SDK's (:mod:`qualify_harness.losses`); nothing
here is shared with ``qualify/reference/``. The vocab-parallel reduction follows
Megatron-Core's ``_VocabParallelCrossEntropy`` (max all-reduce, sum-of-exp all-reduce,
target-logit all-reduce) but uses the role's explicit TP group: megatron-core 0.16.1's
``vocab_parallel_cross_entropy`` reads the *global* ``parallel_state`` TP group, which
this harness does not create (one launch runs an actor and a critic of different TP
sizes; see :func:`harnesses.megatron.model.role_groups`). The differentiable sums use
Megatron's own primitive ``reduce_from_tensor_model_parallel_region(x, group=...)``
(all-reduce forward, identity backward); the max is a detached ``all_reduce(MAX)`` (the
log-sum-exp is invariant to it).

Formulas: ``log p_t = z_t - m - log Σ_v exp(z_v - m)`` and ``H = m + log S - Σ_v
exp(z_v - m) z_v / S`` with ``z = logits / temperature`` and ``S = Σ_v exp(z_v - m)``;
vocab padding columns (global index ``>= V``) are excluded (they are rows this harness
added to fit Megatron's padded vocab, not tokens of the model).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def _reduce(x: Tensor, group: Any) -> Tensor:
    """Differentiable sum over the TP group (Megatron's mapping; identity when TP = 1)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    out: Tensor = reduce_from_tensor_model_parallel_region(x, group=group)
    return out


def vocab_parallel_logprobs_entropy(logits: Tensor, targets: Tensor, *, vocab: int,
                                    tp_rank: int, group: Any,
                                    temperature: float) -> tuple[Tensor, Tensor]:
    """Log-probability of ``targets`` and entropy from vocab-sharded logits.

    Args:
        logits: ``[b, R, V'/tp]`` this rank's vocab shard (any float dtype; computed in
            FP32), columns ``[tp_rank V'/tp, (tp_rank + 1) V'/tp)`` of the padded vocab.
        targets: ``[b, R]`` int64 token ids ``< vocab``.
        vocab: the true vocab size ``V`` (columns at or beyond it are padding).
        tp_rank: this rank's TP index.
        group: the TP process group (collective: every rank of it calls this).
        temperature: logits divisor (> 0).

    Returns:
        ``(logprobs, entropy)``, each ``[b, R]`` FP32, equal on every TP rank;
        differentiable with respect to ``logits``.
    """
    z = logits.float() / temperature
    local = z.shape[-1]
    start = tp_rank * local
    cols = torch.arange(start, start + local, device=z.device)
    pad = cols >= vocab  # [V'/tp]
    with torch.no_grad():
        m = z.masked_fill(pad, float("-inf")).amax(dim=-1)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = z - m.unsqueeze(-1)
    e = torch.exp(shifted).masked_fill(pad, 0.0)
    s = _reduce(e.sum(dim=-1), group)
    t = _reduce((e * shifted).sum(dim=-1), group)
    in_shard = (targets >= start) & (targets < start + local)
    idx = (targets - start).clamp(0, local - 1).unsqueeze(-1)
    target_shifted = _reduce(torch.where(in_shard, shifted.gather(-1, idx).squeeze(-1), 0.0),
                             group)
    log_s = torch.log(s)
    return target_shifted - log_s, log_s - t / s
