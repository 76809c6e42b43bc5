"""What ``report.html`` plots, read from ``report.json`` and the stored tensors.

Nothing here recomputes a verdict: the rows come from ``report.json`` as they are, and the
tensors are read only to draw what a row summarises (the per-token differences behind a
``max_abs``, the per-parameter relative L2 errors behind a ``max_rel_l2``). Each drawing
says whether its data reproduces the row's stored error (:attr:`TokenErrors.reproduces`,
:attr:`ParamErrors.reproduces`, :attr:`PositionDistribution.reproduces`), so a plot that does
not show what was judged says so. The sampler cells' per-position distribution values are not
read from tensors: the comparator keeps them in ``report.json`` ``distribution_positions``
(from the call that gave the rows), and they are drawn as kept.

Sources: the run's ``report.json`` (validated against ``report.schema.json``), the cells'
``outputs.safetensors`` (the attempt ``report.json`` names), and the sealed reference the
run names (:func:`qualify.layout.resolve_reference`): ``bounds.json`` (every bound with the
control error and floor that set it), ``rollout.safetensors`` (the response mask),
``contract.json`` (each cell's reference lane) and ``reference/hf-{lane}.safetensors``.
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
from qualify.compare.rootcause import SAMPLER_ROLE
from qualify.contract import Contract
from qualify.distmetrics import FAMILIES
from qualify.errors import ReferenceDataError, UsageError
from qualify.evidence import store
from qualify.layout import (
    BOUNDS_FILE,
    CONTRACT_FILE,
    HF_REFERENCE_DIR,
    REPORT_JSON,
    hf_tensors_file,
    resolve_reference,
)
from qualify.protocol import OUTPUTS_FILE, ROLLOUT_FILE
from qualify.schema import validate
from qualify.statistics import masked_max_abs, max_rel_l2

__all__ = [
    "PER_PARAM_FAMILIES",
    "PER_TOKEN_FAMILIES",
    "ParamErrors",
    "PositionDistribution",
    "PositionSequence",
    "RunData",
    "TokenErrors",
    "family_margins",
    "load_run",
    "param_errors",
    "position_distributions",
    "round_margins",
    "token_errors",
    "worst_row",
]

PER_TOKEN_FAMILIES: Final = ("logprobs", "entropy", "values")
PER_PARAM_FAMILIES: Final = ("grads", "exp_avg", "exp_avg_sq", "updates")
WORST_SEQUENCES: Final = 4
"""Sequences drawn per per-token plot (those with the largest error)."""
REPRODUCE_REL: Final = 1e-6
"""A drawing reproduces its row when its max equals the stored error within this (relative)."""


def _float(x: Any) -> float | None:
    """A ``report.json`` number (``"inf"``, ``"nan"`` strings included) as a float."""
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, int | float):
        return float(x)
    if x in ("inf", "-inf", "nan"):
        return float(x)
    return None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunData:
    """A run's ``report.json`` and what its plots read from the sealed reference.

    Attributes:
        run_dir: the run directory.
        doc: ``report.json`` (schema-valid).
        ref_dir: the reference directory the run names (``None`` when not found).
        bounds: ``bounds.json`` ``bounds`` entries (empty without a reference).
        mask: the rollout's ``response_mask`` ``[B, R]`` (``None`` without a reference).
        lanes: cell id -> the reference lane it is compared in (``hf-{lane}``).
        note: why the tensor plots are missing, ``""`` when the reference was found.
    """

    run_dir: Path
    doc: Mapping[str, Any]
    ref_dir: Path | None
    bounds: tuple[Mapping[str, Any], ...]
    mask: npt.NDArray[Any] | None
    lanes: Mapping[str, str]
    note: str = ""

    @property
    def rows(self) -> list[Mapping[str, Any]]:
        """``report.json`` rows."""
        return list(self.doc.get("rows", []))

    def cell(self, cid: str) -> Mapping[str, Any] | None:
        """The ``report.json`` ``cells`` entry of ``cid``."""
        return next((c for c in self.doc.get("cells", []) if c.get("cell") == cid), None)

    def outputs(self, cid: str) -> dict[str, npt.NDArray[Any]] | None:
        """The cell's stored ``outputs.safetensors`` (``None`` without an attempt)."""
        c = self.cell(cid)
        attempt = c.get("attempt") if c else None
        path = self.run_dir / str(attempt) / OUTPUTS_FILE if attempt else None
        return store.load_tensors(path) if path is not None and path.is_file() else None

    def expected(self, cid: str) -> dict[str, npt.NDArray[Any]] | None:
        """The HF reference tensors the cell was compared with (its lane's file)."""
        lane = self.lanes.get(cid)
        if self.ref_dir is None or lane is None:
            return None
        path = self.ref_dir / HF_REFERENCE_DIR / hf_tensors_file(lane)
        return store.load_tensors(path) if path.is_file() else None


