"""Hugging Face <-> Megatron-Core weight layout, per tensor-parallel rank (pure torch).

Importable without megatron: every function works on plain tensors. Key names are those of
megatron-core 0.16.1's ``GPTModel`` built with ``get_gpt_layer_local_spec(qk_layernorm=True,
normalization="RMSNorm")`` (checked by instantiating the model; ``tests/test_megatron_convert.py``
does so again), for the Qwen3 family (q/k norms) and the Llama family (none).

Layouts (``H`` hidden, ``n`` query heads, ``g`` KV heads (query groups), ``d`` head dim,
``F`` intermediate size, ``V`` vocab, ``V'`` padded vocab, ``tp`` TP size, rank ``r``):

- ``linear_qkv.weight`` ``[(n + 2g) d, H]``: grouped per KV head,
  ``[q heads of group 0 (n/g rows of d), k_0, v_0, q heads of group 1, k_1, v_1, ...]``
  (``SelfAttention.get_query_key_value_tensors`` views the output as ``[.., g_local,
  (n/g + 2) d]``). A column-parallel layer: rank ``r`` holds the contiguous row chunk ``r``
  of this global layout, i.e. groups ``[r g/tp, (r+1) g/tp)``; when ``tp > g`` a group is
  split across ranks and Megatron all-gathers in the forward (same contiguous chunking).
- ``linear_fc1.weight`` ``[2F, H]`` per rank ``[2F/tp, H]`` = ``[gate rows of rank r;
  up rows of rank r]`` (the GLU splits each rank's local output in two halves), so the
  global TP1 tensor is ``[gate; up]`` but a TP>1 rank is **not** a contiguous chunk of it.
- ``linear_proj.weight`` ``[H, n d]`` and ``linear_fc2.weight`` ``[H, F]``: row-parallel,
  rank ``r`` holds column chunk ``r``.
- ``embedding.word_embeddings.weight`` / ``output_layer.weight`` ``[V', H]``: vocab-parallel,
  rank ``r`` holds rows ``[r V'/tp, (r+1) V'/tp)``; rows ``>= V`` are zero padding
  (``V'`` = ``V`` rounded up to a multiple of ``divisible_by * tp``, Megatron training's
  ``_vocab_size_with_padding``). Tied embeddings: no ``output_layer.weight``.
- Norms (``input_layernorm``, ``pre_mlp_layernorm``, ``q_layernorm``, ``k_layernorm``,
  ``final_layernorm``) are replicated on every rank.
- Critic value head (this harness's own replicated ``Linear(H, 1)``, see
  :mod:`harnesses.megatron.model`): ``output_layer.weight`` ``[1, H]`` and
  ``output_layer.bias`` ``[1]`` on every rank, from HF ``score.weight`` / ``score.bias``.

The conversion is a permutation plus zero padding, so round trips are bitwise.
:func:`layout_errors` checks a set of shards against an HF state dict with an independent
row-by-row index map (no reshapes shared with the converter).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

import torch
from torch import Tensor

from qualify.errors import HarnessError

Family = Literal["qwen3", "llama"]
Head = Literal["lm", "value"]
DEFAULT_VOCAB_DIVISIBLE_BY: Final = 128
"""Megatron training's ``--make-vocab-size-divisible-by`` default."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """The model shape the conversion needs.

    Attributes:
        family: ``qwen3`` (q/k RMSNorm per head) or ``llama`` (none).
        num_layers: decoder layers.
        hidden: hidden size ``H``.
        ffn: intermediate size ``F``.
        heads: query heads ``n``.
        kv_heads: KV heads ``g`` (Megatron ``num_query_groups``).
        head_dim: ``d`` (Megatron ``kv_channels``; independent of ``H / n`` in Qwen3).
        vocab: HF vocab size ``V``.
        tied: embeddings tied to the LM head.
        head: ``lm`` (actor: LM head) or ``value`` (critic: ``score`` Linear(H, 1) + bias).
        vocab_divisible_by: padding multiple per TP rank.
    """

    family: Family
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    head: Head = "lm"
    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY

    def __post_init__(self) -> None:
        if self.family not in ("qwen3", "llama"):
            raise HarnessError(f"model family {self.family!r}: expected 'qwen3' or 'llama'")
        if self.head not in ("lm", "value"):
            raise HarnessError(f"head {self.head!r}: expected 'lm' or 'value'")
        if self.heads % self.kv_heads:
            raise HarnessError(f"heads = {self.heads} not divisible by kv_heads = "
                               f"{self.kv_heads}")

    @classmethod
    def from_hf_config(cls, config: Any, head: Head = "lm",
                       vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY) -> Shape:
        """Shape of an HF ``Qwen3Config`` / ``LlamaConfig``.

        Raises:
            HarnessError: another model type, or biases this layout does not carry.
        """
        mt = str(getattr(config, "model_type", ""))
        if mt not in ("qwen3", "llama"):
            raise HarnessError(f"model_type {mt!r}: the megatron converter handles qwen3 "
                               f"and llama")
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(config, flag, False):
                raise HarnessError(f"{flag} = True is not supported by this converter")
        n = int(config.num_attention_heads)
        hd = getattr(config, "head_dim", None)
        return cls(family="qwen3" if mt == "qwen3" else "llama",
                   num_layers=int(config.num_hidden_layers), hidden=int(config.hidden_size),
                   ffn=int(config.intermediate_size), heads=n,
                   kv_heads=int(config.num_key_value_heads),
                   head_dim=int(hd) if hd else int(config.hidden_size) // n,
                   vocab=int(config.vocab_size),
                   tied=bool(getattr(config, "tie_word_embeddings", False)) and head == "lm",
                   head=head, vocab_divisible_by=vocab_divisible_by)

    def padded_vocab(self, tp: int) -> int:
        """``V'``: ``V`` rounded up to a multiple of ``vocab_divisible_by * tp``."""
        multiple = self.vocab_divisible_by * tp
        return -(-self.vocab // multiple) * multiple

    def check_tp(self, tp: int) -> None:
        """Raise :class:`HarnessError` when ``tp`` does not divide the sharded dimensions.

        Megatron needs ``tp | n`` and ``tp | F``; ``g < tp`` is allowed when ``tp % g == 0``
        (a KV group split over ranks), else ``tp | g``.
        """
        if tp < 1:
            raise HarnessError(f"TP = {tp}: must be >= 1")
        for name, value in (("num_attention_heads", self.heads),
                            ("intermediate_size", self.ffn)):
            if value % tp:
                raise HarnessError(f"{name} = {value} not divisible by TP = {tp}")
        g = self.kv_heads
        if (g >= tp and g % tp) or (g < tp and tp % g):
            raise HarnessError(f"num_key_value_heads = {g} and TP = {tp}: one must divide "
                               f"the other")


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}"


