"""The torch_tp harness under real torchrun + gloo on a tiny Qwen3 (CPU, 2 cores).

Launches (each a real ``torch.distributed.run``, cached per module):

- ``fp32-a2c1`` / ``fp32-a1c2``: Actor TP2 + Critic TP1 and Actor TP1 + Critic TP2, so each
  role has a TP2 and a TP1 run to compare (an independent check of the sharding);
- ``bf16-a2c1`` / ``bf16-a1c2``: the same at BF16 compute with FP32 masters;
- ``fault-a1c1`` / ``fault-a1c2``: the deliberate faults, at most one per role's metric;
- the ``hang_rank1`` fault in a launch of its own.
"""

from __future__ import annotations

import json
import math
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from harness_outputs import (
    TINY,
    build_inputs,
    expected_names,
    family_errors,
    locked,
    role_tensors,
)
from qualify_harness import losses
from safetensors.torch import load_file

from harnesses.torch_tp import vocab_parallel
from harnesses.torch_tp.faults import Faults
from harnesses.torch_tp.parallelize import check_divisible
from qualify.candidate.launch import launch
from qualify.contract import load_contract
from qualify.errors import HarnessError
from qualify.protocol import EXTRA_RIGHT_PADDING, HarnessCell
from qualify.registry import get_engine
from qualify.resources import contracts_dir

RESPONSE_LENGTHS = (10, 6, 3, 8)
R = 10
LAUNCH_TIMEOUT_S = 300.0
MODULE = get_engine("torch_tp").module

RUNS: dict[str, dict[str, Any]] = {
    "fp32-a2c1": {"precision": "fp32", "actor_tp": 2, "critic_tp": 1},
    "fp32-a1c2": {"precision": "fp32", "actor_tp": 1, "critic_tp": 2},
    "bf16-a2c1": {"precision": "bf16", "actor_tp": 2, "critic_tp": 1},
    "bf16-a1c2": {"precision": "bf16", "actor_tp": 1, "critic_tp": 2},
    # Each fault's metric has a single cause: the actor's and the critic's updates never
    # interact, round-1 metrics precede any faulty step, and the grad-norm and value-loss
    # checks recompute the faulty formula from the run's own outputs.
    "fault-a2c1": {"precision": "fp32", "actor_tp": 2, "critic_tp": 1,
                   "faults": ("no_temperature", "grad_norm_replicated_per_rank",
                              "value_loss_unclipped", "bf16_optimizer_state")},
    "fault-a1c0": {"precision": "fp32", "actor_tp": 1, "critic_tp": 0,
                   "faults": ("logprobs_shift_one",)},
}
TP_RUNS = {("fp32", "actor"): ("fp32-a2c1", "fp32-a1c2"),
           ("fp32", "critic"): ("fp32-a1c2", "fp32-a2c1"),
           ("bf16", "actor"): ("bf16-a2c1", "bf16-a1c2"),
           ("bf16", "critic"): ("bf16-a1c2", "bf16-a2c1")}
"""(precision, role) -> (run with that role at TP2, run with it at TP1)."""


# --------------------------------------------------------------------------- fixtures


