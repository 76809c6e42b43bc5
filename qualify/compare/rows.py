"""Building a cell's rows: metric rows under the sealed bounds, and the exact checks.

- :func:`compare_rows`: every metric of an expected tensor set measured in an obtained one
  (:func:`qualify.statistics.compare_sets`) and judged against its sealed bound
  (:func:`qualify.bounds.lookup`, :func:`qualify.bounds.judge`); a metric without a bound
  is ``ERROR``, never ``PASS``; a failing row carries a pytest-approx-style
  :class:`~qualify.compare.verdicts.FailureDetail` (the worst valid elements, parameters
  or loss terms);
- :func:`padding_rows`: each ``*_padded`` tensor against the same cell's unpadded one under
  the family's ``tp_vs_tp1`` bound; a missing padding rerun of the role's main per-token
  family (:data:`PADDING_REQUIRED`) is a ``FAIL``;
- :func:`dtype_row`: master weights, gradients and optimizer state must be
  ``torch.float32``, and so must every gradient reduction and accumulation dtype the engine
  used (:data:`REDUCTION_KEYS`, :data:`PRECISION_REDUCTION_DTYPE`) (``outputs.json``
  ``dtypes``); :func:`replica_row`: replicated
  parameters bitwise equal across TP ranks (``replica_consistency``);
- :func:`lr_rows`: the lr each optimizer step applied (``outputs.json`` ``lr``) against the
  lr the reference sealed for that step (the contract's schedule, :mod:`qualify.schedule`),
  within one FP32 ulp of the sealed lr (:data:`LR_RULE`);
- :func:`not_run_rows`, :func:`declared_not_run`, :func:`declared_or`: ``NOT_RUN`` rows, for
  a comparison that could not run or a metric the harness declared not run;
  :func:`declared_terms`: loss terms a harness declared not reported (its ``losses`` row is
  measured over the terms it reported);
- :func:`guarded`: runs one builder on one cell's data; what it cannot build (it raised, or
  a non-``PASS`` row it built violates ``report.schema.json``) is one ``ERROR`` row naming
  the cell and the builder (:func:`builder_error`), never an exit 4 for the run.

Every ``FAIL`` row carries a :class:`~qualify.compare.verdicts.FailureDetail`; a sealed bound
that is not a finite number ``>= 0`` makes its row ``ERROR`` (it could not fail).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from qualify.bounds import Bound, judge, lookup
from qualify.compare.power import PowerCache, power_of
from qualify.compare.verdicts import Cell, FailureDetail, Row
from qualify.errors import QualifyError
from qualify.lanes import lane_precision
from qualify.layout import BOUNDS_FILE
from qualify.protocol import OUTPUTS_FILE, OUTPUTS_META_FILE
from qualify.schema import first_error
from qualify.statistics import (
    FAMILY_STATISTIC,
    ErrorMeasure,
    MetricKey,
    compare_sets,
    group_tensors,
    l2_norm,
    masked_max_margin,
    max_rel_l2,
    measure,
)

__all__ = [
    "DETAIL_ROWS",
    "FP32",
    "LR_RULE",
    "OPTIMIZER_STATE_KEYS",
    "PADDING_REQUIRED",
    "PRECISION_REDUCTION_DTYPE",
    "REDUCTION_KEYS",
    "builder_error",
    "compare_rows",
    "declared_not_run",
    "declared_or",
    "declared_terms",
    "dtype_row",
    "guarded",
    "lr_rows",
    "not_run_rows",
    "padding_rows",
    "replica_row",
    "row_problem",
]

FP32: Final = "torch.float32"
PADDING_REQUIRED: Final = {"actor": "logprobs", "critic": "values"}
"""Per role, the per-token family whose padding rerun (``*_padded``) must be present."""
OPTIMIZER_STATE_KEYS: Final = ("exp_avg", "exp_avg_sq")
REDUCTION_KEYS: Final = ("grad_reduction", "grad_accumulation")
"""``outputs.json`` ``dtypes`` maps (name -> dtype, each non-empty) of every dtype in which
the engine reduced gradients across ranks (``grad_reduction``: FSDP2's reduce-scatter,
DeepSpeed's communication data type, Megatron's grad buffers...) and accumulated them across
micro-batches (``grad_accumulation``), read back from the engine object at run time."""
PRECISION_REDUCTION_DTYPE: Final[Mapping[str, str]] = {"fp32": FP32, "bf16": FP32}
"""The dtype each contract precision requires of every :data:`REDUCTION_KEYS` entry:
``fp32`` is FP32 throughout; ``bf16`` is BF16 compute with FP32 master weights, FP32
gradients and FP32 optimizer state (docs/concepts.md), so gradients are reduced and
accumulated in FP32 too. A precision absent here fails the row (no policy to check)."""
DETAIL_ROWS: Final = 5
LR_RULE: Final = ("lr: |lr_obtained - lr_sealed| <= spacing_fp32(lr_sealed), one FP32 ulp of "
                  "the sealed lr (numpy.spacing(float32(lr))): a schedule is deterministic, the "
                  "engines compute it in FP64 Python floats (a few FP64 ulps apart by formula "
                  "order) and the FP32 optimizers cannot resolve an lr finer than that; any "
                  "step off by one, a missing warmup or end ratio is many ulps off")
"""The rule of the ``lr_schedule`` rows (:func:`lr_rows`)."""


# --------------------------------------------------------------------------- detail tables


def _mask_for(arr: npt.NDArray[Any], mask: npt.NDArray[Any] | None) -> npt.NDArray[np.bool_]:
    """The mask :func:`qualify.statistics.measure` applies to ``arr`` (all-true if none)."""
    if mask is not None and arr.ndim == 2:
        m = mask if mask.shape == arr.shape else mask[:, : arr.shape[1]]
        if m.shape == arr.shape:
            return np.asarray(m).astype(bool)
    return np.ones(arr.shape, dtype=bool)


def _elementwise_table(a_in: Any, b_in: Any,
                       mask: npt.NDArray[Any] | None) -> tuple[tuple[Cell, ...], ...]:
    """The worst valid elements: ``(index, obtained, expected, abs diff)``."""
    a, b = np.asarray(a_in, dtype=np.float64), np.asarray(b_in, dtype=np.float64)
    if a.shape != b.shape:
        return ((f"shape {a.shape} vs {b.shape}", None, None, math.inf),)
    m = _mask_for(b, mask)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - b)
    diff = np.where(np.isfinite(diff), diff, math.inf)
    idx = np.argwhere(m)
    if idx.size == 0 and a.ndim > 0:
        return ()
    if a.ndim == 0:
        return (("()", float(a), float(b), float(diff)),)
    vals = diff[m]
    order = [j for j in np.argsort(-vals, kind="stable") if vals[j] != 0][:DETAIL_ROWS]
    out: list[tuple[Cell, ...]] = []
    for j in order:
        ix = tuple(int(i) for i in idx[j])
        out.append((str(ix), float(a[ix]), float(b[ix]), float(diff[ix])))
    return tuple(out)


def _term_cell(x: Any) -> Cell:
    """A loss term for a detail table: its value, ``None`` if absent, its shape if no scalar."""
    if x is None:
        return None
    arr = np.asarray(x, dtype=np.float64)
    return float(arr.reshape(-1)[0]) if arr.size == 1 else f"shape {arr.shape}"


def _detail(key: MetricKey, m: ErrorMeasure, obtained: Mapping[str, Any],
            expected: Mapping[str, Any], mask: npt.NDArray[Any] | None) -> FailureDetail:
    """Build the failure detail of one measured metric group."""
    stat = FAMILY_STATISTIC[key.family]
    table: tuple[tuple[Cell, ...], ...]
    if stat == "max_rel_l2":
        columns: tuple[str, ...] = ("param", "rel L2", "norm obtained", "norm expected")
        rows: list[tuple[Cell, ...]] = []
        for name in sorted(set(obtained) | set(expected)):
            a, b = obtained.get(name), expected.get(name)
            na = l2_norm(a) if a is not None else None
            nb = l2_norm(b) if b is not None else None
            rel = max_rel_l2({name: a}, {name: b}).value if a is not None and b is not None \
                else math.inf
            rows.append((name, rel, na, nb))
        rows.sort(key=lambda r: -(r[1] if isinstance(r[1], float) else 0.0))
        table = tuple(r for r in rows if r[1] != 0)[:DETAIL_ROWS]
    elif key.family == "losses":
        columns = ("term", "obtained", "expected", "abs diff")
        rows = []
        for term in sorted(set(obtained) | set(expected)):
            fa, fb = _term_cell(obtained.get(term)), _term_cell(expected.get(term))
            d = abs(fa - fb) if isinstance(fa, float) and isinstance(fb, float) else math.inf
            rows.append((term, fa, fb, d if math.isfinite(d) else math.inf))
        rows.sort(key=lambda r: -(r[3] if isinstance(r[3], float) else 0.0))
        table = tuple(r for r in rows if r[3] != 0)[:DETAIL_ROWS]
    else:
        columns = ("index", "obtained", "expected", "abs diff")
        if "" in obtained and "" in expected:
            table = _elementwise_table(obtained[""], expected[""], mask)
        else:
            table = (("(missing)", None, None, math.inf),)
    return FailureDetail(mismatched=m.mismatched, total=m.total, max_abs=m.max_abs,
                         max_rel=m.max_rel, columns=columns, table=table)


# --------------------------------------------------------------------------- rows


def _metric_row(*, cell: str, klass: str, bound_class: str, key: MetricKey, m: ErrorMeasure,
                precision: str, bounds: Sequence[Bound], obtained: Mapping[str, Any],
                expected: Mapping[str, Any], mask: npt.NDArray[Any] | None,
                scale: Mapping[str, Any] | None = None,
                power_cache: PowerCache | None = None) -> Row:
    """Judge one measured metric against its sealed bound, with its power check.

    The power check (:func:`qualify.compare.power.power_of`) measures the row's null
    alternatives under the same bound; it never changes the verdict.
    """
    stat = FAMILY_STATISTIC[key.family]
    row = Row(cell=cell, klass=klass, bound_class=bound_class, round=key.round, role=key.role,
              family=key.family, variant=key.variant, statistic=stat, error=m.value,
              bound=None, margin=None, verdict="ERROR", reason=None, where=m.where)
    b = lookup(list(bounds), precision=precision, klass=bound_class, key=key)
    if b is None:
        return dataclasses.replace(
            row, reason=f"no sealed bound for {dataclasses.replace(key, variant='').label} "
                        f"(class {bound_class}, precision {precision}) in {BOUNDS_FILE}")
    if not math.isfinite(b.bound) or b.bound < 0:
        return dataclasses.replace(
            row, reason=f"sealed bound of {key.label} (class {bound_class}, precision "
                        f"{precision}) is {b.bound!r} in {BOUNDS_FILE}, not a finite number "
                        ">= 0: a bound that cannot fail is no check")
    if b.statistic != stat:
        return dataclasses.replace(
            row, bound=b.bound, reason=f"sealed bound of {key.label} uses statistic "
                                       f"{b.statistic!r}, the family declares {stat!r}")
    bound, note = b.bound, ""
    per_token = b.token_bounds() if key.variant == "" and b.widest > b.bound else None
    if per_token is not None and "" in obtained and "" in expected:
        try:
            m, bound, note = _per_token(m, b, per_token, obtained[""], expected[""],
                                        mask=mask)
        except ValueError as exc:
            return dataclasses.replace(row, bound=b.bound, reason=f"sealed per-token bounds "
                                       f"of {key.label} (precision {precision}): {exc}")
        row = dataclasses.replace(row, error=m.value, where=f"{m.where}{note}")
    verdict, margin = judge(m.value, bound)
    power = power_of(key, expected, mask, b.widest, scale=scale,
                                  cache=power_cache) if expected else None
    if verdict == "PASS":
        return dataclasses.replace(row, bound=bound, margin=margin, verdict="PASS",
                                   power=power)
    return dataclasses.replace(
        row, bound=bound, margin=margin, verdict="FAIL", power=power,
        reason=f"{key.label}: {stat} = {m.value:.6g} > bound {bound:.6g} "
               f"(margin {margin:.3g}) at {m.where}{note}",
        detail=_detail(key, m, obtained, expected, mask))


def _per_token(m: ErrorMeasure, b: Bound, bounds: npt.NDArray[np.float64], obtained: Any,
               expected: Any, *, mask: npt.NDArray[Any] | None,
               ) -> tuple[ErrorMeasure, float, str]:
    """A per-token row judged token by token (:meth:`qualify.bounds.Bound.token_bounds`).

    Returns:
        ``(measure, bound, note)``: the measure at the token of largest margin
        (:func:`qualify.statistics.masked_max_margin`), that token's bound, and the note its
        ``where`` carries (the row used a per-token bound; that token's response).

    Raises:
        ValueError: the per-token bounds do not have the expected tensor's shape.
    """
    want = np.asarray(expected)
    got, bound = masked_max_margin(obtained, want, _mask_for(want, mask), bounds)
    if not math.isfinite(m.value):
        got = m
    response = 0.0
    idx = tuple(int(x) for x in re.findall(r"-?[0-9]+", got.where))
    if b.tokens is not None and len(idx) == b.tokens.ndim and \
            all(0 <= i < n for i, n in zip(idx, b.tokens.shape, strict=True)):
        response = float(b.tokens[idx])
    return got, bound, (f" [per-token bound: round-to-round response {response:.6g} at this "
                        f"token; row bound {b.bound:.6g}, widest token bound {b.widest:.6g}]")


def not_run_rows(cell: str, klass: str, bound_class: str, keys: Sequence[MetricKey],
                 reason: str) -> list[Row]:
    """One ``NOT_RUN`` row per metric of ``keys`` (nothing measured), each with ``reason``."""
    return [Row(cell=cell, klass=klass, bound_class=bound_class, round=k.round, role=k.role,
                family=k.family, variant=k.variant, statistic=FAMILY_STATISTIC[k.family],
                error=None, bound=None, margin=None, verdict="NOT_RUN", reason=reason,
                where="")
            for k in keys]


def declared_not_run(meta: Mapping[str, Any] | None, round_: int | None,
                     family: str) -> str | None:
    """The reason a harness declared a metric not run, else ``None``.

    A harness that cannot run part of a cell on this machine (Megatron-Core's optimizer
    needs CUDA) lists it in its role's ``outputs.json`` as ``not_run``: entries
    ``{"round": r | null, "family": f | "*", "reason": "..."}`` (``null`` = every round,
    ``"*"`` = every family; the families of :data:`FAMILY_STATISTIC` plus ``dtypes``,
    ``replica`` and ``padding``). A declared metric is judged ``NOT_RUN`` with the reason,
    and only when the tensors are absent: a declared metric that was reported anyway is
    compared as usual, and an undeclared missing metric stays a ``FAIL``.
    """
    entries = meta.get("not_run") if isinstance(meta, Mapping) else None
    if not isinstance(entries, list):
        return None
    for e in entries:
        if not isinstance(e, Mapping) or "terms" in e:  # loss terms only: declared_terms
            continue
        r, f = e.get("round"), e.get("family")
        if (r is None or round_ is None or r == round_) and f in ("*", family):
            return str(e.get("reason") or "declared not run by the harness")
    return None


def declared_terms(meta: Mapping[str, Any] | None, round_: int,
                   terms: Sequence[str]) -> str | None:
    """The reason a harness declared every one of the loss ``terms`` not reported, else ``None``.

    A harness whose stack returns its loss whole (TRL: one scalar, no policy / KL / entropy
    split) reports the terms it has (``loss/total``) and lists the others in its role's
    ``outputs.json`` ``not_run`` as ``{"round": r | null, "family": "losses", "terms":
    [...], "reason": "..."}``. Such an entry declares those terms only, never the family.
    """
    entries = meta.get("not_run") if isinstance(meta, Mapping) else None
    if not isinstance(entries, list) or not terms:
        return None
    left, why = set(terms), []
    for e in entries:
        if not isinstance(e, Mapping) or e.get("family") != "losses" or \
                not isinstance(e.get("terms"), list) or e.get("round") not in (None, round_):
            continue
        hit = left & {str(t) for t in e["terms"]}
        if hit:
            left -= hit
            why.append(str(e.get("reason") or "declared not reported by the harness"))
    return "; ".join(why) if not left else None


def _reported_terms(key: MetricKey, got: Mapping[str, Any], want: Mapping[str, Any],
                    meta: Mapping[str, Any] | None) -> tuple[dict[str, Any], str] | None:
    """The expected loss terms the harness reported, and a note for the row's ``where``.

    ``None`` unless the row is ``losses``, the harness reported some terms and declared every
    missing one (:func:`declared_terms`): then the family is measured whole, and a missing
    undeclared term is ``inf``.
    """
    if key.family != "losses" or not got or not set(got) < set(want):
        return None
    missing = sorted(set(want) - set(got))
    why = declared_terms(meta, key.round, missing)
    if why is None:
        return None
    return ({t: want[t] for t in got},
            f"{', '.join(sorted(got))} compared; {', '.join(missing)} declared not reported: "
            f"{why}")


def compare_rows(*, cell: str, klass: str, precision: str, bounds: Sequence[Bound],
                 obtained: Mapping[str, Any], expected: Mapping[str, Any],
                 mask: npt.NDArray[Any], meta: Mapping[str, Any] | None = None,
                 scale: Mapping[str, Any] | None = None,
                 power_cache: PowerCache | None = None,
                 bound_class: str | None = None) -> list[Row]:
    """Rows of one class: every metric of ``expected`` measured in ``obtained``.

    ``bound_class``: the ``bounds.json`` class judging the rows (``None``: ``klass``;
    :data:`qualify.bounds.TP_CANDIDATE_CLASS` for ``candidate_vs_hf`` rows at TP > 1).

    A metric absent from ``obtained`` that the harness declared not run (see
    :func:`declared_not_run`) is a ``NOT_RUN`` row with the declared reason. A ``losses``
    row whose missing terms the harness declared (:func:`declared_terms`) is measured over
    the terms it reported, under the family's bound (the largest error over a subset of the
    terms is at most the largest over all of them), its ``where`` naming both. ``scale``: the
    unmoved expected run when ``expected`` was moved to other clip branches.
    ``power_cache``: shared by the rows of one comparison (:func:`qualify.compare.power
    .power_of`); every row with a bound carries its power check either way.
    """
    got, want = group_tensors(obtained), group_tensors(expected)
    scales = group_tensors(scale) if scale is not None else {}
    out = []
    for key, m in compare_sets(obtained, expected, mask, scale).items():
        why = None if key in got else declared_not_run(meta, key.round, key.family)
        if why is not None:
            out += not_run_rows(cell, klass, bound_class or klass, [key], why)
            continue
        partial = _reported_terms(key, got.get(key, {}), want[key], meta)
        if partial is not None:  # the loss terms the harness reports, the rest declared
            row = _metric_row(cell=cell, klass=klass, bound_class=bound_class or klass,
                              key=key, m=measure(key, got[key], partial[0], mask),
                              precision=precision, bounds=bounds, obtained=got[key],
                              expected=partial[0], mask=mask, power_cache=power_cache)
            out.append(dataclasses.replace(row, where=f"{row.where} [{partial[1]}]"))
            continue
        out.append(_metric_row(cell=cell, klass=klass, bound_class=bound_class or klass,
                               key=key, m=m,
                               precision=precision, bounds=bounds, obtained=got.get(key, {}),
                               expected=want[key], mask=mask, scale=scales.get(key),
                               power_cache=power_cache))
    return out


def padding_rows(*, cell: str, role: str, precision: str, bounds: Sequence[Bound],
                 outputs: Mapping[str, Any], mask: npt.NDArray[Any]) -> list[Row]:
    """Each ``*_padded`` tensor against the same cell's unpadded one (``tp_vs_tp1`` bound)."""
    groups = group_tensors(outputs)
    out: list[Row] = []
    padded = sorted((k for k in groups if k.variant == "padded"), key=lambda k: k.label)
    for key in padded:
        base = dataclasses.replace(key, variant="")
        m = measure(base, groups[key], groups.get(base, {}), mask)
        # lookup() ignores the variant: the padded row takes the family's tp_vs_tp1 bound.
        out.append(_metric_row(cell=cell, klass="padding_invariance", bound_class="tp_vs_tp1",
                               key=key, m=m, precision=precision, bounds=bounds,
                               obtained=groups[key], expected=groups.get(base, {}),
                               mask=mask))
    need = PADDING_REQUIRED.get(role)
    if need is not None and not any(k.family == need and k.role == role for k in padded):
        out.append(Row(cell=cell, klass="padding_invariance", bound_class="tp_vs_tp1", round=1,
                       role=role, family=need, variant="padded",
                       statistic=FAMILY_STATISTIC[need], error=None, bound=None, margin=None,
                       verdict="FAIL", where="(missing)",
                       reason=f"no padding-invariance rerun in {OUTPUTS_FILE}: expected "
                              f"round<r>/{role}/{need}_padded",
                       detail=FailureDetail(mismatched=1, total=1, max_abs=math.inf,
                                            max_rel=math.inf, columns=("tensor", "present"),
                                            table=((f"round1/{role}/{need}_padded", "no"),))))
    return out


