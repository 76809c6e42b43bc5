"""The Megatron-Core harness end to end on CPU: reference -> candidate -> compare.

Uses ``contracts/tiny-qwen3.toml`` (a copy with ``"megatron"`` added to ``engines`` when
the committed matrix does not list it), takes its sealed reference (the session's shared
:func:`shared_artifacts.default_reference` when that is the committed contract), runs
``megatron-fp32-*`` (one launch of real torchrun + gloo running both topologies, a2c1 and
a1c2, since issue #17) and
compares. On CPU the Megatron cells run their whole update with Megatron's own optimizer
(``get_megatron_optimizer`` under the placement shims of ``harnesses/megatron/cpu_shims.py``):
scoring, both rounds' losses, grad_norm, clip_coef, grads, Adam moments and updates, each
compared with the sealed reference; every FP32 row passes. About 7 minutes on 2 shared cores.

The ``main_grad`` tests check Megatron DDP's FP32 grad buffers after
``finalize_model_grads`` against HF autograd at TP 1 and 2; the optimizer tests check
Megatron's step (FP32 and BF16, TP 1 and 2) against an independent ``torch.optim.AdamW``
step from the same ``main_grad`` (bitwise) and its grad norm against an FP64 norm; the shim
tests check that each shim changes placement only (about 3 + 3 minutes).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from harness_outputs import rank_stderr, warm_command
from shared_artifacts import copy_tree, default_reference

from qualify.candidate.stage import run_candidate_stage
from qualify.compare.stage import compare_run
from qualify.contract import Contract, default_contract_path, load_contract
from qualify.evidence import store
from qualify.reference.stage import run_reference_stage
from qualify.registry import get_engine
from qualify.resources import contracts_dir

pytest.importorskip("megatron.core")

SCORING = {"actor": ("logprobs", "entropy"), "critic": ("values",)}
TRAINING = ("losses", "grad_norm", "clip_coef", "grads", "exp_avg", "exp_avg_sq", "updates")


@pytest.fixture(scope="module")
def contract(tmp_path_factory: pytest.TempPathFactory) -> Contract:
    committed = contracts_dir() / "tiny-qwen3.toml"
    text = committed.read_text("utf-8")
    engines = re.search(r'(?m)^engines = \[(.*)\]$', text)
    assert engines is not None
    if '"megatron"' in engines.group(1):  # the committed matrix already lists megatron
        return load_contract(committed)
    path = tmp_path_factory.mktemp("contract") / "tiny-qwen3.toml"
    path.write_text(text.replace(engines.group(0),
                                 f'engines = [{engines.group(1)}, "megatron"]'), "utf-8")
    return load_contract(path)


@pytest.fixture(scope="module")
def reference(contract: Contract, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sealed reference of ``contract``: when it is the committed default contract (whose
    matrix lists megatron), a copy of the session's shared
    :func:`shared_artifacts.default_reference` (the same real reference stage, which
    test_vllm_rollout checks too, built once per session); else built here."""
    default = load_contract(default_contract_path())
    if contract.digest12 != default.digest12:
        return run_reference_stage(contract, root=tmp_path_factory.mktemp("refs"), quiet=True)
    shared = default_reference(tmp_path_factory) / "references" / \
        f"{contract.name}-{contract.digest12}"
    assert store.is_sealed(shared)
    return copy_tree(shared, tmp_path_factory.mktemp("refs") / shared.name)


