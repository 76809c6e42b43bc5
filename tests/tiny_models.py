"""Seeded, randomly initialised Qwen3 models for the reference-side unit tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForTokenClassification


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
