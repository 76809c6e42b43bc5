"""Read back, at run time, which kernels a trainer's forwards dispatched to.

:func:`sdpa_recorder` wraps ``torch.nn.functional.scaled_dot_product_attention`` for the
duration of a ``with`` block; every call made through it (Hugging Face's ``sdpa`` attention
looks the function up on the module at call time) asks torch which fused backend it selects
for those very arguments (``torch._fused_sdp_choice``: ``MATH``, ``FLASH_ATTENTION``,
``EFFICIENT_ATTENTION``, ``CUDNN_ATTENTION``, ...) and counts it by name with the device and
dtype of the query. A ``DTensor`` query is asked about through its local shard (what the
kernel runs on). Nothing is recorded for code that does not call SDPA (``eager`` attention,
Megatron's local ``DotProductAttention``): :func:`sdpa_summary` then says so.

The same mechanism as :mod:`qualify.routes` (the reference side), kept here because the
SDK never imports ``qualify``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Final

import torch

NO_SDPA: Final = "no SDPA call"
"""The only key of :func:`sdpa_summary` when no forward called SDPA (count 0)."""


def backend_name(choice: int) -> str:
    """The :class:`torch.nn.attention.SDPBackend` member name of ``choice`` (else its str)."""
    names = {int(v.value): k for k, v in torch.nn.attention.SDPBackend.__members__.items()}
    return names.get(int(choice), str(choice))


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


@contextlib.contextmanager
def sdpa_recorder(into: dict[str, int] | None = None) -> Iterator[dict[str, int]]:
    """Count the SDPA backends torch selects for the calls made inside the block.

    Args:
        into: the dict to count into (a fresh one by default); counts add up over blocks.

    Yields:
        ``{"<backend> <device> <dtype>": calls}``, filled as the calls happen. A backend
        torch cannot name for the arguments is ``unknown (<exception type>)``.
    """
    seen: dict[str, int] = {} if into is None else into
    fn = torch.nn.functional.scaled_dot_product_attention

    def wrapped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        q, k, v = (_as_dispatched(_local(t)) for t in (query, key, value))
        loc_args = [_as_dispatched(_local(a)) for a in args]
        loc_kwargs = {n: _as_dispatched(_local(a)) for n, a in kwargs.items()}
        try:
            choice = backend_name(torch._fused_sdp_choice(q, k, v, *loc_args, **loc_kwargs))
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            choice = f"unknown ({type(exc).__name__})"
        label = f"{choice} {q.device.type} {str(q.dtype).removeprefix('torch.')}"  # as run
        seen[label] = seen.get(label, 0) + 1
        return fn(query, key, value, *args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = wrapped
    try:
        yield seen
    finally:
        torch.nn.functional.scaled_dot_product_attention = fn



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

def sdpa_summary(seen: Mapping[str, int]) -> dict[str, int]:
    """``seen`` as recorded, or ``{NO_SDPA: 0}`` when no forward called SDPA."""
    return dict(seen) if seen else {NO_SDPA: 0}


def sdpa_backends(seen: Mapping[str, int]) -> set[str]:
    """The backend names in ``seen``'s labels (``MATH cpu float32`` -> ``MATH``)."""
    return {label.split(" ")[0] for label, n in seen.items() if label != NO_SDPA}


def optimizer_route(opt: Any) -> dict[str, Any]:
    """The optimizer class actually built and its kernel flags (``fused``, ``foreach``).

    Read from the live object (``type(opt)``, ``opt.defaults``); a wrapper's inner optimizer
    (``opt.optimizer``, as DeepSpeed's and Megatron's wrappers hold it) is followed once.
    """
    out: dict[str, Any] = {"class": f"{type(opt).__module__}.{type(opt).__qualname__}"}
    defaults = getattr(opt, "defaults", None)
    if isinstance(defaults, Mapping):
        for key in ("fused", "foreach", "capturable"):
            if key in defaults:
                out[key] = defaults[key]
    inner = getattr(opt, "optimizer", None)
    if inner is not None and inner is not opt:
        out["inner"] = optimizer_route(inner) if not hasattr(inner, "optimizer") else \
            {"class": f"{type(inner).__module__}.{type(inner).__qualname__}"}
    return out
