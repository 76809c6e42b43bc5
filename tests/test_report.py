"""Tests of qualify.compare.report: report.json against its schema, report.md content, atomicity."""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from test_compare import BF16_TP1, CRITIC_TP1, TP1, TP2, World, actor, good_meta

from qualify.compare.report import matrix_frame, render_markdown, report_document
from qualify.compare.verdicts import Report
from qualify.errors import QualifyError
from qualify.evidence import store
from qualify.layout import REPORT_JSON, REPORT_MD
from qualify.resources import load_schema

VALIDATOR = jsonschema.Draft202012Validator(load_schema("report"))


@pytest.fixture(autouse=True)
def _writable(tmp_path: Path) -> Iterator[None]:
    yield
    store.make_writable(tmp_path)


@pytest.fixture
def failing(tmp_path: Path) -> tuple[World, Report]:
    """TP1 fails logprobs at (1, 2); TP2 is identical to HF (so also fails vs TP1);
    a bf16 cell has a BF16 optimizer state; one cell not run, one harness error.
    Required: the cells that ran (the NOT_RUN cell is excluded by ``required_cells``)."""
    w = World(tmp_path, required=[TP1, TP2, BF16_TP1, CRITIC_TP1])
    out = actor(w)
    out["round1/actor/logprobs"][1, 2] += 2e-3
    out["round1/actor/logprobs_padded"][1, 2] += 2e-3
    w.add_cell(TP1, outputs=out)
    w.add_cell(TP2)
    meta = good_meta()
    meta["dtypes"]["optimizer_state"]["exp_avg_sq"] = "torch.bfloat16"
    w.add_cell(BF16_TP1, meta=meta)
    w.add_cell("torch_tp-bf16-actor-tp2", status="NOT_RUN", reason="needs 2 GPUs")
    w.add_cell(CRITIC_TP1, status="ERROR", reason="segfault")
    return w, w.compare()


def test_report_json_validates_and_carries_the_digests(failing: tuple[World, Report]) -> None:
    w, report = failing
    doc = json.loads((w.run_dir / REPORT_JSON).read_text())
    VALIDATOR.validate(doc)
    assert doc == json.loads(json.dumps(report_document(report)))
    assert doc["passed"] is False
    assert doc["contract_digest"] == w.contract.digest
    assert doc["reference"]["manifest_digest"] == store.manifest_digest(w.ref)
    assert doc["bounds_digest"] == store.sha256_file(w.ref / "bounds.json")
    assert {c["cell"]: c["verdict"] for c in doc["cells"]} == {
        TP1: "FAIL", TP2: "FAIL", BF16_TP1: "FAIL", "torch_tp-bf16-actor-tp2": "NOT_RUN",
        CRITIC_TP1: "ERROR"}
    row = next(r for r in doc["rows"] if r["cell"] == TP1 and r["class"] == "candidate_vs_hf"
               and r["metric"] == "round1/actor/logprobs")
    assert set(row) >= {"cell", "class", "round", "role", "family", "statistic", "error",
                        "bound", "margin", "verdict", "reason", "where"}
    assert (row["verdict"], row["where"], row["round"], row["role"]) == (
        "FAIL", "(1, 2)", 1, "actor")
    assert row["detail"]["table"][0][0] == "(1, 2)"
    fm = doc["field_metrics"]
    assert fm["gated"] is False
    assert fm["logprobs_mode"] == "processed"
    assert fm["like_for_like"] is False
    assert "NOT like-for-like" in fm["note"]
    assert [r["source"] for r in fm["rows"]] == ["hf-fp32", "hf-bf16", TP1, TP2, BF16_TP1]


def test_infinite_numbers_are_json_strings(tmp_path: Path) -> None:
    w = World(tmp_path)
    out = actor(w)
    del out["round1/actor/grads/model.w"]
    w.add_cell(TP1, outputs=out)
    w.compare()
    doc = json.loads((w.run_dir / REPORT_JSON).read_text())
    VALIDATOR.validate(doc)
    row = next(r for r in doc["rows"] if r["metric"] == "round1/actor/grads")
    assert (row["error"], row["margin"], row["verdict"]) == ("inf", "inf", "FAIL")


