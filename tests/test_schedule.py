"""The xdist scheduling of tests/conftest.py: which modules stay on one worker, in what order.

A module renamed or removed would silently leave :data:`conftest.ONE_WORKER` (its expensive
fixtures then built on both workers) or :data:`conftest.FIRST` (its shared artifact then
built late, while the other worker waits on the lock): every name must be a test module.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from conftest import (
    AFTER_BUILDERS,
    COST_S,
    FIRST,
    ONE_WORKER,
    one_worker_scope,
    pytest_xdist_make_scheduler,
    unit_rank,
)

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


class _Config:
    """What LoadScopeScheduling reads of a pytest config: ``--tx`` (2 workers), ``--dist``
    and the size reordering xdist does by default."""

    option = SimpleNamespace(loadscopereorder=True)

    def getvalue(self, name: str) -> Any:
        return {"tx": ["2*popen"], "dist": "load"}[name]


class _Node:
    """A worker that records the test indexes it is sent."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent.extend(indexes)

    def shutdown(self) -> None:
        self.shutting_down = True


def test_the_real_scheduler_starts_the_two_builders_on_separate_workers() -> None:
    """xdist's own LoadScopeScheduling with conftest's hook, two fake workers: the first
    units sent are FIRST's modules, one each; the one-worker modules arrive whole."""
    collection = [
        "tests/test_cli.py::test_a", "tests/test_cli.py::test_b",
        "tests/test_diverge.py::test_c", "tests/test_diverge.py::test_d",
        "tests/test_fsdp2.py::test_e", "tests/test_fsdp2.py::test_f",
        "tests/test_fsdp2.py::test_g",
        "tests/test_megatron_harness.py::test_h", "tests/test_megatron_harness.py::test_i",
        "tests/test_megatron_harness.py::test_j",
        "tests/test_tamper_real_run.py::test_k", "tests/test_tamper_real_run.py::test_l",
        "tests/test_tamper_real_run.py::test_m", "tests/test_tamper_real_run.py::test_n"]
    sched = pytest_xdist_make_scheduler(_Config(), None)  # type: ignore[arg-type]
    nodes = [_Node("gw0"), _Node("gw1")]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    modules = [{collection[i].split("::")[0] for i in node.sent} for node in nodes]
    assert modules == [{"tests/test_megatron_harness.py"}, {"tests/test_tamper_real_run.py"}]
    # gw1 finishes all but two of its tests: it is sent the next unit, fsdp2, whole
    for i in nodes[1].sent[:2]:
        sched.mark_test_complete(nodes[1], i)
    fsdp2 = [i for i, n in enumerate(collection) if "test_fsdp2" in n]
    assert nodes[1].sent[4:] == fsdp2
