"""Decode-path rows of a sampler cell: full distributions against the sealed reference.

Reads the sealed ``distribution.json`` / ``distribution.safetensors`` of the reference
(:mod:`qualify.reference.distribution`) and the sampler cell's decode-path tensors
(:mod:`harnesses.vllm.decode`):

- ``sampler_distribution`` (round 1, family ``decode_raw`` / ``decode_tempered``): every
  statistic of :mod:`qualify.distmetrics` of the sampler's decode-path distributions with the
  initial weights (``round1/sampler/decode_raw``: ``log_softmax(logits)``;
  ``round1/sampler/decode_tempered``: ``log_softmax(logits / T)``; ``[B, R, V]``) against the
  reference's HF FP32 prefill distributions, judged against the sealed bound of that
  statistic (``k * control + floor``, the controls HF decode, eager attention and
  per-sequence batches);
- ``sampler_decode_vs_prefill`` (round 2, family ``logprobs``): ``max |d|`` of the sampler's
  own decode-path token logprobs (``round2/sampler/decode_logprobs``) against its prefill
  ones (``round2/sampler/logprobs``), same weights and temperature, against the sealed
  HF decode-vs-prefill bound.

A reference sealed on the **top-k path** (``topk`` in ``distribution.json``: a vocabulary
too large to seal whole) gives the ``sampler_distribution`` rows of family
``decode_raw_topk`` / ``decode_tempered_topk`` instead: every statistic of
:data:`qualify.distmetrics.TOPK_STATISTICS` of the sampler's top-k logprobs and ids
(``round1/sampler/decode_<kind>_topk_logprobs`` / ``_topk_ids`` ``[B, R, k']``, ``k' >= k``,
cut to the sealed ``k``) and its response-token logprobs
(``round1/sampler/decode_<kind>_logprobs``) against the sealed top-k of the reference
(:func:`qualify.distmetrics.topk_metrics`: the KL and TV rows are lower bounds of the true
ones, ``tv_upper_*`` an upper bound; each row's ``where`` states ``k`` and both sides'
missing mass). A ``tv_upper_*`` statistic whose sealed bound is at least 1 (the largest TV:
a missing mass that large hides everything) gives no row, since it could not fail; its value
is stated in the ``where`` of the matching ``tv_*`` row.
A reference sealed without ``distribution.json`` gives no rows; one whose vocabulary was too
large to seal by older code (``distributions_not_run``) gives the
``sampler_decode_vs_prefill`` row only; the report's notes say why (:func:`read_sealed`).
Asked for them, :func:`distribution_rows` also gives, per judged family, the per-position
values of its :data:`WORST_SEQUENCES` worst sequences from the very call that gives its rows
(``report.json`` ``distribution_positions``, what ``report.html`` draws).
A sampler cell without the tensors, against a reference that has them, gives ``NOT_RUN``
rows naming what is missing; none of them passes.

An Actor trainer cell's own distributions (:func:`trainer_distribution_rows`, rows
``trainer_distribution``, role ``actor``, round 1) are judged the same way, by the same
functions against the same sealed distributions: families ``prefill_raw`` /
``prefill_tempered`` (``round1/actor/prefill_<kind>`` ``[B, R, V]`` FP32, the engine's own
forward of the response window at the initial weights) or, on the top-k path,
``prefill_<kind>_topk`` (``round1/actor/prefill_<kind>_topk_logprobs`` / ``_topk_ids``
``[B, R, k']`` and ``round1/actor/prefill_<kind>_logprobs`` ``[B, R]``). An FP32 cell is
judged by the sealed ``bounds`` (the FP32 controls'), a BF16 cell by the sealed
``bounds_bf16`` (``k *`` the largest of the HF BF16 controls against the FP32 reference
``+ floor``, :data:`qualify.reference.distribution.BF16_CONTROLS`); a
reference without ``bounds_bf16`` (sealed by older code) gives a BF16 cell's rows ``NOT_RUN``
naming it. A BF16 cell's top-1 ties are resolved at its own logits' precision
(:func:`qualify.distmetrics.tie_resolution`: BF16 spacings at the magnitude of
``round1/actor/prefill_top_logit`` ``[B, R]``, the cell's top raw logit per position, over
``T`` for the tempered kind); a cell that did not record it (outputs of older harnesses),
recorded a non-finite one, or is judged against a reference whose BF16 controls were
counted by the FP32 rule (no ``bf16_controls_ties``: sealed by older code) is counted by the
FP32 rule, stricter, and its rows' ``where`` says which rule counted and why.
A cell whose harness records none of the tensors (the TRL and verl adapters) has
``NOT_RUN`` rows naming them; a contract lists them as expected
(``matrix.expected_not_run``, :class:`qualify.matrix.ExpectedNotRun`).

:func:`decode_clip_band` is the like-for-like clip-band tail: the HF FP32 reference's and
each actor cell's round-1 logprobs (``log_softmax(logits / T)``) against the sampler's
decode-path tempered logprobs of the same tokens (same distribution, no truncation).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from qualify import jsonio
from qualify.bounds import judge
from qualify.compare.mismatch import clip_band_tail
from qualify.compare.verdicts import FailureDetail, Row
from qualify.distmetrics import (
    BF16_TIE_RULE,
    BF16_TIE_SPACINGS,
    KINDS,
    STATISTICS,
    TOPK_STATISTICS,
    distribution_metrics,
    topk_metrics,
)
from qualify.distmetrics import family as family_name
from qualify.evidence import store
from qualify.layout import DISTRIBUTION_FILE, DISTRIBUTION_JSON

WORST_SEQUENCES: Final = 4
"""Sequences per family whose per-position values the report keeps (largest token KL)."""
ROLE: Final = "sampler"
TRAINER_CLASS: Final = "trainer_distribution"
"""The row class of an Actor trainer cell's own prefill distributions."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Side:
    """Whose distributions a row family judges, and under which sealed bounds.

    Attributes:
        role: the tensors' role (``round1/<role>/...``) and the rows' role.
        path: the family prefix (``decode``: the sampler's decode path; ``prefill``: a
            trainer's forward of the response window).
        klass: the rows' class.
        bounds_key: the sealed bound entries of each kind (``bounds``: the FP32 controls';
            ``bounds_bf16``: the largest of the HF BF16 controls',
            :data:`qualify.reference.distribution.BF16_CONTROLS`).
        missing: why a cell lacks the tensors (part of its ``NOT_RUN`` reason).
        precision: the cell's compute precision, for its top-1 tie resolution
            (:func:`qualify.distmetrics.tie_resolution`: ``bf16`` at the magnitude of its
            recorded top logit, ``round1/<role>/<path>_top_logit``; ``fp32`` otherwise).
    """

    role: str
    path: str
    klass: str
    bounds_key: str
    missing: str
    precision: str = "fp32"


