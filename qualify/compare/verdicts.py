"""The comparator's verdict types: what a comparison finds, and its JSON form.

A :class:`Row` is one check of one cell (a metric in a comparison class, or a dtype /
replica check), a :class:`FailureDetail` what a failing row shows (pytest ``approx``
style), a :class:`CellResult` one cell's verdict, and a :class:`Report` the outcome of one
run (``bool(report)`` is ``report.passed``). A cell's verdict is its worst row by
:data:`VERDICT_PRECEDENCE` (:func:`worst_verdict`).

This module is the bottom of :mod:`qualify.compare`: the row builders
(:mod:`qualify.compare.rows`), the clip-flip re-judging (:mod:`qualify.compare.reflip`),
the sampler rows (:mod:`qualify.compare.sampler`), the report writer
(:mod:`qualify.compare.report`) and the stage (:mod:`qualify.compare.stage`) import it; it
imports none of them (only the leaf modules :mod:`qualify.compare.mismatch`,
:mod:`qualify.compare.power` and :mod:`qualify.compare.rootcause`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from qualify.compare.mismatch import FieldMismatch
from qualify.compare.power import Power
from qualify.compare.rootcause import RootCause, root_causes
from qualify.jsonio import json_number
from qualify.protocol import Verdict
from qualify.reference.coverage import no_power_lines
from qualify.statistics import MetricKey

__all__ = [
    "LEGACY_SECTIONS",
    "OPTIONAL_SECTIONS",
    "ROW_CLASSES",
    "VERDICT_PRECEDENCE",
    "Cell",
    "CellResult",
    "FailureDetail",
    "Report",
    "Row",
    "Verdict",
    "cell_verdict",
    "sections_of",
    "worst_verdict",
]

ROW_CLASSES: Final = ("candidate_vs_hf", "tp_vs_tp1", "padding_invariance", "dtypes",
                      "replica_consistency", "lr_schedule", "resume", "trainer_distribution")
OPTIONAL_SECTIONS: Final[tuple[str, ...]] = ("coverage", "power", "root_causes",
                                              "behavior_weights", "clip_band",
                                              "lr_schedule", "gate_note", "reduction_dtypes",
                                              "gate_decision", "routes", "route_pins",
                                              "distribution_positions",
                                              "trainer_distribution", "bf16_ties",
                                              "trainer_vs_sampler_topk")
"""Report sections added after the first comparator, in the order they were added:
``coverage`` (the reference's coverage record, issue #15), ``power`` (the power check of
every metric row and its per-family summary, issue #15) and ``root_causes`` (each failing
cell's earliest failing quantity, and ``report.md`` leading with them and listing failures
by cell in causal order, issue #20), ``behavior_weights`` (decoupled PPO's importance-weight
statistics, :mod:`qualify.compare.weights`, issue #18), ``clip_band`` (the clip-band tail
of the field metrics, and ``report.md``'s matrix split into trainer and sampler cells, issue
#20) and ``lr_schedule`` (the contract's lr schedule, the rule of the ``lr_schedule`` rows and
the lrs the reference sealed, issue #15; the rows themselves follow from the evidence: none
against a reference that sealed no lr) and ``gate_note`` (a failed ``report.md`` says that its
verdict comes before the contract's gate policy, which ``qualify run``'s exit code follows;
no data of its own) and ``reduction_dtypes`` (each ``dtypes`` row also requires every gradient
reduction and accumulation dtype the harness read back from its engine,
:func:`qualify.compare.rows.dtype_row`; no data of its own) and ``gate_decision`` (the gate's
decision under the contract's policy at compare time, with the policy's document,
:mod:`qualify.evidence.decision`; ``report.md`` leads with it, the comparator's verdict
beneath, and is short: expected failures one line each, row details only of the cells the
decision fails, capped) and ``routes`` (per COMPLETE cell, the kernel routes its harness read
back at run time: ``outputs.json`` ``routes``, or that the harness records none) and
``route_pins`` (a COMPLETE cell whose routes differ from the contract's ``[routes]`` pins or
from the SDPA backends of the reference's controls has a FAILing ``routes`` row,
:mod:`qualify.compare.routes`) and ``distribution_positions`` (per sampler cell and
``sampler_distribution`` family, the per-position values of its worst sequences that the rows
aggregate, :func:`qualify.compare.distribution.distribution_rows`; what ``report.html``
plots) and ``trainer_distribution`` (each Actor trainer cell's own next-token distributions
judged against the reference's sealed ones, rows ``trainer_distribution``,
:func:`qualify.compare.distribution.trainer_distribution_rows`, their per-position values
kept in ``distribution_positions`` as a sampler cell's are) and ``bf16_ties`` (a BF16
Actor cell's ``trainer_distribution`` top-1 ties resolved at its own logits' precision, BF16
spacings at its recorded top logit, :func:`qualify.distmetrics.tie_resolution`, and its
rows' ``where`` naming the rule that counted; no data of its own) and
``trainer_vs_sampler_topk`` (``trainer_vs_sampler`` has pairs on the top-k path too, a
vocabulary above the full path's limit, :func:`qualify.compare.distribution.trainer_vs_sampler`).
A report
without them was sealed
before they existed
and is recomputed, and its ``report.md`` rendered, without them (:func:`sections_of`)."""

VERDICT_PRECEDENCE: Final[tuple[Verdict, ...]] = ("FAIL", "ERROR", "NOT_RUN", "PASS")
"""Worst first: a cell's verdict is the first of these that any of its rows has."""


Cell = str | float | None
"""One entry of a :class:`FailureDetail` table: text, a number, or empty."""


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
        margin: ``error / bound`` (see :func:`qualify.bounds.judge`).
        verdict: ``PASS``, ``FAIL``, ``NOT_RUN`` or ``ERROR``.
        reason: why it is not ``PASS`` (``None`` for ``PASS``).
        where: the worst element: token ``(b, t)``, parameter, loss term, dtype entry.
        detail: the pytest-approx-style detail of a ``FAIL`` row.
        adjustment: for a round >= 2 gradient-family row judged against the expected run
            moved to the obtained run's clip branches (:func:`qualify.branches
            .adjusted_expected`): which sealed tokens moved it, and the unadjusted error
            and margin; ``None`` otherwise.
        power: for a metric row with a sealed bound, whether that bound also accepts a
            null alternative built from the expected tensor (permuted, sign-flipped,
            zeros; :mod:`qualify.compare.power`); ``None`` for rows without a bound.
        expected_not_run: for a ``NOT_RUN`` row the contract expects
            (:class:`qualify.matrix.ExpectedNotRun`), the contract's reason (the row then
            leaves the cell's verdict to the others, :func:`cell_verdict`); else ``None``.
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
    power: Power | None = None
    expected_not_run: str | None = None

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
                "adjustment": self.adjustment,
                "power": self.power.to_dict() if self.power is not None else None,
                **({"expected_not_run": self.expected_not_run}
                   if self.expected_not_run is not None else {})}

    def to_dict_in(self, sections: Sequence[str]) -> dict[str, Any]:
        """:meth:`to_dict` as written by a comparator with only ``sections``.

        The row's ``power`` key exists from the ``power`` section on
        (:data:`OPTIONAL_SECTIONS`).
        """
        d = self.to_dict()
        if "power" not in sections:
            del d["power"]
        return d


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
        coverage: the reference's ``coverage.json`` (what the contract's rules exercise,
            :mod:`qualify.reference.coverage`), or ``None`` for a reference sealed before
            it existed ("coverage not recorded").
        behavior_weights: decoupled PPO's importance-weight statistics of the reference and
            each Actor cell (:func:`qualify.compare.weights.behavior_weight_rows`).
        clip_band: per source, the fraction of valid round-1 tokens whose train/sampler
            ratio falls outside the PPO clip band
            (:func:`qualify.compare.mismatch.clip_band_tail`; informational).
        lr_schedule: ``{"schedule", "rule", "sealed"}``: the contract's schedule settings,
            the rule of the ``lr_schedule`` rows and the reference's sealed lr per role and
            round (``None``: a reference sealed before lr schedules).
        sections: the optional sections this report holds (:data:`OPTIONAL_SECTIONS`,
            every one by default: what the comparator writes today). ``qualify verify``
            recomputes a report sealed by an earlier comparator with the sections that
            report holds (:func:`sections_of`), so evidence stays verifiable after a
            section is added; the verdicts, errors, bounds and margins of every row are
            recomputed and compared whatever the sections.
        sections_recorded: ``report.json`` lists ``sections`` (every report since
            ``root_causes``; ``False`` only to recompute an earlier one).
        gate: the ``gate`` section (:func:`qualify.evidence.decision.decision_section`):
            the gate's decision under the contract's policy at compare time; ``None`` until
            the comparator adds it (written only with the ``gate_decision`` section).
        routes: the ``routes`` section (:func:`qualify.compare.distribution.cell_routes`).
        distribution_positions: ``{cell: {family: {"k", "sequences"}}}``: per sampler cell
            and ``sampler_distribution`` family, the top-k path's ``k`` (``None`` on the full
            path) and the ``sequences`` records of its worst sequences
            (:func:`qualify.distmetrics.distribution_metrics`); written only with the
            ``distribution_positions`` section.
        trainer_vs_sampler: ``{"note", "pairs"}``: per (Actor trainer cell, sampler cell)
            pair and kind on the full path, the direct metrics and the composed TV ceiling
            (:func:`qualify.compare.distribution.trainer_vs_sampler`; information, no
            verdict); written only with the ``trainer_distribution`` section.

    Raises:
        ValueError: an unknown section name.
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
    coverage: Mapping[str, Any] | None = None
    behavior_weights: tuple[Mapping[str, Any], ...] = ()
    clip_band: tuple[Mapping[str, Any], ...] = ()
    lr_schedule: Mapping[str, Any] | None = None
    sections: tuple[str, ...] = OPTIONAL_SECTIONS
    sections_recorded: bool = True
    gate: Mapping[str, Any] | None = None
    routes: Mapping[str, Any] | None = None
    distribution_positions: Mapping[str, Mapping[str, Any]] | None = None
    trainer_vs_sampler: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.sections) - set(OPTIONAL_SECTIONS))
        if unknown:
            raise ValueError(f"unknown report sections {unknown}")

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
    def power(self) -> dict[str, Any]:
        """The power check per family (:mod:`qualify.compare.power`).

        Returns:
            ``{"families": {family: {"rows", "with_power", "without_power"}},
            "without_power": [{"cell", "class", "metric", "accepted"}]}`` over the rows
            that carry a power check, in row order.
        """
        fams: dict[str, dict[str, int]] = {}
        lacking: list[dict[str, Any]] = []
        for r in self.rows:
            if r.power is None:
                continue
            f = fams.setdefault(r.family, {"rows": 0, "with_power": 0, "without_power": 0})
            f["rows"] += 1
            f["with_power" if r.power.has_power else "without_power"] += 1
            if not r.power.has_power:
                lacking.append({"cell": r.cell, "class": r.klass, "metric": r.metric,
                                "accepted": list(r.power.accepted)})
        return {"families": {k: fams[k] for k in sorted(fams)}, "without_power": lacking}

    @property
    def root_causes(self) -> list[RootCause]:
        """Each failing cell's earliest failing quantity (:mod:`qualify.compare.rootcause`).

        Computed from the rows' JSON form (what ``report.json`` holds), in cell order, so
        ``report.json``, ``report.md``, the summary and ``report.html`` name the same cause.
        """
        return root_causes([r.to_dict() for r in self.rows], [c.cell for c in self.cells])

    @property
    def coverage_section(self) -> dict[str, Any]:
        """``report.json`` ``coverage``: the reference's record, or that it has none."""
        if self.coverage is None:
            return {"recorded": False,
                    "note": "coverage not recorded: the reference was sealed before "
                            "coverage.json existed", "rules": [], "no_power": []}
        rules = [dict(r) for r in self.coverage.get("rules", [])]
        return {"recorded": True, "note": None, "rules": rules,
                "no_power": no_power_lines(rules)}

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
        doc: dict[str, Any] = {
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
            "rows": [r.to_dict_in(self.sections) for r in self.rows],
            "field_metrics": {
                "gated": False,
                "logprobs_mode": self.logprobs_mode,
                "like_for_like": self.field_like_for_like,
                "note": self.field_note,
                "rows": [_field_row_json(f) for f in self.field_metrics],
            },
            "notes": list(self.notes),
        }
        if self.sections_recorded:
            doc["sections"] = list(self.sections)
        if "coverage" in self.sections:
            doc["coverage"] = self.coverage_section
        if "power" in self.sections:
            doc["power"] = self.power
        if "root_causes" in self.sections:
            doc["root_causes"] = [rc.to_dict() for rc in self.root_causes]
        if "behavior_weights" in self.sections:
            doc["behavior_weights"] = [
                {k: json_number(v) if isinstance(v, float) else v for k, v in r.items()}
                for r in self.behavior_weights]
        if "clip_band" in self.sections:
            doc["clip_band"] = [
                {k: json_number(v) if isinstance(v, float) else v for k, v in r.items()}
                for r in self.clip_band]
        if "lr_schedule" in self.sections:
            doc["lr_schedule"] = dict(self.lr_schedule or {})
        if "gate_decision" in self.sections and self.gate is not None:
            doc["gate"] = dict(self.gate)
        if "routes" in self.sections:
            doc["routes"] = dict(self.routes or {})
        if "distribution_positions" in self.sections:
            doc["distribution_positions"] = _json_numbers(self.distribution_positions or {})
        if "trainer_distribution" in self.sections:
            doc["trainer_vs_sampler"] = _json_numbers(
                dict(self.trainer_vs_sampler or {"note": "", "pairs": []}))
        return doc


LEGACY_SECTIONS: Final[tuple[tuple[str, ...], ...]] = ((), ("coverage", "power"))
"""The section sets of the comparators that did not record ``sections``: the first one
(the pre-redesign fixture, tests/fixtures/pre_redesign) and the one of issue #15."""


def sections_of(report_doc: Mapping[str, Any]) -> tuple[tuple[str, ...], bool]:
    """The optional sections a stored ``report.json`` holds, and whether it records them.

    A report written since ``root_causes`` records its sections (``"sections"``: the list
    :meth:`Report.to_dict` writes). An earlier one is read by the top-level keys it holds,
    which must be the set of a comparator that existed (:data:`LEGACY_SECTIONS`).

    Returns:
        ``(sections, recorded)``.

    Raises:
        ValueError: an unknown section name, or a report without ``sections`` whose keys
            no comparator wrote (e.g. ``root_causes`` without the record).
    """
    recorded = report_doc.get("sections")
    if recorded is not None:
        if not isinstance(recorded, list) or not all(isinstance(x, str) for x in recorded):
            raise ValueError("report.json sections: not a list of names")
        unknown = sorted(set(recorded) - set(OPTIONAL_SECTIONS))
        if unknown:
            raise ValueError(f"report.json sections: unknown {unknown}")
        return tuple(name for name in OPTIONAL_SECTIONS if name in recorded), True
    present = tuple(name for name in OPTIONAL_SECTIONS if name in report_doc)
    if present not in LEGACY_SECTIONS:
        raise ValueError(f"report.json holds sections {list(present)} without recording them "
                         f"('sections'): no comparator wrote such a report")
    return present, False


def _json_numbers(x: Any) -> Any:
    """``x`` with every float, at any depth of dicts and lists, as :func:`json_number`."""
    if isinstance(x, float):
        return json_number(x)
    if isinstance(x, Mapping):
        return {k: _json_numbers(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_numbers(v) for v in x]
    return x


def _field_row_json(f: FieldMismatch) -> dict[str, Any]:
    return {k: json_number(v) if isinstance(v, float) else v for k, v in f.to_dict().items()}


def worst_verdict(verdicts: Sequence[Verdict]) -> Verdict:
    """The worst of ``verdicts`` by :data:`VERDICT_PRECEDENCE` (``ERROR`` if empty)."""
    for v in VERDICT_PRECEDENCE:
        if v in verdicts:
            return v
    return "ERROR"


def cell_verdict(rows: Sequence[Row]) -> tuple[Verdict, str | None]:
    """A compared cell's verdict and reason from its rows.

    The worst verdict (:func:`worst_verdict`) of the rows that are not an expected
    ``NOT_RUN`` (:attr:`Row.expected_not_run`): a cell whose only ``NOT_RUN`` rows the
    contract expects takes its verdict from the rows that ran, and a cell with no other row
    is ``NOT_RUN``. No rows: ``ERROR``, "nothing was compared".
    """
    if not rows:
        return "ERROR", "nothing was compared"
    counted = [r for r in rows if r.expected_not_run is None or r.verdict != "NOT_RUN"]
    if not counted:
        return "NOT_RUN", cell_reason("NOT_RUN", rows)
    verdict = worst_verdict([r.verdict for r in counted])
    return verdict, cell_reason(verdict, counted)


def cell_reason(verdict: Verdict, rows: Sequence[Row]) -> str | None:
    """A cell's reason: its first row of ``verdict`` and how many more (``None`` on PASS)."""
    if verdict == "PASS":
        return None
    bad = [r for r in rows if r.verdict == verdict]
    first = bad[0].reason or bad[0].metric
    more = f" (and {len(bad) - 1} more {verdict} rows)" if len(bad) > 1 else ""
    return f"{first}{more}"


def worst_margin(rows: Sequence[Row]) -> float | None:
    """The largest finite-or-inf margin of ``rows`` (NaN and ``None`` skipped); ``None`` if none."""
    ms = [r.margin for r in rows if r.margin is not None and not math.isnan(r.margin)]
    return max(ms) if ms else None
