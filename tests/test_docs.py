"""The documentation that is generated or quoted stays true to its source.

- ``docs/contract-reference.md`` is what ``scripts/contract_reference.py`` makes from
  ``contracts/schema/contract.schema.json`` (a schema change without regenerating it fails);
- README command 2 is the exact test command ``.ci/run`` runs;
- every ``docs/`` page and repository path the README's documentation table names exists.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("contract_reference",
                                                  ROOT / "scripts" / "contract_reference.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_contract_reference_is_generated_from_the_schema() -> None:
    gen = _generator()
    assert gen.main(["--check"]) == 0, "run: python scripts/contract_reference.py"


def test_the_contract_reference_lists_every_schema_field() -> None:
    """Every property of the schema appears as a row or a section (no field is skipped)."""
    import json

    gen = _generator()
    schema = json.loads((ROOT / "contracts/schema/contract.schema.json").read_text())
    page = gen.render(schema)
    for section, node in schema["properties"].items():
        assert f"## `{section}`" in page
        for path, *_ in gen._rows(node, schema, f"{section}."):
            assert f"| `{path}` |" in page


def test_a_schema_change_makes_the_check_fail(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    gen = _generator()
    page = tmp_path / "page.md"
    page.write_text(gen.render({"type": "object", "properties": {"x": {"type": "integer"}}}))
    monkeypatch.setattr(gen, "PAGE", page)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1


def _readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_command_2_is_the_ci_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_cmd = re.search(r"^(python -m pytest .*)$", ci, re.M)
    readme_cmd = re.search(r"^\. \.venv/bin/activate && (python -m pytest .*)$", _readme(), re.M)
    assert ci_cmd
    assert readme_cmd
    assert ci_cmd.group(1) == readme_cmd.group(1)


def test_every_page_the_readme_names_exists() -> None:
    named = set(re.findall(r"`((?:docs|contracts|benchmarks|scripts|harnesses)/[^`* ]+)`",
                           _readme()))
    assert named, "the README names no documentation"
    missing = sorted(p for p in named
                     if "<" not in p and not (ROOT / p).exists())
    assert not missing, missing


def test_the_performance_page_is_generated_from_the_benchmark_results() -> None:
    from benchmarks import results

    assert list(results.RESULTS_DIR.glob("*.json")), "no committed benchmark result"
    assert results.write_doc(check=True) == 0, "run: python -m benchmarks --doc"


def test_a_new_result_makes_the_performance_check_fail(tmp_path: Path) -> None:
    import json

    from benchmarks import results

    for p in results.RESULTS_DIR.glob("*.json"):
        (tmp_path / p.name).write_text(p.read_text(encoding="utf-8"), encoding="utf-8")
    doc = json.loads(next(tmp_path.glob("*.json")).read_text(encoding="utf-8"))
    created = doc["created"]
    page = tmp_path / "performance.md"
    assert results.write_doc(directory=tmp_path, page=page) == 0
    assert results.write_doc(check=True, directory=tmp_path, page=page) == 0
    doc["created"] = "2999-01-01T00:00:00Z"  # a newer run: it heads the page
    (tmp_path / "newer.json").write_text(json.dumps(doc), encoding="utf-8")
    assert results.write_doc(check=True, directory=tmp_path, page=page) == 1
    assert results.write_doc(directory=tmp_path, page=page) == 0
    text = page.read_text(encoding="utf-8")
    assert text.index("## 2999-01-01T00:00:00Z") < text.index(f"## {created}")
    assert doc["command"] in text
