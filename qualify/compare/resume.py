"""Rows of a resume cell (issue #18): the resumed rounds against the uninterrupted cell's.

A resume cell ``C-resume`` (:mod:`qualify.candidate.resume_stage`) ran rounds ``1..k``,
checkpointed in its engine's own format, and a fresh launch restored it and ran rounds
``k + 1..rounds``. Its rows, class ``resume``:

- **state rows** (``round`` empty, one per quantity a resume must carry over): the state
  record the load launch measured right after the restore against the one the save launch
  measured right before the checkpoint (``outputs.json`` ``resume``,
  :mod:`harnesses.resume_state`): ``step`` (AdamW's step counter of every parameter, which
  must also be ``k`` itself), ``lr`` (the lr the next step applies), ``scheduler`` (its
  ``last_epoch``, also ``k``), ``master_weights``, ``exp_avg`` and ``exp_avg_sq`` (sha256 of the
  full FP32 tensors) and ``rng_state`` (sha256 of the RNG states). Equality is exact on
  every device: a checkpoint round trip copies bytes. A dropped optimizer state fails
  ``exp_avg``; a reset step counter fails ``step``. What each row proves depends on who
  carries the quantity: ``step``, ``master_weights`` and the moments go through the engine's
  own checkpoint (DCP, DeepSpeed's ``save_checkpoint``, ...), so their rows test the engine's
  save and restore; ``rng_state`` (every engine) and a scheduler the engine's checkpoint does
  not hold (torch_tp's) are carried beside it by the harness (``harnesses/resume_state.py``
  ``trainer_state.pt``), so their rows test that round trip only, as a training framework's
  own RNG save would be; the resumed rounds' metric rows below test the whole;
- **lr rows** per resumed round: the lr that round's step applied (``outputs.json`` ``lr``)
  against the uninterrupted cell's for the same round, exactly; a ``FAIL`` shows both and
  their difference (``round``, ``obtained``, ``expected``, ``abs diff``; a missing or
  non-numeric lr is ``inf``);
- **metric rows** per resumed round and family (logprobs, losses, grads, grad norm, clip
  coefficient, Adam moments, updates): against the uninterrupted cell ``C``'s same round.
  **Bitwise** when both ran on CPU (the deterministic lane: the same engine code on the
  same inputs, one thread per rank, must reproduce every bit); elsewhere **bounded** by
  the family's sealed ``tp_vs_tp1`` bound of the cell's lane (the same-precision repeat
  controls), as two executions of one computation on a device without a determinism
  guarantee. Round ``k + 1``'s logprobs are those of the restored weights; round
  ``k + 2``'s, where the contract runs it, the next logprobs after the resumed update.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from qualify.bounds import Bound, judge, lookup
from qualify.compare.rows import DETAIL_ROWS, guarded, metric_detail
from qualify.compare.verdicts import FailureDetail, Row
from qualify.contract import Contract
from qualify.protocol import parse_tensor_name
from qualify.statistics import FAMILY_STATISTIC, MetricKey, group_tensors, measure

__all__ = ["KLASS", "STATE_QUANTITIES", "resume_required", "resume_rows"]

KLASS: Final = "resume"
STATE_QUANTITIES: Final = ("step", "lr", "scheduler", "master_weights", "exp_avg",
                           "exp_avg_sq", "rng_state")
"""The state rows' families, in causal order of a restore."""
_RECORD_KEY: Final = {"scheduler": "scheduler_last_epoch"}


def resume_required(contract: Contract) -> tuple[str, ...]:
    """The resume cell ids the report requires (none without ``[resume]``, or not required).

    Only the resume cells of required trainer cells (``matrix.required_cells`` when the
    contract names them): a cell the report does not require cannot make its resume cell so.
    """
    spec = contract.resume
    if spec is None or not spec.required:
        return ()
    cells = contract.matrix.cells()
    wanted = contract.matrix.required_cells
    if wanted is not None:
        cells = [c for c in cells if c.cell_id in set(wanted)]
    return tuple(spec.cell_ids(cells))


def _row(cell: str, role: str, family: str, *, round_: int | None, statistic: str,
         error: float | None, bound: float | None, verdict: str, reason: str | None,
         where: str = "", detail: FailureDetail | None = None) -> Row:
    margin = None if error is None or bound is None else judge(error, bound)[1]
    return Row(cell=cell, klass=KLASS, bound_class=None if statistic == "bitwise" else
               "tp_vs_tp1", round=round_, role=role, family=family, statistic=statistic,
               error=error, bound=bound, margin=margin, verdict=verdict,  # type: ignore[arg-type]
               reason=reason, where=where, detail=detail)


