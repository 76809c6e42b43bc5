"""The worked out-of-tree example (examples/qualify-example-engine) qualified end to end.

Its cells run in a second environment (``scripts/install_example.sh``: a venv whose
transformers differs from qualify's, holding the example installed from its own
``pyproject.toml``) through ``--launcher example_tp1=<venv>/bin/python``, and PASS; the
gate then calls them STALE against a copy of the checkout where one line of the example's
harness is edited. qualify's side registers the engine as an installed distribution does:
a ``dist-info`` whose ``entry_points.txt`` is the example's own ``[project.entry-points]``
table. Skipped when the venv is absent, unless ``QUALIFY_REQUIRE_EXAMPLE=1`` (CI builds
it), then it fails.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from qualify.errors import ExitCode
from qualify.resources import repo_root

ROOT = repo_root()
EXAMPLE = ROOT / "examples" / "qualify-example-engine"
VENV = Path(os.environ.get("QUALIFY_EXAMPLE_VENV", ROOT / ".venv-example"))
PYTHON = VENV / "bin" / "python"
HARNESS = "src/qualify_example_engine/harness.py"
pytestmark = pytest.mark.slow  # minutes: a reference stage, a run and two gates (.ci/run runs it)

if not PYTHON.is_file():
    if os.environ.get("QUALIFY_REQUIRE_EXAMPLE") == "1":
        pytest.fail(f"QUALIFY_REQUIRE_EXAMPLE=1 but {PYTHON} is absent: run "
                    "scripts/install_example.sh", pytrace=False)
    pytest.skip(f"{PYTHON} absent (scripts/install_example.sh builds it)",
                allow_module_level=True)


def _register(where: Path) -> Path:
    """A dist-info of the example for qualify's interpreter, from its pyproject.toml."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    info = where / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\n"
                                   f"Version: {project['version']}\n")
    lines = [f"[{group}]" + "".join(f"\n{k} = {v}" for k, v in eps.items())
             for group, eps in project["entry-points"].items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return where


def _qualify(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qualify", *args], capture_output=True,
                          text=True, check=False, env=env, cwd=ROOT)


def test_the_example_passes_in_its_own_venv_and_an_edit_makes_it_stale(tmp_path: Path
                                                                         ) -> None:
    versions = subprocess.run(
        [str(PYTHON), "-c", "import importlib.metadata as m, sys; "
         "print(m.version('transformers')); print(sys.prefix)"],
        capture_output=True, text=True, check=True).stdout.split()
    ours = importlib.metadata.version("transformers")
    assert versions[0] != ours, f"the example venv has qualify's transformers {ours}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(EXAMPLE / "src"), str(_register(tmp_path / "qualify-side"))]),
        "XDG_CONFIG_HOME": str(tmp_path / "config"), "QUALIFY_SIGNING_KEY": "",
        "QUALIFY_SIGNING_KEY_FILE": str(tmp_path / "k.pem")}
    keygen = _qualify("keygen", "--private-key", str(tmp_path / "k.pem"), "--public-dir",
                      str(tmp_path / "keys"), env=env)
    assert keygen.returncode == 0, keygen.stderr
    engines = _qualify("engines", "--json", env={
        **env, "QUALIFY_LAUNCHER_EXAMPLE_TP1": str(PYTHON)})
    row = {r["name"]: r for r in json.loads(engines.stdout)}["example_tp1"]
    assert row["source"] == "qualify-example-engine 0.1.0"
    assert row["interpreter"] == str(PYTHON)
    contract = EXAMPLE / "contract.toml"
    run = _qualify("run", str(contract), "--references", str(tmp_path / "refs"),
                   "--evidence", str(tmp_path / "ev"), "--quiet",
                   "--launcher", f"example_tp1={PYTHON}", env=env)
    assert run.returncode == ExitCode.OK, run.stdout + run.stderr
    (run_dir,) = (tmp_path / "ev" / "example-tp1").glob("2*Z")
    report = json.loads((run_dir / "report.json").read_text())
    cells = {c["cell"]: c["verdict"] for c in report["cells"]}
    assert cells, report
    assert set(cells.values()) == {"PASS"}, cells
    record = json.loads((run_dir / "cells" / next(iter(cells)) / "attempt-1" /
                         "imports.json").read_text())
    (launch,) = record["launches"]
    assert launch["interpreter"]["packages"]["transformers"] == versions[0]
    assert f"examples/qualify-example-engine/{HARNESS}" in launch["checkout"]
    assert not any(p.startswith(".venv-example/") for p in launch["checkout"])
    gate = ["gate", str(tmp_path / "ev"), "--contract", str(contract), "--keys",
            str(tmp_path / "keys")]
    fresh = _qualify(*gate, env=env)
    assert fresh.returncode == ExitCode.OK, fresh.stdout + fresh.stderr
    checkout = tmp_path / "checkout"  # the code with one line of the example edited
    for part in ("qualify", "harnesses", "examples", "sdk"):
        shutil.copytree(ROOT / part, checkout / part,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    edited = checkout / "examples" / "qualify-example-engine" / HARNESS
    edited.write_text(edited.read_text().replace('ENGINE = "example_tp1"',
                                                 'ENGINE = "example_tp1"  # edited', 1))
    stale = _qualify(*gate, "--sources-root", str(checkout), "--json",
                     str(tmp_path / "gate.json"), env=env)
    assert stale.returncode == ExitCode.QUALIFICATION_FAILED, stale.stdout
    (doc,) = json.loads((tmp_path / "gate.json").read_text())["contracts"]
    assert {c["cell"]: (c["outcome"], c["stale_files"]) for c in doc["cells"]} == {
        cell: ("STALE", [f"examples/qualify-example-engine/{HARNESS}"]) for cell in cells}
