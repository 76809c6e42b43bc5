"""The power check of a comparison row: would its bound also accept a tensor that is wrong?

A bound that accepts the expected tensor's elements shuffled, its sign flipped, or all
zeros cannot tell a correct engine from a broken one: the row lacks power, whatever its
verdict. Megatron-LM's ``test_optimizer_grads_match.py`` makes the same check of its own
gradient comparison with a shuffled tensor. For each metric row with a sealed bound,
three null alternatives of the obtained tensor are built **from the expected one** and
measured with the row's own statistic (:func:`qualify.statistics.measure`, the same mask
and scale):

- ``permuted``: per member tensor, a seeded permutation of its valid elements (per-token
  families: the valid tokens of ``response_mask``; per-parameter families: every element;
  ``rewards`` ``[B]``: the sequences). A scalar (``grad_norm``, ``clip_coef``, the loss
  terms) has nothing to permute: ``None``;
- ``sign_flipped``: ``-expected``;
- ``zeros``: ``0 * expected``.

The row ``has_power`` iff the bound rejects every null alternative (:func:`qualify.bounds
.judge` returns ``FAIL`` for each). The verdict of the row is never changed. The seed of a
permutation is ``crc32`` of the metric label and member name, so the check is the same
bits on every machine and on every recomputation (``qualify verify`` step 9).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator, Mapping
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from qualify.bounds import judge
from qualify.evidence.tensor_stream import LazyTensor
from qualify.jsonio import json_number
from qualify.statistics import CHUNK_ELEMENTS, FAMILY_STATISTIC, MetricKey, measure, shape_of

__all__ = ["NULLS", "Power", "PowerCache", "null_alternatives", "null_errors", "power_from",
           "power_of"]

NULLS: Final = ("permuted", "sign_flipped", "zeros")
"""The null alternatives, in report order."""
PowerCache = dict[Any, tuple[dict[str, float | None], Any]]
"""Null errors by metric and expected-array identity, with the arrays they pin
(:func:`power_of`)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Power:
    """The errors of a row's null alternatives and whether its bound rejects them all.

    Attributes:
        permuted: the statistic of the permuted expected tensor (``None`` for a scalar).
        sign_flipped: the statistic of ``-expected``.
        zeros: the statistic of zeros.
        has_power: the bound rejects every null alternative that exists.
        accepted: the null alternatives the bound accepts (empty when it has power).
    """

    permuted: float | None
    sign_flipped: float
    zeros: float
    has_power: bool
    accepted: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``rows[i].power`` of ``report.json``; non-finite as strings)."""
        return {"permuted": json_number(self.permuted),
                "sign_flipped": json_number(self.sign_flipped),
                "zeros": json_number(self.zeros), "has_power": self.has_power,
                "accepted": list(self.accepted)}


def _seed(key: MetricKey, member: str) -> int:
    return zlib.crc32(f"{key.label}|{member}".encode())


def _valid(arr: npt.NDArray[Any], mask: npt.ArrayLike | None) -> npt.NDArray[np.bool_]:
    """The elements :func:`qualify.statistics.measure` counts for ``arr`` (as it crops)."""
    if mask is not None and arr.ndim == 2:
        m = np.asarray(mask)
        if m.shape != arr.shape and m.ndim == 2:
            m = m[:, : arr.shape[1]]
        if m.shape == arr.shape:
            return m.astype(bool)
    return np.ones(arr.shape, dtype=bool)


def _permuted(key: MetricKey, member: str, arr: npt.NDArray[Any],
              mask: npt.ArrayLike | None) -> npt.NDArray[Any]:
    """``arr`` with its valid elements permuted by the member's seed (others kept)."""
    out = np.array(arr, dtype=np.float64, copy=True)
    valid = _valid(out, mask) if FAMILY_STATISTIC[key.family] == "max_abs" \
        else np.ones(out.shape, dtype=bool)
    vals = out[valid]
    out[valid] = vals[np.random.default_rng(_seed(key, member)).permutation(vals.size)]
    return out


