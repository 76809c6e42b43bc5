"""Provenance follows what a cell consumed (issue #43 item 2; qualify.evidence.imports).

A launch's harness processes record the files they imported (a root-level
``sitecustomize.py`` that the launch path imports included); the launcher hashes them into
the attempt's ``imports.json``; :func:`qualify.evidence.sources.stale_cells` takes that record
as the authority and passes a consumed cell's staleness on (a sampler cell that installed a
trainer cell's weights, a resume cell). One real (fake-harness, torch-free) launch, then the
staleness rules on run directories whose records are written here by hand, so that every
rule is checked against the JSON on disk rather than against the collector.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from fresh_world import code_snapshot
from hypothesis import given, settings
from hypothesis import strategies as st
from test_launch import _cell, write_fake

from qualify.contract import load_contract
from qualify.errors import EvidenceIntegrityError, UsageError
from qualify.evidence.sources import check_resume_sources, stale_cells, write_sources
from qualify.resources import contracts_dir

TINY = contracts_dir() / "tiny-qwen3.toml"
TRAINER = "torch_tp-fp32-actor-tp2"
CRITIC = "torch_tp-fp32-critic-tp1"
OTHER = "deepspeed-fp32-zero0-actor-tp1"
SAMPLER = "vllm-fp32-sampler-tp1"
RESUME = "torch_tp-fp32-actor-tp2-resume"
SITE = "sitecustomize.py"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record(root: Path, files: Sequence[str], *, label: str = "l/attempt-1",
           expected: int = 1, ranks: Sequence[int] = (0,),
           modified: Sequence[str] = (), top_level: Sequence[str] | None = None
           ) -> dict[str, Any]:
    """An ``imports.json`` document of one launch over ``files`` (relative to ``root``)."""
    rec: dict[str, Any] = {
        "launch": label, "processes_expected": expected, "ranks_recorded": list(ranks),
        "processes_recorded": len(ranks), "checkout": {f: _sha(root / f) for f in files},
        "distributions": {}, "modified_during_launch": list(modified)}
    if top_level is not None:
        rec["top_level"] = list(top_level)
    return {"schema_version": 1, "launches": [rec]}


@pytest.fixture(scope="module")
def code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A frozen copy of the checkout's code with a ``sitecustomize.py`` at its root."""
    root = code_snapshot(tmp_path_factory.mktemp("code"))
    (root / SITE).write_text("LAUNCH_PATH_HOOK = 1\n")
    return root


def make_run(tmp: Path, code: Path, cells: Mapping[str, Mapping[str, Any]],
             records: Mapping[str, dict[str, Any] | None]) -> Path:
    """A run directory: ``run.json`` of ``cells``, ``sources.json`` of ``code`` and each
    cell's ``cells/<id>/attempt-1/imports.json`` (none where ``records`` maps to None)."""
    run = tmp / "run"
    run.mkdir(parents=True)
    entries = {}
    for cid, extra in cells.items():
        attempt = f"cells/{cid}/attempt-1"
        (run / attempt).mkdir(parents=True)
        rec = records.get(cid)
        if rec is not None:
            (run / attempt / "imports.json").write_text(json.dumps(rec))
        entries[cid] = {"engine": cid.split("-", 1)[0], "status": "COMPLETE",
                        "attempt": attempt, **extra}
    (run / "run.json").write_text(json.dumps({"cells": entries}))
    write_sources(run, contract=load_contract(TINY), root=code)
    return run


def tiny_world(tmp: Path, code: Path) -> Path:
    """A trainer launch (Actor TP2 + Critic TP1), a DeepSpeed cell, the vLLM sampler cell
    that installed the trainer Actor's weights, and the Actor's resume cell."""
    torch_tp = record(code, [SITE, "harnesses/__init__.py", "harnesses/common.py",
                             "harnesses/torch_tp/harness.py", "qualify/protocol.py"],
                      expected=3, ranks=(0, 1, 2))
    records = {
        TRAINER: torch_tp, CRITIC: torch_tp,
        OTHER: record(code, ["harnesses/common.py", "harnesses/deepspeed/harness.py"]),
        SAMPLER: record(code, [SITE, "harnesses/vllm/harness.py", "harnesses/vllm/weights.py"]),
        RESUME: record(code, ["harnesses/torch_tp/harness.py",
                              "harnesses/torch_tp/resume.py"]),
    }
    cells: dict[str, dict[str, Any]] = {TRAINER: {}, CRITIC: {}, OTHER: {},
                                        SAMPLER: {"weights_from": TRAINER},
                                        RESUME: {"resume_of": TRAINER}}
    return make_run(tmp, code, cells, records)


