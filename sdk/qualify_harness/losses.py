"""The PPO / GRPO / decoupled-PPO losses of every engine harness, written once.

Nothing here is shared with ``qualify/reference/`` (the independent side of every
comparison): these are the harnesses' formulas, on the per-token quantities an engine
computed. Shapes: ``b`` sequences of a micro-batch, ``R`` response positions, ``V``
vocabulary. A loss term is a masked **sum** over a micro-batch divided by the aggregation's
denominator over the whole batch (:func:`aggregation_terms`), so any micro-batch partition
sums to the same loss.

:func:`logprobs_and_entropy` is the single-device log-softmax (whole logits on the rank);
an engine whose head is vocab-parallel writes its own (the engine dictates it).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KlEstimator = Literal["k1", "k2", "k3"]


def logprobs_and_entropy(logits: Tensor, targets: Tensor,
                               temperature: float) -> tuple[Tensor, Tensor]:
    """Log-probability of each target token and the entropy, under ``softmax(logits / T)``.

    With ``z = logits.float() / T``, ``m = max_v z`` (no gradient: log-sum-exp does not
    depend on the shift), ``lse = log Σ_v exp(z - m)``:
    ``logprob = (z_target - m) - lse`` and ``H = lse - Σ_v p_v (z_v - m)``.

    Args:
        logits: ``[b, R, V]`` (any float dtype; upcast to FP32 here).
        targets: ``[b, R]`` int64 token ids (the responses).
        temperature: the contract's sampling temperature (> 0).

    Returns:
        ``(logprobs, entropy)``, each ``[b, R]`` FP32.
    """
    z = logits.float() / temperature
    shifted = z - z.detach().amax(dim=-1, keepdim=True)
    lse = shifted.exp().sum(dim=-1).log()
    z_target = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    probs = (shifted - lse.unsqueeze(-1)).exp()
    p_dot_z = (probs * shifted).sum(dim=-1)
    return z_target - lse, lse - p_dot_z


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """``Σ x`` over positions where ``mask`` is true (``where``, so padding never leaks NaN).

    Args:
        x: ``[b, R]`` float.
        mask: ``[b, R]`` bool.

    Returns:
        0-d tensor in ``x``'s dtype.
    """
    return torch.where(mask, x, torch.zeros_like(x)).sum()


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: KlEstimator) -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from samples of π (Schulman 2020).

    ``k1 = lp - ref``, ``k2 = (lp - ref)^2 / 2``, ``k3 = exp(ref - lp) - (ref - lp) - 1``.

    Args:
        logprobs: ``[b, R]`` current policy log-probs (with gradient).
        ref_logprobs: ``[b, R]`` frozen reference policy log-probs.
        estimator: ``k1``, ``k2`` or ``k3``.

    Raises:
        ValueError: unknown estimator.
    """
    diff = ref_logprobs - logprobs
    if estimator == "k1":
        return -diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        return torch.exp(diff) - diff - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")


