"""The ``verl`` engine spec: verl 0.9.1's ``TrainingWorker`` (FSDP2, CPU), in its own venv.

verl 0.9.1 pins ``transformers<5.11``, below qualify's own, so its ranks run in the venv that
``scripts/install_verl.sh`` builds (``.venv-verl``), named at launch:
``qualify run CONTRACT --launcher verl=.venv-verl/bin/python`` (or the engine's
``QUALIFY_LAUNCHER_<ENGINE>`` setting; :mod:`qualify.candidate.interpreter`). Without it,
and with no ``verl`` importable in qualify's own environment, the engine's cells are ``NOT_RUN``
with :data:`INSTALL_REASON`. Importing this module imports neither torch nor verl.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from qualify.candidate.interpreter import env_name
from qualify.registry import Axis, EngineSpec

ALGORITHMS: Final = ("policy_loss=gspo", "clip_ratio_low=*", "clip_ratio_high=*",
                     "clip_ratio_c=*", "kl_loss_type=*", "loss_agg_mode=token-sum",
                     "loss_agg_mode=seq-mean-token-sum-norm")
"""The variants beyond the protocol's base that verl's ``ppo_loss`` runs
(:mod:`harnesses.verl.translate`; what it lacks is named by
:func:`harnesses.verl.translate.unsupported`)."""

INSTALL_REASON: Final = (
    f"engine 'verl' is not installed here (no module 'verl', no {env_name('verl')}): verl "
    "0.9.1 runs in its own venv; build it with `bash scripts/install_verl.sh` and run with "
    "--launcher verl=.venv-verl/bin/python")
"""The ``NOT_RUN`` reason of every ``verl`` cell when verl is nowhere to run."""

DP_AXIS: Final = Axis(name="dp", degrees=(1, 2),
                      description="verl's FSDP2 data-parallel size: each role's parameters, "
                                  "gradients and AdamW state sharded over dp ranks, each rank "
                                  "a contiguous slice of the batch rows")
"""``matrix.engine_options.verl.dp`` (default 1)."""


class VerlEngineSpec(EngineSpec):
    """:class:`~qualify.registry.EngineSpec` whose "not installed" reason names the script."""

    def unavailable_reason(self, cuda_available: bool | None = None, *,
                           variants: Sequence[str] = ()) -> str | None:
        """:meth:`EngineSpec.unavailable_reason`, a missing ``verl`` as :data:`INSTALL_REASON`.

        Raises:
            UsageError: the engine's ``QUALIFY_LAUNCHER_<ENGINE>`` is set to a bad value.
        """
        reason = super().unavailable_reason(cuda_available, variants=variants)
        if reason is not None and reason.startswith(f"engine {self.name!r} is not installed"):
            return INSTALL_REASON
        return reason


SPEC: Final = VerlEngineSpec(
    name="verl",
    entry="harnesses.verl.harness:main",
    axes=(Axis(name="tp", degrees=(1,), description="no tensor parallelism: verl's FSDP2 "
                                                    "engine over the dp ranks of each role"),
          DP_AXIS),
    distributions=("torch", "verl", "transformers", "tensordict"),
    requires=("verl",),
    world_size_rule="(actor_tp+critic_tp)*dp",
    # verl's FSDPEngine at bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    # over FP32 sharded masters born from the checkpoint, with torch.autocast(bf16) around
    # the forward (verl/workers/engine/fsdp/transformer_impl.py _build_fsdp_module,
    # forward_step).
    bf16_style="params",
    algorithms=ALGORITHMS,
    description="verl 0.9.1 TrainingWorker (FSDP2 engine, gloo): its own ppo_loss / "
                "value_loss, backward, grad clip, AdamW and lr scheduler on the frozen "
                "rollout (CPU; its own venv, scripts/install_verl.sh)",
)
"""verl: TP 1, DP 1 and 2 per role, Actor and Critic; FP32 and BF16 (FSDP2 mixed precision)."""