def edited(code: Path, tmp: Path, rel: str) -> Path:
    """A copy of ``code`` with ``rel`` edited (a comment appended)."""
    tree = tmp / "checkout"
    shutil.copytree(code, tree)
    (tree / rel).write_text((tree / rel).read_text() + "\n# edited\n")
    return tree


# --------------------------------------------------------------------------- staleness


def test_fresh_run_with_records_is_fresh(code: Path, tmp_path: Path) -> None:
    run = tiny_world(tmp_path, code)
    assert stale_cells(run, code) == {}
    check_resume_sources(run, code)


def test_a_launch_path_file_outside_qualify_and_harnesses_makes_its_cells_stale(
        code: Path, tmp_path: Path) -> None:
    run = tiny_world(tmp_path, code)
    stale = stale_cells(run, edited(code, tmp_path, SITE))
    assert stale == {TRAINER: [SITE], CRITIC: [SITE], SAMPLER: [SITE, f"via {TRAINER}: {SITE}"],
                     RESUME: [f"via {TRAINER}: {SITE}"]}
    assert OTHER not in stale  # its processes never imported it


def test_a_trainer_harness_edit_makes_the_sampler_that_installed_its_weights_stale(
        code: Path, tmp_path: Path) -> None:
    run = tiny_world(tmp_path, code)
    harness = "harnesses/torch_tp/harness.py"
    stale = stale_cells(run, edited(code, tmp_path, harness))
    assert stale == {TRAINER: [harness], CRITIC: [harness],
                     SAMPLER: [f"via {TRAINER}: {harness}"],
                     RESUME: [harness, f"via {TRAINER}: {harness}"]}


def test_the_record_is_the_authority_for_the_harness_files(code: Path, tmp_path: Path) -> None:
    """A file of the engine's folder that no process imported changes nothing; a removed
    imported file and a ``qualify/`` file (the stages around the harness) do."""
    run = tiny_world(tmp_path, code)
    tree = edited(code, tmp_path, "harnesses/torch_tp/faults.py")
    assert stale_cells(run, tree) == {}
    (tree / "harnesses/vllm/weights.py").unlink()
    assert stale_cells(run, tree) == {SAMPLER: ["harnesses/vllm/weights.py (removed)"]}
    (tree / "qualify/bounds.py").write_text("#\n")
    stale = stale_cells(run, tree)
    assert set(stale) == {TRAINER, CRITIC, OTHER, SAMPLER, RESUME}
    assert all("qualify/bounds.py" in v for v in stale.values())


def test_a_module_added_on_the_launch_path_after_the_run_makes_its_cells_stale(
        code: Path, tmp_path: Path) -> None:
    """The root leads every launch's PYTHONPATH: a ``sitecustomize.py`` (which ``site``
    imports in every interpreter) or a module shadowing an imported top-level name, added
    after the run, changes what would run now."""
    tree = tmp_path / "checkout"
    shutil.copytree(code, tree)
    (tree / SITE).unlink()
    names = ["harnesses", "qualify", "sitecustomize", "torch", "usercustomize"]
    run = make_run(tmp_path, tree, {TRAINER: {}, SAMPLER: {"weights_from": TRAINER}}, {
        TRAINER: record(tree, ["harnesses/__init__.py", "harnesses/torch_tp/harness.py",
                               "qualify/__init__.py"], top_level=names),
        SAMPLER: record(tree, ["harnesses/__init__.py", "harnesses/vllm/harness.py"],
                        top_level=["harnesses"])})
    assert stale_cells(run, tree) == {}
    (tree / SITE).write_text("import os\n")
    (tree / "torch").mkdir()
    (tree / "torch" / "__init__.py").write_text("")
    added = ["sitecustomize.py (added on the launch path)",
             "torch/__init__.py (added on the launch path)"]
    assert stale_cells(run, tree) == {TRAINER: added,
                                      SAMPLER: [f"via {TRAINER}: {a}" for a in added]}


def test_a_record_that_cannot_prove_what_ran_is_stale(code: Path, tmp_path: Path) -> None:
    """A rank that recorded nothing, and a file modified while the launch ran."""
    cells: dict[str, dict[str, Any]] = {TRAINER: {}, OTHER: {}}
    run = make_run(tmp_path, code, cells, {
        TRAINER: record(code, [SITE], label="torch_tp-a2c1/attempt-1", expected=3,
                        ranks=(0, 2)),
        OTHER: record(code, [SITE], label="deepspeed-a1/attempt-1", modified=[SITE])})
    assert stale_cells(run, code) == {
        TRAINER: ["imports not recorded by rank(s) 1 of launch torch_tp-a2c1/attempt-1: "
                  "cannot prove freshness"],
        OTHER: [f"{SITE} (modified during launch deepspeed-a1/attempt-1)"]}


