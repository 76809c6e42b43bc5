"""``report.html``: a static, self-contained page of a compared run (no JS, no CDN).

Generated only from the run's ``report.json`` and the stored tensors
(:mod:`qualify.compare.plotdata`), never from a live comparison, so it can be made again
for any signed run (``qualify report RUN_DIR``). Sections, in order:

1. the result, and the **root cause** of each failing cell, one line per cell
   (:mod:`qualify.compare.rootcause`);
2. heat maps of the worst margin (error / sealed bound) per cell x family, trainer cells
   and families apart from the sampler's;
3. per-token ``|Δ|`` against the bound for the worst sequences of the worst row of each
   per-token family (NeMo-RL style);
4. per-parameter relative L2 error against the bound for the worst failing cell, at its
   root cause's round;
5. error / bound round by round per family (every cell; failing cells in colour);
6. why each bound is what it is: ``k x max(control_error, resolution, propagated) + quantum
   + floor`` with the control
   that set it, for each root cause and (folded) for every sealed bound;
7. the field mismatch metrics ``report.json`` carries (informational, never gated);
8. when ``qualify diverge`` results lie beside the run (``<run-id>.diverge/<cell>/
   diverge.json``), per cell the first module over its bound, a plot of error / bound per
   module and the table of rows.

The figures are inline SVG (:mod:`qualify.compare.plots`, imported only here, when a page
is rendered; drawn in parallel processes by :mod:`qualify.compare.figures`), the style
inline CSS: the file opens with no network. The same ``report.json`` and tensors give the
same bytes.

Where it goes: :func:`default_html_path`, beside the run directory
(``<run-id>.report.html``), never inside it: every file of a sealed run is in its signed
manifest, and this page is a view that can be made again, not evidence.
"""

from __future__ import annotations

import html
import math
import types
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import pandas as pd

from qualify.compare.distribution import TRAINER_CLASS
from qualify.compare.figures import Figures
from qualify.compare.plotdata import (
    DISTRIBUTION_CLASSES,
    PER_PARAM_FAMILIES,
    PER_TOKEN_FAMILIES,
    RunData,
    family_margins,
    load_run,
    param_errors,
    position_distributions,
    round_margins,
    token_errors,
    worst_row,
)
from qualify.compare.report import MATRIX_COLUMNS
from qualify.compare.rootcause import SAMPLER_ROLE, RootCause, causes_of_report
from qualify.display import printable
from qualify.errors import QualifyError
from qualify.evidence import store
from qualify.layout import REPORT_JSON, REPORT_MD

__all__ = ["HTML_SUFFIX", "default_html_path", "render_html", "write_html"]

HTML_SUFFIX: Final = ".report.html"
CSS: Final = """
body { font-family: "DejaVu Sans", Arial, sans-serif; margin: 1.5em auto; max-width: 1200px;
       color: #222; line-height: 1.35; padding: 0 1em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; border-bottom: 1px solid #ccc;
     margin-top: 1.8em; }
.result-passed { color: #2e7d32; } .result-failed { color: #c62828; }
ol.root-causes li { margin: 0.35em 0; font-family: "DejaVu Sans Mono", monospace;
                    font-size: 0.85em; }
table { border-collapse: collapse; font-size: 0.8em; margin: 0.6em 0; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: left; }
th { background: #f3f3f3; }
figure { margin: 1em 0; } figcaption { font-size: 0.85em; color: #444; }
figure svg { max-width: 100%; height: auto; }
.note { font-size: 0.85em; color: #555; }
"""


