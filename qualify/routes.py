"""Read back which torch SDPA kernel a forward actually dispatched to.

:func:`sdpa_recorder` wraps ``torch.nn.functional.scaled_dot_product_attention`` for the
duration of a ``with`` block; every call made through it (Hugging Face's ``sdpa`` attention
looks the function up on the module at call time) asks torch which fused backend it selects
for those very arguments (``torch._fused_sdp_choice``: ``MATH``, ``FLASH_ATTENTION``,
``EFFICIENT_ATTENTION``, ``CUDNN_ATTENTION``, ...) and counts it by name, with the device
and dtype of the query. Nothing is recorded for code that does not call SDPA (``eager``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _backend_name(choice: int) -> str:
    names = {int(v.value): k for k, v in torch.nn.attention.SDPBackend.__members__.items()}
    return names.get(int(choice), str(choice))


def _as_dispatched(a: Any) -> Any:
    """``a`` as SDPA receives it: under autocast a floating tensor is cast to its dtype.

    ``scaled_dot_product_attention`` is a lower-precision op of autocast, which casts every
    floating tensor argument before the backend is chosen; asked about the arguments as the
    caller holds them (Qwen3's ``q_norm`` / ``k_norm`` return FP32 beside a BF16 ``v``),
    ``torch._fused_sdp_choice`` would answer for mixed dtypes (``MATH``), not for the call
    that runs.
    """
    if not isinstance(a, torch.Tensor) or not a.is_floating_point():
        return a
    device = a.device.type
    if not torch.is_autocast_enabled(device):
        return a
    return a.to(torch.get_autocast_dtype(device))


@contextlib.contextmanager
def sdpa_recorder() -> Iterator[dict[str, int]]:
    """Count the SDPA backends torch selects for the calls made inside the block.

    Yields:
        ``{"<backend> <device> <dtype>": calls}``, filled as the calls happen.
    """
    seen: dict[str, int] = {}
    fn = torch.nn.functional.scaled_dot_product_attention

    def wrapped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        q, k, v = (_as_dispatched(t) for t in (query, key, value))
        try:
            choice = _backend_name(torch._fused_sdp_choice(
                q, k, v, *[_as_dispatched(a) for a in args],
                **{n: _as_dispatched(a) for n, a in kwargs.items()}))
        except (RuntimeError, TypeError) as exc:
            choice = f"unknown ({type(exc).__name__})"
        label = f"{choice} {q.device.type} {str(q.dtype).removeprefix('torch.')}"
        seen[label] = seen.get(label, 0) + 1
        return fn(query, key, value, *args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = wrapped
    try:
        yield seen
    finally:
        torch.nn.functional.scaled_dot_product_attention = fn
