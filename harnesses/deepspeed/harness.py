"""DeepSpeed harness: ``python -m harnesses.deepspeed.harness CELL_JSON`` under torchrun.

Runs the PPO update of :mod:`qualify.protocol` with ``deepspeed.initialize`` engines driving
Hugging Face models: the engine's own forward, ``engine.backward``, ``engine.step`` (gradient
accumulation, global-norm clipping, ``torch.optim.AdamW`` through ``"torch_adam": true``), ZeRO
stage 0 / 1 / 2, BF16 with FP32 master weights, and AutoTP tensor parallelism
(``tensor_parallel.autotp_size``). The PPO / value losses are this harness's own
(:mod:`harnesses.deepspeed.losses`).

Reads only ``cell.json`` and, from ``inputs_dir``: ``rollout.safetensors``,
``train_inputs.safetensors``, ``contract.json`` and ``model.json`` (never reference scores). Ranks
``[0, actor_tp)`` run the Actor, the next ``critic_tp`` ranks the Critic, each role in its own TP
group (:mod:`harnesses.deepspeed.parallelize`).

Process-group reuse (``variants``: every variant, precision x options x topology, in order in
the same processes: one process group, each topology's role groups built in turn, fresh models and
engines per variant) and resume (``resume``, :mod:`harnesses.deepspeed.resume`): README.md.

What is reported is what the engine did: its own pre-clip gradient norm
(``engine.get_global_grad_norm()``; where it returns ``None`` the L2 norm of the engine's gradient
buffers measured by the harness, labelled so), its gradient buffers, FP32 master weights and AdamW
state read through DeepSpeed's APIs and gathered to the HF layout
(:mod:`harnesses.deepspeed.state_dict_adapter`); the clip coefficient, which DeepSpeed does not
expose, is the ``c`` of ``exp_avg_r - β1·exp_avg_{r-1} = (1 - β1)·c·g_r`` (least squares, FP64).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.elastic.multiprocessing.errors import record

from harnesses import common, hf_schedule, layer_probe
from harnesses.common import Batch, Inputs
from harnesses.deepspeed import losses, parallelize, resume
from harnesses.deepspeed import state_dict_adapter as sda
from qualify.errors import HarnessError
from qualify.protocol import (
    EXTRA_RIGHT_PADDING,
    HarnessCell,
)

ENGINE: Final = "deepspeed"
GRAD_NORM_ENGINE: Final = "engine.get_global_grad_norm() after the step (pre-clip)"
GRAD_NORM_MEASURED: Final = ("harness-measured: L2 norm of the engine's gradient buffers "
                             "(deepspeed.utils.safe_get_full_grad, gathered, each parameter once, "
                             "FP64) before engine.step(); engine.get_global_grad_norm() was None")
CLIP_COEF_MEASURED: Final = ("harness-measured: DeepSpeed exposes no clip coefficient; c = "
                             "<exp_avg_r - beta1*exp_avg_{r-1}, g_r> / ((1 - beta1) <g_r, g_r>) "
                             "over every parameter (FP64), from the engine's own AdamW state and "
                             "pre-step gradient buffers")
OPTIONS: Final = frozenset({"zero"})
PACKAGES: Final = ("torch", "deepspeed", "transformers", "safetensors")


# --------------------------------------------------------------------------- models


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


def _as_float(x: Any) -> float | None:
    """A grad norm as DeepSpeed returns it (float, 0-d tensor or ``None``) as a float."""
    if x is None:
        return None
    return float(x.item()) if isinstance(x, Tensor) else float(x)


# --------------------------------------------------------------------------- one variant


@dataclasses.dataclass(kw_only=True)
class VariantRun(common.RoleOutputs):
    """One role x one variant on one rank: a fresh model and engine, and what it reports.

    Attributes:
        cell: the launch's cell.
        precision: the variant's precision.
        zero: the variant's ZeRO stage.
        rank: global rank.
        placement: the role's groups.
        inputs: the harness inputs.
        device: compute device.
        tensors, timings: what it reports (:class:`harnesses.common.RoleOutputs`).
    """

    cell: HarnessCell
    precision: str
    zero: int
    rank: int
    placement: parallelize.Placement
    inputs: Inputs
    device: torch.device
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
    reduce_dtypes: dict[str, set[torch.dtype]] = dataclasses.field(default_factory=dict)
    accum_dtypes: dict[str, set[torch.dtype]] = dataclasses.field(default_factory=dict)
    _prev_exp_avg: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    lrs: dict[str, float] = dataclasses.field(default_factory=dict)
    carry: dict[str, Any] = dataclasses.field(default_factory=dict)  # resume.py: state, record

    @property
    def role(self) -> str:
        """``actor`` or ``critic``."""
        return self.placement.role

    @property
    def writer(self) -> bool:
        """TP rank 0 keeps and writes the role's tensors."""
        return self.placement.tp_rank == 0

    # ----------------------------------------------------------------- engine

    def build_engine(self, model: nn.Module, lr: float, n_micro: int) -> Any:
        """``deepspeed.initialize`` on ``model`` with this variant's config, role groups.

        Raises:
            HarnessError: AutoTP could not shard the model for this TP size.
        """
        import deepspeed
        from deepspeed.utils import groups

        c, o = self.inputs.contract, self.inputs.contract.optimizer
        cfg = parallelize.ds_config(
            precision=self.precision, zero=self.zero, tp=self.placement.tp,
            micro_batch_size=c.algorithm.micro_batch_size, n_micro=n_micro, lr=lr,
            betas=(float(o.betas[0]), float(o.betas[1])), eps=o.eps,
            weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm)
        engine, _, _, _ = deepspeed.initialize(  # a client lr scheduler (README: the lr)
            model=model, config=cfg, mpu=parallelize.install_role_groups(self.placement),
            args=parallelize.initialize_args(self.device),
            lr_scheduler=lambda x: hf_schedule.hf_scheduler(x, o))
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
        self.reduce_dtypes, self.accum_dtypes = parallelize.reduction_dtypes(engine)
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
        self.lrs[f"round{round_}"] = parallelize.one_lr(engine.get_lr(), round_)
        engine.step()  # the optimizer step, then DeepSpeed's lr_scheduler.step()
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
        probe = layer_probe.for_model(self.cell.probe, self.role, self.writer, engine.module)
        batch = self.inputs.batch
        for round_ in resume.ResumePlan.of(self.cell).rounds(self.inputs.contract.algorithm.rounds):
            with self.timed(f"round{round_}_s"):
                for s in slices:
                    with probe.capture(round_, batch.prompt_len, batch.input_ids.shape[1]):
                        engine.backward(micro_loss(round_, s), scale_wrt_gas=False)
                    if engine.is_gradient_accumulation_boundary():
                        self.boundary_step(round_, engine, et)
                    else:
                        engine.step()
                micro_loss(round_, None)  # round done: store per-token outputs
            resume.save_after(self, round_, engine, et)  # a resume cell's save launch
        probe.save("deepspeed")

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
        slices = common.micro_slices(batch.input_ids.shape[0], alg.micro_batch_size)
        n_valid = float(batch.mask.sum())
        b, r_len = batch.responses.shape
        with self.timed("load_s"):
            model = common.load_hf_model("causal_lm", self.inputs.actor_dir, self.device)
            ref = common.load_hf_model("causal_lm", self.inputs.ref_dir, self.device)
            ref.requires_grad_(False)
            if self.precision == "bf16":
                ref.to(torch.bfloat16)
        pad_id = common.pad_token_id(model)
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
        # loss_agg_mode (global row weights and denominator); decoupled PPO's weight.
        row_w, denom = losses.aggregation_terms(batch.mask, alg.loss_agg_mode)
        decoupled = alg.name == "decoupled_ppo"
        w_behav, w_raw = torch.ones(2, b, r_len, device=self.device).unbind(0)
        old_lp, w_behav, w_raw = resume.restore_actor(self, engine, et, old_lp, w_behav, w_raw)

        def micro_loss(round_: int, s: slice | None) -> Tensor:
            nonlocal old_lp, lp_r, ent_r, sums
            if s is None:  # end of the round
                if round_ == 1:
                    old_lp = self.carry["old_logprobs"] = lp_r.clone()
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
            if decoupled and round_ == 1:  # the proximal policy: this engine's round 1
                assert mb.behavior_logprobs is not None
                w_behav[s], w_raw[s] = losses.behavior_weight(
                    lp, mb.behavior_logprobs, alg.behavior_weight_cap,
                    alg.behavior_weight_cap_mode)
            rw = row_w[s].unsqueeze(-1)
            weight = rw * w_behav[s] if decoupled else rw  # x 1.0 is exact for token-mean
            policy = losses.policy_loss_sum(lp, old, mb.advantages, mb.mask,
                                            alg.clip_ratio, weight=weight) / denom
            kl = alg.kl_loss_coef * losses.masked_sum(
                losses.kl_penalty(lp, ref_lp[s], alg.kl_loss_estimator) * rw, mb.mask) / denom
            entropy = -alg.entropy_coef * losses.masked_sum(ent * rw, mb.mask) / denom
            sums["policy"] += float(policy.detach())
            sums["kl"] += float(kl.detach())
            sums["entropy"] += float(entropy.detach())
            lp_r[s] = torch.where(mb.mask, lp.detach(), 0.0)
            ent_r[s] = torch.where(mb.mask, ent.detach(), 0.0)
            total: Tensor = policy + kl + entropy
            return total

        self.run_rounds(engine, et, slices, micro_loss)
        meta = self.role_meta(engine, et, n_valid, len(slices))
        meta.update(losses.algorithm_meta(alg, w_raw if decoupled else None, batch.mask))
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
        slices = common.micro_slices(batch.input_ids.shape[0], alg.micro_batch_size)
        n_valid = float(batch.mask.sum())
        b, r_len = batch.responses.shape
        with self.timed("load_s"):
            model = common.load_hf_model("value", self.inputs.critic_dir, self.device)
        pad_id = common.pad_token_id(model)
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
        row_w, denom = losses.aggregation_terms(batch.mask, alg.loss_agg_mode)
        old_v = resume.restore(self, engine, et).get("old_values", old_v)

        def micro_loss(round_: int, s: slice | None) -> Tensor:
            nonlocal old_v, v_r, total
            if s is None:
                if round_ == 1:
                    old_v = self.carry["old_values"] = v_r.clone()
                self.put(round_, "values", v_r)
                self.put(round_, "loss/value", torch.tensor(total))
                self.put(round_, "loss/total", torch.tensor(total))
                v_r, total = torch.zeros_like(v_r), 0.0
                return torch.zeros(())
            mb = batch.rows(s)
            values = self.critic_values(engine, mb)
            old = values.detach() if round_ == 1 else old_v[s]
            loss = losses.value_loss_sum(values, old, mb.returns, mb.mask, alg.value_clip,
                                         weight=row_w[s].unsqueeze(-1)) / denom
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
                "grad_reduction": {k: sda.dtype_name(v) for k, v in self.reduce_dtypes.items()},
                "grad_accumulation": {k: sda.dtype_name(v)
                                      for k, v in self.accum_dtypes.items()},
            },
            "lr": dict(self.lrs), "lr_scheduler": parallelize.DS_SCHEDULER_NOTE,
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


