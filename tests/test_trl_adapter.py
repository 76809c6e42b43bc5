"""The ``trl`` engine's translations without TRL, and its planted faults.

No TRL import (qualify's environment lacks it): TRL's loss mask is the rollout's response
mask, passed only where it differs from the responses' attention; the advantages go to TRL
as given; each planted translation fault replaces exactly the translation it corrupts. What
TRL shares with verl (registration, NOT_RUN reason, unknown and shifted-mask faults) is
tests/test_stack_adapters.py; the end-to-end runs are tests/test_trl.py (slow, in TRL's venv).
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stack_runs import response_masks

from harnesses.trl import faults, harness, translate
from qualify.contract import load_contract
from qualify.resources import contracts_dir


@settings(max_examples=40, deadline=None)
@given(response_masks())
def test_the_loss_mask_is_the_response_mask_where_it_differs_from_attention(
        mask: torch.Tensor) -> None:
    assert harness.tool_mask(mask, mask.long()) is None  # TRL's completion_mask suffices
    attention = torch.ones_like(mask, dtype=torch.long)
    got = harness.tool_mask(mask, attention)
    if torch.equal(mask.long(), attention):
        assert got is None
    else:
        assert got is not None
        assert torch.equal(got, mask.long())


def test_the_temperature_fault_replaces_only_the_sampling_translation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    contract = load_contract(contracts_dir() / "tiny-qwen3-trl.toml")
    assert translate.sampling_kwargs(contract.sampling) == {
        "temperature": contract.sampling.temperature}
    assert contract.sampling.temperature != 1.0  # else the fault could not show
    monkeypatch.setattr(translate, "sampling_kwargs", translate.sampling_kwargs)  # restored
    before = translate.grpo_config_kwargs(contract.algorithm, response_len=10)
    faults.install(["temperature_not_passed"], types.SimpleNamespace())
    assert translate.sampling_kwargs(contract.sampling) == {"temperature": 1.0}
    assert translate.grpo_config_kwargs(contract.algorithm, response_len=10) == before


@settings(max_examples=20, deadline=None)
@given(st.lists(st.floats(-5, 5, width=32), min_size=1, max_size=12))
def test_advantages_go_to_trl_as_given_and_the_planted_fault_flips_their_sign(
        values: list[float]) -> None:
    adv = torch.tensor(values).reshape(1, -1)
    assert torch.equal(harness.trl_advantages(adv), adv)
    assert harness.trl_advantages(adv).dtype == torch.float32
    fake = types.SimpleNamespace(trl_advantages=harness.trl_advantages)
    faults.install(["advantages_negated"], fake)
    assert torch.equal(fake.trl_advantages(adv), -adv)
    assert harness.trl_advantages is not fake.trl_advantages
