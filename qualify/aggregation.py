"""Loss aggregation and the decoupled-PPO behavior weight, the reference side (FP64 numpy).

Both are data for the update, never differentiated: the aggregation's per-token factor
comes from the response mask alone, and the behavior weight from detached logprobs. The
reference update (:mod:`qualify.reference.update`), the clip-branch re-judging
(:mod:`qualify.branches`) and the coverage record (:mod:`qualify.reference.coverage`) read
them here; no harness does (each writes its own, :mod:`qualify.protocol`).

Aggregation (verl ``core_algos.agg_loss``'s mode names). A loss term with per-token values
``x[b, t]`` becomes ``Σ_{b,t} m[b, t] c[b, t] x[b, t]`` with the factor ``c``
(:func:`token_scale`):

- ``token-mean``: ``c = 1 / N``, ``N = Σ m`` (the batch's valid tokens).
- ``seq-mean-token-sum``: ``c = 1 / B'`` (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783:
  ``Σ_t`` per sequence, mean over sequences).
- ``seq-mean-token-mean``: ``c = 1 / (B' n_b)``, ``n_b = Σ_t m[b, t]`` (GRPO, Shao et al.
  2024, arXiv 2402.03300 eq. 3: per-sequence token mean, then mean over sequences).
- ``token-sum``: ``c = 1`` (the plain sum over valid tokens).
- ``seq-mean-token-sum-norm``: ``c = 1 / (B' L)`` with the constant ``L`` (the contract's
  ``loss_scale_factor``; Dr. GRPO's normalisation by the generation budget, Liu et al.
  2025, arXiv 2503.20783 eq. 3's "Dr. GRPO" objective with ``1 / |o_i|`` replaced by a
  constant; TRL ``loss_type = "dr_grpo"`` divides by ``B · max_completion_length``).

TRL's ``loss_type`` normalisations are these modes over one micro-batch: ``grpo`` =
``seq-mean-token-mean``, ``bnpo`` = ``token-mean``, ``dr_grpo`` =
``seq-mean-token-sum-norm`` with ``L = max_completion_length``, ``dapo`` and ``cispo`` =
``token-mean`` (over the global count of valid tokens, ``num_items_in_batch``).

``B'`` is the number of sequences with at least one valid token (a sequence without any
contributes nothing and is not counted). ``N``, ``B'`` and ``n_b`` are global to the batch,
so a micro-batch's share ``Σ_{b in mb}`` sums to the same loss and gradient under every
partition.

Behavior weight (decoupled PPO, Hilton et al. 2022, arXiv 2110.00641; AReaL
``realhf/impl/model/utils/ppo_functional.py::ppo_actor_loss_fn``): ``w = exp(lp_prox -
lp_behav)`` with ``lp_prox`` the trainer's own round-1 logprobs (the proximal policy) and
``lp_behav`` the sampler's ``behavior_logprobs``; with a cap ``C``:
``truncate``: ``min(w, C)`` (verl's truncated importance sampling); ``filter``: ``w`` where
``w <= C`` else 0 (AReaL: ``behav_mask = behav_imp_weight <= behav_imp_weight_cap``).
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import numpy.typing as npt

AGG_MODES: Final = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "token-sum",
                     "seq-mean-token-sum-norm")
CAP_MODES: Final = ("truncate", "filter")


def aggregation_terms(response_mask: npt.ArrayLike, mode: str,
                      scale_factor: float | None = None) -> tuple[npt.NDArray[np.float64], float]:
    """The aggregation ``mode`` as a per-sequence weight and one global denominator.

    ``c[b, t] = row_weight[b] / denominator`` (module docstring): ``token-mean``: ``(1,
    N)``; ``seq-mean-token-sum``: ``(1, B')``; ``seq-mean-token-mean``: ``(1 / n_b, B')``;
    ``token-sum``: ``(1, 1)``; ``seq-mean-token-sum-norm``: ``(1, B' L)``.
    A loss term is ``Σ_{b,t} m x row_weight[b] / denominator``; for ``token-mean`` the
    weight is exactly 1, so the sum is the protocol's ``Σ m x / N`` bit for bit.

    Args:
        response_mask: ``[B, R]`` 0/1 (or bool), 1 on valid response tokens (the whole
            batch, never one micro-batch: the denominators are global).
        mode: one of :data:`AGG_MODES`.
        scale_factor: ``L > 0`` of ``seq-mean-token-sum-norm`` (required there, ignored
            otherwise).

    Returns:
        ``(row_weight [B] float64, denominator)``; a sequence without valid tokens has
        weight 0.

    Raises:
        ValueError: an unknown mode, a mask that is not 2-D, no valid token at all, or
            ``seq-mean-token-sum-norm`` without a positive ``scale_factor``.
    """
    m = np.asarray(response_mask).astype(bool)
    if m.ndim != 2:
        raise ValueError(f"response_mask: expected [B, R], got shape {m.shape}")
    n_total = int(m.sum())
    if n_total == 0:
        raise ValueError("response_mask: no valid token")
    per_seq = m.sum(axis=1).astype(np.float64)  # [B]
    has = per_seq > 0
    if mode == "token-mean":
        return has.astype(np.float64), float(n_total)
    if mode == "seq-mean-token-sum":
        return has.astype(np.float64), float(has.sum())
    if mode == "seq-mean-token-mean":
        return np.where(has, 1.0 / np.maximum(per_seq, 1.0), 0.0), float(has.sum())
    if mode == "token-sum":
        return has.astype(np.float64), 1.0
    if mode == "seq-mean-token-sum-norm":
        if scale_factor is None or not scale_factor > 0:
            raise ValueError(f"seq-mean-token-sum-norm needs a loss_scale_factor > 0, got "
                             f"{scale_factor}")
        return has.astype(np.float64), float(has.sum()) * float(scale_factor)
    raise ValueError(f"loss_agg_mode: expected one of {list(AGG_MODES)}, got {mode!r}")


def token_scale(response_mask: npt.ArrayLike, mode: str,
                scale_factor: float | None = None) -> npt.NDArray[np.float64]:
    """The per-token factor ``c[b, t]`` of the aggregation ``mode`` (module docstring).

    Args:
        response_mask: ``[B, R]`` 0/1, the whole batch.
        mode: one of :data:`AGG_MODES`.
        scale_factor: as :func:`aggregation_terms`.

    Returns:
        ``[B, R]`` float64 ``row_weight[b] / denominator`` (:func:`aggregation_terms`), 0
        on masked tokens.

    Raises:
        ValueError: as :func:`aggregation_terms`.
    """
    m = np.asarray(response_mask).astype(bool)
    row, denom = aggregation_terms(m, mode, scale_factor)
    return np.where(m, row[:, None] / denom, 0.0)


def behavior_weights(proximal_logprobs: npt.ArrayLike, behavior_logprobs: npt.ArrayLike,
                     response_mask: npt.ArrayLike, *, cap: float | None,
                     cap_mode: str = "truncate") -> npt.NDArray[np.float64]:
    """Decoupled PPO's per-token behavior weight (module docstring), FP64.

    Args:
        proximal_logprobs: ``[B, R]`` the trainer's round-1 logprobs (detached).
        behavior_logprobs: ``[B, R]`` the sampler's logprobs of the same tokens.
        response_mask: ``[B, R]`` 0/1, 1 on valid tokens.
        cap: ``C > 1``, or ``None`` (uncapped).
        cap_mode: ``truncate`` or ``filter``.

    Returns:
        ``[B, R]`` float64 weights, 0 on masked tokens.

    Raises:
        ValueError: shapes differ, ``cap <= 1`` or an unknown ``cap_mode``.
    """
    prox = np.asarray(proximal_logprobs, np.float64)
    behav = np.asarray(behavior_logprobs, np.float64)
    m = np.asarray(response_mask).astype(bool)
    if prox.shape != behav.shape or prox.shape != m.shape:
        raise ValueError(f"shapes differ: proximal {prox.shape}, behavior {behav.shape}, "
                         f"mask {m.shape}")
    if cap is not None and not cap > 1.0:
        raise ValueError(f"cap must be > 1, got {cap}")
    if cap_mode not in CAP_MODES:
        raise ValueError(f"cap_mode: expected one of {list(CAP_MODES)}, got {cap_mode!r}")
    w = np.exp(np.where(m, prox - behav, 0.0))
    if cap is not None:
        w = np.minimum(w, cap) if cap_mode == "truncate" else np.where(w <= cap, w, 0.0)
    return np.where(m, w, 0.0)


def weight_stats(raw_weights: npt.ArrayLike, response_mask: npt.ArrayLike,
                 cap: float | None) -> dict[str, Any]:
    """Statistics of the uncapped weights ``exp(lp_prox - lp_behav)`` over valid tokens.

    Args:
        raw_weights: ``[B, R]`` uncapped weights.
        response_mask: ``[B, R]`` 0/1.
        cap: the contract's cap (``None``: nothing is capped).

    Returns:
        ``{"mean", "min", "max", "fraction_capped", "tokens"}``: mean / min / max of the
        uncapped weight, the fraction of valid tokens with ``w > cap`` (the ones the cap
        changes) and the count of valid tokens.
    """
    m = np.asarray(response_mask).astype(bool)
    w = np.asarray(raw_weights, np.float64)[m]
    capped = 0 if cap is None else int((w > cap).sum())
    return {"mean": float(w.mean()), "min": float(w.min()), "max": float(w.max()),
            "fraction_capped": capped / max(int(w.size), 1), "tokens": int(w.size)}
