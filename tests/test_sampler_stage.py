"""The candidate stage's sampler step (qualify.candidate.sampler_stage) with a fake harness.

One harness process runs every sampler cell of the contract, started before the weights
it installs exist: it must be running (engines starting) while the weights source is
still training, receive its requests only once that source is recorded, and end cleanly
when the weights never come or the stage stops. The fake harness (no torch, no vLLM)
records when it started and what request it saw, then copies a committed sampler cell's
real outputs, so the stage's own output check runs on schema-valid files.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
from committed import committed_runs

from qualify.candidate import sampler_stage
from qualify.contract import load_contract
from qualify.evidence import store
from qualify.layout import RunDocument, RunReference
from qualify.resources import contracts_dir

WAIT_S = 60.0
PRIVATE_DIR_ENV = "FAKE_SAMPLER_PRIVATE_DIR"
FAKE = '''
import json, os, shutil, socket, sys, time
from pathlib import Path

outs = [Path(json.loads(Path(a).read_text())["output_dir"]) for a in sys.argv[1:]]
private = os.environ.get("FAKE_SAMPLER_PRIVATE_DIR")
if private:  # a socket left behind, as vLLM leaves its IPC sockets
    socket.socket(socket.AF_UNIX).bind(os.path.join(private, "left-behind"))
for out in outs:
    (out / "fake_started.json").write_text(json.dumps({"t": time.time(), "private": private}))
for out in outs:
    req = out / "sampler_request.json"
    while not req.is_file():
        time.sleep(0.02)
    doc = json.loads(req.read_text())
    (out / "fake_seen.json").write_text(json.dumps({"t": time.time(), "request": doc}))
    if doc["weights_file"] is not None:
        for name in ("outputs.safetensors", "outputs.json"):
            shutil.copyfile(Path(%r) / name, out / name)
'''


class _Engine:
    """The registry entry the stage asks for (``name``, ``module``, availability)."""

    name = "vllm"
    module = "fake_sampler_harness"
    private_dirs: ClassVar[dict[str, str]] = {PRIVATE_DIR_ENV: "qualify-test-sampler-"}

    def unavailable_reason(self) -> str | None:
        return None


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A run directory, its run document, the weights source's launch, the fake harness."""
    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    assert contract.sampler is not None
    real = committed_runs()[-1]
    outputs = real / "cells" / "vllm-fp32-sampler-tp1" / "attempt-1"
    (tmp_path / "fake_sampler_harness.py").write_text(FAKE % str(outputs))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delenv(PRIVATE_DIR_ENV, raising=False)
    monkeypatch.setattr(sampler_stage, "get_engine", lambda name: _Engine())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    launch = tmp_path / "launch"
    launch.mkdir()
    (launch / "actor_round1.safetensors").write_bytes(b"weights of round 1")
    src = run_dir / "cells" / "src" / "attempt-1"
    src.mkdir(parents=True)
    (src / "result.json").write_text(json.dumps({"launch_attempt": str(launch)}))
    run = RunDocument(contract=contract.name, contract_digest=contract.digest,
                      reference=RunReference(path="/nowhere", manifest_digest="0" * 64),
                      run_id="r", started=store.utc_now())
    return {"contract": contract, "run_dir": run_dir, "run": run, "launch": launch,
            "inputs": tmp_path / "inputs", "source": contract.sampler.weights_from}


def _record_source(w: dict[str, Any], status: str) -> None:
    w["run"].cells[w["source"]] = {"status": status, "attempt": "cells/src/attempt-1",
                                   "precision": "fp32", "options": {}, "reason": None}


def _start(w: dict[str, Any], **kw: Any) -> tuple[threading.Thread, threading.Event]:
    ready = threading.Event()
    thread = threading.Thread(target=sampler_stage.run_sampler_cells, args=(w["contract"],),
                              kwargs={"run_dir": w["run_dir"], "run": w["run"],
                                      "inputs": w["inputs"], "weights_ready": ready, **kw},
                              daemon=True)
    thread.start()
    return thread, ready


def _attempts(w: dict[str, Any]) -> list[Path]:
    return [w["run_dir"] / "cells" / cid / "attempt-1"
            for cid, _ in sampler_stage.sampler_cells(w["contract"])]