def load_run(run_dir: str | Path, *, doc: Mapping[str, Any] | None = None) -> RunData:
    """Read a run's ``report.json`` and the reference facts its plots need.

    Args:
        run_dir: ``evidence/<contract>/<run-id>`` (holds ``report.json``).
        doc: its ``report.json`` document, already read and validated by the caller
            (``qualify run`` reads it once after writing it); ``None``: read and validated
            here.

    Returns:
        The :class:`RunData`; without the reference (moved, deleted) its tensors are
        absent and :attr:`RunData.note` says why (the page then shows ``report.json`` only).

    Raises:
        UsageError: no readable ``report.json`` in ``run_dir``.
        QualifyError: ``report.json`` violates its schema.
    """
    run_dir = Path(run_dir)
    if doc is None:
        path = run_dir / REPORT_JSON
        try:
            doc = jsonio.read_json(path)
        except (OSError, ValueError) as exc:
            raise UsageError(f"{path}: unreadable or not JSON ({exc}); is {run_dir} a "
                             "compared run?") from None
        validate(doc, "report", what=str(path))
    try:
        ref_dir = resolve_reference(run_dir, doc)
    except ReferenceDataError as exc:
        return RunData(run_dir=run_dir, doc=doc, ref_dir=None, bounds=(), mask=None, lanes={},
                       note=str(exc))
    bounds_doc = jsonio.read_json(ref_dir / BOUNDS_FILE)
    bounds = tuple(bounds_doc.get("bounds", []))
    mask = np.asarray(store.load_tensors(ref_dir / ROLLOUT_FILE)["response_mask"])
    contract = Contract.from_dict(jsonio.read_json(ref_dir / CONTRACT_FILE),
                                  path=ref_dir / CONTRACT_FILE)
    specs = {c.cell_id: c for c in contract.matrix.cells()}
    sealed_lanes = {str(b.get("precision")) for b in bounds}
    lanes: dict[str, str] = {}
    for c in doc.get("cells", []):
        cid, precision = str(c.get("cell")), str(c.get("precision"))
        spec = specs.get(cid)
        lane = spec.lane if spec is not None else precision
        # the comparator's rule (qualify.compare.stage._lane): a lane the bounds lack is
        # the precision itself (a reference sealed before lanes existed)
        lanes[cid] = lane if lane in sealed_lanes else precision
    return RunData(run_dir=run_dir, doc=doc, ref_dir=ref_dir, bounds=bounds, mask=mask,
                   lanes=lanes)


# --------------------------------------------------------------------------- from the rows


