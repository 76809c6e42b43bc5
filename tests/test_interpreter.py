"""An engine's ranks in another interpreter (qualify.candidate.interpreter), and what follows.

The setting (``QUALIFY_LAUNCHER_<ENGINE>`` / ``--launcher ENGINE=CMD``) is refused with one
line for every bad value; a foreign interpreter always launches through torchrun of that
interpreter with the recording runner, never the warm launcher; a real launch
through a command prefix records every rank; the import record of a foreign interpreter
finds the engine's distribution on that interpreter's ``sys.path`` (and keeps the venv's own
files out of the checkout set even when the venv lies inside it), so that editing the
plugin makes its cells stale; ``sources.json`` records the engine's distributions' versions
from that interpreter; ``qualify diverge`` support is a capability of the spec.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_launch import _cell, write_fake

from qualify.candidate import interpreter
from qualify.candidate.launch import launch, launch_command
from qualify.contract import load_contract
from qualify.errors import ExitCode, UsageError
from qualify.evidence import imports
from qualify.evidence.environment import package_versions
from qualify.evidence.sources import sources_document
from qualify.registry import EngineSpec
from qualify.resources import contracts_dir


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(("value", "words"), [
    ("/no/such/python", "not an executable file"),
    ("no-such-program-xyz -m x", "not an executable file or a program on PATH"),
    ("'unbalanced", "not a command line"),
    ("   ", "empty"),
])
def test_a_bad_interpreter_is_one_line_naming_the_variable(value: str, words: str) -> None:
    env = {"QUALIFY_LAUNCHER_TORCH_TP": value}
    with pytest.raises(UsageError, match=words) as info:
        interpreter.check_env(env)
    assert "QUALIFY_LAUNCHER_TORCH_TP" in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(UsageError, match="--launcher torch_tp"):
        interpreter.apply_options([f"torch_tp={value}"], {})


@pytest.mark.parametrize(("opt", "words"), [
    ("torch_tp", "must be ENGINE=COMMAND"), ("Torch=python3", "must be ENGINE=COMMAND"),
    ("nope=python3", "unknown engine 'nope'")])
def test_a_bad_launcher_option_is_refused(opt: str, words: str) -> None:
    with pytest.raises(UsageError, match=words):
        interpreter.apply_options([opt], {}, known=["torch_tp"])


def test_the_cli_refuses_a_bad_launcher_with_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "qualify", "candidate", "--reference",
                           str(tmp_path), "--out", str(tmp_path / "ev"), "--launcher",
                           "torch_tp=/no/such/python"], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == ExitCode.USAGE_ERROR, proc.stderr
    assert proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ev").exists()


def test_a_relative_interpreter_path_is_resolved_where_qualify_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks start in their attempt directory: ``.venv-x/bin/python`` must not move."""
    python = tmp_path / ".venv-x" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    for value in (".venv-x/bin/python -X dev", "./.venv-x/bin/python -X dev"):
        cmd = interpreter.engine_command("trl", {"QUALIFY_LAUNCHER_TRL": value})
        assert cmd == [str(python), "-X", "dev"]
    bare = interpreter.engine_command("trl", {"QUALIFY_LAUNCHER_TRL": "env A=1 python3"})
    assert bare == ["env", "A=1", "python3"]  # a program on PATH stays a name


def test_a_foreign_interpreter_runs_torchrun_and_the_runner_never_the_warm_launcher(
        tmp_path: Path) -> None:
    prefix = ["/bin/env", "A=1", sys.executable]
    for launcher in ("warm", "torchrun", None):
        cmd = launch_command(tmp_path / "cell.json", module="pkg.harness", world_size=2,
                             log_dir=tmp_path, env={}, launcher=launcher,
                             preload=("x",), python=prefix)
        assert cmd[:5] == [*prefix, "-m", "torch.distributed.run"]
        assert cmd[-3:] == [str(interpreter.RUNNER), "pkg.harness", str(tmp_path / "cell.json")]
        assert "qualify.candidate.warm" not in cmd


def test_a_real_launch_through_a_command_prefix_records_every_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    env = write_fake(root)
    monkeypatch.setattr(imports, "repo_root", lambda: root)
    marker = tmp_path / "marker"
    wrapper = tmp_path / "stack-python"
    wrapper.write_text(f"#!/bin/sh\necho \"$@\" >> {marker}\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    att = tmp_path / "launches" / "fake-a2" / "attempt-1"
    res = launch(_cell(att), module="pkg_fake.harness", attempt_dir=att, timeout_s=120,
                 env=env, python=[str(wrapper)])
    assert res.status == "OK", res.reason
    assert marker.read_text().startswith("-m torch.distributed.run ")
    (rec,) = json.loads((att / "imports.json").read_text())["launches"]
    assert rec["ranks_recorded"] == [0, 1]
    assert {"pkg_fake/__init__.py", "pkg_fake/harness.py"} <= set(rec["checkout"])


def test_sources_record_the_versions_of_the_interpreter_that_runs_the_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sources.json`` names a stack's versions as its ranks see them (its own venv: here a
    wrapper whose ``PYTHONPATH`` holds other ``trl`` and ``transformers`` distributions), not
    qualify's; an interpreter that cannot report them is one line naming the setting."""
    site = tmp_path / "site"
    for name, version in (("trl", "9.9.9"), ("transformers", "4.0.1")):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    stack = tmp_path / "stack-python"
    stack.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    stack.chmod(0o755)
    contract = load_contract(contracts_dir() / "tiny-qwen3-trl.toml")
    monkeypatch.delenv("QUALIFY_LAUNCHER_TRL", raising=False)
    ours = sources_document(contract)["engines"]["trl"]["distributions"]
    assert ours == package_versions(["torch", "trl", "transformers", "accelerate"])
    assert ours["transformers"] != "4.0.1"
    monkeypatch.setenv("QUALIFY_LAUNCHER_TRL", str(stack))
    theirs = sources_document(contract)["engines"]["trl"]["distributions"]
    assert theirs == {**ours, "trl": "9.9.9", "transformers": "4.0.1"}
    stack.write_text("#!/bin/sh\necho 'no python here' >&2\nexit 3\n")
    with pytest.raises(UsageError, match=r"^QUALIFY_LAUNCHER_TRL=.*stack-python: cannot read "
                                         r"its distributions' versions \(exit 3: no python "
                                         r"here\)$"):
        sources_document(contract)