class _StreamedNull:
    """A null alternative of an expected tensor read in chunks, made one chunk at a time.

    For a member that lives on disk (:class:`~qualify.evidence.tensor_stream.LazyTensor`,
    a per-parameter family; :func:`qualify.statistics.max_rel_l2` streams it):
    ``sign_flipped`` and ``zeros`` are the same numbers as in memory. ``permuted`` is a
    seeded permutation made of blocks of :data:`~qualify.statistics.CHUNK_ELEMENTS`
    elements: the order of the whole blocks by the member's seed, the elements inside every
    whole block by one permutation seeded with ``[seed, 1]``, a last partial block permuted
    in place (``[seed, 2]``). One block of the source is read per block made; it is another
    permutation of the elements than the one a member held in memory gets.
    """

    __slots__ = ("_blocks", "_inner", "_seed", "_src", "_tail", "dtype", "kind", "shape",
                 "size")

    def __init__(self, src: Any, kind: str, seed: int) -> None:
        """The ``kind`` null alternative of ``src`` (permuted with ``seed``)."""
        self._src, self.kind, self._seed = src, kind, seed
        self.shape, self.size, self.dtype = tuple(src.shape), int(src.size), np.dtype(np.float64)
        full = self.size // CHUNK_ELEMENTS
        perm = kind == "permuted"
        self._blocks = np.random.default_rng(seed).permutation(full) if perm else None
        self._inner = np.random.default_rng([seed, 1]).permutation(CHUNK_ELEMENTS) \
            if perm else None
        self._tail = np.random.default_rng([seed, 2]).permutation(self.size % CHUNK_ELEMENTS) \
            if perm else None

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def _block(self, j: int) -> npt.NDArray[np.float64]:
        assert self._blocks is not None
        whole = j < self._blocks.size
        src = int(self._blocks[j]) if whole else j
        vals = np.asarray(self._src.read_flat(src * CHUNK_ELEMENTS, (src + 1) * CHUNK_ELEMENTS),
                          dtype=np.float64)
        return vals[self._inner if whole else self._tail]

    def read_flat(self, start: int, stop: int) -> npt.NDArray[np.float64]:
        """Elements ``[start, stop)`` of the flattened null alternative (FP64)."""
        start, stop = max(0, start), min(self.size, stop)
        if self.kind == "zeros":
            return np.zeros(max(0, stop - start))
        if self.kind == "sign_flipped":
            return -np.asarray(self._src.read_flat(start, stop), dtype=np.float64)
        parts = []
        for j in range(start // CHUNK_ELEMENTS, (stop - 1) // CHUNK_ELEMENTS + 1):
            lo = j * CHUNK_ELEMENTS
            parts.append(self._block(j)[max(start, lo) - lo: stop - lo])
        return np.concatenate(parts) if parts else np.zeros(0)

    def __array__(self, dtype: Any = None, copy: Any = None) -> npt.NDArray[Any]:
        """The whole null alternative in memory."""
        arr = self.read_flat(0, self.size).reshape(self.shape)
        return arr if dtype is None else arr.astype(dtype, copy=False)


def _streamed(key: MetricKey, v: Any) -> bool:
    """A member whose nulls are made in chunks: read from disk, in a ``max_rel_l2`` family."""
    return isinstance(v, LazyTensor) and FAMILY_STATISTIC[key.family] == "max_rel_l2"


def null_alternatives(key: MetricKey, expected: Mapping[str, Any],
                      mask: npt.ArrayLike | None) -> dict[str, Mapping[str, Any] | None]:
    """The null alternatives of one metric group, built from the expected tensors.

    Args:
        key: the metric.
        expected: ``{member: array}`` of the expected run (member = parameter name, loss
            term, or ``""``).
        mask: ``[B, R]`` response mask (per-token families).

    Returns:
        ``{"permuted": {member: array} | None, "sign_flipped": ..., "zeros": ...}``, all
        FP64; ``permuted`` is ``None`` when every member is a scalar (or the family is
        ``losses``, whose members are scalar terms). Each is a mapping that makes a
        member when it is read (:class:`_Nulls`); a member read from disk in chunks gets
        a :class:`_StreamedNull` (made one chunk at a time).
    """
    scalar = key.family == "losses" or all(shape_of(v) == () for v in expected.values())
    return {
        "permuted": None if scalar else _Nulls("permuted", key, expected, mask),
        "sign_flipped": _Nulls("sign_flipped", key, expected, mask),
        "zeros": _Nulls("zeros", key, expected, mask),
    }


class _Nulls(Mapping[str, Any]):
    """One null alternative of a metric group, each member made when it is read.

    The statistic reads one member at a time, so one member's FP64 copy and null live at
    once, not the whole group's (the same numbers as building them all first).
    """

    def __init__(self, kind: str, key: MetricKey, expected: Mapping[str, Any],
                 mask: npt.ArrayLike | None) -> None:
        """The ``kind`` alternative of ``expected`` (of metric ``key``, under ``mask``)."""
        self._kind, self._key, self._expected, self._mask = kind, key, expected, mask

    def __getitem__(self, m: str) -> Any:
        """The member's null alternative (FP64 array, or :class:`_StreamedNull`)."""
        v = self._expected[m]
        if _streamed(self._key, v):
            return _StreamedNull(v, self._kind, _seed(self._key, m))
        a = np.asarray(v, dtype=np.float64)
        if self._kind == "permuted":
            return _permuted(self._key, m, a, self._mask)
        return -a if self._kind == "sign_flipped" else np.zeros_like(a)

    def __iter__(self) -> Iterator[str]:
        """The members, as ``expected`` orders them."""
        return iter(self._expected)

    def __len__(self) -> int:
        """Number of members."""
        return len(self._expected)


def null_errors(key: MetricKey, expected: Mapping[str, Any], mask: npt.ArrayLike | None,
                scale: Mapping[str, Any] | None = None) -> dict[str, float | None]:
    """The row's statistic (:func:`qualify.statistics.measure`) of each null alternative.

    Args:
        key: the metric.
        expected: ``{member: array}`` the row compared against.
        mask: ``[B, R]`` response mask, as the row used it.
        scale: the row's ``max_rel_l2`` denominators (a clip-branch adjusted row), or
            ``None``.

    Returns:
        ``{null name: error}`` in :data:`NULLS` order (``None``: no such alternative).
    """
    return {name: None if null is None else measure(key, null, expected, mask, scale).value
            for name, null in null_alternatives(key, expected, mask).items()}


def power_from(errors: Mapping[str, float | None], bound: float) -> Power:
    """Judge the null errors of :func:`null_errors` by ``bound`` (:func:`qualify.bounds.judge`)."""
    accepted = tuple(n for n in NULLS
                     if (e := errors[n]) is not None and judge(e, bound)[0] == "PASS")
    flipped, zeros = errors["sign_flipped"], errors["zeros"]
    assert flipped is not None
    assert zeros is not None
    return Power(permuted=errors["permuted"], sign_flipped=flipped, zeros=zeros,
                 has_power=not accepted, accepted=accepted)


def power_of(key: MetricKey, expected: Mapping[str, Any], mask: npt.ArrayLike | None,
             bound: float, *, scale: Mapping[str, Any] | None = None,
             cache: PowerCache | None = None) -> Power:
    """Measure each null alternative with the row's statistic and judge it by ``bound``.

    Args:
        key: the metric.
        expected: ``{member: array}`` the row compared against.
        mask: ``[B, R]`` response mask, as the row used it.
        bound: the row's sealed bound (>= 0).
        scale: the row's ``max_rel_l2`` denominators, or ``None``.
        cache: null errors already measured in this comparison, keyed by the metric and
            the identity of the expected (and scale) arrays, which it keeps alive: every
            cell of one precision and role is compared with the same HF tensors, so their
            null errors are measured once. The same numbers as without it.

    Returns:
        The :class:`Power` of the row.
    """
    if cache is None:
        return power_from(null_errors(key, expected, mask, scale), bound)
    ident = (key, tuple(sorted((m, id(a)) for m, a in expected.items())),
             None if scale is None else tuple(sorted((m, id(a)) for m, a in scale.items())),
             id(mask))
    hit = cache.get(ident)
    if hit is None:
        hit = (null_errors(key, expected, mask, scale), (expected, scale, mask))
        cache[ident] = hit
    return power_from(hit[0], bound)