SAMPLER: Final = Side(role=ROLE, path="decode", klass="sampler_distribution",
                      bounds_key="bounds", missing="a sampler cell of older code")
"""The sampler cells' decode-path distributions, judged by the FP32 ceilings."""
TRAINER_BOUNDS: Final = {"fp32": "bounds", "bf16": "bounds_bf16"}
"""A trainer cell's precision -> the sealed bounds its distribution rows are judged by."""


def trainer_side(precision: str, *, bf16_ties: bool = True) -> Side:
    """The :class:`Side` of an Actor trainer cell of ``precision`` (``fp32`` or ``bf16``).

    ``bf16_ties``: a BF16 cell's ties at its own precision (``False``: the FP32 rule, as
    reports sealed before the ``bf16_ties`` section were counted).

    Raises:
        KeyError: another precision (no sealed distribution ceiling).
    """
    return Side(role="actor", path="prefill", klass=TRAINER_CLASS,
                bounds_key=TRAINER_BOUNDS[precision],
                missing="its harness records no full distributions",
                precision=precision if bf16_ties else "fp32")


def _tie_inputs(side: Side, tensors: Mapping[str, Any], doc: Mapping[str, Any],
                mask: npt.NDArray[Any]) -> tuple[npt.NDArray[Any] | None, str]:
    """The side's recorded top logit ``[B, R]`` (or ``None``) and the tie note of its rows.

    Only a BF16 side reads it (the FP32 rule needs none). The note is "" for an FP32 side;
    for a BF16 side it names the rule its ``top1_mismatch`` / ``top1_ties`` were counted
    by: :data:`qualify.distmetrics.BF16_TIE_SPACINGS` BF16 spacings at the top logit, or
    the FP32 rule (stricter) when the cell recorded no top logit of the mask's shape, or the
    reference states no temperature or counted its BF16 controls by the FP32 rule (sealed by
    older code: a ceiling and the count it judges then share that rule).
    """
    if side.precision != "bf16":
        return None, ""
    name = f"round1/{side.role}/{side.path}_top_logit"
    top = tensors.get(name)
    why = ""
    if top is None:
        why = f"no {name}"
    elif np.shape(top) != np.shape(mask):
        why = f"{name} has shape {list(np.shape(top))}, not [B, R]"
    elif not np.all(np.isfinite(np.asarray(top, dtype=np.float64)[np.asarray(mask) != 0])):
        why = f"{name} is not finite at a valid position"
    elif "temperature" not in doc:
        why = f"the reference's {DISTRIBUTION_JSON} states no temperature"
    elif doc.get("bf16_controls_ties") != BF16_TIE_RULE:
        why = (f"the reference's BF16 controls were counted by the FP32 rule: no "
               f"bf16_controls_ties in its {DISTRIBUTION_JSON}")
    if why:
        return None, f"; ties by the FP32 rule ({why})"
    return np.asarray(top), f"; ties within {BF16_TIE_SPACINGS:g} BF16 spacings of the top logit"


