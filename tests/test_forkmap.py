"""qualify.forkmap: forked workers give the results a serial map gives; the comparator's cells
judged in forked workers give the report judged here."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from qualify import forkmap
from qualify.compare import stage
from qualify.resources import repo_root


def _square_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


def _fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError(f"item {x}")
    return x


def _sigint(_x: int) -> bool:
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_fork_map_keeps_the_order_and_forks_only_when_asked() -> None:
    items = list(range(7))
    forked = forkmap.fork_map(_square_pid, items, workers=2)
    assert [r for r, _ in forked] == [x * x for x in items]
    assert os.getpid() not in {pid for _, pid in forked}  # drawn in the workers
    here = forkmap.fork_map(_square_pid, items, workers=1)
    assert here == [(x * x, os.getpid()) for x in items]
    assert forkmap.fork_map(_square_pid, [5], workers=4) == [(25, os.getpid())]
    assert forkmap.fork_map(_square_pid, [], workers=4) == []


def test_fork_map_raises_the_workers_exception_and_workers_ignore_sigint() -> None:
    with pytest.raises(ValueError, match="item 3"):
        forkmap.fork_map(_fail_on_three, list(range(6)), workers=2)
    assert forkmap.fork_map(_sigint, [0, 1], workers=2) == [True, True]
    assert forkmap.fork_map(_sigint, [0, 1], workers=1) == [False, False]


def _committed_run() -> Path:
    runs = sorted(p for p in (repo_root() / "evidence" / "tiny-qwen3").glob("2*")
                  if p.is_dir())
    if not runs:
        pytest.skip("the committed tiny-qwen3 evidence is not checked out")
    return runs[-1]


def test_cells_judged_in_forked_workers_give_the_report_judged_here(
        monkeypatch: pytest.MonkeyPatch) -> None:
    run = _committed_run()
    used: list[int | None] = []
    real = stage.fork_map

    def counting(fn, items, *, workers=None):  # type: ignore[no-untyped-def]
        used.append(workers)
        return real(fn, items, workers=workers)

    monkeypatch.setattr(stage, "fork_map", counting)
    monkeypatch.setattr(stage, "default_workers", lambda n: 1)
    here = stage.compare_run(run, write=False).to_dict()
    monkeypatch.setattr(stage, "default_workers", lambda n: 2)
    forked = stage.compare_run(run, write=False).to_dict()
    assert used == [1, 2]
    assert len(here["cells"]) >= stage.FORK_CELLS
    assert forked.pop("created") != ""
    here.pop("created")  # when each was judged: the one field that may differ
    assert forked == here
