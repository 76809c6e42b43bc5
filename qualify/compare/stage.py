"""The comparator: apply the sealed bounds to a candidate run and return a :class:`Report`.

``compare_run`` runs ordered steps (in-toto ``verifylib`` style), each failing with one
error type:

1. read ``run.json`` (:class:`~qualify.errors.UsageError` if it is not a run directory);
   refuse a sealed run when writing (:class:`~qualify.errors.EvidenceIntegrityError`);
2. check the reference: sealed, intact, the very one the run names (manifest digest)
   (:class:`~qualify.errors.ReferenceDataError` / ``EvidenceIntegrityError``);
3. load the contract, ``bounds.json`` (schema-checked, same contract digest) and the rollout;
4. judge every cell of ``run.json`` (below);
5. field mismatch metrics (informational, :mod:`qualify.compare.mismatch`);
6. build the :class:`Report` and, with ``write=True``, write ``report.json`` / ``report.md``
   (:mod:`qualify.compare.report`).

A bound violation is a verdict, never an exception. Per cell of ``run.json``:

- ``NOT_RUN`` -> verdict ``NOT_RUN`` with the run's reason; ``ERROR`` -> verdict ``ERROR``
  with the reason and the path of the attempt's logs.
- ``COMPLETE`` -> one :class:`Row` per check:

  * ``candidate_vs_hf``: the cell's tensors against ``reference/hf-{precision}.safetensors``
    restricted to the cell's role (:func:`qualify.statistics.compare_sets`, rollout's
    ``response_mask``);
  * ``tp_vs_tp1`` (TP > 1): against the TP = 1 cell of the same engine, precision, options
    and role; ``NOT_RUN`` rows when that cell did not complete;
  * ``padding_invariance``: each ``*_padded`` tensor against the same cell's unpadded one,
    under the family's ``tp_vs_tp1`` bound (a same-precision repeat control); a missing
    padding rerun of the role's main per-token family is a ``FAIL``;
  * ``dtypes``: master weights, gradients and optimizer state must be ``torch.float32``
    in fp32 **and** bf16 cells (``outputs.json`` ``dtypes``);
  * ``replica_consistency``: replicated parameters bitwise equal across TP ranks
    (``outputs.json`` ``replica_consistency.all_equal``).

  Bounds come only from the reference's ``bounds.json`` (:func:`qualify.bounds.lookup`);
  a metric without a bound is ``ERROR``, never ``PASS``. ``PASS`` iff the error is finite
  and ``error <= bound``; ``margin = error / bound`` (``inf`` when ``bound == 0 < error``,
  0 when both are 0).

A cell's verdict is its worst row by the precedence ``FAIL > ERROR > NOT_RUN > PASS``: a
cell passes only when every check ran and passed. The report passes iff there is at least
one required cell and every required cell passes; required cells are
``contract.matrix.required_cells`` when set, else every cell of the contract's matrix
(a required cell absent from ``run.json`` is ``NOT_RUN``, and never a pass).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from qualify.bounds import Bound, lookup
from qualify.compare.mismatch import (
    FieldMismatch,
    comparability_note,
    field_mismatch,
    is_like_for_like,
)
from qualify.contract import Contract
from qualify.errors import EvidenceIntegrityError, QualifyError, ReferenceDataError, UsageError
from qualify.evidence import store
from qualify.protocol import (
    OUTPUTS_FILE,
    OUTPUTS_META_FILE,
    ROLLOUT_FILE,
    ROLLOUT_META_FILE,
    TRAIN_INPUTS_FILE,
    Verdict,
    parse_tensor_name,
)
from qualify.statistics import (
    FAMILY_STATISTIC,
    ErrorMeasure,
    MetricKey,
    compare_sets,
    group_tensors,
    max_rel_l2,
    measure,
)

__all__ = [
    "BOUNDS_FILE",
    "REPORT_JSON",
    "REPORT_MD",
    "ROW_CLASSES",
    "RUN_FILE",
    "VERDICT_PRECEDENCE",
    "CellResult",
    "FailureDetail",
    "Report",
    "Row",
    "compare_run",
    "judge",
    "worst_verdict",
]

RUN_FILE: Final = "run.json"
REPORT_JSON: Final = "report.json"
REPORT_MD: Final = "report.md"
BOUNDS_FILE: Final = "bounds.json"
CONTRACT_FILE: Final = "contract.json"
FP32: Final = "torch.float32"
ROW_CLASSES: Final = ("candidate_vs_hf", "tp_vs_tp1", "padding_invariance", "dtypes",
                      "replica_consistency")
VERDICT_PRECEDENCE: Final[tuple[Verdict, ...]] = ("FAIL", "ERROR", "NOT_RUN", "PASS")
"""Worst first: a cell's verdict is the first of these that any of its rows has."""
PADDING_REQUIRED: Final = {"actor": "logprobs", "critic": "values"}
"""Per role, the per-token family whose padding rerun (``*_padded``) must be present."""
OPTIMIZER_STATE_KEYS: Final = ("exp_avg", "exp_avg_sq")
DETAIL_ROWS: Final = 5


# --------------------------------------------------------------------------- verdict types


