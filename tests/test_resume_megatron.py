"""Resume equivalence of the Megatron-Core harness (issue #18) under real torchrun + gloo.

Launches (each a real ``torch.distributed.run`` of Actor TP2 + Critic TP1 on CPU, cached
per session): ``full`` (rounds 1 and 2 uninterrupted), ``save`` (round 1, then
megatron-core's non-distributed checkpoint per TP rank, ``mp_rank_XX/model_optim_rng.pt``:
model, ``MegatronOptimizer.state_dict()``, ``OptimizerParamScheduler.state_dict()``, RNG),
and three ``load`` launches (fresh interpreters restoring it and running round 2): a
correct one, and one with each planted resume fault (:mod:`harnesses.megatron.faults`).
The resumed round 2 is judged by :func:`qualify.compare.resume.resume_rows` against
``full``'s round 2.
"""

from __future__ import annotations

import pytest
from test_resume_torch_tp import Runs, assert_planted_fault_fails

from qualify.compare.resume import STATE_QUANTITIES

pytestmark = pytest.mark.slow  # minutes: .ci/run's resume and recovery step

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Runs:
    base = tmp_path_factory.getbasetemp()
    return Runs((base.parent if worker_id != "master" else base) / "megatron_resume",
                engine="megatron", topology=(2, 1))


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_resumed_round_is_bitwise_the_uninterrupted_one(runs: Runs, role: str) -> None:
    tensors, meta = runs.cell("load", role)
    assert {k.split("/")[0] for k in tensors} == {"round2"}  # only the rounds it ran
    # one model_optim_rng.pt per TP rank of the role (Megatron-LM's legacy layout)
    assert meta["resume"]["checkpoint_files"] == meta["tp"]
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


def test_unknown_megatron_fault_is_refused() -> None:
    from harnesses.megatron import faults, resume
    from qualify.errors import HarnessError

    resume.check_faults(["resume_drops_step_counter"])
    with pytest.raises(HarnessError, match="megatron knows"):
        faults.install(["grad_norm_replicated_per_rank"])
