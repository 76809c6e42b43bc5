"""Resume equivalence of the DeepSpeed harness (issue #18) under real torchrun + gloo.

The launches of :mod:`test_resume_torch_tp` with DeepSpeed FP32 ZeRO 0, Actor TP1 + Critic
TP1: ``full`` (rounds 1 and 2 uninterrupted), ``save`` (round 1, then
``engine.save_checkpoint`` per role), a correct ``load`` (a fresh torchrun,
``engine.load_checkpoint(load_optimizer_states=True, load_lr_scheduler_states=True)``, round
2) and one ``load`` per planted resume fault (``harnesses/deepspeed/resume.py``: the module
only, or every step counter reset). The resumed round 2 is judged by
:func:`qualify.compare.resume.resume_rows` against ``full``'s round 2, bitwise (CPU).
"""

from __future__ import annotations

import pytest
from test_resume_torch_tp import Runs, assert_planted_fault_fails

from qualify.compare.resume import STATE_QUANTITIES

pytestmark = pytest.mark.slow  # minutes: .ci/run's resume and recovery step

pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Runs:
    base = tmp_path_factory.getbasetemp()
    return Runs((base.parent if worker_id != "master" else base) / "deepspeed_resume",
                engine="deepspeed", options={"zero": 0}, topology=(1, 1))


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_resumed_round_is_bitwise_the_uninterrupted_one(runs: Runs, role: str) -> None:
    tensors, meta = runs.cell("load", role)
    assert {k.split("/")[0] for k in tensors} == {"round2"}  # only the rounds it ran
    assert meta["resume"]["checkpoint_files"] >= 1
    assert meta["resume"]["format"].startswith("DeepSpeed engine.save_checkpoint")
    rows = runs.rows("load", role)
    assert {r.family for r in rows if r.round is None} == set(STATE_QUANTITIES)
    assert {"logprobs" if role == "actor" else "values", "grads", "exp_avg", "updates"} <= \
        {r.family for r in rows if r.round == 2}
    assert all(r.statistic == "bitwise" and r.bound == 0.0 for r in rows)
    bad = [r.reason for r in rows if r.verdict != "PASS"]
    assert not bad, bad


@pytest.mark.parametrize(("name", "quantity"), [("load-drops-optimizer", "exp_avg"),
                                                ("load-drops-step", "step")])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_planted_resume_fault_fails_naming_the_quantity(runs: Runs, name: str, quantity: str,
                                                        role: str) -> None:
    assert_planted_fault_fails(runs.rows(name, role), quantity)


def test_an_unknown_fault_is_refused() -> None:
    from harnesses.deepspeed import resume
    from qualify.errors import HarnessError

    resume.check_faults(["resume_drops_step_counter"])
    with pytest.raises(HarnessError, match="injects only"):
        resume.check_faults(["resume_drops_step_countr"])
