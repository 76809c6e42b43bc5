"""What the stack adapters (TRL, verl) share, checked on both without either stack installed.

Each is a built-in engine whose cells, with the stack nowhere to run, are ``NOT_RUN`` with
the registry's "not installed" reason ending in the spec's ``install_hint`` (its install
script and ``--launcher`` option); a contract variant it lacks is named first; a stack
interpreter (``QUALIFY_LAUNCHER_<ENGINE>``) lifts both. Each fault plugin refuses an unknown
fault naming the known ones, and its ``*_mask_shifted`` fault replaces exactly the loss-mask
translation, by the same one-token roll; the clip both adapters measure is the ratio of the
gradient norms after and before it. Each stack's own translations are tested in
tests/test_trl_adapter.py and tests/test_verl_adapter.py, its end-to-end runs in
tests/test_trl.py and tests/test_verl.py (slow, in the stack's venv).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stack_runs import response_masks
from torch import Tensor

from harnesses import common
from qualify.contract import load_contract
from qualify.errors import HarnessError
from qualify.registry import DEFAULT_INSTALL_HINT, EngineSpec, get_engine
from qualify.resources import contracts_dir

STACKS = {"trl": ("tiny-qwen3-trl", "tiny-qwen3-trl-gspo"),
          "verl": ("tiny-qwen3-verl", "tiny-qwen3-verl-gspo")}
"""Engine -> its committed contracts."""
CONTRACTS = [(engine, name) for engine, names in STACKS.items() for name in names]
LOSS_MASK: dict[str, tuple[str, str, Callable[[Tensor], tuple[Tensor, ...]]]] = {
    "trl": ("completion_mask_shifted", "tool_mask", lambda m: (m, torch.ones_like(m.long()))),
    "verl": ("response_mask_shifted", "response_loss_mask", lambda m: (m,)),
}
"""Engine -> (its shifted-mask fault, the harness function it replaces, that function's
arguments for a response mask: TRL's also takes the responses' attention, all ones)."""


@pytest.mark.parametrize(("engine", "name"), CONTRACTS)
def test_a_stack_nowhere_to_run_names_its_install_script(
        engine: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = get_engine(engine)
    assert (spec.source, spec.entry) == ("builtin", f"harnesses.{engine}.harness:main")
    contract = load_contract(contracts_dir() / f"{name}.toml")
    assert set(contract.matrix.engines) == {engine}
    variants = contract.algorithm.variants()
    monkeypatch.delenv(f"QUALIFY_LAUNCHER_{engine.upper()}", raising=False)
    assert f"bash scripts/install_{engine}.sh" in spec.install_hint
    assert f"--launcher {engine}=.venv-{engine}/bin/python" in spec.install_hint
    if importlib.util.find_spec(engine) is None:
        assert spec.unavailable_reason(False, variants=variants) == (
            f"engine {engine!r} is not installed here (no module {engine!r}, no "
            f"QUALIFY_LAUNCHER_{engine.upper()}): {spec.install_hint}")
    lacking = spec.unavailable_reason(False, variants=(*variants, "policy_loss=nope"))
    assert lacking is not None
    assert "policy_loss=nope" in lacking
    monkeypatch.setenv(f"QUALIFY_LAUNCHER_{engine.upper()}", sys.executable)
    assert spec.unavailable_reason(False, variants=variants) is None


def test_a_spec_without_an_install_hint_names_the_readme() -> None:
    spec = EngineSpec(name="nowhere", entry="no_such_module_qualify.harness:main",
                      requires=("no_such_module_qualify",))
    assert spec.unavailable_reason(False) == (
        "engine 'nowhere' is not installed here (no module 'no_such_module_qualify', no "
        f"QUALIFY_LAUNCHER_NOWHERE): {DEFAULT_INSTALL_HINT}")


@pytest.mark.parametrize("engine", STACKS)
def test_an_unknown_fault_is_refused_naming_the_known_ones(engine: str) -> None:
    faults = importlib.import_module(f"harnesses.{engine}.faults")
    with pytest.raises(HarnessError, match=rf"{engine} knows .*{faults.KNOWN[0]}"):
        faults.install(["no_such_fault"], types.SimpleNamespace())


@pytest.mark.parametrize("engine", STACKS)
@settings(max_examples=30, deadline=None)
@given(mask=response_masks())
def test_the_shifted_mask_fault_rolls_the_loss_mask_one_token(engine: str,
                                                               mask: Tensor) -> None:
    fault, attr, args = LOSS_MASK[engine]
    harness = importlib.import_module(f"harnesses.{engine}.harness")
    faults = importlib.import_module(f"harnesses.{engine}.faults")
    fake = types.SimpleNamespace(**{attr: getattr(harness, attr)})
    faults.install([fault], fake)
    shifted = getattr(fake, attr)(*args(mask))
    assert shifted is not None
    assert shifted.dtype == torch.int64
    assert torch.equal(shifted, torch.roll(mask.long(), 1, dims=1))
    assert getattr(harness, attr) is not getattr(fake, attr)  # the plugin patched only `fake`


@settings(max_examples=30, deadline=None)
@given(shapes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
       scale=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_the_measured_clip_is_the_ratio_of_the_gradient_norms(shapes: list[int], scale: float,
                                                              seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=gen) for n in shapes]
    got = common.measured_clip_coef([g * scale for g in grads], grads)
    assert got.shape == ()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(scale), rtol=1e-6, atol=1e-7)
    assert float(common.measured_clip_coef(grads, [torch.zeros(n) for n in shapes])) == 1.0