def test_a_launch_that_died_is_its_cells_error_not_staleness(code: Path,
                                                               tmp_path: Path) -> None:
    """The ranks of a killed launch record nothing: its ERROR cells are not STALE for that
    (the gate then shows the launch's ERROR), while a file it imported that changed since
    still makes them stale; the same record under a COMPLETE cell is stale."""
    died = record(code, [SITE], label="torch_tp-a2c1/attempt-1", expected=3, ranks=())
    run = make_run(tmp_path / "died", code, {TRAINER: {"status": "ERROR"},
                                             OTHER: {"status": "COMPLETE"}},
                   {TRAINER: died, OTHER: died})
    assert stale_cells(run, code) == {
        OTHER: ["imports not recorded by rank(s) 0, 1, 2 of launch torch_tp-a2c1/attempt-1: "
                "cannot prove freshness"]}
    before = (code / SITE).read_text()
    (code / SITE).write_text("# changed after the run\n")  # the module's copy: put back
    try:
        assert stale_cells(run, code)[TRAINER] == [SITE]
    finally:
        (code / SITE).write_text(before)


def test_a_cell_without_a_record_falls_back_to_its_engine_folder(code: Path,
                                                                 tmp_path: Path) -> None:
    """Runs made before the record: the folder set of sources.json, as before; a consumer
    of such a cell still inherits it."""
    cells: dict[str, dict[str, Any]] = {TRAINER: {}, SAMPLER: {"weights_from": TRAINER}}
    run = make_run(tmp_path, code, cells, {TRAINER: None, SAMPLER: None})
    harness = "harnesses/torch_tp/faults.py"
    assert stale_cells(run, edited(code, tmp_path, harness)) == {
        TRAINER: [harness], SAMPLER: [f"via {TRAINER}: {harness}"]}


def test_a_resume_skips_the_cells_it_launches_again_and_only_those(code: Path,
                                                                   tmp_path: Path) -> None:
    """The interrupted run that Ctrl-C leaves while the sampler imports: its cell ERROR, a
    rank unrecorded (its ERROR, not staleness), and a trainer cell ERROR whose launch saw a
    file modified. A resume launches those cells again (their next attempts record what
    they import), so they do not refuse the resume; a COMPLETE consumer of a cell launched
    again does not inherit its lines. The gate's view (stale_cells) is unchanged."""
    unrecorded = record(code, [SITE], label="vllm-sampler/attempt-1", expected=2, ranks=(0,))
    cells: dict[str, dict[str, Any]] = {
        TRAINER: {"status": "ERROR"}, CRITIC: {}, SAMPLER: {"status": "ERROR"},
        RESUME: {"resume_of": TRAINER}}
    run = make_run(tmp_path, code, cells, {
        TRAINER: record(code, [SITE], label="torch_tp-a2c1/attempt-1", expected=3,
                        ranks=(0, 2), modified=[SITE]),
        CRITIC: record(code, [SITE]), SAMPLER: unrecorded, RESUME: record(code, [SITE])})
    stale = stale_cells(run, code)
    assert stale[TRAINER] == [f"{SITE} (modified during launch torch_tp-a2c1/attempt-1)"]
    assert set(stale) == {TRAINER, RESUME}
    assert stale[RESUME] == [f"via {TRAINER}: {line}" for line in stale[TRAINER]]
    check_resume_sources(run, code)  # every line above is a cell launched again: resumed
    # a qualify file changed: refused, whatever the cells
    with pytest.raises(UsageError, match=r"\(qualify/protocol.py\): start a new --run-id"):
        check_resume_sources(run, edited(code, tmp_path, "qualify/protocol.py"))


def test_a_resume_still_refuses_a_cell_it_would_not_launch_with_a_record(
        code: Path, tmp_path: Path) -> None:
    """A NOT_RUN cell with no attempt (its engine unavailable) is judged by its engine's
    files at the gate after the resume too, so a change there still refuses the resume,
    as a change to a COMPLETE cell's recorded files does."""
    cells: dict[str, dict[str, Any]] = {
        TRAINER: {}, OTHER: {"status": "NOT_RUN", "attempt": None}}
    run = make_run(tmp_path, code, cells, {TRAINER: record(code, [SITE]), OTHER: None})
    harness = "harnesses/deepspeed/harness.py"
    with pytest.raises(UsageError, match=rf"\({harness}\): start a new --run-id"):
        check_resume_sources(run, edited(code, tmp_path, harness))
    with pytest.raises(UsageError, match=rf"\({SITE}\): start a new --run-id"):
        check_resume_sources(run, edited(code, tmp_path / "b", SITE))