@pytest.fixture(scope="module")
def report(contract: Contract, reference: Path,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = run_candidate_stage(contract, reference=reference,
                                  root=tmp_path_factory.mktemp("ev"),
                                  cells=["megatron-fp32-*"], quiet=True)
    compare_run(run_dir)
    doc: dict[str, Any] = json.loads((run_dir / "report.json").read_text("utf-8"))
    doc["_run_dir"] = str(run_dir)
    return doc


def _rows(report: dict[str, Any], cell: str) -> list[dict[str, Any]]:
    return [r for r in report["rows"] if r["cell"] == cell]


CELLS = ["megatron-fp32-actor-tp1", "megatron-fp32-actor-tp2", "megatron-fp32-critic-tp1",
         "megatron-fp32-critic-tp2"]


@pytest.mark.parametrize("cell", CELLS)
def test_scoring_rows_pass_against_the_sealed_reference(report: dict[str, Any],
                                                        cell: str) -> None:
    role, tp = cell.split("-")[2], int(cell[-1])
    rows = _rows(report, cell)
    scored = [r for r in rows if r["round"] == 1 and r["family"] in SCORING[role]]
    classes = {"candidate_vs_hf", "padding_invariance"} | ({"tp_vs_tp1"} if tp > 1 else set())
    assert {r["class"] for r in scored} == classes
    for r in scored:
        print(f"\n[megatron] {cell} {r['class']} {r['metric']}: error {r['error']:.3g} "
              f"bound {r['bound']:.3g} margin {r['margin']:.3g} {r['verdict']}")
        assert r["verdict"] == "PASS", r
        assert 0.0 <= r["margin"] < 1.0


@pytest.mark.parametrize("cell", CELLS)
def test_training_rows_run_on_cpu_and_pass(report: dict[str, Any], cell: str) -> None:
    """Megatron's own optimizer runs on CPU: every training family of both rounds is
    compared with the sealed reference and passes (nothing NOT_RUN, nothing failed)."""
    rows = _rows(report, cell)
    training = [r for r in rows if r["family"] in TRAINING]
    fams = {(r["round"], r["family"]) for r in training}
    assert {(rd, f) for rd in (1, 2) for f in TRAINING} <= fams
    assert any(r["round"] == 2 and r["family"] in SCORING[cell.split("-")[2]] for r in rows)
    for r in sorted(training, key=lambda r: -r["margin"])[:3]:
        print(f"\n[megatron] {cell} r{r['round']} {r['class']} {r['metric']}: error "
              f"{r['error']:.3g} bound {r['bound']:.3g} margin {r['margin']:.3g}")
    bad = [(r["metric"], r["class"], r["verdict"], r["margin"]) for r in rows
           if r["verdict"] != "PASS"]
    assert not bad, bad
    verdict = {c["cell"]: c["verdict"] for c in report["cells"]}
    assert verdict[cell] == "PASS"


@pytest.mark.parametrize("cell", ["megatron-fp32-actor-tp1", "megatron-fp32-actor-tp2"])
def test_distribution_is_the_references_within_the_cells_logprobs_bound(
        report: dict[str, Any], reference: Path, cell: str) -> None:
    """``round1/actor/prefill_<kind>`` (TP 2: the padded vocabulary's shards gathered with
    megatron-core's gather and cut to V) equals the reference's sealed distribution entry by
    entry, within the cell's own sealed round-1 logprobs bound (``candidate_vs_hf``: the same
    log-softmax on the same forward); 0 at masked positions."""
    from safetensors.torch import load_file

    (att,) = sorted((Path(report["_run_dir"]) / "cells" / cell).glob("attempt-*"))[-1:]
    got = load_file(str(att / "outputs.safetensors"))
    ref = load_file(str(reference / "distribution.safetensors"))
    mask = load_file(str(reference / "rollout.safetensors"))["response_mask"].bool()
    (bound,) = {r["bound"] for r in _rows(report, cell) if r["round"] == 1
                and r["class"] == "candidate_vs_hf"
                and r["metric"] == "round1/actor/logprobs"}
    assert json.loads((att / "outputs.json").read_text("utf-8"))["distribution"] == {
        "path": "full", "k": None, "vocab": ref["raw"].shape[-1]}
    for kind in ("raw", "tempered"):
        t = got[f"round1/actor/prefill_{kind}"]
        assert t.shape == ref[kind].shape
        assert not t[~mask].any()
        err = float((t - ref[kind]).abs()[mask].max())
        print(f"\n[megatron] {cell} prefill_{kind} vs reference: {err:.3g} (bound {bound:.3g})")
        assert err <= bound


def test_outputs_list_the_shims(report: dict[str, Any]) -> None:
    run_dir = Path(report["_run_dir"])
    metas = sorted(run_dir.glob("cells/megatron-fp32-*/attempt-*/outputs.json"))
    assert len(metas) == 4
    for path in metas:
        meta = json.loads(path.read_text("utf-8"))
        shims = " ".join(meta["shims"])
        assert "torch.cuda.current_device" in shims
        assert "initialize_rng_tracker" in shims
        assert "_set_global_memory_buffer" in shims
        assert "megatron/core/optimizer/optimizer.py:907" in shims
        assert "megatron/core/optimizer/clip_grads.py:167" in shims
        assert meta["engine"] == "megatron"
        routes = meta["routes"]  # the cell's role, read back from the built model
        assert routes["core_attention"] == [
            "megatron.core.transformer.dot_product_attention.DotProductAttention"]
        assert routes["fusions"]["masked_softmax_fusion"] is False
        assert routes["fusions"]["attention_softmax_in_fp32"] is True
        assert routes["sdpa_backends"] == {"no SDPA call": 0}
        assert meta["versions"]["megatron-core"] == "0.16.1"
        assert meta["device"] == "cpu"
        assert not meta.get("not_run")
        opt = meta["engine_info"]["optimizer"]
        assert opt["wrapped"] == ["FP32Optimizer"]
        assert opt["inner"] == ["AdamW"]
        # FP32Optimizer._scale, the grad-norm scalar and its overflow flag were served
        assert {"megatron/core/optimizer/optimizer.py:907", "megatron/core/utils.py:1207",
                "megatron/core/optimizer/clip_grads.py:103"} <= set(opt["cpu_placement_served"])
        assert meta["dtypes"]["master_weights"] == "torch.float32"


# --------------------------------------------------------------------------- gradients

GRAD_SCRIPT = r'''
import json, sys
from pathlib import Path
import torch, torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
import qualify_harness as sdk
from qualify_harness import losses
from harnesses.megatron import convert, harness as H, model as mm, train
from qualify.contract import load_contract
from qualify.protocol import HarnessCell

role, root = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
contract = load_contract(Path(sys.argv[3]))
ids = torch.load(root / "ids.pt")
am, resp, mask = ids["am"], ids["responses"], ids["mask"]
P = ids["P"]
batch = H.Batch(input_ids=ids["input_ids"], attention_mask=am,
                position_ids=(am.cumsum(1) - 1).clamp(min=0), responses=resp, mask=mask,
                advantages=torch.zeros_like(resp, dtype=torch.float32),
                returns=ids["returns"], prompt_len=P)
cell = HarnessCell(engine="megatron", precision="fp32", options={},
                   actor_tp=world if role == "actor" else 0,
                   critic_tp=world if role == "critic" else 0, rounds=1, seed=0,
                   inputs_dir=str(root), output_dir=str(root))
groups = mm.role_groups(cell.actor_tp, cell.critic_tp, rank, 60.0)
mm.apply_group_shims()
mm.apply_cpu_shims()
cpu = torch.device("cpu")
model, shape, _ = H.build(root / role, "lm" if role == "actor" else "value", groups,
                          bf16=False, device=cpu)
eng = train.MegatronEngine(model=model, shape=shape, groups=groups, contract=contract,
                           device=cpu, bf16=False, rec=sdk.Recorder(role=role, writer=True))
eng.after_scoring([])  # train mode, empty main_grad buffers
n = float(mask.sum())
if role == "actor":
    lp, ent = eng.logprobs_and_entropy(eng.ddp, batch)
    loss = (-losses.masked_sum(lp, mask) - 0.01 * losses.masked_sum(ent, mask)) / n
else:
    v = eng.values(eng.ddp, batch)
    loss = 0.5 * losses.masked_sum((v - batch.returns) ** 2, mask) / n
loss.backward()
eng.prepare_grads()  # Megatron's finalize_model_grads
grads = {k: p.main_grad for k, p in eng.named().items()}
hf = eng.full_hf(grads)
if rank == 0:
    torch.save({"loss": float(loss), "grads": hf,
                "dtypes": sorted({str(g.dtype) for g in grads.values()})},
               root / f"grads-{role}-tp{world}.pt")
dist.destroy_process_group()
'''


def _hf_grads(root: Path, role: str, temperature: float) -> tuple[float, dict[str, Any]]:
    """Independent HF autograd of the same loss (eager attention, FP32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    ids = torch.load(root / "ids.pt")
    am, resp, mask, p = ids["am"], ids["responses"], ids["mask"], ids["P"]
    kw: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "eager"}
    model = (AutoModelForCausalLM.from_pretrained(str(root / "actor"), **kw) if role == "actor"
             else AutoModelForTokenClassification.from_pretrained(str(root / "critic"),
                                                                  num_labels=1, **kw))
    out = model(input_ids=ids["input_ids"], attention_mask=am,
                position_ids=(am.cumsum(1) - 1).clamp(min=0)).logits[:, p - 1:p - 1 + resp.shape[1]]
    n = mask.sum()
    if role == "actor":
        ls = torch.log_softmax(out / temperature, dim=-1)
        lp = ls.gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        ent = -(ls.exp() * ls).sum(-1)
        loss = (-(lp * mask).sum() - 0.01 * (ent * mask).sum()) / n
    else:
        loss = 0.5 * (((out[..., 0] - ids["returns"]) ** 2) * mask).sum() / n
    loss.backward()
    return float(loss.detach()), {k: v.grad for k, v in model.named_parameters()}


@pytest.fixture(scope="module")
def grad_inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForTokenClassification

    root = tmp_path_factory.mktemp("megatron_grads")
    cfg = Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=160,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, tie_word_embeddings=False, max_position_embeddings=64,
                      pad_token_id=0)
    torch.manual_seed(5)
    actor = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # non-trivial norm weights, so their gradients are distinctive
        for name, param in actor.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    ccfg = {k: v for k, v in cfg.to_dict().items() if k not in ("id2label", "label2id")}
    # num_labels goes to PreTrainedConfig via @strict's **kwargs; mypy sees only the fields.
    critic = Qwen3ForTokenClassification(Qwen3Config(**ccfg, num_labels=1))  # type: ignore[call-arg]
    critic.model.load_state_dict(actor.model.state_dict())
    with torch.no_grad():
        critic.score.weight.normal_(0.0, 0.3)
        critic.score.bias.fill_(0.1)
    actor.save_pretrained(root / "actor")
    critic.save_pretrained(root / "critic")
    g = torch.Generator().manual_seed(9)
    b, p, r = 4, 5, 6
    am = torch.ones(b, p + r, dtype=torch.long)
    am[1, :2] = 0  # left-padded prompt
    am[2, p + 4:] = 0  # short response
    mask = am[:, p:].bool()
    ids = torch.randint(3, 384, (b, p + r), generator=g) * am
    torch.save({"input_ids": ids, "am": am, "responses": ids[:, p:], "mask": mask, "P": p,
                "returns": torch.randn(b, r, generator=g)}, root / "ids.pt")
    (root / "run.py").write_text(GRAD_SCRIPT, "utf-8")
    return root


# TP 2 (where partial q/k-norm gradients must be reduced) runs in CI; TP 1 with -m slow.
@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_megatron_main_grads_match_hf_autograd(grad_inputs: Path, role: str, tp: int) -> None:
    """Megatron DDP ``main_grad`` + ``finalize_model_grads`` (no optimizer: runs on CPU).

    The loss (actor: -Σ logp - 0.01 Σ H over valid tokens / N through this harness's
    vocab-parallel log-softmax; critic: 0.5 Σ (V - G)^2 / N) is backpropagated through
    megatron-core's GPTModel into its FP32 grad buffers, finalized as Megatron's training
    loop does (which all-reduces the partial q/k-layernorm gradients over TP), gathered
    and converted to HF names: each must match HF autograd of the same loss. Bound 1e-5
    relative L2 (FP32 summation-order noise; measured ~1e-6). Without
    ``finalize_model_grads`` the TP2 q/k-norm gradients are off by ~60%.
    """
    import subprocess

    import torch

    contract = contracts_dir() / "tiny-qwen3.toml"
    logs = grad_inputs / f"logs-run-{role}-{tp}"
    cmd = warm_command(str(grad_inputs / "run.py"), tp, logs, role, str(grad_inputs),
                       str(contract), preload=get_engine("megatron").warm_imports)
    env = {**__import__("os").environ,
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                         check=False)
    assert res.returncode == 0, res.stderr[-3000:] + rank_stderr(logs)
    got = torch.load(grad_inputs / f"grads-{role}-tp{tp}.pt")
    temperature = load_contract(contract).sampling.temperature
    loss, want = _hf_grads(grad_inputs, role, temperature)
    assert got["dtypes"] == ["torch.float32"]
    assert got["loss"] == pytest.approx(loss, rel=1e-6)
    assert set(got["grads"]) == set(want)
    errs = {k: float((got["grads"][k] - g).norm() / g.norm()) for k, g in want.items()}
    worst = max(errs, key=lambda k: errs[k])
    print(f"\n[megatron] main_grad vs HF autograd, {role} TP{tp}: worst rel L2 "
          f"{errs[worst]:.2e} ({worst})")
    assert errs[worst] < 1e-5, errs


# --------------------------------------------------------------------------- optimizer step

OPT_SCRIPT = r'''
import sys
from pathlib import Path
import torch, torch.distributed as dist
import qualify_harness as sdk
from qualify_harness import losses
from harnesses.megatron import harness as H, model as mm, train
from qualify.contract import load_contract
from qualify.protocol import HarnessCell

role, root = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
contract = load_contract(Path(sys.argv[3]))
ids = torch.load(root / "ids.pt")
am, resp, mask = ids["am"], ids["responses"], ids["mask"]
batch = H.Batch(input_ids=ids["input_ids"], attention_mask=am,
                position_ids=(am.cumsum(1) - 1).clamp(min=0), responses=resp, mask=mask,
                advantages=torch.zeros_like(resp, dtype=torch.float32),
                returns=ids["returns"], prompt_len=ids["P"])
mm.apply_cpu_shims()
groups, out = None, {}
for precision in ("fp32", "bf16"):
    cell = HarnessCell(engine="megatron", precision=precision, options={},
                       actor_tp=world if role == "actor" else 0,
                       critic_tp=world if role == "critic" else 0, rounds=1, seed=0,
                       inputs_dir=str(root), output_dir=str(root))
    if groups is None:
        groups = mm.role_groups(cell.actor_tp, cell.critic_tp, rank, 60.0)
        mm.apply_group_shims()
    cpu, bf16 = torch.device("cpu"), precision == "bf16"
    model, shape, _ = H.build(root / role, "lm" if role == "actor" else "value", groups,
                              bf16=bf16, device=cpu)
    rec = sdk.Recorder(role=role, writer=groups.tp_rank == 0)
    eng = train.MegatronEngine(model=model, shape=shape, groups=groups, contract=contract,
                               device=cpu, bf16=bf16, rec=rec)  # DDP + optimizer
    eng.after_scoring([])
    n = float(mask.sum())
    if role == "actor":
        lp, ent = eng.logprobs_and_entropy(eng.ddp, batch)
        loss = (-losses.masked_sum(lp, mask) - 0.01 * losses.masked_sum(ent, mask)) / n
    else:
        v = eng.values(eng.ddp, batch)
        loss = 0.5 * losses.masked_sum((v - batch.returns) ** 2, mask) / n
    loss.backward()
    before = eng.full_params()
    eng.update(rec, 1, contract.optimizer.max_grad_norm)  # main_grad, Megatron's step()
    meta = sdk.role_meta(rec, tp=groups.tp, global_ranks=groups.ranks, precision=precision,
                         optimizer=eng.optimizer_info())
    out[precision] = {"before": before, "tensors": dict(rec.tensors), "meta": meta}
if rank == 0:
    torch.save(out, root / f"opt-{role}-tp{world}.pt")
dist.destroy_process_group()
'''


def _adamw_reference(before: dict[str, Any], grads: dict[str, Any], contract: Contract,
                     role: str, clip: float) -> dict[str, dict[str, Any]]:
    """Independent step: ``torch.optim.AdamW`` with the contract's settings on FP32 copies
    of the masters, from the given gradients scaled by ``clip``.

    Returns:
        ``{HF name: {"updates", "exp_avg", "exp_avg_sq"}}``.
    """
    import torch

    o = contract.optimizer
    lr = o.actor_lr if role == "actor" else o.critic_lr
    names = sorted(before)
    params = [torch.nn.Parameter(before[n].clone()) for n in names]
    opt = torch.optim.AdamW(params, lr=lr, betas=(o.betas[0], o.betas[1]), eps=o.eps,
                            weight_decay=o.weight_decay)
    for p, n in zip(params, names, strict=True):
        p.grad = grads[n] * clip
    opt.step()
    return {n: {"updates": p.detach() - before[n], "exp_avg": opt.state[p]["exp_avg"],
                "exp_avg_sq": opt.state[p]["exp_avg_sq"]}
            for p, n in zip(params, names, strict=True)}


# TP 2 (Megatron's TP-aware norm counts replicated parameters once) in CI; TP 1 with -m slow.
@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_megatron_optimizer_step_on_cpu_matches_torch_adamw(grad_inputs: Path, role: str,
                                                            tp: int) -> None:
    """``get_megatron_optimizer``'s step on CPU (FP32Optimizer and, for BF16,
    Float16OptimizerWithFloat16Params around torch.optim.AdamW; Megatron's
    ``clip_grad_norm``) equals an independent AdamW step from the same ``main_grad``.

    1. Norm: Megatron's ``grad_norm`` equals the FP64 L2 norm of the gathered HF-layout
       gradients (each parameter once) within 2e-6 relative (FP32 per-tensor norms summed
       in FP32; measured <= 5e-7). Untagged TP weights (each rank's shards counted as
       replicas) were 26% low at TP 2.
    2. Step: ``torch.optim.AdamW`` with the contract's settings, from the masters Megatron
       started from and its pre-clip ``main_grad`` scaled by ``max_norm / (norm + 1e-6)``
       (``clip_grads.py:172`` with the Python float norm Megatron clipped with,
       ``outputs.json`` ``grad_norms``): Adam moments and updates **bitwise** equal (the
       same FP32 AdamW arithmetic on the same inputs). Weight decay 0 instead of 0.1 would
       move an update by ``lr * wd * |w|``; a clip from another norm changes ~3% of the
       weights by one FP32 spacing (measured with the FP32-stored norm).
    """
    import subprocess

    import torch

    contract_path = contracts_dir() / "tiny-qwen3.toml"
    contract = load_contract(contract_path)
    max_norm = contract.optimizer.max_grad_norm
    (grad_inputs / "opt.py").write_text(OPT_SCRIPT, "utf-8")
    logs = grad_inputs / f"logs-opt-{role}-{tp}"
    cmd = warm_command(str(grad_inputs / "opt.py"), tp, logs, role, str(grad_inputs),
                       str(contract_path), preload=get_engine("megatron").warm_imports)
    env = {**__import__("os").environ,
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                         check=False)
    assert res.returncode == 0, res.stderr[-3000:] + rank_stderr(logs)
    got = torch.load(grad_inputs / f"opt-{role}-tp{tp}.pt")
    hf = {k: v.detach() for k, v in _hf_state(grad_inputs, role).items()}
    for precision, wrapped in (("fp32", "FP32Optimizer"),
                               ("bf16", "Float16OptimizerWithFloat16Params")):
        d = got[precision]
        t, before, meta = d["tensors"], d["before"], d["meta"]
        assert meta["optimizer"]["wrapped"] == [wrapped]
        assert meta["optimizer"]["inner"] == ["AdamW"]
        assert meta["dtypes"]["master_weights"] == "torch.float32"
        assert meta["dtypes"]["grads"] == "torch.float32"
        # FP32: the masters are the checkpoint; BF16: Megatron copies its BF16 params
        # (optimizer.py:674 main_param = param.detach().clone().float()): BF16-rounded.
        born = {k: (v if precision == "fp32" else v.bfloat16().float()) for k, v in hf.items()}
        assert set(before) == set(born)
        assert all(torch.equal(before[k], born[k]) for k in born)
        key = f"round1/{role}"
        grads = {n: t[f"{key}/grads/{n}"] for n in before}
        fp64 = sum(float((g.double() ** 2).sum()) for g in grads.values()) ** 0.5
        (norm,) = meta["optimizer"]["grad_norms"]
        got_clip = float(t[f"{key}/clip_coef"])
        clip = max_norm / (norm + 1e-6)
        assert clip < 1.0  # clip_grad_by_total_norm_fp32 scaled the grads
        assert norm == pytest.approx(fp64, rel=2e-6)
        assert float(t[f"{key}/grad_norm"]) == pytest.approx(norm, rel=1e-7)  # FP32-stored
        assert got_clip == pytest.approx(clip, rel=1e-6)
        want = _adamw_reference(before, grads, contract, role, clip)
        diff = {f: max(float((t[f"{key}/{f}/{n}"] - w[f]).abs().max()) for n, w in want.items())
                for f in ("updates", "exp_avg", "exp_avg_sq")}
        print(f"\n[megatron] {role} TP{tp} {precision}: grad_norm {norm:.9g} (FP64 "
              f"{fp64:.9g}, rel {abs(norm - fp64) / fp64:.1e}), clip {clip:.6g}, max abs "
              f"difference from torch AdamW {diff}")
        for n, w in want.items():
            for f in ("updates", "exp_avg", "exp_avg_sq"):
                assert torch.equal(t[f"{key}/{f}/{n}"], w[f]), (precision, f, n)
        served = set(meta["optimizer"]["cpu_placement_served"])
        assert "megatron/core/optimizer/clip_grads.py:167" in served  # the FP32-grad assert
        assert "megatron/core/optimizer/clip_grads.py:174" in served  # the scale's flag
        assert ("megatron/core/optimizer/optimizer.py:907" in served) == (precision == "fp32")
        assert ("megatron/core/optimizer/optimizer.py:671" in served) == (precision == "bf16")


def _hf_state(root: Path, role: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    kw: dict[str, Any] = {"dtype": torch.float32}
    model = (AutoModelForCausalLM.from_pretrained(str(root / "actor"), **kw) if role == "actor"
             else AutoModelForTokenClassification.from_pretrained(str(root / "critic"),
                                                                  num_labels=1, **kw))
    return dict(model.state_dict())


# --------------------------------------------------------------------------- CPU shims


def _upstream_line(entry: str) -> str:
    """The installed megatron-core source line an ``OPTIMIZER_SHIMS`` entry names."""
    import megatron.core

    where = entry.split(" ", 1)[0]
    path, line = where.rsplit(":", 1)
    root = Path(megatron.core.__file__).resolve().parents[2]
    return (root / path).read_text("utf-8").splitlines()[int(line) - 1]


def test_every_shim_names_an_upstream_cuda_line() -> None:
    """Each ``file:line`` of ``OPTIMIZER_SHIMS`` is a CUDA placement in the installed 0.16.1."""
    from harnesses.megatron import cpu_shims

    entries = [u for s in cpu_shims.OPTIMIZER_SHIMS for u in s["upstream"]]
    assert len(entries) == 11
    for e in entries:
        line = _upstream_line(e)
        assert "cuda" in line, (e, line)
    texts = " ".join(cpu_shims.shim_texts())
    assert all(e.split(" ", 1)[0] in texts for e in entries)


def test_placed_factories_change_placement_only() -> None:
    """``CpuPlacedTorch.tensor`` / ``zeros`` asked for CUDA give torch's CPU tensor (same
    values, dtype, shape) and record the calling line; other calls are torch's."""
    import torch

    from harnesses.megatron import cpu_shims

    placed = cpu_shims.Placement()
    proxy = cpu_shims.CpuPlacedTorch(placed)
    one = proxy.tensor([1.0], dtype=torch.float, device="cuda")
    flag = proxy.zeros(1, dtype=torch.int, device=torch.device("cuda", 0))
    plain = proxy.zeros(2, 3)
    for got, want in ((one, torch.tensor([1.0], dtype=torch.float)),
                      (flag, torch.zeros(1, dtype=torch.int)), (plain, torch.zeros(2, 3))):
        assert got.device.type == "cpu"
        assert got.dtype == want.dtype
        assert got.shape == want.shape
        assert torch.equal(got, want)
    assert sum(placed.served.values()) == 2  # the two CUDA requests, not the plain call
    assert all(k.startswith(__file__.replace("\\", "/")) for k in placed.served)
    assert proxy.float32 is torch.float32
    assert proxy.distributed is torch.distributed
    assert cpu_shims.cpu_device("cpu") == "cpu"
    assert cpu_shims.cpu_device(None) is None
    assert cpu_shims.cpu_device(0) == torch.device("cpu")
    assert cpu_shims.cuda_type_name("torch.BFloat16Tensor") == "torch.cuda.BFloat16Tensor"
    with pytest.raises(ValueError, match="not a CPU legacy"):
        cpu_shims.cuda_type_name("torch.cuda.FloatTensor")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only behaviour")
