"""The xdist scheduling of tests/conftest.py: which modules stay on one worker, in what order.

A module renamed or removed would silently leave :data:`conftest.ONE_WORKER` (its expensive
fixtures then built on both workers) or :data:`conftest.FIRST` (its shared artifact then
built late, while the other worker waits on the lock): every name must be a test module.
"""

from __future__ import annotations

from pathlib import Path

from conftest import AFTER_BUILDERS, COST_S, FIRST, ONE_WORKER, one_worker_scope, unit_rank

TESTS = Path(__file__).resolve().parent


def test_every_named_module_exists() -> None:
    for stem in ONE_WORKER | set(FIRST) | AFTER_BUILDERS | set(COST_S):
        assert (TESTS / f"{stem}.py").is_file(), stem


def test_builders_and_their_readers_are_one_worker_units() -> None:
    assert set(FIRST) <= ONE_WORKER
    assert AFTER_BUILDERS <= ONE_WORKER
    assert not AFTER_BUILDERS & set(FIRST)
    assert len(FIRST) == 2  # one per worker of the README's `-n 2`


def test_units() -> None:
    assert one_worker_scope("tests/test_fsdp2.py::test_x[a]") == "tests/test_fsdp2.py"
    assert one_worker_scope("tests/test_cli.py::test_x[a]") == "tests/test_cli.py::test_x[a]"


def test_rank_orders_builders_then_costly_modules_then_readers_then_singles() -> None:
    scopes = ["tests/test_cli.py::test_a", "tests/test_pipeline.py::test_b",
              "tests/test_vllm_rollout.py", "tests/test_packaging.py", "tests/test_fsdp2.py",
              "tests/test_tamper_real_run.py", "tests/test_megatron_harness.py",
              "tests/test_diverge.py"]
    assert sorted(scopes, key=unit_rank) == [
        "tests/test_megatron_harness.py", "tests/test_tamper_real_run.py",
        "tests/test_fsdp2.py", "tests/test_packaging.py",
        "tests/test_vllm_rollout.py", "tests/test_diverge.py",
        "tests/test_pipeline.py::test_b", "tests/test_cli.py::test_a"]
