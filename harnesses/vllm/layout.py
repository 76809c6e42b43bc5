"""HF layout <-> vLLM per-TP-rank fused layout, and the digests of installed shards.

vLLM (``vllm.model_executor.layers.linear`` / ``vocab_parallel_embedding``) holds a decoder
(Qwen3, Llama) per TP rank ``r`` of ``tp`` as:

- ``*.self_attn.qkv_proj.{weight,bias}`` (``QKVParallelLinear``, from ``{q,k,v}_proj``):
  rank ``r``'s ``H/tp`` query heads' rows, then its KV heads' rows of ``k_proj``, then of
  ``v_proj``; when ``K < tp`` a KV head is replicated on ``tp/K`` ranks (rank ``r`` holds
  KV head ``r // (tp/K)``).
- ``*.mlp.gate_up_proj.weight`` (``MergedColumnParallelLinear``, from ``{gate,up}_proj``):
  rank ``r``'s ``I/tp`` rows of ``gate_proj``, then the same rows of ``up_proj``.
- ``*.self_attn.o_proj.weight``, ``*.mlp.down_proj.weight`` (``RowParallelLinear``):
  columns ``[r*in/tp, (r+1)*in/tp)``; a bias is whole on every rank.
- ``model.embed_tokens.weight``, ``lm_head.weight`` (``VocabParallelEmbedding``,
  ``ParallelLMHead``): the vocabulary padded with zero rows to a multiple of
  ``padding_size`` (64), rows ``[r*Vp/tp, (r+1)*Vp/tp)``.
- everything else (norms, per-head ``q_norm`` / ``k_norm``): the whole tensor.

With tied embeddings (``tie_word_embeddings``) vLLM's ``lm_head`` *is* ``embed_tokens``;
an HF ``lm_head.weight`` is then not installed.

This module is pure torch (no vLLM import): :func:`to_vllm_rank` builds what rank ``r``
must hold from the HF tensors, :func:`from_vllm_ranks` rebuilds the HF tensors from every
rank's shards (the bitwise round trip is tested at TP 2 on non-square shapes), and
:func:`tensor_digest` is the digest both sides compute (the expected side here, the
installed side inside each vLLM worker).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import torch
from torch import Tensor

from qualify.errors import HarnessError

VOCAB_PADDING: Final = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE`` (``vocab_parallel_embedding.py``)."""
QKV: Final = ("q_proj", "k_proj", "v_proj")
GATE_UP: Final = ("gate_proj", "up_proj")
ROW_PARALLEL: Final = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
VOCAB_PARALLEL: Final = ("model.embed_tokens.weight", "lm_head.weight")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LayoutSpec:
    """The shapes that decide the sharding.

    Attributes:
        num_heads: query heads ``H``.
        num_kv_heads: KV heads ``K``.
        head_dim: per-head size ``D``.
        vocab_size: ``V`` (rows of the embedding / LM head).
        tie_word_embeddings: the LM head is the embedding.
        padding_size: vocabulary padding multiple (64).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    padding_size: int = VOCAB_PADDING

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise HarnessError(f"num_kv_heads {self.num_kv_heads} does not divide "
                               f"num_heads {self.num_heads}")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> LayoutSpec:
        """From an HF ``config.json`` document (``head_dim`` defaults to hidden / heads)."""
        heads = int(cfg["num_attention_heads"])
        return cls(num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
                   head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                   vocab_size=int(cfg["vocab_size"]),
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))

    @classmethod
    def from_model_dir(cls, path: Path) -> LayoutSpec:
        """From ``path/config.json``."""
        return cls.from_config(json.loads((path / "config.json").read_text("utf-8")))

    def check_tp(self, tp: int) -> None:
        """Raise if vLLM cannot shard these shapes over ``tp`` ranks.

        Raises:
            HarnessError: ``tp`` does not divide ``H``, or neither divides the other of
                ``K`` and ``tp``.
        """
        if tp < 1 or self.num_heads % tp:
            raise HarnessError(f"TP {tp} does not divide num_heads {self.num_heads}")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise HarnessError(f"TP {tp} and num_kv_heads {self.num_kv_heads}: neither "
                               f"divides the other")

    def padded_vocab(self) -> int:
        """``ceil(V / padding) * padding`` (vLLM ``pad_vocab_size``)."""
        return -(-self.vocab_size // self.padding_size) * self.padding_size

    def kv_heads_of(self, tp: int, rank: int) -> range:
        """The KV head indices rank ``rank`` holds (one replicated head when ``K < tp``)."""
        if self.num_kv_heads >= tp:
            n = self.num_kv_heads // tp
            return range(rank * n, (rank + 1) * n)
        head = rank // (tp // self.num_kv_heads)
        return range(head, head + 1)


def _rows(t: Tensor, start: int, stop: int) -> Tensor:
    return t[start:stop]


def _qkv_rank(q: Tensor, k: Tensor, v: Tensor, *, spec: LayoutSpec, tp: int,
              rank: int) -> Tensor:
    """Rank's fused QKV rows ``[(H/tp + 2 kv) * D, ...]`` (weight ``[., hidden]`` or bias)."""
    d = spec.head_dim
    hq = spec.num_heads // tp
    kv = spec.kv_heads_of(tp, rank)
    qs = _rows(q, rank * hq * d, (rank + 1) * hq * d)
    ks = _rows(k, kv.start * d, kv.stop * d)
    vs = _rows(v, kv.start * d, kv.stop * d)
    return torch.cat([qs, ks, vs], dim=0)


