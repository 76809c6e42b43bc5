"""Variants of the default contract for tests that need one engine only.

The committed ``contracts/tiny-qwen3.toml`` qualifies every engine (torch_tp, DeepSpeed,
Megatron-Core, the vLLM sampler) and samples its rollout with vLLM. Tests of the stages
themselves (sealing, resume, faults, tampering) need a run whose cells all PASS in well
under a minute: :func:`torch_tp_only` writes the same contract with the torch_tp engine
alone, no sampler cells, the independent HF sampler for the rollout and no round-to-round
term.
"""

from __future__ import annotations

import re
from pathlib import Path

from qualify.resources import contracts_dir

TINY = contracts_dir() / "tiny-qwen3.toml"


def torch_tp_only_text() -> str:
    """The text of ``tiny-qwen3.toml`` reduced to torch_tp cells and the HF sampler.

    Raises:
        AssertionError: the committed contract no longer has the sections edited here.
    """
    text = TINY.read_text(encoding="utf-8")
    text, n = re.subn(r'(?m)^engines = \[.*\]$', 'engines = ["torch_tp"]', text, count=1)
    assert n == 1, "tiny-qwen3.toml: [matrix] engines line not found"
    text = re.sub(r"(?ms)^\[matrix\.engine_options\.[a-z_]+\]\n.*?(?=^\[)", "", text)
    text = re.sub(r"(?ms)^\[sampler\]\n.*?(?=^\[)", "", text)
    text, n = re.subn(r'(?m)^(\[sampling\]\n(?:#.*\n)*)engine = "vllm"$', r'\1engine = "hf"',
                      text, count=1)
    assert n == 1, "tiny-qwen3.toml: [sampling] engine = \"vllm\" not found"
    # The round-to-round term's perturbed updates (170 per lane) are a third of the default
    # reference stage; the stage tests that build this contract's reference test sealing,
    # resume, faults and tampering, not the bound rule (the committed default contract, with
    # the term, is built once per session by shared_artifacts.default_reference).
    text, n = re.subn(r'(?m)^round_to_round = true$', 'round_to_round = false', text, count=1)
    assert n == 1, "tiny-qwen3.toml: [bounds] round_to_round = true not found"
    return text


def torch_tp_only(directory: Path) -> Path:
    """Write :func:`torch_tp_only_text` to ``directory/tiny-qwen3.toml``; return the path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tiny-qwen3.toml"
    path.write_text(torch_tp_only_text(), encoding="utf-8")
    return path
