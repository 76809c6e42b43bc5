"""The Megatron-Core engine's parts for the SDK's round driver (:mod:`qualify_harness`).

What Megatron dictates, and only that: per role,

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
   ``clip_grad_by_total_norm_fp32`` applies. Clip and step are one call, so
   :meth:`MegatronEngine.update` replaces the SDK's default update sequence and records
   the same families around it. The lr: Megatron-Core's ``OptimizerParamScheduler``
   (:func:`lr_scheduler`), stepped after each optimizer step; the lr of each step read
   from ``param_groups`` before it.
4. Adam moments and the master weights (FP32 model parameters in FP32 cells,
   ``fp32_from_float16_groups`` in BF16 cells) gathered and converted the same way.

On CPU the optimizer runs under :func:`harnesses.megatron.cpu_shims.optimizer_placement`.
The forward is the model's own (vocab-parallel log-softmax:
:func:`harnesses.megatron.losses.vocab_parallel_logprobs_entropy`); the losses and the
rounds are the SDK's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Final

import qualify_harness as sdk
import torch
import torch.distributed as dist
from qualify_harness.routes import optimizer_route
from torch import Tensor, nn

from harnesses.megatron import convert, cpu_shims, losses
from harnesses.megatron import model as mm
from qualify.contract import Contract

MEGATRON_FUSIONS: Final = ("bias_activation_fusion", "masked_softmax_fusion",
                            "persist_layer_norm", "bias_dropout_fusion", "apply_rope_fusion",
                            "gradient_accumulation_fusion", "attention_softmax_in_fp32")
"""``TransformerConfig`` flags that switch Megatron's fused kernels (read off the built model)."""


def gather_hf(groups: mm.RoleGroups, shape: convert.Shape,
              local: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """All-gather this rank's ``{megatron name: tensor}`` over the TP group; HF layout.

    Collective over the role's TP group. Returns FP32 CPU tensors (all ranks).
    """
    names = convert.megatron_param_names(shape)
    shards: list[dict[str, Tensor]] = [{} for _ in range(groups.tp)]
    for n in names:
        x = local[n].detach().float().contiguous()
        parts = [torch.empty_like(x) for _ in range(groups.tp)]
        dist.all_gather(parts, x, group=groups.tp_group)
        for r, p in enumerate(parts):
            shards[r][n] = p.cpu()
    return convert.megatron_to_hf(shards, shape)


def replica_check(groups: mm.RoleGroups, shape: convert.Shape,
                  local: Mapping[str, Tensor]) -> dict[str, float]:
    """Max abs difference across TP ranks of each replicated parameter (0.0 = bitwise)."""
    out: dict[str, float] = {}
    for n in convert.replicated_megatron_names(shape):
        x = local[n].detach().float().contiguous()
        parts = [torch.empty_like(x) for _ in range(groups.tp)]
        dist.all_gather(parts, x, group=groups.tp_group)
        out[n] = max(float((p - parts[0]).abs().max()) for p in parts)
    return out


def output_window(model: nn.Module, batch: sdk.Batch) -> Tensor:
    """The Megatron model's output at positions ``P - 1 + t``, ``t < R``.

    Returns:
        ``[b, R, V'/tp]`` (LM head: this rank's vocab shard) or ``[b, R, 1]`` (value head).
    """
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                attention_mask=mm.padding_mask(batch.attention_mask))
    start = batch.prompt_len - 1
    window: Tensor = out[:, start:start + batch.responses.shape[1]]
    return window


