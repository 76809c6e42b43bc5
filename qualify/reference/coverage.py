"""Contract coverage: what the frozen rollout and the reference update actually exercise.

A check that cannot fail is not evidence. A contract whose learning rate never moves a
token past the lower PPO clip edge cannot tell an engine that mishandles that branch from
one that does not; a contract with the library's AdamW defaults cannot tell a harness that
ignores them. This module counts, from what the reference stage already holds (the frozen
rollout, the FP64 targets, the training inputs and each reference update's own reported
tensors), how many tokens, sequences or settings each rule of the losses, the padding and
the optimizer touches, and marks a rule ``exercised`` only when that count is non-zero.
The result is sealed as ``coverage.json`` (:data:`qualify.layout.COVERAGE_FILE`); the
comparator lists every rule nothing exercises as ``NO POWER`` (:mod:`qualify.compare.report`).

Rules (``role`` / ``round`` / ``label`` where they apply; ``label`` is the reference run,
``fp32``, ``bf16`` or a BF16 lane):

- ``policy_upper_clipped`` / ``policy_upper_unclipped`` (actor, round >= 2): valid tokens
  with ``A > 0`` and ``ratio > 1 + eps`` (the clipped surrogate wins: zero policy
  gradient) / ``ratio <= 1 + eps``; ``ratio = exp(logp_r - logp_1)`` of that run (the
  protocol's clip centre is the run's own round-1 logprob), ``eps = clip_ratio``.
- ``policy_lower_clipped`` / ``policy_lower_unclipped``: ``A < 0`` and ``ratio < 1 - eps``
  / ``ratio >= 1 - eps``. Schulman et al. 2017, eq. 7; the same strict inequalities as
  :func:`qualify.branches.actor_full_gradient` and :mod:`qualify.reference.update`.
- ``ratio_far_from_one`` (actor, round >= 2): ``|ratio - 1| > clip_ratio / 2``.
- ``value_clipped`` / ``value_unclipped`` (critic, round >= 2): the clipped value term is
  strictly the larger (zero gradient) / not (:func:`qualify.branches
  .critic_full_gradient`; OpenAI baselines ``ppo2``).
- ``loss_kl_active`` (actor, round >= 2 when the reference policy is the actor's init,
  else every round): ``kl_loss_coef != 0`` and valid tokens whose estimator
  (``kl_loss_estimator`` of ``logp_r - logp_ref``, Schulman 2020) is non-zero.
- ``entropy_bonus_active`` (actor, round 1): ``entropy_coef != 0`` and valid tokens with
  non-zero entropy.
- ``grad_clip_engaged`` (actor / critic): rounds whose ``clip_coef < 1``.
- ``reward_kl_active`` (no label): ``kl_coef != 0`` and valid tokens whose FP64 target
  ``kl`` is non-zero.
- ``prompts_left_padded`` / ``responses_right_padded``: sequences with a pad before the
  first real prompt token / after the last valid response token.
- ``loss_aggregation``: the protocol's token mean over the batch's valid tokens
  (``sum / N``); exercised when the response lengths differ (else a per-sequence mean
  gives the same numbers); the count is the number of distinct lengths.
  The message names the contract's ``loss_agg_mode``.
- ``grpo_advantage_nonzero`` (``grpo`` only): valid tokens with a non-zero FP64 advantage
  (a group whose scores are all equal gives 0).
- ``behavior_weight_off_one`` / ``behavior_weight_capped`` (``decoupled_ppo`` only, actor,
  round 1, per label): valid tokens whose behavior weight ``exp(logp_1 - behavior_logprobs)``
  differs from 1 by more than :data:`BEHAVIOR_WEIGHT_TOL` / exceeds ``behavior_weight_cap``
  (Hilton et al. 2022; AReaL ``ppo_actor_loss_fn``).
- ``gradient_accumulation``: micro-batches per step (exercised when more than one).
- ``adamw_betas`` / ``adamw_eps`` / ``adamw_weight_decay``: the contract's setting differs
  from ``torch.optim.AdamW``'s default ((0.9, 0.999), 1e-8, 0.01); count 1 or 0.
- ``lr_schedule``: consecutive rounds whose scheduled lr differs (:mod:`qualify.schedule`);
  exercised when one does and no round's lr is 0 (a zero step exercises no update).

Everything is FP64 numpy and deterministic (rules in a fixed order), so the record is the
same bytes for the same inputs.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from qualify.contract import Contract

__all__ = ["ADAMW_DEFAULTS", "COVERAGE_SCHEMA_VERSION", "Rule", "compute_coverage",
           "coverage_document", "coverage_of_reference", "no_power_lines"]

COVERAGE_SCHEMA_VERSION: Final = 1
ADAMW_DEFAULTS: Final = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
"""``torch.optim.AdamW``'s defaults (torch 2.x documentation)."""

