"""``qualify sweep``: a contract over seed variants, judged by its gate policy; a policy derived.

A gate policy fitted to one run goes red when nothing but a seed moves. The sweep runs the
contract's seed variants and answers two questions:

1. **Does the committed policy hold across seeds?** Each variant is the contract with its
   seeds moved by an offset ``k`` (:data:`SEED_FIELDS`: the model's, the sampling's, the
   critic head's and the reward model's; ``--move`` picks fewer), renamed
   ``<name>-seed<k>``, run end to end by ``qualify run`` in a child process (its own sealed
   reference, every cell), and its report judged by the contract's gate policy
   (:func:`qualify.evidence.policy.evaluate`; the variants share the contract's cell ids).
   A variant whose required cells do not all pass or fail as expected is a false alarm to
   be fixed at its cause (a control the bound rule lacks) or a finding to explain.
2. **What policy do the seeds support?** :func:`derive_policy` groups every FAIL row of
   every variant (and of any extra runs given) by cell and family and writes one expected
   failure per group: the rounds and roles that failed, and a ceiling (:func:`ceiling`):
   ``factor x`` the largest margin seen, or, when the group failed in at least
   :data:`MIN_SPREAD_RUNS` runs, the one-sided ``coverage`` prediction bound of the next seed's
   margin from their spread if that is larger (a row without a finite margin, a ``dtypes``
   check, is covered by family alone). Each group keeps the reason and upstream of the
   committed entry that covers its cell; a group no committed entry names gets the reason
   ``UNEXPLAINED`` and the sweep fails: a new failure is a finding, never a line silently
   added to a policy.

The summary (``sweep.json``, ``sweep.md``; :func:`write_summary`) records the base
contract's digest, the policy's digest, the bound rule's source digest, the offsets and
per variant the gate's exit and every cell outside the policy with its first failing
quantity, so a test can tell when the policy or the rule changed after the sweep
(``tests/test_sweep.py``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from qualify.contract import Contract, load_contract
from qualify.digests import sha256_file
from qualify.display import markdown_cell
from qualify.errors import ContractError, ExitCode, UsageError
from qualify.evidence.policy import Policy, all_cells, evaluate, policy_from_document
from qualify.jsonio import read_json
from qualify.layout import REPORT_JSON

__all__ = [
    "DEFAULT_COVERAGE",
    "DEFAULT_FACTOR",
    "MIN_SPREAD_RUNS",
    "SEED_FIELDS",
    "SweepResult",
    "VariantResult",
    "ceiling",
    "derive_policy",
    "policy_toml",
    "rule_digest",
    "run_sweep",
    "student_t_quantile",
    "summary_markdown",
    "variant_text",
    "write_summary",
]

SEED_FIELDS: Final = {"model": ("model", "seed"), "sampling": ("sampling", "seed"),
                      "critic_head": ("roles", "critic_head_seed"),
                      "reward": ("roles", "reward_seed")}
"""The seeds a variant moves, by name: ``(TOML section, key)``."""
DEFAULT_FACTOR: Final = 1.5
"""A derived ceiling is at least this factor times the largest margin the sweep saw."""
DEFAULT_COVERAGE: Final = 0.99
"""The probability with which the spread term of :func:`ceiling` covers the next seed."""
MIN_SPREAD_RUNS: Final = 5
"""Runs a (cell, family) must fail in before its spread enters its ceiling; fewer
runs leave ``factor x`` the largest margin alone (a spread of two or three runs says
little, and their Student-t quantile would open the ceiling wide)."""
UNEXPLAINED: Final = "UNEXPLAINED"
SUMMARY_JSON: Final = "sweep.json"
SUMMARY_MD: Final = "sweep.md"


def _section_key(text: str, section: str, key: str) -> re.Match[str] | None:
    return re.search(rf"(?m)(^\[{re.escape(section)}\]\n(?:(?!^\[).*\n)*?)^{re.escape(key)}"
                     rf" = ([^\n#]*?)\s*(#.*)?$", text)


def variant_text(text: str, offset: int, move: Sequence[str] = tuple(SEED_FIELDS)
                 ) -> tuple[str, str]:
    """The contract text with the ``move`` seeds moved by ``offset``: ``(name, text)``.

    Comments and layout are kept (the text is edited, not re-serialised).

    Raises:
        ContractError: the contract has no ``name`` or lacks one of the seeds to move.
    """
    m = re.search(r'(?m)^name = "([^"]+)"\s*$', text)
    if m is None:
        raise ContractError("sweep: the contract has no top-level name = \"...\"")
    name = f"{m.group(1)}-seed{offset}"
    text = text[:m.start()] + f'name = "{name}"' + text[m.end():]
    for field in move:
        section, key = SEED_FIELDS[field]
        found = _section_key(text, section, key)
        if found is None or not found.group(2).strip().isdigit():
            raise ContractError(f"sweep: no integer '{key} = ...' in [{section}] of the "
                                f"contract (seed {field!r})")
        value = int(found.group(2)) + offset
        start, end = found.span(2)
        text = text[:start] + str(value) + text[end:]
    return name, text


def rule_digest() -> str:
    """sha256 of the bound rule's sources (:mod:`qualify.bounds`, :mod:`qualify.statistics`)."""
    here = Path(__file__).resolve().parent.parent
    return sha256_file(here / "bounds.py")[:32] + sha256_file(here / "statistics.py")[:32]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class VariantResult:
    """One seed variant: its run, and its judgement by the policy.

    Attributes:
        offset: the seed offset.
        name: the variant contract's name.
        report: its ``report.json`` (``None``: the run wrote none).
        exit_code: the gate's exit under the policy (``None`` without a report).
        run_exit: ``qualify run``'s exit code (``None`` with ``--report-only``).
        wall_s: the run's wall time (``None`` with ``--report-only``).
        counts: cells per report verdict.
        outside: every required cell whose gate outcome is not ok: ``{cell, outcome,
            reason, first}`` (``first``: its first failing quantity).
    """

    offset: int
    name: str
    report: Path | None
    exit_code: int | None
    run_exit: int | None
    wall_s: float | None
    counts: Mapping[str, int]
    outside: tuple[Mapping[str, Any], ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"offset": self.offset, "name": self.name,
                "report": None if self.report is None else str(self.report),
                "exit_code": self.exit_code, "run_exit": self.run_exit,
                "wall_s": self.wall_s, "counts": dict(self.counts),
                "outside": [dict(o) for o in self.outside]}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SweepResult:
    """The whole sweep (``bool()``: every variant gated 0 and nothing was unexplained).

    Attributes:
        contract: the base contract.
        policy: the policy the variants were judged by.
        variants: one result per offset.
        derived: the derived policy document (``None`` when no report was read).
        seen: per derived entry ``(cell, family)``, the largest finite margin seen.
        factor: the least ceiling factor of the derived policy.
        moved: the seeds moved.
        coverage: the probability of the ceilings' spread term (:func:`ceiling`).
        rules: per derived entry ``(cell, family)``: the runs, per-run margins and the
            term that set its ceiling.
    """

    contract: Contract
    policy: Policy
    variants: tuple[VariantResult, ...]
    derived: Mapping[str, Any] | None
    factor: float
    moved: tuple[str, ...]
    seen: Mapping[tuple[str, str], float | None] = dataclasses.field(default_factory=dict)
    coverage: float = DEFAULT_COVERAGE
    rules: Mapping[tuple[str, str], Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def unexplained(self) -> tuple[str, ...]:
        """Cells of the derived policy that no committed entry explains."""
        if self.derived is None:
            return ()
        return tuple(sorted({e["cells"] for e in self.derived.get("expected_failures", [])
                             if e["reason"].startswith(UNEXPLAINED)}))

    @property
    def exit_code(self) -> ExitCode:
        """0 when every variant wrote a report and gated 0 and nothing is unexplained."""
        ok = all(v.exit_code == 0 for v in self.variants) and not self.unexplained
        return ExitCode.OK if ok and self.variants else ExitCode.QUALIFICATION_FAILED

    def __bool__(self) -> bool:
        return self.exit_code == ExitCode.OK

    def to_dict(self) -> dict[str, Any]:
        """The ``sweep.json`` document."""
        return {"schema_version": 1, "contract": self.contract.name,
                "contract_digest": self.contract.digest,
                "policy": None if self.policy.path is None else str(self.policy.path),
                "policy_digest": self.policy.digest, "rule_digest": rule_digest(),
                "moved": list(self.moved), "factor": self.factor,
                "coverage": self.coverage, "min_spread_runs": MIN_SPREAD_RUNS,
                "exit_code": int(self.exit_code), "unexplained": list(self.unexplained),
                "variants": [v.to_dict() for v in self.variants],
                "derived": [] if self.derived is None else [
                    {"cells": e["cells"], "families": e["families"],
                     "max_margin": e["max_margin"],
                     "max_margin_seen": self.seen.get((e["cells"], e["families"][0])),
                     **self.rules.get((e["cells"], e["families"][0]), {})}
                    for e in self.derived.get("expected_failures", [])]}


def student_t_quantile(p: float, dof: int) -> float:
    """The ``p`` quantile of Student's t distribution with ``dof`` degrees of freedom.

    Bisection on the CDF ``1/2 + integral_0^t pdf`` (composite Simpson rule, 2,000
    intervals; ``pdf(x) = Gamma((v+1)/2) / (sqrt(v pi) Gamma(v/2)) (1 + x^2/v)^(-(v+1)/2)``),
    to 1e-9 in ``t``. Tables: ``t(0.99, 10) = 2.764``, ``t(0.995, 5) = 4.032``.

    Args:
        p: a probability in ``[0.5, 1)``.
        dof: degrees of freedom, ``>= 1``.

    Raises:
        ValueError: ``p`` or ``dof`` out of range.
    """
    if not (0.5 <= p < 1.0) or dof < 1:
        raise ValueError(f"student_t_quantile: p {p!r} must be in [0.5, 1), dof {dof!r} >= 1")
    v = float(dof)
    log_c = math.lgamma((v + 1) / 2) - math.lgamma(v / 2) - 0.5 * math.log(v * math.pi)

    def pdf(x: float) -> float:
        return math.exp(log_c - (v + 1) / 2 * math.log1p(x * x / v))

    def cdf(t: float) -> float:
        n = 2000
        h = t / n
        acc = pdf(0.0) + pdf(t) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, n))
        return 0.5 + acc * h / 3

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def ceiling(margins: Sequence[float], *, factor: float = DEFAULT_FACTOR,
            coverage: float = DEFAULT_COVERAGE) -> tuple[float, str]:
    """The derived ``max_margin`` of one (cell, family) from its margin in each run.

    ``margins`` holds, per run in which the (cell, family) failed, its largest finite margin:
    the ceiling judges failing rows only, so the distribution to predict is the defect's
    size on a seed where it shows. The ceiling is ``factor x max(margins)``, or
    when ``n = len(margins) >= MIN_SPREAD_RUNS`` and it is larger, the one-sided
    ``coverage`` prediction bound of one more run's margin, margins taken log-normal over
    seeds (a defect's error scales with the data it meets, so its spread is a ratio):
    ``exp(mean + t(coverage, n - 1) * sd * sqrt(1 + 1/n))`` of ``ln margins``
    (:func:`student_t_quantile`). A defect whose size moves 3-5x with the seed gets a
    ceiling that the next seed stays under with that probability; one whose size is stable
    keeps ``factor x`` the largest margin.

    Args:
        margins: positive finite margins, one per run (empty: no run had one).
        factor: the least ratio of ceiling to largest margin, ``> 1``.
        coverage: the prediction bound's probability, in ``[0.5, 1)``.

    Returns:
        ``(ceiling, rule)``: ``rule`` is ``"factor"`` or ``"spread"`` (which term set it).
        ``factor x 1`` with ``"factor"`` when ``margins`` is empty.

    Raises:
        UsageError: ``factor <= 1`` or ``coverage`` out of range.
    """
    if not (math.isfinite(factor) and factor > 1.0):
        raise UsageError(f"--factor: {factor!r}: must be a number > 1")
    if not (0.5 <= coverage < 1.0):
        raise UsageError(f"--coverage: {coverage!r}: must be in [0.5, 1)")
    ms = [m for m in margins if m > 0 and math.isfinite(m)]
    if not ms:
        return factor, "factor"
    by_factor = factor * max(ms)
    n = len(ms)
    if n < MIN_SPREAD_RUNS:
        return by_factor, "factor"
    logs = [math.log(m) for m in ms]
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    spread = math.exp(mean + student_t_quantile(coverage, n - 1) * sd * math.sqrt(1 + 1 / n))
    return (spread, "spread") if spread > by_factor else (by_factor, "factor")


