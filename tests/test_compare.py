"""Tests of qualify.compare (stage, rows, reflip) on a synthetic sealed reference and run.

The world: B = 3 sequences, R = 4 response tokens (mask below: 9 valid tokens), an
actor with two parameters (``model.w`` [4, 3], ``model.b`` [3]), two rounds, HF reference
tensors at fp32 and bf16, hand-made bounds (``BOUND`` per family, both classes), sealed
with :func:`qualify.evidence.store.seal` like a real reference. Candidate cells are written as
sealed attempts with ``outputs.safetensors`` / ``outputs.json``; every comparison is the
real code path (safetensors, manifests, ``compare_sets``, bounds lookup).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from safetensors.numpy import save_file
from tiny_contracts import torch_tp_only_text

from qualify.bounds import TP_CANDIDATE_CLASS, Bound, bounds_document, judge
from qualify.cli.main import main
from qualify.compare.rows import compare_rows
from qualify.compare.stage import compare_run
from qualify.compare.verdicts import Row, worst_verdict
from qualify.contract import Contract
from qualify.errors import EvidenceIntegrityError, ExitCode, ReferenceDataError, UsageError
from qualify.evidence import store
from qualify.layout import REPORT_JSON, REPORT_MD, RUN_FILE
from qualify.protocol import ROLLOUT_KEYS
from qualify.statistics import FAMILY_STATISTIC, compare_sets, group_tensors

B, R = 3, 4
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=np.int64)
N_VALID = int(MASK.sum())  # 9
PARAMS = {"model.w": (4, 3), "model.b": (3,)}
BOUND = {"logprobs": 1e-3, "entropy": 1e-3, "values": 1e-3, "rewards": 1e-3, "losses": 1e-4,
         "grad_norm": 1e-4, "clip_coef": 1e-4, "grads": 1e-2, "exp_avg": 1e-2,
         "exp_avg_sq": 1e-2, "updates": 1e-2}
FP32 = "torch.float32"
TP1, TP2 = "torch_tp-fp32-actor-tp1", "torch_tp-fp32-actor-tp2"
BF16_TP1 = "torch_tp-bf16-actor-tp1"
CRITIC_TP1 = "torch_tp-fp32-critic-tp1"
# Without ``required_cells`` every cell of the contract's matrix is required (a cell that
# did not run is never a pass). The tiny-qwen3 matrix has 8 cells; a world that adds only
# some of them and means "every required cell ran" names them in ``required``.


@pytest.fixture(autouse=True)
def _writable(tmp_path: Path) -> Iterator[None]:
    yield
    store.make_writable(tmp_path)


# --------------------------------------------------------------------------- the world


def hf_tensors(seed: int) -> dict[str, np.ndarray]:
    """HF reference tensors of both roles, two rounds (masked tokens hold 0, as the reference
    writes them)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for r in (1, 2):
        lp = -rng.uniform(0.5, 3.0, size=(B, R)) * MASK
        out[f"round{r}/actor/logprobs"] = lp.astype(np.float32)
        out[f"round{r}/actor/entropy"] = (rng.uniform(1, 2, size=(B, R)) * MASK).astype(np.float32)
        out[f"round{r}/critic/values"] = (rng.normal(size=(B, R)) * MASK).astype(np.float32)
        for term in ("policy", "kl", "entropy", "total"):
            out[f"round{r}/actor/loss/{term}"] = np.array(rng.normal(), dtype=np.float32)
        for term in ("value", "total"):
            out[f"round{r}/critic/loss/{term}"] = np.array(rng.normal(), dtype=np.float32)
        for role in ("actor", "critic"):
            out[f"round{r}/{role}/grad_norm"] = np.array(rng.uniform(1, 2), dtype=np.float32)
            out[f"round{r}/{role}/clip_coef"] = np.array(rng.uniform(0.2, 1), dtype=np.float32)
            for metric in ("grads", "exp_avg", "exp_avg_sq", "updates"):
                for name, shape in PARAMS.items():
                    out[f"round{r}/{role}/{metric}/{name}"] = rng.normal(
                        size=shape).astype(np.float32)
    out["round1/reward/rewards"] = rng.normal(size=(B,)).astype(np.float32)
    return out


def role_outputs(hf: Mapping[str, np.ndarray], role: str) -> dict[str, np.ndarray]:
    """A perfect candidate of ``role``: the HF tensors plus an identical padding rerun."""
    out = {k: v.copy() for k, v in hf.items() if k.split("/")[1] == role}
    main = "logprobs" if role == "actor" else "values"
    out[f"round1/{role}/{main}_padded"] = out[f"round1/{role}/{main}"].copy()
    return out


def good_meta() -> dict[str, Any]:
    return {"dtypes": {"master_weights": FP32, "grads": FP32,
                       "optimizer_state": {"exp_avg": FP32, "exp_avg_sq": FP32},
                       "grad_reduction": {"engine.reduce": FP32},
                       "grad_accumulation": {"engine.accumulate": FP32},
                       "compute": ["torch.float32"]},
            "replica_consistency": {"all_equal": True, "params": {
                "model.w": {"equal": True, "max_abs_diff": 0.0}}},
            "versions": {"torch": "2.x"}, "timings": {"total_s": 1.0}}


def all_bounds(hf: Mapping[str, Mapping[str, np.ndarray]]) -> list[Bound]:
    out = []
    for prec, tensors in hf.items():
        for klass in ("candidate_vs_hf", "tp_vs_tp1"):
            for key in group_tensors(tensors):
                out.append(Bound(precision=prec, klass=klass, key=key,
                                 statistic=FAMILY_STATISTIC[key.family], control_error=0.0,
                                 control="hand-made", floor=BOUND[key.family], k=4.0,
                                 bound=BOUND[key.family]))
    return out


def make_contract(required: list[str] | None = None) -> Contract:
    doc = tomllib.loads(torch_tp_only_text())
    if required is not None:
        doc["matrix"]["required_cells"] = required
    return Contract.from_dict(doc)