Array = npt.NDArray[Any]
BEHAVIOR_WEIGHT_TOL: Final = 1e-3
"""``behavior_weight_off_one`` counts tokens whose weight differs from 1 by more than this."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """One rule of the contract and how much of the frozen data exercises it.

    Attributes:
        rule: the rule's name (module docstring).
        label: the reference run it was counted in (``fp32``, ``bf16``, a lane), or
            ``None`` for a rule of the rollout or the contract.
        role: ``actor`` / ``critic`` or ``None``.
        round: 1-based round or ``None``.
        count: tokens, sequences, rounds or settings that exercise it.
        total: what was counted over (valid tokens, sequences, rounds, 1).
        exercised: ``count > 0`` (and, for a term with a coefficient, the coefficient is
            non-zero).
        absent: what is missing when not exercised (``no token on the lower policy clip
            edge``), for the ``NO POWER`` line.
    """

    rule: str
    label: str | None
    role: str | None
    round: int | None
    count: int
    total: int
    exercised: bool
    absent: str

    def to_dict(self) -> dict[str, Any]:
        """JSON form (one element of ``coverage.json`` ``rules``)."""
        return dataclasses.asdict(self)

    @property
    def where(self) -> str:
        """``round 2, actor, fp32`` (the parts that apply)."""
        parts = [f"round {self.round}" if self.round is not None else None, self.role,
                 self.label]
        return ", ".join(p for p in parts if p)


def _kl(log_ratio: Array, estimator: str) -> Array:
    """Per-token KL estimate (its value) from ``log_ratio = logp - logp_ref`` (Schulman 2020).

    A straight-through ``+`` form has its base estimator's value; ``low_var_kl`` clamps as
    :func:`qualify.reference.losses.kl_estimate`.
    """
    estimator = estimator.removesuffix("+")
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "low_var_kl":
        neg = np.clip(-log_ratio, -20.0, 20.0)
        return np.clip(np.exp(neg) - neg - 1.0, -10.0, 10.0)
    return np.exp(-log_ratio) + log_ratio - 1.0


def _policy_rules(contract: Contract, label: str, run: Mapping[str, Array], *,
                  adv: Array, valid: Array, ref_logprobs: Array | None) -> list[Rule]:
    alg = contract.algorithm
    eps, eps_hi = alg.clip_low, alg.clip_high
    out: list[Rule] = []
    old_name = "round1/actor/logprobs"
    if old_name not in run:
        return out
    old = np.asarray(run[old_name], np.float64)
    n = int(valid.sum())
    first_kl = 1 if contract.roles.reference != "actor_init" else 2
    for r in range(1, alg.rounds + 1):
        name = f"round{r}/actor/logprobs"
        if name not in run:
            continue
        cur = np.asarray(run[name], np.float64)
        if r >= 2:
            ratio = np.exp(cur - old)
            pos, neg = valid & (adv > 0), valid & (adv < 0)
            counts = [
                ("policy_upper_clipped", pos & (ratio > 1 + eps_hi),
                 "no token on the upper policy clip edge (A > 0, ratio > 1 + clip_ratio)"),
                ("policy_upper_unclipped", pos & (ratio <= 1 + eps_hi),
                 "no token with A > 0 inside the upper policy clip edge"),
                ("policy_lower_clipped", neg & (ratio < 1 - eps),
                 "no token on the lower policy clip edge (A < 0, ratio < 1 - clip_ratio)"),
                ("policy_lower_unclipped", neg & (ratio >= 1 - eps),
                 "no token with A < 0 inside the lower policy clip edge"),
                ("ratio_far_from_one", valid & (np.abs(ratio - 1) > eps / 2),
                 "no token whose ratio is far from 1 (|ratio - 1| > clip_ratio / 2)"),
            ]
            out += [Rule(rule=k, label=label, role="actor", round=r, count=int(m.sum()),
                         total=n, exercised=bool(m.any()), absent=a) for k, m, a in counts]
        if r >= first_kl:
            ref = ref_logprobs if ref_logprobs is not None else old
            kl = _kl(cur - np.asarray(ref, np.float64), alg.kl_loss_form)
            m = valid & (kl != 0)
            active = alg.kl_loss_coef != 0
            out.append(Rule(rule="loss_kl_active", label=label, role="actor", round=r,
                            count=int(m.sum()) if active else 0, total=n,
                            exercised=active and bool(m.any()),
                            absent="no KL loss term (kl_loss_coef = 0)" if not active else
                            "no token with a non-zero KL loss term"))
    ent = run.get("round1/actor/entropy")
    if ent is not None:
        m = valid & (np.asarray(ent, np.float64) != 0)
        active = alg.entropy_coef != 0
        out.append(Rule(rule="entropy_bonus_active", label=label, role="actor", round=1,
                        count=int(m.sum()) if active else 0, total=n,
                        exercised=active and bool(m.any()),
                        absent="no entropy bonus (entropy_coef = 0)" if not active else
                        "no token with a non-zero entropy"))
    return out


def _behavior_rules(contract: Contract, label: str, run: Mapping[str, Array],
                    rollout: Mapping[str, Array], valid: Array) -> list[Rule]:
    """Decoupled PPO's behavior weight ``w = exp(lp_1 - lp_behav)`` (:mod:`qualify.aggregation`)."""
    alg = contract.algorithm
    if alg.name != "decoupled_ppo" or "round1/actor/logprobs" not in run \
            or "behavior_logprobs" not in rollout:
        return []
    w = np.exp(np.asarray(run["round1/actor/logprobs"], np.float64)
               - np.asarray(rollout["behavior_logprobs"], np.float64))
    n = int(valid.sum())
    off = valid & (np.abs(w - 1.0) > BEHAVIOR_WEIGHT_TOL)
    cap = alg.behavior_weight_cap
    capped = valid & (w > cap) if cap is not None else np.zeros_like(valid)
    return [
        Rule(rule="behavior_weight_off_one", label=label, role="actor", round=1,
             count=int(off.sum()), total=n, exercised=bool(off.any()),
             absent=f"every behavior weight within {BEHAVIOR_WEIGHT_TOL} of 1 (a harness "
                    "that ignores the weight is not told apart)"),
        Rule(rule="behavior_weight_capped", label=label, role="actor", round=1,
             count=int(capped.sum()), total=n, exercised=bool(capped.any()),
             absent="no behavior weight above behavior_weight_cap" if cap is not None
             else "no behavior_weight_cap (uncapped)"),
    ]


