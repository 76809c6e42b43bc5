"""The ranks of ``example_tp1``: a plain single-process PyTorch trainer at TP 1, on the SDK.

The harness SDK (:mod:`qualify_harness`) reads the frozen inputs, runs the contract's rounds
with its losses and writes every output; this module supplies only what the engine owns
(:class:`PlainEngine`): the Hugging Face model in FP32 on one device, the forward to
per-token log-probs / entropy / values, and ``torch.optim.AdamW`` with transformers' lr
scheduler, which the SDK's :class:`qualify_harness.TorchOptimEngine` steps and reads (at TP 1
each tensor is already whole). Global rank 0 runs the Actor, the next rank the Critic (a cell
with one role has one rank); the roles never communicate: each writes its part, rank 0
merges them. It imports the SDK, torch and transformers only (no ``qualify``), runs in
whichever interpreter the site names (``QUALIFY_LAUNCHER_EXAMPLE_TP1``) and talks to qualify
through files only.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import qualify_harness as sdk
import torch
from torch import Tensor, nn
from torch.distributed.elastic.multiprocessing.errors import record

ENGINE = "example_tp1"
UNSUPPORTED = ("options", "faults", "probe", "resume", "variants", "export_weights")
"""``cell.json`` keys this engine takes no value for (its spec declares none of them)."""


def load(kind: str, path: Path, device: torch.device) -> nn.Module:
    """An HF model in FP32 with SDPA attention and dropout off (``critic``: backbone + score)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cls = AutoModelForTokenClassification if kind == "critic" else AutoModelForCausalLM
    extra = {"num_labels": 1} if kind == "critic" else {}
    model: nn.Module = cls.from_pretrained(str(path), dtype=torch.float32,
                                           attn_implementation="sdpa", **extra)
    model.to(device).eval()
    model.config.use_cache = False
    return model


def scheduler(optimizer: torch.optim.Optimizer, opt: dict[str, Any]) -> Any:
    """The lr scheduler of the contract's ``optimizer.lr_schedule``: HF ``get_scheduler``.

    Raises:
        ValueError: a schedule not mapped here.
    """
    from transformers import get_scheduler

    name, ratio = opt.get("lr_schedule", "constant"), float(opt.get("min_lr_ratio", 0.0))
    warmup, total = int(opt.get("warmup_steps", 0)), int(opt.get("total_steps", 1))
    kind, extra = {"constant": ("constant", None),
                   "linear": ("linear", None) if ratio == 0.0 else ("polynomial", {
                       "power": 1.0, "lr_end": ratio * float(optimizer.defaults["lr"])}),
                   "cosine": ("cosine_with_min_lr", {"min_lr_rate": ratio})}.get(name, ("", None))
    if kind:
        return get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total,
                             scheduler_specific_kwargs=extra)
    raise ValueError(f"contract.json optimizer.lr_schedule {name!r}: not supported by {ENGINE}")


class PlainEngine(sdk.TorchOptimEngine):
    """One role on one rank: an FP32 HF model (BF16 autocast for ``bf16``) and AdamW.

    The update parts (pre-clip gradients, clip, step, applied lr, optimizer state and the
    full tensors by HF name: at TP 1 each is already whole) are
    :class:`qualify_harness.TorchOptimEngine`'s, over :attr:`model`, :attr:`optimizer` and
    :attr:`lr_scheduler`; this class adds the forwards, the dtypes of its gradients and the
    (empty) replica check.
    """

    def __init__(self, model: nn.Module, *, lr: float, inputs: sdk.Inputs, precision: str,
                 rec: sdk.Recorder, device: torch.device) -> None:
        r = inputs.recipe
        self.model, self.rec, self.device, self.precision = model, rec, device, precision
        self.temperature = r.temperature
        self.pad_token_id = int(getattr(model.config, "pad_token_id", None) or 0)
        self.optimizer = torch.optim.AdamW(self.params(), lr=lr, betas=r.betas, eps=r.eps,
                                           weight_decay=r.weight_decay, foreach=False,
                                           fused=False)
        self.lr_scheduler = scheduler(self.optimizer, dict(inputs.contract["optimizer"]))

    def hidden(self, model: nn.Module, batch: sdk.Batch) -> Tensor:
        """Backbone output at positions ``P - 1 + t`` for ``t < R``: ``[b, R, H]``."""
        backbone = getattr(model, str(model.base_model_prefix))
        with (torch.autocast(self.device.type, dtype=torch.bfloat16)
              if self.precision == "bf16" else contextlib.nullcontext()):
            out = backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids, use_cache=False)
        h: Tensor = out.last_hidden_state[:, batch.prompt_len - 1:][:, :batch.response_len]
        return h

    def response_logits(self, model: Any, batch: sdk.Batch) -> Tensor:
        """The Actor's logits on the response window, ``[b, R, V]``, in its compute dtype.

        The SDK records the initial weights' next-token distributions from them.
        """
        logits: Tensor = model.lm_head(self.hidden(model, batch))
        return logits

    def logprobs_and_entropy(self, model: Any, batch: sdk.Batch) -> tuple[Tensor, Tensor]:
        """Log-probs of the responses and entropy under ``softmax(logits / T)``, FP32."""
        logits = self.response_logits(model, batch)
        self.rec.compute_dtypes.add(logits.dtype)
        logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1), entropy

    def values(self, model: Any, batch: sdk.Batch) -> Tensor:
        """The value head on the response window, ``[b, R]`` FP32."""
        v: Tensor = model.score(self.hidden(model, batch))
        self.rec.compute_dtypes.add(v.dtype)
        return v.float().squeeze(-1)

    def engine_dtypes(self) -> tuple[dict[str, set[torch.dtype]], dict[str, set[torch.dtype]]]:
        """No cross-rank reduction (one rank per role); autograd accumulates in ``.grad``."""
        grads = {p.grad.dtype for p in self.params() if p.grad is not None}
        return {"none_one_rank_per_role:param.grad": grads}, {"AccumulateGrad:param.grad": grads}

    def check_replicas(self) -> tuple[dict[str, bool], dict[str, float]]:
        """TP 1: no parameter is replicated across ranks."""
        return {}, {}


