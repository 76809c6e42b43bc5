"""The KL reference logprobs of the stage's update runs, taken before the Actor is loaded.

:func:`qualify.reference.stage._update_run` takes each run's KL reference logprobs from the
frozen reference policy alone (:func:`qualify.reference.update.kl_reference_before_load`)
and runs the Actor's update with no second model: every sealed tensor of every lane's update
and control is bitwise the one the reference policy passed to
:func:`qualify.reference.update.run_actor` gives, and the policy is gone when the update
starts.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from tiny_models import THREE_LAYER_CFG, seeded_batch, seeded_qwen3

from qualify.contract import Contract, load_contract
from qualify.lanes import lane_bf16_mode, lane_precision
from qualify.models import roles
from qualify.reference import stage
from qualify.reference.controls import control_settings
from qualify.reference.update import Batch, UpdateSettings, run_actor, run_critic
from qualify.resources import contracts_dir


def _runs() -> list[tuple[str, UpdateSettings, str]]:
    """Every lane's own update and every control of tiny-qwen3, and the ``bf16`` lane's."""
    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    mbs = contract.algorithm.micro_batch_size
    out = []
    for lane in [*contract.matrix.lanes(), "bf16"]:
        out.append((f"hf-{lane}", UpdateSettings(
            precision="bf16" if lane_precision(lane) == "bf16" else "fp32",
            bf16_mode=lane_bf16_mode(lane), micro_batch_size=mbs, label=f"hf-{lane}"), "sdpa"))
        if lane != "bf16":
            out += [(s.label, s, attn) for s, attn in control_settings(contract, lane).values()]
    return out


RUNS = _runs()
FAST = {"hf-fp32", "hf-bf16", "fp64-fp32", "attn_impl-fp32", "microbatch-bf16-castmasters",
        "row_split-bf16-autocast"}
"""One run of each precision, the layout controls and eager attention; the rest are slow."""


def test_the_runs_cover_every_precision_layout_and_kernel() -> None:
    settings = [s for _, s, _ in RUNS]
    assert {(s.precision, s.bf16_mode) for s in settings} >= {
        ("fp32", "params"), ("fp64", "params"), ("bf16", "params"), ("bf16", "castmasters"),
        ("bf16", "autocast")}
    assert any(s.extra_left_padding and s.extra_right_padding for s in settings)
    assert len({s.micro_batch_size for s in settings}) > 1
    assert any(s.row_split > 1 for s in settings)
    assert {attn for _, _, attn in RUNS} == {"sdpa", "eager"}


def _old_update_run(contract: Contract, batch: Batch, settings: UpdateSettings,
                    load: Any) -> dict[str, torch.Tensor]:
    """The update run as the stage ran it with the reference policy passed to run_actor."""
    torch.manual_seed(0)
    fp64 = settings.precision == "fp64"
    actor = load("actor", True)
    ref = load("actor", False)
    out, _ = run_actor(actor.double() if fp64 else actor, ref.double() if fp64 else ref,
                       batch, contract, settings)
    critic = load("critic", True)
    t, _ = run_critic(critic.double() if fp64 else critic, batch, contract, settings)
    out.update(t)
    return stage._strip_padding(out, batch.responses.shape[1])


@pytest.mark.parametrize(("label", "settings", "attn"), [
    pytest.param(*r, id=r[0], marks=() if r[0] in FAST else pytest.mark.slow) for r in RUNS])
@pytest.mark.usefixtures("one_thread")
def test_update_run_holds_no_reference_policy_and_seals_the_same_bits(
        label: str, settings: UpdateSettings, attn: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run's sealed tensors are bitwise the old path's (the reference policy passed to
    run_actor); run_actor gets the logprobs and no policy, and every frozen model loaded
    for them is gone when the Actor's update starts."""
    loaded: list[tuple[weakref.ref[torch.nn.Module], bool]] = []

    def load(role: str, grad: bool, impl: str = attn) -> torch.nn.Module:
        m = seeded_qwen3(role, THREE_LAYER_CFG).requires_grad_(grad).eval()
        cast(Any, m.config)._attn_implementation = impl
        loaded.append((weakref.ref(m), grad))
        return m

    def loader(role: str) -> Any:
        return lambda _path, **kw: load(role, kw["requires_grad"], kw["attn_implementation"])

    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    batch = cast(Batch, seeded_batch(96, short={0: 4}, masked_targets=False))
    old = _old_update_run(contract, batch, settings, load)
    loaded.clear()
    calls: list[bool] = []

    def checked_run_actor(actor: torch.nn.Module, ref: torch.nn.Module | None, *a: Any,
                          **kw: Any) -> Any:
        gc.collect()
        frozen = [r for r, grad in loaded if not grad]
        calls.append(ref is None and kw.get("ref_logprobs") is not None and bool(frozen)
                     and all(r() is None for r in frozen))
        return run_actor(actor, ref, *a, **kw)

    monkeypatch.setattr(roles, "load_actor", loader("actor"))
    monkeypatch.setattr(roles, "load_critic", loader("critic"))
    monkeypatch.setattr(stage, "run_actor", checked_run_actor)
    bundle: Any = SimpleNamespace(actor_dir=Path("actor"), critic_dir=Path("critic"))
    new, meta = stage._update_run(contract, bundle, batch, settings, attn)
    assert calls == [True]
    assert meta["kl_reference"] == stage.KL_REFERENCE_SOURCE
    assert new.keys() == old.keys()
    assert any(k.startswith("round1/actor/loss/kl") for k in new)
    for k, v in old.items():
        assert torch.equal(v, new[k]), (label, k)