def family_margins(rows: Sequence[Mapping[str, Any]], cells: Sequence[str],
                   families: Sequence[str]) -> tuple[npt.NDArray[np.float64], list[list[str]]]:
    """Worst margin and worst verdict per cell x family (every class and round).

    Args:
        rows: ``report.json`` rows.
        cells: the row order of the matrix.
        families: the column order (a ``*_padded`` row counts as ``padding``).

    Returns:
        ``(margins [cells, families], verdicts)``: ``nan`` where no row has a margin;
        ``verdicts[i][j]`` the worst verdict (``FAIL`` > ``ERROR`` > ``NOT_RUN`` >
        ``PASS``) or ``""`` where the cell has no row of that family.
    """
    order = ("FAIL", "ERROR", "NOT_RUN", "PASS")
    ci = {c: i for i, c in enumerate(cells)}
    fi = {f: j for j, f in enumerate(families)}
    margins = np.full((len(cells), len(families)), np.nan)
    verdicts = [[""] * len(families) for _ in cells]
    for r in rows:
        fam = "padding" if r.get("variant") == "padded" else str(r.get("family"))
        i, j = ci.get(str(r.get("cell"))), fi.get(fam)
        if i is None or j is None:
            continue
        v = str(r.get("verdict"))
        old = verdicts[i][j]
        if not old or order.index(v) < order.index(old):
            verdicts[i][j] = v
        m = _float(r.get("margin"))
        if m is not None and not math.isnan(m) and not m <= margins[i, j]:
            margins[i, j] = m
    return margins, verdicts


def round_margins(rows: Sequence[Mapping[str, Any]], family: str,
                  klass: str = "candidate_vs_hf") -> dict[str, dict[int, float]]:
    """Per cell, the margin of ``family`` in each round (class ``klass``, unpadded).

    Returns:
        cell id -> round -> margin (finite or ``inf``), cells in row order.
    """
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        m = _float(r.get("margin"))
        if (r.get("family") != family or r.get("class") != klass or r.get("variant")
                or not isinstance(r.get("round"), int) or m is None or math.isnan(m)
                or r.get("role") == SAMPLER_ROLE):
            continue
        out.setdefault(str(r.get("cell")), {})[int(r["round"])] = m
    return out


def worst_row(rows: Sequence[Mapping[str, Any]], families: Sequence[str], *,
              klass: str = "candidate_vs_hf", cell: str | None = None
              ) -> Mapping[str, Any] | None:
    """The row of ``families`` with the largest finite margin; ``None`` if there is none.

    Only rows of class ``klass``, unpadded, not of the sampler, and of ``cell`` when given.
    """
    best: Mapping[str, Any] | None = None
    for r in rows:
        m = _float(r.get("margin"))
        if (r.get("family") not in families or r.get("class") != klass or r.get("variant")
                or (cell is not None and r.get("cell") != cell) or m is None
                or not math.isfinite(m) or r.get("role") == SAMPLER_ROLE):
            continue
        if best is None or m > float(best["margin"]):
            best = r
    return best


# --------------------------------------------------------------------------- from tensors


def _reproduces(value: float, stored: Any) -> bool:
    s = _float(stored)
    if s is None or not math.isfinite(s):
        return False
    return abs(value - s) <= REPRODUCE_REL * max(abs(s), 1e-30)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TokenErrors:
    """Per-token ``|obtained - expected|`` of one per-token row's worst sequences.

    Attributes:
        row: the ``report.json`` row drawn.
        sequences: ``(b, positions, abs diff)`` per drawn sequence (valid tokens only),
            worst first.
        bound: the row's sealed bound.
        max_abs: the largest difference over every valid token.
        reproduces: ``max_abs`` equals the row's stored error (the plot shows what was judged).
    """

    row: Mapping[str, Any]
    sequences: tuple[tuple[int, npt.NDArray[np.int64], npt.NDArray[np.float64]], ...]
    bound: float
    max_abs: float
    reproduces: bool


