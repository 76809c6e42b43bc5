"""Every row builder, fed failing evidence, yields rows of a report that satisfies its schema.

The class of defect: a builder that builds a ``FAIL`` / ``ERROR`` / ``NOT_RUN`` row the
report schema refuses (a ``FAIL`` without ``detail``, a non-finite ``bound``, a round 0), or
that raises on a cell's data, made ``qualify compare`` exit 4 and write no report for the
whole run. Each property test below drives one builder with failing inputs drawn by
hypothesis (values far off, NaN, +-inf, missing tensors and keys, wrong shapes, extra
members, non-protocol names, JSON values of the wrong type, non-finite or missing sealed
bounds) and validates the **whole** ``report.json`` document the rows would be written in
(:func:`qualify.compare.report.report_document`: ``contracts/schema/report.schema.json``,
the cells, summary, root causes and power sections computed from those rows).

Builders and families covered (the ``ids`` of the parametrized tests):

- ``qualify.compare.rows.compare_rows`` with its failure detail (``_detail``) and the
  power check (``qualify.compare.power.power_of``), once per metric family of
  :data:`qualify.statistics.FAMILY_STATISTIC`: logprobs, entropy, values, rewards, losses,
  grad_norm, clip_coef, grads, exp_avg, exp_avg_sq, updates;
- ``qualify.compare.rows.padding_rows`` (padding invariance);
- ``qualify.compare.rows.dtype_row`` and ``replica_row`` (with ``declared_or``);
- ``qualify.compare.rows.lr_rows`` (lr schedule);
- ``qualify.compare.rows.not_run_rows`` / ``declared_not_run``;
- ``qualify.compare.resume.resume_rows``: state rows, lr rows, metric rows (bitwise on CPU,
  bounded elsewhere), the missing record and the missing uninterrupted cell;
- ``qualify.compare.sampler.sampler_rows``: install, kernels, prefix cache, rejection
  probes, sampler vs actor;
- ``qualify.compare.rows.guarded``: a builder that raises, or returns a row the schema
  refuses, becomes one ``ERROR`` row naming the cell and the builder; through
  ``compare_run`` every guarded builder of a trainer cell at once (``compare_rows`` of
  both classes, ``qualify.compare.reflip.with_branch_flips``, ``padding_rows``,
  ``dtype_row``, ``replica_row``, ``lr_rows``), the report still written and the other
  cell still compared;
- the cell records of ``compare_run``: a ``run.json`` reason of any JSON type.

And the case of the issue through the real compare path: a resumed round that applied
another lr than the uninterrupted cell gives a report with a ``FAIL`` row.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_compare
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file
from test_compare import TP1, TP2, World, actor, good_meta, make_contract

import qualify.compare.stage as stage_mod
from qualify.bounds import Bound
from qualify.cli.main import main
from qualify.compare.report import report_document
from qualify.compare.resume import resume_required, resume_rows
from qualify.compare.rows import (
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
from qualify.compare.sampler import PROBES, sampler_rows
from qualify.compare.verdicts import (
    VERDICT_PRECEDENCE,
    CellResult,
    Report,
    Row,
    cell_reason,
    worst_margin,
    worst_verdict,
)
from qualify.contract import Contract
from qualify.errors import ExitCode, ReferenceDataError
from qualify.evidence import store
from qualify.layout import REPORT_JSON
from qualify.statistics import FAMILY_STATISTIC, MetricKey, group_tensors

B, R = 3, 4
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=np.int64)
PARAMS = {"model.w": (4, 3), "model.b": (3,)}
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
ROLE_OF = {"logprobs": "actor", "entropy": "actor", "values": "critic", "rewards": "reward"}


@pytest.fixture(autouse=True)
def _writable(tmp_path: Path) -> Iterator[None]:
    yield
    store.make_writable(tmp_path)


# --------------------------------------------------------------------------- the document


def document(rows: Sequence[Row]) -> dict[str, Any]:
    """The validated ``report.json`` document of ``rows`` (one cell result per cell)."""
    cells = []
    for cid in dict.fromkeys(r.cell for r in rows):
        mine = [r for r in rows if r.cell == cid]
        verdict = worst_verdict([r.verdict for r in mine])
        cells.append(CellResult(
            cell=cid, engine="torch_tp", precision="fp32", options={}, role=mine[0].role,
            tp=1, status="COMPLETE", verdict=verdict, reason=cell_reason(verdict, mine),
            attempt=f"cells/{cid}/attempt-1", required=True,
            counts={v: sum(r.verdict == v for r in mine) for v in VERDICT_PRECEDENCE},
            worst_margin=worst_margin(mine)))
    report = Report(contract="tiny-qwen3", contract_digest="0" * 64, run_id="run-1",
                    run_dir="run", reference_dir="ref", reference_manifest_digest="1" * 64,
                    bounds_digest="2" * 64, lane="approximate", created="2025-01-01T00:00:00Z",
                    cells=tuple(cells), rows=tuple(rows), logprobs_mode="processed",
                    field_like_for_like=True, field_note="note", field_metrics=())
    doc = report_document(report)  # raises QualifyError on a schema violation
    json.dumps(doc, allow_nan=False)  # and it is writable JSON
    return doc


# --------------------------------------------------------------------------- strategies

JSON_SCALARS = (st.none() | st.booleans() | st.integers(-(10**30), 10**30)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=4))
JSON_VALUES = st.recursive(
    JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
"""Any JSON-like value (a field of the wrong type, a missing one, a number off the scale)."""
BAD_NUMBERS = st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -1e300, 0.0, -1.0,
                               1e-300, 3.0e-4])
TENSOR_OPS = ("far", "nan", "inf", "neg_inf", "drop", "flatten_plus_one", "add_axis",
              "empty", "extra_member", "round0", "round01")
BOUND_OPS = ("keep", "drop", "inf", "nan", "zero", "wrong_statistic")


def corrupt(tensors: dict[str, Any], op: str, index: int) -> dict[str, Any]:
    """``tensors`` with one of them (``index`` modulo their number) damaged by ``op``."""
    out = dict(tensors)
    if not out:
        return out
    name = sorted(out)[index % len(out)]
    x = np.asarray(out[name], dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        if op == "far":
            out[name] = (x * 1e6 + 1e3).astype(np.float32)
        elif op in ("nan", "inf", "neg_inf"):
            out[name] = np.full_like(x, {"nan": np.nan, "inf": np.inf,
                                         "neg_inf": -np.inf}[op])
        elif op == "drop":
            del out[name]
        elif op == "flatten_plus_one":
            out[name] = np.append(x.reshape(-1), np.float32(1.0))
        elif op == "add_axis":
            out[name] = x[None]
        elif op == "empty":
            out[name] = np.zeros((0,), dtype=np.float32)
        elif op == "extra_member":
            out[f"{name}/extra.member"] = x.copy()
        elif op in ("round0", "round01"):
            del out[name]
            out[name.replace(name.split("/")[0], "round0" if op == "round0" else "round01",
                             1)] = x
    return out


def corrupt_bounds(bounds: list[Bound], op: str, index: int) -> list[Bound]:
    """``bounds`` with one of them (``index`` modulo their number) damaged by ``op``."""
    if not bounds or op == "keep":
        return bounds
    i = index % len(bounds)
    out = list(bounds)
    b = out[i]
    if op == "drop":
        del out[i]
        return out
    out[i] = dataclasses.replace(
        b, bound={"inf": math.inf, "nan": math.nan, "zero": 0.0}.get(op, b.bound),
        statistic="max_rel_l2" if op == "wrong_statistic" and b.statistic != "max_rel_l2"
        else ("abs" if op == "wrong_statistic" else b.statistic))
    return out


def family_tensors(family: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Rounds 1 and 2 of one family, shaped as the protocol writes them."""
    out: dict[str, np.ndarray] = {}
    for r in (1, 2):
        if family in ROLE_OF:
            shape = (B,) if family == "rewards" else (B, R)
            x = rng.normal(size=shape) * (MASK if shape == (B, R) else 1)
            out[f"round{r}/{ROLE_OF[family]}/{family}"] = x.astype(np.float32)
        elif family == "losses":
            for term in ("policy", "kl", "entropy", "total"):
                out[f"round{r}/actor/loss/{term}"] = np.array(rng.normal(), dtype=np.float32)
        elif FAMILY_STATISTIC[family] == "abs":
            out[f"round{r}/actor/{family}"] = np.array(rng.uniform(0.5, 2), dtype=np.float32)
        else:
            for p, p_shape in PARAMS.items():
                out[f"round{r}/actor/{family}/{p}"] = rng.normal(size=p_shape).astype(
                    np.float32)
    return out


