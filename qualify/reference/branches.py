"""Sealed clip-branch contributions: the reference stage's answer to a legitimate flip.

PPO's clipped losses switch a token's gradient between its full value and zero
(:mod:`qualify.branches`). A candidate whose values and logprobs pass their sealed bounds can
still sit on the other side of a switch for a token that lies that close to it, and then
its round-``r`` gradient differs from the reference's by that token's whole contribution:
an exact consequence of the contract, not an engine error, and not something the
gradient bounds (set by controls that rarely flip a token) cover.

Before any candidate runs, the reference stage therefore lists, per precision, role and
round ``r >= 2``, every token whose branch can change within the sealed ``max_abs`` bounds
of the reference's own round-1 and round-``r`` values / logprobs
(:func:`qualify.branches.ambiguous_tokens`), reruns the reference update of that role (the
same code, which must reproduce the sealed run) and, at round ``r``, records for each
listed token the gradient ``J_t`` of its logprob or value
(:func:`qualify.reference.jacobian.token_gradients`; the token's contribution is ``s_t J_t``
with a scalar the comparator takes from the run it adjusts), reported like the gradients
(exact, or the protocol's sample of a large parameter: the only elements the comparator
reads, so nothing is lost), plus the scalars ``<g, J_t>`` (FP64, ``g`` the reference's whole
pre-clip gradient) and ``<J_s, J_t>`` over the whole ``J_t`` (:mod:`qualify.reference.gram`:
FP64 while they fit; else rebuilt from each token's backward factors,
:mod:`qualify.reference.gram_factors`, or by forward mode, both exact to FP32 rounding).
The comparator may then judge a gradient family against the expected run moved to the
obtained run's own branches (:func:`qualify.branches.adjusted_expected`), with the same sealed
bounds, and only for tokens sealed here.

``J_t`` is computed in FP32 from the round's FP32 master at every precision. For BF16 that
differs from the BF16 forward's own ``J_t`` by BF16 rounding of one token's term (relative
~1e-2 of ``s_t J_t``, itself ~1/N of the round's gradient), far inside the BF16 gradient
bounds, and it costs one FP32 backward per token instead of a BF16 one (measured on
SmolLM2-135M on a 2-core CPU: 3.0 s against 24.9 s per token). ``branches.json`` records
this as ``j_precision``.

Files: ``branches/hf-{precision}.safetensors`` (tensors ``round{r}/{role}/{b}_{t}/{param}``)
and ``branches.json`` (tokens, tolerances, scalars, the rerun's reproduction check).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from qualify import branches
from qualify.bounds import Bound, ControlErrors, lookup
from qualify.contract import Contract
from qualify.errors import ReferenceDataError
from qualify.evidence import store
from qualify.lanes import lane_bf16_mode
from qualify.layout import BRANCHES_DIR, BRANCHES_FILE, hf_tensors_file
from qualify.memory import release_free_memory
from qualify.models import bundle as models
from qualify.protocol import ParamSampling, param_sample_indices, tensor_name
from qualify.reference import gram, gram_factors
from qualify.reference.devices import load_role
from qualify.reference.jacobian import token_gradients
from qualify.reference.update import (
    Batch,
    RoundHook,
    UpdateSettings,
    kl_reference_before_load,
    run_actor,
    run_critic,
    with_rollout_rows,
)
from qualify.statistics import MetricKey, compare_sets

MAX_SEALED_TOKENS = 128
"""At most this many tokens per precision, role and round, those nearest a switch first: each
costs one FP32 backward pass of its sequence in the reference stage and its ``J_t`` is
stored at the reported elements (0.28 MB per token for SmolLM2-135M at 256:256 sampling,
docs/evidence-size.md). A flip of an
ambiguous token left unsealed is never adjusted (its row fails and names it; a control's
raw error, discontinuity included, sets the bound); ``branches.json`` records how many
were left. On SmolLM2-135M at BF16 every valid token (111 of 112) is ambiguous in round 2,
and a cap of 32 left the ``bf16_mode`` control's flip at (2, 9) unsealed: its raw round-2
Actor ``grad_norm`` error, 2.14 on a norm of 4.56, set the bound."""
REPRODUCE_FRACTION = 0.1
"""The rerun must reproduce the sealed round-``r`` values / logprobs within this fraction of
the round's bound (bitwise on a deterministic CPU run)."""


