"""The ``trl`` engine without TRL: its registration, its NOT_RUN reason, its fault plugin.

No TRL import (qualify's environment lacks it): the spec is registered as a built-in; with
no TRL anywhere its cells' reason names ``scripts/install_trl.sh``, a variant it lacks is
named first, a TRL interpreter (``QUALIFY_LAUNCHER_TRL``) lifts both; each planted
translation fault replaces exactly the translation it corrupts, and an unknown one is
refused. The end-to-end runs are tests/test_trl.py (slow, in TRL's venv).
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harnesses.trl import faults, harness, translate
from harnesses.trl.spec import INSTALL_REASON
from qualify.contract import load_contract
from qualify.errors import HarnessError
from qualify.registry import get_engine
from qualify.resources import contracts_dir

TRL_CONTRACTS = ("tiny-qwen3-trl", "tiny-qwen3-trl-gspo")


@pytest.mark.parametrize("name", TRL_CONTRACTS)
def test_trl_is_a_builtin_whose_missing_stack_names_the_install_script(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = get_engine("trl")
    assert (spec.source, spec.entry, spec.bf16_style) == ("builtin", "harnesses.trl.harness:main",
                                                          "autocast")
    contract = load_contract(contracts_dir() / f"{name}.toml")
    assert set(contract.matrix.engines) == {"trl"}
    variants = contract.algorithm.variants()
    monkeypatch.delenv("QUALIFY_LAUNCHER_TRL", raising=False)
    if importlib.util.find_spec("trl") is None:
        assert spec.unavailable_reason(False, variants=variants) == INSTALL_REASON
        assert "scripts/install_trl.sh" in INSTALL_REASON
    lacking = spec.unavailable_reason(False, variants=(*variants, "policy_loss=nope"))
    assert lacking is not None
    assert "policy_loss=nope" in lacking
    monkeypatch.setenv("QUALIFY_LAUNCHER_TRL", sys.executable)
    assert spec.unavailable_reason(False, variants=variants) is None


_MASKS = st.integers(1, 6).flatmap(lambda r: st.lists(
    st.tuples(st.integers(0, r - 1), st.integers(1, r)), min_size=1, max_size=5).map(
    lambda rows: (r, rows)))


def _mask(r: int, rows: list[tuple[int, int]]) -> torch.Tensor:
    """Response masks ``[B, R]``: row ``i`` is 1 on ``[lo, lo + n)`` (clipped at ``R``)."""
    m = torch.zeros((len(rows), r), dtype=torch.bool)
    for i, (lo, n) in enumerate(rows):
        m[i, lo:lo + n] = True
    return m


@settings(max_examples=40, deadline=None)
@given(_MASKS)
def test_the_loss_mask_is_the_response_mask_and_the_planted_shift_moves_it(
        case: tuple[int, list[tuple[int, int]]]) -> None:
    r, rows = case
    mask = _mask(r, rows)
    assert harness.tool_mask(mask, mask.long()) is None  # TRL's completion_mask suffices
    attention = torch.ones_like(mask, dtype=torch.long)
    got = harness.tool_mask(mask, attention)
    if torch.equal(mask.long(), attention):
        assert got is None
    else:
        assert got is not None
        assert torch.equal(got, mask.long())
    fake = types.SimpleNamespace(tool_mask=harness.tool_mask)
    faults.install(["completion_mask_shifted"], fake)
    shifted = fake.tool_mask(mask, attention)
    assert shifted is not None
    assert torch.equal(shifted, torch.roll(mask.long(), 1, dims=1))
    assert harness.tool_mask is not fake.tool_mask  # the plugin patched only what it got


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


def test_an_unknown_fault_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(HarnessError, match="completion_mask_shifted"):
        faults.install(["no_such_fault"], types.SimpleNamespace())