def bounds_of(tensors: Mapping[str, Any], klass: str = "candidate_vs_hf",
              precision: str = "fp32", bound: float = 1e-3) -> list[Bound]:
    return [Bound(precision=precision, klass=klass, key=k, statistic=FAMILY_STATISTIC[k.family],
                  control_error=0.0, control="hand-made", floor=bound, k=4.0, bound=bound)
            for k in group_tensors(tensors) if not k.variant]


def assert_fail_rows_explained(rows: Sequence[Row]) -> None:
    for r in rows:
        if r.verdict != "PASS":
            assert r.reason, r
        if r.verdict == "FAIL":
            assert r.detail is not None, r


# --------------------------------------------------------------------------- metric families


@pytest.mark.parametrize("family", sorted(FAMILY_STATISTIC))
@SETTINGS
@given(ops=st.lists(st.tuples(st.sampled_from(TENSOR_OPS), st.integers(0, 20),
                              st.booleans()), min_size=1, max_size=3),
       bound_op=st.tuples(st.sampled_from(BOUND_OPS), st.integers(0, 20)),
       seed=st.integers(0, 3))
def test_compare_rows_of_every_family(family: str, ops: list[tuple[str, int, bool]],
                                      bound_op: tuple[str, int], seed: int) -> None:
    """compare_rows (with _detail and power_of) on a failing candidate of one family."""
    expected = family_tensors(family, np.random.default_rng(seed))
    bounds = corrupt_bounds(bounds_of(expected), *bound_op)
    obtained = {k: v.copy() for k, v in expected.items()}
    only_obtained = True
    for op, index, on_expected in ops:
        if on_expected:
            expected = corrupt(expected, op, index)
            only_obtained = False
        else:
            obtained = corrupt(obtained, op, index)
    rows = compare_rows(cell="torch_tp-fp32-actor-tp1", klass="candidate_vs_hf",
                        precision="fp32", bounds=bounds, obtained=obtained, expected=expected,
                        mask=MASK, power_cache={})
    if rows:
        document(rows)
    assert_fail_rows_explained(rows)
    # every op damages a compared metric, but a scalar with a unit axis is the same number
    same = family == "losses" or FAMILY_STATISTIC[family] == "abs"
    if only_obtained and bound_op[0] == "keep" and not (same and {o for o, _, _ in ops}
                                                         == {"add_axis"}):
        assert any(r.verdict == "FAIL" for r in rows)
    for r in rows:
        if r.bound is not None and r.verdict in ("PASS", "FAIL") and r.family in ROLE_OF:
            assert r.power is not None  # the power check ran on the rows with a bound
        if r.bound is not None:
            assert math.isfinite(r.bound)
            assert r.bound >= 0


