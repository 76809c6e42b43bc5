"""DeepSpeed harness: ``python -m harnesses.deepspeed.harness CELL_JSON`` under torchrun.

Runs the PPO update of :mod:`qualify.protocol` with ``deepspeed.initialize`` engines
driving Hugging Face models: the engine's own forward, ``engine.backward``,
``engine.step`` (gradient accumulation, global-norm clipping, ``torch.optim.AdamW``
through ``"torch_adam": true``), ZeRO stage 0 / 1 / 2, BF16 with FP32 master weights, and
AutoTP tensor parallelism (``tensor_parallel.autotp_size``). The PPO / value losses are this
harness's own (:mod:`harnesses.deepspeed.losses`).

Reads only ``cell.json`` and, from ``inputs_dir``: ``rollout.safetensors``,
``train_inputs.safetensors``, ``contract.json`` and ``model.json`` (never reference
scores). Ranks ``[0, actor_tp)`` run the Actor, the next ``critic_tp`` ranks the Critic,
each role in its own TP group (:mod:`harnesses.deepspeed.parallelize`).

Process-group reuse: a cell with ``variants`` runs every ``(precision, options)`` variant
in order inside the same processes (one ``init_process_group``, one set of groups, fresh
models and engines per variant) and writes variant ``v`` to
``output_dir / variant_tag(v)``; without variants the single variant goes to
``output_dir``. A variant that raises ends the launch with a non-zero exit (the variants
before it keep their outputs).

What is reported is what the engine did: its own pre-clip gradient norm
(``engine.get_global_grad_norm()``; where it returns ``None`` the L2 norm of the engine's
gradient buffers measured by the harness, labelled so), its gradient buffers, FP32 master
weights and AdamW state read through DeepSpeed's APIs and gathered to the HF layout
(:mod:`harnesses.deepspeed.state_dict_adapter`). DeepSpeed exposes no clip coefficient:
the one reported is measured from the engine's own state, the ``c`` with
``exp_avg_r - β1·exp_avg_{r-1} = (1 - β1)·c·g_r`` (least squares over every element,
FP64), which is the factor the engine applied to the gradients it stepped with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.metadata
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.elastic.multiprocessing.errors import record
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
from transformers.utils import logging as hf_logging

from harnesses.deepspeed import losses, parallelize
from harnesses.deepspeed import state_dict_adapter as sda
from qualify.contract import Contract
from qualify.errors import HarnessError
from qualify.protocol import (
    CELL_FILE,
    EXTRA_RIGHT_PADDING,
    OUTPUTS_FILE,
    OUTPUTS_META_FILE,
    ROLLOUT_FILE,
    ROLLOUT_KEYS,
    TRAIN_INPUT_KEYS,
    TRAIN_INPUTS_FILE,
    HarnessCell,
    param_sample_indices,
    tensor_name,
)

ENGINE: Final = "deepspeed"
CONTRACT_JSON: Final = "contract.json"
MODEL_JSON: Final = "model.json"
PART_WAIT_S: Final = 24 * 3600.0
"""Upper bound of rank 0's wait for the other role's part (torchrun ends the job first
when a rank fails; the launcher's wall-clock timeout ends a stuck one)."""
GRAD_NORM_ENGINE: Final = "engine.get_global_grad_norm() after the step (pre-clip)"
GRAD_NORM_MEASURED: Final = ("harness-measured: L2 norm of the engine's gradient buffers "
                             "(deepspeed.utils.safe_get_full_grad, gathered, each parameter "
                             "once, FP64) before engine.step(); "
                             "engine.get_global_grad_norm() returned None")
CLIP_COEF_MEASURED: Final = ("harness-measured: DeepSpeed exposes no clip coefficient; c = "
                             "<exp_avg_r - beta1*exp_avg_{r-1}, g_r> / ((1 - beta1) <g_r, g_r>) "
                             "over every parameter (FP64), from the engine's own AdamW state and "
                             "pre-step gradient buffers")
OPTIONS: Final = frozenset({"zero"})


# --------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """Rollout rows as the engine consumes them (``b`` rows, ``T = P + R`` columns).

    Attributes:
        input_ids: ``[b, T]`` int64, prompt (left-padded) then response (right-padded).
        attention_mask: ``[b, T]`` int64.
        position_ids: ``[b, T]`` int64.
        responses: ``[b, R]`` int64 target tokens.
        mask: ``[b, R]`` bool, response tokens that count in losses.
        advantages: ``[b, R]`` FP32.
        returns: ``[b, R]`` FP32.
        prompt_len: ``P``.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    responses: Tensor
    mask: Tensor
    advantages: Tensor
    returns: Tensor
    prompt_len: int

    @property
    def response_len(self) -> int:
        """``R``."""
        return int(self.responses.shape[1])

    def rows(self, s: slice) -> Batch:
        """The sub-batch of rows ``s``."""
        return dataclasses.replace(
            self, input_ids=self.input_ids[s], attention_mask=self.attention_mask[s],
            position_ids=self.position_ids[s], responses=self.responses[s], mask=self.mask[s],
            advantages=self.advantages[s], returns=self.returns[s])

    def right_padded(self, extra: int, pad_token_id: int) -> Batch:
        """``extra`` more pad columns on the right (attention 0), for padding invariance.

        The response window is unchanged; positions follow ``clamp(cumsum(mask) - 1, 0)``.
        """
        b = self.input_ids.shape[0]
        ids = torch.cat([self.input_ids, self.input_ids.new_full((b, extra), pad_token_id)], 1)
        am = torch.cat([self.attention_mask, self.attention_mask.new_zeros((b, extra))], 1)
        pos = torch.clamp(torch.cumsum(am, dim=1) - 1, min=0)
        return dataclasses.replace(self, input_ids=ids, attention_mask=am, position_ids=pos)

    def to(self, device: torch.device) -> Batch:
        """The batch on ``device``."""
        return dataclasses.replace(
            self, **{f.name: getattr(self, f.name).to(device)
                     for f in dataclasses.fields(self) if f.name != "prompt_len"})

    def window(self) -> Tensor:
        """``[R]`` int64 sequence positions ``P - 1 + t`` whose outputs score token ``t``."""
        start = self.prompt_len - 1
        return torch.arange(start, start + self.response_len, device=self.input_ids.device)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Inputs:
    """What the harness reads from ``inputs_dir`` (and nothing else).

    Attributes:
        batch: the rollout with the training inputs.
        contract: the contract (``contract.json``).
        actor_dir, critic_dir, ref_dir: HF model directories (``model.json``).
    """

    batch: Batch
    contract: Contract
    actor_dir: Path
    critic_dir: Path
    ref_dir: Path


def read_inputs(inputs_dir: Path) -> Inputs:
    """Load the frozen rollout, training inputs, contract and model paths.

    Raises:
        HarnessError: a file or tensor is missing, or shapes disagree.
        ContractError: ``contract.json`` fails validation.
    """
    for name in (ROLLOUT_FILE, TRAIN_INPUTS_FILE, CONTRACT_JSON, MODEL_JSON):
        if not (inputs_dir / name).is_file():
            raise HarnessError(f"{inputs_dir / name}: missing harness input")
    rollout = load_file(str(inputs_dir / ROLLOUT_FILE))
    train = load_file(str(inputs_dir / TRAIN_INPUTS_FILE))
    for file, tensors, keys in ((ROLLOUT_FILE, rollout, ROLLOUT_KEYS),
                                (TRAIN_INPUTS_FILE, train, TRAIN_INPUT_KEYS)):
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise HarnessError(f"{inputs_dir / file}: missing tensors {missing}")
    contract = Contract.from_dict(json.loads((inputs_dir / CONTRACT_JSON).read_text("utf-8")))
    models = json.loads((inputs_dir / MODEL_JSON).read_text("utf-8"))
    prompts, responses = rollout["prompts"], rollout["responses"]
    b, p = prompts.shape
    r = responses.shape[1]
    for key, shape in (("attention_mask", (b, p + r)), ("position_ids", (b, p + r)),
                       ("response_mask", (b, r))):
        if tuple(rollout[key].shape) != shape:
            raise HarnessError(f"{ROLLOUT_FILE}: {key} has shape {tuple(rollout[key].shape)}, "
                               f"expected {shape}")
    for key in TRAIN_INPUT_KEYS:
        if tuple(train[key].shape) != (b, r):
            raise HarnessError(f"{TRAIN_INPUTS_FILE}: {key} has shape "
                               f"{tuple(train[key].shape)}, expected {(b, r)}")
    batch = Batch(
        input_ids=torch.cat([prompts, responses], dim=1).long(),
        attention_mask=rollout["attention_mask"].long(),
        position_ids=rollout["position_ids"].long(),
        responses=responses.long(),
        mask=rollout["response_mask"].bool(),
        advantages=train["advantages"].float(),
        returns=train["returns"].float(),
        prompt_len=int(p),
    )
    try:
        dirs = {k: Path(models[k]) for k in ("actor_dir", "critic_dir")}
    except KeyError as exc:
        raise HarnessError(f"{inputs_dir / MODEL_JSON}: missing {exc.args[0]!r}") from None
    return Inputs(batch=batch, contract=contract, actor_dir=dirs["actor_dir"],
                  critic_dir=dirs["critic_dir"],
                  ref_dir=Path(models.get("ref_dir", models["actor_dir"])))


# --------------------------------------------------------------------------- models


def load_model(kind: str, path: Path, device: torch.device) -> nn.Module:
    """Load an HF model in FP32 with SDPA attention, dropout off (``eval()`` mode).

    Args:
        kind: ``causal_lm`` (actor, reference policy) or ``value`` (critic:
            ``AutoModelForTokenClassification``, ``num_labels=1``: backbone + ``score``).
        path: HF directory.
        device: where the model lives.

    Raises:
        HarnessError: the directory does not exist.
    """
    hf_logging.disable_progress_bar()
    if not path.is_dir():
        raise HarnessError(f"{path}: model directory not found")
    kw: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if kind == "value":
        model = AutoModelForTokenClassification.from_pretrained(str(path), num_labels=1, **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    model.to(device)
    model.eval()  # dropout off; autograd is unaffected by eval mode
    model.config.use_cache = False
    return model


SNAPSHOT_MAX_ELEMENTS: Final = 50_000_000
"""Largest model whose FP32 checkpoint values are kept to check the engine's initial masters."""


def snapshot(model: nn.Module) -> dict[str, Tensor] | None:
    """CPU FP32 copy of every trainable parameter (``None`` above the size limit).

    Taken before ``deepspeed.initialize`` (which casts the module to BF16 in place for
    ``bf16`` and builds the FP32 masters from it).
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if sum(p.numel() for _, p in params) > SNAPSHOT_MAX_ELEMENTS:
        return None
    return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in params}


def micro_slices(n: int, size: int) -> list[slice]:
    """Row slices of at most ``size`` sequences, in order."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _pad_token_id(model: nn.Module) -> int:
    pad = getattr(model.config, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def _as_float(x: Any) -> float | None:
    """A grad norm as DeepSpeed returns it (float, 0-d tensor or ``None``) as a float."""
    if x is None:
        return None
    return float(x.item()) if isinstance(x, Tensor) else float(x)


# --------------------------------------------------------------------------- one variant


@dataclasses.dataclass(kw_only=True)
class VariantRun:
    """One role x one variant on one rank: a fresh model and engine, and what it reports.

    Attributes:
        cell: the launch's cell.
        precision: the variant's precision.
        zero: the variant's ZeRO stage.
        rank: global rank.
        placement: the role's groups.
        inputs: the harness inputs.
        device: compute device.
        tensors: protocol name -> FP32 CPU tensor (kept on the writer rank only).
        timings: wall seconds per phase.
    """

    cell: HarnessCell
    precision: str
    zero: int
    rank: int
    placement: parallelize.Placement
    inputs: Inputs
    device: torch.device
    tensors: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    compute_dtypes: set[torch.dtype] = dataclasses.field(default_factory=set)
    master_dtypes: set[torch.dtype] = dataclasses.field(default_factory=set)
    grad_dtypes: set[torch.dtype] = dataclasses.field(default_factory=set)
    state_dtypes: dict[str, set[torch.dtype]] = dataclasses.field(
        default_factory=lambda: {"exp_avg": set(), "exp_avg_sq": set()})
    replica_rounds: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    replica_params: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    grad_norms: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    shims: list[str] = dataclasses.field(default_factory=list)
    engine_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    _prev_exp_avg: dict[str, Tensor] = dataclasses.field(default_factory=dict)

    @property
    def role(self) -> str:
        """``actor`` or ``critic``."""
        return self.placement.role

    @property
    def writer(self) -> bool:
        """TP rank 0 keeps and writes the role's tensors."""
        return self.placement.tp_rank == 0

    def put(self, round_: int, metric: str, value: Tensor, param: str | None = None) -> None:
        """Keep ``value`` (FP32, CPU) under its protocol name on the writer rank.

        Per-parameter tensors of large parameters are reported at the protocol's seeded
        sample of elements (:func:`qualify.protocol.param_sample_indices`).
        """
        if self.writer:
            out = value.detach().to("cpu", torch.float32)
            idx = param_sample_indices(param, out.numel()) if param is not None else None
            if idx is not None:
                out = out.reshape(-1)[torch.from_numpy(idx)]
            self.tensors[tensor_name(round_, self.role, metric, param)] = out.contiguous()

    @contextlib.contextmanager
    def timed(self, key: str) -> Iterator[None]:
        """Record the wall time of the block under ``key``."""
        t0 = time.perf_counter()
        yield
        self.timings[key] = round(time.perf_counter() - t0, 4)

    # ----------------------------------------------------------------- engine

    def build_engine(self, model: nn.Module, lr: float, n_micro: int) -> Any:
        """``deepspeed.initialize`` on ``model`` with this variant's config, role groups.

        Raises:
            HarnessError: AutoTP could not shard the model for this TP size.
        """
        import deepspeed
        from deepspeed.utils import groups

        c = self.inputs.contract
        o = c.optimizer
        cfg = parallelize.ds_config(
            precision=self.precision, zero=self.zero, tp=self.placement.tp,
            micro_batch_size=c.algorithm.micro_batch_size, n_micro=n_micro, lr=lr,
            betas=(float(o.betas[0]), float(o.betas[1])), eps=o.eps,
            weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm)
        mpu = parallelize.install_role_groups(self.placement)
        engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, mpu=mpu)
        hook = getattr(engine, "first_dataloader_check", None)
        src = groups.get_tensor_model_parallel_src_rank() if self.placement.tp > 1 else None
        if hook is not None and src is not None and src != self.placement.ranks[0]:
            # DeepSpeed's AutoTP input check broadcasts from (rank // tp) * tp, a rank
            # outside a TP group that does not start at a multiple of tp: it cannot run.
            hook.remove()
            engine.first_dataloader_check = None
            self.shims.append(
                f"AutoTP first_dataloader_check forward pre-hook removed: its broadcast source "
                f"groups.get_tensor_model_parallel_src_rank() = {src} (rank // tp * tp) is not "
                f"in the role's TP group {list(self.placement.ranks)}; every rank reads the "
                f"same rollout file")
        model_dtype, accum_dtype = engine.get_data_types()
        self.engine_info.update({
            "deepspeed_config": cfg,
            "optimizer_wrapper": type(engine.optimizer).__name__,
            "basic_optimizer": type(getattr(engine, "basic_optimizer", None)
                                    or engine.optimizer).__name__,
            "zero_stage": int(engine.zero_optimization_stage()),
            "autotp_size": int(engine.autotp_size()),
            "model_dtype": str(model_dtype),
            "grad_accum_dtype": str(accum_dtype),
            "gradient_accumulation_steps": int(engine.gradient_accumulation_steps()),
            "loss_scaling": "engine.backward(loss, scale_wrt_gas=False): each micro-batch "
                            "loss is sum / N (global valid tokens), not divided by GAS",
            "forward": "engine(...) (DeepSpeedEngine.forward on the HF model)",
            "pid": os.getpid(),
        })
        return engine

    def check_initial_masters(self, et: sda.EngineTensors,
                              ckpt: dict[str, Tensor] | None) -> None:
        """Compare the engine's FP32 masters before the first step with the checkpoint.

        Collective over the role's TP group (gathers). Records the worst absolute
        difference and whether the masters equal the BF16-rounded checkpoint.
        """
        masters = et.full_masters()
        if ckpt is None:
            self.engine_info["initial_master_vs_checkpoint"] = {
                "measured": False, "why": f"model above {SNAPSHOT_MAX_ELEMENTS} elements"}
            return
        worst, where, bf16_equal = 0.0, "", True
        for name, m in masters.items():
            ref = ckpt[name]
            d = float((m - ref).abs().max()) if m.numel() else 0.0
            if d > worst:
                worst, where = d, name
            bf16_equal = bf16_equal and torch.equal(m, ref.to(torch.bfloat16).float())
        self.engine_info["initial_master_vs_checkpoint"] = {
            "measured": True, "max_abs": worst, "param": where,
            "equals_bf16_rounded_checkpoint": bf16_equal}

    def boundary_step(self, round_: int, engine: Any, et: sda.EngineTensors) -> None:
        """Record grads and masters, ``engine.step()``, then norm, clip, state, updates.

        Called at the accumulation boundary (after the last micro-batch's backward).
        Collective over the role's TP group (gathers).
        """
        grads = et.full_grads()
        self.grad_dtypes |= et.grad_dtypes()
        before = et.full_masters()
        measured = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
        engine.step()
        engine_norm = _as_float(engine.get_global_grad_norm())
        norm = engine_norm if engine_norm is not None else measured
        self.grad_norms.append({"round": round_, "source": GRAD_NORM_ENGINE
                                if engine_norm is not None else GRAD_NORM_MEASURED,
                                "engine": engine_norm, "harness_measured": measured})
        for name, g in grads.items():
            self.put(round_, "grads", g, name)
        self.put(round_, "grad_norm", torch.tensor(norm, dtype=torch.float32))
        state = {key: et.full_state(key) for key in ("exp_avg", "exp_avg_sq")}
        after = et.full_masters()
        for key, dtypes in et.dtypes().items():
            (self.master_dtypes if key == "master" else self.state_dtypes[key]).update(dtypes)
        beta1 = float(self.inputs.contract.optimizer.betas[0])
        num = den = 0.0
        for name, g in grads.items():
            m = state["exp_avg"][name].double()
            prev = self._prev_exp_avg.get(name)
            delta = m - beta1 * prev.double() if prev is not None else m
            gd = g.double()
            num += float((delta * gd).sum())
            den += (1.0 - beta1) * float(gd.square().sum())
        if den <= 0.0:
            raise HarnessError(f"round {round_}: every gradient is zero; no clip coefficient")
        self.put(round_, "clip_coef", torch.tensor(num / den, dtype=torch.float32))
        self._prev_exp_avg = state["exp_avg"]
        for key, tensors in state.items():
            for name, t in tensors.items():
                self.put(round_, key, t, name)
        for name, a in after.items():
            self.put(round_, "updates", a - before[name], name)
        self.check_replicas(round_, engine, et)

    def check_replicas(self, round_: int, engine: Any, et: sda.EngineTensors) -> None:
        """Compare every replicated parameter (FP32 master and module copy) across TP ranks.

        Bitwise on the FP32 bit patterns; one ``all_gather`` over the role's TP group.
        """
        del engine
        reps = [pl for pl in et.layout if pl.dim is None]
        if self.placement.tp == 1 or not reps:
            equal = {pl.name: True for pl in reps}
            diff = {pl.name: 0.0 for pl in reps}
        else:
            local = []
            for pl in reps:
                local.append(et.local_master(pl.name).detach().float().reshape(-1))
                local.append(et.params[pl.name].detach().float().reshape(-1))
            flat = torch.cat(local)
            gathered = [torch.empty_like(flat) for _ in range(self.placement.tp)]
            dist.all_gather(gathered, flat, group=self.placement.tp_group)
            base = gathered[0]
            equal, diff = {}, {}
            offset = 0
            for pl in reps:
                n = 2 * et.params[pl.name].numel()
                sl = slice(offset, offset + n)
                offset += n
                bits = base[sl].view(torch.int32)
                equal[pl.name] = all(torch.equal(g[sl].view(torch.int32), bits)
                                     for g in gathered[1:])
                diff[pl.name] = max(float((g[sl] - base[sl]).abs().max()) if n else 0.0
                                    for g in gathered[1:])
        self.replica_rounds.append({"round": round_, "all_equal": all(equal.values()),
                                    "max_abs_diff": max(diff.values(), default=0.0)})
        for name, eq in equal.items():
            entry = self.replica_params.setdefault(name, {"equal": True, "max_abs_diff": 0.0})
            entry["equal"] = bool(entry["equal"] and eq)
            entry["max_abs_diff"] = max(float(entry["max_abs_diff"]), diff[name])

    def run_rounds(self, engine: Any, et: sda.EngineTensors, slices: list[slice],
                   micro_loss: Any) -> None:
        """Rounds 1..rounds of forward, loss, ``engine.backward`` and ``engine.step``.

        ``engine.step`` inside the accumulation window only counts the micro-batch; at the
        boundary :meth:`boundary_step` records around the real step. ``micro_loss(r, s)``
        returns the loss of rows ``s`` (0-d FP32, sum / N); ``micro_loss(r, None)`` ends
        round ``r`` (stores the per-token outputs).
        """
        for round_ in range(1, self.inputs.contract.algorithm.rounds + 1):
            with self.timed(f"round{round_}_s"):
                for s in slices:
                    loss = micro_loss(round_, s)
                    engine.backward(loss, scale_wrt_gas=False)
                    if engine.is_gradient_accumulation_boundary():
                        self.boundary_step(round_, engine, et)
                    else:
                        engine.step()
                micro_loss(round_, None)  # round done: store per-token outputs

    # ----------------------------------------------------------------- actor

    def actor_scores(self, model: Any, batch: Batch) -> tuple[Tensor, Tensor]:
        """Log-probs and entropy ``[b, R]`` FP32 of ``batch.responses`` under ``model``."""
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False,
                    logits_to_keep=batch.window())
        logits = out.logits  # [b, R, V], gathered over the TP group by AutoTP's lm_head
        self.compute_dtypes.add(logits.dtype)
        return losses.token_logprobs_and_entropy(logits, batch.responses,
                                                 self.inputs.contract.sampling.temperature)

    def run_actor(self) -> dict[str, Any]:
        """The Actor: reference log-probs, padded rerun, rounds; returns the role meta."""
        c = self.inputs.contract
        alg = c.algorithm
        batch = self.inputs.batch.to(self.device)
        slices = micro_slices(batch.input_ids.shape[0], alg.micro_batch_size)
        n_valid = float(batch.mask.sum())
        b, r_len = batch.responses.shape
        with self.timed("load_s"):
            model = load_model("causal_lm", self.inputs.actor_dir, self.device)
            ref = load_model("causal_lm", self.inputs.ref_dir, self.device)
            ref.requires_grad_(False)
            if self.precision == "bf16":
                ref.to(torch.bfloat16)
        pad_id = _pad_token_id(model)
        ckpt = snapshot(model)
        with self.timed("initialize_s"):
            engine = self.build_engine(model, c.optimizer.actor_lr, len(slices))
            et = sda.EngineTensors(engine, parallelize.tp_layout(engine.module))
        self.check_initial_masters(et, ckpt)
        del ckpt
        with self.timed("scoring_s"), torch.no_grad():
            ref_lp = torch.zeros(b, r_len, device=self.device)
            padded = torch.zeros(b, r_len, device=self.device)
            for s in slices:
                ref_lp[s] = self.actor_scores(ref, batch.rows(s))[0]
                padded[s] = self.actor_scores(
                    engine, batch.rows(s).right_padded(EXTRA_RIGHT_PADDING, pad_id))[0]
            self.put(1, "logprobs_padded", torch.where(batch.mask, padded, 0.0))
        del ref
        old_lp = torch.zeros(b, r_len, device=self.device)
        lp_r = torch.zeros(b, r_len, device=self.device)
        ent_r = torch.zeros(b, r_len, device=self.device)
        sums = {"policy": 0.0, "kl": 0.0, "entropy": 0.0}

        def micro_loss(round_: int, s: slice | None) -> Tensor:
            nonlocal old_lp, lp_r, ent_r, sums
            if s is None:  # end of the round
                if round_ == 1:
                    old_lp = lp_r.clone()
                self.put(round_, "logprobs", lp_r)
                self.put(round_, "entropy", ent_r)
                for term, v in sums.items():
                    self.put(round_, f"loss/{term}", torch.tensor(v))
                self.put(round_, "loss/total", torch.tensor(sum(sums.values())))
                lp_r, ent_r = torch.zeros_like(lp_r), torch.zeros_like(ent_r)
                sums = dict.fromkeys(sums, 0.0)
                return torch.zeros(())
            mb = batch.rows(s)
            lp, ent = self.actor_scores(engine, mb)
            old = lp.detach() if round_ == 1 else old_lp[s]
            policy = losses.policy_loss_sum(lp, old, mb.advantages, mb.mask,
                                            alg.clip_ratio) / n_valid
            kl = alg.kl_loss_coef * losses.masked_sum(
                losses.kl_penalty(lp, ref_lp[s], alg.kl_loss_estimator), mb.mask) / n_valid
            entropy = -alg.entropy_coef * losses.masked_sum(ent, mb.mask) / n_valid
            sums["policy"] += float(policy.detach())
            sums["kl"] += float(kl.detach())
            sums["entropy"] += float(entropy.detach())
            lp_r[s] = torch.where(mb.mask, lp.detach(), 0.0)
            ent_r[s] = torch.where(mb.mask, ent.detach(), 0.0)
            total: Tensor = policy + kl + entropy
            return total

        self.run_rounds(engine, et, slices, micro_loss)
        meta = self.role_meta(engine, et, n_valid, len(slices))
        _destroy(engine)
        return meta

    # ----------------------------------------------------------------- critic

    def critic_values(self, model: Any, batch: Batch) -> Tensor:
        """Values ``V(s_t)`` ``[b, R]`` FP32 (``score`` head on the response window)."""
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False)
        v = out.logits[:, batch.window()]  # [b, R, 1]
        self.compute_dtypes.add(v.dtype)
        values: Tensor = v.float().squeeze(-1)
        return values

    def run_critic(self) -> dict[str, Any]:
        """The Critic: padded rerun, rounds; returns the role meta."""
        c = self.inputs.contract
        alg = c.algorithm
        batch = self.inputs.batch.to(self.device)
        slices = micro_slices(batch.input_ids.shape[0], alg.micro_batch_size)
        n_valid = float(batch.mask.sum())
        b, r_len = batch.responses.shape
        with self.timed("load_s"):
            model = load_model("value", self.inputs.critic_dir, self.device)
        pad_id = _pad_token_id(model)
        ckpt = snapshot(model)
        with self.timed("initialize_s"):
            engine = self.build_engine(model, c.optimizer.critic_lr, len(slices))
            et = sda.EngineTensors(engine, parallelize.tp_layout(engine.module))
        self.check_initial_masters(et, ckpt)
        del ckpt
        with self.timed("scoring_s"), torch.no_grad():
            padded = torch.zeros(b, r_len, device=self.device)
            for s in slices:
                padded[s] = self.critic_values(
                    engine, batch.rows(s).right_padded(EXTRA_RIGHT_PADDING, pad_id))
            self.put(1, "values_padded", torch.where(batch.mask, padded, 0.0))
        old_v = torch.zeros(b, r_len, device=self.device)
        v_r = torch.zeros(b, r_len, device=self.device)
        total = 0.0

        def micro_loss(round_: int, s: slice | None) -> Tensor:
            nonlocal old_v, v_r, total
            if s is None:
                if round_ == 1:
                    old_v = v_r.clone()
                self.put(round_, "values", v_r)
                self.put(round_, "loss/value", torch.tensor(total))
                self.put(round_, "loss/total", torch.tensor(total))
                v_r, total = torch.zeros_like(v_r), 0.0
                return torch.zeros(())
            mb = batch.rows(s)
            values = self.critic_values(engine, mb)
            old = values.detach() if round_ == 1 else old_v[s]
            loss = losses.value_loss_sum(values, old, mb.returns, mb.mask,
                                         alg.value_clip) / n_valid
            total += float(loss.detach())
            v_r[s] = torch.where(mb.mask, values.detach(), 0.0)
            return loss

        self.run_rounds(engine, et, slices, micro_loss)
        meta = self.role_meta(engine, et, n_valid, len(slices))
        _destroy(engine)
        return meta

    # ----------------------------------------------------------------- meta

    def role_meta(self, engine: Any, et: sda.EngineTensors, n_valid: float,
                  n_micro: int) -> dict[str, Any]:
        """The role's part of ``outputs.json`` (merged under ``roles.<role>``)."""
        del engine
        sharded = [pl.name for pl in et.layout if pl.dim is not None]
        replicated = [pl.name for pl in et.layout if pl.dim is None]
        info = dict(self.engine_info)
        info.update({
            "grad_norm": {"reported": self.grad_norms[0]["source"] if self.grad_norms else None,
                          "rounds": self.grad_norms},
            "clip_coef": CLIP_COEF_MEASURED,
            "apis": {k: sorted(v) for k, v in et.sources.items()},
            "tp_gather": sda.API_TP_GATHER if sharded else None,
            "shard_dims": {pl.name: pl.dim for pl in et.layout if pl.dim is not None},
            "reference_policy": ("frozen HF model outside DeepSpeed, replicated on each TP "
                                 "rank, in the engine's module dtype"),
            "shims": list(self.shims),
        })
        return {
            "tp": self.placement.tp,
            "global_ranks": list(self.placement.ranks),
            "model_class": type(et.engine.module).__name__,
            "parallelism": {
                "mesh_dim_names": ["tp"],
                "lm_head": ("vocab_parallel" if "lm_head.weight" in sharded else
                            "replicated" if self.role == "actor" else None),
                "sharded_params": sharded,
                "replicated_params": replicated,
                "partial_grads_reduced": [],
            },
            "precision": self.precision,
            "bf16_mechanism": (f"DeepSpeed bf16.enabled: module parameters cast to BF16 "
                               f"(BF16 compute), FP32 master weights and AdamW state in "
                               f"{info['optimizer_wrapper']}; gradient accumulation in "
                               f"{info['grad_accum_dtype']}"
                               if self.precision == "bf16" else None),
            "dtypes": {
                "master_weights": sda.dtype_name(self.master_dtypes),
                "grads": sda.dtype_name(self.grad_dtypes),
                "optimizer_state": {k: sda.dtype_name(v) for k, v in self.state_dtypes.items()},
                "compute": sorted(str(d) for d in self.compute_dtypes),
            },
            "replica_consistency": {
                "all_equal": all(r["all_equal"] for r in self.replica_rounds),
                "rounds": self.replica_rounds,
                "params": self.replica_params,
            },
            "valid_tokens": int(n_valid),
            "micro_batches": n_micro,
            "dropout": "off (eval mode)",
            "role_timings": dict(self.timings),
            "engine_info": info,
        }


