"""A planted DeepSpeed BF16 fault inside the expected families: XFAIL without a ceiling, FAIL
with one (the committed policy).

The plant (tests/plant.py, no branch in the harness): DeepSpeed's optimizer applies 1.5x the
scheduled lr in the round-2 step of ``deepspeed-bf16-zero1-actor-tp1`` while the engine still
reports the scheduled lr (so the ``lr`` row passes). Only the round-2 ``updates`` row moves,
a family the policy expects to fail there (BF16-born masters). Without a ceiling (the
policies before ``max_margin``: the families alone) the cell is XFAIL and the gate stays
green; under the committed policy it is FAIL, "regressed beyond the expected failure".
One real launch of the cell against the committed reference (tens of seconds): slow.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from plant import plant_env

from qualify.compare.stage import compare_run
from qualify.contract import load_contract
from qualify.evidence.policy import evaluate, policy_for
from qualify.layout import reference_dir_name
from qualify.pipeline.chain import find_sealed_reference
from qualify.resources import contracts_dir, repo_root

CELL = "deepspeed-bf16-zero1-actor-tp1"
LR_FACTOR = 1.5

PATCH = f"""
    cls = module.DeepSpeedEngine
    step = cls.step

    def planted_step(self, *a, **k):
        boundary = self.is_gradient_accumulation_boundary()
        n = getattr(self, "_planted_steps", 0)
        self._planted_steps = n + int(boundary)
        if not (boundary and n >= 1):  # every step but round 2's boundary step
            return step(self, *a, **k)
        opt = self.optimizer
        inner = opt.step

        def scaled(*ia, **ik):
            saved = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = g["lr"] * {LR_FACTOR}
            try:
                return inner(*ia, **ik)
            finally:
                for g, lr in zip(opt.param_groups, saved):
                    g["lr"] = lr

        opt.step = scaled
        try:
            return step(self, *a, **k)
        finally:
            del opt.step

    cls.step = planted_step
"""


@pytest.mark.slow
def test_planted_lr_fault_is_xfail_without_a_ceiling_and_fail_with_it(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    ref = find_sealed_reference(repo_root() / "references", reference_dir_name(contract))
    if ref is None:
        pytest.skip("no committed sealed reference of the default contract")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(repo_root()), plant_env(tmp_path / "plant", "deepspeed.runtime.engine",
                                     PATCH)["PYTHONPATH"]])}
    subprocess.run([sys.executable, "-m", "qualify", "candidate", str(contract.path),
                    "--reference", str(ref), "--out", str(tmp_path / "evidence"), "--cells",
                    CELL, "--run-id", "plant", "--quiet"], env=env, check=True,
                   capture_output=True, timeout=900)
    policy = policy_for(contract)
    report = compare_run(tmp_path / "evidence" / contract.name / "plant", reference_dir=ref,
                         write=False, policy=policy).to_dict()
    rows = {r["metric"]: r for r in report["rows"] if r["cell"] == CELL
            and r["class"] == "candidate_vs_hf" and r["variant"] == ""}
    assert rows["round1/actor/updates"]["verdict"] == "PASS"  # round 1 untouched
    lr = [r["verdict"] for r in report["rows"] if r["cell"] == CELL and r["family"] == "lr"]
    assert lr
    assert set(lr) == {"PASS"}  # the engine still reports the scheduled lr
    (cell,) = [c for c in evaluate(report, policy).cells if c.cell == CELL]
    assert cell.outcome == "FAIL", cell.reason
    assert (cell.reason or "").startswith("regressed beyond the expected failure: "
                                          "round2/actor/updates (candidate_vs_hf) margin ")
    # the same policy without ceilings (what the families alone allowed): XFAIL, gate green
    loose = dataclasses.replace(policy, expected_failures=tuple(
        dataclasses.replace(e, max_margin=float("inf")) for e in policy.expected_failures))
    (old,) = [c for c in evaluate(report, loose).cells if c.cell == CELL]
    assert old.outcome == "XFAIL", old.reason
