"""The AdamW moments and the sensitivity copy on the host (``optimizer_state = "host"``).

:class:`qualify.reference.update.HostAdamW` steps one parameter at a time with torch's own
AdamW on a host copy and keeps every moment there; the sensitivity's ``saved`` copy goes to
the host with it. On host parameters the update and control runs must seal bitwise what the
placed path with the state on the devices seals (the same per-parameter arithmetic in the same
order), and the option must really be taken (the optimizer torch steps is then one host
tensor per parameter, never the model's parameters).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from placed_runs import (
    EnteredError,
    assert_same_runs,
    placed_update_runs,
    spy_on_entered_devices,
)
from tiny_models import THREE_LAYER_CFG, seeded_batch, seeded_qwen3

from qualify.contract import Contract, load_contract
from qualify.reference import devices, update
from qualify.reference.sensitivity import LossSensitivity
from qualify.reference.update import Batch, HostAdamW, UpdateSettings
from qualify.resources import contracts_dir

CFG = THREE_LAYER_CFG




def _contract() -> Contract:
    return load_contract(contracts_dir() / "tiny-qwen3.toml")


def _run(state: str, precision: str, mode: str) -> tuple[dict[str, Any], ...]:
    """The Actor's and the Critic's update runs, placed on two ``cpu`` devices."""
    runs = placed_update_runs(devices.ReferenceDevices(("cpu", "cpu"), devices.ENV, state),
                              precision, mode)
    record = runs[4]
    assert record["optimizer_state"] == state
    assert len(set(record["placed"]["actor"]["assignment"])) == 2
    return runs[:4]


@pytest.mark.parametrize(("precision", "mode"), [("fp32", "params"), ("bf16", "castmasters"),
                                                 ("fp64", "params")])
@pytest.mark.usefixtures("one_thread")
def test_host_state_seals_bitwise_the_device_state(precision: str, mode: str) -> None:
    """Every tensor of both runs (grads, moments, updates, logprobs, losses, norms) and the
    meta (optimizer-state dtypes, the FP32 norm evaluations, the sensitivities) are equal."""
    dev = _run("device", precision, mode)
    host = _run("host", precision, mode)
    assert_same_runs(dev, host, must_have="/exp_avg_sq/")


@pytest.mark.usefixtures("one_thread")
def test_the_host_option_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``host`` torch's AdamW steps one tensor per parameter and step, none of them a
    model parameter nor sharing its storage, and the sensitivity pass keeps its copy on the
    host; with ``device`` it steps the model's parameters together. The bytes noted per
    device after each step are the parameters and gradients (8 per FP32 element), with the
    moments only when they are on the devices (16)."""
    stepped: list[list[torch.Tensor]] = []
    plain_step = torch.optim.AdamW.step

    def spy(self: torch.optim.AdamW, *a: Any, **kw: Any) -> Any:
        stepped.append([p for g in self.param_groups for p in g["params"]])
        return plain_step(self, *a, **kw)

    saved_on_host: list[bool] = []
    plain_norm = LossSensitivity.grad_norm

    def norm_spy(self: LossSensitivity, *a: Any, **kw: Any) -> None:
        saved_on_host.append(bool(kw.get("saved_on_host", False)))
        plain_norm(self, *a, **kw)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    monkeypatch.setattr(LossSensitivity, "grad_norm", norm_spy)
    contract = _contract()
    rounds = contract.algorithm.rounds
    for state in ("device", "host"):
        stepped.clear()
        saved_on_host.clear()
        critic = seeded_qwen3("critic", CFG)
        params = [p for p in critic.parameters() if p.requires_grad]
        with devices.active(devices.ReferenceDevices(("cpu", "cpu"), devices.ENV,
                                                     state)) as record:
            devices.place(critic, "critic")
            batch = cast(Batch, seeded_batch(96, short={0: 4}, masked_targets=False))
            update.run_critic(critic, batch, contract, UpdateSettings(precision="fp32",
                                                                      micro_batch_size=2))
        assert saved_on_host == [state == "host"] * rounds
        # the noted device bytes: FP32 master and gradient, and the moments if kept there
        n = sum(p.numel() for p in params)
        memory = record["memory"]
        assert memory["measure"] == devices.MEMORY_MEASURES["cpu"]
        assert sum(memory["bytes"]) == (8 if state == "host" else 16) * n
        assert all(b > 0 for b in memory["bytes"])
        if state == "device":
            assert len(stepped) == rounds
            assert all(len(s) == len(params) and all(x is y for x, y in zip(s, params,
                                                                               strict=True))
                       for s in stepped)
            continue
        assert len(stepped) == rounds * len(params)
        ptrs = {p.untyped_storage().data_ptr() for p in params}
        for s in stepped:
            (t,) = s
            assert t.device.type == "cpu"
            assert not any(t is p for p in params)
            assert t.numel() == 0 or t.untyped_storage().data_ptr() not in ptrs