def _device(cell: HarnessCell) -> tuple[torch.device, str, torch.device | None]:
    """:func:`harnesses.common.launch_device`; on CPU ``DS_ACCELERATOR`` defaults to ``cpu``.

    Raises:
        HarnessError: more local ranks than CUDA devices.
    """
    device, backend, device_id = common.launch_device(cell)
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return device, backend, device_id


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
    resume.check_faults(cell.faults)
    return out


def run(cell: HarnessCell) -> None:
    """Run every variant of ``cell`` on this rank (the process group must not exist yet).

    Raises:
        HarnessError: not under torchrun, a world size that is not the cell's, bad
            options or inputs; any error of a variant propagates (non-zero exit).
    """
    t0 = time.perf_counter()
    rank, world = common.env_int("RANK"), common.env_int("WORLD_SIZE")
    if world != cell.world_size:
        raise HarnessError(f"WORLD_SIZE = {world} but the cell needs actor_tp + critic_tp = "
                           f"{cell.world_size}")
    check_cell(cell)
    topologies, init_s = common.topology_runs(cell), 0.0
    inputs = common.read_inputs(Path(cell.inputs_dir))
    device, backend, device_id = _device(cell)
    dist.init_process_group(backend, timeout=timedelta(seconds=cell.collective_timeout_s),
                            device_id=device_id)
    try:
        for (actor_tp, critic_tp), vcells in topologies:  # each topology's groups in turn
            placement = parallelize.build_placement(
                actor_tp=actor_tp, critic_tp=critic_tp, rank=rank,
                timeout_s=cell.collective_timeout_s)
            dist.barrier(group=placement.tp_group)
            parallelize.skip_shm_comm_build()
            import deepspeed  # noqa: F401  (after the group exists: DeepSpeed adopts it)

            roles = common.roles(actor_tp, critic_tp)
            init_s = init_s or time.perf_counter() - t0  # start-up: to the first groups
            print(f"[deepspeed] rank {rank}/{world}: {placement.role} tp_rank "
                  f"{placement.tp_rank}/{placement.tp} ranks {list(placement.ranks)} on "
                  f"{device} ({backend}); variants {[v.output_dir for v in vcells]}", flush=True)
            for vcell in vcells:
                tv, zero = time.perf_counter(), int(vcell.options.get("zero", 0))
                torch.manual_seed(cell.seed)
                runner = VariantRun(cell=vcell, precision=vcell.precision, zero=zero, rank=rank,
                                    placement=placement, inputs=inputs, device=device)
                with runner.timed("total_s"):
                    meta = runner.run_actor() if runner.role == "actor" else runner.run_critic()
                out_dir = Path(vcell.output_dir)
                print(f"[deepspeed] rank {rank}: {placement.role} {vcell.precision} zero{zero} "
                      f"done, timings {runner.timings}", flush=True)
                if runner.writer:  # a resumed launch: the rounds it ran, its resume record
                    common.write_part(ENGINE, out_dir, placement.role, *resume.report(runner, meta))
                if rank == 0:
                    head = common.outputs_head(
                        engine=ENGINE, cell={**vcell.to_dict(), "options": {"zero": zero}},
                        packages=PACKAGES, world=world, backend=backend, device=device,
                        timings={"init_s": round(init_s, 4),
                                 "variant_s": round(time.perf_counter() - tv, 4),
                                 "rank0_total_s": round(time.perf_counter() - t0, 4)},
                        shims=[parallelize.GROUPS_SHIM, parallelize.SHM_SHIM], faults=[])
                    common.merge_parts(ENGINE, roles, out_dir, head)
    finally:
        dist.destroy_process_group()


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m harnesses.deepspeed.harness CELL_JSON``.

    Returns:
        0 on success, 2 on a usage error (exceptions propagate so torchrun records them).
    """
    return common.harness_main(argv, engine=ENGINE, module="harnesses.deepspeed.harness",
                               run=run)


if __name__ == "__main__":
    common.exit_now(main())