def _judge(report: Mapping[str, Any], contract: Contract, policy: Policy
           ) -> tuple[int, dict[str, int], tuple[Mapping[str, Any], ...]]:
    ev = evaluate(report, policy, cells=all_cells(contract))
    counts: dict[str, int] = {}
    for c in report.get("cells", []):
        if isinstance(c, Mapping):
            counts[str(c.get("verdict"))] = counts.get(str(c.get("verdict")), 0) + 1
    outside = tuple({"cell": c.cell, "outcome": c.outcome, "reason": c.reason,
                     "first": None if c.first is None else dict(c.first)}
                    for c in ev.cells if c.required and not c.ok)
    return int(ev.exit_code), counts, outside


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def derive_policy(reports: Sequence[Mapping[str, Any]], contract: Contract, policy: Policy,
                  *, factor: float = DEFAULT_FACTOR, coverage: float = DEFAULT_COVERAGE,
                  source: str = "",
                  seen: dict[tuple[str, str], float | None] | None = None,
                  rules: dict[tuple[str, str], dict[str, Any]] | None = None
                  ) -> dict[str, Any]:
    """A gate policy document that expects exactly what failed in ``reports``.

    One expected failure per (cell, family) that failed in any report: its rounds and
    roles, ``max_margin`` from :func:`ceiling` over the (cell, family)'s largest finite
    margin in each report where it failed (``factor x 1`` when no row
    of the group has a finite margin, so the entry stays valid; such rows are covered by
    family alone), the reason and upstream of the first entry of ``policy``
    whose glob matches the cell (else ``UNEXPLAINED``). ``required`` and
    ``allowed_not_run`` are ``policy``'s.

    Args:
        reports: ``report.json`` documents of runs of the contract (or its seed variants).
        contract: the base contract (its cell ids).
        policy: the committed policy (reasons, upstream pointers, required cells).
        factor: the least ceiling factor over the largest margin, > 1.
        coverage: the probability of the spread term of :func:`ceiling`.
        source: a line naming where the reports came from (the document's ``comment``).
        seen: filled, when given, with each entry's ``(cell, family)`` and the largest
            finite margin seen (``None``: no failing row of the group had one).
        rules: filled, when given, with each entry's ``(cell, family)`` and
            ``{"runs": n, "rule": "factor" | "spread", "margins": [...]}`` (the per-run
            margins :func:`ceiling` read).

    Returns:
        The policy document (valid for :func:`qualify.evidence.policy.policy_from_document`).

    Raises:
        UsageError: ``factor <= 1`` or ``coverage`` out of range.
    """
    ceiling([], factor=factor, coverage=coverage)  # refuses a bad factor or coverage first
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    ids = set(all_cells(contract))
    per_run: list[dict[tuple[str, str], float]] = []
    for report in reports:
        largest: dict[tuple[str, str], float] = {}
        for r in report.get("rows", []):
            m = _finite(r.get("margin")) if isinstance(r, Mapping) else None
            if m is not None:
                key = (str(r.get("cell")), str(r.get("family")))
                largest[key] = max(m, largest.get(key, m))
        per_run.append(largest)
        for r in report.get("rows", []):
            if not isinstance(r, Mapping) or r.get("verdict") != "FAIL":
                continue
            cell, family = str(r.get("cell")), str(r.get("family"))
            if cell not in ids:
                continue
            g = groups.setdefault((cell, family), {"rounds": set(), "roles": set(),
                                                   "margin": None})
            if isinstance(r.get("round"), int):
                g["rounds"].add(int(r["round"]))
            if r.get("role"):
                g["roles"].add(str(r["role"]))
            m = _finite(r.get("margin"))
            if m is not None:
                g["margin"] = m if g["margin"] is None else max(g["margin"], m)
    entries = []
    for (cell, family), g in sorted(groups.items()):
        explained = next((e for e in policy.expected_failures
                          if fnmatch.fnmatchcase(cell, e.cells)), None)
        margins = [run[(cell, family)] for run in per_run
                   if run.get((cell, family), 0.0) > 1.0] if g["margin"] is not None else []
        top, rule = ceiling(margins, factor=factor, coverage=coverage)
        entry: dict[str, Any] = {"cells": cell, "families": [family]}
        if g["rounds"]:
            entry["rounds"] = sorted(g["rounds"])
        if g["roles"]:
            entry["roles"] = sorted(g["roles"])
        entry["max_margin"] = float(f"{max(top, 1.0 + 1e-9):.4g}")
        if entry["max_margin"] <= 1.0:
            entry["max_margin"] = 1.001
        entry["reason"] = explained.reason if explained is not None else (
            f"{UNEXPLAINED}: failed in the sweep, named by no entry of the committed policy")
        # an unexplained entry points at the findings page, where its explanation belongs;
        # the sweep fails on it (SweepResult.unexplained) until a person writes it up
        entry["upstream"] = explained.upstream if explained is not None else "docs/findings.md"
        entries.append(entry)
        if seen is not None:
            seen[(cell, family)] = g["margin"]
        if rules is not None:
            rules[(cell, family)] = {"runs": len(margins), "rule": rule, "margins": margins}
    doc: dict[str, Any] = {"schema_version": 1, "contract": contract.name}
    if policy.path is not None and set(policy.required) != set(all_cells(contract)):
        doc["required"] = list(policy.required)
    if entries:
        doc["expected_failures"] = entries
    if policy.allowed_not_run:
        doc["allowed_not_run"] = [{k: v for k, v in a.to_dict().items() if v is not None}
                                  for a in policy.allowed_not_run]
    if source:
        doc["comment"] = source
    return doc


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def policy_toml(doc: Mapping[str, Any]) -> str:
    """``doc`` (from :func:`derive_policy`) as gate-policy TOML, its comment as a header."""
    lines = ["# Gate policy derived by `qualify sweep` (qualify/pipeline/sweep.py): one expected",
             "# failure per cell and family that failed in the sweep, its ceiling the larger of",
             "# the factor times the largest margin seen and the prediction bound of the next",
             "# seed's margin from the runs' spread (qualify.pipeline.sweep.ceiling)."]
    if doc.get("comment"):
        lines += [f"# {line}" for line in str(doc["comment"]).splitlines()]
    lines += [f"schema_version = {doc['schema_version']}",
              f"contract = {_toml_value(doc['contract'])}"]
    if "required" in doc:
        lines.append(f"required = {_toml_value(doc['required'])}")
    for e in doc.get("expected_failures", []):
        lines += ["", "[[expected_failures]]"]
        lines += [f"{k} = {_toml_value(e[k])}" for k in
                  ("cells", "families", "rounds", "roles", "max_margin", "reason", "upstream")
                  if k in e]
    for a in doc.get("allowed_not_run", []):
        lines += ["", "[[allowed_not_run]]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in a.items()]
    return "\n".join(lines) + "\n"


def _latest_report(evidence: Path, name: str) -> Path | None:
    runs = sorted(p for p in (evidence / name).glob(f"*/{REPORT_JSON}") if p.is_file())
    return runs[-1] if runs else None


def run_sweep(contract_path: Path, *, offsets: Sequence[int], out: Path, policy: Policy,
              move: Sequence[str] = tuple(SEED_FIELDS), factor: float = DEFAULT_FACTOR,
              coverage: float = DEFAULT_COVERAGE,
              cells: Sequence[str] | None = None, report_only: bool = False,
              extra_reports: Sequence[Path] = (),
              progress: Callable[[str], None] | None = None) -> SweepResult:
    """Run (or, with ``report_only``, re-read) every variant and judge it by ``policy``.

    Args:
        contract_path: the base contract.
        offsets: the seed offsets of the variants (``0`` is the contract's own seeds).
        out: working directory (``contracts/``, ``references/``, ``evidence/``, ``logs/``).
        policy: the gate policy of the base contract.
        move: the seeds to move (:data:`SEED_FIELDS` names).
        factor: the derived policy's least ceiling factor.
        coverage: the probability of the derived ceilings' spread term (:func:`ceiling`).
        cells: cell globs passed to ``qualify run`` (``None``: every cell).
        report_only: run nothing; judge the reports already under ``out``.
        extra_reports: ``report.json`` files of further runs of the base contract (the
            committed run) that the derived policy must also cover.
        progress: called with one line per finished variant.

    Returns:
        The :class:`SweepResult`.

    Raises:
        UsageError: an unknown seed name, no offsets, or a report of another contract.
        ContractError: the contract lacks a seed to move.
    """
    unknown = [m for m in move if m not in SEED_FIELDS]
    if unknown or not move:
        raise UsageError(f"--move: {','.join(unknown) or '(none)'}: seeds are "
                         f"{', '.join(SEED_FIELDS)}")
    if not offsets:
        raise UsageError("--offsets: no seed offset given")
    contract = load_contract(contract_path)
    text = contract_path.read_text(encoding="utf-8")
    out = out.resolve()
    for d in ("contracts", "references", "evidence", "logs"):
        (out / d).mkdir(parents=True, exist_ok=True)
    results: list[VariantResult] = []
    reports: list[Mapping[str, Any]] = []
    for k in offsets:
        name, vtext = variant_text(text, k, move)
        path = out / "contracts" / f"{name}.toml"
        path.write_text(vtext, encoding="utf-8")
        run_exit = wall = None
        if not report_only:
            cmd = [sys.executable, "-m", "qualify", "run", str(path), "--references",
                   str(out / "references"), "--evidence", str(out / "evidence"), "--quiet"]
            if cells:
                cmd += ["--cells", *cells]
            t0 = time.monotonic()
            with (out / "logs" / f"{name}.log").open("w", encoding="utf-8") as log:
                run_exit = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          check=False).returncode
            wall = round(time.monotonic() - t0, 1)
        found = _latest_report(out / "evidence", name)
        if found is None:
            results.append(VariantResult(offset=k, name=name, report=None, exit_code=None,
                                         run_exit=run_exit, wall_s=wall, counts={},
                                         outside=()))
        else:
            doc = read_json(found)
            reports.append(doc)
            code, counts, outside = _judge(doc, contract, policy)
            results.append(VariantResult(offset=k, name=name, report=found, exit_code=code,
                                         run_exit=run_exit, wall_s=wall, counts=counts,
                                         outside=outside))
        if progress is not None:
            v = results[-1]
            progress(f"{name}: qualify run exit {v.run_exit}, gate exit {v.exit_code}, "
                     f"{len(v.outside)} cell(s) outside the policy"
                     + (f", {v.wall_s:.0f} s" if v.wall_s is not None else ""))
    for extra in extra_reports:
        doc = read_json(extra)
        if not isinstance(doc, Mapping) or doc.get("contract_digest") != contract.digest:
            raise UsageError(f"{extra}: --include: not a report of contract {contract.name} "
                             f"({contract.digest12})")
        reports.append(doc)
    source = (f"Sweep of {contract.name} ({contract.digest12}): seed offsets "
              f"{', '.join(str(k) for k in offsets)} moving {', '.join(move)}"
              + (f", plus {len(extra_reports)} committed run(s)" if extra_reports else "")
              + f"; ceilings by qualify.pipeline.sweep.ceiling: factor {factor:g}, coverage "
              f"{coverage:g} from {MIN_SPREAD_RUNS} runs.")
    seen: dict[tuple[str, str], float | None] = {}
    rules: dict[tuple[str, str], dict[str, Any]] = {}
    derived = derive_policy(reports, contract, policy, factor=factor, coverage=coverage,
                            source=source, seen=seen, rules=rules) if reports else None
    if derived is not None:  # the derived document must itself be a valid policy
        policy_from_document({k: v for k, v in derived.items() if k != "comment"}, contract,
                             path=out / "derived-policy.toml")
    return SweepResult(contract=contract, policy=policy, variants=tuple(results),
                       derived=derived, factor=factor, moved=tuple(move), seen=seen,
                       coverage=coverage, rules=rules)


