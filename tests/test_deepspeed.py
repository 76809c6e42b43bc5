"""The DeepSpeed harness under real torchrun + gloo on a tiny Qwen3 (CPU, 2 cores).

Two launches (each a real ``torch.distributed.run`` through :func:`qualify.candidate.launch.launch`,
cached per module), each one process group serving several variants:

- ``a2c1``: Actor TP2 (AutoTP) + Critic TP1, variants ``fp32-zero0``, ``fp32-zero2``,
  ``bf16-zero0``, ``bf16-zero1``;
- ``a1c2``: Actor TP1 + Critic TP2 (a TP group ``[1, 2]`` that does not start at a multiple
  of 2), variant ``fp32-zero1``.

Expected values are derived independently of the harness: TP2 against TP1 and ZeRO stages
against each other on the same inputs, the protocol's loss, norm and clip formulas
recomputed from the outputs, DeepSpeed's documented dtype rules.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("deepspeed")

from harness_outputs import (
    TINY,
    build_inputs,
    expected_names,
    family_errors,
    locked,
    rank_stderr,
    role_tensors,
)
from qualify_harness import losses

from harnesses.deepspeed.harness import check_cell
from harnesses.deepspeed.parallelize import ds_config, role_ranks
from harnesses.deepspeed.state_dict_adapter import dtype_name
from qualify.candidate.launch import check_outputs, launch_command, launch_env, validate_cell
from qualify.contract import load_contract
from qualify.errors import HarnessError
from qualify.protocol import HarnessCell, variant_tag
from qualify.registry import get_engine
from qualify.resources import contracts_dir, repo_root

RESPONSE_LENGTHS = (10, 6, 3, 8, 9, 2)
R = 10
LAUNCH_TIMEOUT_S = 400.0
ENGINE = get_engine("deepspeed")

RUNS: dict[str, dict[str, Any]] = {
    "a2c1": {"actor_tp": 2, "critic_tp": 1,
             "variants": (("fp32", 0), ("fp32", 2), ("bf16", 0), ("bf16", 1))},
    "a1c2": {"actor_tp": 1, "critic_tp": 2, "variants": (("fp32", 1),)},
}


# --------------------------------------------------------------------------- fixtures


class Runs:
    """Each named launch run once per test session, shared by pytest-xdist workers."""

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

    def _launch(self, name: str) -> Path:
        """torchrun with ``qualify.candidate.launch``'s command line and environment; then
        :func:`qualify.candidate.launch.check_outputs` on every variant's subdirectory."""
        out = self.root / name
        with locked(self.root / f"{name}.lock"):
            done = out / "result.json"
            if not done.is_file():
                spec = RUNS[name]
                variants = tuple({"precision": p, "options": {"zero": z}}
                                 for p, z in spec["variants"])
                cell = HarnessCell(
                    engine="deepspeed", precision=spec["variants"][0][0],
                    options={"zero": spec["variants"][0][1]}, actor_tp=spec["actor_tp"],
                    critic_tp=spec["critic_tp"], rounds=2, seed=0,
                    inputs_dir=str(self.inputs_dir), output_dir=str(out),
                    collective_timeout_s=120.0, variants=variants)
                out.mkdir(parents=True, exist_ok=True)
                validate_cell(cell.to_dict())
                cell_file = out / "cell.json"
                cell_file.write_text(json.dumps(cell.to_dict()))
                cmd = launch_command(cell_file, module=ENGINE.module,
                                     world_size=cell.world_size, log_dir=out / "logs",
                                     preload=ENGINE.warm_imports)
                t0 = time.monotonic()
                proc = subprocess.run(cmd, cwd=out, env=launch_env(ENGINE.cpu_env),
                                      capture_output=True, text=True,
                                      timeout=LAUNCH_TIMEOUT_S, check=False)
                status, reason = "OK", ""
                if proc.returncode != 0:
                    status, reason = "ERROR", (f"rc {proc.returncode}: {proc.stderr[-3000:]}"
                                               f"\n{rank_stderr(out / 'logs')}")
                else:
                    try:
                        for _, _, sub in cell.variant_runs():
                            check_outputs(out / sub)
                    except HarnessError as exc:
                        status, reason = "ERROR", str(exc)
                done.write_text(json.dumps({"status": status, "reason": reason,
                                            "wall_s": time.monotonic() - t0}))
        result = json.loads((out / "result.json").read_text())
        assert result["status"] == "OK", f"{name}: {result['reason']}"
        print(f"\n[deepspeed] launch {name}: {result['wall_s']:.1f} s wall")
        return out

    def variant_dir(self, name: str, precision: str, zero: int) -> Path:
        return self._launch(name) / variant_tag(precision, {"zero": zero})

    def tensors(self, name: str, precision: str, zero: int) -> dict[str, torch.Tensor]:
        return load_file(str(self.variant_dir(name, precision, zero) / "outputs.safetensors"))

    def meta(self, name: str, precision: str, zero: int) -> dict[str, Any]:
        path = self.variant_dir(name, precision, zero) / "outputs.json"
        meta: dict[str, Any] = json.loads(path.read_text())
        return meta


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Runs:
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if worker_id != "master" else base
    return Runs(shared / "deepspeed_runs")