def _check_row(*, cell: str, role: str, klass: str, family: str, statistic: str,
               problems: Sequence[tuple[str, str, str]], total: int,
               error: float | None = None, bound: float | None = None) -> Row:
    """A dtype / replica row from ``(item, obtained, expected)`` problems (none = ``PASS``)."""
    margin = None if error is None or bound is None else judge(error, bound)[1]
    row = Row(cell=cell, klass=klass, bound_class=None, round=None, role=role, family=family,
              statistic=statistic, error=error, bound=bound, margin=margin, verdict="PASS",
              reason=None, where="")
    if not problems:
        return row
    item, obtained, expected = problems[0]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    detail = FailureDetail(mismatched=len(problems), total=max(total, len(problems)),
                           max_abs=error, max_rel=None, columns=("item", "obtained", "expected"),
                           table=tuple(problems[:DETAIL_ROWS]))
    return dataclasses.replace(
        row, verdict="FAIL", where=item, detail=detail,
        reason=f"{family}: {item} is {obtained}, expected {expected}{more}")


def dtype_row(cell: str, role: str, meta: Mapping[str, Any] | None, why: str, *,
              precision: str | None = None, reduction: bool = True) -> Row:
    """The precision policy of a cell, from ``outputs.json`` ``dtypes``.

    Master weights, gradients and optimizer state must be FP32 (fp32 and bf16 cells alike);
    with ``reduction``, every entry of each :data:`REDUCTION_KEYS` map must be the dtype
    :data:`PRECISION_REDUCTION_DTYPE` gives ``precision``, and a map that is absent or empty
    is a failing item named ``grad_reduction`` / ``grad_accumulation`` (``missing``).

    Args:
        cell: the row's cell id.
        role: the row's role.
        meta: ``outputs.json`` (``None``: unreadable, ``why`` says why).
        why: why ``meta`` is ``None``.
        precision: the cell's contract precision or its reference lane (``bf16-autocast``
            takes the policy of ``bf16``; ``None``: ``fp32``).
        reduction: check the :data:`REDUCTION_KEYS` maps (a report sealed before the
            ``reduction_dtypes`` section, :data:`~qualify.compare.verdicts.OPTIONAL_SECTIONS`,
            is recomputed without them).

    Returns:
        A ``dtypes`` row: ``PASS``, or ``FAIL`` naming the first offending item (``item is
        obtained, expected torch.float32``) with every offending item in its detail table.
    """
    kw: dict[str, Any] = {"cell": cell, "role": role, "klass": "dtypes", "family": "dtypes",
                          "statistic": "dtype"}
    if meta is None:
        return _check_row(**kw, problems=[(OUTPUTS_META_FILE, why, "readable JSON")], total=1)
    d = meta.get("dtypes")
    if not isinstance(d, Mapping):
        return _check_row(**kw, problems=[("dtypes", f"missing from {OUTPUTS_META_FILE}",
                                           "present")], total=1)
    found: list[tuple[str, Any, str]] = [("master_weights", d.get("master_weights"), FP32),
                                         ("grads", d.get("grads"), FP32)]
    state = d.get("optimizer_state")
    if isinstance(state, Mapping):
        found += [(f"optimizer_state.{k}", state.get(k), FP32)
                  for k in sorted(set(OPTIMIZER_STATE_KEYS) | set(state))]
    else:
        found.append(("optimizer_state", None, FP32))
    if reduction:
        p = lane_precision(precision or "fp32")  # a lane (bf16-autocast) keys its precision
        want = PRECISION_REDUCTION_DTYPE.get(p, f"a dtype policy (none for precision {p!r})")
        for key in REDUCTION_KEYS:
            entries = d.get(key)
            if isinstance(entries, Mapping) and entries:
                found += [(f"{key}.{name}", entries[name], want) for name in sorted(entries)]
            else:
                found.append((key, None, want))
    problems = [(item, "missing" if got is None else str(got), want)
                for item, got, want in found if got != want]
    return _check_row(**kw, problems=problems, total=len(found))


