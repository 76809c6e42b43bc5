"""Why Megatron BF16 (``Float16Module``) entropies differ between TP 1 and TP 2 on CPU.

Finding (issue #15): every sub-module runs in the same dtype at TP 1 and TP 2 (BF16
activations, FP32 softmax inside ``FusedScaleMaskSoftmax``, FP32 RoPE frequencies), and
every module before the first ``RowParallelLinear`` is bit-identical. The first difference
is ``decoder.layers.0.self_attention.linear_proj``: at TP 2 each rank's partial product
``x_r @ W_r^T`` is rounded to BF16 and the two BF16 partials are summed by
``reduce_from_tensor_model_parallel_region`` (an all-reduce in BF16), where TP 1 rounds the
full FP32-accumulated product once. ``linear_fc2`` does the same. That is how megatron-core
0.16.1 executes BF16 TP (not a harness bug); the differences then grow through the layers.
Proof by emulation, both ways:

- TP 1 with its two ``RowParallelLinear`` replaced by "sum of the two half products, each
  rounded to BF16" reproduces TP 2 bit for bit (logits and entropy);
- TP 2 with the partials summed in FP32 and rounded once reproduces TP 1.

Usage (one torchrun launch of 2 gloo ranks on CPU; rank 0 also runs TP 1 and HF)::

    python scripts/repro/megatron_bf16_tp.py                  # tiny synthetic Qwen3, ~30 s CPU
    python scripts/repro/megatron_bf16_tp.py --inputs RUN/inputs   # a harness inputs dir
    python scripts/repro/megatron_bf16_tp.py --json out.json  # also write the numbers

The table lists each Megatron sub-module in execution order: output dtype at TP 1 / TP 2 /
HF BF16 parameters (``Qwen3ForCausalLM.to(bfloat16)``, sdpa, positions 0..T-1 as Megatron),
and the max abs difference of the outputs (TP 2 shards all-gathered to the TP 1 layout;
HF differences over attended positions only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
ROW_PARALLEL = ("self_attention.linear_proj", "mlp.linear_fc2")
# Megatron sub-module suffix -> HF Qwen3 module suffix (same layer index)
HF_NAMES = {
    "embedding": "model.embed_tokens",
    "input_layernorm": "input_layernorm", "self_attention.linear_qkv": None,
    "self_attention.q_layernorm": "self_attn.q_norm",
    "self_attention.k_layernorm": "self_attn.k_norm",
    "self_attention.core_attention": "self_attn.o_proj:input",
    "self_attention.linear_proj": "self_attn.o_proj", "self_attention": "self_attn",
    "pre_mlp_layernorm": "post_attention_layernorm", "mlp.linear_fc1": None,
    "mlp.linear_fc2": "mlp.down_proj", "mlp": "mlp", "": "",
    "decoder.final_layernorm": "model.norm", "output_layer": "lm_head",
}
SKIP = ("dropout", "pre_cross_attn_layernorm", "cross_attention", "rotary_pos_emb",
        "word_embeddings", "scale_mask_softmax")


# --------------------------------------------------------------------------- inputs


def synthetic_inputs(work: Path) -> None:
    """A tiny Qwen3 (2 layers, H 64, 4 heads / 2 KV, head_dim 32, V 384) and 4 x 12 tokens."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=160,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, tie_word_embeddings=False, max_position_embeddings=64,
                      pad_token_id=0)
    torch.manual_seed(5)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the 0.02 init: peaked, BF16-sensitive logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(work / "actor")
    g = torch.Generator().manual_seed(9)
    torch.save({"input_ids": torch.randint(3, 384, (4, 12), generator=g), "P": 4},
               work / "ids.pt")


def load_batch(args: argparse.Namespace) -> tuple[Any, Path, Any]:
    """``(Batch, actor_dir, contract)`` of ``--inputs`` or the synthetic work dir."""
    from harnesses import common
    from qualify.contract import load_contract
    from qualify.resources import contracts_dir

    if args.inputs:
        inp = common.read_inputs(Path(args.inputs))
        return inp.batch, Path(inp.actor_dir), inp.contract
    d = torch.load(Path(args.work) / "ids.pt")
    ids, p = d["input_ids"], d["P"]
    am = torch.ones_like(ids)
    resp = ids[:, p:]
    batch = common.Batch(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(1) - 1),
                         responses=resp, mask=torch.ones_like(resp, dtype=torch.bool),
                         advantages=torch.zeros(resp.shape), returns=torch.zeros(resp.shape),
                         prompt_len=p)
    return batch, Path(args.work) / "actor", load_contract(contracts_dir() / "tiny-qwen3.toml")


