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
import os
from pathlib import Path
from typing import Any

import pytest
from stack_runs import Runs, require_venv, run_contracts

from qualify.candidate.stage import run_candidate_stage
from qualify.compare.stage import compare_run
from qualify.contract import load_contract
from qualify.evidence import store
from qualify.resources import contracts_dir, repo_root

ROOT = repo_root()
VENV = Path(os.environ.get("QUALIFY_TRL_VENV", ROOT / ".venv-trl"))
PYTHON = VENV / "bin" / "python"
CONTRACTS = ("tiny-qwen3-trl", "tiny-qwen3-trl-gspo")
CELLS = ("trl-fp32-actor-tp1", "trl-bf16-actor-tp1")
LOSS_SPLIT = "total compared; entropy, kl, policy declared not reported: GRPOTrainer"
"""How the ``where`` of a ``losses`` row of a TRL cell starts after its worst term."""
pytestmark = pytest.mark.slow  # minutes: a reference stage and TRL launches per contract

require_venv("trl", PYTHON)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """contract name -> (its sealed reference, its run directory, wall seconds of the run)."""
    return run_contracts("trl", PYTHON, CONTRACTS, tmp_path_factory.mktemp("trl"))


def _report(run: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((run / "report.json").read_text())
    return doc


@pytest.mark.parametrize("name", CONTRACTS)
def test_trl_cells_pass_every_row_they_run(name: str,
                                           runs: Runs) -> None:
    _, run, wall = runs[name]
    sources = json.loads((run / "sources.json").read_text())
    assert sources["engines"]["trl"]["distributions"]["trl"] == "1.16.0"  # the venv's
    report = _report(run)
    cells = {c["cell"]: c for c in report["cells"]}
    assert sorted(cells) == sorted(CELLS)
    for cell in CELLS:
        rows = [r for r in report["rows"] if r["cell"] == cell]
        ran = [r for r in rows if r["verdict"] != "NOT_RUN"]
        assert len(ran) == len(rows), [r for r in rows if r not in ran]
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
    monkeypatch.setenv("QUALIFY_LAUNCHER_TRL", str(PYTHON))
    contract = load_contract(contracts_dir() / "tiny-qwen3-trl.toml")
    run = run_candidate_stage(contract, reference=ref, root=tmp_path, quiet=True,
                              faults=(fault,), cells=["trl-fp32-actor-tp1"])
    report = compare_run(run)
    assert report.verdicts["trl-fp32-actor-tp1"] == "FAIL", report.summary
    failing = {r["family"] for r in _report(run)["rows"] if r["verdict"] == "FAIL"}
    assert {"logprobs", "grads"} <= failing, failing
    store.make_writable(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("trl") is not None,
                    reason="trl importable in qualify's own environment")
def test_without_a_trl_interpreter_the_cells_are_not_run_naming_the_install_script(
        runs: Runs, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    ref, _, _ = runs["tiny-qwen3-trl"]
    monkeypatch.delenv("QUALIFY_LAUNCHER_TRL", raising=False)
    contract = load_contract(contracts_dir() / "tiny-qwen3-trl.toml")
    run = run_candidate_stage(contract, reference=ref, root=tmp_path, quiet=True)
    report = compare_run(run)
    assert {report.verdicts[c] for c in CELLS} == {"NOT_RUN"}
    cells = {c["cell"]: c for c in _report(run)["cells"]}
    for cell in CELLS:
        assert "scripts/install_trl.sh" in cells[cell]["reason"], cells[cell]["reason"]
    store.make_writable(tmp_path)
