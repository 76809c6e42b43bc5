"""TRL's GRPOTrainer qualified end to end in its own venv (harnesses/trl, the ``trl`` engine).

``qualify run contracts/<c>.toml --launcher trl=.venv-trl/bin/python`` for each TRL contract:
every ``trl`` cell completes with all its metric, dtype, replica, padding, lr and route rows
``PASS``, its ``losses`` rows measured on TRL's one loss (``total``; the policy / KL / entropy
split declared not reported by the adapter), and the run's ``sources.json`` names the TRL
version of the venv its ranks ran in;
each planted translation fault (harnesses/trl/faults.py) turns the FP32 cell ``FAIL``; the
same cells without a TRL interpreter are ``NOT_RUN`` naming ``scripts/install_trl.sh``.
Skipped when ``.venv-trl`` is absent (``scripts/install_trl.sh`` builds it), unless
``QUALIFY_REQUIRE_TRL=1`` (CI builds it), then it fails.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import stack_runs
from stack_runs import Runs, candidate_run
from stack_runs import report as read_report

PYTHON = stack_runs.venv_python("trl")
CONTRACTS = ("tiny-qwen3-trl", "tiny-qwen3-trl-gspo")
CELLS = ("trl-fp32-actor-tp1", "trl-bf16-actor-tp1")
LOSS_SPLIT = "total compared; entropy, kl, policy declared not reported: GRPOTrainer"
"""How the ``where`` of a ``losses`` row of a TRL cell starts after its worst term."""
pytestmark = pytest.mark.slow  # minutes: a reference stage and TRL launches per contract

stack_runs.require_venv("trl", PYTHON)
runs = stack_runs.runs_fixture("trl", PYTHON, CONTRACTS)


@pytest.mark.parametrize("name", CONTRACTS)
def test_trl_cells_pass_every_row_they_run(name: str,
                                           runs: Runs) -> None:
    _, run, wall = runs[name]
    sources = json.loads((run / "sources.json").read_text())
    assert sources["engines"]["trl"]["distributions"]["trl"] == "1.16.0"  # the venv's
    report = read_report(run)
    cells = {c["cell"]: c for c in report["cells"]}
    assert sorted(cells) == sorted(CELLS)
    for cell in CELLS:
        rows = [r for r in report["rows"] if r["cell"] == cell]
        ran = [r for r in rows if r["verdict"] != "NOT_RUN"]
        # the only rows not run are those the contract expects: TRL records no full
        # distributions (matrix.expected_not_run), every trainer_distribution row of round 1
        declared = [r for r in rows if r not in ran and r.get("expected_not_run")]
        assert len(ran) + len(declared) == len(rows), [r for r in rows if r not in ran]
        assert {(r["class"], r["family"], r["round"]) for r in declared} == {
            ("trainer_distribution", "prefill_raw", 1),
            ("trainer_distribution", "prefill_tempered", 1)}
        bad = [(r["family"], r["round"], r["verdict"], r["reason"]) for r in ran
               if r["verdict"] != "PASS"]
        assert not bad, bad
        assert cells[cell]["verdict"] == "PASS"
        losses = [r for r in ran if r["family"] == "losses"]
        assert {r["round"] for r in losses} == {1, 2}
        for r in losses:  # measured on TRL's total, never skipped
            assert r["where"].startswith(f"total [{LOSS_SPLIT}"), r["where"]
            assert r["error"] is not None, r
            assert r["bound"] is not None, r
        families = {r["family"] for r in ran}
        assert {"logprobs", "entropy", "losses", "grad_norm", "clip_coef", "grads", "exp_avg",
                "exp_avg_sq", "updates", "lr", "dtypes", "replica", "routes"} <= families, \
            families
        assert {r["round"] for r in ran if r["family"] == "updates"} == {1, 2}
        print(f"{name} {cell}: {cells[cell]['verdict']} worst margin "
              f"{cells[cell]['worst_margin']:.3g} ({len(ran)} PASS); run {wall:.0f} s")


@pytest.mark.parametrize("fault", ["completion_mask_shifted", "temperature_not_passed",
                                   "advantages_negated"])
def test_a_planted_translation_fault_fails_the_cell(
        fault: str, runs: Runs, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    ref, _, _ = runs["tiny-qwen3-trl"]
    run, verdicts = candidate_run("trl", PYTHON, ref, "tiny-qwen3-trl", tmp_path, monkeypatch,
                                  faults=(fault,), cells=["trl-fp32-actor-tp1"])
    assert verdicts["trl-fp32-actor-tp1"] == "FAIL", verdicts
    failing = {r["family"] for r in read_report(run)["rows"] if r["verdict"] == "FAIL"}
    assert {"logprobs", "grads"} <= failing, failing


@pytest.mark.skipif(importlib.util.find_spec("trl") is not None,
                    reason="trl importable in qualify's own environment")
def test_without_a_trl_interpreter_the_cells_are_not_run_naming_the_install_script(
        runs: Runs, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    ref, _, _ = runs["tiny-qwen3-trl"]
    stack_runs.assert_not_run_naming_the_install_script("trl", ref, "tiny-qwen3-trl", CELLS,
                                                        tmp_path, monkeypatch)
