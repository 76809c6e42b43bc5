"""Error statistics per metric family: how far an obtained tensor is from an expected one.

The same statistic is used to measure control errors (reference stage) and candidate
errors (comparator), so a bound and the error it bounds are always the same quantity
(docs/bound-rule.md). All arithmetic is FP64 numpy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

Statistic = Literal["max_abs", "abs", "max_rel_l2"]

FAMILY_STATISTIC: Final[Mapping[str, Statistic]] = {
    "logprobs": "max_abs",
    "entropy": "max_abs",
    "values": "max_abs",
    "rewards": "max_abs",
    "losses": "max_abs",
    "grad_norm": "abs",
    "clip_coef": "abs",
    "grads": "max_rel_l2",
    "exp_avg": "max_rel_l2",
    "exp_avg_sq": "max_rel_l2",
    "updates": "max_rel_l2",
}
"""Declared statistic of each metric family.

- ``max_abs``: max |a - b| over valid tokens (per-token families, mask applied) or over
  the elements (losses: over the loss terms).
- ``abs``: |a - b| of a scalar.
- ``max_rel_l2``: max over parameters of ``||a_p - b_p||_2 / ||b_p||_2`` (absolute
  ``||a_p - b_p||_2`` where ``||b_p||_2 = 0``).
"""

Array = npt.NDArray[np.float64]

CHUNK_ELEMENTS: Final = 1 << 16
"""Elements per chunk when a tensor read from disk is measured in pieces (512 KiB of FP64
per operand)."""


def family_of(metric: str) -> str:
    """Map a protocol metric name to its bound family.

    ``loss/policy`` -> ``losses``; ``logprobs_padded`` -> ``logprobs``; others unchanged.
    """
    if metric.startswith("loss/"):
        return "losses"
    if metric.endswith("_padded"):
        return metric[: -len("_padded")]
    return metric


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ErrorMeasure:
    """One measured error and where it is worst.

    Attributes:
        value: the statistic (>= 0; ``inf`` if shapes differ or values are non-finite).
        where: the worst element: token index ``(b, t)``, parameter name, or loss term.
        mismatched: elements whose |a - b| > 0 (or parameters with non-zero error).
        total: elements (or parameters) compared.
        max_abs: largest absolute element difference.
        max_rel: largest relative element difference ``|a-b| / |b|`` (``|b| > 0``).
    """

    value: float
    where: str
    mismatched: int
    total: int
    max_abs: float
    max_rel: float


def _f64(x: npt.ArrayLike) -> Array:
    return np.asarray(x, dtype=np.float64)


def masked_max_abs(obtained: npt.ArrayLike, expected: npt.ArrayLike,
                   mask: npt.ArrayLike | None = None) -> ErrorMeasure:
    """Max |obtained - expected| over the elements where ``mask`` is non-zero.

    Args:
        obtained: ``[B, R]`` (or any shape) values of the candidate.
        expected: same shape, the expected values.
        mask: same shape, 1 on elements that count; ``None`` counts all.

    Returns:
        The :class:`ErrorMeasure`; ``value = inf`` if shapes differ or a counted element
        is non-finite.
    """
    a, b = _f64(obtained), _f64(expected)
    if a.shape != b.shape:
        return ErrorMeasure(value=float("inf"), where=f"shape {a.shape} != {b.shape}",
                            mismatched=max(a.size, b.size), total=max(a.size, b.size),
                            max_abs=float("inf"), max_rel=float("inf"))
    m = np.ones(a.shape, dtype=bool) if mask is None else _f64(mask).astype(bool)
    if m.shape != a.shape:
        raise ValueError(f"mask shape {m.shape} != tensor shape {a.shape}")
    total = int(m.sum())
    if total == 0:
        return ErrorMeasure(value=0.0, where="(no valid element)", mismatched=0, total=0,
                            max_abs=0.0, max_rel=0.0)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite elements: checked below
        diff = np.where(m, np.abs(a - b), 0.0)
    finite = np.isfinite(a) & np.isfinite(b)
    if not np.all(finite[m]):
        idx = np.argwhere(m & ~finite)[0]
        return ErrorMeasure(value=float("inf"), where=f"non-finite at {tuple(int(i) for i in idx)}",
                            mismatched=int((m & ~finite).sum()), total=total,
                            max_abs=float("inf"), max_rel=float("inf"))
    flat = int(np.argmax(diff))
    idx = np.unravel_index(flat, diff.shape)
    denom = np.abs(b)
    rel = np.where(m & (denom > 0), diff / np.where(denom > 0, denom, 1.0), 0.0)
    return ErrorMeasure(
        value=float(diff[idx]),
        where=str(tuple(int(i) for i in idx)) if diff.ndim else "()",
        mismatched=int(((diff > 0) & m).sum()),
        total=total,
        max_abs=float(diff[idx]),
        max_rel=float(rel.max()),
    )


def masked_max_margin(obtained: npt.ArrayLike, expected: npt.ArrayLike,
                      mask: npt.ArrayLike | None, bounds: npt.ArrayLike,
                      ) -> tuple[ErrorMeasure, float]:
    """The valid element of largest margin ``|obtained - expected| / bounds`` and its bound.

    The ``max_abs`` statistic judged against a bound per element (a per-token family with
    round-to-round responses, :meth:`qualify.bounds.Bound.token_bounds`).

    Args:
        obtained: ``[B, R]`` values of the candidate.
        expected: same shape, the expected values.
        mask: same shape, 1 on elements that count; ``None`` counts all.
        bounds: same shape, FP64, each element's bound (>= 0).

    Returns:
        ``(measure, bound)``: :func:`masked_max_abs`'s measure with ``value`` and ``where``
        those of the element of largest margin (the first in row-major order among equal
        margins; margin ``inf`` where the bound is 0 and the difference is not, 0 where
        both are), ``bound`` that element's bound; where every margin is 0 or no element
        is valid, the element :func:`masked_max_abs` names. A measure that is ``inf``
        (shapes differ, a non-finite element) is returned as it is, with the bound of the
        element it names (the largest bound if it names none).

    Raises:
        ValueError: ``bounds`` does not have the shape of ``expected``.
    """
    m = masked_max_abs(obtained, expected, mask)
    a, b, bt = _f64(obtained), _f64(expected), _f64(bounds)
    if bt.shape != b.shape:
        raise ValueError(f"per-element bounds of shape {bt.shape} for a tensor of shape "
                         f"{b.shape}")
    if not math.isfinite(m.value) or m.total == 0:
        idx = _index(m.where)
        at = float(bt[idx]) if idx is not None and len(idx) == bt.ndim and \
            all(0 <= i < n for i, n in zip(idx, bt.shape, strict=True)) else float(bt.max())
        return m, at
    valid = _f64(mask).astype(bool) if mask is not None else np.ones(b.shape, dtype=bool)
    diff = np.where(valid, np.abs(a - b), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        margin = np.where(bt > 0, diff / np.where(bt > 0, bt, 1.0),
                          np.where(diff > 0, np.inf, 0.0))
    margin = np.where(valid, margin, 0.0)
    if not np.any(margin > 0):
        idx = _index(m.where)
        assert idx is not None
        return m, float(bt[idx])
    where = np.unravel_index(int(np.argmax(margin)), margin.shape)
    return dataclasses.replace(m, value=float(diff[where]),
                               where=str(tuple(int(i) for i in where))), float(bt[where])


def _index(where: str) -> tuple[int, ...] | None:
    """``(b, t)`` of a measure's ``where`` (``"(1, 2)"``, ``"non-finite at (1, 2)"``)."""
    text = where.removeprefix("non-finite at ").strip()
    if not (text.startswith("(") and text.endswith(")")):
        return None
    try:
        return tuple(int(x) for x in text[1:-1].split(",") if x.strip())
    except ValueError:
        return None


