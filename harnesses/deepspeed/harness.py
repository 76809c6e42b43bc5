"""DeepSpeed harness: ``python -m harnesses.deepspeed.harness CELL_JSON`` under torchrun.

Runs the PPO update of :mod:`qualify.protocol` with ``deepspeed.initialize`` engines driving
Hugging Face models: the engine's own forward, ``engine.backward``, ``engine.step`` (gradient
accumulation, global-norm clipping, ``torch.optim.AdamW`` through ``"torch_adam": true``), ZeRO
stage 0 / 1 / 2, BF16 with FP32 master weights, and AutoTP tensor parallelism
(``tensor_parallel.autotp_size``). The rounds, the PPO / value losses and the output files
are the harness SDK's (:mod:`qualify_harness`): this module supplies
:class:`DeepSpeedEngine`, the engine's parts.

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

import qualify_harness as sdk
import torch
import torch.distributed as dist
from qualify_harness import routes as sdk_routes
from torch import Tensor, nn
from torch.distributed.elastic.multiprocessing.errors import record

from harnesses import common, hf_schedule, layer_probe
from harnesses.common import Batch, Inputs
from harnesses.deepspeed import parallelize, resume
from harnesses.deepspeed import state_dict_adapter as sda
from qualify.errors import HarnessError
from qualify.protocol import HarnessCell

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


# --------------------------------------------------------------------------- the engine


@dataclasses.dataclass(kw_only=True)
class DeepSpeedEngine(sdk.Engine):
    """One role on one rank: a ``deepspeed.initialize`` engine over the HF model.

    DeepSpeed owns the step: ``engine.backward`` accumulates, ``engine.step`` inside the
    accumulation window only counts the micro-batch, and at the boundary it clips, steps the
    optimizer and the client lr scheduler together. :meth:`update` therefore records around
    that one call (the SDK's default sequence has separate clip and step parts).

    Attributes:
        ds: the DeepSpeed engine.
        et: its tensors, gathered to the HF layout (:class:`sda.EngineTensors`).
        placement: the role's TP group.
        temperature: the contract's sampling temperature.
        beta1: AdamW's first-moment decay (the clip coefficient's least squares).
        rec: what the role reports.
    """

    ds: Any
    et: sda.EngineTensors
    placement: parallelize.Placement
    device: torch.device
    temperature: float
    beta1: float
    rec: sdk.Recorder
    pad_token_id: int = 0
    grad_norms: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    prev_exp_avg: dict[str, Tensor] = dataclasses.field(default_factory=dict)

    def response_logits(self, model: Any, batch: Batch) -> Tensor:
        """Logits ``[b, R, V]`` of ``model`` on the response window, in the module's dtype.

        AutoTP's vocab-parallel ``lm_head`` gathers its output: the logits arrive whole on
        every TP rank.
        """
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False,
                    logits_to_keep=batch.window())
        logits: Tensor = out.logits  # [b, R, V], gathered over the TP group by AutoTP
        self.rec.compute_dtypes.add(logits.dtype)
        return logits

    def values(self, model: Any, batch: Batch) -> Tensor:
        """Values ``V(s_t)`` ``[b, R]`` FP32 (``score`` head on the response window)."""
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False)
        v = out.logits[:, batch.window()]  # [b, R, 1]
        self.rec.compute_dtypes.add(v.dtype)
        values: Tensor = v.float().squeeze(-1)
        return values

    def backward(self, loss: Tensor) -> None:
        """``engine.backward(loss, scale_wrt_gas=False)``; inside the window ``engine.step()``.

        Each micro-batch loss is already ``sum / N`` (whole-batch denominators), so it is
        not divided by the accumulation steps; the boundary's step is :meth:`update`'s.
        """
        self.ds.backward(loss, scale_wrt_gas=False)
        if not self.ds.is_gradient_accumulation_boundary():
            self.ds.step()

    def update(self, rec: sdk.Recorder, round_: int, max_norm: float) -> None:
        """Record grads and masters, ``engine.step()``, then norm, clip, state, updates.

        Called at the accumulation boundary (after the last micro-batch's backward).
        Collective over the role's TP group (gathers). The grad norm is the engine's
        (``get_global_grad_norm()``, else the harness-measured L2 norm, labelled); the clip
        coefficient, which DeepSpeed does not expose, is measured from its AdamW moments.

        Raises:
            HarnessError: every gradient is zero (no clip coefficient).
        """
        del max_norm  # DeepSpeed's own gradient_clipping (its config) clips
        et = self.et
        grads = et.full_grads()
        rec.grad_dtypes |= et.grad_dtypes()
        before = et.full_masters()
        measured = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
        rec.lrs[f"round{round_}"] = parallelize.one_lr(self.ds.get_lr(), round_)
        self.ds.step()  # the optimizer step, then DeepSpeed's lr_scheduler.step()
        engine_norm = _as_float(self.ds.get_global_grad_norm())
        norm = engine_norm if engine_norm is not None else measured
        self.grad_norms.append({"round": round_, "source": GRAD_NORM_ENGINE
                                if engine_norm is not None else GRAD_NORM_MEASURED,
                                "engine": engine_norm, "harness_measured": measured})
        for name, g in grads.items():
            rec.put(round_, "grads", g, name)
        rec.put(round_, "grad_norm", torch.tensor(norm, dtype=torch.float32))
        state = {key: et.full_state(key) for key in ("exp_avg", "exp_avg_sq")}
        after = et.full_masters()
        for key, dtypes in et.dtypes().items():
            (rec.master_dtypes if key == "master" else rec.state_dtypes[key]).update(dtypes)
        num = den = 0.0
        for name, g in grads.items():
            m = state["exp_avg"][name].double()
            prev = self.prev_exp_avg.get(name)
            delta = m - self.beta1 * prev.double() if prev is not None else m
            gd = g.double()
            num += float((delta * gd).sum())
            den += (1.0 - self.beta1) * float(gd.square().sum())
        if den <= 0.0:
            raise HarnessError(f"round {round_}: every gradient is zero; no clip coefficient")
        rec.put(round_, "clip_coef", torch.tensor(num / den, dtype=torch.float32))
        self.prev_exp_avg = state["exp_avg"]
        for key, tensors in state.items():
            for name, t in tensors.items():
                rec.put(round_, key, t, name)
        for name, a in after.items():
            rec.put(round_, "updates", a - before[name], name)
        rec.replicas(round_, *self.check_replicas())

    def check_replicas(self) -> tuple[dict[str, bool], dict[str, float]]:
        """Compare every replicated parameter (FP32 master and module copy) across TP ranks.

        Bitwise on the FP32 bit patterns; one ``all_gather`` over the role's TP group.
        """
        et = self.et
        reps = [pl for pl in et.layout if pl.dim is None]
        if self.placement.tp == 1 or not reps:
            return {pl.name: True for pl in reps}, {pl.name: 0.0 for pl in reps}
        local = []
        for pl in reps:
            local.append(et.local_master(pl.name).detach().float().reshape(-1))
            local.append(et.params[pl.name].detach().float().reshape(-1))
        flat = torch.cat(local)
        gathered = [torch.empty_like(flat) for _ in range(self.placement.tp)]
        dist.all_gather(gathered, flat, group=self.placement.tp_group)
        base = gathered[0]
        equal: dict[str, bool] = {}
        diff: dict[str, float] = {}
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
        return equal, diff

    def routes(self) -> dict[str, Any]:
        """The optimizer wrapper, the basic optimizer and the ZeRO stage, read off the engine.

        The wrapper: ``FP16_Optimizer`` is the fused-flatten path, ``FP16_UnfusedOptimizer``
        the per-tensor one; the basic optimizer it steps: DeepSpeed's ``FusedAdam`` /
        ``DeepSpeedCPUAdam`` or torch's AdamW with its ``fused`` / ``foreach`` flags.
        """
        basic = getattr(self.ds, "basic_optimizer", None) or self.ds.optimizer
        return {"optimizer_wrapper": sdk_routes.optimizer_route(self.ds.optimizer),
                "optimizer": sdk_routes.optimizer_route(basic),
                "zero_stage": int(self.ds.zero_optimization_stage())}

    # The SDK's default update sequence is replaced by :meth:`update`: these parts of it
    # are DeepSpeed's, inside ``engine.step()``.
    def params(self) -> list[Tensor]:
        """Trainable module parameters."""
        return [p for p in self.ds.module.parameters() if p.requires_grad]

    def full_grads(self) -> dict[str, Tensor]:
        """The engine's gradient buffers, full, by HF name."""
        return self.et.full_grads()

    def clip(self, max_norm: float) -> Tensor:
        """Not separable from DeepSpeed's step (:meth:`update`)."""
        raise NotImplementedError("DeepSpeed clips inside engine.step()")

    def full_params(self) -> dict[str, Tensor]:
        """The FP32 masters, full, by HF name."""
        return self.et.full_masters()

    def applied_lr(self) -> float:
        """The lr of the engine's next step."""
        return float(parallelize.one_lr(self.ds.get_lr(), 0))

    def optimizer_step(self) -> None:
        """Not separable from DeepSpeed's step (:meth:`update`)."""
        raise NotImplementedError("DeepSpeed steps inside engine.step()")

    def zero_grad(self) -> None:
        """DeepSpeed zeroes its gradients in ``engine.step()``."""

    def state_dtypes(self, key: str) -> set[torch.dtype]:
        """Dtypes of AdamW's ``key`` state."""
        return set(self.et.dtypes().get(key, set()))

    def full_optimizer_state(self, key: str) -> dict[str, Tensor]:
        """AdamW state ``key``, full, by HF name."""
        return self.et.full_state(key)


# --------------------------------------------------------------------------- one variant


@dataclasses.dataclass(kw_only=True)
class VariantRun:
    """One role x one variant on one rank: a fresh model and engine, and what it reports.

    Attributes:
        cell: the variant's cell.
        precision: the variant's precision.
        zero: the variant's ZeRO stage.
        rank: global rank.
        placement: the role's groups.
        inputs: the harness inputs.
        device: compute device.
        rec: what the role reports.
        carry: a resume cell's state (:mod:`harnesses.deepspeed.resume`).
    """

    cell: HarnessCell
    precision: str
    zero: int
    rank: int
    placement: parallelize.Placement
    inputs: Inputs
    device: torch.device
    rec: sdk.Recorder
    shims: list[str] = dataclasses.field(default_factory=list)
    engine_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    carry: dict[str, Any] = dataclasses.field(default_factory=dict)
    _prev_exp_avg: dict[str, Tensor] = dataclasses.field(default_factory=dict)

    @property
    def role(self) -> str:
        """``actor`` or ``critic``."""
        return self.placement.role

    @property
    def writer(self) -> bool:
        """TP rank 0 keeps and writes the role's tensors."""
        return self.placement.tp_rank == 0

    @property
    def tensors(self) -> dict[str, Tensor]:
        """The role's reported tensors (:mod:`harnesses.deepspeed.resume` keeps some)."""
        return self.rec.tensors

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
        self.rec.engine_dtypes(*parallelize.reduction_dtypes(engine))
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

    def run(self) -> dict[str, Any]:
        """The role: load, initialize, the SDK's rounds; returns the role meta."""
        actor = self.role == "actor"
        c = self.inputs.contract
        batch = self.inputs.batch.to(self.device)
        n_micro = len(sdk.micro_slices(batch.input_ids.shape[0], c.algorithm.micro_batch_size))
        ref = None
        with self.rec.timed("load_s"):
            model = common.load_hf_model("causal_lm" if actor else "value",
                                         self.inputs.actor_dir if actor
                                         else self.inputs.critic_dir, self.device)
            if actor:
                ref = common.load_hf_model("causal_lm", self.inputs.ref_dir, self.device)
                ref.requires_grad_(False)
                if self.precision == "bf16":
                    ref.to(torch.bfloat16)
        ckpt = snapshot(model)
        with self.rec.timed("initialize_s"):
            ds = self.build_engine(model, c.optimizer.actor_lr if actor
                                   else c.optimizer.critic_lr, n_micro)
            et = sda.EngineTensors(ds, parallelize.tp_layout(ds.module))
        self.check_initial_masters(et, ckpt)
        del ckpt
        engine = DeepSpeedEngine(ds=ds, et=et, placement=self.placement, device=self.device,
                                 temperature=c.sampling.temperature,
                                 beta1=float(c.optimizer.betas[0]), rec=self.rec,
                                 pad_token_id=common.pad_token_id(model))
        plan = resume.ResumePlan.of(self.cell)
        probe = layer_probe.for_model(self.cell.probe, self.role, self.writer, ds.module)

        def restore() -> dict[str, Tensor]:
            got = resume.restore(self, ds, et)
            engine.prev_exp_avg = self._prev_exp_avg  # the clip coefficient's previous moment
            return got

        def after_round(round_: int, rollout_state: dict[str, Tensor]) -> None:
            self.carry.update(rollout_state)
            resume.save_after(self, round_, ds, et)  # a resume cell's save launch

        def capture(round_: int, mb: Batch) -> contextlib.AbstractContextManager[Any]:
            return probe.capture(round_, mb.prompt_len, mb.input_ids.shape[1])

        recipe = self.inputs.recipe
        kw: dict[str, Any] = {"rec": self.rec, "rounds": plan.rounds(recipe.rounds),
                              "restore": restore if plan.loading else None,
                              "after_round": after_round, "capture": capture}
        if actor:
            meta = sdk.run_actor(engine, ds, ref, batch, recipe, **kw)
        else:
            meta = sdk.run_critic(engine, ds, batch, recipe, **kw)
        probe.save("deepspeed")
        out = self.role_meta(engine, meta)
        _destroy(ds)
        return out

    def role_meta(self, engine: DeepSpeedEngine, meta: dict[str, Any]) -> dict[str, Any]:
        """The role's part of ``outputs.json`` (merged under ``roles.<role>``)."""
        et = engine.et
        sharded = [pl.name for pl in et.layout if pl.dim is not None]
        replicated = [pl.name for pl in et.layout if pl.dim is None]
        info = dict(self.engine_info)
        info.update({
            "grad_norm": {"reported": engine.grad_norms[0]["source"] if engine.grad_norms
                          else None, "rounds": engine.grad_norms},
            "clip_coef": CLIP_COEF_MEASURED,
            "apis": {k: sorted(v) for k, v in et.sources.items()},
            "tp_gather": sda.API_TP_GATHER if sharded else None,
            "shard_dims": {pl.name: pl.dim for pl in et.layout if pl.dim is not None},
            "reference_policy": ("frozen HF model outside DeepSpeed, replicated on each TP "
                                 "rank, in the engine's module dtype"),
            "shims": list(self.shims),
        })
        return sdk.role_meta(
            self.rec, tp=self.placement.tp, global_ranks=self.placement.ranks,
            precision=self.precision, model_class=type(et.engine.module).__name__,
            parallelism={
                "mesh_dim_names": ["tp"],
                "lm_head": ("vocab_parallel" if "lm_head.weight" in sharded else
                            "replicated" if self.role == "actor" else None),
                "sharded_params": sharded,
                "replicated_params": replicated,
                "partial_grads_reduced": [],
            },
            bf16_mechanism=(f"DeepSpeed bf16.enabled: module parameters cast to BF16 "
                            f"(BF16 compute), FP32 master weights and AdamW state in "
                            f"{info['optimizer_wrapper']}; gradient accumulation in "
                            f"{info['grad_accum_dtype']}"
                            if self.precision == "bf16" else None),
            lr_scheduler=parallelize.DS_SCHEDULER_NOTE, dropout="off (eval mode)",
            engine_info=info, **meta)


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
    if cell.faults:  # the test suite's deliberate bugs, patched in (harnesses/deepspeed/faults.py)
        from harnesses.deepspeed import faults
        faults.install(cell.faults)
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
                rec = sdk.Recorder(
                    role=placement.role, writer=placement.tp_rank == 0,
                    sampling=sdk.ParamSampling.from_dict(vcell.param_sampling.to_dict()))
                runner = VariantRun(cell=vcell, precision=vcell.precision, zero=zero, rank=rank,
                                    placement=placement, inputs=inputs, device=device, rec=rec)
                with rec.timed("total_s"):
                    meta = runner.run()
                out_dir = Path(vcell.output_dir)
                print(f"[deepspeed] rank {rank}: {placement.role} {vcell.precision} zero{zero} "
                      f"done, timings {rec.timings}", flush=True)
                if runner.writer:  # a resumed launch: the rounds it ran, its resume record
                    sdk.write_part(ENGINE, out_dir, placement.role, *resume.report(runner, meta))
                if rank == 0:
                    head = sdk.outputs_head(
                        engine=ENGINE, cell={**vcell.to_dict(), "options": {"zero": zero}},
                        packages=PACKAGES, world=world, backend=backend, device=device,
                        timings={"init_s": round(init_s, 4),
                                 "variant_s": round(time.perf_counter() - tv, 4),
                                 "rank0_total_s": round(time.perf_counter() - t0, 4)},
                        shims=[parallelize.GROUPS_SHIM, parallelize.SHM_SHIM], faults=[])
                    sdk.merge_parts(ENGINE, roles, out_dir, head)
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
