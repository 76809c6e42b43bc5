"""Tests of qualify.evidence.audit (``qualify audit``) on test_verify's signed evidence world."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from test_verify import (
    CONTRACT,
    MUTATION_IDS,
    MUTATIONS,
    TENSOR_CELL,
    Mutation,
    World,
    flip_byte,
    run_cli,
    signed_world,
    tampered,
    world,
)

from qualify.errors import ExitCode
from qualify.evidence import sign as signing
from qualify.evidence import store
from qualify.evidence.audit import COLUMNS, audit, render

__all__ = ["signed_world", "world"]  # fixtures shared with test_verify


def audit_cli(w: World, *dirs: Path, fmt: str = "table") -> tuple[int, str]:
    return run_cli(["audit", *map(str, dirs), "--keys", str(w.keys), "--contracts-dir",
                    str(w.contracts), "--format", fmt])


def test_untouched_world_has_no_problem(signed_world: World) -> None:
    result = audit(signed_world.root, trusted_keys_dir=signed_world.keys,
                   contracts_dir=signed_world.contracts)
    assert result.exit_code == ExitCode.OK
    assert bool(result)
    rows = {Path(r.path).name: r for r in result.rows}
    assert set(rows) == {signed_world.reference.name, "run-1-old", "run-2-good", "run-3-fail"}
    assert rows["run-3-fail"].verdict == "FAIL"  # a failed run is listed, not a problem
    assert rows["run-3-fail"].counts["FAIL"] == 1
    # every matrix cell is required (no required_cells): the 4 deepspeed cells NOT_RUN keep
    # the good run's report from passing, though all 4 cells that ran pass
    assert rows["run-2-good"].verdict == "FAIL"
    assert dict(rows["run-2-good"].counts) == {"PASS": 4, "FAIL": 0, "ERROR": 0, "NOT_RUN": 4}
    assert rows["run-2-good"].problems == ()  # a report that does not pass is no problem
    assert rows["run-1-old"].attempts == "5 (1 failed)"  # the crashed attempt stays listed
    for r in result.rows:
        assert r.signature == f"valid {signed_world.key.keyid[:16]}"
        assert r.integrity == "ok"
        assert r.contract_digest == "current"
        assert r.contract == CONTRACT
        assert r.source_commit in ("", r.source_commit)  # git may be absent
    assert rows[signed_world.reference.name].kind == "reference"


def test_good_failed_and_tampered_runs(world: World, tmp_path: Path) -> None:
    """The audit of a directory holding a good run, a failed run and a tampered run."""
    flip_byte(world.old / "cells" / TENSOR_CELL / "attempt-2" / "outputs.safetensors")
    code, table = audit_cli(world, world.root)
    assert code == ExitCode.INTEGRITY_ERROR
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["path", "kind", "contract", "run_id"]
    (old,) = [ln for ln in lines if "run-1-old" in ln]
    (good,) = [ln for ln in lines if "run-2-good" in ln]
    (fail,) = [ln for ln in lines if "run-3-fail" in ln]
    assert "FAILED step 4" in old
    assert "outputs.safetensors: modified" in old
    # integrity, verdict (the gate's decision: no policy file here, so the comparator's),
    # the comparator's verdict, then the PASS / FAIL / ERROR / NOT_RUN counts: the good run
    # does not pass (its deepspeed cells, required by the matrix, did not run), none failed
    assert re.search(r" ok +FAIL +FAIL +4 +0 +0 +4 ", good), good
    assert re.search(r" ok +FAIL +FAIL +3 +1 +0 +4 ", fail), fail
    assert lines[-1] == "4 directories audited, 1 problem(s)"
    (tmp_path / "audit-table.txt").write_text(table)
    code, md = audit_cli(world, world.root, fmt="md")
    assert code == ExitCode.INTEGRITY_ERROR
    assert md.startswith("| path")
    assert "FAILED step 4" in md
    code, text = audit_cli(world, world.root, fmt="json")
    doc = json.loads(text)
    assert doc["exit_code"] == 3
    assert set(doc["rows"][0]) == set(COLUMNS)
    bad = [r for r in doc["rows"] if r["problems"]]
    assert [Path(r["path"]).name for r in bad] == ["run-1-old"]
    assert bad[0]["problems"][0].startswith("step 4 (subject digests")


def test_incomplete_directories_are_listed_and_are_problems(world: World) -> None:
    aside = world.root / "evidence" / CONTRACT / "run-5.incomplete-20250102T000000.000000Z"
    aside.mkdir()
    (aside / "run.json").write_text(json.dumps({"contract": CONTRACT, "run_id": "run-5",
                                                "started": "2025-01-02T00:00:00Z"}))
    store.claim_dir(world.root / "evidence" / CONTRACT / "run-6", kind="candidate-run")
    unsealed = world.root / "evidence" / CONTRACT / "run-7"
    unsealed.mkdir()
    (unsealed / "run.json").write_text(json.dumps({"contract": CONTRACT, "run_id": "run-7"}))
    result = audit(world.root, trusted_keys_dir=world.keys, contracts_dir=world.contracts)
    assert result.exit_code == ExitCode.INTEGRITY_ERROR
    rows = {Path(r.path).name: r for r in result.rows}
    assert rows[aside.name].integrity == "INCOMPLETE"
    assert "moved aside" in rows[aside.name].problems[0]
    assert rows["run-6"].integrity == "INCOMPLETE"
    assert "INCOMPLETE marker" in rows["run-6"].problems[0]
    assert "never sealed" in rows["run-7"].problems[0]
    assert rows["run-2-good"].problems == ()
    assert len(result.problems) == 3


def test_stale_contract_and_unsigned_reference(world: World) -> None:
    world.contract.write_text(world.contract.read_text().replace("k = 4.0", "k = 5.0"))
    store.make_writable(world.reference)
    (world.reference / signing.ATTESTATION_FILE).unlink()
    result = audit(world.root, trusted_keys_dir=world.keys, contracts_dir=world.contracts)
    rows = {Path(r.path).name: r for r in result.rows}
    ref = rows[world.reference.name]
    assert ref.signature == "unsigned"
    assert ref.integrity == "manifest ok"
    assert ref.contract_digest == "STALE"
    assert any(p.startswith("stale:") for p in ref.problems)
    assert any(p.startswith("step 1") for p in ref.problems)
    for name in ("run-1-old", "run-2-good", "run-3-fail"):
        assert rows[name].contract_digest == "STALE"
        assert any(p.startswith("step 6") for p in rows[name].problems)
    assert "STALE" in render(result, "table")


@pytest.mark.parametrize("mutation", MUTATIONS, ids=MUTATION_IDS)
def test_tamper_is_caught_by_audit(signed_world: World, mutation: Mutation,
                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    w, target = tampered(signed_world, mutation, tmp_path_factory)
    result = audit(target, trusted_keys_dir=w.keys, contracts_dir=w.contracts)
    assert result.exit_code == ExitCode.INTEGRITY_ERROR
    (row,) = result.rows
    assert row.problems
    assert row.problems[0].startswith(f"step {mutation.step} "), row.problems
    code, _ = audit_cli(w, target, fmt="json")
    assert code == ExitCode.INTEGRITY_ERROR


def test_audit_usage_error(tmp_path: Path, signed_world: World) -> None:
    code, _ = audit_cli(signed_world, tmp_path / "missing")
    assert code == ExitCode.USAGE_ERROR
    empty = tmp_path / "empty"
    empty.mkdir()
    code, text = audit_cli(signed_world, empty)
    assert code == ExitCode.USAGE_ERROR  # nothing to audit is no clean audit
    assert text.strip().splitlines() == [
        f"qualify audit: nothing to audit: no reference or candidate-run directory under "
        f"{empty}"]
    (empty / "notes").mkdir()
    (empty / "notes" / "README.md").write_text("no evidence here\n")
    result = audit(empty, trusted_keys_dir=signed_world.keys)
    assert result.empty
    assert not result
    assert result.exit_code == ExitCode.USAGE_ERROR
    code, text = audit_cli(signed_world, empty, fmt="json")
    assert code == ExitCode.USAGE_ERROR
    assert json.loads(text)["rows"] == []


def test_stray_dev_zero_directory_is_a_problem_not_a_crash(world: World) -> None:
    stray = world.root / "evidence" / CONTRACT / "stray"
    stray.mkdir()
    (stray / "run.json").symlink_to("/dev/zero")
    manifest_only = world.root / "evidence" / "manifest-only"
    manifest_only.mkdir()
    (manifest_only / store.MANIFEST_FILE).symlink_to("/dev/zero")
    fifo = world.root / "evidence" / CONTRACT / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "run.json")
    code, table = audit_cli(world, world.root)
    assert code == ExitCode.INTEGRITY_ERROR
    result = audit(world.root, trusted_keys_dir=world.keys, contracts_dir=world.contracts)
    rows = {Path(r.path).name: r for r in result.rows}
    assert rows["stray"].integrity == "INCOMPLETE"
    assert any("run.json: a symbolic link" in p for p in rows["stray"].problems)
    assert any("MANIFEST.json: a symbolic link" in p for p in rows["manifest-only"].problems)
    assert any("not a regular file" in p for p in rows["fifo"].problems)
    assert rows["run-2-good"].problems == ()  # the good runs beside are still audited
    assert "stray" in table


def test_hand_made_run_with_incomplete_marker_is_incomplete(world: World) -> None:
    run = world.root / "evidence" / CONTRACT / "20990101T000000Z"
    run.mkdir()
    (run / store.INCOMPLETE_FILE).write_text("")  # the first write of the candidate stage
    result = audit(world.root, trusted_keys_dir=world.keys, contracts_dir=world.contracts)
    assert result.exit_code == ExitCode.INTEGRITY_ERROR
    (row,) = [r for r in result.rows if Path(r.path).name == run.name]
    assert row.integrity == "INCOMPLETE"
    assert row.problems[0].startswith("incomplete: INCOMPLETE marker")
    code, text = audit_cli(world, run)
    assert code == ExitCode.INTEGRITY_ERROR
    assert "INCOMPLETE" in text
