"""What of a qualify contract TRL's ``GRPOTrainer`` runs, and the ``GRPOConfig`` it maps to.

No TRL import here (the matrix planner may ask :func:`unsupported` without TRL installed).
Names follow TRL 1.16.0's ``GRPOConfig`` and ``GRPOTrainer._compute_loss``:

- the PPO clip (``policy_loss = "ppo_clip"``) and GSPO (``"gspo"``, TRL
  ``importance_sampling_level = "sequence"``) take ``epsilon = clip_ratio_low`` and
  ``epsilon_high = clip_ratio_high``; the aggregation picks the ``loss_type`` whose
  normalisation it is: ``token-mean`` -> ``dapo`` (``Σ / num_items_in_batch``, the global
  valid-token count), ``seq-mean-token-mean`` -> ``grpo``, ``seq-mean-token-sum-norm`` ->
  ``dr_grpo`` (``max_completion_length = loss_scale_factor``), ``seq-mean-token-sum`` ->
  ``luspo`` (``Σ_t`` per sequence, mean over sequences);
- CISPO (``"cispo"``): TRL clamps the ratio at ``epsilon_high`` from above only, so it
  runs the contract's CISPO when ``clip_ratio_low = 1`` (no lower clip) with
  ``epsilon_high = 1 + clip_ratio_high``, aggregated ``token-mean``;
- the KL loss term is ``beta · k3`` (``kl_loss_coef``, estimator ``k3`` only), added to
  each token's loss before the aggregation, as the reference does; ``use_bias_correction_kl``
  (TRL's default ``True``: the term times the differentiable ratio) is set from the
  contract's ``kl_loss_bias_correction`` (default ``false``), never left to TRL's default;
- the entropy bonus is a token mean whatever the ``loss_type``: with an entropy
  coefficient the aggregation must be ``token-mean``.

Everything else a contract may name is refused by :func:`unsupported`, one name per
variant, for the cell's ``NOT_RUN`` reason.
"""

from __future__ import annotations

from typing import Any, Final

from qualify.contract import AlgorithmSpec, SamplingSpec

LOSS_TYPES: Final = {"token-mean": "dapo", "seq-mean-token-mean": "grpo",
                     "seq-mean-token-sum-norm": "dr_grpo", "seq-mean-token-sum": "luspo"}
"""``loss_agg_mode`` -> TRL ``loss_type`` of the same normalisation (PPO clip and GSPO)."""


def unsupported(alg: AlgorithmSpec, roles: tuple[str, ...] = ("actor",)) -> list[str]:
    """The contract's algorithm variants TRL 1.16.0's GRPOTrainer does not run.

    Args:
        alg: the contract's ``[algorithm]``.
        roles: the matrix's roles.

    Returns:
        ``field=value`` names (empty: TRL runs this algorithm).
    """
    out: list[str] = []
    if "critic" in roles:
        out.append("roles=critic (GRPOTrainer trains no critic)")
    if alg.name == "decoupled_ppo":
        out.append("name=decoupled_ppo (decoupled PPO's behavior weight)")
    if alg.policy_loss == "cispo":
        if alg.clip_low != 1.0:
            out.append(f"clip_ratio_low={alg.clip_low} (TRL's cispo has no lower clip: "
                       "clip_ratio_low = 1)")
        if alg.loss_agg_mode != "token-mean":
            out.append(f"loss_agg_mode={alg.loss_agg_mode} with policy_loss=cispo")
    elif alg.loss_agg_mode not in LOSS_TYPES:
        out.append(f"loss_agg_mode={alg.loss_agg_mode}")
    if alg.clip_ratio_c is not None:
        out.append(f"clip_ratio_c={alg.clip_ratio_c} (dual clip)")
    if alg.kl_loss_coef != 0 and alg.kl_loss_form != "k3":
        field = "kl_loss_estimator" if alg.kl_loss_type is None else "kl_loss_type"
        out.append(f"{field}={alg.kl_loss_form}")
    if alg.entropy_coef != 0 and alg.loss_agg_mode != "token-mean":
        out.append(f"entropy_coef={alg.entropy_coef} with loss_agg_mode="
                   f"{alg.loss_agg_mode} (TRL's entropy bonus is a token mean)")
    if alg.rollout_is is not None:
        out.append(f"rollout_is={alg.rollout_is}_{alg.rollout_is_mode} (TRL computes its IS "
                   "ratio inside vLLM generation only)")
    if alg.loss_agg_mode == "seq-mean-token-sum-norm" and alg.loss_scale_factor is not None \
            and float(alg.loss_scale_factor) != int(alg.loss_scale_factor):
        out.append(f"loss_scale_factor={alg.loss_scale_factor} (TRL's "
                   "max_completion_length is an integer)")
    return out


def grpo_config_kwargs(alg: AlgorithmSpec, *, response_len: int) -> dict[str, Any]:
    """The loss fields of ``GRPOConfig`` for ``alg`` (call :func:`unsupported` first).

    Args:
        alg: the contract's ``[algorithm]``.
        response_len: ``R`` (TRL's ``max_completion_length`` unless ``dr_grpo`` needs the
            contract's ``loss_scale_factor``).

    Returns:
        ``loss_type``, ``importance_sampling_level``, ``epsilon``, ``epsilon_high``,
        ``beta``, ``use_bias_correction_kl``, ``max_completion_length``.
    """
    if alg.policy_loss == "cispo":
        return {"loss_type": "cispo", "importance_sampling_level": "token",
                "epsilon": alg.clip_low, "epsilon_high": 1.0 + alg.clip_high,
                "beta": alg.kl_loss_coef, "use_bias_correction_kl": alg.kl_loss_bias_correction,
                "max_completion_length": response_len}
    loss_type = LOSS_TYPES[alg.loss_agg_mode]
    length = int(alg.loss_scale_factor) if loss_type == "dr_grpo" and \
        alg.loss_scale_factor is not None else response_len
    return {"loss_type": loss_type,
            "importance_sampling_level": "sequence" if alg.policy_loss == "gspo" else "token",
            "epsilon": alg.clip_low, "epsilon_high": alg.clip_high, "beta": alg.kl_loss_coef,
            "use_bias_correction_kl": alg.kl_loss_bias_correction, "max_completion_length": length}


def sampling_kwargs(sampling: SamplingSpec) -> dict[str, Any]:
    """The sampling fields of ``GRPOConfig``: ``temperature`` (the sampler's).

    TRL divides its trainer logits by ``GRPOConfig.temperature`` before the logprobs, so the
    loss refers to the distribution the rollout was sampled from.
    """
    return {"temperature": sampling.temperature}
