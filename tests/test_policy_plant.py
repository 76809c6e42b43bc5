"""A planted DeepSpeed BF16 fault inside the families the old policy expected: XFAIL under the
old policy, FAIL under the committed one.

The plant (tests/plant.py, no branch in the harness): DeepSpeed's optimizer applies 1.5x the
scheduled lr in the round-2 step of ``deepspeed-bf16-zero1-actor-tp1`` while the engine still
reports the scheduled lr (so the ``lr`` row passes). Only the round-2 ``updates`` row moves.
The old policy (:data:`OLD_ENTRY`, the entry of commit 9c848ee: ZeRO-1/2 BF16 Actor cells
expected to fail in eight families, no ceiling, because their FP32 masters were born
BF16-rounded from an FP32 checkpoint) calls the cell XFAIL and the gate stays green; the
committed policy (BF16 cells compared like with like, the cell no longer expected to fail)
calls it FAIL. One real launch of the cell against the committed reference: slow.
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
from qualify.evidence.policy import ExpectedFailure, evaluate, policy_for
from qualify.layout import reference_dir_name
from qualify.pipeline.chain import find_sealed_reference
from qualify.resources import contracts_dir, repo_root

CELL = "deepspeed-bf16-zero1-actor-tp1"
LR_FACTOR = 1.5
OLD_ENTRY = ExpectedFailure(
    cells="deepspeed-bf16-zero[12]-actor-*",
    families=("logprobs", "entropy", "losses", "grad_norm", "grads", "exp_avg", "exp_avg_sq",
              "updates"),
    max_margin=float("inf"),
    reason="DeepSpeed BF16 ZeRO-1/2 builds its FP32 masters from the BF16-cast module",
    upstream="harnesses/deepspeed/README.md")

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
def test_planted_lr_fault_is_xfail_under_the_old_policy_and_fail_now(tmp_path: Path) -> None:
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
    assert "round2/actor/updates" in (cell.reason or ""), cell.reason
    print(f"committed policy: {cell.outcome}: {cell.reason}")
    # the old policy: the cell's families expected to fail, with no ceiling
    old_policy = dataclasses.replace(policy, expected_failures=(OLD_ENTRY,))
    (old,) = [c for c in evaluate(report, old_policy).cells if c.cell == CELL]
    assert old.outcome == "XFAIL", old.reason
    print(f"old policy: {old.outcome}: {old.reason}")
