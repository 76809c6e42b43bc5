"""Tests of qualify.evidence.gate (``qualify gate``) on the signed evidence world of test_verify."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from fresh_world import code_root, fresh, fresh_world
from test_verify import (
    CONTRACT,
    CUDA_ONLY,
    FAIL_CELL,
    MUTATION_IDS,
    MUTATIONS,
    Mutation,
    World,
    run_cli,
    signed_world,
    tampered,
    world,
)

from qualify.errors import ExitCode
from qualify.evidence import store
from qualify.evidence.gate import gate, latest_run
from qualify.resources import load_schema

__all__ = ["fresh", "fresh_world", "signed_world", "world"]  # shared fixtures

ALLOW_CUDA = f"{CUDA_ONLY}-*"


def gate_cli(w: World, evidence: Path, *extra: str, contracts: tuple[Path, ...] = ()
             ) -> tuple[int, str]:
    argv = ["gate", str(evidence), "--keys", str(w.keys)]
    if code_root(w).is_dir():  # a fresh world: its runs recorded the sources of this code
        argv += ["--sources-root", str(code_root(w))]
    for c in contracts or (w.contract,):
        argv += ["--contract", str(c)]
    return run_cli([*argv, *extra])


def _line(text: str, cell: str) -> str:
    """The summary table's row of ``cell``."""
    (line,) = [x for x in text.splitlines() if f" {cell} " in x]
    return line


def test_good_run_with_cuda_cells_allowed_passes(fresh_world: World, tmp_path: Path) -> None:
    out = tmp_path / "gate.json"
    code, text = gate_cli(fresh_world, fresh_world.good, "--allow-not-run", ALLOW_CUDA,
                          "--json", str(out))
    assert code == ExitCode.OK, text
    assert text.startswith("qualify gate: PASS (exit 0)")
    assert "no policy file; 8 required cells: 4 PASS, 4 NOT_RUN (4 NOT_RUN allowed" in text
    assert "cells not passing" not in text
    assert f"report: {fresh_world.good / 'report.md'}" in text
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, load_schema("gate"))
    (c,) = doc["contracts"]
    assert doc["result"] == "PASS"
    assert c["failed_cells"] == []
    assert sorted(c["allowed_not_run"]) == sorted(
        x["cell"] for x in c["cells"] if x["cell"].startswith(CUDA_ONLY))
    assert c["verification"]["passed"] is True
    assert doc["policy"]["allow_not_run"] == [ALLOW_CUDA]
    assert {x["allowed_not_run"] for x in c["cells"] if x["outcome"] == "NOT_RUN"} == {
        ALLOW_CUDA}


def test_cuda_cells_not_run_without_policy_fail(fresh_world: World) -> None:
    result = gate(fresh_world.good, [fresh_world.contract],
                  trusted_keys_dir=fresh_world.keys, sources_root=code_root(fresh_world))
    assert result.exit_code == ExitCode.QUALIFICATION_FAILED
    (c,) = result.contracts
    assert set(c.failed_cells) == {x.cell for x in c.cells if x.cell.startswith(CUDA_ONLY)}
    assert len(c.failed_cells) == 4
    assert all(x.verdict == "NOT_RUN" for x in c.cells if not x.ok)
    code, text = gate_cli(fresh_world, fresh_world.good)
    assert code == ExitCode.QUALIFICATION_FAILED
    line = _line(text, f"{CUDA_ONLY}-fp32-zero0-critic-tp2")
    assert "NOT_RUN" in line
    assert "FAILS" in line
    assert "CUDA is not available" in line


def test_failing_cell_exits_1_and_is_named(fresh_world: World, tmp_path: Path) -> None:
    out = tmp_path / "gate.json"
    code, text = gate_cli(fresh_world, fresh_world.failing, "--allow-not-run", ALLOW_CUDA,
                          "--json", str(out))
    assert code == ExitCode.QUALIFICATION_FAILED
    line = _line(text, FAIL_CELL)
    assert "FAIL" in line
    assert "logprobs, round 1, max_abs" in line
    assert f"1 not passed: {FAIL_CELL}" in text
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, load_schema("gate"))
    assert doc["result"] == "FAIL"
    assert doc["contracts"][0]["failed_cells"] == [FAIL_CELL]


