"""The ``verl`` engine's translations without verl, and its planted faults.

No verl import (qualify's environment lacks it): the committed verl contracts use only what
verl runs; the contract's algorithm maps onto verl's config fields by name, and every
variant verl's engine path does not run is named; the loss mask and advantages go to verl as
given, and each planted translation fault replaces exactly the translation it corrupts. What
verl shares with TRL (registration, NOT_RUN reason, unknown and shifted-mask faults) is
tests/test_stack_adapters.py; the end-to-end runs are tests/test_verl.py (slow, in verl's
venv).
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from stack_runs import response_masks

from harnesses.verl import faults, harness, translate
from qualify.contract import load_contract
from qualify.resources import contracts_dir

VERL_CONTRACTS = ("tiny-qwen3-verl", "tiny-qwen3-verl-gspo")


@pytest.mark.parametrize("name", VERL_CONTRACTS)
def test_verls_contracts_use_only_what_verl_runs(name: str) -> None:
    contract = load_contract(contracts_dir() / f"{name}.toml")
    assert translate.unsupported(contract.algorithm, contract.optimizer,
                                 tuple(contract.matrix.roles)) == []


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


@settings(max_examples=40, deadline=None)
@given(response_masks())
def test_verl_gets_the_loss_mask_and_advantages_as_given_and_the_planted_fault_scales_them(
        mask: torch.Tensor) -> None:
    assert torch.equal(harness.response_loss_mask(mask), mask.long())
    adv = torch.linspace(-1.0, 1.0, mask.numel()).reshape(mask.shape)
    assert torch.equal(harness.advantages_in(adv), adv)
    fake = types.SimpleNamespace(advantages_in=harness.advantages_in)
    faults.install(["advantages_unnormalised"], fake)
    assert torch.equal(fake.advantages_in(adv), adv * 4.0)
    assert harness.advantages_in is not fake.advantages_in  # only what it got
