"""Staleness (qualify.evidence.sources): sources.json of a run against a checkout, directly on
a fake run directory, then through the gate and the audit on the fresh signed world."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from fresh_world import code_root, code_snapshot, fresh, fresh_world
from test_verify import CONTRACT, CUDA_ONLY, World, run_cli, signed_world

from qualify.contract import load_contract
from qualify.errors import EvidenceIntegrityError, UsageError
from qualify.evidence.audit import audit
from qualify.evidence.sources import (
    NOT_RECORDED,
    check_resume_sources,
    engine_files,
    recorded_policy_digest,
    sources_document,
    stale_cells,
    write_sources,
)
from qualify.layout import SOURCES_FILE
from qualify.resources import contracts_dir

__all__ = ["fresh", "fresh_world", "signed_world"]

TINY = contracts_dir() / "tiny-qwen3.toml"


@pytest.fixture(scope="module")
def code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A frozen copy of this checkout's qualify/ and harnesses/ sources."""
    return code_snapshot(tmp_path_factory.mktemp("code"))


def fake_run(tmp: Path, code: Path) -> Path:
    """A run directory: run.json naming one cell per engine, and sources.json of ``code``."""
    run = tmp / "run"
    run.mkdir()
    cells = {"torch_tp-fp32-actor-tp1": {"engine": "torch_tp", "status": "COMPLETE"},
             "deepspeed-fp32-zero0-actor-tp1": {"engine": "deepspeed", "status": "COMPLETE"},
             "vllm-fp32-sampler-tp1": {"engine": "vllm", "status": "COMPLETE"}}
    (run / "run.json").write_text(json.dumps({"cells": cells}))
    write_sources(run, contract=load_contract(TINY), root=code)
    return run


def test_document_records_every_source_file_and_the_digests(code: Path, tmp_path: Path) -> None:
    contract = load_contract(TINY)
    doc = sources_document(contract, root=code)
    files = doc["qualify"]["files"]
    assert "qualify/evidence/sources.py" in files
    assert len(files) == len(list((code / "qualify").rglob("*.py")))
    # sha256 of the bytes, computed here independently
    p = code / "qualify" / "layout.py"
    assert files["qualify/layout.py"] == hashlib.sha256(p.read_bytes()).hexdigest()
    assert set(doc["engines"]) == {"torch_tp", "deepspeed", "megatron", "vllm"}
    ds = doc["engines"]["deepspeed"]
    assert "harnesses/common.py" in ds["files"]
    assert all(f.startswith(("harnesses/deepspeed/", "harnesses/common.py",
                             "harnesses/__init__.py", "harnesses/hf_schedule.py",
                             "harnesses/faults.py",
                             "harnesses/layer_probe.py", "harnesses/resume_state.py",
                             "sdk/qualify_harness/"))
               for f in ds["files"])
    assert "sdk/qualify_harness/driver.py" in ds["files"]  # the SDK runs in every engine
    assert "harnesses/layer_probe.py" in ds["files"]  # around every DeepSpeed micro-batch
    assert set(ds["distributions"]) == {"deepspeed"}
    assert doc["contract"] == {"name": "tiny-qwen3", "digest": contract.digest}
    assert doc["policy"]["path"].endswith("gates/tiny-qwen3.toml")
    assert re.fullmatch("[0-9a-f]{64}", doc["policy"]["digest"])


def test_fresh_run_has_no_stale_cell(code: Path, tmp_path: Path) -> None:
    run = fake_run(tmp_path, code)
    assert stale_cells(run, code) == {}
    check_resume_sources(run, code)  # does not raise
    recorded, digest = recorded_policy_digest(run)
    assert recorded
    assert digest is not None


