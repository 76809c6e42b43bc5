"""The CUDA training path: Megatron DDP + ``get_megatron_optimizer`` (not runnable on CPU).

**Not run in this repository's CI** (no CUDA): written against megatron-core 0.16.1's
source and exercised only by ``scripts/gpu/acceptance.sh`` on a GPU machine.

Per role and round (``qualify.protocol``):

1. ``DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
   use_distributed_optimizer=False), module, pg_collection=...)``: gradients accumulate in
   the FP32 ``main_grad`` buffers of ``param_and_grad_buffer``; then Megatron's
   ``finalize_model_grads`` (DP sync, DP = 1 here, and the TP all-reduce of the
   ``q_layernorm`` / ``k_layernorm`` gradients, partial per rank since each rank normalises
   only its own heads). The reduction and accumulation dtypes are read back from the DDP
   object (:func:`reduction_dtypes`).
2. The pre-clip ``main_grad`` of every parameter, gathered over the TP group and converted
   to the HF layout (:func:`harnesses.megatron.convert.megatron_to_hf`).
3. ``optimizer.step()`` of ``get_megatron_optimizer(OptimizerConfig(optimizer="adam",
   lr, weight_decay, adam_beta1/2, adam_eps, clip_grad=max_grad_norm, bf16, params_dtype),
   [model], config_overrides={}, use_gloo_process_groups=False, pg_collection=...)``
   (gloo groups are refused with explicit process groups); ``config_overrides={}`` applies
   weight decay to every parameter (the protocol's ``torch.optim.AdamW`` does; Megatron's
   default exempts biases and 1-D parameters). Its returned grad norm is Megatron's
   TP-aware ``get_grad_norm_fp32`` (tensor-parallel duplicates counted once), and
   ``clip_coef = min(1, max_norm / (norm + 1e-6))`` is the coefficient its
   ``clip_grad_by_total_norm_fp32`` applies.
   The lr: Megatron-Core's ``OptimizerParamScheduler`` (:func:`lr_scheduler`), stepped
   after each optimizer step; the lr of each step read from ``param_groups`` before it.
4. Adam moments and the master weights (FP32 model parameters in FP32 cells,
   ``fp32_from_float16_groups`` in BF16 cells) gathered and converted the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from harnesses import layer_probe
from harnesses.megatron import convert, cpu_shims, faults, losses, resume
from harnesses.resume_state import ResumePlan

if TYPE_CHECKING:
    from harnesses.common import Batch
    from harnesses.megatron import model as mm
    from qualify.contract import Contract
    from qualify.protocol import HarnessCell


class RoleRun(Protocol):
    """What training needs of :class:`harnesses.megatron.harness.RoleRun` (one role, one rank).

    A structural type, so this module does not import the harness that imports it.
    """

    cell: HarnessCell
    groups: mm.RoleGroups
    contract: Contract
    device: torch.device
    compute_dtypes: set[str]
    faults: faults.Faults

    @property
    def role(self) -> str:
        """``actor`` or ``critic``."""

    @property
    def bf16(self) -> bool:
        """Megatron BF16 mode."""

    def put(self, round_: int, metric: str, value: Tensor, param: str | None = None) -> None:
        """Report one tensor (:meth:`harnesses.common.RoleOutputs.put`)."""

    def timed(self, key: str) -> AbstractContextManager[None]:
        """Time a block under ``key`` (:meth:`harnesses.common.RoleOutputs.timed`)."""

    def actor_scores(self, model: nn.Module, shape: convert.Shape,
                     batch: Batch) -> tuple[Tensor, Tensor]:
        """Logprobs and entropy ``[b, R]`` FP32."""

    def critic_values(self, model: nn.Module, batch: Batch) -> Tensor:
        """Values ``[b, R]`` FP32."""


def gather_hf(run: RoleRun, shape: convert.Shape, local: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """All-gather this rank's ``{megatron name: tensor}`` over the TP group; HF layout.

    Collective over the role's TP group. Returns FP32 CPU tensors (all ranks).
    """
    names = convert.megatron_param_names(shape)
    shards: list[dict[str, Tensor]] = [{} for _ in range(run.groups.tp)]
    for n in names:
        x = local[n].detach().float().contiguous()
        parts = [torch.empty_like(x) for _ in range(run.groups.tp)]
        dist.all_gather(parts, x, group=run.groups.tp_group)
        for r, p in enumerate(parts):
            shards[r][n] = p.cpu()
    return convert.megatron_to_hf(shards, shape)


def replica_check(run: RoleRun, shape: convert.Shape,
                  local: Mapping[str, Tensor]) -> dict[str, float]:
    """Max abs difference across TP ranks of each replicated parameter (0.0 = bitwise)."""
    out: dict[str, float] = {}
    for n in convert.replicated_megatron_names(shape):
        x = local[n].detach().float().contiguous()
        parts = [torch.empty_like(x) for _ in range(run.groups.tp)]
        dist.all_gather(parts, x, group=run.groups.tp_group)
        out[n] = max(float((p - parts[0]).abs().max()) for p in parts)
    return out


@dataclasses.dataclass(kw_only=True)
class Trainer:
    """Megatron DDP + optimizer for one role (CUDA only).

    Attributes:
        run: the role run (inputs, reporting).
        model: the Megatron model (``Float16Module``-wrapped in BF16 cells).
        shape: its conversion shape.
        ref: the frozen reference policy (actor only).
        probe: ``qualify diverge``'s layer probe (:mod:`harnesses.megatron.probe`), if any.
    """

    run: RoleRun
    model: nn.Module
    shape: convert.Shape
    ref: nn.Module | None
    probe: layer_probe.LayerProbe | None = None
    replica_rounds: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    dtypes: dict[str, Any] = dataclasses.field(default_factory=dict)
    behavior_weight: dict[str, Any] = dataclasses.field(default_factory=dict)
    served: dict[str, int] = dataclasses.field(default_factory=dict)
    norms: list[float] = dataclasses.field(default_factory=list)
    lrs: dict[str, float] = dataclasses.field(default_factory=dict)
    scheduler: Any = None
    resume_meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        run, c = self.run, self.run.contract
        inner: Any = getattr(self.model, "module", self.model)
        tcfg = inner.config
        self.model.train()
        self.ddp = DistributedDataParallel(
            config=tcfg, ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=False),
            module=self.model, pg_collection=run.groups.pg_collection)
        o = c.optimizer
        lr = o.actor_lr if run.role == "actor" else o.critic_lr
        min_lr = lr if o.lr_schedule == "constant" else o.min_lr_ratio * lr
        self.opt_config = OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_eps=o.eps,
            clip_grad=o.max_grad_norm, bf16=run.bf16,
            params_dtype=torch.bfloat16 if run.bf16 else torch.float32,
            use_distributed_optimizer=False)
        with self.placement():
            self.optimizer = get_megatron_optimizer(
                self.opt_config, [self.ddp], config_overrides={}, use_gloo_process_groups=False,
                pg_collection=run.groups.pg_collection)
        self.scheduler = lr_scheduler(self.optimizer, o, lr=lr, min_lr=min_lr,
                                      rounds=c.algorithm.rounds)

    def placement(self) -> AbstractContextManager[Any]:
        """:func:`harnesses.megatron.cpu_shims.optimizer_placement` on CPU; nothing on CUDA.

        What each CPU block served is accumulated in :attr:`served` (``outputs.json``).
        """
        if self.run.device.type != "cpu":
            return contextlib.nullcontext()
        return self._cpu_placement()

    @contextlib.contextmanager
    def _cpu_placement(self) -> Iterator[None]:
        with cpu_shims.optimizer_placement() as placed:
            yield
        for where, n in placed.served.items():
            self.served[where] = self.served.get(where, 0) + n

    # ----------------------------------------------------------------- views

    def params(self) -> dict[str, nn.Parameter]:
        """Model parameters by Megatron name."""
        return {_strip(n): p for n, p in self.ddp.named_parameters()}

    def _optimizers(self) -> list[Any]:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def masters(self) -> dict[str, Tensor]:
        """FP32 master weights by Megatron name (the model params themselves in FP32 cells)."""
        by_id = {id(p): n for n, p in self.params().items()}
        out: dict[str, Tensor] = {}
        for opt in self._optimizers():
            if hasattr(opt, "fp32_from_float16_groups"):
                for mg, fg in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
                    for model_p, master in zip(mg, fg, strict=True):
                        out[by_id[id(model_p)]] = master
                for g in getattr(opt, "fp32_from_fp32_groups", []):
                    for p in g:
                        out[by_id[id(p)]] = p
            else:
                for g in opt.optimizer.param_groups:
                    for p in g["params"]:
                        out[by_id[id(p)]] = p
        return out

    def full_hf(self, local: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """:func:`gather_hf` of this role (collective over its TP group; FP32 CPU, HF names)."""
        return gather_hf(self.run, self.shape, local)

    def state(self, key: str) -> dict[str, Tensor]:
        """Adam state ``key`` (``exp_avg`` / ``exp_avg_sq``) by Megatron name."""
        masters = self.masters()
        out: dict[str, Tensor] = {}
        for opt in self._optimizers():
            st = opt.optimizer.state
            for name, m in masters.items():
                if m in st and key in st[m]:
                    out[name] = st[m][key]
        return out

    # ----------------------------------------------------------------- step

    def step(self, round_: int) -> None:
        """Record main_grad, step Megatron's optimizer, record state, updates, replicas."""
        from megatron.core.distributed import finalize_model_grads

        run = self.run
        # Megatron's own end of the backward (what its training loop's
        # config.finalize_model_grads_func runs): DP grad sync, then the TP all-reduce of
        # gradients of replicated parameters fed by head-sharded inputs (q_layernorm /
        # k_layernorm); without it those main_grads are per-rank partial sums.
        finalize_model_grads([self.ddp], num_tokens=None, pg_collection=run.groups.pg_collection)
        params = self.params()
        grads: dict[str, Tensor] = {n: p.main_grad for n, p in params.items()}  # type: ignore[attr-defined]
        self.dtypes["grads"] = sorted({str(g.dtype) for g in grads.values()})
        for key, got in zip(("grad_reduction", "grad_accumulation"), reduction_dtypes(self.ddp),
                            strict=True):
            into = self.dtypes.setdefault(key, {})
            for name, dtypes in got.items():
                into[name] = sorted(set(into.get(name, [])) | {str(d) for d in dtypes})
        for name, g in gather_hf(run, self.shape, grads).items():
            run.put(round_, "grads", g, name)
        before = gather_hf(run, self.shape, self.masters())
        self.lrs[f"round{round_}"] = applied_lr(self.optimizer)
        with self.placement():
            success, norm, _ = self.optimizer.step()
        if not success:
            raise RuntimeError(f"Megatron optimizer step skipped in round {round_}")
        self.scheduler.step(increment=1)  # as megatron.training.train_step, after the step
        max_norm = float(self.opt_config.clip_grad)
        self.norms.append(float(norm))  # the Python float Megatron clipped with
        norm_t = torch.tensor(float(norm))
        run.put(round_, "grad_norm", norm_t)
        run.put(round_, "clip_coef", torch.clamp(max_norm / (norm_t + 1e-6), max=1.0))
        masters = self.masters()
        self.dtypes["master_weights"] = sorted({str(m.dtype) for m in masters.values()})
        for key in ("exp_avg", "exp_avg_sq"):
            st = self.state(key)
            self.dtypes.setdefault("optimizer_state", {})[key] = sorted(
                {str(t.dtype) for t in st.values()})
            for name, t in gather_hf(run, self.shape, st).items():
                run.put(round_, key, t, name)
        for name, after in gather_hf(run, self.shape, masters).items():
            run.put(round_, "updates", after - before[name], name)
        diffs = replica_check(run, self.shape, dict(params))
        self.replica_rounds.append({"round": round_, "all_equal": all(v == 0 for v in
                                                                       diffs.values()),
                                    "max_abs_diff": max(diffs.values(), default=0.0),
                                    "params": diffs})
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def train(self, batch: Batch, slices: list[slice]) -> None:
        """Rounds ``1..rounds`` of the role's update (protocol losses, ``loss_agg_mode``).

        A resume cell (``cell.json`` ``resume``, :mod:`harnesses.megatron.resume`) runs rounds
        ``1..k`` and checkpoints after round ``k`` (``save``), or restores that checkpoint and
        the round-1 old logprobs / values (decoupled PPO: behavior weights) and runs rounds
        ``k + 1..rounds`` (``load``).
        """
        run = self.run
        alg = run.contract.algorithm
        b, r_len = batch.responses.shape
        dev = run.device
        ref_lp = torch.zeros(b, r_len, device=dev)
        if run.role == "actor" and self.ref is not None:
            with torch.no_grad():
                for s in slices:
                    ref_lp[s] = run.actor_scores(self.ref, self.shape, batch.rows(s))[0]
        old = torch.zeros(b, r_len, device=dev)
        row_w, denom = losses.aggregation_terms(batch.mask, alg.loss_agg_mode)
        row_w = row_w.to(dev)
        dppo = alg.name == "decoupled_ppo"
        w_b, w_raw = torch.ones(b, r_len, device=dev), torch.ones(b, r_len, device=dev)
        self.ddp.zero_grad_buffer()
        probe = self.probe or layer_probe.LayerProbe(None, role=run.role, writer=False,
                                                     modules={}, to_full=lambda _n, t: t)
        plan = ResumePlan.of(run.cell)
        if plan.loading:  # a resume cell's second launch: restore, then round k + 1
            with run.timed("checkpoint_load_s"):
                got, self.resume_meta = resume.load(plan, self, run.faults)
            old = got["old"].to(dev)
            if run.role == "actor":
                w_b, w_raw = got["w_behav"].to(dev), got["w_raw"].to(dev)
        for round_ in plan.rounds(alg.rounds):
            with run.timed(f"round{round_}_s"):
                cur = torch.zeros(b, r_len, device=dev)
                ent_r = torch.zeros(b, r_len, device=dev)
                sums: dict[str, float] = {}
                for s in slices:
                    with probe.capture(round_, batch.prompt_len,
                                       batch.input_ids.shape[1]):
                        mb = batch.rows(s)
                        if run.role == "actor":
                            lp, ent = run.actor_scores(self.ddp, self.shape, mb)
                            o_lp = lp.detach() if round_ == 1 else old[s]
                            if dppo and round_ == 1:  # proximal policy: this engine's round 1
                                assert mb.behavior_logprobs is not None
                                w_b[s], w_raw[s] = losses.behavior_weight(
                                    lp, mb.behavior_logprobs, alg.behavior_weight_cap,
                                    alg.behavior_weight_cap_mode)
                            rw = row_w[s, None]
                            pw = rw * w_b[s] if dppo else \
                                (None if alg.loss_agg_mode == "token-mean" else rw)
                            terms = {
                                "policy": losses.policy_loss_sum(lp, o_lp, mb.advantages, mb.mask,
                                                                 alg.clip_ratio, weight=pw) / denom,
                                "kl": alg.kl_loss_coef * losses.masked_sum(losses.kl_penalty(
                                    lp, ref_lp[s], alg.kl_loss_estimator) * rw, mb.mask) / denom,
                                "entropy": -alg.entropy_coef * losses.masked_sum(ent * rw, mb.mask)
                                / denom}
                            cur[s] = torch.where(mb.mask, lp.detach(), 0.0)
                            ent_r[s] = torch.where(mb.mask, ent.detach(), 0.0)
                        else:
                            v = run.critic_values(self.ddp, mb)
                            o_v = v.detach() if round_ == 1 else old[s]
                            vw = None if alg.loss_agg_mode == "token-mean" else row_w[s, None]
                            terms = {"value": losses.value_loss_sum(
                                v, o_v, mb.returns, mb.mask, alg.value_clip, weight=vw) / denom}
                            cur[s] = torch.where(mb.mask, v.detach(), 0.0)
                        sum(terms.values()).backward()  # type: ignore[union-attr]
                    for k, t in terms.items():
                        sums[k] = sums.get(k, 0.0) + float(t.detach())
                if round_ == 1:
                    old = cur.clone()
                if run.role == "actor":
                    run.put(round_, "logprobs", cur)
                    run.put(round_, "entropy", ent_r)
                else:
                    run.put(round_, "values", cur)
                for k, v_ in sums.items():
                    run.put(round_, f"loss/{k}", torch.tensor(v_))
                run.put(round_, "loss/total", torch.tensor(sum(sums.values())))
                self.step(round_)
                if plan.saves_after(round_):
                    with run.timed("checkpoint_save_s"):
                        resume.save(plan, self, {"old": old} if run.role == "critic" else
                                    {"old": old, "w_behav": w_b, "w_raw": w_raw})
        probe.save("megatron")
        if dppo and run.role == "actor":  # fixed by round 1 (the proximal policy)
            stats = losses.weight_stats(w_raw.cpu(), batch.mask.cpu(), alg.behavior_weight_cap)
            self.behavior_weight = {f"round{r}": stats for r in range(1, alg.rounds + 1)}

    def meta(self) -> dict[str, Any]:
        """Training part of the role's ``outputs.json`` (dtypes, replicas, optimizer)."""
        maps = ("optimizer_state", "grad_reduction", "grad_accumulation")
        one = {k: (v[0] if isinstance(v, list) and len(v) == 1 else v)
               for k, v in self.dtypes.items() if k not in maps}
        state, reduction, accumulation = ({k: (v[0] if len(v) == 1 else v)
                                           for k, v in self.dtypes.get(m, {}).items()}
                                          for m in maps)
        params: dict[str, dict[str, Any]] = {}
        for r in self.replica_rounds:
            for n, d in r["params"].items():
                e = params.setdefault(n, {"equal": True, "max_abs_diff": 0.0})
                e["equal"] = bool(e["equal"] and d == 0)
                e["max_abs_diff"] = max(float(e["max_abs_diff"]), d)
        return {
            "dtypes": {**one, "optimizer_state": state,
                       "compute": sorted(self.run.compute_dtypes),
                       "grad_reduction": reduction, "grad_accumulation": accumulation},
            "replica_consistency": {
                "all_equal": all(r["all_equal"] for r in self.replica_rounds),
                "rounds": [{k: v for k, v in r.items() if k != "params"}
                           for r in self.replica_rounds],
                "params": params},
            "loss_agg_mode": self.run.contract.algorithm.loss_agg_mode,
            "behavior_weight": self.behavior_weight,
            "lr": dict(self.lrs),
            "lr_scheduler": LR_SCHEDULER_NOTE,
            "resume": self.resume_meta or None,
            "optimizer": {"class": type(self.optimizer).__name__,
                          "wrapped": [type(o).__name__ for o in self._optimizers()],
                          "inner": [type(o.optimizer).__name__ for o in self._optimizers()],
                          "config_overrides": "{} (weight decay on every parameter)",
                          "cpu_placement_served": dict(sorted(self.served.items())),
                          "grad_norms": list(self.norms)},
        }


