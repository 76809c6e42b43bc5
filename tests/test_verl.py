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
VENV = Path(os.environ.get("QUALIFY_VERL_VENV", ROOT / ".venv-verl"))
PYTHON = VENV / "bin" / "python"
CONTRACT = "tiny-qwen3-verl"
CONTRACTS = {CONTRACT: ("actor", "critic"), "tiny-qwen3-verl-gspo": ("actor",)}
"""Contract -> the roles of its cells."""
CELLS = tuple(f"verl-{p}-{r}-tp1-dp{d}" for p in ("fp32", "bf16") for r in ("actor", "critic")
              for d in (1, 2))
FAULT_CELL = "verl-fp32-actor-tp1-dp1"
pytestmark = pytest.mark.slow  # minutes: a reference stage and 4 verl launches per contract

require_venv("verl", PYTHON)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """contract name -> (its sealed reference, its run directory, wall seconds of the run)."""
    return run_contracts("verl", PYTHON, CONTRACTS, tmp_path_factory.mktemp("verl"))


def _report(run: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((run / "report.json").read_text())
    return doc


@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_verl_cells_pass_every_row(name: str,
                                   runs: Runs) -> None:
    _, run, wall = runs[name]
    sources = json.loads((run / "sources.json").read_text())
    assert sources["engines"]["verl"]["distributions"]["verl"] == "0.9.1"  # the venv's
    report = _report(run)
    cells = {c["cell"]: c for c in report["cells"]}
    expected = [c for c in CELLS if c.split("-")[2] in CONTRACTS[name]]
    assert sorted(cells) == sorted(expected)
    for cell in expected:
        rows = [r for r in report["rows"] if r["cell"] == cell]
        bad = [(r["family"], r["round"], r["verdict"], r["reason"]) for r in rows
               if r["verdict"] != "PASS"]
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
    monkeypatch.setenv("QUALIFY_LAUNCHER_VERL", str(PYTHON))
    contract = load_contract(contracts_dir() / f"{CONTRACT}.toml")
    run = run_candidate_stage(contract, reference=ref, root=tmp_path, quiet=True,
                              faults=(fault,), cells=[FAULT_CELL])
    report = compare_run(run)
    assert report.verdicts[FAULT_CELL] == "FAIL", report.summary
    failing = {r["family"] for r in _report(run)["rows"]
               if r["cell"] == FAULT_CELL and r["verdict"] == "FAIL"}
    assert {"grads", "updates"} <= failing, failing
    store.make_writable(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("verl") is not None,
                    reason="verl importable in qualify's own environment")
def test_without_a_verl_interpreter_the_cells_are_not_run_naming_the_install_script(
        runs: Runs, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    ref, _, _ = runs[CONTRACT]
    monkeypatch.delenv("QUALIFY_LAUNCHER_VERL", raising=False)
    contract = load_contract(contracts_dir() / f"{CONTRACT}.toml")
    run = run_candidate_stage(contract, reference=ref, root=tmp_path, quiet=True)
    report = compare_run(run)
    assert {report.verdicts[c] for c in CELLS} == {"NOT_RUN"}
    cells = {c["cell"]: c for c in _report(run)["cells"]}
    for cell in CELLS:
        assert "scripts/install_verl.sh" in cells[cell]["reason"], cells[cell]["reason"]
    store.make_writable(tmp_path)
