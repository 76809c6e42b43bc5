"""End to end on the default contract: seal a reference, run candidate cells, compare.

The contract is ``tiny-qwen3.toml`` reduced to the torch_tp engine and the HF sampler
(:mod:`tiny_contracts`; the other engines have their own test modules). The reference
(about 40 s on 2 cores) is the session's shared :func:`shared_artifacts.tiny_reference`,
copied per module; the run of every cell (about 3 minutes) is the session's shared
:func:`shared_artifacts.tiny_chain` (the tamper set of test_tamper_real_run seals and signs
the same run), copied per test. Each other candidate launch is a real torchrun + gloo job
of the torch_tp engine (about 20 s).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from shared_artifacts import copy_tree, tiny_chain, tiny_reference
from tiny_contracts import torch_tp_only, torch_tp_only_text

from qualify.candidate.stage import run_candidate_stage
from qualify.compare.stage import compare_run
from qualify.contract import Contract, load_contract
from qualify.errors import ExitCode, ReferenceDataError
from qualify.evidence import store
from qualify.reference.stage import BOUNDS_FILE, run_reference_stage
from qualify.statistics import FAMILY_STATISTIC


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return torch_tp_only(tmp_path_factory.mktemp("contracts"))


@pytest.fixture(scope="module")
def contract(tiny: Path) -> Contract:
    return load_contract(tiny)


@pytest.fixture(scope="module")
def reference(contract: Contract, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the shared reference of this contract (:func:`run_reference_stage`)."""
    shared = tiny_reference(tmp_path_factory) / "references" / \
        f"{contract.name}-{contract.digest12}"
    assert store.is_sealed(shared)
    root = tmp_path_factory.mktemp("refs")
    return copy_tree(shared, root / shared.name)


def _rows(report_dir: Path) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = json.loads((report_dir / "report.json").read_text())["rows"]
    return rows


def test_reference_is_sealed_read_only_and_complete(reference: Path, contract: Contract) -> None:
    assert store.is_sealed(reference)
    store.check_sealed(reference)
    for path in reference.rglob("*"):
        if path.is_file() and path.name != "attestation.dsse.json":
            assert not path.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH), path
    rollout = json.loads((reference / "rollout.json").read_text())
    assert set(rollout["finish_reasons"]) == {"eos", "length"}, rollout["finish_reasons"]
    bounds = json.loads((reference / BOUNDS_FILE).read_text())["bounds"]
    seen = {(b["precision"], b["class"], b["round"], b["role"], b["family"]) for b in bounds}
    for prec in contract.matrix.lanes():  # a BF16 lane per engine style
        for klass in ("candidate_vs_hf", "tp_vs_tp1"):
            for rnd in (1, 2):
                for fam in FAMILY_STATISTIC:
                    if fam in ("values", "rewards", "logprobs", "entropy"):
                        continue
                    for role in ("actor", "critic"):
                        assert (prec, klass, rnd, role, fam) in seen
            assert (prec, klass, 1, "actor", "logprobs") in seen
            assert (prec, klass, 1, "critic", "values") in seen
    for b in bounds:
        assert b["bound"] == pytest.approx(
            b["k"] * max(b["control_error"], b["resolution"], b["propagated"])
            + b["quantum"] + b["floor"])
        assert (b["resolution"] > 0) == (b["family"] in ("grad_norm", "clip_coef", "losses"))
    meta = json.loads((reference / "reference.json").read_text())
    bf16 = meta["scoring_records"]["bf16"]["actor"]
    fp32 = meta["scoring_records"]["fp32"]["actor"]
    assert "bfloat16" in json.dumps(bf16)
    assert "bfloat16" not in json.dumps(fp32)
    branches = json.loads((reference / "branches.json").read_text())
    for prec in contract.matrix.lanes():  # a BF16 lane per engine style
        for role in ("actor", "critic"):
            r2 = branches["precisions"][prec][role]["round2"]
            assert r2["tol_old"] > 0
            assert r2["tol_cur"] > 0
            assert set(r2["gram"]) == set(r2["tokens"])
            assert r2["unsealed"] == r2["ambiguous"] - len(r2["tokens"]) >= 0
            assert meta["clip_ambiguous_tokens"][prec][role]["round2"] == len(r2["tokens"])
            if r2["tokens"]:
                assert r2["rerun_max_abs_diff"] <= 0.1 * r2["tol_cur"]
                assert r2["j_precision"] == "fp32"
                for tok in r2["tokens"].values():
                    assert tok["reference_branch"] in ("full", "zero")
                    assert r2["gram"][f"{tok['index'][0]}_{tok['index'][1]}"] is not None
    assert "fp64-fp32" in meta["update_meta"], sorted(meta["update_meta"])
    for label, run in meta["update_meta"].items():
        state = "torch.float64" if label == "fp64-fp32" else "torch.float32"
        for role in ("actor", "critic"):
            assert run[role]["optimizer_state"] == {"exp_avg": state, "exp_avg_sq": state}, label
    assert meta["update_meta"]["fp64-fp32"]["actor"]["master_weights"] == "torch.float64"
    assert meta["update_meta"]["fp64-fp32"]["actor"]["compute"] == ["torch.float64"]
    assert {b["control"] for b in bounds if b["precision"] == "fp32"} <= {
        "attn_impl", "microbatch", "fp64", "row_split", "none"}
    assert "fp64" not in {b["control"] for b in bounds if b["precision"].startswith("bf16")}
    assert any(b["precision"].startswith("bf16") for b in bounds)


