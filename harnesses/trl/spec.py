"""The ``trl`` engine spec: TRL 1.16.0's GRPOTrainer, in its own venv (not registered yet).

Registered at merge, once an engine can name its interpreter (``.venv-trl/bin/python``,
``scripts/install_trl.sh``); importing this module imports neither torch nor TRL.
"""

from __future__ import annotations

from typing import Final

from qualify.registry import Axis, EngineSpec

ALGORITHMS: Final = ("policy_loss=gspo", "policy_loss=cispo", "clip_ratio_low=*",
                     "clip_ratio_high=*", "kl_loss_bias_correction=true",
                     "loss_agg_mode=seq-mean-token-sum-norm")
"""The variants beyond the protocol's base that TRL runs (:mod:`harnesses.trl.translate`;
the base's own forms TRL lacks, a critic, decoupled PPO, k1 / k2, are named by
:func:`harnesses.trl.translate.unsupported`)."""

SPEC: Final = EngineSpec(
    name="trl",
    entry="harnesses.trl.harness:main",
    axes=(Axis(name="tp", degrees=(1,), description="one process, the actor alone"),),
    distributions=("torch", "trl", "transformers", "accelerate"),
    requires=("trl",),
    bf16_style="autocast",  # GRPOConfig(bf16=True): accelerate's bf16 autocast, FP32 weights
    algorithms=ALGORITHMS,
    description="TRL 1.16.0 GRPOTrainer: its own compute_loss, backward, grad clip and AdamW "
                "step on the frozen rollout (CPU)",
)
"""TRL: TP 1, actor only; FP32 and BF16 (autocast)."""
