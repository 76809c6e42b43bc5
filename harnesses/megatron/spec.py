"""The ``megatron`` engine spec: Megatron-Core tensor parallelism, no number-changing option.

Registered in :data:`qualify.registry.BUILTIN_ENGINES`; importing this module imports
neither megatron nor the harness.
"""

from __future__ import annotations

from typing import Final

from qualify.registry import TP_AXIS, EngineSpec

SPEC: Final = EngineSpec(
    name="megatron",
    entry="harnesses.megatron.harness:main",
    axes=(TP_AXIS,),
    distributions=("megatron-core",),
    requires=("megatron",),
    groups_variants=True,  # one launch per world size: every variant and topology
    warm_imports=("megatron.core.models.gpt", "megatron.core.optimizer",
                  "megatron.core.distributed", "harnesses.megatron.train",
                  "harnesses.megatron.probe"),  # imported lazily by the harness
    groups_topologies=True,
    resumes=True,  # harnesses/megatron/resume.py: megatron-core's non-distributed checkpoint
    bf16_style="params",  # Float16Module BF16 parameters, FP32 main params in the optimizer
    description="Megatron-Core tensor parallelism; Megatron's own optimizer on CPU under "
                "placement-only shims (harnesses/megatron/cpu_shims.py) and on CUDA",
)
"""Megatron-Core: the TP axis at 1, 2, 4, 8; no engine options."""
