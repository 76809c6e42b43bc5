"""Clip-flip re-judging: failing round >= 2 gradient rows that a sealed clip flip explains.

A token whose clip branch (policy ratio or value clip) differs between the obtained and
the expected run changes every later gradient, so a round >= 2 gradient-family row can
fail on a legitimate flip. :func:`with_branch_flips` finds the flipped tokens
(:func:`qualify.branches.flipped_tokens`); when the reference sealed every one of them as
clip-ambiguous (``branches.json`` and ``branches/hf-{precision}.safetensors``, written by
:mod:`qualify.reference.branches` before any candidate ran), the round's gradient-family
rows are judged again, with the same sealed bounds, against the expected run moved to the
obtained run's branches (:func:`qualify.branches.adjusted_expected`). Otherwise the
failing rows keep their verdict and their reason names the flips.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from qualify import branches, jsonio
from qualify.bounds import Bound
from qualify.compare.rows import compare_rows
from qualify.compare.verdicts import Row
from qualify.contract import Contract
from qualify.evidence import store
from qualify.evidence.tensor_stream import in_memory
from qualify.layout import BRANCHES_DIR, BRANCHES_FILE, TRAIN_INPUTS_FILE, hf_tensors_file
from qualify.protocol import ROLLOUT_FILE

__all__ = ["SealedBranches", "with_branch_flips"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SealedBranches:
    """What re-judging reads from the sealed reference, loaded on first need.

    Attributes:
        ref_dir: the sealed reference directory.
        contract: its contract (clip ranges, AdamW settings).
        bounds: the sealed bounds (``bounds.json``).
        mask: ``[B, R]`` response mask of the frozen rollout.
        train: the reference's ``train_inputs.safetensors`` (advantages, returns, ...),
            filled on the first failing gradient row.
        cache: ``"doc"`` -> ``branches.json``; precision -> the tensors of
            ``branches/hf-{precision}.safetensors`` (empty when absent).
    """

    ref_dir: Path
    contract: Contract
    bounds: list[Bound]
    mask: npt.NDArray[Any]
    train: dict[str, npt.NDArray[Any]] = dataclasses.field(default_factory=dict)
    cache: dict[str, Any] = dataclasses.field(default_factory=dict)


def _sealed_branches(ctx: SealedBranches,
                     precision: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The reference's ``branches.json`` and ``branches/hf-{precision}`` tensors, or empty."""
    if "doc" not in ctx.cache:
        path = ctx.ref_dir / BRANCHES_FILE
        ctx.cache["doc"] = jsonio.read_json(path) if path.is_file() else {}
    if precision not in ctx.cache:
        path = ctx.ref_dir / BRANCHES_DIR / hf_tensors_file(precision)
        ctx.cache[precision] = store.load_tensors(path) if path.is_file() else {}
    return ctx.cache["doc"], ctx.cache[precision]


def _adjusted_rows(ctx: SealedBranches, rows: list[Row], *, cell: str, klass: str,
                   precision: str, role: str, rnd: int, flips: list[dict[str, Any]],
                   obtained: Mapping[str, Any], expected: Mapping[str, Any],
                   meta: Mapping[str, Any] | None, reference: Mapping[str, Any] | None = None,
                   ) -> tuple[list[Row] | None, str]:
    """Round ``rnd``'s gradient-family rows against the flip-adjusted expected run.

    ``reference``: the HF reference's tensors of the role when ``expected`` is another
    candidate (TP = 1): its own branch offsets from the reference then correct the sealed
    ``<g, J_t>`` (:func:`qualify.branches.branch_offsets`).
    """
    doc, tensors = _sealed_branches(ctx, precision)
    sealed = (doc.get("precisions", {}).get(precision, {}).get(role, {})
              .get(f"round{rnd}"))
    if not sealed:
        return None, "the reference sealed no clip-branch contributions for this round"
    prefix = f"round{rnd}/{role}/"
    jacobians = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    opt = ctx.contract.optimizer
    lr = opt.lr(role, rnd)  # the round's scheduled lr (qualify.schedule)
    behavior = None
    if ctx.contract.algorithm.name == "decoupled_ppo":  # the weight of the expected run
        behavior = np.asarray(store.load_tensors(ctx.ref_dir / ROLLOUT_FILE)["behavior_logprobs"])
    n_valid = float(np.asarray(ctx.mask).sum())
    offsets = None
    if reference is not None:
        alg = ctx.contract.algorithm
        try:
            offsets = branches.branch_offsets(
                expected, reference, role=role, round_=rnd, train=ctx.train, mask=ctx.mask,
                n_valid=n_valid, value_clip=alg.value_clip, clip_ratio=alg.clip_ratio,
                factors=branches.loss_factors_of(ctx.contract, reference, role, ctx.mask,
                                                 behavior))
        except KeyError as exc:
            return None, f"the reference lacks {exc} (the TP = 1 run's own branches)"
    adjusted, note = branches.adjusted_expected(
        expected, role=role, round_=rnd, flips=flips, jacobians=jacobians, scalars=sealed,
        train=ctx.train, n_valid=n_valid, lr=lr,
        betas=(float(opt.betas[0]), float(opt.betas[1])), eps=opt.eps,
        max_grad_norm=opt.max_grad_norm,
        factors=branches.loss_factors_of(ctx.contract, expected, role, ctx.mask, behavior),
        offsets=offsets)
    if adjusted is None:
        return None, note
    bound_class = next((r.bound_class for r in rows if r.bound_class), klass)
    again = {(r.round, r.family, r.variant): r for r in compare_rows(
        cell=cell, klass=klass, precision=precision, bounds=ctx.bounds, obtained=obtained,
        expected=adjusted, mask=ctx.mask, meta=meta, scale=expected, bound_class=bound_class)}
    out = []
    for row in rows:
        if row.round == rnd and row.family in branches.GRADIENT_FAMILIES and not row.variant:
            new = again[(row.round, row.family, row.variant)]
            was = f"unadjusted error {row.error:.6g}, margin {row.margin:.3g}" \
                if row.error is not None and row.margin is not None else "unadjusted: -"
            out.append(dataclasses.replace(new, adjustment=f"{note}; {was}"))
        else:
            out.append(row)
    return out, note


