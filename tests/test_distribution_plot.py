"""report.html's per-position plot of a sampler cell's decode-path distribution rows.

The values come from the comparator's own call (:func:`distribution_rows` with ``positions``,
kept in ``report.json`` ``distribution_positions`` through :class:`Report`): built here in
memory for a full-vocabulary reference and a top-k one, with one sequence planted as the
worst and a near-tie planted in another. The figure draws the planted worst sequence first,
the tie as a tie, both bounds, and (top-k) the lumped-tail caveat; a report without
distribution rows, or written before the section existed, draws no figure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from qualify.compare import html
from qualify.compare.distribution import WORST_SEQUENCES, distribution_rows
from qualify.compare.figures import Figures
from qualify.compare.plotdata import RunData, position_distributions
from qualify.compare.verdicts import OPTIONAL_SECTIONS, CellResult, Report, Row
from qualify.distmetrics import STATISTICS, TOPK_STATISTICS, tie_resolution, topk_of
from qualify.reference.distribution import FLOORS
from qualify.schema import validate

B, R, V, K = 6, 7, 40, 8
CELL = "vllm-fp32-sampler-tp1"
WORST, WORST_T = 4, 5
TIE_B, TIE_T = 1, 2


def _lsm(x: np.ndarray) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(x), dim=-1).numpy().astype(np.float32)


def _inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Reference and sampler logprobs ``[B, R, V]``: small noise everywhere, one far position
    ``(WORST, WORST_T)``, a near-tie at ``(TIE_B, TIE_T)``; tokens, and a mask with a hole."""
    g = np.random.default_rng(7)
    logits = g.normal(0.0, 3.0, (B, R, V))
    ref = _lsm(logits)
    cand = _lsm(logits + g.normal(0.0, 0.02, logits.shape))
    cand[WORST, WORST_T] = _lsm(g.normal(0.0, 3.0, V))
    o = np.argsort(-ref[TIE_B, TIE_T], kind="stable")
    cand[TIE_B, TIE_T] = ref[TIE_B, TIE_T]
    cand[TIE_B, TIE_T, o[1]] = cand[TIE_B, TIE_T, o[0]]
    cand[TIE_B, TIE_T, o[0]] -= np.float32(tie_resolution(cand[TIE_B, TIE_T, o[0]]) / 2)
    mask = np.ones((B, R), dtype=np.int64)
    mask[0, 4:] = 0
    return ref, cand, g.integers(0, V, (B, R)), mask


def _bounds(stats: tuple[str, ...]) -> dict[str, Any]:
    return {s: {"bound": 0.05 + FLOORS[s], "control": "decode", "control_error": 0.0125,
                "k": 4.0, "floor": FLOORS[s]} for s in stats}


def _report(tmp: Path, *, topk: bool, positions: bool = True) -> dict[str, Any]:
    """``report.json`` of one sampler cell judged by the comparator's code on the inputs."""
    ref, cand, tokens, mask = _inputs()
    doc: dict[str, Any] = {"clip_ratio": 0.2}
    if topk:
        vals, ids = topk_of(ref, K)
        tok = np.take_along_axis(ref, tokens[..., None], -1)[..., 0]
        doc.update(topk={"k": K, "why": "test"}, raw={"bounds": _bounds(TOPK_STATISTICS)},
                   tempered={"bounds": _bounds(TOPK_STATISTICS)})
        save_file({f"{kind}_{n}": torch.from_numpy(np.array(a, copy=True))
                   for kind in ("raw", "tempered")
                   for n, a in (("topk_logprobs", vals), ("topk_ids", ids),
                                ("token_logprobs", tok))}, str(tmp / "distribution.safetensors"))
        cv, ci = topk_of(cand, K + 3)
        ct = np.take_along_axis(cand, tokens[..., None], -1)[..., 0]
        tensors = {f"round1/sampler/decode_{kind}_{n}": a for kind in ("raw", "tempered")
                   for n, a in (("topk_logprobs", cv), ("topk_ids", ci), ("logprobs", ct))}
    else:
        doc.update(raw={"bounds": _bounds(STATISTICS)}, tempered={"bounds": _bounds(STATISTICS)})
        save_file({"raw": torch.from_numpy(ref), "tempered": torch.from_numpy(ref.copy())},
                  str(tmp / "distribution.safetensors"))
        tensors = {"round1/sampler/decode_raw": cand, "round1/sampler/decode_tempered": ref}
    (tmp / "distribution.json").write_text(json.dumps(doc))
    kept: dict[str, Any] = {}
    rows = distribution_rows(cell=CELL, tensors=tensors, ref_dir=tmp, mask=mask,
                             responses=tokens, positions=kept if positions else None)
    return _document(rows, kept if positions else None)