def scalar_abs(obtained: float, expected: float) -> ErrorMeasure:
    """|obtained - expected| of two scalars (``inf`` if either is non-finite)."""
    a, b = float(obtained), float(expected)
    if not (np.isfinite(a) and np.isfinite(b)):
        return ErrorMeasure(value=float("inf"), where="non-finite", mismatched=1, total=1,
                            max_abs=float("inf"), max_rel=float("inf"))
    d = abs(a - b)
    return ErrorMeasure(value=d, where="()", mismatched=int(d > 0), total=1, max_abs=d,
                        max_rel=d / abs(b) if b else (0.0 if d == 0 else float("inf")))


def max_rel_l2(obtained: Mapping[str, npt.ArrayLike],
               expected: Mapping[str, npt.ArrayLike],
               scale: Mapping[str, npt.ArrayLike] | None = None) -> ErrorMeasure:
    """Max over parameters of the relative L2 error ``||a_p - b_p|| / ||b_p||``.

    Args:
        obtained: parameter name -> tensor (any shape) of the candidate.
        expected: parameter name -> tensor, the expected values.
        scale: for an expected run moved to other clip branches
            (:func:`qualify.branches.adjusted_expected`), the unmoved tensors: the
            denominator is then ``max(||b_p||, ||scale_p||)``. The move shifts the expected
            value by a known amount; it does not shrink the rounding noise the bound was
            calibrated on, which scales with the unmoved magnitudes.

    Returns:
        The :class:`ErrorMeasure` naming the worst parameter. A parameter missing on
        either side, or with another shape, gives ``inf``.
    """
    missing = sorted(set(expected) ^ set(obtained))
    if missing:
        return ErrorMeasure(value=float("inf"), where=f"parameter sets differ: {missing[:5]}",
                            mismatched=len(missing), total=len(set(expected) | set(obtained)),
                            max_abs=float("inf"), max_rel=float("inf"))
    worst, worst_name, mism, max_abs, max_rel = 0.0, "", 0, 0.0, 0.0
    for name in sorted(expected):
        sa, sb = shape_of(obtained[name]), shape_of(expected[name])
        if sa != sb:
            return ErrorMeasure(value=float("inf"), where=f"{name}: shape {sa} != {sb}",
                                mismatched=1, total=len(expected), max_abs=float("inf"),
                                max_rel=float("inf"))
        p = _param_error(obtained[name], expected[name],
                         None if scale is None else scale.get(name))
        if p is None:
            return ErrorMeasure(value=float("inf"), where=f"{name}: non-finite",
                                mismatched=1, total=len(expected), max_abs=float("inf"),
                                max_rel=float("inf"))
        err, p_abs, p_rel = p
        if err > 0:
            mism += 1
        max_abs, max_rel = max(max_abs, p_abs), max(max_rel, p_rel)
        if err > worst or not worst_name:
            worst, worst_name = err, name
    return ErrorMeasure(value=worst, where=worst_name, mismatched=mism, total=len(expected),
                        max_abs=max_abs, max_rel=max_rel)


