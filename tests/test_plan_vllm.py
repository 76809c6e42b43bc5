"""``qualify plan``: the vLLM processes (the reference stage's rollout, the candidate sampler).

The expected figures are derived here from the model's parameter count and the constants,
term by term, as the harness runs the engines (``harnesses/vllm``); the sizes the plan takes
from the harness are checked against the harness's own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qualify.candidate.plan import VLLM_SAMPLER_KV_BYTES
from qualify.contract import load_contract
from qualify.reference import plan_core
from qualify.reference.plan import VLLM_ROLLOUT_KV_BYTES, build_plan
from qualify.reference.plan_core import INTERPRETER_BYTES, VLLM_ENGINE_BYTES, Machine, model_shape

ROOT = Path(__file__).resolve().parents[1]
HOST = Machine(devices=0, device_bytes=0, host_bytes=64 * 10**9, cores=2)
GPUS = Machine(devices=8, device_bytes=141 * 10**9, host_bytes=2000 * 10**9, cores=64,
               device_kind="gpu")


def test_the_harness_settings_the_plan_uses() -> None:
    """KV cache sizes and the decode path's passes are the vLLM harness's."""
    from harnesses.vllm import decode, engine, harness

    assert VLLM_ROLLOUT_KV_BYTES == engine.DEFAULT_KV_CACHE_BYTES
    assert VLLM_SAMPLER_KV_BYTES == harness.KV_CACHE_BYTES
    assert len(decode.PASSES) + 1 == 4  # the four [B, R, V] the plan holds per process


@pytest.mark.parametrize("machine", [HOST, GPUS], ids=["host", "gpus"])
def test_the_rollout_is_the_reference_stage_s_first_step_on_the_host(machine: Machine) -> None:
    """The pinned vLLM is the CPU build: the rollout is planned on the host, devices or not."""
    contract = load_contract(ROOT / "contracts" / "tiny-qwen3.toml")
    assert contract.sampling.engine == "vllm"
    tp = contract.sampling.tp
    p = model_shape(contract).count("actor")
    steps = build_plan(contract, machine).steps
    first = steps[0]
    assert first.name == f"rollout vllm tp{tp} (child process)"
    assert first.kind == "reference"
    assert first.device_peak == 0
    # the stage's process, the child (and its tp workers beyond TP 1), the parameters over
    # the ranks, a KV cache per rank, the checkpoint the parameters are copied from
    processes = 1 + (tp if tp > 1 else 0)
    assert first.host_peak == (INTERPRETER_BYTES + processes * VLLM_ENGINE_BYTES + 4 * p
                               + tp * VLLM_ROLLOUT_KV_BYTES + 4 * p)
    assert [s.name for s in steps].count(first.name) == 1


def test_the_sampler_step_runs_every_sampler_cell_beside_the_trainer_launches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the sampler's engines are alive during every trainer launch (two launches at a
    time), so each trainer launch's host peak carries the sampler's; with
    ``QUALIFY_JOBS=1`` (or a CUDA machine's default) it does not; a bad ``QUALIFY_JOBS``
    does not fail the plan (it is the candidate stage's error)."""
    contract = load_contract(ROOT / "contracts" / "tiny-qwen3.toml")
    assert contract.sampler is not None
    tps = list(contract.sampler.tp_sizes)
    assert tps == [1, 2]
    shape = model_shape(contract)
    p = shape.count("actor")
    n_seq, _, resp, _ = plan_core.rollout_shape(contract)
    monkeypatch.delenv("QUALIFY_JOBS", raising=False)
    monkeypatch.delenv("QUALIFY_AHEAD", raising=False)
    steps = build_plan(contract, HOST).steps
    (sampler,) = [s for s in steps if s.kind == "sampler"]
    assert sampler.name == "sampler vllm-tp1-tp2 (2 cells, 3 ranks)"
    ranks = 3  # the harness process runs the TP 1 engine and forks the TP 2 engine's 2 ranks
    distribution = 4 * n_seq * resp * shape.vocab_size
    assert sampler.host_peak == (ranks * VLLM_ENGINE_BYTES
                                 + 2 * 4 * p  # each engine's parameters
                                 + 4 * p  # one mapped checkpoint
                                 + ranks * VLLM_SAMPLER_KV_BYTES
                                 + ranks * 8 * p  # each rank's probes read both weights
                                 + ranks * 4 * distribution)  # three passes and round 2's
    assert sampler.processes == ranks
    trainers = [s for s in steps if s.kind == "launch"]
    assert trainers
    assert all(s.terms["sampler_beside"] == sampler.host_peak for s in trainers)
    for jobs in ("1", "three"):
        monkeypatch.setenv("QUALIFY_JOBS", jobs)
        alone = [s for s in build_plan(contract, HOST).steps if s.kind == "launch"]
        if jobs == "1":
            assert all("sampler_beside" not in s.terms for s in alone)
            # QUALIFY_JOBS=1 also runs no launcher ahead (tests/test_ahead.py)
            assert [a.host_peak + sampler.host_peak + s.terms.get("launcher_ahead", 0)
                    for a, s in zip(alone, trainers, strict=True)] == \
                [s.host_peak for s in trainers]
        else:  # not a number: the plan takes the default (beside, on CPU)
            assert [s.host_peak for s in alone] == [s.host_peak for s in trainers]
    monkeypatch.delenv("QUALIFY_JOBS")
    on_gpus = build_plan(contract, GPUS).steps
    assert all("sampler_beside" not in s.terms for s in on_gpus)


def test_the_sampler_needs_no_device() -> None:
    """A one-device machine refuses the three-rank trainer launches, not the sampler, whose
    CPU engines hold no device."""
    contract = load_contract(ROOT / "contracts" / "tiny-qwen3.toml")
    one = Machine(devices=1, device_bytes=141 * 10**9, host_bytes=2000 * 10**9, cores=64,
                  device_kind="gpu")
    plan = build_plan(contract, one)
    lines = plan.shortfalls()
    assert lines
    assert all(line.startswith("launch ") for line in lines), lines
    assert not any(line.startswith("sampler ") for line in lines)


def test_a_contract_without_a_sampler_section_plans_no_sampler_step() -> None:
    contract = load_contract(ROOT / "contracts" / "qwen3-8b.toml")
    assert contract.sampler is None
    steps = build_plan(contract, GPUS).steps
    assert not any(s.kind == "sampler" for s in steps)
    assert all("sampler_beside" not in s.terms for s in steps)