def policy_loss_sum(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                    clip_ratio: float, *, weight: Tensor | None = None) -> Tensor:
    """Clipped surrogate ``Σ k · max(-A·ρ, -A·clip(ρ, 1-ε, 1+ε))`` over valid tokens.

    Schulman et al. 2017, eq. 7, with ``ρ = exp(logprobs - old_logprobs)``; ``k`` the
    per-token ``weight`` (aggregation row weight x behavior weight; 1 when ``None``).

    Args:
        logprobs: ``[b, R]`` FP32, with gradient.
        old_logprobs: ``[b, R]`` FP32, detached (round 1's own log-probs).
        advantages: ``[b, R]`` FP32.
        mask: ``[b, R]`` bool, valid response tokens.
        clip_ratio: ε.
        weight: ``[b, R]`` FP32 detached per-token factor, or ``None``.

    Returns:
        0-d FP32 sum (the caller divides by the aggregation's global denominator).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = torch.maximum(-advantages * ratio,
                              -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio))
    if weight is not None:
        surrogate = surrogate * weight
    return masked_sum(surrogate, mask)


def value_loss_sum(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                   value_clip: float, *, weight: Tensor | None = None) -> Tensor:
    """Clipped value loss ``0.5 · Σ max((V - G)^2, (V_old + clip(V - V_old, ±δ) - G)^2)``.

    Args:
        values: ``[b, R]`` FP32 critic values, with gradient.
        old_values: ``[b, R]`` FP32, detached (round 1's own values).
        returns: ``[b, R]`` FP32 targets ``G``.
        mask: ``[b, R]`` bool, valid response tokens.
        value_clip: δ.
        weight: ``[b, R]`` FP32 per-token aggregation factor, or ``None`` (1).

    Returns:
        0-d FP32 sum (the caller divides by the aggregation's denominator).
    """
    clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    per_token = torch.maximum((values - returns).square(), (clipped - returns).square())
    if weight is not None:
        per_token = per_token * weight
    return 0.5 * masked_sum(per_token, mask)


def aggregation_terms(mask: Tensor, mode: str) -> tuple[Tensor, float]:
    """Per-sequence weight and global denominator of the contract's ``loss_agg_mode``.

    A loss term is ``Σ_{b,t} mask · x · row_weight[b] / denominator``, the denominators
    taken over the **whole** batch (never one micro-batch), so any partition sums to the
    same loss (verl ``core_algos.agg_loss`` names): ``token-mean`` ``(1, N)``;
    ``seq-mean-token-sum`` ``(1, B')`` (Dr. GRPO, arXiv 2503.20783); ``seq-mean-token-mean``
    ``(1 / n_b, B')`` (GRPO, arXiv 2402.03300 eq. 3). ``N`` = valid tokens, ``n_b`` = valid
    tokens of row ``b``, ``B'`` = rows with at least one.

    Args:
        mask: ``[B, R]`` bool, the whole batch's valid response tokens.
        mode: ``token-mean``, ``seq-mean-token-sum`` or ``seq-mean-token-mean``.

    Returns:
        ``(row_weight [B] FP32, denominator)``.

    Raises:
        ValueError: unknown mode.
    """
    lengths = mask.sum(dim=1)
    has = (lengths > 0).float()
    if mode == "token-mean":
        return has, float(mask.sum())
    if mode == "seq-mean-token-sum":
        return has, float(has.sum())
    if mode == "seq-mean-token-mean":
        return has / lengths.clamp(min=1).float(), float(has.sum())
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def behavior_weight(proximal_logprobs: Tensor, behavior_logprobs: Tensor, cap: float | None,
                    cap_mode: str) -> tuple[Tensor, Tensor]:
    """Decoupled PPO's behavior importance weight (Hilton et al. 2022; AReaL).

    ``w = exp(lp_prox - lp_behav)``, detached, with ``lp_prox`` this engine's own round-1
    logprobs (the proximal policy) and ``lp_behav`` the rollout's ``behavior_logprobs``;
    ``truncate``: ``min(w, cap)``; ``filter``: ``w`` if ``w <= cap`` else 0 (AReaL
    ``ppo_actor_loss_fn``).

    Args:
        proximal_logprobs: ``[b, R]`` FP32.
        behavior_logprobs: ``[b, R]`` FP32.
        cap: ``> 1`` or ``None`` (uncapped).
        cap_mode: ``truncate`` or ``filter``.

    Returns:
        ``(weight, uncapped weight)``, each ``[b, R]`` FP32 without gradient.

    Raises:
        ValueError: unknown ``cap_mode``.
    """
    raw = (proximal_logprobs.detach() - behavior_logprobs).exp()
    if cap is None:
        return raw, raw
    if cap_mode == "truncate":
        return raw.clamp(max=cap), raw
    if cap_mode == "filter":
        return torch.where(raw <= cap, raw, torch.zeros_like(raw)), raw
    raise ValueError(f"unknown behavior_weight_cap_mode {cap_mode!r}")


def weight_stats(raw: Tensor, mask: Tensor, cap: float | None) -> dict[str, float]:
    """``{"mean", "min", "max", "fraction_capped", "tokens"}`` of the uncapped weights.

    Args:
        raw: ``[B, R]`` uncapped behavior weights.
        mask: ``[B, R]`` bool.
        cap: the cap (``None``: fraction 0).
    """
    w = raw[mask].double()
    capped = 0 if cap is None else int((w > cap).sum())
    return {"mean": float(w.mean()), "min": float(w.min()), "max": float(w.max()),
            "fraction_capped": capped / max(w.numel(), 1), "tokens": int(w.numel())}