# --------------------------------------------------------------------------- padding, checks


@SETTINGS
@given(ops=st.lists(st.tuples(st.sampled_from(TENSOR_OPS), st.integers(0, 20)), max_size=3),
       bound_op=st.tuples(st.sampled_from(BOUND_OPS), st.integers(0, 20)),
       role=st.sampled_from(["actor", "critic"]))
def test_padding_rows(ops: list[tuple[str, int]], bound_op: tuple[str, int], role: str) -> None:
    """padding_rows on damaged ``*_padded`` reruns (or none) of the role's main family."""
    main_family = "logprobs" if role == "actor" else "values"
    rng = np.random.default_rng(0)
    base = (rng.normal(size=(B, R)) * MASK).astype(np.float32)
    padded = {f"round1/{role}/{main_family}_padded": base.copy()}
    for op, index in ops:
        padded = corrupt(padded, op, index)
    outputs = {f"round1/{role}/{main_family}": base, **padded}
    bounds = corrupt_bounds(bounds_of({f"round1/{role}/{main_family}": base}, "tp_vs_tp1"),
                            *bound_op)
    rows = padding_rows(cell=f"torch_tp-fp32-{role}-tp1", role=role, precision="fp32",
                        bounds=bounds, outputs=outputs, mask=MASK)
    rows = [declared_or(r, {"not_run": [{"round": None, "family": "padding",
                                         "reason": "declared"}]} if role == "critic" else None,
                        "padding") for r in rows]
    document(rows)
    assert_fail_rows_explained(rows)
    if ops and role == "actor":
        assert any(r.verdict != "PASS" for r in rows)


META_FIELDS = ("dtypes", "replica_consistency", "lr", "not_run")