def _tolerance(bounds: list[Bound], precision: str, role: str, family: str, round_: int) -> float:
    b = lookup(bounds, precision=precision, klass="candidate_vs_hf",
               key=MetricKey(round=round_, role=role, family=family))
    if b is None:
        raise ReferenceDataError(f"bounds: no candidate_vs_hf bound for "
                                 f"round{round_}/{role}/{family} at {precision}")
    return b.widest  # a token with a round-to-round response may move this far


def _reported(name: str, t: torch.Tensor, sampling: ParamSampling) -> torch.Tensor:
    idx = param_sample_indices(name, t.numel(), sampling)
    t = t if idx is None else t.reshape(-1)[torch.from_numpy(idx)]
    return t.cpu().clone()  # sealed on the host (a placed model's J_t is on its devices)


def seal_branches(contract: Contract, bundle: models.ModelBundle, batch: Batch, *,
                  ref_runs: Mapping[str, Mapping[str, torch.Tensor]], bounds: list[Bound],
                  train: Mapping[str, npt.NDArray[Any]], mask: npt.NDArray[Any],
                  out: Path, attn: str = "sdpa") -> dict[str, Any]:
    """List the clip-ambiguous tokens and seal their contributions (module docstring).

    Args:
        contract: the contract (rounds, clip ranges, micro-batch size).
        bundle: the prepared models (fresh FP32 copies are loaded for each rerun).
        batch: the reference update's batch (no extra padding).
        ref_runs: ``{lane: protocol tensors of the reference update}`` (lanes:
            :mod:`qualify.lanes`; a lane's rerun uses its BF16 style).
        bounds: the bounds just computed from the controls.
        train: the sealed ``advantages`` / ``returns``, ``[B, R]``.
        mask: ``[B, R]`` valid tokens.
        out: the reference directory (being written).
        attn: the reference's attention implementation.

    Returns:
        The ``branches.json`` document (also written).

    Raises:
        ReferenceDataError: a needed bound is missing, or a rerun does not reproduce the
            sealed reference update.
    """
    alg = contract.algorithm
    # The branch switches (qualify.branches) are PPO's symmetric clip's: a contract using
    # another policy-loss variant seals no actor contributions, so no actor row is re-judged.
    role_names = ([] if alg.variants() else ["actor"]) + ([] if alg.name == "grpo" else
                                                          ["critic"])
    doc: dict[str, Any] = {"schema_version": 1, "precisions": {}}
    for prec, run in ref_runs.items():
        tensors: dict[str, torch.Tensor] = {}
        doc["precisions"][prec] = {}
        for role in role_names:
            family = "logprobs" if role == "actor" else "values"
            wanted: dict[int, list[tuple[int, int]]] = {}
            rounds_doc: dict[str, Any] = {}
            for r in range(2, alg.rounds + 1):
                tol_old = _tolerance(bounds, prec, role, family, 1)
                tol_cur = _tolerance(bounds, prec, role, family, r)
                args: dict[str, Any] = {
                    "role": role, "old": run[tensor_name(1, role, family)].numpy(),
                    "cur": run[tensor_name(r, role, family)].numpy(), "train": train,
                    "mask": mask, "tol_old": tol_old, "tol_cur": tol_cur,
                    "value_clip": alg.value_clip, "clip_ratio": alg.clip_ratio}
                n_all = len(branches.ambiguous_tokens(**args))
                toks = branches.ambiguous_tokens(**args, limit=MAX_SEALED_TOKENS)
                wanted[r] = toks
                rounds_doc[f"round{r}"] = {"tol_old": tol_old, "tol_cur": tol_cur,
                                           "ambiguous": n_all, "unsealed": n_all - len(toks),
                                           "tokens": {}, "gram": {}}
                if toks:
                    print(f"qualify: reference {prec} {role} round {r}: sealing {len(toks)} "
                          f"clip-ambiguous token(s) of {n_all} (one backward each)",
                          file=sys.stderr, flush=True)
            if any(wanted.values()):
                _rerun(contract, bundle, batch, prec=prec, role=role, wanted=wanted,
                       run=run, tensors=tensors, rounds_doc=rounds_doc, attn=attn)
            doc["precisions"][prec][role] = rounds_doc
        store.save_tensors(out / BRANCHES_DIR / hf_tensors_file(prec),
                           tensors or {"empty": torch.zeros(0)})
    store.atomic_write_json(out / BRANCHES_FILE, doc)
    return doc


