"""The host AdamW keeping ``g1`` instead of the moments between a parameter's first two steps.

:class:`qualify.reference.update.HostAdamW` with ``keep="g1"`` (the placed stage's
``round2_state = "g1"``) rebuilds the moments of the second step from the first step's
gradient: its parameters and moments must be bitwise ``torch.optim.AdamW``'s at every step,
it must really hold no moments between the two steps, and the update runs must seal bitwise
what the runs keeping the moments seal.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from placed_runs import assert_same_runs, placed_update_runs
from tiny_models import THREE_LAYER_CFG, seeded_qwen3

from qualify.contract import load_contract
from qualify.reference import devices, plan_core, update
from qualify.reference import plan as reference_plan
from qualify.reference.update import HostAdamW
from qualify.resources import contracts_dir


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal bit patterns (``torch.equal`` holds ``-0.0 == 0.0``; sealed bytes do not)."""
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.dtype in ints:
        return torch.equal(x.contiguous().view(ints[x.dtype]), y.contiguous().view(ints[y.dtype]))
    return torch.equal(x, y)


def test_reading_the_state_dtypes_rebuilds_no_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's record of its moments' dtypes must not rebuild every kept ``g1``'s moments
    at once (two models more on the host, where ``g1`` was chosen to save one)."""
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    host = HostAdamW(params, keep="g1", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    host.step([torch.randn(3, 4), torch.randn(5)])

    def no_rebuild(_self: HostAdamW, _g1: torch.Tensor) -> dict[str, torch.Tensor]:
        raise AssertionError("moments rebuilt to read a dtype")

    monkeypatch.setattr(HostAdamW, "_rebuilt", no_rebuild)
    assert update._state_dtypes(host) == {"exp_avg": "torch.float32",
                                          "exp_avg_sq": "torch.float32"}


@settings(max_examples=25, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 4)), min_size=1,
                       max_size=4),
       steps=st.integers(1, 4), skip=st.integers(0, 7), seed=st.integers(0, 2**16),
       lr=st.sampled_from([1e-3, 0.5]), wd=st.sampled_from([0.0, 0.01]),
       betas=st.sampled_from([(0.9, 0.95), (0.9, 0.999)]),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_g1_host_adamw_is_torch_adamw(shapes: list[tuple[int, int]], steps: int, skip: int,
                                      seed: int, lr: float, wd: float,
                                      betas: tuple[float, float], dtype: torch.dtype) -> None:
    """Bitwise torch's parameters and moments after every step, over steps where some
    parameters have no gradient (their first and second steps then fall on different
    rounds); a parameter stepped once holds ``g1`` and no torch state."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=g, dtype=dtype) for s in shapes] for _ in range(steps)]
    for row in grads:  # signed zeros: (1 - b1) * g1 keeps -0.0, torch's lerp_ from 0 does not
        for t in row:
            t[torch.rand(t.shape, generator=g) < 0.2] = -0.0
            t[torch.rand(t.shape, generator=g) < 0.1] = 0.0
    a = [torch.nn.Parameter(t.clone()) for t in init]
    b = [torch.nn.Parameter(t.clone()) for t in init]
    kw: dict[str, Any] = {"lr": lr, "betas": betas, "eps": 1e-8, "weight_decay": wd}
    ref = torch.optim.AdamW(a, foreach=False, fused=False, **kw)
    host = HostAdamW(b, keep="g1", **kw)
    for k in range(steps):
        given_grad = [(skip >> (i % 3)) & 1 == 0 or k == 0 for i in range(len(shapes))]
        grad_list: list[torch.Tensor | None] = [grads[k][i].clone() if given_grad[i] else None
                                                for i in range(len(shapes))]
        for i, pa in enumerate(a):
            pa.grad = grads[k][i].clone() if given_grad[i] else None
        for opt in (ref, host):
            for group in opt.param_groups:
                group["lr"] = lr / (k + 1)
        ref.step()
        host.step(grad_list)
        ref.zero_grad(set_to_none=True)
        for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(pa, pb)
            sa, sb = ref.state[pa], host.moments(pb)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert _same_bits(sa[key], sb[key]), key
            once = float(sa["step"]) == 1.0
            assert (host._g1[i] is not None) == once
            assert (host._slots[i] in host._optims[i].state) == (not once)
    assert len(host.states()) == len(b)


