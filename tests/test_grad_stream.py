"""Per-layer gradient streaming of the reference update (``gradients = "host"``).

:class:`qualify.reference.update._GradStream` moves each parameter's gradient to the host as
the backward completes it and every reader of the round's gradient (the sealed ``grads``, the
norm and the clip, :class:`~qualify.reference.update.HostAdamW`'s step, the sensitivity pass)
reads the host copy. The micro-batch accumulation is then a host sum of the same gradients in
the same order: every sealed tensor and the meta must equal, bitwise, the unstreamed run with
the state on the host, and the option must really be taken (the devices hold no gradient at
the step, one hook call per parameter, micro-batch and round).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from placed_runs import (
    EnteredError,
    assert_same_runs,
    placed_update_runs,
    spy_on_entered_devices,
    tiny_contract,
)
from tiny_models import THREE_LAYER_CFG, seeded_qwen3

from qualify.contract import load_contract
from qualify.reference import devices, plan_core, update
from qualify.reference import plan as reference_plan
from qualify.resources import contracts_dir


def _run(gradients: str, precision: str, mode: str,
         seen: list[update._GradStream]) -> tuple[Any, ...]:
    """The Actor's and the Critic's update runs on two ``cpu`` devices, state on the host;
    ``(actor, critic, metas, the bytes noted per device, the contract)``."""
    two = devices.ReferenceDevices(("cpu", "cpu"), devices.ENV, "host", gradients)
    actor, critic, meta_a, meta_c, record = placed_update_runs(two, precision, mode)
    assert record["gradients"] == gradients
    return actor, critic, meta_a, meta_c, record["memory"]["bytes"], tiny_contract()


@pytest.mark.parametrize(("precision", "mode"), [("fp32", "params"), ("bf16", "castmasters"),
                                                 ("fp64", "params")])
@pytest.mark.usefixtures("one_thread")
def test_streamed_gradients_seal_bitwise_the_unstreamed(precision: str, mode: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor (grads, norms, moments, updates, logprobs, values, losses) and the meta
    (dtypes, FP32 norm evaluations, sensitivities) equal; the streamed run's hooks ran once
    per parameter, micro-batch and round on the module the backward went through."""
    seen: list[update._GradStream] = []
    plain_attach = update._GradStream.attach

    def spy(self: update._GradStream, module: torch.nn.Module) -> None:
        if self not in seen:
            seen.append(self)
        plain_attach(self, module)

    monkeypatch.setattr(update._GradStream, "attach", spy)
    dev = _run("device", precision, mode, seen)
    assert not seen
    host = _run("host", precision, mode, seen)
    assert_same_runs(dev, host, must_have="/grads/")
    # noted per device at each step: the master and its .grad, or the master alone
    assert [2 * b for b in host[4]] == dev[4]
    assert all(b > 0 for b in host[4])
    contract = host[5]
    rounds, batches = contract.algorithm.rounds, 2  # 4 rows, micro-batches of 2
    assert len(seen) == 2  # the Actor's and the Critic's runs
    n_params = len([p for p in seeded_qwen3("actor", THREE_LAYER_CFG).parameters()
                    if p.requires_grad])
    assert seen[0].calls == rounds * batches * n_params
    assert all(not s.grads and not s._handles for s in seen)  # emptied, hooks removed


def test_streaming_needs_the_host_state() -> None:
    """``gradients = "host"`` with the AdamW state on the devices is refused (the step reads
    the host copies only through :class:`~qualify.reference.update.HostAdamW`)."""
    with pytest.raises(ValueError, match="needs optimizer_state host"):
        devices.ReferenceDevices(("cpu",), devices.ENV, "device", "host")
    with pytest.raises(ValueError, match=r"ReferenceDevices\.gradients"):
        devices.ReferenceDevices(("cpu",), devices.ENV, "host", "disk")


def _qwen3_8b() -> Any:
    return load_contract(contracts_dir() / "qwen3-8b.toml")


