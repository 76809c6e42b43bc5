"""The ``fsdp2`` engine spec: PyTorch FSDP2 (``fully_shard``), a data-parallel shard axis.

Registered in :data:`qualify.registry.BUILTIN_ENGINES`; importing this module imports
neither torch nor the harness.
"""

from __future__ import annotations

from typing import Final

from qualify.registry import Axis, EngineSpec

DP_AXIS: Final = Axis(name="dp", degrees=(1, 2),
                      description="FSDP2 shard degree: parameters, gradients and AdamW state "
                                  "sharded over dp ranks, each rank a slice of the batch rows")
"""The data-parallel shard axis (``matrix.engine_options.fsdp2.dp``; default 1)."""

TP_AXIS_FSDP2: Final = Axis(name="tp", degrees=(1,),
                            description="tensor parallel: TP 1 only (2-D FSDP2 x TP not built)")
"""TP 1 only: the harness shards over a 1-D ``("dp",)`` mesh (README: 2-D is not done)."""

SPEC: Final = EngineSpec(
    name="fsdp2",
    entry="harnesses.fsdp2.harness:main",
    axes=(TP_AXIS_FSDP2, DP_AXIS),
    distributions=("torch",),
    world_size_rule="(actor_tp+critic_tp)*dp",
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): BF16 unsharded parameters
    # for compute, all-gathered from FP32 sharded masters (harness.BF16_MECHANISM).
    bf16_style="params",
    description="PyTorch FSDP2 (fully_shard per decoder layer and root, MixedPrecisionPolicy, "
                "DTensor); CPU (gloo) and CUDA (NCCL)",
)
"""FSDP2: TP 1, the DP axis at 1 and 2; no engine options."""