# --------------------------------------------------------------------------- worker


def groups_for(ranks: list[int], group: Any, own: Any, rank: int) -> Any:
    """A :class:`harnesses.megatron.model.RoleGroups` with ``tp`` = ``group`` (as role_groups)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from harnesses.megatron import model as mm

    pgc = ProcessGroupCollection()
    for name in ("tp", "mp", "tp_cp", "tp_dp_cp", "tp_ep", "tp_ep_pp", "expt_tp"):
        setattr(pgc, name, group)
    for name in ("pp", "embd", "pos_embd", "cp", "ep", "dp", "dp_cp", "expt_dp",
                 "intra_dp_cp", "intra_expt_dp", "inter_dist_opt", "intra_dist_opt"):
        setattr(pgc, name, own)
    pgc.hcp = [own]
    return mm.RoleGroups(role="actor", ranks=tuple(ranks), tp_rank=ranks.index(rank),
                         pg_collection=pgc)


def gather(name: str, t: torch.Tensor, groups: Any) -> torch.Tensor:
    """A TP-sharded module output, all-gathered into the TP 1 layout (identity at TP 1)."""
    import torch.distributed as dist

    if groups.tp == 1:
        return t
    dim = None  # replicated outputs (norms, row-parallel after their all-reduce, layers)
    last = name.rsplit(".", maxsplit=1)[-1]
    if last in ("linear_qkv", "core_attention", "linear_fc1", "output_layer"):
        dim = -1
    elif last in ("q_layernorm", "k_layernorm"):
        dim = -2
    if dim is None:
        return t
    parts = [torch.empty_like(t) for _ in range(groups.tp)]
    dist.all_gather(parts, t.contiguous(), group=groups.tp_group)
    if last == "linear_fc1":  # rank r holds [gate_r; up_r]; TP 1 is [gate; up]
        halves = [p.chunk(2, dim=-1) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=-1)
    return torch.cat(parts, dim=dim)


def record(model: torch.nn.Module, groups: Any, rec: dict[str, Any]) -> list[Any]:
    """Forward hooks storing each sub-module's output (dtype, FP32 copy in TP 1 layout)."""
    from megatron.core.transformer.identity_op import IdentityOp

    handles = []
    for full, mod in model.named_modules():
        name = full.removeprefix("module.") if full.startswith("module.") else ""
        if not name or isinstance(mod, (IdentityOp, torch.nn.Dropout)) or any(
                s in name for s in SKIP):
            continue

        def hook(_m: Any, _i: Any, out: Any, name: str = name) -> None:
            t = out[0] if isinstance(out, tuple) else out
            rec[name] = (str(t.dtype).removeprefix("torch."),
                         gather(name, t.detach(), groups).float())
        handles.append(mod.register_forward_hook(hook))
    return handles


def split_forward(mod: Any, parts: int) -> Any:
    """TP 1 ``RowParallelLinear`` computed as TP ``parts`` does: BF16 partials, BF16 sum."""
    def forward(input_: torch.Tensor) -> tuple[torch.Tensor, None]:
        k = input_.shape[-1] // parts
        out = [torch.matmul(input_[..., i * k:(i + 1) * k], mod.weight[:, i * k:(i + 1) * k].t())
               for i in range(parts)]
        total = out[0]
        for o in out[1:]:
            total = total + o  # BF16 + BF16, rounded to BF16 (what the gloo all-reduce does)
        return total, None
    return forward


