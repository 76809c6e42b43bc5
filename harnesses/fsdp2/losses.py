"""The PPO update's per-token quantities and losses, in the fsdp2 harness's own code.

Nothing numerical is imported from :mod:`qualify` (the reference path is the independent
side of every comparison) nor from another harness; the formulas are the ones
:mod:`qualify.protocol` writes down (the same as ``harnesses/torch_tp/losses.py``, on
plain tensors: FSDP2 all-gathers the parameters, so every rank holds whole logits).
Shapes: ``b`` sequences of a micro-batch, ``R`` response positions, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KlEstimator = Literal["k1", "k2", "k3"]


def token_logprobs_and_entropy(logits: Tensor, targets: Tensor,
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
    """Clipped surrogate ``Σ max(-A·ρ, -A·clip(ρ, 1-ε, 1+ε))`` over valid tokens.

    Schulman et al. 2017, eq. 7, with ``ρ = exp(logprobs - old_logprobs)``.

    Args:
        logprobs: ``[b, R]`` FP32, with gradient.
        old_logprobs: ``[b, R]`` FP32, detached (round 1's own log-probs).
        advantages: ``[b, R]`` FP32.
        mask: ``[b, R]`` bool, valid response tokens.
        clip_ratio: ε.
        weight: ``[b, R]`` detached per-token factor (aggregation row weight x decoupled
            PPO's behavior weight), or ``None`` (1).

    Returns:
        0-d FP32 sum (the caller divides by the aggregation's global denominator).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = torch.maximum(-advantages * ratio,
                              -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio))
    if weight is not None:
        surrogate = weight * surrogate
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
        weight: ``[b, R]`` per-token aggregation factor, or ``None`` (1).

    Returns:
        0-d FP32 sum (the caller divides by the aggregation's denominator).
    """
    clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    per_token = torch.maximum((values - returns).square(), (clipped - returns).square())
    if weight is not None:
        per_token = weight * per_token
    return 0.5 * masked_sum(per_token, mask)


def aggregation_terms(mask: Tensor, mode: str) -> tuple[Tensor, float]:
    """The ``loss_agg_mode`` as ``(row_weight [B] FP32, denominator)`` over the whole batch.

    Every data-parallel rank calls it on the **full** batch mask and keeps its rows' weights,
    so the denominators are global and the summed gradient is partition invariant. verl
    ``core_algos.agg_loss`` names: ``token-mean`` ``(1, N)``; ``seq-mean-token-sum``
    ``(1, B')`` (Dr. GRPO, arXiv 2503.20783); ``seq-mean-token-mean`` ``(1 / n_b, B')``
    (GRPO, arXiv 2402.03300 eq. 3); ``N`` valid tokens, ``n_b`` row ``b``'s, ``B'`` rows
    with any.

    Args:
        mask: ``[B, R]`` bool.
        mode: the mode name.

    Raises:
        ValueError: unknown mode.
    """
    counts = mask.float().sum(dim=1)
    valid_rows = (counts > 0).float()
    if mode == "token-mean":
        return valid_rows, float(counts.sum())
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        rows = float(valid_rows.sum())
        if mode == "seq-mean-token-sum":
            return valid_rows, rows
        return valid_rows / torch.clamp(counts, min=1.0), rows
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def behavior_weight(proximal_logprobs: Tensor, behavior_logprobs: Tensor, cap: float | None,
                    cap_mode: str) -> tuple[Tensor, Tensor]:
    """Decoupled PPO's weight ``π_prox / π_behav`` per token (Hilton et al. 2022; AReaL).

    ``π_prox``: this engine's own round-1 logprobs (detached); ``π_behav``: the rollout's
    ``behavior_logprobs``. ``truncate`` caps at ``cap``; ``filter`` zeroes a weight above
    it (AReaL ``ppo_actor_loss_fn``'s ``behav_mask``).

    Args:
        proximal_logprobs: ``[b, R]`` FP32.
        behavior_logprobs: ``[b, R]`` FP32.
        cap: ``> 1`` or ``None``.
        cap_mode: ``truncate`` or ``filter``.

    Returns:
        ``(weight, uncapped)``, ``[b, R]`` FP32, detached.

    Raises:
        ValueError: unknown ``cap_mode``.
    """
    with torch.no_grad():
        uncapped = torch.exp(proximal_logprobs - behavior_logprobs)
        if cap is None:
            return uncapped, uncapped
        if cap_mode == "truncate":
            return uncapped.clamp(max=cap), uncapped
        if cap_mode == "filter":
            return torch.where(uncapped > cap, 0.0, uncapped), uncapped
    raise ValueError(f"unknown behavior_weight_cap_mode {cap_mode!r}")


def weight_stats(raw: Tensor, mask: Tensor, cap: float | None) -> dict[str, float]:
    """Statistics of the valid uncapped weights ``[B, R]``: mean, min, max, fraction > cap."""
    vals = raw[mask].double()
    n = int(vals.numel())
    frac = 0.0 if cap is None else float((vals > cap).sum()) / max(n, 1)
    return {"mean": float(vals.mean()), "min": float(vals.min()), "max": float(vals.max()),
            "fraction_capped": frac, "tokens": n}