def _temperature(doc: Mapping[str, Any], kind: str) -> float:
    """The divisor of ``kind``'s logits: 1 for ``raw``, the sealed ``T`` for ``tempered``."""
    return 1.0 if kind == "raw" else float(doc.get("temperature", 1.0))


def _not_run(cell: str, klass: str, *, family: str, statistic: str, round_: int,
             reason: str, role: str = ROLE) -> Row:
    return Row(cell=cell, klass=klass, bound_class=None, round=round_, role=role,
               family=family, statistic=statistic, error=None, bound=None, margin=None,
               verdict="NOT_RUN", reason=reason, where="")


def _judged(cell: str, klass: str, *, family: str, statistic: str, round_: int, error: float,
            bound: float, where: str, control: str, role: str = ROLE) -> Row:
    verdict, margin = judge(error, bound)
    reason = detail = None
    if verdict != "PASS":
        reason = (f"{family} {statistic} {error:.6g} > bound {bound:.6g} (sealed from the "
                  f"{control} control)")
        detail = FailureDetail(mismatched=1, total=1, max_abs=error, max_rel=None,
                               columns=("item", "obtained", "expected"),
                               table=((where or statistic, error, f"<= {bound:.6g}"),))
    return Row(cell=cell, klass=klass, bound_class=None, round=round_, role=role,
               family=family, statistic=statistic, error=error, bound=bound, margin=margin,
               verdict=verdict, reason=reason, where=where, detail=detail)


def read_sealed(ref_dir: Path) -> tuple[dict[str, Any] | None, str]:
    """The reference's ``distribution.json`` (or ``None``) and why rows are missing (or "")."""
    path = ref_dir / DISTRIBUTION_JSON
    if not path.is_file():
        return None, (f"the reference {ref_dir.name} was sealed without {DISTRIBUTION_JSON} "
                      f"(no decode-path bounds)")
    doc = jsonio.read_json(path)
    if not isinstance(doc, dict):
        return None, f"{path}: not a JSON object"
    if doc.get("not_run"):
        return None, f"{path}: {doc['not_run']}"
    return doc, str(doc.get("distributions_not_run") or "")


def _no_bounds(doc: Mapping[str, Any], kind: str, side: Side, ref_dir: Path) -> str:
    """Why ``doc`` has no ``side.bounds_key`` for ``kind`` ("" when it has them)."""
    section = doc.get(kind)
    if isinstance(section, Mapping) and isinstance(section.get(side.bounds_key), Mapping):
        return ""
    why = section.get(f"{side.bounds_key}_not_run") if isinstance(section, Mapping) else None
    return (f"the reference {ref_dir.name}'s {DISTRIBUTION_JSON} has no {kind} "
            f"{side.bounds_key}" + (f": {why}" if why else " (sealed by older code)"))