Cell = str | float | None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FailureDetail:
    """What a failing row shows, in the manner of pytest's ``approx``.

    Attributes:
        mismatched: elements (or parameters, loss terms, checks) that differ.
        total: elements (or parameters, loss terms, checks) compared.
        max_abs: largest absolute element difference (``None`` for dtype checks).
        max_rel: largest relative element difference ``|a - b| / |b|`` (``None`` for
            dtype and replica checks).
        columns: header of :attr:`table`, e.g. ``("index", "obtained", "expected",
            "abs diff")`` (per-token), ``("param", "rel L2", "norm obtained",
            "norm expected")`` (per-parameter), ``("term", ...)`` (losses).
        table: the (at most 5) worst differing entries, worst first (valid tokens only).
    """

    mismatched: int
    total: int
    max_abs: float | None
    max_rel: float | None
    columns: tuple[str, ...]
    table: tuple[tuple[Cell, ...], ...]

    def summary_lines(self) -> list[str]:
        """``Mismatched elements: k / N``, max absolute and relative difference."""
        out = [f"Mismatched elements: {self.mismatched} / {self.total}"]
        if self.max_abs is not None:
            out.append(f"Max absolute difference: {self.max_abs:.6g}")
        if self.max_rel is not None:
            out.append(f"Max relative difference: {self.max_rel:.6g}")
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON form (non-finite floats as the strings ``inf`` / ``-inf`` / ``nan``)."""
        return {"mismatched": self.mismatched, "total": self.total,
                "max_abs": json_number(self.max_abs), "max_rel": json_number(self.max_rel),
                "columns": list(self.columns),
                "table": [[json_number(c) if isinstance(c, float) else c for c in row]
                          for row in self.table]}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One check of one cell: a metric in a comparison class, or a dtype / replica check.

    Attributes:
        cell: cell id.
        klass: one of :data:`ROW_CLASSES`.
        bound_class: the ``bounds.json`` class whose bound applies (``None`` for dtype and
            replica checks, which need exact equality).
        round: 1-based round (``None`` for dtype and replica checks).
        role: ``actor`` or ``critic``.
        family: metric family (``logprobs``, ``grads``...), ``dtypes`` or ``replica``.
        variant: ``""`` or ``"padded"``.
        statistic: the family's declared statistic, ``dtype`` or ``bitwise``.
        error: the measured error (``inf`` when shapes differ, values are non-finite or
            tensors are missing; ``None`` when nothing was measured).
        bound: the sealed bound (``None`` when there is none or nothing was measured).
        margin: ``error / bound`` (see :func:`judge`).
        verdict: ``PASS``, ``FAIL``, ``NOT_RUN`` or ``ERROR``.
        reason: why it is not ``PASS`` (``None`` for ``PASS``).
        where: the worst element: token ``(b, t)``, parameter, loss term, dtype entry.
        detail: the pytest-approx-style detail of a ``FAIL`` row.
        adjustment: for a round >= 2 gradient-family row judged against the expected run
            moved to the obtained run's clip branches (:func:`qualify.branches
            .adjusted_expected`): which sealed tokens moved it, and the unadjusted error
            and margin; ``None`` otherwise.
    """

    cell: str
    klass: str
    bound_class: str | None
    round: int | None
    role: str
    family: str
    variant: str = ""
    statistic: str
    error: float | None
    bound: float | None
    margin: float | None
    verdict: Verdict
    reason: str | None
    where: str
    detail: FailureDetail | None = None
    adjustment: str | None = None

    @property
    def metric(self) -> str:
        """``round1/actor/logprobs[padded]``-style label (``actor/dtypes`` for checks)."""
        if self.round is None:
            return f"{self.role}/{self.family}"
        return MetricKey(round=self.round, role=self.role, family=self.family,
                         variant=self.variant).label

    def to_dict(self) -> dict[str, Any]:
        """JSON form (one element of ``rows`` in ``report.json``)."""
        return {"cell": self.cell, "class": self.klass, "bound_class": self.bound_class,
                "round": self.round, "role": self.role, "family": self.family,
                "variant": self.variant, "metric": self.metric, "statistic": self.statistic,
                "error": json_number(self.error), "bound": json_number(self.bound),
                "margin": json_number(self.margin), "verdict": self.verdict,
                "reason": self.reason, "where": self.where,
                "detail": self.detail.to_dict() if self.detail else None,
                "adjustment": self.adjustment}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CellResult:
    """The verdict of one cell.

    Attributes:
        cell: cell id (``torch_tp-bf16-actor-tp2``).
        engine, precision, options, role, tp: as in ``run.json``.
        status: the run's status (``COMPLETE``, ``ERROR``, ``NOT_RUN``).
        verdict: worst row verdict (``COMPLETE``) or the status (otherwise).
        reason: why it is not ``PASS`` (``None`` for ``PASS``).
        attempt: the attempt directory, relative to the run directory.
        required: whether the report's ``passed`` depends on this cell.
        counts: rows per verdict.
        worst_margin: the largest finite-or-infinite margin of its rows (``None`` if none).
    """

    cell: str
    engine: str
    precision: str
    options: Mapping[str, Any]
    role: str
    tp: int
    status: str
    verdict: Verdict
    reason: str | None
    attempt: str | None
    required: bool
    counts: Mapping[str, int]
    worst_margin: float | None

    def to_dict(self) -> dict[str, Any]:
        """JSON form (one element of ``cells`` in ``report.json``)."""
        return {"cell": self.cell, "engine": self.engine, "precision": self.precision,
                "options": dict(self.options), "role": self.role, "tp": self.tp,
                "status": self.status, "verdict": self.verdict, "reason": self.reason,
                "attempt": self.attempt, "required": self.required,
                "rows": {v: int(self.counts.get(v, 0)) for v in VERDICT_PRECEDENCE},
                "worst_margin": json_number(self.worst_margin)}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """The outcome of comparing one candidate run (python-tuf ``VerificationResult`` style).

    ``bool(report)`` is :attr:`passed`.

    Attributes:
        contract: contract name.
        contract_digest: hex sha256 of the contract.
        run_id: the run's id.
        run_dir: the run directory.
        reference_dir: the sealed reference directory used.
        reference_manifest_digest: hex sha256 of the reference's ``MANIFEST.json``.
        bounds_digest: hex sha256 of the reference's ``bounds.json`` bytes.
        lane: ``approximate`` or ``deterministic`` (from ``bounds.json``).
        created: ISO-8601 UTC time of the comparison.
        cells: one result per cell of ``run.json`` (plus required cells it lacks).
        rows: every check of every ``COMPLETE`` cell.
        logprobs_mode: the rollout's ``logprobs_mode``.
        field_like_for_like: whether the field metrics compare the same distribution.
        field_note: the comparability caveat of the field metrics (always shown).
        field_metrics: informational train/inference mismatch rows (never gated).
        notes: further remarks (skipped field rows, ...).
    """

    contract: str
    contract_digest: str
    run_id: str
    run_dir: str
    reference_dir: str
    reference_manifest_digest: str
    bounds_digest: str
    lane: str
    created: str
    cells: tuple[CellResult, ...]
    rows: tuple[Row, ...]
    logprobs_mode: str
    field_like_for_like: bool
    field_note: str
    field_metrics: tuple[FieldMismatch, ...]
    notes: tuple[str, ...] = ()

    @property
    def verdicts(self) -> dict[str, Verdict]:
        """Cell id -> verdict."""
        return {c.cell: c.verdict for c in self.cells}

    @property
    def required(self) -> tuple[str, ...]:
        """Ids of the required cells."""
        return tuple(c.cell for c in self.cells if c.required)

    @property
    def not_passed(self) -> tuple[str, ...]:
        """Required cells whose verdict is not ``PASS`` (what stands between us and a pass)."""
        return tuple(c.cell for c in self.cells if c.required and c.verdict != "PASS")

    @property
    def passed(self) -> bool:
        """At least one required cell, and every required cell ``PASS``."""
        return bool(self.required) and not self.not_passed

    def __bool__(self) -> bool:
        return self.passed

    @property
    def failures(self) -> tuple[Row, ...]:
        """The ``FAIL`` rows."""
        return tuple(r for r in self.rows if r.verdict == "FAIL")

    @property
    def summary(self) -> dict[str, Any]:
        """Counts of cells and rows per verdict, the required cells and those not passed."""
        return {
            "cells": {v: sum(c.verdict == v for c in self.cells) for v in VERDICT_PRECEDENCE},
            "rows": {v: sum(r.verdict == v for r in self.rows) for v in VERDICT_PRECEDENCE},
            "required": list(self.required),
            "required_not_passed": list(self.not_passed),
        }

    def to_dict(self) -> dict[str, Any]:
        """The ``report.json`` document (schema ``contracts/schema/report.schema.json``)."""
        return {
            "schema_version": 1,
            "contract": self.contract,
            "contract_digest": self.contract_digest,
            "run_id": self.run_id,
            "run_dir": self.run_dir,
            "reference": {"path": self.reference_dir,
                          "manifest_digest": self.reference_manifest_digest},
            "bounds_digest": self.bounds_digest,
            "lane": self.lane,
            "created": self.created,
            "passed": self.passed,
            "summary": self.summary,
            "cells": [c.to_dict() for c in self.cells],
            "rows": [r.to_dict() for r in self.rows],
            "field_metrics": {
                "gated": False,
                "logprobs_mode": self.logprobs_mode,
                "like_for_like": self.field_like_for_like,
                "note": self.field_note,
                "rows": [_field_row_json(f) for f in self.field_metrics],
            },
            "notes": list(self.notes),
        }


