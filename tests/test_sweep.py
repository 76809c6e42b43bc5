"""``qualify sweep``: seed variants, a policy derived from what they measured, the standing check.

- :func:`variant_text` moves exactly the named seeds and the name, and keeps the comments;
- :func:`derive_policy` on the committed run's report gives a valid policy under which that
  report gates 0, every failing cell XFAIL; a failing row raised past its derived ceiling, or
  a failure in a family nothing failed in, gates 1; a cell the committed policy does not name
  is ``UNEXPLAINED`` and fails the sweep;
- :func:`policy_toml` writes what :mod:`tomllib` reads back;
- the committed sweep summary (``evidence/<contract>/sweep.json``) was made under the
  contract, gate policy and bound rule of this checkout: a change to any of them without a
  new sweep fails here.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest
from committed import committed_runs
from hypothesis import given, settings
from hypothesis import strategies as st

from qualify.cli.main import main
from qualify.contract import load_contract
from qualify.errors import ContractError, ExitCode, UsageError
from qualify.evidence.policy import (
    all_cells,
    evaluate,
    policy_for,
    policy_from_document,
)
from qualify.pipeline.sweep import (
    MIN_SPREAD_RUNS,
    SEED_FIELDS,
    ceiling,
    derive_policy,
    policy_toml,
    rule_digest,
    run_sweep,
    student_t_quantile,
    variant_text,
)

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = ROOT / "contracts" / "tiny-qwen3.toml"


@pytest.fixture(scope="module")
def base() -> tuple[Any, Any, dict[str, Any]]:
    contract = load_contract(CONTRACT)
    report = json.loads((committed_runs()[-1] / "report.json").read_text())
    return contract, policy_for(contract), report


def _seed(text: str, section: str, key: str) -> int:
    return int(tomllib.loads(text)[section][key]) if section != "roles" else \
        int(tomllib.loads(text)["roles"][key])


@pytest.mark.parametrize("offset", [1, 7])
def test_a_variant_moves_the_named_seeds_and_keeps_the_rest(offset: int) -> None:
    text = CONTRACT.read_text()
    for move in (tuple(SEED_FIELDS), ("model", "sampling")):
        name, vtext = variant_text(text, offset, move)
        assert name == f"tiny-qwen3-seed{offset}"
        assert tomllib.loads(vtext)["name"] == name
        for field, (section, key) in SEED_FIELDS.items():
            want = _seed(text, section, key) + (offset if field in move else 0)
            assert _seed(vtext, section, key) == want
        a, b = tomllib.loads(text), tomllib.loads(vtext)
        for doc in (a, b):
            doc.pop("name")
            for section, key in SEED_FIELDS.values():
                doc[section].pop(key)
        assert a == b  # nothing else moved
        assert [ln for ln in vtext.splitlines() if ln.startswith("#")] == \
            [ln for ln in text.splitlines() if ln.startswith("#")]


def test_a_contract_without_a_seed_is_refused() -> None:
    text = CONTRACT.read_text().replace("reward_seed = 11", "")
    with pytest.raises(ContractError, match="reward_seed"):
        variant_text(text, 1)


def test_the_derived_policy_accepts_what_it_was_derived_from(base: Any) -> None:
    contract, policy, report = base
    doc = derive_policy([report], contract, policy, factor=1.5)
    derived = policy_from_document(doc, contract, path="derived.toml")
    ev = evaluate(report, derived, cells=all_cells(contract))
    assert ev.exit_code == ExitCode.OK
    failing = {c["cell"] for c in report["cells"] if c["verdict"] == "FAIL"}
    assert {c.cell for c in ev.cells if c.outcome == "XFAIL"} == failing
    assert all(e["reason"] != "" and not e["reason"].startswith("UNEXPLAINED")
               for e in doc.get("expected_failures", []))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(st.data())
def test_a_row_past_its_derived_ceiling_fails(base: Any, data: st.DataObject) -> None:
    contract, policy, report = base
    doc = derive_policy([report], contract, policy, factor=1.5)
    derived = policy_from_document(doc, contract, path="derived.toml")
    fails = [i for i, r in enumerate(report["rows"]) if r["verdict"] == "FAIL"
             and isinstance(r.get("margin"), float)]
    if not fails:
        pytest.skip("the committed run has no failing row with a margin")
    i = data.draw(st.sampled_from(fails))
    bumped = copy.deepcopy(report)
    row = bumped["rows"][i]
    entry = next(e for e in doc["expected_failures"]
                 if e["cells"] == row["cell"] and e["families"] == [row["family"]])
    row["margin"] = entry["max_margin"] * data.draw(st.floats(1.01, 10.0))
    ev = evaluate(bumped, derived, cells=all_cells(contract))
    outcome = next(c for c in ev.cells if c.cell == row["cell"])
    assert outcome.outcome == "FAIL"
    assert "regressed beyond the expected failure" in (outcome.reason or "")


def test_a_failure_no_committed_entry_names_is_unexplained(base: Any) -> None:
    contract, policy, report = base
    passing = next(c["cell"] for c in report["cells"] if c["verdict"] == "PASS")
    planted = copy.deepcopy(report)
    row = next(r for r in planted["rows"] if r["cell"] == passing and r["family"] == "grads")
    row["verdict"], row["margin"] = "FAIL", 3.0
    doc = derive_policy([planted], contract, policy)
    entry = next(e for e in doc["expected_failures"] if e["cells"] == passing)
    assert entry["reason"].startswith("UNEXPLAINED")
    assert entry["max_margin"] == pytest.approx(4.5)


def test_the_toml_reads_back_as_the_document(base: Any) -> None:
    contract, policy, report = base
    doc = derive_policy([report], contract, policy, source="a sweep\nof one run")
    back = tomllib.loads(policy_toml(doc))
    assert back == {k: v for k, v in doc.items() if k != "comment"}
    policy_from_document(back, contract, path="derived.toml")


def test_a_factor_of_one_or_less_is_refused(base: Any) -> None:
    contract, policy, report = base
    with pytest.raises(UsageError, match="--factor"):
        derive_policy([report], contract, policy, factor=1.0)


def test_report_only_judges_the_runs_under_out(tmp_path: Path, base: Any,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A variant directory holding the committed run's report gates as the committed run."""
    contract, policy, report = base
    name, _ = variant_text(CONTRACT.read_text(), 3)
    run = tmp_path / "evidence" / name / "20990101T000000Z"
    run.mkdir(parents=True)
    shutil.copy(committed_runs()[-1] / "report.json", run / "report.json")
    result = run_sweep(CONTRACT, offsets=[3, 4], out=tmp_path, policy=policy,
                       report_only=True)
    v3, v4 = result.variants
    assert v3.report is not None
    assert v3.exit_code == evaluate(report, policy, cells=all_cells(contract)).exit_code
    assert v4.report is None
    assert v4.exit_code is None
    assert result.exit_code == ExitCode.QUALIFICATION_FAILED  # a variant wrote no report
    out = tmp_path / "derived.toml"
    code = main(["sweep", str(CONTRACT), "--out", str(tmp_path), "--offsets", "3",
                 "--report-only", "--write-policy", str(out), "--summary-dir", str(tmp_path)])
    assert code == v3.exit_code
    assert "| `tiny-qwen3-seed3` | 3 |" in capsys.readouterr().out
    policy_from_document(tomllib.loads(out.read_text()), contract, path=out)
    assert json.loads((tmp_path / "sweep.json").read_text())["rule_digest"] == rule_digest()