def _document(rows: list[Row], kept: dict[str, Any] | None) -> dict[str, Any]:
    cell = CellResult(cell=CELL, engine="vllm", precision="fp32", options={}, role="sampler",
                      tp=1, status="COMPLETE", verdict="PASS", reason=None,
                      attempt=f"cells/{CELL}/attempt-1", required=True, counts={},
                      worst_margin=None)
    sections = OPTIONAL_SECTIONS if kept is not None else tuple(
        s for s in OPTIONAL_SECTIONS if s != "distribution_positions")
    rep = Report(contract="t", contract_digest="0" * 64, run_id="r", run_dir="run",
                 reference_dir="ref", reference_manifest_digest="0" * 64,
                 bounds_digest="0" * 64, lane="approximate", created="now", cells=(cell,),
                 rows=tuple(rows), logprobs_mode="processed", field_like_for_like=True,
                 field_note="n/a", field_metrics=(), sections=sections,
                 distribution_positions={CELL: kept} if kept else {})
    doc = json.loads(json.dumps(rep.to_dict(), allow_nan=False))  # as report.json holds it
    validate(doc, "report")
    return doc


def _data(tmp: Path, doc: dict[str, Any]) -> RunData:
    return RunData(run_dir=tmp / "run", doc=doc, ref_dir=None, bounds=(), mask=None, lanes={})


def _section(data: RunData) -> str:
    """The page's distribution section, its figures drawn (as render_html draws them)."""
    figs = Figures()
    return figs.fill("\n".join(html._distribution_plots(data, figs)), workers=1)


@pytest.mark.parametrize("topk", [False, True], ids=["full", "topk"])
def test_the_worst_sequence_is_drawn_with_its_bounds(tmp_path: Path, topk: bool) -> None:
    doc = _report(tmp_path, topk=topk)
    pds = position_distributions(_data(tmp_path, doc), CELL)
    fams = ["decode_raw_topk", "decode_tempered_topk"] if topk else ["decode_raw",
                                                                      "decode_tempered"]
    assert [p.family for p in pds] == fams
    pd_ = pds[0]
    assert pd_.k == (K if topk else None)
    assert len(pd_.sequences) == WORST_SEQUENCES
    worst = pd_.sequences[0]
    assert worst.b == WORST  # the planted far position's sequence
    assert int(worst.t[int(np.argmax(worst.kl_ref_cand))]) == WORST_T
    assert pd_.reproduces
    assert pd_.kl_max == float(pd_.stored["error"])  # type: ignore[index]
    assert pd_.bound == 0.05 + FLOORS["kl_ref_cand_max"]
    assert pd_.bound_cand_ref == 0.05 + FLOORS["kl_cand_ref_max"]
    maxima = [float(np.max(q.kl_ref_cand)) for q in pd_.sequences]
    assert maxima == sorted(maxima, reverse=True)
    tie = next(q for q in pd_.sequences if q.b == TIE_B)
    assert tie.top1[list(tie.t).index(TIE_T)] == "tie"
    page = _section(_data(tmp_path, doc))
    for fam in fams:
        assert f'id="distribution-{CELL}-{fam}"' in page
    assert page.count("<svg") == 2
    assert "equals the row&#x27;s stored kl_ref_cand_max" in page
    assert "KL(q‖p)" in page
    assert "tie" in page
    assert ("a lower bound on the true KL" in page) is topk
    assert ("lumped token KL" in page) is topk
    assert len(json.dumps(doc["distribution_positions"])) < 12_000  # worst sequences only


def test_a_drawing_that_is_not_the_judged_row_says_so(tmp_path: Path) -> None:
    doc = _report(tmp_path, topk=False)
    for r in doc["rows"]:
        if r["family"] == "decode_raw" and r["statistic"] == "kl_ref_cand_max":
            r["error"] += 1e-3
    (pd_, _) = position_distributions(_data(tmp_path, doc), CELL)
    assert not pd_.reproduces
    assert "NOTE: the largest" in _section(_data(tmp_path, doc))


def test_without_distribution_rows_there_is_no_figure(tmp_path: Path) -> None:
    doc = _document([], {})  # a sampler cell against a reference without distribution rows
    assert "distribution_positions" in doc
    assert position_distributions(_data(tmp_path, doc), CELL) == []
    page = _section(_data(tmp_path, doc))
    assert "<svg" not in page
    assert 'id="distribution-' not in page.replace('id="distribution-title"', "")
    assert "the sampler cells or the reference hold none" in page
    doc["cells"] = []  # no sampler cell: no section at all
    assert html._distribution_plots(_data(tmp_path, doc), Figures()) == []


def test_a_report_from_before_the_section_says_so(tmp_path: Path) -> None:
    doc = _report(tmp_path, topk=False, positions=False)
    assert "distribution_positions" not in doc
    page = _section(_data(tmp_path, doc))
    assert "<svg" not in page
    assert "written before the comparator kept the per-position values" in page


