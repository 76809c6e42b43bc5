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
    # Float16Module BF16 parameters; Float16OptimizerWithFloat16Params makes each FP32 main
    # param from the BF16 parameter, main_param = param.detach().clone().float()
    # (megatron-core 0.16.1 megatron/core/optimizer/optimizer.py:674): masters born from
    # the BF16-cast parameters.
    bf16_style="castmasters",
    diverge=True,  # takes cell.json probe (harnesses/layer_probe.py)
    description="Megatron-Core tensor parallelism; Megatron's own optimizer on CPU under "
                "placement-only shims (harnesses/megatron/cpu_shims.py) and on CUDA",
)
"""Megatron-Core: the TP axis at 1, 2, 4, 8; no engine options."""