@SETTINGS
@given(fields=st.dictionaries(st.sampled_from(META_FIELDS), JSON_VALUES),
       lr=st.dictionaries(st.sampled_from(["round1", "round2", "round0", "x"]),
                          JSON_SCALARS | BAD_NUMBERS, max_size=3),
       sealed=st.none() | st.dictionaries(
           st.sampled_from(["round1", "round2", "round0", "round²", "roundx"]),
           JSON_SCALARS | BAD_NUMBERS, max_size=3),
       meta_missing=st.booleans())
def test_dtype_replica_lr_and_declared_rows(fields: dict[str, Any], lr: dict[str, Any],
                                            sealed: dict[str, Any] | None,
                                            meta_missing: bool) -> None:
    """dtype_row, replica_row, lr_rows, declared_or, not_run_rows on any outputs.json."""
    meta: dict[str, Any] | None = None if meta_missing else {**fields, "lr": lr}
    cell, role = "torch_tp-bf16-actor-tp2", "actor"
    why = "outputs.json missing"
    rows = [declared_or(dtype_row(cell, role, meta, why), meta, "dtypes"),
            declared_or(replica_row(cell, role, meta, why), meta, "replica")]
    rows += lr_rows(cell, role, meta, why, sealed)
    reason = declared_not_run(meta, 1, "grads")
    rows += not_run_rows(cell, "candidate_vs_hf", "candidate_vs_hf",
                         [MetricKey(round=1, role=role, family="grads")],
                         reason or "declared not run by the harness")
    document(rows)
    assert_fail_rows_explained(rows)
    if meta is None:
        assert rows[0].verdict == "FAIL"


# --------------------------------------------------------------------------- resume


REC = {"step": {"min": 1.0, "max": 1.0}, "lr": [1.65e-4], "scheduler_last_epoch": 1,
       "master_weights": "a" * 64, "exp_avg": "b" * 64, "exp_avg_sq": "c" * 64,
       "rng_state": "d" * 64}


class _Out:
    """A loaded cell as the comparator holds it."""

    def __init__(self, tensors: Mapping[str, Any], meta: Any, problem: str = "") -> None:
        self.tensors, self.meta, self.meta_problem = dict(tensors), meta, problem


@SETTINGS
@given(record=st.one_of(st.none(), JSON_VALUES, st.fixed_dictionaries(
           {"saved": st.just(REC) | JSON_VALUES, "loaded": st.just(REC) | JSON_VALUES})),
       lr_mine=JSON_SCALARS | BAD_NUMBERS, lr_base=JSON_SCALARS | BAD_NUMBERS,
       ops=st.lists(st.tuples(st.sampled_from(TENSOR_OPS), st.integers(0, 20)), max_size=2),
       device=st.sampled_from(["cpu", "cuda"]),
       bound_op=st.tuples(st.sampled_from(BOUND_OPS), st.integers(0, 20)),
       base_missing=st.booleans())
def test_resume_rows(record: Any, lr_mine: Any, lr_base: Any, ops: list[tuple[str, int]],
                     device: str, bound_op: tuple[str, int], base_missing: bool) -> None:
    """resume_rows: state, lr and metric rows of a resume that lost what it carries."""
    rng = np.random.default_rng(1)
    base_t = {**family_tensors("logprobs", rng), **family_tensors("grad_norm", rng),
              **family_tensors("updates", rng)}
    mine = {k: v.copy() for k, v in base_t.items() if k.startswith("round2/")}
    for op, index in ops:
        mine = corrupt(mine, op, index)
    meta = {"device": device, "lr": {"round2": lr_mine}, "resume": record}
    base_meta = {"device": "cpu", "lr": {"round1": 3e-4, "round2": lr_base}}
    bounds = corrupt_bounds(bounds_of({k: v for k, v in base_t.items()
                                       if k.startswith("round2/")}, "tp_vs_tp1"), *bound_op)
    cell = "torch_tp-fp32-actor-tp1-resume"
    rows = resume_rows(
        cell=cell, entry={"role": "actor", "after_round": 1,
                          "resume_of": "torch_tp-fp32-actor-tp1"},
        outputs=_Out(mine, meta), loaded={"torch_tp-fp32-actor-tp1": "not COMPLETE"}
        if base_missing else {"torch_tp-fp32-actor-tp1": _Out(base_t, base_meta)},
        bounds=bounds, mask=MASK, lane="fp32")
    document(rows)
    assert_fail_rows_explained(rows)
    assert not any("could not build" in (r.reason or "") for r in rows), rows
    if record != {"saved": REC, "loaded": REC}:
        assert any(r.verdict == "FAIL" and r.round is None for r in rows)
    if not base_missing and lr_mine != lr_base:
        lr_row = next(r for r in rows if r.family == "lr" and r.round == 2)
        assert lr_row.verdict == "FAIL"


