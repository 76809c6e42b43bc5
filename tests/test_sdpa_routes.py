"""The SDPA route recorders report the backend of the call that runs, under autocast too.

Under ``torch.autocast`` SDPA receives its floating arguments cast to the autocast dtype;
Qwen3's ``q_norm`` / ``k_norm`` hand it FP32 queries and keys beside a BF16 ``value``.
Asked about the arguments as the caller holds them, torch names ``MATH`` (mixed dtypes);
the call that runs gets BF16 tensors and ``FLASH_ATTENTION`` on CPU. The recorder (the
harness SDK's :mod:`qualify_harness.routes`, which the reference stage uses too) must record
the latter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
from qualify_harness import routes as sdk_routes
from torch.nn import functional

Recorder = Callable[[], AbstractContextManager[dict[str, int]]]
RECORDERS: dict[str, Recorder] = {"qualify_harness.routes": sdk_routes.sdpa_recorder}


def _args() -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 8, 32, generator=g) for _ in range(2))
    v = torch.randn(2, 4, 8, 32, generator=g).bfloat16()
    mask = torch.zeros(2, 1, 8, 8)
    yield from (q, k, v, mask)


def _name(choice: int) -> str:
    return sdk_routes.backend_name(choice)


@pytest.mark.parametrize("which", sorted(RECORDERS))
def test_autocast_records_the_backend_of_the_cast_call(which: str) -> None:
    q, k, v, mask = _args()
    as_held = _name(torch._fused_sdp_choice(q, k, v, mask, 0.0, False))
    qb, kb, vb, mb = (t.bfloat16() for t in (q, k, v, mask))
    as_run = _name(torch._fused_sdp_choice(qb, kb, vb, mb, 0.0, False))
    assert as_held != as_run, "the arguments no longer tell the two apart on this torch"
    with RECORDERS[which]() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        out = functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.dtype == torch.bfloat16  # autocast did cast the call
    assert seen == {f"{as_run} cpu bfloat16": 1}


@pytest.mark.parametrize("which", sorted(RECORDERS))
def test_without_autocast_the_arguments_are_asked_about_as_given(which: str) -> None:
    q, k, v, mask = _args()
    v32: Any = v.float()
    with RECORDERS[which]() as seen:
        functional.scaled_dot_product_attention(q, k, v32, attn_mask=mask)
    expected = _name(torch._fused_sdp_choice(q, k, v32, mask, 0.0, False))
    assert seen == {f"{expected} cpu float32": 1}
