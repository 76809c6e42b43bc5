"""The comparator: apply the sealed bounds to a candidate run and return its report.

``compare_run`` runs ordered steps (in-toto ``verifylib`` style), each failing with one
error type:

1. read ``run.json`` (:class:`~qualify.errors.UsageError` if it is not a run directory;
   :class:`~qualify.errors.ReferenceDataError` naming the field if one has the wrong type,
   :class:`qualify.layout.RunDocument`);
   refuse a sealed run when writing (:class:`~qualify.errors.EvidenceIntegrityError`);
2. find the reference (:func:`qualify.layout.resolve_reference`) and check it: sealed,
   intact, the very one the run names (manifest digest)
   (:class:`~qualify.errors.ReferenceDataError` / ``EvidenceIntegrityError``);
3. load the contract, ``bounds.json`` (schema-checked, same contract digest) and the rollout;
4. judge every cell of ``run.json`` (below);
5. field mismatch metrics (informational, :mod:`qualify.compare.mismatch`);
6. build the report (with the reference's ``coverage.json``, "coverage not recorded" for
   a reference sealed before it, and every metric row's power check,
   :mod:`qualify.compare.power`) and, with ``write=True``, write ``report.json`` /
   ``report.md`` (:mod:`qualify.compare.report`).

A bound violation is a verdict, never an exception (the rule: :func:`qualify.bounds.judge`;
the rows: :mod:`qualify.compare.rows`, clip-flip re-judging of round >= 2 gradient rows:
:mod:`qualify.compare.reflip`, sampler cells: :mod:`qualify.compare.sampler`; the verdict
types: :mod:`qualify.compare.verdicts`). Per cell of ``run.json``:

- ``NOT_RUN`` -> ``NOT_RUN``, the run's reason; ``ERROR`` -> ``ERROR``, the reason and logs path.
- ``COMPLETE`` -> one :class:`~qualify.compare.verdicts.Row` per check:

  * ``candidate_vs_hf``: the cell's tensors against ``reference/hf-{precision}.safetensors``
    restricted to the cell's role (:func:`qualify.statistics.compare_sets`, rollout's
    ``response_mask``); a cell at TP > 1 is judged by the bound class
    :data:`~qualify.bounds.TP_CANDIDATE_CLASS` when the reference sealed it;
  * ``tp_vs_tp1`` (TP > 1): against the TP = 1 cell of the same engine, precision, options
    and role; ``NOT_RUN`` rows when that cell did not complete;
  * ``padding_invariance``: each ``*_padded`` tensor against the same cell's unpadded one,
    under the family's ``tp_vs_tp1`` bound (a same-precision repeat control); a missing
    padding rerun of the role's main per-token family is a ``FAIL``;
  * ``dtypes``: master weights, gradients and optimizer state must be ``torch.float32``
    in fp32 **and** bf16 cells, and so must every gradient reduction and accumulation dtype
    the harness read back from its engine (``outputs.json`` ``dtypes``;
    :func:`qualify.compare.rows.dtype_row`);
  * ``replica_consistency``: replicated parameters bitwise equal across TP ranks
    (``outputs.json`` ``replica_consistency.all_equal``);
  * ``trainer_distribution`` (an Actor cell): its own round-1 next-token distributions
    against the reference's sealed ones, under the sealed bounds of its precision
    (:func:`qualify.compare.distribution.trainer_distribution_rows`);
  * ``lr_schedule``: the lr each optimizer step applied (``outputs.json`` ``lr``) within one
    FP32 ulp of the lr the reference sealed for that step (``reference.json`` ``update_meta``;
    :func:`qualify.compare.rows.lr_rows`; none for a reference sealed before lr schedules).

  Bounds come only from the reference's ``bounds.json`` (:func:`qualify.bounds.lookup`); a
  metric without a bound (or with a non-finite one) is ``ERROR``, never ``PASS``. ``PASS``
  iff the error is finite and ``error <= bound``; ``margin = error / bound`` (``inf`` when
  ``bound == 0 < error``, 0 when both are 0). A resume cell (``resume_of``) has the rows
  of :mod:`qualify.compare.resume`.

  Each row builder runs guarded (:func:`qualify.compare.rows.guarded`): one that raises on
  a cell's evidence gives one ``ERROR`` row naming the cell, the builder and the exception
  (one line), and the cell's other checks and the other cells are still compared; an
  integrity or input error (:class:`~qualify.errors.QualifyError`) keeps its exit code.

A cell's verdict is its worst row by the precedence ``FAIL > ERROR > NOT_RUN > PASS``: a
cell passes only when every check ran and passed. The report passes iff there is at least
one required cell and every required cell passes; required cells are
``contract.matrix.required_cells`` when set, else every cell of the contract's matrix
(a required cell absent from ``run.json`` is ``NOT_RUN``, and never a pass).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from qualify import jsonio
from qualify.bounds import TP_CANDIDATE_CLASS, Bound
from qualify.compare.distribution import (
    TRAINER_VS_SAMPLER_NOTE,
    cell_routes,
    decode_clip_band,
    distribution_rows,
    read_sealed,
    trainer_distribution_rows,
    trainer_vs_sampler,
)
from qualify.compare.mismatch import (
    FieldMismatch,
    clip_band_tail,
    comparability_note,
    field_mismatch,
    is_like_for_like,
)
from qualify.compare.power import PowerCache
from qualify.compare.reflip import SealedBranches, with_branch_flips
from qualify.compare.report import write_report
from qualify.compare.resume import resume_required, resume_rows
from qualify.compare.routes import reference_backends, route_row
from qualify.compare.rows import (
    LR_RULE,
    compare_rows,
    declared_not_run,
    declared_or,
    dtype_row,
    guarded,
    lr_rows,
    not_run_rows,
    padding_rows,
    replica_row,
)
from qualify.compare.sampler import ACTOR_KEY, sampler_required, sampler_rows
from qualify.compare.verdicts import (
    OPTIONAL_SECTIONS,
    VERDICT_PRECEDENCE,
    CellResult,
    Report,
    Row,
    Verdict,
    cell_verdict,
    worst_margin,
    worst_verdict,
)
from qualify.compare.weights import behavior_weight_rows
from qualify.contract import CellSpec, Contract
from qualify.digests import sha256_bytes
from qualify.errors import EvidenceIntegrityError, ReferenceDataError, UsageError
from qualify.evidence import store
from qualify.evidence.policy import Policy
from qualify.evidence.tensor_stream import TensorFile, in_memory, open_tensors
from qualify.lanes import lane_precision
from qualify.layout import (
    COVERAGE_FILE,
    ENVIRONMENT_FILE,
    HF_REFERENCE_DIR,
    LOGS_DIR,
    OUTPUTS_FILE,
    OUTPUTS_META_FILE,
    REPORT_JSON,
    ROLLOUT_FILE,
    ROLLOUT_META_FILE,
    RUN_FILE,
    RunDocument,
    hf_tensors_file,
    resolve_reference,
)
from qualify.matrix import ExpectedNotRun
from qualify.protocol import parse_tensor_name
from qualify.reference import documents
from qualify.statistics import group_tensors

__all__ = ["compare_run"]


# --------------------------------------------------------------------------- loading


class _CellError(Exception):
    """A COMPLETE cell whose evidence cannot be judged (becomes an ``ERROR`` verdict)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Outputs:
    tensors: TensorFile
    """Small tensors in memory, large ones read in chunks when used (:func:`open_tensors`)."""
    meta: dict[str, Any] | None
    meta_problem: str


