"""Interrupted runs superseded, never deleted: the marker, its trust, the rerun's plan.

On the signed evidence world of test_verify (fresh copies: sources recorded for this
code). A superseded run is kept whole and accepted by gate and audit only when the run it
names confirms it in its own sealed ``run.json``; every way of using a marker to hide a
run (pointing at nothing, at a run that does not confirm it, an edited marker, a marker in
a sealed run or in one whose manifest was removed) leaves the gate at exit 3. The plan of
a plain ``qualify run`` (:mod:`qualify.pipeline.recovery`) is checked over a dataset of
interrupted runs: what it resumes, what it supersedes and why, what it leaves alone.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fresh_world import code_root, fresh, fresh_world
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gate import ALLOW_CUDA
from test_verify import CONTRACT, World, run_cli, signed_world, world

from qualify.cli import main as cli
from qualify.compare.stage import compare_run
from qualify.contract import load_contract
from qualify.errors import EvidenceIntegrityError, ExitCode, UsageError, WriterBusyError
from qualify.evidence import sign as signing
from qualify.evidence import store, supersede
from qualify.evidence.audit import audit
from qualify.evidence.gate import gate
from qualify.evidence.statement import RUN_KIND
from qualify.layout import (
    ATTESTATION_FILE,
    MANIFEST_FILE,
    RUN_FILE,
    SUPERSEDED_FILE,
    RunDocument,
    RunReference,
)
from qualify.pipeline import recovery

__all__ = ["fresh", "fresh_world", "signed_world", "world"]  # shared fixtures

NEW = "run-5-new"


def _runs(w: World) -> Path:
    return w.root / "evidence" / CONTRACT


def _doc(w: World, run_id: str, **kw: Any) -> dict[str, Any]:
    contract = load_contract(w.contract)
    doc = RunDocument(contract=contract.name, contract_digest=contract.digest,
                      reference=RunReference(path=str(w.reference),
                                             manifest_digest=store.manifest_digest(w.reference)),
                      run_id=run_id, started=store.utc_now_iso(), selection=None,
                      selection_recorded=True).to_dict()
    doc.update(kw)
    return doc


def interrupted(w: World, run_id: str, **kw: Any) -> Path:
    """An unsealed run as a killed candidate stage leaves it (marker, run.json, a file)."""
    d = store.claim_dir(_runs(w) / run_id, kind=RUN_KIND)
    store.atomic_write_json(d / RUN_FILE, _doc(w, run_id, **kw))
    store.atomic_write_text(d / "launches" / "x" / "attempt-1" / "cell.json", "{}\n")
    return d


def superseding(w: World, run_id: str, entries: list[dict[str, str]]) -> Path:
    """A sealed, signed run (run-2-good's cells) whose ``run.json`` records ``entries``."""
    d = _runs(w) / run_id
    shutil.copytree(w.good, d, symlinks=True)
    store.make_writable(d)
    (d / MANIFEST_FILE).unlink()
    (d / ATTESTATION_FILE).unlink()
    doc = json.loads((d / RUN_FILE).read_text())
    doc.update(run_id=run_id, started=store.utc_now_iso(), supersedes=entries)
    store.atomic_write_json(d / RUN_FILE, doc)
    compare_run(d, reference_dir=w.reference, write=True)
    signing.seal_and_sign(d, kind=RUN_KIND, key=w.key)
    return d


def _gate(w: World) -> tuple[ExitCode, str]:
    result = gate(w.root / "evidence", [w.contract], allow_not_run=[ALLOW_CUDA],
                  trusted_keys_dir=w.keys, sources_root=code_root(w))
    return result.exit_code, result.contracts[0].message


def test_superseded_run_is_kept_and_gate_and_audit_accept_it(fresh: World) -> None:
    old = interrupted(fresh, "run-4-killed")
    code, msg = _gate(fresh)
    assert code == ExitCode.INTEGRITY_ERROR, msg  # the interrupted run blocks
    before = supersede.listing_digest(old)
    files = sorted(p.relative_to(old) for p in old.rglob("*"))
    entry = supersede.supersede(old, by=NEW, reason="made against another sealed reference")
    assert supersede.listing_digest(old) == before  # nothing of the run was touched
    assert sorted(p.relative_to(old) for p in old.rglob("*")) == \
        sorted([*files, Path(SUPERSEDED_FILE)])
    code, msg = _gate(fresh)
    assert code == ExitCode.INTEGRITY_ERROR, msg  # no run confirms the marker yet
    assert "not confirmed" in msg
    new = superseding(fresh, NEW, [entry])
    code, msg = _gate(fresh)
    assert code == ExitCode.OK, msg
    assert f"run {new}" in msg  # the newest complete run is the one judged
    rows = {r.run_id: r for r in audit(fresh.root / "evidence", trusted_keys_dir=fresh.keys,
                                       contracts_dir=fresh.contracts,
                                       source_root=code_root(fresh)).rows}
    assert rows["run-4-killed"].integrity == "SUPERSEDED"
    assert rows["run-4-killed"].verdict == f"superseded by {NEW}"
    assert rows["run-4-killed"].problems == ()
    assert rows[NEW].integrity == "ok"
    assert rows[NEW].problems == ()
    rc, out = run_cli(["verify", str(old), "--keys", str(fresh.keys)])
    assert rc == ExitCode.INTEGRITY_ERROR  # never evidence itself; it names its successor
    assert f"superseded by run {NEW}: verify that run" in out
    # its files are kept as they were: an edit after the fact is an audit problem
    (old / "launches" / "x" / "attempt-1" / "cell.json").write_text('{"edited": 1}\n')
    rows = {r.run_id: r for r in audit(fresh.root / "evidence", trusted_keys_dir=fresh.keys,
                                       contracts_dir=fresh.contracts,
                                       source_root=code_root(fresh)).rows}
    assert any("files changed since it was superseded" in p
               for p in rows["run-4-killed"].problems)


def _names_nothing(w: World, old: Path) -> None:
    supersede.supersede(old, by="run-9-absent", reason="r")


def _names_a_run_that_does_not_confirm(w: World, old: Path) -> None:
    supersede.supersede(old, by=w.good.name, reason="r")


def _marker_edited_after(w: World, old: Path) -> None:
    superseding(w, NEW, [supersede.supersede(old, by=NEW, reason="r")])
    doc = json.loads((old / SUPERSEDED_FILE).read_text())
    doc["reason"] = "edited"
    (old / SUPERSEDED_FILE).write_text(json.dumps(doc))


def _confirmed_by_an_unsealed_run(w: World, old: Path) -> None:
    entry = supersede.supersede(old, by="run-6-also-killed", reason="r")
    interrupted(w, "run-6-also-killed", supersedes=[entry])


def _manifest_removed_from_the_failing_run(w: World, old: Path) -> None:
    store.make_writable(w.failing)
    (w.failing / MANIFEST_FILE).unlink()
    (w.failing / ATTESTATION_FILE).unlink()
    (w.failing / SUPERSEDED_FILE).write_text(json.dumps(
        {"superseded_by": w.good.name, "reason": "hide it", "created": "x",
         "listing_sha256": "0" * 64}))


def _marker_in_the_sealed_failing_run(w: World, old: Path) -> None:
    store.make_writable(w.failing)
    (w.failing / SUPERSEDED_FILE).write_text(json.dumps(
        {"superseded_by": w.good.name, "reason": "hide it", "created": "x",
         "listing_sha256": "0" * 64}))


HIDING: dict[str, Callable[[World, Path], None]] = {
    "names-nothing": _names_nothing,
    "not-confirmed": _names_a_run_that_does_not_confirm,
    "marker-edited": _marker_edited_after,
    "confirmer-unsealed": _confirmed_by_an_unsealed_run,
    "manifest-removed": _manifest_removed_from_the_failing_run,
    "in-sealed-run": _marker_in_the_sealed_failing_run,
}


@pytest.mark.parametrize("how", list(HIDING))
def test_a_marker_never_hides_a_run(fresh: World, how: str) -> None:
    """Every hostile marker leaves the gate at exit 3 (and the audit with a problem)."""
    old = interrupted(fresh, "run-4-killed")
    HIDING[how](fresh, old)
    code, msg = _gate(fresh)
    assert code == ExitCode.INTEGRITY_ERROR, msg
    result = audit(fresh.root / "evidence", trusted_keys_dir=fresh.keys,
                   contracts_dir=fresh.contracts, source_root=code_root(fresh))
    assert result.exit_code == ExitCode.INTEGRITY_ERROR


def test_only_an_unsealed_run_without_a_live_writer_is_superseded(world: World) -> None:
    with pytest.raises(EvidenceIntegrityError, match="only an unsealed"):
        supersede.supersede(world.failing, by=NEW, reason="r")
    old = interrupted(world, "run-4-killed")
    with pytest.raises(EvidenceIntegrityError, match="itself"):
        supersede.supersede(old, by=old.name, reason="r")
    with store.hold_writer_lock(old, kind=RUN_KIND), pytest.raises(WriterBusyError):
        supersede.supersede(old, by=NEW, reason="r")
    assert not (old / SUPERSEDED_FILE).exists()
    pending = supersede.prepare(old, by=NEW, reason="r")
    (old / "launches" / "x" / "late.log").write_text("a writer came back\n")
    assert not supersede.write(pending)  # the run changed since: not superseded
    assert not (old / SUPERSEDED_FILE).exists()


def test_a_superseded_run_is_never_written_again(world: World) -> None:
    old = interrupted(world, "run-4-killed")
    supersede.supersede(old, by=NEW, reason="another reference")
    with pytest.raises(UsageError, match=f"superseded by run {NEW}"):
        supersede.refuse(old)
    code, _out = run_cli(["compare", str(old)])
    assert code == ExitCode.USAGE_ERROR
    assert not (old / MANIFEST_FILE).exists()


# --------------------------------------------------------------------------- the plan

OTHER = "f" * 64


def _plan(w: World, cells: list[str] | None = None, run_id: str | None = None
          ) -> recovery.Plan:
    return recovery.plan(load_contract(w.contract), reference=w.reference,
                         evidence=w.root / "evidence", cells=cells, run_id=run_id,
                         new_id=NEW)


PLAN_CASES: dict[str, tuple[dict[str, Any], str | None]] = {
    # name: (run.json fields of the interrupted run, why it is superseded; None: resumed)
    "same": ({}, None),
    "contract": ({"contract_digest": OTHER}, "made for contract digest ffffffffffff"),
    "reference": ({"reference": {"path": "x", "manifest_digest": OTHER, "sealed": None}},
                  "another sealed reference"),
    "cells": ({"selection": ["torch_tp-*"]}, "another --cells selection"),
    "unrecorded": ({"selection": "drop"}, "selection was not recorded"),
    "faults": ({"faults": ["nan"]}, "test faults"),
    "no-run-json": ({"run.json": "drop"}, "no run.json"),
    "unreadable": ({"cells": []}, "run.json unreadable"),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_plain_rerun_resumes_or_supersedes(world: World, case: str) -> None:
    fields, why = PLAN_CASES[case]
    old = interrupted(world, "run-4-killed")
    doc = json.loads((old / RUN_FILE).read_text())
    for key, value in fields.items():
        if value == "drop":
            doc.pop(key, None)
        else:
            doc[key] = value
    if "run.json" in fields:
        (old / RUN_FILE).unlink()
    else:
        (old / RUN_FILE).write_text(json.dumps(doc))
    p = _plan(world)
    if why is None:
        assert (p.run_id, p.resume, p.supersede) == ("run-4-killed", True, ())
        assert p.notes[0].startswith("resuming interrupted run run-4-killed (started ")
    else:
        assert (p.run_id, p.resume) == (NEW, False)
        ((d, reason),) = p.supersede
        assert d == old
        assert why in reason


def test_plan_resumes_the_newest_and_supersedes_the_rest(world: World) -> None:
    first = interrupted(world, "run-4-a", started="2026-01-01T00:00:00Z")
    interrupted(world, "run-4-b", started="2026-01-02T00:00:00Z")
    p = _plan(world)
    assert (p.run_id, p.resume) == ("run-4-b", True)
    assert [d for d, _ in p.supersede] == [first]
    pending = recovery.apply(p, _runs(world))
    assert [x.entry["run_id"] for x in pending] == ["run-4-a"]
    assert supersede.read_marker(first) is None  # written once run-4-b records it
    # a marker written but never recorded (an older version's order, or a hand): the next
    # plan supersedes that run again; --run-id names the run the others are superseded by
    assert supersede.write(pending[0])
    named = _plan(world, run_id="ci-1")
    assert (named.run_id, named.resume) == ("ci-1", False)
    assert [d.name for d, _ in named.supersede] == ["run-4-a", "run-4-b"]
    assert "never confirmed" in named.supersede[0][1]


def test_plan_leaves_a_live_writers_run_alone(world: World) -> None:
    old = interrupted(world, "run-4-live")
    with store.hold_writer_lock(old, kind=RUN_KIND):
        p = _plan(world)
    assert (p.run_id, p.resume, p.supersede) == (NEW, False, ())
    assert any("left alone" in n for n in p.notes)


_STAMP = st.datetimes(min_value=datetime.datetime(2000, 1, 1)).map(
    lambda t: t.strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
_HEX64 = st.text("0123456789abcdef", min_size=64, max_size=64)
_RUN_ID = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,20}\Z")


@settings(max_examples=25, deadline=None)
@given(selection=st.none() | st.lists(st.text(min_size=1, max_size=8), max_size=3),
       resumed=st.lists(_STAMP, max_size=3),
       supersedes=st.lists(st.fixed_dictionaries({"run_id": _RUN_ID,
                                                  "reason": st.text(max_size=20),
                                                  "marker_sha256": _HEX64}),
                           max_size=3))
def test_run_document_keeps_the_recovery_fields(selection: list[str] | None,
                                                resumed: list[str],
                                                supersedes: list[dict[str, str]]) -> None:
    doc = RunDocument(contract="c", contract_digest="d" * 64,
                      reference=RunReference(path="p", manifest_digest="e" * 64), run_id="r",
                      started="2026-12-05T00:00:00Z", selection=selection,
                      selection_recorded=True,
                      resumed=resumed, supersedes=supersedes)
    again = RunDocument.from_dict(json.loads(json.dumps(doc.to_dict())))
    assert again == doc
    old = doc.to_dict()
    del old["selection"]  # a run made before the field: not recorded, never resumed plainly
    assert not RunDocument.from_dict(old).selection_recorded


# --------------------------------------------------------------------------- unwritable


@pytest.mark.parametrize("err", sorted(cli.UNWRITABLE_ERRNOS))
def test_an_unwritable_place_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str],
                                                    err: int) -> None:
    def fail(args: object) -> ExitCode:
        raise OSError(err, os.strerror(err), "/evidence/x/run.json")

    monkeypatch.setattr(cli, "_cmd_validate", fail)
    assert cli.main(["validate"]) == ExitCode.USAGE_ERROR
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("qualify: error: /evidence/x/run.json: ")
    assert errno.errorcode[err] in lines[0]


def test_another_os_error_stays_an_internal_error(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    def fail(args: object) -> ExitCode:
        raise OSError(errno.EIO, "I/O error", "/x")

    monkeypatch.setattr(cli, "_cmd_validate", fail)
    assert cli.main(["validate"]) == ExitCode.INTERNAL_ERROR
    assert "Traceback" in capsys.readouterr().err


def test_read_only_evidence_directory_is_one_line_exit_2(world: World, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         ) -> None:
    """A real read-only file system under ``--out`` (a tmpfs mounted ``ro``; root only)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                             capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        code = cli.main(["candidate", str(world.contract), "--reference", str(world.reference),
                         "--out", str(ro)])
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.USAGE_ERROR, lines
    assert len(lines) == 1, lines
    assert "EROFS" in lines[0] or "Read-only file system" in lines[0]
    assert str(ro) in lines[0]