def _destroy(engine: Any) -> None:
    """Release an engine before the next variant builds its own."""
    with contextlib.suppress(Exception):
        engine.destroy()
    del engine
    gc.collect()


# --------------------------------------------------------------------------- output files


def _part_paths(output_dir: Path, role: str) -> tuple[Path, Path]:
    return output_dir / f".part-{role}.safetensors", output_dir / f".part-{role}.json"


def _atomic_json(path: Path, doc: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n", "utf-8")
    os.replace(tmp, path)


def _atomic_tensors(path: Path, tensors: dict[str, Tensor], meta: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def write_part(output_dir: Path, role: str, tensors: dict[str, Tensor],
               meta: dict[str, Any]) -> None:
    """Write one role's tensors and meta (the JSON last: it marks the part complete)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    st, js = _part_paths(output_dir, role)
    _atomic_tensors(st, tensors, {"engine": ENGINE, "role": role})
    _atomic_json(js, meta)


def merge_parts(roles: Sequence[str], output_dir: Path, head: dict[str, Any]) -> None:
    """Wait for every role's part, then write ``outputs.safetensors`` and ``outputs.json``.

    Raises:
        HarnessError: a part did not appear within :data:`PART_WAIT_S`.
    """
    deadline = time.monotonic() + PART_WAIT_S
    t0 = time.perf_counter()
    for role in roles:
        js = _part_paths(output_dir, role)[1]
        while not js.is_file():
            if time.monotonic() > deadline:
                raise HarnessError(f"{js}: the {role} part never appeared")
            time.sleep(0.05)
    tensors: dict[str, Tensor] = {}
    role_meta: dict[str, Any] = {}
    shims = set(head["shims"])
    for role in roles:
        st, js = _part_paths(output_dir, role)
        tensors.update(load_file(str(st)))
        role_meta[role] = json.loads(js.read_text("utf-8"))
        shims.update(role_meta[role]["engine_info"]["shims"])
    head["roles"] = role_meta
    head["shims"] = sorted(shims)
    head["tensors"] = {"file": OUTPUTS_FILE, "count": len(tensors)}
    head["timings"]["merge_s"] = round(time.perf_counter() - t0, 4)
    _atomic_tensors(output_dir / OUTPUTS_FILE, tensors, {"engine": ENGINE})
    _atomic_json(output_dir / OUTPUTS_META_FILE, head)
    for role in roles:
        for path in _part_paths(output_dir, role):
            path.unlink()


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "deepspeed", "transformers", "safetensors"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise HarnessError(f"${name} is not set: run this harness under torchrun "
                           f"(qualify.launch.launch)")
    return int(value)


def _device() -> tuple[torch.device, str]:
    """CUDA (NCCL) when available and not disabled by ``QUALIFY_DEVICE=cpu``; else CPU (gloo).

    On CPU, ``DS_ACCELERATOR`` defaults to ``cpu`` so DeepSpeed's accelerator matches.
    """
    if torch.cuda.is_available() and os.environ.get("QUALIFY_DEVICE", "") != "cpu":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise HarnessError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA "
                               f"device(s): NCCL needs one device per rank (QUALIFY_DEVICE=cpu "
                               f"runs on CPU with gloo)")
        torch.cuda.set_device(local)
        return torch.device("cuda", local), "nccl"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return torch.device("cpu"), "gloo"


def check_cell(cell: HarnessCell) -> list[tuple[str, int, str]]:
    """The variants to run as ``(precision, zero stage, output subdirectory)``, validated.

    Raises:
        HarnessError: an unknown precision, an option other than ``zero``, or a ZeRO
            stage other than 0, 1, 2.
    """
    out: list[tuple[str, int, str]] = []
    for precision, options, sub in cell.variant_runs():
        unknown = sorted(set(options) - OPTIONS)
        if unknown:
            raise HarnessError(f"deepspeed options {unknown} are not known (only 'zero')")
        if precision not in ("fp32", "bf16"):
            raise HarnessError(f"precision {precision!r}: deepspeed runs fp32 or bf16")
        zero = int(options.get("zero", 0))
        if zero not in (0, 1, 2):
            raise HarnessError(f"ZeRO stage {zero}: the deepspeed harness runs stages 0, 1, 2")
        out.append((precision, zero, sub))
    if cell.faults:
        raise HarnessError(f"the deepspeed harness injects no faults, got {list(cell.faults)}")
    return out


def run(cell: HarnessCell) -> None:
    """Run every variant of ``cell`` on this rank (the process group must not exist yet).

    Raises:
        HarnessError: not under torchrun, a world size that is not the cell's, bad
            options or inputs; any error of a variant propagates (non-zero exit).
    """
    t0 = time.perf_counter()
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if world != cell.world_size:
        raise HarnessError(f"WORLD_SIZE = {world} but the cell needs actor_tp + critic_tp = "
                           f"{cell.world_size}")
    variants = check_cell(cell)
    inputs = read_inputs(Path(cell.inputs_dir))
    device, backend = _device()
    dist.init_process_group(backend, timeout=timedelta(seconds=cell.collective_timeout_s),
                            device_id=device if device.type == "cuda" else None)
    try:
        placement = parallelize.build_placement(
            actor_tp=cell.actor_tp, critic_tp=cell.critic_tp, rank=rank,
            timeout_s=cell.collective_timeout_s)
        dist.barrier(group=placement.tp_group)
        parallelize.skip_shm_comm_build()
        import deepspeed  # noqa: F401  (after the group exists: DeepSpeed adopts it)

        roles = list(parallelize.role_ranks(cell.actor_tp, cell.critic_tp))
        init_s = time.perf_counter() - t0
        print(f"[deepspeed] rank {rank}/{world}: {placement.role} tp_rank "
              f"{placement.tp_rank}/{placement.tp} ranks {list(placement.ranks)} on {device} "
              f"({backend}); variants {[v[2] or v[0] for v in variants]}", flush=True)
        for precision, zero, sub in variants:
            tv = time.perf_counter()
            torch.manual_seed(cell.seed)
            runner = VariantRun(cell=cell, precision=precision, zero=zero, rank=rank,
                                placement=placement, inputs=inputs, device=device)
            with runner.timed("total_s"):
                meta = runner.run_actor() if placement.role == "actor" else runner.run_critic()
            out_dir = Path(cell.output_dir) / sub if sub else Path(cell.output_dir)
            print(f"[deepspeed] rank {rank}: {placement.role} {precision} zero{zero} done, "
                  f"timings {runner.timings}", flush=True)
            if runner.writer:
                write_part(out_dir, placement.role, runner.tensors, meta)
            if rank == 0:
                ranks = [{"rank": r, "role": role, "tp_rank": i, "tp_group": list(rs)}
                         for role, rs in parallelize.role_ranks(cell.actor_tp,
                                                                cell.critic_tp).items()
                         for i, r in enumerate(rs)]
                cell_doc = {**cell.to_dict(), "precision": precision, "options": {"zero": zero},
                            "output_dir": str(out_dir)}
                head: dict[str, Any] = {
                    "schema_version": 1,
                    "engine": ENGINE,
                    "cell": cell_doc,
                    "versions": _versions(),
                    "world_size": world,
                    "backend": backend,
                    "device": device.type,
                    "ranks": ranks,
                    "timings": {"init_s": round(init_s, 4),
                                "variant_s": round(time.perf_counter() - tv, 4),
                                "rank0_total_s": round(time.perf_counter() - t0, 4)},
                    "shims": [parallelize.GROUPS_SHIM, parallelize.SHM_SHIM],
                    "faults": [],
                }
                merge_parts(roles, out_dir, head)
    finally:
        dist.destroy_process_group()


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m harnesses.deepspeed.harness CELL_JSON``.

    Returns:
        0 on success, 2 on a usage error (exceptions propagate so torchrun records them).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(f"usage: python -m harnesses.deepspeed.harness {CELL_FILE}", file=sys.stderr)
        return 2
    cell = HarnessCell.from_dict(json.loads(Path(args[0]).read_text("utf-8")))
    if cell.engine != ENGINE:
        raise HarnessError(f"{args[0]}: engine {cell.engine!r} is not {ENGINE!r}")
    run(cell)
    return 0


if __name__ == "__main__":
    sys.exit(main())