class World:
    """A sealed reference and a candidate run under ``tmp_path``.

    ``required``: the contract's ``matrix.required_cells``; None leaves it unset (every
    cell of the tiny-qwen3 matrix is then required).
    """

    def __init__(self, tmp_path: Path, *, required: list[str] | None = None,
                 drop_bound: Callable[[Bound], bool] | None = None,
                 behavior_shift: float = 0.05,
                 edit_hf: Callable[[dict[str, np.ndarray]], None] | None = None,
                 train: Mapping[str, np.ndarray] | None = None,
                 sealed_branches: tuple[dict[str, Any], dict[str, np.ndarray]] | None = None,
                 tp_class_factor: float | None = None,
                 ) -> None:
        self.contract = make_contract(required)
        self.hf = {"fp32": hf_tensors(1)}
        if edit_hf is not None:
            edit_hf(self.hf["fp32"])
        rng = np.random.default_rng(2)
        self.hf["bf16"] = {
            k: np.asarray(v + rng.normal(size=v.shape) * 1e-3
                          * (MASK if v.shape == (B, R) else 1), dtype=np.float32)
            for k, v in self.hf["fp32"].items()}
        self.ref = tmp_path / "references" / f"tiny-qwen3-{self.contract.digest12}"
        (self.ref / "reference").mkdir(parents=True)
        (self.ref / "contract.json").write_text(json.dumps(self.contract.to_dict()))
        rollout: dict[str, np.ndarray] = {k: np.zeros((B, R), dtype=np.int64)
                                          for k in ROLLOUT_KEYS}
        rollout["response_mask"] = MASK
        self.behavior = (self.hf["fp32"]["round1/actor/logprobs"] + behavior_shift * MASK
                         ).astype(np.float32)
        rollout["behavior_logprobs"] = self.behavior
        rollout["eos_terminated"] = np.ones(B, dtype=np.int64)
        rollout["group_index"] = np.arange(B, dtype=np.int64)
        save_file(rollout, str(self.ref / "rollout.safetensors"))
        (self.ref / "rollout.json").write_text(json.dumps({"logprobs_mode": "processed"}))
        for prec, t in self.hf.items():
            save_file(t, str(self.ref / "reference" / f"hf-{prec}.safetensors"))
        if train is not None:
            save_file(dict(train), str(self.ref / "train_inputs.safetensors"))
        if sealed_branches is not None:
            (self.ref / "branches").mkdir()
            (self.ref / "branches.json").write_text(json.dumps(sealed_branches[0]))
            save_file(sealed_branches[1], str(self.ref / "branches" / "hf-fp32.safetensors"))
        bounds = [b for b in all_bounds(self.hf) if not (drop_bound and drop_bound(b))]
        if tp_class_factor is not None:  # a TP-only control (row_split) sealed its own class
            bounds += [dataclasses.replace(b, klass=TP_CANDIDATE_CLASS,
                                           bound=b.bound * tp_class_factor)
                       for b in bounds if b.klass == "candidate_vs_hf"]
        (self.ref / "bounds.json").write_text(
            json.dumps(bounds_document(self.contract, bounds)))
        (self.ref / "reference.json").write_text(json.dumps({
            "schema_version": 1, "contract": self.contract.name,
            "contract_digest": self.contract.digest, "created": "2025-01-01T00:00:00Z"}))
        store.seal(self.ref, kind="reference")
        self.run_dir = tmp_path / "evidence" / "tiny-qwen3" / "run-1"
        self.run_dir.mkdir(parents=True)
        self.cells: dict[str, Any] = {}

    def add_cell(self, cid: str, *, status: str = "COMPLETE",
                 outputs: Mapping[str, np.ndarray] | None = None,
                 meta: Mapping[str, Any] | None = None, reason: str | None = None) -> None:
        engine, precision, role, tp = cid.split("-")
        attempt = None
        if status != "NOT_RUN":
            attempt = f"cells/{cid}/attempt-1"
            adir = self.run_dir / attempt
            adir.mkdir(parents=True)
            (adir / "logs").mkdir()
            (adir / "logs" / "rank0.log").write_text("log\n")
            if status == "COMPLETE":
                out = outputs if outputs is not None else role_outputs(self.hf[precision], role)
                save_file(dict(out), str(adir / "outputs.safetensors"))
                (adir / "outputs.json").write_text(
                    json.dumps(meta if meta is not None else good_meta()))
            store.seal(adir, kind="cell-attempt")
        self.cells[cid] = {"engine": engine, "precision": precision, "options": {},
                           "role": role, "tp": int(tp[2:]), "status": status,
                           "reason": reason, "attempt": attempt}

    def write_run(self) -> None:
        (self.run_dir / "run.json").write_text(json.dumps({
            "schema_version": 1, "contract": self.contract.name,
            "contract_digest": self.contract.digest,
            "reference": {"path": str(self.ref),
                          "manifest_digest": store.manifest_digest(self.ref)},
            "run_id": "run-1", "started": "2025-01-01T00:00:00Z", "cells": self.cells}))

    def compare(self, **kw: Any) -> Any:
        self.write_run()
        return compare_run(self.run_dir, **kw)


def actor(world: World, precision: str = "fp32") -> dict[str, np.ndarray]:
    return role_outputs(world.hf[precision], "actor")


def rows_of(report: Any, cell: str, klass: str | None = None) -> list[Row]:
    return [r for r in report.rows if r.cell == cell and (klass is None or r.klass == klass)]


# --------------------------------------------------------------------------- verdicts


def test_identical_outputs_pass_with_margin_zero(tmp_path: Path) -> None:
    w = World(tmp_path, required=[TP1, TP2, BF16_TP1, CRITIC_TP1])
    w.add_cell(TP1)
    w.add_cell(TP2)
    w.add_cell(BF16_TP1)
    w.add_cell(CRITIC_TP1)
    report = w.compare(write=False)
    assert report.passed
    assert bool(report)
    assert report.verdicts == {TP1: "PASS", TP2: "PASS", BF16_TP1: "PASS", CRITIC_TP1: "PASS"}
    assert all(r.verdict == "PASS" for r in report.rows)
    assert all(r.margin == 0.0 for r in report.rows if r.margin is not None)
    assert {r.klass for r in rows_of(report, TP2)} == {
        "candidate_vs_hf", "tp_vs_tp1", "padding_invariance", "dtypes", "replica_consistency"}
    assert "tp_vs_tp1" not in {r.klass for r in rows_of(report, TP1)}
    # candidate_vs_hf covers every actor metric group of the reference: 2 rounds x 9
    # (logprobs, entropy, losses, grad_norm, clip_coef, grads, exp_avg, exp_avg_sq, updates)
    hf_rows = rows_of(report, TP1, "candidate_vs_hf")
    assert len(hf_rows) == 2 * 9
    assert {r.role for r in hf_rows} == {"actor"}
    assert {r.family for r in rows_of(report, CRITIC_TP1, "candidate_vs_hf")} >= {"values"}
    assert report.summary["cells"]["PASS"] == 4


