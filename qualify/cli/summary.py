"""The end of ``qualify run`` and ``qualify gate`` for a person: short rich tables.

One table of cells by engine with their outcome counts (``PASS`` / ``XFAIL`` / ``FAIL`` /
``NOT_RUN`` / ``STALE`` / ``XPASS``, :data:`qualify.evidence.policy.OUTCOMES`), then the
cells that did not plainly pass, each with its first failing quantity (family, round,
statistic) and margin (error / sealed bound, dimensionless; > 1 fails), and where
``report.md`` is. Machine output stays ``--json``.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from rich.console import Console
from rich.table import Table

from qualify.evidence.policy import OUTCOMES, CellOutcome, PolicyEvaluation

if TYPE_CHECKING:
    from qualify.evidence.gate import GateResult

__all__ = ["console", "engine_table", "print_evaluation", "print_gate", "problem_table"]

_STYLE = {"PASS": "green", "XFAIL": "yellow", "FAIL": "bold red", "NOT_RUN": "dim",
          "STALE": "magenta", "XPASS": "bold red"}
WIDTH_NOT_A_TTY = 160
"""Columns of the tables when stdout is not a terminal (CI logs)."""


def console(file: TextIO | None = None) -> Console:
    """A console on ``file`` (default: the current ``sys.stdout``), wide in a CI log."""
    out = file if file is not None else sys.stdout
    tty = hasattr(out, "isatty") and out.isatty()
    width = shutil.get_terminal_size((WIDTH_NOT_A_TTY, 24)).columns if tty else WIDTH_NOT_A_TTY
    return Console(file=out, width=width, highlight=False, soft_wrap=False)


def engine_table(cells: Sequence[CellOutcome], *, title: str = "cells by engine") -> Table:
    """Outcome counts per engine, required cells only (a total row last)."""
    table = Table(title=title, title_justify="left")
    table.add_column("engine")
    for o in OUTCOMES:
        table.add_column(o, justify="right", style=_STYLE[o])
    engines = sorted({c.engine for c in cells if c.required})
    total = dict.fromkeys(OUTCOMES, 0)
    for e in engines:
        row = [sum(c.outcome == o for c in cells if c.required and c.engine == e)
               for o in OUTCOMES]
        for o, n in zip(OUTCOMES, row, strict=True):
            total[o] += n
        table.add_row(e, *(str(n) if n else "" for n in row))
    table.add_row("total", *(str(total[o]) for o in OUTCOMES), style="bold")
    return table


def _first(c: CellOutcome) -> tuple[str, str]:
    f = c.first
    if not f:
        return "", ""
    where = f"{f.get('family')}, round {f.get('round')}, {f.get('statistic')}" \
        if f.get("round") is not None else f"{f.get('family')}, {f.get('statistic') or ''}"
    margin = f.get("margin")
    return where.strip(), (f"{margin:.3g}" if isinstance(margin, int | float) else "")


def problem_table(cells: Sequence[CellOutcome], *, reason_width: int = 56) -> Table | None:
    """The cells that did not plainly pass (allowed NOT_RUN left out); ``None`` if none.

    One line per cell: the first failing quantity as ``family, round N, statistic``, its
    margin, and the reason cut at ``reason_width`` columns (``--json`` has it whole).
    """
    shown = [c for c in cells if c.outcome != "PASS" and not (c.outcome == "NOT_RUN" and c.ok)]
    if not shown:
        return None
    table = Table(title="cells not passing", title_justify="left")
    for col in ("cell", "outcome", "gate", "first failing", "margin", "reason"):
        table.add_column(col, overflow="ellipsis", no_wrap=True,
                         max_width=reason_width if col == "reason" else None)
    for c in shown:
        where, margin = _first(c)
        gate = ("ok" if c.ok else "FAILS") if c.required else "not required"
        reason = c.reason or ""  # one line here; the whole reason is in --json
        table.add_row(c.cell, f"[{_STYLE[c.outcome]}]{c.outcome}[/]", gate, where, margin,
                      reason)
    return table


def print_evaluation(evaluation: PolicyEvaluation, *, report_md: Path | None,
                     out: Console | None = None) -> None:
    """Print the engine table, the problem table and where report.md is."""
    con = out if out is not None else console()
    con.print(engine_table(evaluation.cells))
    problems = problem_table(evaluation.cells)
    if problems is not None:
        con.print(problems)
    if report_md is not None:
        con.print(f"report: {report_md}", highlight=False, markup=False, soft_wrap=True)


def print_gate(result: GateResult, *, out: Console | None = None) -> None:
    """Print a gate decision: its plain lines, then per contract the tables."""
    con = out if out is not None else console()
    word = {0: "PASS", 1: "FAIL", 3: "INTEGRITY ERROR"}.get(int(result.exit_code), "?")
    con.print(f"qualify gate: {word} (exit {int(result.exit_code)})", highlight=False,
              soft_wrap=True)
    for c in result.contracts:
        con.print(f"[{c.contract} {c.contract_digest[:12]}] {c.message}", markup=False,
                  highlight=False, soft_wrap=True)
        for note in c.notes:
            con.print(f"  note: {note}", markup=False, highlight=False, soft_wrap=True)
        v = c.verification
        if v is not None and not v.passed:
            for p in v.problems:
                con.print(f"  {p}", markup=False, highlight=False, soft_wrap=True)
        if c.cells:
            print_evaluation(PolicyEvaluation(cells=c.cells), report_md=c.report_md, out=con)