def test_every_reference_step_is_timed_in_order(reference: Path) -> None:
    """``reference.json`` times each step of the stage (keys sorted when written); the
    distribution step is a step of its own (its ``step()`` releases the memory the
    clip-branch reruns freed before it loads its models: ``qualify.memory``)."""
    started = json.loads((reference / "reference.json").read_text())["step_started_s"]
    order = ["models", "rollout", "scoring", "targets", "updates", "controls", "round_to_round",
             "branches", "distribution", "seal"]  # a step may take less than the 1 ms rounding
    assert set(started) == set(order)
    assert [started[s] for s in order] == sorted(started.values())
    # strict here: the branch and distribution steps each load models, seconds at least
    assert started["branches"] < started["distribution"] < started["seal"]


def test_sealed_reference_is_never_rewritten(reference: Path, contract: Contract,
                                             tiny: Path) -> None:
    digest = store.manifest_digest(reference)
    with pytest.raises(ReferenceDataError, match="sealed"):
        run_reference_stage(contract, root=reference.parent, quiet=True)
    assert store.manifest_digest(reference) == digest
    proc = subprocess.run(
        [sys.executable, "-m", "qualify", "reference", str(tiny), "--out", str(reference.parent),
         "--quiet"], capture_output=True, text=True, check=False)
    assert proc.returncode == ExitCode.USAGE_ERROR, proc.stderr
    assert "Traceback" not in proc.stderr
    assert store.manifest_digest(reference) == digest


