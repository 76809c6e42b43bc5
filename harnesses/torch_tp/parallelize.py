"""How torch_tp places ranks and shards a Hugging Face decoder over a 1-D TP mesh.

Placement (:func:`build_role_mesh`): ranks ``[0, actor_tp)`` run the Actor and ranks
``[actor_tp, actor_tp + critic_tp)`` the Critic. Each role gets its own process group
(``dist.new_group`` with the cell's collective timeout, so a hang becomes an error) wrapped
in a 1-D :class:`~torch.distributed.device_mesh.DeviceMesh` named ``("tp",)`` by
``DeviceMesh.from_group``. ``init_device_mesh`` cannot be used here: it always spans the
whole world, and the two roles are disjoint sub-meshes of different sizes.

Sharding (:func:`parallelize_model`), torchtitan's Qwen3 plan without sequence parallelism
(``torchtitan/models/qwen3/infra/parallelize.py``), applied with
:func:`torch.distributed.tensor.parallel.parallelize_module`:

==============================================  ==========================================
module                                          style
==============================================  ==========================================
``self_attn.{q,k,v}_proj``, ``mlp.{gate,up}``   ``ColwiseParallel()``: rank ``r`` holds
                                                query heads ``[r H/tp, (r+1) H/tp)`` and KV
                                                heads ``[r K/tp, (r+1) K/tp)``
``self_attn.o_proj``, ``mlp.down_proj``         ``RowwiseParallel()`` (all-reduce)
``self_attn.{q,k}_norm`` (Qwen3 per-head norm)  ``SequenceParallel(sequence_dim=2)``: the
                                                input ``[B, T, H/tp, d]`` is sharded on the
                                                head dim, the weight replicated; its
                                                gradient is summed over ranks
embeddings, layer norms, final norm, ``score``  :class:`ReplicateParallel` (Replicate
                                                DTensor parameters, local activations)
``lm_head``                                     ``ColwiseParallel(use_local_output=False)``:
                                                vocab-parallel logits ``Shard(-1)``
                                                (replicated when the embeddings are tied)
==============================================  ==========================================

Every parameter ends up a DTensor on the role's mesh (checked), so
``torch.nn.utils.clip_grad_norm_`` counts replicated parameters once and sharded ones
across ranks. HF's attention reshapes with ``view(*input_shape, -1, head_dim)`` and
``reshape(*input_shape, -1)`` (transformers 5.19 ``Qwen3Attention.forward``), so local
heads need no patch; ``num_key_value_groups`` (``H / K``) is the same locally.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from qualify.errors import HarnessError

Role = Literal["actor", "critic"]
LmHeadMode = Literal["vocab_parallel", "replicated"]

_LAYER_STYLES: dict[str, str] = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "self_attn.q_norm": "head_norm",
    "self_attn.k_norm": "head_norm",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
    "input_layernorm": "replicate",
    "post_attention_layernorm": "replicate",
}
"""Style of each submodule of a decoder layer, by its name inside the layer."""


class ReplicateParallel(ParallelStyle):
    """Keep a module whole on every rank: parameters become ``Replicate()`` DTensors.

    Inputs (plain tensors equal on every rank: token ids, the replicated residual stream)
    are wrapped as ``Replicate()`` DTensors and outputs returned as local tensors, so the
    module computes exactly what a single device would; its parameter gradients are
    equal on all ranks because every input and upstream gradient is. This is torchtitan's
    ``NoParallel`` without the MoE-specific layouts.
    """

    def _replicate_params(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        del name
        for pname, param in list(module.named_parameters(recurse=False)):
            replicated = distribute_tensor(param.detach(), mesh, [Replicate()],
                                           src_data_rank=self.src_data_rank)
            module.register_parameter(
                pname, nn.Parameter(replicated, requires_grad=param.requires_grad))

    @staticmethod
    def _wrap_inputs(module: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
        del module
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
            for x in inputs)

    @staticmethod
    def _unwrap_output(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        del module, mesh
        return output.to_local() if isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate_params,
                                 self._wrap_inputs, self._unwrap_output)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoleMesh:
    """This rank's place in the launch.

    Attributes:
        role: ``actor`` or ``critic``.
        ranks: global ranks of the role's TP group, ascending.
        tp_rank: this rank's index in ``ranks``.
        group: the TP process group (its timeout is the cell's collective timeout).
        mesh: 1-D DeviceMesh ``("tp",)`` over ``group``.
    """

    role: Role
    ranks: tuple[int, ...]
    tp_rank: int
    group: dist.ProcessGroup
    mesh: DeviceMesh

    @property
    def tp(self) -> int:
        """TP size of the role."""
        return len(self.ranks)


def role_ranks(actor_tp: int, critic_tp: int) -> dict[Role, tuple[int, ...]]:
    """Global ranks of each role that runs (``actor_tp`` / ``critic_tp`` of 0 = absent)."""
    out: dict[Role, tuple[int, ...]] = {}
    if actor_tp:
        out["actor"] = tuple(range(actor_tp))
    if critic_tp:
        out["critic"] = tuple(range(actor_tp, actor_tp + critic_tp))
    return out


def build_role_mesh(*, actor_tp: int, critic_tp: int, rank: int, device_type: str,
                    timeout_s: float) -> RoleMesh:
    """Create every role's TP group (collectively, on all ranks) and return this rank's.

    Args:
        actor_tp: Actor TP size (0 = no Actor).
        critic_tp: Critic TP size (0 = no Critic).
        rank: this process's global rank.
        device_type: ``cpu`` or ``cuda``.
        timeout_s: timeout of every collective of the groups.

    Raises:
        HarnessError: ``rank`` belongs to no role (world larger than the cell).
    """
    mine: tuple[Role, tuple[int, ...], dist.ProcessGroup] | None = None
    for role, ranks in role_ranks(actor_tp, critic_tp).items():
        group = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s))
        if rank in ranks:
            assert group is not None
            mine = (role, ranks, group)
    if mine is None:
        raise HarnessError(f"rank {rank} belongs to no role (actor_tp={actor_tp}, "
                           f"critic_tp={critic_tp})")
    role, ranks, group = mine
    mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("tp",))
    return RoleMesh(role=role, ranks=ranks, tp_rank=ranks.index(rank), group=group, mesh=mesh)


def check_divisible(config: Any, tp: int) -> None:
    """Refuse a TP size that does not split heads and the MLP evenly.

    Args:
        config: the HF model config (``num_attention_heads``, ``num_key_value_heads``,
            ``intermediate_size``).
        tp: tensor-parallel size.

    Raises:
        HarnessError: a count is not divisible by ``tp`` (each rank must hold whole query
            heads and whole KV heads; KV-head replication for ``K < tp`` is not supported).
    """
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", kv),
                    ("intermediate_size", int(config.intermediate_size))):
        if n % tp:
            raise HarnessError(
                f"{what} = {n} is not divisible by TP = {tp}: torch_tp shards whole "
                f"heads / MLP columns per rank; choose a TP size that divides {n}")


def _style(kind: str) -> ParallelStyle:
    if kind == "colwise":
        return ColwiseParallel()
    if kind == "rowwise":
        return RowwiseParallel()
    if kind == "head_norm":
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if kind == "replicate":
        return ReplicateParallel()
    if kind == "vocab_parallel":
        return ColwiseParallel(use_local_output=False)
    raise AssertionError(kind)


def build_plan(model: nn.Module, *, tied: bool) -> tuple[dict[str, ParallelStyle], LmHeadMode]:
    """The explicit per-module plan (FQN -> style) for a HF ``*ForCausalLM`` or critic.

    Args:
        model: ``*ForCausalLM`` (``lm_head``) or ``*ForTokenClassification`` (``score``)
            whose backbone is ``model.<base_model_prefix>`` with ``embed_tokens``,
            ``layers`` and ``norm``.
        tied: the LM head shares its weight with the embeddings (then it is replicated).

    Returns:
        ``(plan, lm_head_mode)``.

    Raises:
        HarnessError: the model lacks the Llama/Qwen-style module names.
    """
    prefix = str(getattr(model, "base_model_prefix", "model"))
    backbone = getattr(model, prefix, None)
    if backbone is None or not hasattr(backbone, "layers"):
        raise HarnessError(f"{type(model).__name__}: no decoder backbone at .{prefix}.layers")
    plan: dict[str, str] = {f"{prefix}.embed_tokens": "replicate", f"{prefix}.norm": "replicate"}
    modules = dict(model.named_modules())
    for i in range(len(backbone.layers)):
        for suffix, kind in _LAYER_STYLES.items():
            fqn = f"{prefix}.layers.{i}.{suffix}"
            if fqn in modules:
                plan[fqn] = kind
    head: LmHeadMode = "replicated" if tied else "vocab_parallel"
    if "lm_head" in modules:
        plan["lm_head"] = "replicate" if tied else "vocab_parallel"
    if "score" in modules:
        plan["score"] = "replicate"
    return {k: _style(v) for k, v in plan.items()}, head


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ShardingInfo:
    """What :func:`parallelize_model` did (recorded in ``outputs.json``).

    Attributes:
        lm_head: ``vocab_parallel`` or ``replicated`` (``None`` for the critic).
        sharded: HF names of parameters sharded over the mesh.
        replicated: HF names of parameters replicated on every rank.
    """

    lm_head: LmHeadMode | None
    sharded: tuple[str, ...]
    replicated: tuple[str, ...]


def parallelize_model(model: nn.Module, mesh: DeviceMesh) -> ShardingInfo:
    """Shard ``model`` in place over the 1-D TP ``mesh`` (see the module docstring).

    Args:
        model: HF ``*ForCausalLM`` or ``*ForTokenClassification`` on the mesh's device.
        mesh: the role's 1-D TP mesh.

    Returns:
        What was sharded and what replicated, by HF parameter name.

    Raises:
        HarnessError: a parameter is left outside the plan (not a DTensor), or TP does not
            divide the heads (:func:`check_divisible`).
    """
    check_divisible(model.config, mesh.size())
    tied = bool(getattr(model.config, "tie_word_embeddings", False)) and hasattr(model, "lm_head")
    plan, head = build_plan(model, tied=tied)
    parallelize_module(model, mesh, plan)
    if tied:
        # Weight tying is restored after parallelisation (torchtitan does the same).
        prefix = str(getattr(model, "base_model_prefix", "model"))
        lm_head = model.get_submodule("lm_head")
        lm_head.weight = getattr(model, prefix).embed_tokens.weight
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
        raise HarnessError(f"{type(model).__name__}: parameters outside the TP plan "
                           f"(not DTensors): {loose[:5]}{' ...' if len(loose) > 5 else ''}")
    return ShardingInfo(lm_head=head if hasattr(model, "lm_head") else None,
                        sharded=tuple(sharded), replicated=tuple(replicated))


def replicated_parameters(model: nn.Module) -> list[tuple[str, DTensor]]:
    """``(HF name, parameter)`` of every parameter whose placements are all ``Replicate``."""
    return [(n, p) for n, p in model.named_parameters()
            if isinstance(p, DTensor) and all(pl.is_replicate() for pl in p.placements)]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaCheck:
    """Replicated parameters compared bitwise across the TP group after one step.

    Attributes:
        equal: HF name -> all ranks hold bitwise-equal values.
        max_abs_diff: HF name -> max |value on rank k - value on TP rank 0| over ranks.
    """

    equal: dict[str, bool]
    max_abs_diff: dict[str, float]

    @property
    def all_equal(self) -> bool:
        """Every replicated parameter is bitwise equal on every rank."""
        return all(self.equal.values())


def check_replicas(model: nn.Module, role_mesh: RoleMesh) -> ReplicaCheck:
    """Gather every replicated parameter's local value from all TP ranks and compare.

    Collective over the role's TP group (one ``all_gather`` of the concatenated values).
    Bitwise equality is judged on the FP32 bit patterns (so ``-0.0 != 0.0`` and NaN
    payloads count).

    Args:
        model: the parallelised model.
        role_mesh: the role's TP group.
    """
    reps = replicated_parameters(model)
    if role_mesh.tp == 1 or not reps:
        return ReplicaCheck(equal={n: True for n, _ in reps},
                            max_abs_diff={n: 0.0 for n, _ in reps})
    local = [p.to_local().detach().float().reshape(-1) for _, p in reps]
    flat = torch.cat(local).cpu() if role_mesh.mesh.device_type == "cpu" else torch.cat(local)
    gathered = [torch.empty_like(flat) for _ in range(role_mesh.tp)]
    dist.all_gather(gathered, flat, group=role_mesh.group)
    base = gathered[0]
    equal: dict[str, bool] = {}
    diff: dict[str, float] = {}
    offset = 0
    for (name, _), x in zip(reps, local, strict=True):
        sl = slice(offset, offset + x.numel())
        offset += x.numel()
        ref_bits = base[sl].view(torch.int32)
        equal[name] = all(torch.equal(g[sl].view(torch.int32), ref_bits) for g in gathered[1:])
        diff[name] = max(float((g[sl] - base[sl]).abs().max()) if x.numel() else 0.0
                         for g in gathered[1:])
    return ReplicaCheck(equal=equal, max_abs_diff=diff)


def reduction_dtypes(model: nn.Module) -> tuple[dict[str, set[torch.dtype]],
                                                 dict[str, set[torch.dtype]]]:
    """The gradient reduction and accumulation dtypes of a TP model, after backward.

    torch_tp has no data parallelism and no reduction dtype of its own: the only gradient
    reduction is DTensor's ``Partial -> Replicate`` redistribute of the gradients of
    replicated parameters (:func:`reduce_partial_grads`), which runs in the gradient
    DTensor's own dtype; autograd's ``AccumulateGrad`` sums micro-batches into each
    parameter's ``.grad`` DTensor in its dtype. Both are read from the gradient DTensors
    (call it before :func:`reduce_partial_grads`).

    Returns:
        ``(reduction, accumulation)``: ``{"DTensor.redistribute:replicated_param_grads":
        ...}`` (the gradients of every ``Replicate`` parameter, ``Partial`` or not) and
        ``{"AccumulateGrad:param.grad": ...}``; empty before any backward.
    """
    reduce = {p.grad.dtype for _, p in replicated_parameters(model) if p.grad is not None}
    reduce |= {p.grad.dtype for p in model.parameters()
               if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)}
    accum = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    return (({"DTensor.redistribute:replicated_param_grads": reduce} if reduce else {}),
            ({"AccumulateGrad:param.grad": accum} if accum else {}))


def reduce_partial_grads(model: nn.Module) -> list[str]:
    """All-reduce gradients that autograd left as ``Partial`` to their parameter's layout.

    The per-head norms (``q_norm`` / ``k_norm``, replicated weights applied to head-sharded
    activations) receive ``Partial(sum)`` gradients: each rank holds its heads' share.
    DTensor would reduce them lazily inside every optimizer op; reducing them once, right
    after backward, gives every replicated parameter a ``Replicate`` gradient (what the
    grad-norm, the recorded gradients and AdamW then read). Collective over the TP group.

    Returns:
        HF names of the parameters whose gradients were reduced.
    """
    reduced: list[str] = []
    for name, p in model.named_parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            assert isinstance(p, DTensor)
            p.grad = g.redistribute(g.device_mesh, p.placements)
            reduced.append(name)
    return reduced