def json_number(x: float | None) -> float | str | None:
    """A float for JSON: finite as is, ``inf`` / ``-inf`` / ``nan`` as strings, ``None`` kept."""
    if x is None:
        return None
    if math.isfinite(x):
        return float(x)
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _field_row_json(f: FieldMismatch) -> dict[str, Any]:
    return {k: json_number(v) if isinstance(v, float) else v for k, v in f.to_dict().items()}


def judge(error: float, bound: float) -> tuple[Verdict, float]:
    """Verdict and margin of one measured error against its bound.

    Args:
        error: the measured statistic (>= 0, may be ``inf``).
        bound: the sealed bound (>= 0).

    Returns:
        ``("PASS", margin)`` iff ``error`` is finite and ``error <= bound``, else
        ``("FAIL", margin)``; ``margin = error / bound``, ``inf`` when ``bound == 0`` and
        ``error > 0`` (or ``error`` is not finite), 0 when both are 0.
    """
    if not math.isfinite(error):
        return "FAIL", math.inf
    margin = error / bound if bound > 0 else (0.0 if error == 0 else math.inf)
    return ("PASS" if error <= bound else "FAIL"), margin


def worst_verdict(verdicts: Sequence[Verdict]) -> Verdict:
    """The worst of ``verdicts`` by :data:`VERDICT_PRECEDENCE` (``ERROR`` if empty)."""
    for v in VERDICT_PRECEDENCE:
        if v in verdicts:
            return v
    return "ERROR"


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
            na = float(np.linalg.norm(np.asarray(a, dtype=np.float64))) if a is not None \
                else None
            nb = float(np.linalg.norm(np.asarray(b, dtype=np.float64))) if b is not None \
                else None
            rel = max_rel_l2({name: a}, {name: b}).value if a is not None and b is not None \
                else math.inf
            rows.append((name, rel, na, nb))
        rows.sort(key=lambda r: -(r[1] if isinstance(r[1], float) else 0.0))
        table = tuple(r for r in rows if r[1] != 0)[:DETAIL_ROWS]
    elif key.family == "losses":
        columns = ("term", "obtained", "expected", "abs diff")
        rows = []
        for term in sorted(set(obtained) | set(expected)):
            a, b = obtained.get(term), expected.get(term)
            fa = float(np.asarray(a)) if a is not None else None
            fb = float(np.asarray(b)) if b is not None else None
            d = abs(fa - fb) if fa is not None and fb is not None else math.inf
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
                expected: Mapping[str, Any], mask: npt.NDArray[Any] | None) -> Row:
    """Judge one measured metric against its sealed bound."""
    stat = FAMILY_STATISTIC[key.family]
    row = Row(cell=cell, klass=klass, bound_class=bound_class, round=key.round, role=key.role,
              family=key.family, variant=key.variant, statistic=stat, error=m.value,
              bound=None, margin=None, verdict="ERROR", reason=None, where=m.where)
    b = lookup(list(bounds), precision=precision, klass=bound_class, key=key)
    if b is None:
        return dataclasses.replace(
            row, reason=f"no sealed bound for {dataclasses.replace(key, variant='').label} "
                        f"(class {bound_class}, precision {precision}) in {BOUNDS_FILE}")
    if b.statistic != stat:
        return dataclasses.replace(
            row, bound=b.bound, reason=f"sealed bound of {key.label} uses statistic "
                                       f"{b.statistic!r}, the family declares {stat!r}")
    verdict, margin = judge(m.value, b.bound)
    if verdict == "PASS":
        return dataclasses.replace(row, bound=b.bound, margin=margin, verdict="PASS")
    return dataclasses.replace(
        row, bound=b.bound, margin=margin, verdict="FAIL",
        reason=f"{key.label}: {stat} = {m.value:.6g} > bound {b.bound:.6g} "
               f"(margin {margin:.3g}) at {m.where}",
        detail=_detail(key, m, obtained, expected, mask))


