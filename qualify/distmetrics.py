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
  candidate's own top-2 gap ``q1 - q2`` in log space is at most :func:`tie_resolution`:
  below what the candidate's own precision resolves (FP32: at its top logprob; BF16: at its
  top raw logit's magnitude, when the candidate recorded it, see :func:`tie_resolution`);
- ``topk`` disagreement: ``1 - |top-k(q) ∩ top-k(p)| / k`` (``k`` = :data:`TOPK`);
- ratio tails at the response token ``y``: ``r = q(y) / p(y)``; the fraction of valid
  tokens with ``r`` outside ``[1/2, 2]`` and outside the PPO band ``[1 - ε, 1 + ε]``.

Statistics (the keys of :func:`distribution_metrics`): ``kl_ref_cand_max``,
``kl_ref_cand_mean``, ``kl_cand_ref_max``, ``kl_cand_ref_mean``, ``tv_max``, ``tv_mean``,
``top1_mismatch`` (count, ties excluded), ``topk_disagreement_mean``, ``ratio_outside_2``,
``ratio_outside_clip``, ``seq_max_kl_mean`` (the mean over sequences of each sequence's
largest token ``KL(p || q)``; its maximum is ``kl_ref_cand_max``).

**Top-k path** (:func:`topk_metrics`, a vocabulary too large to keep whole): each side holds,
per position, its own ``k`` largest logprobs (normalised over the whole vocabulary) with
their token ids (:func:`topk_of`), and the logprob of the response token. Let ``I`` be the
intersection of the two top-k sets, and lump everything outside ``I`` into one bucket, of
mass ``1 - P(I)`` under ``p`` and ``1 - Q(I)`` under ``q`` (every mass computed in FP64 from
the FP32 logprobs). Statistics of the same names then mean:

- ``kl_*`` and ``seq_max_kl_mean``: the KL of the lumped distributions (the ``|I|`` tokens
  and the bucket), a **lower bound** on the true KL by the data-processing inequality (a
  partition of the vocabulary cannot increase a KL); no upper bound exists (the tail may put
  arbitrarily little mass where the other puts some);
- ``tv_max`` / ``tv_mean``: the lumped total variation, a lower bound on the true TV;
- ``tv_upper_max`` / ``tv_upper_mean``: ``0.5 * (sum_I |p - q| + (1 - P(I)) + (1 - Q(I)))``,
  an **upper bound** on the true TV (the tokens outside ``I`` differ by at most the sum of
  their masses), sharp when the two tails may sit on disjoint tokens;