def test_the_committed_sweep_was_made_under_this_checkout() -> None:
    """The standing check: rerun ``qualify sweep`` when the contract, policy or rule change."""
    contract = load_contract(CONTRACT)
    summary = ROOT / "evidence" / contract.name / "sweep.json"
    if not summary.is_file():
        pytest.fail(f"{summary}: no committed sweep summary (qualify sweep "
                    f"{CONTRACT.relative_to(ROOT)} --out DIR --summary-dir "
                    f"{summary.parent.relative_to(ROOT)})")
    doc = json.loads(summary.read_text())
    assert doc["contract_digest"] == contract.digest, "the contract changed since the sweep"
    assert doc["policy_digest"] == policy_for(contract).digest, "the policy changed"
    assert doc["rule_digest"] == rule_digest(), "the bound rule changed since the sweep"
    assert len(doc["variants"]) >= 5
    assert doc["exit_code"] == 0, [v["outside"] for v in doc["variants"] if v["exit_code"]]


# --------------------------------------------------------------------------- ceilings


def test_student_t_quantiles_match_the_tables() -> None:
    # Student-t tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2): one-sided upper quantiles
    for p, dof, want in ((0.99, 10, 2.764), (0.995, 5, 4.032), (0.975, 3, 3.182),
                         (0.95, 1, 6.314), (0.99, 100, 2.364)):
        assert student_t_quantile(p, dof) == pytest.approx(want, abs=1.5e-3)
    with pytest.raises(ValueError, match="dof"):
        student_t_quantile(0.99, 0)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.floats(0.05, 200.0), min_size=1, max_size=14), st.floats(0.1, 10.0))