def _state_rows(cell: str, role: str, record: Mapping[str, Any], k: int) -> list[Row]:
    """One exact row per :data:`STATE_QUANTITIES`: loaded against saved (and ``k``)."""
    saved, loaded = (x if isinstance(x := record.get(k), Mapping) else {}
                     for k in ("saved", "loaded"))
    out = []
    for q in STATE_QUANTITIES:
        key = _RECORD_KEY.get(q, q)
        got, want = loaded.get(key), saved.get(key)
        problems: list[tuple[str, str, str]] = []
        if got != want:
            problems.append((f"{q} after the restore", str(got), f"{want} (saved)"))
        if q == "step" and want != {"min": float(k), "max": float(k)}:
            problems.append((f"{q} saved after round {k}", str(want), f"{float(k)} for every "
                             "parameter"))
        if q == "scheduler" and want != k:
            problems.append((f"{q} last_epoch saved after round {k}", str(want), str(k)))
        if q != "scheduler" and want is None:
            problems.append((f"{q} saved", "none", "a value (the engine held no state)"))
        if not problems:
            out.append(_row(cell, role, q, round_=None, statistic="bitwise", error=0.0,
                            bound=0.0, verdict="PASS", reason=None))
            continue
        item, obtained, expected = problems[0]
        out.append(_row(cell, role, q, round_=None, statistic="bitwise", error=math.inf,
                        bound=0.0, verdict="FAIL", where=item,
                        reason=f"resume {q}: {item} is {obtained}, expected {expected}",
                        detail=FailureDetail(mismatched=len(problems), total=len(problems),
                                             max_abs=None, max_rel=None,
                                             columns=("item", "obtained", "expected"),
                                             table=tuple(problems[:DETAIL_ROWS]))))
    return out


def _lr_value(lr: Mapping[str, Any], r: int) -> tuple[float | None, str]:
    """``lr["round<r>"]`` as a float (``None`` when absent or no number) and as shown."""
    x = lr.get(f"round{r}")
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None, "none" if x is None else f"{x!r} (not a number)"
    return float(x), repr(float(x))


def _lr_rows(cell: str, role: str, meta: Mapping[str, Any], base_meta: Mapping[str, Any],
             rounds: Sequence[int]) -> list[Row]:
    """The lr each resumed round applied against the uninterrupted cell's, exactly."""
    got, want = (x if isinstance(x := m.get("lr"), Mapping) else {} for m in (meta, base_meta))
    out = []
    for r in rounds:
        (a, shown_a), (b, shown_b) = _lr_value(got, r), _lr_value(want, r)
        if a is not None and b is not None and a == b:
            out.append(_row(cell, role, "lr", round_=r, statistic="bitwise", error=0.0,
                            bound=0.0, verdict="PASS", reason=None))
            continue
        err = abs(a - b) if a is not None and b is not None else math.inf
        err = err if math.isfinite(err) else math.inf
        out.append(_row(cell, role, "lr", round_=r, statistic="bitwise", error=err, bound=0.0,
                        verdict="FAIL", where=f"round{r}",
                        reason=f"resume lr: round {r} applied {shown_a}, the uninterrupted "
                               f"cell {shown_b}",
                        detail=FailureDetail(
                            mismatched=1, total=1, max_abs=err,
                            max_rel=err / abs(b) if b else math.inf,
                            columns=("round", "obtained", "expected", "abs diff"),
                            table=((f"round{r}", a if a is not None else shown_a,
                                    b if b is not None else shown_b, err),))))
    return out


def _bitwise(obtained: Mapping[str, Any], expected: Mapping[str, Any]) -> bool:
    if set(obtained) != set(expected):
        return False
    for name, b in expected.items():
        x, y = np.asarray(obtained[name]), np.asarray(b)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return False
    return True


def _metric_rows(cell: str, *, lane: str, bounds: Sequence[Bound], mask: npt.NDArray[Any],
                 obtained: Mapping[str, Any], expected: Mapping[str, Any],
                 deterministic: bool) -> list[Row]:
    """Every metric of ``expected`` (the uninterrupted resumed rounds) in ``obtained``."""
    got, want = group_tensors(obtained), group_tensors(expected)
    out = []
    for key in sorted(want, key=lambda x: x.label):
        mine = got.get(key, {})
        m = measure(key, mine, want[key], mask)
        stat = FAMILY_STATISTIC[key.family]
        if deterministic:
            same = _bitwise(mine, want[key])
            out.append(_row(
                cell, key.role, key.family, round_=key.round, statistic="bitwise",
                error=m.value, bound=0.0, verdict="PASS" if same else "FAIL",
                where="" if same else m.where,
                reason=None if same else (
                    f"resume {key.label}: not bitwise equal to the uninterrupted cell "
                    f"({stat} = {m.value:.6g} at {m.where}; the CPU lane is deterministic)"),
                detail=None if same else metric_detail(key, m, mine, want[key], mask)))
            continue
        b = lookup(list(bounds), precision=lane, klass="tp_vs_tp1",
                   key=MetricKey(round=key.round, role=key.role, family=key.family))
        if b is None or not math.isfinite(b.bound) or b.bound < 0:
            what = "no sealed tp_vs_tp1 bound" if b is None else \
                f"the sealed tp_vs_tp1 bound {b.bound!r} is not a finite number >= 0"
            out.append(_row(cell, key.role, key.family, round_=key.round, statistic=stat,
                            error=m.value, bound=None, verdict="ERROR",
                            reason=f"{what} for {key.label} ({lane})"))
            continue
        verdict, _ = judge(m.value, b.bound)
        out.append(_row(
            cell, key.role, key.family, round_=key.round, statistic=stat, error=m.value,
            bound=b.bound, verdict=verdict, where=m.where,
            reason=None if verdict == "PASS" else (
                f"resume {key.label}: {stat} = {m.value:.6g} > bound {b.bound:.6g} at "
                f"{m.where}"),
            detail=None if verdict == "PASS" else metric_detail(key, m, mine, want[key], mask)))
    return out