def _plots() -> types.ModuleType:
    """:mod:`qualify.compare.plots`, imported on first use (it imports matplotlib).

    matplotlib 3.9.2 builds its fontconfig parser at import time with pyparsing names that
    pyparsing >= 3.3 deprecates (``PyparsingDeprecationWarning``, a ``DeprecationWarning``
    whose text starts with the deprecated name); that warning alone is silenced here, and
    inside the figures by :func:`qualify.compare.plots.quiet_pyparsing`.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"'\w+' (argument is )?deprecated",
                                category=DeprecationWarning)
        from qualify.compare import plots
    return plots


def default_html_path(run_dir: str | Path) -> Path:
    """``<parent>/<run-id>.report.html``: beside the run directory, outside its seal."""
    rd = Path(run_dir).resolve()
    return rd.parent / f"{rd.name}{HTML_SUFFIX}"


def _e(x: Any) -> str:
    """HTML-escaped :func:`~qualify.display.printable` text (no control or bidi character)."""
    return html.escape(printable(x), quote=True)


def _num(x: Any) -> str:
    if isinstance(x, bool) or x is None:
        return "-" if x is None else str(x)
    if isinstance(x, int | float):
        return "nan" if math.isnan(x) else format(float(x), ".4g")
    return str(x)


def _table(frame: pd.DataFrame, table_id: str) -> str:
    """A pandas table as HTML (numbers formatted, text and ``table_id`` escaped).

    pandas writes ``table_id`` into the ``id`` attribute as given, so it is escaped here
    (a diverge section's id carries a cell id read from an unsigned ``diverge.json``).
    """
    return str(frame.to_html(index=False, table_id=_e(table_id), border=0, escape=True,
                             na_rep="-", float_format=lambda v: format(v, ".4g")))


def _figure(svg_text: str, fig_id: str, caption: str) -> str:
    return (f'<figure id="{_e(fig_id)}">{svg_text}<figcaption>{_e(caption)}</figcaption>'
            "</figure>")


# --------------------------------------------------------------------------- sections


MAX_GATE_ITEMS: Final = 12
"""Offending cells the gate line lists (the rest are counted)."""


def _gate_line(gate: Mapping[str, Any] | None) -> str:
    """The gate's decision under the result line, or a note that none was applied.

    ``qualify run`` and ``qualify report --contract`` pass the decision; without one the
    report's verdict alone counts expected failures (the policy's XFAIL) as failures.
    """
    if gate is None:
        return ('<p class="note" id="gate-none">No gate policy was applied to this page: the '
                "result below is the comparator's own verdict, where an expected failure "
                "(a finding the contract's gate policy lists) still fails. <code>qualify "
                "report RUN_DIR --contract CONTRACT</code> or <code>qualify gate</code> "
                "judges the run by the policy.</p>")
    ok = int(gate.get("exit_code", 1)) == 0
    counts = ", ".join(f"{k} {v}" for k, v in dict(gate.get("counts", {})).items() if v)
    by = (f"gate policy {_e(gate['policy'])}" if gate.get("policy")
          else "the report verdict (the contract has no gate policy file)")
    bad = [c for c in gate.get("cells", []) if isinstance(c, Mapping) and not c.get("ok")]
    items = "".join(f"<li>{_e(c.get('cell'))}: {_e(c.get('outcome'))}"
                    f"{' (' + _e(c.get('reason')) + ')' if c.get('reason') else ''}</li>"
                    for c in bad[:MAX_GATE_ITEMS])
    if len(bad) > MAX_GATE_ITEMS:
        items += f"<li>and {len(bad) - MAX_GATE_ITEMS} more (qualify gate lists them)</li>"
    unverified = "" if gate.get("verified", True) else (
        '<p class="note" id="gate-unverified">Decided here on the run as it lies, not '
        "verified: <code>qualify gate</code> verifies the signed evidence (signature, "
        "manifest, recomputed verdicts) before it decides.</p>")
    return (f'<div id="gate"><p class="result result-{"passed" if ok else "failed"}">'
            f'<strong>Gate: {"PASS" if ok else "FAIL"}</strong> (exit '
            f'{_e(gate.get("exit_code"))}) by {by}; required cells: {_e(counts)}</p>'
            + (f'<ul class="gate-offending">{items}</ul>' if items else "") + unverified
            + "</div>")


def _sealed_gate_line(sealed: Mapping[str, Any]) -> str:
    """The decision the report sealed at compare time (``report.json`` ``gate``)."""
    got = sealed.get("policy")
    pol: Mapping[str, Any] = got if isinstance(got, Mapping) else {}
    view = {"exit_code": sealed.get("exit_code", 1), "counts": sealed.get("counts", {}),
            "policy": pol.get("path"),
            "cells": [c for c in sealed.get("cells", []) if isinstance(c, Mapping)
                      and c.get("required")]}
    digest = str(pol.get("digest") or "")[:12]
    note = ('<p class="note" id="gate-sealed">The decision sealed with the run at compare '
            f"time{' (policy sha256 ' + _e(digest) + ')' if digest else ''}; "
            "<code>qualify gate</code> decides again under the current policy, on verified, "
            "fresh evidence.</p>")
    return _gate_line(view).replace("</div>", note + "</div>")


def _header(data: RunData, causes: Sequence[RootCause],
            gate: Mapping[str, Any] | None = None) -> list[str]:
    doc = data.doc
    passed = bool(doc.get("passed"))
    s = doc.get("summary", {})
    counts = ", ".join(f"{k} {v}" for k, v in s.get("cells", {}).items())
    sealed = doc.get("gate") if gate is None else None
    headline = _gate_line(gate) if gate is not None or not isinstance(sealed, Mapping) \
        else _sealed_gate_line(sealed)
    out = [f"<h1>Qualification report: {_e(doc.get('contract'))} / run "
           f"{_e(doc.get('run_id'))}</h1>", headline,
           f'<p class="result result-{"passed" if passed else "failed"}"><strong>Comparator '
           f'verdict (before the policy): {"PASSED" if passed else "FAILED"}</strong> '
           f"(cells: {_e(counts)})</p>",
           f'<p class="note">contract sha256 {_e(doc.get("contract_digest"))}; bounds.json '
           f'sha256 {_e(doc.get("bounds_digest"))}; lane {_e(doc.get("lane"))}; compared '
           f'{_e(doc.get("created"))}. Generated from {REPORT_JSON} and the stored tensors; '
           f"every row with its failure detail is in {REPORT_MD}.</p>",
           '<h2 id="root-causes-title">Root causes</h2>',
           '<p class="note">Per failing cell, the earliest failing quantity in causal order '
           "(round 1 before round 2; forward, losses, grads, grad_norm, clip_coef, lr, exp_avg / "
           "exp_avg_sq, updates; the sampler by its own chain); the cell's other failing rows "
           "are folded under it. A failing check (dtypes, replica) is listed beside the "
           "cause, never before it.</p>"]
    if not causes:
        return [*out, '<p id="root-causes-none">No failing cell.</p>']
    items = "".join(f'<li class="root-cause" data-cell="{_e(rc.cell)}">{_e(rc.line())}</li>'
                    for rc in causes)
    return [*out, f'<ol class="root-causes" id="root-causes">{items}</ol>']


def _families(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    """Trainer families (matrix order) and sampler families (first appearance)."""
    trainer: set[str] = set()
    sampler: list[str] = []
    for r in rows:
        fam = "padding" if r.get("variant") == "padded" else str(r.get("family"))
        if r.get("role") == SAMPLER_ROLE:
            if fam not in sampler:
                sampler.append(fam)
        else:
            trainer.add(fam)
    ordered = [c for c in MATRIX_COLUMNS if c in trainer] + sorted(trainer - set(MATRIX_COLUMNS))
    return ordered, sampler


def _heatmaps(data: RunData, figs: Figures) -> list[str]:
    heatmap_svg = _plots().heatmap_svg

    rows = data.rows
    trainer_fams, sampler_fams = _families(rows)
    cells = list(data.doc.get("cells", []))
    sampler_cells = [str(c["cell"]) for c in cells if c.get("role") == SAMPLER_ROLE]
    trainer_cells = [str(c["cell"]) for c in cells if c.get("role") != SAMPLER_ROLE]
    out = ['<h2 id="heatmaps-title">Margins: cells x families</h2>',
           '<p class="note">The worst margin (error / sealed bound, every comparison class '
           "and round) of each cell and family; above 1 fails. Grey: no row with a margin "
           "(NR: not run; a check without a margin shows its verdict).</p>"]
    for cells_of, fams, fid, title in ((trainer_cells, trainer_fams, "heatmap-trainer",
                                        "trainer cells"),
                                       (sampler_cells, sampler_fams, "heatmap-sampler",
                                        "sampler cells")):
        if not cells_of or not fams:
            continue
        margins, verdicts = family_margins(rows, cells_of, fams)
        out.append(_figure(figs.add(heatmap_svg, margins, verdicts, cells_of, fams,
                                    title=f"{title}: worst margin per family"),
                           fid, f"{title}: {len(cells_of)} cells x {len(fams)} families"))
    return out


def _token_plots(data: RunData, figs: Figures) -> list[str]:
    token_svg = _plots().token_svg

    out = ['<h2 id="tokens-title">Per-token error against the bound</h2>',
           '<p class="note">For the worst candidate-vs-HF row of each per-token family, '
           "|obtained - expected| at every valid response token of its worst sequences; "
           "the dashed line is the sealed bound.</p>"]
    drawn = 0
    for fam in PER_TOKEN_FAMILIES:
        row = worst_row(data.rows, (fam,))
        te = token_errors(data, row) if row is not None else None
        if row is None or te is None:
            continue
        check = ("the largest equals the row's stored error" if te.reproduces else
                 f"NOTE: the largest, {te.max_abs:.6g}, is not the row's stored error "
                 f"{row.get('error')}")
        out.append(_figure(figs.add(token_svg, te), f"tokens-{fam}",
                           f"{row['cell']} {row['metric']}: {len(te.sequences)} worst "
                           f"sequences; {check}."))
        drawn += 1
    if not drawn:
        out.append(f'<p class="note">No per-token tensors to draw. {_e(data.note)}</p>')
    return out


def _drawn_trainers(data: RunData, trainers: Sequence[str]) -> list[str]:
    """The Actor trainer cells whose distributions are drawn, in run order.

    Every cell with a failing distribution row, and for each distribution family and
    precision the cell with the largest ``kl_ref_cand_max`` margin (error / bound): the one
    nearest its ceiling. The others' values stay in ``report.json``
    ``distribution_positions``; each drawing costs about a second of CPU, and a run has
    dozens of Actor cells.
    """
    precision = {str(c.get("cell")): str(c.get("precision")) for c in data.doc.get("cells", [])}
    mine = set(trainers)
    worst: dict[tuple[str, str], tuple[float, str]] = {}
    keep: set[str] = set()
    for r in data.rows:
        cell = str(r.get("cell"))
        if r.get("class") != TRAINER_CLASS or cell not in mine:
            continue
        if r.get("verdict") == "FAIL":
            keep.add(cell)
        margin = r.get("margin")
        if r.get("statistic") == "kl_ref_cand_max" and isinstance(margin, int | float):
            key = (str(r.get("family")), precision.get(cell, ""))
            if key not in worst or float(margin) > worst[key][0]:
                worst[key] = (float(margin), cell)
    keep |= {cell for _, cell in worst.values()}
    return [c for c in trainers if c in keep]


def _distribution_plots(data: RunData, figs: Figures) -> list[str]:
    """The worst sequences' per-position values, one figure per cell and family.

    Every sampler cell's families, and those of the drawn Actor trainer cells
    (:func:`_drawn_trainers`).
    """
    kept = data.doc.get("distribution_positions")
    trainers = [str(c.get("cell")) for c in data.doc.get("cells", [])
                if c.get("role") == "actor" and c.get("status") == "COMPLETE"
                and isinstance(kept, Mapping) and kept.get(c.get("cell"))]
    drawn_trainers = _drawn_trainers(data, trainers)
    cells = [str(c.get("cell")) for c in data.doc.get("cells", [])
             if c.get("role") == SAMPLER_ROLE and c.get("status") == "COMPLETE"] + drawn_trainers
    if not cells:
        return []
    distribution_svg = _plots().distribution_svg
    out = ['<h2 id="distribution-title">Sampler distribution per position</h2>',
           '<p class="note">For each sampler cell and decode-path distribution row family '
           "(and each Actor trainer cell and prefill_* family: its own forward in place of "
           "the sampler's), "
           "the sampler (q) against the sealed HF reference (p) at every valid response "
           "position of its worst sequences (largest token KL(p || q)), as the comparator "
           "computed them for the rows: token KL both ways (log scale) with the sealed "
           "kl_ref_cand_max and kl_cand_ref_max bounds, the top-k set agreement, and the "
           "top-1 state (a disagreement within the sampler's own FP32 resolution of its "
           "top-2 gap is a tie, not counted as a mismatch).</p>"]
    if len(drawn_trainers) < len(trainers):
        out.append(f'<p class="note">Actor trainer cells drawn: {len(drawn_trainers)} of '
                   f"{len(trainers)}, those with a failing distribution row and, per family "
                   "and precision, the one nearest its kl_ref_cand_max ceiling. The others' "
                   "per-position values are in report.json distribution_positions.</p>")
    drawn = 0
    for cid in cells:
        for pd_ in position_distributions(data, cid):
            stored = pd_.stored.get("error") if pd_.stored is not None else None
            check = ("the largest equals the row's stored kl_ref_cand_max" if pd_.reproduces
                     else f"NOTE: the largest, {pd_.kl_max:.6g}, is not a stored "
                          f"kl_ref_cand_max ({stored})")
            lumped = (f" Top-k path (k = {pd_.k}): each KL is of the lumped distributions "
                      "(the shared top-k tokens and one bucket for the rest), a lower bound "
                      "on the true KL; the top-1 states and top-k agreement are exact."
                      if pd_.k is not None else "")
            out.append(_figure(figs.add(distribution_svg, pd_),
                               f"distribution-{cid}-{pd_.family}",
                               f"{cid} {pd_.family}: {len(pd_.sequences)} worst sequences; "
                               f"{check}.{lumped}"))
            drawn += 1
    if not drawn:
        rows = any(r.get("class") in DISTRIBUTION_CLASSES and r.get("error") is not None
                   for r in data.rows)
        why = ("this report was written before the comparator kept the per-position values "
               "(report.json distribution_positions); qualify compare on the run writes them"
               if rows else "the sampler cells or the reference hold none")
        out.append(f'<p class="note">No decode-path distributions to draw ({why}). '
                   f"{_e(data.note)}</p>")
    return out


def _param_plot(data: RunData, causes: Sequence[RootCause], figs: Figures) -> list[str]:
    param_svg = _plots().param_svg

    out = ['<h2 id="params-title">Per-parameter error of the worst cell</h2>']
    chain = [rc for rc in causes if rc.kind == "chain" and rc.role != SAMPLER_ROLE
             and isinstance(rc.margin, int | float)]
    if not chain:
        return [*out, '<p class="note">No failing trainer cell.</p>']
    worst = max(chain, key=lambda rc: float(rc.margin or 0.0))
    rnd = worst.round or 1
    panels = []
    for fam in PER_PARAM_FAMILIES:
        row = next((r for r in data.rows if r.get("cell") == worst.cell
                    and r.get("class") == "candidate_vs_hf" and r.get("family") == fam
                    and r.get("round") == rnd and not r.get("variant")), None)
        pe = param_errors(data, row) if row is not None else None
        if pe is not None:
            panels.append(pe)
    if not panels:
        return [*out, f'<p class="note">No per-parameter tensors of {_e(worst.cell)}. '
                f"{_e(data.note)}</p>"]
    off = [p.row["metric"] for p in panels if not p.reproduces]
    check = ("each panel's largest error equals its row's stored error" if not off else
             f"NOTE: not the stored error for {', '.join(off)} (an adjusted expected run, "
             "or sampled elements)")
    title = (f"{worst.cell}, round {rnd} (its root cause: {worst.metric}, margin "
             f"{_num(worst.margin)})")
    out.append(_figure(figs.add(param_svg, panels, title=title),
                       "params-worst", f"{worst.cell} round {rnd}: the 12 largest "
                                       f"per-parameter errors per family; {check}."))
    return out


def _rounds_plot(data: RunData, causes: Sequence[RootCause], figs: Figures) -> list[str]:
    rounds_svg = _plots().rounds_svg

    per_family = {f: round_margins(data.rows, f) for f in
                  ("logprobs", "entropy", "values", "losses", "grads", "grad_norm",
                   "clip_coef", "exp_avg", "exp_avg_sq", "updates")}
    per_family = {f: d for f, d in per_family.items() if d}
    if not per_family:
        return []
    return ['<h2 id="rounds-title">Error / bound round by round</h2>',
            _figure(figs.add(rounds_svg, per_family, {rc.cell for rc in causes}), "rounds",
                    "candidate-vs-HF margin of every cell per family and round (log scale); "
                    "the dashed line is the bound; failing cells in colour.")]


def _bound_of(data: RunData, rc: RootCause) -> Mapping[str, Any] | None:
    row = next((r for r in data.rows if r.get("cell") == rc.cell and r.get("class") == rc.klass
                and r.get("metric") == rc.metric), None)
    if row is None:
        return None
    klass, lane = row.get("bound_class"), data.lanes.get(rc.cell)
    return next((b for b in data.bounds if b.get("class") == klass
                 and b.get("precision") == lane and b.get("role") == row.get("role")
                 and b.get("round") == row.get("round") and b.get("family") == row.get("family")
                 and b.get("bound") == row.get("bound")), None)


def _bounds_tables(data: RunData, causes: Sequence[RootCause]) -> list[str]:
    out = ['<h2 id="bounds-title">Why each bound is what it is</h2>',
           '<p class="note">bound = k x max(control_error, resolution, propagated) + quantum + '
           "floor, sealed in the reference's bounds.json before any candidate ran (resolution: "
           "one FP32 ulp of a scalar; propagated: per-token control errors carried into a "
           "loss or the grad norm; quantum: one BF16 ulp of a BF16-emitted value): the "
           "control is two legitimate executions "
           "of the same computation (attention implementation, micro-batch partition, "
           "FP64 vs FP32), its error measured by the family's statistic.</p>"]
    rows = []
    for rc in causes:
        b = _bound_of(data, rc)
        if b is None:
            rows.append([rc.cell, rc.metric, rc.klass, "-", rc.statistic, None, "-", None, None,
                         None, None, None, None, rc.bound, rc.error, rc.margin])
            continue
        terms = [float(b.get(t, 0.0)) for t in ("resolution", "propagated", "quantum")]
        again = (float(b["k"]) * max(float(b["control_error"]), terms[0], terms[1])
                 + terms[2] + float(b["floor"]))
        rows.append([rc.cell, rc.metric, b.get("class"), b.get("precision"), b.get("statistic"),
                     b.get("k"), b.get("control"), b.get("control_error"), *terms,
                     b.get("floor"), again, b.get("bound"), rc.error, rc.margin])
    cols = ["cell", "root cause", "bound class", "lane", "statistic", "k", "control",
            "control error", "resolution", "propagated", "quantum", "floor", "rule again",
            "sealed bound", "error", "margin"]
    if rows:
        frame = pd.DataFrame([[_num(v) if not isinstance(v, str) else v for v in r]
                              for r in rows], columns=cols)
        out.append(_table(frame, "cause-bounds"))
    if data.bounds:
        full = pd.DataFrame([{k: b.get(k) for k in ("class", "precision", "role", "round",
                                                     "family", "statistic", "k", "control",
                                                     "control_error", "resolution",
                                                     "propagated", "quantum", "floor",
                                                     "bound")}
                             for b in data.bounds])
        out.append(f"<details><summary>every sealed bound ({len(data.bounds)})</summary>"
                   f"{_table(full, 'all-bounds')}</details>")
    else:
        out.append(f'<p class="note">bounds.json not read: {_e(data.note)}</p>')
    return out


FIELD_COLUMNS: Final = ("source", "precision", "n_valid", "mean_abs", "max_abs", "mean_signed",
                        "token_mult_prob_error", "k3_kl", "prob_pearson")


def _field_table(data: RunData) -> list[str]:
    fm = data.doc.get("field_metrics", {})
    out = ['<h2 id="field-title">Field mismatch (informational, not gated)</h2>',
           f'<p class="note">Round-1 teacher-forced logprobs against the sampler\'s behavior '
           f"logprobs (logprobs_mode = {_e(fm.get('logprobs_mode'))}; like-for-like: "
           f"{'yes' if fm.get('like_for_like') else 'NO'}). {_e(fm.get('note', ''))} "
           "token_mult_prob_error = mean exp(|d|) (NeMo-RL); k3 KL = mean exp(d) - d - 1; "
           "prob pearson: Pearson correlation of the token probabilities.</p>"]
    rows = fm.get("rows", [])
    if not rows:
        return [*out, '<p class="note">No source with round-1 actor logprobs.</p>']
    extra = sorted({k for r in rows for k in r} - set(FIELD_COLUMNS)
                   - {"logprobs_mode", "like_for_like", "n_nonfinite", "p99_abs", "worst"})
    cols = [*FIELD_COLUMNS, *extra]
    frame = pd.DataFrame([[r.get(c) if isinstance(r.get(c), str) else _num(r.get(c))
                           for c in cols] for r in rows], columns=cols)
    out.append(_table(frame, "field-metrics"))
    band = data.doc.get("clip_band")
    if not isinstance(band, list):
        out.append('<p class="note">The fraction of tokens whose ratio falls outside the PPO '
                   f"clip band is not in this {REPORT_JSON} (sealed before it was recorded); "
                   "it is not shown.</p>")
        return out
    out.append('<p class="note">Clip-band tail: the fraction of valid round-1 tokens whose '
               "ratio r = exp(lp_train - lp_gen) falls outside the PPO clip band "
               "[1 - clip_ratio, 1 + clip_ratio] (huggingface/trl #6789).</p>")
    band_cols = ("source", "precision", "clip_low", "clip_high", "tokens", "below", "above",
                 "fraction_outside")
    out.append(_table(pd.DataFrame(
        [[r.get(c) if isinstance(r.get(c), (str, int)) else _num(r.get(c)) for c in band_cols]
         for r in band if isinstance(r, Mapping)], columns=list(band_cols)), "clip-band"))
    return out


def _diverge(data: RunData, figs: Figures) -> list[str]:
    """The ``qualify diverge`` results beside the run, one figure and table per cell."""
    from qualify import jsonio, schema

    root = data.run_dir.parent / f"{data.run_dir.name}.diverge"
    files = sorted(root.glob("*/diverge.json")) if root.is_dir() else []
    if not files:
        return []
    out = ['<h2 id="diverge-title">First diverging module (qualify diverge)</h2>',
           '<p class="note">Each cell rerun with layer probes beside the HF reference of its '
           "lane: per module, max |engine - reference| of its output (forward) and of its "
           "output gradient (backward) on valid positions, against k x the largest control "
           "error of the same module + the floor.</p>"]
    for path in files:
        try:
            doc = jsonio.read_json(path)
        except (OSError, ValueError, QualifyError) as exc:
            out.append(f'<p class="note">{_e(path)}: not shown (unreadable: {_e(exc)})</p>')
            continue
        problem = schema.first_error(doc, "diverge")
        if problem is not None:
            out.append(f'<p class="note">{_e(path)}: not shown ({_e(problem)})</p>')
            continue
        cell, first = doc["cell"]["id"], doc["first"]
        line = ("none: every module within its bound" if first is None else
                f"{first['module']} ({first['direction']}): max_abs "
                f"{float(first['error']):.3g} > bound {float(first['bound']):.3g} "
                f"(margin {float(first['margin']):.3g})")
        out.append(f"<h3>{_e(cell)}, round {doc['round']} ({_e(doc['lane'])})</h3>"
                   f"<p>first diverging: <b>{_e(line)}</b></p>")
        out.append(_figure(figs.add(
            _plots().diverge_svg, doc["rows"], title=f"{cell}, round {doc['round']}",
            named=None if first is None else first["module"]),
            f"diverge-{cell}", "error / bound per module (dashed: the bound)"))
        frame = pd.DataFrame([{
            "direction": r["direction"], "module": r["module"], "error": r["error"],
            "bound": r["bound"], "margin": r["margin"], "control": r["control"] or "-",
            "power": r["power"], "exceeds": r["exceeds"]} for r in doc["rows"]])
        out.append(_table(frame, f"diverge-table-{cell}"))
    return out


def expected_not_run_html(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The section listing the rows the contract expects not run (none: no section).

    Such rows (``report.json`` rows with ``expected_not_run``) do not count in their cell's
    verdict; each is shown with the harness's reason and the contract's.
    """
    expected = [r for r in rows if r.get("expected_not_run")]
    if not expected:
        return []
    return ['<h2 id="expected-not-run-title">Rows the contract expects not run</h2>',
            "<ul>" + "".join(
                f"<li>{_e(r.get('cell'))} {_e(r.get('metric'))}: {_e(r.get('reason'))} "
                f"(expected by the contract: {_e(r.get('expected_not_run'))})</li>"
                for r in expected) + "</ul>"]