def _device_kind_notes(ref_dir: Path, loaded: Mapping[str, Any]) -> list[str]:
    """A note when cells ran on another device kind than the reference's bounds were sealed on.

    The reference's kind is its ``environment.json`` ``reference_devices.kind`` (``cuda``, or
    the host: ``host`` / ``cpu``, and every reference written before the field); a cell's is
    its ``outputs.json`` ``device`` (``cpu``, ``cuda:N``). Bounds are their device kind's: a
    flag for the reader, not a verdict.
    """
    try:
        env = json.loads((ref_dir / ENVIRONMENT_FILE).read_text("utf-8"))
        kind = str((env.get("reference_devices") or {}).get("kind") or "host")
    except (OSError, ValueError, AttributeError):
        return []
    ref_kind = "cuda" if kind == "cuda" else "cpu"
    other = sorted(cid for cid, got in loaded.items()
                   if isinstance(got, _Outputs) and isinstance(got.meta, dict)
                   and isinstance(got.meta.get("device"), str)
                   and got.meta["device"].split(":")[0] != ref_kind)
    if not other:
        return []
    return [f"device kinds differ: the bounds were sealed on {ref_kind} (the reference's "
            f"{ENVIRONMENT_FILE} reference_devices) and {len(other)} cell(s) ran on another "
            f"kind ({', '.join(other[:3])}{', ...' if len(other) > 3 else ''}): bounds are "
            "their device kind's"]