def with_branch_flips(ctx: SealedBranches, rows: list[Row], *, cell: str, klass: str,
                      precision: str, role: str, obtained: Mapping[str, Any],
                      expected: Mapping[str, Any],
                      meta: Mapping[str, Any] | None = None,
                      reference: Mapping[str, Any] | None = None) -> list[Row]:
    """Handle failing gradient-family rows of rounds >= 2 that a clip-branch flip explains.

    For each such round, the tokens whose clip branch differs between ``obtained`` and
    ``expected`` (as each run's own reported values place them, :mod:`qualify.branches`)
    are found. When every one of them is a token the reference sealed as clip-ambiguous
    (:mod:`qualify.reference.branches`), the round's gradient-family rows are judged again,
    with the same sealed bounds, against the expected run moved to the obtained run's
    branches (:func:`qualify.branches.adjusted_expected`); each such row records the
    adjustment and its unadjusted error. Otherwise the failing rows keep their verdict and
    their reason names the flips and why no adjustment applies.

    Args:
        ctx: the sealed reference's branch data (:class:`SealedBranches`).
        rows: the rows of one comparison class of one cell (:func:`qualify.compare.rows
            .compare_rows`).
        cell: the cell id.
        klass: the comparison class (``candidate_vs_hf`` or ``tp_vs_tp1``).
        precision: the cell's precision (which sealed branch tensors apply).
        role: ``actor`` or ``critic``.
        obtained: the cell's tensors of ``role``.
        expected: the tensors it was compared against.
        meta: the cell's ``outputs.json`` (declared not-run metrics).
        reference: the HF reference's tensors of ``role`` when ``expected`` is another
            candidate (``tp_vs_tp1``); ``None`` when ``expected`` is the reference.

    Returns:
        ``rows``, with the adjusted rows replaced and the unexplained failures annotated.
    """
    if not any(
            r.verdict == "FAIL" and (r.round or 0) >= 2 and r.family in branches.GRADIENT_FAMILIES
            for r in rows):
        return rows
    obtained, expected = in_memory(obtained), in_memory(expected)  # the branch arithmetic
    if reference is not None:
        reference = in_memory(reference)
    path = ctx.ref_dir / TRAIN_INPUTS_FILE
    if not ctx.train and path.is_file():
        ctx.train.update(store.load_tensors(path))
    alg = ctx.contract.algorithm
    failing = sorted({int(r.round or 0) for r in rows if r.verdict == "FAIL"
                      and (r.round or 0) >= 2 and r.family in branches.GRADIENT_FAMILIES})
    notes: dict[int, str] = {}
    for rnd in failing:
        flips = branches.flipped_tokens(
            obtained, expected, role=role, round_=rnd, train=ctx.train, mask=ctx.mask,
            value_clip=alg.value_clip, clip_ratio=alg.clip_ratio) \
            if {"advantages", "returns"} <= set(ctx.train) else None
        if not flips:
            continue
        earlier = branches.earlier_flip_rounds(
            obtained, expected, role=role, round_=rnd, train=ctx.train, mask=ctx.mask,
            value_clip=alg.value_clip, clip_ratio=alg.clip_ratio)
        if earlier:
            why = branches.inherited_flips_note(earlier)
        else:
            adjusted, why = _adjusted_rows(ctx, rows, cell=cell, klass=klass,
                                           precision=precision, role=role, rnd=rnd,
                                           flips=flips, obtained=obtained, expected=expected,
                                           meta=meta, reference=reference)
            if adjusted is not None:
                rows = adjusted
                continue
        notes[rnd] = f"{branches.explain(flips, role=role, round_=rnd)}; not adjusted: {why}"
    out = []
    for row in rows:
        rnd = int(row.round or 0)
        if (row.verdict == "FAIL" and rnd in notes and row.family in branches.GRADIENT_FAMILIES
                and row.adjustment is None):
            out.append(dataclasses.replace(row, reason=f"{row.reason}; {notes[rnd]}"))
        else:
            out.append(row)
    return out
