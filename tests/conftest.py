"""Keep each module whose fixtures are expensive real runs on one pytest-xdist worker.

The README's test command runs ``pytest -n 2``, which distributes tests one by one
(``--dist load``): a module's tests land on both workers, and each worker then builds the
module's fixtures. For most modules that costs nothing; for the modules in
:data:`ONE_WORKER` it repeats minutes of real work (the Megatron harness's reference and
launches, the vLLM sampler's engine starts, the FSDP2 launches, the kill-point job, the
wheel install). :func:`pytest_xdist_make_scheduler` gives ``load`` a scheduler that sends
all tests of each such module to one worker as one unit, largest unit first (xdist's
``loadscope`` ordering), and every other test on its own, so the long chains start early
and the short tests fill in around them.

(xdist's own ``--dist loadgroup`` with ``xdist_group`` marks would do the same, but with
pytest 9 it groups nothing: it renames ``item._nodeid``, which ``Item.nodeid`` no longer
reads.) An explicit ``--dist`` other than ``load`` is left as it is.

Artifacts several modules need (the tiny contract's reference and 8-cell run, the default
contract's reference) are shared across modules and workers by :mod:`shared_artifacts`: the
first worker that asks builds one while a second one waits on its file lock. So the units
are not handed out by size alone (:func:`unit_rank`): the two modules that build those
artifacts (:data:`FIRST`) start at once, one on each worker; then the other expensive
modules, longest first (:data:`COST_S`); then the modules that read what :data:`FIRST`
built (:data:`AFTER_BUILDERS`: by then it is there, nobody waits); then the single tests,
those of the costlier modules first, so that the cheapest fill the end of both workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import Any

import pytest

ONE_WORKER = frozenset({
    "test_diverge",  # reference: the shared tiny reference, 2 one-cell runs + diverge (slow)
    "test_fsdp2",  # runs: each launch cached in the worker's process (5 launches)
    "test_html_passing",  # passing: a copy of the shared tiny chain and its HTML page
    "test_kill_points",  # kit + clean: keygen, reference, candidate, compare
    "test_lr_schedule",  # deepspeed_lrs: one DeepSpeed probe process
    "test_megatron_bf16_finding",  # finding: one torchrun launch of the repro script
    "test_deepspeed",  # runs: 2 DeepSpeed launches, file-locked
    "test_megatron_harness",  # report: reference + 2 Megatron launches
    "test_packaging",  # installed: wheel build, venv, install
    "test_resume_deepspeed",  # runs: 5 launches, each after the save launch
    "test_resume_fsdp2",  # runs: 5 launches per topology, each after the save launch
    "test_resume_megatron",  # runs: 5 launches, each after the save launch
    "test_resume_torch_tp",  # runs: 5 launches, each after the save launch
    "test_slurm",  # the real jobs; it submits test_slurm_timeout's job as it starts
    "test_tamper_real_run",  # real_world: the shared tiny chain, copied, sealed, signed
    "test_vllm_rollout",  # reference: the shared default reference (a vLLM engine start)
    "test_vllm_sampler",  # run / tied_run: one vLLM harness start each
})
"""Test modules (file stems) whose tests all go to one xdist worker, with the fixture
that makes them expensive. The resume and DeepSpeed modules share their launches across
workers through file locks, but every test of a resume module needs the ``save`` launch
first: split over two workers, one built while the other waited on its lock (about 15 s of
each module's 30-45 s of worker time in a measured run of the suite, 2026-12-04). The Slurm
timeout test (``test_slurm_timeout``) waits over a minute for Slurm's time limit: its job
is submitted when ``test_slurm`` starts and the test is handed out last
(:data:`COST_S` below 0), by when the job has ended."""


FIRST = ("test_megatron_harness", "test_tamper_real_run")
"""Started first, one on each worker: the builders of the shared artifacts
(:func:`shared_artifacts.default_reference`; :func:`~shared_artifacts.tiny_reference` and
:func:`~shared_artifacts.tiny_chain`), each among the longest chains of the suite."""

AFTER_BUILDERS = frozenset({"test_diverge", "test_html_passing", "test_vllm_rollout"})
""":data:`ONE_WORKER` modules that only read what :data:`FIRST` builds: handed out after
the other expensive modules, when the artifact exists (else a worker would idle on the
lock while the other builds)."""

COST_S = {
    "test_fsdp2": 120, "test_vllm_sampler": 110, "test_kill_points": 100,
    "test_packaging": 90, "test_slurm": 85, "test_megatron_bf16_finding": 40,
    "test_lr_schedule": 30, "test_pipeline": 30, "test_resume_megatron": 25,
    "test_resume_fsdp2": 25, "test_deepspeed": 20, "test_resume_torch_tp": 18,
    "test_resume_deepspeed": 16,
    "test_slurm_timeout": -1,  # last: test_slurm submitted its job when it started
}
"""Rough relative cost (only the order it gives matters; unlisted: 0): of the whole unit for
:data:`ONE_WORKER` modules (fsdp2 and the vLLM sampler took about the same in a loaded run
of the suite, the others fewer launches), of one test for modules of single tests
(test_pipeline: each test is a real candidate launch)."""


def one_worker_scope(nodeid: str) -> str:
    """The scheduling unit of a test: its module for :data:`ONE_WORKER`, else itself."""
    module = nodeid.split("::", 1)[0]
    return module if PurePosixPath(module).stem in ONE_WORKER else nodeid


def unit_rank(scope: str) -> tuple[int, float]:
    """The order units are handed out in (smallest first): :data:`FIRST` in its order, the
    other :data:`ONE_WORKER` modules by :data:`COST_S`, :data:`AFTER_BUILDERS`, then single
    tests by their module's :data:`COST_S`."""
    stem = PurePosixPath(scope.split("::", 1)[0]).stem
    if stem in FIRST:
        return 0, FIRST.index(stem)
    cost = -float(COST_S.get(stem, 0))
    if stem not in ONE_WORKER:
        return 3, cost
    return (2 if stem in AFTER_BUILDERS else 1), cost


@pytest.hookimpl(optionalhook=True)  # pytest -p no:xdist: the hook does not exist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """For ``--dist load`` (``-n N`` alone): :func:`one_worker_scope` units in
    :func:`unit_rank` order."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class OneWorkerModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return one_worker_scope(nodeid)

        ranked = False

        def _assign_work_unit(self, node: Any) -> None:
            # LoadScopeScheduling fills its queue (largest unit first), then pops its first
            # unit per assignment: before the first one, order the queue by unit_rank
            # (sorted is stable: the size order stays among equals). A unit a crashed
            # worker leaves is put back at the front by xdist, as before.
            if not self.ranked:
                for scope in sorted(self.workqueue, key=unit_rank):
                    self.workqueue.move_to_end(scope)
                self.ranked = True
            super()._assign_work_unit(node)

    return OneWorkerModules(config, log)




@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread for tiny models (two spin against each other on a loaded 2-core
    machine: 100x the wall); restored after."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
