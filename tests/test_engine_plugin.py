"""A new engine is one folder plus one registry line: an engine plugged in from outside.

A test-only distribution is built in ``tmp_path`` (a ``*.dist-info`` directory with an
``entry_points.txt`` in the ``qualify.engines`` group, and a package whose ``spec`` module
declares an :class:`~qualify.registry.EngineSpec`) and put on ``sys.path``. Without touching
``qualify/``, its engine is found, a contract naming it parses with its option and its
shard-degree axis (``dp``) checked against the spec, its cells carry the axis in their ids,
and the candidate stage plans launches for it. The last test checks that no engine name is
written into the code of the engine-agnostic modules.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qualify import registry
from qualify.candidate.stage import plan_launches
from qualify.contract import Contract, cells_matching, load_contract
from qualify.errors import ContractError
from qualify.resources import contracts_dir, repo_root

DIST = "qualify-test-shardy"
ENGINE = "shardy"
PACKAGE = "qualify_test_shardy"
SPEC_SOURCE = '''"""Test-only engine: TP plus a shard-degree axis and one number-changing option."""

from qualify.registry import TP_AXIS, Axis, EngineOption, EngineSpec

SPEC = EngineSpec(
    name="shardy",
    entry="qualify_test_shardy.harness:main",
    axes=(TP_AXIS, Axis(name="dp", degrees=(1, 2, 4), description="data-parallel shards")),
    options=(EngineOption(name="reshard_after_forward", key="reshard", values=(0, 1),
                          default=(1,), description="free the gathered weights after forward"),),
    distributions=("qualify-test-shardy",),
    description="test-only sharded engine",
)
'''


@pytest.fixture
def plugin(tmp_path_factory: pytest.TempPathFactory,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The test distribution on ``sys.path``; the registry re-reads entry points around it."""
    root = tmp_path_factory.mktemp("site")
    dist_info = root / f"{PACKAGE}-0.0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.0.0\n")
    (dist_info / "entry_points.txt").write_text(
        f"[{registry.ENGINE_ENTRY_POINT_GROUP}]\n{ENGINE} = {PACKAGE}.spec:SPEC\n")
    pkg = root / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""Test-only engine package."""\n')
    (pkg / "spec.py").write_text(SPEC_SOURCE)
    monkeypatch.syspath_prepend(str(root))
    registry._reset_for_tests()
    yield root
    monkeypatch.undo()
    for name in [m for m in sys.modules if m.split(".")[0] == PACKAGE]:
        del sys.modules[name]
    registry._reset_for_tests()


def _doc(**shardy_options: list[int]) -> dict[str, Any]:
    """The committed tiny contract with the plugged engine next to ``torch_tp``."""
    doc = tomllib.loads((contracts_dir() / "tiny-qwen3.toml").read_text())
    doc["matrix"]["engines"] = ["torch_tp", ENGINE]
    doc["matrix"]["engine_options"][ENGINE] = dict(shardy_options)
    return doc


def _write(doc: dict[str, Any], path: Path) -> Path:
    """Write ``doc`` as TOML through the JSON-compatible subset (inline tables)."""
    def val(v: Any) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f'"{k}" = {val(x)}' for k, x in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, bool):
            return "true" if v else "false"
        return json.dumps(v)
    path.write_text("".join(f'"{k}" = {val(v)}\n' for k, v in doc.items()))
    return path


@pytest.mark.usefixtures("plugin")
def test_entry_point_engine_is_found() -> None:
    assert ENGINE in registry.engine_names()
    spec = registry.get_engine(ENGINE)
    assert spec.source == DIST
    assert [a.name for a in spec.axes] == ["tp", "dp"]
    assert [a.name for a in spec.extra_axes] == ["dp"]
    assert spec.option("reshard_after_forward") is not None
    assert spec.distributions == (DIST,)
    assert spec.module == f"{PACKAGE}.harness"
    with pytest.raises(registry.UsageError, match="did you mean 'shardy'"):
        registry.get_engine("shardie")


@pytest.mark.usefixtures("plugin")
def test_contract_naming_the_engine_parses_with_its_axis_and_option() -> None:
    c = Contract.from_dict(_doc(dp=[1, 2], reshard_after_forward=[0, 1]))
    ids = [x.cell_id for x in c.matrix.cells() if x.engine == ENGINE]
    assert ids == [f"shardy-{p}-reshard{r}-{role}-tp{tp}-dp{dp}"
                   for p in ("fp32", "bf16") for r in (0, 1) for role in ("actor", "critic")
                   for tp in (1, 2) for dp in (1, 2)]
    torch_tp = [x.cell_id for x in c.matrix.cells() if x.engine == "torch_tp"]
    assert torch_tp[:2] == ["torch_tp-fp32-actor-tp1", "torch_tp-fp32-actor-tp2"]
    cell = next(x for x in c.matrix.cells() if x.cell_id == "shardy-bf16-reshard0-critic-tp2-dp2")
    assert cell.axes == (("dp", 2),)
    assert cell.options == (("reshard", 0),)
    assert cell.harness_options == {"reshard": 0, "dp": 2}
    assert not cell.is_base
    assert cell.base_cell_id() == "shardy-bf16-reshard0-critic-tp1-dp1"
    assert cell.base_cell_id() in {x.cell_id for x in c.matrix.cells()}


@pytest.mark.usefixtures("plugin")
def test_unnamed_option_and_axis_take_the_spec_defaults() -> None:
    c = Contract.from_dict(_doc())
    ids = [x.cell_id for x in c.matrix.cells() if x.engine == ENGINE and x.precision == "fp32"]
    assert ids == ["shardy-fp32-reshard1-actor-tp1-dp1", "shardy-fp32-reshard1-actor-tp2-dp1",
                   "shardy-fp32-reshard1-critic-tp1-dp1", "shardy-fp32-reshard1-critic-tp2-dp1"]


@pytest.mark.parametrize(("options", "pattern"), [
    pytest.param({"reshard_after_forward": [0, 2]},
                 r"matrix\.engine_options\.shardy\.reshard_after_forward\.1: 2 is not one of "
                 r"the values 'shardy' takes \(0, 1\)", id="bad-option-value"),
    pytest.param({"dp": [1, 3]},
                 r"matrix\.engine_options\.shardy\.dp\.1: 3 is not one of the dp degrees "
                 r"'shardy' takes \(1, 2, 4\)", id="bad-axis-degree"),
    pytest.param({"reshard": [0]},
                 r"matrix\.engine_options\.shardy\.reshard: 'shardy' has no option or axis "
                 r"'reshard'; did you mean 'reshard_after_forward'\? it takes: "
                 r"reshard_after_forward, dp", id="id-key-is-not-the-field"),
])
@pytest.mark.usefixtures("plugin")
def test_bad_values_are_rejected_naming_file_and_field(tmp_path: Path, options: dict[str, Any],
                                                       pattern: str) -> None:
    path = _write(_doc(**options), tmp_path / "plugged.toml")
    with pytest.raises(ContractError) as info:
        load_contract(path)
    msg = str(info.value)
    assert msg.startswith(f"{path.resolve()}: "), msg
    assert re.search(pattern, msg), msg


@pytest.mark.usefixtures("plugin")
def test_launches_carry_the_axis_degrees() -> None:
    c = Contract.from_dict(_doc(dp=[1, 2], reshard_after_forward=[1]))
    wanted = cells_matching(c, ["shardy:*fp32*"])
    launches = plan_launches(c, wanted)
    assert [lc.launch_id for lc in launches] == [
        f"shardy-fp32-reshard1-dp{dp}-{topo}" for dp in (1, 2) for topo in ("a2c1", "a1c2")]
    assert [dict(lc.options) for lc in launches[::2]] == [{"reshard": 1, "dp": 1},
                                                          {"reshard": 1, "dp": 2}]
    assert sorted(x.cell_id for lc in launches for x in lc.cells) == sorted(
        x.cell_id for x in wanted)


def test_unregistered_engine_is_a_contract_error() -> None:
    """Without the distribution on ``sys.path`` the same contract names an unknown engine."""
    registry._reset_for_tests()
    with pytest.raises(ContractError, match=r"matrix\.engines\.1: unknown engine 'shardy'"):
        Contract.from_dict(_doc())


ENGINE_AGNOSTIC = ("qualify/contract.py", "qualify/matrix.py",
                   "qualify/candidate/sampler_stage.py", "qualify/candidate/stage.py")
NAMES = re.compile(r"\b(torch_tp|deepspeed|megatron|vllm|fsdp2)\b", re.IGNORECASE)


def _code_strings(path: Path) -> list[str]:
    """String constants of a module's code (docstrings left out: they may give examples)."""
    tree = ast.parse(path.read_text("utf-8"))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docstrings]


@pytest.mark.parametrize("rel", ENGINE_AGNOSTIC)
def test_no_engine_name_in_engine_agnostic_code(rel: str) -> None:
    strings = _code_strings(repo_root() / rel)
    assert [s for s in strings if NAMES.search(s) or s == "hf"] == []


def test_no_engine_name_in_the_contract_schema() -> None:
    schema = json.loads((contracts_dir() / "schema" / "contract.schema.json").read_text())
    found: list[str] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if NAMES.search(k) or k == "hf":
                    found.append(f"{where}/{k}")
                walk(v, f"{where}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}/{i}")
        elif isinstance(node, str) and (NAMES.search(node) or node == "hf"):
            found.append(f"{where}: {node}")

    walk(schema, "")
    assert found == []