def reduction_dtypes(ddp: Any) -> tuple[dict[str, set[torch.dtype]],
                                        dict[str, set[torch.dtype]]]:
    """The gradient reduction and accumulation dtypes of a megatron-core DDP module.

    Read back from the engine object, not from the ``DistributedDataParallelConfig`` the
    harness passed: every bucket of every gradient buffer (``ddp.buffers`` and
    ``ddp.expert_parallel_buffers``, ``_ParamAndGradBucket.grad_data``: the tensor each
    bucket group's ``start_grad_sync`` all-reduces or reduce-scatters; the buffer's
    ``grad_dtype`` is FP32 under ``grad_reduce_in_fp32``, the parameter dtype otherwise), and
    every parameter's ``main_grad`` (the view into its buffer that Megatron's grad hooks add
    each micro-batch's ``.grad`` into). Under ``reduce_scatter_with_fp32_accumulation``
    (distributed optimizer only) the reduce-scatter accumulates in FP32 whatever the bucket
    dtype; the entry names it.

    Returns:
        ``(reduction, accumulation)``: ``{"DistributedDataParallel.buckets.grad_data": ...}``
        (``...:reduce_scatter_with_fp32_accumulation`` when that is on) and
        ``{"param.main_grad": ...}``.
    """
    buffers = [*getattr(ddp, "buffers", []), *getattr(ddp, "expert_parallel_buffers", [])]
    reduce = {bucket.grad_data.dtype for b in buffers for bucket in b.buckets}
    accum = {p.main_grad.dtype for p in ddp.module.parameters()
             if getattr(p, "main_grad", None) is not None}
    fp32_rs = bool(getattr(ddp.ddp_config, "reduce_scatter_with_fp32_accumulation", False))
    name = "DistributedDataParallel.buckets.grad_data" + (
        ":reduce_scatter_with_fp32_accumulation" if fp32_rs else "")
    return (({name: reduce} if reduce else {}),
            ({"param.main_grad": accum} if accum else {}))


