"""Megatron-Core model construction for the harness (imports megatron: only inside ranks).

Builds megatron-core's own ``GPTModel`` with ``get_gpt_layer_local_spec(qk_layernorm=...,
normalization="RMSNorm")`` (no Transformer Engine, no Apex) from an HF config, loads the
per-rank weights of :mod:`harnesses.megatron.convert`, and, for the critic, swaps the LM
output layer for a replicated value head (verl's ``LinearForLastLayer`` pattern).

The HF -> ``TransformerConfig`` mapping (Qwen3 / Llama):

- ``kv_channels = head_dim`` (Qwen3's head_dim is independent of hidden / heads), so
  Megatron's default softmax scale ``1 / sqrt(kv_channels)`` equals HF's ``head_dim**-0.5``;
- ``num_query_groups = num_key_value_heads``; ``qk_layernorm`` = Qwen3 (RMSNorm over each
  head's ``head_dim`` before RoPE, as HF's ``q_norm`` / ``k_norm``);
- ``normalization = "RMSNorm"``, ``layernorm_epsilon = rms_norm_eps``; SwiGLU
  (``gated_linear_unit``, ``silu``), no biases; RoPE with ``rotary_base = rope_theta``,
  non-interleaved (HF ``rotate_half``);
- dropout 0, every fusion off (the CPU and no-TE path).

CPU shims (the smallest set that lets megatron-core 0.16.1 run forward on CPU with gloo;
listed in every ``outputs.json``): see :data:`CPU_SHIMS` and :func:`apply_cpu_shims`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch
from torch import Tensor, nn

from harnesses.megatron.convert import Shape
from qualify.errors import HarnessError

CPU_SHIMS: Final = (
    {"patches": "torch.cuda.current_device",
     "to": "a function returning 'cpu'",
     "why": "megatron-core 0.16.1 allocates RotaryEmbedding's inv_freq, the attention mask "
            "buffers and the global memory buffer on torch.cuda.current_device(), which "
            "raises without CUDA"},
    {"patches": "megatron.core.tensor_parallel.random RNG tracker",
     "to": "initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)",
     "why": "the default CudaRNGStatesTracker forks CUDA RNG state around dropout; dropout "
            "is 0 here and the inference tracker's fork is a no-op that needs no CUDA"},
)
"""What the CPU path patches and why (written to ``outputs.json`` ``shims``)."""

GROUP_SHIMS: Final = (
    {"patches": "megatron.core.parallel_state global memory buffer",
     "to": "parallel_state._set_global_memory_buffer()",
     "why": "the harness passes explicit process groups (pg_collection) instead of "
            "initialize_model_parallel, which cannot give the actor and the critic of one "
            "launch different TP sizes; the attention's scratch buffer is the one global "
            "that initialize_model_parallel would have created and the forward still reads"},
)
"""Needed on every device (written to ``outputs.json`` ``shims``)."""


def shim_text(shim: Mapping[str, str]) -> str:
    """One ``outputs.json`` ``shims`` entry: ``"<what> -> <replacement>: <why>"``."""
    return f"{shim['patches']} -> {shim['to']}: {shim['why']}"


def apply_group_shims() -> list[str]:
    """Install :data:`GROUP_SHIMS` (once per process, after :func:`role_groups`).

    Returns:
        The shims installed, as ``outputs.json`` strings.
    """
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # idempotent within one process
        parallel_state._set_global_memory_buffer()
    return [shim_text(s) for s in GROUP_SHIMS]


def apply_cpu_shims() -> list[str]:
    """Install :data:`CPU_SHIMS` (call once per process, before building a model).

    Returns:
        The shims installed, as ``outputs.json`` strings.
    """
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    from megatron.core import tensor_parallel

    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return [shim_text(s) for s in CPU_SHIMS]


def rope_theta(config: Any) -> float:
    """RoPE base of an HF config (``rope_parameters`` in transformers 5, else ``rope_theta``).

    Raises:
        HarnessError: a RoPE scaling type other than the default.
    """
    params = getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise HarnessError(f"rope_type {kind!r}: only default RoPE is converted")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise HarnessError("HF config has no rope_theta")
    return float(theta)


def transformer_config(config: Any, shape: Shape, tp: int, *, bf16: bool,
                       cpu: bool) -> Any:
    """Megatron ``TransformerConfig`` for an HF Qwen3 / Llama config (mapping in the module doc).

    Args:
        config: the HF config.
        shape: its :class:`~harnesses.megatron.convert.Shape`.
        tp: TP size.
        bf16: Megatron's BF16 mode (BF16 parameters and compute; FP32 master weights live
            in Megatron's optimizer).
        cpu: build on CPU (``use_cpu_initialization``); fusions are off either way.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        tensor_model_parallel_size=tp, num_layers=shape.num_layers, hidden_size=shape.hidden,
        ffn_hidden_size=shape.ffn, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.head_dim,
        normalization="RMSNorm", layernorm_epsilon=float(config.rms_norm_eps),
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=shape.family == "qwen3",
        hidden_dropout=0.0, attention_dropout=0.0,
        bf16=bf16, params_dtype=torch.float32,
        # perform_initialization=True although load_shard overwrites every weight: in
        # megatron-core 0.16.1 only the initializers (_initialize_affine_weight_cpu / _gpu,
        # tensor_parallel/layers.py:170 / :137) tag a TP-sharded weight
        # tensor_model_parallel=True; untagged, param_is_not_tensor_parallel_duplicate
        # (layers.py:89) treats every shard as a replica and the optimizer's grad norm counts
        # only TP rank 0's shards (README "TP grad norm"; checked by check_tp_tags).
        use_cpu_initialization=cpu, perform_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
    )


