"""The end of ``qualify run`` and ``qualify gate`` for a person: short rich tables.

First the root cause of each failing cell, one line per cell, with the cell's outcome
(:mod:`qualify.compare.rootcause`: the earliest failing quantity in causal order, the
other failing rows folded under it; read from the run's ``report.json``). Then one table
of cells by engine with their outcome counts (``PASS`` / ``XFAIL`` / ``FAIL`` /
``NOT_RUN`` / ``STALE`` / ``XPASS``, :data:`qualify.evidence.policy.OUTCOMES`), then the
cells that did not plainly pass, each with its first failing quantity (family, round,
statistic) and margin (error / sealed bound, dimensionless; > 1 fails), and where
``report.md`` (and ``report.html``, when written) are. Machine output stays ``--json``.
"""

from __future__ import annotations

import errno
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from qualify import jsonio
from qualify.compare.rootcause import RootCause, causes_of_report
from qualify.display import printable
from qualify.errors import EvidenceIntegrityError
from qualify.evidence.policy import OUTCOMES, CellOutcome, PolicyEvaluation
from qualify.layout import REPORT_JSON

if TYPE_CHECKING:
    from qualify.evidence.gate import GateResult

__all__ = ["console", "engine_table", "print_evaluation", "print_gate", "problem_table",
           "root_cause_lines", "run_root_causes"]

_STYLE = {"PASS": "green", "XFAIL": "yellow", "FAIL": "bold red", "NOT_RUN": "dim",
          "STALE": "magenta", "XPASS": "bold red"}
WIDTH_NOT_A_TTY = 160
"""Columns of the tables when stdout is not a terminal (CI logs)."""


class _Console(Console):
    """rich's console, but a reader that went away raises :class:`BrokenPipeError`.

    rich's own :meth:`~rich.console.Console.on_broken_pipe` exits 1, a failing verdict's
    code (``qualify gate ... | head -1`` exited 1 after printing PASS); the error goes on to
    :func:`qualify.cli.main.main`, which exits 141 as a writer killed by SIGPIPE.
    """

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "the reader of stdout went away")


def console(file: TextIO | None = None) -> Console:
    """A console on ``file`` (default: the current ``sys.stdout``), wide in a CI log.

    Raises (when printing):
        BrokenPipeError: the reader of ``file`` went away (``| head``).
    """
    out = file if file is not None else sys.stdout
    tty = hasattr(out, "isatty") and out.isatty()
    width = shutil.get_terminal_size((WIDTH_NOT_A_TTY, 24)).columns if tty else WIDTH_NOT_A_TTY
    return _Console(file=out, width=width, highlight=False, soft_wrap=False)


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
        table.add_row(Text(printable(e)), *(str(n) if n else "" for n in row))
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
        table.add_row(Text(printable(c.cell)), f"[{_STYLE[c.outcome]}]{c.outcome}[/]", gate,
                      Text(printable(where)), margin, Text(printable(reason)))
    return table


def run_root_causes(report_md: Path | None) -> list[RootCause] | None:
    """The root causes in the ``report.json`` beside ``report_md``.

    Returns:
        :func:`qualify.compare.rootcause.causes_of_report` of that document; ``None`` when
        there is no readable ``report.json`` there (then nothing is printed of them).
    """
    if report_md is None:
        return None
    try:
        doc = jsonio.read_json(report_md.parent / REPORT_JSON)
    except (OSError, ValueError, EvidenceIntegrityError):
        return None
    if not isinstance(doc, dict):
        return None
    try:
        return causes_of_report(doc)
    except (KeyError, TypeError, ValueError):
        return None


def root_cause_lines(causes: Sequence[RootCause],
                     cells: Sequence[CellOutcome] = ()) -> list[str]:
    """One line per failing cell: ``[OUTCOME] <cause line>`` (the outcome when known).

    Args:
        causes: the run's root causes.
        cells: the policy's outcomes (``XFAIL`` / ``FAIL`` ...), to prefix each line.

    Returns:
        The lines, in the causes' order.
    """
    outcome = {c.cell: c.outcome for c in cells}
    return [(f"[{outcome[rc.cell]}] " if rc.cell in outcome else "") + rc.line()
            for rc in causes]


def print_evaluation(evaluation: PolicyEvaluation, *, report_md: Path | None,
                     out: Console | None = None, report_html: Path | None = None,
                     causes: Sequence[RootCause] | None = None) -> None:
    """Print the root causes, the engine table, the problem table, where the reports are.

    Args:
        evaluation: the policy's outcome of every cell.
        report_md: the run's ``report.md`` (its ``report.json`` beside it gives the root
            causes when ``causes`` is ``None``).
        out: the console (default :func:`console`).
        report_html: the run's ``report.html`` when one was written.
        causes: the root causes (default: read from the run's ``report.json``).
    """
    con = out if out is not None else console()
    found = list(causes) if causes is not None else run_root_causes(report_md)
    if found:
        con.print("root causes (earliest failing quantity per failing cell, in causal "
                  "order; the cell's other failing rows folded under it):", markup=False,
                  highlight=False, soft_wrap=True)
        for line in root_cause_lines(found, evaluation.cells):
            con.print(f"  {printable(line)}", markup=False, highlight=False, soft_wrap=True)
    con.print(engine_table(evaluation.cells))
    problems = problem_table(evaluation.cells)
    if problems is not None:
        con.print(problems)
    if report_md is not None:
        con.print(f"report: {printable(report_md)}", highlight=False, markup=False, soft_wrap=True)
    if report_html is not None:
        con.print(f"report.html: {printable(report_html)}", highlight=False, markup=False,
                  soft_wrap=True)


def print_gate(result: GateResult, *, out: Console | None = None) -> None:
    """Print a gate decision: its plain lines, then per contract the tables."""
    con = out if out is not None else console()
    word = {0: "PASS", 1: "FAIL", 3: "INTEGRITY ERROR"}.get(int(result.exit_code), "?")
    con.print(f"qualify gate: {word} (exit {int(result.exit_code)})", highlight=False,
              soft_wrap=True)
    con.print(result.trust_root.line, markup=False, highlight=False, soft_wrap=True)
    for c in result.contracts:
        con.print(printable(f"[{c.contract} {c.contract_digest[:12]}] {c.message}"), markup=False,
                  highlight=False, soft_wrap=True)
        for t in c.trust_changes:
            con.print(f"  trust: {t.line}", markup=False, highlight=False, soft_wrap=True)
        for note in c.notes:
            con.print(f"  note: {printable(note)}", markup=False, highlight=False, soft_wrap=True)
        v = c.verification
        if v is not None and not v.passed:
            for p in v.problems:
                con.print(f"  {printable(p)}", markup=False, highlight=False, soft_wrap=True)
        if c.cells:
            print_evaluation(PolicyEvaluation(cells=c.cells), report_md=c.report_md, out=con)
