"""qualify.registry: lazy engine strings, entry points, duplicates, "did you mean"."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from qualify import registry
from qualify.errors import HarnessError, UsageError
from qualify.protocol import HarnessCell
from qualify.registry import EngineSpec, engine_names, get_engine, register_engine


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
    assert "registered engines: deepspeed, megatron, torch_tp, vllm" in str(exc.value)


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
    eps = [importlib.metadata.EntryPoint(name="mystack", value="json:dumps",
                                         group=registry.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry.importlib.metadata, "entry_points",
                        lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
    registry._reset_for_tests()
    try:
        spec = get_engine("mystack")
        assert spec.entry == "json:dumps"
        assert spec.load() is json.dumps
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


def test_import_is_lazy() -> None:
    """``import qualify`` / the registry / the launcher import no engine, no torch.distributed."""
    code = (
        "import json, sys\n"
        "import qualify, qualify.registry, qualify.candidate.launch\n"
        "qualify.registry.engine_names(); qualify.registry.get_engine('torch_tp').module\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'vllm', 'deepspeed', 'megatron', 'harnesses'} or m.startswith('torch.distributed'))\n"
        "print(json.dumps({'bad': bad}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["bad"] == []