def run(cell: dict[str, Any]) -> None:
    """Run this rank's role of ``cell``; rank 0 merges the outputs.

    Raises:
        ValueError: a key of :data:`UNSUPPORTED` set, a TP other than 1, or a rank count that
            is not the cell's.
    """
    t0 = time.perf_counter()
    given = [k for k in UNSUPPORTED if cell.get(k)]
    if given or cell["actor_tp"] > 1 or cell["critic_tp"] > 1:
        raise ValueError(f"cell.json: {ENGINE} runs TP 1 and takes no {given or 'TP > 1'}")
    roles = [r for r in ("actor", "critic") if cell[f"{r}_tp"]]
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world != len(roles):
        raise ValueError(f"WORLD_SIZE {world}, but cell.json runs {roles}")
    role, out = roles[rank], Path(cell["output_dir"])
    cuda = torch.cuda.is_available() and os.environ.get("QUALIFY_DEVICE") != "cpu"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda \
        else torch.device("cpu")
    inputs = sdk.read_inputs(Path(cell["inputs_dir"]))
    torch.manual_seed(int(cell["seed"]))
    rec = sdk.Recorder(role=role, writer=True,
                       sampling=sdk.ParamSampling.from_dict(cell.get("param_sampling")))
    batch, r = inputs.batch.to(device), inputs.recipe
    with rec.timed("total_s"):
        model = load(role, inputs.actor_dir if role == "actor" else inputs.critic_dir, device)
        engine = PlainEngine(model, lr=r.actor_lr if role == "actor" else r.critic_lr,
                             inputs=inputs, precision=cell["precision"], rec=rec, device=device)
        rounds = range(1, r.rounds + 1)
        if role == "actor":
            ref = load("actor", inputs.ref_dir, device).requires_grad_(False)
            meta = sdk.run_actor(engine, model, ref, batch, r, rec=rec, rounds=rounds)
        else:
            meta = sdk.run_critic(engine, model, batch, r, rec=rec, rounds=rounds)
    sdk.write_part(ENGINE, out, role, rec.tensors, sdk.role_meta(
        rec, tp=1, global_ranks=[rank], precision=cell["precision"],
        model_class=type(model).__name__, parallelism={"tp": 1}, dropout="off (eval mode)",
        bf16_mechanism="torch.autocast over FP32 parameters" if cell["precision"] == "bf16"
        else None, **meta))
    if rank == 0:
        head = sdk.outputs_head(engine=ENGINE, cell=cell, world=world, device=device,
                                packages=("torch", "transformers", "qualify-example-engine"),
                                backend="none (the roles never communicate)", shims=[],
                                faults=[], timings={"rank0_total_s": time.perf_counter() - t0})
        sdk.merge_parts(ENGINE, roles, out, head)


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``main([CELL_JSON])``; the exit status (2: usage)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: qualify_example_engine.harness CELL_JSON", file=sys.stderr)
        return 2
    cell = json.loads(Path(args[0]).read_text("utf-8"))
    if cell.get("engine") != ENGINE:
        raise ValueError(f"{args[0]}: engine {cell.get('engine')!r} is not {ENGINE!r}")
    run(cell)
    return 0


if __name__ == "__main__":
    sys.exit(main())