@pytest.mark.parametrize("contract_name", ["qwen3-8b", "smollm2-135m"])
@pytest.mark.parametrize("n", [1, 3])
def test_the_planned_stream_drops_the_update_gradients(contract_name: str, n: int) -> None:
    """Streamed, every update, control and round-to-round step's device peak is at most the
    unstreamed one's (the clip-branch reruns keep ``.grad`` there: unchanged), the host's at
    least; on one device an FP64 control whose peak is its backward drops exactly the FP64
    gradient less the one parameter in flight (``8 P - 8 x largest``)."""

    contract = load_contract(contracts_dir() / f"{contract_name}.toml")
    m = plan_core.Machine(devices=n, device_bytes=10**15, host_bytes=10**15, cores=2)
    plain = reference_plan.plan_reference(contract, m, optimizer_state="host")
    streamed = reference_plan.plan_reference(contract, m, optimizer_state="host", gradients="host")
    assert [s.name for s in plain] == [s.name for s in streamed]
    dropped = 0
    for a, b in zip(plain, streamed, strict=True):
        if a.name.startswith(("updates", "control", "round_to_round")):
            assert b.device_peak <= a.device_peak, a.name
            assert b.host_peak >= a.host_peak, a.name
            dropped += b.device_peak < a.device_peak
        else:
            assert (b.device_peak, b.host_peak) == (a.device_peak, a.host_peak), a.name
    assert dropped
    if n == 1:
        shape = plan_core.model_shape(contract)
        largest = max(k for _, k in shape.params("actor"))
        a, b = (next(s for s in steps if s.name == "control fp64-fp32")
                for steps in (plain, streamed))
        if contract_name == "smollm2-135m":  # its FP64 control peaks in the backward
            assert a.device_phase == b.device_phase == "actor backward"
            assert a.device_peak - b.device_peak == 8 * shape.count("actor") - 8 * largest
        else:  # streamed, the FP64 control's load (weights, FP32 before .double()) is left
            assert a.device_phase != "actor load", a.device_phase
            assert b.device_phase == "actor load", b.device_phase
            assert b.device_peak < a.device_peak


def test_build_plan_streams_only_when_the_devices_need_it() -> None:
    """Qwen3-8B on 4 devices of 48 GB: the host state alone leaves the FP64 control short;
    streaming fits, so the plan takes both. On 8 x 141 GB neither is taken; a stream without
    the host state is refused."""

    contract = _qwen3_8b()
    tight = plan_core.Machine(devices=4, device_bytes=48 * 10**9,
                              host_bytes=2000 * 10**9, cores=2)
    plan = reference_plan.build_plan(contract, tight)
    assert (plan.optimizer_state, plan.gradients) == ("host", "host")
    assert plan.shortfall("reference") is None
    assert plan.gradients_why.startswith("with them on the devices: control fp64-fp32: "), \
        plan.gradients_why
    unstreamed = reference_plan.build_plan(contract, tight, optimizer_state="host",
                                           gradients="device")
    assert unstreamed.shortfall("reference") is not None
    roomy = dataclasses.replace(tight, devices=8, device_bytes=141 * 10**9)
    plan = reference_plan.build_plan(contract, roomy)
    assert (plan.optimizer_state, plan.gradients) == ("device", "device")
    assert plan.to_dict()["gradients"] == "device"
    with pytest.raises(ValueError, match="gradients"):
        reference_plan.plan_reference(contract, roomy, optimizer_state="device", gradients="host")


def test_the_stage_enters_its_devices_with_the_plans_stream(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The plan's ``gradients = "host"`` and ``round2_state = "g1"`` reach the stage's
    :class:`ReferenceDevices` and its ``plan_check`` record."""
    from qualify.reference import stage

    seen = spy_on_entered_devices(monkeypatch)
    plain_build = reference_plan.build_plan
    monkeypatch.setattr(reference_plan, "build_plan", lambda c, m: plain_build(
        c, m, optimizer_state="host", gradients="host", round2_state="g1"))
    monkeypatch.setenv(devices.ENV, "cpu,cpu")
    monkeypatch.setenv(devices.MEMORY_ENV, "1")
    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    with pytest.raises(EnteredError):
        stage.run_reference_stage(contract, root=tmp_path, quiet=True)
    assert seen[-1] == devices.ReferenceDevices(("cpu",) * 2, devices.ENV, "host", "host", "g1")
    record = stage._plan_check(contract, True, seen[-1], devices.device_memory())
    assert (record["gradients"], record["gradients_why"]) == ("host", "asked for")
    assert (record["round2_state"], record["round2_state_why"]) == ("g1", "asked for")