# --------------------------------------------------------------------------- helpers


def _grad_norm(t: dict[str, torch.Tensor], r: int, role: str,
               rank0_of: dict[str, int] | None = None) -> float:
    """L2 norm of the reported gradients; with ``rank0_of`` (param -> shard dim) only the
    first of two equal shards of each sharded parameter (TP rank 0's share) counts."""
    prefix = f"round{r}/{role}/grads/"
    total = 0.0
    for k, v in t.items():
        if not k.startswith(prefix):
            continue
        g = v.double()
        dim = (rank0_of or {}).get(k[len(prefix):])
        if dim is not None:
            g = g.narrow(dim, 0, g.shape[dim] // 2)
        total += float(g.square().sum())
    return math.sqrt(total)


# --------------------------------------------------------------------------- launch tests


@pytest.mark.parametrize(("run", "precision", "zero"),
                         [(n, p, z) for n, s in RUNS.items() for p, z in s["variants"]])
def test_every_variant_writes_the_protocol_outputs(runs: Runs, run: str, precision: str,
                                                   zero: int) -> None:
    t, meta = runs.tensors(run, precision, zero), runs.meta(run, precision, zero)
    want = (expected_names("actor", runs.params["actor"])
            | expected_names("critic", runs.params["critic"]))
    assert set(t) == want  # the exact output set of torch_tp (parameters < 32,768 elements)
    assert t["round1/actor/grads/lm_head.weight"].shape == (TINY["vocab_size"],
                                                            TINY["hidden_size"])
    assert t["round1/actor/exp_avg/model.layers.0.mlp.down_proj.weight"].shape == (
        TINY["hidden_size"], TINY["intermediate_size"])
    assert all(v.dtype == torch.float32 for v in t.values())
    spec = RUNS[run]
    assert meta["engine"] == "deepspeed"
    assert meta["cell"]["precision"] == precision
    assert meta["cell"]["options"] == {"zero": zero}
    assert meta["roles"]["actor"]["tp"] == spec["actor_tp"]
    assert meta["roles"]["critic"]["tp"] == spec["critic_tp"]
    for rm in meta["roles"].values():
        info = rm["engine_info"]
        assert info["zero_stage"] == zero
        assert info["deepspeed_config"]["optimizer"]["params"]["torch_adam"] is True
        assert info["gradient_accumulation_steps"] == 2  # 6 sequences, micro-batches of 4


def test_one_process_group_serves_every_variant(runs: Runs) -> None:
    """Process-group reuse: the variants of a launch ran in the same ranks' processes."""
    pids = {(p, z): {role: rm["engine_info"]["pid"]
                     for role, rm in runs.meta("a2c1", p, z)["roles"].items()}
            for p, z in RUNS["a2c1"]["variants"]}
    assert len({json.dumps(v, sort_keys=True) for v in pids.values()}) == 1, pids
    inits = {runs.meta("a2c1", p, z)["timings"]["init_s"] for p, z in RUNS["a2c1"]["variants"]}
    assert len(inits) == 1  # one init_process_group, timed once
    assert not (runs.variant_dir("a2c1", "fp32", 0).parent / "outputs.json").exists()


def test_tp2_agrees_with_tp1_at_fp32(runs: Runs) -> None:
    """AutoTP TP2 against TP1 (layout gathering: every grad / state / update in HF layout)."""
    a2 = runs.tensors("a2c1", "fp32", 2)  # actor TP2, critic TP1
    a1 = runs.tensors("a1c2", "fp32", 1)  # actor TP1, critic TP2
    for role, tp2, tp1 in (("actor", a2, a1), ("critic", a1, a2)):
        err = family_errors(role_tensors(tp2, role), role_tensors(tp1, role), runs.mask)
        print(f"\n[deepspeed] TP2 vs TP1 fp32 {role}: "
              + ", ".join(f"{k}={v:.2e}" for k, v in sorted(err.items())))
        per_token = ("logprobs", "entropy", "prefill_raw", "prefill_tempered") \
            if role == "actor" else ("values",)
        assert all(err[f] < 1e-5 for f in per_token), err
        assert err["grads"] < 1e-4, err
        assert err["exp_avg"] < 1e-4, err
        assert err["updates"] < 1e-3, err


def test_zero_stages_agree_at_fp32(runs: Runs) -> None:
    """With one data-parallel rank ZeRO 0 and 2 partition nothing: same numbers."""
    z0, z2 = runs.tensors("a2c1", "fp32", 0), runs.tensors("a2c1", "fp32", 2)
    err = family_errors(z2, z0, runs.mask)
    print("\n[deepspeed] ZeRO2 vs ZeRO0 fp32: "
          + ", ".join(f"{k}={v:.2e}" for k, v in sorted(err.items())))
    assert all(v < 1e-5 for k, v in err.items() if k != "updates"), err
    assert err["updates"] < 1e-4, err


@pytest.mark.parametrize(("precision", "zero"), RUNS["a2c1"]["variants"])
def test_norm_clip_and_losses_follow_the_protocol(runs: Runs, precision: str,
                                                  zero: int) -> None:
    """Grad norm, clip coefficient and round-2 losses recomputed from the outputs."""
    t, meta = runs.tensors("a2c1", precision, zero), runs.meta("a2c1", precision, zero)
    max_norm = runs.contract.optimizer.max_grad_norm
    rel = 1e-5 if precision == "fp32" else 2e-2
    for role in ("actor", "critic"):
        rm = meta["roles"][role]
        for r in (1, 2):
            norm = float(t[f"round{r}/{role}/grad_norm"])
            full = _grad_norm(t, r, role)
            if (precision, zero) == ("bf16", 0) and rm["tp"] > 1:
                # DeepSpeed finding (README): FP16_UnfusedOptimizer hands gradient tensors
                # to get_weight_norm, whose TP de-duplication drops every gradient of TP
                # ranks > 0: the engine's norm is TP rank 0's shards + replicated only.
                rank0 = _grad_norm(t, r, role, rm["engine_info"]["shard_dims"])
                assert norm == pytest.approx(rank0, rel=1e-5)
                assert norm < 0.9 * full
            else:
                assert norm == pytest.approx(full, rel=rel)
            # The engine clips with its own norm (clip_coef is read from its AdamW state).
            assert float(t[f"round{r}/{role}/clip_coef"]) == pytest.approx(
                min(1.0, max_norm / (norm + 1e-6)), rel=rel)
        src = meta["roles"][role]["engine_info"]["grad_norm"]["reported"]
        # FP32 ZeRO 0 steps the bare torch.optim.AdamW: DeepSpeed keeps no norm there.
        assert src.startswith("harness-measured") == (precision == "fp32" and zero == 0), src
    alg, mask = runs.contract.algorithm, runs.mask
    adv, ret = runs.train["advantages"], runs.train["returns"]
    n = mask.sum()
    ratio = torch.exp(t["round2/actor/logprobs"] - t["round1/actor/logprobs"])
    eps = alg.clip_ratio
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    assert float(t["round2/actor/loss/policy"]) == pytest.approx(float(pg[mask].sum() / n),
                                                                 abs=1e-6)
    v1, v2 = t["round1/critic/values"].double(), t["round2/critic/values"].double()
    sq = torch.maximum((v2 - ret).square(),
                       (v1 + (v2 - v1).clamp(-alg.value_clip, alg.value_clip) - ret).square())
    assert float(t["round2/critic/loss/value"]) == pytest.approx(
        float(0.5 * sq[mask].sum() / n), abs=1e-6)


@pytest.mark.parametrize(("precision", "zero"), RUNS["a2c1"]["variants"])
def test_dtypes_are_what_deepspeed_holds(runs: Runs, precision: str, zero: int) -> None:
    """FP32 masters and AdamW state everywhere; BF16 ZeRO 0 accumulates grads in BF16."""
    meta = runs.meta("a2c1", precision, zero)
    for role, rm in meta["roles"].items():
        d, info = rm["dtypes"], rm["engine_info"]
        assert d["master_weights"] == "torch.float32", (role, d)
        assert d["optimizer_state"] == {"exp_avg": "torch.float32",
                                        "exp_avg_sq": "torch.float32"}, (role, d)
        compute = "torch.bfloat16" if precision == "bf16" else "torch.float32"
        assert d["compute"] == [compute], (role, d)
        # DeepSpeed 0.19.8 rejects FP32 gradient accumulation for BF16 without ZeRO.
        grads = "torch.bfloat16" if (precision, zero) == ("bf16", 0) else "torch.float32"
        assert d["grads"] == grads == info["grad_accum_dtype"], (role, d, info)
        # read back from the engine: FP32 communication everywhere, accumulation as above
        assert d["grad_reduction"]["engine.communication_data_type"] == "torch.float32", d
        assert d["grad_accumulation"]["engine.get_data_types.grad_accum_dtype"] == grads, d
        assert info["optimizer_wrapper"] == {("fp32", 0): "AdamW", ("fp32", 2): (
            "DeepSpeedZeroOptimizer"), ("bf16", 0): "FP16_UnfusedOptimizer",
            ("bf16", 1): "BF16_Optimizer"}[(precision, zero)]
        routes = rm["routes"]  # read back from the live engine and the forwards
        assert routes["optimizer_wrapper"]["class"].endswith("." + info["optimizer_wrapper"])
        assert routes["zero_stage"] == zero
        assert sum(routes["sdpa_backends"].values()) > 0, routes


@pytest.mark.parametrize(("precision", "zero"), RUNS["a2c1"]["variants"])
def test_initial_masters_against_the_checkpoint(runs: Runs, precision: str, zero: int) -> None:
    """FP32: the masters are the checkpoint. BF16: DeepSpeed builds the FP32 masters from
    the BF16-cast module, so they equal the BF16-rounded checkpoint (a finding)."""
    for role, rm in runs.meta("a2c1", precision, zero)["roles"].items():
        init = rm["engine_info"]["initial_master_vs_checkpoint"]
        assert init["measured"] is True, (role, init)
        if precision == "fp32":
            assert init["max_abs"] == 0.0, (role, init)
        else:
            assert init["max_abs"] > 0.0, (role, init)
            if zero > 0:
                assert init["equals_bf16_rounded_checkpoint"] is True, (role, init)


@pytest.mark.parametrize(("run", "precision", "zero"), [("a2c1", "fp32", 0),
                                                         ("a2c1", "bf16", 1),
                                                         ("a1c2", "fp32", 1)])
def test_replicas_and_layout(runs: Runs, run: str, precision: str, zero: int) -> None:
    meta = runs.meta(run, precision, zero)
    for role, rm in meta["roles"].items():
        rc = rm["replica_consistency"]
        assert rc["all_equal"] is True, (role, rc)
        assert [r["round"] for r in rc["rounds"]] == [1, 2]
        assert "model.norm.weight" in rc["params"]
        if rm["tp"] > 1:
            par, info = rm["parallelism"], rm["engine_info"]
            assert "model.layers.0.self_attn.q_norm.weight" in par["replicated_params"]
            assert info["shard_dims"]["model.layers.0.self_attn.q_proj.weight"] == 0
            assert info["shard_dims"]["model.layers.0.mlp.down_proj.weight"] == 1
            if role == "actor":
                assert par["lm_head"] == "vocab_parallel"
    shims = meta["shims"]
    # The critic's TP group [1, 2] in a1c2 does not start at a multiple of 2.
    assert any("first_dataloader_check" in s for s in shims) == (run == "a1c2"), shims
    assert any("deepspeed_shm_comm" in s for s in shims)


def test_padding_invariance(runs: Runs) -> None:
    t = runs.tensors("a2c1", "fp32", 0)
    for role, metric in (("actor", "logprobs"), ("critic", "values")):
        a, b = t[f"round1/{role}/{metric}_padded"], t[f"round1/{role}/{metric}"]
        err = float((a - b).abs()[runs.mask].max())
        print(f"\n[deepspeed] padding {role} {metric}: {err:.2e}")
        assert err < 1e-5


# --------------------------------------------------------------------------- unit tests


@pytest.mark.parametrize(("precision", "zero", "tp", "accum", "autotp"), [
    ("fp32", 0, 1, None, None),
    ("fp32", 2, 2, None, 2),
    ("bf16", 0, 2, None, 2),   # DeepSpeed: no FP32 accumulation without ZeRO
    ("bf16", 1, 1, "fp32", None),
    ("bf16", 2, 1, "fp32", None),
])
def test_ds_config(precision: str, zero: int, tp: int, accum: str | None,
                   autotp: int | None) -> None:
    cfg = ds_config(precision=precision, zero=zero, tp=tp, micro_batch_size=4, n_micro=3,
                    lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                    max_grad_norm=0.5)
    assert cfg["train_batch_size"] == 12
    assert cfg["gradient_accumulation_steps"] == 3
    assert cfg["optimizer"] == {"type": "AdamW", "params": {
        "lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
        "torch_adam": True}}
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["zero_optimization"] == {"stage": zero}
    assert cfg.get("data_types", {}).get("grad_accum_dtype") == accum
    assert cfg.get("tensor_parallel", {}).get("autotp_size") == autotp
    assert ("bf16" in cfg) == (precision == "bf16")
    # DeepSpeed's BF16 default communication dtype is BF16; the contract reduces in FP32
    assert cfg.get("communication_data_type") == ("fp32" if precision == "bf16" else None)


def _cell(**kw: Any) -> HarnessCell:
    base: dict[str, Any] = {"engine": "deepspeed", "precision": "fp32", "options": {"zero": 0},
                            "actor_tp": 1, "critic_tp": 1, "rounds": 2, "seed": 0,
                            "inputs_dir": "/nonexistent", "output_dir": "/nonexistent"}
    return HarnessCell(**{**base, **kw})


def test_check_cell_lists_variants_in_order() -> None:
    assert check_cell(_cell()) == [("fp32", 0, "")]
    cell = _cell(variants=({"precision": "bf16", "options": {"zero": 2}},
                           {"precision": "fp32", "options": {"zero": 1}}))
    assert check_cell(cell) == [("bf16", 2, "bf16-zero2"), ("fp32", 1, "fp32-zero1")]


@pytest.mark.parametrize(("kw", "match"), [
    ({"options": {"zero": 3}}, "ZeRO stage 3"),
    ({"options": {"offload": 1}}, "not known"),
    ({"variants": ({"precision": "fp16", "options": {"zero": 0}},)}, "fp16"),
    ({"faults": ("hang_rank1",)}, "injects only .*resume_drops_optimizer_state.*got .*hang_rank1"),
])
def test_check_cell_refuses(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(HarnessError, match=match):
        check_cell(_cell(**kw))


def test_tied_embeddings_are_listed_once() -> None:
    """SmolLM2 ties ``lm_head.weight`` to ``model.embed_tokens.weight``: the layout and the
    engine-tensor reader name it once, as ``named_parameters()`` and the HF reference do
    (found by ``qualify run contracts/smollm2-135m.toml``: KeyError 'lm_head.weight')."""
    import types

    from transformers import LlamaConfig, LlamaForCausalLM

    from harnesses.deepspeed.parallelize import tp_layout
    from harnesses.deepspeed.state_dict_adapter import EngineTensors

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = [pl.name for pl in tp_layout(model)]
    assert names == [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names
    assert names.count("model.embed_tokens.weight") == 1
    et = EngineTensors(types.SimpleNamespace(module=model, optimizer=object()),
                       tp_layout(model))
    assert set(et.params) == set(names)


def test_role_ranks_and_dtype_names() -> None:
    assert role_ranks(2, 1) == {"actor": (0, 1), "critic": (2,)}
    assert role_ranks(0, 2) == {"critic": (0, 1)}
    assert dtype_name([torch.float32, torch.float32]) == "torch.float32"
    assert dtype_name([torch.float32, torch.bfloat16]) == ["torch.bfloat16", "torch.float32"]


@pytest.mark.parametrize(("estimator", "expected"), [
    ("k1", -0.5), ("k2", 0.125), ("k3", math.exp(0.5) - 0.5 - 1.0)])
def test_kl_estimators(estimator: Any, expected: float) -> None:
    lp, ref = torch.tensor([-1.5]), torch.tensor([-1.0])  # ref - lp = 0.5
    assert float(losses.kl_penalty(lp, ref, estimator)[0]) == pytest.approx(expected, rel=1e-6)


def test_logprobs_and_entropy_match_a_hand_softmax() -> None:
    logits = torch.tensor([[[1.0, 2.0, 0.5]]])
    lp, ent = losses.logprobs_and_entropy(logits, torch.tensor([[1]]), temperature=0.5)
    z = [2.0, 4.0, 1.0]
    lse = math.log(sum(math.exp(v) for v in z))
    p = [math.exp(v - lse) for v in z]
    assert float(lp[0, 0]) == pytest.approx(4.0 - lse, rel=1e-6)
    assert float(ent[0, 0]) == pytest.approx(-sum(q * math.log(q) for q in p), rel=1e-6)


def test_the_warm_imports_hold_zeros_lazy_import() -> None:
    """Every ZeRO ``deepspeed.initialize`` imports the Muon module lazily (1.9 s per rank
    here): the spec's ``warm_imports`` name it, so the warm launcher imports it once, before
    the fork. Fails when DeepSpeed moves that import (the preload would then be dead weight)
    or when a warm import no longer imports. In a child: importing DeepSpeed sets
    environment variables this test worker must not keep."""
    code = textwrap.dedent("""
        import inspect
        from deepspeed.runtime.zero import utils
        from harnesses.deepspeed.spec import SPEC
        from qualify.candidate import warm
        src = inspect.getsource(utils.is_zero_supported_optimizer)
        lazy = [m for m in SPEC.warm_imports if m != "deepspeed"]
        assert lazy and all(f"from {m} import" in src for m in lazy), (lazy, src)
        notes = warm.preload("harnesses.deepspeed.harness", SPEC.warm_imports, None)
        assert notes == [], notes
    """)
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, env=launch_env(ENGINE.cpu_env), cwd=repo_root(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