def _not_run_rows(cell: str, klass: str, bound_class: str, keys: Sequence[MetricKey],
                  reason: str) -> list[Row]:
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
        if not isinstance(e, Mapping):
            continue
        r, f = e.get("round"), e.get("family")
        if (r is None or round_ is None or r == round_) and f in ("*", family):
            return str(e.get("reason") or "declared not run by the harness")
    return None


def _compare_rows(*, cell: str, klass: str, precision: str, bounds: Sequence[Bound],
                  obtained: Mapping[str, Any], expected: Mapping[str, Any],
                  mask: npt.NDArray[Any], meta: Mapping[str, Any] | None = None,
                  scale: Mapping[str, Any] | None = None) -> list[Row]:
    """Rows of one class: every metric of ``expected`` measured in ``obtained``.

    A metric absent from ``obtained`` that the harness declared not run (see
    :func:`declared_not_run`) is a ``NOT_RUN`` row with the declared reason. ``scale``: the
    unmoved expected run when ``expected`` was moved to other clip branches.
    """
    got, want = group_tensors(obtained), group_tensors(expected)
    out = []
    for key, m in compare_sets(obtained, expected, mask, scale).items():
        why = None if key in got else declared_not_run(meta, key.round, key.family)
        if why is not None:
            out += _not_run_rows(cell, klass, klass, [key], why)
            continue
        out.append(_metric_row(cell=cell, klass=klass, bound_class=klass, key=key, m=m,
                               precision=precision, bounds=bounds, obtained=got.get(key, {}),
                               expected=want[key], mask=mask))
    return out


