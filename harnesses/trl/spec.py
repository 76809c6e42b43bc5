"""The ``trl`` engine spec: TRL 1.16.0's GRPOTrainer, in its own venv.

TRL pins a transformers above qualify's own: its ranks run in the venv
``scripts/install_trl.sh`` builds, named by ``--launcher trl=...`` or
``QUALIFY_LAUNCHER_TRL`` (:mod:`qualify.candidate.interpreter`); with neither, nor ``trl``
in qualify's environment, its cells are ``NOT_RUN`` saying so (:data:`INSTALL_HINT`).
Importing this module imports neither torch nor TRL.
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

INSTALL_HINT: Final = (
    "TRL 1.16.0 runs in its own venv; build it with `bash scripts/install_trl.sh` and run "
    "with --launcher trl=.venv-trl/bin/python")
"""The end of every ``trl`` cell's ``NOT_RUN`` reason when TRL is nowhere to run
(:attr:`qualify.registry.EngineSpec.install_hint`)."""


SPEC: Final = EngineSpec(
    name="trl",
    entry="harnesses.trl.harness:main",
    axes=(Axis(name="tp", degrees=(1,), description="one process, the actor alone"),),
    distributions=("torch", "trl", "transformers", "accelerate"),
    requires=("trl",),
    bf16_style="autocast",  # GRPOConfig(bf16=True): accelerate's bf16 autocast, FP32 weights
    algorithms=ALGORITHMS,
    install_hint=INSTALL_HINT,
    description="TRL 1.16.0 GRPOTrainer: its own compute_loss, backward, grad clip and AdamW "
                "step on the frozen rollout (CPU; its own venv, scripts/install_trl.sh)",
)
"""TRL: TP 1, actor only; FP32 and BF16 (autocast)."""
