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
        try:
            choice = _backend_name(torch._fused_sdp_choice(query, key, value, *args, **kwargs))
        except (RuntimeError, TypeError) as exc:
            choice = f"unknown ({type(exc).__name__})"
        label = f"{choice} {query.device.type} {str(query.dtype).removeprefix('torch.')}"
        seen[label] = seen.get(label, 0) + 1
        return fn(query, key, value, *args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = wrapped
    try:
        yield seen
    finally:
        torch.nn.functional.scaled_dot_product_attention = fn
