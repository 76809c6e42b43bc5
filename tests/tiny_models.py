"""Seeded, randomly initialised Qwen3 models for the reference-side unit tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForTokenClassification

THREE_LAYER_CFG: Final[dict[str, Any]] = {
    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "pad_token_id": 0,
    "eos_token_id": 2, "bos_token_id": 1, "attention_dropout": 0.0}
"""A Qwen3 of three decoder layers (placement over up to three devices), vocabulary 96."""


def seeded_qwen3(role: str, cfg: Mapping[str, Any], *,
                 tie_word_embeddings: bool = False) -> torch.nn.Module:
    """A Qwen3 of config ``cfg`` initialised after ``torch.manual_seed(0)``, SDPA attention.

    ``role``: ``actor`` (``Qwen3ForCausalLM``, its embeddings tied to the head when
    ``tie_word_embeddings``) or ``critic`` (``Qwen3ForTokenClassification`` with one label).
    """
    torch.manual_seed(0)
    if role == "critic":
        config = Qwen3Config(**cfg, num_labels=1)  # type: ignore[call-arg]
        config._attn_implementation = "sdpa"
        return Qwen3ForTokenClassification(config)
    config = Qwen3Config(**cfg, tie_word_embeddings=tie_word_embeddings)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config)


def seeded_batch(vocab_size: int, *, short: Mapping[int, int],
                 masked_targets: bool) -> Any:
    """A seeded training batch of 4 sequences (prompts 5 tokens, responses 6).

    Drawn after ``torch.Generator().manual_seed(1)``: prompt ids then response ids in
    ``[3, vocab_size)``, then advantages and returns ``~ N(0, 1)``. Row 1 has two left pad
    columns; row ``b`` of ``short`` has a response cut at ``short[b]`` (pad id 0 after it);
    ``masked_targets`` zeroes the advantages and returns at the cut positions.

    Returns:
        :class:`qualify.reference.update.Batch` (pad id 0).
    """
    from qualify.reference.update import Batch

    g = torch.Generator().manual_seed(1)
    b, p, r = 4, 5, 6
    prompts = torch.randint(3, vocab_size, (b, p), generator=g)
    prompts[1, :2] = 0  # left padding
    responses = torch.randint(3, vocab_size, (b, r), generator=g)
    response_mask = torch.ones(b, r, dtype=torch.int64)
    for row, cut in short.items():
        response_mask[row, cut:] = 0
    responses[response_mask == 0] = 0
    prompt_mask = torch.ones(b, p, dtype=torch.int64)
    prompt_mask[1, :2] = 0
    weight = response_mask if masked_targets else torch.ones_like(response_mask)
    return Batch(prompts=prompts, responses=responses,
                 attention_mask=torch.cat([prompt_mask, response_mask], 1),
                 response_mask=response_mask,
                 advantages=torch.randn(b, r, generator=g) * weight,
                 returns=torch.randn(b, r, generator=g) * weight, pad_token_id=0)
