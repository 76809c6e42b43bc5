"""The engine's spec, read by qualify (in qualify's environment) through its entry point.

Importing it needs ``qualify`` (for :class:`qualify.registry.EngineSpec`), never torch:
qualify imports it to plan cells; the harness module is imported only by the ranks.
"""

from __future__ import annotations

from typing import Final

from qualify.registry import Axis, EngineSpec

SPEC: Final = EngineSpec(
    name="example_tp1",
    entry="qualify_example_engine.harness:main",
    axes=(Axis(name="tp", degrees=(1,), description="no tensor parallelism"),),
    distributions=("qualify-example-engine", "torch", "transformers"),
    bf16_style="autocast",
    description="worked example: a plain single-process PyTorch trainer at TP 1, run in "
                "its own environment (examples/qualify-example-engine)",
)
