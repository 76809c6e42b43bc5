"""Resume equivalence of the fsdp2 harness (issue #18) under real torchrun + gloo.

Launches (each a real ``torch.distributed.run``, at most 4 ranks, cached per session):
``full`` (rounds 1 and 2 uninterrupted), ``save`` (round 1, then a
``torch.distributed.checkpoint`` of ``get_state_dict(model, AdamW)`` of the ``fully_shard``-ed
model beside the scheduler, RNG and round-1 state), and ``load`` launches (fresh interpreters
restoring ``save``'s checkpoint and running round 2): a correct one, and one with each
planted resume fault. Two topologies: ``dp2`` (Actor and Critic each TP 1 x DP 2: the
parameters, AdamW state and batch rows sharded over two ranks; the faults run here) and
``tp2`` (each role TP 2 x DP 1: a ``("dp", "tp")`` mesh, TP DTensors in the checkpoint). The
resumed round 2 is judged by :func:`qualify.compare.resume.resume_rows` against ``full``'s.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
from harness_outputs import build_inputs, locked
from safetensors.numpy import load_file
from test_resume_torch_tp import assert_planted_fault_fails

from qualify.candidate.launch import launch
from qualify.compare.resume import STATE_QUANTITIES, resume_rows
from qualify.compare.verdicts import Row
from qualify.protocol import HarnessCell
from qualify.registry import get_engine

pytestmark = pytest.mark.slow  # minutes: .ci/run's resume and recovery step

ENGINE = get_engine("fsdp2")
LAUNCH_TIMEOUT_S = 400.0
TOPOLOGIES: dict[str, tuple[int, int]] = {"dp2": (1, 2), "tp2": (2, 1)}
"""Topology -> (TP of each role, DP degree): 4 ranks each."""
PHASES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "full": (None, ()),
    "save": ("save", ()),
    "load": ("load", ()),
    "load-drops-optimizer": ("load", ("resume_drops_optimizer_state",)),
    "load-drops-step": ("load", ("resume_drops_step_counter",)),
}


class Runs:
    """Each launch once per session (file-locked, shared by xdist workers)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.inputs = root / "inputs"
        root.mkdir(parents=True, exist_ok=True)
        with locked(root / "inputs.lock"):
            if not (self.inputs / "params.json").is_file():
                self.inputs.mkdir(exist_ok=True)
                build_inputs(self.inputs, (10, 6, 3, 8), 10)

    def out(self, topo: str, name: str) -> Path:
        phase, faults = PHASES[name]
        if phase == "load":
            self.out(topo, "save")
        out = self.root / topo / name
        tp, dp = TOPOLOGIES[topo]
        with locked(self.root / f"{topo}-{name}.lock"):
            if not (out / "result.json").is_file():
                cell = HarnessCell(
                    engine="fsdp2", precision="fp32", options={"dp": dp}, actor_tp=tp,
                    critic_tp=tp, rounds=2, seed=0, inputs_dir=str(self.inputs),
                    output_dir=str(out), collective_timeout_s=120.0, faults=faults,
                    resume=None if phase is None else {
                        "phase": phase, "after_round": 1, "dir": str(self.root / topo / "ckpt")})
                res = launch(cell, module=ENGINE.module, attempt_dir=out,
                             timeout_s=LAUNCH_TIMEOUT_S, env={"CUDA_VISIBLE_DEVICES": ""},
                             world_size=ENGINE.world_size(cell))
                (out / "result.json").write_text(json.dumps(
                    {"status": res.status, "reason": res.reason, "wall_s": res.wall_s}))
        result = json.loads((out / "result.json").read_text())
        assert result["status"] == "OK", f"{topo}/{name}: {result['reason']}"
        return out

    def cell(self, topo: str, name: str, role: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The launch's share for ``role``, as the candidate stage splits a cell."""
        out = self.out(topo, name)
        tensors = {k: v for k, v in load_file(str(out / "outputs.safetensors")).items()
                   if k.split("/")[1] == role}
        meta = json.loads((out / "outputs.json").read_text())
        return tensors, {**{k: v for k, v in meta.items() if k != "roles"},
                         **meta["roles"][role]}

    def rows(self, topo: str, name: str, role: str) -> list[Row]:
        tensors, meta = self.cell(topo, name, role)
        mask = load_file(str(self.inputs / "rollout.safetensors"))["response_mask"]
        base_t, base_m = self.cell(topo, "full", role)
        base = f"fsdp2-fp32-{role}-{topo}"
        return resume_rows(cell=f"{base}-resume", entry={
            "role": role, "after_round": 1, "resume_of": base},
            outputs=_out(tensors, meta), loaded={base: _out(base_t, base_m)},
            bounds=[], mask=mask, lane="fp32")


def _out(tensors: dict[str, Any], meta: dict[str, Any]) -> types.SimpleNamespace:
    """A loaded cell as the comparator holds it (tensors, outputs.json, its problem)."""
    return types.SimpleNamespace(tensors=tensors, meta=meta, meta_problem="")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Runs:
    base = tmp_path_factory.getbasetemp()
    return Runs((base.parent if worker_id != "master" else base) / "fsdp2_resume")


@pytest.mark.parametrize("topo", sorted(TOPOLOGIES))
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_resumed_round_is_bitwise_the_uninterrupted_one(runs: Runs, topo: str,
                                                        role: str) -> None:
    tensors, meta = runs.cell(topo, "load", role)
    assert {k.split("/")[0] for k in tensors} == {"round2"}  # only the rounds it ran
    rec = meta["resume"]
    assert rec["checkpoint_files"] >= 1
    assert rec["format"].startswith("torch.distributed.checkpoint")
    tp, dp = TOPOLOGIES[topo]
    assert meta["parallelism"]["dp"] == dp
    assert meta["tp"] == tp
    rows = runs.rows(topo, "load", role)
    metric = [r for r in rows if r.round is not None and r.family != "lr"]
    # every round-2 family of the role was compared, bitwise (the CPU lane)
    fams = {r.family for r in metric}
    want = {"logprobs", "entropy", "losses", "grads", "grad_norm", "clip_coef", "exp_avg",
            "exp_avg_sq", "updates"} if role == "actor" else {
        "values", "losses", "grads", "grad_norm", "clip_coef", "exp_avg", "exp_avg_sq",
        "updates"}
    assert fams == want
    assert {r.family for r in rows if r.round is None} == set(STATE_QUANTITIES)
    assert [r.round for r in rows if r.family == "lr" and r.round] == [2]
    assert all(r.statistic == "bitwise" and r.bound == 0.0 for r in rows)
    bad = [r.reason for r in rows if r.verdict != "PASS"]
    assert not bad, bad


@pytest.mark.parametrize(("name", "quantity"), [("load-drops-optimizer", "exp_avg"),
                                                ("load-drops-step", "step")])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_planted_resume_fault_fails_naming_the_quantity(runs: Runs, name: str, quantity: str,
                                                        role: str) -> None:
    rows = runs.rows("dp2", name, role)
    assert_planted_fault_fails(rows, quantity)
    if quantity != "step":  # a fresh AdamW: no moments at all
        state = {r.family: r for r in rows if r.round is None}
        assert state["exp_avg_sq"].verdict == "FAIL"