def token_errors(data: RunData, row: Mapping[str, Any],
                 n: int = WORST_SEQUENCES) -> TokenErrors | None:
    """The per-token differences behind a ``candidate_vs_hf`` per-token row.

    Args:
        data: the run.
        row: a row of a family in :data:`PER_TOKEN_FAMILIES`, class ``candidate_vs_hf``.
        n: how many sequences to keep (largest max difference first).

    Returns:
        The :class:`TokenErrors`, ``None`` when a tensor or the mask is missing.
    """
    if data.mask is None or row.get("class") != "candidate_vs_hf":
        return None
    name = f"round{row['round']}/{row['role']}/{row['family']}"
    got, want = data.outputs(str(row["cell"])), data.expected(str(row["cell"]))
    if got is None or want is None or name not in got or name not in want:
        return None
    a = np.asarray(got[name], dtype=np.float64)
    b = np.asarray(want[name], dtype=np.float64)
    mask = data.mask.astype(bool)
    if a.shape != b.shape or a.shape != mask.shape:
        return None
    total = masked_max_abs(a, b, mask).value
    diff = np.where(mask, np.abs(a - b), -np.inf)
    per_seq = diff.max(axis=1)
    order = [int(i) for i in np.argsort(-per_seq, kind="stable") if mask[i].any()][:n]
    seqs = tuple((i, np.flatnonzero(mask[i]).astype(np.int64),
                  np.abs(a[i] - b[i])[mask[i]]) for i in order)
    bound = _float(row.get("bound"))
    return TokenErrors(row=row, sequences=seqs, bound=bound if bound is not None else math.nan,
                       max_abs=total, reproduces=_reproduces(total, row.get("error")))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ParamErrors:
    """Per-parameter relative L2 errors of one per-parameter row.

    Attributes:
        row: the ``report.json`` row drawn.
        params: ``(name, ||a - b|| / ||b||)`` per parameter, largest first.
        bound: the row's sealed bound.
        reproduces: the largest equals the row's stored error (``False`` for a row judged
            against a clip-branch adjusted expected run, :attr:`adjusted`).
        adjusted: the row was judged against an adjusted expected run; the plot shows the
            unadjusted one.
    """

    row: Mapping[str, Any]
    params: tuple[tuple[str, float], ...]
    bound: float
    reproduces: bool
    adjusted: bool


def param_errors(data: RunData, row: Mapping[str, Any]) -> ParamErrors | None:
    """The per-parameter errors behind a ``candidate_vs_hf`` per-parameter row.

    Args:
        data: the run.
        row: a row of a family in :data:`PER_PARAM_FAMILIES`, class ``candidate_vs_hf``.

    Returns:
        The :class:`ParamErrors` (each parameter's error by
        :func:`qualify.statistics.max_rel_l2`, over the stored elements: exact, or the
        seeded sample both sides store), ``None`` when tensors are missing.
    """
    if row.get("class") != "candidate_vs_hf":
        return None
    prefix = f"round{row['round']}/{row['role']}/{row['family']}/"
    got, want = data.outputs(str(row["cell"])), data.expected(str(row["cell"]))
    if got is None or want is None:
        return None
    names = sorted(k[len(prefix):] for k in want if k.startswith(prefix))
    if not names or any(prefix + p not in got for p in names):
        return None
    errs = [(p, max_rel_l2({p: got[prefix + p]}, {p: want[prefix + p]}).value) for p in names]
    errs.sort(key=lambda e: (-e[1], e[0]))
    bound = _float(row.get("bound"))
    return ParamErrors(row=row, params=tuple(errs),
                       bound=bound if bound is not None else math.nan,
                       reproduces=_reproduces(errs[0][1], row.get("error")),
                       adjusted=bool(row.get("adjustment")))


# --------------------------------------------------------------------------- sampler cells