def _side_rows(cell: str, side: Side, *, tensors: Mapping[str, Any], doc: Mapping[str, Any],
               ref_dir: Path, mask: npt.NDArray[Any], responses: npt.NDArray[Any],
               positions: dict[str, Any] | None) -> list[Row]:
    """The full-path or top-k-path distribution rows of one side (module docstring)."""
    if "raw" not in doc:  # sealed by older code above the full-path vocabulary: none
        return []
    ref = store.load_tensors(ref_dir / DISTRIBUTION_FILE)
    if "topk" in doc:
        return _topk_rows(cell, tensors, doc, ref, mask, positions=positions, side=side,
                          ref_dir=ref_dir)
    rows: list[Row] = []
    top_logit, tie_note = _tie_inputs(side, tensors, doc, mask)
    for kind in KINDS:
        family = family_name(side.path, kind, topk=False)
        mine = tensors.get(f"round1/{side.role}/{family}")
        reason = (f"{cell} has no round1/{side.role}/{family} ({side.missing})" if mine is None
                  else _no_bounds(doc, kind, side, ref_dir))
        if reason:
            rows += [_not_run(cell, side.klass, family=family, statistic=s, round_=1,
                              reason=reason, role=side.role) for s in STATISTICS]
            continue
        got = distribution_metrics(np.asarray(mine), np.asarray(ref[kind]), responses, mask,
                                   clip_ratio=float(doc["clip_ratio"]),
                                   worst_sequences=WORST_SEQUENCES if positions is not None
                                   else 0, precision=side.precision, top_logit=top_logit,
                                   temperature=_temperature(doc, kind))
        if positions is not None:
            positions[family] = {"k": None, "sequences": got["sequences"]}
        for s in STATISTICS:
            b = doc[kind][side.bounds_key][s]
            err = float(got[s])
            rows.append(_judged(cell, side.klass, family=family, statistic=s,
                                round_=1, error=err if math.isfinite(err) else math.inf,
                                bound=float(b["bound"]),
                                where=f"{got['worst']} (n={got['n_valid']}, top-1 ties "
                                      f"{got['top1_ties']}{tie_note})",
                                control=str(b["control"]),
                                role=side.role))
    return rows


def distribution_rows(*, cell: str, tensors: Mapping[str, Any], ref_dir: Path,
                      mask: npt.NDArray[Any], responses: npt.NDArray[Any],
                      positions: dict[str, Any] | None = None) -> list[Row]:
    """The rows of the module docstring for one COMPLETE sampler cell.

    Args:
        cell: the sampler cell id.
        tensors: its ``outputs.safetensors`` (numpy).
        ref_dir: the sealed reference directory.
        mask: ``[B, R]`` response mask of the frozen rollout.
        responses: ``[B, R]`` response token ids of the frozen rollout.
        positions: when given, receives per judged ``sampler_distribution`` family
            ``{"k": the top-k path's k or None, "sequences": ...}``: the per-position values
            of the :data:`WORST_SEQUENCES` worst sequences from the same call that gives the
            family's rows (``worst_sequences`` of :mod:`qualify.distmetrics`).
    """
    doc, _ = read_sealed(ref_dir)
    if doc is None:  # a reference without decode-path bounds: no rows (a report note says so)
        return []
    rows = _side_rows(cell, SAMPLER, tensors=tensors, doc=doc, ref_dir=ref_dir, mask=mask,
                      responses=responses, positions=positions)
    dec, pre = tensors.get(f"round2/{ROLE}/decode_logprobs"), tensors.get(f"round2/{ROLE}/logprobs")
    if "decode_vs_prefill" not in doc:
        return rows
    if dec is None or pre is None:
        rows.append(_not_run(cell, "sampler_decode_vs_prefill", family="logprobs",
                             statistic="max_abs", round_=2,
                             reason=f"{cell} has no round2/{ROLE}/decode_logprobs"))
        return rows
    m = np.asarray(mask) != 0
    d = np.abs(np.asarray(dec, dtype=np.float64) - np.asarray(pre, dtype=np.float64))[m]
    err = float(d.max()) if d.size and np.isfinite(d).all() else math.inf
    worst = np.argwhere(m)[int(np.argmax(np.where(np.isfinite(d), d, np.inf)))]
    b = doc["decode_vs_prefill"]
    rows.append(_judged(cell, "sampler_decode_vs_prefill", family="logprobs",
                        statistic="max_abs", round_=2, error=err, bound=float(b["bound"]),
                        where=f"({int(worst[0])}, {int(worst[1])}) mean {float(d.mean()):.3g}",
                        control=str(b["control"])))
    return rows