@pytest.mark.parametrize(("delta", "verdict"), [(1.001e-3, "FAIL"), (0.999e-3, "PASS")])
def test_perturbation_around_the_bound(tmp_path: Path, delta: float, verdict: str) -> None:
    w = World(tmp_path, required=[TP1])
    out = actor(w)
    out["round1/actor/logprobs"][1, 2] += delta
    out["round1/actor/logprobs_padded"][1, 2] += delta  # keep padding invariance exact
    w.add_cell(TP1, outputs=out)
    report = w.compare(write=False)
    (row,) = [r for r in rows_of(report, TP1, "candidate_vs_hf")
              if r.metric == "round1/actor/logprobs"]
    assert row.verdict == verdict
    assert row.where == "(1, 2)"
    assert row.margin == pytest.approx(delta / 1e-3, rel=1e-3)
    assert report.passed is (verdict == "PASS")
    if verdict == "FAIL":
        assert row.reason is not None
        assert "round1/actor/logprobs" in row.reason
        assert "(1, 2)" in row.reason
        assert row.detail is not None
        assert (row.detail.mismatched, row.detail.total) == (1, N_VALID)
        assert row.detail.columns == ("index", "obtained", "expected", "abs diff")
        assert row.detail.table[0][0] == "(1, 2)"
        assert row.detail.table[0][3] == pytest.approx(delta, rel=1e-3)
        assert report.verdicts[TP1] == "FAIL"
        assert report.failures == (row,)


def test_masked_token_differences_are_ignored(tmp_path: Path) -> None:
    w = World(tmp_path)
    out = actor(w)
    for name in ("round1/actor/logprobs", "round1/actor/logprobs_padded",
                 "round2/actor/entropy"):
        out[name][0, 3] = 1e6  # MASK[0, 3] == 0
        out[name][2, 2:] = np.nan  # MASK[2, 2:] == 0
    w.add_cell(TP1, outputs=out)
    report = w.compare(write=False)
    assert report.verdicts[TP1] == "PASS"


def test_missing_bound_is_error_not_pass(tmp_path: Path) -> None:
    w = World(tmp_path, drop_bound=lambda b: (b.precision, b.klass, b.key.label) == (
        "fp32", "candidate_vs_hf", "round1/actor/entropy"), required=[TP1])
    w.add_cell(TP1)
    report = w.compare(write=False)
    (row,) = [r for r in rows_of(report, TP1) if r.metric == "round1/actor/entropy"]
    assert row.verdict == "ERROR"
    assert row.error == 0.0  # measured, identical, and still not a pass
    assert row.reason is not None
    assert "no sealed bound for round1/actor/entropy" in row.reason
    assert report.verdicts[TP1] == "ERROR"
    assert not report.passed


@pytest.mark.parametrize(("required", "passed"), [
    (None, False),                # default: every matrix cell is required, NOT_RUN blocks
    ([TP1], True),                # explicitly not required: does not block
    ([TP1, TP2], False),          # required and not run
    ([TP1, "torch_tp-fp32-critic-tp2"], False),  # required and absent from run.json
])
def test_not_run_cell(tmp_path: Path, required: list[str] | None, passed: bool) -> None:
    w = World(tmp_path, required=required)
    w.add_cell(TP1)
    w.add_cell(TP2, status="NOT_RUN", reason="needs CUDA")
    report = w.compare(write=False)
    assert report.verdicts[TP2] == "NOT_RUN"
    (cell,) = [c for c in report.cells if c.cell == TP2]
    assert cell.reason == "needs CUDA"
    assert cell.required is (required is None or TP2 in required)
    assert not rows_of(report, TP2)
    assert report.passed is passed
    if required and len(required) == 2 and required[1] not in w.cells:
        assert report.verdicts[required[1]] == "NOT_RUN"


@pytest.mark.parametrize("required", [None, []])
def test_only_not_run_cells_never_pass(tmp_path: Path, required: list[str] | None) -> None:
    w = World(tmp_path, required=required)
    w.add_cell(TP1, status="NOT_RUN", reason="no engine")
    report = w.compare(write=False)
    if required is None:  # every matrix cell required: TP1 NOT_RUN, the others absent
        assert set(report.required) == {c.cell_id for c in w.contract.matrix.cells()}
        assert set(report.not_passed) == set(report.required)
    else:  # no required cell at all is no pass either
        assert report.required == ()
    assert not report.passed


def test_error_status_propagates_with_logs_path(tmp_path: Path) -> None:
    w = World(tmp_path, required=[TP1, TP2])
    w.add_cell(TP1)
    w.add_cell(TP2, status="ERROR", reason="rank 1 exited with 1")
    report = w.compare(write=False)
    (cell,) = [c for c in report.cells if c.cell == TP2]
    assert cell.verdict == "ERROR"
    assert cell.required
    assert cell.reason is not None
    assert "rank 1 exited with 1" in cell.reason
    assert str(w.run_dir / "cells" / TP2 / "attempt-1" / "logs") in cell.reason
    assert not report.passed


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda d: d["optimizer_state"].update(exp_avg="torch.bfloat16"),
     "optimizer_state.exp_avg is torch.bfloat16, expected torch.float32"),
    (lambda d: d.update(master_weights="torch.bfloat16"), "master_weights is torch.bfloat16"),
    (lambda d: d.pop("grads"), "grads is missing"),
    (lambda d: d.pop("optimizer_state"), "optimizer_state is missing"),
    (lambda d: d["grad_reduction"].update({"engine.reduce": "torch.bfloat16"}),
     "grad_reduction.engine.reduce is torch.bfloat16, expected torch.float32"),
    (lambda d: d.pop("grad_accumulation"), "grad_accumulation is missing"),
])
def test_dtype_check_in_bf16_cell(tmp_path: Path, mutate: Callable[[dict[str, Any]], Any],
                                  needle: str) -> None:
    w = World(tmp_path)
    meta = good_meta()
    mutate(meta["dtypes"])
    w.add_cell(BF16_TP1, meta=meta)
    report = w.compare(write=False)
    (row,) = rows_of(report, BF16_TP1, "dtypes")
    assert row.verdict == "FAIL"
    assert row.reason is not None
    assert row.reason.startswith("dtypes: ")
    assert needle in row.reason
    assert report.verdicts[BF16_TP1] == "FAIL"


