"""Rows a harness or a contract declares not run, and how they count in a cell's verdict.

The class of defect: a check that could not fail passing for one that ran, or a cell that
could never pass for a row its engine cannot run. A contract's ``matrix.expected_not_run``
lets a cell whose only ``NOT_RUN`` rows it expects take its verdict from the rows that ran
(listed in report.json, report.md, report.html and the JUnit testcase); any other
``NOT_RUN`` row still makes the cell ``NOT_RUN``, and a ``FAIL`` anywhere still fails it.
A harness whose stack returns its loss whole (TRL) reports ``loss/total`` and declares the
other terms (:func:`qualify.compare.rows.declared_terms`): its ``losses`` row is then
measured on the terms it reported, so a wrong total still fails it, and a term missing
without a declaration is still an infinite error (``FAIL``), never a skipped one.
"""

from __future__ import annotations

import json
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_compare
from hypothesis import given, settings
from hypothesis import strategies as st

from qualify.bounds import Bound
from qualify.compare.html import expected_not_run_html
from qualify.compare.rows import compare_rows, declared_not_run, declared_terms
from qualify.contract import Contract
from qualify.errors import ContractError
from qualify.evidence import junit, store
from qualify.evidence.policy import Policy, evaluate
from qualify.protocol import ACTOR_LOSS_TERMS
from qualify.statistics import MetricKey

MASK = np.ones((2, 3), dtype=np.int64)
BOUND = 1e-3
REASON = "the stack returns one loss"


def _bounds(rounds: int = 2) -> list[Bound]:
    return [Bound(precision="fp32", klass="candidate_vs_hf",
                  key=MetricKey(round=r, role="actor", family="losses"), statistic="max_abs",
                  control_error=0.0, control="fp64", floor=BOUND, k=4.0, bound=BOUND)
            for r in range(1, rounds + 1)]


def _losses(values: dict[str, float], round_: int = 1) -> dict[str, Any]:
    return {f"round{round_}/actor/loss/{t}": np.asarray(v, dtype=np.float32)
            for t, v in values.items()}


def _rows(obtained: dict[str, Any], expected: dict[str, Any],
          meta: dict[str, Any] | None) -> list[Any]:
    return compare_rows(cell="trl-fp32-actor-tp1", klass="candidate_vs_hf", precision="fp32",
                        bounds=_bounds(), obtained=obtained, expected=expected, mask=MASK,
                        meta=meta, power_cache={})


TERMS = st.fixed_dictionaries({t: st.floats(-10, 10, width=32) for t in ACTOR_LOSS_TERMS})


@settings(max_examples=20, deadline=None, derandomize=True)
@given(want=TERMS, reported=st.sets(st.sampled_from(ACTOR_LOSS_TERMS), min_size=1),
       declared=st.sets(st.sampled_from(ACTOR_LOSS_TERMS)),
       off=st.sampled_from([0.0, 0.5 * BOUND, 10 * BOUND]), whole=st.booleans())
def test_a_losses_row_is_measured_on_the_reported_terms_only_when_the_rest_is_declared(
        want: dict[str, float], reported: set[str], declared: set[str], off: float,
        whole: bool) -> None:
    """Reported terms judged under the family's bound; an undeclared gap is a FAIL."""
    got = {t: want[t] + off for t in reported}
    entry: dict[str, Any] = {"round": None, "family": "losses", "reason": REASON}
    if not whole:
        entry["terms"] = sorted(declared)
    meta = {"not_run": [entry]} if declared or whole else None
    (row,) = _rows(_losses(got), _losses(want), meta)
    missing = set(ACTOR_LOSS_TERMS) - reported
    covered = not missing or (not whole and missing <= declared)
    worst = max(abs(np.float32(want[t] + off) - np.float32(want[t])) for t in reported)
    if not covered:  # a term missing and not declared: never judged on the rest
        assert row.verdict == "FAIL", row
        assert row.error == float("inf"), row
    else:
        assert row.verdict == ("PASS" if worst <= BOUND else "FAIL"), row
        assert row.error == pytest.approx(worst, abs=1e-6)
        if missing:
            assert f"{', '.join(sorted(missing))} declared not reported: {REASON}" in row.where
            assert f"[{', '.join(sorted(reported))} compared;" in row.where


def test_a_terms_entry_declares_the_terms_never_the_family() -> None:
    """The whole family absent with only a terms entry is a FAIL, not NOT_RUN."""
    meta = {"not_run": [{"round": None, "family": "losses", "terms": ["policy", "kl"],
                         "reason": REASON}]}
    assert declared_not_run(meta, 1, "losses") is None
    assert declared_terms(meta, 1, ["policy", "kl"]) == REASON
    assert declared_terms(meta, 1, ["policy", "entropy"]) is None
    want = _losses(dict.fromkeys(ACTOR_LOSS_TERMS, 1.0))
    (row,) = _rows({}, want, meta)
    assert row.verdict == "FAIL"
    round2 = {"not_run": [{"round": 2, "family": "losses", "terms": ["policy", "kl",
                                                                     "entropy"],
                           "reason": REASON}]}
    (row,) = _rows(_losses({"total": 1.0}), want, round2)  # declared for round 2 only
    assert row.verdict == "FAIL"
    assert row.error == float("inf")


# --------------------------------------------------------------------------- the contract's


GRADS_WHY = "this engine's optimizer state is not reachable"


def _expecting(monkeypatch: pytest.MonkeyPatch, entries: list[dict[str, Any]]) -> None:
    """Make test_compare's World build its contract with ``matrix.expected_not_run``."""
    def make(required: list[str] | None = None) -> Contract:
        doc = tomllib.loads(test_compare.torch_tp_only_text())
        if required is not None:
            doc["matrix"]["required_cells"] = required
        if entries:
            doc["matrix"]["expected_not_run"] = entries
        return Contract.from_dict(doc)
    monkeypatch.setattr(test_compare, "make_contract", make)


