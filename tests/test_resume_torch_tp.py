"""Resume equivalence of the torch_tp harness (issue #18) under real torchrun + gloo.

Launches (each a real ``torch.distributed.run`` of Actor TP2 + Critic TP1, cached per
module): ``full`` (rounds 1 and 2 uninterrupted), ``save`` (round 1, then a
``torch.distributed.checkpoint`` of model + AdamW beside the scheduler, RNG and round-1
state), and three ``load`` launches (fresh interpreters restoring ``save``'s checkpoint and
running round 2): a correct one, and one with each planted resume fault. The resumed round
2 is judged by :func:`qualify.compare.resume.resume_rows` against ``full``'s round 2.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
from harness_outputs import build_inputs, locked
from safetensors.numpy import load_file

from qualify.candidate.launch import launch
from qualify.compare.resume import STATE_QUANTITIES, resume_rows
from qualify.compare.verdicts import Row
from qualify.protocol import HarnessCell
from qualify.registry import get_engine

pytestmark = pytest.mark.slow  # minutes: .ci/run's resume and recovery step

LAUNCH_TIMEOUT_S = 400.0
PHASES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "full": (None, ()),
    "save": ("save", ()),
    "load": ("load", ()),
    "load-drops-optimizer": ("load", ("resume_drops_optimizer_state",)),
    "load-drops-step": ("load", ("resume_drops_step_counter",)),
}


class Runs:
    """Each launch once per session (file-locked, shared by xdist workers).

    Args:
        root: where the launches go.
        engine: the trainer engine (its registry name).
        options: the engine's options (``{"zero": 0}``).
        topology: ``(actor_tp, critic_tp)``.
    """

    def __init__(self, root: Path, engine: str = "torch_tp",
                 options: dict[str, int] | None = None,
                 topology: tuple[int, int] = (2, 1)) -> None:
        self.engine, self.options, self.topology = engine, dict(options or {}), topology
        self.spec = get_engine(engine)
        self.root = root
        self.inputs = root / "inputs"
        root.mkdir(parents=True, exist_ok=True)
        with locked(root / "inputs.lock"):
            if not (self.inputs / "params.json").is_file():
                self.inputs.mkdir(exist_ok=True)
                build_inputs(self.inputs, (10, 6, 3, 8), 10)

    def out(self, name: str) -> Path:
        phase, faults = PHASES[name]
        if phase == "load":
            self.out("save")
        out = self.root / name
        with locked(self.root / f"{name}.lock"):
            if not (out / "result.json").is_file():
                cell = HarnessCell(
                    engine=self.engine, precision="fp32", options=dict(self.options),
                    actor_tp=self.topology[0], critic_tp=self.topology[1],
                    rounds=2, seed=0, inputs_dir=str(self.inputs), output_dir=str(out),
                    faults=faults, resume=None if phase is None else {
                        "phase": phase, "after_round": 1, "dir": str(self.root / "ckpt")})
                res = launch(cell, module=self.spec.module, attempt_dir=out,
                             timeout_s=LAUNCH_TIMEOUT_S,
                             env={**dict(self.spec.cpu_env), "CUDA_VISIBLE_DEVICES": ""})
                (out / "result.json").write_text(json.dumps(
                    {"status": res.status, "reason": res.reason, "wall_s": res.wall_s}))
        result = json.loads((out / "result.json").read_text())
        assert result["status"] == "OK", f"{name}: {result['reason']}"
        return out

    def cell(self, name: str, role: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The launch's share for ``role``, as the candidate stage splits a cell."""
        out = self.out(name)
        tensors = {k: v for k, v in load_file(str(out / "outputs.safetensors")).items()
                   if k.split("/")[1] == role}
        meta = json.loads((out / "outputs.json").read_text())
        return tensors, {**{k: v for k, v in meta.items() if k != "roles"},
                         **meta["roles"][role]}

    def rows(self, name: str, role: str) -> list[Row]:
        tensors, meta = self.cell(name, role)
        mask = load_file(str(self.inputs / "rollout.safetensors"))["response_mask"]
        base_t, base_m = self.cell("full", role)
        base = f"{self.engine}-fp32-{role}"
        return resume_rows(cell=f"{base}-resume", entry={
            "role": role, "after_round": 1, "resume_of": base},
            outputs=_out(tensors, meta), loaded={base: _out(base_t, base_m)},
            bounds=[], mask=mask, lane="fp32")


def _out(tensors: dict[str, Any], meta: dict[str, Any]) -> types.SimpleNamespace:
    """A loaded cell as the comparator holds it (tensors, outputs.json, its problem)."""
    return types.SimpleNamespace(tensors=tensors, meta=meta, meta_problem="")


def assert_planted_fault_fails(rows: list[Row], quantity: str) -> None:
    """A load with a planted resume fault: its ``quantity`` state row FAILs, naming it, and
    the resumed round-2 update is not bitwise (shared by every engine's resume test)."""
    state = {r.family: r for r in rows if r.round is None}
    assert state[quantity].verdict == "FAIL"
    reason = state[quantity].reason
    assert reason is not None
    assert reason.startswith(f"resume {quantity}:")
    # the wrong restore changes the resumed update itself: round-2 updates are not bitwise
    updates = next(r for r in rows if r.round == 2 and r.family == "updates")
    assert updates.verdict == "FAIL"
    assert updates.error is not None
    assert updates.error > 0
    if quantity == "step":  # moments restored, only the counter lost
        assert state["exp_avg"].verdict == "PASS"
        assert state["master_weights"].verdict == "PASS"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Runs:
    base = tmp_path_factory.getbasetemp()
    return Runs((base.parent if worker_id != "master" else base) / "torch_tp_resume")


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_resumed_round_is_bitwise_the_uninterrupted_one(runs: Runs, role: str) -> None:
    tensors, meta = runs.cell("load", role)
    assert {k.split("/")[0] for k in tensors} == {"round2"}  # only the rounds it ran
    assert meta["resume"]["checkpoint_files"] >= 1
    rows = runs.rows("load", role)
    metric = [r for r in rows if r.round is not None and r.family != "lr"]
    # every round-2 family of the role was compared, bitwise (the CPU lane)
    fams = {r.family for r in metric}
    want = {"logprobs", "entropy", "losses", "grads", "grad_norm", "clip_coef", "exp_avg",
            "exp_avg_sq", "updates"} if role == "actor" else {
        "values", "losses", "grads", "grad_norm", "clip_coef", "exp_avg", "exp_avg_sq",
        "updates"}
    assert fams == want
    assert {r.family for r in rows if r.round is None} == set(STATE_QUANTITIES)
    assert all(r.statistic == "bitwise" and r.bound == 0.0 for r in rows)
    bad = [r.reason for r in rows if r.verdict != "PASS"]
    assert not bad, bad


@pytest.mark.parametrize(("name", "quantity"), [("load-drops-optimizer", "exp_avg"),
                                                ("load-drops-step", "step")])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_planted_resume_fault_fails_naming_the_quantity(runs: Runs, name: str, quantity: str,
                                                        role: str) -> None:
    assert_planted_fault_fails(runs.rows(name, role), quantity)
