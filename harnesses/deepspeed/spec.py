"""The ``deepspeed`` engine spec: ZeRO stage as a number-changing option, AutoTP as the TP axis.

Registered in :data:`qualify.registry.BUILTIN_ENGINES`; importing this module imports
neither deepspeed nor the harness.
"""

from __future__ import annotations

from typing import Final

from qualify.registry import TP_AXIS, EngineOption, EngineSpec

ZERO_STAGE: Final = EngineOption(
    name="zero_stage", key="zero", values=(0, 1, 2), default=(0,),
    description="ZeRO stage (0: none, 1: optimizer state, 2: + gradients partitioned); "
                "the harness runs stages 0, 1, 2",
)
"""``matrix.engine_options.deepspeed.zero_stage = [0, 1]`` -> cells ``...-zero0-...``."""

SPEC: Final = EngineSpec(
    name="deepspeed",
    entry="harnesses.deepspeed.harness:main",
    axes=(TP_AXIS,),
    options=(ZERO_STAGE,),
    distributions=("deepspeed",),
    cpu_env={"DS_ACCELERATOR": "cpu"},
    requires=("deepspeed",),
    groups_variants=True,
    resumes=True,  # harnesses/deepspeed/resume.py: engine.save_checkpoint / load_checkpoint
    # its import (accelerator, op probes) once per launch; and the Muon module every ZeRO
    # initialize imports lazily (runtime/zero/utils.py is_zero_supported_optimizer; its
    # torch.compile decorators import torch._dynamo): 1.9 s per rank, once, in each launch
    warm_imports=("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer"),
    groups_topologies=True,  # one launch per world size runs every topology (issue #17)
    # BF16 module, FP32 masters born from the BF16-cast parameters, at every ZeRO stage
    # (deepspeed 0.19.8): DeepSpeedEngine._configure_distributed_model casts the module's
    # parameters to BF16 (runtime/engine.py:2080-2088, _cast_module_mixed_precision) before
    # the optimizer is built; ZeRO 1/2 then clone the FP32 partitions from the BF16 groups
    # (runtime/zero/stage_1_and_2.py:560, parallel_partitioned_bit16_groups[i][partition_id]
    # .detach().clone().to(dtype=master_weights_and_grads_dtype)), ZeRO 0's
    # FP16_UnfusedOptimizer from the BF16 params (runtime/fp16/unfused_optimizer.py:78,
    # p.clone().float().detach()). Measured per role: engine_info
    # .initial_master_vs_checkpoint (harness.check_initial_masters).
    bf16_style="castmasters",
    diverge=True,  # takes cell.json probe (harnesses/layer_probe.py)
    description="DeepSpeed ZeRO 0/1/2 + AutoTP; runs on CPU with DS_ACCELERATOR=cpu",
)
"""DeepSpeed: TP axis, the ZeRO stage option; one launch per topology runs every variant."""