def render_html(data: RunData, gate: Mapping[str, Any] | None = None, *,
                workers: int | None = None) -> str:
    """The whole page for one run.

    Args:
        data: the run (:func:`qualify.compare.plotdata.load_run`).
        gate: the gate's decision to show under the result
            (:func:`qualify.pipeline.chain.gate_view`); ``None``: a note that none was
            applied.
        workers: processes that draw the figures (default
            :func:`qualify.compare.figures.default_workers`; 1: drawn in this process).

    Returns:
        The HTML text (UTF-8, self-contained; the same data gives the same text, whatever
        ``workers``).
    """
    causes = causes_of_report(data.doc)
    figs = Figures()
    body = [*_header(data, causes, gate), *_heatmaps(data, figs), *_token_plots(data, figs),
            *_distribution_plots(data, figs), *_param_plot(data, causes, figs),
            *_rounds_plot(data, causes, figs), *_bounds_tables(data, causes),
            *_field_table(data), *_diverge(data, figs)]
    body += expected_not_run_html(data.rows)
    notes = data.doc.get("notes", [])
    if notes:
        body += ['<h2 id="notes-title">Notes</h2>',
                 "<ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>"]
    title = f"qualify report: {data.doc.get('contract')} / {data.doc.get('run_id')}"
    return figs.fill("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                     f"<title>{_e(title)}</title><style>{CSS}</style></head><body>\n"
                     + "\n".join(body) + "\n</body></html>\n", workers=workers)


def write_html(run_dir: str | Path, out: str | Path | None = None, *,
               gate: Mapping[str, Any] | None = None,
               doc: Mapping[str, Any] | None = None) -> Path:
    """Render a run's page and write it atomically.

    Args:
        run_dir: the compared run (holds ``report.json``).
        out: where to write (default :func:`default_html_path`).
        gate: the gate's decision to show (see :func:`render_html`).
        doc: its ``report.json`` document when the caller has read and validated it
            (:func:`qualify.compare.plotdata.load_run`); ``None``: read here.

    Returns:
        The path written.

    Raises:
        UsageError: no readable ``report.json``.
        QualifyError: ``report.json`` violates its schema.
        EvidenceIntegrityError: ``out`` lies in a sealed directory (the run itself).
    """
    path = Path(out) if out is not None else default_html_path(run_dir)
    store.refuse_if_sealed(path)  # before the work: the run itself is sealed
    text = render_html(load_run(run_dir, doc=doc), gate)
    store.atomic_write_text(path, text)
    return path