@pytest.mark.parametrize("missing", ["dtypes", "replica_consistency"])
def test_missing_meta_key_fails_that_check(tmp_path: Path, missing: str) -> None:
    w = World(tmp_path)
    meta = good_meta()
    del meta[missing]
    w.add_cell(TP1, meta=meta)
    report = w.compare(write=False)
    bad = [r for r in rows_of(report, TP1) if r.verdict != "PASS"]
    assert len(bad) == 1
    assert bad[0].verdict == "FAIL"
    assert bad[0].reason is not None
    assert f"{missing} is missing from outputs.json" in bad[0].reason


@pytest.mark.parametrize("rc", [
    {"all_equal": False, "params": {"model.w": {"equal": False, "max_abs_diff": 2.5e-8}}},
    {"all_equal": True, "params": {"model.w": {"equal": False, "max_abs_diff": 1e-7}}},
    {"params": {}},
])
def test_replica_inconsistency_fails(tmp_path: Path, rc: dict[str, Any]) -> None:
    w = World(tmp_path)
    meta = good_meta()
    meta["replica_consistency"] = rc
    w.add_cell(TP1)
    w.add_cell(TP2, meta=meta)
    report = w.compare(write=False)
    (row,) = rows_of(report, TP2, "replica_consistency")
    assert row.verdict == "FAIL"
    assert row.detail is not None
    assert row.detail.table
    assert report.verdicts[TP2] == "FAIL"


def test_padding_variant_mismatch_fails(tmp_path: Path) -> None:
    w = World(tmp_path)
    out = actor(w)
    out["round1/actor/logprobs_padded"][2, 1] += 0.5
    w.add_cell(TP1, outputs=out)
    report = w.compare(write=False)
    (row,) = rows_of(report, TP1, "padding_invariance")
    assert (row.verdict, row.bound_class, row.variant) == ("FAIL", "tp_vs_tp1", "padded")
    assert row.metric == "round1/actor/logprobs[padded]"
    assert row.where == "(2, 1)"
    assert row.error == pytest.approx(0.5, rel=1e-6)


def test_missing_padding_rerun_fails(tmp_path: Path) -> None:
    w = World(tmp_path)
    out = actor(w)
    del out["round1/actor/logprobs_padded"]
    w.add_cell(TP1, outputs=out)
    report = w.compare(write=False)
    (row,) = rows_of(report, TP1, "padding_invariance")
    assert row.verdict == "FAIL"
    assert row.reason is not None
    assert "logprobs_padded" in row.reason


def test_tp_vs_tp1_catches_what_hf_bounds_allow(tmp_path: Path) -> None:
    """TP2 and TP1 each within the HF bound (0.6 %), but 1.2 % apart: over the TP bound."""
    w = World(tmp_path)
    lo, hi = actor(w), actor(w)
    for r in (1, 2):
        for name in PARAMS:
            lo[f"round{r}/actor/grads/{name}"] *= np.float32(1 - 0.006)
            hi[f"round{r}/actor/grads/{name}"] *= np.float32(1 + 0.006)
    w.add_cell(TP1, outputs=lo)
    w.add_cell(TP2, outputs=hi)
    report = w.compare(write=False)
    assert all(r.verdict == "PASS" for r in rows_of(report, TP2, "candidate_vs_hf"))
    bad = [r for r in rows_of(report, TP2, "tp_vs_tp1") if r.verdict != "PASS"]
    assert {r.metric for r in bad} == {"round1/actor/grads", "round2/actor/grads"}
    detail = bad[0].detail
    assert detail is not None
    assert detail.columns == ("param", "rel L2", "norm obtained", "norm expected")
    assert {row[0] for row in detail.table} == set(PARAMS)
    assert bad[0].error == pytest.approx(0.012 / 0.994, rel=1e-4)


@pytest.mark.parametrize("sealed", [True, False], ids=["tp-class", "no-tp-class"])
def test_tp_only_bounds_judge_the_cells_at_tp_above_one(tmp_path: Path, sealed: bool) -> None:
    """A reference that sealed the TP-only class (row_split) judges the candidate_vs_hf rows
    of a TP 2 cell by it, never a TP 1 cell's; one without it judges both by
    candidate_vs_hf (a reference sealed before the class existed)."""
    w = World(tmp_path, tp_class_factor=3.0 if sealed else None)
    off = actor(w)
    for r in (1, 2):
        for name in PARAMS:  # 1.2 %: over the candidate_vs_hf bound, under 3x it
            off[f"round{r}/actor/grads/{name}"] *= np.float32(1 + 0.012)
    w.add_cell(TP1, outputs=off)
    w.add_cell(TP2, outputs=off)
    report = w.compare(write=False)
    tp1, tp2 = rows_of(report, TP1, "candidate_vs_hf"), rows_of(report, TP2, "candidate_vs_hf")
    assert {r.bound_class for r in tp1} == {"candidate_vs_hf"}
    assert {r.bound_class for r in tp2} == ({TP_CANDIDATE_CLASS} if sealed
                                            else {"candidate_vs_hf"})
    grads = {"round1/actor/grads", "round2/actor/grads"}
    assert {r.metric for r in tp1 if r.verdict == "FAIL"} == grads
    assert {r.metric for r in tp2 if r.verdict == "FAIL"} == (set() if sealed else grads)


def test_tp_row_not_run_when_tp1_did_not_complete(tmp_path: Path) -> None:
    w = World(tmp_path, required=[TP1, TP2])
    w.add_cell(TP1, status="ERROR", reason="oom")
    w.add_cell(TP2)
    report = w.compare(write=False)
    tp_rows = rows_of(report, TP2, "tp_vs_tp1")
    assert tp_rows
    assert all(r.verdict == "NOT_RUN" for r in tp_rows)
    assert all(r.reason is not None
               and "TP=1 cell of the same engine did not complete" in r.reason
               for r in tp_rows)
    assert report.verdicts[TP2] == "NOT_RUN"
    assert not report.passed