def test_allow_not_run_never_excuses_a_failure(fresh_world: World) -> None:
    result = gate(fresh_world.failing, [fresh_world.contract],
                  allow_not_run=["torch_tp-*", ALLOW_CUDA], trusted_keys_dir=fresh_world.keys,
                  sources_root=code_root(fresh_world))
    assert result.exit_code == ExitCode.QUALIFICATION_FAILED
    assert result.contracts[0].failed_cells == (FAIL_CELL,)


def test_evidence_root_gates_the_newest_run(fresh_world: World) -> None:
    root = fresh_world.root / "evidence"
    newest = latest_run(root, CONTRACT)
    assert newest is not None
    assert newest.path.name == "run-3-fail"
    result = gate(root, [fresh_world.contract], allow_not_run=[ALLOW_CUDA],
                  trusted_keys_dir=fresh_world.keys, sources_root=code_root(fresh_world))
    assert result.exit_code == ExitCode.QUALIFICATION_FAILED
    assert result.contracts[0].run_dir == newest.path


def test_newest_run_incomplete_is_an_integrity_error(world: World) -> None:
    new = world.root / "evidence" / CONTRACT / "run-4-interrupted"
    store.claim_dir(new, kind="candidate-run")
    store.atomic_write_json(new / "run.json", {
        "contract": CONTRACT, "run_id": "run-4", "started": store.utc_now_iso(), "cells": {}})
    result = gate(world.root / "evidence", [world.contract], allow_not_run=[ALLOW_CUDA],
                  trusted_keys_dir=world.keys)
    assert result.exit_code == ExitCode.INTEGRITY_ERROR
    assert "incomplete" in result.contracts[0].message


def test_several_contracts_combine_by_worst_code(fresh: World) -> None:
    world = fresh
    other = world.contracts / "other.toml"
    other.write_text(world.contract.read_text().replace(f'name = "{CONTRACT}"',
                                                        'name = "other"'))
    code, text = gate_cli(world, world.good, "--allow-not-run", ALLOW_CUDA,
                          contracts=(world.contract, other))
    assert code == ExitCode.QUALIFICATION_FAILED
    assert "no candidate run of other" in text
    (world.good / "notes.txt").write_text("x")
    code, _ = gate_cli(world, world.good, "--allow-not-run", ALLOW_CUDA,
                       contracts=(world.contract, other))
    assert code == ExitCode.INTEGRITY_ERROR


@pytest.mark.parametrize("mutation", MUTATIONS, ids=MUTATION_IDS)
def test_tamper_is_caught_by_gate(signed_world: World, mutation: Mutation,
                                  tmp_path: Path,
                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    w, target = tampered(signed_world, mutation, tmp_path_factory)
    out = tmp_path / "gate.json"
    code, text = gate_cli(w, target, "--allow-not-run", ALLOW_CUDA, "--json", str(out))
    assert code == ExitCode.INTEGRITY_ERROR, text
    assert f"fails verification at step {mutation.step} " in text
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, load_schema("gate"))
    assert doc["result"] == "INTEGRITY_ERROR"
    steps = doc["contracts"][0]["verification"]["steps"]
    assert next(s["step"] for s in steps if s["status"] == "failed") == mutation.step


def test_gate_usage_errors(signed_world: World, tmp_path: Path) -> None:
    code, _ = run_cli(["gate", str(signed_world.good)])  # no --contract
    assert code == ExitCode.USAGE_ERROR
    code, _ = gate_cli(signed_world, tmp_path / "nowhere")
    assert code == ExitCode.USAGE_ERROR
    code, _ = gate_cli(signed_world, signed_world.good,
                       contracts=(tmp_path / "missing.toml",))
    assert code == ExitCode.USAGE_ERROR


