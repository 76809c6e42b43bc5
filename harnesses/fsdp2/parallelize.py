"""How the fsdp2 harness places ranks, slices the batch and applies ``fully_shard``.

Placement (:func:`build_role_mesh`): each role runs on ``dp x tp`` ranks: the Actor on
global ranks ``[0, actor_tp dp)``, the Critic on the next ``critic_tp dp`` (a role with
TP 0 is absent); inside a role, rank ``i = d tp + t`` is DP rank ``d``, TP rank ``t`` (TP
groups contiguous, ``init_device_mesh``'s layout). Each role gets its own process groups
(``dist.new_group`` with the cell's collective timeout): at TP 1 one group wrapped in a
1-D :class:`~torch.distributed.device_mesh.DeviceMesh` ``("dp",)``, at TP > 1 its DP and
TP groups wrapped in a 2-D mesh ``("dp", "tp")`` by ``DeviceMesh.from_group``
(``init_device_mesh`` always spans the whole world; the roles are disjoint sub-meshes).
At TP > 1 the model is first parallelised over the ``tp`` sub-mesh
(:mod:`harnesses.fsdp2.tensor_parallel`), then ``fully_shard``-ed over the ``dp`` sub-mesh.

Data parallelism (:func:`dp_rows`): DP rank ``d`` (every TP rank of it alike) takes the
contiguous rows ``[d B / dp, (d + 1) B / dp)`` of the frozen batch (verl's
``DataProto.chunk``) and micro-batches them with the contract's ``micro_batch_size``.
Every loss is the sum over the rank's valid tokens divided by the **global** valid-token
count ``N`` (the whole batch's), so the gradients of the ranks *add up* to the single-rank
gradient: they must be reduced once by a sum, not averaged.

Sharding (:func:`shard_model`), torchtitan's FSDP2 recipe
(``torchtitan/models/llama3/infra/parallelize.py::apply_fsdp``): ``fully_shard`` on each
decoder layer, then on the root (which takes the embeddings, the final norm and the LM
head or value head), with ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``:
``param_dtype`` is FP32 for ``fp32`` cells and BF16 for ``bf16`` cells. Every parameter
becomes a ``Shard(0)`` DTensor on the role's mesh (FP32: the master weights); each forward
all-gathers the unsharded parameters in ``param_dtype``; each backward reduce-scatters the
gradients in FP32 into the FP32 sharded ``.grad`` (one reduce-scatter per micro-batch, so
micro-batch gradients accumulate in FP32).

Gradient reduction (:func:`set_sum_reduction`): FSDP2 by default divides the reduced
gradient by the DP size (a mean over ranks, right for a loss averaged per rank). Here the
loss is already normalised by the global ``N``, so every FSDP module is set to
``set_gradient_divide_factor(1.0)`` (a plain sum) and ``set_force_sum_reduction_for_comms
(True)`` (gloo has no ``ReduceOp.AVG`` / ``PREMUL_SUM``; FSDP2 then uses ``SUM`` with its
own pre/post division, here by 1). The fault ``grad_averaged_twice`` leaves FSDP2's default
divide factor in place (:mod:`harnesses.fsdp2.faults`).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from qualify.errors import HarnessError

Role = Literal["actor", "critic"]
MESH_DIM: str = "dp"
TP_DIM: str = "tp"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoleMesh:
    """This rank's place in the launch.

    Attributes:
        role: ``actor`` or ``critic``.
        ranks: global ranks of the role, ascending (``dp x tp`` of them; role-local index
            ``i = dp_rank * tp + tp_rank``: TP groups are contiguous, as
            ``init_device_mesh`` lays out ``("dp", "tp")``).
        tp: the role's TP degree.
        dp_rank: this rank's index along ``dp``.
        tp_rank: this rank's index along ``tp``.
        group: the role's process group (all its ranks; the cell's collective timeout).
        dp_group: the ranks with this rank's ``tp_rank`` (the batch rows are split here).
        tp_group: the ranks with this rank's ``dp_rank`` (the same rows, other shards).
        mesh: ``("dp",)`` at TP 1, else the 2-D ``("dp", "tp")`` mesh of the role.
    """

    role: Role
    ranks: tuple[int, ...]
    tp: int
    dp_rank: int
    tp_rank: int
    group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    mesh: DeviceMesh

    @property
    def dp(self) -> int:
        """DP (shard) size of the role."""
        return len(self.ranks) // self.tp

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The 1-D ``dp`` mesh ``fully_shard`` shards over."""
        return self.mesh if self.tp == 1 else self.mesh[MESH_DIM]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D ``tp`` sub-mesh (``None`` at TP 1: no tensor parallelism)."""
        return None if self.tp == 1 else self.mesh[TP_DIM]

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """``("dp",)`` or ``("dp", "tp")``."""
        return (MESH_DIM,) if self.tp == 1 else (MESH_DIM, TP_DIM)


def role_ranks(actor_tp: int, critic_tp: int, dp: int) -> dict[Role, tuple[int, ...]]:
    """Global ranks of each role that runs: ``tp x dp`` ranks each, Actor first.

    Args:
        actor_tp: Actor TP size (0 = no Actor).
        critic_tp: Critic TP size (0 = no Critic).
        dp: the cell's DP degree.
    """
    out: dict[Role, tuple[int, ...]] = {}
    n_actor = actor_tp * dp
    if actor_tp:
        out["actor"] = tuple(range(n_actor))
    if critic_tp:
        out["critic"] = tuple(range(n_actor, n_actor + critic_tp * dp))
    return out


def grid(ranks: tuple[int, ...], tp: int) -> list[list[int]]:
    """The role's ranks as a ``[dp][tp]`` grid (row ``d`` = the TP group of DP rank ``d``)."""
    return [list(ranks[d * tp:(d + 1) * tp]) for d in range(len(ranks) // tp)]


def build_role_mesh(*, actor_tp: int, critic_tp: int, dp: int, rank: int, device_type: str,
                    timeout_s: float) -> RoleMesh:
    """Create every role's groups (collectively, in one order on all ranks); return this rank's.

    Per role: the role group, then one TP group per DP rank, then one DP group per TP rank
    (``dist.new_group`` is collective over the world, so every rank creates every group).
    At TP 1 the mesh is the 1-D ``("dp",)`` mesh of the role group; else
    ``DeviceMesh.from_group([dp_group, tp_group], mesh=grid)`` named ``("dp", "tp")``
    (``init_device_mesh`` would span the whole world; the roles are disjoint meshes).

    Raises:
        HarnessError: ``rank`` belongs to no role (world larger than the cell).
    """
    timeout = timedelta(seconds=timeout_s)
    tps: dict[Role, int] = {"actor": actor_tp, "critic": critic_tp}
    mine: RoleMesh | None = None
    for role, ranks in role_ranks(actor_tp, critic_tp, dp).items():
        tp = tps[role]
        rows = grid(ranks, tp)
        group = dist.new_group(list(ranks), timeout=timeout)
        tp_groups = [dist.new_group(row, timeout=timeout) for row in rows]
        dp_groups = [dist.new_group([row[t] for row in rows], timeout=timeout)
                     for t in range(tp)]
        if rank not in ranks:
            continue
        assert group is not None
        d, t = divmod(ranks.index(rank), tp)
        dp_group, tp_group = dp_groups[t], tp_groups[d]
        assert dp_group is not None
        assert tp_group is not None
        if tp == 1:
            mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=(MESH_DIM,))
        else:
            mesh = DeviceMesh.from_group([dp_group, tp_group], device_type,
                                         mesh=torch.tensor(rows, dtype=torch.int),
                                         mesh_dim_names=(MESH_DIM, TP_DIM))
        mine = RoleMesh(role=role, ranks=ranks, tp=tp, dp_rank=d, tp_rank=t, group=group,
                        dp_group=group if tp == 1 else dp_group, tp_group=tp_group, mesh=mesh)
    if mine is None:
        raise HarnessError(f"rank {rank} belongs to no role (actor_tp={actor_tp}, "
                           f"critic_tp={critic_tp}, dp={dp})")
    return mine


def dp_rows(batch_rows: int, dp: int, dp_rank: int, micro_batch_size: int) -> slice:
    """The contiguous rows of the frozen batch that DP rank ``dp_rank`` trains on.

    Args:
        batch_rows: ``B``, rows of the whole batch.
        dp: DP degree.
        dp_rank: this rank's index in its DP group.
        micro_batch_size: the contract's micro-batch size (sequences per micro-batch).

    Returns:
        ``slice(d B / dp, (d + 1) B / dp)``.

    Raises:
        HarnessError: ``B`` is not divisible by ``dp`` (every rank must run the same number
            of forward/backward passes: each is a collective under FSDP2).
    """
    if dp < 1 or not 0 <= dp_rank < dp:
        raise HarnessError(f"dp rank {dp_rank} of dp {dp}: not a valid placement")
    if batch_rows % dp:
        raise HarnessError(f"the frozen batch has {batch_rows} rows, not divisible by dp = "
                           f"{dp}: every DP rank must take as many rows (and micro-batches "
                           f"of {micro_batch_size}) as the others")
    per = batch_rows // dp
    return slice(dp_rank * per, (dp_rank + 1) * per)


def mp_policy(precision: str) -> MixedPrecisionPolicy:
    """``MixedPrecisionPolicy`` of a cell: BF16 or FP32 compute parameters, FP32 reduction.

    Raises:
        HarnessError: a precision other than ``fp32`` / ``bf16``.
    """
    if precision not in ("fp32", "bf16"):
        raise HarnessError(f"precision {precision!r}: fsdp2 runs fp32 or bf16")
    param = torch.bfloat16 if precision == "bf16" else torch.float32
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=torch.float32,
                                output_dtype=None, cast_forward_inputs=True)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ShardingInfo:
    """What :func:`shard_model` did (recorded in ``outputs.json``).

    Attributes:
        units: module names given to ``fully_shard`` (``""`` = the root), in order.
        sharded: HF names of parameters sharded over the mesh.
        replicated: HF names of parameters whose placements are all ``Replicate``.
        tp_replicated: HF names of parameters replicated along ``tp`` (sharded on ``dp``).
        placements: HF name -> its placements (``["Shard(dim=0)", "Replicate()"]``).
        param_dtype: the policy's compute dtype of the unsharded parameters.
        reduce_dtype: the policy's gradient reduction dtype.
    """

    units: tuple[str, ...]
    sharded: tuple[str, ...]
    replicated: tuple[str, ...]
    tp_replicated: tuple[str, ...]
    placements: dict[str, list[str]]
    param_dtype: str
    reduce_dtype: str


