"""The PPO update's per-token quantities and losses, in this harness's own code.

Nothing numerical is imported from :mod:`qualify` or from another harness; the formulas
are the ones :mod:`qualify.protocol` writes down. AutoTP's vocab-parallel ``lm_head``
gathers its output, so the logits arrive whole (``[b, R, V]``) on every TP rank and the
log-softmax below is a plain single-device computation. Shapes: ``b`` sequences of a
micro-batch, ``R`` response positions, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Literal

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
                    clip_ratio: float) -> Tensor:
    """Clipped surrogate ``Σ max(-A·ρ, -A·clip(ρ, 1-ε, 1+ε))`` over valid tokens.

    Schulman et al. 2017, eq. 7, with ``ρ = exp(logprobs - old_logprobs)``.

    Args:
        logprobs: ``[b, R]`` FP32, with gradient.
        old_logprobs: ``[b, R]`` FP32, detached (round 1's own log-probs).
        advantages: ``[b, R]`` FP32.
        mask: ``[b, R]`` bool, valid response tokens.
        clip_ratio: ε.

    Returns:
        0-d FP32 sum (the caller divides by the global token count ``N``).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    return masked_sum(torch.maximum(unclipped, clipped), mask)


def value_loss_sum(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                   value_clip: float) -> Tensor:
    """Clipped value loss ``0.5 · Σ max((V - G)^2, (V_old + clip(V - V_old, ±δ) - G)^2)``.

    Value clipping as in OpenAI baselines ``ppo2``.

    Args:
        values: ``[b, R]`` FP32 critic values, with gradient.
        old_values: ``[b, R]`` FP32, detached (round 1's own values).
        returns: ``[b, R]`` FP32 targets ``G``.
        mask: ``[b, R]`` bool, valid response tokens.
        value_clip: δ.

    Returns:
        0-d FP32 sum (the caller divides by ``N``).
    """
    v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    err = (values - returns) ** 2
    err_clipped = (v_clipped - returns) ** 2
    return 0.5 * masked_sum(torch.maximum(err, err_clipped), mask)
