"""The ``verl`` engine spec: verl 0.9.1's ``TrainingWorker`` (FSDP2, CPU), in its own venv.

verl pins ``transformers<5.11``, below qualify's own: its ranks run in the venv
``scripts/install_verl.sh`` builds, named by ``--launcher verl=...`` or
``QUALIFY_LAUNCHER_VERL`` (:mod:`qualify.candidate.interpreter`); with neither, nor ``verl``
in qualify's environment, its cells are ``NOT_RUN`` saying so (:data:`INSTALL_HINT`).
Importing this module imports neither torch nor verl.
"""

from __future__ import annotations

from typing import Final

from qualify.registry import Axis, EngineSpec

ALGORITHMS: Final = ("policy_loss=gspo", "clip_ratio_low=*", "clip_ratio_high=*",
                     "clip_ratio_c=*", "kl_loss_type=*", "loss_agg_mode=token-sum",
                     "loss_agg_mode=seq-mean-token-sum-norm")
"""The variants beyond the protocol's base that verl's ``ppo_loss`` runs
(:mod:`harnesses.verl.translate`; what it lacks is named by
:func:`harnesses.verl.translate.unsupported`)."""

INSTALL_HINT: Final = (
    "verl 0.9.1 runs in its own venv; build it with `bash scripts/install_verl.sh` and run "
    "with --launcher verl=.venv-verl/bin/python")
"""The end of every ``verl`` cell's ``NOT_RUN`` reason when verl is nowhere to run
(:attr:`qualify.registry.EngineSpec.install_hint`)."""

DP_AXIS: Final = Axis(name="dp", degrees=(1, 2),
                      description="verl's FSDP2 data-parallel size: each role's parameters, "
                                  "gradients and AdamW state sharded over dp ranks, each rank "
                                  "a contiguous slice of the batch rows")
"""``matrix.engine_options.verl.dp`` (default 1)."""


SPEC: Final = EngineSpec(
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
    install_hint=INSTALL_HINT,
    description="verl 0.9.1 TrainingWorker (FSDP2 engine, gloo): its own ppo_loss / "
                "value_loss, backward, grad clip, AdamW and lr scheduler on the frozen "
                "rollout (CPU; its own venv, scripts/install_verl.sh)",
)
"""verl: TP 1, DP 1 and 2 per role, Actor and Critic; FP32 and BF16 (FSDP2 mixed precision)."""
