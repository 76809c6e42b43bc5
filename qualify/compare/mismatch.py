"""Field mismatch metrics: training-engine logprobs against the sampler's behavior logprobs.

These numbers are **informational, never gated**: they describe the train/inference
mismatch an RL run sees in the field (the quantity RL frameworks log on every step), not
whether a candidate computes the same numbers as the HF reference (that is
:mod:`qualify.compare.stage`, under sealed bounds). All arithmetic is FP64 numpy.

For response token ``t`` of sequence ``b`` let ``lp_train[b, t]`` be the teacher-forced
logprob of the sampled token (``round1/{role}/logprobs``, protocol convention:
``log_softmax(logits / temperature)``) and ``lp_gen[b, t]`` the sampler's behavior logprob
(``behavior_logprobs`` of the rollout). With ``d = lp_train - lp_gen`` over the ``n``
valid tokens (``response_mask == 1``):

- ``mean_abs``, ``max_abs``, ``p99_abs``: mean, max and 99th percentile (numpy's linear
  interpolation) of ``|d|``; ``mean_signed``: mean of ``d`` (a systematic offset shows here).
- ``token_mult_prob_error`` = ``(1/n) Σ exp(|d|)`` — the **mean of the per-token**
  multiplicative probability error (1.0 when identical), **not** ``exp(mean |d|)``.
  Source: NeMo-RL, ``NVIDIA-NeMo/RL`` ``nemo_rl/algorithms/loss_functions.py``
  (``ClippedPGLossFn.__call__``: ``masked_mean(torch.exp(lp_error * mask), mask)`` with
  ``lp_error = |generation_logprobs - prev_logprobs|``) and ``docs/guides/grpo.md``,
  section "Multiplicative Token Probability Error".
- ``k3_kl`` = ``(1/n) Σ (exp(d) - d - 1)``: Schulman's k3 estimator (2020, "Approximating
  KL divergence") of ``KL(π_gen || π_train)`` from tokens sampled by the generator, i.e.
  NeMo-RL's ``gen_kl_error`` with ``kl_type = k3`` (same file; ``log_ratio =
  prev_logprobs - generation_logprobs``).
- ``prob_pearson``: Pearson correlation of the token probabilities ``exp(lp_train)`` and
  ``exp(lp_gen)`` (``None`` when fewer than two tokens or a constant side).
- The **clip-band tail** (:func:`clip_band_tail`, the ``clip_band`` section of
  ``report.json``): with the importance ratio ``r = exp(d) = π_train / π_gen`` per valid
  token and the contract's PPO ``clip_ratio`` ``ε``, the fraction of tokens with
  ``r < 1 - ε`` (``below``) or ``r > 1 + ε`` (``above``): the tokens PPO's clipped objective
  would already clip at the first update only because the trainer and the sampler disagree
  (the tail metric of huggingface/trl #6789, for a stack that takes the sampler's logprobs
  as the old policy).

Comparability: with ``logprobs_mode = "processed"`` the behavior logprobs are of the
sampling distribution *after* top-k / top-p truncation and renormalisation, so on a token
whose kept mass is ``Z < 1`` they exceed the untruncated teacher-forced logprob by
``-log Z``: ``d <= 0`` systematically, and the numbers above include that offset. With
``logprobs_mode = "raw"`` they are ``log_softmax`` of the unscaled logits, which differ from
the temperature-scaled training logprobs unless ``temperature == 1``.
:func:`comparability_note` states which case applies; reports print it next to the table.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["FieldMismatch", "clip_band_tail", "comparability_note", "field_mismatch",
           "is_like_for_like"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FieldMismatch:
    """Mismatch of one source's round-1 logprobs against the behavior logprobs.

    Attributes:
        source: what was compared with the sampler: ``hf-fp32`` / ``hf-bf16`` (the HF
            reference's own scores, the "rollout" rows) or a candidate cell id.
        precision: ``fp32`` or ``bf16``.
        logprobs_mode: ``processed`` or ``raw`` (from ``rollout.json``).
        like_for_like: whether ``lp_train`` and ``lp_gen`` are of the same distribution
            (see :func:`is_like_for_like`); when false the numbers include that offset.
        n_valid: valid tokens (``response_mask == 1``).
        n_nonfinite: valid tokens where either side is not finite (left out of the stats).
        mean_abs: mean ``|d|`` (nats), ``None`` without finite valid tokens.
        max_abs: max ``|d|`` (nats).
        p99_abs: 99th percentile of ``|d|`` (nats).
        mean_signed: mean ``d = lp_train - lp_gen`` (nats).
        worst: token index ``(b, t)`` of ``max_abs``.
        token_mult_prob_error: ``mean exp(|d|)`` (NeMo-RL's definition; 1.0 = identical).
        k3_kl: ``mean (exp(d) - d - 1)``, k3 estimate of ``KL(π_gen || π_train)`` (nats).
        prob_pearson: Pearson correlation of ``exp(lp_train)`` and ``exp(lp_gen)``.
    """

    source: str
    precision: str
    logprobs_mode: str
    like_for_like: bool
    n_valid: int
    n_nonfinite: int
    mean_abs: float | None
    max_abs: float | None
    p99_abs: float | None
    mean_signed: float | None
    worst: str
    token_mult_prob_error: float | None
    k3_kl: float | None
    prob_pearson: float | None

    def to_dict(self) -> dict[str, Any]:
        """JSON form (one row of ``field_metrics`` in ``report.json``)."""
        return dataclasses.asdict(self)


def is_like_for_like(logprobs_mode: str, *, temperature: float, top_k: int,
                     top_p: float) -> bool:
    """Whether behavior logprobs and teacher-forced logprobs are of the same distribution.

    Args:
        logprobs_mode: ``processed`` or ``raw``.
        temperature: sampling temperature (the training logprobs are scaled by it).
        top_k: sampling top-k (0 disables).
        top_p: sampling top-p (1 disables).

    Raises:
        ValueError: unknown ``logprobs_mode``.
    """
    if logprobs_mode == "processed":
        return top_k == 0 and top_p >= 1.0
    if logprobs_mode == "raw":
        return temperature == 1.0
    raise ValueError(f"logprobs_mode: expected 'processed' or 'raw', got {logprobs_mode!r}")


def comparability_note(logprobs_mode: str, *, temperature: float, top_k: int,
                       top_p: float) -> str:
    """One paragraph saying whether the field metrics compare like with like, and why not.

    Args:
        logprobs_mode: ``processed`` or ``raw``.
        temperature: sampling temperature.
        top_k: sampling top-k (0 disables).
        top_p: sampling top-p (1 disables).

    Raises:
        ValueError: unknown ``logprobs_mode``.
    """
    like = is_like_for_like(logprobs_mode, temperature=temperature, top_k=top_k, top_p=top_p)
    if logprobs_mode == "processed":
        if like:
            return ("logprobs_mode = processed without top-k/top-p truncation: behavior and "
                    "teacher-forced logprobs are of the same temperature-scaled distribution; "
                    "the field metrics compare like with like.")
        return (f"logprobs_mode = processed (top_k = {top_k}, top_p = {top_p}): the behavior "
                "logprobs include top-k/top-p truncation and renormalisation, the "
                "teacher-forced logprobs do not, so they are NOT like-for-like: each token's "
                "behavior logprob exceeds the untruncated one by -log(kept mass), and the raw "
                "differences reported here include that systematic offset (mean_signed <= 0).")
    if like:
        return ("logprobs_mode = raw at temperature 1: behavior and teacher-forced logprobs "
                "are of the same distribution; the field metrics compare like with like.")
    return (f"logprobs_mode = raw at temperature {temperature}: the behavior logprobs are "
            "log_softmax of the unscaled logits, the teacher-forced ones of logits / "
            "temperature, so they are NOT like-for-like; the raw differences reported here "
            "include the temperature effect.")


def _f64(x: npt.ArrayLike) -> npt.NDArray[np.float64]:
    return np.asarray(x, dtype=np.float64)


def field_mismatch(train_logprobs: npt.ArrayLike, behavior_logprobs: npt.ArrayLike,
                   response_mask: npt.ArrayLike, *, source: str, precision: str,
                   logprobs_mode: str, like_for_like: bool) -> FieldMismatch:
    """Compute the field mismatch metrics of one source (module docstring has the formulas).

    Args:
        train_logprobs: ``[B, R]`` teacher-forced logprobs (any float dtype).
        behavior_logprobs: ``[B, R]`` the sampler's logprobs of the same tokens.
        response_mask: ``[B, R]`` 1 on valid tokens; masked tokens are never read.
        source: label of the row (``hf-fp32``, a cell id).
        precision: the source's precision.
        logprobs_mode: ``processed`` or ``raw``.
        like_for_like: result of :func:`is_like_for_like` for the rollout.

    Returns:
        The :class:`FieldMismatch`; statistics are ``None`` without finite valid tokens.

    Raises:
        ValueError: the three arrays do not have the same 2-D shape.
    """
    a, g = _f64(train_logprobs), _f64(behavior_logprobs)
    m = np.asarray(response_mask).astype(bool)
    if a.ndim != 2 or a.shape != g.shape or a.shape != m.shape:
        raise ValueError(f"{source}: shapes differ or are not 2-D: train {a.shape}, "
                         f"behavior {g.shape}, mask {m.shape}")
    finite = np.isfinite(a) & np.isfinite(g)
    use = m & finite
    n_valid, n_bad = int(m.sum()), int((m & ~finite).sum())
    empty = FieldMismatch(source=source, precision=precision, logprobs_mode=logprobs_mode,
                          like_for_like=like_for_like, n_valid=n_valid, n_nonfinite=n_bad,
                          mean_abs=None, max_abs=None, p99_abs=None, mean_signed=None,
                          worst="(no finite valid token)", token_mult_prob_error=None,
                          k3_kl=None, prob_pearson=None)
    if not use.any():
        return empty
    d = a[use] - g[use]  # row-major order of the valid tokens
    ad = np.abs(d)
    worst_flat = int(np.argmax(ad))
    worst_idx = tuple(int(i) for i in np.argwhere(use)[worst_flat])
    # logprobs far off overflow exp to inf (a statistic of inf, never a warning)
    with np.errstate(over="ignore", invalid="ignore"):
        pa, pg = np.exp(a[use]), np.exp(g[use])
        pearson: float | None = None
        if pa.size >= 2:
            ca, cg = pa - pa.mean(), pg - pg.mean()
            den = math.sqrt(float(np.dot(ca, ca)) * float(np.dot(cg, cg)))
            if den > 0:
                pearson = float(np.dot(ca, cg)) / den
        return dataclasses.replace(
            empty,
            mean_abs=float(ad.mean()),
            max_abs=float(ad[worst_flat]),
            p99_abs=float(np.percentile(ad, 99.0)),
            mean_signed=float(d.mean()),
            worst=str(worst_idx),
            token_mult_prob_error=float(np.exp(ad).mean()),
            k3_kl=float(np.mean(np.expm1(d) - d)),
            prob_pearson=pearson,
        )


def clip_band_tail(train_logprobs: npt.ArrayLike, behavior_logprobs: npt.ArrayLike,
                   response_mask: npt.ArrayLike, *, source: str, precision: str,
                   clip_ratio: float) -> dict[str, Any]:
    """The fraction of valid tokens whose train/sampler ratio falls outside the PPO clip band.

    ``r = exp(lp_train - lp_gen)`` in FP64 per valid token (``response_mask == 1``, both
    sides finite); ``below``: ``r < 1 - clip_ratio``, ``above``: ``r > 1 + clip_ratio``
    (strict: a token on the edge is inside, as ``torch.clamp`` leaves it unclipped).

    Args:
        train_logprobs: ``[B, R]`` teacher-forced logprobs (any float dtype).
        behavior_logprobs: ``[B, R]`` the sampler's logprobs of the same tokens.
        response_mask: ``[B, R]`` 1 on valid tokens.
        source: label of the row (``hf-fp32``, a cell id).
        precision: the source's precision.
        clip_ratio: the contract's PPO clip epsilon ``ε`` (> 0).

    Returns:
        ``{source, precision, clip_low, clip_high, tokens, below, above, fraction_outside}``;
        ``tokens`` counts the finite valid tokens, ``fraction_outside`` is
        ``(below + above) / tokens`` (``None`` without tokens).

    Raises:
        ValueError: the arrays do not have the same 2-D shape, or ``clip_ratio <= 0``.
    """
    if not clip_ratio > 0:
        raise ValueError(f"{source}: clip_ratio must be > 0, got {clip_ratio!r}")
    a, g = _f64(train_logprobs), _f64(behavior_logprobs)
    m = np.asarray(response_mask).astype(bool)
    if a.ndim != 2 or a.shape != g.shape or a.shape != m.shape:
        raise ValueError(f"{source}: shapes differ or are not 2-D: train {a.shape}, "
                         f"behavior {g.shape}, mask {m.shape}")
    use = m & np.isfinite(a) & np.isfinite(g)
    r = np.exp(a[use] - g[use])
    low, high = 1.0 - clip_ratio, 1.0 + clip_ratio
    below, above, n = int((r < low).sum()), int((r > high).sum()), int(use.sum())
    return {"source": source, "precision": precision, "clip_low": low, "clip_high": high,
            "tokens": n, "below": below, "above": above,
            "fraction_outside": (below + above) / n if n else None}
