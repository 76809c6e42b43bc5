"""Rank placement, DeepSpeed process groups and the DeepSpeed config of one variant.

Placement (:func:`build_placement`): ranks ``[0, actor_tp)`` run the Actor and ranks
``[actor_tp, actor_tp + critic_tp)`` the Critic. Every rank creates, in the same order, one
TP group per role and one single-rank data-parallel group per rank (``dist.new_group`` is
collective over the world, with the cell's collective timeout).

DeepSpeed 0.19.8 builds its AutoTP groups in ``deepspeed.utils.groups._init_tp_mesh_device``
from the *whole world* (``initialize_mesh_device((world // tp, tp))``): with two roles in
one world that would put Actor and Critic ranks into one data-parallel group (their
gradients averaged together) or fail for a world that ``tp`` does not divide.
``_init_tp_mesh_device`` returns early when ``groups._TENSOR_MODEL_PARALLEL_GROUP`` is
already set, so :func:`install_role_groups` sets DeepSpeed's own group registry (tensor,
model and data parallel group) to this role's groups before ``deepspeed.initialize``, and
the module ``deepspeed.utils.groups`` itself is passed as ``mpu`` (it implements
``get_{tensor_model,model,data}_parallel_{group,rank,world_size}``). Every DeepSpeed
collective then runs in the role's TP group or in a one-rank data-parallel group. This is
recorded as a shim in ``outputs.json``; it changes which ranks talk, not the arithmetic.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Final, Literal

import torch
import torch.distributed as dist
from torch import nn

from qualify.contract import OptimizerSpec
from qualify.errors import HarnessError

Role = Literal["actor", "critic"]

SHM_OP_NAME: Final = "deepspeed_shm_comm"
"""``ShareMemCommBuilder.NAME``: the CPU shared-memory all-reduce op DeepSpeed JIT-builds."""

GROUPS_SHIM: Final = ("deepspeed.utils.groups: _TENSOR_MODEL_PARALLEL_GROUP / _MODEL_PARALLEL_GROUP"
                      " / _DATA_PARALLEL_GROUP set to the role's TP group and a one-rank DP "
                      "group before deepspeed.initialize(mpu=deepspeed.utils.groups) "
                      "(DeepSpeed's _init_tp_mesh_device spans the whole world)")
SHM_SHIM: Final = ("deepspeed.ops.__compatible_ops__['deepspeed_shm_comm'] = False: the CPU "
                   "shared-memory comm op is not JIT-built; TorchBackend.inference_all_reduce "
                   "falls back to torch.distributed.all_reduce (the same sum the op computes)")


def role_ranks(actor_tp: int, critic_tp: int) -> dict[Role, tuple[int, ...]]:
    """Global ranks of each role that runs (a role with TP 0 is absent).

    Args:
        actor_tp: Actor TP size (0 = no Actor).
        critic_tp: Critic TP size (0 = no Critic).

    Returns:
        ``{"actor": (0, .., actor_tp - 1), "critic": (actor_tp, ..)}``.
    """
    out: dict[Role, tuple[int, ...]] = {}
    if actor_tp:
        out["actor"] = tuple(range(actor_tp))
    if critic_tp:
        out["critic"] = tuple(range(actor_tp, actor_tp + critic_tp))
    return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """This rank's place in the launch.

    Attributes:
        role: ``actor`` or ``critic``.
        ranks: global ranks of the role (its TP group, in TP order).
        tp_rank: index of this rank in ``ranks``.
        tp_group: the role's process group.
        dp_group: a process group holding only this rank (data parallel size 1).
    """

    role: Role
    ranks: tuple[int, ...]
    tp_rank: int
    tp_group: Any
    dp_group: Any

    @property
    def tp(self) -> int:
        """TP size of the role."""
        return len(self.ranks)


def build_placement(*, actor_tp: int, critic_tp: int, rank: int, timeout_s: float) -> Placement:
    """Create every role group and one-rank group (collective: all ranks, same order).

    Args:
        actor_tp: Actor TP size.
        critic_tp: Critic TP size.
        rank: this process's global rank.
        timeout_s: timeout of every collective of the new groups.

    Raises:
        HarnessError: ``rank`` belongs to no role.
    """
    timeout = timedelta(seconds=timeout_s)
    roles = role_ranks(actor_tp, critic_tp)
    groups = {role: dist.new_group(list(rs), timeout=timeout) for role, rs in roles.items()}
    world = actor_tp + critic_tp
    singles = [dist.new_group([r], timeout=timeout) for r in range(world)]
    for role, rs in roles.items():
        if rank in rs:
            return Placement(role=role, ranks=rs, tp_rank=rs.index(rank), tp_group=groups[role],
                             dp_group=singles[rank])
    raise HarnessError(f"rank {rank} is in no role (actor_tp={actor_tp}, critic_tp={critic_tp})")


def install_role_groups(placement: Placement) -> Any:
    """Point DeepSpeed's group registry at this role's groups; return the ``mpu`` to pass.

    Sets ``deepspeed.utils.groups._TENSOR_MODEL_PARALLEL_GROUP`` and
    ``_MODEL_PARALLEL_GROUP`` to the role's TP group and ``_DATA_PARALLEL_GROUP`` to the
    one-rank group, and clears the cached TP size / rank overrides. Call before every
    ``deepspeed.initialize`` (a fresh engine per variant).

    Returns:
        The module ``deepspeed.utils.groups`` (DeepSpeed's own ``mpu`` implementation).
    """
    from deepspeed.utils import groups

    groups._TENSOR_MODEL_PARALLEL_GROUP = placement.tp_group
    groups._MODEL_PARALLEL_GROUP = placement.tp_group
    groups._DATA_PARALLEL_GROUP = placement.dp_group
    groups._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = None
    groups._MPU_TENSOR_MODEL_PARALLEL_RANK = None
    return groups


def initialize_args(device: torch.device) -> Any:
    """The ``args`` of ``deepspeed.initialize``: ``device_rank`` = the rank's CUDA device.

    DeepSpeed's engine sets its device from ``args.device_rank``, else from ``LOCAL_RANK``
    (``DeepSpeedEngine._set_distributed_vars``): with ranks sharing a GPU
    (:func:`harnesses.common.role_device`, Actor TP1 + Critic TP1 on one GPU) ``LOCAL_RANK`` 1
    names a device that does not exist. ``None`` on CPU (DeepSpeed's default path).
    """
    if device.type != "cuda":
        return None
    return types.SimpleNamespace(device_rank=device.index)


def skip_shm_comm_build() -> None:
    """Mark DeepSpeed's CPU shared-memory comm op unavailable, so it is never JIT-compiled.

    ``deepspeed.comm.torch.build_shm_op`` builds the op only when
    ``deepspeed.ops.__compatible_ops__[SHM_OP_NAME]`` is true (a dict DeepSpeed probes once
    and caches; edits persist). The op serves only ``inference_all_reduce``; without it that
    call is ``torch.distributed.all_reduce`` on the same group (AutoTP's training
    row-parallel layers call ``all_reduce`` directly either way).
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_OP_NAME] = False


def ds_config(*, precision: str, zero: int, tp: int, micro_batch_size: int, n_micro: int,
              lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
              max_grad_norm: float, scheduler: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config of one role x variant (data parallel size 1).

    - ``optimizer``: ``AdamW`` with ``torch_adam: true`` (``torch.optim.AdamW``, decoupled
      weight decay, bias correction), the contract's lr / betas / eps / weight decay.
    - ``gradient_clipping``: the contract's ``max_grad_norm`` (global-norm clipping by the
      engine before the step).
    - ``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps``: the contract's
      micro-batch size and the number of micro-batches; ``train_batch_size`` their product.
    - ``zero_optimization.stage``: 0, 1 or 2.
    - ``tensor_parallel.autotp_size``: the role's TP size when > 1 (AutoTP training).
    - ``bf16``: ``{"enabled": true}`` for ``bf16`` (BF16 module parameters, FP32 master
      weights and optimizer state), plus ``communication_data_type = "fp32"`` (gradients
      reduced in FP32, as the contract asks; DeepSpeed's BF16 default is BF16) and
      ``data_types.grad_accum_dtype = "fp32"`` at ZeRO 1 and 2 (FP32 gradient accumulation,
      as the contract asks). DeepSpeed 0.19.8 rejects
      FP32 accumulation without ZeRO (``NotImplementedError: unsupported mix of
      model_dtype=torch.bfloat16 and grad_accum_dtype=torch.float32``), so ZeRO 0 BF16
      accumulates gradients in BF16, DeepSpeed's only BF16 mode there; the dtype is reported.
    - ``scheduler``: DeepSpeed's own lr scheduler (:func:`ds_scheduler`), when not ``None``.

    Args:
        precision: ``fp32`` or ``bf16``.
        zero: ZeRO stage (0, 1, 2).
        tp: the role's TP size.
        micro_batch_size: sequences per micro-batch.
        n_micro: micro-batches per optimizer step.
        lr: AdamW learning rate.
        betas: AdamW ``(β1, β2)``.
        eps: AdamW epsilon.
        weight_decay: AdamW decoupled weight decay.
        max_grad_norm: global-norm clipping threshold.
        scheduler: the config's ``scheduler`` section (``None``: no scheduler, the lr stays).

    Raises:
        HarnessError: a ZeRO stage other than 0, 1, 2 or an unknown precision.
    """
    if zero not in (0, 1, 2):
        raise HarnessError(f"ZeRO stage {zero}: the deepspeed harness runs stages 0, 1, 2")
    if precision not in ("fp32", "bf16"):
        raise HarnessError(f"precision {precision!r}: deepspeed runs fp32 or bf16")
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": n_micro,
        "train_batch_size": micro_batch_size * n_micro,
        "gradient_clipping": max_grad_norm,
        "optimizer": {"type": "AdamW", "params": {
            "lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay,
            "torch_adam": True}},
        "zero_optimization": {"stage": zero},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        cfg["communication_data_type"] = "fp32"
        if zero in (1, 2):
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def reduction_dtypes(engine: Any) -> tuple[dict[str, set[torch.dtype]],
                                           dict[str, set[torch.dtype]]]:
    """The gradient reduction and accumulation dtypes of a built DeepSpeed engine.

    Read back from the engine after ``deepspeed.initialize``, not from the config dict:
    ``engine.communication_data_type`` (what ``buffered_allreduce_fallback`` reduces in at
    ZeRO 0, and what the engine hands its ZeRO optimizer; under sequence parallelism the
    engine sets it to ``seq_parallel_communication_data_type``), ``engine.get_data_types()``'s
    gradient accumulation dtype, and, from the optimizer wrapper (``DeepSpeedZeroOptimizer``
    at ZeRO 1 and 2, ``BF16_Optimizer``), its ``communication_data_type``, the dtypes of its
    reduction buckets (``ipg_buckets``) and its ``gradient_accumulation_dtype`` /
    ``grad_acc_dtype``, each where the wrapper has it.

    Returns:
        ``(reduction, accumulation)``: ``"<object>.<attribute>"`` -> dtypes.
    """
    reduce: dict[str, set[torch.dtype]] = {
        "engine.communication_data_type": {engine.communication_data_type}}
    accum: dict[str, set[torch.dtype]] = {
        "engine.get_data_types.grad_accum_dtype": {engine.get_data_types()[1]}}
    opt = engine.optimizer
    kind = type(opt).__name__
    comm = getattr(opt, "communication_data_type", None)
    if isinstance(comm, torch.dtype):
        reduce[f"{kind}.communication_data_type"] = {comm}
    buckets = getattr(opt, "ipg_buckets", None)
    if isinstance(buckets, dict) and buckets:
        reduce[f"{kind}.ipg_buckets"] = {d for d in buckets if isinstance(d, torch.dtype)}
    for attr in ("gradient_accumulation_dtype", "grad_acc_dtype"):
        got = getattr(opt, attr, None)
        if isinstance(got, torch.dtype):
            accum[f"{kind}.{attr}"] = {got}
    return reduce, accum


DS_SCHEDULER_NOTE: Final = ("client lr_scheduler: deepspeed.initialize(lr_scheduler=callable) "
                             "builds transformers.get_scheduler on the engine's basic optimizer "
                             "(engine._configure_lr_scheduler); engine.step() steps it after the "
                             "optimizer step; lr = engine.get_lr() just before engine.step()")


def one_lr(lrs: Sequence[float], round_: int) -> float:
    """The one lr of ``engine.get_lr()`` (its param groups' ``lr``) for round ``round_``.

    Raises:
        HarnessError: the param groups hold different lrs.
    """
    found = sorted({float(x) for x in lrs})
    if len(found) != 1:
        raise HarnessError(f"round {round_}: DeepSpeed param groups hold lrs {found}")
    return found[0]


def ds_scheduler(o: OptimizerSpec, lr: float) -> dict[str, Any] | None:
    """The DeepSpeed ``scheduler`` config of the contract's lr schedule (its real classes).

    Not what the harness runs (it passes a client scheduler, README "The lr schedule"): the
    repro of the finding that DeepSpeed's config schedulers cannot express the contract's
    schedule (``tests/test_lr_schedule.py::test_deepspeed_config_schedulers``).

    ``o``: the contract's ``[optimizer]`` (``lr_schedule``, ``W = warmup_steps``,
    ``T = total_steps``, ``r = min_lr_ratio``); ``lr``: the role's base lr.

    ``deepspeed.initialize`` builds it (``DeepSpeedEngine._scheduler_from_config``) and
    ``engine.step()`` steps it after each optimizer step (``_take_model_step``); it is
    built with ``last_batch_iteration = -1`` and never stepped before step 1.

    - ``constant``: ``None`` (no scheduler: the optimizer's lr);
    - ``linear``: ``WarmupDecayLR`` (``warmup_min_lr = 0``, ``warmup_max_lr = lr``,
      ``warmup_type = "linear"``, ``total_num_steps = T``); it decays to 0, it has no end
      lr (a contract ``min_lr_ratio > 0`` is not expressible);
    - ``cosine``: ``WarmupCosineLR`` (``warmup_min_ratio = 0``, ``cos_min_ratio = r``,
      ``warmup_type = "linear"``, ``total_num_steps = T``).

    ``warmup_num_steps`` is ``max(1, W)``: DeepSpeed refuses 0 (``ValueError``) and raises
    any value below 2 to 2 itself (``max(2, warmup_num_steps)``), so a contract ``W < 2``
    is not expressible either. Nothing is corrected here: where DeepSpeed's lr differs
    from the contract's, the cell's ``lr`` rows fail (a finding, not a harness fix).
    """
    if o.lr_schedule == "constant":
        return None
    warm = max(1, o.warmup_steps)
    if o.lr_schedule == "linear":
        return {"type": "WarmupDecayLR", "params": {
            "total_num_steps": o.total_steps, "warmup_min_lr": 0.0, "warmup_max_lr": lr,
            "warmup_num_steps": warm, "warmup_type": "linear"}}
    if o.lr_schedule == "cosine":
        return {"type": "WarmupCosineLR", "params": {
            "total_num_steps": o.total_steps, "warmup_min_ratio": 0.0,
            "warmup_num_steps": warm, "cos_min_ratio": o.min_lr_ratio, "warmup_type": "linear"}}
    raise HarnessError(f"optimizer.lr_schedule {o.lr_schedule!r}: no DeepSpeed scheduler mapped")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ParamLayout:
    """How AutoTP laid out one HF parameter on this rank.

    Attributes:
        name: HF parameter name.
        layer: the module holding it (an AutoTP ``TensorParallel_Layer`` when sharded).
        dim: the dimension sharded over the TP group, ``None`` when replicated.
    """

    name: str
    layer: nn.Module
    dim: int | None


def tp_layout(model: nn.Module) -> list[ParamLayout]:
    """Every trainable parameter with its AutoTP shard dimension (HF names, model order).

    The dimension comes from the universal-checkpoint metadata AutoTP attaches to each
    parameter it shards (``deepspeed.module_inject.layers._get_param_uc_conversion_meta``:
    ``partition_dim``, ``replicated``); a parameter without it (embeddings, norms, the
    critic's ``score``) is whole on every rank.

    A tied parameter (SmolLM2's ``lm_head.weight`` is ``model.embed_tokens.weight``) is
    listed once, under its first name, as ``named_parameters()`` and the HF reference list it.

    Raises:
        HarnessError: a sharded layout other than a plain split along one dimension
            (sub-parameter / fused layouts are not gathered by this harness).
    """
    from deepspeed.module_inject.layers import _get_param_uc_conversion_meta

    out: list[ParamLayout] = []
    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{pname}" if mod_name else pname
            meta = _get_param_uc_conversion_meta(p)
            dim: int | None = None
            if meta and not meta.get("replicated") and meta.get("partition_dim") is not None \
                    and getattr(mod, "is_tp_parallel", False):
                if meta.get("sub_param_shape") or meta.get("unsupported_reason"):
                    raise HarnessError(f"{name}: AutoTP layout {meta.get('partition_type')} with "
                                       f"sub-parameters is not gathered by this harness")
                dim = int(meta["partition_dim"])
            out.append(ParamLayout(name=name, layer=mod, dim=dim))
    return out