def _wait_for(paths: list[Path]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not all(p.is_file() for p in paths):
        assert time.monotonic() < deadline, f"not written within {WAIT_S} s: {paths}"
        time.sleep(0.02)


def test_one_process_starts_before_the_weights_and_installs_them_once_recorded(
        world: dict[str, Any]) -> None:
    thread, ready = _start(world)
    attempts = _attempts(world)
    _wait_for([a / "fake_started.json" for a in attempts])  # running while the source trains
    time.sleep(0.3)
    assert not any((a / sampler_stage.REQUEST_FILE).exists() for a in attempts)
    _record_source(world, "COMPLETE")
    t_ready = time.time()
    ready.set()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    weights = world["launch"] / "actor_round1.safetensors"
    started = {json.loads((a / "fake_started.json").read_text())["t"] for a in attempts}
    assert max(started) < t_ready
    (private,) = {json.loads((a / "fake_started.json").read_text())["private"] for a in attempts}
    assert Path(private).name.startswith("qualify-test-sampler-")
    assert not Path(private).exists()  # the engine's private directory, removed after it
    results = [json.loads((a / "result.json").read_text()) for a in attempts]
    assert len({r["started"] for r in results}) == 1  # one process for every cell
    assert {r["launch"] for r in results} == {"vllm-sampler-tp1-tp2"}
    for a, r in zip(attempts, results, strict=True):
        seen = json.loads((a / "fake_seen.json").read_text())
        assert seen["t"] >= t_ready
        assert seen["request"]["weights_file"] == str(weights.resolve())
        assert seen["request"]["weights_sha256"] == store.sha256_file(weights)
        assert r["status"] == "COMPLETE", r
        assert (a / "logs" / "stderr.txt").is_file()
        assert store.is_sealed(a)
    entries = [world["run"].cells[cid] for cid, _ in sampler_stage.sampler_cells(
        world["contract"])]
    assert [e["status"] for e in entries] == ["COMPLETE", "COMPLETE"]
    on_disk = json.loads((world["run_dir"] / "run.json").read_text())["cells"]
    assert all(on_disk[cid]["status"] == "COMPLETE"
               for cid, _ in sampler_stage.sampler_cells(world["contract"]))


@pytest.mark.parametrize("source_status", ["ERROR", None])
def test_weights_that_never_come_end_the_process_with_not_run(
        world: dict[str, Any], source_status: str | None) -> None:
    thread, ready = _start(world)
    _wait_for([a / "fake_started.json" for a in _attempts(world)])
    if source_status is not None:
        _record_source(world, source_status)
    ready.set()  # the stage's launches are over
    thread.join(WAIT_S)
    assert not thread.is_alive()
    for cid, _ in sampler_stage.sampler_cells(world["contract"]):
        entry = world["run"].cells[cid]
        assert entry["status"] == "NOT_RUN", entry
        assert world["source"] in entry["reason"]
        assert entry["attempt"] is None


def test_a_stopped_stage_cancels_the_waiting_process(world: dict[str, Any]) -> None:
    stop = threading.Event()
    thread, _ = _start(world, stop=stop)
    attempts = _attempts(world)
    _wait_for([a / "fake_started.json" for a in attempts])
    stop.set()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    for a in attempts:
        assert not (a / sampler_stage.REQUEST_FILE).exists()
        assert not (a / "fake_seen.json").exists()
        private = json.loads((a / "fake_started.json").read_text())["private"]
        assert not Path(private).exists()  # removed after the ended process tree too
    reasons = [world["run"].cells[cid] for cid, _ in sampler_stage.sampler_cells(
        world["contract"])]
    assert all(e["status"] == "ERROR" and "cancelled" in e["reason"] for e in reasons), reasons


def test_the_harness_refuses_cells_it_cannot_run_together(tmp_path: Path) -> None:
    from harnesses.vllm import harness
    from qualify.errors import HarnessError
    from qualify.protocol import HarnessCell

    def cell(out: str, inputs: str = "in") -> HarnessCell:
        return HarnessCell(engine="vllm", precision="fp32", options={"rollout_tp": 1},
                           actor_tp=0, critic_tp=0, rounds=2, seed=0,
                           inputs_dir=str(tmp_path / inputs), output_dir=str(tmp_path / out))

    with pytest.raises(HarnessError, match="same output_dir"):
        harness.run_cells([cell("a"), cell("a")])
    with pytest.raises(HarnessError, match="one inputs_dir"):
        harness.run_cells([cell("a"), cell("b", inputs="other")])


def test_wait_request_returns_the_request_once_written(tmp_path: Path) -> None:
    from harnesses.vllm import harness

    doc = {"weights_file": None, "weights_sha256": None, "weights_from": "x", "reason": "r"}
    timer = threading.Timer(0.2, lambda: store.atomic_write_json(
        tmp_path / harness.REQUEST_FILE, doc))
    timer.start()
    assert harness.wait_request(tmp_path, poll_s=0.01) == doc
    timer.join()


def test_the_forked_ranks_of_an_external_launcher_engine_must_record_their_imports(
        tmp_path: Path) -> None:
    """The sampler process's import record expects ranks 0 .. tp - 1 where a cell's outputs
    say its engine ran under ``external_launcher`` (the harness forked those ranks, each
    importing the engine's model code), and the harness alone otherwise; a record missing a
    rank then cannot prove the cells fresh."""
    from qualify.candidate.sampler_stage import _Process
    from qualify.evidence import imports

    attempts = {}
    for name, tp, executor in (("tp1", 1, None), ("tp2", 2, "external_launcher")):
        a = tmp_path / name / "attempt-1"
        a.mkdir(parents=True)
        (a / "outputs.json").write_text(json.dumps(
            {"tp": tp, "engine_settings": {"distributed_executor_backend": executor}}))
        attempts[name] = a
    proc = object.__new__(_Process)
    proc.attempts = attempts
    assert proc._expected_processes() == 2
    (attempts["tp2"] / "outputs.json").write_text(json.dumps(
        {"tp": 2, "engine_settings": {"distributed_executor_backend": "mp"}}))
    assert proc._expected_processes() == 1  # mp's spawned workers record nothing of their own
    (attempts["tp2"] / "outputs.json").write_text("{not json")
    assert proc._expected_processes() == 1
    # what the record then says when a forked rank wrote no record
    record = {"schema_version": 1, "launches": [{
        "launch": "l", "processes_expected": 2, "ranks_recorded": [0], "processes_recorded": 2,
        "checkout": {}, "distributions": {}, "modified_during_launch": [], "top_level": []}]}
    changes = imports.record_changes(record, root=tmp_path)
    assert any("imports not recorded by rank(s) 1" in c for c in changes), changes
