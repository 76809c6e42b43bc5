"""Full-distribution metrics between two next-token distributions at every response position.

Shared by the reference stage (its controls, :mod:`qualify.reference.distribution`) and
the comparator (the sampler cells, :mod:`qualify.compare.distribution`), so a bound and
the error it judges are computed by the same code. FP64 numpy throughout.

Inputs are log-probabilities ``[B, R, V]`` over the whole vocabulary (``-inf`` allowed for
a token outside a truncated distribution), the frozen response tokens ``[B, R]`` and the
response mask ``[B, R]``; each position's row is renormalised in FP64 first. ``cand`` is
the execution under test, ``ref`` the reference.
Per valid position ``(b, t)``, with ``p = exp(ref)``, ``q = exp(cand)``:

- ``kl_ref_cand`` = ``KL(p || q)``, ``kl_cand_ref`` = ``KL(q || p)`` (``0 * log 0 = 0``;
  ``inf`` where one puts mass the other excludes);
- ``tv`` = ``0.5 * sum |p - q|``;
- ``top1`` disagreement: ``argmax q != argmax p``, a **tie** (not counted) when the
  candidate's own top-2 gap ``q1 - q2`` in log space is at most :func:`tie_resolution` of
  its top logprob: below what the candidate's FP32 arithmetic resolves at that magnitude;
- ``topk`` disagreement: ``1 - |top-k(q) ∩ top-k(p)| / k`` (``k`` = :data:`TOPK`);
- ratio tails at the response token ``y``: ``r = q(y) / p(y)``; the fraction of valid
  tokens with ``r`` outside ``[1/2, 2]`` and outside the PPO band ``[1 - ε, 1 + ε]``.

Statistics (the keys of :func:`distribution_metrics`): ``kl_ref_cand_max``,
``kl_ref_cand_mean``, ``kl_cand_ref_max``, ``kl_cand_ref_mean``, ``tv_max``, ``tv_mean``,
``top1_mismatch`` (count, ties excluded), ``topk_disagreement_mean``, ``ratio_outside_2``,
``ratio_outside_clip``, ``seq_max_kl_mean`` (the mean over sequences of each sequence's
largest token ``KL(p || q)``; its maximum is ``kl_ref_cand_max``).
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import numpy.typing as npt

TOPK: Final = 5
"""``k`` of the top-k set agreement."""
TIE_ULPS: Final = 4.0
"""FP32 spacings of the top logprob below which a top-2 gap is a tie (log_softmax rounds
the logit, the running max and the log-sum-exp: a few spacings at that magnitude)."""
STATISTICS: Final = ("kl_ref_cand_max", "kl_ref_cand_mean", "kl_cand_ref_max",
                     "kl_cand_ref_mean", "tv_max", "tv_mean", "top1_mismatch",
                     "topk_disagreement_mean", "ratio_outside_2", "ratio_outside_clip",
                     "seq_max_kl_mean")
"""Every statistic :func:`distribution_metrics` returns, in report order."""


def tie_resolution(top: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """The smallest top-2 gap an FP32 computation resolves at log-probability ``top``."""
    a = np.abs(np.asarray(top, dtype=np.float64)).astype(np.float32)
    return TIE_ULPS * np.spacing(np.maximum(a, np.float32(1.0))).astype(np.float64)


def _renormalise(lp: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Each row minus its FP64 log-sum-exp.

    FP32 logprobs sum to 1 only within FP32 rounding, which would dominate a KL between
    nearly equal distributions.
    """
    top = np.max(lp, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        lse = top + np.log(np.sum(np.exp(lp - top), axis=-1, keepdims=True))
    out: npt.NDArray[np.float64] = lp - lse
    return out


def _kl(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """``KL(exp a || exp b)`` over the last axis (``0 log 0 = 0``)."""
    pa = np.exp(a)
    with np.errstate(invalid="ignore"):
        terms = np.where(pa > 0, pa * (a - b), 0.0)
    out: npt.NDArray[np.float64] = terms.sum(axis=-1)
    return out


def distribution_metrics(cand: npt.ArrayLike, ref: npt.ArrayLike, tokens: npt.ArrayLike,
                         mask: npt.ArrayLike, *, clip_ratio: float) -> dict[str, Any]:
    """Every statistic of the module docstring, plus where the worst KL sits.

    Args:
        cand: ``[B, R, V]`` candidate logprobs.
        ref: ``[B, R, V]`` reference logprobs.
        tokens: ``[B, R]`` response token ids.
        mask: ``[B, R]`` response mask (non-zero = valid).
        clip_ratio: PPO ``ε`` (> 0).

    Returns:
        ``{statistic: float}`` for :data:`STATISTICS`, plus ``n_valid``, ``top1_ties``,
        ``worst`` (``"(b, t)"`` of the largest ``KL(p || q)``) and ``seq_max_kl``
        (per-sequence maxima, a list).

    Raises:
        ValueError: shapes differ, are not ``[B, R, V]`` / ``[B, R]``, no valid position,
            a token id outside the vocabulary, or ``clip_ratio <= 0``.
    """
    c = np.asarray(cand, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    tok = np.asarray(tokens).astype(np.int64)
    m = np.asarray(mask) != 0
    if c.ndim != 3 or c.shape != r.shape or tok.shape != c.shape[:2] or m.shape != tok.shape:
        raise ValueError(f"shapes: cand {c.shape}, ref {r.shape}, tokens {tok.shape}, mask "
                         f"{m.shape}; expected [B, R, V] twice and [B, R] twice")
    if not clip_ratio > 0:
        raise ValueError(f"clip_ratio must be > 0, got {clip_ratio!r}")
    if not m.any():
        raise ValueError("no valid response position")
    v = c.shape[2]
    if ((tok[m] < 0) | (tok[m] >= v)).any():
        raise ValueError(f"a response token id is outside the vocabulary of {v}")
    cv, rv, tv_tok = _renormalise(c[m]), _renormalise(r[m]), tok[m]
    kl_rc, kl_cr = _kl(rv, cv), _kl(cv, rv)
    tv = 0.5 * np.abs(np.exp(rv) - np.exp(cv)).sum(axis=-1)
    order_c = np.argsort(-cv, axis=-1, kind="stable")
    order_r = np.argsort(-rv, axis=-1, kind="stable")
    top_c = np.take_along_axis(cv, order_c[:, :2], axis=-1)
    differ = order_c[:, 0] != order_r[:, 0]
    tie = differ & ((top_c[:, 0] - top_c[:, 1]) <= tie_resolution(top_c[:, 0]))
    k = min(TOPK, v)
    inter = np.array([len(set(a[:k].tolist()) & set(b[:k].tolist()))
                      for a, b in zip(order_c, order_r, strict=True)], dtype=np.float64)
    idx = np.arange(len(tv_tok))
    with np.errstate(invalid="ignore", over="ignore"):
        log_ratio = cv[idx, tv_tok] - rv[idx, tv_tok]
    ratio_out_2 = ~(np.abs(log_ratio) <= np.log(2.0))
    with np.errstate(over="ignore"):
        ratio = np.exp(log_ratio)
    ratio_out_clip = ~((ratio >= 1.0 - clip_ratio) & (ratio <= 1.0 + clip_ratio))
    full_kl = np.full(m.shape, -np.inf)
    full_kl[m] = kl_rc
    seq = [float(full_kl[b][m[b]].max()) for b in range(m.shape[0]) if m[b].any()]
    flat = int(np.nanargmax(np.where(np.isnan(kl_rc), np.inf, kl_rc)))
    where = np.argwhere(m)[flat]
    return {"kl_ref_cand_max": float(np.max(kl_rc)), "kl_ref_cand_mean": float(np.mean(kl_rc)),
            "kl_cand_ref_max": float(np.max(kl_cr)), "kl_cand_ref_mean": float(np.mean(kl_cr)),
            "tv_max": float(np.max(tv)), "tv_mean": float(np.mean(tv)),
            "top1_mismatch": float(np.sum(differ & ~tie)),
            "topk_disagreement_mean": float(np.mean(1.0 - inter / k)),
            "ratio_outside_2": float(np.mean(ratio_out_2)),
            "ratio_outside_clip": float(np.mean(ratio_out_clip)),
            "seq_max_kl_mean": float(np.mean(seq)),
            "n_valid": int(m.sum()), "top1_ties": int(np.sum(tie)),
            "worst": f"({int(where[0])}, {int(where[1])})", "seq_max_kl": seq}


def position_metrics(cand: npt.ArrayLike, ref: npt.ArrayLike, mask: npt.ArrayLike
                     ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Per position, the token ``KL(p || q)`` and the top-k set agreement.

    The same quantities :func:`distribution_metrics` aggregates (its ``kl_ref_cand_max`` is
    the maximum of the first over valid positions, its ``topk_disagreement_mean`` the mean of
    one minus the second).

    Args:
        cand: ``[B, R, V]`` candidate logprobs ``q``.
        ref: ``[B, R, V]`` reference logprobs ``p``.
        mask: ``[B, R]`` response mask (non-zero = valid).

    Returns:
        ``(kl, agreement)``, each ``[B, R]`` float64, ``nan`` at masked positions;
        ``agreement = |top-k(q) ∩ top-k(p)| / k`` (``k = min(TOPK, V)``).

    Raises:
        ValueError: shapes differ or are not ``[B, R, V]`` / ``[B, R]``.
    """
    c = np.asarray(cand, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    m = np.asarray(mask) != 0
    if c.ndim != 3 or c.shape != r.shape or m.shape != c.shape[:2]:
        raise ValueError(f"shapes: cand {c.shape}, ref {r.shape}, mask {m.shape}; expected "
                         f"[B, R, V] twice and [B, R]")
    kl = np.full(m.shape, np.nan)
    agree = np.full(m.shape, np.nan)
    if not m.any():
        return kl, agree
    cv, rv = _renormalise(c[m]), _renormalise(r[m])
    kl[m] = _kl(rv, cv)
    k = min(TOPK, c.shape[2])
    order_c = np.argsort(-cv, axis=-1, kind="stable")[:, :k]
    order_r = np.argsort(-rv, axis=-1, kind="stable")[:, :k]
    agree[m] = [len(set(a.tolist()) & set(b.tolist())) / k
                for a, b in zip(order_c, order_r, strict=True)]
    return kl, agree
