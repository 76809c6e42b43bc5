"""The fsdp2 harness's tensor-parallel plan: ``parallelize_module`` over the ``tp`` sub-mesh.

Applied before ``fully_shard`` (torchtitan's order, ``torchtitan/models/llama3/infra/
parallelize.py::parallelize_llama``: TP first, then FSDP over the ``dp`` sub-mesh of the
same 2-D ``("dp", "tp")`` mesh), so every parameter becomes a 2-D DTensor: FSDP2 adds
``Shard(0)`` on ``dp`` (``_StridedShard`` when TP already split dim 0) to the TP placement.

The plan is torchtitan's Qwen3 plan without sequence parallelism
(``torchtitan/models/qwen3/infra/parallelize.py``), on the Hugging Face module names:

==============================================  ==========================================
module                                          style (on the ``tp`` mesh)
==============================================  ==========================================
``self_attn.{q,k,v}_proj``, ``mlp.{gate,up}``   ``ColwiseParallel()``: TP rank ``r`` holds
                                                query heads ``[r H/tp, (r+1) H/tp)``, KV
                                                heads ``[r K/tp, (r+1) K/tp)``, MLP columns
``self_attn.o_proj``, ``mlp.down_proj``         ``RowwiseParallel()`` (all-reduce of the
                                                partial sums: the only FP32 reordering)
``self_attn.{q,k}_norm`` (per-head RMSNorm)     ``SequenceParallel(sequence_dim=2)``: the
                                                input ``[B, T, H/tp, d]`` is sharded on
                                                the head dim, the ``[d]`` weight replicated
                                                (its gradient is a ``Partial`` sum)
embeddings, layer norms, final norm, ``score``  :class:`ReplicateParallel`
``lm_head``                                     ``ColwiseParallel(output_layouts=
                                                Replicate())``: vocab-sharded weight, the
                                                logits all-gathered to the full vocab
==============================================  ==========================================

Why these three choices:

- **Embeddings replicated** (not ``RowwiseParallel``, vocab-sharded): without sequence
  parallelism the residual stream is replicated anyway; a vocab-sharded lookup would add an
  all-reduce of one non-zero term per token for no saving at this size. FSDP2 still shards
  the table over ``dp``.
- **LM head column-parallel, logits gathered** (torchtitan's setting with ``loss_parallel``
  off): the weight is vocab-sharded, the logits are all-gathered (a concatenation: each
  logit is one rank's dot product, no cross-rank sum), so the losses of
  :mod:`harnesses.fsdp2.losses` read full-vocab logits at every TP degree. Tied embeddings
  replicate the head instead (one weight, one layout).
- **Value head replicated**: ``score`` has one output row, which two TP ranks cannot split.

HF's ``Qwen3Attention.forward`` reshapes with ``view(*input_shape, -1, head_dim)`` and
``reshape(*input_shape, -1)`` (transformers 5.19), so with ``use_local_output=True`` it sees
the local ``H/tp`` heads and needs no patch; ``num_key_value_groups`` (``H / K``) is the
same locally. :func:`check_divisible` refuses a TP that splits a head.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
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

LmHead = Literal["colwise_gathered", "replicated"]
LAYER_STYLES: dict[str, str] = {
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
    """Keep a module whole on every TP rank: its parameters become ``Replicate()`` DTensors.

    Inputs (plain tensors equal on every TP rank: token ids, the replicated residual
    stream) are wrapped as ``Replicate()`` DTensors and outputs returned as local tensors,
    so the module computes what one device would. Its parameters must be DTensors on the
    TP mesh (not plain tensors) so that FSDP2 makes every parameter of the model a 2-D
    DTensor on one ``("dp", "tp")`` mesh, and ``clip_grad_norm_`` sees one mesh.
    """

    def _replicate(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        del name
        for pname, param in list(module.named_parameters(recurse=False)):
            rep = distribute_tensor(param.detach(), mesh, [Replicate()],
                                    src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(rep, requires_grad=param.requires_grad))

    @staticmethod
    def _wrap(module: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
        del module
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
                     for x in inputs)

    @staticmethod
    def _unwrap(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        del module, mesh
        return output.to_local() if isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate, self._wrap, self._unwrap)


def check_divisible(config: Any, tp: int) -> None:
    """Refuse a TP size that does not give every rank whole heads and equal MLP columns.

    Args:
        config: HF config (``num_attention_heads``, ``num_key_value_heads``,
            ``intermediate_size``).
        tp: the TP degree.

    Raises:
        HarnessError: a count not divisible by ``tp`` (KV-head replication is not built).
    """
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", kv),
                    ("intermediate_size", int(config.intermediate_size))):
        if n % tp:
            raise HarnessError(f"{what} = {n} is not divisible by TP = {tp}: fsdp2's TP plan "
                               f"gives each rank whole heads and equal MLP columns")


def _style(kind: str) -> ParallelStyle:
    styles: dict[str, ParallelStyle] = {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "head_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "replicate": ReplicateParallel(),
        "colwise_gathered": ColwiseParallel(output_layouts=Replicate()),
    }
    return styles[kind]


def build_plan(model: nn.Module, *, tied: bool) -> dict[str, str]:
    """FQN -> style name for a HF ``*ForCausalLM`` or ``*ForTokenClassification``.

    Raises:
        HarnessError: no ``.<base_model_prefix>.layers``.
    """
    prefix = str(getattr(model, "base_model_prefix", "model"))
    backbone = getattr(model, prefix, None)
    if backbone is None or not isinstance(getattr(backbone, "layers", None), nn.ModuleList):
        raise HarnessError(f"{type(model).__name__}: no decoder layers at .{prefix}.layers")
    modules = dict(model.named_modules())
    plan = {f"{prefix}.embed_tokens": "replicate", f"{prefix}.norm": "replicate"}
    for i in range(len(backbone.layers)):
        for suffix, kind in LAYER_STYLES.items():
            fqn = f"{prefix}.layers.{i}.{suffix}"
            if fqn in modules:
                plan[fqn] = kind
    if "lm_head" in modules:
        plan["lm_head"] = "replicate" if tied else "colwise_gathered"
    if "score" in modules:
        plan["score"] = "replicate"
    return plan


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TpInfo:
    """What :func:`apply_tp` did (``outputs.json`` ``parallelism.tensor_parallel``).

    Attributes:
        tp: the TP degree.
        lm_head: ``colwise_gathered`` / ``replicated``; ``None`` without an LM head.
        styles: style name -> number of modules given it.
    """

    tp: int
    lm_head: LmHead | None
    styles: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"tp": self.tp, "lm_head": self.lm_head, "styles": dict(self.styles),
                "sequence_parallel": False, "order": "parallelize_module, then fully_shard"}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> TpInfo:
    """``parallelize_module(model, tp_mesh, plan)`` in place (module docstring).

    Args:
        model: HF model, FP32, on the mesh's device, not yet ``fully_shard``-ed.
        tp_mesh: the role's 1-D ``tp`` sub-mesh of its ``("dp", "tp")`` mesh.

    Raises:
        HarnessError: TP does not divide the heads, or a parameter left outside the plan.
    """
    tp = tp_mesh.size()
    check_divisible(model.config, tp)
    tied = bool(getattr(model.config, "tie_word_embeddings", False)) and hasattr(model, "lm_head")
    plan = build_plan(model, tied=tied)
    parallelize_module(model, tp_mesh, {k: _style(v) for k, v in plan.items()})
    if tied:  # one weight: re-tie after parallelisation (torchtitan does the same)
        prefix = str(getattr(model, "base_model_prefix", "model"))
        model.get_submodule("lm_head").weight = getattr(model, prefix).embed_tokens.weight
    loose = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if loose:
        raise HarnessError(f"{type(model).__name__}: parameters outside the TP plan: {loose[:5]}")
    styles: dict[str, int] = {}
    for kind in plan.values():
        styles[kind] = styles.get(kind, 0) + 1
    head: LmHead | None = None
    if "lm_head" in plan:
        head = "replicated" if tied else "colwise_gathered"
    return TpInfo(tp=tp, lm_head=head, styles=styles)