class Runs:
    """Each named run launched once per test session, shared by pytest-xdist workers.

    Runs live under the session's shared temporary root (the parent of each worker's
    base temp); a per-run file lock makes one worker launch while the other waits and
    then reads the same outputs, and two different runs can launch in parallel.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.inputs_dir = root / "inputs"
        root.mkdir(parents=True, exist_ok=True)
        with locked(root / "inputs.lock"):
            if not (self.inputs_dir / "params.json").is_file():
                self.inputs_dir.mkdir(exist_ok=True)
                build_inputs(self.inputs_dir, RESPONSE_LENGTHS, R)
        self.contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
        self.rollout = load_file(str(self.inputs_dir / "rollout.safetensors"))
        self.train = load_file(str(self.inputs_dir / "train_inputs.safetensors"))
        self.params = json.loads((self.inputs_dir / "params.json").read_text())
        self.mask = self.rollout["response_mask"].bool()

    def cell(self, out: Path, **kw: Any) -> HarnessCell:
        return HarnessCell(engine="torch_tp", options={}, rounds=2, seed=0,
                           inputs_dir=str(self.inputs_dir), output_dir=str(out),
                           **{"collective_timeout_s": 120.0, **kw})

    def _launch(self, name: str) -> Path:
        out = self.root / name
        with locked(self.root / f"{name}.lock"):
            done = out / "result.json"
            if not done.is_file():
                spec = dict(RUNS[name])
                spec["faults"] = tuple(spec.get("faults", ()))
                res = launch(self.cell(out, **spec), module=MODULE, attempt_dir=out,
                             timeout_s=LAUNCH_TIMEOUT_S)
                done.write_text(json.dumps({"status": res.status, "reason": res.reason,
                                            "wall_s": res.wall_s}))
        result = json.loads((out / "result.json").read_text())
        assert result["status"] == "OK", f"{name}: {result['reason']}"
        print(f"\n[torch_tp] launch {name}: {result['wall_s']:.1f} s wall")
        return out

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        return load_file(str(self._launch(name) / "outputs.safetensors"))

    def meta(self, name: str) -> dict[str, Any]:
        meta: dict[str, Any] = json.loads((self._launch(name) / "outputs.json").read_text())
        return meta


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Runs:
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if worker_id != "master" else base
    return Runs(shared / "torch_tp_runs")


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("run", ["fp32-a2c1", "fp32-a1c2"])
def test_launch_writes_complete_outputs(runs: Runs, run: str) -> None:
    t, meta = runs.tensors(run), runs.meta(run)
    want = (expected_names("actor", runs.params["actor"])
            | expected_names("critic", runs.params["critic"]))
    assert set(t) == want
    b = len(RESPONSE_LENGTHS)
    assert t["round1/actor/logprobs"].shape == (b, R)
    assert t["round2/critic/values"].shape == (b, R)
    assert t["round1/actor/grads/lm_head.weight"].shape == (TINY["vocab_size"],
                                                            TINY["hidden_size"])
    assert all(v.dtype == torch.float32 for v in t.values())
    spec = RUNS[run]
    assert meta["world_size"] == spec["actor_tp"] + spec["critic_tp"]
    assert meta["roles"]["actor"]["tp"] == spec["actor_tp"]
    assert meta["roles"]["actor"]["parallelism"]["lm_head"] == "vocab_parallel"
    assert meta["shims"] == []
    assert meta["faults"] == []
    assert [r["role"] for r in meta["ranks"]] == (["actor"] * spec["actor_tp"]
                                                  + ["critic"] * spec["critic_tp"])
    for role in ("actor", "critic"):  # read back as the forwards ran (HF sdpa attention)
        routes = meta["roles"][role]["routes"]
        sdpa = routes["sdpa_backends"]
        assert sdpa, role
        assert all(n > 0 and label.endswith(" cpu float32") and
                   not label.startswith("unknown") for label, n in sdpa.items()), sdpa
        assert routes["optimizer"] == {"class": "torch.optim.adamw.AdamW", "fused": False,
                                       "foreach": False, "capturable": False}


@pytest.mark.parametrize(("precision", "role"), [
    ("fp32", "actor"), ("fp32", "critic"),
    # BF16 needs a fourth launch (bf16-a1c2): about 30 s on 2 cores.
    pytest.param("bf16", "actor", marks=pytest.mark.slow),
    pytest.param("bf16", "critic", marks=pytest.mark.slow),
])
def test_tp2_agrees_with_tp1(runs: Runs, precision: str, role: str) -> None:
    tp2_run, tp1_run = TP_RUNS[(precision, role)]
    err = family_errors(role_tensors(runs.tensors(tp2_run), role),
                        role_tensors(runs.tensors(tp1_run), role), runs.mask)
    print(f"\n[torch_tp] TP2 vs TP1 {precision} {role}: "
          + ", ".join(f"{k}={v:.2e}" for k, v in sorted(err.items())))
    per_token = ("logprobs", "entropy") if role == "actor" else ("values",)
    if precision == "fp32":
        assert all(err[f] < 1e-5 for f in per_token), err
        assert err["grads"] < 1e-4, err
        assert err["updates"] < 1e-3, err
    else:  # BF16 compute: sharded matmuls round differently; loose sanity bounds only
        assert all(err[f] < 0.1 for f in per_token), err
        assert err["grads"] < 0.1, err


@pytest.mark.parametrize("run", ["fp32-a2c1", "fp32-a1c2", "bf16-a2c1"])
def test_replicas_and_dtypes(runs: Runs, run: str) -> None:
    meta = runs.meta(run)
    compute = "torch.bfloat16" if RUNS[run]["precision"] == "bf16" else "torch.float32"
    for role, rm in meta["roles"].items():
        rc = rm["replica_consistency"]
        assert rc["all_equal"] is True, (role, rc)
        assert [r["round"] for r in rc["rounds"]] == [1, 2]
        assert "model.norm.weight" in rc["params"]
        assert all(p["equal"] and p["max_abs_diff"] == 0.0 for p in rc["params"].values())
        if rm["tp"] > 1:
            par = rm["parallelism"]
            assert "model.layers.0.self_attn.q_norm.weight" in par["replicated_params"]
            assert "model.layers.0.self_attn.q_proj.weight" in par["sharded_params"]
            # per-head norms: replicated weights, head-sharded inputs -> Partial gradients
            assert "model.layers.0.self_attn.k_norm.weight" in par["partial_grads_reduced"]
        d = rm["dtypes"]
        assert d["master_weights"] == d["grads"] == "torch.float32", d
        assert d["grad_reduction"] == {
            "DTensor.redistribute:replicated_param_grads": "torch.float32"}, d
        assert d["grad_accumulation"] == {"AccumulateGrad:param.grad": "torch.float32"}, d
        assert d["optimizer_state"] == {"exp_avg": "torch.float32",
                                        "exp_avg_sq": "torch.float32"}, d
        assert d["compute"] == [compute], d
        assert (rm["bf16_mechanism"] is None) == (compute == "torch.float32")


def test_padding_invariance(runs: Runs) -> None:
    t = runs.tensors("fp32-a2c1")
    for role, metric in (("actor", "logprobs"), ("critic", "values")):
        a, b = t[f"round1/{role}/{metric}_padded"], t[f"round1/{role}/{metric}"]
        err = float((a - b).abs()[runs.mask].max())
        print(f"\n[torch_tp] padding (+{EXTRA_RIGHT_PADDING} cols) {role} {metric}: {err:.2e}")
        assert err < 1e-5


def _hf_window_log_softmax(runs: Runs, dtype: torch.dtype, temperature: float
                           ) -> torch.Tensor:
    """An independent HF forward of the inputs' Actor (``dtype``, sdpa, one batch):
    ``log_softmax(logits / temperature)`` on the response positions, ``[B, R, V]`` FP64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(runs.inputs_dir / "actor"),
                                                 dtype=dtype).eval()
    ro = runs.rollout
    p = ro["prompts"].shape[1]
    ids = torch.cat([ro["prompts"], ro["responses"]], dim=1).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=ro["attention_mask"].long(),
                       position_ids=ro["position_ids"].long(), use_cache=False).logits
    return torch.log_softmax(logits[:, p - 1:p - 1 + R].to(dtype) / temperature, -1).double()