def test_harness_change_makes_only_its_engine_stale(code: Path, tmp_path: Path) -> None:
    run = fake_run(tmp_path, code)
    tree = code_snapshot(tmp_path / "checkout")
    harness = tree / "harnesses" / "deepspeed" / "harness.py"
    harness.write_text(harness.read_text() + "\n# changed\n")
    (tree / "harnesses" / "torch_tp" / "new_module.py").write_text("X = 1\n")
    assert stale_cells(run, tree) == {
        "deepspeed-fp32-zero0-actor-tp1": ["harnesses/deepspeed/harness.py"],
        "torch_tp-fp32-actor-tp1": ["harnesses/torch_tp/new_module.py (added)"]}
    with pytest.raises(UsageError, match=r"sources changed since run run began "
                                         r"\(harnesses/deepspeed/harness.py, .*start a new "
                                         r"--run-id"):
        check_resume_sources(run, tree)


def test_shared_and_qualify_changes_make_every_cell_stale(code: Path, tmp_path: Path) -> None:
    run = fake_run(tmp_path, code)
    tree = code_snapshot(tmp_path / "checkout")
    (tree / "qualify" / "bounds.py").unlink()
    stale = stale_cells(run, tree)
    assert set(stale) == {"torch_tp-fp32-actor-tp1", "deepspeed-fp32-zero0-actor-tp1",
                          "vllm-fp32-sampler-tp1"}
    assert all(v == ["qualify/bounds.py (removed)"] for v in stale.values())
    common = tree / "harnesses" / "common.py"
    common.write_text(common.read_text() + "#\n")
    assert "harnesses/common.py" in stale_cells(run, tree)["vllm-fp32-sampler-tp1"]


def test_run_without_sources_cannot_prove_freshness(code: Path, tmp_path: Path) -> None:
    run = fake_run(tmp_path, code)
    (run / SOURCES_FILE).unlink()
    assert stale_cells(run, code) == {c: [NOT_RECORDED] for c in (
        "torch_tp-fp32-actor-tp1", "deepspeed-fp32-zero0-actor-tp1", "vllm-fp32-sampler-tp1")}
    check_resume_sources(run, code)  # a run from before sources.json is not refused
    assert recorded_policy_digest(run) == (False, None)


def test_unknown_engine_and_broken_record(code: Path, tmp_path: Path) -> None:
    run = fake_run(tmp_path, code)
    doc = json.loads((run / SOURCES_FILE).read_text())
    del doc["engines"]["vllm"]
    (run / SOURCES_FILE).write_text(json.dumps(doc))
    assert stale_cells(run, code) == {
        "vllm-fp32-sampler-tp1": ["sources of engine vllm not recorded"]}
    (run / SOURCES_FILE).write_text(json.dumps({"qualify": []}))
    with pytest.raises(EvidenceIntegrityError, match="not a sources record"):
        stale_cells(run, code)
    (run / SOURCES_FILE).unlink()
    (run / SOURCES_FILE).symlink_to("/dev/zero")
    with pytest.raises(EvidenceIntegrityError):
        stale_cells(run, code)


def test_engine_files_match_the_folder(code: Path) -> None:
    files = engine_files(code, "torch_tp")
    want = {p.relative_to(code).as_posix() for p in (code / "harnesses" / "torch_tp").rglob(
        "*.py")} | {"harnesses/common.py", "harnesses/__init__.py", "harnesses/hf_schedule.py",
                    "harnesses/faults.py", "harnesses/layer_probe.py",
                    "harnesses/resume_state.py"} | {
        p.relative_to(code).as_posix() for p in (code / "sdk" / "qualify_harness").rglob("*.py")}
    assert set(files) == want


def test_every_shared_harness_module_an_engine_imports_is_tracked() -> None:
    """The shared set, derived from the engines' own imports (``ast``): a harness module
    outside the engine folders that any engine imports makes its cells stale when it
    changes, so it must be in HARNESS_SHARED (layer_probe was missing once)."""
    import ast

    from qualify.evidence.sources import HARNESS_SHARED

    root = Path(__file__).resolve().parent.parent
    engines = {p.name for p in (root / "harnesses").iterdir() if p.is_dir()
               and (p / "__init__.py").is_file()}
    shared: set[str] = set()
    for path in (root / "harnesses").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module == "harnesses":
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "harnesses."):
                names = [str(node.module).split(".")[1]]
            elif isinstance(node, ast.Import):
                names = [a.name.split(".")[1] for a in node.names
                         if a.name.startswith("harnesses.")]
            shared |= {f"harnesses/{n}.py" for n in names if n not in engines}
    assert shared, "no shared harness import found: the scan is broken"
    assert shared <= set(HARNESS_SHARED), sorted(shared - set(HARNESS_SHARED))