def _run(keep: str, precision: str) -> tuple[Any, ...]:
    two = devices.ReferenceDevices(("cpu", "cpu"), devices.ENV, "host", "host", keep)
    runs = placed_update_runs(two, precision)
    assert runs[4]["round2_state"] == keep
    return runs[:4]


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
@pytest.mark.usefixtures("one_thread")
def test_g1_runs_seal_bitwise_the_kept_moments(precision: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sealed tensor (both rounds' moments included) and the meta are equal; the g1
    runs' optimizers really kept ``g1`` (each parameter once, between its two steps)."""
    kept: list[int] = []
    plain_step = HostAdamW.step

    def spy(self: HostAdamW, grads: Any = None) -> None:
        plain_step(self, grads)
        kept.append(sum(g is not None for g in self._g1))

    monkeypatch.setattr(HostAdamW, "step", spy)
    moments = _run("moments", precision)
    assert not any(kept)
    kept.clear()
    g1 = _run("g1", precision)
    n = [len([p for p in seeded_qwen3(r, THREE_LAYER_CFG).parameters() if p.requires_grad])
         for r in ("actor", "critic")]
    assert kept == [n[0], 0, n[1], 0]  # after round 1: every parameter's g1; after 2: none
    assert_same_runs(moments, g1, must_have="/exp_avg_sq/")
    assert any(k.startswith("round2/") and "/exp_avg_sq/" in k for k in g1[0])


def test_g1_needs_the_host_state() -> None:
    """``round2_state = "g1"`` with the state on the devices, or an unknown value, is refused."""
    with pytest.raises(ValueError, match="g1 needs optimizer_state host"):
        devices.ReferenceDevices(("cpu",), devices.ENV, "device", "device", "g1")
    with pytest.raises(ValueError, match=r"ReferenceDevices\.round2_state"):
        devices.ReferenceDevices(("cpu",), devices.ENV, "host", "device", "p1")
    with pytest.raises(ValueError, match="keep"):
        HostAdamW([], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, keep="p1")


def test_the_plan_keeps_g1_only_where_the_host_needs_it() -> None:
    """Qwen3-8B on 4 devices of 48 GB: with a 256 GB host the moments leave the FP64 control
    short of host memory and ``g1`` fits, so the plan takes the state on the host, the
    gradients streamed and ``g1``; with 2 TB it keeps the moments. Keeping ``g1`` lowers no
    device peak and raises no host peak, and does nothing with three rounds."""
    contract = load_contract(contracts_dir() / "qwen3-8b.toml")
    small = plan_core.Machine(devices=4, device_bytes=48 * 10**9, host_bytes=256 * 10**9,
                              cores=2)
    plan = reference_plan.build_plan(contract, small)
    assert (plan.optimizer_state, plan.gradients, plan.round2_state) == ("host", "host", "g1")
    assert plan.shortfall("reference") is None
    assert plan.round2_state_why.startswith(
        "keeping the moments: control fp64-fp32: needs 272.6 GB of host memory"), \
        plan.round2_state_why
    big = dataclasses.replace(small, host_bytes=2000 * 10**9)
    assert reference_plan.build_plan(contract, big).round2_state == "moments"
    steps = {keep: reference_plan.plan_reference(contract, big, optimizer_state="host",
                                                 gradients="host", round2_state=keep)
             for keep in ("moments", "g1")}
    lower = 0
    for a, b in zip(steps["moments"], steps["g1"], strict=True):
        assert b.device_peak == a.device_peak, a.name
        assert b.host_peak <= a.host_peak, a.name
        lower += b.host_peak < a.host_peak
    assert lower
    three = dataclasses.replace(contract, algorithm=dataclasses.replace(contract.algorithm,
                                                                        rounds=3))
    again = {keep: reference_plan.plan_reference(three, big, optimizer_state="host",
                                                 round2_state=keep)
             for keep in ("moments", "g1")}
    assert [s.host_peak for s in again["moments"]] == [s.host_peak for s in again["g1"]]
    assert reference_plan.build_plan(three, small).round2_state == "moments"
    with pytest.raises(ValueError, match="round2_state"):
        reference_plan.plan_reference(contract, big, round2_state="g1")


@pytest.mark.slow
def test_tiny_reference_streamed_keeping_g1_seals_the_unplaced_tensors(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny torch_tp contract's whole reference stage on ``cpu,cpu,cpu`` with the state on
    the host, the gradients streamed and ``g1`` kept (the plan's choice forced) seals the
    unplaced shared reference's update, control, branch and score tensors and its bounds
    byte for byte; environment.json records the three."""
    import json

    from shared_artifacts import assert_sealed_bitwise_equal, tiny_reference
    from tiny_contracts import torch_tp_only_text

    from qualify.reference.stage import run_reference_stage

    plain = next(p for p in (tiny_reference(tmp_path_factory) / "references").iterdir()
                 if p.is_dir())
    path = tmp_path / "tiny-qwen3.toml"
    path.write_text(torch_tp_only_text(), encoding="utf-8")
    plain_build = reference_plan.build_plan
    monkeypatch.setattr(reference_plan, "build_plan", lambda c, m: plain_build(
        c, m, optimizer_state="host", gradients="host", round2_state="g1"))
    monkeypatch.setenv(devices.ENV, "cpu,cpu,cpu")
    monkeypatch.setenv(devices.MEMORY_ENV, "1")
    out = run_reference_stage(load_contract(path), root=tmp_path / "references", quiet=True)
    files = assert_sealed_bitwise_equal(plain, out)
    assert any(f.startswith("branches/") for f in files)
    assert any(f.startswith("controls/fp64") for f in files)
    env = json.loads((out / "environment.json").read_text())
    where = env["reference_devices"]
    assert (where["optimizer_state"], where["gradients"], where["round2_state"]) == (
        "host", "host", "g1")
    assert (env["plan_check"]["gradients"], env["plan_check"]["round2_state"]) == ("host", "g1")
