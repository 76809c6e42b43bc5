"""What changed between two compared runs: ``qualify diff RUN_A RUN_B``.

A run is judged alone; a reviewer deciding a merge also wants to know what moved since the
last accepted run. :func:`diff_runs` reads both runs' ``report.json`` and the ``bounds.json``
of the reference each run was compared with, and lists:

- **cells whose verdict changed** (``PASS`` -> ``FAIL``, a cell that appeared or vanished),
  with each side's worst margin;
- **rows whose margin moved** by more than ``factor`` either way (``margin_b / margin_a >
  factor`` or ``< 1 / factor``), among rows where at least one side's margin is at least
  ``min_margin`` (a row far inside its bound on both sides moving from 1e-4 to 1e-3 is
  noise, not news); a row is identified by ``(cell, metric, class, statistic, variant)``;
  a row whose margin is not a number on one side (``None``, ``"inf"``) and a number on the
  other counts as moved;
- **rows that appeared or vanished**;
- **bounds that changed** between the two references, identified by ``(class, precision,
  role, round, family, statistic)``, with the old and new value and the control that set
  each (its name and its error), so a bound that widened names the control that widened it.

Two runs of the same reference have no bound changes. Nothing is recomputed: the diff
reads what each run's report says (``qualify verify`` is the check that the report is what
the tensors say).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from qualify.errors import QualifyError, UsageError
from qualify.jsonio import read_json
from qualify.layout import REPORT_JSON, RUN_FILE, resolve_reference

__all__ = ["DEFAULT_FACTOR", "DEFAULT_MIN_MARGIN", "RunDiff", "diff_runs", "read_run_report"]

DEFAULT_FACTOR: Final = 2.0
"""A row's margin moved when it grew or shrank by more than this factor."""
DEFAULT_MIN_MARGIN: Final = 0.1
"""Rows whose margin is below this on both sides are not reported as moved."""

RowKey = tuple[str, str, str, str, str]
BoundKey = tuple[str, str, str, int, str, str]


def _row_key(row: Mapping[str, Any]) -> RowKey:
    return (str(row.get("cell")), str(row.get("metric")), str(row.get("class")),
            str(row.get("statistic")), str(row.get("variant") or ""))


