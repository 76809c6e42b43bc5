"""qualify.candidate.beside: the sampler cells' thread beside the trainer launches."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qualify.candidate import beside
from qualify.errors import UsageError
from qualify.resources import contracts_dir, repo_root


@pytest.mark.parametrize(("env", "cuda", "want"), [
    ({}, False, 2), ({}, True, 1), ({"QUALIFY_JOBS": "1"}, False, 1),
    ({"QUALIFY_JOBS": "2"}, True, 2), ({"QUALIFY_JOBS": "8"}, False, 2)])
def test_jobs(env: dict[str, str], cuda: bool, want: int) -> None:
    assert beside.jobs(cuda=cuda, env=env) == want


@pytest.mark.parametrize("raw", ["0", "-1", "two", "1.5"])
def test_jobs_refuses_bad_values(raw: str) -> None:
    with pytest.raises(UsageError, match=f"QUALIFY_JOBS={raw!r}: must be a positive integer"):
        beside.jobs(cuda=False, env={"QUALIFY_JOBS": raw})


def test_no_thread_with_one_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUALIFY_JOBS", "1")
    with beside.running(lambda stop: None, cuda=False) as thread:
        assert thread is None


def test_fn_waits_for_go_then_runs_in_another_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QUALIFY_JOBS", raising=False)
    ran: list[str] = []
    with beside.running(lambda stop: ran.append(threading.current_thread().name),
                        cuda=False) as thread:
        assert thread is not None
        time.sleep(0.2)
        assert ran == []  # not before go()
        thread.go()
        thread.result()
    assert ran == ["qualify-sampler-cells"]


def test_result_reraises_what_fn_raised() -> None:
    def boom(stop: threading.Event) -> None:
        raise RuntimeError("sampler failed")

    failing = beside.Beside(boom)
    failing.start()
    with pytest.raises(RuntimeError, match="sampler failed"):
        failing.result()  # result() also lets a thread that was never told to go run


def test_a_failing_stage_stops_and_joins_the_thread(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Before go(): fn never starts. After go(): fn sees stop and the thread is joined before
    the stage's exception goes on; fn's own error is printed, not lost."""
    monkeypatch.delenv("QUALIFY_JOBS", raising=False)
    ran: list[int] = []
    with pytest.raises(KeyError), beside.running(lambda stop: ran.append(1), cuda=False):
        raise KeyError("stage failed")
    assert ran == []
    seen: list[bool] = []
    entered = threading.Event()

    def cell_loop(stop: threading.Event) -> None:
        entered.set()
        assert stop.wait(timeout=30)  # what a sampler cell's procs.run(cancel=stop) sees
        seen.append(stop.is_set())
        raise OSError("sampler cell cancelled")

    started: list[beside.Beside] = []

    def failing_stage() -> None:
        with beside.running(cell_loop, cuda=False) as thread:
            assert thread is not None
            started.append(thread)
            thread.go()
            assert entered.wait(timeout=30)  # the cell is running when the stage fails
            raise KeyError("stage failed")

    with pytest.raises(KeyError):
        failing_stage()
    assert not started[0].is_alive()
    assert seen == [True]
    assert "also failed: OSError: sampler cell cancelled" in capsys.readouterr().err


@pytest.mark.parametrize(("var", "value", "message"), [
    ("QUALIFY_LAUNCHER", "bogus", "QUALIFY_LAUNCHER='bogus': must be one of warm, torchrun, srun"),
    ("QUALIFY_JOBS", "0", "QUALIFY_JOBS='0': must be a positive integer"),
    ("QUALIFY_AHEAD", "yes", "QUALIFY_AHEAD='yes': must be 0 or 1"),
    ("QUALIFY_NNODES", "x", "QUALIFY_NNODES='x': must be a positive integer")])
def test_bad_launch_settings_exit_2_before_any_run_is_written(
        tmp_path: Path, var: str, value: str, message: str) -> None:
    reference = next(repo_root().glob("references/tiny-qwen3-*"), None)
    if reference is None:
        pytest.skip("the committed tiny-qwen3 reference is not checked out")
    proc = subprocess.run(
        [sys.executable, "-m", "qualify", "candidate", str(contracts_dir() / "tiny-qwen3.toml"),
         "--reference", str(reference), "--out", str(tmp_path / "ev"), "--quiet"],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, var: value})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"qualify: error: {message}"
    assert not (tmp_path / "ev").exists()  # no INCOMPLETE run left to break a gate
