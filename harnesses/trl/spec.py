"""The ``trl`` engine spec: TRL 1.16.0's GRPOTrainer, in its own venv.

TRL 1.16.0 pins a transformers above qualify's own, so its ranks run in the venv that
``scripts/install_trl.sh`` builds (``.venv-trl``), named at launch:
``qualify run CONTRACT --launcher trl=.venv-trl/bin/python`` (or the engine's
``QUALIFY_LAUNCHER_<ENGINE>`` setting; :mod:`qualify.candidate.interpreter`). Without it,
and with no ``trl`` importable in qualify's own environment, the engine's cells are ``NOT_RUN`` with
:data:`INSTALL_REASON`. Importing this module imports neither torch nor TRL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from qualify.candidate.interpreter import env_name
from qualify.registry import Axis, EngineSpec

ALGORITHMS: Final = ("policy_loss=gspo", "policy_loss=cispo", "clip_ratio_low=*",
                     "clip_ratio_high=*", "kl_loss_bias_correction=true",
                     "loss_agg_mode=seq-mean-token-sum-norm")
"""The variants beyond the protocol's base that TRL runs (:mod:`harnesses.trl.translate`;
the base's own forms TRL lacks, a critic, decoupled PPO, k1 / k2, are named by
:func:`harnesses.trl.translate.unsupported`)."""

INSTALL_REASON: Final = (
    f"engine 'trl' is not installed here (no module 'trl', no {env_name('trl')}): TRL "
    "1.16.0 runs in its own venv; build it with `bash scripts/install_trl.sh` and run with "
    "--launcher trl=.venv-trl/bin/python")
"""The ``NOT_RUN`` reason of every ``trl`` cell when TRL is nowhere to run."""


class TrlEngineSpec(EngineSpec):
    """:class:`~qualify.registry.EngineSpec` whose "not installed" reason names the script."""

    def unavailable_reason(self, cuda_available: bool | None = None, *,
                           variants: Sequence[str] = ()) -> str | None:
        """:meth:`EngineSpec.unavailable_reason`, a missing ``trl`` as :data:`INSTALL_REASON`.

        Raises:
            UsageError: the engine's ``QUALIFY_LAUNCHER_<ENGINE>`` is set to a bad value.
        """
        reason = super().unavailable_reason(cuda_available, variants=variants)
        if reason is not None and reason.startswith(f"engine {self.name!r} is not installed"):
            return INSTALL_REASON
        return reason


SPEC: Final = TrlEngineSpec(
    name="trl",
    entry="harnesses.trl.harness:main",
    axes=(Axis(name="tp", degrees=(1,), description="one process, the actor alone"),),
    distributions=("torch", "trl", "transformers", "accelerate"),
    requires=("trl",),
    bf16_style="autocast",  # GRPOConfig(bf16=True): accelerate's bf16 autocast, FP32 weights
    algorithms=ALGORITHMS,
    description="TRL 1.16.0 GRPOTrainer: its own compute_loss, backward, grad clip and AdamW "
                "step on the frozen rollout (CPU; its own venv, scripts/install_trl.sh)",
)
"""TRL: TP 1, actor only; FP32 and BF16 (autocast)."""
