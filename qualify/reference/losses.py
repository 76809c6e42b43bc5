"""The reference's per-token RL losses, one function per variant, written from each paper.

Every function here takes per-token tensors ``[B, R]`` (``B`` sequences, ``R`` response
positions) and returns the per-token loss term ``[B, R]`` *before* aggregation (the
contract's ``loss_agg_mode``, :mod:`qualify.aggregation`), so that the loss a trainer
minimises is ``Σ_{b,t} m[b, t] c[b, t] w[b, t] ℓ[b, t]`` with the aggregation factor ``c``
and the rollout-correction weight ``w`` (:func:`rollout_correction_weights`). The functions
are dtype-generic torch (autograd gives the gradient the variant defines, including the
stop-gradients its paper writes ``sg(.)``); the reference update calls them at its working
precision, the FP64 control and the golden tests (``tests/test_loss_variants.py``, numbers
derived by hand with :mod:`fractions`) call them in FP64. They share no code with any
trainer harness or stack: each is written from the equation cited in its docstring.

Names are the field's (verl ``actor.policy_loss.loss_mode`` / ``clip_ratio_low`` /
``clip_ratio_high`` / ``clip_ratio_c``, ``kl_loss_type``; TRL ``GRPOConfig.loss_type`` /
``epsilon`` / ``epsilon_high`` / ``importance_sampling_level``): see
:class:`qualify.contract.AlgorithmSpec` for the mapping.
"""

from __future__ import annotations

from typing import Final

import torch

POLICY_LOSSES: Final = ("ppo_clip", "gspo", "cispo")
"""``algorithm.policy_loss`` values: :func:`ppo_clip`, :func:`gspo`, :func:`cispo`."""
KL_ESTIMATORS: Final = ("k1", "k2", "k3", "low_var_kl", "k1+", "k3+", "low_var_kl+")
"""KL estimator names (:func:`kl_estimate`); ``k2+`` is ``k2`` itself and not listed."""
IS_LEVELS: Final = ("token", "sequence")
IS_MODES: Final = ("truncate", "mask")
LOW_VAR_KL_BOUND: Final = 10.0
"""``low_var_kl`` clamps the estimate to ``[-10, 10]`` (verl ``kl_penalty_forward``)."""
LOW_VAR_KL_LOG_BOUND: Final = 20.0
"""``low_var_kl`` clamps ``log(π_ref / π)`` to ``[-20, 20]`` before exponentiating."""


def ppo_clip(logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, *,
             clip_low: float, clip_high: float,
             clip_c: float | None = None) -> torch.Tensor:
    """PPO's clipped surrogate loss per token, with asymmetric and dual clipping.

    ``r = exp(logp - old)``; ``ℓ = max(-A r, -A clip(r, 1 - ε_low, 1 + ε_high))``
    (Schulman et al. 2017, arXiv 1707.06347, eq. 7, negated to a loss; ``ε_low = ε_high``
    is PPO's symmetric clip, ``ε_high > ε_low`` is DAPO's clip-higher, Yu et al. 2025,
    arXiv 2503.14476, eq. 10). Dual-clip (Ye et al. 2020, arXiv 1912.09729, eq. 5): for
    ``A < 0`` the loss is further bounded, ``ℓ = min(ℓ, -A c)`` with ``c > 1``
    (``clip_c``; ``None``: no dual clip).

    Args:
        logp: ``[B, R]`` current logprobs (differentiated).
        old: ``[B, R]`` logprobs of the clip centre (detached by the caller).
        advantages: ``[B, R]``.
        clip_low: ``ε_low`` in ``[0, 1]``.
        clip_high: ``ε_high > 0``.
        clip_c: dual-clip ``c > 1`` or ``None``.

    Returns:
        ``[B, R]`` per-token loss, gradient through ``logp`` where the unclipped term is
        the active one.

    Raises:
        ValueError: ``clip_c <= 1``.
    """
    if clip_c is not None and not clip_c > 1.0:
        raise ValueError(f"clip_c: dual-clip needs c > 1, got {clip_c}")
    ratio = torch.exp(logp - old)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * clip_c), loss)
    return loss