def test_a_ceiling_is_never_below_the_factor_and_scales_with_the_margins(
        margins: list[float], scale: float) -> None:
    top, rule = ceiling(margins, factor=1.5)
    assert top >= 1.5 * max(margins) * (1 - 1e-12)
    assert rule == ("factor" if len(margins) < MIN_SPREAD_RUNS else rule)
    scaled, rule2 = ceiling([m * scale for m in margins], factor=1.5)
    assert scaled == pytest.approx(top * scale, rel=1e-9)
    assert rule2 == rule


def test_a_defect_that_moves_with_the_seed_gets_the_ceiling_of_its_spread() -> None:
    stable = [4.0, 4.1, 3.9, 4.2, 4.0, 4.05]
    top_stable, rule_stable = ceiling(stable)
    assert top_stable == pytest.approx(1.5 * 4.2)
    assert rule_stable == "factor"
    moving = [2.8, 1.4, 7.0, 3.4, 1.1, 9.2, 1.8, 3.6]  # a ZeRO-0 family over 8 seeds
    top, rule = ceiling(moving, coverage=0.99)
    logs = [math.log(m) for m in moving]
    mean, n = sum(logs) / len(logs), len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    assert rule == "spread"
    assert top == pytest.approx(math.exp(mean + student_t_quantile(0.99, n - 1) * sd
                                         * math.sqrt(1 + 1 / n)))
    assert top > 1.5 * max(moving)
    top_few, rule_few = ceiling(moving[:MIN_SPREAD_RUNS - 1])
    assert top_few == pytest.approx(1.5 * 7.0)
    assert rule_few == "factor"
    with pytest.raises(UsageError, match="--coverage"):
        ceiling(moving, coverage=1.0)


def _scaled(report: dict[str, Any], scale: float) -> dict[str, Any]:
    """``report`` with the margin of every failing row times ``scale >= 1`` (a defect whose
    size moves with the seed)."""
    out = copy.deepcopy(report)
    for r in out["rows"]:
        if r["verdict"] == "FAIL" and isinstance(r.get("margin"), float):
            r["margin"] *= scale
    return out


def test_the_next_seed_of_a_defect_that_moves_stays_within_and_a_planted_fault_fails(
        base: Any) -> None:
    """Derived from runs whose defect margins move 3x with the seed, the policy accepts a
    next seed 1.6x beyond the largest seen (a factor-1.5 ceiling of the largest margin
    failed it: the held-out seeds 7 and 8), and still fails a fault planted in a failing
    cell's family that no run failed, or a row past its ceiling."""
    contract, policy, report = base
    runs = [_scaled(report, s) for s in (1.0, 1.3, 3.0, 1.5, 1.1, 2.2)]
    doc = derive_policy(runs, contract, policy, factor=1.5)
    derived = policy_from_document(doc, contract, path="derived.toml")
    for run in runs:
        assert evaluate(run, derived, cells=all_cells(contract)).exit_code == ExitCode.OK
    nxt = _scaled(report, 3.0 * 1.6)
    assert evaluate(nxt, derived, cells=all_cells(contract)).exit_code == ExitCode.OK
    cell = next(c["cell"] for c in report["cells"] if c["verdict"] == "FAIL")
    named = {f for e in doc["expected_failures"] if e["cells"] == cell for f in e["families"]}
    planted = copy.deepcopy(report)
    row = next(r for r in planted["rows"] if r["cell"] == cell and r["verdict"] == "PASS"
               and r["family"] not in named and isinstance(r.get("margin"), float))
    row["verdict"], row["margin"] = "FAIL", 1.2
    outcome = next(c for c in evaluate(planted, derived, cells=all_cells(contract)).cells
                   if c.cell == cell)
    assert (outcome.outcome, "fails outside the expected families" in (outcome.reason or "")) \
        == ("FAIL", True)
    past = copy.deepcopy(report)
    entry = next(e for e in doc["expected_failures"] if e["cells"] == cell
                 and any(r["cell"] == cell and r["family"] == e["families"][0]
                         and isinstance(r.get("margin"), float) for r in past["rows"]))
    row = next(r for r in past["rows"] if r["cell"] == cell
               and r["family"] == entry["families"][0] and isinstance(r.get("margin"), float)
               and r["round"] in entry.get("rounds", [r["round"]]))
    row["verdict"], row["margin"] = "FAIL", entry["max_margin"] * 1.01
    outcome = next(c for c in evaluate(past, derived, cells=all_cells(contract)).cells
                   if c.cell == cell)
    assert outcome.outcome == "FAIL"
