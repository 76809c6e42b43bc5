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
contract's reference) are shared across modules and workers by :mod:`shared_artifacts`.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import pytest

ONE_WORKER = frozenset({
    "test_diverge",  # reference: the shared tiny reference, 2 one-cell runs + diverge
    "test_fsdp2",  # runs: each launch cached in the worker's process (5 launches)
    "test_kill_points",  # kit + clean: keygen, reference, candidate, compare
    "test_megatron_bf16_finding",  # finding: one torchrun launch of the repro script
    "test_megatron_harness",  # report: reference + 2 Megatron launches
    "test_packaging",  # installed: wheel build, venv, install
    "test_tamper_real_run",  # real_world: the shared tiny chain, copied, sealed, signed
    "test_vllm_rollout",  # reference: the shared default reference (a vLLM engine start)
    "test_vllm_sampler",  # run / tied_run: one vLLM harness start each
})
"""Test modules (file stems) whose tests all go to one xdist worker, with the fixture
that makes them expensive."""


def one_worker_scope(nodeid: str) -> str:
    """The scheduling unit of a test: its module for :data:`ONE_WORKER`, else itself."""
    module = nodeid.split("::", 1)[0]
    return module if PurePosixPath(module).stem in ONE_WORKER else nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """For ``--dist load`` (``-n N`` alone): :func:`one_worker_scope` units."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class OneWorkerModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return one_worker_scope(nodeid)

    return OneWorkerModules(config, log)
