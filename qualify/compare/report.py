"""Write a comparison :class:`~qualify.compare.verdicts.Report`: ``report.json``, ``report.md``.

- ``report.json``: :meth:`Report.to_dict`, validated against
  ``contracts/schema/report.schema.json`` before anything is written. Non-finite numbers
  (an infinite error or margin) are written as the strings ``"inf"`` / ``"-inf"`` /
  ``"nan"`` because JSON has no such numbers.
- ``report.md`` of a report with the sealed gate decision (section ``gate_decision``,
  :mod:`qualify.evidence.decision`): the decision under the contract's policy at compare
  time, the comparator's verdict beneath it, digests, the root causes (each with its gate
  outcome), the cells not plainly passing, the expected failures one line each, the detail
  of the failing rows of the cells the decision fails (at most :data:`ROW_DETAILS_PER_CELL`
  per cell), errors, coverage, the power check and field metrics in brief; every row stays
  in ``report.json``.
- ``report.md`` of an earlier report, as it was sealed: the result (a failed one says that
  the contract's gate policy, applied after it, decides ``qualify run``'s exit code) and
  digests; the root cause of each
  failing cell, one line per cell (:mod:`qualify.compare.rootcause`); a matrix of cells x
  metric families (pandas ``DataFrame.to_markdown``, tabulate; trainer and sampler cells
  apart), each entry the
  worst verdict of that family's rows and its worst margin; the per-cell summary; a
  pytest-approx-style detail block for each failure (by cell, causally ordered within a
  cell); the errors and checks not run; the
  rows judged against a clip-branch adjusted expected run (:mod:`qualify.branches`); the
  coverage of the contract (every rule nothing exercises, ``NO POWER: ...``, or "coverage
  not recorded"); the power check per family and the rows without power
  (:mod:`qualify.compare.power`); the field mismatch table with its caveat and the
  clip-band tail.

Both files are written atomically (:func:`qualify.evidence.sealed.atomic_write_json` /
:func:`qualify.evidence.sealed.atomic_write_text`: temp file, fsync, ``os.replace``), and never
into a sealed directory. The plots are in ``report.html`` (:mod:`qualify.compare.html`),
generated from ``report.json`` and the stored tensors, outside the sealed run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import pandas as pd

from qualify.compare.rootcause import causal_key
from qualify.compare.verdicts import (
    VERDICT_PRECEDENCE,
    CellResult,
    Report,
    Row,
    worst_verdict,
)
from qualify.display import printable
from qualify.evidence import store
from qualify.layout import (
    BOUNDS_FILE,
    REPORT_JSON,
    REPORT_MD,
)
from qualify.schema import validate

__all__ = ["MATRIX_COLUMNS", "REPORT_SCHEMA", "ROW_DETAILS_PER_CELL", "matrix_frame",
           "render_markdown", "report_document", "write_report"]

REPORT_SCHEMA: Final = "report"
MATRIX_COLUMNS: Final = ("logprobs", "entropy", "values", "rewards", "losses", "grad_norm",
                         "clip_coef", "lr", "grads", "exp_avg", "exp_avg_sq", "updates", "padding",
                         "dtypes", "replica")
"""Columns of the matrix, in this order (families absent from the report are dropped)."""


def report_document(report: Report) -> dict[str, Any]:
    """The ``report.json`` document, validated against ``report.schema.json``.

    Raises:
        QualifyError: the document violates the schema (a bug in qualify).
    """
    doc = report.to_dict()
    validate(doc, REPORT_SCHEMA, what=REPORT_JSON)
    return doc


def write_report(report: Report, run_dir: Path) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.md`` into ``run_dir`` atomically.

    Args:
        report: the comparison result.
        run_dir: the candidate run directory.

    Returns:
        The paths of ``report.json`` and ``report.md``.

    Raises:
        QualifyError: the JSON document violates its schema (nothing is written).
        EvidenceIntegrityError: ``run_dir`` is sealed or lies in a sealed directory.
    """
    doc = report_document(report)
    md = render_markdown(report)
    json_path, md_path = Path(run_dir) / REPORT_JSON, Path(run_dir) / REPORT_MD
    store.atomic_write_json(json_path, doc)  # report_document validated it, once
    store.atomic_write_text(md_path, md)
    return json_path, md_path