@settings(max_examples=25, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 4)), min_size=1,
                       max_size=4),
       steps=st.integers(1, 4), skip=st.integers(0, 7), seed=st.integers(0, 2**16),
       lr=st.sampled_from([1e-3, 0.5]), wd=st.sampled_from([0.0, 0.01]),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_host_adamw_is_torch_adamw(shapes: list[tuple[int, int]], steps: int, skip: int,
                                   seed: int, lr: float, wd: float,
                                   dtype: torch.dtype) -> None:
    """:class:`HostAdamW` gives bitwise ``torch.optim.AdamW``'s (single-tensor) parameters,
    moments and per-parameter step counts, over steps where some parameters have no
    gradient (torch skips them: their step count does not advance) and the lr changes."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=g, dtype=dtype) for s in shapes] for _ in range(steps)]
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.clone()) for t in init]
    kw: dict[str, Any] = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": wd}
    ref = torch.optim.AdamW(a, foreach=False, fused=False, **kw)
    host = HostAdamW(b, **kw)
    for k in range(steps):
        for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
            given_grad = (skip >> (i % 3)) & 1 == 0 or k == 0
            pa.grad = grads[k][i].clone() if given_grad else None
            pb.grad = grads[k][i].clone() if given_grad else None
        for opt in (ref, host):
            for group in opt.param_groups:
                group["lr"] = lr / (k + 1)
        ref.step()
        host.step()
        ref.zero_grad(set_to_none=True)
        host.zero_grad(set_to_none=True)
        for pa, pb in zip(a, b, strict=True):
            assert torch.equal(pa, pb)
            sa, sb = ref.state[pa], host.moments(pb)
            assert set(sb) == {"step", "exp_avg", "exp_avg_sq"}
            for key in sb:
                assert torch.equal(sa[key], sb[key]), key
            assert sb["exp_avg"].device.type == "cpu"
            assert sb["exp_avg"].untyped_storage().data_ptr() != pb.untyped_storage().data_ptr()


def test_the_stage_runs_with_the_plans_choice(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """Under ``cpu,cpu,cpu`` and a device memory the device-state plan of tiny-qwen3 does not
    fit (28.2 MB on the fullest device) and the host-state plan does (27.6 MB), the stage
    enters its devices with ``optimizer_state = "host"``; with room for both, ``device``.
    A device memory with nothing placed is one line before anything is written."""
    from qualify.errors import UsageError
    from qualify.reference import stage

    seen = spy_on_entered_devices(monkeypatch)
    monkeypatch.setenv(devices.ENV, "cpu,cpu,cpu")
    for memory, want in (("0.028", "host"), ("1", "device")):
        monkeypatch.setenv(devices.MEMORY_ENV, memory)
        with pytest.raises(EnteredError):
            stage.run_reference_stage(_contract(), root=tmp_path / memory, quiet=True)
        assert seen[-1] == devices.ReferenceDevices(("cpu",) * 3, devices.ENV, want)
        record = stage._plan_check(_contract(), True, seen[-1], devices.device_memory())
        assert (record["devices"], record["device_bytes"]) == (3, int(float(memory) * 1e9))
        assert record["optimizer_state"] == want
        if want == "host":  # a small budget's refusal line reads in MB, not "0.0 GB"
            assert "on a device, each of the 3 has 28.0 MB (short by" in record[
                "optimizer_state_why"], record
    monkeypatch.setenv(devices.ENV, "host")
    with pytest.raises(UsageError, match=devices.MEMORY_ENV):
        stage.run_reference_stage(_contract(), root=tmp_path / "host", quiet=True)
    assert not (tmp_path / "host").exists()


@pytest.mark.slow
def test_tiny_reference_under_a_device_budget_seals_the_unplaced_tensors(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny torch_tp contract's whole reference stage on ``cpu,cpu,cpu`` under 0.028 GB
    per device (the device-state plan needs 28.2 MB, the host-state plan 27.6 MB) runs with
    the state on the host and seals the unplaced shared reference's update, control, branch
    and score tensors and its bounds byte for byte; environment.json records the budget and
    the choice."""
    import json

    from shared_artifacts import assert_sealed_bitwise_equal, tiny_reference
    from tiny_contracts import torch_tp_only_text

    from qualify.reference.stage import run_reference_stage

    plain = next(p for p in (tiny_reference(tmp_path_factory) / "references").iterdir()
                 if p.is_dir())
    path = tmp_path / "tiny-qwen3.toml"
    path.write_text(torch_tp_only_text(), encoding="utf-8")
    monkeypatch.setenv(devices.ENV, "cpu,cpu,cpu")
    monkeypatch.setenv(devices.MEMORY_ENV, "0.028")
    budget = run_reference_stage(load_contract(path), root=tmp_path / "references", quiet=True)
    files = assert_sealed_bitwise_equal(plain, budget)
    assert any(f.startswith("branches/") for f in files)
    env = json.loads((budget / "environment.json").read_text())
    assert env["reference_devices"]["optimizer_state"] == "host"
    assert env["plan_check"]["optimizer_state"] == "host"
    assert (env["plan_check"]["devices"], env["plan_check"]["device_bytes"]) == (3, 28 * 10**6)
    assert env["plan_check"]["shortfall"] is None