def shape_of(x: Any) -> tuple[int, ...]:
    """The shape of an array, or of a tensor read in chunks (anything with ``read_flat``)."""
    return tuple(x.shape) if hasattr(x, "read_flat") else np.shape(x)


def flat_chunks(x: Any, chunk: int = CHUNK_ELEMENTS) -> Iterator[Array]:
    """Row-major flat FP64 chunks of ``chunk`` elements of ``x`` (one empty chunk if empty).

    ``x`` is array-like, or a tensor read in chunks: an object with ``size`` and
    ``read_flat(start, stop)`` (:class:`qualify.evidence.tensor_stream.LazyTensor`, the
    power check's null alternatives), so only one chunk of it is in memory at a time.
    """
    read = getattr(x, "read_flat", None)
    if read is not None:
        for s in range(0, max(int(x.size), 1), chunk):
            yield _f64(read(s, s + chunk))
        return
    flat = np.asarray(x).reshape(-1)
    for s in range(0, max(flat.size, 1), chunk):
        yield _f64(flat[s:s + chunk])


def l2_norm(x: Any) -> float:
    """``||x||_2`` in FP64: ``np.linalg.norm`` of an array in memory, bit for bit as ever.

    A tensor read from disk (``read_flat``) is streamed in :data:`CHUNK_ELEMENTS` chunks,
    ``sqrt(sum(sum(c * c)))``.
    """
    if not hasattr(x, "read_flat"):
        return float(np.linalg.norm(_f64(x)))
    return float(np.sqrt(sum(_sumsq(c) for c in flat_chunks(x))))


