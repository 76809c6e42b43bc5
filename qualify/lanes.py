"""Reference lanes: a precision, and at BF16 the style of BF16 training an engine uses.

Legitimate ways to train in BF16 give different numbers, by more than the noise of any
one of them:

- ``params``: BF16 parameters for compute, FP32 master weights for the optimizer, the
  masters born from the FP32 checkpoint (FSDP2's ``MixedPrecisionPolicy``: FP32 sharded
  parameters, BF16 unsharded ones for compute): the lane ``bf16``;
- ``castmasters``: BF16 parameters for compute, FP32 master weights for the optimizer,
  the masters born from the BF16-cast parameters, ``bf16(checkpoint)`` upcast (DeepSpeed's
  ``bf16`` engine casts the module before it builds its FP32 partitions; Megatron-Core's
  ``Float16OptimizerWithFloat16Params`` makes each ``main_param`` as
  ``param.detach().clone().float()`` of the BF16 parameter): the lane ``bf16-castmasters``;
- ``autocast``: FP32 parameters under ``torch.autocast(dtype=torch.bfloat16)`` (torch
  mixed precision, as the ``torch_tp`` harness does): the lane ``bf16-autocast``.

``params`` and ``castmasters`` differ only where the checkpoint holds values that BF16
cannot represent (an FP32 random init, a dequantised GGUF); on a checkpoint stored in
BF16, as released checkpoints are, the two styles are the same computation.

A BF16 candidate is compared with the HF reference run **of its own style**, under bounds
set by controls run in that style (attention implementation, micro-batch partition, row
split), so the bound measures the noise within one style and a 1 % gradient bug is
visible. The ``bf16_mode`` control (the distance between ``params`` and ``autocast``)
stays measurable, but a bound that includes it (about 13 % on round-2 gradients on
tiny-qwen3) cannot see such a bug (issue #15). Each engine declares its style
(:attr:`qualify.registry.EngineSpec.bf16_style`).

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
    "forward_mode",
    "lane_bf16_mode",
    "lane_of",
    "lane_precision",
    "lanes",
]

Bf16Style = Literal["params", "castmasters", "autocast"]
BF16_STYLES: Final = ("params", "castmasters", "autocast")
DEFAULT_BF16_STYLE: Final[Bf16Style] = "params"


def lane_of(precision: str, bf16_style: str = DEFAULT_BF16_STYLE) -> str:
    """The lane of a cell at ``precision`` whose engine trains BF16 in ``bf16_style``.

    Args:
        precision: ``fp32`` or ``bf16`` (a cell's precision axis).
        bf16_style: ``params``, ``castmasters`` or ``autocast``; ignored unless
            ``precision == "bf16"``.

    Returns:
        ``fp32``, ``bf16`` (the ``params`` style), ``bf16-castmasters`` or
        ``bf16-autocast``.

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
    """The reference update's ``bf16_mode`` for a lane (``params`` outside BF16).

    Raises:
        ValueError: a lane whose BF16 style is unknown.
    """
    _, _, style = lane.partition("-")
    if not style:
        return DEFAULT_BF16_STYLE
    if style == "castmasters":
        return "castmasters"
    if style == "autocast":
        return "autocast"
    raise ValueError(f"lane {lane!r}: unknown BF16 style {style!r}")


def forward_mode(style: str) -> Literal["params", "autocast"]:
    """How a BF16 style runs a forward pass: on BF16 parameters, or under autocast.

    ``params`` and ``castmasters`` differ only in how the FP32 masters are born, so a
    frozen model (reward scoring, the KL reference policy) runs the same in both.
    """
    return "autocast" if style == "autocast" else "params"


def lanes(precisions: Iterable[str], bf16_styles: Iterable[str]) -> list[str]:
    """The lanes a reference seals for a matrix.

    Args:
        precisions: the matrix's precisions.
        bf16_styles: the BF16 styles of the matrix's trainer engines.

    Returns:
        Each precision once, BF16 expanded into one lane per style in use (``params``
        when no engine declares one), in a stable order: ``fp32``, ``bf16``,
        ``bf16-castmasters``, ``bf16-autocast``.
    """
    out: list[str] = []
    styles = sorted(set(bf16_styles), key=BF16_STYLES.index) or [DEFAULT_BF16_STYLE]
    for p in precisions:
        out += [lane_of(p, s) for s in styles] if p == "bf16" else [p]
    return list(dict.fromkeys(out))