def _bound_key(entry: Mapping[str, Any]) -> BoundKey:
    return (str(entry.get("class")), str(entry.get("precision")), str(entry.get("role")),
            int(entry.get("round") or 0), str(entry.get("family")), str(entry.get("statistic")))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _moved(a: Any, b: Any, factor: float, min_margin: float) -> bool:
    na, nb = _number(a), _number(b)
    if na is None or nb is None:
        return (na is None) != (nb is None) or (a != b)
    if max(na, nb) < min_margin:
        return False
    if na == 0.0 or nb == 0.0:
        return na != nb
    ratio = nb / na
    return ratio > factor or ratio < 1.0 / factor


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunDiff:
    """The differences between run ``a`` (the baseline) and run ``b``.

    Attributes:
        run_a: the baseline run directory.
        run_b: the compared run directory.
        factor: the margin factor of :attr:`moved_rows`.
        min_margin: the margin below which rows are not reported as moved.
        cells: ``{cell, verdict_a, verdict_b, worst_margin_a, worst_margin_b}`` for every
            cell whose verdict differs (``None`` on the side that lacks the cell).
        moved_rows: ``{cell, metric, class, statistic, variant, margin_a, margin_b,
            verdict_a, verdict_b}`` for every row whose margin moved.
        new_rows: keys of rows only in ``b``.
        vanished_rows: keys of rows only in ``a``.
        bounds: ``{class, precision, role, round, family, statistic, bound_a, bound_b,
            control_a, control_b, control_error_a, control_error_b}`` for every bound
            whose value differs or that exists on one side only.
        same_reference: whether both runs were compared with the same sealed reference
            (the same ``bounds.json`` content).
        bounds_found: whether both runs' references were found (else :attr:`bounds` is
            empty and says nothing).
    """

    run_a: Path
    run_b: Path
    factor: float
    min_margin: float
    cells: tuple[Mapping[str, Any], ...]
    moved_rows: tuple[Mapping[str, Any], ...]
    new_rows: tuple[RowKey, ...]
    vanished_rows: tuple[RowKey, ...]
    bounds: tuple[Mapping[str, Any], ...]
    same_reference: bool
    bounds_found: bool = True

    @property
    def changed(self) -> bool:
        """Whether any cell's verdict changed (the exit status of ``qualify diff``)."""
        return bool(self.cells)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"run_a": str(self.run_a), "run_b": str(self.run_b), "factor": self.factor,
                "min_margin": self.min_margin, "same_reference": self.same_reference,
                "cells": [dict(c) for c in self.cells],
                "moved_rows": [dict(r) for r in self.moved_rows],
                "new_rows": [list(k) for k in self.new_rows],
                "vanished_rows": [list(k) for k in self.vanished_rows],
                "bounds": [dict(b) for b in self.bounds], "bounds_found": self.bounds_found}

    def lines(self) -> list[str]:
        """The diff for a person, one finding a line."""
        out = [f"qualify diff: {self.run_a} -> {self.run_b}"]
        out.append(f"cells whose verdict changed: {len(self.cells)}")
        out += [f"  {c['cell']}: {c['verdict_a']} -> {c['verdict_b']} (worst margin "
                f"{c['worst_margin_a']} -> {c['worst_margin_b']})" for c in self.cells]
        out.append(f"rows whose margin moved by more than x{self.factor:g} (margin >= "
                   f"{self.min_margin:g} on a side): {len(self.moved_rows)}")
        out += [f"  {r['cell']} {r['metric']} ({r['class']}, {r['statistic']}): margin "
                f"{r['margin_a']} -> {r['margin_b']} ({r['verdict_a']} -> {r['verdict_b']})"
                for r in self.moved_rows]
        out.append(f"new rows: {len(self.new_rows)}; vanished rows: {len(self.vanished_rows)}")
        out += [f"  new: {' '.join(k)}" for k in self.new_rows]
        out += [f"  vanished: {' '.join(k)}" for k in self.vanished_rows]
        if not self.bounds_found:
            out.append("bounds: a run's sealed reference was not found; bounds not compared")
        elif self.same_reference:
            out.append("bounds: the same sealed reference (no bound changed)")
        else:
            out.append(f"bounds that changed: {len(self.bounds)}")
            out += [f"  {b['precision']} {b['role']} round {b['round']} {b['family']} "
                    f"({b['class']}, {b['statistic']}): {b['bound_a']} -> {b['bound_b']}; "
                    f"control {b['control_a']} ({b['control_error_a']}) -> {b['control_b']} "
                    f"({b['control_error_b']})" for b in self.bounds]
        return out


def read_run_report(run_dir: Path) -> Mapping[str, Any]:
    """The ``report.json`` of the candidate run ``run_dir`` (``qualify diff`` and ``report``).

    Raises:
        UsageError: ``run_dir`` is not a directory, holds no ``run.json`` (not a candidate
            run) or no ``report.json`` (not compared yet), or its report has no ``rows`` /
            ``cells`` lists.
        QualifyError: ``report.json`` is not readable JSON (:func:`qualify.jsonio.read_json`).
    """
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: run directory: no such directory")
    if not (run_dir / RUN_FILE).is_file():
        raise UsageError(f"{run_dir}: not a candidate run (no {RUN_FILE})")
    if not (run_dir / REPORT_JSON).is_file():
        raise UsageError(f"{run_dir}: no {REPORT_JSON}; compare the run first "
                         "(qualify compare RUN_DIR)")
    doc = read_json(run_dir / REPORT_JSON)
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) \
            or not isinstance(doc.get("cells"), list):
        raise UsageError(f"{run_dir / REPORT_JSON}: rows / cells: not a qualify report")
    return doc


def _bounds(run_dir: Path) -> list[Mapping[str, Any]] | None:
    """The bounds of the reference ``run_dir`` was compared with (``None``: not found)."""
    try:
        ref = resolve_reference(run_dir, read_json(run_dir / RUN_FILE))
        doc = read_json(ref / "bounds.json")
    except (QualifyError, OSError):  # a run whose reference is gone still diffs its rows
        return None
    entries = doc.get("bounds") if isinstance(doc, dict) else None
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else None