def _read_run(run_dir: Path) -> RunDocument:
    """``run_dir/run.json``, type-checked.

    Raises:
        UsageError: no readable ``run.json``, or not a run document (no ``cells`` object).
        ReferenceDataError: a field of it has the wrong type (the field is named).
    """
    run_file = run_dir / RUN_FILE
    if not os.path.lexists(run_file):
        raise UsageError(f"{run_file}: not found; {run_dir} is not a candidate run")
    try:
        raw = jsonio.read_json(run_file)
    except (OSError, EvidenceIntegrityError) as exc:  # unreadable, not strict JSON, a link
        raise UsageError(f"{run_file}: unreadable or not JSON: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("cells"), dict):
        raise UsageError(f"{run_file}: not a run document (no 'cells' object)")
    return RunDocument.from_dict(raw, where=str(run_file))


def _load_outputs(run_dir: Path, attempt: str | None) -> _Outputs:
    """Load a COMPLETE cell's sealed attempt.

    Raises:
        _CellError: no attempt, the attempt is outside the run, unsealed, edited, or its
            tensors are unreadable.
    """
    if not attempt:
        raise _CellError(f"{RUN_FILE} lists the cell COMPLETE without an attempt directory")
    adir = (run_dir / attempt).resolve()
    if not adir.is_relative_to(run_dir.resolve()):
        raise _CellError(f"attempt {attempt!r} lies outside the run directory")
    if not adir.is_dir():
        raise _CellError(f"attempt directory {adir} not found")
    problems = store.verify_manifest(adir)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise _CellError(f"attempt {attempt} is incomplete or edited: {problems[0]}{more}")
    try:
        tensors = open_tensors(adir / OUTPUTS_FILE)
    except EvidenceIntegrityError as exc:
        raise _CellError(str(exc)) from None
    meta: dict[str, Any] | None = None
    problem = ""
    try:
        raw = jsonio.read_json(adir / OUTPUTS_META_FILE)
        if isinstance(raw, dict):
            meta = raw
        else:
            problem = f"{OUTPUTS_META_FILE} is not a JSON object"
    except FileNotFoundError:
        problem = f"{OUTPUTS_META_FILE} missing"
    except (OSError, ValueError, EvidenceIntegrityError) as exc:
        problem = f"{OUTPUTS_META_FILE} unreadable: {exc}"
    return _Outputs(tensors=tensors, meta=meta, meta_problem=problem)


def _role_of(name: str) -> str | None:
    try:
        return parse_tensor_name(name)[1]
    except ValueError:
        return None


def _check_reference(ref_dir: Path, run: RunDocument, run_file: Path) -> str:
    """Sealed, intact and the one the run was made against; returns the manifest digest."""
    if not ref_dir.is_dir():
        raise ReferenceDataError(f"{ref_dir}: reference directory not found")
    if not store.is_sealed(ref_dir):
        raise ReferenceDataError(store.not_sealed_reason(
            ref_dir, "reference", advice="bounds are only read from a sealed reference"))
    digest = store.check_sealed(ref_dir)
    want = run.reference.manifest_digest
    if want != digest:
        raise EvidenceIntegrityError(
            f"{run_file}: reference.manifest_digest is {str(want)[:12]}, but {ref_dir} has "
            f"manifest digest {digest[:12]}: the run was made against another reference")
    return digest


def _load_bounds(ref_dir: Path, contract: Contract) -> tuple[list[Bound], str, str]:
    """The checked ``bounds.json``'s rows, its bytes' sha256 and its lane.

    (:func:`qualify.reference.documents.read_bounds`; each row with its sealed per-token
    round-to-round responses, :func:`qualify.reference.bound_inputs.with_token_responses`.)
    """
    from qualify.reference.bound_inputs import with_token_responses

    doc, data = documents.read_bounds(ref_dir, contract.digest)
    return (with_token_responses([Bound.from_dict(b) for b in doc["bounds"]], ref_dir),
            sha256_bytes(data), str(doc["lane"]))


def _load_contract(ref_dir: Path) -> Contract:
    """The reference's contract, its ``reference.json`` and ``bounds.json`` checked.

    All three documents of one contract digest, each on its schema
    (:func:`qualify.reference.documents.check_reference_documents`).
    """
    digest = documents.read_reference_record(ref_dir)["contract_digest"]
    contract = documents.read_contract(ref_dir, digest)
    documents.check_reference_documents(ref_dir, contract)
    return contract


def _load_coverage(ref_dir: Path) -> dict[str, Any] | None:
    """The reference's ``coverage.json``, or ``None`` when it was sealed before it existed.

    Raises:
        ReferenceDataError: the file is there but unreadable or not a coverage document.
    """
    path = ref_dir / COVERAGE_FILE
    if not os.path.lexists(path):
        return None
    try:
        doc = jsonio.read_json(path)
    except (OSError, ValueError, EvidenceIntegrityError) as exc:
        raise ReferenceDataError(f"{path}: unreadable or not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rules"), list):
        raise ReferenceDataError(f"{path}: rules: not a list of coverage rules")
    return doc


