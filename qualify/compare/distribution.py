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

:func:`decode_clip_band` is the like-for-like clip-band tail: the HF FP32 reference's and
each actor cell's round-1 logprobs (``log_softmax(logits / T)``) against the sampler's
decode-path tempered logprobs of the same tokens (same distribution, no truncation).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from qualify import jsonio
from qualify.bounds import judge
from qualify.compare.mismatch import clip_band_tail
from qualify.compare.verdicts import FailureDetail, Row
from qualify.distmetrics import (
    STATISTICS,
    TOPK_STATISTICS,
    distribution_metrics,
    topk_metrics,
)
from qualify.evidence import store

DISTRIBUTION_FILE: Final = "distribution.safetensors"
DISTRIBUTION_JSON: Final = "distribution.json"
KINDS: Final = ("raw", "tempered")
WORST_SEQUENCES: Final = 4
"""Sequences per family whose per-position values the report keeps (largest token KL)."""
ROLE: Final = "sampler"


def _not_run(cell: str, klass: str, *, family: str, statistic: str, round_: int,
             reason: str) -> Row:
    return Row(cell=cell, klass=klass, bound_class=None, round=round_, role=ROLE,
               family=family, statistic=statistic, error=None, bound=None, margin=None,
               verdict="NOT_RUN", reason=reason, where="")


def _judged(cell: str, klass: str, *, family: str, statistic: str, round_: int, error: float,
            bound: float, where: str, control: str) -> Row:
    verdict, margin = judge(error, bound)
    reason = detail = None
    if verdict != "PASS":
        reason = (f"{family} {statistic} {error:.6g} > bound {bound:.6g} (sealed from the "
                  f"{control} control)")
        detail = FailureDetail(mismatched=1, total=1, max_abs=error, max_rel=None,
                               columns=("item", "obtained", "expected"),
                               table=((where or statistic, error, f"<= {bound:.6g}"),))
    return Row(cell=cell, klass=klass, bound_class=None, round=round_, role=ROLE,
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
    rows: list[Row] = []
    full = "raw" in doc and "topk" not in doc
    ref = store.load_tensors(ref_dir / DISTRIBUTION_FILE) if "raw" in doc else {}
    if "topk" in doc:
        rows += _topk_rows(cell, tensors, doc, ref, mask, positions=positions)
    why = ""
    for kind in KINDS if full else ():
        family = f"decode_{kind}"
        mine = tensors.get(f"round1/{ROLE}/{family}")
        if mine is None:
            reason = f"{cell} has no round1/{ROLE}/{family} (a sampler cell of older code)"
            rows += [_not_run(cell, "sampler_distribution", family=family, statistic=s, round_=1,
                         reason=reason)
                     for s in STATISTICS]
            continue
        got = distribution_metrics(np.asarray(mine), np.asarray(ref[kind]), responses, mask,
                                   clip_ratio=float(doc["clip_ratio"]),
                                   worst_sequences=WORST_SEQUENCES if positions is not None
                                   else 0)
        if positions is not None:
            positions[family] = {"k": None, "sequences": got["sequences"]}
        for s in STATISTICS:
            b = doc[kind]["bounds"][s]
            err = float(got[s])
            rows.append(_judged(cell, "sampler_distribution", family=family, statistic=s,
                                round_=1, error=err if math.isfinite(err) else math.inf,
                                bound=float(b["bound"]),
                                where=f"{got['worst']} (n={got['n_valid']}, top-1 ties "
                                      f"{got['top1_ties']})", control=str(b["control"])))
    dec, pre = tensors.get(f"round2/{ROLE}/decode_logprobs"), tensors.get(f"round2/{ROLE}/logprobs")
    if "decode_vs_prefill" not in doc:
        return rows
    if dec is None or pre is None:
        rows.append(_not_run(cell, "sampler_decode_vs_prefill", family="logprobs",
                             statistic="max_abs", round_=2,
                             reason=why or f"{cell} has no round2/{ROLE}/decode_logprobs"))
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


def _topk_rows(cell: str, tensors: Mapping[str, Any], doc: Mapping[str, Any],
               ref: Mapping[str, Any], mask: npt.NDArray[Any], *,
               positions: dict[str, Any] | None = None) -> list[Row]:
    """The ``decode_<kind>_topk`` rows (module docstring) of one sampler cell."""
    k = int(doc["topk"]["k"])
    rows: list[Row] = []
    for kind in KINDS:
        family = f"decode_{kind}_topk"
        names = [f"round1/{ROLE}/decode_{kind}_topk_logprobs",
                 f"round1/{ROLE}/decode_{kind}_topk_ids", f"round1/{ROLE}/decode_{kind}_logprobs"]
        missing = [n for n in names if n not in tensors]
        lp = np.asarray(tensors[names[0]]) if not missing else None
        reason = (f"{cell} has no {', '.join(missing)} (a sampler cell of older code)"
                  if missing else "")
        if lp is not None and (lp.ndim != 3 or lp.shape[2] < k):
            reason = (f"{cell}'s {names[0]} has shape {lp.shape}: fewer than the sealed "
                      f"top-{k} logprobs per position")
        if reason:
            rows += [_not_run(cell, "sampler_distribution", family=family, statistic=s,
                              round_=1, reason=reason) for s in TOPK_STATISTICS]
            continue
        assert lp is not None
        ids = np.asarray(tensors[names[1]]).astype(np.int64)
        order = np.lexsort((ids, -lp.astype(np.float64)), axis=-1)[..., :k]  # its own top-k
        got = topk_metrics(np.take_along_axis(lp, order, axis=-1),
                           np.take_along_axis(ids, order, axis=-1),
                           ref[f"{kind}_topk_logprobs"], ref[f"{kind}_topk_ids"],
                           cand_token=np.asarray(tensors[names[2]]),
                           ref_token=ref[f"{kind}_token_logprobs"], mask=mask,
                           clip_ratio=float(doc["clip_ratio"]),
                           worst_sequences=WORST_SEQUENCES if positions is not None else 0)
        if positions is not None:
            positions[family] = {"k": k, "sequences": got["sequences"]}
        where = (f"{got['worst']} (n={got['n_valid']}, top-1 ties {got['top1_ties']}, k={k}, "
                 f"missing mass ref <= {got['missing_ref_max']:.3g}, sampler <= "
                 f"{got['missing_cand_max']:.3g})")
        bounds = doc[kind]["bounds"]
        for s in TOPK_STATISTICS:
            b, err = bounds[s], float(got[s])
            upper = s.replace("tv_", "tv_upper_") if s in ("tv_max", "tv_mean") else ""
            if s.startswith("tv_upper_") and float(b["bound"]) >= 1.0:
                continue  # could not fail: stated on the tv_ row instead
            note = ""
            if upper and float(bounds[upper]["bound"]) >= 1.0:
                note = (f"; true TV <= {float(got[upper]):.3g} ({upper} not judged: its "
                        f"sealed bound {float(bounds[upper]['bound']):.3g} >= 1)")
            rows.append(_judged(cell, "sampler_distribution", family=family, statistic=s,
                                round_=1, error=err if math.isfinite(err) else math.inf,
                                bound=float(b["bound"]), where=where + note,
                                control=str(b["control"])))
    return rows


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