# --------------------------------------------------------------------------- formatting


def _num(x: float | None, spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return format(x, spec)


def _text(x: Any) -> str:
    """One line of user-controlled text (newlines and tabs as spaces, the rest escaped).

    Every other non-printable character is escaped by :func:`qualify.display.printable`.
    """
    return printable(str(x).replace("\n", " ").replace("\t", " "))


def _cell(x: Any) -> str:
    """A table cell: numbers formatted, one :func:`_text` line, ``|`` escaped."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return _num(x, ".6g")
    return _text(x).replace("|", "\\|")


def _markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    frame = pd.DataFrame([[_cell(c) for c in r] for r in rows], columns=list(columns))
    return str(frame.to_markdown(index=False, disable_numparse=True))


def _matrix_column(row: Row) -> str:
    if row.klass == "dtypes":
        return "dtypes"
    if row.klass == "replica_consistency":
        return "replica"
    if row.variant == "padded":
        return "padding"
    return row.family


def matrix_frame(report: Report, cells: Sequence[CellResult] | None = None) -> pd.DataFrame:
    """Cells x metric families: ``"<worst verdict> <worst margin>"`` per entry.

    An entry aggregates every row of that cell and family (all classes and rounds);
    ``padding`` gathers the ``*_padded`` rows. Cells without rows (not run, harness error)
    show their verdict only.

    Args:
        report: the report.
        cells: the cells to show, in this order (default every cell of the report); the
            columns are the families these cells have rows of.

    Returns:
        A frame indexed by cell id with a ``verdict`` column and one column per family.
    """
    shown = list(report.cells if cells is None else cells)
    ids = {c.cell for c in shown}
    by_cell: dict[str, dict[str, list[Row]]] = {}
    for r in report.rows:
        if r.cell in ids:
            by_cell.setdefault(r.cell, {}).setdefault(_matrix_column(r), []).append(r)
    present = {col for cols in by_cell.values() for col in cols}
    columns = [c for c in MATRIX_COLUMNS if c in present] + sorted(present - set(MATRIX_COLUMNS))
    data: list[list[str]] = []
    for c in shown:
        entries = [c.verdict + (" (required)" if c.required else "")]
        for col in columns:
            rows = by_cell.get(c.cell, {}).get(col, [])
            if not rows:
                entries.append("")
                continue
            verdict = worst_verdict([r.verdict for r in rows])
            margins = [r.margin for r in rows if r.margin is not None]
            entries.append(f"{verdict} {_num(max(margins))}" if margins else verdict)
        data.append(entries)
    return pd.DataFrame(data, index=pd.Index([c.cell for c in shown], name="cell"),
                        columns=["verdict", *columns])


def _not_run_reason(r: Row) -> str | None:
    """A row's reason, with the contract's expectation of a ``NOT_RUN`` row it expects."""
    if r.expected_not_run is None:
        return r.reason
    return f"{r.reason} (expected by the contract: {r.expected_not_run})"


def _matrix_lines(report: Report) -> list[str]:
    """``## Matrix``: one table, or (since ``clip_band``) trainer and sampler cells apart.

    A report sealed before the ``clip_band`` section is rendered as its comparator wrote
    it: one matrix of every cell (``qualify verify`` re-renders ``report.md`` byte for byte).
    """
    lines = ["## Matrix", "",
             "Each entry: the worst verdict of that family's rows (all comparison classes and "
             "rounds) and the worst margin = error / sealed bound (PASS needs margin <= 1).", ""]
    if "clip_band" not in report.sections:
        return [*lines, str(matrix_frame(report).to_markdown(disable_numparse=True)), ""]
    groups = (("Trainer cells (Actor and Critic)", [c for c in report.cells
                                                    if c.role != "sampler"]),
              ("Sampler cells (weights installed into the sampler)",
               [c for c in report.cells if c.role == "sampler"]))
    for title, cells in groups:
        if cells:
            lines += [f"### {title}", "",
                      str(matrix_frame(report, cells).to_markdown(disable_numparse=True)), ""]
    return lines


def _clip_band_lines(report: Report) -> list[str]:
    """The clip-band tail table (``clip_band`` section; nothing for an earlier report)."""
    if "clip_band" not in report.sections:
        return []
    lines = ["Clip-band tail: the fraction of valid round-1 tokens whose ratio "
             "r = exp(lp_train - lp_gen) falls outside the PPO clip band [1 - clip_ratio, "
             "1 + clip_ratio] (huggingface/trl #6789); the same comparability caveat applies.",
             ""]
    if not report.clip_band:
        return [*lines, "No source with round-1 actor logprobs.", ""]
    return [*lines, _markdown_table(
        ("source", "precision", "band", "tokens", "below", "above", "fraction outside"),
        [(r["source"], r["precision"], f"[{_num(r['clip_low'])}, {_num(r['clip_high'])}]",
          r["tokens"], r["below"], r["above"], _num(r.get("fraction_outside"), ".4g"))
         for r in report.clip_band]), ""]


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {counts.get(v, 0)}" for v in VERDICT_PRECEDENCE)


def _cells_table(cells: Sequence[CellResult]) -> str:
    rows = [(c.cell, "yes" if c.required else "no", c.status, c.verdict,
             c.counts.get("PASS", 0), c.counts.get("FAIL", 0), c.counts.get("ERROR", 0),
             c.counts.get("NOT_RUN", 0), _num(c.worst_margin), c.reason or "")
            for c in cells]
    return _markdown_table(("cell", "required", "status", "verdict", "PASS", "FAIL", "ERROR",
                            "NOT_RUN", "worst margin", "reason"), rows)


def _failure_block(i: int, r: Row) -> list[str]:
    out = [f"### {i}. `{r.cell}` · {r.klass} · `{r.metric}`", ""]
    bound_src = f" (bound class {r.bound_class})" if r.bound_class and \
        r.bound_class != r.klass else ""
    out += [f"{_text(r.reason)}{bound_src}", "",
            f"statistic `{r.statistic}`: error {_num(r.error, '.6g')}, bound "
            f"{_num(r.bound, '.6g')}, margin {_num(r.margin)}, worst at `{r.where}`", ""]
    if r.detail is not None:
        out += ["```", *map(printable, r.detail.summary_lines()), "```", "",
                _markdown_table(r.detail.columns, r.detail.table), ""]
    return out


def _root_cause_lines(report: Report) -> list[str]:
    """``## Root causes``: one line per failing cell, its earliest failing quantity."""
    lr = " -> lr" if "lr_schedule" in report.sections else ""  # as sealed before lr rows
    out = ["## Root causes", "",
           "Per failing cell, the earliest failing quantity in causal order (round 1 before "
           f"round 2; forward -> losses -> grads -> grad_norm -> clip_coef{lr} -> exp_avg / "
           "exp_avg_sq -> updates; the sampler by its own chain), with the cell's other "
           "failing rows folded under it (`qualify/compare/rootcause.py`).", ""]
    causes = report.root_causes
    if not causes:
        return [*out, "None.", ""]
    return [*out, *(f"- {_text(rc.line())}" for rc in causes), ""]


def _causal_failures(report: Report) -> list[Row]:
    """The ``FAIL`` rows grouped by cell (cell order), causally ordered within a cell."""
    order = {c.cell: i for i, c in enumerate(report.cells)}
    fails = list(report.failures)
    keys = {id(r): causal_key(r.to_dict()) for r in fails}
    return sorted(fails, key=lambda r: (order.get(r.cell, len(order)), r.cell, keys[id(r)]))


def _coverage_lines(report: Report) -> list[str]:
    """``## Coverage``: every rule of the contract that nothing in the frozen data exercises."""
    cov = report.coverage_section
    out = ["## Coverage", "",
           "What the contract's rules exercise on the frozen rollout and the reference "
           "update (the reference's `coverage.json`, `qualify/reference/coverage.py`). A "
           "rule nothing exercises is a check that cannot fail on this contract.", ""]
    if not cov["recorded"]:
        return [*out, f"Coverage not recorded: {cov['note'].split(': ', 1)[-1]}.", ""]
    n, bad = len(cov["rules"]), cov["no_power"]
    out += [f"{n - len(bad)} of {n} rules exercised.", ""]
    return [*out, *(f"- {line}" for line in bad), ""] if bad else out


def _power_lines(report: Report) -> list[str]:
    """``## Power check``: per family, the rows whose bound rejects every null alternative."""
    p = report.power
    out = ["## Power check", "",
           "Each metric row's statistic measured for null alternatives built from the "
           "expected tensor (a seeded permutation of its valid elements, its sign flip, "
           "zeros; no permutation for a scalar): a row whose bound accepts any of them "
           "lacks power (`qualify/compare/power.py`); its verdict is unchanged.", ""]
    if not p["families"]:
        return [*out, "No row with a bound.", ""]
    out += [_markdown_table(("family", "rows", "with power", "without power"),
                            [(f, d["rows"], d["with_power"], d["without_power"])
                             for f, d in p["families"].items()]), ""]
    if p["without_power"]:
        out += ["Rows without power:", "",
                _markdown_table(("cell", "class", "metric", "the bound accepts"),
                                [(r["cell"], r["class"], r["metric"], ", ".join(r["accepted"]))
                                 for r in p["without_power"]]), ""]
    return out


def _behavior_weight_lines(report: Report) -> list[str]:
    """``## Behavior importance weights``: decoupled PPO's ``w = exp(lp_prox - lp_behav)``.

    The rows of ``report.behavior_weights`` (:mod:`qualify.compare.weights`); nothing for
    a contract without the weight.
    """
    if not report.behavior_weights:
        return []
    rows = [(r["source"], r["round"], _num(r.get("mean"), ".6g"), _num(r.get("min"), ".6g"),
             _num(r.get("max"), ".6g"), _num(r.get("fraction_capped"), ".4g"), r.get("tokens"))
            for r in report.behavior_weights]
    return ["## Behavior importance weights", "",
            "Decoupled PPO: w = exp(lp_prox - lp_behav), lp_prox each side's own round-1 "
            "logprobs, lp_behav the rollout's behavior logprobs; uncapped statistics over "
            "valid tokens, fraction above behavior_weight_cap (informational, not gated).", "",
            _markdown_table(("source", "round", "mean", "min", "max", "fraction capped",
                             "tokens"), rows), ""]


def _lr_lines(report: Report) -> list[str]:
    """``## Learning-rate schedule``: the contract's schedule, the rule, the sealed lrs."""
    doc = report.lr_schedule or {}
    sealed = doc.get("sealed")
    lines = ["## Learning-rate schedule", ""]
    if not sealed:
        return [*lines, "No lr sealed: the reference was sealed before lr schedules.", ""]
    sched = doc.get("schedule") or {}
    lines += [f"Schedule: {', '.join(f'{k} = {v}' for k, v in sched.items())}. "
              f"Rule of the `lr_schedule` rows: {doc.get('rule')}.", ""]
    rows = [(role, rnd, _num(lr, ".9g")) for role, by_round in sorted(sealed.items())
            for rnd, lr in by_round.items()]
    return [*lines, _markdown_table(("role", "round", "sealed lr"), rows), ""]


ROW_DETAILS_PER_CELL: Final = 20
"""Failure detail blocks shown per cell the gate's decision fails (the rest: ``report.json``)."""


def _decision_lines(report: Report) -> list[str]:
    """The headline: the gate's decision under the policy, the comparator's verdict beneath."""
    gate = report.gate or {}
    pol = gate.get("policy") or {}
    counts = gate.get("counts") or {}
    required = [c for c in gate.get("cells", []) if c.get("required")]
    tally = ", ".join(f"{n} {o}" for o, n in counts.items() if n)
    if pol.get("path"):
        under = (f"under gate policy `{pol['path']}` (sha256 {str(pol.get('digest'))[:12]}) "
                 "at compare time")
    else:
        under = "without a gate policy file (the comparator's verdict decides)"
    lines = [f"**Gate decision: {gate.get('result')}** (exit {gate.get('exit_code')}) {under}: "
             f"{len(required)} required cells, {tally or 'none'}."]
    bad = [c for c in required if not c.get("ok")]
    if bad:
        lines[-1] += " Not passing: " + ", ".join(f"`{c['cell']}` ({c['outcome']})"
                                                   for c in bad) + "."
    fails = [c for c in report.cells if c.required and c.verdict != "PASS"]
    xfail = sum(c.get("outcome") == "XFAIL" for c in required)
    raw = "PASSED" if report.passed else "FAILED"
    lines += ["", f"Comparator verdict (before the policy): {raw} ({len(fails)} required "
              f"cell{'s' if len(fails) != 1 else ''} not PASS; {xfail} of them expected by "
              "the policy)."]
    lines += ["", "`qualify gate` and `qualify audit` decide again under the policy current "
              "when they run, with the run's freshness; this is the decision sealed with the "
              "run (`report.json` `gate`)."]
    return lines


def _outcomes(report: Report) -> dict[str, Mapping[str, Any]]:
    return {str(c.get("cell")): c for c in (report.gate or {}).get("cells", [])}


def _cell_lines(report: Report) -> list[str]:
    """``## Cells``: the cells not plainly passing, one row each; the passing ones counted."""
    out = _outcomes(report)
    causes = {rc.cell: rc for rc in report.root_causes}
    shown = [c for c in report.cells
             if c.verdict != "PASS" or out.get(c.cell, {}).get("outcome") not in (None, "PASS")]
    passing = [c for c in report.cells if c not in shown]
    lines = ["## Cells", ""]
    by_engine: dict[str, int] = {}
    for c in passing:
        by_engine[c.engine or c.cell.split("-", 1)[0]] = \
            by_engine.get(c.engine or c.cell.split("-", 1)[0], 0) + 1
    lines += [f"{len(passing)} cells PASS at the comparator and the gate"
              + (f" ({', '.join(f'{e} {n}' for e, n in sorted(by_engine.items()))})"
                 if by_engine else "") + "; the others:", ""]
    if not shown:
        return [*lines[:-2], f"All {len(passing)} cells PASS.", ""]
    rows = []
    for c in shown:
        o = out.get(c.cell, {})
        rc = causes.get(c.cell)
        first = (f"round {rc.round} {rc.role} {rc.family}" if rc.round is not None
                 else f"{rc.role} {rc.family}") if rc is not None else (c.reason or "")
        rows.append((c.cell, o.get("outcome", "-"), c.verdict, c.counts.get("FAIL", 0),
                     sum(c.counts.values()), _num(c.worst_margin), first))
    return [*lines, _markdown_table(("cell", "gate", "comparator", "FAIL rows", "rows",
                                     "worst margin", "root cause"), rows), ""]


def _expected_lines(report: Report) -> list[str]:
    """``## Expected failures``: one line per cell the policy expects to fail (XFAIL)."""
    xf = [c for c in (report.gate or {}).get("cells", []) if c.get("outcome") == "XFAIL"]
    lines = ["## Expected failures", "",
             "Cells failing only as the gate policy expects (XFAIL): each failing row in a "
             "family, round and role an entry names, within its max_margin. Row details: "
             "`report.json`.", ""]
    if not xf:
        return [*lines, "None.", ""]
    cells = {c.cell: c for c in report.cells}
    for o in xf:
        c = cells.get(str(o["cell"]))
        n = c.counts.get("FAIL", 0) if c else 0
        worst = _num(c.worst_margin) if c else "-"
        lines.append(f"- {o['cell']}: {n} failing rows, worst margin {worst}; {o.get('reason')}")
    return [*lines, ""]


def _unexpected_failure_lines(report: Report) -> list[str]:
    """``## Failures``: detail blocks of the cells the decision fails, capped per cell."""
    out = _outcomes(report)
    bad = {cid for cid, o in out.items() if not o.get("ok") and o.get("outcome") == "FAIL"}
    if not out:  # no decision recorded: every failing cell
        bad = {c.cell for c in report.cells if c.verdict == "FAIL"}
    lines = ["## Failures", "",
             f"The failing rows of the cells the gate's decision fails (FAIL), each cell's "
             f"in causal order (its root cause first), at most {ROW_DETAILS_PER_CELL} per "
             "cell; every row is in `report.json`.", ""]
    rows = [r for r in _causal_failures(report) if r.cell in bad]
    if not rows:
        return [*lines, "None.", ""]
    shown: dict[str, int] = {}
    i = 0
    for r in rows:
        shown[r.cell] = shown.get(r.cell, 0) + 1
        if shown[r.cell] <= ROW_DETAILS_PER_CELL:
            i += 1
            lines += _failure_block(i, r)
    for cell, n in shown.items():
        if n > ROW_DETAILS_PER_CELL:
            lines += [f"`{cell}`: {n - ROW_DETAILS_PER_CELL} more failing rows in "
                      "`report.json`.", ""]
    return lines


def _short_power_lines(report: Report) -> list[str]:
    """``## Power check``, one line, and the rows without power."""
    p = report.power
    n = sum(d["rows"] for d in p["families"].values())
    lines = ["## Power check", "",
             f"{n - len(p['without_power'])} of {n} metric rows reject every null "
             "alternative built from the expected tensor (`qualify/compare/power.py`; per "
             "family in `report.json` `power`).", ""]
    if p["without_power"]:
        lines += [_markdown_table(("cell", "class", "metric", "the bound accepts"),
                                  [(r["cell"], r["class"], r["metric"], ", ".join(r["accepted"]))
                                   for r in p["without_power"]]), ""]
    return lines


def _header_table(report: Report, extra: Sequence[tuple[str, str]] = ()) -> str:
    """The ``item | value`` table under the headline: digests, lane, counts, then ``extra``."""
    s = report.summary
    return _markdown_table(("item", "value"), [
        ("contract", f"{report.contract} (sha256 {report.contract_digest})"),
        ("reference", f"{report.reference_dir}"),
        ("reference manifest sha256", report.reference_manifest_digest),
        (f"{BOUNDS_FILE} sha256", report.bounds_digest),
        ("lane", report.lane),
        ("created", report.created),
        ("cells", _counts(s["cells"])),
        ("rows", _counts(s["rows"])),
        *extra,
    ])


def _trainer_vs_sampler_lines(report: Report) -> list[str]:
    """The trainer-vs-sampler table (``trainer_distribution`` section; information)."""
    got = report.trainer_vs_sampler or {}
    pairs = got.get("pairs") or []
    errors = [f"- {e['trainer']} vs {e['sampler']}: not measured ({e['error']})"
              for e in got.get("errors") or []]
    if "trainer_distribution" not in report.sections or not (pairs or errors):
        return []
    topk = sorted({int(p["k"]) for p in pairs if "k" in p})
    extra = ([f"Top-k path (k = {', '.join(map(str, topk))}): the TV and KL columns are "
              "lower bounds (the mass outside both top-k sets is lumped); max TV is shown "
              "as its lower to its upper bound, and the ceiling composes from the two "
              "cells' sealed `tv_upper_max` bounds (none where their sum is 1 or more).", ""]
             if topk else [])

    def tv(p: Mapping[str, Any]) -> str:
        return (_num(p["tv_max"]) if "tv_upper_max" not in p
                else f"{_num(p['tv_max'])} to {_num(p['tv_upper_max'])}")

    if errors:
        extra += [*errors, ""]
    return ["## Trainer vs sampler distributions (information, no verdict)", "",
            str(got.get("note", "")), "", *extra,
            _markdown_table(("trainer", "sampler", "kind", "max TV", "mean TV",
                             "TV ceiling (max)", "max KL(t ‖ s)", "max KL(s ‖ t)",
                             "top-1 disagreements"),
                            [(p["trainer"], p["sampler"], p["kind"], tv(p),
                              _num(p["tv_mean"]), _num(p.get("tv_max_ceiling")),
                              _num(p["kl_trainer_sampler_max"]),
                              _num(p["kl_sampler_trainer_max"]),
                              f"{p['top1_mismatch']} of {p['n_valid']}") for p in pairs]), ""]


def _render_decision_first(report: Report) -> str:
    """``report.md`` of a report with the ``gate_decision`` section: short, decision first.

    The decision and the comparator's verdict, the digests, the root causes, the cells not
    plainly passing, the expected failures one line each, the detail of failures the
    decision does not expect (capped), then the errors, coverage, power, lr and field
    metrics in brief. Everything else is in ``report.json``.
    """
    lines = [f"# Qualification report: {report.contract} / run {report.run_id}", "",
             *_decision_lines(report), ""]
    adjusted = sum(1 for r in report.rows if r.adjustment)
    lines += [_header_table(report, [
        ("clip-branch adjusted rows", f"{adjusted} (`qualify/branches.py`; in `report.json`)"),
    ]), ""]
    outcome = {k: str(v.get("outcome")) for k, v in _outcomes(report).items()}
    causes = _root_cause_lines(report)
    lines += [f"- [{outcome.get(ln[2:].split(':', 1)[0], '-')}] {ln[2:]}"
              if ln.startswith("- ") else ln for ln in causes]
    lines += _cell_lines(report)
    lines += _expected_lines(report)
    lines += _unexpected_failure_lines(report)
    others = [r for r in report.rows if r.verdict in ("ERROR", "NOT_RUN")]
    lines += ["## Errors and checks not run", ""]
    lines += ([_markdown_table(("cell", "class", "metric", "verdict", "reason"),
                               [(r.cell, r.klass, r.metric, r.verdict, _not_run_reason(r))
                                for r in others]), ""] if others else ["None.", ""])
    lines += _coverage_lines(report)
    lines += _short_power_lines(report)
    if report.behavior_weights:
        lines += _behavior_weight_lines(report)
    lines += _lr_lines(report)
    lines += ["## Field mismatch (informational, not gated)", "",
              f"Round-1 teacher-forced logprobs against the sampler's behavior logprobs "
              f"(`logprobs_mode = {report.logprobs_mode}`; like-for-like: "
              f"{'yes' if report.field_like_for_like else 'NO'}). {report.field_note} "
              "Per source (token_mult_prob_error, k3 KL, clip-band tail): `report.json`.", ""]
    if report.field_metrics:
        lines += [_markdown_table(
            ("source", "precision", "valid", "mean abs", "max abs", "token_mult_prob_error",
             "k3 KL"),
            [(f.source, f.precision, f.n_valid, f.mean_abs, f.max_abs,
              f.token_mult_prob_error, f.k3_kl) for f in report.field_metrics]), ""]
    else:
        lines += ["No source with round-1 actor logprobs.", ""]
    lines += _trainer_vs_sampler_lines(report)
    if report.notes:
        lines += ["## Notes", "", *[f"- {n}" for n in report.notes], ""]
    return "\n".join(lines)


def render_markdown(report: Report) -> str:
    """The ``report.md`` text (see the module docstring for its sections)."""
    if "gate_decision" in report.sections and report.gate is not None:
        return _render_decision_first(report)
    verdict = "PASSED" if report.passed else "FAILED"
    lines = [f"# Qualification report: {report.contract} / run {report.run_id}", "",
             f"**Result: {verdict}**"]
    if not report.passed:
        why = ", ".join(f"`{c}`" for c in report.not_passed) or "no required cell ran"
        lines[-1] += f" (required cells not passing: {why})"
    if not report.passed and "gate_note" in report.sections:
        lines += ["", "This is the comparator's own verdict, before any gate policy: "
                  "`qualify gate RUN_DIR --contract CONTRACT` applies the contract's policy "
                  "(`contracts/gates/<contract>.toml`), where a failure it lists as expected "
                  "is XFAIL, never PASS, and decides the exit code of `qualify run`."]
    lines += ["", _header_table(report), ""]
    causal = "root_causes" in report.sections  # a report sealed before it: file order
    if causal:
        lines += _root_cause_lines(report)
    lines += _matrix_lines(report)
    lines += ["## Cells", "", _cells_table(report.cells), ""]
    failures = _causal_failures(report) if causal else list(report.failures)
    lines += ["## Failures", ""]
    if not failures:
        lines += ["None.", ""]
    elif causal:
        lines += ["By cell, each cell's rows in causal order (its root cause first).", ""]
    for i, r in enumerate(failures, 1):
        lines += _failure_block(i, r)
    others = [r for r in report.rows if r.verdict in ("ERROR", "NOT_RUN")]
    lines += ["## Errors and checks not run", ""]
    if others:
        lines += [_markdown_table(("cell", "class", "metric", "verdict", "reason"),
                                  [(r.cell, r.klass, r.metric, r.verdict, _not_run_reason(r))
                                   for r in others]), ""]
    else:
        lines += ["None.", ""]
    adjusted = [r for r in report.rows if r.adjustment]
    lines += ["## Clip-branch adjusted comparisons", "",
              "Round >= 2 gradient-family rows judged against the expected run moved to the "
              "obtained run's clip branches by contributions the reference sealed before any "
              "candidate ran (same sealed bounds; `qualify/branches.py`).", ""]
    if adjusted:
        lines += [_markdown_table(("cell", "class", "metric", "verdict", "margin", "adjustment"),
                                  [(r.cell, r.klass, r.metric, r.verdict, _num(r.margin),
                                    r.adjustment) for r in adjusted]), ""]
    else:
        lines += ["None.", ""]
    if "coverage" in report.sections:
        lines += _coverage_lines(report)
    if "power" in report.sections:
        lines += _power_lines(report)
    if "behavior_weights" in report.sections:
        lines += _behavior_weight_lines(report)
    if "lr_schedule" in report.sections:
        lines += _lr_lines(report)
    lines += ["## Field mismatch (informational, not gated)", "",
              f"Round-1 teacher-forced logprobs against the sampler's behavior logprobs "
              f"(`logprobs_mode = {report.logprobs_mode}`; like-for-like: "
              f"{'yes' if report.field_like_for_like else 'NO'}). {report.field_note}", "",
              "token_mult_prob_error = mean over valid tokens of exp(|lp_train - lp_gen|) "
              "(NeMo-RL); k3 KL = mean of exp(d) - d - 1, d = lp_train - lp_gen, an "
              "estimate of KL(gen || train).", ""]
    if report.field_metrics:
        lines += [_markdown_table(
            ("source", "precision", "valid", "mean abs", "max abs", "p99 abs", "mean signed",
             "worst", "token_mult_prob_error", "k3 KL", "prob pearson"),
            [(f.source, f.precision, f.n_valid, f.mean_abs, f.max_abs, f.p99_abs,
              f.mean_signed, f.worst, f.token_mult_prob_error, f.k3_kl, f.prob_pearson)
             for f in report.field_metrics]), ""]
    else:
        lines += ["No source with round-1 actor logprobs.", ""]
    lines += _clip_band_lines(report)
    lines += _trainer_vs_sampler_lines(report)
    if report.notes:
        lines += ["## Notes", "", *[f"- {_text(n)}" for n in report.notes], ""]
    return "\n".join(lines)
