"""``qualify diverge``'s layer probe on Megatron-Core's ``GPTModel``: names and layout.

The modules probed (:mod:`harnesses.layer_probe`) under their HF names (the local layer
spec of :func:`harnesses.megatron.model.build_gpt`, no Transformer Engine fusion):

==============================================  ==========================================
Megatron-Core (``GPTModel``)                    HF (Qwen3 / Llama)
==============================================  ==========================================
``embedding``                                   ``model.embed_tokens``
``decoder.layers.{i}.input_layernorm``          ``model.layers.{i}.input_layernorm``
``decoder.layers.{i}.self_attention``           ``model.layers.{i}.self_attn`` (after
                                                ``linear_proj``'s all-reduce)
``decoder.layers.{i}.pre_mlp_layernorm``        ``model.layers.{i}.post_attention_layernorm``
``decoder.layers.{i}.mlp``                      ``model.layers.{i}.mlp`` (after
                                                ``linear_fc2``'s all-reduce)
``decoder.layers.{i}``                          ``model.layers.{i}``
``decoder.final_layernorm``                     ``model.norm``
``output_layer``                                ``lm_head`` (actor) / ``score`` (critic)
==============================================  ==========================================

Layout: Megatron's activations are ``[S, B, F]`` (sequence first); each is transposed to
HF's ``[B, S, F]``. Sequence parallelism is off, so every output but the LM head's is the
full tensor on every TP rank; the LM head's logits (and their gradient) are this rank's
vocabulary shard of the padded vocabulary ``V'``, all-gathered over the TP group in rank
order (``ColumnParallelLinear``'s partition) and cut to the HF vocabulary ``V``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from harnesses import layer_probe


def hf_modules(model: nn.Module, role: str) -> dict[str, nn.Module]:
    """HF name -> Megatron module, in forward order (the table above).

    Raises:
        StopIteration: ``model`` holds no ``GPTModel``.
    """
    gpt: Any = next(m for m in model.modules() if type(m).__name__ == "GPTModel")
    mods: dict[str, nn.Module] = {"model.embed_tokens": gpt.embedding}
    for i, layer in enumerate(gpt.decoder.layers):
        mods[f"model.layers.{i}.input_layernorm"] = layer.input_layernorm
        mods[f"model.layers.{i}.self_attn"] = layer.self_attention
        mods[f"model.layers.{i}.post_attention_layernorm"] = layer.pre_mlp_layernorm
        mods[f"model.layers.{i}.mlp"] = layer.mlp
        mods[f"model.layers.{i}"] = layer
    mods["model.norm"] = gpt.decoder.final_layernorm
    mods["lm_head" if role == "actor" else "score"] = gpt.output_layer
    return mods


def megatron_probe(spec: Mapping[str, Any] | None, *, role: str, writer: bool,
                   model: nn.Module, vocab: int, tp: int,
                   tp_group: Any) -> layer_probe.LayerProbe:
    """The cell's probe over a Megatron model (inactive without ``cell.probe``).

    Args:
        spec: ``cell.probe``.
        role: ``actor`` or ``critic``.
        writer: TP rank 0.
        model: the role's model (``GPTModel``, or wrapped in ``Float16Module``).
        vocab: the HF vocabulary ``V`` (the padded columns are cut).
        tp: the role's TP size.
        tp_group: its process group (the LM head's gather is collective over it).
    """
    def to_full(name: str, t: Tensor) -> Tensor:
        x = t
        if name == "lm_head":
            if tp > 1:
                x = x.float().contiguous()
                parts = [torch.empty_like(x) for _ in range(tp)]
                dist.all_gather(parts, x, group=tp_group)
                x = torch.cat(parts, -1)
            x = x[..., :vocab]
        return x.transpose(0, 1)

    mods = hf_modules(model, role) if spec else {}
    return layer_probe.LayerProbe(spec, role=role, writer=writer, modules=mods,
                                  to_full=to_full)
