"""``qualify audit DIR``: one table of every reference and evidence directory below DIR.

Each directory found by :func:`qualify.evidence.discover.find_evidence` becomes one row:
contract, run id, date, source commit, signature status, integrity status (the nine
verification steps of :func:`qualify.evidence.verify.verify`), the gate's decision under
the contract's current policy (``verdict``), the comparator's verdict beneath it and the
cell counts by verdict, cell attempts (failed ones counted, never hidden), the contract's
digest against the committed contract (``contract_digest``: ``STALE`` when the committed
contract changed since sealing), the run's sources
(:func:`qualify.evidence.sources.stale_cells`: ``fresh``, or the STALE cells and the source
files changed since the run; ``not recorded`` for a run made before ``sources.json``) and
every problem found. Stale sources are no problem of the audit (an old run is an honest
record of old code); the gate fails on them. Failed runs are listed as ``FAIL`` (a
verdict, not a problem); incomplete directories (``INCOMPLETE`` marker, no manifest, moved
aside as ``*.incomplete-*``) are listed as ``INCOMPLETE`` and are problems; an interrupted
run a later run superseded (:mod:`qualify.evidence.supersede`) is listed as ``SUPERSEDED``,
a problem only when that run does not confirm it or its files changed since. A
directory whose records :mod:`qualify.jsonio` refused is a problem too (a symbolic link, a
special file such as ``/dev/zero``, an oversized or unparsable document: never read
further). The audit
exits 3 when any problem is found, and 2 when it found nothing to audit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import pandas as pd
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from qualify.display import markdown_cell, printable
from qualify.errors import EvidenceIntegrityError, ExitCode, QualifyError, UsageError
from qualify.evidence import store, supersede
from qualify.evidence.discover import EvidenceDir, find_evidence
from qualify.evidence.keys import trusted_keys
from qualify.evidence.sources import NOT_RECORDED, stale_cells
from qualify.evidence.statement import RUN_KIND
from qualify.evidence.steps import VerificationResult
from qualify.evidence.verify import committed_contract_path, verify
from qualify.jsonio import read_json
from qualify.layout import CELLS_DIR, REPORT_JSON, RESULT_FILE, RUN_FILE

__all__ = ["COLUMNS", "AuditResult", "AuditRow", "audit", "render"]

COLUMNS: Final = ("path", "kind", "contract", "run_id", "date", "source_commit", "signature",
                  "integrity", "verdict", "comparator", "PASS", "FAIL", "ERROR", "NOT_RUN",
                  "attempts",
                  "contract_digest", "sources", "problems")
"""The table's columns, in order."""
VERDICTS: Final = ("PASS", "FAIL", "ERROR", "NOT_RUN")
Format = Literal["table", "json", "md"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AuditRow:
    """One audited directory.

    Attributes:
        path: the directory (relative to the audited root when below it).
        kind: ``reference``, ``candidate-run`` or ``unknown``.
        contract: contract name.
        run_id: a run's id (``""`` for a reference).
        date: run start or reference creation time.
        source_commit: git commit (12 hex, ``+dirty`` if dirty) from the statement.
        signature: ``valid <keyid16>``, ``unsigned``, ``bad envelope``, ``untrusted key``,
            ``invalid`` or ``-`` (incomplete).
        integrity: ``ok``, ``INCOMPLETE``, ``FAILED step N`` or ``manifest ok`` /
            ``manifest BROKEN`` when the signature could not be checked.
        verdict: a run's gate decision (``PASS`` / ``FAIL``) under its committed contract's
            gate policy as ``qualify gate`` finds it now, staleness aside (the ``sources``
            column); the comparator's verdict when the contract has no policy file or is
            not committed; ``-`` for a reference (:func:`_decision`).
        comparator: a run's report result before any policy (``PASS`` / ``FAIL``).
        counts: cells per verdict in the report (the comparator's).
        attempts: cell attempts, ``N (k failed)``.
        contract_digest: the run's or reference's contract digest against the committed
            contract of that name: ``current``, ``STALE``, ``no committed contract`` or
            ``unknown`` (the code's staleness is the ``sources`` column).
        sources: a run's code against this checkout: ``fresh``, ``STALE <n>/<cells> cells:
            <changed files>``, ``not recorded`` (``""`` for a reference).
        problems: every problem found (empty: none).
    """

    path: str
    kind: str
    contract: str
    run_id: str
    date: str
    source_commit: str
    signature: str
    integrity: str
    verdict: str
    counts: Mapping[str, int]
    attempts: str
    contract_digest: str
    problems: tuple[str, ...]
    sources: str = ""
    comparator: str = "-"

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``problems`` as a list)."""
        return {"path": self.path, "kind": self.kind, "contract": self.contract,
                "run_id": self.run_id, "date": self.date, "source_commit": self.source_commit,
                "signature": self.signature, "integrity": self.integrity,
                "verdict": self.verdict, "comparator": self.comparator,
                **{v: int(self.counts.get(v, 0)) for v in VERDICTS},
                "attempts": self.attempts, "contract_digest": self.contract_digest,
                "sources": self.sources, "problems": list(self.problems)}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AuditResult:
    """Every audited directory (``bool()``: no problem found).

    Attributes:
        roots: the audited directories.
        rows: one row per reference or run, sorted by path.
    """

    roots: tuple[Path, ...]
    rows: tuple[AuditRow, ...]

    @property
    def problems(self) -> tuple[str, ...]:
        """``<path>: <problem>`` for every problem."""
        return tuple(f"{r.path}: {p}" for r in self.rows for p in r.problems)

    @property
    def empty(self) -> bool:
        """No reference or run directory was found: nothing was audited."""
        return not self.rows

    @property
    def exit_code(self) -> ExitCode:
        """``INTEGRITY_ERROR`` (a problem), ``USAGE_ERROR`` (nothing to audit), else ``OK``.

        An empty audit is a usage error, exit 2: a wrong path or an emptied tree is no
        clean audit, and nothing was found that could be broken (exit 3 would claim a
        tamper that is not there).
        """
        if self.empty:
            return ExitCode.USAGE_ERROR
        return ExitCode.INTEGRITY_ERROR if self.problems else ExitCode.OK

    def __bool__(self) -> bool:
        return not self.empty and not self.problems

    def frame(self) -> pd.DataFrame:
        """The table (problems joined by `` | ``)."""
        rows = []
        for r in self.rows:
            d = r.to_dict()
            d["problems"] = " | ".join(r.problems) if r.problems else ""
            rows.append(d)
        return pd.DataFrame(rows, columns=list(COLUMNS))


def _signature(v: VerificationResult) -> str:
    s1, s2 = v.steps[0], v.steps[1]
    if s1.status == "failed":
        return "unsigned" if "missing" in s1.detail or "unsigned" in s1.detail \
            else "bad envelope"
    if s2.status == "failed":
        return "untrusted key" if "not a trusted key" in s2.detail else "invalid"
    return "valid " + ",".join(k[:16] for k in v.keyids)


def _integrity(v: VerificationResult, d: Path) -> tuple[str, list[str]]:
    """Integrity column and extra problems (manifest check when unsigned)."""
    failed = [s for s in v.steps[2:] if s.status == "failed"]
    if failed:
        return f"FAILED step {failed[0].number}", []
    if v.steps[2].status == "passed":
        return "ok", []
    problems = store.verify_manifest(d)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return "manifest BROKEN", [f"manifest: {problems[0]}{more}"]
    return "manifest ok", []


def _attempts(d: Path) -> str:
    cells = d / CELLS_DIR
    if not cells.is_dir():
        return ""
    total = failed = 0
    for cell in sorted(cells.iterdir()):
        for a in store.attempts(cell):
            total += 1
            result: Any = {}
            sealed = not store.is_incomplete(a)
            try:
                store.read_manifest(a)
            except EvidenceIntegrityError:
                sealed = False
            with contextlib.suppress(FileNotFoundError, EvidenceIntegrityError):
                result = read_json(a / RESULT_FILE)
            status = result.get("status") if isinstance(result, dict) else "unreadable"
            if not sealed or status not in (None, "COMPLETE"):
                failed += 1
    return f"{total} ({failed} failed)" if total else "0"


def _contract_digest(e: EvidenceDir, digest: str | None,
                     contracts_dir: str | Path | None) -> tuple[str, str | None]:
    """The ``contract_digest`` column and the problem, if stale."""
    from qualify.contract import load_contract

    if not e.contract:
        return "unknown", None
    path = committed_contract_path(e.contract, contracts_dir=contracts_dir)
    if path is None:
        return "no committed contract", f"no committed contract {e.contract}.toml"
    try:
        committed = load_contract(path).digest
    except QualifyError as exc:
        return "unknown", f"committed contract {path}: {exc}"
    if digest is None:
        return "unknown", None
    if committed != digest:
        return "STALE", (f"stale: {path} is now {committed[:12]}, the evidence is for "
                         f"{digest[:12]}")
    return "current", None


def _sources(d: Path, source_root: str | Path | None) -> str:
    """The ``sources`` column of a run (see :class:`AuditRow`)."""
    try:
        stale = stale_cells(d, source_root)
        n = len(read_json(d / RUN_FILE).get("cells", {}))
    except (OSError, EvidenceIntegrityError, AttributeError) as exc:
        return f"unreadable: {exc}"
    if not stale:
        return "fresh"
    if all(v == [NOT_RECORDED] for v in stale.values()):
        return NOT_RECORDED
    files = sorted({f for fs in stale.values() for f in fs})
    more = f" (and {len(files) - 4} more)" if len(files) > 4 else ""
    return f"STALE {len(stale)}/{n} cells: {', '.join(files[:4])}{more}"


def _report(d: Path) -> dict[str, Any]:
    try:
        doc = read_json(d / REPORT_JSON)
    except EvidenceIntegrityError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _decision(e: EvidenceDir, report: Mapping[str, Any], raw: str,
              contracts_dir: str | Path | None) -> tuple[str, str | None]:
    """``(verdict, problem)``: the gate's decision on ``report`` under today's policy.

    The policy of the committed contract of the run's name, found as ``qualify gate``
    finds it (``contracts/gates/<name>.toml`` beside it); staleness is the ``sources``
    column's. The comparator's verdict when there is no report, no committed contract of
    that digest (the gate would not judge the run by it) or no policy file; an invalid
    policy file is a problem.
    """
    from qualify.contract import load_contract
    from qualify.evidence.decision import section_code
    from qualify.evidence.policy import all_cells, evaluate, policy_for

    path = committed_contract_path(e.contract, contracts_dir=contracts_dir) \
        if report and e.contract else None
    try:
        contract = load_contract(path) if path is not None else None
        if contract is None or contract.digest != report.get("contract_digest"):
            return raw, None
        policy = policy_for(contract)
    except QualifyError as exc:
        return raw, f"gate policy: {exc}"
    ev = evaluate(report, policy, cells=all_cells(contract))
    code = section_code(policy, ev, bool(report.get("passed")))
    return ("PASS" if code == ExitCode.OK else "FAIL"), None


def _row(e: EvidenceDir, root: Path, *, keys: Any, contracts_dir: str | Path | None,
         source_root: str | Path | None = None) -> AuditRow:
    try:
        rel = e.path.relative_to(root).as_posix() if e.path != root else e.path.name
    except ValueError:
        rel = str(e.path)
    problems: list[str] = []
    signature = integrity = "-"
    commit = ""
    digest = e.contract_digest
    step6_ran = False
    if e.superseded_by is not None:  # kept whole; a problem only if unconfirmed
        integrity = "SUPERSEDED"
        _, problem = supersede.check(e.path)
        problems += [f"superseded marker not confirmed: {problem}"] if problem else []
        problems += [f"refused: {p}" for p in e.problems]
    elif e.state == "incomplete":
        integrity = "INCOMPLETE"
        problems.append(f"incomplete: {e.reason}")
        problems += [f"refused: {p}" for p in e.problems]
    else:
        v = verify(e.path, trusted=keys, contracts_dir=contracts_dir)
        signature = _signature(v)
        integrity, extra = _integrity(v, e.path)
        problems += list(v.problems) + extra
        if not problems:
            problems += [f"refused: {p}" for p in e.problems]
        if e.problems and integrity == "ok":
            integrity = "UNREADABLE"
        step6_ran = v.steps[5].status in ("passed", "failed")
        if v.statement is not None:
            pred = v.statement["predicate"]
            digest = pred["contract"]["digest"]
            src = pred["source"]
            commit = (str(src.get("commit") or "")[:12] + ("+dirty" if src.get("dirty") else ""))
    contract_state, stale_problem = _contract_digest(e, digest, contracts_dir)
    if stale_problem and not step6_ran and e.superseded_by is None:
        problems.append(stale_problem)  # a superseded run may be of an older contract
    report = _report(e.path) if e.kind == RUN_KIND else {}
    counts = dict.fromkeys(VERDICTS, 0)
    for c in report.get("cells", []):
        if isinstance(c, dict) and c.get("verdict") in counts:
            counts[str(c["verdict"])] += 1
    verdict = raw = "-"
    if e.superseded_by is not None:
        verdict = f"superseded by {e.superseded_by}"
    elif e.kind == RUN_KIND:
        raw = ("PASS" if report.get("passed") else "FAIL") if report else "no report"
        verdict, why = _decision(e, report, raw, contracts_dir)
        problems += [why] if why else []
    return AuditRow(path=rel, kind=e.kind, contract=e.contract or "", run_id=e.run_id or "",
                    date=e.date or "", source_commit=commit, signature=signature,
                    integrity=integrity, verdict=verdict, comparator=raw, counts=counts,
                    attempts=_attempts(e.path) if e.kind == RUN_KIND else "",
                    contract_digest=contract_state, problems=tuple(problems),
                    sources=_sources(e.path, source_root)
                    if e.kind == RUN_KIND and e.state == "sealed" else "")


def audit(roots: str | Path | Sequence[str | Path], *,
          trusted: Mapping[str, Ed25519PublicKey] | None = None,
          trusted_keys_dir: str | Path | None = None,
          contracts_dir: str | Path | None = None,
          source_root: str | Path | None = None) -> AuditResult:
    """Audit every reference and evidence directory at or below ``roots``.

    Args:
        roots: one directory or several.
        trusted: trusted keys (``qualify audit --trust-from``:
            :func:`qualify.evidence.trust.root_keys`); default: those of
            ``trusted_keys_dir``.
        trusted_keys_dir: trusted ``*.pub`` directory (default ``contracts/keys``).
        contracts_dir: committed contracts (default ``./contracts``, then qualify's).
        source_root: the code runs' ``sources.json`` is compared with (default: the code
            this process runs).

    Returns:
        The :class:`AuditResult` (problems are rows' content, never raised).

    Raises:
        UsageError: a root is not a directory, or a trusted key file is malformed.
    """
    rs = [Path(roots)] if isinstance(roots, str | os.PathLike) else [Path(r) for r in roots]
    for r in rs:
        if not r.is_dir():
            raise UsageError(f"{r}: not a directory")
    keys = trusted if trusted is not None else trusted_keys(trusted_keys_dir)
    rows = [_row(e, r, keys=keys, contracts_dir=contracts_dir, source_root=source_root)
            for r in rs for e in find_evidence(r)]
    return AuditResult(roots=tuple(rs), rows=tuple(rows))


def render(result: AuditResult, fmt: Format = "table") -> str:
    """Render the audit as a text table, Markdown table or JSON.

    Args:
        result: the audit.
        fmt: ``table`` (pandas text), ``md`` (pandas/tabulate Markdown) or ``json``;
            every cell of a table is :func:`~qualify.display.printable` (``md`` also
            escapes ``|``).

    Returns:
        The text (a trailing summary line for ``table`` and ``md``).
    """
    if result.empty:
        line = ("qualify audit: nothing to audit: no reference or candidate-run directory "
                f"under {', '.join(map(printable, result.roots))}")
        if fmt == "json":
            return json.dumps({"roots": [str(r) for r in result.roots],
                               "exit_code": int(result.exit_code), "rows": [],
                               "message": line}, indent=2)
        return line
    n = len(result.problems)
    summary = (f"{len(result.rows)} directories audited, {n} problem(s)"
               + ("" if n else ": all intact"))
    if fmt == "json":
        return json.dumps({"roots": [str(r) for r in result.roots],
                           "exit_code": int(result.exit_code),
                           "rows": [r.to_dict() for r in result.rows]}, indent=2)
    df = result.frame()
    if df.empty:
        return summary
    # every cell one visible line: a name holding a newline or an escape forges nothing
    escape = markdown_cell if fmt == "md" else printable
    df = df.map(lambda v: escape(v) if isinstance(v, str) else v)
    if fmt == "md":
        return str(df.to_markdown(index=False)) + "\n\n" + summary
    with pd.option_context("display.max_colwidth", None, "display.width", 10_000):
        return str(df.to_string(index=False)) + "\n\n" + summary
