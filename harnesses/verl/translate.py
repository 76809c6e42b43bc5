"""What of a qualify contract verl 0.9.1's ``ppo_loss`` / ``value_loss`` run, and their configs.

No verl import here (the matrix planner may ask :func:`unsupported` without verl installed).
Names follow verl 0.9.1's ``ActorConfig`` / ``CriticConfig`` / ``FSDPOptimizerConfig`` and
``verl.trainer.ppo.core_algos``:

- ``policy_loss = "ppo_clip"`` -> ``policy_loss.loss_mode = "vanilla"``
  (``compute_policy_loss_vanilla``), ``"gspo"`` -> ``"gspo"``; ``clip_ratio_low`` /
  ``clip_ratio_high`` -> the same names; ``clip_ratio_c`` -> ``clip_ratio_c``. verl's vanilla
  loss always applies its dual clip (``clip_ratio_c``, default 3.0): a contract without a dual
  clip is run with ``clip_ratio_c = inf`` (``min(-A·c, ·)`` is then the clipped loss itself);
- ``loss_agg_mode`` -> ``loss_agg_mode`` (the same names; ``loss_scale_factor`` likewise);
- the KL loss: ``use_kl_loss = kl_loss_coef != 0``, ``kl_loss_coef``, ``kl_loss_type`` = the
  contract's estimator in verl's names (``k1``, ``k2``, ``k3``, ``low_var_kl`` and the ``+``
  forms; verl's ``k3`` is its ``low_var_kl``, clamped to [-10, 10]);
- the entropy bonus: ``entropy_coeff``;
- the critic: ``cliprange_value = value_clip``, the same ``loss_agg_mode``;
- the optimizer: torch AdamW (``lr``, ``betas``, ``weight_decay``, ``eps`` through
  ``override_optimizer_config``), ``clip_grad = max_grad_norm``, ``lr_scheduler_type``
  ``constant`` or ``cosine`` (``min_lr_ratio``, ``lr_warmup_steps``,
  ``total_training_steps``).

Everything else a contract may name is refused by :func:`unsupported`, one name per
variant, for the cell's ``NOT_RUN`` reason.
"""

from __future__ import annotations

import math
from typing import Any, Final

from qualify.contract import AlgorithmSpec, OptimizerSpec

KL_TYPES: Final = {"k1": "k1", "k2": "k2", "k3": "k3", "low_var_kl": "low_var_kl",
                   "k1+": "k1+", "k3+": "k3+", "low_var_kl+": "low_var_kl+"}
"""The contract's KL loss form -> verl ``kl_loss_type``."""
LOSS_MODES: Final = {"ppo_clip": "vanilla", "gspo": "gspo"}
"""The contract's ``policy_loss`` -> verl ``policy_loss.loss_mode``."""
SCHEDULES: Final = ("constant", "cosine")
"""The lr schedules verl's FSDP engine builds (``_build_lr_scheduler``)."""


def unsupported(alg: AlgorithmSpec, opt: OptimizerSpec,
                roles: tuple[str, ...] = ("actor", "critic")) -> list[str]:
    """The contract's variants verl 0.9.1's engine worker path does not run.

    Args:
        alg: the contract's ``[algorithm]``.
        opt: the contract's ``[optimizer]``.
        roles: the matrix's roles.

    Returns:
        ``field=value`` names (empty: verl runs this algorithm).
    """
    del roles
    out: list[str] = []
    if alg.name == "decoupled_ppo":
        out.append("name=decoupled_ppo (decoupled PPO's behavior weight: verl's "
                   "rollout_corr_helper bypass mode is not mapped)")
    if alg.policy_loss not in LOSS_MODES:
        out.append(f"policy_loss={alg.policy_loss} (verl's cispo clamps the ratio at "
                   "clip_ratio_high only, another formula than the contract's)")
    if alg.kl_loss_coef != 0 and alg.kl_loss_form not in KL_TYPES:
        out.append(f"kl_loss_type={alg.kl_loss_form}")
    if alg.kl_loss_bias_correction:
        out.append("kl_loss_bias_correction=true (verl's KL loss has no ratio weight)")
    if alg.rollout_is is not None:
        out.append(f"rollout_is={alg.rollout_is}_{alg.rollout_is_mode} (verl's "
                   "rollout_corr_helper is not mapped)")
    if opt.lr_schedule not in SCHEDULES:
        out.append(f"lr_schedule={opt.lr_schedule} (verl's FSDP engine builds constant or "
                   "cosine)")
    if alg.loss_scale_factor is not None and \
            float(alg.loss_scale_factor) != int(alg.loss_scale_factor):
        out.append(f"loss_scale_factor={alg.loss_scale_factor} (verl's is an integer)")
    return out


def actor_fields(alg: AlgorithmSpec) -> dict[str, Any]:
    """The loss fields of verl's ``FSDPActorConfig`` for ``alg`` (call :func:`unsupported` first).

    Returns:
        ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``,
        ``policy_loss``, ``loss_agg_mode``, ``loss_scale_factor``, ``entropy_coeff``,
        ``use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type``.
    """
    return {"clip_ratio": alg.clip_ratio, "clip_ratio_low": alg.clip_low,
            "clip_ratio_high": alg.clip_high,
            "clip_ratio_c": math.inf if alg.clip_ratio_c is None else alg.clip_ratio_c,
            "policy_loss": {"loss_mode": LOSS_MODES[alg.policy_loss]},
            "loss_agg_mode": alg.loss_agg_mode,
            "loss_scale_factor": None if alg.loss_scale_factor is None
            else int(alg.loss_scale_factor),
            "entropy_coeff": alg.entropy_coef, "use_kl_loss": alg.kl_loss_coef != 0,
            "kl_loss_coef": alg.kl_loss_coef, "kl_loss_type": KL_TYPES[alg.kl_loss_form]}


def critic_fields(alg: AlgorithmSpec) -> dict[str, Any]:
    """The loss fields of verl's ``FSDPCriticConfig``: ``cliprange_value``, the aggregation."""
    return {"cliprange_value": alg.value_clip, "loss_agg_mode": alg.loss_agg_mode,
            "loss_scale_factor": None if alg.loss_scale_factor is None
            else int(alg.loss_scale_factor)}


def optimizer_fields(opt: OptimizerSpec, *, role: str, rounds: int) -> dict[str, Any]:
    """``FSDPOptimizerConfig`` fields of ``role`` (``actor`` or ``critic``).

    ``total_training_steps`` is the contract's ``total_steps`` (else ``rounds``): verl steps
    its scheduler once per ``train_mini_batch`` call, one call per round.
    """
    return {"lr": opt.actor_lr if role == "actor" else opt.critic_lr,
            "betas": tuple(opt.betas), "weight_decay": opt.weight_decay,
            "clip_grad": opt.max_grad_norm, "lr_scheduler_type": opt.lr_schedule,
            "min_lr_ratio": opt.min_lr_ratio if opt.lr_schedule == "cosine" else None,
            "lr_warmup_steps": opt.warmup_steps,
            "total_training_steps": opt.total_steps if opt.total_steps is not None else rounds,
            "override_optimizer_config": {"eps": opt.eps}}


def sampling_temperature(temperature: float) -> float:
    """Verl's ``meta_info["temperature"]``: the trainer divides its logits by the sampler's."""
    return temperature