def gspo(logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor,
         mask: torch.Tensor, *, clip_low: float, clip_high: float) -> torch.Tensor:
    """GSPO's sequence-level clipped loss, broadcast to the sequence's tokens.

    ``s_b = exp((1 / n_b) Σ_t m (logp - old))`` (Zheng et al. 2025, arXiv 2507.18071, eq. 7:
    the length-normalised sequence ratio ``(π / π_old)^(1 / |y|)``), and per token
    ``ℓ_{b,t} = max(-A s_b, -A clip(s_b, 1 - ε_low, 1 + ε_high))`` (eq. 5, negated). The
    value of ``ℓ`` is constant over the sequence's valid tokens; its gradient is the
    sequence term's, ``∂s_b / ∂logp_{b,t} = s_b / n_b``, so under any aggregation the
    loss equals GSPO-token's (eq. 13), whose ``sg(s_b) π_t / sg(π_t)`` has the same value
    and, summed over the sequence's tokens with weight ``1 / n_b``, the same gradient.
    ``n_b`` counts at least 1 (a sequence without valid tokens has ratio 1).

    Args:
        logp: ``[B, R]`` current logprobs (differentiated).
        old: ``[B, R]`` logprobs of the clip centre (detached by the caller).
        advantages: ``[B, R]`` (constant per sequence in GRPO; a token's own ``A`` is used).
        mask: ``[B, R]`` 0/1 response mask.
        clip_low: ``ε_low`` (GSPO's are small, e.g. 3e-4).
        clip_high: ``ε_high`` (e.g. 4e-4).

    Returns:
        ``[B, R]`` per-token loss.
    """
    m = mask.to(logp.dtype)
    n = m.sum(-1).clamp(min=1.0)
    s = torch.exp(((logp - old) * m).sum(-1) / n)[:, None]  # [B, 1]
    unclipped = -advantages * s
    clipped = -advantages * torch.clamp(s, 1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped)