def test_a_malformed_record_is_refused(code: Path, tmp_path: Path) -> None:
    rec = record(code, [SITE])
    rec["launches"][0]["checkout"] = {"x\n[ok] 5.": "0" * 64}  # a forged output line
    run = make_run(tmp_path, code, {TRAINER: {}}, {TRAINER: rec})
    with pytest.raises(EvidenceIntegrityError, match=r"imports\.json: launches\.0\.checkout"):
        stale_cells(run, code)


FILES = ("sitecustomize.py", "harnesses/common.py", "harnesses/torch_tp/harness.py",
         "harnesses/vllm/harness.py", "qualify_plugin_shim.py")


@pytest.fixture(scope="module")
def closure_base(code: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(code root holding FILES, a sources.json of it)`` for the property test."""
    tmp = tmp_path_factory.mktemp("closure")
    base = tmp / "code"
    shutil.copytree(code / "qualify", base / "qualify")
    for f in FILES:
        (base / f).parent.mkdir(parents=True, exist_ok=True)
        (base / f).write_text(f"# {f}\n")
    sources = write_sources(tmp, contract=load_contract(TINY), root=base)
    return base, sources


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 5), data=st.data())
def test_staleness_is_the_closure_of_what_each_cell_consumed(
        closure_base: tuple[Path, Path], n: int, data: st.DataObject) -> None:
    """For any consumption graph (cycles included) and any imported sets, editing a file
    makes stale exactly the cells that imported it or consumed, directly or not, a cell
    that did."""
    base, sources = closure_base
    cids = [f"torch_tp-fp32-actor-tp{i}" for i in range(n)]
    imported = {c: data.draw(st.sets(st.sampled_from(FILES)), label=c) for c in cids}
    edges = {c: data.draw(st.dictionaries(st.sampled_from(("weights_from", "resume_of")),
                                          st.sampled_from(cids), max_size=2)) for c in cids}
    target = data.draw(st.sampled_from(FILES), label="edited")
    before = (base / target).read_text()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        entries = {}
        for c in cids:
            (run / "cells" / c / "attempt-1").mkdir(parents=True)
            (run / "cells" / c / "attempt-1" / "imports.json").write_text(
                json.dumps(record(base, sorted(imported[c]))))
            entries[c] = {"engine": "torch_tp", "attempt": f"cells/{c}/attempt-1", **edges[c]}
        (run / "run.json").write_text(json.dumps({"cells": entries}))
        shutil.copyfile(sources, run / "sources.json")
        (base / target).write_text(before + "# edited\n")
        try:
            stale = stale_cells(run, base)
        finally:
            (base / target).write_text(before)

    def reaches(c: str) -> set[str]:
        seen, todo = {c}, [c]
        while todo:
            for src in edges[todo.pop()].values():
                if src not in seen:
                    seen.add(src)
                    todo.append(src)
        return seen

    assert set(stale) == {c for c in cids if any(target in imported[s] for s in reaches(c))}


# --------------------------------------------------------------------------- the record


def test_a_real_launch_records_every_rank_and_the_launch_path_module(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Warm launcher: both ranks record; the root's ``sitecustomize.py`` (imported by the
    interpreter that forked them, from the ``PYTHONPATH`` the launch puts first) and the
    harness run as ``__main__`` are in it; nothing of the standard library or site-packages
    is."""
    from qualify.candidate.launch import launch
    from qualify.evidence import imports

    root = tmp_path / "root"
    env = write_fake(root)
    (root / SITE).write_text("LAUNCH_PATH_HOOK = 1\n")
    monkeypatch.setattr(imports, "repo_root", lambda: root)
    att = tmp_path / "launches" / "fake-a2" / "attempt-1"
    res = launch(_cell(att), module="pkg_fake.harness", attempt_dir=att, timeout_s=120,
                 env=env)
    assert res.status == "OK", res.reason
    doc = json.loads((att / "imports.json").read_text())
    (launch_rec,) = doc["launches"]
    assert launch_rec["launch"] == "fake-a2/attempt-1"
    assert launch_rec["ranks_recorded"] == [0, 1]
    assert launch_rec["processes_expected"] == 2
    assert set(launch_rec["checkout"]) == {SITE, "pkg_fake/__init__.py", "pkg_fake/harness.py"}
    assert launch_rec["checkout"][SITE] == _sha(root / SITE)
    assert launch_rec["modified_during_launch"] == []
    assert {"pkg_fake", "sitecustomize", "usercustomize", "json"} <= set(launch_rec["top_level"])
    assert not (att / "logs" / "imports").exists()  # the per-process lists are merged away
    assert imports.record_changes(doc, root) == []
    (root / SITE).write_text("LAUNCH_PATH_HOOK = 2\n")
    assert imports.record_changes(doc, root) == [SITE]


def _raw(attempt: Path, files: Sequence[Path], rank: int = 0) -> None:
    folder = attempt / "logs" / "imports"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{rank}-{os.getpid()}.json").write_text(json.dumps(
        {"rank": rank, "pid": os.getpid(), "files": [str(f) for f in files]}))