def _mc_layer(i: int) -> str:
    return f"decoder.layers.{i}"


def hf_param_names(shape: Shape) -> list[str]:
    """The HF parameter names this shape converts (in HF ``named_parameters`` order)."""
    names = ["model.embed_tokens.weight"]
    for i in range(shape.num_layers):
        p = _hf_layer(i)
        names += [f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"]
        if shape.family == "qwen3":
            names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        names += [f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if shape.head == "value":
        names += ["score.weight", "score.bias"]
    elif not shape.tied:
        names.append("lm_head.weight")
    return names


def _replicated_pairs(shape: Shape) -> list[tuple[str, str]]:
    """(HF name, Megatron name) of parameters replicated on every TP rank."""
    pairs = []
    for i in range(shape.num_layers):
        h, m = _hf_layer(i), _mc_layer(i)
        pairs += [(f"{h}.input_layernorm.weight", f"{m}.input_layernorm.weight"),
                  (f"{h}.post_attention_layernorm.weight", f"{m}.pre_mlp_layernorm.weight")]
        if shape.family == "qwen3":
            pairs += [(f"{h}.self_attn.q_norm.weight", f"{m}.self_attention.q_layernorm.weight"),
                      (f"{h}.self_attn.k_norm.weight", f"{m}.self_attention.k_layernorm.weight")]
    pairs.append(("model.norm.weight", "decoder.final_layernorm.weight"))
    if shape.head == "value":
        pairs += [("score.weight", "output_layer.weight"), ("score.bias", "output_layer.bias")]
    return pairs


def replicated_megatron_names(shape: Shape) -> list[str]:
    """Megatron names of the parameters every TP rank holds in full."""
    return [m for _, m in _replicated_pairs(shape)]


def _fused_qkv(q: Tensor, k: Tensor, v: Tensor, shape: Shape) -> Tensor:
    """HF q/k/v ``[n d, H]``, ``[g d, H]``, ``[g d, H]`` -> Megatron ``[(n + 2g) d, H]``."""
    g, d, per = shape.kv_heads, shape.head_dim, shape.heads // shape.kv_heads
    cols = q.shape[1]
    return torch.cat([q.reshape(g, per * d, cols), k.reshape(g, d, cols),
                      v.reshape(g, d, cols)], dim=1).reshape(-1, cols)


def _split_qkv(qkv: Tensor, shape: Shape) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`_fused_qkv`."""
    g, d, per = shape.kv_heads, shape.head_dim, shape.heads // shape.kv_heads
    cols = qkv.shape[1]
    q, k, v = qkv.reshape(g, (per + 2) * d, cols).split([per * d, d, d], dim=1)
    return q.reshape(-1, cols), k.reshape(-1, cols), v.reshape(-1, cols)


def _pad_rows(w: Tensor, rows: int) -> Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros((rows - w.shape[0], *w.shape[1:]))], dim=0)


def hf_to_megatron(hf: Mapping[str, Tensor], shape: Shape, tp: int) -> list[dict[str, Tensor]]:
    """Split an HF state dict into the ``tp`` Megatron-Core rank state dicts.

    Args:
        hf: HF tensors (the names of :func:`hf_param_names`; extra keys are ignored, a
            tied model's ``lm_head.weight`` included).
        shape: the model shape.
        tp: TP size.

    Returns:
        ``tp`` dicts ``{megatron name: tensor}`` (contiguous copies, same dtype as ``hf``).

    Raises:
        HarnessError: a name is missing, a shape is unexpected, or ``tp`` does not fit.
    """
    shape.check_tp(tp)
    missing = [n for n in hf_param_names(shape) if n not in hf]
    if missing:
        raise HarnessError(f"HF state dict lacks {missing[:4]}{'...' if len(missing) > 4 else ''}")
    out: list[dict[str, Tensor]] = [{} for _ in range(tp)]

    def put_chunks(name: str, full: Tensor, dim: int) -> None:
        for r, c in enumerate(full.chunk(tp, dim=dim)):
            out[r][name] = c.contiguous().clone()

    vp = shape.padded_vocab(tp)
    emb = hf["model.embed_tokens.weight"]
    if tuple(emb.shape) != (shape.vocab, shape.hidden):
        raise HarnessError(f"model.embed_tokens.weight has shape {tuple(emb.shape)}, expected "
                           f"{(shape.vocab, shape.hidden)}")
    put_chunks("embedding.word_embeddings.weight", _pad_rows(emb, vp), 0)
    for i in range(shape.num_layers):
        h, m = _hf_layer(i), _mc_layer(i)
        qkv = _fused_qkv(hf[f"{h}.self_attn.q_proj.weight"], hf[f"{h}.self_attn.k_proj.weight"],
                         hf[f"{h}.self_attn.v_proj.weight"], shape)
        put_chunks(f"{m}.self_attention.linear_qkv.weight", qkv, 0)
        put_chunks(f"{m}.self_attention.linear_proj.weight", hf[f"{h}.self_attn.o_proj.weight"], 1)
        gates = hf[f"{h}.mlp.gate_proj.weight"].chunk(tp, dim=0)
        ups = hf[f"{h}.mlp.up_proj.weight"].chunk(tp, dim=0)
        for r in range(tp):
            out[r][f"{m}.mlp.linear_fc1.weight"] = torch.cat([gates[r], ups[r]], dim=0)
        put_chunks(f"{m}.mlp.linear_fc2.weight", hf[f"{h}.mlp.down_proj.weight"], 1)
    for hf_name, mc_name in _replicated_pairs(shape):
        for r in range(tp):
            out[r][mc_name] = hf[hf_name].contiguous().clone()
    if shape.head == "lm" and not shape.tied:
        put_chunks("output_layer.weight", _pad_rows(hf["lm_head.weight"], vp), 0)
    return out


def megatron_to_hf(shards: Sequence[Mapping[str, Tensor]], shape: Shape) -> dict[str, Tensor]:
    """Merge Megatron-Core rank state dicts into one HF state dict (inverse of the split).

    Replicated tensors are taken from rank 0 (use :func:`replica_mismatches` to check that
    the ranks agree). Vocab padding rows are dropped.

    Args:
        shards: the ``tp`` rank state dicts, in rank order (``_extra_state`` keys ignored).
        shape: the model shape.

    Returns:
        ``{HF name: tensor}`` with the names of :func:`hf_param_names`.

    Raises:
        HarnessError: a Megatron name is missing on some rank.
    """
    tp = len(shards)
    shape.check_tp(tp)
    for r, s in enumerate(shards):
        missing = [n for n in megatron_param_names(shape) if n not in s]
        if missing:
            raise HarnessError(f"TP rank {r} lacks {missing[:4]}")

    def cat(name: str, dim: int) -> Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    hf: dict[str, Tensor] = {}
    hf["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)[:shape.vocab]
    for i in range(shape.num_layers):
        h, m = _hf_layer(i), _mc_layer(i)
        q, k, v = _split_qkv(cat(f"{m}.self_attention.linear_qkv.weight", 0), shape)
        hf[f"{h}.self_attn.q_proj.weight"] = q
        hf[f"{h}.self_attn.k_proj.weight"] = k
        hf[f"{h}.self_attn.v_proj.weight"] = v
        hf[f"{h}.self_attn.o_proj.weight"] = cat(f"{m}.self_attention.linear_proj.weight", 1)
        halves = [s[f"{m}.mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
        hf[f"{h}.mlp.gate_proj.weight"] = torch.cat([x[0] for x in halves], dim=0)
        hf[f"{h}.mlp.up_proj.weight"] = torch.cat([x[1] for x in halves], dim=0)
        hf[f"{h}.mlp.down_proj.weight"] = cat(f"{m}.mlp.linear_fc2.weight", 1)
    for hf_name, mc_name in _replicated_pairs(shape):
        hf[hf_name] = shards[0][mc_name]
    if shape.head == "lm" and not shape.tied:
        hf["lm_head.weight"] = cat("output_layer.weight", 0)[:shape.vocab]
    return {n: hf[n].contiguous() for n in hf_param_names(shape)}


def megatron_param_names(shape: Shape) -> list[str]:
    """Megatron-Core parameter names of one rank (no ``_extra_state``)."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(shape.num_layers):
        m = _mc_layer(i)
        names += [f"{m}.self_attention.linear_qkv.weight", f"{m}.self_attention.linear_proj.weight",
                  f"{m}.mlp.linear_fc1.weight", f"{m}.mlp.linear_fc2.weight"]
    names += replicated_megatron_names(shape)
    if shape.head == "lm" and not shape.tied:
        names.append("output_layer.weight")
    return names


def replica_mismatches(shards: Sequence[Mapping[str, Tensor]], shape: Shape) -> list[str]:
    """Replicated Megatron parameters that are not bitwise equal on every rank."""
    return [n for n in replicated_megatron_names(shape)
            if any(not torch.equal(s[n], shards[0][n]) for s in shards[1:])]


# --------------------------------------------------------------------------- layout check


def _qkv_row_source(shape: Shape, row: int) -> tuple[str, int]:
    """Which HF projection and row feed global fused-QKV row ``row`` (explicit arithmetic)."""
    d = shape.head_dim
    per = shape.heads // shape.kv_heads
    block = (per + 2) * d
    group, offset = divmod(row, block)
    if offset < per * d:
        return "q", group * per * d + offset
    if offset < (per + 1) * d:
        return "k", group * d + offset - per * d
    return "v", group * d + offset - (per + 1) * d


def layout_errors(hf: Mapping[str, Tensor], shards: Sequence[Mapping[str, Tensor]],
                  shape: Shape) -> list[str]:
    """Check Megatron rank shards against an HF state dict, row by row.

    An independent statement of the layout (explicit index arithmetic per rank and row,
    no reshape shared with :func:`hf_to_megatron`): for every rank-local row of the fused
    QKV, fused gate/up, the vocab-parallel embedding / output layer and every column chunk
    of the row-parallel weights, the HF row it must equal. Distinct rows of random weights
    never coincide, so a wrong layout (for instance the per-rank ``[gate_r; up_r]`` fc1
    read as chunks of the global ``[gate; up]``) shows up as mismatched rows.

    Args:
        hf: the HF state dict.
        shards: the ``tp`` rank state dicts.
        shape: the model shape.

    Returns:
        One line per mismatching tensor (empty: the layout is right).
    """
    tp = len(shards)
    errors: list[str] = []

    def check(where: str, got: Tensor, expected: Tensor) -> None:
        if tuple(got.shape) != tuple(expected.shape):
            errors.append(f"{where}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
        elif not torch.equal(got, expected):
            bad = int((got != expected).reshape(got.shape[0], -1).any(dim=1).sum())
            errors.append(f"{where}: {bad} / {got.shape[0]} rows differ")

    vp = shape.padded_vocab(tp)
    rows_v = vp // tp

    def vocab_rows(src: Tensor, r: int) -> Tensor:
        out = src.new_zeros((rows_v, src.shape[1]))
        for j in range(rows_v):
            tok = r * rows_v + j
            if tok < shape.vocab:
                out[j] = src[tok]
        return out

    for r, s in enumerate(shards):
        check(f"rank {r} embedding.word_embeddings.weight", s["embedding.word_embeddings.weight"],
              vocab_rows(hf["model.embed_tokens.weight"], r))
        if shape.head == "lm" and not shape.tied:
            check(f"rank {r} output_layer.weight", s["output_layer.weight"],
                  vocab_rows(hf["lm_head.weight"], r))
        for i in range(shape.num_layers):
            h, m = _hf_layer(i), _mc_layer(i)
            qkv_rows = (shape.heads + 2 * shape.kv_heads) * shape.head_dim // tp
            src = {x: hf[f"{h}.self_attn.{x}_proj.weight"] for x in "qkv"}
            want = torch.stack([src[p][k] for p, k in (
                _qkv_row_source(shape, r * qkv_rows + j) for j in range(qkv_rows))])
            check(f"rank {r} {m}.self_attention.linear_qkv.weight",
                  s[f"{m}.self_attention.linear_qkv.weight"], want)
            f_r = shape.ffn // tp
            gate, up = hf[f"{h}.mlp.gate_proj.weight"], hf[f"{h}.mlp.up_proj.weight"]
            want = torch.stack([gate[r * f_r + j] if j < f_r else up[r * f_r + j - f_r]
                                for j in range(2 * f_r)])
            check(f"rank {r} {m}.mlp.linear_fc1.weight", s[f"{m}.mlp.linear_fc1.weight"], want)
            for hf_name, mc_name, cols in (
                    (f"{h}.self_attn.o_proj.weight", f"{m}.self_attention.linear_proj.weight",
                     shape.heads * shape.head_dim // tp),
                    (f"{h}.mlp.down_proj.weight", f"{m}.mlp.linear_fc2.weight", shape.ffn // tp)):
                check(f"rank {r} {mc_name}", s[mc_name], hf[hf_name][:, r * cols:(r + 1) * cols])
        for hf_name, mc_name in _replicated_pairs(shape):
            check(f"rank {r} {mc_name}", s[mc_name], hf[hf_name])
    return errors
