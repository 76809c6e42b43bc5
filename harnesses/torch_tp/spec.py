"""The ``torch_tp`` engine spec: PyTorch-native tensor parallelism, no number-changing option.

Registered in :data:`qualify.registry.BUILTIN_ENGINES`; importing this module imports
neither torch nor the harness.
"""

from __future__ import annotations

from typing import Final

from qualify.registry import TP_AXIS, EngineSpec

SPEC: Final = EngineSpec(
    name="torch_tp",
    entry="harnesses.torch_tp.harness:main",
    axes=(TP_AXIS,),
    distributions=("torch",),
    groups_variants=True,  # one launch per topology runs the fp32 and bf16 variants
    resumes=True,  # harnesses/torch_tp/resume.py: torch.distributed.checkpoint
    groups_topologies=True,  # one launch per world size runs every topology (issue #17)
    bf16_style="autocast",  # torch.autocast over FP32 DTensor masters (harness.BF16_MECHANISM)
    diverge=True,  # takes cell.json probe (harnesses/layer_probe.py)
    description="PyTorch-native tensor parallelism (DTensor, parallelize_module); "
                "CPU (gloo) and CUDA (NCCL)",
)
"""PyTorch-native TP: the TP axis at 1, 2, 4, 8; no engine options."""