def test_report_md_leads_with_the_decision_then_details(failing: tuple[World, Report]) -> None:
    w, report = failing
    md = (w.run_dir / REPORT_MD).read_text()
    assert md == render_markdown(report)
    head = md.splitlines()[2]
    assert head.startswith("**Gate decision: FAIL** (exit 1) without a gate policy file (the "
                           "comparator's verdict decides)")
    assert f"`{TP1}` (FAIL)" in head
    assert "Comparator verdict (before the policy): FAILED" in md
    sections = ["## Root causes", "## Cells", "## Expected failures", "## Failures",
                "## Errors and checks not run", "## Field mismatch (informational, not gated)"]
    assert [md.index(s) for s in sections] == sorted(md.index(s) for s in sections)
    cells = md[md.index("## Cells"):md.index("## Expected failures")]
    assert re.search(rf"\| {TP1} +\| FAIL +\| FAIL +\| 1 +\| 21 +\| 2 +\| round 1 actor "
                     "logprobs", cells), cells
    failures = md[md.index("## Failures"):md.index("## Errors and checks not run")]
    assert f"`{TP1}` · candidate_vs_hf · `round1/actor/logprobs`" in failures
    assert "Mismatched elements: 1 / 9" in failures
    assert "Max absolute difference: 0.002" in failures
    assert "| (1, 2)  |" in failures
    assert "optimizer_state.exp_avg_sq is torch.bfloat16" in failures
    assert "segfault" in md
    assert "needs 2 GPUs" in md
    assert "token_mult_prob_error" in md
    assert "NOT like-for-like" in md


def test_report_md_expected_failures_are_one_line_and_details_are_capped(
        failing: tuple[World, Report]) -> None:
    """A cell the policy expects to fail: one line, no row detail; a cell it fails: at most
    ROW_DETAILS_PER_CELL detail blocks, the rest counted."""
    import dataclasses

    from qualify.compare.report import ROW_DETAILS_PER_CELL
    from qualify.evidence.decision import decision_section
    from qualify.evidence.policy import all_cells, policy_from_document

    w, report = failing
    doc = {"schema_version": 1, "contract": w.contract.name, "expected_failures": [
        {"cells": TP1, "families": ["logprobs"], "max_margin": 1e9, "reason": "planted r",
         "upstream": "https://example.org/1"}]}
    policy = policy_from_document(doc, w.contract, path="p.toml")
    gate = decision_section(report.to_dict(), policy, all_cells(w.contract))
    md = render_markdown(dataclasses.replace(report, gate=gate))
    expected = md[md.index("## Expected failures"):md.index("## Failures")]
    (line,) = [x for x in expected.splitlines() if x.startswith("- ")]
    assert line.startswith(f"- {TP1}: 1 failing rows, worst margin 2; ")
    assert line.endswith("planted r (https://example.org/1)")
    failures = md[md.index("## Failures"):md.index("## Errors and checks not run")]
    assert f"`{TP1}`" not in failures
    many = tuple(dataclasses.replace(r, where=f"(9, {i})")
                 for r in report.rows if r.cell == TP1 and r.verdict == "FAIL"
                 for i in range(ROW_DETAILS_PER_CELL))
    big = dataclasses.replace(report, rows=report.rows + many)
    md = render_markdown(dataclasses.replace(big, gate=decision_section(
        big.to_dict(), policy_from_document({**doc, "expected_failures": []}, w.contract,
                                            path="p.toml"), all_cells(w.contract))))
    failures = md[md.index("## Failures"):md.index("## Errors and checks not run")]
    n = sum(r.cell == TP1 and r.verdict == "FAIL" for r in big.rows)
    assert failures.count(f"`{TP1}` · ") == ROW_DETAILS_PER_CELL
    assert f"`{TP1}`: {n - ROW_DETAILS_PER_CELL} more failing rows in `report.json`." \
        in failures


def test_matrix_frame(failing: tuple[World, Report]) -> None:
    _, report = failing
    frame = matrix_frame(report)
    assert list(frame.index) == [c.cell for c in report.cells]
    assert frame.loc[TP1, "verdict"] == "FAIL (required)"
    assert frame.loc[TP1, "logprobs"] == "FAIL 2"
    assert frame.loc[TP1, "grads"] == "PASS 0"
    assert frame.loc[BF16_TP1, "dtypes"] == "FAIL"
    assert frame.loc["torch_tp-bf16-actor-tp2", "verdict"] == "NOT_RUN"


def test_rewrite_is_atomic_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    w = World(tmp_path, required=[TP1])
    w.add_cell(TP1)
    first = w.compare()
    second = w.compare()
    assert first.passed
    assert second.passed
    assert sorted(p.name for p in w.run_dir.iterdir()) == ["cells", REPORT_JSON, REPORT_MD,
                                                           "run.json"]


def _valid_doc(tmp_path: Path) -> dict[str, Any]:
    w = World(tmp_path)
    out = actor(w)
    out["round2/actor/entropy"][0, 0] += 1.0
    w.add_cell(TP1, outputs=out)
    return report_document(w.compare(write=False))


def _pass_row(doc: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in doc["rows"] if r["verdict"] == "PASS")


def _fail_row(doc: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in doc["rows"] if r["verdict"] == "FAIL")


