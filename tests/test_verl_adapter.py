"""The ``verl`` engine without verl: its registration, NOT_RUN reasons, translation, fault plugin.

No verl import (qualify's environment lacks it): the spec is registered as a built-in; with
no verl anywhere its cells' reason names ``scripts/install_verl.sh``, a variant it lacks is
named first, a verl interpreter (``QUALIFY_LAUNCHER_VERL``) lifts both; the contract's
algorithm maps onto verl's config fields by name, and every variant verl's engine path does
not run is named; each planted translation fault replaces exactly the translation it
corrupts. The end-to-end runs are tests/test_verl.py (slow, in verl's venv).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
import types
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harnesses.verl import faults, harness, translate
from harnesses.verl.spec import INSTALL_REASON
from qualify.contract import load_contract
from qualify.errors import HarnessError
from qualify.registry import get_engine
from qualify.resources import contracts_dir

VERL_CONTRACTS = ("tiny-qwen3-verl", "tiny-qwen3-verl-gspo")


@pytest.mark.parametrize("name", VERL_CONTRACTS)
def test_verl_is_a_builtin_whose_missing_stack_names_the_install_script(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = get_engine("verl")
    assert (spec.source, spec.entry, spec.bf16_style) == ("builtin",
                                                          "harnesses.verl.harness:main", "params")
    contract = load_contract(contracts_dir() / f"{name}.toml")
    assert set(contract.matrix.engines) == {"verl"}
    assert translate.unsupported(contract.algorithm, contract.optimizer) == []
    variants = contract.algorithm.variants()
    monkeypatch.delenv("QUALIFY_LAUNCHER_VERL", raising=False)
    if importlib.util.find_spec("verl") is None:
        assert spec.unavailable_reason(False, variants=variants) == INSTALL_REASON
        assert "scripts/install_verl.sh" in INSTALL_REASON
    lacking = spec.unavailable_reason(False, variants=(*variants, "policy_loss=nope"))
    assert lacking is not None
    assert "policy_loss=nope" in lacking
    monkeypatch.setenv("QUALIFY_LAUNCHER_VERL", sys.executable)
    assert spec.unavailable_reason(False, variants=variants) is None


def test_the_contract_maps_onto_verls_fields_by_name() -> None:
    c = load_contract(contracts_dir() / "tiny-qwen3-verl.toml")
    a = translate.actor_fields(c.algorithm)
    assert a["policy_loss"] == {"loss_mode": "vanilla"}
    assert (a["clip_ratio_low"], a["clip_ratio_high"], a["clip_ratio_c"]) == (0.2, 0.2, 3.0)
    assert (a["use_kl_loss"], a["kl_loss_coef"], a["kl_loss_type"]) == (True, 0.04, "low_var_kl")
    assert (a["entropy_coeff"], a["loss_agg_mode"]) == (0.01, "token-mean")
    assert translate.critic_fields(c.algorithm)["cliprange_value"] == c.algorithm.value_clip
    o = translate.optimizer_fields(c.optimizer, role="critic", rounds=2)
    assert (o["lr"], o["weight_decay"], o["clip_grad"]) == (3e-4, 0.1, 0.5)
    assert (o["lr_scheduler_type"], o["min_lr_ratio"], o["total_training_steps"]) == \
        ("cosine", 0.1, 2)
    assert o["override_optimizer_config"] == {"eps": 1e-6}
    # no dual clip in the contract: verl's always-on dual clip is moved out of reach
    plain = dataclasses.replace(c.algorithm, clip_ratio_c=None)
    assert math.isinf(translate.actor_fields(plain)["clip_ratio_c"])
    g = load_contract(contracts_dir() / "tiny-qwen3-verl-gspo.toml")
    assert translate.actor_fields(g.algorithm)["policy_loss"] == {"loss_mode": "gspo"}


@pytest.mark.parametrize(("change", "named"), [
    ({"policy_loss": "cispo", "clip_ratio_c": None}, "policy_loss=cispo"),
    ({"kl_loss_bias_correction": True}, "kl_loss_bias_correction=true"),
    ({"rollout_is": "token", "rollout_is_threshold": 2.0}, "rollout_is=token_truncate"),
])
def test_a_variant_verl_does_not_run_is_named(change: dict[str, Any], named: str) -> None:
    c = load_contract(contracts_dir() / "tiny-qwen3-verl.toml")
    alg = dataclasses.replace(c.algorithm, **change)
    assert any(x.startswith(named) for x in translate.unsupported(alg, c.optimizer))


def test_an_lr_schedule_verl_does_not_build_is_named() -> None:
    c = load_contract(contracts_dir() / "tiny-qwen3-trl.toml")  # linear decay
    assert any(x.startswith("lr_schedule=linear")
               for x in translate.unsupported(c.algorithm, c.optimizer))


_MASKS = st.integers(1, 6).flatmap(lambda r: st.lists(
    st.tuples(st.integers(0, r - 1), st.integers(1, r)), min_size=1, max_size=5).map(
    lambda rows: (r, rows)))


@settings(max_examples=40, deadline=None)
@given(_MASKS)
def test_the_loss_mask_is_the_response_mask_and_the_planted_shift_moves_it(
        case: tuple[int, list[tuple[int, int]]]) -> None:
    r, rows = case
    mask = torch.zeros((len(rows), r), dtype=torch.bool)
    for i, (lo, n) in enumerate(rows):
        mask[i, lo:lo + n] = True
    assert torch.equal(harness.response_loss_mask(mask), mask.long())
    adv = torch.linspace(-1.0, 1.0, mask.numel()).reshape(mask.shape)
    assert torch.equal(harness.advantages_in(adv), adv)
    fake = types.SimpleNamespace(response_loss_mask=harness.response_loss_mask,
                                 advantages_in=harness.advantages_in)
    faults.install(["response_mask_shifted", "advantages_unnormalised"], fake)
    assert torch.equal(fake.response_loss_mask(mask), torch.roll(mask.long(), 1, dims=1))
    assert torch.equal(fake.advantages_in(adv), adv * 4.0)
    assert harness.response_loss_mask is not fake.response_loss_mask  # only what it got


def test_an_unknown_fault_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(HarnessError, match="response_mask_shifted"):
        faults.install(["no_such_fault"], types.SimpleNamespace())