def test_collect_hashes_the_plugin_distribution_files_and_flags_late_edits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin engine installed from outside the checkout: its distribution's imported
    files are recorded against its RECORD and checked against the installed copy; where it
    is not installed the check says so; another package's files are not hashed."""
    from qualify.evidence import imports

    site = tmp_path / "site"
    (site / "qplug").mkdir(parents=True)
    (site / "qplug" / "__init__.py").write_text("")
    (site / "qplug" / "harness.py").write_text("def main(argv): return 0\n")
    (site / "otherpkg.py").write_text("X = 1\n")
    info = site / "qplug-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: qplug\nVersion: 1.2\n")
    (info / "RECORD").write_text("qplug/__init__.py,,\nqplug/harness.py,,\n"
                                 "qplug-1.2.dist-info/METADATA,,\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    root = tmp_path / "root"
    (root / "harnesses").mkdir(parents=True)
    (root / SITE).write_text("X = 1\n")
    assert imports.engine_distributions("qplug.harness", root) == ("qplug",)
    assert imports.engine_distributions("harnesses.torch_tp.harness") == ()  # in the checkout
    attempt = tmp_path / "launches" / "qplug-a1" / "attempt-1"
    _raw(attempt, [site / "qplug" / "harness.py", site / "qplug" / "__init__.py",
                   site / "otherpkg.py", root / SITE])
    doc = imports.collect(attempt, module="qplug.harness", expected=1,
                          started_ns=time.time_ns(), root=root)
    (rec,) = doc["launches"]
    assert rec["checkout"] == {SITE: _sha(root / SITE)}
    assert rec["distributions"] == {"qplug": {"version": "1.2", "files": {
        "qplug/__init__.py": _sha(site / "qplug" / "__init__.py"),
        "qplug/harness.py": _sha(site / "qplug" / "harness.py")}}}
    assert json.loads((attempt / "imports.json").read_text()) == doc
    assert imports.record_changes(doc, root) == []
    (site / "qplug" / "harness.py").write_text("def main(argv): return 1\n")
    assert imports.record_changes(doc, root) == ["qplug: qplug/harness.py"]
    monkeypatch.undo()
    importlib.invalidate_caches()
    assert imports.record_changes(doc, root) == [
        "qplug not installed here: 2 imported files cannot be checked"]
    # a file whose mtime is after the launch began: not necessarily what ran
    late = tmp_path / "launches" / "late" / "attempt-1"
    _raw(late, [root / SITE], rank=0)
    doc = imports.collect(late, module="harnesses.x", expected=2, started_ns=0, root=root)
    assert imports.record_changes(doc, root) == [
        "imports not recorded by rank(s) 1 of launch late/attempt-1: cannot prove freshness",
        f"{SITE} (modified during launch late/attempt-1)"]


def test_a_module_with_a_relative_file_is_not_recorded(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """torch's ``torch.ops`` / ``torch.classes`` namespaces say ``__file__ = "_ops.py"``: a
    relative name is no loaded file, and resolved against the working directory (the code
    root for the sampler stage) it read as a code file "modified during launch", so every
    vLLM sampler cell was STALE."""
    import types

    from qualify.candidate import imported

    monkeypatch.chdir(tmp_path)
    fake = types.ModuleType("fake_namespace")
    fake.__file__ = "_ops.py"
    real = types.ModuleType("fake_real")
    real.__file__ = str(tmp_path / "real.py")
    monkeypatch.setitem(sys.modules, "fake_namespace", fake)
    monkeypatch.setitem(sys.modules, "fake_real", real)
    files = imported.loaded_files()
    assert str(tmp_path / "real.py") in files
    assert str(tmp_path / "_ops.py") not in files
    assert all(os.path.isabs(f) for f in files)