def trainer_distribution_rows(*, cell: str, precision: str, tensors: Mapping[str, Any],
                              ref_dir: Path, mask: npt.NDArray[Any],
                              responses: npt.NDArray[Any],
                              positions: dict[str, Any] | None = None,
                              bf16_ties: bool = True) -> list[Row]:
    """The ``trainer_distribution`` rows of one COMPLETE Actor trainer cell (module docstring).

    Args:
        cell: the trainer cell id.
        precision: its precision (``fp32``: the sealed ``bounds``; ``bf16``: the sealed
            ``bounds_bf16``; any other: ``NOT_RUN`` rows saying no ceiling is sealed for it).
        tensors: its ``outputs.safetensors`` (numpy).
        ref_dir: the sealed reference directory.
        mask: ``[B, R]`` response mask of the frozen rollout.
        responses: ``[B, R]`` response token ids of the frozen rollout.
        positions: as :func:`distribution_rows`, per judged ``prefill_*`` family.
        bf16_ties: a BF16 cell's top-1 ties resolved at its own precision (the report's
            ``bf16_ties`` section; ``False``: the FP32 rule and the rows of a report sealed
            before it).
    """
    doc, _ = read_sealed(ref_dir)
    if doc is None:
        return []
    if precision not in TRAINER_BOUNDS:
        fams = [family_name("prefill", kind, topk="topk" in doc) for kind in KINDS]
        stats = TOPK_STATISTICS if "topk" in doc else STATISTICS
        return [_not_run(cell, TRAINER_CLASS, family=f, statistic=s, round_=1, role="actor",
                         reason=f"no distribution ceiling is sealed for precision "
                                f"{precision!r}") for f in fams for s in stats]
    return _side_rows(cell, trainer_side(precision, bf16_ties=bf16_ties), tensors=tensors,
                      doc=doc, ref_dir=ref_dir, mask=mask, responses=responses,
                      positions=positions)


def _topk_names(pre: str, kind: str) -> list[str]:
    """A top-k side's tensor names under ``pre`` (``round1/<role>/<path>``).

    Its top-k logprobs ``[B, R, k']``, their ids ``[B, R, k']`` and the response token's
    logprobs ``[B, R]``.
    """
    return [f"{pre}_{kind}_topk_logprobs", f"{pre}_{kind}_topk_ids", f"{pre}_{kind}_logprobs"]


def _own_topk(tensors: Mapping[str, Any], names: Sequence[str], k: int
              ) -> tuple[npt.NDArray[Any], npt.NDArray[np.int64], npt.NDArray[Any]]:
    """A cell's own top-``k`` and its response-token logprobs.

    Returns:
        ``(logprobs [B, R, k], ids [B, R, k] int64, token logprobs [B, R])``: the ``k``
        largest of its ``[B, R, k' >= k]`` tensors ``names`` (:func:`_topk_names`), by
        (-logprob, id).
    """
    lp = np.asarray(tensors[names[0]])
    ids = np.asarray(tensors[names[1]]).astype(np.int64)
    order = np.lexsort((ids, -lp.astype(np.float64)), axis=-1)[..., :k]
    return (np.take_along_axis(lp, order, axis=-1), np.take_along_axis(ids, order, axis=-1),
            np.asarray(tensors[names[2]]))