def _finite_or_nan(x: Any) -> float:
    """A JSON number as float (``nan`` when it is not a number)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return math.nan
    return float(x)


def replica_row(cell: str, role: str, meta: Mapping[str, Any] | None, why: str) -> Row:
    """Replicated parameters must be bitwise equal across TP ranks (``all_equal``)."""
    kw: dict[str, Any] = {"cell": cell, "role": role, "klass": "replica_consistency",
                          "family": "replica", "statistic": "bitwise"}
    if meta is None:
        return _check_row(**kw, problems=[(OUTPUTS_META_FILE, why, "readable JSON")], total=1)
    rc = meta.get("replica_consistency")
    if not isinstance(rc, Mapping):
        return _check_row(**kw, problems=[("replica_consistency",
                                           f"missing from {OUTPUTS_META_FILE}", "present")],
                          total=1)
    raw_params = rc.get("params", {})
    params: Mapping[str, Any] = raw_params if isinstance(raw_params, Mapping) else {}
    bad: list[tuple[float, tuple[str, str, str]]] = []
    diffs: list[float] = []
    for name in sorted(params):
        p = params[name] if isinstance(params[name], Mapping) else {}
        d = _finite_or_nan(p.get("max_abs_diff"))
        if not math.isnan(d):
            diffs.append(d)
        if p.get("equal") is not True or (not math.isnan(d) and d != 0):
            bad.append((-1.0 if math.isnan(d) else d,
                        (name, f"equal={p.get('equal')!r} (max abs diff {d:.6g})",
                         "bitwise equal")))
    problems = [pr for _, pr in sorted(bad, key=lambda x: -x[0])]
    all_equal = rc.get("all_equal")
    if all_equal is not True:
        problems.insert(0, ("all_equal", "missing" if all_equal is None else repr(all_equal),
                            "True"))
    error: float | None = max(diffs) if diffs else (None if problems else 0.0)
    return _check_row(**kw, problems=problems, total=max(1, len(params)), error=error,
                      bound=0.0 if error is not None else None)



_FP32_MAX: Final = float(np.finfo(np.float32).max)
_ROUND_KEY: Final = re.compile(r"round([1-9][0-9]*)", re.ASCII)


def _lr_of(lr: Any, rnd: int) -> float | None:
    """``lr["round<rnd>"]`` as a float, ``None`` when absent or not a number."""
    x = lr.get(f"round{rnd}") if isinstance(lr, Mapping) else None
    return None if isinstance(x, bool) or not isinstance(x, int | float) else float(x)


def lr_rows(cell: str, role: str, meta: Mapping[str, Any] | None, why: str,
            sealed: Mapping[str, Any] | None) -> list[Row]:
    """One ``lr_schedule`` row per round: the lr the cell's step applied vs the sealed one.

    Args:
        cell: cell id.
        role: ``actor`` or ``critic``.
        meta: the cell's ``outputs.json`` (its ``lr``: ``{"round<r>": lr}``, the lr the
            engine's optimizer step ``r`` applied, read from its param groups).
        why: why ``meta`` is ``None``.
        sealed: the reference's ``{"round<r>": lr}`` of this role (``reference.json``
            ``update_meta``), ``None`` for a reference sealed before lr schedules: no rows.

    Returns:
        Rows with family ``lr``, statistic ``abs``, ``error = |obtained - sealed|``,
        ``bound = spacing_fp32(sealed)`` (:data:`LR_RULE`); an lr the cell did not report
        is a ``FAIL``.
    """
    if not isinstance(sealed, Mapping):
        return []
    rounds = sorted(int(m[1]) for k in sealed if (m := _ROUND_KEY.fullmatch(str(k))))
    out = []
    for rnd in rounds:
        want = _lr_of(sealed, rnd)
        got = _lr_of(meta.get("lr") if isinstance(meta, Mapping) else None, rnd)
        row = Row(cell=cell, klass="lr_schedule", bound_class=None, round=rnd, role=role,
                  family="lr", statistic="abs", error=None, bound=None, margin=None,
                  verdict="FAIL", reason=None, where="")
        if want is None or not math.isfinite(want) or abs(want) > _FP32_MAX:
            out.append(dataclasses.replace(
                row, verdict="ERROR", reason=f"sealed lr of round {rnd} is "
                                             f"{sealed.get(f'round{rnd}')!r}, not a finite "
                                             "FP32 number"))
            continue
        bound = float(np.spacing(np.float32(abs(want))))
        if got is None:
            missing = why if meta is None else f"lr.round{rnd} missing from {OUTPUTS_META_FILE}"
            out.append(dataclasses.replace(
                row, bound=bound, where="(missing)",
                reason=f"{row.metric}: no lr reported ({missing})",
                detail=FailureDetail(mismatched=1, total=1, max_abs=math.inf, max_rel=math.inf,
                                     columns=("step", "obtained", "expected", "abs diff"),
                                     table=((str(rnd), None, want, math.inf),))))
            continue
        err = abs(got - want)
        verdict, margin = judge(err, bound)
        row = dataclasses.replace(row, error=err, bound=bound, margin=margin,
                                  where=f"step {rnd}")
        if verdict == "PASS":
            out.append(dataclasses.replace(row, verdict="PASS"))
            continue
        out.append(dataclasses.replace(
            row, reason=f"{row.metric}: lr = {got:.9g} applied at optimizer step {rnd}, the "
                        f"contract's schedule gives {want:.9g} (|diff| {err:.3g} > 1 FP32 ulp "
                        f"{bound:.3g})",
            detail=FailureDetail(mismatched=1, total=1, max_abs=err,
                                 max_rel=err / abs(want) if want else math.inf,
                                 columns=("step", "obtained", "expected", "abs diff"),
                                 table=((str(rnd), got, want, err),))))
    return out


def declared_or(row: Row, meta: Mapping[str, Any] | None, family: str) -> Row:
    """A check row that failed only for lack of evidence the harness declared not run."""
    if row.verdict != "FAIL" or "missing" not in (row.reason or "") + row.where:
        return row
    why = declared_not_run(meta, None, family)
    if why is None:
        return row
    return dataclasses.replace(row, verdict="NOT_RUN", reason=why, detail=None, where="",
                               error=None, bound=None, margin=None)



metric_detail = _detail
"""The pytest-approx-style detail of one measured metric group (the resume rows use it)."""


# --------------------------------------------------------------------------- builder guard


def row_problem(row: Row) -> str | None:
    """The first violation of ``report.schema.json`` ``$defs/row`` by ``row``'s JSON form."""
    try:
        doc = row.to_dict()
    except (TypeError, ValueError, AttributeError) as exc:  # e.g. a string where a number goes
        return f"no JSON form: {type(exc).__name__}: {exc}"
    return first_error(doc, "report", definition="row")


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else f"{line[: limit - 3]}..."