def _rerun(contract: Contract, bundle: models.ModelBundle, batch: Batch, *, prec: str,
           role: str, wanted: Mapping[int, list[tuple[int, int]]],
           run: Mapping[str, torch.Tensor], tensors: dict[str, torch.Tensor],
           rounds_doc: dict[str, Any], attn: str) -> None:
    """Rerun one role's reference update and record the wanted tokens' contributions."""
    release_free_memory()  # what the last rerun freed (qualify.memory)
    settings = UpdateSettings(precision="fp32" if prec == "fp32" else "bf16",
                              bf16_mode=lane_bf16_mode(prec),
                              micro_batch_size=contract.algorithm.micro_batch_size,
                              label=f"hf-{prec}-branches")
    # J_t in FP32 from the FP32 master at every precision (module docstring).
    j_settings = UpdateSettings(precision="fp32",
                                micro_batch_size=contract.algorithm.micro_batch_size,
                                label=f"hf-{prec}-branches-jt")
    family = "logprobs" if role == "actor" else "values"
    vocab = json.loads((bundle.actor_dir / "config.json").read_text("utf-8"))["vocab_size"]
    sampling = with_rollout_rows(contract, batch, int(vocab)).evidence  # as run_actor's

    def hook(round_: int, work: torch.nn.Module, master: torch.nn.Module, b: Batch,
             old: torch.Tensor) -> None:
        toks = wanted.get(round_) or []
        if not toks:
            return
        rd = rounds_doc[f"round{round_}"]
        grad = {n: (p.grad if p.grad is not None else torch.zeros_like(p))
                for n, p in master.named_parameters() if p.requires_grad}
        numel = {n: g.numel() for n, g in grad.items()}
        # Whole J_t kept for an exact FP64 Gram while they fit (one token: only the exact
        # diagonal, nothing to keep past the loop); else each token's backward factors while
        # they fit (qualify.reference.gram_factors); else one jvp row per token.
        positions = b.prompts.shape[1] + b.responses.shape[1]
        if len(toks) == 1 or len(toks) * sum(numel.values()) * 4 <= gram.FULL_BUDGET_BYTES:
            way = "fp64"
        elif gram_factors.factor_bytes(master, len(toks), len({bi for bi, _ in toks}),
                                       positions) <= gram_factors.BUDGET_BYTES:
            way = "factored"
        else:
            way = "jvp"
        rd["j_precision"] = "fp32"
        try:
            _seal_tokens(way, toks, round_=round_, master=master, b=b, grad=grad, rd=rd)
        except ReferenceDataError as e:
            if way != "factored":
                raise
            # a model the factors do not describe (a weight read outside its Linear or
            # Embedding): the forward-mode rows need no such assumption
            print(f"qualify: reference {prec} {role} round {round_}: {e}; taking the Gram "
                  "by forward mode instead", file=sys.stderr)
            rd["gram_factored_refused"] = str(e)
            _seal_tokens("jvp", toks, round_=round_, master=master, b=b, grad=grad, rd=rd)

    def _seal_tokens(way: str, toks: list[tuple[int, int]], *, round_: int,
                     master: torch.nn.Module, b: Batch, grad: Mapping[str, torch.Tensor],
                     rd: dict[str, Any]) -> None:
        """One backward per token: its J_t, <g, J_t>, |J_t|^2, branch, and the Gram."""
        norm_sq: dict[str, float] = {}
        whole: dict[str, dict[str, torch.Tensor]] = {}
        rows: dict[str, dict[str, float]] = {}
        side = branches.critic_full_gradient if role == "critic" else None
        with ExitStack() as stack:  # the spilled factors' directory, removed at the end
            factored = None
            if way == "factored":
                spill = stack.enter_context(gram_factors.spill_directory())
                factored = gram_factors.FactorCapture(master, list(grad), spill=Path(spill))
                stack.enter_context(factored.hooks())
            for (bi, ti), c in token_gradients(master, master, b, contract, j_settings,
                                               role=role, tokens=toks):
                # what the earlier tokens freed and this backward did not reuse, back to the
                # OS: the J_t's per-layer tensors come from glibc's heap, whose freed pages
                # otherwise stay resident and add up over the tokens (qualify.memory). Here,
                # not after the token: the last J_t's pages are then the next one's.
                release_free_memory()
                key = branches.token_key(bi, ti)
                dot = sum(float((grad[n].double() * c[n].double()).sum()) for n in c)
                nsq = sum(float(c[n].double().square().sum()) for n in c)
                for n in c:
                    tensors[f"round{round_}/{role}/{key}/{n}"] = _reported(n, c[n],
                                                                           sampling)
                norm_sq[key] = nsq
                if way == "fp64":
                    whole[key] = c
                elif factored is not None:
                    factored.take(key, c)
                else:
                    row = gram.jvp_row(  # the upper triangle: tokens yielded from this one on
                        master, b, contract, role=role, direction=c,
                        tokens=[t for t in toks if tuple(t) >= (bi, ti)],
                        micro_batch_size=j_settings.micro_batch_size)
                    rows[key] = {branches.token_key(*k): v for k, v in row.items()}
                del c
                x_old = float(run[tensor_name(1, role, family)][bi, ti])
                x_cur = float(run[tensor_name(round_, role, family)][bi, ti])
                if side is not None:
                    full = bool(side(np.array(x_old), np.array(x_cur),
                                     np.array(float(b.returns[bi, ti])),
                                     contract.algorithm.value_clip))
                else:
                    full = bool(branches.actor_full_gradient(
                        np.array(x_old), np.array(x_cur), np.array(float(b.advantages[bi, ti])),
                        contract.algorithm.clip_ratio))
                rd["tokens"][key] = {"index": [bi, ti], "old": x_old, "current": x_cur,
                                     "reference_branch": "full" if full else "zero",
                                     "dot_grad": dot, "norm_sq": nsq}
            release_free_memory()  # the last J_t, before the Gram allocates
            if way == "fp64":
                rd["gram"], rd["gram_rel_error"] = gram.exact_gram(whole, norm_sq), 0.0
                rd["gram_off_diagonal"] = "exact: FP64 over the whole J_t"
            elif factored is not None:
                rd["gram"], rd["gram_rel_error"] = factored.gram(
                    norm_sq, {k: v["dot_grad"] for k, v in rd["tokens"].items()}, grad)
                rd["gram_off_diagonal"] = ("factored: each J_t rebuilt from its backward's "
                                           "per-position inputs and output gradients, FP32 "
                                           "rounding")
            else:
                rd["gram"], rd["gram_rel_error"] = gram.symmetrize(rows, norm_sq)
                rd["gram_off_diagonal"] = "forward mode (jvp) over the whole J_t, FP32 rounding"

    torch.manual_seed(0)
    hook_fn: RoundHook = hook
    if role == "actor":
        # The KL reference logprobs first, from the frozen reference policy alone (freed
        # before the Actor is loaded), as the stage's update run takes them.
        ref_logp = kl_reference_before_load(contract, bundle.actor_dir, batch, settings, attn)
        release_free_memory()
        actor = load_role("actor", bundle.actor_dir, dtype=torch.float32,
                          attn_implementation=attn, requires_grad=True)
        again, _ = run_actor(actor, None, batch, contract, settings, on_round=hook_fn,
                             ref_logprobs=ref_logp)
    else:
        critic = load_role("critic", bundle.critic_dir, dtype=torch.float32,
                           attn_implementation=attn, requires_grad=True)
        again, _ = run_critic(critic, batch, contract, settings, on_round=hook_fn)
    for r in wanted:
        name = tensor_name(r, role, family)
        diff = float((again[name].double() - run[name].double()).abs().max())
        tol = float(rounds_doc[f"round{r}"]["tol_cur"]) * REPRODUCE_FRACTION
        rounds_doc[f"round{r}"]["rerun_max_abs_diff"] = diff
        if not diff <= tol:
            raise ReferenceDataError(
                f"{prec} {role}: the rerun of the reference update gives round-{r} {family} "
                f"{diff:.3g} from the sealed run (allowed {tol:.3g}); the sealed clip-branch "
                "contributions would not belong to the reference")