def test_interrupted_reference_is_never_taken_as_sealed(contract: Contract, tiny: Path,
                                                        tmp_path: Path) -> None:
    def interrupt(step: str) -> None:
        if step == "targets":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_reference_stage(contract, root=tmp_path, quiet=True, on_step=interrupt)
    (partial,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert not store.is_sealed(partial)
    assert (partial / store.INCOMPLETE_FILE).exists()
    with pytest.raises(ReferenceDataError, match="not sealed"):
        run_candidate_stage(contract, reference=partial, root=tmp_path / "ev", quiet=True)
    proc = subprocess.run(
        [sys.executable, "-m", "qualify", "candidate", str(tiny), "--reference", str(partial),
         "--out", str(tmp_path / "ev"), "--quiet"], capture_output=True, text=True, check=False)
    assert proc.returncode == ExitCode.USAGE_ERROR
    assert "not sealed" in proc.stderr
    store.make_writable(tmp_path)


def test_every_torch_tp_cell_passes(contract: Contract, tmp_path: Path,
                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """The shared chain's run of every cell (:func:`shared_artifacts.tiny_chain`: the real
    candidate stage on the sealed reference, then :func:`compare_run`), on a copy."""
    chain = tiny_chain(tmp_path_factory)
    assert chain.contract.read_text() == torch_tp_only_text()
    assert chain.doc["verdicts"] == {c.cell_id: "PASS" for c in contract.matrix.cells()}, \
        chain.doc["summary"]
    assert chain.doc["passed"] is True
    report = json.loads((chain.run / "report.json").read_text())
    assert {c["cell"]: c["verdict"] for c in report["cells"]} == chain.doc["verdicts"]
    # The sealed reference is byte-identical after a candidate run.
    assert store.manifest_digest(chain.reference) == \
        chain.doc["reference_digest_before_candidate"]
    store.check_sealed(chain.reference)
    for part in ("references", "evidence"):
        copy_tree(chain.root / part, tmp_path / part)
    reference = tmp_path / "references" / chain.reference.name
    run_dir = (tmp_path / "evidence" / contract.name / chain.run.name).resolve()
    # Resume: nothing left to run, the complete attempts are kept as they are.
    again = run_candidate_stage(contract, reference=reference, root=tmp_path / "evidence",
                                run_id=run_dir.name, quiet=True)
    assert again == run_dir
    for cell in contract.matrix.cells():
        assert [p.name for p in store.attempts(run_dir / "cells" / cell.cell_id)] == ["attempt-1"]
    store.make_writable(tmp_path)


# fault -> (cell that must FAIL, family that must FAIL in it)
FAULTS = {
    "no_temperature": ("torch_tp-fp32-actor-tp1", "logprobs"),
    "logprobs_shift_one": ("torch_tp-fp32-actor-tp1", "logprobs"),
    "grad_norm_replicated_per_rank": ("torch_tp-fp32-actor-tp2", "grad_norm"),
    "bf16_optimizer_state": ("torch_tp-bf16-actor-tp1", "dtypes"),
    "value_loss_unclipped": ("torch_tp-fp32-critic-tp1", "losses"),
    # A gradient change of about entropy_coef (1 %): before BF16 cells met the reference of
    # their own BF16 style (qualify/lanes.py) it passed every BF16 cell (worst margin 0.85).
    "entropy_bonus_dropped": ("torch_tp-bf16-actor-tp1", "grad_norm"),
    "kl_loss_sign_flipped": ("torch_tp-fp32-actor-tp1", "grads"),
    # The scheduler stepped before the optimizer: step s applies lambda(s), one step early.
    "lr_scheduler_stepped_first": ("torch_tp-fp32-actor-tp1", "lr"),
}


# A power gap, kept visible (strict: it fails the suite the day the fault is caught again).
# On this torch_tp-only, HF-sampled contract with the BF16-representable checkpoint the
# eager-vs-sdpa control's round-2 errors are about twice those of the FP32 checkpoint
# (entropy 0.10 against 0.047), and the 1 % gradient change of a dropped entropy bonus stays
# inside every bound (worst: round-2 clip_coef margin 0.755, grad_norm 0.31 against 0.50).
# The full default contract (vLLM rollout) still catches it (grad_norm 1.02, clip_coef 2.23,
# grads 1.05, updates 1.11) and so does this contract with the FP32 checkpoint (grad_norm
# 1.56): measured on the h/bf16ckpt branch with `qualify run` on each.
POWER_GAPS = {"entropy_bonus_dropped"}


@pytest.mark.parametrize("fault", [
    pytest.param(f, marks=pytest.mark.xfail(strict=True, reason="power gap on this contract "
                                            "(see POWER_GAPS)")) if f in POWER_GAPS else f
    for f in sorted(FAULTS)])
def test_broken_engine_variant_fails_with_the_expected_metric(
        fault: str, reference: Path, contract: Contract, tmp_path: Path) -> None:
    cell, family = FAULTS[fault]
    run_dir = run_candidate_stage(
        contract, reference=reference, root=tmp_path, quiet=True, faults=(fault,),
        cells=[cell])
    report = compare_run(run_dir)
    assert report.verdicts[cell] == "FAIL", report.summary
    failing = {(r["cell"], r["family"]) for r in _rows(run_dir) if r["verdict"] == "FAIL"}
    assert (cell, family) in failing, sorted(failing)
    assert not report.passed
    store.make_writable(tmp_path)


@pytest.mark.slow  # waits out a collective timeout: .ci/run's slow tier, not command 2
def test_hung_rank_is_an_error_with_logs_kept(reference: Path, contract: Contract,
                                             tmp_path: Path) -> None:
    run_dir = run_candidate_stage(
        contract, reference=reference, root=tmp_path, quiet=True, faults=("hang_rank1",),
        cells=["torch_tp-fp32-actor-tp2", "torch_tp-fp32-critic-tp1"],
        collective_timeout_s=10, launch_timeout_s=120)
    report = compare_run(run_dir)
    assert report.verdicts["torch_tp-fp32-actor-tp2"] == "ERROR"
    attempt = run_dir / "cells" / "torch_tp-fp32-actor-tp2" / "attempt-1"
    result = json.loads((attempt / "result.json").read_text())
    assert result["status"] == "ERROR"
    assert result["wall_s"] < 120
    logs = list((attempt / "logs").rglob("*.log"))
    assert logs, "rank logs must be kept"
    assert not report.passed
    if os.environ.get("QUALIFY_KEEP_TMP") is None:
        store.make_writable(tmp_path)


