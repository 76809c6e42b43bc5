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
    bf16_style="params",  # BF16 ZeRO engine: BF16 module, FP32 master partitions
    description="DeepSpeed ZeRO 0/1/2 + AutoTP; runs on CPU with DS_ACCELERATOR=cpu",
)
"""DeepSpeed: TP axis, the ZeRO stage option; one launch per topology runs every variant."""