def _topk_rows(cell: str, tensors: Mapping[str, Any], doc: Mapping[str, Any],
               ref: Mapping[str, Any], mask: npt.NDArray[Any], *,
               positions: dict[str, Any] | None = None, side: Side = SAMPLER,
               ref_dir: Path | None = None) -> list[Row]:
    """The ``<path>_<kind>_topk`` rows (module docstring) of one side's cell."""
    k = int(doc["topk"]["k"])
    rows: list[Row] = []
    top_logit, tie_note = _tie_inputs(side, tensors, doc, mask)
    pre = f"round1/{side.role}/{side.path}"
    for kind in KINDS:
        family = family_name(side.path, kind, topk=True)
        names = _topk_names(pre, kind)
        missing = [n for n in names if n not in tensors]
        lp = np.asarray(tensors[names[0]]) if not missing else None
        reason = (f"{cell} has no {', '.join(missing)} ({side.missing})" if missing else "")
        if lp is not None and (lp.ndim != 3 or lp.shape[2] < k):
            reason = (f"{cell}'s {names[0]} has shape {lp.shape}: fewer than the sealed "
                      f"top-{k} logprobs per position")
        if not reason and ref_dir is not None:
            reason = _no_bounds(doc, kind, side, ref_dir)
        if reason:
            rows += [_not_run(cell, side.klass, family=family, statistic=s,
                              round_=1, reason=reason, role=side.role) for s in TOPK_STATISTICS]
            continue
        own_lp, own_ids, own_token = _own_topk(tensors, names, k)
        got = topk_metrics(own_lp, own_ids,
                           ref[f"{kind}_topk_logprobs"], ref[f"{kind}_topk_ids"],
                           cand_token=own_token,
                           ref_token=ref[f"{kind}_token_logprobs"], mask=mask,
                           clip_ratio=float(doc["clip_ratio"]),
                           worst_sequences=WORST_SEQUENCES if positions is not None else 0,
                           precision=side.precision, top_logit=top_logit,
                           temperature=_temperature(doc, kind))
        if positions is not None:
            positions[family] = {"k": k, "sequences": got["sequences"]}
        where = (f"{got['worst']} (n={got['n_valid']}, top-1 ties {got['top1_ties']}, k={k}, "
                 f"missing mass ref <= {got['missing_ref_max']:.3g}, {side.role} <= "
                 f"{got['missing_cand_max']:.3g}{tie_note})")
        bounds = doc[kind][side.bounds_key]
        for s in TOPK_STATISTICS:
            b, err = bounds[s], float(got[s])
            upper = s.replace("tv_", "tv_upper_") if s in ("tv_max", "tv_mean") else ""
            if s.startswith("tv_upper_") and float(b["bound"]) >= 1.0:
                continue  # could not fail: stated on the tv_ row instead
            note = ""
            if upper and float(bounds[upper]["bound"]) >= 1.0:
                note = (f"; true TV <= {float(got[upper]):.3g} ({upper} not judged: its "
                        f"sealed bound {float(bounds[upper]['bound']):.3g} >= 1)")
            rows.append(_judged(cell, side.klass, family=family, statistic=s,
                                round_=1, error=err if math.isfinite(err) else math.inf,
                                bound=float(b["bound"]), where=where + note,
                                control=str(b["control"]), role=side.role))
    return rows


TRAINER_VS_SAMPLER_NOTE: Final = (
    "information, no verdict: each Actor trainer cell's round-1 prefill distributions (p) "
    "against each sampler cell's decode-path ones (q), same weights and tokens. The TV "
    "ceiling is the triangle inequality through the sealed reference, TV(p, q) <= TV(p, ref) "
    "+ TV(ref, q) at each position, so tv_max <= the trainer's sealed tv_max bound + the "
    "sampler's (tv_mean likewise): both cells within their own rows imply the pair within "
    "it. KL obeys no triangle inequality: no KL ceiling composes from the two rows.")
"""What ``report.json`` ``trainer_vs_sampler`` measures (its ``note``)."""