@pytest.mark.parametrize("kind", ["raw", "tempered"])
def test_recorded_distribution_is_hf_fp32_log_softmax_at_tp1_and_tp2(runs: Runs,
                                                                      kind: str) -> None:
    """``round1/actor/prefill_<kind>`` of the Actor at TP 1 and TP 2 (vocabulary gathered)
    equals an independent HF FP32 ``log_softmax`` on the response positions, and TP 2 equals
    TP 1, within ``k`` (the contract's) x the FP32 rounding of this model on these tokens
    (max |HF FP32 - HF FP64| over valid entries, the bound rule's ``fp64`` control; the
    FP32 floor is left out: it is 10 times that here and would hide a real difference).
    Masked positions are 0."""
    c = runs.contract
    temperature = c.sampling.temperature if kind == "tempered" else 1.0
    hf32 = _hf_window_log_softmax(runs, torch.float32, temperature)
    hf64 = _hf_window_log_softmax(runs, torch.float64, temperature)
    m = runs.mask
    control = float((hf32 - hf64).abs()[m].max())
    tol = c.bounds.k * control
    name = f"round1/actor/prefill_{kind}"
    tp2, tp1 = runs.tensors("fp32-a2c1")[name], runs.tensors("fp32-a1c2")[name]
    errs = {"tp1_vs_hf": float((tp1.double() - hf32).abs()[m].max()),
            "tp2_vs_hf": float((tp2.double() - hf32).abs()[m].max()),
            "tp2_vs_tp1": float((tp2 - tp1).abs()[m].max())}
    print(f"\n[torch_tp] prefill_{kind}: control {control:.2e} tol {tol:.2e} "
          + ", ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    for t in (tp1, tp2):
        assert t.dtype == torch.float32
        assert t.shape == hf32.shape
        assert not t[~m].any()
    assert all(e <= tol for e in errs.values()), (errs, tol)
    for run in ("fp32-a2c1", "fp32-a1c2"):
        assert runs.meta(run)["roles"]["actor"]["distribution"] == {
            "path": "full", "k": None, "vocab": TINY["vocab_size"]}


def _value_loss(t: dict[str, torch.Tensor], ret: torch.Tensor, mask: torch.Tensor,
                clip: float | None) -> float:
    v1, v2 = t["round1/critic/values"].double(), t["round2/critic/values"].double()
    sq = (v2 - ret).square()
    if clip is not None:
        sq = torch.maximum(sq, (v1 + (v2 - v1).clamp(-clip, clip) - ret).square())
    return float(0.5 * sq[mask].sum() / mask.sum())


def _grad_sq(t: dict[str, torch.Tensor], role: str, names: list[str] | None = None) -> float:
    prefix = f"round1/{role}/grads/"
    return sum(float(v.double().square().sum()) for k, v in t.items()
               if k.startswith(prefix) and (names is None or k[len(prefix):] in names))


def test_losses_follow_the_protocol(runs: Runs) -> None:
    """Round-2 losses and round-1 norms recomputed from the run's own outputs."""
    t = runs.tensors("fp32-a1c2")
    alg, mask = runs.contract.algorithm, runs.mask
    adv, ret = runs.train["advantages"], runs.train["returns"]
    n = mask.sum()
    ratio = torch.exp(t["round2/actor/logprobs"] - t["round1/actor/logprobs"])
    eps = alg.clip_ratio
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    assert float(t["round2/actor/loss/policy"]) == pytest.approx(float(pg[mask].sum() / n),
                                                                 abs=1e-6)
    ent = -alg.entropy_coef * t["round2/actor/entropy"][mask].sum() / n
    assert float(t["round2/actor/loss/entropy"]) == pytest.approx(float(ent), abs=1e-6)
    assert float(t["round2/critic/loss/value"]) == pytest.approx(
        _value_loss(t, ret, mask, alg.value_clip), abs=1e-6)
    max_norm = runs.contract.optimizer.max_grad_norm
    for role in ("actor", "critic"):
        norm = float(t[f"round1/{role}/grad_norm"])
        assert norm == pytest.approx(math.sqrt(_grad_sq(t, role)), rel=1e-5)
        assert float(t[f"round1/{role}/clip_coef"]) == pytest.approx(
            min(1.0, max_norm / (norm + 1e-6)), rel=1e-6)


def test_fault_no_temperature_changes_logprobs(runs: Runs) -> None:
    bad, good = runs.tensors("fault-a2c1"), runs.tensors("fp32-a2c1")  # actor TP2 in both
    d = float((bad["round1/actor/logprobs"] - good["round1/actor/logprobs"]).abs()[
        runs.mask].max())
    print(f"\n[torch_tp] no_temperature: round-1 logprobs max abs change {d:.3e}")
    assert d > 1e-2


def test_fault_logprobs_shift_one_changes_logprobs(runs: Runs) -> None:
    bad, good = runs.tensors("fault-a1c0"), runs.tensors("fp32-a1c2")  # actor TP1 in both
    d = float((bad["round1/actor/logprobs"] - good["round1/actor/logprobs"]).abs()[
        runs.mask].max())
    print(f"\n[torch_tp] logprobs_shift_one: round-1 logprobs max abs change {d:.3e}")
    assert d > 1e-1


def test_fault_grad_norm_replicated_per_rank_changes_grad_norm(runs: Runs) -> None:
    t, meta = runs.tensors("fault-a2c1"), runs.meta("fault-a2c1")
    replicated = meta["roles"]["actor"]["parallelism"]["replicated_params"]
    true = math.sqrt(_grad_sq(t, "actor"))
    faulty = math.sqrt(_grad_sq(t, "actor") + (2 - 1) * _grad_sq(t, "actor", replicated))
    got = float(t["round1/actor/grad_norm"])
    print(f"\n[torch_tp] grad_norm_replicated_per_rank (actor TP2): reported {got:.6f}, "
          f"true {true:.6f}")
    assert got == pytest.approx(faulty, rel=1e-5)
    assert got > true * (1 + 1e-3)
    # at TP1 (the critic of the same launch) nothing is replicated across ranks
    assert float(t["round1/critic/grad_norm"]) == pytest.approx(
        math.sqrt(_grad_sq(t, "critic")), rel=1e-5)


def test_fault_bf16_optimizer_state_changes_state(runs: Runs) -> None:
    bad, good = runs.tensors("fault-a2c1"), runs.tensors("fp32-a2c1")  # critic TP1 in both
    for role in ("actor", "critic"):
        state = runs.meta("fault-a2c1")["roles"][role]["dtypes"]["optimizer_state"]
        assert state == {"exp_avg": "torch.bfloat16", "exp_avg_sq": "torch.bfloat16"}
    worst = 0.0
    for k, v in role_tensors(good, "critic").items():
        if k.startswith("round1/critic/grads/"):  # same round-1 gradients ...
            torch.testing.assert_close(bad[k], v, rtol=1e-6, atol=1e-9)
        if k.startswith("round1/critic/exp_avg/"):  # ... rounded moments
            worst = max(worst, float((bad[k] - v).norm() / v.norm()))
    print(f"\n[torch_tp] bf16_optimizer_state: round-1 exp_avg rel L2 change {worst:.3e}")
    assert 1e-5 < worst < 1e-2


def test_fault_value_loss_unclipped_changes_value_loss(runs: Runs) -> None:
    bad = runs.tensors("fault-a2c1")
    ret, clip = runs.train["returns"], runs.contract.algorithm.value_clip
    reported = float(bad["round2/critic/loss/value"])
    unclipped = _value_loss(bad, ret, runs.mask, None)
    clipped = _value_loss(bad, ret, runs.mask, clip)
    print(f"\n[torch_tp] value_loss_unclipped: reported {reported:.6f}, "
          f"clipped would be {clipped:.6f}")
    assert reported == pytest.approx(unclipped, abs=1e-6)
    assert abs(reported - clipped) > 1e-3


@pytest.mark.slow  # waits out a collective timeout: .ci/run's slow tier, not command 2
def test_fault_hang_rank1_is_an_error_within_the_timeout(runs: Runs, tmp_path: Path) -> None:
    cell = runs.cell(tmp_path, precision="fp32", actor_tp=2, critic_tp=0,
                     collective_timeout_s=10.0, faults=("hang_rank1",))
    res = launch(cell, module=MODULE, attempt_dir=tmp_path, timeout_s=60.0)
    print(f"\n[torch_tp] hang_rank1: {res.status} after {res.wall_s:.1f} s; "
          f"{res.reason.splitlines()[0]}")
    assert res.status == "ERROR"
    assert res.wall_s < 60.0
    assert not res.reason.startswith("timeout after"), "the collective timeout must fire first"
    assert res.failed_rank == 0
    assert "Timed out waiting 10000ms" in res.reason, res.reason
    assert "barrier" in res.reason, res.reason
    assert res.launcher_log.is_file()
    assert {p.name for p in res.rank_logs} >= {"stdout.log", "stderr.log", "error.json"}
    assert not (tmp_path / "outputs.json").exists()


# --------------------------------------------------------------------------- in-process units


def test_vocab_parallel_math_matches_log_softmax_on_plain_tensors() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    targets = torch.randint(0, 11, (3, 5), generator=g)
    lp, ent = vocab_parallel.logprobs_and_entropy(logits, targets, 0.7)
    ref = torch.log_softmax(logits / 0.7, dim=-1)
    torch.testing.assert_close(lp, ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))


