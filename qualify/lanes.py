"""Reference lanes: a precision, and at BF16 the style of BF16 training an engine uses.

Two legitimate ways to train in BF16 give different numbers, by more than the noise of
either one:

- ``params``: BF16 parameters for compute, an FP32 master copy for the optimizer
  (DeepSpeed's ``bf16`` ZeRO engine, Megatron-Core's ``Float16OptimizerWithFloat16Params``
  / distributed optimizer with ``main_params``): the lane ``bf16``;
- ``autocast``: FP32 parameters under ``torch.autocast(dtype=torch.bfloat16)`` (torch
  mixed precision, as the ``torch_tp`` harness does): the lane ``bf16-autocast``.

A BF16 candidate is compared with the HF reference run **of its own style**, under bounds
set by controls run in that style (attention implementation, micro-batch partition), so
the bound measures the noise within one style and a 1 % gradient bug is visible. The
``bf16_mode`` control (the distance between the two styles) stays measurable, but a bound
that includes it (about 13 % on round-2 gradients on tiny-qwen3) cannot see such a bug
(issue #15). Each engine declares its style (:attr:`qualify.registry.EngineSpec.bf16_style`).

A lane names the reference's tensor files (``reference/hf-{lane}.safetensors``,
``controls/{control}-{lane}.safetensors``, ``branches/hf-{lane}.safetensors``) and the
``precision`` field of the sealed bounds. ``fp32`` and ``bf16`` keep the names of
references sealed before lanes existed.

This module imports no engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal

__all__ = [
    "BF16_STYLES",
    "DEFAULT_BF16_STYLE",
    "Bf16Style",
    "lane_bf16_mode",
    "lane_of",
    "lane_precision",
    "lanes",
]

Bf16Style = Literal["params", "autocast"]
BF16_STYLES: Final = ("params", "autocast")
DEFAULT_BF16_STYLE: Final[Bf16Style] = "params"


def lane_of(precision: str, bf16_style: str = DEFAULT_BF16_STYLE) -> str:
    """The lane of a cell at ``precision`` whose engine trains BF16 in ``bf16_style``.

    Args:
        precision: ``fp32`` or ``bf16`` (a cell's precision axis).
        bf16_style: ``params`` or ``autocast``; ignored unless ``precision == "bf16"``.

    Returns:
        ``fp32``, ``bf16`` (the ``params`` style) or ``bf16-autocast``.

    Raises:
        ValueError: an unknown BF16 style.
    """
    if precision != "bf16":
        return precision
    if bf16_style not in BF16_STYLES:
        raise ValueError(f"bf16_style {bf16_style!r}: one of {BF16_STYLES}")
    return "bf16" if bf16_style == "params" else f"bf16-{bf16_style}"


def lane_precision(lane: str) -> str:
    """The precision of a lane (``bf16-autocast`` -> ``bf16``): the key of its floors."""
    return lane.split("-", 1)[0]


def lane_bf16_mode(lane: str) -> Bf16Style:
    """The reference update's ``bf16_mode`` for a lane (``params`` outside BF16)."""
    _, _, style = lane.partition("-")
    if style and style not in BF16_STYLES:
        raise ValueError(f"lane {lane!r}: unknown BF16 style {style!r}")
    return "autocast" if style == "autocast" else "params"


def lanes(precisions: Iterable[str], bf16_styles: Iterable[str]) -> list[str]:
    """The lanes a reference seals for a matrix.

    Args:
        precisions: the matrix's precisions.
        bf16_styles: the BF16 styles of the matrix's trainer engines.

    Returns:
        Each precision once, BF16 expanded into one lane per style in use (``params``
        when no engine declares one), in a stable order: ``fp32``, ``bf16``,
        ``bf16-autocast``.
    """
    out: list[str] = []
    styles = sorted(set(bf16_styles), key=BF16_STYLES.index) or [DEFAULT_BF16_STYLE]
    for p in precisions:
        out += [lane_of(p, s) for s in styles] if p == "bf16" else [p]
    return list(dict.fromkeys(out))
