"""qualify.candidate.ahead: a launch started ahead of its turn forks no rank before its gate.

Real warm launchers of the fake harness of ``test_launch`` (no torch in the ranks), real
pipes and real :func:`qualify.procs.run` waits; the gate's rules, the launcher's exit when
its pipe closes, the limit counted from the gate, a cancel past the gate, and the plan's
``launcher_ahead`` term.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import psutil
import pytest
from test_launch import _cell, write_fake

from qualify import procs
from qualify.candidate import ahead, beside
from qualify.candidate.launch import LaunchResult, launch
from qualify.candidate.plan import launch_host_peaks, launch_steps
from qualify.candidate.warm import GATE_SHUT_EXIT
from qualify.contract import Contract, load_contract
from qualify.errors import ContractError, UsageError
from qualify.reference.plan_core import INTERPRETER_BYTES, Machine
from qualify.resources import contracts_dir, repo_root


def _wait_for(predicate: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _launch_in_thread(att: Path, mode: str | None, fake: dict[str, str], gate: ahead.Gate,
                      timeout_s: float = 120.0, launcher: Any = "warm"
                      ) -> tuple[threading.Thread, list[LaunchResult]]:
    """``launch`` in a daemon thread (a failing test cannot hang pytest's exit on it)."""
    out: list[LaunchResult] = []
    thread = threading.Thread(target=lambda: out.append(launch(
        _cell(att, mode), module="pkg_fake.harness:main", attempt_dir=att,
        timeout_s=timeout_s, env=fake, launcher=launcher, gate=gate)), daemon=True)
    thread.start()
    return thread, out


def _gated(tmp_path: Path, gates: list[ahead.Gate], mode: str | None, launcher: Any = "warm",
           timeout_s: float = 120.0) -> tuple[Path, ahead.Gate, threading.Thread,
                                               list[LaunchResult]]:
    """A gated launch of the fake harness in a thread: its attempt, gate, thread and result."""
    fake = write_fake(tmp_path / "pkg")
    att = tmp_path / "attempt-1"
    gate = ahead.Gate()
    gates.append(gate)
    thread, out = _launch_in_thread(att, mode, fake, gate, timeout_s=timeout_s,
                                    launcher=launcher)
    return att, gate, thread, out


def _default_stage(monkeypatch: pytest.MonkeyPatch) -> tuple[Contract, Path]:
    """The default contract and its committed reference (skip without it); the stage's
    launch settings at their defaults."""
    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    reference = repo_root() / "references" / f"tiny-qwen3-{contract.digest12}"
    if not reference.is_dir():
        pytest.skip("the committed tiny-qwen3 reference is not checked out")
    monkeypatch.delenv("QUALIFY_JOBS", raising=False)
    monkeypatch.delenv("QUALIFY_AHEAD", raising=False)
    return contract, reference


@pytest.fixture
def gates() -> Iterator[list[ahead.Gate]]:
    """Every gate a test makes is shut at its end, whatever the test did."""
    made: list[ahead.Gate] = []
    yield made
    for gate in made:
        gate.shut()


def _waiting(att: Path) -> bool:
    log = att / "logs" / "launcher.log"
    return log.is_file() and "waiting for the start signal" in log.read_text()


def _hand_launcher(tmp_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    """The warm launcher of the fake harness with ``--wait-stdin``, run by hand (two ranks,
    stdin a pipe, stdout and stderr merged); its cell's outputs go to ``tmp_path/out``."""
    fake = write_fake(tmp_path / "pkg")
    out = tmp_path / "out"
    out.mkdir()
    cell = tmp_path / "cell.json"
    cell.write_text(json.dumps(_cell(out).to_dict()))
    return subprocess.Popen(
        [sys.executable, "-m", "qualify.candidate.warm", "--nproc-per-node", "2",
         "--log-dir", str(tmp_path / "ranks"), *extra, "--wait-stdin", "pkg_fake.harness:main",
         str(cell)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, **fake})


def _until_waiting(proc: subprocess.Popen[bytes]) -> None:
    """Read the launcher's output up to its line saying it waits for its start signal."""
    assert proc.stdout is not None
    while b"waiting for the start signal" not in (line := proc.stdout.readline()):
        assert line, "the launcher ended before it waited"


def test_gate_open_and_shut_are_final() -> None:
    gate = ahead.Gate()
    gate.open()
    gate.open()  # no effect
    assert os.read(gate.stdin, 8) == ahead.START_BYTE
    assert os.read(gate.stdin, 8) == b""  # the write end is closed
    assert gate.wait()
    assert gate.opened_at is not None
    assert gate.opened_utc
    gate.shut()  # past the gate: a cancel, the open stays
    assert gate.opened.is_set()
    assert gate.cancelled.is_set()
    gate.release()
    shut = ahead.Gate()
    shut.shut()
    shut.open()  # no effect once shut
    assert os.read(shut.stdin, 8) == b""  # end of file, no start byte
    assert not shut.wait()
    assert shut.opened_at is None
    shut.release()


@pytest.mark.slow  # seconds of real launches and waits: .ci/run's slow step
def test_a_gated_launch_forks_no_rank_until_its_gate_opens(tmp_path: Path,
                                                           gates: list[ahead.Gate]) -> None:
    att, gate, thread, out = _gated(tmp_path, gates, None, timeout_s=10.0)
    _wait_for(lambda: _waiting(att))
    time.sleep(11.0)  # past timeout_s: the limit counts from the gate, not from the start
    assert not list(att.glob("pid*")), "a rank ran before its gate opened"
    gate.open()
    thread.join(60)
    (res,) = out
    assert res.status == "OK", res.reason
    assert res.ahead
    assert sorted(p.name for p in att.glob("pid*")) == ["pid0", "pid1"]
    assert res.started >= (gate.opened_utc or "")
    assert res.launcher_started < res.started  # the launcher imported before its turn
    assert res.wall_s < 11.0  # from the gate: the wait before it is not the launch's
    log = res.launcher_log.read_text()
    assert log.index("waiting for the start signal") < log.index("2 ranks of pkg_fake")


def test_a_gate_shut_before_it_opens_starts_no_rank(
        tmp_path: Path, gates: list[ahead.Gate]) -> None:
    att, gate, thread, out = _gated(tmp_path, gates, None)
    _wait_for(lambda: _waiting(att))
    gate.shut()
    thread.join(60)
    (res,) = out
    assert res.status == "ERROR"
    assert res.reason.startswith("not started: the candidate stage stopped"), res.reason
    assert not list(att.glob("pid*"))


@pytest.mark.parametrize(("end", "code", "line"), [
    ("close stdin", GATE_SHUT_EXIT, b"start pipe closed before the start signal: no rank"),
    ("SIGTERM", 128 + signal.SIGTERM, b"signal 15 before any rank started")])
def test_a_waiting_launcher_ends_before_any_rank(tmp_path: Path, end: str, code: int,
                                                 line: bytes) -> None:
    """Its pipe closed (without the stage's cancel) or a signal: exit, no rank forked."""
    with _hand_launcher(tmp_path) as proc:
        assert proc.stdin is not None
        assert proc.stdout is not None
        _until_waiting(proc)
        if end == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
        else:
            proc.stdin.close()
        assert proc.wait(60) == code
        assert line in proc.stdout.read()
    assert not list((tmp_path / "out").glob("pid*"))


@pytest.mark.slow  # seconds of real launches and waits: .ci/run's slow step
def test_a_launch_past_its_gate_is_cancelled_with_its_tree(
        tmp_path: Path, gates: list[ahead.Gate]) -> None:
    att, gate, thread, out = _gated(tmp_path, gates, "sleep")
    gate.open()
    _wait_for(lambda: len(list(att.glob("pid*"))) == 2)
    pids = [int(p.read_text()) for p in att.glob("pid*")]
    gate.shut()
    thread.join(60)
    (res,) = out
    assert res.status == "ERROR"
    assert res.reason.startswith("cancelled")
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == \
            psutil.STATUS_ZOMBIE


def test_a_gated_torchrun_launch_waits_here_and_never_starts_once_shut(
        tmp_path: Path) -> None:
    """Not the warm launcher: nothing runs ahead; a shut gate means no launcher at all."""
    fake = write_fake(tmp_path / "pkg")
    att = tmp_path / "attempt-1"
    gate = ahead.Gate()
    gate.shut()
    res = launch(_cell(att), module="pkg_fake.harness:main", attempt_dir=att, timeout_s=60,
                 env=fake, launcher="torchrun", gate=gate)
    assert res.status == "ERROR"
    assert res.reason.startswith("not started")
    assert not (att / "logs" / "launcher.log").exists()


@pytest.mark.slow  # seconds of real launches and waits: .ci/run's slow step
def test_clock_from_starts_the_limit_at_the_event() -> None:
    cmd = [sys.executable, "-c", "import time; time.sleep(1.5)"]
    later = threading.Event()
    ran = procs.run(cmd, timeout_s=1.0, clock_from=later)  # never set: no limit
    assert ran.returncode == 0
    assert not ran.timed_out
    now = threading.Event()
    now.set()
    ran = procs.run(cmd, timeout_s=0.5, clock_from=now)
    assert ran.timed_out
    assert ran.returncode is None


def test_room_ahead_and_mem_available(tmp_path: Path) -> None:
    assert ahead.room_ahead(10, 5, available=15)
    assert not ahead.room_ahead(10, 5, available=14)
    assert not ahead.room_ahead(0, 5, available=None)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   1000 kB\n")
    assert ahead.mem_available(meminfo) == 1000 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert ahead.mem_available(meminfo) is None
    assert ahead.mem_available(tmp_path / "missing") is None


@pytest.mark.parametrize(("jobs", "on", "cuda", "want"), [
    ("", "", False, True), ("2", "1", False, True), ("", "0", False, False),
    ("1", "", False, False), ("1", "1", False, False), ("", "", True, False),
    ("2", "1", True, False)])
def test_ahead_setting(jobs: str, on: str, cuda: bool, want: bool) -> None:
    env = {"QUALIFY_JOBS": jobs, "QUALIFY_AHEAD": on}
    assert beside.ahead(cuda=cuda, env=env) is want


def test_ahead_setting_refuses_bad_values() -> None:
    with pytest.raises(UsageError, match="QUALIFY_AHEAD='2': must be 0 or 1"):
        beside.ahead(cuda=False, env={"QUALIFY_AHEAD": "2"})


@pytest.mark.parametrize(("jobs", "on"), [("", ""), ("1", ""), ("", "0")])
def test_the_plan_holds_one_more_interpreter_beside_every_launch_but_the_last(
        monkeypatch: pytest.MonkeyPatch, jobs: str, on: str) -> None:
    monkeypatch.setenv("QUALIFY_JOBS", jobs)
    monkeypatch.setenv("QUALIFY_AHEAD", on)
    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    cpu = Machine(devices=0, device_bytes=0, host_bytes=24 * 10**9, cores=2)
    steps = [s for s in launch_steps(contract, cpu) if s.kind == "launch"]
    assert len(steps) == 3
    from qualify.candidate.launches import in_stage_order, launches_for

    launches = in_stage_order(contract, launches_for(contract, list(contract.matrix.cells())))
    assert launches[0].launch_id == "torch_tp-a2c1-a1c2"  # exports the sampler's weights
    assert [s.name.split()[1] for s in steps] == [lc.launch_id for lc in launches]
    peaks = launch_host_peaks(contract, cpu, launches)
    for i, (step, lc) in enumerate(zip(steps, launches, strict=True)):
        held = jobs == "" and on == "" and i + 1 < len(steps)
        assert step.terms.get("launcher_ahead") == (INTERPRETER_BYTES if held else None)
        assert peaks[lc.launch_id] == step.host_peak - (INTERPRETER_BYTES if held else 0)
    gpu = Machine(devices=4, device_bytes=80 * 10**9, host_bytes=10**12, cores=16)
    assert all("launcher_ahead" not in s.terms for s in launch_steps(contract, gpu))


@pytest.mark.slow  # seconds of real launches and waits: .ci/run's slow step
def test_an_interrupted_stage_shuts_the_launch_waiting_ahead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real candidate stage, its launches the fake harness: the second launch's launcher
    waits ahead while the first launch's ranks run; Ctrl-C then ends the first launch's tree,
    the second never forks a rank, and no process of either is left."""
    from qualify.candidate import stage
    from qualify.progress import Progress

    pytest.importorskip("megatron.core")  # the second launch's engine must be available
    contract, reference = _default_stage(monkeypatch)
    fake = write_fake(tmp_path / "pkg")
    attempts: list[Path] = []

    def fake_launch_engine(cell: Any, *, engine: Any, attempt_dir: Path, timeout_s: float,
                           cuda: bool, gate: ahead.Gate | None = None) -> LaunchResult:
        attempts.append(attempt_dir)
        return launch(_cell(attempt_dir, "sleep" if len(attempts) == 1 else None),
                      module="pkg_fake.harness:main", attempt_dir=attempt_dir,
                      timeout_s=timeout_s, env=fake, launcher="warm", gate=gate)

    def interrupt(self: Progress, step: str) -> None:  # the stage waits for the first launch
        _wait_for(lambda: len(attempts) == 2 and _waiting(attempts[1]))
        _wait_for(lambda: len(list(attempts[0].glob("pid*"))) == 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(stage, "launch_engine", fake_launch_engine)
    monkeypatch.setattr(Progress, "advance", interrupt)
    monkeypatch.setattr(ahead, "mem_available", lambda: 10**15)  # room, whatever the box
    with pytest.raises(KeyboardInterrupt):
        stage.run_candidate_stage(contract, reference=reference, root=tmp_path / "ev",
                                  cells=["torch_tp-fp32-*", "megatron-fp32-*"], quiet=True)
    assert [a.parent.name for a in attempts] == ["torch_tp-a2c1-a1c2", "megatron-a2c1-a1c2"]
    assert not list(attempts[1].glob("pid*")), "a rank of the launch waiting ahead ran"
    for pid in (int(p.read_text()) for p in attempts[0].glob("pid*")):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == \
            psutil.STATUS_ZOMBIE
    assert psutil.Process().children(recursive=True) == []


@pytest.mark.slow  # seconds of real launches and waits: .ci/run's slow step
def test_a_gated_torchrun_launch_is_cancelled_when_its_gate_shuts(
        tmp_path: Path, gates: list[ahead.Gate]) -> None:
    """Not the warm launcher: it starts when its gate opens, and a shut still ends it."""
    att, gate, thread, out = _gated(tmp_path, gates, "sleep", launcher="torchrun")
    time.sleep(1.0)
    assert not (att / "logs" / "launcher.log").exists()  # it waits for its turn here
    gate.open()
    _wait_for(lambda: len(list(att.glob("pid*"))) == 2, timeout_s=120)
    t0 = time.monotonic()
    gate.shut()
    thread.join(60)
    (res,) = out
    assert time.monotonic() - t0 < 30
    assert res.status == "ERROR"
    assert res.reason.startswith("cancelled"), res.reason
    assert not res.ahead


def test_a_failed_launch_shuts_the_next_gate() -> None:
    failed: Future[LaunchResult] = Future()
    failed.set_exception(OSError("disk full"))
    gate = ahead.Gate()
    gate.open_after(failed)
    assert gate.cancelled.is_set()
    assert not gate.wait()
    assert os.read(gate.stdin, 8) == b""
    gate.release()
    gate.release()  # twice is safe
    ok: Future[LaunchResult] = Future()
    ok.set_result(cast(LaunchResult, None))
    nxt = ahead.Gate()
    nxt.open_after(ok)
    assert nxt.wait()
    assert os.read(nxt.stdin, 8) == ahead.START_BYTE
    nxt.release()


def test_a_contract_the_plan_cannot_size_runs_one_launch_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage's plan of the launches raises ContractError (a model without manifest
    sizes): no gate, nothing ahead; the contract runs unplanned, one launch at a time."""
    from qualify.candidate import stage

    contract, reference = _default_stage(monkeypatch)

    def unsized(*args: Any, **kwargs: Any) -> Any:
        raise ContractError("model.manifest.config: missing")

    seen: list[object] = []

    def first_launch(cell: Any, *, engine: Any, attempt_dir: Path, timeout_s: float,
                     cuda: bool, gate: ahead.Gate | None = None) -> LaunchResult:
        seen.append(gate)
        raise RuntimeError("stop after the first launch call")

    monkeypatch.setattr(stage, "launch_host_peaks", unsized)
    monkeypatch.setattr(stage, "launch_engine", first_launch)
    with pytest.raises(RuntimeError, match="stop after the first launch call"):
        stage.run_candidate_stage(contract, reference=reference, root=tmp_path / "ev",
                                  cells=["torch_tp-fp32-*", "megatron-fp32-*"], quiet=True)
    assert seen == [None]


@pytest.mark.slow  # seconds of real launches and waits: .ci/run's slow step
def test_a_signal_while_importing_ends_the_launcher_at_once(tmp_path: Path) -> None:
    """SIGTERM (the death signal of a killed qualify) during a slow import: no wait for it."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "slowimp.py").write_text("import time\ntime.sleep(60)\n")
    with _hand_launcher(tmp_path, "--preload", "slowimp") as proc:
        assert proc.stdout is not None
        time.sleep(2.0)  # inside slowimp's import
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 5.0
        assert b"signal 15 before any rank started" in proc.stdout.read()
    assert not list((tmp_path / "out").glob("pid*"))


def test_the_launcher_refuses_a_closed_stdin(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import os, sys; os.close(0); from qualify.candidate.warm "
         "import main; sys.exit(main(['--nproc-per-node', '1', '--log-dir', 'x', "
         "'--wait-stdin', 'pkg_fake.harness:main', 'cell.json']))"],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path)
    assert proc.returncode == 2
    assert "--wait-stdin: stdin is not open" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # seconds of real launches and waits: .ci/run's slow step
def test_what_a_launch_leaves_in_its_group_is_ended(tmp_path: Path) -> None:
    """A rank's own child outlives its launcher: launch() ends it before it returns."""
    harness = tmp_path / "pkg" / "pkg_stray"
    harness.mkdir(parents=True)
    (harness / "__init__.py").write_text("")
    (harness / "harness.py").write_text(
        "import os, subprocess, sys\n"
        "from pathlib import Path\n"
        "def main(argv):\n"
        "    if os.environ['RANK'] == '0':\n"
        "        p = subprocess.Popen(['sleep', '120'])\n"
        "        Path(sys.argv[-1]).parent.joinpath('stray').write_text(str(p.pid))\n"
        "    return 0\n")
    att = tmp_path / "attempt-1"
    res = launch(_cell(att), module="pkg_stray.harness:main", attempt_dir=att, timeout_s=120,
                 env={"PYTHONPATH": str(tmp_path / "pkg")}, launcher="warm")
    assert res.status == "ERROR"  # no outputs written; what matters is the stray below
    stray = int((att / "stray").read_text())
    assert not psutil.pid_exists(stray) or psutil.Process(stray).status() == \
        psutil.STATUS_ZOMBIE
    assert "outlived its launcher: ended" in res.launcher_log.read_text()