def _layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    prefix = str(getattr(model, "base_model_prefix", "model"))
    backbone = getattr(model, prefix, None)
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise HarnessError(f"{type(model).__name__}: no decoder layers at .{prefix}.layers")
    return f"{prefix}.layers", layers


def shard_model(model: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> ShardingInfo:
    """``fully_shard`` each decoder layer, then the root, in place (module docstring).

    Args:
        model: HF ``*ForCausalLM`` or ``*ForTokenClassification`` on the mesh's device, FP32;
            at TP > 1 already parallelised over the ``tp`` sub-mesh
            (:func:`harnesses.fsdp2.tensor_parallel.apply_tp`): FSDP2 then shards each
            TP DTensor along ``dp`` too (2-D DTensors on the role's ``("dp", "tp")`` mesh).
        mesh: the role's 1-D DP mesh (at TP > 1 the ``dp`` sub-mesh of the 2-D mesh).
        policy: the cell's mixed-precision policy (:func:`mp_policy`).

    Raises:
        HarnessError: no decoder layers, or a parameter left a plain tensor.
    """
    where, layers = _layers(model)
    units: list[str] = []
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
        units.append(f"{where}.{i}")
    fully_shard(model, mesh=mesh, mp_policy=policy)
    units.append("")
    sharded: list[str] = []
    replicated: list[str] = []
    loose: list[str] = []
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            loose.append(name)
        elif all(pl.is_replicate() for pl in p.placements):
            replicated.append(name)
        else:
            sharded.append(name)
    if loose:
        raise HarnessError(f"{type(model).__name__}: parameters outside fully_shard (not "
                           f"DTensors): {loose[:5]}")
    return ShardingInfo(units=tuple(units), sharded=tuple(sharded), replicated=tuple(replicated),
                        tp_replicated=tuple(n for n, _ in tp_replicated_parameters(model)),
                        placements={n: [repr(pl) for pl in p.placements]
                                    for n, p in model.named_parameters()
                                    if isinstance(p, DTensor)},
                        param_dtype=str(policy.param_dtype), reduce_dtype=str(policy.reduce_dtype))


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """Every module ``fully_shard`` was applied to (the root last)."""
    found: list[FSDPModule] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return found[::-1]


def set_sum_reduction(model: nn.Module, *, divide_factor: float | None) -> dict[str, Any]:
    """Set how every FSDP unit reduces gradients over the DP group.

    Args:
        model: the sharded model.
        divide_factor: the gradient divide factor: ``1.0`` (a sum: the losses are already
            normalised by the global token count) or ``None`` (FSDP2's default: divide by
            the DP size, the fault ``grad_averaged_twice``).

    Returns:
        What was set (for ``outputs.json``).
    """
    for m in fsdp_modules(model):
        m.set_force_sum_reduction_for_comms(True)
        if divide_factor is not None:
            m.set_gradient_divide_factor(divide_factor)
    return {"force_sum_reduction_for_comms": True,
            "gradient_divide_factor": divide_factor if divide_factor is not None
            else "FSDP2 default (the DP size)"}


def reduction_dtypes(model: nn.Module) -> tuple[dict[str, set[torch.dtype]],
                                                 dict[str, set[torch.dtype]]]:
    """The gradient reduction and accumulation dtypes FSDP2 holds for ``model``'s parameters.

    Read back from the engine, not from the policy this module built: each FSDP unit's
    parameter group (``FSDPModule._get_fsdp_state()._fsdp_param_group``) and its
    ``FSDPParam``s, whose dtypes FSDP2 fixes at its lazy init (the root's first forward), so
    call it after a forward. FSDP2's ``foreach_reduce`` reduce-scatters (and, for HSDP,
    all-reduces) in ``reduce_dtype``, which FSDP2 sets to ``None`` when it equals the
    unsharded parameter's ``param_dtype``: the gradient is then reduced in the dtype
    autograd produced it in (``param_dtype``, or ``orig_dtype`` without mixed precision).
    The reduced shard is cast to ``orig_dtype`` (the sharded parameter's dtype) and summed
    into the sharded ``.grad`` across micro-batches.

    Returns:
        ``(reduction, accumulation)``: name -> the set of dtypes over every parameter,
        ``{"fully_shard.reduce_scatter": ...}`` and ``{"fully_shard.sharded_grad": ...}``;
        empty before lazy init.
    """
    reduce: set[torch.dtype] = set()
    accum: set[torch.dtype] = set()
    for m in fsdp_modules(model):
        group = m._get_fsdp_state()._fsdp_param_group
        for fp in group.fsdp_params if group is not None else ():
            if not hasattr(fp, "orig_dtype"):  # lazy init not run yet
                continue
            reduce.add(fp.reduce_dtype or fp.param_dtype or fp.orig_dtype)
            accum.add(fp.orig_dtype)
    return (({"fully_shard.reduce_scatter": reduce} if reduce else {}),
            ({"fully_shard.sharded_grad": accum} if accum else {}))


def reshard(model: nn.Module) -> None:
    """Free the unsharded parameters (the root keeps them after a forward without backward)."""
    for m in fsdp_modules(model):
        m.reshard()


def replicated_parameters(model: nn.Module) -> list[tuple[str, DTensor]]:
    """``(HF name, parameter)`` of every parameter whose placements are all ``Replicate``."""
    return [(n, p) for n, p in model.named_parameters()
            if isinstance(p, DTensor) and all(pl.is_replicate() for pl in p.placements)]


def tp_replicated_parameters(model: nn.Module) -> list[tuple[str, DTensor]]:
    """``(HF name, parameter)`` of the 2-D parameters replicated along ``tp``.

    Their local ``dp`` shards must be bitwise equal on the ranks of each TP group (the
    replica check); empty at TP 1 (1-D ``("dp",)`` parameters).
    """
    out: list[tuple[str, DTensor]] = []
    for n, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        names = p.device_mesh.mesh_dim_names or ()
        if TP_DIM in names and p.placements[names.index(TP_DIM)].is_replicate():
            out.append((n, p))
    return out
