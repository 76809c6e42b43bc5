"""verl 0.9.1's TrainingWorker qualified end to end in its own venv (the ``verl`` engine).

``qualify run contracts/<c>.toml --launcher verl=.venv-verl/bin/python`` for each verl
contract: every ``verl`` cell (PPO: Actor and Critic; GSPO: the Actor; FP32 and BF16, DP 1
and 2) completes with every metric, loss, dtype, replica and padding row ``PASS``, the run's
``sources.json`` naming the verl version of the venv its ranks ran in; each planted
translation fault
(harnesses/verl/faults.py) turns the FP32 DP 1 Actor cell ``FAIL``; the same cells without a
verl interpreter are ``NOT_RUN`` naming ``scripts/install_verl.sh``. Skipped when
``.venv-verl`` is absent (``scripts/install_verl.sh`` builds it), unless
``QUALIFY_REQUIRE_VERL=1`` (CI builds it), then it fails.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import stack_runs
from stack_runs import Runs, candidate_run
from stack_runs import report as read_report

PYTHON = stack_runs.venv_python("verl")
CONTRACT = "tiny-qwen3-verl"
CONTRACTS = {CONTRACT: ("actor", "critic"), "tiny-qwen3-verl-gspo": ("actor",)}
"""Contract -> the roles of its cells."""
CELLS = tuple(f"verl-{p}-{r}-tp1-dp{d}" for p in ("fp32", "bf16") for r in ("actor", "critic")
              for d in (1, 2))
FAULT_CELL = "verl-fp32-actor-tp1-dp1"
pytestmark = pytest.mark.slow  # minutes: a reference stage and 4 verl launches per contract

stack_runs.require_venv("verl", PYTHON)
runs = stack_runs.runs_fixture("verl", PYTHON, CONTRACTS)


@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_verl_cells_pass_every_row(name: str,
                                   runs: Runs) -> None:
    _, run, wall = runs[name]
    sources = json.loads((run / "sources.json").read_text())
    assert sources["engines"]["verl"]["distributions"]["verl"] == "0.9.1"  # the venv's
    report = read_report(run)
    cells = {c["cell"]: c for c in report["cells"]}
    expected = [c for c in CELLS if c.split("-")[2] in CONTRACTS[name]]
    assert sorted(cells) == sorted(expected)
    for cell in expected:
        rows = [r for r in report["rows"] if r["cell"] == cell]
        # the only rows not run are those the contract expects: verl's actor records no full
        # distributions (matrix.expected_not_run), every trainer_distribution row of round 1
        declared = [r for r in rows if r["verdict"] == "NOT_RUN" and r.get("expected_not_run")]
        assert {(r["class"], r["family"], r["round"]) for r in declared} == ({
            ("trainer_distribution", "prefill_raw", 1),
            ("trainer_distribution", "prefill_tempered", 1)} if "-actor-" in cell else set())
        bad = [(r["family"], r["round"], r["verdict"], r["reason"]) for r in rows
               if r["verdict"] != "PASS" and r not in declared]
        assert not bad, (cell, bad)
        families = {r["family"] for r in rows}
        per_token = {"logprobs", "entropy"} if "-actor-" in cell else {"values"}
        assert per_token | {"losses", "grad_norm", "clip_coef", "grads", "exp_avg",
                            "exp_avg_sq", "updates", "lr", "dtypes", "replica"} <= families, \
            (cell, families)
        assert {r["round"] for r in rows if r["family"] == "updates"} == {1, 2}
        assert cells[cell]["verdict"] == "PASS", cells[cell]
        print(f"{name} {cell}: PASS worst margin {cells[cell]['worst_margin']:.3g} "
              f"({len(rows)} rows); run {wall:.0f} s")


@pytest.mark.parametrize("fault", ["response_mask_shifted", "advantages_unnormalised"])
def test_a_planted_translation_fault_fails_the_cell(
        fault: str, runs: Runs, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    ref, _, _ = runs[CONTRACT]
    run, verdicts = candidate_run("verl", PYTHON, ref, CONTRACT, tmp_path, monkeypatch,
                                  faults=(fault,), cells=[FAULT_CELL])
    assert verdicts[FAULT_CELL] == "FAIL", verdicts
    failing = {r["family"] for r in read_report(run)["rows"]
               if r["cell"] == FAULT_CELL and r["verdict"] == "FAIL"}
    assert {"grads", "updates"} <= failing, failing


@pytest.mark.skipif(importlib.util.find_spec("verl") is not None,
                    reason="verl importable in qualify's own environment")
def test_without_a_verl_interpreter_the_cells_are_not_run_naming_the_install_script(
        runs: Runs, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    ref, _, _ = runs[CONTRACT]
    stack_runs.assert_not_run_naming_the_install_script("verl", ref, CONTRACT, CELLS, tmp_path,
                                                        monkeypatch)