# --------------------------------------------------------------------------- sampler


def _good_sampler_meta(tp: int) -> dict[str, Any]:
    return {
        "install": {"accepted": True, "acks": [{"rank": r, "version": 1, "digest": f"d{r}"}
                                               for r in range(tp)],
                    "expected_digest": [f"d{r}" for r in range(tp)], "tensors_verified": 9},
        "final": {"verified": True, "version": 1},
        "kernel_probe": {"stale": [], "layers_probed": 5, "worst_err_new": 0.0},
        "cache_proof": {"cached_tokens_first_after_update": 0,
                        "cached_tokens_same_version_replay": 8},
        "probes": [{"name": n, "rejected": True, "stayed": True, "reason": "refused",
                    "version_before": 1, "version_after": 1} for n in PROBES]}


SAMPLER_FIELDS = ("install", "final", "kernel_probe", "cache_proof", "probes")


@SETTINGS
@given(edits=st.dictionaries(st.sampled_from(SAMPLER_FIELDS), JSON_VALUES, max_size=3),
       ack_edit=st.none() | st.tuples(st.sampled_from(["rank", "version", "digest"]),
                                      JSON_SCALARS),
       ops=st.lists(st.tuples(st.sampled_from(TENSOR_OPS), st.integers(0, 20)), max_size=2),
       bound=st.sampled_from([1e-3, 0.0, 1e3, math.inf, math.nan, None]),
       actor_missing=st.booleans(), meta_missing=st.booleans())
def test_sampler_rows(edits: dict[str, Any], ack_edit: tuple[str, Any] | None,
                      ops: list[tuple[str, int]], bound: float | None, actor_missing: bool,
                      meta_missing: bool) -> None:
    """sampler_rows: install, kernels, prefix cache, probes and round 2 on damaged evidence."""
    tp = 2
    meta: dict[str, Any] | None = None if meta_missing else {**_good_sampler_meta(tp), **edits}
    if meta is not None and ack_edit is not None and isinstance(meta["install"], dict) \
            and "acks" in meta["install"]:
        meta["install"] = copy.deepcopy(meta["install"])
        meta["install"]["acks"][0][ack_edit[0]] = ack_edit[1]
    lp = (np.random.default_rng(2).normal(size=(B, R)) * MASK).astype(np.float32)
    mine = {"round2/sampler/logprobs": lp.copy()}
    for op, index in ops:
        mine = corrupt(mine, op, index)
    key = MetricKey(round=2, role="actor", family="logprobs")
    bounds = [] if bound is None else [Bound(
        precision="fp32", klass="candidate_vs_hf", key=key, statistic="max_abs",
        control_error=0.0, control="hand-made", floor=0.0, k=4.0, bound=bound)]
    rows = sampler_rows(cell="vllm-fp32-sampler-tp2", entry={"tp": tp,
                                                           "weights_from": TP1},
                        tensors=mine, meta=meta, meta_problem="outputs.json missing",
                        actor="not COMPLETE" if actor_missing else {key.label: lp},
                        bounds=bounds, mask=MASK)
    document(rows)
    assert_fail_rows_explained(rows)
    assert not any("could not build" in (r.reason or "") for r in rows), rows
    if meta_missing or edits or ack_edit is not None:
        assert any(r.verdict != "PASS" for r in rows)


# --------------------------------------------------------------------------- the guard


def _boom() -> list[Row]:
    raise ValueError("could not convert string to float: 'x'\nsecond line")


def _schema_invalid_fail() -> list[Row]:
    return [Row(cell="c", klass="resume", bound_class=None, round=2, role="actor",
                family="lr", statistic="bitwise", error=1.0, bound=0.0, margin=math.inf,
                verdict="FAIL", reason="resume lr: round 2 differs", where="round2")]


