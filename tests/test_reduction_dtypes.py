"""The precision policy where numbers are reduced: the ``dtypes`` row's reduction check.

A BF16 cell whose engine reduces or accumulates gradients in BF16 (FSDP2's
``MixedPrecisionPolicy.reduce_dtype``, DeepSpeed's ``communication_data_type`` and
``grad_accum_dtype``, Megatron's ``grad_reduce_in_fp32``) keeps FP32 masters, FP32 ``.grad``
and FP32 optimizer state, so the master / grads / state items of the ``dtypes`` row cannot see
it. Each trainer harness reads the reduction and accumulation dtypes back from its engine
object (``outputs.json`` ``dtypes.grad_reduction`` / ``dtypes.grad_accumulation``) and
:func:`qualify.compare.rows.dtype_row` holds them to the contract's precision.

- the row itself, on generated ``dtypes`` documents (hypothesis): FAIL exactly when a master /
  grads / state item or a reduction entry is not FP32, or a reduction map is missing, and the
  legacy rule (``reduction=False``, reports sealed before ``reduction_dtypes``) is the old
  row;
- planted faults: real BF16 launches of FSDP2 and DeepSpeed with the reduction set to BF16 by
  a ``sitecustomize`` the test puts on the launch's ``PYTHONPATH`` (:mod:`plant`: the harness
  runs as shipped, one seam replaced), each beside the same launch unplanted (PASS);
- Megatron: the same, a real BF16 Actor cell on its CPU path
  (:mod:`harnesses.megatron.cpu_shims`) with ``grad_reduce_in_fp32=False`` planted in
  ``DistributedDataParallelConfig``;
  its ``main_grad`` is a view of the grad buffer, so the reported ``grads`` show the BF16
  buffer too, and the reduction entries name where it came from.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from harness_outputs import build_inputs
from hypothesis import given, settings
from hypothesis import strategies as st
from plant import plant_env

from qualify.compare.rows import FP32, OPTIMIZER_STATE_KEYS, REDUCTION_KEYS, dtype_row
from qualify.protocol import HarnessCell
from qualify.registry import get_engine

BF16 = "torch.bfloat16"
DTYPES = st.sampled_from([FP32, BF16, "torch.float16", [BF16, FP32]])
NAMES = st.text(alphabet="abcdefgh_.", min_size=1, max_size=8)


def _meta(d: Mapping[str, Any]) -> dict[str, Any]:
    return {"dtypes": dict(d)}


# --------------------------------------------------------------------------- the row


@settings(max_examples=150, deadline=None)
@given(master=DTYPES, grads=DTYPES, state=st.dictionaries(st.sampled_from(
    ["exp_avg", "exp_avg_sq", "step"]), DTYPES, min_size=2),
       reduction=st.one_of(st.none(), st.dictionaries(NAMES, DTYPES, max_size=3)),
       accumulation=st.one_of(st.none(), st.dictionaries(NAMES, DTYPES, max_size=3)),
       # the compare stage passes a cell's reference lane: every lane keys its precision
       precision=st.sampled_from(["fp32", "bf16", "bf16-castmasters", "bf16-autocast"]))
def test_row_fails_exactly_on_a_non_fp32_or_missing_item(
        master: Any, grads: Any, state: dict[str, Any], reduction: dict[str, Any] | None,
        accumulation: dict[str, Any] | None, precision: str) -> None:
    d: dict[str, Any] = {"master_weights": master, "grads": grads, "optimizer_state": state,
                         "compute": [BF16]}
    maps = dict(zip(REDUCTION_KEYS, (reduction, accumulation), strict=True))
    d.update({k: v for k, v in maps.items() if v is not None})
    bad_old = [k for k, v in [("master_weights", master), ("grads", grads),
                              *((f"optimizer_state.{k}", state.get(k))
                                for k in sorted(set(OPTIMIZER_STATE_KEYS) | set(state)))]
               if v != FP32]
    bad_new = list(bad_old)
    for key, m in maps.items():
        bad_new += ([key] if not m else [f"{key}.{n}" for n in sorted(m) if m[n] != FP32])
    row = dtype_row("c", "actor", _meta(d), "", precision=precision)
    legacy = dtype_row("c", "actor", _meta(d), "", precision=precision, reduction=False)
    for r, bad in ((row, bad_new), (legacy, bad_old)):
        assert (r.verdict == "FAIL") == bool(bad), (r, bad)
        if bad:
            assert r.detail is not None
            assert [t[0] for t in r.detail.table] == bad[:len(r.detail.table)]
            assert str(r.reason).startswith(f"dtypes: {bad[0]} is ")
            assert r.detail.mismatched == len(bad)


def test_missing_reduction_maps_are_named() -> None:
    d = {"master_weights": FP32, "grads": FP32, "compute": [BF16],
         "optimizer_state": {"exp_avg": FP32, "exp_avg_sq": FP32}}
    row = dtype_row("c", "critic", _meta(d), "", precision="bf16")
    assert row.verdict == "FAIL"
    assert row.reason == ("dtypes: grad_reduction is missing, expected torch.float32 "
                          "(and 1 more)")
    assert row.detail is not None
    assert [t[0] for t in row.detail.table] == ["grad_reduction", "grad_accumulation"]
    assert dtype_row("c", "critic", _meta(d), "", reduction=False).verdict == "PASS"
    d |= {"grad_reduction": {"x": FP32}, "grad_accumulation": {"y": FP32}}
    assert dtype_row("c", "critic", _meta(d), "", precision="bf16").verdict == "PASS"
    unknown = dtype_row("c", "critic", _meta(d), "", precision="fp8")
    assert unknown.verdict == "FAIL"
    assert "none for precision 'fp8'" in str(unknown.reason)


# --------------------------------------------------------------------------- launches


def _launch(root: Path, engine: str, name: str, *, options: Mapping[str, Any],
            env: Mapping[str, str] | None) -> dict[str, Any]:
    """One real BF16 Actor launch (1 round) of ``engine``; its ``outputs.json``."""
    from qualify.candidate.launch import launch

    spec = get_engine(engine)
    inputs = root / "inputs"
    if not inputs.exists():
        inputs.mkdir(parents=True)
        build_inputs(inputs, (10, 6, 3, 8), 10)
    out = root / name
    cell = HarnessCell(engine=engine, precision="bf16", options=dict(options), actor_tp=1,
                       critic_tp=0, rounds=1, seed=0, inputs_dir=str(inputs),
                       output_dir=str(out), collective_timeout_s=120.0)
    res = launch(cell, module=spec.module, attempt_dir=out, timeout_s=600.0, env=env,
                 world_size=spec.world_size(cell), preload=spec.warm_imports)
    assert res.status == "OK", res.reason
    meta: dict[str, Any] = json.loads((out / "outputs.json").read_text("utf-8"))
    return meta


def _rows(meta: Mapping[str, Any], cell: str) -> Any:
    row = dtype_row(cell, "actor", meta["roles"]["actor"], "", precision="bf16")
    print(f"\n[{cell}] {meta['roles']['actor']['dtypes']}\n  -> {row.verdict}: {row.reason}")
    return row


@pytest.mark.slow
def test_fsdp2_bf16_reduce_scatter_fails_the_dtypes_row(tmp_path: Path) -> None:
    """FSDP2 DP 2 BF16: ``reduce_dtype=bfloat16`` planted in the policy the harness builds."""
    plant = plant_env(tmp_path / "plant", "harnesses.fsdp2.parallelize", """
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy
        module.mp_policy = lambda precision: MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    """)
    clean = _launch(tmp_path, "fsdp2", "clean", options={"dp": 2}, env=None)
    bad = _launch(tmp_path, "fsdp2", "planted", options={"dp": 2}, env=plant)
    ok = _rows(clean, "fsdp2-bf16-actor-tp1-dp2")
    assert ok.verdict == "PASS", ok.reason
    row = _rows(bad, "fsdp2-bf16-actor-tp1-dp2")
    assert row.verdict == "FAIL"
    assert row.reason == ("dtypes: grad_reduction.fully_shard.reduce_scatter is torch.bfloat16, "
                          "expected torch.float32")
    # what the old check read is unchanged: FP32 masters, .grad and AdamW state
    d = bad["roles"]["actor"]["dtypes"]
    assert (d["master_weights"], d["grads"]) == (FP32, FP32)
    assert dtype_row("x", "actor", bad["roles"]["actor"], "", reduction=False).verdict == "PASS"


@pytest.mark.slow
def test_deepspeed_bf16_communication_dtype_fails_the_dtypes_row(tmp_path: Path) -> None:
    """DeepSpeed ZeRO 1 BF16: ``communication_data_type = "bf16"`` planted in its config.

    The engine's BF16 default is BF16 communication; the harness asks for FP32. With the
    plant, the gradients still accumulate in FP32 (``grad_accum_dtype``, the
    ``BF16_Optimizer``'s FP32 buffers), so masters, ``.grad`` and AdamW state stay FP32 and
    only the engine's communication dtype names the fault.
    """
    plant = plant_env(tmp_path / "plant", "harnesses.deepspeed.parallelize", """
        built = module.ds_config

        def ds_config(**kw):
            cfg = built(**kw)
            cfg["communication_data_type"] = "bf16"
            return cfg

        module.ds_config = ds_config
    """)
    clean = _launch(tmp_path, "deepspeed", "clean", options={"zero": 1}, env=None)
    bad = _launch(tmp_path, "deepspeed", "planted", options={"zero": 1}, env=plant)
    ok = _rows(clean, "deepspeed-bf16-zero1-actor-tp1")
    assert ok.verdict == "PASS", ok.reason
    row = _rows(bad, "deepspeed-bf16-zero1-actor-tp1")
    assert row.verdict == "FAIL"
    assert row.reason == ("dtypes: grad_reduction.engine.communication_data_type is "
                          "torch.bfloat16, expected torch.float32")
    d = bad["roles"]["actor"]["dtypes"]
    assert (d["master_weights"], d["grads"]) == (FP32, FP32)
    assert d["grad_accumulation"]["engine.get_data_types.grad_accum_dtype"] == FP32
    assert dtype_row("x", "actor", bad["roles"]["actor"], "", reduction=False).verdict == "PASS"


@pytest.mark.slow
def test_megatron_bf16_grad_buffers_fail_the_dtypes_row(tmp_path: Path) -> None:
    """Megatron BF16 (CPU path): ``grad_reduce_in_fp32=False`` planted in its DDP config."""
    plant = plant_env(tmp_path / "plant", "megatron.core.distributed", """
        config = module.DistributedDataParallelConfig

        def planted(**kw):
            kw["grad_reduce_in_fp32"] = False
            return config(**kw)

        module.DistributedDataParallelConfig = planted
    """)
    clean = _launch(tmp_path, "megatron", "clean", options={}, env=None)
    bad = _launch(tmp_path, "megatron", "planted", options={}, env=plant)
    ok = _rows(clean, "megatron-bf16-actor-tp1")
    assert ok.verdict == "PASS", ok.reason
    row = _rows(bad, "megatron-bf16-actor-tp1")
    assert row.verdict == "FAIL"
    # main_grad is the grad buffer itself: Megatron's reported grads show the dtype too
    assert row.reason == "dtypes: grads is torch.bfloat16, expected torch.float32 (and 2 more)"
    assert row.detail is not None
    assert list(row.detail.table) == [
        ("grads", BF16, FP32),
        ("grad_reduction.DistributedDataParallel.buckets.grad_data", BF16, FP32),
        ("grad_accumulation.param.main_grad", BF16, FP32)]
