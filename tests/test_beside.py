"""qualify.candidate.beside: the sampler cells' thread beside the trainer launches."""

from __future__ import annotations

import threading
import time

import pytest

from qualify.candidate import beside
from qualify.errors import UsageError


@pytest.mark.parametrize(("env", "cuda", "want"), [
    ({}, False, 2), ({}, True, 1), ({"QUALIFY_JOBS": "1"}, False, 1),
    ({"QUALIFY_JOBS": "2"}, True, 2), ({"QUALIFY_JOBS": "8"}, False, 2)])
def test_jobs(env: dict[str, str], cuda: bool, want: int) -> None:
    assert beside.jobs(cuda=cuda, env=env) == want


@pytest.mark.parametrize("raw", ["0", "-1", "two", "1.5"])
def test_jobs_refuses_bad_values(raw: str) -> None:
    with pytest.raises(UsageError, match=f"QUALIFY_JOBS={raw!r}: must be a positive integer"):
        beside.jobs(cuda=False, env={"QUALIFY_JOBS": raw})


def test_start_is_none_with_one_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUALIFY_JOBS", "1")
    assert beside.start(lambda: None, cuda=False) is None


def test_fn_waits_for_go_then_runs_in_another_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QUALIFY_JOBS", raising=False)
    ran: list[str] = []
    thread = beside.start(lambda: ran.append(threading.current_thread().name), cuda=False)
    assert thread is not None
    time.sleep(0.2)
    assert ran == []  # not before go()
    thread.go()
    thread.result()
    assert ran == ["qualify-sampler-cells"]


def test_result_reraises_and_cancel_never_starts() -> None:
    def boom() -> None:
        raise RuntimeError("sampler failed")

    failing = beside.Beside(boom)
    failing.start()
    with pytest.raises(RuntimeError, match="sampler failed"):
        failing.result()  # result() also lets a thread that was never told to go run
    ran: list[int] = []
    cancelled = beside.Beside(lambda: ran.append(1))
    cancelled.start()
    with pytest.raises(KeyError), beside.cancelled_on_error(cancelled):
        raise KeyError("stage failed")
    cancelled.result()
    assert ran == []