def summary_markdown(result: SweepResult) -> str:
    """The sweep table for a person (``sweep.md``)."""
    lines = [f"# Seed sweep of `{result.contract.name}` ({result.contract.digest12})", "",
             f"Policy `{result.policy.path}` ({(result.policy.digest or '')[:12]}); seeds moved: "
             f"{', '.join(result.moved)}; sweep exit {int(result.exit_code)}.", "",
             "| variant | offset | cells PASS / FAIL | gate exit | cells outside the policy "
             "(first failing quantity) |", "| --- | --- | --- | --- | --- |"]
    for v in result.variants:
        outside = "; ".join(
            f"`{o['cell']}` {o['outcome']}"
            + (f": {o['first'].get('metric')} margin {o['first'].get('margin')}"
               if o.get("first") else f": {o.get('reason')}") for o in v.outside) or "none"
        lines.append(f"| `{v.name}` | {v.offset} | {v.counts.get('PASS', 0)} / "
                     f"{v.counts.get('FAIL', 0)} | "
                     f"{'no report' if v.exit_code is None else v.exit_code} | "
                     f"{markdown_cell(outside)} |")
    if result.unexplained:
        lines += ["", "Failures no committed entry explains (findings to run to their cause): "
                  + ", ".join(f"`{c}`" for c in result.unexplained)]
    if result.derived is not None and result.derived.get("expected_failures"):
        lines += ["", f"Derived ceilings (`qualify.pipeline.sweep.ceiling`: at least "
                  f"{result.factor:g} x the largest margin; from {MIN_SPREAD_RUNS} failing "
                  f"runs the one-sided {result.coverage:g} prediction bound of the next "
                  "failing run's margin if larger):", "",
                  "| cell | family | runs failed | margins (min / max) | ceiling | set by |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for e in result.derived["expected_failures"]:
            key = (e["cells"], e["families"][0])
            rule = result.rules.get(key, {})
            ms = rule.get("margins") or []
            span = f"{min(ms):.3g} / {max(ms):.3g}" if ms else "no margin (check)"
            lines.append(f"| `{e['cells']}` | {e['families'][0]} | {rule.get('runs', 0)} | "
                         f"{span} | {e['max_margin']:g} | {rule.get('rule', 'factor')} |")
    return "\n".join(lines) + "\n"


def write_summary(result: SweepResult, directory: Path) -> tuple[Path, Path]:
    """Write ``sweep.json`` and ``sweep.md`` into ``directory``; return their paths."""
    from qualify.atomic import write_with

    directory.mkdir(parents=True, exist_ok=True)
    js, md = directory / SUMMARY_JSON, directory / SUMMARY_MD
    data = json.dumps(result.to_dict(), indent=1, sort_keys=True) + "\n"
    write_with(js, lambda f: f.write(data.encode("utf-8")))
    text = summary_markdown(result)
    write_with(md, lambda f: f.write(text.encode("utf-8")))
    return js, md