@pytest.mark.parametrize(("estimator", "expected"), [
    ("k1", lambda lp, ref: lp - ref),
    ("k2", lambda lp, ref: 0.5 * (lp - ref) ** 2),
    ("k3", lambda lp, ref: torch.exp(ref - lp) - (ref - lp) - 1),
])
def test_kl_estimators(estimator: Any, expected: Any) -> None:
    lp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    torch.testing.assert_close(losses.kl_penalty(lp, ref, estimator), expected(lp, ref))


@pytest.mark.parametrize(("heads", "kv", "inter", "tp", "bad"), [
    (4, 2, 160, 2, None), (4, 2, 160, 3, "num_attention_heads"),
    (4, 1, 160, 2, "num_key_value_heads"), (4, 2, 161, 2, "intermediate_size"),
])
def test_tp_must_divide_heads(heads: int, kv: int, inter: int, tp: int, bad: str | None) -> None:
    cfg = types.SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv,
                                intermediate_size=inter)
    if bad is None:
        check_divisible(cfg, tp)
    else:
        with pytest.raises(HarnessError, match=f"{bad} = .* not divisible by TP = {tp}"):
            check_divisible(cfg, tp)


def test_unknown_fault_is_refused() -> None:
    with pytest.raises(HarnessError, match="unknown fault"):
        Faults(["no_temprature"])
    assert "no_temperature" in Faults(["no_temperature"])