def fp32_reduce_forward(mod: Any, group: Any) -> Any:
    """TP 2 ``RowParallelLinear`` with FP32 partials, FP32 all-reduce, one BF16 rounding."""
    import torch.distributed as dist

    def forward(input_: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.matmul(input_.float(), mod.weight.float().t())
        dist.all_reduce(out, group=group)
        return out.to(input_.dtype), None
    return forward


def patch_row_parallel(model: torch.nn.Module, make: Any) -> int:
    """Replace the forward of every ``RowParallelLinear``; returns how many."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    n = 0
    for mod in model.modules():
        if isinstance(mod, RowParallelLinear):
            mod.forward = make(mod)
            n += 1
    return n


def megatron_pass(groups: Any, model: Any, shape: Any, batch: Any,
                  temperature: float) -> dict[str, Any]:
    """One scored forward with hooks: per-module outputs, logprobs, entropy."""
    from harnesses.megatron import losses, train

    rec: dict[str, Any] = {}
    handles = record(model, groups, rec)
    with torch.no_grad():
        lp, ent = losses.vocab_parallel_logprobs_entropy(
            train.output_window(model, batch), batch.responses, vocab=shape.vocab,
            tp_rank=groups.tp_rank, group=groups.tp_group, temperature=temperature)
    for h in handles:
        h.remove()
    return {"rec": rec, "lp": lp, "ent": ent}


def hf_pass(actor_dir: Path, batch: Any, temperature: float) -> dict[str, Any]:
    """HF BF16 parameters (the reference's ``bf16_mode = params``), positions 0..T-1."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(actor_dir), dtype=torch.float32)
    model = model.to(torch.bfloat16).eval()
    rec: dict[str, Any] = {}
    for name, mod in model.named_modules():
        def hook(_m: Any, inp: Any, out: Any, name: str = name) -> None:
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor):
                rec[name] = (str(t.dtype).removeprefix("torch."), t.detach().float())
            if name.endswith("o_proj"):
                rec[name + ":input"] = (str(inp[0].dtype).removeprefix("torch."),
                                        inp[0].detach().float())
        mod.register_forward_hook(hook)
    b, t = batch.input_ids.shape
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=torch.arange(t).expand(b, t)).logits
    r, p = batch.responses.shape[1], batch.prompt_len
    ls = torch.log_softmax(logits[:, p - 1:p - 1 + r].float() / temperature, dim=-1)
    return {"rec": rec, "lp": ls.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1),
            "ent": -(ls.exp() * ls).sum(-1)}


def hf_name(name: str) -> str | None:
    """The HF module of a Megatron sub-module name, or None."""
    parts = name.split(".")
    if name.startswith("decoder.layers."):
        layer, rest = parts[2], ".".join(parts[3:])
        mapped = HF_NAMES.get(rest)
        if mapped is None:
            return None
        return f"model.layers.{layer}" + (f".{mapped}" if mapped else "")
    return HF_NAMES.get(name)


def to_bth(name: str, t: torch.Tensor) -> torch.Tensor:
    """Megatron ``[T, b, ...]`` -> ``[b, T, ...]`` (HF's layout), flattening head dims."""
    if name == "output_layer" or name.startswith(("embedding", "decoder")):
        t = t.transpose(0, 1)
    return t.reshape(t.shape[0], t.shape[1], -1)


def table(tp1: dict[str, Any], tp2: dict[str, Any], hf: dict[str, Any], valid: torch.Tensor,
          vocab: int) -> list[dict[str, Any]]:
    """Per-module rows (execution order of TP 1)."""
    rows = []
    for name, (d1, t1) in tp1["rec"].items():
        d2, t2 = tp2["rec"][name]
        a, b = to_bth(name, t1), to_bth(name, t2)
        if name == "output_layer":
            a, b = a[..., :vocab], b[..., :vocab]
        row: dict[str, Any] = {"module": name, "tp1": d1, "tp2": d2,
                               "tp1_vs_tp2": float((a - b).abs().max())}
        hn = hf_name(name)
        if hn is not None and hn in hf["rec"]:
            dh, th = hf["rec"][hn]
            h = th.reshape(th.shape[0], th.shape[1], -1)
            row["hf"] = dh
            row["tp1_vs_hf"] = float((a - h).abs()[valid].max())
            row["tp2_vs_hf"] = float((b - h).abs()[valid].max())
        rows.append(row)
    return rows


def worker(args: argparse.Namespace) -> None:
    """Rank 0 and 1: TP 2 (+ FP32-reduce variant); rank 0 also TP 1 (+ split) and HF."""
    import torch.distributed as dist

    from harnesses.megatron import harness
    from harnesses.megatron import model as mm

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    both = dist.new_group([0, 1])
    singles = [dist.new_group([0]), dist.new_group([1])]
    mm.apply_group_shims()
    mm.apply_cpu_shims()
    batch, actor_dir, contract = load_batch(args)

    def groups_of(tp: int) -> Any:
        return (groups_for([0, 1], both, singles[rank], rank) if tp == 2
                else groups_for([rank], singles[rank], singles[rank], rank))

    cpu, temp = torch.device("cpu"), contract.sampling.temperature
    res: dict[str, Any] = {}
    if rank == 0:
        g1 = groups_of(1)
        model1, shape, _ = harness.build(actor_dir, "lm", g1, bf16=True, device=cpu)
        res["tp1"] = megatron_pass(g1, model1, shape, batch, temp)
        assert patch_row_parallel(model1, lambda m: split_forward(m, 2)) == 2 * shape.num_layers
        res["tp1_split"] = megatron_pass(g1, model1, shape, batch, temp)
    g2 = groups_of(2)
    model2, shape, _ = harness.build(actor_dir, "lm", g2, bf16=True, device=cpu)
    res["tp2"] = megatron_pass(g2, model2, shape, batch, temp)
    patch_row_parallel(model2, lambda m: fp32_reduce_forward(m, both))
    res["tp2_fp32_reduce"] = megatron_pass(g2, model2, shape, batch, temp)
    if rank == 0:
        res["hf"] = hf_pass(actor_dir, batch, contract.sampling.temperature)
        if os.environ.get("REPRO_DUMP"):
            torch.save({"res": res, "batch": batch, "vocab": shape.vocab}, os.environ["REPRO_DUMP"])
        report(res, batch, shape.vocab, args)
    dist.destroy_process_group()