def adjust_control_errors(contract: Contract, errors: ControlErrors, *,
                          ref_runs: Mapping[str, Mapping[str, npt.NDArray[Any]]],
                          control_runs: Mapping[str, Mapping[str, Mapping[str, Any]]],
                          doc: Mapping[str, Any], out: Path,
                          train: Mapping[str, npt.NDArray[Any]], mask: npt.NDArray[Any],
                          behavior: npt.NDArray[Any] | None = None,
                          ) -> list[dict[str, Any]]:
    """Measure a control that flipped a sealed token against the reference on its branches.

    A control can itself sit on the other side of a clip switch for a sealed token; its
    round-``r`` gradient families then differ from the reference by that token's whole
    term, and the bound would be widened by a discontinuity instead of by rounding noise.
    Such a control's round-``r`` gradient families are measured against the reference moved
    to the control's branches (:func:`qualify.branches.adjusted_expected`, exact here: both
    sides are reference code). A flip outside the sealed tokens, or in a round after one
    whose branches already differ (the moved reference would lack that earlier step's
    difference; the comparator refuses the same case), leaves the raw error.

    Args:
        contract: supplies the clip ranges and AdamW settings.
        errors: ``{precision: {control: {metric: error}}}``, updated in place.
        ref_runs: ``{precision: reference tensors}`` (numpy).
        control_runs: ``{precision: {control: tensors}}`` (numpy).
        doc: the ``branches.json`` document of :func:`seal_branches`.
        out: the reference directory (holds ``branches/``).
        train: the sealed ``advantages`` / ``returns``.
        mask: ``[B, R]`` valid tokens.
        behavior: ``[B, R]`` the rollout's behavior logprobs (read by decoupled PPO).

    Returns:
        One record per adjusted (or not adjustable) control x role x round: tokens, the
        note, and the raw and adjusted errors of each gradient family.
    """
    alg, opt = contract.algorithm, contract.optimizer
    records: list[dict[str, Any]] = []
    for prec, runs in control_runs.items():
        sealed_prec = doc.get("precisions", {}).get(prec, {})
        path = out / BRANCHES_DIR / hf_tensors_file(prec)
        tensors = store.load_tensors(path) if path.is_file() else {}
        for name, run in runs.items():
            for role, by_round in sealed_prec.items():
                for rkey, sealed in by_round.items():
                    r = int(rkey.removeprefix("round"))
                    flips = branches.flipped_tokens(
                        run, ref_runs[prec], role=role, round_=r, train=train, mask=mask,
                        value_clip=alg.value_clip, clip_ratio=alg.clip_ratio)
                    if not flips:
                        continue
                    earlier = branches.earlier_flip_rounds(
                        run, ref_runs[prec], role=role, round_=r, train=train, mask=mask,
                        value_clip=alg.value_clip, clip_ratio=alg.clip_ratio)
                    rec: dict[str, Any] = {"precision": prec, "control": name, "role": role,
                                           "round": r, "tokens": [f["index"] for f in flips],
                                           "families": {}}
                    if earlier:
                        rec["note"] = f"{branches.inherited_flips_note(earlier)}; raw errors kept"
                        records.append(rec)
                        continue
                    prefix = f"round{r}/{role}/"
                    adjusted, note = branches.adjusted_expected(
                        ref_runs[prec], role=role, round_=r, flips=flips,
                        jacobians={k[len(prefix):]: v for k, v in tensors.items()
                                   if k.startswith(prefix)},
                        scalars=sealed, train=train, n_valid=float(np.asarray(mask).sum()),
                        lr=opt.lr(role, r),
                        betas=(float(opt.betas[0]), float(opt.betas[1])), eps=opt.eps,
                        max_grad_norm=opt.max_grad_norm,
                        factors=branches.loss_factors_of(
                            contract, ref_runs[prec], role, mask, behavior))
                    rec["note"] = note
                    if adjusted is not None:
                        again = compare_sets(run, adjusted, mask, scale=ref_runs[prec])
                        for key, e in again.items():
                            if (key.round == r and key.role == role and not key.variant
                                    and key.family in branches.GRADIENT_FAMILIES):
                                raw = errors[prec][name].get(key)
                                rec["families"][key.family] = {
                                    "raw": raw.value if raw is not None else None,
                                    "adjusted": e.value}
                                errors[prec][name][key] = e
                    records.append(rec)
    return records