def _padding_rows(*, cell: str, role: str, precision: str, bounds: Sequence[Bound],
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


def _dtype_row(cell: str, role: str, meta: Mapping[str, Any] | None, why: str) -> Row:
    """Master weights, grads and optimizer state must be FP32 (fp32 and bf16 cells alike)."""
    kw: dict[str, Any] = {"cell": cell, "role": role, "klass": "dtypes", "family": "dtypes",
                          "statistic": "dtype"}
    if meta is None:
        return _check_row(**kw, problems=[(OUTPUTS_META_FILE, why, "readable JSON")], total=1)
    d = meta.get("dtypes")
    if not isinstance(d, Mapping):
        return _check_row(**kw, problems=[("dtypes", f"missing from {OUTPUTS_META_FILE}",
                                           "present")], total=1)
    found: list[tuple[str, Any]] = [("master_weights", d.get("master_weights")),
                                    ("grads", d.get("grads"))]
    state = d.get("optimizer_state")
    if isinstance(state, Mapping):
        found += [(f"optimizer_state.{k}", state.get(k))
                  for k in sorted(set(OPTIMIZER_STATE_KEYS) | set(state))]
    else:
        found.append(("optimizer_state", None))
    problems = [(item, "missing" if got is None else str(got), FP32)
                for item, got in found if got != FP32]
    return _check_row(**kw, problems=problems, total=len(found))


def _finite_or_nan(x: Any) -> float:
    """A JSON number as float (``nan`` when it is not a number)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return math.nan
    return float(x)


def _replica_row(cell: str, role: str, meta: Mapping[str, Any] | None, why: str) -> Row:
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


# --------------------------------------------------------------------------- loading


class _CellError(Exception):
    """A COMPLETE cell whose evidence cannot be judged (becomes an ``ERROR`` verdict)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Outputs:
    tensors: dict[str, npt.NDArray[Any]]
    meta: dict[str, Any] | None
    meta_problem: str


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _load_outputs(run_dir: Path, attempt: str | None) -> _Outputs:
    """Load a COMPLETE cell's sealed attempt.

    Raises:
        _CellError: no attempt, the attempt is outside the run, unsealed, edited, or its
            tensors are unreadable.
    """
    if not attempt:
        raise _CellError("run.json lists the cell COMPLETE without an attempt directory")
    adir = (run_dir / attempt).resolve()
    if not adir.is_relative_to(run_dir.resolve()):
        raise _CellError(f"attempt {attempt!r} lies outside the run directory")
    if not adir.is_dir():
        raise _CellError(f"attempt directory {adir} not found")
    problems = store.verify_manifest(adir)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise _CellError(f"attempt {attempt} is incomplete or edited: {problems[0]}{more}")
    try:
        tensors = store.load_tensors(adir / OUTPUTS_FILE)
    except EvidenceIntegrityError as exc:
        raise _CellError(str(exc)) from None
    meta: dict[str, Any] | None = None
    problem = ""
    try:
        raw = _read_json(adir / OUTPUTS_META_FILE)
        if isinstance(raw, dict):
            meta = raw
        else:
            problem = f"{OUTPUTS_META_FILE} is not a JSON object"
    except FileNotFoundError:
        problem = f"{OUTPUTS_META_FILE} missing"
    except (OSError, ValueError) as exc:
        problem = f"{OUTPUTS_META_FILE} unreadable: {exc}"
    return _Outputs(tensors=tensors, meta=meta, meta_problem=problem)


def _role_of(name: str) -> str | None:
    try:
        return parse_tensor_name(name)[1]
    except ValueError:
        return None


def _resolve_reference(run_dir: Path, doc: Mapping[str, Any], given: Path | None) -> Path:
    if given is not None:
        return Path(given)
    ref = doc.get("reference")
    path = ref.get("path") if isinstance(ref, Mapping) else None
    if not isinstance(path, str) or not path:
        raise UsageError(f"{run_dir / RUN_FILE}: reference.path missing; pass reference_dir")
    p = Path(path)
    if p.is_absolute():
        return p
    for cand in (Path.cwd() / p, run_dir / p):
        if cand.is_dir():
            return cand
    return p


def _check_reference(ref_dir: Path, doc: Mapping[str, Any], run_file: Path) -> str:
    """Sealed, intact and the one the run was made against; returns the manifest digest."""
    if not ref_dir.is_dir():
        raise ReferenceDataError(f"{ref_dir}: reference directory not found")
    if not store.is_sealed(ref_dir):
        raise ReferenceDataError(f"{ref_dir}: reference is not sealed; bounds are only read "
                                 "from a sealed reference")
    digest = store.check_sealed(ref_dir)
    ref = doc.get("reference")
    want = ref.get("manifest_digest") if isinstance(ref, Mapping) else None
    if want != digest:
        raise EvidenceIntegrityError(
            f"{run_file}: reference.manifest_digest is {str(want)[:12]}, but {ref_dir} has "
            f"manifest digest {digest[:12]}: the run was made against another reference")
    return digest


def _load_bounds(ref_dir: Path, contract: Contract) -> tuple[list[Bound], str, str]:
    """Rows of ``bounds.json`` (schema-checked), the sha256 of its bytes, and its lane."""
    path = ref_dir / BOUNDS_FILE
    try:
        data = path.read_bytes()
        doc = json.loads(data)
    except FileNotFoundError:
        raise ReferenceDataError(f"{path}: missing; the reference has no sealed bounds") \
            from None
    except (OSError, ValueError) as exc:
        raise ReferenceDataError(f"{path}: unreadable or not JSON: {exc}") from None
    try:
        store.validate_json(doc, "bounds", what=str(path))
    except QualifyError as exc:
        raise ReferenceDataError(str(exc)) from None
    if doc["contract_digest"] != contract.digest:
        raise ReferenceDataError(f"{path}: contract_digest {doc['contract_digest'][:12]} is "
                                 f"not the reference contract's {contract.digest12}")
    return ([Bound.from_dict(b) for b in doc["bounds"]], hashlib.sha256(data).hexdigest(),
            str(doc["lane"]))


def _load_contract(ref_dir: Path) -> Contract:
    path = ref_dir / CONTRACT_FILE
    try:
        doc = _read_json(path)
    except FileNotFoundError:
        raise ReferenceDataError(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise ReferenceDataError(f"{path}: unreadable or not JSON: {exc}") from None
    return Contract.from_dict(doc, path=path)


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Ctx:
    run_dir: Path
    ref_dir: Path
    bounds: list[Bound]
    mask: npt.NDArray[Any]
    hf: dict[str, dict[str, npt.NDArray[Any]] | None]
    contract: Contract | None = None
    train: dict[str, npt.NDArray[Any]] = dataclasses.field(default_factory=dict)
    branches: dict[str, Any] = dataclasses.field(default_factory=dict)


def _sealed_branches(ctx: _Ctx, precision: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The reference's ``branches.json`` and ``branches/hf-{precision}`` tensors, or empty."""
    from qualify.branches import BRANCHES_DIR, BRANCHES_FILE

    if "doc" not in ctx.branches:
        path = ctx.ref_dir / BRANCHES_FILE
        ctx.branches["doc"] = _read_json(path) if path.is_file() else {}
    if precision not in ctx.branches:
        path = ctx.ref_dir / BRANCHES_DIR / f"hf-{precision}.safetensors"
        ctx.branches[precision] = store.load_tensors(path) if path.is_file() else {}
    return ctx.branches["doc"], ctx.branches[precision]


def _adjusted_rows(ctx: _Ctx, rows: list[Row], *, cell: str, klass: str, precision: str,
                   role: str, rnd: int, flips: list[dict[str, Any]],
                   obtained: Mapping[str, Any], expected: Mapping[str, Any],
                   meta: Mapping[str, Any] | None) -> tuple[list[Row] | None, str]:
    """Round ``rnd``'s gradient-family rows against the flip-adjusted expected run."""
    from qualify import branches

    assert ctx.contract is not None
    doc, tensors = _sealed_branches(ctx, precision)
    sealed = (doc.get("precisions", {}).get(precision, {}).get(role, {})
              .get(f"round{rnd}"))
    if not sealed:
        return None, "the reference sealed no clip-branch contributions for this round"
    prefix = f"round{rnd}/{role}/"
    jacobians = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    opt = ctx.contract.optimizer
    lr = opt.actor_lr if role == "actor" else opt.critic_lr
    adjusted, note = branches.adjusted_expected(
        expected, role=role, round_=rnd, flips=flips, jacobians=jacobians, scalars=sealed,
        train=ctx.train, n_valid=float(np.asarray(ctx.mask).sum()), lr=lr,
        betas=(float(opt.betas[0]), float(opt.betas[1])), eps=opt.eps,
        max_grad_norm=opt.max_grad_norm)
    if adjusted is None:
        return None, note
    again = {(r.round, r.family, r.variant): r for r in _compare_rows(
        cell=cell, klass=klass, precision=precision, bounds=ctx.bounds, obtained=obtained,
        expected=adjusted, mask=ctx.mask, meta=meta, scale=expected)}
    out = []
    for row in rows:
        if row.round == rnd and row.family in branches.GRADIENT_FAMILIES and not row.variant:
            new = again[(row.round, row.family, row.variant)]
            was = f"unadjusted error {row.error:.6g}, margin {row.margin:.3g}" \
                if row.error is not None and row.margin is not None else "unadjusted: -"
            out.append(dataclasses.replace(new, adjustment=f"{note}; {was}"))
        else:
            out.append(row)
    return out, note


def _with_branch_flips(ctx: _Ctx, rows: list[Row], *, cell: str, klass: str, precision: str,
                       role: str, obtained: Mapping[str, Any], expected: Mapping[str, Any],
                       meta: Mapping[str, Any] | None = None) -> list[Row]:
    """Handle failing gradient-family rows of rounds >= 2 that a clip-branch flip explains.

    For each such round, the tokens whose clip branch differs between ``obtained`` and
    ``expected`` (as each run's own reported values place them, :mod:`qualify.branches`)
    are found. When every one of them is a token the reference sealed as clip-ambiguous
    (:mod:`qualify.reference.branches`), the round's gradient-family rows are judged again,
    with the same sealed bounds, against the expected run moved to the obtained run's
    branches (:func:`qualify.branches.adjusted_expected`); each such row records the
    adjustment and its unadjusted error. Otherwise the failing rows keep their verdict and
    their reason names the flips and why no adjustment applies.
    """
    from qualify import branches

    if ctx.contract is None or not any(
            r.verdict == "FAIL" and (r.round or 0) >= 2 and r.family in branches.GRADIENT_FAMILIES
            for r in rows):
        return rows
    path = ctx.ref_dir / TRAIN_INPUTS_FILE
    if not ctx.train and path.is_file():
        ctx.train.update(store.load_tensors(path))
    alg = ctx.contract.algorithm
    failing = sorted({int(r.round or 0) for r in rows if r.verdict == "FAIL"
                      and (r.round or 0) >= 2 and r.family in branches.GRADIENT_FAMILIES})
    notes: dict[int, str] = {}
    for rnd in failing:
        flips = branches.flipped_tokens(
            obtained, expected, role=role, round_=rnd, train=ctx.train, mask=ctx.mask,
            value_clip=alg.value_clip, clip_ratio=alg.clip_ratio) \
            if {"advantages", "returns"} <= set(ctx.train) else None
        if not flips:
            continue
        earlier = branches.earlier_flip_rounds(
            obtained, expected, role=role, round_=rnd, train=ctx.train, mask=ctx.mask,
            value_clip=alg.value_clip, clip_ratio=alg.clip_ratio)
        if earlier:
            why = branches.inherited_flips_note(earlier)
        else:
            adjusted, why = _adjusted_rows(ctx, rows, cell=cell, klass=klass,
                                           precision=precision, role=role, rnd=rnd,
                                           flips=flips, obtained=obtained, expected=expected,
                                           meta=meta)
            if adjusted is not None:
                rows = adjusted
                continue
        notes[rnd] = f"{branches.explain(flips, role=role, round_=rnd)}; not adjusted: {why}"
    out = []
    for row in rows:
        rnd = int(row.round or 0)
        if (row.verdict == "FAIL" and rnd in notes and row.family in branches.GRADIENT_FAMILIES
                and row.adjustment is None):
            out.append(dataclasses.replace(row, reason=f"{row.reason}; {notes[rnd]}"))
        else:
            out.append(row)
    return out


def _hf(ctx: _Ctx, precision: str) -> dict[str, npt.NDArray[Any]] | None:
    if precision not in ctx.hf:
        path = ctx.ref_dir / "reference" / f"hf-{precision}.safetensors"
        ctx.hf[precision] = store.load_tensors(path) if path.is_file() else None
    return ctx.hf[precision]


def _same_cell_tp1(cells: Mapping[str, Any], entry: Mapping[str, Any]) -> tuple[str, Any]:
    for cid, e in cells.items():
        if (isinstance(e, Mapping) and e.get("tp") == 1 and e.get("engine") == entry["engine"]
                and e.get("precision") == entry["precision"] and e.get("role") == entry["role"]
                and dict(e.get("options") or {}) == dict(entry.get("options") or {})):
            return cid, e
    return "", None


def _complete_rows(ctx: _Ctx, *, cid: str, entry: Mapping[str, Any], cells: Mapping[str, Any],
                   outputs: _Outputs, loaded: dict[str, _Outputs | str]) -> list[Row]:
    role, precision, tp = str(entry["role"]), str(entry["precision"]), int(entry["tp"])
    mine = {k: v for k, v in outputs.tensors.items() if _role_of(k) == role}
    rows: list[Row] = []
    hf = _hf(ctx, precision)
    if hf is None:
        rows.append(Row(cell=cid, klass="candidate_vs_hf", bound_class="candidate_vs_hf",
                        round=None, role=role, family="all", statistic="-", error=None,
                        bound=None, margin=None, verdict="ERROR", where="",
                        reason=f"reference has no reference/hf-{precision}.safetensors"))
    else:
        expected = {k: v for k, v in hf.items() if _role_of(k) == role}
        rows += _with_branch_flips(
            ctx, _compare_rows(cell=cid, klass="candidate_vs_hf", precision=precision,
                               bounds=ctx.bounds, obtained=mine, expected=expected,
                               mask=ctx.mask, meta=outputs.meta),
            cell=cid, klass="candidate_vs_hf", precision=precision, role=role,
            obtained=mine, expected=expected, meta=outputs.meta)
    if tp > 1:
        tp1_id, tp1 = _same_cell_tp1(cells, entry)
        got = loaded.get(tp1_id) if tp1_id else None
        if isinstance(got, _Outputs):
            ref1 = {k: v for k, v in got.tensors.items() if _role_of(k) == role}
            rows += _with_branch_flips(
                ctx, _compare_rows(cell=cid, klass="tp_vs_tp1", precision=precision,
                                   bounds=ctx.bounds, obtained=mine, expected=ref1,
                                   mask=ctx.mask, meta=outputs.meta),
                cell=cid, klass="tp_vs_tp1", precision=precision, role=role,
                obtained=mine, expected=ref1, meta=outputs.meta)
        else:
            status = tp1.get("status") if isinstance(tp1, Mapping) else "absent from run.json"
            why = f": {got}" if isinstance(got, str) else ""
            keys = sorted(group_tensors(mine), key=lambda k: k.label)
            rows += _not_run_rows(cid, "tp_vs_tp1", "tp_vs_tp1", keys,
                                  f"TP=1 cell of the same engine did not complete "
                                  f"({tp1_id or 'no such cell'}: {status}{why})")
    padding = _padding_rows(cell=cid, role=role, precision=precision, bounds=ctx.bounds,
                            outputs=mine, mask=ctx.mask)
    rows += [_declared_or(r, outputs.meta, "padding") for r in padding]
    rows.append(_declared_or(_dtype_row(cid, role, outputs.meta, outputs.meta_problem),
                             outputs.meta, "dtypes"))
    rows.append(_declared_or(_replica_row(cid, role, outputs.meta, outputs.meta_problem),
                             outputs.meta, "replica"))
    return rows


def _declared_or(row: Row, meta: Mapping[str, Any] | None, family: str) -> Row:
    """A check row that failed only for lack of evidence the harness declared not run."""
    if row.verdict != "FAIL" or "missing" not in (row.reason or "") + row.where:
        return row
    why = declared_not_run(meta, None, family)
    if why is None:
        return row
    return dataclasses.replace(row, verdict="NOT_RUN", reason=why, detail=None, where="",
                               error=None, bound=None, margin=None)


def _cell_reason(verdict: Verdict, rows: Sequence[Row]) -> str | None:
    if verdict == "PASS":
        return None
    bad = [r for r in rows if r.verdict == verdict]
    first = bad[0].reason or bad[0].metric
    more = f" (and {len(bad) - 1} more {verdict} rows)" if len(bad) > 1 else ""
    return f"{first}{more}"


def _worst_margin(rows: Sequence[Row]) -> float | None:
    ms = [r.margin for r in rows if r.margin is not None and not math.isnan(r.margin)]
    return max(ms) if ms else None


def compare_run(run_dir: Path, *, reference_dir: Path | None = None,
                write: bool = True) -> Report:
    """Judge every cell of a candidate run against the sealed reference's bounds.

    Args:
        run_dir: ``evidence/<contract>/<run-id>/`` (holds ``run.json``).
        reference_dir: the sealed reference; default: ``run.json``'s ``reference.path``.
            Either way its manifest digest must equal ``run.json``'s.
        write: write ``report.json`` and ``report.md`` into ``run_dir``.

    Returns:
        The :class:`Report` (``bool(report)`` is ``report.passed``).

    Raises:
        UsageError: ``run_dir`` has no readable ``run.json``.
        ReferenceDataError: the reference is missing, unsealed, lacks its contract,
            bounds or rollout, or belongs to another contract than the run.
        EvidenceIntegrityError: the reference was edited or is not the run's reference,
            or ``write=True`` and the run directory is sealed.
    """
    run_dir = Path(run_dir)
    # 1. the run
    run_file = run_dir / RUN_FILE
    try:
        doc = _read_json(run_file)
    except FileNotFoundError:
        raise UsageError(f"{run_file}: not found; {run_dir} is not a candidate run") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{run_file}: unreadable or not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cells"), dict):
        raise UsageError(f"{run_file}: not a run document (no 'cells' object)")
    if write and (store.is_sealed(run_dir) or store.sealed_ancestor(run_dir / REPORT_JSON)):
        raise EvidenceIntegrityError(f"{run_dir}: run is sealed; a sealed directory is never "
                                     "written again (compare with write=False)")
    # 2. the reference
    ref_dir = _resolve_reference(run_dir, doc, reference_dir)
    manifest_digest = _check_reference(ref_dir, doc, run_file)
    # 3. contract, bounds, rollout
    contract = _load_contract(ref_dir)
    if doc.get("contract_digest") != contract.digest:
        got_digest = str(doc.get("contract_digest"))[:12]
        raise ReferenceDataError(f"{run_file}: contract_digest {got_digest} is not the "
                                 f"reference contract's {contract.digest12}")
    bounds, bounds_digest, lane = _load_bounds(ref_dir, contract)
    rollout = store.load_tensors(ref_dir / ROLLOUT_FILE)
    for k in ("response_mask", "behavior_logprobs"):
        if k not in rollout:
            raise ReferenceDataError(f"{ref_dir / ROLLOUT_FILE}: no {k!r} tensor")
    mask = np.asarray(rollout["response_mask"])
    ctx = _Ctx(run_dir=run_dir, ref_dir=ref_dir, bounds=bounds, mask=mask, hf={},
               contract=contract)
    # 4. the cells
    cells: dict[str, Any] = doc["cells"]
    loaded: dict[str, _Outputs | str] = {}
    for cid, entry in cells.items():
        if isinstance(entry, Mapping) and entry.get("status") == "COMPLETE":
            try:
                loaded[cid] = _load_outputs(run_dir, entry.get("attempt"))
            except _CellError as exc:
                loaded[cid] = str(exc)
    required_ids = contract.matrix.required_cells
    if required_ids is None:  # every cell of the matrix: a cell that did not run is no pass
        required_ids = tuple(c.cell_id for c in contract.matrix.cells())
    if contract.sampler is not None and contract.sampler.required:
        required_ids = (*required_ids, *contract.sampler.cell_ids())
    results: list[CellResult] = []
    all_rows: list[Row] = []
    for cid, entry in cells.items():
        e = entry if isinstance(entry, Mapping) else {}
        status = str(e.get("status", "NOT_RUN"))
        attempt = e.get("attempt")
        rows: list[Row] = []
        reason = e.get("reason")
        verdict: Verdict
        if status == "COMPLETE":
            got = loaded[cid]
            if isinstance(got, str):
                verdict, reason = "ERROR", got
            elif e.get("role") == "sampler":  # qualify.compare.sampler: the sampler cells
                from qualify.compare.sampler import sampler_rows

                src = loaded.get(str(e.get("weights_from")), "not COMPLETE in run.json")
                rows = sampler_rows(cell=cid, entry=e, tensors=got.tensors, meta=got.meta,
                                    meta_problem=got.meta_problem, bounds=ctx.bounds,
                                    mask=ctx.mask,
                                    actor=src.tensors if isinstance(src, _Outputs) else src)
            else:
                rows = _complete_rows(ctx, cid=cid, entry=e, cells=cells, outputs=got,
                                      loaded=loaded)
            if not isinstance(got, str):  # every compared cell: its verdict is its rows'
                verdict = worst_verdict([r.verdict for r in rows])
                reason = _cell_reason(verdict, rows) if rows else "nothing was compared"
        elif status == "ERROR":
            logs = run_dir / str(attempt) / "logs" if attempt else None
            verdict = "ERROR"
            reason = f"{reason or 'harness error'}" + (f" (logs: {logs})" if logs else "")
        elif status == "NOT_RUN":
            verdict = "NOT_RUN"
            reason = reason or "not run"
        else:
            verdict = "ERROR"
            reason = f"{RUN_FILE} status {status!r} is not COMPLETE, ERROR or NOT_RUN"
            status = "ERROR"
        required = cid in required_ids
        results.append(CellResult(
            cell=cid, engine=str(e.get("engine", "")), precision=str(e.get("precision", "")),
            options=dict(e.get("options") or {}), role=str(e.get("role", "")),
            tp=int(e.get("tp", 0)), status=status, verdict=verdict, reason=reason,
            attempt=str(attempt) if attempt else None, required=required,
            counts={v: sum(r.verdict == v for r in rows) for v in VERDICT_PRECEDENCE},
            worst_margin=_worst_margin(rows)))
        all_rows += rows
    for cid in required_ids or ():
        if cid not in cells:
            results.append(CellResult(
                cell=cid, engine="", precision="", options={}, role="", tp=0,
                status="NOT_RUN", verdict="NOT_RUN", attempt=None, required=True,
                reason=f"required by the contract but absent from {RUN_FILE}",
                counts={}, worst_margin=None))
    # 5. field mismatch metrics (informational)
    fields, field_note, like, mode, notes = _field_metrics(ctx, contract, rollout, cells,
                                                          loaded)
    report = Report(
        contract=contract.name, contract_digest=contract.digest,
        run_id=str(doc.get("run_id", run_dir.name)), run_dir=str(run_dir),
        reference_dir=str(ref_dir), reference_manifest_digest=manifest_digest,
        bounds_digest=bounds_digest, lane=lane, created=store.utc_now_iso(),
        cells=tuple(results), rows=tuple(all_rows), logprobs_mode=mode,
        field_like_for_like=like, field_note=field_note, field_metrics=tuple(fields),
        notes=tuple(notes))
    # 6. write
    if write:
        # qualify.compare.report renders this module's types: imported here, not at the top, so
        # that the two modules do not import each other at import time.
        from qualify.compare.report import write_report

        write_report(report, run_dir)
    return report


def _field_metrics(ctx: _Ctx, contract: Contract, rollout: Mapping[str, Any],
                   cells: Mapping[str, Any], loaded: Mapping[str, _Outputs | str],
                   ) -> tuple[list[FieldMismatch], str, bool, str, list[str]]:
    """The HF reference's and each COMPLETE actor cell's round-1 logprobs vs the sampler's."""
    notes: list[str] = []
    try:
        meta = _read_json(ctx.ref_dir / ROLLOUT_META_FILE)
        mode = str(meta.get("logprobs_mode")) if isinstance(meta, dict) else "unknown"
    except (OSError, ValueError) as exc:
        mode = "unknown"
        notes.append(f"{ROLLOUT_META_FILE} unreadable: {exc}")
    s = contract.sampling
    try:
        like = is_like_for_like(mode, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
        note = comparability_note(mode, temperature=s.temperature, top_k=s.top_k,
                                  top_p=s.top_p)
    except ValueError:
        like = False
        note = (f"{ROLLOUT_META_FILE} has logprobs_mode = {mode!r}: it is unknown which "
                "distribution the behavior logprobs are of; the field metrics may not "
                "compare like with like.")
    behavior = rollout["behavior_logprobs"]
    sources: list[tuple[str, str, Any]] = []
    for prec in contract.matrix.precisions:
        hf = _hf(ctx, prec)
        if hf is not None and "round1/actor/logprobs" in hf:
            sources.append((f"hf-{prec}", prec, hf["round1/actor/logprobs"]))
    for cid, entry in cells.items():
        got = loaded.get(cid)
        if not isinstance(got, _Outputs) or entry.get("role") != "actor":
            continue
        lp = got.tensors.get("round1/actor/logprobs")
        if lp is None:
            notes.append(f"{cid}: no round1/actor/logprobs; no field metrics")
            continue
        sources.append((cid, str(entry.get("precision", "")), lp))
    out: list[FieldMismatch] = []
    for source, src_prec, lp in sources:
        try:
            out.append(field_mismatch(lp, behavior, ctx.mask, source=source, precision=src_prec,
                                      logprobs_mode=mode, like_for_like=like))
        except ValueError as exc:
            notes.append(f"field metrics skipped: {exc}")
    return out, note, like, mode, notes
