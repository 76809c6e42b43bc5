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
    surrogate = torch.maximum(-advantages * ratio,
                              -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio))
    return masked_sum(surrogate, mask)


def value_loss_sum(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                   value_clip: float) -> Tensor:
    """Clipped value loss ``0.5 · Σ max((V - G)^2, (V_old + clip(V - V_old, ±δ) - G)^2)``.

    Args:
        values: ``[b, R]`` FP32 critic values, with gradient.
        old_values: ``[b, R]`` FP32, detached (round 1's own values).
        returns: ``[b, R]`` FP32 targets ``G``.
        mask: ``[b, R]`` bool, valid response tokens.
        value_clip: δ.

    Returns:
        0-d FP32 sum (the caller divides by ``N``).
    """
    clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    per_token = torch.maximum((values - returns).square(), (clipped - returns).square())
    return 0.5 * masked_sum(per_token, mask)