- ``top1_mismatch`` and ``topk_disagreement_mean`` (``k`` = :data:`TOPK` <= the kept ``k``)
  and the ratio tails (from the response token's logprobs): exact, as on the full path;
- ``topk_set_disagreement_mean``: ``1 - |I| / k`` at the kept ``k``.

A bucket is measured from FP32 logprobs and resolved only down to
:func:`tail_resolution` (``k`` FP32 roundings of the kept probabilities) plus
:data:`NORM_RESOLUTION` of the kept mass (a row's FP32 normalisation offset, which the full
path renormalises away): two buckets that differ by less are taken as equal, and a larger
difference is reduced by it (``tv_upper`` instead adds it to each bucket); when both buckets
are below :func:`tail_resolution` they are dropped and the kept parts renormalised (as the
full path renormalises each row, so ``k = V`` gives the full path's statistics); otherwise a
bucket below it is raised to it (a tail the FP32 sums cannot see is not called empty). The
bounds hold up to that resolution. ``missing_ref_max`` / ``missing_cand_max`` (and
``_mean``) report each side's mass outside its own top-k.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import numpy.typing as npt

KINDS: Final = ("raw", "tempered")
"""The distributions compared: ``raw`` ``log_softmax(logits)``, ``tempered``
``log_softmax(logits / T)``."""
PATHS: Final = ("decode", "prefill")
"""Where a judged distribution is taken: ``decode`` a sampler cell's decode path,
``prefill`` an Actor trainer cell's teacher-forced forward of the response window."""


def family(path: str, kind: str, *, topk: bool) -> str:
    """The row family of the ``kind`` distributions taken on ``path``.

    ``<path>_<kind>``, with ``_topk`` appended on the top-k path (a vocabulary too large to
    compare whole).
    """
    return f"{path}_{kind}" + ("_topk" if topk else "")


FAMILIES: Final = tuple(family(path, kind, topk=topk) for path in PATHS
                        for topk in (False, True) for kind in KINDS)
"""Every distribution row family, in report and drawing order (``decode_raw``,
``decode_tempered``, ``decode_raw_topk``, ..., ``prefill_tempered_topk``). Defined here, the
comparator's leaf module, so that :mod:`qualify.compare.rootcause` (imported by the rows'
own module) and :mod:`qualify.evidence.policy` name them without an import cycle."""
TOPK: Final = 5
"""``k`` of the top-k set agreement."""
TIE_ULPS: Final = 4.0
"""FP32 spacings of the top logprob below which a top-2 gap is a tie (log_softmax rounds
the logit, the running max and the log-sum-exp: a few spacings at that magnitude)."""
BF16_TIE_SPACINGS: Final = 2.0
"""BF16 spacings of the top raw logit below which a BF16 candidate's top-2 gap is a tie
(``c`` of :func:`tie_resolution`, where the choice is argued)."""
BF16_TIE_RULE: Final = "bf16_spacings"
"""A sealed reference's ``distribution.json`` ``bf16_controls_ties``: its BF16 controls'
top-1 ties were counted at their own precision (:func:`tie_resolution` with
``precision="bf16"`` and each control's top raw logit), as a BF16 trainer cell's are. A
reference without it counted them by the FP32 rule, and its BF16 cells are then counted by
that rule too (:mod:`qualify.compare.distribution`): a ceiling and the count it judges share
one rule."""
TIE_PRECISIONS: Final = ("fp32", "bf16")
"""The candidate precisions :func:`tie_resolution` knows."""
STATISTICS: Final = ("kl_ref_cand_max", "kl_ref_cand_mean", "kl_cand_ref_max",
                     "kl_cand_ref_mean", "tv_max", "tv_mean", "top1_mismatch",
                     "topk_disagreement_mean", "ratio_outside_2", "ratio_outside_clip",
                     "seq_max_kl_mean")
"""Every statistic :func:`distribution_metrics` returns, in report order."""
TOPK_STATISTICS: Final = (*STATISTICS, "tv_upper_max", "tv_upper_mean",
                          "topk_set_disagreement_mean")
"""Every statistic :func:`topk_metrics` returns, in report order."""



def bf16_spacing(x: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """The spacing of BF16 numbers at magnitude ``max(|x|, 1)``, FP64.

    ``2^(e - 7)`` for ``|x|`` in ``[2^e, 2^(e+1))`` (8 significant bits). The floor at 1
    mirrors :func:`tie_resolution`'s FP32 rule: a logit's error does not shrink with its own
    magnitude (it is a sum of rounded products of any size), so a small top logit does not
    make a small gap resolvable.
    """
    a = np.maximum(np.abs(np.asarray(x, dtype=np.float64)), 1.0)
    _, e = np.frexp(a)  # a = m * 2^e, m in [0.5, 1): a in [2^(e-1), 2^e)
    return np.ldexp(1.0, e - 8).astype(np.float64)


def tie_resolution(top: npt.ArrayLike, *, precision: str = "fp32",
                   top_logit: npt.ArrayLike | None = None,
                   temperature: float = 1.0) -> npt.NDArray[np.float64]:
    """The smallest top-2 log-probability gap the candidate's own precision resolves.

    FP32 (and any candidate without ``top_logit``): :data:`TIE_ULPS` FP32 spacings at the
    top log-probability ``top`` (magnitude floored at 1), what the FP32 log-softmax's own
    roundings leave unresolved.

    BF16 with ``top_logit``: the logits are BF16 values, so a top-2 gap is resolved only to
    BF16 spacings at the logits' magnitude, not at the log-probability's. The gap of two
    BF16 logits in one binade is a multiple of the spacing ``s = bf16_spacing(top_logit)``;
    one rounding of each already lets an observed gap of one ``s`` come from a true gap of
    0, and a BF16 forward's logit carries more error than its final rounding (every layer's
    output is rounded to BF16 before the head), of the same order or larger. The rule takes
    ``c =`` :data:`BF16_TIE_SPACINGS` ``= 2``: an observed gap of 0, 1 or 2 spacings (each
    logit off by up to one spacing, twice the final rounding's half spacing) is a tie; a
    larger gap is a mismatch. It is not a bound on the upstream error (none holds a priori:
    a logit is a sum of products with cancellation); a flip beyond it is counted, and judged
    against the sealed ceiling. The resolution is ``c * s / temperature`` (a tempered gap
    is the raw gap over ``T``) **plus** the FP32 rule (the stored log-probabilities are FP32
    roundings of the FP64 log-softmax, which moves a gap of exactly ``c * s`` by a few FP32
    spacings), so it is never below the FP32 rule. ``s`` is the larger spacing of the two
    logits: the top one's for a top logit ``z >= 0`` (the runner-up is nearer 0), and for
    ``z < 0`` the spacing at ``|z| + c * bf16_spacing(z)``, the farthest from 0 a runner-up
    within the rule sits (it may be in the next binade, of twice the spacing).

    Args:
        top: ``[N]`` the candidate's top log-probability per position.
        precision: the candidate's compute precision (:data:`TIE_PRECISIONS`).
        top_logit: ``[N]`` the candidate's top raw logit per position (``None``: not
            recorded; the FP32 rule for every precision).
        temperature: the divisor of the logits these log-probabilities come from (1 for
            the raw kind, ``T`` for the tempered kind; > 0).

    Returns:
        ``[N]`` FP64 resolutions.

    Raises:
        ValueError: an unknown precision, ``temperature <= 0``, or ``top_logit`` of another
            shape than ``top``.
    """
    if precision not in TIE_PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {TIE_PRECISIONS}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    a = np.abs(np.asarray(top, dtype=np.float64)).astype(np.float32)
    fp32 = TIE_ULPS * np.spacing(np.maximum(a, np.float32(1.0))).astype(np.float64)
    if precision == "fp32" or top_logit is None:
        return fp32
    z = np.asarray(top_logit, dtype=np.float64)
    if z.shape != fp32.shape:
        raise ValueError(f"top_logit has shape {z.shape}, top {fp32.shape}")
    far = np.where(z < 0, np.abs(z) + BF16_TIE_SPACINGS * bf16_spacing(z), z)
    out: npt.NDArray[np.float64] = fp32 + BF16_TIE_SPACINGS * bf16_spacing(far) / float(
        temperature)
    return out


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


TOP1_STATES: Final = ("agree", "mismatch", "tie")
"""A position's top-1 state in a ``sequences`` record: the argmaxes agree, differ, or differ
within the candidate's own resolution (:func:`tie_resolution`, not counted)."""


def _summary(*, kl_rc: npt.NDArray[np.float64], kl_cr: npt.NDArray[np.float64],
             tv: npt.NDArray[np.float64], differ: npt.NDArray[np.bool_],
             tie: npt.NDArray[np.bool_], agree: npt.NDArray[np.float64],
             cand_token: npt.NDArray[np.float64], ref_token: npt.NDArray[np.float64],
             mask: npt.NDArray[np.bool_], clip_ratio: float, worst_sequences: int
             ) -> tuple[dict[str, float], dict[str, Any]]:
    """The statistics both paths aggregate from their per-position values.

    Args:
        kl_rc: ``[N]`` ``KL(p || q)`` at the ``N`` valid positions (row-major order of
            ``mask``).
        kl_cr: ``[N]`` ``KL(q || p)``.
        tv: ``[N]`` total variation.
        differ: ``[N]`` the two top-1 tokens differ.
        tie: ``[N]`` they differ within the candidate's resolution (a subset of ``differ``).
        agree: ``[N]`` top-:data:`TOPK` set agreement in ``[0, 1]``.
        cand_token: ``[N]`` the candidate's logprob of the response token.
        ref_token: ``[N]`` the reference's.
        mask: ``[B, R]`` boolean response mask.
        clip_ratio: PPO ``ε``.
        worst_sequences: how many ``sequences`` records to add (``0``: no key).

    Returns:
        ``(statistics, meta)``: :data:`STATISTICS` in order; ``n_valid``, ``top1_ties``,
        ``worst``, ``seq_max_kl`` and, when ``worst_sequences > 0``, ``sequences``: for the
        sequences with the largest token ``KL(p || q)`` (``nan`` counted as ``inf``; equal
        maxima by the smaller ``b``), largest first, ``{"b", "t": [valid positions],
        "kl_ref_cand", "kl_cand_ref", "top1": [TOP1_STATES], "topk_agreement"}``.
    """
    m = mask
    with np.errstate(invalid="ignore", over="ignore"):
        log_ratio = cand_token - ref_token
    ratio_out_2 = ~(np.abs(log_ratio) <= np.log(2.0))
    with np.errstate(over="ignore"):
        ratio = np.exp(log_ratio)
    ratio_out_clip = ~((ratio >= 1.0 - clip_ratio) & (ratio <= 1.0 + clip_ratio))
    full_kl = np.full(m.shape, -np.inf)
    full_kl[m] = kl_rc
    seq = [float(full_kl[b][m[b]].max()) for b in range(m.shape[0]) if m[b].any()]
    flat = int(np.nanargmax(np.where(np.isnan(kl_rc), np.inf, kl_rc)))
    where = np.argwhere(m)[flat]
    stats = {"kl_ref_cand_max": float(np.max(kl_rc)), "kl_ref_cand_mean": float(np.mean(kl_rc)),
             "kl_cand_ref_max": float(np.max(kl_cr)), "kl_cand_ref_mean": float(np.mean(kl_cr)),
             "tv_max": float(np.max(tv)), "tv_mean": float(np.mean(tv)),
             "top1_mismatch": float(np.sum(differ & ~tie)),
             "topk_disagreement_mean": float(np.mean(1.0 - agree)),
             "ratio_outside_2": float(np.mean(ratio_out_2)),
             "ratio_outside_clip": float(np.mean(ratio_out_clip)),
             "seq_max_kl_mean": float(np.mean(seq))}
    meta: dict[str, Any] = {"n_valid": int(m.sum()), "top1_ties": int(np.sum(tie)),
                            "worst": f"({int(where[0])}, {int(where[1])})", "seq_max_kl": seq}
    if worst_sequences > 0:
        meta["sequences"] = _worst_sequences(
            worst_sequences, mask=m, kl_rc=kl_rc, kl_cr=kl_cr, agree=agree,
            top1=np.where(tie, 2, np.where(differ, 1, 0)))
    return stats, meta


def _worst_sequences(n: int, *, mask: npt.NDArray[np.bool_], kl_rc: npt.NDArray[np.float64],
                     kl_cr: npt.NDArray[np.float64], agree: npt.NDArray[np.float64],
                     top1: npt.NDArray[np.int64]) -> list[dict[str, Any]]:
    """The ``sequences`` records of :func:`_summary` (``top1`` indexes :data:`TOP1_STATES`)."""
    per_pos = np.full(mask.shape, -np.inf)
    per_pos[mask] = np.where(np.isnan(kl_rc), np.inf, kl_rc)
    ranked = [int(b) for b in np.argsort(-per_pos.max(axis=1), kind="stable") if mask[b].any()]
    start = np.concatenate([[0], np.cumsum(mask.sum(axis=1))])  # b's slice of the [N] arrays
    out = []
    for b in ranked[:n]:
        sl = slice(int(start[b]), int(start[b + 1]))
        out.append({"b": b, "t": [int(t) for t in np.flatnonzero(mask[b])],
                    "kl_ref_cand": [float(x) for x in kl_rc[sl]],
                    "kl_cand_ref": [float(x) for x in kl_cr[sl]],
                    "top1": [TOP1_STATES[int(x)] for x in top1[sl]],
                    "topk_agreement": [float(x) for x in agree[sl]]})
    return out


def distribution_metrics(cand: npt.ArrayLike, ref: npt.ArrayLike, tokens: npt.ArrayLike,
                         mask: npt.ArrayLike, *, clip_ratio: float,
                         worst_sequences: int = 0, precision: str = "fp32",
                         top_logit: npt.ArrayLike | None = None,
                         temperature: float = 1.0) -> dict[str, Any]:
    """Every statistic of the module docstring, plus where the worst KL sits.

    Args:
        cand: ``[B, R, V]`` candidate logprobs.
        ref: ``[B, R, V]`` reference logprobs.
        tokens: ``[B, R]`` response token ids.
        mask: ``[B, R]`` response mask (non-zero = valid).
        clip_ratio: PPO ``ε`` (> 0).
        worst_sequences: how many of the sequences with the largest token ``KL(p || q)`` to
            return per position (key ``sequences``; ``0``: no key).
        precision: the candidate's compute precision, for its top-1 tie resolution
            (:func:`tie_resolution`).
        top_logit: ``[B, R]`` the candidate's top raw logit per position (``None``: not
            recorded, the FP32 tie rule).
        temperature: the divisor of the logits ``cand`` was formed from (1 for the raw
            kind, ``T`` for the tempered kind).

    Returns:
        ``{statistic: float}`` for :data:`STATISTICS`, plus ``n_valid``, ``top1_ties``,
        ``worst`` (``"(b, t)"`` of the largest ``KL(p || q)``), ``seq_max_kl``
        (per-sequence maxima, a list) and, when asked, ``sequences``: the per-position
        values those statistics aggregate, of the worst sequences (:func:`_summary`).

    Raises:
        ValueError: shapes differ, are not ``[B, R, V]`` / ``[B, R]`` (``top_logit``
            included), no valid position, a token id outside the vocabulary,
            ``clip_ratio <= 0``, or a bad ``precision`` / ``temperature``
            (:func:`tie_resolution`).
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
    tie = differ & ((top_c[:, 0] - top_c[:, 1]) <= tie_resolution(
        top_c[:, 0], precision=precision, top_logit=_at_valid(top_logit, m),
        temperature=temperature))
    k = min(TOPK, v)
    inter = np.array([len(set(a[:k].tolist()) & set(b[:k].tolist()))
                      for a, b in zip(order_c, order_r, strict=True)], dtype=np.float64)
    idx = np.arange(len(tv_tok))
    stats, meta = _summary(kl_rc=kl_rc, kl_cr=kl_cr, tv=tv, differ=differ, tie=tie,
                           agree=inter / k, cand_token=cv[idx, tv_tok],
                           ref_token=rv[idx, tv_tok], mask=m, clip_ratio=clip_ratio,
                           worst_sequences=worst_sequences)
    return {**stats, **meta}


def _at_valid(top_logit: npt.ArrayLike | None, mask: npt.NDArray[np.bool_]
              ) -> npt.NDArray[np.float64] | None:
    """``top_logit [B, R]`` at the valid positions ``[N]`` (``None`` stays ``None``).

    Raises:
        ValueError: ``top_logit`` is not of ``mask``'s shape.
    """
    if top_logit is None:
        return None
    z = np.asarray(top_logit, dtype=np.float64)
    if z.shape != mask.shape:
        raise ValueError(f"top_logit has shape {z.shape}, expected the mask's {mask.shape}")
    out: npt.NDArray[np.float64] = z[mask]
    return out


NORM_RESOLUTION: Final = 2.0 ** -18
"""Relative resolution of an FP32 logprob row's normalisation: its log-sum-exp is off by up
to a few FP32 spacings (4 at a magnitude of 16), which scales every kept probability alike;
the full path renormalises it away, the top-k path cannot (the tail is unseen)."""


def tail_resolution(k: int) -> float:
    """The smallest bucket mass a sum of ``k`` FP32-rounded probabilities resolves."""
    return float(k) * 2.0 ** -24


def topk_of(lp: npt.ArrayLike, k: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """The ``k`` largest entries of each row of ``lp [..., V]`` and their ids.

    Ordered by logprob, largest first, equal logprobs by the smaller id (the full path's
    stable order); ``-inf`` entries last.

    Returns:
        ``(logprobs [..., k] float32, ids [..., k] int64)``.

    Raises:
        ValueError: ``k`` not in ``[1, V]``.
    """
    a = np.asarray(lp, dtype=np.float32)
    if not 1 <= k <= a.shape[-1]:
        raise ValueError(f"k = {k} is not in [1, V = {a.shape[-1]}]")
    ids = np.argsort(-a, axis=-1, kind="stable")[..., :k].astype(np.int64)
    return np.take_along_axis(a, ids, axis=-1), ids


def _topk_positions(lp: npt.NDArray[np.float64], ids: npt.NDArray[np.int64]
                    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Each row of ``[N, k]`` sorted by (-logprob, id)."""
    order = np.lexsort((ids, -lp), axis=-1)
    return np.take_along_axis(lp, order, axis=-1), np.take_along_axis(ids, order, axis=-1)


def topk_metrics(cand: npt.ArrayLike, cand_ids: npt.ArrayLike, ref: npt.ArrayLike,
                 ref_ids: npt.ArrayLike, *, cand_token: npt.ArrayLike,
                 ref_token: npt.ArrayLike, mask: npt.ArrayLike,
                 clip_ratio: float, worst_sequences: int = 0, precision: str = "fp32",
                 top_logit: npt.ArrayLike | None = None,
                 temperature: float = 1.0) -> dict[str, Any]:
    """Every statistic of :data:`TOPK_STATISTICS` on the top-k path (module docstring).

    Args:
        cand: ``[B, R, k]`` the candidate's top-k logprobs ``log q`` (normalised over the
            whole vocabulary; any order).
        cand_ids: ``[B, R, k]`` their token ids.
        ref: ``[B, R, k]`` the reference's top-k logprobs ``log p``.
        ref_ids: ``[B, R, k]`` their token ids.
        cand_token: ``[B, R]`` the candidate's logprob of the response token.
        ref_token: ``[B, R]`` the reference's logprob of the response token.
        mask: ``[B, R]`` response mask (non-zero = valid).
        clip_ratio: PPO ``ε`` (> 0).
        worst_sequences: as in :func:`distribution_metrics` (the lumped KLs, the exact top-1
            states and top-:data:`TOPK` agreement).
        precision: as in :func:`distribution_metrics`.
        top_logit: as in :func:`distribution_metrics`, ``[B, R]``.
        temperature: as in :func:`distribution_metrics`.

    Returns:
        ``{statistic: float}`` for :data:`TOPK_STATISTICS`, plus ``k``, ``n_valid``,
        ``top1_ties``, ``worst`` (``"(b, t)"`` of the largest lumped ``KL(p || q)``),
        ``seq_max_kl`` (per-sequence maxima, a list), ``sequences`` when asked,
        ``missing_ref_max``, ``missing_ref_mean``, ``missing_cand_max``,
        ``missing_cand_mean``.

    Raises:
        ValueError: shapes differ or are not ``[B, R, k]`` / ``[B, R]`` (``top_logit``
            included), ``k < TOPK``, a position repeats a token id, no valid position,
            ``clip_ratio <= 0``, or a bad ``precision`` / ``temperature``.
    """
    c = np.asarray(cand, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    ci = np.asarray(cand_ids).astype(np.int64)
    ri = np.asarray(ref_ids).astype(np.int64)
    ct = np.asarray(cand_token, dtype=np.float64)
    rt = np.asarray(ref_token, dtype=np.float64)
    m = np.asarray(mask) != 0
    if c.ndim != 3 or not (c.shape == r.shape == ci.shape == ri.shape) or \
            not (ct.shape == rt.shape == m.shape == c.shape[:2]):
        raise ValueError(f"shapes: cand {c.shape}, cand_ids {ci.shape}, ref {r.shape}, "
                         f"ref_ids {ri.shape}, cand_token {ct.shape}, ref_token {rt.shape}, "
                         f"mask {m.shape}; expected [B, R, k] four times and [B, R] three")
    k = c.shape[2]
    if k < TOPK:
        raise ValueError(f"k = {k} < {TOPK} (the top-{TOPK} set agreement needs {TOPK})")
    if not clip_ratio > 0:
        raise ValueError(f"clip_ratio must be > 0, got {clip_ratio!r}")
    if not m.any():
        raise ValueError("no valid response position")
    cv, cid = _topk_positions(c[m], ci[m])
    rv, rid = _topk_positions(r[m], ri[m])
    for name, ids in (("cand_ids", cid), ("ref_ids", rid)):
        s = np.sort(ids, axis=-1)
        if (s[:, 1:] == s[:, :-1]).any():
            raise ValueError(f"{name}: a position repeats a token id")
    eq = cid[:, :, None] == rid[:, None, :]          # [N, k (cand), k (ref)]
    in_ref = eq.any(axis=2)                           # candidate entry j is in I
    in_cand = eq.any(axis=1)                          # reference entry j is in I
    pc, pr = np.exp(cv), np.exp(rv)
    with np.errstate(invalid="ignore"):
        # log p at the candidate's entries that are in I (-inf elsewhere, unused)
        lp_at_c = np.where(in_ref, np.max(np.where(eq, rv[:, None, :], -np.inf), axis=2),
                           -np.inf)
    q_i = np.where(in_ref, pc, 0.0).sum(axis=-1)
    p_i = np.where(in_cand, pr, 0.0).sum(axis=-1)
    tau = tail_resolution(k)
    bp, bq = np.maximum(1.0 - p_i, 0.0), np.maximum(1.0 - q_i, 0.0)
    bp_raw, bq_raw = bp, bq
    # buckets that differ by no more than the normalisation's resolution are equal; a larger
    # difference is counted less that resolution (the lumped statistics stay lower bounds)
    rho = tau + NORM_RESOLUTION * np.maximum(p_i, q_i)
    gap = bq - bp
    bq = bp + np.sign(gap) * np.maximum(np.abs(gap) - rho, 0.0)
    drop = (bp <= tau) & (bq <= tau)
    bp = np.where(drop, 0.0, np.maximum(bp, tau))
    bq = np.where(drop, 0.0, np.maximum(bq, tau))
    log_zp, log_zq = np.log(p_i + bp), np.log(q_i + bq)   # renormalise the lumped vectors
    with np.errstate(divide="ignore"):
        lbp, lbq = np.log(bp) - log_zp, np.log(bq) - log_zq
    lq = np.where(in_ref, cv, -np.inf) - log_zq[:, None]
    lpp = lp_at_c - log_zp[:, None]
    # KL over the |I| shared tokens (indexed by the candidate's entries) plus the bucket
    kl_rc = _kl(np.concatenate([lpp, lbp[:, None]], axis=1),
                np.concatenate([lq, lbq[:, None]], axis=1))
    kl_cr = _kl(np.concatenate([lq, lbq[:, None]], axis=1),
                np.concatenate([lpp, lbp[:, None]], axis=1))
    shared = np.where(in_ref, np.abs(np.exp(lpp) - np.exp(lq)), 0.0).sum(axis=-1)
    bpn, bqn = np.exp(lbp), np.exp(lbq)
    tv = 0.5 * (shared + np.abs(bpn - bqn))
    tv_up = 0.5 * (shared + np.where(drop, 0.0, np.exp(np.log(bp_raw + rho) - log_zp)
                                     + np.exp(np.log(bq_raw + rho) - log_zq)))
    differ = cid[:, 0] != rid[:, 0]
    tie = differ & ((cv[:, 0] - cv[:, 1]) <= tie_resolution(
        cv[:, 0], precision=precision, top_logit=_at_valid(top_logit, m),
        temperature=temperature))
    small = (cid[:, :TOPK, None] == rid[:, None, :TOPK]).any(axis=2).sum(axis=1)
    stats, meta = _summary(kl_rc=kl_rc, kl_cr=kl_cr, tv=tv, differ=differ, tie=tie,
                           agree=small / TOPK, cand_token=ct[m], ref_token=rt[m], mask=m,
                           clip_ratio=clip_ratio, worst_sequences=worst_sequences)
    miss_r = np.maximum(1.0 - pr.sum(axis=-1), 0.0)
    miss_c = np.maximum(1.0 - pc.sum(axis=-1), 0.0)
    return {**stats,
            "tv_upper_max": float(np.max(tv_up)), "tv_upper_mean": float(np.mean(tv_up)),
            "topk_set_disagreement_mean": float(np.mean(1.0 - in_ref.sum(axis=1) / k)),
            "k": int(k), **meta,
            "missing_ref_max": float(miss_r.max()), "missing_ref_mean": float(miss_r.mean()),
            "missing_cand_max": float(miss_c.max()), "missing_cand_mean": float(miss_c.mean())}