INVALID: dict[str, Callable[[dict[str, Any]], Any]] = {
    "unknown top-level key": lambda d: d.update(extra=1),
    "missing bounds digest": lambda d: d.pop("bounds_digest"),
    "short contract digest": lambda d: d.update(contract_digest="abc"),
    "PASS row with a reason": lambda d: _pass_row(d).update(reason="why"),
    "FAIL row without reason": lambda d: _fail_row(d).update(reason=None),
    "FAIL row without detail": lambda d: _fail_row(d).update(detail=None),
    "unknown verdict": lambda d: _pass_row(d).update(verdict="OK"),
    "unknown class": lambda d: _pass_row(d).update({"class": "vibes"}),
    "negative bound": lambda d: _pass_row(d).update(bound=-1.0),
    "NaN-as-number error": lambda d: _pass_row(d).update(error="NaN"),
    "field metrics gated": lambda d: d["field_metrics"].update(gated=True),
    "cell without reason while failing": lambda d: d["cells"][0].update(reason=None),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_schema_rejects_invalid_documents(tmp_path: Path, case: str) -> None:
    doc = _valid_doc(tmp_path)
    VALIDATOR.validate(doc)
    bad = copy.deepcopy(doc)
    INVALID[case](bad)
    assert not VALIDATOR.is_valid(bad), case


def test_write_report_validates_once_and_writes_nothing_invalid(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qualify import schema
    from qualify.compare import report as report_mod

    w = World(tmp_path)
    w.add_cell(TP1, outputs=actor(w))
    good = w.compare(write=False)
    seen: list[str] = []
    real = schema.first_error

    def counting(obj: Any, name: str) -> str | None:
        seen.append(name)
        return real(obj, name)

    monkeypatch.setattr(schema, "first_error", counting)  # every validate() goes through it
    report_mod.write_report(good, w.run_dir)
    assert seen == ["report"]  # once: a 1 MB report.json takes seconds to validate
    for p in (w.run_dir / REPORT_JSON, w.run_dir / REPORT_MD):
        p.unlink()
    bad = report_document(good)
    bad["passed"] = "yes"
    monkeypatch.setattr(Report, "to_dict", lambda self: bad)
    with pytest.raises(QualifyError, match="passed"):
        report_mod.write_report(good, w.run_dir)
    assert not (w.run_dir / REPORT_JSON).exists()
    assert not (w.run_dir / REPORT_MD).exists()


def test_margin_of_a_failing_row_is_finite_or_inf(failing: tuple[World, Report]) -> None:
    _, report = failing
    for r in report.failures:
        assert r.margin is None or r.margin > 1 or math.isinf(r.margin)


def test_report_without_coverage_says_so_and_has_power_rows(
        failing: tuple[World, Report]) -> None:
    """The test world's reference has no coverage.json (sealed before it existed)."""
    _, report = failing
    doc = report_document(report)
    assert doc["coverage"] == {"recorded": False, "note": doc["coverage"]["note"],
                               "rules": [], "no_power": []}
    md = render_markdown(report)
    assert "Coverage not recorded: the reference was sealed before coverage.json existed." in md
    fams = doc["power"]["families"]
    with_bound = [r for r in doc["rows"] if r["power"] is not None]
    assert sum(f["rows"] for f in fams.values()) == len(with_bound) > 0
    assert all(r["bound"] is not None for r in with_bound)
    assert all(r["power"] is None for r in doc["rows"] if r["class"] in ("dtypes",
                                                                          "replica_consistency"))
    lacking = {(r["cell"], r["class"], r["metric"]) for r in doc["power"]["without_power"]}
    assert lacking == {(r["cell"], r["class"], r["metric"]) for r in with_bound
                       if not r["power"]["has_power"]}
    assert "## Power check" in md


def test_report_lists_no_power_rules(failing: tuple[World, Report]) -> None:
    import dataclasses

    _, report = failing
    rules = [{"rule": "policy_lower_clipped", "label": "fp32", "role": "actor", "round": 2,
              "count": 0, "total": 42, "exercised": False,
              "absent": "no token on the lower policy clip edge"},
             {"rule": "adamw_betas", "label": None, "role": None, "round": None, "count": 1,
              "total": 1, "exercised": True, "absent": "AdamW betas are the library default"}]
    again = dataclasses.replace(report, coverage={"rules": rules})
    doc = report_document(again)
    assert doc["coverage"]["no_power"] == [
        "NO POWER: no token on the lower policy clip edge (round 2, actor, fp32)"]
    md = render_markdown(again)
    assert "1 of 2 rules exercised." in md
    assert "- NO POWER: no token on the lower policy clip edge (round 2, actor, fp32)" in md