def test_host_adamw_moments_of_an_unstepped_parameter_raise() -> None:
    """:meth:`HostAdamW.moments` raises ``KeyError`` for a parameter not stepped yet (its
    docstring) and for one not its own, and asking leaves :meth:`HostAdamW.states` as it was
    (no empty state that the meta's dtypes would trip on)."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    host = HostAdamW([a, b], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    a.grad = torch.ones(3)
    host.step()
    for p in (b, torch.nn.Parameter(torch.ones(1))):
        with pytest.raises(KeyError, match=r"HostAdamW\.moments"):
            host.moments(p)
    assert [set(s) for s in host.states()] == [{"step", "exp_avg", "exp_avg_sq"}]
    assert set(host.moments(a)) == {"step", "exp_avg", "exp_avg_sq"}


def test_a_budget_for_a_contract_the_plan_cannot_read_is_not_silently_unused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A device budget on a contract whose sizes the plan cannot read (an ``hf-dir`` model
    without ``model.manifest.config``) is refused with the plan check on and warned about
    with it off; without a budget the contract runs unplanned, as before."""
    from qualify.errors import UsageError
    from qualify.reference import stage

    doc = _contract().to_dict()
    doc["model"] = {"source": "hf-dir", "path": str(tmp_path / "model")}
    contract = Contract.from_dict(doc)
    cpu = devices.ReferenceDevices(("cpu",) * 2, devices.ENV, "device")
    with pytest.raises(UsageError, match=rf"^{devices.MEMORY_ENV}: .* cannot be planned \("):
        stage._plan_check(contract, True, cpu, 10**9)
    record = stage._plan_check(contract, False, cpu, 10**9)
    assert "running without it (--no-plan-check)" in capsys.readouterr().err
    assert record["not_planned"]
    assert stage._plan_check(contract, True, cpu, None)["not_planned"]
    assert capsys.readouterr().err == ""