def _sumsq(c: Array) -> float:
    """``sum(c * c)`` of one FP64 chunk (``einsum``: no BLAS threads, no temporary)."""
    return float(np.einsum("i,i->", c, c))


def _param_error(a_in: Any, b_in: Any, s_in: Any | None) -> tuple[float, float, float] | None:
    """``(relative L2 error, max abs diff, max rel diff)`` of one parameter; None: non-finite.

    Two arrays in memory are measured whole (the same bits as ever); when either side is
    read from disk (``read_flat``: a large tensor, :mod:`qualify.evidence.tensor_stream`),
    one chunk of each side at a time: the squared norms are summed over chunks (their last
    bits may differ from one dot product), the maxima are exact.
    """
    if not (hasattr(a_in, "read_flat") or hasattr(b_in, "read_flat")):
        a, b = _f64(a_in), _f64(b_in)
        if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
            return None
        d = a - b
        nd, nb = float(np.linalg.norm(d)), float(np.linalg.norm(b))
        p_abs = p_rel = 0.0
        if d.size:
            p_abs = float(np.max(np.abs(d)))
            nz = np.abs(b) > 0
            if np.any(nz):
                p_rel = float(np.max(np.abs(d[nz]) / np.abs(b[nz])))
    else:
        ssd = ssb = 0.0
        p_abs = p_rel = 0.0
        for ca, cb in zip(flat_chunks(a_in), flat_chunks(b_in), strict=True):
            d = ca - cb
            sd, sb = _sumsq(d), _sumsq(cb)
            # a non-finite element makes a sum non-finite; only then are the elements checked
            if not (math.isfinite(sd) and math.isfinite(sb)) and not (
                    np.all(np.isfinite(ca)) and np.all(np.isfinite(cb))):
                return None
            ssd += sd
            ssb += sb
            if d.size:
                ad, ab = np.abs(d, out=d), np.abs(cb)
                p_abs = max(p_abs, float(ad.max()))
                rel = np.divide(ad, ab, out=np.zeros_like(ad), where=ab > 0)
                p_rel = max(p_rel, float(rel.max()))
        nd, nb = float(np.sqrt(ssd)), float(np.sqrt(ssb))
    if s_in is not None:
        nb = max(nb, l2_norm(s_in))
    return (nd / nb if nb > 0 else nd), p_abs, p_rel


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MetricKey:
    """Identifies one bounded quantity: round, role, metric family.

    ``role`` is ``actor``, ``critic`` or ``reward``; ``family`` is a key of
    :data:`FAMILY_STATISTIC`; ``variant`` is ``""`` or ``"padded"`` (the padding rerun).
    """

    round: int
    role: str
    family: str
    variant: str = ""

    @property
    def label(self) -> str:
        """``round1/actor/logprobs`` (``.../logprobs[padded]`` for the variant)."""
        v = f"[{self.variant}]" if self.variant else ""
        return f"round{self.round}/{self.role}/{self.family}{v}"


def group_tensors(tensors: Mapping[str, npt.ArrayLike]) -> dict[MetricKey, dict[str, Any]]:
    """Group protocol-named tensors by :class:`MetricKey`.

    Returns:
        ``{key: {member: array}}`` where member is the parameter name (per-parameter
        families), the loss term (``losses``), or ``""`` (per-token and scalar families).
        Names that are not protocol names are ignored.
    """
    from qualify.protocol import parse_tensor_name

    out: dict[MetricKey, dict[str, Any]] = {}
    for name, arr in tensors.items():
        try:
            r, role, metric, param = parse_tensor_name(name)
        except ValueError:
            continue
        variant = "padded" if metric.endswith("_padded") else ""
        family = family_of(metric)
        if family not in FAMILY_STATISTIC:
            continue
        key = MetricKey(round=r, role=role, family=family, variant=variant)
        member = param if param is not None else (metric[5:] if family == "losses" else "")
        out.setdefault(key, {})[member] = arr
    return out