def _fake_dist(site: Path, name: str, version: str) -> None:
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text("")
    (site / name / "harness.py").write_text("def main(argv): return 0\n")
    info = site / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(f"{name}\n")
    (info / "RECORD").write_text(f"{name}/__init__.py,,\n{name}/harness.py,,\n")


def test_a_foreign_interpreter_s_plugin_is_hashed_where_it_is_installed(
        tmp_path: Path) -> None:
    """The plugin lives only in the other interpreter's site-packages (a venv inside the
    checkout here): recorded by distribution with its site, none of the venv's files count
    as checkout files, an edit of the plugin is a change, and without the venv the cell
    cannot be proven fresh."""
    root = tmp_path / "root"
    (root / "harnesses").mkdir(parents=True)
    (root / "own.py").write_text("X = 1\n")
    venv = root / ".venv-stack"
    site = venv / "lib" / "python3.x" / "site-packages"
    _fake_dist(site, "qforeign", "0.3")
    (site / "otherlib.py").write_text("Y = 2\n")
    attempt = tmp_path / "launches" / "qforeign-a1" / "attempt-1"
    folder = attempt / "logs" / "imports"
    folder.mkdir(parents=True)
    files = [site / "qforeign" / "harness.py", site / "qforeign" / "__init__.py",
             site / "otherlib.py", root / "own.py"]
    (folder / "0-1.json").write_text(json.dumps({
        "rank": 0, "pid": 1, "files": [str(f) for f in files], "modules": ["qforeign"],
        "prefixes": [str(venv), str(site)], "sys_path": [str(site)],
        "executable": str(venv / "bin" / "python")}))
    assert importlib.util.find_spec("qforeign") is None  # not in qualify's interpreter
    doc = imports.collect(attempt, module="qforeign.harness", expected=1,
                          started_ns=time.time_ns(), root=root)
    (rec,) = doc["launches"]
    assert rec["checkout"] == {"own.py": _sha(root / "own.py")}
    assert rec["distributions"] == {"qforeign": {
        "version": "0.3", "site": str(site), "files": {
            "qforeign/__init__.py": _sha(site / "qforeign" / "__init__.py"),
            "qforeign/harness.py": _sha(site / "qforeign" / "harness.py")}}}
    assert rec["interpreter"] == {"executables": [str(venv / "bin" / "python")],
                                  "packages": {"qforeign": "0.3"}}
    assert imports.record_changes(doc, root) == []
    (site / "qforeign" / "harness.py").write_text("def main(argv): return 1\n")
    assert imports.record_changes(doc, root) == ["qforeign: qforeign/harness.py"]
    (site / "qforeign-0.3.dist-info" / "METADATA").unlink()
    (site / "qforeign-0.3.dist-info").rename(site / "gone")
    assert imports.record_changes(doc, root) == [
        f"qforeign not installed here (in {site}): 2 imported files cannot be checked"]


def test_diverge_support_is_the_spec_s_capability(tmp_path: Path) -> None:
    from qualify import registry
    from qualify.diverge.run import resolve_cell, supported

    assert set(supported()) == {n for n in registry.engine_names()
                                if registry.get_engine(n).diverge}
    run = tmp_path / "run"
    run.mkdir()
    cells: dict[str, Any] = {
        f"{e}-fp32-actor-tp1": {"engine": e, "precision": "fp32", "role": "actor", "tp": 1}
        for e in ("probing", "plain")}
    (run / "run.json").write_text(json.dumps({"cells": cells}))
    registry.register_engine(EngineSpec(name="probing", entry="x.y:main", diverge=True))
    registry.register_engine(EngineSpec(name="plain", entry="x.y:main"))
    try:
        assert resolve_cell(run, "probing-fp32-actor-tp1")[0].engine == "probing"
        with pytest.raises(UsageError, match="does not declare diverge"):
            resolve_cell(run, "plain-fp32-actor-tp1")
    finally:
        registry.ENGINES.reset()


def test_engines_lists_source_axes_options_capabilities(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    from qualify.cli.main import main

    assert main(["engines", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["deepspeed"]["source"] == "builtin"
    assert rows["deepspeed"]["options"]["zero_stage"]["values"] == [0, 1, 2]
    assert rows["fsdp2"]["axes"] == {"tp": [1, 2], "dp": [1, 2]}
    assert "diverge" in rows["torch_tp"]["capabilities"]
    assert "diverge" not in rows["fsdp2"]["capabilities"]
    proc = subprocess.run([sys.executable, "-m", "qualify", "--version"], capture_output=True,
                          text=True, check=False)
    from qualify import __version__

    assert proc.returncode == 0
    assert proc.stdout.strip() == f"qualify {__version__}"