def report(res: dict[str, Any], batch: Any, vocab: int, args: argparse.Namespace) -> None:
    """Print the per-module table and the entropy summary; write ``--json``."""
    valid = batch.attention_mask.bool()
    rows = table(res["tp1"], res["tp2"], res["hf"], valid, vocab)
    f = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
    print(f"{'module':42s} {'dtype tp1/tp2/hf':26s} {'|tp1-tp2|':>9s} {'|tp1-hf|':>9s} "
          f"{'|tp2-hf|':>9s}")
    for r in rows:
        dt = f"{r['tp1']}/{r['tp2']}/{r.get('hf', '-')}"
        print(f"{r['module']:42s} {dt:26s} {f(r['tp1_vs_tp2']):>9s} "
              f"{f(r.get('tp1_vs_hf')):>9s} {f(r.get('tp2_vs_hf')):>9s}")
    first = next((r["module"] for r in rows if r["tp1_vs_tp2"] > 0), None)
    mask = batch.mask
    ent = {k: v["ent"] for k, v in res.items()}
    lp = {k: v["lp"] for k, v in res.items()}

    def dmax(a: dict[str, torch.Tensor], x: str, y: str) -> float:
        return float((a[x] - a[y]).abs()[mask].max())

    pairs = [("tp1", "tp2"), ("tp1_split", "tp2"), ("tp2_fp32_reduce", "tp1"),
             ("tp1", "hf"), ("tp2", "hf")]
    summary = {f"{x}_vs_{y}": {"entropy": dmax(ent, x, y), "logprobs": dmax(lp, x, y)}
               for x, y in pairs}
    def logits(key: str) -> torch.Tensor:
        return res[key]["rec"]["output_layer"][1][..., :vocab]

    summary["tp1_split_vs_tp2"]["logits"] = float((logits("tp1_split") - logits("tp2")).abs().max())
    summary["tp2_fp32_reduce_vs_tp1"]["logits"] = float(
        (logits("tp2_fp32_reduce") - logits("tp1")).abs().max())
    print(f"\nfirst sub-module whose output differs between TP 1 and TP 2: {first}")
    print("dtypes differing between TP 1 and TP 2:",
          [r["module"] for r in rows if r["tp1"] != r["tp2"]] or "none")
    print(f"max |diff| over {int(mask.sum())} response tokens: entropy, logprobs (, logits)")
    for k, v in summary.items():
        print(f"  {k:24s} " + "  ".join(f"{v[m]:.4g}" for m in ("entropy", "logprobs",
                                                                  "logits") if m in v))
    tokens = [(5, 1), (1, 2), (3, 1)] if args.inputs else []
    for i, j in tokens:
        print(f"  entropy ({i},{j}): " + "  ".join(f"{k} {float(v[i, j]):.4f}"
                                                   for k, v in ent.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "rows": rows, "first_difference": first, "summary": summary}, indent=1),
            "utf-8")


# --------------------------------------------------------------------------- main


def main() -> int:
    """Prepare inputs and launch the 2-rank worker under torchrun (or be the worker)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs", help="harness inputs dir (rollout, contract, model.json)")
    ap.add_argument("--json", help="write the table and summary here")
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not args.inputs:
            synthetic_inputs(work)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", "2", str(Path(__file__).resolve()), "--worker",
               "--work", str(work)]
        cmd += ["--inputs", str(Path(args.inputs).resolve())] if args.inputs else []
        cmd += ["--json", str(Path(args.json).resolve())] if args.json else []
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore",
               "OMP_NUM_THREADS": "1"}
        return subprocess.run(cmd, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
