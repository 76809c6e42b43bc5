"""``qualify plan`` with the AdamW state on the host, and the stage's choice of it.

With ``optimizer_state = "host"`` (:class:`qualify.reference.update.HostAdamW`) the whole
model's AdamW moments (``8`` bytes per FP32 parameter) and the sensitivity's ``saved`` copy
(``4``) are on the host; the devices keep the FP32 master and its ``.grad`` (``8``), the FP64
arithmetic of one parameter (``3 x 8`` bytes per element of the largest) and, in the
sensitivity pass, one parameter of the host copy brought back (``4`` bytes per element of the
largest); the host's AdamW step holds one parameter's value, gradient and the two
temporaries of torch's ``denom`` (``4 x 4`` bytes per element of the largest, measured
below). The expected bytes are written here from Qwen3-8B's shape (as
``tests/test_plan_devices.py``), not taken from the planner.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from qwen3_8b_shape import ACTOR, EMBED, GB, LAYERS, QWEN3_8B, activations

from qualify.contract import load_contract
from qualify.errors import ExitCode, UsageError
from qualify.reference import plan, plan_core
from qualify.resources import contracts_dir

NODE = plan_core.Machine(devices=1, device_bytes=141 * GB, host_bytes=2000 * GB, cores=2)


def test_host_state_moves_the_moments_and_the_copy_to_the_host() -> None:
    """One device, the FP32 update: the device keeps 8 bytes per parameter and the
    per-parameter transients (its peak the larger of the sensitivity pass and the backward);
    the host holds the interpreter, the moments and the copy (12 bytes per parameter); the
    device-state plan of the same step holds 12 bytes per parameter more on the device,
    less the one parameter brought back."""
    contract = load_contract(QWEN3_8B)
    host = {s.name: s for s in plan.plan_reference(contract, NODE, optimizer_state="host")}
    device = {s.name: s for s in plan.plan_reference(contract, NODE)}
    elements, head = activations()
    layer, n = 4 * elements, LAYERS
    sensitivity = 8 * ACTOR + 24 * EMBED + 4 * EMBED + head + layer
    backward = 8 * ACTOR + n * layer + head
    step = host["updates hf-fp32"]
    assert step.device_peak == max(sensitivity, backward)
    assert step.host_peak == plan_core.INTERPRETER_BYTES + 12 * ACTOR
    assert step.terms == {"interpreter": plan_core.INTERPRETER_BYTES, "adamw": 8 * ACTOR,
                          "sensitivity_copy": 4 * ACTOR}
    assert device["updates hf-fp32"].device_peak == 20 * ACTOR + 24 * EMBED + head + layer
    # the host's AdamW step of one parameter: below the sensitivity pass on the host here
    assert 8 * ACTOR + 4 * 4 * EMBED < 12 * ACTOR


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_host_state_never_holds_more_on_a_device(devices: int) -> None:
    """Whatever the split, no reference step needs more of a device with the state on the
    host than on the devices, and the whole-model moments land on the host."""
    contract = load_contract(QWEN3_8B)
    machine = plan_core.Machine(devices=devices, device_bytes=141 * GB, host_bytes=2000 * GB,
                                cores=2)
    host = plan.plan_reference(contract, machine, optimizer_state="host")
    device = plan.plan_reference(contract, machine)
    assert [s.name for s in host] == [s.name for s in device]
    for a, b in zip(host, device, strict=True):
        assert a.device_peak <= b.device_peak, a.name
    updates = next(s for s in host if s.name == "updates hf-fp32")
    assert updates.terms["adamw"] == 8 * ACTOR


def test_the_plan_chooses_host_state_only_when_the_devices_need_it() -> None:
    """1 x 141 GB: the device-state plan is refused at the FP32 update (179.4 GB), so the
    plan takes the state to the host, where the stage with the gradients on the device gets
    as far as the FP64 control (its weights, gradient and activations on the device: 151.9
    GB; the frozen reference policy is not loaded beside them), and with them streamed to
    the host the whole stage fits; 8 x 141 GB: it fits on the devices, which keep it; no
    devices: nothing to move. Asked for, either is planned."""
    contract = load_contract(QWEN3_8B)
    one = plan.build_plan(contract, NODE)
    assert one.optimizer_state == "host"
    assert one.optimizer_state_why.startswith("with the AdamW state on the devices: updates "
                                              "hf-fp32: needs 179.4 GB on a device")
    assert one.shortfall("reference") is None
    assert one.gradients == "host"
    assert plan.build_plan(contract, NODE, optimizer_state="host", gradients="device",
                           round2_state="moments").shortfall("reference").startswith(  # type: ignore[union-attr]
        "control fp64-fp32: needs 151.9 GB on a device")
    assert plan.build_plan(contract, NODE, optimizer_state="device").shortfall(
        "reference").startswith("updates hf-fp32: ")  # type: ignore[union-attr]
    eight = plan.build_plan(contract, plan_core.Machine(devices=8, device_bytes=141 * GB,
                                                        host_bytes=2000 * GB, cores=2))
    assert eight.optimizer_state == "device"
    host_only = plan.build_plan(contract, plan_core.Machine(devices=0, device_bytes=0,
                                                            host_bytes=10 * GB, cores=2))
    assert host_only.optimizer_state == "device"
    assert host_only.shortfall("reference") is not None
    # host state that would not get further keeps the state on the devices: a host too small
    # for the moments
    small_host = plan_core.Machine(devices=1, device_bytes=141 * GB, host_bytes=70 * GB, cores=2)
    chosen = plan.build_plan(contract, small_host)
    assert chosen.optimizer_state == "device"
    assert chosen.shortfall("reference").startswith("updates hf-fp32: needs 179.4 GB")  # type: ignore[union-attr]


def test_qualify_plan_on_one_h200_gets_past_the_updates(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``qualify plan contracts/qwen3-8b.toml --devices 1 --device-memory 141 --host-memory
    2000`` prints where the state and the gradients are, fits the whole reference stage, and
    is refused at the first candidate launch that does not fit one device (the TP 1 cells),
    one line, exit 2."""
    from qualify.cli.main import main

    code = main(["plan", str(QWEN3_8B), "--devices", "1", "--device-memory", "141",
                 "--host-memory", "2000"])
    out = capsys.readouterr()
    assert code == ExitCode.USAGE_ERROR
    assert "AdamW state and sensitivity copy: on the host (with the AdamW state on the " \
           "devices: updates hf-fp32: needs 179.4 GB" in out.out
    assert "update gradients: on the host, streamed (with them on the devices: control " \
           "fp64-fp32: needs 151.9 GB" in out.out
    (line,) = out.err.strip().splitlines()
    assert "does not fit: launch torch_tp-a1c1 (4 cells, 2 ranks): needs 2 devices" in line
    code = main(["plan", str(QWEN3_8B), "--devices", "1", "--device-memory", "141",
                 "--host-memory", "2000", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["optimizer_state"] == "host"
    assert doc["gradients"] == "host"


def _refused(capsys: pytest.CaptureFixture[str], why: object) -> str:
    """The one line ``qualify plan contracts/qwen3-8b.toml --json`` refuses with: exit 2,
    nothing on stdout, one line on stderr (``why`` labels a failed assertion)."""
    from qualify.cli.main import main

    code = main(["plan", str(QWEN3_8B), "--json"])
    out = capsys.readouterr()
    assert code == ExitCode.USAGE_ERROR, why
    assert out.out == "", why
    (line,) = out.err.strip().splitlines()
    return line


def test_device_memory_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    """``$QUALIFY_REFERENCE_DEVICE_MEMORY`` makes a ``cpu`` list devices of that memory in
    ``qualify plan``; a bad value is one line naming the variable, exit 2."""
    from qualify.cli.main import main

    monkeypatch.setenv("QUALIFY_REFERENCE_DEVICES", "cpu")
    monkeypatch.setenv("QUALIFY_REFERENCE_DEVICE_MEMORY", "141")
    main(["plan", str(QWEN3_8B), "--host-memory", "2000", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["machine"]["devices"] == 1
    assert doc["machine"]["device_bytes"] == 141 * GB
    assert doc["optimizer_state"] == "host"
    for bad in ("0", "-3", "1e3", "lots", "inf", "nan"):
        monkeypatch.setenv("QUALIFY_REFERENCE_DEVICE_MEMORY", bad)
        assert f"QUALIFY_REFERENCE_DEVICE_MEMORY={bad!r}" in _refused(capsys, bad)


@pytest.mark.parametrize("text", ["141", " 0.5 ", ".25", "2000.", "0", "-3", "1e3", "1E3",
                                  "lots", "inf", "nan", "1e400", "+5", "0x10", "1_000", ""])
def test_device_memory_flag_and_setting_share_one_grammar(text: str) -> None:
    """``--device-memory`` / ``--host-memory`` accept exactly what
    ``$QUALIFY_REFERENCE_DEVICE_MEMORY`` accepts, with the same bytes."""
    import argparse

    from qualify.cli.plan import _gb
    from qualify.reference import devices

    try:
        want: int | None = devices.parse_memory(text)
    except UsageError:
        want = None
    try:
        got: int | None = _gb(text)
    except argparse.ArgumentTypeError:
        got = None
    assert got == want, (text, got, want)


def _machine(devices: int, kind: str = "gpu") -> plan_core.Machine:
    """``devices`` of 100 GB (none: host only) of ``kind``, 2000 GB of host, 2 cores."""
    return plan_core.Machine(devices=devices, device_bytes=100 * GB if devices else 0,
                             host_bytes=2000 * GB, cores=2, device_kind=kind)


def test_cpu_devices_under_a_budget_are_timed_at_the_hosts_rates() -> None:
    """``cpu`` devices under ``$QUALIFY_REFERENCE_DEVICE_MEMORY`` share the host's cores: each
    step's planned time is the host-only plan's, not a GPU's (memory is counted per device)."""
    contract = load_contract(contracts_dir() / "smollm2-135m.toml")
    host = plan.build_plan(contract, _machine(0))
    cpu = plan.build_plan(contract, _machine(3, "cpu"))
    gpu = plan.build_plan(contract, _machine(3))
    times = {p: {s.name: s.seconds for s in x.steps} for p, x in
             (("host", host), ("cpu", cpu), ("gpu", gpu))}
    assert times["cpu"] == times["host"]
    assert all(times["gpu"][n] < times["host"][n] for n in times["host"]
               if n.startswith(("updates", "control")))
    assert any(s.device_peak > 0 for s in cpu.steps)


def test_cpu_devices_under_a_budget_hold_no_candidate_launch() -> None:
    """The device budget is the reference stage's: under it a ``cpu`` list's candidate
    launches are the host's processes, planned as on the host (no launch is refused for the
    count of ``cpu`` devices, none is put on them), while the reference steps keep their
    device peaks."""
    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    host = plan.build_plan(contract, _machine(0))
    cpu = plan.build_plan(contract, _machine(1, "cpu"))
    launches = {s.name: s for s in cpu.steps if s.kind == "launch"}
    assert any(s.processes > 1 for s in launches.values())
    assert launches == {s.name: s for s in host.steps if s.kind == "launch"}
    assert cpu.shortfall() is None
    assert any(s.device_peak > 0 for s in cpu.steps if s.kind == "reference")


def test_plan_memory_options_refuse_what_is_no_size(capsys: pytest.CaptureFixture[str]) -> None:
    """``--device-memory`` and ``--host-memory`` refuse a value that is no finite size of at
    least one byte (an overflow, an infinity, a size that rounds to 0 bytes) as argparse
    refuses a word: exit 2, no traceback, nothing on stdout."""
    from qualify.cli.main import main

    for option in ("--device-memory", "--host-memory"):
        for bad in ("inf", "1e400", "-inf", "nan", "0", "-1", "1e-12", "words"):
            code = main(["plan", str(QWEN3_8B), "--devices", "1", f"{option}={bad}"])
            out = capsys.readouterr()
            assert code == ExitCode.USAGE_ERROR, (option, bad)
            assert out.out == "", (option, bad)
            assert "Traceback" not in out.err, (option, bad)
            assert f"argument {option}: {bad!r}" in out.err, (option, bad)


def test_plan_refuses_a_device_budget_with_nothing_placed(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``$QUALIFY_REFERENCE_DEVICE_MEMORY`` with nothing placed (``host``, or no devices here
    and no list) is refused by ``qualify plan`` as the stage refuses it, one line naming the
    variable, exit 2; ``--devices N`` plans N devices of that memory."""
    from qualify.cli.main import main

    monkeypatch.setattr(plan_core, "machine_defaults", lambda: plan_core.Machine(
        devices=0, device_bytes=0, host_bytes=2000 * GB, cores=2))
    monkeypatch.setenv("QUALIFY_REFERENCE_DEVICE_MEMORY", "141")
    for listed in ("host", None):
        if listed is None:
            monkeypatch.delenv("QUALIFY_REFERENCE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("QUALIFY_REFERENCE_DEVICES", listed)
        assert "QUALIFY_REFERENCE_DEVICE_MEMORY: nothing is placed" in _refused(capsys, listed)
    main(["plan", str(QWEN3_8B), "--devices", "2", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert (doc["machine"]["devices"], doc["machine"]["device_bytes"]) == (2, 141 * GB)


def test_refusal_sizes_never_read_zero() -> None:
    """A refusal line's size is never ``0.0`` of a unit for a positive size, and reads the
    size back to its unit's rounding."""
    for n in (1, 999, 10**5 - 1, 10**5, GB // 10 - 1, GB // 10, 141 * GB):
        text = plan_core._size(n)
        value, unit = text.split()
        assert float(value) > 0, text
        scale = {"bytes": 1, "MB": 10**6, "GB": GB}[unit]
        assert abs(float(value) * scale - n) <= 0.05 * scale, text


def _host_step_peak(elements: int, dtype: torch.dtype) -> int:
    """Peak bytes :meth:`HostAdamW.step` allocates over its moments, for one parameter of
    ``elements`` (its second step: the moments exist), counted op by op (every tensor an op
    returns whose storage is new, until the tensor is freed)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from qualify.reference.update import HostAdamW

    class Live(TorchDispatchMode):
        def __init__(self, known: set[int]) -> None:
            super().__init__()
            self.seen, self.live, self.peak = known, 0, 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                key, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                if key in self.seen or n == 0:
                    continue
                self.seen.add(key)
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t if t._base is None else t._base, self._free, key, n)
            return out

        def _free(self, key: int, n: int) -> None:
            self.live -= n
            self.seen.discard(key)

    p = torch.nn.Parameter(torch.randn(elements, dtype=dtype))
    optim = HostAdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    p.grad = torch.randn(elements, dtype=dtype)
    optim.step()
    p.grad = torch.randn(elements, dtype=dtype)
    known = {t.untyped_storage().data_ptr() for s in optim.states() for t in s.values()}
    known |= {p.untyped_storage().data_ptr(), p.grad.untyped_storage().data_ptr()}
    mode = Live(known)
    with mode:
        optim.step()
    return mode.peak


def test_host_step_term_is_host_adamws_measured_peak() -> None:
    """The plan's ``host_step`` (the host's bytes in :class:`HostAdamW`'s step beside the
    moments) is the peak the step allocates, measured op by op on a parameter of the role's
    largest size, at FP32 and in the FP64 control; on a model whose embedding is most of it
    (tiny-qwen3-vocab32k) the step is the update's host peak, so an undercount is the
    plan's host peak."""
    contract = load_contract(contracts_dir() / "tiny-qwen3-vocab32k.toml")
    shape = plan_core.model_shape(contract)
    largest = max(n for _, n in shape.params("actor"))
    machine = plan_core.Machine(devices=2, device_bytes=100 * GB, host_bytes=2000 * GB, cores=2)
    steps = {s.name: s for s in plan.plan_reference(contract, machine,
                                                    optimizer_state="host")}
    for name, dtype in (("updates hf-fp32", torch.float32), ("control fp64-fp32",
                                                              torch.float64)):
        step = steps[name]
        assert step.phase == "actor step", (name, step.phase)
        assert step.terms["host_step"] == _host_step_peak(largest, dtype), name


def test_machine_refuses_an_unknown_device_kind() -> None:
    """A device kind the plan does not know is refused, not timed and placed as ``cpu``."""
    with pytest.raises(ValueError, match="device_kind"):
        plan_core.Machine(devices=1, device_bytes=GB, host_bytes=GB, cores=1, device_kind="cuda")


@pytest.mark.parametrize("state", ["device", "host"])
def test_cpu_devices_are_counted_in_the_hosts_memory(state: str) -> None:
    """``cpu`` devices under a budget live in the host's memory: each reference step's host
    peak is what the host-only plan holds (the devices' bytes included), while each device's
    peak is still checked against the budget."""
    contract = load_contract(contracts_dir() / "smollm2-135m.toml")
    host = plan.plan_reference(contract, plan_core.Machine(devices=0, device_bytes=0,
                                                           host_bytes=2000 * GB, cores=2),
                               optimizer_state=state)
    cpu = plan.plan_reference(contract, plan_core.Machine(devices=2, device_bytes=GB,
                                                          host_bytes=2000 * GB, cores=2,
                                                          device_kind="cpu"),
                              optimizer_state=state)
    assert [(s.name, s.host_peak) for s in cpu] == [(s.name, s.host_peak) for s in host]
    # every placed step holds device bytes; verify, the distribution step and the vLLM
    # rollout (its own process, on the host) run unplaced
    assert all(s.device_peak > 0 for s in cpu
               if not s.name.startswith(("verify", "distribution", "rollout vllm")))
    assert [s.device_peak for s in cpu if s.name.startswith(("verify", "distribution"))] == [0, 0]