def _split(n: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    if n % tp:
        raise HarnessError(f"{what}: size {n} is not divisible by TP {tp}")
    per = n // tp
    return rank * per, (rank + 1) * per


def vllm_name(hf_name: str) -> str:
    """The vLLM parameter an HF parameter is installed into (``q_proj`` -> ``qkv_proj``)."""
    for proj in QKV:
        if f".self_attn.{proj}." in hf_name:
            return hf_name.replace(f".self_attn.{proj}.", ".self_attn.qkv_proj.")
    for proj in GATE_UP:
        if f".mlp.{proj}." in hf_name:
            return hf_name.replace(f".mlp.{proj}.", ".mlp.gate_up_proj.")
    return hf_name


def to_vllm_rank(hf: Mapping[str, Tensor], spec: LayoutSpec, tp: int,
                 rank: int) -> dict[str, Tensor]:
    """What TP rank ``rank`` of ``tp`` holds after installing the HF tensors ``hf``.

    Args:
        hf: HF parameter name -> full tensor (``q_proj.weight`` ``[H*D, hidden]``,
            ``gate_proj.weight`` ``[I, hidden]``, ``down_proj.weight`` ``[hidden, I]``...).
        spec: the shapes.
        tp: TP size.
        rank: TP rank in ``[0, tp)``.

    Returns:
        vLLM parameter name -> contiguous per-rank tensor (same dtype as the input).

    Raises:
        HarnessError: a fused group is incomplete, or a dimension does not divide by TP.
    """
    spec.check_tp(tp)
    if not 0 <= rank < tp:
        raise HarnessError(f"rank {rank} outside [0, {tp})")
    out: dict[str, Tensor] = {}
    done: set[str] = set()
    for name in sorted(hf):
        if name in done:
            continue
        t = hf[name]
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            done.add(name)
            continue
        if any(f".self_attn.{p}." in name for p in QKV):
            parts = [name.replace(".self_attn.q_proj.", f".self_attn.{p}.")
                     .replace(".self_attn.k_proj.", f".self_attn.{p}.")
                     .replace(".self_attn.v_proj.", f".self_attn.{p}.") for p in QKV]
            missing = [p for p in parts if p not in hf]
            if missing:
                raise HarnessError(f"{name}: fused QKV needs {missing}")
            out[vllm_name(name)] = _qkv_rank(*(hf[p] for p in parts), spec=spec, tp=tp, rank=rank)
            done.update(parts)
        elif any(f".mlp.{p}." in name for p in GATE_UP):
            parts = [name.replace(".mlp.gate_proj.", f".mlp.{p}.")
                     .replace(".mlp.up_proj.", f".mlp.{p}.") for p in GATE_UP]
            missing = [p for p in parts if p not in hf]
            if missing:
                raise HarnessError(f"{name}: fused gate_up needs {missing}")
            gate, up = hf[parts[0]], hf[parts[1]]
            a, b = _split(gate.shape[0], tp, rank, parts[0])
            out[vllm_name(name)] = torch.cat([gate[a:b], up[a:b]], dim=0)
            done.update(parts)
        elif name.endswith(ROW_PARALLEL):
            a, b = _split(t.shape[1], tp, rank, name)
            out[name] = t[:, a:b]
            done.add(name)
        elif name in VOCAB_PARALLEL:
            vp = spec.padded_vocab()
            padded = torch.zeros((vp, *t.shape[1:]), dtype=t.dtype)
            padded[: t.shape[0]] = t
            a, b = _split(vp, tp, rank, name)
            out[name] = padded[a:b]
            done.add(name)
        else:
            out[name] = t
            done.add(name)
    return {k: v.contiguous() for k, v in out.items()}


def from_vllm_ranks(ranks: list[Mapping[str, Tensor]], spec: LayoutSpec,
                    hf_names: list[str]) -> dict[str, Tensor]:
    """Rebuild the HF tensors from every rank's vLLM shards (inverse of :func:`to_vllm_rank`).

    Args:
        ranks: per TP rank (index = rank), vLLM parameter name -> tensor.
        spec: the shapes.
        hf_names: the HF names wanted (decides which pieces are unfused).

    Returns:
        HF name -> full contiguous tensor.

    Raises:
        HarnessError: a vLLM parameter is missing on a rank.
    """
    tp = len(ranks)
    spec.check_tp(tp)
    d = spec.head_dim
    hq = spec.num_heads // tp
    out: dict[str, Tensor] = {}
    for name in hf_names:
        vname = vllm_name(name)
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            vname = "model.embed_tokens.weight"
        try:
            pieces = [r[vname] for r in ranks]
        except KeyError:
            raise HarnessError(f"{name}: vLLM parameter {vname!r} missing on a rank") from None
        if vname != name and ".qkv_proj." in vname:
            proj = next(p for p in QKV if f".self_attn.{p}." in name)
            if proj == "q_proj":
                out[name] = torch.cat([p[: hq * d] for p in pieces], dim=0)
            else:
                off = hq * d if proj == "k_proj" else None
                chunks: list[Tensor] = []
                seen: set[int] = set()
                for r, p in enumerate(pieces):
                    kv = spec.kv_heads_of(tp, r)
                    if kv.start in seen:
                        continue  # a replicated KV head: take it from its first rank
                    seen.add(kv.start)
                    n = len(kv) * d
                    start = hq * d if off is not None else hq * d + n
                    chunks.append(p[start:start + n])
                out[name] = torch.cat(chunks, dim=0)
        elif vname != name and ".gate_up_proj." in vname:
            half = [p.shape[0] // 2 for p in pieces]
            if name.endswith(f".mlp.{GATE_UP[0]}.weight"):
                out[name] = torch.cat([p[:h] for p, h in zip(pieces, half, strict=True)], 0)
            else:
                out[name] = torch.cat([p[h:] for p, h in zip(pieces, half, strict=True)], 0)
        elif name.endswith(ROW_PARALLEL):
            out[name] = torch.cat(pieces, dim=1)
        elif vname in VOCAB_PARALLEL:
            out[name] = torch.cat(pieces, dim=0)[: spec.vocab_size]
        else:
            out[name] = pieces[0]
        out[name] = out[name].contiguous()
    return out


def tensor_digest(t: Tensor) -> str:
    """``sha256`` hex of dtype, shape and the contiguous bytes of ``t`` (CPU copy).

    Both sides use it: the expected per-rank shards built here, and each vLLM worker on
    the tensors it holds, so equal digests mean bitwise-equal installed tensors.
    """
    c = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{c.dtype}|{tuple(c.shape)}|".encode())
    h.update(c.view(torch.uint8).reshape(-1).numpy().tobytes() if c.numel() else b"")
    return h.hexdigest()


def expected_digests(hf: Mapping[str, Tensor], spec: LayoutSpec,
                     tp: int) -> list[dict[str, str]]:
    """Per rank, vLLM parameter name -> :func:`tensor_digest` of what it must hold."""
    return [{k: tensor_digest(v) for k, v in to_vllm_rank(hf, spec, tp, r).items()}
            for r in range(tp)]


def digest_of_digests(digests: Mapping[str, str]) -> str:
    """One sha256 over a rank's sorted ``name:digest`` lines (the acknowledged digest)."""
    return hashlib.sha256("".join(f"{k}:{v}\n" for k, v in sorted(digests.items()))
                          .encode()).hexdigest()
