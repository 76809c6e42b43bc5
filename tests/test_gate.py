"""Tests of qualify.evidence.gate (``qualify gate``) on the signed evidence world of test_verify."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
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

__all__ = ["signed_world", "world"]  # fixtures shared with test_verify

ALLOW_CUDA = f"{CUDA_ONLY}-*"


def gate_cli(w: World, evidence: Path, *extra: str, contracts: tuple[Path, ...] = ()
             ) -> tuple[int, str]:
    argv = ["gate", str(evidence), "--keys", str(w.keys)]
    for c in contracts or (w.contract,):
        argv += ["--contract", str(c)]
    return run_cli([*argv, *extra])


def test_good_run_with_cuda_cells_allowed_passes(signed_world: World, tmp_path: Path) -> None:
    out = tmp_path / "gate.json"
    code, text = gate_cli(signed_world, signed_world.good, "--allow-not-run", ALLOW_CUDA,
                          "--json", str(out))
    assert code == ExitCode.OK, text
    assert text.startswith("qualify gate: PASS (exit 0)")
    assert f"NOT_RUN  {CUDA_ONLY}-fp32-zero0-actor-tp1: allowed by --allow-not-run" in text
    assert "4 PASS, 4 NOT_RUN allowed by policy" in text
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, load_schema("gate"))
    (c,) = doc["contracts"]
    assert doc["result"] == "PASS"
    assert c["failed_cells"] == []
    assert sorted(c["allowed_not_run"]) == sorted(
        x["cell"] for x in c["cells"] if x["cell"].startswith(CUDA_ONLY))
    assert c["verification"]["passed"] is True
    assert doc["policy"]["allow_not_run"] == [ALLOW_CUDA]


def test_cuda_cells_not_run_without_policy_fail(signed_world: World) -> None:
    result = gate(signed_world.good, [signed_world.contract],
                  trusted_keys_dir=signed_world.keys)
    assert result.exit_code == ExitCode.QUALIFICATION_FAILED
    (c,) = result.contracts
    assert set(c.failed_cells) == {x.cell for x in c.cells if x.cell.startswith(CUDA_ONLY)}
    assert len(c.failed_cells) == 4
    assert all(x.verdict == "NOT_RUN" for x in c.cells if not x.ok)
    code, text = gate_cli(signed_world, signed_world.good)
    assert code == ExitCode.QUALIFICATION_FAILED
    assert f"NOT_RUN  {CUDA_ONLY}-fp32-zero0-critic-tp2: CUDA is not available" in text


def test_failing_cell_exits_1_and_is_named(signed_world: World, tmp_path: Path) -> None:
    out = tmp_path / "gate.json"
    code, text = gate_cli(signed_world, signed_world.failing, "--allow-not-run", ALLOW_CUDA,
                          "--json", str(out))
    assert code == ExitCode.QUALIFICATION_FAILED
    assert f"FAIL     {FAIL_CELL}: round1/actor/logprobs" in text
    assert f"1 not passed: {FAIL_CELL}" in text
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, load_schema("gate"))
    assert doc["result"] == "FAIL"
    assert doc["contracts"][0]["failed_cells"] == [FAIL_CELL]


def test_allow_not_run_never_excuses_a_failure(signed_world: World) -> None:
    result = gate(signed_world.failing, [signed_world.contract],
                  allow_not_run=["torch_tp-*", ALLOW_CUDA], trusted_keys_dir=signed_world.keys)
    assert result.exit_code == ExitCode.QUALIFICATION_FAILED
    assert result.contracts[0].failed_cells == (FAIL_CELL,)


def test_evidence_root_gates_the_newest_run(signed_world: World) -> None:
    root = signed_world.root / "evidence"
    newest = latest_run(root, CONTRACT)
    assert newest is not None
    assert newest.path.name == "run-3-fail"
    result = gate(root, [signed_world.contract], allow_not_run=[ALLOW_CUDA],
                  trusted_keys_dir=signed_world.keys)
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


def test_several_contracts_combine_by_worst_code(world: World) -> None:
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