def test_the_comparator_keeps_what_its_rows_aggregate(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``compare_run`` on a sampler cell against a reference with distribution rows: the
    report holds ``distribution_positions`` (schema-valid), whose worst sequence's largest KL
    is the judged ``kl_ref_cand_max``; a report recomputed without the section (one sealed
    before it) has no such key and the same rows."""
    import test_compare
    from test_compare import SAMPLER, TP1, World, _sampler_meta

    b, r = test_compare.B, test_compare.R
    g = np.random.default_rng(3)
    ref = _lsm(g.normal(0.0, 3.0, (b, r, V)))
    cand = _lsm(ref.astype(np.float64) + g.normal(0.0, 0.02, (b, r, V)))
    valid = np.argwhere(np.asarray(test_compare.MASK) != 0)
    wb, wt = (int(x) for x in valid[len(valid) // 2])
    cand[wb, wt] = _lsm(g.normal(0.0, 3.0, V))  # the planted worst position
    seal = test_compare.store.seal

    def seal_with(path: Path, *, kind: str) -> Any:
        if kind == "reference":
            (path / "distribution.json").write_text(json.dumps(
                {"clip_ratio": 0.2, "raw": {"bounds": _bounds(STATISTICS)},
                 "tempered": {"bounds": _bounds(STATISTICS)}}))
            save_file({"raw": torch.from_numpy(ref), "tempered": torch.from_numpy(ref.copy())},
                      str(path / "distribution.safetensors"))
        return seal(path, kind=kind)

    monkeypatch.setattr(test_compare.store, "seal", seal_with)
    w = World(tmp_path, required=[TP1])
    w.add_cell(TP1)
    w.add_cell(SAMPLER, outputs={"round2/sampler/logprobs": w.hf["fp32"][
        "round2/actor/logprobs"].copy(), "round1/sampler/decode_raw": cand,
        "round1/sampler/decode_tempered": cand.copy()}, meta=_sampler_meta(0))
    w.cells[SAMPLER]["weights_from"] = TP1
    report = w.compare(write=False)
    doc = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    validate(doc, "report")
    kept = doc["distribution_positions"][SAMPLER]
    assert set(kept) == {"decode_raw", "decode_tempered"}
    (row,) = [x for x in doc["rows"] if x["cell"] == SAMPLER and x["family"] == "decode_raw"
              and x["statistic"] == "kl_ref_cand_max"]
    worst = kept["decode_raw"]["sequences"][0]
    assert worst["b"] == wb
    assert worst["t"][int(np.argmax(worst["kl_ref_cand"]))] == wt
    assert max(worst["kl_ref_cand"]) == row["error"]
    before = tuple(s for s in OPTIONAL_SECTIONS if s != "distribution_positions")
    old = w.compare(write=False, sections=before)
    assert "distribution_positions" not in old.to_dict()
    assert [x.to_dict() for x in old.rows] == [x.to_dict() for x in report.rows]


def test_the_drawn_trainer_cells_are_the_failing_and_the_nearest_their_ceiling(
        tmp_path: Path) -> None:
    """Of the Actor trainer cells, report.html draws every one with a failing distribution
    row and, per family and precision, the one with the largest ``kl_ref_cand_max`` margin;
    the rest are only in ``report.json`` (drawing each costs about a second of CPU)."""
    cells = {"a-fp32-tp1": "fp32", "a-fp32-tp2": "fp32", "a-bf16-tp1": "bf16",
             "a-bf16-tp2": "bf16", "a-bf16-tp4": "bf16"}
    margins = {  # kl_ref_cand_max margin per cell and family
        ("a-fp32-tp1", "prefill_raw"): 0.1, ("a-fp32-tp2", "prefill_raw"): 0.3,
        ("a-fp32-tp1", "prefill_tempered"): 0.4, ("a-fp32-tp2", "prefill_tempered"): 0.2,
        ("a-bf16-tp1", "prefill_raw"): 0.5, ("a-bf16-tp2", "prefill_raw"): 0.1,
        ("a-bf16-tp1", "prefill_tempered"): 0.6, ("a-bf16-tp2", "prefill_tempered"): 0.2,
        ("a-bf16-tp4", "prefill_raw"): 0.0, ("a-bf16-tp4", "prefill_tempered"): 0.0}
    rows = [{"cell": c, "class": "trainer_distribution", "family": f,
             "statistic": "kl_ref_cand_max", "margin": m, "verdict": "PASS"}
            for (c, f), m in margins.items()]
    rows.append({"cell": "a-bf16-tp4", "class": "trainer_distribution",
                 "family": "prefill_raw", "statistic": "top1_mismatch", "margin": None,
                 "verdict": "FAIL"})
    rows.append({"cell": "a-bf16-tp2", "class": "candidate_vs_hf", "family": "grads",
                 "statistic": "max_rel_l2", "margin": 9.0, "verdict": "FAIL"})  # not drawn for
    doc = {"cells": [{"cell": c, "precision": p, "role": "actor", "status": "COMPLETE"}
                     for c, p in cells.items()], "rows": rows}
    drawn = html._drawn_trainers(_data(tmp_path, doc), list(cells))
    assert drawn == ["a-fp32-tp1", "a-fp32-tp2", "a-bf16-tp1", "a-bf16-tp4"]