LR_SCHEDULER_NOTE = ("megatron.core.optimizer_param_scheduler.OptimizerParamScheduler "
                     "(init_lr 0, min_lr = min_lr_ratio * lr, steps in optimizer steps, "
                     "step(increment=1) after each optimizer step); lr read from "
                     "optimizer.param_groups before optimizer.step()")


def lr_scheduler(optimizer: Any, o: Any, *, lr: float, min_lr: float, rounds: int) -> Any:
    """Megatron-Core's ``OptimizerParamScheduler`` for the contract's lr schedule.

    As ``megatron.training.training.get_optimizer_param_scheduler`` builds it, in optimizer
    steps (``increment = 1``; Megatron counts samples, ``global_batch_size`` per step, the
    same ratios): ``init_lr = 0`` (HF warmup from 0), ``max_lr = lr``, ``min_lr = r * lr``,
    ``lr_warmup_steps = W``, ``lr_decay_steps = T``, ``lr_decay_style`` the contract's
    ``constant`` / ``linear`` / ``cosine`` (``constant``: ``lr_decay_steps = rounds``, which
    Megatron requires positive and ignores), weight decay constant (``start_wd = end_wd``).
    Its ``__init__`` calls ``step(0)``: step 1 applies ``get_lr`` at ``num_steps = 0``.

    Args:
        optimizer: the ``MegatronOptimizer`` (its ``param_groups`` carry ``max_lr`` /
            ``min_lr`` from the ``OptimizerConfig``).
        o: the contract's :class:`~qualify.contract.OptimizerSpec`.
        lr: the role's base lr.
        min_lr: the ``OptimizerConfig.min_lr`` (``lr`` for a constant schedule).
        rounds: the contract's rounds.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    total = o.total_steps if o.total_steps is not None else rounds
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=total, lr_decay_style=o.lr_schedule, start_wd=o.weight_decay,
        end_wd=o.weight_decay, wd_incr_steps=total, wd_incr_style="constant")


def applied_lr(optimizer: Any) -> float:
    """The lr the next ``optimizer.step()`` applies: ``param_groups[*]["lr"]`` (all equal).

    Raises:
        RuntimeError: the param groups hold different lrs.
    """
    lrs = {float(g["lr"]) for g in optimizer.param_groups}
    if len(lrs) != 1:
        raise RuntimeError(f"Megatron optimizer param groups hold different lrs {sorted(lrs)}")
    return lrs.pop()


def _strip(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name