@pytest.mark.parametrize("build", [_boom, _schema_invalid_fail], ids=["raises", "invalid-row"])
def test_guard_turns_what_a_builder_cannot_build_into_an_error_row(
        build: Callable[[], list[Row]]) -> None:
    rows = guarded(build, cell="c", builder="qualify.compare.x.some_rows", klass="resume",
                   role="actor", family="lr")
    assert [r.verdict for r in rows] == ["ERROR"]
    reason = str(rows[0].reason)
    assert "cell c" in reason
    assert "qualify.compare.x.some_rows" in reason
    assert "\n" not in reason
    document(rows)


def test_guard_keeps_integrity_errors() -> None:
    from qualify.errors import EvidenceIntegrityError

    def build() -> list[Row]:
        raise EvidenceIntegrityError("edited")

    with pytest.raises(EvidenceIntegrityError):
        guarded(build, cell="c", builder="b", klass="resume", role="actor", family="lr")


def test_guard_keeps_the_rows_a_reviser_was_given() -> None:
    kept = [Row(
        cell="c", klass="candidate_vs_hf", bound_class="candidate_vs_hf", round=2,
        role="actor", family="grads", statistic="max_rel_l2", error=0.0, bound=1e-3,
        margin=0.0, verdict="PASS", reason=None, where="model.w")]
    rows = guarded(_boom, cell="c", builder="qualify.compare.reflip.with_branch_flips",
                   klass="candidate_vs_hf", role="actor", family="grads", keep=kept)
    assert rows[:-1] == kept
    assert rows[-1].verdict == "ERROR"
    assert "with_branch_flips" in str(rows[-1].reason)


BROKEN = {  # stage name -> (the builder named in the ERROR row, the class it breaks in)
    "compare_rows": ("qualify.compare.rows.compare_rows", "candidate_vs_hf"),
    "with_branch_flips": ("qualify.compare.reflip.with_branch_flips", "tp_vs_tp1"),
    "padding_rows": ("qualify.compare.rows.padding_rows", None),
    "dtype_row": ("qualify.compare.rows.dtype_row", None),
    "replica_row": ("qualify.compare.rows.replica_row", None),
    "lr_rows": ("qualify.compare.rows.lr_rows", None),
}