DISTRIBUTION_CLASSES: Final = ("sampler_distribution", "trainer_distribution")
"""The row classes whose per-position values ``report.json`` keeps."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PositionSequence:
    """One drawn sequence: its valid positions and the values there.

    Attributes:
        b: the sequence's row in the rollout.
        t: ``[n]`` its valid response positions.
        kl_ref_cand: ``[n]`` token ``KL(p || q)`` (``p`` the reference, ``q`` the sampler).
        kl_cand_ref: ``[n]`` token ``KL(q || p)``.
        top1: ``agree``, ``mismatch`` or ``tie`` per position
            (:data:`qualify.distmetrics.TOP1_STATES`).
        topk_agreement: ``[n]`` top-k set agreement in ``[0, 1]``.
    """

    b: int
    t: npt.NDArray[np.int64]
    kl_ref_cand: npt.NDArray[np.float64]
    kl_cand_ref: npt.NDArray[np.float64]
    top1: tuple[str, ...]
    topk_agreement: npt.NDArray[np.float64]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PositionDistribution:
    """Per-position values of one cell's distribution family (``decode_*``, ``prefill_*``).

    Attributes:
        cell: the sampler or Actor trainer cell id.
        family: one of :data:`qualify.distmetrics.FAMILIES`.
        k: the top-k path's ``k`` (its KLs are of the lumped distributions, lower bounds of
            the true ones); ``None`` on the full path.
        sequences: the worst sequences, largest token KL first.
        kl_max: the largest ``KL(p || q)`` drawn (the worst sequence's).
        stored: the family's ``kl_ref_cand_max`` row (``None`` when the report has none).
        bound: that row's sealed bound (``nan`` when none).
        bound_cand_ref: the ``kl_cand_ref_max`` row's sealed bound (``nan`` when none).
        reproduces: ``kl_max`` equals the stored row's error.
    """

    cell: str
    family: str
    k: int | None
    sequences: tuple[PositionSequence, ...]
    kl_max: float
    stored: Mapping[str, Any] | None
    bound: float
    bound_cand_ref: float
    reproduces: bool


def _numbers(xs: Any) -> npt.NDArray[np.float64]:
    vals = [_float(x) for x in xs] if isinstance(xs, list) else []
    return np.array([math.nan if v is None else v for v in vals], dtype=np.float64)


def position_distributions(data: RunData, cell: str) -> list[PositionDistribution]:
    """The per-position values behind a cell's distribution rows (:data:`DISTRIBUTION_CLASSES`).

    Read from ``report.json`` ``distribution_positions`` as the comparator kept them (the
    same call that gave the rows, :func:`qualify.compare.distribution.distribution_rows`):
    nothing is recomputed here.

    Args:
        data: the run.
        cell: a sampler or Actor trainer cell id.

    Returns:
        One :class:`PositionDistribution` per family the report keeps for ``cell``, in
        :data:`qualify.distmetrics.FAMILIES` order; ``[]`` for a report without them.
    """
    section = data.doc.get("distribution_positions")
    fams = section.get(cell) if isinstance(section, Mapping) else None
    if not isinstance(fams, Mapping):
        return []
    out = []
    for family in FAMILIES:
        rec = fams.get(family)
        if not isinstance(rec, Mapping) or not isinstance(rec.get("sequences"), list):
            continue
        seqs = tuple(PositionSequence(
            b=int(q["b"]), t=np.asarray(q["t"], dtype=np.int64),
            kl_ref_cand=_numbers(q["kl_ref_cand"]), kl_cand_ref=_numbers(q["kl_cand_ref"]),
            top1=tuple(str(x) for x in q["top1"]), topk_agreement=_numbers(q["topk_agreement"]))
            for q in rec["sequences"] if isinstance(q, Mapping))
        if not seqs:
            continue
        kl_max = float(np.nanmax(np.where(np.isnan(seqs[0].kl_ref_cand), np.inf,
                                          seqs[0].kl_ref_cand)))
        rows = {str(r.get("statistic")): r for r in data.rows if r.get("cell") == cell
                and r.get("class") in DISTRIBUTION_CLASSES and r.get("family") == family}
        stored = rows.get("kl_ref_cand_max")
        bounds = [_float(rows[s].get("bound")) if s in rows else None
                  for s in ("kl_ref_cand_max", "kl_cand_ref_max")]
        error = _float(stored.get("error")) if stored is not None else None
        k = rec.get("k")
        out.append(PositionDistribution(
            cell=cell, family=family, k=int(k) if isinstance(k, int) else None, sequences=seqs,
            kl_max=kl_max, stored=stored,
            bound=bounds[0] if bounds[0] is not None else math.nan,
            bound_cand_ref=bounds[1] if bounds[1] is not None else math.nan,
            reproduces=error is not None and (error == kl_max or _reproduces(kl_max, error))))
    return out