def resume_rows(*, cell: str, entry: Mapping[str, Any], outputs: Any,
                loaded: Mapping[str, Any], bounds: Sequence[Bound], mask: npt.NDArray[Any],
                lane: str) -> list[Row]:
    """The rows of one COMPLETE resume cell.

    Args:
        cell: the resume cell id.
        entry: its ``run.json`` entry (``role``, ``resume_of``, ``after_round``).
        outputs: its loaded outputs (``tensors``: rounds ``k + 1..rounds`` of its role;
            ``meta``: its ``outputs.json``, ``None`` when unreadable, ``meta_problem`` why).
        loaded: every COMPLETE cell's loaded outputs by id, or why they could not be
            loaded; the uninterrupted cell ``entry["resume_of"]`` is taken from it.
        bounds: the sealed bounds (the non-deterministic lane's).
        mask: ``[B, R]`` response mask.
        lane: the cell's reference lane (:mod:`qualify.lanes`).

    Returns:
        State rows, lr rows, metric rows (every ``FAIL`` with its detail table); a
        ``NOT_RUN`` row when the uninterrupted cell did not complete, a ``FAIL`` row when
        the resume record is missing; one ``ERROR`` row for a group the cell's data does
        not let be built (:func:`qualify.compare.rows.guarded`).

    Raises:
        KeyError, ValueError: ``entry`` lacks ``role``, ``after_round`` or ``resume_of``
            (the stage's guard makes that an ``ERROR`` row).
    """
    role, k = str(entry["role"]), int(entry["after_round"])
    tensors, meta, meta_problem = outputs.tensors, outputs.meta, outputs.meta_problem
    src = loaded.get(str(entry["resume_of"]), "not COMPLETE in run.json")
    base = src if isinstance(src, str) else (src.tensors, src.meta)
    mine = {n: v for n, v in tensors.items() if n.split("/")[1:2] == [role]}
    record = (meta or {}).get("resume")
    rows: list[Row] = []
    here = "qualify.compare.resume."
    if not isinstance(record, Mapping):
        why = meta_problem or "outputs.json has no resume record (the load launch's state)"
        rows.append(_row(cell, role, "state", round_=None, statistic="bitwise",
                         error=math.inf, bound=0.0, verdict="FAIL", reason=f"resume: {why}",
                         where="resume",
                         detail=FailureDetail(mismatched=1, total=1, max_abs=None,
                                              max_rel=None,
                                              columns=("item", "obtained", "expected"),
                                              table=(("resume", "absent" if record is None
                                                      else type(record).__name__,
                                                      "the load launch's state record"),))))
    else:
        rows += guarded(lambda: _state_rows(cell, role, record, k), cell=cell, role=role,
                        builder=f"{here}_state_rows", klass=KLASS, family="state")
    if isinstance(base, str):
        rows.append(_row(cell, role, "all", round_=None, statistic="bitwise", error=None,
                         bound=None, verdict="NOT_RUN",
                         reason=f"uninterrupted cell {entry.get('resume_of')}: {base}"))
        return rows
    base_tensors, base_meta = base
    expected, rounds_of = {}, set()
    for n, v in base_tensors.items():
        try:
            r, r_role, metric, _ = parse_tensor_name(n)
        except ValueError:
            continue
        if r_role == role and r > k and not metric.endswith("_padded"):
            expected[n] = v
            rounds_of.add(r)
    rounds = sorted(rounds_of)
    rows += guarded(lambda: _lr_rows(cell, role, meta or {}, base_meta or {}, rounds),
                    cell=cell, role=role, builder=f"{here}_lr_rows", klass=KLASS, family="lr")
    deterministic = (meta or {}).get("device") == "cpu" and (base_meta or {}).get("device") \
        == "cpu"
    rows += guarded(lambda: _metric_rows(cell, lane=lane, bounds=bounds, mask=mask,
                                         obtained=mine, expected=expected,
                                         deterministic=deterministic),
                    cell=cell, role=role, builder=f"{here}_metric_rows", klass=KLASS,
                    family="all")
    return rows