def _bound_changes(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]
                   ) -> list[Mapping[str, Any]]:
    by_a = {_bound_key(e): e for e in a}
    by_b = {_bound_key(e): e for e in b}
    out: list[Mapping[str, Any]] = []
    for key in sorted(set(by_a) | set(by_b)):
        ea, eb = by_a.get(key, {}), by_b.get(key, {})
        if ea.get("bound") == eb.get("bound"):
            continue
        klass, precision, role, rnd, family, statistic = key
        out.append({"class": klass, "precision": precision, "role": role, "round": rnd,
                    "family": family, "statistic": statistic,
                    "bound_a": ea.get("bound"), "bound_b": eb.get("bound"),
                    "control_a": ea.get("control"), "control_b": eb.get("control"),
                    "control_error_a": ea.get("control_error"),
                    "control_error_b": eb.get("control_error")})
    return out


def diff_runs(run_a: str | Path, run_b: str | Path, *, factor: float = DEFAULT_FACTOR,
              min_margin: float = DEFAULT_MIN_MARGIN) -> RunDiff:
    """Compare two compared runs (``a`` the baseline, e.g. the last accepted run).

    Args:
        run_a: the baseline run directory (holds ``report.json``).
        run_b: the run to compare with it.
        factor: a row's margin moved when it changed by more than this factor (> 1).
        min_margin: rows whose margin is below this on both sides are not reported as moved.

    Returns:
        The :class:`RunDiff`.

    Raises:
        UsageError: a directory is missing or is not a compared run, or ``factor <= 1``.
    """
    if not (isinstance(factor, int | float) and math.isfinite(factor) and factor > 1.0):
        raise UsageError(f"--factor: {factor!r}: must be a number > 1")
    if not (isinstance(min_margin, int | float) and math.isfinite(min_margin)
            and min_margin >= 0.0):
        raise UsageError(f"--min-margin: {min_margin!r}: must be a number >= 0")
    pa, pb = Path(run_a), Path(run_b)
    ra, rb = read_run_report(pa), read_run_report(pb)
    cells_a = {c.get("cell"): c for c in ra["cells"] if isinstance(c, dict)}
    cells_b = {c.get("cell"): c for c in rb["cells"] if isinstance(c, dict)}
    cells = []
    for cell in sorted(set(cells_a) | set(cells_b), key=str):
        ca, cb = cells_a.get(cell, {}), cells_b.get(cell, {})
        if ca.get("verdict") != cb.get("verdict"):
            cells.append({"cell": cell, "verdict_a": ca.get("verdict"),
                          "verdict_b": cb.get("verdict"),
                          "worst_margin_a": ca.get("worst_margin"),
                          "worst_margin_b": cb.get("worst_margin")})
    rows_a = {_row_key(r): r for r in ra["rows"] if isinstance(r, dict)}
    rows_b = {_row_key(r): r for r in rb["rows"] if isinstance(r, dict)}
    moved = []
    for key in sorted(set(rows_a) & set(rows_b)):
        a, b = rows_a[key], rows_b[key]
        if _moved(a.get("margin"), b.get("margin"), factor, min_margin):
            moved.append({"cell": key[0], "metric": key[1], "class": key[2],
                          "statistic": key[3], "variant": key[4],
                          "margin_a": a.get("margin"), "margin_b": b.get("margin"),
                          "verdict_a": a.get("verdict"), "verdict_b": b.get("verdict")})
    bounds_a, bounds_b = _bounds(pa), _bounds(pb)
    same = bounds_a is not None and bounds_a == bounds_b
    changes = [] if same or bounds_a is None or bounds_b is None \
        else _bound_changes(bounds_a, bounds_b)
    return RunDiff(run_a=pa, run_b=pb, factor=float(factor), min_margin=float(min_margin),
                   cells=tuple(cells), moved_rows=tuple(moved),
                   new_rows=tuple(sorted(set(rows_b) - set(rows_a))),
                   vanished_rows=tuple(sorted(set(rows_a) - set(rows_b))),
                   bounds=tuple(changes), same_reference=same,
                   bounds_found=bounds_a is not None and bounds_b is not None)
