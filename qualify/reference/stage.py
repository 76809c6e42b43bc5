"""The frozen-contract stage: ``qualify reference CONTRACT``.

Steps (docs/concepts.md, "The stages"; each name is a key of ``reference.json``
``step_started_s``), each writing into an unsealed directory
``references/<name>-<digest12>/`` that is sealed only at the very end:

1. ``models``: verify the model manifest and prepare the role models;
2. ``rollout``: capture the rollout with the contract's sampler;
3. ``scoring``: teacher-forced HF scoring at FP32 and BF16 (actor, reference policy, critic,
   reward);
4. ``targets``: PPO / GRPO targets in FP64 (numpy) from the FP32 scores;
5. ``updates``: the independent reference update (HF + ``torch.optim.AdamW``) in each lane;
6. ``controls``: the independent controls and their errors;
7. ``round_to_round``: the perturbed round-to-round updates
   (:mod:`qualify.reference.round_to_round`, when the contract's ``[bounds] round_to_round``
   asks for their term) and the bounds;
8. ``branches``: the clip-ambiguous tokens and their sealed gradient contributions
   (:mod:`qualify.reference.branches`: ``branches.json``, ``branches/``), the control errors
   they adjust, ``control_errors.json`` and ``bounds.json``;
9. ``distribution``: the reference's next-token distributions and their HF controls
   (:mod:`qualify.reference.distribution`: ``distribution.json``, ``distribution.safetensors``);
10. ``seal``: environment capture, ``MANIFEST.json`` last, files read-only.

Each step starts with :func:`qualify.memory.release_free_memory`: the heap pages the
previous step freed go back to the OS before it allocates (the plan,
:mod:`qualify.reference.plan`, models each step from that floor).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qualify import scratch
from qualify.bounds import (
    Bound,
    bf16_quanta,
    bounds_document,
    compute_bounds,
    measure_controls,
    scalar_resolutions,
)
from qualify.contract import Contract, Precision
from qualify.errors import ContractError, ReferenceDataError, UsageError
from qualify.evidence import statement, store
from qualify.evidence.environment import capture_environment
from qualify.evidence.sign import ensure_signed, needs_signature, seal_and_sign
from qualify.lanes import forward_mode, lane_bf16_mode, lane_precision
from qualify.layout import (
    BOUNDS_FILE,
    CONTRACT_FILE,
    CONTRACT_TOML_FILE,
    CONTROL_ERRORS_FILE,
    CONTROLS_DIR,
    COVERAGE_FILE,
    ENVIRONMENT_FILE,
    HF_REFERENCE_DIR,
    MODEL_FILE,
    REFERENCE_FILE,
    ROUND_TO_ROUND_FILE,
    ROUND_TO_ROUND_TENSORS_FILE,
    SCORES_DIR,
    TARGETS_FILE,
    hf_tensors_file,
    reference_dir_name,
)
from qualify.memory import release_free_memory
from qualify.models import bundle as models
from qualify.models import roles
from qualify.progress import Progress
from qualify.prompts import check_token_ids, read_prompts_file
from qualify.protocol import ROLLOUT_META_FILE, TRAIN_INPUTS_FILE, parse_tensor_name
from qualify.reference import devices as reference_devices
from qualify.reference import rollout, round_to_round, sampling, scoring, targets
from qualify.reference.bound_inputs import norm_evals, recompute_bounds, sensitivities
from qualify.reference.branches import adjust_control_errors, seal_branches
from qualify.reference.controls import control_errors_document, control_settings
from qualify.reference.distribution import seal_distribution
from qualify.reference.update import (
    KL_REFERENCE_SOURCE,
    Batch,
    Bf16Mode,
    UpdateSettings,
    kl_reference_before_load,
    run_actor,
    run_critic,
)
from qualify.statistics import ErrorMeasure, MetricKey

__all__ = ["BOUNDS_FILE", "CONTROL_ERRORS_FILE", "REFERENCE_FILE", "REFERENCE_KIND",
           "reference_dir_name", "resolve_prompts",
           "run_reference_stage"]

REFERENCE_KIND = statement.REFERENCE_KIND


def resolve_prompts(contract: Contract, bundle: models.ModelBundle) -> list[list[int]]:
    """Turn the contract's prompts into token id lists.

    Raises:
        ContractError: text prompts without a tokenizer; a bad prompts file
            (:func:`qualify.prompts.read_prompts_file`); a token id outside the vocabulary;
            a prompt whose length plus ``sampling.max_new_tokens`` exceeds the model's
            ``max_position_embeddings``.
    """
    p = contract.prompts
    texts: list[str] | None = None
    ids: list[list[int]] | None = None
    if p.token_ids is not None:
        ids = [list(x) for x in p.token_ids]
    elif p.text is not None:
        texts = list(p.text)
    else:
        assert p.file is not None
        base = contract.path.parent if contract.path else Path.cwd()
        got = read_prompts_file((base / p.file).resolve(), p.sha256)
        ids = [list(x) for x in got.token_ids] if got.token_ids is not None else None
        texts = list(got.text) if got.text is not None else None
    if texts is not None:
        tok = roles.load_tokenizer(bundle)
        if tok is None:
            raise ContractError("prompts.text: the model has no tokenizer; use prompts.token_ids")
        ids = [list(tok(t, add_special_tokens=True)["input_ids"]) for t in texts]
    assert ids is not None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(bundle.actor_dir)
    positions = getattr(config, "max_position_embeddings", None)
    check_token_ids(ids, int(config.vocab_size), f"{contract.path}: " if contract.path else "",
                    max_positions=positions if isinstance(positions, int) else None,
                    max_new_tokens=contract.sampling.max_new_tokens,
                    field="prompts.text" if texts is not None else "prompts.token_ids")
    return ids


def _batch(roll: rollout.Rollout, train: dict[str, torch.Tensor], pad: int) -> Batch:
    return Batch(prompts=roll.prompts, responses=roll.responses,
                 attention_mask=roll.attention_mask, response_mask=roll.response_mask,
                 advantages=train["advantages"], returns=train["returns"], pad_token_id=pad,
                 behavior_logprobs=roll.behavior_logprobs.float())


def _update_run(contract: Contract, bundle: models.ModelBundle, batch: Batch,
                settings: UpdateSettings, attn: str) -> tuple[dict[str, torch.Tensor],
                                                             dict[str, Any]]:
    """One full reference-update run (actor + critic, all rounds) with fresh FP32 models."""
    release_free_memory()  # the models and states the last run freed (qualify.memory)
    out: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"attn_implementation": attn, "settings": {
        "precision": settings.precision, "bf16_mode": settings.bf16_mode,
        "micro_batch_size": settings.micro_batch_size,
        "extra_left_padding": settings.extra_left_padding,
        "extra_right_padding": settings.extra_right_padding}}
    r_len = batch.responses.shape[1]
    torch.manual_seed(0)
    fp64 = settings.precision == "fp64"  # the FP64 control: FP64 copies of the FP32 checkpoint
    ref_logp = kl_reference_before_load(contract, bundle.actor_dir, batch, settings, attn)
    meta["kl_reference"] = dict(KL_REFERENCE_SOURCE)
    release_free_memory()  # the reference policy, before the trained Actor is loaded
    actor = reference_devices.load_role("actor", bundle.actor_dir, dtype=torch.float32,
                                        attn_implementation=attn, requires_grad=True)
    if fp64:
        actor = actor.double()
    t, meta["actor"] = run_actor(actor, None, batch, contract, settings, ref_logprobs=ref_logp)
    out.update(t)
    del actor
    release_free_memory()
    if contract.algorithm.name != "grpo":
        critic = reference_devices.load_role("critic", bundle.critic_dir, dtype=torch.float32,
                                             attn_implementation=attn, requires_grad=True)
        if settings.precision == "fp64":
            critic = critic.double()
        t, meta["critic"] = run_critic(critic, batch, contract, settings)
        out.update(t)
        del critic
    return _strip_padding(out, r_len), meta


def _round_to_round(contract: Contract, bundle: models.ModelBundle, batch: Batch, *,
                    lane: str, reference: dict[str, torch.Tensor],
                    errors: dict[str, dict[MetricKey, ErrorMeasure]],
                    mask: torch.Tensor) -> dict[MetricKey, round_to_round.Response]:
    """The round-to-round responses of one lane (:mod:`qualify.reference.round_to_round`).

    Each perturbed update runs with the lane's reference settings on fresh FP32 models,
    as :func:`_update_run` does (one load of the checkpoint, restored into one working
    copy before each run; the KL reference logprobs taken once, by the reference policy
    loaded alone before the Actor,
    :func:`qualify.reference.update.kl_reference_before_load`); the size is
    the largest control error of the lane over every control it measured. None in the
    deterministic lane (its bounds are 0) or where the contract does not ask for the term
    (``[bounds] round_to_round``).
    """
    if contract.bounds.lane == "deterministic" or not contract.bounds.round_to_round:
        return {}
    rounds = contract.algorithm.rounds
    roles_run = ["actor"] + ([] if contract.algorithm.name == "grpo" else ["critic"])
    sizes = {(r - 1, role): round_to_round.perturbation_size(errors, errors, r - 1, role)
             for r in range(2, rounds + 1) for role in roles_run}
    settings = UpdateSettings(precision="bf16" if lane_precision(lane) == "bf16" else "fp32",
                              bf16_mode=lane_bf16_mode(lane),
                              micro_batch_size=contract.algorithm.micro_batch_size,
                              label=f"round_to_round-{lane}")
    r_len = batch.responses.shape[1]
    loaded: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}
    kl_reference: dict[str, torch.Tensor] = {}

    def fresh(role: str) -> torch.nn.Module:
        """A ``role`` model holding its checkpoint's FP32 values, as a fresh load would.

        The checkpoint is loaded once and copied once (one role held at a time); each call
        then restores that one working copy from the load
        (:func:`qualify.models.roles.restore_model`) instead
        of copying the module again.
        """
        if role not in loaded:
            loaded.clear()
            template = reference_devices.load_role(
                role, bundle.actor_dir if role == "actor" else bundle.critic_dir,
                dtype=torch.float32, attn_implementation="sdpa", requires_grad=True)
            loaded[role] = (template, copy.deepcopy(template))
        template, work = loaded[role]
        return roles.restore_model(work, template)

    def update(role: str, n: int, offsets: Mapping[int, torch.Tensor] | None
               ) -> dict[str, torch.Tensor]:
        release_free_memory()
        torch.manual_seed(0)
        if role == "actor":
            # The reference policy is the Actor's checkpoint (reference_policy), frozen; its
            # KL logprobs are the same in every perturbed update, so they are taken once,
            # from the policy alone (no role model held), before the Actor's first load.
            if "actor" not in kl_reference:
                loaded.clear()
                kl_reference["actor"] = kl_reference_before_load(
                    contract, bundle.actor_dir, batch, settings, "sdpa")
                release_free_memory()
                torch.manual_seed(0)  # the Actor's load sees the seed as without this load
            t, _ = run_actor(fresh("actor"), None, batch, contract, settings, offsets=offsets,
                             last_forward=n, ref_logprobs=kl_reference["actor"])
        else:
            t, _ = run_critic(fresh("critic"), batch, contract, settings, offsets=offsets,
                              last_forward=n)
        return _strip_padding(t, r_len)

    logprobs = {r: reference[f"round{r}/actor/logprobs"] for r in range(1, rounds)
                if f"round{r}/actor/logprobs" in reference}
    return round_to_round.measure(update, roles=roles_run, rounds=rounds, sizes=sizes,
                                  mask=mask, logprobs=logprobs,
                                  temperature=contract.sampling.temperature)


def _strip_padding(tensors: dict[str, torch.Tensor], r_len: int) -> dict[str, torch.Tensor]:
    """Cut per-token tensors ``[B, R + extra]`` back to ``[B, R]`` (padding columns dropped).

    Only per-token metrics (``logprobs``, ``entropy``, ``values``) are cut; parameters,
    gradients and optimizer state keep their shapes.
    """
    out = {}
    for k, v in tensors.items():
        metric = parse_tensor_name(k)[2]
        per_token = metric in ("logprobs", "entropy", "values")
        out[k] = v[:, :r_len].contiguous() if per_token and v.shape[1] > r_len else v
    return out


def _reward_scores(contract: Contract, bundle: models.ModelBundle, roll: rollout.Rollout,
                   *, precision: scoring.Precision, bf16_mode: Bf16Mode, attn: str,
                   micro_batch_size: int,
                   extra_left: int = 0, extra_right: int = 0) -> torch.Tensor:
    if contract.roles.reward == "model":
        assert bundle.reward_dir is not None
        rm = reference_devices.load_role("reward", bundle.reward_dir, dtype=torch.float32,
                                         attn_implementation=attn, requires_grad=False)
        res = scoring.score_rewards(rm, roll, precision=precision,
                                    bf16_mode=forward_mode(bf16_mode),
                                    micro_batch_size=micro_batch_size,
                                    extra_left_padding=extra_left,
                                    extra_right_padding=extra_right)
        return res.tensors["scores"].float()
    return scoring.rule_rewards(roll, rule=contract.roles.reward.removeprefix("rule:")).float()


def run_reference_stage(contract: Contract, *, root: Path, new: bool = False,
                        quiet: bool = False,
                        on_step: Callable[[str], None] | None = None,
                        plan_check: bool = True) -> Path:
    """Run the whole reference stage and seal its directory.

    Its models run on the devices :func:`qualify.reference.devices.resolve` gives (every
    CUDA device, whole layers per device; ``$QUALIFY_REFERENCE_DEVICES``; else the host),
    recorded in the environment document's ``reference_devices``, with the AdamW state and
    the sensitivity copy where the plan check chose (``optimizer_state``: on the host when
    only the host fits them, :func:`_plan_check`).

    Args:
        contract: the loaded contract.
        root: parent directory (``references/``).
        new: make ``<name>-<digest12>-N`` when a sealed directory exists.
        quiet: no progress bars.
        on_step: test hook called with each step name before it runs (used to simulate an
            interrupted run).
        plan_check: refuse, before anything is written, a contract whose planned memory
            does not fit this machine (:func:`_plan_check`: the reference steps'
            shortfall). ``False`` (``qualify reference --no-plan-check``) runs it anyway; the
            environment document records which (``plan_check``).

    Returns:
        The sealed reference directory.

    Raises:
        ReferenceDataError: the directory is sealed and signed already (without ``new``); a
            sealed directory left unsigned by a killed signer is signed and returned.
        ModelSourceError: the model manifest does not match.
        ContractError: the prompts cannot be resolved.
        UsageError: ``$QUALIFY_SCRATCH_DIR`` names no writable directory
            (:func:`qualify.scratch.check_setting`), ``$QUALIFY_REFERENCE_DEVICES`` no
            devices (:func:`qualify.reference.devices.resolve`), or
            ``$QUALIFY_REFERENCE_DEVICE_MEMORY`` a bad memory, one without placed devices
            (:func:`qualify.reference.devices.device_memory`) or one for a contract that
            cannot be planned (with ``plan_check``), before anything is written.
        DoesNotFitError: the plan does not fit this machine (with ``plan_check``), before
            anything is written.
    """
    scratch.check_setting()
    devices = reference_devices.resolve()
    memory = reference_devices.device_memory()
    if memory is not None and devices is None:
        raise UsageError(f"{reference_devices.MEMORY_ENV}: nothing is placed (no CUDA device, "
                         f"or {reference_devices.ENV}=host); give {reference_devices.ENV}="
                         "cpu,cpu,... for the placed path on the host")
    plan_record = _plan_check(contract, plan_check, devices, memory)
    if devices is not None and plan_record["optimizer_state"] == "host":
        devices = dataclasses.replace(devices, optimizer_state="host",
                                      gradients=plan_record.get("gradients", "device"),
                                      round2_state=plan_record.get("round2_state", "moments"))
    base = root / reference_dir_name(contract)
    if not new and store.is_sealed(base) and needs_signature(base):
        # sealed, then killed while signing (tests/test_kill_points.py, ref-sign): sign it
        ensure_signed(base)
        return base
    target = store.next_free_dir(base) if new and store.is_sealed(base) else base
    out = store.claim_dir(target, kind=REFERENCE_KIND)
    timings: dict[str, float] = {}
    precisions = list(contract.matrix.precisions)
    mbs = contract.algorithm.micro_batch_size
    steps = ["models", "rollout", "scoring", "targets", "updates", "controls", "round_to_round",
             "branches", "distribution", "seal"]
    with reference_devices.active(devices) as devices_record, \
            Progress(total=len(steps), description=f"reference {contract.name}",
                     quiet=quiet) as bar:

        def step(name: str) -> None:
            release_free_memory()
            if on_step is not None:
                on_step(name)
            bar.advance(name)
            timings[name] = time.perf_counter()

        step("models")
        bundle = models.prepare_models(contract)
        store.atomic_write_text(out / CONTRACT_TOML_FILE,
                                contract.path.read_text() if contract.path else "")
        store.atomic_write_json(out / CONTRACT_FILE, contract.to_dict())
        store.atomic_write_json(out / MODEL_FILE, bundle.to_dict())

        step("rollout")
        prompts = resolve_prompts(contract, bundle)
        roll = sampling.capture_rollout(contract.sampling, prompts, actor_dir=bundle.actor_dir,
                                       pad_token_id=bundle.pad_token_id,
                                       eos_token_id=bundle.eos_token_id)
        roll.save(out)

        step("scoring")
        scores: dict[str, dict[str, torch.Tensor]] = {}
        records: dict[str, Any] = {}
        for prec in precisions:
            s, rec = _score_all(contract, bundle, roll, precision=prec, attn="sdpa",
                                micro_batch_size=mbs)
            scores[prec] = s
            records[prec] = rec
            store.save_tensors(out / SCORES_DIR / hf_tensors_file(prec), s)
        fp32_scores = scores.get("fp32")
        if fp32_scores is None:
            fp32_scores, _ = _score_all(contract, bundle, roll, precision="fp32", attn="sdpa",
                                        micro_batch_size=mbs)

        step("targets")
        tg = targets.compute_targets(
            algorithm=contract.algorithm.name,
            scores=fp32_scores["reward/scores"].double().numpy(),
            logprobs=fp32_scores["actor/logprobs"].double().numpy(),
            ref_logprobs=fp32_scores["reference/logprobs"].double().numpy(),
            values=fp32_scores["critic/values"].double().numpy()
            if "critic/values" in fp32_scores else None,
            bootstrap_values=fp32_scores["critic/last_values"].double().numpy()
            if "critic/last_values" in fp32_scores else None,
            response_mask=roll.response_mask.numpy(),
            eos_terminated=roll.eos_terminated.numpy(),
            group_index=roll.group_index.numpy(),
            gamma=contract.algorithm.gamma, lam=contract.algorithm.lam,
            kl_coef=contract.algorithm.kl_coef, kl_estimator=contract.algorithm.kl_estimator,
            whiten=contract.algorithm.whiten_advantages,
            grpo_eps=contract.algorithm.grpo_eps,
            grpo_norm_by_std=contract.algorithm.grpo_norm_by_std,
        )
        store.save_tensors(out / TARGETS_FILE, tg.to_tensors())
        train = {"advantages": torch.from_numpy(tg.advantages.astype(np.float32)),
                 "returns": torch.from_numpy(tg.returns.astype(np.float32))}
        store.save_tensors(out / TRAIN_INPUTS_FILE, train)
        batch = _batch(roll, train, bundle.pad_token_id)

        step("updates")
        # One reference update per lane: a precision, and at BF16 each BF16 style the
        # matrix's engines declare (qualify.lanes): a BF16 cell meets its own style.
        lanes = contract.matrix.lanes()
        ref_runs: dict[str, dict[str, torch.Tensor]] = {}
        update_meta: dict[str, Any] = {}
        for lane in lanes:
            lane_prec = lane_precision(lane)
            settings = UpdateSettings(precision="bf16" if lane_prec == "bf16" else "fp32",
                                      bf16_mode=lane_bf16_mode(lane), micro_batch_size=mbs,
                                      label=f"hf-{lane}")
            t, meta = _update_run(contract, bundle, batch, settings, "sdpa")
            # The frozen reward model runs alike in the lanes of one forward mode (a
            # castmasters lane's masters differ from the params lane's, its forwards do not).
            t["round1/reward/rewards"] = scores[lane_prec]["reward/scores"] \
                if forward_mode(settings.bf16_mode) == "params" else \
                _reward_scores(contract, bundle, roll, precision=settings.precision,
                               bf16_mode=settings.bf16_mode, attn="sdpa", micro_batch_size=mbs)
            ref_runs[lane] = t
            update_meta[f"hf-{lane}"] = meta
            store.save_tensors(out / HF_REFERENCE_DIR / hf_tensors_file(lane), t)
            _check_state_dtypes(meta, f"hf-{lane}")

        step("controls")
        control_runs: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        for lane in lanes:
            control_runs[lane] = {}
            for name, (settings, attn) in control_settings(contract, lane).items():
                if name == "bf16_mode" and "bf16-autocast" in ref_runs:
                    # The same settings as the autocast lane's reference update: reuse it.
                    t, meta = ref_runs["bf16-autocast"], update_meta["hf-bf16-autocast"]
                else:
                    t, meta = _update_run(contract, bundle, batch, settings, attn)
                    t["round1/reward/rewards"] = _reward_scores(
                        contract, bundle, roll, precision=settings.precision,
                        bf16_mode=settings.bf16_mode,
                        attn=attn, micro_batch_size=settings.micro_batch_size,
                        extra_left=settings.extra_left_padding,
                        extra_right=settings.extra_right_padding)
                control_runs[lane][name] = t
                update_meta[f"{name}-{lane}"] = meta
                store.save_tensors(out / CONTROLS_DIR / f"{name}-{lane}.safetensors", t)
        mask = roll.response_mask.numpy()
        errors = measure_controls(
            {p: {k: v.numpy() for k, v in t.items()} for p, t in ref_runs.items()},
            {p: {n: {k: v.numpy() for k, v in t.items()} for n, t in runs.items()}
             for p, runs in control_runs.items()},
            mask,
        )
        ref_np = {p: {k: v.numpy() for k, v in t.items()} for p, t in ref_runs.items()}
        resolutions = scalar_resolutions(
            ref_np, {lane: norm_evals(update_meta[f"hf-{lane}"]) for lane in ref_runs})
        quanta = bf16_quanta(ref_np)
        sens = {lane: sensitivities(update_meta[f"hf-{lane}"]) for lane in ref_runs}
        step("round_to_round")
        r2r_runs = {lane: _round_to_round(contract, bundle, batch, lane=lane,
                                          reference=ref_runs[lane], errors=errors[lane],
                                          mask=roll.response_mask)
                    for lane in lanes}
        r2r = round_to_round.terms(r2r_runs)
        if contract.bounds.round_to_round:
            store.atomic_write_json(out / ROUND_TO_ROUND_FILE,
                                    round_to_round.round_to_round_document(r2r_runs))
            store.save_tensors(out / ROUND_TO_ROUND_TENSORS_FILE,
                               round_to_round.round_to_round_tensors(r2r_runs))
        bounds = compute_bounds(contract, errors, resolutions, sens, quanta,
                                round_to_round=r2r)

        step("branches")
        train_np = {k: v.numpy() for k, v in train.items()}
        branch_doc = seal_branches(contract, bundle, batch, ref_runs=ref_runs, bounds=bounds,
                                   train=train_np, mask=mask, out=out)
        adjustments = adjust_control_errors(
            contract, errors,
            ref_runs={p: {k: v.numpy() for k, v in t.items()} for p, t in ref_runs.items()},
            control_runs={p: {n: {k: v.numpy() for k, v in t.items()} for n, t in runs.items()}
                          for p, runs in control_runs.items()},
            doc=branch_doc, out=out, train=train_np, mask=mask,
            behavior=roll.behavior_logprobs.double().numpy())
        bounds = compute_bounds(contract, errors, resolutions, sens, quanta,
                                round_to_round=r2r)
        store.atomic_write_json(out / CONTROL_ERRORS_FILE, control_errors_document(errors))
        store.atomic_write_json(out / BOUNDS_FILE, bounds_document(contract, bounds),
                                schema="bounds")

        step("distribution")  # releases what the clip-branch reruns freed (qualify.memory)
        seal_distribution(contract, bundle.actor_dir, roll.to_tensors(), out)  # decode rows

        step("seal")
        coverage = _coverage(contract, out, roll=roll, tg=tg, train=train, scores=scores,
                             ref_runs=ref_runs)
        store.atomic_write_json(out / ENVIRONMENT_FILE,
                                {**capture_environment(), "plan_check": plan_record,
                                 "reference_devices": devices_record},
                                schema="environment")
        t0 = min(timings.values())
        store.atomic_write_json(out / REFERENCE_FILE, {
            "schema_version": 1,
            "contract": contract.name,
            "contract_digest": contract.digest,
            "created": store.utc_now(),
            "rollout_engine": contract.sampling.engine,
            "rollout_meta": ROLLOUT_META_FILE,
            "precisions": precisions,
            "lanes": lanes,
            "scoring_records": records,
            "update_meta": update_meta,
            "coverage": coverage,
            "control_clip_branch_adjustments": adjustments,
            "clip_ambiguous_tokens": {
                prec: {role: {rnd: len(d["tokens"]) for rnd, d in by_round.items()}
                       for role, by_round in by_role.items()}
                for prec, by_role in branch_doc["precisions"].items()},
            "step_started_s": {k: round(v - t0, 3) for k, v in timings.items()},
        })
        _check_recomputable(out, contract, bounds)
        seal_and_sign(out, kind=REFERENCE_KIND)
    return out


def _plan_check(contract: Contract, enforce: bool,
                devices: reference_devices.ReferenceDevices | None = None,
                device_bytes: int | None = None) -> dict[str, Any]:
    """Plan the stage on this machine; refuse it if ``enforce`` and it does not fit.

    The plan's devices are the stage's CUDA devices (:func:`qualify.reference.devices.resolve`)
    with their own memory, or ``device_bytes`` each when given
    (``$QUALIFY_REFERENCE_DEVICE_MEMORY``); a ``cpu`` placement is planned as its devices with
    ``device_bytes`` each when given (the device-budget mode on the host), else without
    devices (host memory), as is the host (``host``, nothing placed). The plan chooses where
    the AdamW state lives (:func:`qualify.reference.plan.build_plan`: on the devices unless
    only the host fits it), and the stage runs with that choice.

    Returns:
        The environment document's ``plan_check``: whether it was enforced, the planned
        devices and each one's memory (``device_bytes``, 0 without devices), the planned host
        peak (bytes), the shortfall line (``None`` when it fits), ``optimizer_state`` and
        why (``optimizer_state_why``), ``gradients`` and why (``gradients_why``: the update
        runs' gradients streamed to the host or not, :data:`qualify.reference.plan.GRADIENTS`),
        ``round2_state`` and why (``round2_state_why``: what the host AdamW keeps between
        rounds 1 and 2, :data:`qualify.reference.plan.ROUND2_STATES`);
        a contract whose model sizes the plan cannot read (an
        ``hf-dir`` model without ``model.manifest.config``) is not planned (``not_planned``:
        why) and runs with the state on the devices; with ``device_bytes`` given too it is
        refused when ``enforce`` (a budget nothing checks), else warned about.

    Raises:
        DoesNotFitError: it does not fit and ``enforce``.
        UsageError: ``device_bytes`` given, ``enforce``, and the contract cannot be planned.
    """
    from qualify.reference.plan import DoesNotFitError, build_plan
    from qualify.reference.plan_core import machine_defaults

    machine = machine_defaults()
    n = len(devices.devices) if devices is not None and (
        devices.kind == "cuda" or device_bytes is not None) else 0
    machine = dataclasses.replace(
        machine, devices=n, device_bytes=0 if not n else (
            machine.device_bytes if device_bytes is None else device_bytes),
        device_kind="cpu" if devices is not None and devices.kind == "cpu" else "gpu")
    try:
        plan = build_plan(contract, machine)
    except ContractError as e:  # sizes the contract does not state: the model decides later
        if device_bytes is not None:  # a budget that nothing can be checked against
            msg = (f"{reference_devices.MEMORY_ENV}: {contract.path or contract.name} cannot be "
                   f"planned ({e}), so a device budget cannot be applied")
            if enforce:
                raise UsageError(f"{msg}; unset it, or `qualify reference --no-plan-check` "
                                 "goes on without it") from None
            print(f"qualify: warning: {msg}; running without it (--no-plan-check)",
                  file=sys.stderr)
        return {"enforced": enforce, "devices": machine.devices,
                "device_bytes": machine.device_bytes,
                "host_bytes": machine.host_bytes, "planned_host_peak_bytes": None,
                "shortfall": None, "optimizer_state": "device",
                "optimizer_state_why": "not planned", "not_planned": str(e)}
    short = plan.shortfall("reference")  # the launches are the candidate stage's
    if short is not None and enforce:
        raise DoesNotFitError(f"{contract.path or contract.name}: does not fit this machine: "
                              f"{short} (qualify plan shows each step; `qualify reference "
                              "--no-plan-check` runs it anyway)")
    if short is not None:
        print(f"qualify: warning: the plan does not fit this machine, running anyway "
              f"(--no-plan-check): {short}", file=sys.stderr)
    return {"enforced": enforce, "devices": machine.devices,
            "device_bytes": machine.device_bytes, "host_bytes": machine.host_bytes,
            "planned_host_peak_bytes": max((s.host_peak for s in plan.steps
                                            if s.kind == "reference"), default=0),
            "shortfall": short, "optimizer_state": plan.optimizer_state,
            "optimizer_state_why": plan.optimizer_state_why, "gradients": plan.gradients,
            "gradients_why": plan.gradients_why, "round2_state": plan.round2_state,
            "round2_state_why": plan.round2_state_why}


def _check_recomputable(out: Path, contract: Contract, bounds: list[Bound]) -> None:
    """The bounds follow from what is about to be sealed (``qualify verify`` step 9).

    Raises:
        ReferenceDataError: the rule applied to the written files gives other bounds (a
            defect of the stage: a rule input it does not seal).
    """
    again = recompute_bounds(out, contract)
    if [b.to_dict() for b in again] != [b.to_dict() for b in bounds]:
        raise ReferenceDataError(f"{out}: the bounds do not follow from the sealed control "
                                 "errors and update records (internal error of the stage)")


def _coverage(contract: Contract, out: Path, *, roll: rollout.Rollout, tg: targets.Targets,
              train: dict[str, torch.Tensor], scores: dict[str, dict[str, torch.Tensor]],
              ref_runs: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Write ``coverage.json`` (:mod:`qualify.reference.coverage`); return its summary.

    Each rule nothing exercises is warned about on stderr (``NO POWER: ...``): a check
    that cannot fail on this contract is no evidence.
    """
    from qualify.reference.coverage import compute_coverage, coverage_document

    rollout_np = {k: v.numpy() for k, v in roll.to_tensors().items()}
    refs = {label: s["reference/logprobs"].numpy()
            for label in ref_runs
            if (s := scores.get(label) or scores.get(label.split("-")[0])) is not None
            and "reference/logprobs" in s}
    rules = compute_coverage(
        contract, rollout=rollout_np, targets=tg.to_tensors(),
        train={k: v.numpy() for k, v in train.items()},
        runs={label: {k: v.numpy() for k, v in t.items()} for label, t in ref_runs.items()},
        ref_logprobs=refs)
    doc = coverage_document(contract, rules)
    store.atomic_write_json(out / COVERAGE_FILE, doc)
    for line in doc["summary"]["no_power"]:
        print(f"qualify: warning: {line}", file=sys.stderr)
    return {"file": COVERAGE_FILE, **doc["summary"]}


def _check_state_dtypes(meta: dict[str, Any], label: str) -> None:
    """The reference's own optimizer state must be FP32 in both precisions."""
    for role in ("actor", "critic"):
        if role not in meta:
            continue
        for key, dtype in meta[role]["optimizer_state"].items():
            if dtype != "torch.float32":
                raise ReferenceDataError(f"{label}: {role} optimizer {key} is {dtype}, "
                                         "expected torch.float32")


def _score_all(contract: Contract, bundle: models.ModelBundle, roll: rollout.Rollout, *,
               precision: Precision, attn: str,
               micro_batch_size: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Teacher-forced scores of every role at one precision (BF16: BF16 parameters)."""
    temp = contract.sampling.temperature
    out: dict[str, torch.Tensor] = {}
    rec: dict[str, Any] = {}
    bf16_mode: scoring.Bf16Mode = "params"
    actor = reference_devices.load_role("actor", bundle.actor_dir, dtype=torch.float32,
                                        attn_implementation=attn, requires_grad=False)
    res = scoring.score_policy(actor, roll, temperature=temp, micro_batch_size=micro_batch_size,
                               precision=precision, bf16_mode=bf16_mode)
    out["actor/logprobs"] = res.tensors["logprobs"]
    out["actor/entropy"] = res.tensors["entropy"]
    rec["actor"] = res.record.to_dict()
    # The reference policy is the actor's init: a separate load, so nothing is shared.
    ref = reference_devices.load_role("actor", bundle.actor_dir, dtype=torch.float32,
                                      attn_implementation=attn, requires_grad=False)
    res = scoring.score_policy(ref, roll, temperature=temp, micro_batch_size=micro_batch_size,
                               precision=precision, bf16_mode=bf16_mode)
    out["reference/logprobs"] = res.tensors["logprobs"]
    rec["reference"] = res.record.to_dict()
    del actor, ref
    if contract.algorithm.name != "grpo":
        critic = reference_devices.load_role("critic", bundle.critic_dir, dtype=torch.float32,
                                             attn_implementation=attn, requires_grad=False)
        res = scoring.score_values(critic, roll, micro_batch_size=micro_batch_size,
                                   precision=precision, bf16_mode=bf16_mode)
        out["critic/values"] = res.tensors["values"]
        out["critic/last_values"] = res.tensors["last_values"]
        rec["critic"] = res.record.to_dict()
    out["reward/scores"] = _reward_scores(contract, bundle, roll, precision=precision,
                                          bf16_mode=bf16_mode, attn=attn,
                                          micro_batch_size=micro_batch_size)
    return {k: v.float().contiguous() for k, v in out.items()}, rec