def builder_error(*, cell: str, builder: str, klass: str, role: str, family: str,
                  why: str) -> Row:
    """The ``ERROR`` row that stands for what ``builder`` could not build for ``cell``.

    Args:
        cell: the cell id.
        builder: the row builder, e.g. ``qualify.compare.rows.padding_rows``.
        klass: the comparison class of the rows it builds (one of the report's classes).
        role: the cell's role.
        family: the family of the rows it builds (``padding``, ``install``, ...).
        why: one line: the exception, or the schema violation of the row it built.

    Returns:
        A row without round, error or bound, whose reason names the cell, the builder and
        ``why``.
    """
    return Row(cell=cell, klass=klass, bound_class=None, round=None, role=role,
               family=family, statistic="-", error=None, bound=None, margin=None,
               verdict="ERROR", where="",
               reason=f"cell {cell}: {builder} could not build its rows: {_one_line(why)}")


def guarded(build: Callable[[], Sequence[Row]], *, cell: str, builder: str, klass: str,
            role: str, family: str, keep: Sequence[Row] = ()) -> list[Row]:
    """Run one row builder on one cell's data; what it cannot build is an ``ERROR`` row.

    A builder that raises on the cell's evidence (a value of the wrong type, a shape it did
    not expect) gives one :func:`builder_error` row naming the cell, the builder and the
    exception, so the rest of the cell and the other cells are still compared and the
    report is written; a ``FAIL`` / ``ERROR`` / ``NOT_RUN`` row it returns that violates
    the report schema (:func:`row_problem`) is replaced by such a row. ``PASS`` rows are
    not re-checked (their cost would be paid on every passing run). ``keep``: rows that
    stand when the builder raises, before its ``ERROR`` row (a builder that revises rows
    already built, e.g. :func:`qualify.compare.reflip.with_branch_flips`).

    Raises:
        QualifyError: raised by the builder (an integrity or input error keeps its exit
            code); ``MemoryError`` likewise.
    """
    try:
        rows = list(build())
    except (QualifyError, MemoryError):
        raise
    except Exception as exc:  # a builder's defect on this cell's data: its ERROR row
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return [*keep, builder_error(cell=cell, builder=builder, klass=klass, role=role,
                                     family=family, why=why)]
    out = []
    for r in rows:
        problem = None if r.verdict == "PASS" else row_problem(r)
        out.append(r if problem is None else builder_error(
            cell=cell, builder=builder, klass=klass, role=role, family=family,
            why=f"its {r.verdict} row {r.metric} violates report.schema.json: {problem}"))
    return out
