"""The ``fsdp2`` engine spec: PyTorch FSDP2 (``fully_shard``) x tensor parallelism (2-D).

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

TP_AXIS_FSDP2: Final = Axis(name="tp", degrees=(1, 2),
                            description="tensor parallel (parallelize_module before fully_shard: "
                                        "a 2-D (dp, tp) mesh per role at TP 2)")
"""TP 1 (a 1-D ``("dp",)`` mesh) and TP 2 (2-D ``("dp", "tp")``: TP first, then FSDP2 over dp).

Only 2 is declared above 1: it is the degree run and compared (tiny-qwen3: 4 heads, 2 KV
heads); the plan itself refuses any TP that does not divide the heads."""

SPEC: Final = EngineSpec(
    name="fsdp2",
    entry="harnesses.fsdp2.harness:main",
    axes=(TP_AXIS_FSDP2, DP_AXIS),
    distributions=("torch",),
    world_size_rule="(actor_tp+critic_tp)*dp",
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): BF16 unsharded parameters
    # for compute, all-gathered from FP32 sharded masters (harness.BF16_MECHANISM). The
    # sharded parameters keep the module's FP32 checkpoint values (orig_dtype =
    # sharded_param.dtype, torch 2.13 distributed/fsdp/_fully_shard/_fsdp_param.py:588);
    # only the all-gather input is cast (_fsdp_param.py:901, _to_dtype_if_needed(
    # sharded_param_data, self.param_dtype)): masters born from the checkpoint.
    resumes=True,  # harnesses/fsdp2/resume.py: torch.distributed.checkpoint (DCP)
    bf16_style="params",
    description="PyTorch FSDP2 (fully_shard per decoder layer and root, MixedPrecisionPolicy, "
                "DTensor), optionally over TP (parallelize_module, 2-D mesh); CPU (gloo) "
                "and CUDA (NCCL)",
)
"""FSDP2: TP 1 and 2, the DP axis at 1 and 2 (2-D at TP 2 x DP 2); no engine options."""