def test_missing_candidate_tensor_fails_with_inf(tmp_path: Path) -> None:
    w = World(tmp_path)
    out = actor(w)
    del out["round2/actor/exp_avg/model.b"]
    w.add_cell(TP1, outputs=out)
    report = w.compare(write=False)
    (row,) = [r for r in rows_of(report, TP1) if r.metric == "round2/actor/exp_avg"]
    assert row.verdict == "FAIL"
    assert row.error == math.inf
    assert row.margin == math.inf


def test_edited_attempt_is_an_error(tmp_path: Path) -> None:
    w = World(tmp_path, required=[TP1])
    w.add_cell(TP1)
    adir = w.run_dir / "cells" / TP1 / "attempt-1"
    store.make_writable(adir)
    (adir / "outputs.json").write_text(json.dumps(good_meta()) + " ")
    report = w.compare(write=False)
    assert report.verdicts[TP1] == "ERROR"
    (cell,) = report.cells
    assert cell.reason is not None
    assert "outputs.json" in cell.reason


def test_matrix_cell_absent_from_run_is_required_and_not_run(tmp_path: Path) -> None:
    """No ``required_cells``: a matrix cell missing from run.json is NOT_RUN, required,
    and the run does not pass, though every cell that ran passes."""
    w = World(tmp_path)
    matrix = [c.cell_id for c in w.contract.matrix.cells()]
    assert len(matrix) == 8
    for cid in matrix:
        w.add_cell(cid)
    assert w.compare(write=False).passed  # the whole matrix ran and passed
    absent = "torch_tp-bf16-critic-tp2"
    del w.cells[absent]
    report = w.compare(write=False)
    assert not report.passed
    assert not bool(report)
    assert report.verdicts == {**{c: "PASS" for c in matrix if c != absent}, absent: "NOT_RUN"}
    (cell,) = [c for c in report.cells if c.cell == absent]
    assert (cell.status, cell.verdict, cell.required) == ("NOT_RUN", "NOT_RUN", True)
    assert cell.reason is not None
    assert "absent from run.json" in cell.reason
    assert set(report.required) == set(matrix)
    assert report.not_passed == (absent,)
    assert not rows_of(report, absent)


# --------------------------------------------------------------------------- integrity


def test_writes_reports_and_refuses_a_sealed_run(tmp_path: Path) -> None:
    w = World(tmp_path, required=[TP1])
    w.add_cell(TP1)
    report = w.compare()
    assert (w.run_dir / "report.json").is_file()
    assert (w.run_dir / "report.md").is_file()
    assert json.loads((w.run_dir / "report.json").read_text())["passed"] is True
    assert report.passed
    store.seal(w.run_dir, kind="candidate-run")
    with pytest.raises(EvidenceIntegrityError, match="sealed"):
        compare_run(w.run_dir)
    assert compare_run(w.run_dir, write=False).passed