@dataclasses.dataclass(kw_only=True, eq=False)
class MegatronEngine(sdk.Engine):
    """One role on one rank: Megatron DDP + ``get_megatron_optimizer`` over a ``GPTModel``.

    Attributes:
        model: the Megatron model (``Float16Module``-wrapped in BF16 cells), in eval mode
            until the scoring pass is over (:meth:`after_scoring`).
        shape: its conversion shape.
        groups: the role's process groups.
        contract: the contract (optimizer, schedule, temperature).
        device: compute device.
        bf16: Megatron BF16 mode.
        rec: what the role reports (compute dtypes).
        ddp, optimizer, scheduler, opt_config: built in ``__post_init__``.
        served: what each CPU placement block served (``outputs.json``).
        norms: the grad norm each ``optimizer.step()`` returned.
    """

    model: nn.Module
    shape: convert.Shape
    groups: mm.RoleGroups
    contract: Contract
    device: torch.device
    bf16: bool
    rec: sdk.Recorder
    pad_token_id: int = 0
    served: dict[str, int] = dataclasses.field(default_factory=dict)
    norms: list[float] = dataclasses.field(default_factory=list)
    ddp: Any = dataclasses.field(init=False)
    optimizer: Any = dataclasses.field(init=False)
    scheduler: Any = dataclasses.field(init=False)
    opt_config: Any = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        c = self.contract
        inner: Any = getattr(self.model, "module", self.model)
        self.ddp = DistributedDataParallel(
            config=inner.config, ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=False),
            module=self.model, pg_collection=self.groups.pg_collection)
        o = c.optimizer
        lr = o.actor_lr if self.role == "actor" else o.critic_lr
        min_lr = lr if o.lr_schedule == "constant" else o.min_lr_ratio * lr
        self.opt_config = OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_eps=o.eps,
            clip_grad=o.max_grad_norm, bf16=self.bf16,
            params_dtype=torch.bfloat16 if self.bf16 else torch.float32,
            use_distributed_optimizer=False)
        with self.placement():
            self.optimizer = get_megatron_optimizer(
                self.opt_config, [self.ddp], config_overrides={}, use_gloo_process_groups=False,
                pg_collection=self.groups.pg_collection)
        self.scheduler = lr_scheduler(self.optimizer, o, lr=lr, min_lr=min_lr,
                                      rounds=c.algorithm.rounds)

    @property
    def role(self) -> str:
        """``actor`` or ``critic``."""
        return self.groups.role

    def placement(self) -> AbstractContextManager[Any]:
        """:func:`harnesses.megatron.cpu_shims.optimizer_placement` on CPU; nothing on CUDA.

        What each CPU block served is accumulated in :attr:`served` (``outputs.json``).
        """
        if self.device.type != "cpu":
            return contextlib.nullcontext()
        return self._cpu_placement()

    @contextlib.contextmanager
    def _cpu_placement(self) -> Iterator[None]:
        with cpu_shims.optimizer_placement() as placed:
            yield
        for where, n in placed.served.items():
            self.served[where] = self.served.get(where, 0) + n

    # ----------------------------------------------------------------- forward

    def window(self, model: nn.Module, batch: sdk.Batch) -> Tensor:
        """Model output at positions ``P - 1 + t``, ``t < R``.

        Returns:
            ``[b, R, V'/tp]`` (actor: this rank's vocab shard) or ``[b, R, 1]`` (critic).
        """
        out = output_window(model, batch)
        self.rec.compute_dtypes.add(out.dtype)
        return out

    def logprobs_and_entropy(self, model: Any, batch: sdk.Batch) -> tuple[Tensor, Tensor]:
        """Logprobs and entropy ``[b, R]`` FP32 (vocab-parallel, the contract's temperature)."""
        return losses.vocab_parallel_logprobs_entropy(
            self.window(model, batch), batch.responses, vocab=self.shape.vocab,
            tp_rank=self.groups.tp_rank, group=self.groups.tp_group,
            temperature=self.contract.sampling.temperature)

    def response_logits(self, model: Any, batch: sdk.Batch) -> Tensor:
        """Logits ``[b, R, V]`` on every TP rank, in the compute dtype.

        :meth:`window`'s vocab shards gathered over the role's TP group with megatron-core's
        ``gather_from_tensor_model_parallel_region`` (all-gather, concatenated along the
        vocabulary in TP-rank order: the padded ``V'``), then cut to the true ``V``.
        """
        from megatron.core.tensor_parallel.mappings import (
            gather_from_tensor_model_parallel_region,
        )

        shard = self.window(model, batch)
        whole: Tensor = gather_from_tensor_model_parallel_region(shard,
                                                                 group=self.groups.tp_group)
        return whole[..., :self.shape.vocab]

    def values(self, model: Any, batch: sdk.Batch) -> Tensor:
        """Values ``[b, R]`` FP32 (replicated value head; identical on every TP rank)."""
        return self.window(model, batch).float().squeeze(-1)

    def after_scoring(self, models: list[Any]) -> None:
        """The trained model to train mode (dropout is 0 either way); empty grad buffers."""
        self.model.train()
        self.ddp.zero_grad_buffer()

    # ----------------------------------------------------------------- views

    def named(self) -> dict[str, nn.Parameter]:
        """Model parameters by Megatron name."""
        return {_strip(n): p for n, p in self.ddp.named_parameters()}

    def optimizers(self) -> list[Any]:
        """The ``MegatronOptimizer`` s (a chained optimizer's members, else itself)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def masters(self) -> dict[str, Tensor]:
        """FP32 master weights by Megatron name (the model params themselves in FP32 cells)."""
        by_id = {id(p): n for n, p in self.named().items()}
        out: dict[str, Tensor] = {}
        for opt in self.optimizers():
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
        return gather_hf(self.groups, self.shape, local)

    def state(self, key: str) -> dict[str, Tensor]:
        """Adam state ``key`` (``exp_avg`` / ``exp_avg_sq``) by Megatron name."""
        masters = self.masters()
        out: dict[str, Tensor] = {}
        for opt in self.optimizers():
            st = opt.optimizer.state
            for name, m in masters.items():
                if m in st and key in st[m]:
                    out[name] = st[m][key]
        return out

    # ----------------------------------------------------------------- the SDK's parts

    def prepare_grads(self) -> None:
        """Megatron's own end of the backward (its ``finalize_model_grads_func``).

        DP grad sync, then the TP all-reduce of gradients of replicated parameters fed by
        head-sharded inputs (``q_layernorm`` / ``k_layernorm``); without it those
        ``main_grad`` s are per-rank partial sums.
        """
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp], num_tokens=None, pg_collection=self.groups.pg_collection)

    def params(self) -> list[Tensor]:
        """Model parameters (their ``main_grad`` is what Megatron steps with)."""
        return list(self.named().values())

    def engine_dtypes(self) -> tuple[dict[str, set[torch.dtype]], dict[str, set[torch.dtype]]]:
        """:func:`reduction_dtypes` of the DDP module."""
        return reduction_dtypes(self.ddp)

    def full_grads(self) -> dict[str, Tensor]:
        """The pre-clip ``main_grad`` of every parameter, full, by HF name (collective)."""
        return self.full_hf({n: p.main_grad for n, p in self.named().items()})  # type: ignore[attr-defined]

    def clip(self, max_norm: float) -> Tensor:
        """Not separable from Megatron's ``optimizer.step()`` (:meth:`update`)."""
        raise NotImplementedError("Megatron clips inside optimizer.step()")

    def full_params(self) -> dict[str, Tensor]:
        """The FP32 masters, full, by HF name (collective)."""
        return self.full_hf(self.masters())

    def applied_lr(self) -> float:
        """The lr of the next ``optimizer.step()`` (:func:`applied_lr`)."""
        return applied_lr(self.optimizer)

    def optimizer_step(self) -> None:
        """Not separable from Megatron's clip (:meth:`update`)."""
        raise NotImplementedError("Megatron steps inside optimizer.step()")

    def scheduler_step(self) -> None:
        """``OptimizerParamScheduler.step(increment=1)``, as ``megatron.training.train_step``."""
        self.scheduler.step(increment=1)

    def zero_grad(self) -> None:
        """Zero the DDP grad buffers and the optimizer's gradients."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def state_dtypes(self, key: str) -> set[torch.dtype]:
        """Dtypes of Adam's ``key`` state."""
        return {t.dtype for t in self.state(key).values()}

    def full_optimizer_state(self, key: str) -> dict[str, Tensor]:
        """Adam state ``key``, full, by HF name (collective)."""
        return self.full_hf(self.state(key))

    def routes(self) -> dict[str, Any]:
        """The kernel routes of the built model and optimizer, read back from live objects.

        ``fusions``: :data:`MEGATRON_FUSIONS` from the ``config`` the model's layers hold (the
        one they branch on at run time); ``core_attention``: the classes of the modules named
        ``*.core_attention`` (``DotProductAttention`` for the local spec, TE's otherwise);
        ``optimizer``: :func:`qualify_harness.routes.optimizer_route` of the optimizer stepped.
        """
        config = next((m.config for m in self.model.modules() if hasattr(m, "config")
                       and hasattr(m.config, "masked_softmax_fusion")), None)
        attn = sorted({f"{type(m).__module__}.{type(m).__qualname__}"
                       for n, m in self.model.named_modules() if n.endswith("core_attention")})
        return {"fusions": {k: getattr(config, k, None) for k in MEGATRON_FUSIONS},
                "core_attention": attn,
                "optimizer": optimizer_route(self.optimizer)}

    def check_replicas(self) -> tuple[dict[str, bool], dict[str, float]]:
        """Replicated parameters (Megatron names) across the TP group: equal, max abs diff."""
        diffs = replica_check(self.groups, self.shape, self.named())
        return {n: d == 0 for n, d in diffs.items()}, diffs

    def update(self, rec: sdk.Recorder, round_: int, max_norm: float) -> None:
        """Record ``main_grad``, Megatron's ``optimizer.step()``, then norm, clip, state.

        Collective over the role's TP group (gathers). ``max_norm`` is the optimizer
        config's ``clip_grad`` (Megatron clips inside its step).

        Raises:
            RuntimeError: Megatron skipped the step.
        """
        self.prepare_grads()
        rec.engine_dtypes(*self.engine_dtypes())
        named = self.named()
        rec.grad_dtypes |= {p.main_grad.dtype for p in named.values()}  # type: ignore[attr-defined]
        for name, g in self.full_grads().items():
            rec.put(round_, "grads", g, name)
        before = self.full_params()
        rec.lrs[f"round{round_}"] = self.applied_lr()
        with self.placement():
            success, norm, _ = self.optimizer.step()
        if not success:
            raise RuntimeError(f"Megatron optimizer step skipped in round {round_}")
        self.scheduler_step()
        clip = float(self.opt_config.clip_grad)
        self.norms.append(float(norm))  # the Python float Megatron clipped with
        norm_t = torch.tensor(float(norm))
        rec.put(round_, "grad_norm", norm_t)
        rec.put(round_, "clip_coef", torch.clamp(clip / (norm_t + 1e-6), max=1.0))
        masters = self.masters()
        rec.master_dtypes |= {m.dtype for m in masters.values()}
        for key in ("exp_avg", "exp_avg_sq"):
            rec.state_dtypes[key] |= self.state_dtypes(key)
            for name, t in self.full_optimizer_state(key).items():
                rec.put(round_, key, t, name)
        for name, after in self.full_hf(masters).items():
            rec.put(round_, "updates", after - before[name], name)
        rec.replicas(round_, *self.check_replicas())
        self.zero_grad()

    def optimizer_info(self) -> dict[str, Any]:
        """``engine_info.optimizer`` of the role's ``outputs.json``."""
        return {"class": type(self.optimizer).__name__,
                "wrapped": [type(o).__name__ for o in self.optimizers()],
                "inner": [type(o.optimizer).__name__ for o in self.optimizers()],
                "config_overrides": "{} (weight decay on every parameter)",
                "cpu_placement_served": dict(sorted(self.served.items())),
                "grad_norms": list(self.norms)}


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