def _grads_not_run(w: test_compare.World, *, also: tuple[str, ...] = (),
                   off: float = 0.0) -> None:
    """TP 1 without its ``grads`` (and ``also``), declared by the harness; ``off`` moves
    its round-1 logprobs."""
    out = {k: v for k, v in test_compare.actor(w).items()
           if not any(f"/actor/{f}/" in k for f in ("grads", *also))}
    out["round1/actor/logprobs"] = out["round1/actor/logprobs"] + off
    decl = [{"round": None, "family": f, "reason": "the harness cannot read it"}
            for f in ("grads", *also)]
    w.add_cell(test_compare.TP1, outputs=out,
               meta={**test_compare.good_meta(), "not_run": decl})


@pytest.mark.parametrize(("expected", "also", "off", "verdict"), [
    ([], (), 0.0, "NOT_RUN"),  # nothing expected: a NOT_RUN row makes the cell NOT_RUN
    ([{"engine": "torch_tp", "family": "grads", "reason": GRADS_WHY}], (), 0.0, "PASS"),
    ([{"engine": "torch_tp", "family": "grads", "reason": GRADS_WHY}], (), 1.0, "FAIL"),
    ([{"engine": "torch_tp", "family": "grads", "reason": GRADS_WHY}], ("exp_avg",), 0.0,
     "NOT_RUN"),  # another NOT_RUN row the contract does not expect
    ([{"engine": "torch_tp", "family": "grads", "round": 2, "reason": GRADS_WHY}], (), 0.0,
     "NOT_RUN"),  # round 1's grads are not expected
], ids=["none", "expected", "expected-other-row-fails", "other-not-run", "other-round"])
def test_a_cell_whose_only_not_run_rows_the_contract_expects_is_judged_by_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, expected: list[dict[str, Any]],
        also: tuple[str, ...], off: float, verdict: str) -> None:
    _expecting(monkeypatch, expected)
    w = test_compare.World(tmp_path, required=[test_compare.TP1])
    _grads_not_run(w, also=also, off=off)
    report = w.compare()
    assert report.verdicts[test_compare.TP1] == verdict
    rows = test_compare.rows_of(report, test_compare.TP1)
    grads = [r for r in rows if r.family == "grads"]
    assert {r.verdict for r in grads} == {"NOT_RUN"}  # still listed, as not run
    marked = [r for r in rows if r.expected_not_run is not None]
    if verdict == "PASS" or (expected and expected[0].get("round") is None):
        assert marked == grads
        assert all(r.expected_not_run == GRADS_WHY for r in marked)
    doc = json.loads((w.run_dir / "report.json").read_text())  # schema-valid as written
    md = (w.run_dir / "report.md").read_text()
    policy = Policy(contract=w.contract.name, path=None, digest=None,
                    required=(test_compare.TP1,))
    (outcome,) = evaluate(doc, policy).cells
    assert outcome.ok is (verdict == "PASS"), outcome
    if marked:
        assert f"(expected by the contract: {GRADS_WHY})" in md
        assert outcome.expected_not_run
        suite = ET.Element("testsuite")
        junit._cell_case(suite, "c", outcome)
        out = suite.find("testcase/system-out")
        assert out is not None
        assert out.text is not None
        assert GRADS_WHY in out.text
        html = "".join(expected_not_run_html(doc["rows"]))  # render_html's section
        assert "Rows the contract expects not run" in html
        assert html.count("<li>") == len(marked)
    else:
        assert outcome.expected_not_run == ()
    store.make_writable(tmp_path)


def test_an_expected_family_that_ran_and_failed_fails_the_cell(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The expectation excuses a row not run, never a row that ran."""
    _expecting(monkeypatch, [{"engine": "torch_tp", "family": "grads", "reason": GRADS_WHY}])
    w = test_compare.World(tmp_path, required=[test_compare.TP1])
    out = test_compare.actor(w)
    out["round1/actor/grads/model.w"] = out["round1/actor/grads/model.w"] * 2.0
    w.add_cell(test_compare.TP1, outputs=out, meta=test_compare.good_meta())
    report = w.compare(write=False)
    assert report.verdicts[test_compare.TP1] == "FAIL"
    assert not any(r.expected_not_run for r in test_compare.rows_of(report, test_compare.TP1))


def test_an_expectation_of_an_engine_outside_the_matrix_is_refused_naming_the_field() -> None:
    doc = tomllib.loads(test_compare.torch_tp_only_text())
    doc["matrix"]["expected_not_run"] = [{"engine": "fsdp2", "family": "grads",
                                          "reason": GRADS_WHY}]
    with pytest.raises(ContractError, match=r"matrix\.expected_not_run\[0\]\.engine"):
        Contract.from_dict(doc)
    doc["matrix"]["expected_not_run"] = [{"engine": "torch_tp", "family": "grads"}]
    with pytest.raises(ContractError, match="reason"):
        Contract.from_dict(doc)


def test_a_contract_without_expectations_keeps_its_digest() -> None:
    """The field is optional: a contract that does not write it is the document it was."""
    doc = tomllib.loads(test_compare.torch_tp_only_text())
    plain = Contract.from_dict(doc)
    assert plain.matrix.expected_not_run == ()
    assert "expected_not_run" not in plain.to_dict()["matrix"]
    doc["matrix"]["expected_not_run"] = [{"engine": "torch_tp", "family": "rewards",
                                          "reason": "no reward model"}]
    assert Contract.from_dict(doc).digest != plain.digest
