"""Qwen3-8B's shape as ``contracts/qwen3-8b.toml`` states it, for hand-derived plan bytes.

The constants are the contract's model config (hidden ``H``, MLP width, layers, query and KV
heads, head dim ``D``, vocabulary ``V``); ``tests/test_plan_devices.py`` checks them against
:func:`qualify.reference.plan_core.model_shape`.
"""

from __future__ import annotations

from qualify.contract import load_contract
from qualify.reference import plan_core
from qualify.resources import contracts_dir

QWEN3_8B = contracts_dir() / "qwen3-8b.toml"
H, MLP, LAYERS, HEADS, KV_HEADS, D, V = 4096, 12288, 36, 32, 8, 128, 151936
LAYER = (H * HEADS * D + 2 * H * KV_HEADS * D + HEADS * D * H + 2 * D + 3 * H * MLP + 2 * H)
ACTOR = V * H + LAYERS * LAYER + H + V * H  # embedding, layers, final norm, untied lm_head
EMBED = V * H  # the largest parameter (lm_head is the same size)
GB = 10**9


def activations() -> tuple[int, int]:
    """``(one layer's activation elements of a micro-batch, the head's output bytes)``.

    Per token a layer keeps its inputs, projections, attention and MLP intermediates
    (counted by hand from the Qwen3 layer), times the micro-batch's ``b x T`` positions; the
    head's output is 5 FP32 ``[b, R, V]`` logit copies and two FP32 ``[b, T, H]`` hidden
    states.
    """
    contract = load_contract(QWEN3_8B)
    _, prompt, resp, _ = plan_core.rollout_shape(contract)
    mbs, pos = contract.algorithm.micro_batch_size, prompt + resp
    q, kv = HEADS * D, KV_HEADS * D
    layer_elems = 2 * H + 2 * (q + kv) + kv + 5 * q + 2 * H + 4 * MLP + (q + kv)
    head = 5 * mbs * resp * V * 4 + 2 * mbs * pos * H * 4
    return layer_elems * mbs * pos, head