def measure(key: MetricKey, obtained: Mapping[str, Any], expected: Mapping[str, Any],
            response_mask: npt.ArrayLike | None,
            scale: Mapping[str, Any] | None = None) -> ErrorMeasure:
    """Apply the family's declared statistic to one metric group.

    Args:
        key: the metric.
        obtained: ``{member: array}`` of the candidate (or control).
        expected: ``{member: array}`` of the reference.
        response_mask: ``[B, R]`` mask for per-token families (``None`` = all count).
        scale: ``{member: array}`` denominators for ``max_rel_l2`` (see :func:`max_rel_l2`).

    Returns:
        The :class:`ErrorMeasure`; ``inf`` when members are missing on either side, a
        member of a scalar family or a loss term is not one number, or a per-token tensor
        of matching shapes does not fit ``response_mask``.
    """
    stat = FAMILY_STATISTIC[key.family]
    if stat == "max_rel_l2":
        return max_rel_l2(obtained, expected, scale)
    if set(obtained) != set(expected):
        diff = sorted(set(obtained) ^ set(expected))
        return ErrorMeasure(value=float("inf"), where=f"members differ: {diff}", mismatched=1,
                            total=max(len(obtained), len(expected)), max_abs=float("inf"),
                            max_rel=float("inf"))
    if key.family == "losses" or stat == "abs":
        return _measure_scalars(key, obtained, expected)
    a, b = np.asarray(obtained[""]), np.asarray(expected[""])
    mask = None
    if response_mask is not None and a.ndim == 2:
        mask = np.asarray(response_mask)
        if mask.shape != b.shape:
            mask = None if b.ndim != 2 else mask[:, : b.shape[1]]
        if mask is not None and mask.shape != b.shape and a.shape == b.shape:
            return _inf(f"shape {b.shape} does not fit the response mask "
                        f"{np.shape(response_mask)}", total=int(b.size))
    return masked_max_abs(a, b, mask)


def _measure_scalars(key: MetricKey, obtained: Mapping[str, Any],
                     expected: Mapping[str, Any]) -> ErrorMeasure:
    """``abs`` of a scalar family, or ``max_abs`` over the loss terms (same member names).

    A member that is not one number (any rank, one element) gives ``inf``.
    """
    names = sorted(expected)
    for t in names:
        for side in (obtained, expected):
            shape = shape_of(side[t])
            if math.prod(shape) != 1:
                return _inf(f"{t or key.label}: shape {shape} is not a scalar",
                            total=len(names))
    if FAMILY_STATISTIC[key.family] == "abs":
        return scalar_abs(_scalar(obtained[""]), _scalar(expected[""]))
    m = masked_max_abs([_scalar(obtained[t]) for t in names],
                       [_scalar(expected[t]) for t in names])
    where = names[int(m.where.strip("(),") or 0)] if m.total and np.isfinite(m.value) \
        else m.where
    return dataclasses.replace(m, where=where)


def _scalar(x: Any) -> float:
    """A one-element tensor (any rank) as a float."""
    return float(np.asarray(x, dtype=np.float64).reshape(-1)[0])


def _inf(where: str, *, total: int) -> ErrorMeasure:
    """The measure of a comparison that cannot be made (``inf``, naming why in ``where``)."""
    return ErrorMeasure(value=float("inf"), where=where, mismatched=max(total, 1),
                        total=max(total, 1), max_abs=float("inf"), max_rel=float("inf"))


def compare_sets(obtained: Mapping[str, npt.ArrayLike], expected: Mapping[str, npt.ArrayLike],
                 response_mask: npt.ArrayLike | None,
                 scale: Mapping[str, npt.ArrayLike] | None = None,
                 ) -> dict[MetricKey, ErrorMeasure]:
    """Measure every metric present in ``expected`` (missing in ``obtained`` -> ``inf``).

    Args:
        obtained: protocol-named tensors of a candidate or control.
        expected: protocol-named tensors of the reference.
        response_mask: ``[B, R]`` valid-token mask of the rollout.
        scale: protocol-named unmoved tensors when ``expected`` was moved to other clip
            branches (see :func:`max_rel_l2`).
    """
    got, want = group_tensors(obtained), group_tensors(expected)
    scales = group_tensors(scale) if scale is not None else {}
    return {key: measure(key, got.get(key, {}), members, response_mask, scales.get(key))
            for key, members in sorted(want.items(), key=lambda kv: kv[0].label)}