def trainer_vs_sampler(*, trainer: str, precision: str, sampler: str,
                       trainer_tensors: Mapping[str, Any], sampler_tensors: Mapping[str, Any],
                       ref_dir: Path, mask: npt.NDArray[Any], responses: npt.NDArray[Any],
                       topk: bool = True) -> list[dict[str, Any]]:
    """Direct trainer-vs-sampler metrics of one pair, per kind (no verdict).

    **Full path** (a reference sealed whole): for each kind with both
    ``round1/actor/prefill_<kind>`` (``p``) and ``round1/sampler/decode_<kind>`` (``q``), both
    ``[B, R, V]``: :func:`qualify.distmetrics.distribution_metrics` of ``q`` against ``p`` and
    the derived TV ceilings (:data:`TRAINER_VS_SAMPLER_NOTE`): ``tv_max_ceiling`` = the
    trainer's sealed ``tv_max`` bound (its precision's: ``bounds`` or ``bounds_bf16``) + the
    sampler's (``bounds``), ``tv_mean_ceiling`` likewise; ``None`` where either bound is not
    sealed.

    **Top-k path** (a reference sealed on the top-k path, ``k`` its sealed width): for each
    kind with both cells' top-k tensors (``round1/actor/prefill_<kind>_topk_logprobs`` /
    ``_topk_ids`` / ``_logprobs`` and the sampler's ``decode_`` ones, each cut to its own
    top-``k``): :func:`qualify.distmetrics.topk_metrics` of ``q`` against ``p``. Its TV and KL
    are lower bounds of the true ones (the mass outside both top-k sets is lumped), its
    ``tv_upper_*`` upper bounds; the true TV lies between ``tv_max`` and ``tv_upper_max``.
    The ceilings then compose from the two cells' sealed ``tv_upper_max`` / ``tv_upper_mean``
    bounds (the true TV of each cell against the reference is at most its ``tv_upper``), and
    are ``None`` where either is at least 1 (a TV ceiling of 1 or more bounds nothing).

    Returns:
        One dict per kind: ``trainer``, ``sampler``, ``kind``, ``family`` (the two row
        families), ``n_valid``, ``tv_max``, ``tv_mean``, ``kl_trainer_sampler_max``
        (``max KL(p || q)``), ``kl_sampler_trainer_max`` (``max KL(q || p)``),
        ``top1_mismatch`` (count), ``top1_ties``, ``worst`` (the worst position),
        ``tv_max_ceiling``, ``tv_mean_ceiling``; on the top-k path also ``k``,
        ``tv_upper_max``, ``tv_upper_mean``, ``missing_trainer_max`` and
        ``missing_sampler_max`` (the largest mass outside each side's top-k). ``[]`` for a
        reference without sealed distributions (no ceilings to compose), a pair without
        the tensors, or on the top-k path with ``topk=False`` (a report sealed before the
        ``trainer_vs_sampler_topk`` section).

    Raises:
        ValueError: a tensor the metrics refuse (:mod:`qualify.distmetrics`: shapes, a
            repeated top-k id); the caller records it beside the pairs.
    """
    doc, _ = read_sealed(ref_dir)
    if doc is None or "raw" not in doc:
        return []
    side = trainer_side(precision) if precision in TRAINER_BOUNDS else None
    if "topk" in doc:
        if not topk:
            return []
        return _trainer_vs_sampler_topk(trainer=trainer, sampler=sampler, side=side,
                                        trainer_tensors=trainer_tensors,
                                        sampler_tensors=sampler_tensors, doc=doc, mask=mask)
    out = []
    for kind in KINDS:
        p = trainer_tensors.get(f"round1/actor/prefill_{kind}")
        q = sampler_tensors.get(f"round1/{ROLE}/decode_{kind}")
        if p is None or q is None:
            continue
        got = distribution_metrics(np.asarray(q), np.asarray(p), responses, mask,
                                   clip_ratio=float(doc["clip_ratio"]))
        out.append(_pair_row(trainer=trainer, sampler=sampler, kind=kind, got=got,
                             doc=doc, side=side, k=None))
    return out


def _trainer_vs_sampler_topk(*, trainer: str, sampler: str, side: Side | None,
                             trainer_tensors: Mapping[str, Any],
                             sampler_tensors: Mapping[str, Any], doc: Mapping[str, Any],
                             mask: npt.NDArray[Any]) -> list[dict[str, Any]]:
    """:func:`trainer_vs_sampler` on the top-k path (its docstring)."""
    k = int(doc["topk"]["k"])
    out = []
    for kind in KINDS:
        p_names = _topk_names("round1/actor/prefill", kind)
        q_names = _topk_names(f"round1/{ROLE}/decode", kind)
        if any(n not in trainer_tensors for n in p_names) or \
                any(n not in sampler_tensors for n in q_names):
            continue
        if any(np.ndim(t[n[0]]) != 3 or np.shape(t[n[0]])[2] < k
               for t, n in ((trainer_tensors, p_names), (sampler_tensors, q_names))):
            continue  # fewer than the sealed top-k: that cell's own rows say so
        p, p_ids, p_token = _own_topk(trainer_tensors, p_names, k)
        q, q_ids, q_token = _own_topk(sampler_tensors, q_names, k)
        got = topk_metrics(q, q_ids, p, p_ids, cand_token=q_token, ref_token=p_token,
                           mask=mask, clip_ratio=float(doc["clip_ratio"]))
        out.append(_pair_row(trainer=trainer, sampler=sampler, kind=kind, got=got,
                             doc=doc, side=side, k=k))
    return out