class ValueHead(nn.Module):
    """Replicated critic head ``Linear(H, 1)`` with bias, in the output layer's calling form.

    GPTModel calls ``output_layer(hidden, weight=..., runtime_gather_output=...)`` and
    unpacks ``(logits, bias)``; this head returns ``(values [s, b, 1], None)``. Its
    parameters (``weight`` ``[1, H]``, ``bias`` ``[1]``) are not tensor-parallel: every rank
    holds them and receives the same gradient (the final-norm output is replicated when
    sequence parallelism is off), so Megatron's grad norm counts them once
    (``param_is_not_tensor_parallel_duplicate``).

    Args:
        hidden: ``H``.
    """

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, input: Tensor, weight: Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[Tensor, None]:
        """``[s, b, H]`` -> ``([s, b, 1], None)``; ``weight`` / ``runtime_gather_output`` unused."""
        del weight, runtime_gather_output
        return torch.nn.functional.linear(input, self.weight, self.bias), None


def build_gpt(config: Any, shape: Shape, groups: RoleGroups, *, bf16: bool,
              cpu: bool) -> nn.Module:
    """Megatron-Core ``GPTModel`` (local layer spec) for ``shape`` on this TP rank.

    The critic (``shape.head == "value"``) gets a :class:`ValueHead` as ``output_layer``.
    Parameters are FP32 here; :func:`load_shard` fills them.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    tp = groups.tp
    tcfg = transformer_config(config, shape, tp, bf16=bf16, cpu=cpu)
    spec = get_gpt_layer_local_spec(qk_layernorm=shape.family == "qwen3",
                                    normalization="RMSNorm")
    model = GPTModel(config=tcfg, transformer_layer_spec=spec,
                     vocab_size=shape.padded_vocab(tp),
                     max_sequence_length=int(config.max_position_embeddings),
                     share_embeddings_and_output_weights=shape.tied,
                     position_embedding_type="rope", rotary_base=int(rope_theta(config)),
                     parallel_output=True, pg_collection=groups.pg_collection)
    if shape.head == "value":
        model.output_layer = ValueHead(shape.hidden)
    return model


def check_tp_tags(model: nn.Module, replicated: Sequence[str]) -> None:
    """Check Megatron's own TP tags against the conversion's layout.

    A parameter is tensor-parallel for Megatron's grad norm
    (``param_is_not_tensor_parallel_duplicate``) iff it carries
    ``tensor_model_parallel=True``; every parameter outside ``replicated`` is sharded by
    :mod:`harnesses.megatron.convert` and must carry it, every replicated one must not.

    Args:
        model: the ``GPTModel`` (not wrapped).
        replicated: Megatron names of the replicated parameters
            (:func:`harnesses.megatron.convert.replicated_megatron_names`).

    Raises:
        HarnessError: a sharded parameter is untagged or a replicated one is tagged.
    """
    rep = set(replicated)
    wrong = [n for n, p in model.named_parameters()
             if bool(getattr(p, "tensor_model_parallel", False)) == (n in rep)]
    if wrong:
        raise HarnessError(f"Megatron tensor_model_parallel tags disagree with the layout: "
                           f"{wrong[:4]} (sharded untagged or replicated tagged)")


def load_shard(model: nn.Module, shard: Mapping[str, Tensor]) -> None:
    """Copy one rank's converted weights into ``model`` (strict: every parameter, no extra).

    Raises:
        HarnessError: a parameter is missing, unexpected, or has the wrong shape.
    """
    params = dict(model.named_parameters())
    if set(params) != set(shard):
        raise HarnessError(f"Megatron parameters and converted shard differ: missing "
                           f"{sorted(set(params) - set(shard))[:4]}, unexpected "
                           f"{sorted(set(shard) - set(params))[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            if p.shape != shard[name].shape:
                raise HarnessError(f"{name}: Megatron shape {tuple(p.shape)}, converted "
                                   f"{tuple(shard[name].shape)}")
            p.copy_(shard[name])


def padding_mask(attention_mask: Tensor) -> Tensor:
    """Megatron attention mask ``[b, 1, T, T]`` bool (True = masked) from ``[b, T]`` 0/1.

    Causal and key padding: position ``i`` attends ``j <= i`` with ``attention_mask[j] == 1``.
    (Megatron's local attention fills masked scores with -10000 before its softmax.)
    """
    t = attention_mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    return ~allowed[:, None]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoleGroups:
    """This rank's role and its Megatron process groups.

    Attributes:
        role: ``actor`` or ``critic``.
        ranks: the role's global ranks (its TP group, in TP-rank order).
        tp_rank: this rank's index in ``ranks``.
        pg_collection: megatron-core ``ProcessGroupCollection`` with ``tp`` = the role's
            group and every other dimension (pp, cp, dp, ep, ...) this rank alone.
    """

    role: str
    ranks: tuple[int, ...]
    tp_rank: int
    pg_collection: Any

    @property
    def tp(self) -> int:
        """TP size of the role."""
        return len(self.ranks)

    @property
    def tp_group(self) -> Any:
        """The role's TP process group."""
        return self.pg_collection.tp


def role_groups(actor_tp: int, critic_tp: int, rank: int, timeout_s: float) -> RoleGroups:
    """Build the role groups of one launch (collective: every rank calls it).

    One launch holds the actor on ranks ``[0, actor_tp)`` and the critic on the next
    ``critic_tp`` ranks; their TP sizes differ (a2c1: world 3), which Megatron's global
    ``parallel_state.initialize_model_parallel`` cannot express (it needs ``world % tp ==
    0`` and would make the other ranks data-parallel peers). megatron-core 0.16 takes
    explicit process groups instead (``GPTModel(pg_collection=...)``,
    ``DistributedDataParallel(pg_collection=...)``, ``get_megatron_optimizer(...,
    pg_collection=...)``): the role's TP group, and singleton groups for every other
    dimension, so the two roles never communicate.

    Raises:
        HarnessError: ``rank`` is outside the launch.
    """
    from datetime import timedelta

    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    timeout = timedelta(seconds=timeout_s)
    world = actor_tp + critic_tp
    if not 0 <= rank < world:
        raise HarnessError(f"rank {rank} outside the launch of {world} ranks")
    spans = {"actor": tuple(range(actor_tp)), "critic": tuple(range(actor_tp, world))}
    groups = {role: dist.new_group(list(r), timeout=timeout)
              for role, r in spans.items() if r}
    singles = [dist.new_group([r], timeout=timeout) for r in range(world)]
    role = "actor" if rank < actor_tp else "critic"
    pgc = ProcessGroupCollection()
    pgc.tp = groups[role]
    pgc.mp = groups[role]
    pgc.tp_cp = groups[role]
    pgc.tp_dp_cp = groups[role]
    pgc.tp_ep = groups[role]
    pgc.tp_ep_pp = groups[role]
    pgc.expt_tp = groups[role]
    own = singles[rank]
    for name in ("pp", "embd", "pos_embd", "cp", "ep", "dp", "dp_cp", "expt_dp",
                 "intra_dp_cp", "intra_expt_dp", "inter_dist_opt", "intra_dist_opt"):
        setattr(pgc, name, own)
    pgc.hcp = [own]
    ranks = spans[role]
    return RoleGroups(role=role, ranks=ranks, tp_rank=ranks.index(rank), pg_collection=pgc)