def _value_rules(contract: Contract, label: str, run: Mapping[str, Array],
                 returns: Array, valid: Array) -> list[Rule]:
    alg = contract.algorithm
    out: list[Rule] = []
    if "round1/critic/values" not in run:
        return out
    old = np.asarray(run["round1/critic/values"], np.float64)
    n = int(valid.sum())
    for r in range(2, alg.rounds + 1):
        name = f"round{r}/critic/values"
        if name not in run:
            continue
        d = np.asarray(run[name], np.float64) - old
        rho = returns - old
        clipped = np.clip(d, -alg.value_clip, alg.value_clip)
        zero = (np.abs(d) > alg.value_clip) & ((clipped - rho) ** 2 > (d - rho) ** 2)
        out += [Rule(rule="value_clipped", label=label, role="critic", round=r,
                     count=int((valid & zero).sum()), total=n,
                     exercised=bool((valid & zero).any()),
                     absent="no token on the clipped side of the value clip"),
                Rule(rule="value_unclipped", label=label, role="critic", round=r,
                     count=int((valid & ~zero).sum()), total=n,
                     exercised=bool((valid & ~zero).any()),
                     absent="no token on the unclipped side of the value clip")]
    return out


def _clip_rule(contract: Contract, label: str, run: Mapping[str, Array],
               role: str) -> list[Rule]:
    coefs = [float(np.asarray(run[k])) for r in range(1, contract.algorithm.rounds + 1)
             if (k := f"round{r}/{role}/clip_coef") in run]
    if not coefs:
        return []
    c = sum(x < 1.0 for x in coefs)
    return [Rule(rule="grad_clip_engaged", label=label, role=role, round=None, count=c,
                 total=len(coefs), exercised=c > 0,
                 absent="gradient clipping never engaged (clip_coef = 1 in every round)")]