def test_optimizer_placement_runs_megatron_code_with_upstream_values() -> None:
    """Inside ``optimizer_placement`` megatron-core's own optimizer code runs on CPU tensors
    with upstream's constants and dtype split; outside it, the same calls fail (the shims are
    needed) and every patch is undone."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, clip_grads
    from megatron.core.optimizer import optimizer as mopt

    from harnesses.megatron import cpu_shims

    def opt_config(bf16: bool) -> OptimizerConfig:
        return OptimizerConfig(optimizer="adam", lr=1e-3, bf16=bf16, clip_grad=1.0,
                               params_dtype=torch.bfloat16 if bf16 else torch.float32)

    w32 = torch.nn.Parameter(torch.ones(3))
    w16 = torch.nn.Parameter(torch.full((2,), 0.1, dtype=torch.bfloat16))
    with pytest.raises((RuntimeError, AssertionError)):
        mopt.FP32Optimizer(torch.optim.AdamW([w32]), opt_config(False), lambda *a: None)
    with cpu_shims.optimizer_placement() as placed:
        inside: Any = mopt.torch
        assert isinstance(inside, cpu_shims.CpuPlacedTorch)
        assert w32.type() == "torch.FloatTensor"  # this module is not Megatron's
        fp32 = mopt.FP32Optimizer(torch.optim.AdamW([w32]), opt_config(False), lambda *a: None)
        mixed = mopt.Float16OptimizerWithFloat16Params(
            torch.optim.AdamW([w16, w32]), opt_config(True), None, lambda *a: None)
        # clip_grad_by_total_norm_fp32: the FP32-grad assert, then grads * max / (norm + 1e-6)
        g = torch.tensor([3.0, -4.0, 12.0])
        w32.grad = g.clone()
        clip_grads.clip_grad_by_total_norm_fp32([w32], max_norm=1.0, total_norm=13.0)
        scaled = w32.grad.clone()
    after: Any = mopt.torch
    assert after is torch
    assert "type" not in torch.Tensor.__dict__
    for t in (fp32._scale, mixed._scale_one):
        assert t.device.type == "cpu"
        assert t.dtype == torch.float32
        assert torch.equal(t, torch.tensor([1.0]))  # upstream: torch.tensor([1.0], ...)
    assert mixed._dummy_overflow_buf is None  # BF16: no overflow buffer upstream either
    # the dtype split is the one CUDA makes: the BF16 param gets an FP32 master copy
    assert mixed.float16_groups == [[w16]]
    assert mixed.fp32_from_fp32_groups == [[w32]]
    master = mixed.fp32_from_float16_groups[0][0]
    assert master.dtype == torch.float32
    assert torch.equal(master, w16.detach().float())
    assert torch.equal(scaled, g * (1.0 / (13.0 + 1e-6)))
    assert {"megatron/core/optimizer/optimizer.py:907",
            "megatron/core/optimizer/optimizer.py:485",
            "megatron/core/optimizer/optimizer.py:671",
            "megatron/core/optimizer/optimizer.py:690",
            "megatron/core/optimizer/clip_grads.py:167",
            "megatron/core/optimizer/clip_grads.py:174"} <= set(placed.served)
    w32.grad = g.clone()
    with pytest.raises(AssertionError):  # upstream's assert, without the shim
        clip_grads.clip_grad_by_total_norm_fp32([w32], max_norm=1.0, total_norm=13.0)