def test_reference_of_another_run_is_refused(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.add_cell(TP1)
    w.write_run()
    doc = json.loads((w.run_dir / "run.json").read_text())
    doc["reference"]["manifest_digest"] = "0" * 64
    (w.run_dir / "run.json").write_text(json.dumps(doc))
    with pytest.raises(EvidenceIntegrityError, match="another reference"):
        compare_run(w.run_dir, write=False)


def test_contract_digest_mismatch_is_refused(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.add_cell(TP1)
    w.write_run()
    doc = json.loads((w.run_dir / "run.json").read_text())
    doc["contract_digest"] = "f" * 64
    (w.run_dir / "run.json").write_text(json.dumps(doc))
    with pytest.raises(ReferenceDataError, match="contract_digest"):
        compare_run(w.run_dir, write=False)


def test_not_a_run_directory(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"run\.json"):
        compare_run(tmp_path, write=False)


# --------------------------------------------------------------------------- judge


@pytest.mark.parametrize(("error", "bound", "verdict", "margin"), [
    (0.0, 0.0, "PASS", 0.0),
    (0.0, 1e-3, "PASS", 0.0),
    (1e-3, 1e-3, "PASS", 1.0),
    (5e-4, 1e-3, "PASS", 0.5),
    (2e-3, 1e-3, "FAIL", 2.0),
    (1e-9, 0.0, "FAIL", math.inf),
    (math.inf, 1.0, "FAIL", math.inf),
    (math.nan, 1.0, "FAIL", math.inf),
])
def test_judge(error: float, bound: float, verdict: str, margin: float) -> None:
    assert judge(error, bound) == (verdict, margin)


@pytest.mark.parametrize(("verdicts", "worst"), [
    (["PASS", "PASS"], "PASS"), (["PASS", "NOT_RUN"], "NOT_RUN"),
    (["NOT_RUN", "ERROR"], "ERROR"), (["ERROR", "FAIL", "PASS"], "FAIL"), ([], "ERROR"),
])
def test_worst_verdict(verdicts: list[Any], worst: str) -> None:
    assert worst_verdict(verdicts) == worst


# --------------------------------------------------------------------------- invariants

_floats = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)


@st.composite
def tensor_sets(draw: st.DrawFn) -> tuple[dict[str, np.ndarray], np.ndarray]:
    b, r = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    mask = draw(hnp.arrays(np.int64, (b, r), elements=st.integers(0, 1)))
    t = {"round1/actor/logprobs": draw(hnp.arrays(np.float32, (b, r), elements=_floats)),
         "round1/actor/grad_norm": draw(hnp.arrays(np.float32, (), elements=_floats))}
    for term in draw(st.lists(st.sampled_from(["policy", "kl", "total"]), min_size=1,
                              unique=True)):
        t[f"round1/actor/loss/{term}"] = draw(hnp.arrays(np.float32, (), elements=_floats))
    for name in draw(st.lists(st.sampled_from(list(PARAMS)), min_size=1, unique=True)):
        t[f"round1/actor/grads/{name}"] = draw(hnp.arrays(np.float32, PARAMS[name],
                                                          elements=_floats))
    return t, mask


@given(tensor_sets(), st.sampled_from([0.0, 1e-6, 1.0]))
@settings(max_examples=60, deadline=None)
def test_any_tensor_set_against_itself_passes_with_error_zero(
        ts: tuple[dict[str, np.ndarray], np.ndarray], bound: float) -> None:
    tensors, mask = ts
    bounds = [Bound(precision="fp32", klass="candidate_vs_hf", key=k,
                    statistic=FAMILY_STATISTIC[k.family], control_error=0.0, control="x",
                    floor=bound, k=4.0, bound=bound) for k in group_tensors(tensors)]
    rows = compare_rows(cell="c", klass="candidate_vs_hf", precision="fp32", bounds=bounds,
                        obtained=tensors, expected=tensors, mask=mask)
    assert rows
    assert all((r.verdict, r.error, r.margin) == ("PASS", 0.0, 0.0) for r in rows)


@given(tensor_sets(), st.data())
@settings(max_examples=60, deadline=None)
def test_max_abs_error_is_symmetric(ts: tuple[dict[str, np.ndarray], np.ndarray],
                                    data: st.DataObject) -> None:
    a, mask = ts
    b = {k: data.draw(hnp.arrays(np.float32, v.shape, elements=_floats)) for k, v in a.items()}
    ab, ba = compare_sets(a, b, mask), compare_sets(b, a, mask)
    for key, m in ab.items():
        if FAMILY_STATISTIC[key.family] in ("max_abs", "abs"):
            assert m.value == ba[key].value


def test_explicit_reference_dir(tmp_path: Path) -> None:
    w = World(tmp_path, required=[TP1])
    w.add_cell(TP1)
    w.write_run()
    assert compare_run(w.run_dir, reference_dir=w.ref, write=False).passed
    with pytest.raises(ReferenceDataError, match="not found"):
        compare_run(w.run_dir, reference_dir=tmp_path / "nowhere", write=False)


def test_cli_compare_with_reference_after_the_reference_moved(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``qualify compare RUN --reference DIR``: the recorded reference path is gone."""
    w = World(tmp_path, required=[TP1])
    w.add_cell(TP1)
    w.write_run()
    moved = tmp_path / "moved" / w.ref.name
    (tmp_path / "references").rename(tmp_path / "moved")
    assert not w.ref.exists()
    assert main(["compare", str(w.run_dir), "--no-seal"]) == ExitCode.USAGE_ERROR
    assert "--reference" in capsys.readouterr().err
    assert not (w.run_dir / REPORT_JSON).exists()
    assert main(["compare", str(w.run_dir), "--reference", str(moved), "--no-seal"]) \
        == ExitCode.OK
    doc = json.loads((w.run_dir / REPORT_JSON).read_text())
    assert doc["reference"]["path"] == str(moved)
    assert doc["passed"] is True
    assert (w.run_dir / REPORT_MD).is_file()


def test_renamed_reference_is_found_by_its_manifest_digest(tmp_path: Path) -> None:
    """No ``reference_dir``: a reference renamed under ``references/`` is found again."""
    w = World(tmp_path, required=[TP1])
    w.add_cell(TP1)
    w.write_run()
    renamed = w.ref.with_name("renamed")
    w.ref.rename(renamed)
    report = compare_run(w.run_dir, write=False)
    assert report.passed
    assert report.reference_dir == str(renamed)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("tp", "1", r"cells\.torch_tp-fp32-actor-tp1: tp: expected int, found '1'"),
    ("tp", 1.0, r"cells\.torch_tp-fp32-actor-tp1: tp: expected int"),
    ("status", None, r"cells\.torch_tp-fp32-actor-tp1: status: expected str"),
    ("attempt", 3, r"cells\.torch_tp-fp32-actor-tp1: attempt: expected str"),
])
def test_mistyped_run_json_field_is_named(tmp_path: Path, field: str, value: Any,
                                           match: str) -> None:
    w = World(tmp_path, required=[TP1])
    w.add_cell(TP1)
    w.cells[TP1][field] = value
    with pytest.raises(ReferenceDataError, match=match):
        w.compare(write=False)


def test_mistyped_run_reference_is_named(tmp_path: Path) -> None:
    w = World(tmp_path, required=[TP1])
    w.add_cell(TP1)
    w.write_run()
    doc = json.loads((w.run_dir / RUN_FILE).read_text())
    doc["reference"]["manifest_digest"] = 12
    (w.run_dir / RUN_FILE).write_text(json.dumps(doc))
    with pytest.raises(ReferenceDataError, match=r"reference: manifest_digest: expected str"):
        compare_run(w.run_dir, write=False)


def test_unknown_status_is_an_error(tmp_path: Path) -> None:
    w = World(tmp_path, required=[TP1])
    w.add_cell(TP1)
    w.cells[TP1]["status"] = "RUNNING"
    report = w.compare(write=False)
    (cell,) = report.cells
    assert (cell.status, cell.verdict) == ("ERROR", "ERROR")
    assert cell.reason is not None
    assert "'RUNNING'" in cell.reason


def _scoring_only(world: World) -> dict[str, np.ndarray]:
    """Round-1 logprobs/entropy (+ padding rerun) only, as Megatron's CPU scoring cell."""
    full = actor(world)
    keep = ("round1/actor/logprobs", "round1/actor/entropy", "round1/actor/logprobs_padded")
    return {k: v for k, v in full.items() if k in keep}


NOT_RUN_DECL = [{"round": None, "family": f, "reason": "Megatron optimizer needs CUDA"}
                for f in ("losses", "grad_norm", "clip_coef", "grads", "exp_avg",
                          "exp_avg_sq", "updates", "dtypes", "replica")] + [
    {"round": 2, "family": "*", "reason": "round 2 needs the round-1 update"}]


def test_declared_not_run_metrics_are_not_run_with_the_reason(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.add_cell(TP1, outputs=_scoring_only(w),
               meta={"not_run": NOT_RUN_DECL, "versions": {}, "timings": {}})
    report = w.compare(write=False)
    rows = {r.metric: r for r in rows_of(report, TP1, "candidate_vs_hf")}
    assert rows["round1/actor/logprobs"].verdict == "PASS"
    assert rows["round1/actor/entropy"].verdict == "PASS"
    assert rows["round1/actor/grads"].verdict == "NOT_RUN"
    assert rows["round1/actor/grads"].reason == "Megatron optimizer needs CUDA"
    assert rows["round2/actor/logprobs"].verdict == "NOT_RUN"
    assert rows["round2/actor/logprobs"].reason == "round 2 needs the round-1 update"
    checks = {r.klass: r for r in rows_of(report, TP1) if r.klass in ("dtypes",
                                                                         "replica_consistency")}
    assert checks["dtypes"].verdict == "NOT_RUN"
    assert checks["replica_consistency"].verdict == "NOT_RUN"
    assert not any(r.verdict == "FAIL" for r in rows_of(report, TP1))
    assert report.verdicts[TP1] == "NOT_RUN"  # never a pass: part of the cell did not run
    assert not report.passed


def test_undeclared_missing_metrics_still_fail(tmp_path: Path) -> None:
    w = World(tmp_path)
    decl = [d for d in NOT_RUN_DECL if d["family"] != "grads"]
    w.add_cell(TP1, outputs=_scoring_only(w), meta={"not_run": decl})
    report = w.compare(write=False)
    rows = {r.metric: r for r in rows_of(report, TP1, "candidate_vs_hf")}
    assert rows["round1/actor/grads"].verdict == "FAIL"
    assert rows["round1/actor/grads"].error == math.inf
    assert report.verdicts[TP1] == "FAIL"


def test_declared_but_reported_metric_is_still_compared(tmp_path: Path) -> None:
    w = World(tmp_path)
    out = actor(w)
    out["round1/actor/grads/model.w"] = out["round1/actor/grads/model.w"] * 2.0
    w.add_cell(TP1, outputs=out, meta={**good_meta(), "not_run": NOT_RUN_DECL})
    report = w.compare(write=False)
    rows = {r.metric: r for r in rows_of(report, TP1, "candidate_vs_hf")}
    assert rows["round1/actor/grads"].verdict == "FAIL"


# --------------------------------------------------------------------------- branch flips

EPS_V = 0.2  # tiny-qwen3's value_clip


def _near_edge(t: dict[str, np.ndarray]) -> None:
    """Round-2 values 0.05 - 4e-4 above round 1 at token (1, 1): just inside the clip range."""
    t["round2/critic/values"] = t["round1/critic/values"].copy()
    t["round2/critic/values"][1, 1] += np.float32(EPS_V - 4e-4)


def test_flipped_clip_branch_is_named_in_the_failure(tmp_path: Path) -> None:
    """Round-2 values within the bound, but token (1, 1) crosses the value-clip edge
    towards its return: the failing round-2 gradient rows name the flip; verdicts stay."""
    returns = np.ones((B, R), dtype=np.float32) * 5.0  # far above: moving up is towards R
    w = World(tmp_path, required=[CRITIC_TP1], edit_hf=_near_edge,
              train={"returns": returns, "advantages": np.zeros((B, R), np.float32)})
    out = role_outputs(w.hf["fp32"], "critic")
    out["round2/critic/values"][1, 1] += np.float32(8e-4)  # 4e-4 outside; error 8e-4 < 1e-3
    out["round2/critic/grads/model.b"] *= np.float32(1.5)  # the flipped token's gradient
    w.add_cell(CRITIC_TP1, outputs=out)
    report = w.compare(write=False)
    rows = {r.metric: r for r in rows_of(report, CRITIC_TP1, "candidate_vs_hf")}
    assert rows["round2/critic/values"].verdict == "PASS"
    grads = rows["round2/critic/grads"]
    assert grads.verdict == "FAIL"
    assert grads.reason is not None
    assert "clip branch differs at 1 round-2 critic token(s)" in grads.reason
    assert "(1, 1) zero vs full" in grads.reason
    assert report.verdicts[CRITIC_TP1] == "FAIL"


def _sealed_flip(jac_b: np.ndarray) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``branches.json`` + tensors sealing critic token (1, 1) of round 2 with ``J_t`` zero
    except ``model.b``."""
    jac = {"round2/critic/1_1/model.w": np.zeros(PARAMS["model.w"], np.float32),
           "round2/critic/1_1/model.b": jac_b.astype(np.float32)}
    doc = {"schema_version": 1, "precisions": {"fp32": {"critic": {"round2": {
        "tol_old": 1e-3, "tol_cur": 1e-3, "tokens": {"1_1": {"index": [1, 1], "dot_grad": 0.0}},
        "gram": {"1_1": {"1_1": float(np.square(jac_b).sum())}}}}}}}
    return doc, jac


@pytest.mark.parametrize("sealed_right", [True, False])
def test_sealed_flip_is_judged_on_the_obtained_branch(tmp_path: Path, sealed_right: bool) -> None:
    """The same flip as above, now sealed by the reference: the round-2 gradient rows are
    judged against the expected run moved to the candidate's branch. A candidate equal to
    that moved run passes, with the adjustment and the unadjusted error recorded; a sealed
    gradient that does not explain the candidate's still fails."""
    from qualify import branches

    returns = np.ones((B, R), dtype=np.float32) * 5.0
    train = {"returns": returns, "advantages": np.zeros((B, R), np.float32)}
    probe = World(tmp_path / "probe", required=[CRITIC_TP1], edit_hf=_near_edge, train=train)
    out = role_outputs(probe.hf["fp32"], "critic")
    out["round2/critic/values"][1, 1] += np.float32(8e-4)
    jac_b = np.array([1.0, -2.0, 0.5])
    flips = branches.flipped_tokens(out, role_outputs(probe.hf["fp32"], "critic"),
                                    role="critic", round_=2, train=train, mask=MASK,
                                    value_clip=EPS_V, clip_ratio=0.2)
    assert flips is not None
    assert [f["index"] for f in flips] == [[1, 1]]
    doc, jac = _sealed_flip(jac_b)
    moved, note = branches.adjusted_expected(
        probe.hf["fp32"], role="critic", round_=2, flips=flips,
        jacobians={k.removeprefix("round2/critic/"): v for k, v in jac.items()},
        scalars=doc["precisions"]["fp32"]["critic"]["round2"], train=train,
        n_valid=float(N_VALID), lr=probe.contract.optimizer.lr("critic", 2),  # round 2's
        betas=(0.9, 0.95), eps=1e-6, max_grad_norm=0.5)
    assert moved is not None, note
    for k, v in moved.items():
        if k.startswith("round2/critic/") and "values" not in k and k in out:
            out[k] = np.asarray(v, np.float32)
    w = World(tmp_path, required=[CRITIC_TP1], edit_hf=_near_edge, train=train,
              sealed_branches=_sealed_flip(jac_b if sealed_right else -jac_b))
    w.add_cell(CRITIC_TP1, outputs=out)
    report = w.compare(write=False)
    rows = {r.metric: r for r in rows_of(report, CRITIC_TP1, "candidate_vs_hf")}
    grads = rows["round2/critic/grads"]
    assert grads.adjustment is not None
    assert "(1, 1) removed" in grads.adjustment  # the candidate left the clip range
    assert "unadjusted error" in grads.adjustment
    if sealed_right:
        assert grads.verdict == "PASS"
        assert report.verdicts[CRITIC_TP1] == "PASS"
        assert rows["round2/critic/exp_avg"].adjustment is not None
    else:
        assert grads.verdict == "FAIL"
        assert report.verdicts[CRITIC_TP1] == "FAIL"


def test_max_rel_l2_scale_is_the_larger_norm() -> None:
    """An expected value moved to another branch keeps the unmoved scale as denominator."""
    from qualify.statistics import max_rel_l2

    got = {"p": np.array([1.1, 0.0])}
    moved = {"p": np.array([1.0, 0.0])}
    assert max_rel_l2(got, moved).value == pytest.approx(0.1)
    assert max_rel_l2(got, moved, {"p": np.array([0.0, 4.0])}).value == pytest.approx(0.025)
    assert max_rel_l2(got, moved, {"p": np.array([0.0, 0.5])}).value == pytest.approx(0.1)


def test_failure_without_a_flip_is_not_annotated(tmp_path: Path) -> None:
    returns = np.ones((B, R), dtype=np.float32) * 5.0
    w = World(tmp_path, required=[CRITIC_TP1], edit_hf=_near_edge,
              train={"returns": returns, "advantages": np.zeros((B, R), np.float32)})
    out = role_outputs(w.hf["fp32"], "critic")
    out["round2/critic/grads/model.b"] *= np.float32(1.5)
    w.add_cell(CRITIC_TP1, outputs=out)
    report = w.compare(write=False)
    (grads,) = [r for r in rows_of(report, CRITIC_TP1, "candidate_vs_hf")
                if r.metric == "round2/critic/grads"]
    assert grads.verdict == "FAIL"
    assert grads.reason is not None
    assert "clip branch" not in grads.reason


# --------------------------------------------------------------------------- sampler cells

SAMPLER = "vllm-fp32-sampler-tp1"


def _sampler_meta(first_after_update: int) -> dict[str, Any]:
    from qualify.compare.sampler import PROBES

    return {
        "install": {"accepted": True, "acks": [{"rank": 0, "version": 1, "digest": "d0"}],
                    "expected_digest": ["d0"], "tensors_verified": 3},
        "final": {"version": 1, "verified": True, "problem": None},
        "cache_proof": {"cached_tokens_first_after_update": first_after_update,
                        "cached_tokens_same_version_replay": 32},
        "kernel_probe": {"version": 1, "previous_file": "/m/v0", "layers_probed": 9,
                        "changed": 9, "stale": [], "worst_err_new": 1e-7, "tolerance": 1e-3},
        "probes": [{"name": n, "rejected": True, "stayed": True, "reason": f"{n} refused",
                    "version_before": 1, "version_after": 1, "expected_check": n,
                    "record": {"accepted": False, "check": n}} for n in PROBES]}


@pytest.mark.parametrize(("first_after_update", "verdict"), [(0, "PASS"), (32, "FAIL")])
def test_sampler_cell_verdict_is_its_own_rows(tmp_path: Path, first_after_update: int,
                                              verdict: str) -> None:
    """A sampler cell judged right after a passing trainer cell gets its own rows' verdict
    (it once inherited the previous cell's verdict)."""
    w = World(tmp_path, required=[TP1])
    w.add_cell(TP1)
    lp = w.hf["fp32"]["round2/actor/logprobs"].copy()
    w.add_cell(SAMPLER, outputs={"round2/sampler/logprobs": lp},
               meta=_sampler_meta(first_after_update))
    w.cells[SAMPLER]["weights_from"] = TP1
    report = w.compare(write=False)
    assert report.verdicts[TP1] == "PASS"
    assert report.verdicts[SAMPLER] == verdict
    cell = next(c for c in report.cells if c.cell == SAMPLER)
    if verdict == "FAIL":
        assert cell.reason is not None
        assert "predates the update" in cell.reason
    else:
        assert cell.reason is None


def test_sampler_rows_read_only_the_weights_source_logprobs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler rows get the weights source's ``round2/actor/logprobs`` and nothing else.

    The weights source is an Actor cell, whose outputs hold its whole gradients, moments and
    updates: reading them all for one ``[B, R]`` tensor would make that cell the compare's
    memory peak on a large model. The committed default run is compared again (not written)
    with the builder watched; its rows are the committed report's.
    """
    from committed import committed_runs

    import qualify.compare.stage as stage

    run = committed_runs()[-1]
    seen: list[Any] = []
    real = stage.sampler_rows

    def watched(**kw: Any) -> list[Row]:
        actor = kw["actor"]
        seen.append(actor if isinstance(actor, str) else sorted(actor))
        return real(**kw)

    monkeypatch.setattr(stage, "sampler_rows", watched)
    report = compare_run(run, write=False)
    assert len(seen) == 2, seen  # the TP 1 and TP 2 sampler cells
    assert all(s == ["round2/actor/logprobs"] for s in seen), seen
    committed = json.loads((run / REPORT_JSON).read_text())
    want = {(r["cell"], r["class"], r["family"], r["statistic"]): r["verdict"]
            for r in committed["rows"] if r["class"] == "sampler_vs_actor"}
    got = {(r.cell, r.klass, r.family, r.statistic): r.verdict for r in report.rows
           if r.klass == "sampler_vs_actor"}
    assert want
    assert got == want