# --------------------------------------------------------------------------- gate, audit


def gate_on(w: World, root: Path, *extra: str) -> tuple[int, str]:
    return run_cli(["gate", str(w.good), "--keys", str(w.keys), "--contract",
                    str(w.contract), "--sources-root", str(root),
                    "--allow-not-run", f"{CUDA_ONLY}-*", *extra])


def test_gate_fails_on_stale_cells_naming_the_files(fresh: World, tmp_path: Path) -> None:
    code, text = gate_on(fresh, code_root(fresh))
    assert code == 0, text
    harness = code_root(fresh) / "harnesses" / "torch_tp" / "harness.py"
    harness.write_text(harness.read_text() + "\n# a change without new evidence\n")
    out = tmp_path / "gate.json"
    code, text = gate_on(fresh, code_root(fresh), "--json", str(out))
    assert code == 1, text
    assert "4 STALE" in text
    assert re.search(r"torch_tp-fp32-actor-tp1\s.*STALE\s.*FAILS\s.*stale: "
                     r"harnesses/torch_tp/harness.py", text), text
    doc = json.loads(out.read_text())
    cells = {c["cell"]: c for c in doc["contracts"][0]["cells"]}
    assert cells["torch_tp-fp32-critic-tp2"]["stale_files"] == ["harnesses/torch_tp/harness.py"]
    assert cells[f"{CUDA_ONLY}-fp32-zero0-actor-tp1"]["outcome"] == "NOT_RUN"  # its code same
    rows = audit(fresh.root / "evidence", trusted_keys_dir=fresh.keys,
                 contracts_dir=fresh.contracts, source_root=code_root(fresh))
    by = {r.run_id: r for r in rows.rows}
    assert by["run-2-good"].sources == ("STALE 4/8 cells: harnesses/torch_tp/harness.py")
    assert not rows.problems  # stale sources are the gate's failure, not an audit problem


def test_unfreshened_world_is_stale_not_recorded(signed_world: World) -> None:
    code, text = run_cli(["gate", str(signed_world.good), "--keys", str(signed_world.keys),
                          "--contract", str(signed_world.contract), "--allow-not-run",
                          f"{CUDA_ONLY}-*"])
    assert code == 1
    assert f"{NOT_RECORDED}" in text
    rows = audit(signed_world.root / "evidence", trusted_keys_dir=signed_world.keys,
                 contracts_dir=signed_world.contracts)
    assert {r.sources for r in rows.rows if r.run_id} == {NOT_RECORDED}


def test_policy_digest_recorded_then_edited(fresh: World) -> None:
    """A run that recorded its policy: the same policy gives no note; an edit gives one."""
    gates = fresh.contracts / "gates"
    gates.mkdir()
    policy = gates / f"{CONTRACT}.toml"
    policy.write_text(f'schema_version = 1\ncontract = "{CONTRACT}"\n[[allowed_not_run]]\n'
                      f'cells = "{CUDA_ONLY}-*"\nreason = "needs CUDA"\n')
    from fresh_world import freshen

    freshen(fresh, [fresh.good])
    code, text = run_cli(["gate", str(fresh.good), "--keys", str(fresh.keys), "--contract",
                          str(fresh.contract), "--sources-root", str(code_root(fresh))])
    assert code == 0, text
    assert "policy edited" not in text
    policy.write_text(policy.read_text().replace("needs CUDA", "needs CUDA (edited)"))
    code, text = run_cli(["gate", str(fresh.good), "--keys", str(fresh.keys), "--contract",
                          str(fresh.contract), "--sources-root", str(code_root(fresh))])
    assert code == 0, text
    assert re.search(r"note: policy edited since the run \(recorded [0-9a-f]{12}, now "
                     r"[0-9a-f]{12}\): evaluating with the current policy", text), text