def _update_meta(ref_dir: Path) -> dict[str, Any]:
    """``reference.json`` ``update_meta`` (``{}`` when absent: nothing sealed there).

    Raises:
        ReferenceDataError: ``reference.json`` is missing, unreadable or off its schema.
    """
    meta: dict[str, Any] = documents.read_reference_record(ref_dir).get("update_meta", {})
    return meta


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Ctx:
    run_dir: Path
    ref_dir: Path
    bounds: list[Bound]
    mask: npt.NDArray[Any]
    contract: Contract
    branches: SealedBranches
    hf: dict[str, TensorFile | None] = dataclasses.field(default_factory=dict)
    cells: dict[str, CellSpec] = dataclasses.field(default_factory=dict)
    """The contract's matrix cells by id."""
    power: PowerCache = dataclasses.field(default_factory=dict)
    """Null errors of the power check measured so far (:func:`qualify.compare.power.power_of`)."""
    update_meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """``reference.json`` ``update_meta``: per ``hf-<lane>`` and role, the sealed ``lr``."""
    reduction_dtypes: bool = True
    """``dtypes`` rows check the gradient reduction and accumulation dtypes (the report's
    ``reduction_dtypes`` section)."""
    trainer_distribution: bool = True
    """Actor trainer cells have ``trainer_distribution`` rows (the report's section of that
    name)."""
    bf16_ties: bool = True
    """A BF16 Actor cell's top-1 ties are resolved at its own precision (the report's
    ``bf16_ties`` section; without it, by the FP32 rule, as reports sealed before it)."""
    trainer_vs_sampler_topk: bool = True
    """``trainer_vs_sampler`` has pairs on the top-k path (the report's section of that name;
    without it, none there, as reports sealed before it)."""
    positions: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Per sampler and Actor trainer cell, the per-position values behind its distribution
    rows (the report's ``distribution_positions`` section)."""


def _hf(ctx: _Ctx, precision: str) -> TensorFile | None:
    if precision not in ctx.hf:
        path = ctx.ref_dir / HF_REFERENCE_DIR / hf_tensors_file(precision)
        ctx.hf[precision] = open_tensors(path) if path.is_file() else None
    return ctx.hf[precision]


def _lane(ctx: _Ctx, cid: str, precision: str) -> str:
    """The reference lane a cell is compared in (:mod:`qualify.lanes`).

    The cell's own lane (its engine's BF16 style) when the sealed bounds have it; the
    precision itself for a reference sealed before lanes existed (one BF16 reference run,
    BF16 parameters), so its evidence still recomputes to the report it was signed with.
    """
    spec = ctx.cells.get(cid)
    lane = spec.lane if spec is not None else precision
    if lane != precision and lane not in {b.precision for b in ctx.bounds}:
        return precision
    return lane


def _candidate_bound_class(ctx: _Ctx, cid: str) -> str:
    """The bound class of a cell's ``candidate_vs_hf`` rows.

    :data:`~qualify.bounds.TP_CANDIDATE_CLASS` for a cell at TP > 1 when the sealed bounds
    hold it (the contract names a TP-only control such as ``row_split``), else
    ``candidate_vs_hf``.
    """
    spec = ctx.cells.get(cid)
    if spec is not None and spec.tp > 1 and any(b.klass == TP_CANDIDATE_CLASS
                                                 for b in ctx.bounds):
        return TP_CANDIDATE_CLASS
    return "candidate_vs_hf"


def _base_cell(ctx: _Ctx, cid: str) -> tuple[str | None, bool]:
    """``(id of the same cell at every axis's base degree, whether cid is that cell)``.

    From the contract's matrix (:meth:`~qualify.matrix.CellSpec.base_cell_id`): TP=n is
    compared with TP=1 of the same engine, precision, role and options, and an engine's
    other parallel axes (a shard degree) go to their base degree too. ``(None, True)`` for
    a cell the matrix does not list (nothing to compare it with).
    """
    spec = ctx.cells.get(cid)
    if spec is None:
        return None, True
    return spec.base_cell_id(), spec.is_base


def _class_rows(ctx: _Ctx, *, cell: str, klass: str, precision: str, role: str,
                obtained: Mapping[str, Any], expected: Mapping[str, Any],
                meta: Mapping[str, Any] | None, bound_class: str | None = None,
                reference: Mapping[str, Any] | None = None) -> list[Row]:
    """One comparison class's rows, with round >= 2 clip flips re-judged (:mod:`.reflip`).

    ``reference``: the HF reference's tensors of the role when ``expected`` is the TP = 1
    cell (its own clip branches are then measured from the reference).
    """
    rows = compare_rows(cell=cell, klass=klass, precision=precision, bounds=ctx.bounds,
                        obtained=obtained, expected=expected, mask=ctx.mask, meta=meta,
                        power_cache=ctx.power, bound_class=bound_class)
    return guarded(lambda: with_branch_flips(
        ctx.branches, rows, cell=cell, klass=klass, precision=precision, role=role,
        obtained=obtained, expected=expected, meta=meta, reference=reference),
        cell=cell, builder="qualify.compare.reflip.with_branch_flips", klass=klass, role=role,
        family="grads", keep=rows)


def _complete_rows(ctx: _Ctx, *, cid: str, entry: Mapping[str, Any], cells: Mapping[str, Any],
                   outputs: _Outputs, loaded: dict[str, _Outputs | str]) -> list[Row]:
    role = str(entry.get("role", ""))
    precision = _lane(ctx, cid, str(entry.get("precision", "")))
    mine = {k: v for k, v in outputs.tensors.items() if _role_of(k) == role}
    rows: list[Row] = []
    hf = _hf(ctx, precision)
    # each builder below is guarded: one it cannot build is an ERROR row naming it
    g: dict[str, Any] = {"cell": cid, "role": role}
    if hf is None:
        rows.append(Row(cell=cid, klass="candidate_vs_hf", bound_class="candidate_vs_hf",
                        round=None, role=role, family="all", statistic="-", error=None,
                        bound=None, margin=None, verdict="ERROR", where="",
                        reason=f"reference has no {HF_REFERENCE_DIR}/"
                               f"{hf_tensors_file(precision)}"))
    else:
        expected = {k: v for k, v in hf.items() if _role_of(k) == role}
        rows += guarded(lambda: _class_rows(
            ctx, cell=cid, klass="candidate_vs_hf", precision=precision, role=role,
            obtained=mine, expected=expected, meta=outputs.meta,
            bound_class=_candidate_bound_class(ctx, cid)),
            **g, builder="qualify.compare.rows.compare_rows", klass="candidate_vs_hf",
            family="all")
    tp1_id, is_base = _base_cell(ctx, cid)
    if not is_base and tp1_id is not None:
        tp1 = cells.get(tp1_id)
        got = loaded.get(tp1_id)
        if isinstance(got, _Outputs):
            ref1 = {k: v for k, v in got.tensors.items() if _role_of(k) == role}
            rows += guarded(lambda: _class_rows(
                ctx, cell=cid, klass="tp_vs_tp1", precision=precision, role=role,
                obtained=mine, expected=ref1, meta=outputs.meta,
                reference=None if hf is None
                else {k: v for k, v in hf.items() if _role_of(k) == role}),
                **g, builder="qualify.compare.rows.compare_rows", klass="tp_vs_tp1",
                family="all")
        else:
            status = tp1.get("status") if isinstance(tp1, Mapping) else f"absent from {RUN_FILE}"
            why = f": {got}" if isinstance(got, str) else ""
            keys = sorted(group_tensors(mine), key=lambda k: k.label)
            rows += not_run_rows(cid, "tp_vs_tp1", "tp_vs_tp1", keys,
                                 f"TP=1 cell of the same engine did not complete "
                                 f"({tp1_id}: {status}{why})")
    padding = guarded(lambda: padding_rows(cell=cid, role=role, precision=precision,
                                           bounds=ctx.bounds, outputs=mine, mask=ctx.mask),
                      **g, builder="qualify.compare.rows.padding_rows",
                      klass="padding_invariance", family="padding")
    rows += [declared_or(r, outputs.meta, "padding") for r in padding]
    rows += guarded(lambda: [declared_or(dtype_row(cid, role, outputs.meta,
                                                   outputs.meta_problem,
                                                   precision=lane_precision(precision),
                                                   reduction=ctx.reduction_dtypes),
                                         outputs.meta, "dtypes")],
                    **g, builder="qualify.compare.rows.dtype_row", klass="dtypes",
                    family="dtypes")
    rows += guarded(lambda: [declared_or(replica_row(cid, role, outputs.meta,
                                                     outputs.meta_problem),
                                         outputs.meta, "replica")],
                    **g, builder="qualify.compare.rows.replica_row",
                    klass="replica_consistency", family="replica")
    for r in guarded(lambda: lr_rows(cid, role, outputs.meta, outputs.meta_problem,
                                     _sealed_lr(ctx, precision, role)),
                     **g, builder="qualify.compare.rows.lr_rows", klass="lr_schedule",
                     family="lr"):
        declared = (declared_not_run(outputs.meta, r.round, "lr") if r.where == "(missing)"
                    else None)
        rows.append(r if declared is None else dataclasses.replace(
            r, verdict="NOT_RUN", reason=declared, detail=None, where="", bound=None))
    return rows


def _lr_section(ctx: _Ctx) -> dict[str, Any]:
    """``report.json`` ``lr_schedule``: the contract's schedule, the rule, the sealed lrs."""
    o = ctx.contract.optimizer
    sealed = {role: dict(lr) for role in ("actor", "critic")
              if (lr := _sealed_lr(ctx, "", role)) is not None}
    return {"schedule": {"lr_schedule": o.lr_schedule, "warmup_steps": o.warmup_steps,
                         "total_steps": o.total_steps, "min_lr_ratio": o.min_lr_ratio},
            "rule": LR_RULE, "sealed": sealed or None}


def _sealed_lr(ctx: _Ctx, lane: str, role: str) -> Mapping[str, Any] | None:
    """The reference's per-round lr of ``role`` (``update_meta`` ``hf-<lane>``), else ``None``.

    The schedule does not depend on the precision, so a lane without its own record takes
    another HF lane's; ``None`` for a reference sealed before lr schedules (no lr rows).
    """
    labels = [f"hf-{lane}", *sorted(k for k in ctx.update_meta if str(k).startswith("hf-"))]
    for label in labels:
        m = ctx.update_meta.get(label)
        lr = (m.get(role) or {}).get("lr") if isinstance(m, Mapping) else None
        if isinstance(lr, Mapping):
            return lr
    return None


def _required_ids(contract: Contract) -> tuple[str, ...]:
    """The ids of the cells the report's ``passed`` depends on.

    ``required_cells``, else every matrix cell (a cell that did not run is no pass); plus
    the sampler cells when the contract requires them.
    """
    required_ids = contract.matrix.required_cells
    if required_ids is None:
        required_ids = tuple(c.cell_id for c in contract.matrix.cells())
    return (*required_ids, *sampler_required(contract), *resume_required(contract))


def expected_not_run(rows: Sequence[Row], engine: str,
                     expected: Sequence[ExpectedNotRun]) -> list[Row]:
    """``rows`` with each ``NOT_RUN`` row the contract expects of ``engine`` marked.

    The first matching :class:`~qualify.matrix.ExpectedNotRun` gives the row's
    :attr:`~qualify.compare.verdicts.Row.expected_not_run`; every other row is unchanged.
    """
    out = []
    for r in rows:
        hit = next((x for x in expected if x.matches(engine, r.family, r.round)), None) \
            if r.verdict == "NOT_RUN" else None
        out.append(r if hit is None else dataclasses.replace(r, expected_not_run=hit.reason))
    return out


def _round1(tensors: TensorFile, prefix: str) -> dict[str, Any]:
    """The round-1 tensors ``round1/<prefix>...`` of a cell, in memory; the others unread.

    An Actor's outputs hold its whole gradients, moments and updates: the distribution rows
    read only their own tensors, so a compare stays bounded by its largest tensor.
    """
    return _only(tensors, lambda name: name.startswith(f"round1/{prefix}"))


def _only(tensors: TensorFile, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The tensors of a cell whose names ``wanted`` accepts, in memory; the others unread."""
    return in_memory({k: v for k, v in tensors.items() if wanted(k)})


def _cell_precision(ctx: _Ctx, cid: str, e: Mapping[str, Any]) -> str:
    """A cell's precision lane (``fp32`` / ``bf16``).

    Its ``run.json`` entry's, else the contract's matrix cell's.
    """
    spec = ctx.cells.get(cid)
    return lane_precision(str(e.get("precision") or (spec.precision if spec else "")))


def _trainer_distribution(ctx: _Ctx, cid: str, e: Mapping[str, Any],
                          outputs: _Outputs) -> list[Row]:
    """An Actor trainer cell's ``trainer_distribution`` rows, its positions kept in ``ctx``.

    The cell's precision (``run.json``, else the contract's matrix cell) picks the sealed
    bounds: ``fp32`` the FP32 controls', ``bf16`` the BF16 control's.
    """
    precision = _cell_precision(ctx, cid, e)
    kept: dict[str, Any] = {}  # the report's only when every row was built
    got = trainer_distribution_rows(
        cell=cid, precision=precision, tensors=_round1(outputs.tensors, "actor/prefill_"),
        ref_dir=ctx.ref_dir, mask=ctx.mask,
        responses=store.load_tensors(ctx.ref_dir / ROLLOUT_FILE)["responses"], positions=kept,
        bf16_ties=ctx.bf16_ties)
    ctx.positions[cid] = kept
    return got


def _trainer_vs_sampler(ctx: _Ctx, cells: Mapping[str, Any],
                        loaded: Mapping[str, _Outputs | str]) -> dict[str, Any] | None:
    """``report.json`` ``trainer_vs_sampler``: each (Actor trainer, sampler) cell pair's metrics.

    Every COMPLETE Actor trainer cell (not a resume cell) with every COMPLETE sampler cell
    (:func:`trainer_vs_sampler`); ``None`` without the ``trainer_distribution`` section.
    """
    if not ctx.trainer_distribution:
        return None
    done = {cid: got for cid, got in loaded.items() if isinstance(got, _Outputs)}
    actors = [c for c in done if cells[c].get("role") == "actor" and "resume_of" not in cells[c]]
    samplers = [c for c in done if cells[c].get("role") == "sampler"]
    pairs: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    if actors and samplers:
        responses = store.load_tensors(ctx.ref_dir / ROLLOUT_FILE)["responses"]
        for a in actors:
            precision = _cell_precision(ctx, a, cells[a])
            for s in samplers:
                try:
                    pairs += trainer_vs_sampler(
                        trainer=a, precision=precision, sampler=s,
                        trainer_tensors=_round1(done[a].tensors, "actor/prefill_"),
                        sampler_tensors=_round1(done[s].tensors, "sampler/decode_"),
                        ref_dir=ctx.ref_dir, mask=ctx.mask, responses=responses,
                        topk=ctx.trainer_vs_sampler_topk)
                except (ValueError, KeyError, TypeError, IndexError) as exc:
                    # information only: a malformed tensor (which that cell's own rows judge
                    # as an ERROR) costs the pair, not the report
                    errors.append({"trainer": a, "sampler": s,
                                   "error": f"{type(exc).__name__}: {exc}"})
    return {"note": TRAINER_VS_SAMPLER_NOTE, "pairs": pairs,
            **({"errors": errors} if errors else {})}


def _judge_cell(ctx: _Ctx, cid: str, e: Mapping[str, Any], cells: Mapping[str, Any],
                loaded: dict[str, _Outputs | str]) -> tuple[str, Verdict, str | None, list[Row]]:
    """Status, verdict, reason and rows of one ``run.json`` cell entry."""
    status = str(e.get("status", "NOT_RUN"))
    attempt = e.get("attempt")
    rows: list[Row] = []
    raw_reason = e.get("reason")  # run.json text; a hand-edited non-string is shown as JSON
    reason = None if raw_reason in (None, "") else (
        raw_reason if isinstance(raw_reason, str) else json.dumps(raw_reason, default=str))
    verdict: Verdict
    if status == "COMPLETE":
        got = loaded[cid]
        if isinstance(got, str):
            return status, "ERROR", got, rows
        outputs = got
        if e.get("role") == "sampler":  # qualify.compare.sampler: the sampler cells
            src = loaded.get(str(e.get("weights_from")), f"not COMPLETE in {RUN_FILE}")
            rows = guarded(lambda: sampler_rows(
                cell=cid, entry=e, tensors=in_memory(outputs.tensors), meta=outputs.meta,
                meta_problem=outputs.meta_problem, bounds=ctx.bounds, mask=ctx.mask,
                actor=_only(src.tensors, lambda name: name == ACTOR_KEY.label)
                if isinstance(src, _Outputs) else src),
                cell=cid, builder="qualify.compare.sampler.sampler_rows",
                klass="sampler_install", role="sampler", family="all")

            def distribution() -> list[Row]:  # qualify.compare.distribution
                kept: dict[str, Any] = {}  # the report's only when every row was built
                got = distribution_rows(
                    cell=cid, tensors=in_memory(outputs.tensors), ref_dir=ctx.ref_dir,
                    mask=ctx.mask, responses=store.load_tensors(ctx.ref_dir / ROLLOUT_FILE)[
                        "responses"], positions=kept)
                ctx.positions[cid] = kept
                return got

            rows += guarded(distribution, cell=cid, klass="sampler_distribution",
                            role="sampler", family="all",
                            builder="qualify.compare.distribution.distribution_rows")
        elif "resume_of" in e:  # qualify.compare.resume: against the uninterrupted cell
            rows = guarded(lambda: resume_rows(
                cell=cid, entry=e, outputs=outputs, loaded=loaded, bounds=ctx.bounds,
                mask=ctx.mask, lane=_lane(ctx, str(e["resume_of"]), str(e["precision"]))),
                cell=cid, builder="qualify.compare.resume.resume_rows", klass="resume",
                role=str(e.get("role", "")), family="all")
        else:
            rows = _complete_rows(ctx, cid=cid, entry=e, cells=cells, outputs=got,
                                  loaded=loaded)
            if e.get("role") == "actor" and ctx.trainer_distribution:  # its distributions
                rows += guarded(lambda: _trainer_distribution(ctx, cid, e, outputs),
                                cell=cid, klass="trainer_distribution", role="actor",
                                family="all",
                                builder="qualify.compare.distribution."
                                        "trainer_distribution_rows")
        rows = expected_not_run(rows, str(e.get("engine", "")),
                                ctx.contract.matrix.expected_not_run)
        verdict, reason = cell_verdict(rows)  # a compared cell: its rows'

    elif status == "ERROR":
        logs = ctx.run_dir / str(attempt) / LOGS_DIR if attempt else None
        verdict = "ERROR"
        reason = f"{reason or 'harness error'}" + (f" (logs: {logs})" if logs else "")
    elif status == "NOT_RUN":
        verdict = "NOT_RUN"
        reason = reason or "not run"
    else:
        verdict = "ERROR"
        reason = f"{RUN_FILE} status {status!r} is not COMPLETE, ERROR or NOT_RUN"
        status = "ERROR"
    return status, verdict, reason, rows


def compare_run(run_dir: Path, *, reference_dir: Path | None = None,
                write: bool = True, sections: Sequence[str] = OPTIONAL_SECTIONS,
                policy: Policy | Callable[[Contract], Policy] | None = None) -> Report:
    """Judge every cell of a candidate run against the sealed reference's bounds.

    Args:
        run_dir: ``evidence/<contract>/<run-id>/`` (holds ``run.json``).
        reference_dir: the sealed reference; default: found from ``run.json``'s
            ``reference`` (:func:`qualify.layout.resolve_reference`). Either way its
            manifest digest must equal ``run.json``'s.
        write: write ``report.json`` and ``report.md`` into ``run_dir``.
        sections: the optional report sections whose rules apply
            (:data:`~qualify.compare.verdicts.OPTIONAL_SECTIONS`, all by default);
            verification recomputes a report sealed by an earlier comparator with the
            sections it holds (``reduction_dtypes``: the ``dtypes`` rows check the gradient
            reduction and accumulation dtypes).
        policy: the gate policy whose decision the report records (section
            ``gate_decision``, :mod:`qualify.evidence.decision`), or a function of the
            run's contract giving it (verification: the policy the sealed report embeds);
            default: the one the run recorded at its start (``sources.json``), read now,
            else none (the comparator's verdict decides).

    Returns:
        The :class:`~qualify.compare.verdicts.Report` (``bool(report)`` is
        ``report.passed``).

    Raises:
        UsageError: ``run_dir`` has no readable ``run.json``.
        ReferenceDataError: a ``run.json`` field has the wrong type (e.g. a non-integer
            ``tp``); the reference is missing, unsealed, lacks its contract, bounds or
            rollout, or belongs to another contract than the run.
        ContractError: the recorded gate policy file is invalid (one line naming it).
        EvidenceIntegrityError: the reference was edited or is not the run's reference,
            or ``write=True`` and the run directory is sealed.
    """
    run_dir = Path(run_dir)
    # 1. the run
    run_file = run_dir / RUN_FILE
    run = _read_run(run_dir)
    if write and (store.is_sealed(run_dir) or store.sealed_ancestor(run_dir / REPORT_JSON)):
        raise EvidenceIntegrityError(f"{run_dir}: run is sealed; a sealed directory is never "
                                     "written again (qualify verify RUN_DIR recomputes its "
                                     "report)")
    # 2. the reference
    ref_dir = resolve_reference(run_dir, run, reference_dir)
    manifest_digest = _check_reference(ref_dir, run, run_file)
    # 3. contract, bounds, rollout
    contract = _load_contract(ref_dir)
    if run.contract_digest != contract.digest:
        raise ReferenceDataError(f"{run_file}: contract_digest {run.contract_digest[:12]} is "
                                 f"not the reference contract's {contract.digest12}")
    bounds, bounds_digest, lane = _load_bounds(ref_dir, contract)
    rollout = store.load_tensors(ref_dir / ROLLOUT_FILE)
    for k in ("response_mask", "behavior_logprobs"):
        if k not in rollout:
            raise ReferenceDataError(f"{ref_dir / ROLLOUT_FILE}: no {k!r} tensor")
    mask = np.asarray(rollout["response_mask"])
    coverage = _load_coverage(ref_dir)
    ctx = _Ctx(run_dir=run_dir, ref_dir=ref_dir, bounds=bounds, mask=mask, contract=contract,
               branches=SealedBranches(ref_dir=ref_dir, contract=contract, bounds=bounds,
                                       mask=mask),
               cells={c.cell_id: c for c in contract.matrix.cells()},
               update_meta=_update_meta(ref_dir),
               reduction_dtypes="reduction_dtypes" in sections,
               trainer_distribution="trainer_distribution" in sections,
               bf16_ties="bf16_ties" in sections,
               trainer_vs_sampler_topk="trainer_vs_sampler_topk" in sections)
    # 4. the cells
    cells = run.cells
    loaded: dict[str, _Outputs | str] = {}
    for cid, entry in cells.items():
        if entry.get("status") == "COMPLETE":
            try:
                loaded[cid] = _load_outputs(run_dir, entry.get("attempt"))
            except _CellError as exc:
                loaded[cid] = str(exc)
    required_ids = _required_ids(contract)
    results: list[CellResult] = []
    all_rows: list[Row] = []
    routes = cell_routes({cid: got.meta for cid, got in loaded.items()
                          if isinstance(got, _Outputs)}, ctx.ref_dir)
    ref_backends = reference_backends(read_sealed(ctx.ref_dir)[0])
    for cid, e in cells.items():
        status, verdict, reason, rows = _judge_cell(ctx, cid, e, cells, loaded)
        if "route_pins" in sections and status == "COMPLETE" and cid in routes and \
                (rrow := route_row(cid, str(e.get("role", "")), "sampler" if e.get("role") ==
                                   "sampler" else "trainer", routes[cid], pins=contract.routes,
                                   reference=ref_backends)) is not None:  # qualify.compare.routes
            rows.append(rrow)
            if worst_verdict([verdict, rrow.verdict]) != verdict:
                verdict, reason = rrow.verdict, rrow.reason
        attempt = e.get("attempt")
        results.append(CellResult(
            cell=cid, engine=str(e.get("engine", "")), precision=str(e.get("precision", "")),
            options=dict(e.get("options") or {}), role=str(e.get("role", "")),
            tp=int(e.get("tp", 0)), status=status, verdict=verdict, reason=reason,
            attempt=str(attempt) if attempt else None, required=cid in required_ids,
            counts={v: sum(r.verdict == v for r in rows) for v in VERDICT_PRECEDENCE},
            worst_margin=worst_margin(rows)))
        all_rows += rows
    for cid in required_ids:
        if cid not in cells:
            results.append(CellResult(
                cell=cid, engine="", precision="", options={}, role="", tp=0,
                status="NOT_RUN", verdict="NOT_RUN", attempt=None, required=True,
                reason=f"required by the contract but absent from {RUN_FILE}",
                counts={}, worst_margin=None))
    # 5. field mismatch metrics (informational)
    fields, band, field_note, like, mode, notes = _field_metrics(ctx, contract, rollout,
                                                                cells, loaded)
    notes += _device_kind_notes(ctx.ref_dir, loaded)
    hf32 = _hf(ctx, "fp32")
    if "routes" in sections and any(e.get("role") == "sampler" for e in cells.values()) \
            and read_sealed(ctx.ref_dir)[1]:  # a report sealed before routes: as then
        notes.append(f"no sampler_distribution rows: {read_sealed(ctx.ref_dir)[1]}")
    if ctx.trainer_distribution and any(e.get("role") == "actor" for e in cells.values()) \
            and read_sealed(ctx.ref_dir)[1]:
        notes.append(f"no trainer_distribution rows: {read_sealed(ctx.ref_dir)[1]}")
    for cid, got in loaded.items():  # the like-for-like pair: qualify.compare.distribution
        if isinstance(got, _Outputs) and cells[cid].get("role") == "sampler" and \
                hf32 is not None and "round1/actor/logprobs" in hf32:
            band += decode_clip_band(sources=[("hf-fp32", "fp32", hf32["round1/actor/logprobs"])],
                                     cell=cid, tensors=in_memory(got.tensors), mask=ctx.mask,
                                     clip_ratio=contract.algorithm.clip_ratio)
    report = Report(
        contract=contract.name, contract_digest=contract.digest,
        run_id=run.run_id, run_dir=str(run_dir),
        reference_dir=str(ref_dir), reference_manifest_digest=manifest_digest,
        bounds_digest=bounds_digest, lane=lane, created=store.utc_now_iso(),
        cells=tuple(results), rows=tuple(all_rows), logprobs_mode=mode,
        field_like_for_like=like, field_note=field_note, field_metrics=tuple(fields),
        notes=tuple(notes), coverage=coverage, clip_band=tuple(band),
        lr_schedule=_lr_section(ctx),
        routes=routes,
        distribution_positions={c: p for c, p in ctx.positions.items() if p},
        trainer_vs_sampler=_trainer_vs_sampler(ctx, cells, loaded),
        behavior_weights=behavior_weight_rows(
            ref_dir, run_dir, [(c.cell, c.attempt) for c in results
                               if c.role == "actor" and c.attempt]))
    if "gate_decision" in sections:  # 6. the gate's decision under the policy, now
        from qualify.evidence.decision import decision_section, recorded_policy
        from qualify.evidence.policy import all_cells

        pol = policy(contract) if callable(policy) else policy if policy is not None \
            else recorded_policy(run_dir, contract)
        report = dataclasses.replace(report, sections=tuple(sections), gate=decision_section(
            report.to_dict(), pol, all_cells(contract)))
    # 7. write
    if write:
        write_report(report, run_dir)
    return report


def _field_metrics(ctx: _Ctx, contract: Contract, rollout: Mapping[str, Any],
                   cells: Mapping[str, Any], loaded: Mapping[str, _Outputs | str],
                   ) -> tuple[list[FieldMismatch], list[dict[str, Any]], str, bool, str,
                              list[str]]:
    """The HF reference's and each COMPLETE actor cell's round-1 logprobs vs the sampler's.

    Returns the field mismatch rows, the clip-band tail rows (:func:`clip_band_tail`, one
    per source, with the contract's ``clip_ratio``), the comparability note, whether it is
    like for like, the rollout's ``logprobs_mode`` and notes on skipped sources.
    """
    notes: list[str] = []
    try:
        meta = jsonio.read_json(ctx.ref_dir / ROLLOUT_META_FILE)
        mode = str(meta.get("logprobs_mode")) if isinstance(meta, dict) else "unknown"
    except (OSError, ValueError, EvidenceIntegrityError) as exc:
        mode = "unknown"
        notes.append(f"{ROLLOUT_META_FILE} unreadable: {exc}")
    s = contract.sampling
    try:
        like = is_like_for_like(mode, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
        note = comparability_note(mode, temperature=s.temperature, top_k=s.top_k,
                                  top_p=s.top_p)
    except ValueError:
        like = False
        note = (f"{ROLLOUT_META_FILE} has logprobs_mode = {mode!r}: it is unknown which "
                "distribution the behavior logprobs are of; the field metrics may not "
                "compare like with like.")
    behavior = rollout["behavior_logprobs"]
    sources: list[tuple[str, str, Any]] = []
    for prec in contract.matrix.precisions:
        hf = _hf(ctx, prec)
        if hf is not None and "round1/actor/logprobs" in hf:
            sources.append((f"hf-{prec}", prec, hf["round1/actor/logprobs"]))
    for cid, entry in cells.items():
        got = loaded.get(cid)
        if not isinstance(got, _Outputs) or entry.get("role") != "actor" or "resume_of" in entry:
            continue
        lp = got.tensors.get("round1/actor/logprobs")
        if lp is None:
            notes.append(f"{cid}: no round1/actor/logprobs; no field metrics")
            continue
        sources.append((cid, str(entry.get("precision", "")), lp))
    out: list[FieldMismatch] = []
    band: list[dict[str, Any]] = []
    for source, src_prec, lp in sources:
        try:
            out.append(field_mismatch(lp, behavior, ctx.mask, source=source, precision=src_prec,
                                      logprobs_mode=mode, like_for_like=like))
            band.append(clip_band_tail(lp, behavior, ctx.mask, source=source,
                                       precision=src_prec,
                                       clip_ratio=contract.algorithm.clip_ratio))
        except ValueError as exc:
            notes.append(f"field metrics skipped: {exc}")
    return out, band, note, like, mode, notes