def test_a_raising_builder_is_an_error_row_and_the_run_is_still_compared(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every guarded builder of a trainer cell raising on that cell (TP2): one ERROR row
    each, naming the cell and the builder; report.json written; the rows that reflip was
    to revise kept; the other cell (TP1) compared as usual."""
    w = World(tmp_path, required=[TP1, TP2])
    w.add_cell(TP1, outputs=actor(w))
    w.add_cell(TP2, outputs=actor(w))
    for name, (_, klass) in BROKEN.items():
        real = getattr(stage_mod, name)

        def broken(*a: Any, _real: Any = real, _name: str = name, _klass: str | None = klass,
                   **kw: Any) -> Any:
            cell = kw.get("cell", a[0] if a and isinstance(a[0], str) else None)
            if cell == TP2 and _klass in (None, kw.get("klass")):
                raise KeyError(f"{_name} met something odd")
            return _real(*a, **kw)

        monkeypatch.setattr(stage_mod, name, broken)
    report = w.compare()
    doc = json.loads((w.run_dir / REPORT_JSON).read_text())
    errors = [r for r in doc["rows"] if r["cell"] == TP2 and r["verdict"] == "ERROR"]
    assert sorted(b for b, _ in BROKEN.values() for r in errors if b in r["reason"]) \
        == sorted(b for b, _ in BROKEN.values())
    assert all(r["reason"].startswith(f"cell {TP2}: ") and "KeyError" in r["reason"]
               for r in errors)
    kept = [r for r in doc["rows"] if r["cell"] == TP2 and r["class"] == "tp_vs_tp1"
            and r["verdict"] == "PASS"]
    assert kept  # compared before reflip raised, kept
    assert report.verdicts == {TP1: "PASS", TP2: "ERROR"}
    assert all(r["verdict"] == "PASS" for r in doc["rows"] if r["cell"] == TP1)


@pytest.mark.parametrize("reason", ["", None], ids=["empty", "null"])
def test_a_cell_reason_of_any_json_type_gives_a_valid_report(tmp_path: Path,
                                                            reason: Any) -> None:
    """run.json cells that did not complete, with an empty or null reason."""
    w = World(tmp_path, required=[TP1, TP2])
    w.add_cell(TP1, status="NOT_RUN", reason=reason)
    w.add_cell(TP2, status="ERROR", reason=reason)
    report = w.compare()
    doc = json.loads((w.run_dir / REPORT_JSON).read_text())
    assert [c["verdict"] for c in doc["cells"]][:2] == ["NOT_RUN", "ERROR"]
    assert all(isinstance(c["reason"], str) and c["reason"] for c in doc["cells"])
    assert not report.passed


@pytest.mark.parametrize("reason", [5, ["a", 1], {"why": None}], ids=["int", "list", "object"])
def test_a_cell_reason_of_another_json_type_is_refused_with_one_line(tmp_path: Path,
                                                                     reason: Any) -> None:
    """run.json is validated against its schema before anything is compared."""
    w = World(tmp_path, required=[TP1, TP2])
    w.add_cell(TP1, status="NOT_RUN", reason=reason)
    w.add_cell(TP2, status="ERROR", reason=reason)
    with pytest.raises(ReferenceDataError, match=r"run\.json: cells\..*\.reason: ") as info:
        w.compare()
    assert "\n" not in str(info.value)
    assert not (w.run_dir / REPORT_JSON).exists()


# --------------------------------------------------------------------------- resume lr, end to end


def _add_resume_cell(w: World, base: str, lr: float) -> str:
    """A COMPLETE resume cell of ``base`` (after round 1) whose round 2 applied ``lr``."""
    cid = f"{base}-resume"
    attempt = f"cells/{cid}/attempt-1"
    adir = w.run_dir / attempt
    (adir / "logs").mkdir(parents=True)
    (adir / "logs" / "rank0.log").write_text("log\n")
    outs = {k: v for k, v in actor(w).items() if k.startswith("round2/")
            and not k.endswith("_padded")}
    save_file(outs, str(adir / "outputs.safetensors"))
    (adir / "outputs.json").write_text(json.dumps({
        "device": "cpu", "lr": {"round2": lr},
        "resume": {"after_round": 1, "format": "dcp", "saved": REC,
                   "loaded": copy.deepcopy(REC)}}))
    store.seal(adir, kind="cell-attempt")
    w.cells[cid] = {"engine": "torch_tp", "precision": "fp32", "options": {}, "role": "actor",
                    "tp": 1, "status": "COMPLETE", "reason": None, "attempt": attempt,
                    "resume_of": base, "after_round": 1}
    return cid


def _with_resume(required: list[str] | None = None) -> Contract:
    """The compare tests' contract with a ``[resume]`` section (resume cells required)."""
    doc = make_contract(required).to_dict()
    doc["resume"] = {"after_round": 1}
    return Contract.from_dict(doc)


def test_a_resumed_round_with_another_lr_gives_a_report_with_a_fail_row(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case through ``qualify compare``: exit 1 (not 4), report.json written."""
    monkeypatch.setattr(test_compare, "make_contract", _with_resume)
    w = World(tmp_path, required=[TP1])
    assert resume_required(w.contract) == (f"{TP1}-resume",)
    meta = {**good_meta(), "device": "cpu", "lr": {"round1": 3.0e-4, "round2": 1.65e-4}}
    w.add_cell(TP1, outputs=actor(w), meta=meta)
    cid = _add_resume_cell(w, TP1, lr=3.0e-4)  # the resumed step restarted the schedule
    w.write_run()
    code = main(["compare", str(w.run_dir), "--no-seal"])
    capsys.readouterr()
    assert code == ExitCode.QUALIFICATION_FAILED
    doc = json.loads((w.run_dir / REPORT_JSON).read_text())
    lr = [r for r in doc["rows"] if r["cell"] == cid and r["family"] == "lr"
          and r["round"] is not None]  # (the state row "lr" is the restored scheduler lr)
    assert [(r["round"], r["verdict"]) for r in lr] == [(2, "FAIL")]
    row = lr[0]
    assert row["reason"] == ("resume lr: round 2 applied 0.0003, the uninterrupted cell "
                             "0.000165")
    assert row["detail"]["table"] == [["round2", 3.0e-4, 1.65e-4, pytest.approx(1.35e-4)]]
    assert row["error"] == pytest.approx(1.35e-4)
    others = [r for r in doc["rows"] if r["cell"] == cid and r not in lr]
    assert others
    assert all(r["verdict"] == "PASS" for r in others)
    assert {c["cell"]: c["verdict"] for c in doc["cells"]} == {TP1: "PASS", cid: "FAIL"}