def cispo(logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, *,
          clip_low: float, clip_high: float) -> torch.Tensor:
    """CISPO's loss per token: a clipped, stop-gradient IS weight times REINFORCE.

    ``ℓ = -sg(clip(r, 1 - ε_low, 1 + ε_high)) A logp`` with ``r = exp(logp - old)``
    (MiniMax et al. 2025, arXiv 2506.13585, eq. 4-5, negated to a loss). No token is
    dropped: the gradient is ``-clip(r) A`` at every token. ``ε_low = 1`` leaves the ratio
    unclipped from below (the paper sets no lower bound).

    Args:
        logp: ``[B, R]`` current logprobs (differentiated).
        old: ``[B, R]`` logprobs of the ratio's denominator (detached by the caller).
        advantages: ``[B, R]``.
        clip_low: ``ε_low`` in ``[0, 1]``.
        clip_high: ``ε_high > 0``.

    Returns:
        ``[B, R]`` per-token loss.
    """
    weight = torch.clamp(torch.exp(logp - old), 1 - clip_low, 1 + clip_high).detach()
    return -weight * advantages * logp


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of ``KL(π || π_ref)`` from samples of ``π``.

    With ``x = logp - ref`` (Schulman 2020, "Approximating KL divergence",
    http://joschu.net/blog/kl-approx.html): ``k1 = x``; ``k2 = x² / 2``;
    ``k3 = exp(-x) + x - 1`` (unbiased, low variance); ``low_var_kl`` = ``k3`` with
    ``-x`` clamped to ``[-20, 20]`` and the result to ``[-10, 10]`` (verl's name and
    clamps). A ``+`` suffix is the straight-through form: the value of the base estimator
    and the gradient of ``k2`` (``∂/∂logp = x``), the unbiased gradient of the KL
    (verl ``kl_penalty``; ``k2+`` is ``k2``).

    Args:
        logp: ``[B, R]`` current logprobs (differentiated).
        ref: ``[B, R]`` reference-policy logprobs (no gradient).
        estimator: one of :data:`KL_ESTIMATORS` or ``k2+``.

    Returns:
        ``[B, R]`` estimate.

    Raises:
        ValueError: an unknown estimator.
    """
    straight = estimator.endswith("+")
    base = estimator[:-1] if straight else estimator
    x = logp - ref
    if base == "k1":
        value = x
    elif base == "k2":
        value = 0.5 * x.square()
    elif base == "k3":
        value = torch.exp(-x) + x - 1.0
    elif base == "low_var_kl":
        neg = torch.clamp(-x, -LOW_VAR_KL_LOG_BOUND, LOW_VAR_KL_LOG_BOUND)
        value = torch.clamp(torch.exp(neg) - neg - 1.0, -LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}")
    if not straight or base == "k2":
        return value
    k2 = 0.5 * x.square()
    return k2 - k2.detach() + value.detach()


def ratio_weighted_kl(kl: torch.Tensor, logp: torch.Tensor, old: torch.Tensor,
                      mask: torch.Tensor, *, level: str = "token") -> torch.Tensor:
    """The KL estimate weighted by the (differentiable) policy ratio: ``r · k``.

    Samples come from ``π_old``; ``E_{π_old}[r k(π_θ, π_ref)]`` with ``r = π_θ / π_old`` is
    the KL of ``π_θ`` itself, and its gradient the unbiased reverse-KL gradient (DeepSeek-AI
    2025, "DeepSeek-V3.2", arXiv 2512.02556, the unbiased KL estimate of its GRPO objective;
    TRL ``use_bias_correction_kl``). ``r`` is not detached: at ``r = 1`` (round 1) the
    value is ``k`` but the gradient gains ``k ∂r/∂logp = k``. ``level = "sequence"``
    weights every token by GSPO's sequence ratio ``s_b`` (:func:`gspo`).

    Args:
        kl: ``[B, R]`` per-token estimate (:func:`kl_estimate`).
        logp: ``[B, R]`` current logprobs (differentiated).
        old: ``[B, R]`` the ratio's denominator (detached by the caller).
        mask: ``[B, R]`` 0/1 response mask (for the sequence ratio).
        level: ``token`` or ``sequence``.

    Returns:
        ``[B, R]`` weighted estimate.

    Raises:
        ValueError: an unknown level.
    """
    if level == "token":
        return torch.exp(logp - old) * kl
    if level == "sequence":
        m = mask.to(logp.dtype)
        return torch.exp(((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None] * kl
    raise ValueError(f"level: expected token or sequence, got {level!r}")


def rollout_correction_weights(old: torch.Tensor, behavior: torch.Tensor,
                               mask: torch.Tensor, *, level: str, mode: str,
                               threshold: float,
                               threshold_low: float | None = None) -> torch.Tensor:
    """Train/rollout importance weights, truncated (TIS) or masked (MIS), detached.

    ``ρ_t = exp(old_t - behavior_t)`` per token (``level = "token"``), or
    ``ρ_b = exp(Σ_t m (old - behavior))`` of the whole sequence broadcast to its tokens
    (``"sequence"``): the ratio of the trainer's policy to the sampler's that the sampled
    tokens were drawn from. ``truncate`` (TIS; Yao et al. 2025, "Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training"): ``min(ρ, C)``. ``mask`` (MIS;
    Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
    Training-Inference Mismatch"): ``ρ`` where ``C_low <= ρ <= C`` else 0 (``C_low``:
    ``threshold_low``, 0 when ``None``). Multiplying a token's policy term by ``w`` is
    also decoupled PPO's behavior weight (Hilton et al. 2022) at token level.

    Args:
        old: ``[B, R]`` the trainer's round-1 logprobs (detached).
        behavior: ``[B, R]`` the sampler's logprobs of the same tokens.
        mask: ``[B, R]`` 0/1 response mask.
        level: ``token`` or ``sequence``.
        mode: ``truncate`` or ``mask``.
        threshold: ``C > 0``.
        threshold_low: ``C_low`` for ``mask`` (``< C``) or ``None``.

    Returns:
        ``[B, R]`` weights, 0 on masked tokens, no gradient.

    Raises:
        ValueError: an unknown level or mode, or thresholds out of order.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is: expected one of {list(IS_LEVELS)}, got {level!r}")
    if mode not in IS_MODES:
        raise ValueError(f"rollout_is_mode: expected one of {list(IS_MODES)}, got {mode!r}")
    if not threshold > 0 or (threshold_low is not None and not 0 <= threshold_low < threshold):
        raise ValueError(f"rollout_is thresholds: need 0 <= low < high, got {threshold_low}, "
                         f"{threshold}")
    m = mask.to(old.dtype)
    log_rho = (old - behavior).detach() * m
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    rho = torch.exp(log_rho)
    if mode == "truncate":
        w = torch.clamp(rho, max=threshold)
    else:
        low = 0.0 if threshold_low is None else threshold_low
        w = torch.where((rho >= low) & (rho <= threshold), rho, torch.zeros_like(rho))
    return w * m
