"""``qualify plan``: the vLLM processes (the reference stage's rollout, the candidate sampler).

The expected figures are derived here from the model's parameter count and the constants,
term by term, not read back from the plan's own helpers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qualify.contract import load_contract
from qualify.reference import plan as plan_mod
from qualify.reference.plan import (
    INTERPRETER_BYTES,
    VLLM_ENGINE_BYTES,
    VLLM_ROLLOUT_KV_BYTES,
    VLLM_SAMPLER_KV_BYTES,
    Machine,
    build_plan,
    model_shape,
)

ROOT = Path(__file__).resolve().parents[1]
HOST = Machine(devices=0, device_bytes=0, host_bytes=64 * 10**9, cores=2)
GPUS = Machine(devices=8, device_bytes=141 * 10**9, host_bytes=2000 * 10**9, cores=64,
               device_kind="gpu")


def test_the_kv_cache_sizes_are_the_harness_settings() -> None:
    """The plan's KV cache sizes are the ones the vLLM harness gives its engines."""
    from harnesses.vllm import engine, harness

    assert VLLM_ROLLOUT_KV_BYTES == engine.DEFAULT_KV_CACHE_BYTES
    assert VLLM_SAMPLER_KV_BYTES == harness.KV_CACHE_BYTES


def test_the_rollout_is_the_reference_stage_s_first_step_with_its_terms() -> None:
    contract = load_contract(ROOT / "contracts" / "tiny-qwen3.toml")
    assert contract.sampling.engine == "vllm"
    p = model_shape(contract).count("actor")
    steps = build_plan(contract, HOST).steps
    first = steps[0]
    assert first.name == f"rollout vllm tp{contract.sampling.tp} (child process)"
    assert first.kind == "reference"
    tp = contract.sampling.tp
    # the stage's process, then per rank a vLLM process and its KV cache, the FP32
    # parameters and the checkpoint they are copied from
    assert first.host_peak == (INTERPRETER_BYTES + tp * (VLLM_ENGINE_BYTES + VLLM_ROLLOUT_KV_BYTES)
                               + 4 * p + 4 * p)
    assert [s.name for s in steps].count(first.name) == 1
    gpu = build_plan(contract, GPUS).steps[0]  # parameters and KV cache on the devices
    assert gpu.device_peak == 4 * p // tp + VLLM_ROLLOUT_KV_BYTES
    assert gpu.host_peak == INTERPRETER_BYTES + tp * VLLM_ENGINE_BYTES + 4 * p


def test_the_sampler_step_runs_every_sampler_cell_beside_the_trainer_launches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the sampler's engines are alive during every trainer launch (two launches at a
    time), so each trainer launch's host peak carries the sampler's; with
    ``QUALIFY_JOBS=1`` or on GPUs (one launch at a time) it does not."""
    contract = load_contract(ROOT / "contracts" / "tiny-qwen3.toml")
    assert contract.sampler is not None
    tps = list(contract.sampler.tp_sizes)
    shape = model_shape(contract)
    p = shape.count("actor")
    n_seq, _, resp, _ = plan_mod._rollout_shape(contract)
    monkeypatch.delenv("QUALIFY_JOBS", raising=False)
    launches = [s for s in build_plan(contract, HOST).steps if s.kind == "launch"]
    sampler = launches[-1]
    assert sampler.name == (f"sampler vllm-{'-'.join(f'tp{t}' for t in tps)} "
                            f"({len(tps)} cells, {sum(tps)} ranks)")
    distributions = 2 * 4 * n_seq * resp * shape.vocab_size  # raw and tempered [B, R, V]
    assert sampler.host_peak == (sum(t * (VLLM_ENGINE_BYTES + VLLM_SAMPLER_KV_BYTES)
                                     + 4 * p for t in tps)
                                 + 4 * p  # one mapped checkpoint
                                 + 4 * p  # the round-1 weights read from their file
                                 + len(tps) * distributions)
    trainers = launches[:-1]
    assert trainers
    assert all(s.terms["sampler_beside"] == sampler.host_peak for s in trainers)
    monkeypatch.setenv("QUALIFY_JOBS", "1")
    alone = [s for s in build_plan(contract, HOST).steps if s.kind == "launch"]
    assert all("sampler_beside" not in s.terms for s in alone)
    assert [a.host_peak + sampler.host_peak for a in alone[:-1]] == \
        [s.host_peak for s in trainers]
    monkeypatch.delenv("QUALIFY_JOBS")
    on_gpus = [s for s in build_plan(contract, GPUS).steps if s.kind == "launch"]
    assert all("sampler_beside" not in s.terms for s in on_gpus)
    # engines of TP t take devices 0 .. t-1: device 0 holds a rank of each
    assert on_gpus[-1].processes == max(tps)
    assert on_gpus[-1].device_peak == sum(4 * p // t + VLLM_SAMPLER_KV_BYTES for t in tps)


def test_a_sampler_needing_more_devices_than_the_machine_has_is_refused() -> None:
    contract = load_contract(ROOT / "contracts" / "tiny-qwen3.toml")
    assert contract.sampler is not None
    assert max(contract.sampler.tp_sizes) == 2
    one = Machine(devices=1, device_bytes=141 * 10**9, host_bytes=2000 * 10**9, cores=64,
                  device_kind="gpu")
    lines = build_plan(contract, one).shortfalls("launch")
    assert any(line.startswith("sampler vllm-tp1-tp2 (2 cells, 3 ranks): needs 2 devices at "
                               "once; the machine has 1") for line in lines), lines


def test_a_contract_without_a_sampler_section_plans_no_sampler_step() -> None:
    contract = load_contract(ROOT / "contracts" / "qwen3-8b.toml")
    assert contract.sampler is None
    steps = build_plan(contract, GPUS).steps
    assert not any(s.name.startswith("sampler ") for s in steps)
    assert all("sampler_beside" not in s.terms for s in steps)