def _pair_row(*, trainer: str, sampler: str, kind: str, got: Mapping[str, Any],
              doc: Mapping[str, Any], side: Side | None, k: int | None) -> dict[str, Any]:
    """One :func:`trainer_vs_sampler` row from its metrics ``got`` (its docstring's fields).

    ``k`` is the sealed top-k width on the top-k path (``got`` from
    :func:`qualify.distmetrics.topk_metrics`: the ceilings compose the two cells' sealed
    ``tv_upper_*`` bounds) and ``None`` on the full path (``got`` from
    :func:`qualify.distmetrics.distribution_metrics`: they compose ``tv_*``). A ceiling is
    ``None`` where either bound is not sealed or their sum is at least 1 (a TV ceiling of 1
    bounds nothing).
    """
    topk = k is not None
    ceilings: dict[str, float | None] = {}
    for stat in ("tv_max", "tv_mean"):
        sealed = stat.replace("tv_", "tv_upper_") if topk else stat
        mine = doc[kind].get(side.bounds_key, {}).get(sealed) if side is not None else None
        theirs = doc[kind].get(SAMPLER.bounds_key, {}).get(sealed)
        total = (float(mine["bound"]) + float(theirs["bound"])
                 if mine is not None and theirs is not None else math.inf)
        ceilings[f"{stat}_ceiling"] = total if total < 1.0 else None
    row: dict[str, Any] = {"trainer": trainer, "sampler": sampler, "kind": kind}
    if topk:
        row["k"] = k
    row.update({"family": [family_name("prefill", kind, topk=topk),
                           family_name("decode", kind, topk=topk)],
                "n_valid": int(got["n_valid"]), "tv_max": float(got["tv_max"]),
                "tv_mean": float(got["tv_mean"])})
    if topk:
        row.update({"tv_upper_max": float(got["tv_upper_max"]),
                    "tv_upper_mean": float(got["tv_upper_mean"])})
    row.update({"kl_trainer_sampler_max": float(got["kl_ref_cand_max"]),
                "kl_sampler_trainer_max": float(got["kl_cand_ref_max"]),
                "top1_mismatch": int(got["top1_mismatch"]),
                "top1_ties": int(got["top1_ties"]), "worst": str(got["worst"])})
    if topk:
        row.update({"missing_trainer_max": float(got["missing_ref_max"]),
                    "missing_sampler_max": float(got["missing_cand_max"])})
    row.update(ceilings)
    return row


def decode_clip_band(*, sources: list[tuple[str, str, Any]], cell: str,
                     tensors: Mapping[str, Any], mask: npt.NDArray[Any],
                     clip_ratio: float) -> list[dict[str, Any]]:
    """Clip-band tails of each source's round-1 logprobs against the decode-path ones.

    ``sources``: ``(source, precision, [B, R] logprobs)``; the sampler's side is ``cell``'s
    ``round1/sampler/decode_tempered_logprobs`` (like for like); ``[]`` when it has none.
    """
    beh = tensors.get(f"round1/{ROLE}/decode_tempered_logprobs")
    if beh is None:
        return []
    out = []
    for source, prec, lp in sources:
        row = clip_band_tail(lp, beh, mask, source=f"{source} vs {cell} decode (like for like)",
                             precision=prec, clip_ratio=clip_ratio)
        out.append(row)
    return out


def cell_routes(metas: Mapping[str, Mapping[str, Any] | None], ref_dir: Path
                ) -> dict[str, Any]:
    """The report's ``routes`` section.

    Each cell's ``outputs.json`` ``routes`` (a trainer cell's: ``{role: roles.<role>.routes}``;
    or that its harness records none), and the
    reference's SDPA read-back from ``distribution.json`` (key ``reference``).

    Args:
        metas: COMPLETE cell id -> its ``outputs.json`` (``None`` when unreadable).
        ref_dir: the sealed reference directory.
    """
    out: dict[str, Any] = {}
    for cid, meta in metas.items():
        got = meta.get("routes") if isinstance(meta, Mapping) else None
        if got is None and isinstance(meta, Mapping) and isinstance(meta.get("roles"), Mapping):
            got = {role: r["routes"] for role, r in meta["roles"].items()
                   if isinstance(r, Mapping) and isinstance(r.get("routes"), Mapping)} or None
        out[cid] = dict(got) if isinstance(got, Mapping) else "not recorded by this harness"
    doc, _ = read_sealed(ref_dir)
    if doc is not None and isinstance(doc.get("routes"), Mapping):
        out["reference"] = dict(doc["routes"])
    return out
