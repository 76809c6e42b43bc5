"""The PPO update's per-token quantities and losses, in this harness's own code.

Nothing numerical is imported from :mod:`qualify` or from another harness; the formulas
are the ones :mod:`qualify.protocol` writes down. AutoTP's vocab-parallel ``lm_head``
gathers its output, so the logits arrive whole (``[b, R, V]``) on every TP rank and the
log-softmax below is a plain single-device computation. Shapes: ``b`` sequences of a
micro-batch, ``R`` response positions, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

KlEstimator = Literal["k1", "k2", "k3"]


def token_logprobs_and_entropy(logits: Tensor, targets: Tensor,
                               temperature: float) -> tuple[Tensor, Tensor]:
    """Log-probability of each target token and the entropy under ``softmax(logits / T)``.

    ``log p = log_softmax(logits.float() / T)``; ``logprob = log p[target]``,
    ``H = -Σ_v p_v log p_v``.

    Args:
        logits: ``[b, R, V]`` any float dtype (upcast to FP32 here).
        targets: ``[b, R]`` int64 token ids (the responses).
        temperature: the contract's sampling temperature (> 0).

    Returns:
        ``(logprobs, entropy)``, each ``[b, R]`` FP32.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    target_lp = torch.gather(logp, -1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return target_lp, entropy


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """``Σ x`` over positions where ``mask`` is true (``where``: padding never leaks NaN).

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
        ref_logprobs: ``[b, R]`` frozen reference-policy log-probs.
        estimator: ``k1``, ``k2`` or ``k3``.

    Raises:
        ValueError: unknown estimator.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio * log_ratio
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
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
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    per_token = torch.maximum(unclipped, clipped)
    return masked_sum(per_token if weight is None else per_token * weight, mask)


def value_loss_sum(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                   value_clip: float, *, weight: Tensor | None = None) -> Tensor:
    """Clipped value loss ``0.5 · Σ max((V - G)^2, (V_old + clip(V - V_old, ±δ) - G)^2)``.

    Value clipping as in OpenAI baselines ``ppo2``.

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
    v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    err = (values - returns) ** 2
    err_clipped = (v_clipped - returns) ** 2
    per_token = torch.maximum(err, err_clipped)
    return 0.5 * masked_sum(per_token if weight is None else per_token * weight, mask)


def aggregation_terms(mask: Tensor, mode: str) -> tuple[Tensor, float]:
    """``(row_weight [B], denominator)`` of the contract's ``loss_agg_mode``.

    With ``n_b`` the valid tokens of row ``b``, ``N = Σ n_b`` and ``S`` the rows with
    ``n_b > 0`` (whole batch, so every micro-batch partition gives the same loss; verl
    ``core_algos.agg_loss`` names): ``token-mean`` ``(1, N)``, ``seq-mean-token-sum``
    ``(1, S)`` (Dr. GRPO, arXiv 2503.20783), ``seq-mean-token-mean`` ``(1 / n_b, S)``
    (GRPO, arXiv 2402.03300 eq. 3). A term is ``Σ mask · x · row_weight / denominator``.

    Args:
        mask: ``[B, R]`` bool, valid tokens of the whole batch.
        mode: the mode name.

    Raises:
        ValueError: unknown mode.
    """
    n_b = mask.sum(dim=-1).float()
    nonempty = n_b > 0
    ones = nonempty.float()
    if mode == "token-mean":
        return ones, float(n_b.sum())
    if mode == "seq-mean-token-sum":
        return ones, float(nonempty.sum())
    if mode == "seq-mean-token-mean":
        return torch.where(nonempty, 1.0 / torch.where(nonempty, n_b, 1.0), 0.0), \
            float(nonempty.sum())
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def behavior_weight(proximal_logprobs: Tensor, behavior_logprobs: Tensor, cap: float | None,
                    cap_mode: str) -> tuple[Tensor, Tensor]:
    """Decoupled PPO weight ``exp(lp_prox - lp_behav)`` (Hilton et al. 2022; AReaL).

    ``lp_prox``: this engine's round-1 logprobs, detached (the proximal policy);
    ``lp_behav``: the rollout's ``behavior_logprobs``. ``truncate``: ``min(w, cap)``;
    ``filter``: 0 where ``w > cap`` (AReaL ``ppo_actor_loss_fn``).

    Args:
        proximal_logprobs: ``[b, R]`` FP32.
        behavior_logprobs: ``[b, R]`` FP32.
        cap: ``> 1`` or ``None``.
        cap_mode: ``truncate`` or ``filter``.

    Returns:
        ``(weight, uncapped)`` ``[b, R]`` FP32, no gradient.

    Raises:
        ValueError: unknown ``cap_mode``.
    """
    w = torch.exp(proximal_logprobs.detach() - behavior_logprobs)
    if cap is None:
        return w, w
    if cap_mode == "truncate":
        return torch.minimum(w, torch.full_like(w, cap)), w
    if cap_mode == "filter":
        return torch.where(w <= cap, w, torch.zeros_like(w)), w
    raise ValueError(f"unknown behavior_weight_cap_mode {cap_mode!r}")


def weight_stats(raw: Tensor, mask: Tensor, cap: float | None) -> dict[str, float]:
    """Mean, min, max, fraction above ``cap`` and count of the valid uncapped weights ``[B, R]``."""
    w = torch.masked_select(raw, mask).double()
    above = 0.0 if cap is None else float((w > cap).double().sum())
    return {"mean": float(w.mean()), "min": float(w.min()), "max": float(w.max()),
            "fraction_capped": above / max(w.numel(), 1), "tokens": int(w.numel())}


def algorithm_meta(algorithm: Any, raw: Tensor | None, mask: Tensor) -> dict[str, Any]:
    """The role's ``loss_agg_mode`` and, for decoupled PPO, its weight statistics.

    Args:
        algorithm: the contract's ``AlgorithmSpec`` (mode, cap, rounds).
        raw: ``[B, R]`` uncapped behavior weights (fixed by round 1, used in every round),
            or ``None``.
        mask: ``[B, R]`` bool.

    Returns:
        ``{"loss_agg_mode": ..., ["behavior_weight": {"round{r}": weight_stats}]}``.
    """
    out: dict[str, Any] = {"loss_agg_mode": algorithm.loss_agg_mode}
    if raw is not None:
        stats = weight_stats(raw, mask, algorithm.behavior_weight_cap)
        out["behavior_weight"] = {f"round{r}": stats for r in range(1, algorithm.rounds + 1)}
    return out