def _batch_rules(contract: Contract, rollout: Mapping[str, Array],
                 targets: Mapping[str, Array], valid: Array) -> list[Rule]:
    alg, opt = contract.algorithm, contract.optimizer
    b = int(valid.shape[0])
    n = int(valid.sum())
    p_len = int(np.asarray(rollout["prompts"]).shape[1])
    am = np.asarray(rollout["attention_mask"]).astype(bool)[:, :p_len]
    left = int(sum(bool(row.any()) and not bool(row[0]) for row in am))
    lengths = valid.sum(1)
    right = int((lengths < valid.shape[1]).sum())
    out = []
    kl = targets.get("kl")
    active = alg.kl_coef != 0
    kl_count = int((valid & (np.asarray(kl, np.float64) != 0)).sum()) \
        if kl is not None and active else 0
    out.append(Rule(rule="reward_kl_active", label=None, role=None, round=None,
                    count=kl_count, total=n, exercised=kl_count > 0,
                    absent="no reward KL term (kl_coef = 0)" if not active else
                    "no token with a non-zero reward KL (the reference policy equals the "
                    "scored actor)"))
    out.append(Rule(rule="prompts_left_padded", label=None, role=None, round=None,
                    count=left, total=b, exercised=left > 0,
                    absent="no prompt left-padded in the batch"))
    out.append(Rule(rule="responses_right_padded", label=None, role=None, round=None,
                    count=right, total=b, exercised=right > 0,
                    absent="no response right-padded in the batch"))
    # The modes' per-token factors (qualify.aggregation): token-mean 1/N and
    # seq-mean-token-mean 1/(B' n_b) coincide when every response has the same length;
    # seq-mean-token-sum 1/B' differs from both unless every response has length 1.
    distinct = len({int(x) for x in lengths})
    if alg.loss_agg_mode == "seq-mean-token-sum":
        longer = int(sum(int(x) > 1 for x in lengths))
        out.append(Rule(rule="loss_aggregation", label=None, role=None, round=None,
                        count=longer, total=b, exercised=longer > 0,
                        absent="seq-mean-token-sum loss aggregation indistinguishable from "
                               "the token means (every response has length 1)"))
    else:
        other = ("seq-mean-token-mean" if alg.loss_agg_mode == "token-mean"
                 else "token-mean")
        out.append(Rule(rule="loss_aggregation", label=None, role=None, round=None,
                        count=distinct, total=b, exercised=distinct > 1,
                        absent=f"{alg.loss_agg_mode} loss aggregation indistinguishable from "
                               f"{other} (every response has the same length)"))
    if alg.name == "grpo":
        adv = np.asarray(targets["advantages"], np.float64) if "advantages" in targets \
            else None
        nz = int((valid & (adv != 0)).sum()) if adv is not None else 0
        out.append(Rule(rule="grpo_advantage_nonzero", label=None, role=None, round=None,
                        count=nz, total=n, exercised=nz > 0,
                        absent="every GRPO group has equal scores (all advantages 0)"))
    micro = -(-b // alg.micro_batch_size)
    out.append(Rule(rule="gradient_accumulation", label=None, role=None, round=None,
                    count=micro, total=micro, exercised=micro > 1,
                    absent="one micro-batch per step (no gradient accumulation)"))
    for key, got, absent in (
            ("adamw_betas", tuple(float(x) for x in opt.betas),
             "AdamW betas are the library default (0.9, 0.999)"),
            ("adamw_eps", float(opt.eps), "AdamW eps is the library default 1e-8"),
            ("adamw_weight_decay", float(opt.weight_decay),
             "AdamW weight decay is the library default 0.01")):
        differs = int(got != ADAMW_DEFAULTS[key.removeprefix("adamw_")])
        out.append(Rule(rule=key, label=None, role=None, round=None, count=differs,
                        total=1, exercised=bool(differs), absent=absent))
    lrs = [opt.lr("actor", r) for r in range(1, alg.rounds + 1)]
    steps = sum(1 for a, b in itertools.pairwise(lrs) if a != b)
    out.append(Rule(rule="lr_schedule", label=None, role=None, round=None, count=steps,
                    total=max(alg.rounds - 1, 0), exercised=steps > 0 and min(lrs) > 0,
                    absent=f"the lr is the same in every round or zero in one "
                           f"(lr_schedule = {opt.lr_schedule!r}: "
                           f"{', '.join(f'{x:.6g}' for x in lrs)})"))
    return out


def compute_coverage(contract: Contract, *, rollout: Mapping[str, Array],
                     targets: Mapping[str, Array], train: Mapping[str, Array],
                     runs: Mapping[str, Mapping[str, Array]],
                     ref_logprobs: Mapping[str, Array] | None = None) -> list[Rule]:
    """Count what the contract's rules exercise on the frozen data (module docstring).

    Args:
        contract: the contract (clip ranges, coefficients, AdamW settings, rounds).
        rollout: ``rollout.safetensors``: ``prompts`` ``[B, P]``, ``attention_mask``
            ``[B, P + R]``, ``response_mask`` ``[B, R]`` (int).
        targets: ``targets.safetensors`` (FP64): ``kl`` ``[B, R]`` (the reward's KL term).
        train: ``train_inputs.safetensors``: ``advantages``, ``returns`` ``[B, R]`` FP32
            (what the update consumed).
        runs: label (``fp32``, ``bf16``, a lane) -> that reference update's protocol
            tensors (``round{r}/actor/logprobs`` ``[B, R]``, ``round{r}/critic/values``,
            ``round{r}/{role}/clip_coef`` scalars, ``round1/actor/entropy``).
        ref_logprobs: label -> ``[B, R]`` reference-policy logprobs at that run's
            precision (scores); absent: the run's round-1 logprobs (the reference policy
            is the actor's init).

    Returns:
        The rules, rollout / contract rules first, then per label in sorted order.
    """
    valid = np.asarray(rollout["response_mask"]).astype(bool)
    adv = np.asarray(train["advantages"], np.float64)
    returns = np.asarray(train["returns"], np.float64)
    out = _batch_rules(contract, rollout, targets, valid)
    for label in sorted(runs):
        run = runs[label]
        ref = (ref_logprobs or {}).get(label)
        out += _policy_rules(contract, label, run, adv=adv, valid=valid, ref_logprobs=ref)
        out += _behavior_rules(contract, label, run, rollout, valid)
        out += _value_rules(contract, label, run, returns, valid)
        for role in ("actor", "critic"):
            out += _clip_rule(contract, label, run, role)
    return out


def no_power_lines(rules: Sequence[Mapping[str, Any]]) -> list[str]:
    """``NO POWER: <what is absent> (round 2, actor, fp32)`` per rule nothing exercises.

    Args:
        rules: ``coverage.json`` ``rules`` (dicts of :meth:`Rule.to_dict`).
    """
    out = []
    for d in rules:
        if d.get("exercised"):
            continue
        parts = [f"round {d['round']}" if d.get("round") is not None else None,
                 d.get("role"), d.get("label")]
        where = ", ".join(str(p) for p in parts if p)
        out.append(f"NO POWER: {d.get('absent')}" + (f" ({where})" if where else ""))
    return out


def coverage_document(contract: Contract, rules: Sequence[Rule]) -> dict[str, Any]:
    """The ``coverage.json`` document: the rules and a summary.

    Returns:
        ``{"schema_version", "contract", "contract_digest", "rules": [...], "summary":
        {"rules", "exercised", "no_power": [NO POWER lines]}}``.
    """
    docs = [r.to_dict() for r in rules]
    return {"schema_version": COVERAGE_SCHEMA_VERSION, "contract": contract.name,
            "contract_digest": contract.digest, "rules": docs,
            "summary": {"rules": len(docs), "exercised": sum(r.exercised for r in rules),
                        "no_power": no_power_lines(docs)}}


def coverage_of_reference(ref_dir: Path) -> dict[str, Any]:
    """Recompute the coverage document of a sealed reference from its stored files.

    Reads ``contract.json``, ``rollout.safetensors``, ``targets.safetensors``,
    ``train_inputs.safetensors``, ``reference/hf-*.safetensors`` and
    ``scores/hf-*.safetensors`` (for the reference-policy logprobs), nothing else; useful
    for a reference sealed before ``coverage.json`` existed.

    Raises:
        FileNotFoundError: a needed file is missing.
        EvidenceIntegrityError: a tensor file is unreadable.
    """
    from qualify import jsonio
    from qualify.evidence import store
    from qualify.layout import CONTRACT_FILE, HF_REFERENCE_DIR, SCORES_DIR, TARGETS_FILE
    from qualify.protocol import ROLLOUT_FILE, TRAIN_INPUTS_FILE

    contract = Contract.from_dict(jsonio.read_json(ref_dir / CONTRACT_FILE),
                                  path=ref_dir / CONTRACT_FILE)
    runs: dict[str, dict[str, Array]] = {}
    refs: dict[str, Array] = {}
    prefix = "hf-"
    for f in sorted((ref_dir / HF_REFERENCE_DIR).glob(f"{prefix}*.safetensors")):
        label = f.name[len(prefix):-len(".safetensors")]
        runs[label] = store.load_tensors(f)
        scores = ref_dir / SCORES_DIR / f"{prefix}{label.split('-')[0]}.safetensors"
        if scores.is_file():
            s = store.load_tensors(scores)
            if "reference/logprobs" in s:
                refs[label] = s["reference/logprobs"]
    rules = compute_coverage(contract, rollout=store.load_tensors(ref_dir / ROLLOUT_FILE),
                             targets=store.load_tensors(ref_dir / TARGETS_FILE),
                             train=store.load_tensors(ref_dir / TRAIN_INPUTS_FILE),
                             runs=runs, ref_logprobs=refs)
    return coverage_document(contract, rules)
