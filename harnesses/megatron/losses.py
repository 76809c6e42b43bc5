"""This harness's own numerics: vocab-parallel log-softmax / entropy and the PPO losses.

Written for this harness (no code shared with ``qualify/reference/scoring.py``,
``qualify/reference/targets.py``, ``qualify/reference/update.py`` or another harness). The
vocab-parallel reduction follows
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
added to fit Megatron's padded vocab, not tokens of the model). PPO: Schulman et al. 2017,
eq. 7; KL estimators: Schulman 2020, "Approximating KL divergence"; value clipping as in
:mod:`qualify.protocol`.
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


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Σ of ``x`` over ``mask`` (both ``[b, R]``); 0-d FP32."""
    return torch.where(mask, x, torch.zeros_like(x)).sum()


def policy_loss_sum(logprobs: Tensor, old: Tensor, advantages: Tensor, mask: Tensor,
                    clip: float, *, weight: Tensor | None = None) -> Tensor:
    """Σ over valid tokens of ``k max(-A r, -A clip(r, 1-ε, 1+ε))``, ``r = exp(lp - old)``.

    Args:
        logprobs: ``[b, R]`` FP32 current logprobs.
        old: ``[b, R]`` FP32 logprobs of round 1 (detached).
        advantages: ``[b, R]`` FP32.
        mask: ``[b, R]`` bool.
        clip: ε.
        weight: ``[b, R]`` detached factor ``k`` (aggregation row weight x behavior weight),
            or ``None`` (1).
    """
    ratio = torch.exp(logprobs - old)
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip))
    return masked_sum(loss if weight is None else loss * weight, mask)


def kl_penalty(logprobs: Tensor, ref: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimate ``k1 | k2 | k3`` of ``π`` from ``π_ref`` (``[b, R]``).

    Raises:
        ValueError: unknown estimator.
    """
    d = ref - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown KL estimator {estimator!r}")


def value_loss_sum(values: Tensor, old: Tensor, returns: Tensor, mask: Tensor,
                   clip: float, *, weight: Tensor | None = None) -> Tensor:
    """``0.5 Σ k max((V - G)^2, (old + clip(V - old, -δ, δ) - G)^2)`` over valid tokens.

    ``k``: ``weight`` ``[b, R]`` (the aggregation row weight), or 1 when ``None``.
    """
    clipped = old + (values - old).clamp(-clip, clip)
    per = torch.maximum((values - returns).square(), (clipped - returns).square())
    return 0.5 * masked_sum(per if weight is None else per * weight, mask)


def aggregation_terms(mask: Tensor, mode: str) -> tuple[Tensor, float]:
    """``loss_agg_mode`` as ``(row_weight [B] FP32, denominator)`` of the whole batch.

    verl ``core_algos.agg_loss`` names: ``token-mean`` ``(1, N)``; ``seq-mean-token-sum``
    ``(1, B')`` (Dr. GRPO, arXiv 2503.20783); ``seq-mean-token-mean`` ``(1 / n_b, B')``
    (GRPO, arXiv 2402.03300 eq. 3). ``N`` valid tokens, ``n_b`` those of row ``b``, ``B'``
    rows with any; global, so every micro-batch split gives the same gradient.

    Raises:
        ValueError: unknown mode.
    """
    n_b = mask.long().sum(-1)
    keep = (n_b > 0).to(torch.float32)
    if mode == "token-mean":
        return keep, float(n_b.sum())
    if mode == "seq-mean-token-sum":
        return keep, float(keep.sum())
    if mode == "seq-mean-token-mean":
        return keep / n_b.clamp(min=1).to(torch.float32), float(keep.sum())
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def behavior_weight(proximal: Tensor, behavior: Tensor, cap: float | None,
                    cap_mode: str) -> tuple[Tensor, Tensor]:
    """Decoupled PPO's detached ``(weight, uncapped)`` ``[b, R]`` (Hilton et al. 2022; AReaL).

    ``uncapped = exp(lp_prox - lp_behav)`` (this engine's round-1 logprobs against the
    rollout's ``behavior_logprobs``); ``truncate``: ``min(., cap)``; ``filter``: 0 above
    ``cap`` (AReaL ``ppo_actor_loss_fn``).

    Raises:
        ValueError: unknown ``cap_mode``.
    """
    u = (proximal.detach() - behavior).exp()
    if cap is None:
        return u, u
    if cap_mode == "truncate":
        return u.clamp(max=cap), u
    if cap_mode == "filter":
        return u.masked_fill(u > cap, 0.0), u
    raise ValueError(f"unknown behavior_weight_cap_mode {cap_mode!r}")


def weight_stats(raw: Tensor, mask: Tensor, cap: float | None) -> dict[str, float]:
    """Mean / min / max / fraction above ``cap`` / count of the valid uncapped weights."""
    v = raw.masked_select(mask).double()
    frac = 0.0 if cap is None else float((v > cap).sum()) / max(v.numel(), 1)
    return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max()),
            "fraction_capped": frac, "tokens": int(v.numel())}