def _stray_dev_zero(w: World, name: str = "stray") -> Path:
    """An unsigned stray directory beside the good runs: run.json -> /dev/zero."""
    stray = w.root / "evidence" / CONTRACT / name
    stray.mkdir()
    (stray / "run.json").symlink_to("/dev/zero")
    return stray


def test_stray_dev_zero_directory_fails_the_gate_without_crashing(world: World,
                                                                  tmp_path: Path) -> None:
    stray = _stray_dev_zero(world)
    out = tmp_path / "gate.json"
    code, text = gate_cli(world, world.root / "evidence", "--allow-not-run", ALLOW_CUDA,
                          "--json", str(out))
    assert code == ExitCode.INTEGRITY_ERROR, text
    assert f"{stray}: unreadable evidence directory" in text
    assert "symbolic link" in text
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, load_schema("gate"))
    assert doc["result"] == "INTEGRITY_ERROR"


def test_stray_manifest_only_directory_fails_the_gate(world: World) -> None:
    stray = world.root / "evidence" / CONTRACT / "stray-manifest"
    stray.mkdir()
    (stray / "MANIFEST.json").symlink_to("/dev/zero")
    result = gate(world.root / "evidence", [world.contract], allow_not_run=[ALLOW_CUDA],
                  trusted_keys_dir=world.keys)
    assert result.exit_code == ExitCode.INTEGRITY_ERROR
    assert str(stray) in result.contracts[0].message


def test_stray_directory_as_the_gate_in_a_subprocess(world: World) -> None:
    """The CLI process itself: exit 3 and one line, never a MemoryError (exit 4)."""
    _stray_dev_zero(world)
    proc = subprocess.run(
        [sys.executable, "-m", "qualify", "gate", str(world.root / "evidence"), "--keys",
         str(world.keys), "--contract", str(world.contract), "--allow-not-run", ALLOW_CUDA],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == ExitCode.INTEGRITY_ERROR, proc.stderr
    assert "unreadable evidence directory" in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("marker", [b"", b'{"kind": "candidate-run"}', b"not json"],
                         ids=["empty", "json", "text"])
def test_run_with_incomplete_marker_is_incomplete_never_no_run(world: World,
                                                               marker: bytes) -> None:
    """A hand-made run directory holding only the INCOMPLETE marker (the candidate stage
    writes it first and removes it when sealing)."""
    lone = world.root / "only" / CONTRACT / "20990101T000000Z"
    lone.mkdir(parents=True)
    (lone / store.INCOMPLETE_FILE).write_bytes(marker)
    result = gate(world.root / "only", [world.contract], allow_not_run=[ALLOW_CUDA],
                  trusted_keys_dir=world.keys)
    assert result.exit_code == ExitCode.INTEGRITY_ERROR
    msg = result.contracts[0].message
    assert "incomplete" in msg
    assert "no candidate run" not in msg
    # beside the good runs, older or newer, it still fails the gate
    beside = world.root / "evidence" / CONTRACT / "run-0-writing"
    beside.mkdir()
    (beside / store.INCOMPLETE_FILE).write_bytes(marker)
    (beside / "run.json").write_text(json.dumps({"contract": CONTRACT, "run_id": "run-0",
                                                 "started": "2000-01-01T00:00:00Z"}))
    result = gate(world.root / "evidence", [world.contract], allow_not_run=[ALLOW_CUDA],
                  trusted_keys_dir=world.keys)
    assert result.exit_code == ExitCode.INTEGRITY_ERROR
    assert f"{beside}: incomplete: INCOMPLETE marker" in result.contracts[0].message


def test_run_of_another_contract_with_marker_does_not_block(fresh: World) -> None:
    world = fresh
    other = world.root / "evidence" / "other" / "run-1"
    other.mkdir(parents=True)
    (other / store.INCOMPLETE_FILE).write_text("")
    (other / "run.json").write_text(json.dumps({"contract": "other", "run_id": "run-1"}))
    code, text = gate_cli(world, world.root / "evidence", "--allow-not-run", ALLOW_CUDA)
    assert code == ExitCode.QUALIFICATION_FAILED, text  # run-3-fail, as before