@pytest.mark.parametrize("lane", ["fp32", pytest.param("bf16-castmasters",
                                                        marks=pytest.mark.slow)])
@pytest.mark.usefixtures("one_thread")
def test_round_to_round_updates_hold_no_reference_policy_and_give_the_same_bits(
        lane: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The round-to-round term's perturbed Actor updates (:func:`stage._round_to_round`)
    take the KL reference logprobs once from the policy alone: each update is bitwise
    run_actor with a fresh reference policy passed (stopped after round ``n``, with and
    without logit offsets), with only the Actor's template and working copy alive when
    it runs (no frozen model)."""
    from qualify.reference import round_to_round

    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    batch = cast(Batch, seeded_batch(96, short={0: 4}, masked_targets=False))
    loaded: list[tuple[weakref.ref[torch.nn.Module], bool]] = []

    def load(grad: bool) -> torch.nn.Module:
        m = seeded_qwen3("actor", THREE_LAYER_CFG).requires_grad_(grad).eval()
        loaded.append((weakref.ref(m), grad))
        return m

    offs = {1: torch.full(batch.responses.shape, 0.25, dtype=torch.float64)}
    got: list[dict[str, torch.Tensor]] = []
    alive: list[int] = []

    def measure(update: Any, **_: Any) -> dict[Any, Any]:  # the Actor's (the KL's) only
        for n, o in ((1, None), (2, None), (2, offs)):
            got.append(update("actor", n, o))
            gc.collect()
            alive.append(sum(r() is not None for r, _ in loaded))
        return {}

    def checked_run_actor(actor: torch.nn.Module, ref: torch.nn.Module | None, *a: Any,
                          **kw: Any) -> Any:
        gc.collect()
        assert ref is None
        assert kw.get("ref_logprobs") is not None
        assert all(r() is None for r, grad in loaded if not grad)
        return run_actor(actor, ref, *a, **kw)

    monkeypatch.setattr(roles, "load_actor", lambda _p, **kw: load(kw["requires_grad"]))
    monkeypatch.setattr(stage, "run_actor", checked_run_actor)
    monkeypatch.setattr(round_to_round, "measure", measure)
    monkeypatch.setattr(round_to_round, "perturbation_size", lambda *a: 1.0)
    bundle: Any = SimpleNamespace(actor_dir=Path("actor"), critic_dir=Path("critic"))
    stage._round_to_round(contract, bundle, batch, lane=lane, reference={}, errors={},
                          mask=batch.response_mask)
    assert [grad for _, grad in loaded] == [False, True]  # the policy, then the template
    assert alive == [1, 1, 1]  # of the loads, the template only (the working copy is its copy)
    settings = UpdateSettings(precision="bf16" if lane_precision(lane) == "bf16" else "fp32",
                              bf16_mode=lane_bf16_mode(lane),
                              micro_batch_size=contract.algorithm.micro_batch_size)
    for (n, o), new in zip(((1, None), (2, None), (2, offs)), got, strict=True):
        torch.manual_seed(0)
        old, _ = run_actor(load(True), load(False), batch, contract, settings,
                           offsets=o, last_forward=n)
        old = stage._strip_padding(old, batch.responses.shape[1])
        assert old.keys() == new.keys()
        for k, v in old.items():
            assert torch.equal(v, new[k]), (lane, n, k)


@pytest.mark.parametrize("name", ["tiny-qwen3.toml", "qwen3-8b.toml"])
def test_the_plan_puts_each_kl_reference_forward_before_its_update_with_one_model(
        name: str) -> None:
    """Every Actor update the stage runs (each lane's, each control's, each lane's
    round-to-round runs and clip-branch rerun) is planned after its own ``kl reference``
    step: the frozen policy alone (one model in the run's dtype, nothing written); the
    update's own load holds one model."""
    from qualify.reference import plan, plan_core

    contract = load_contract(contracts_dir() / name)
    contract = dataclasses.replace(contract, bounds=dataclasses.replace(
        contract.bounds, lane="approximate", round_to_round=True))
    p_actor = plan_core.model_shape(contract).count("actor")
    steps = plan.plan_reference(contract, plan_core.Machine(devices=0, device_bytes=0,
                                                            host_bytes=10**15, cores=2))
    names = [s.name for s in steps]
    updates = [n for n in names if n.startswith(("updates ", "control ", "round_to_round "))
               or (n.startswith("branches ") and n.endswith(" actor"))]
    assert len(updates) > len(contract.matrix.lanes()) * 3
    for n in updates:
        kl = steps[names.index(n) - 1]
        assert kl.name == f"kl reference: {n}"
        assert kl.written == 0
        assert kl.terms["weights"] == (8 if "fp64" in n else 4) * p_actor, n
    assert len([n for n in names if n.startswith("kl reference: ")]) == len(updates)
