"""``qualify gate``: the CI merge decision on committed, signed evidence.

For each ``--contract``, the newest candidate run of that contract under the evidence
directory is verified (:func:`qualify.evidence.verify.verify`, all nine steps, the contract digest
against that committed contract file) and its report is read. The gate's exit code:

- ``3`` (:attr:`~qualify.errors.ExitCode.INTEGRITY_ERROR`): a verification step failed;
  the newest run is incomplete (not sealed and signed); a run directory of the contract
  carries the ``INCOMPLETE`` marker; or a directory under the evidence directory is
  unreadable evidence (a record refused by :mod:`qualify.jsonio`: a symbolic link, a
  special file, an oversized or unparsable document), see :func:`blocking_dirs`;
- ``1`` (:attr:`~qualify.errors.ExitCode.QUALIFICATION_FAILED`): no run for a contract, or
  a required cell is not ``PASS``; required cells are the contract's
  ``matrix.required_cells``, else every cell of its matrix. A cell matching an
  ``--allow-not-run`` glob may be ``NOT_RUN`` (for example CUDA-only engines on a CPU
  runner), as the verified report must show it; any other verdict of it still fails;
- ``0``: otherwise.

Several contracts combine by the worst code (3 over 1 over 0). The decision is written as
JSON (``contracts/schema/gate.schema.json``) and summarised for a human.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from qualify.contract import Contract, load_contract
from qualify.errors import ExitCode, UsageError
from qualify.evidence import store
from qualify.evidence.discover import EvidenceDir, find_evidence
from qualify.evidence.statement import RUN_KIND
from qualify.evidence.steps import VerificationResult
from qualify.evidence.timestamps import utc_now_iso
from qualify.evidence.verify import verify
from qualify.jsonio import read_json
from qualify.layout import INCOMPLETE_INFIX, REPORT_JSON

__all__ = [
    "GATE_SCHEMA",
    "CellDecision",
    "ContractDecision",
    "GateResult",
    "blocking_dirs",
    "gate",
    "latest_run",
    "required_cells",
]

GATE_SCHEMA: Final = "gate"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CellDecision:
    """The gate's view of one required cell.

    Attributes:
        cell: cell id.
        verdict: the verified report's verdict (``NOT_RUN`` when absent from it).
        allowed_not_run: the glob that allows it to be ``NOT_RUN`` (``None``: none matches).
        ok: ``PASS``, or ``NOT_RUN`` allowed by policy.
        reason: the report's reason for a verdict other than ``PASS``.
    """

    cell: str
    verdict: str
    allowed_not_run: str | None
    ok: bool
    reason: str | None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"cell": self.cell, "verdict": self.verdict,
                "allowed_not_run": self.allowed_not_run, "ok": self.ok, "reason": self.reason}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ContractDecision:
    """The gate's decision for one contract.

    Attributes:
        contract: contract name.
        contract_path: the committed contract file.
        contract_digest: its digest.
        run_dir: the newest run (``None`` when there is none).
        run_id: its id.
        verification: the verification of ``run_dir`` (``None`` when not verified).
        cells: the required cells.
        exit_code: 0, 1 or 3.
        message: one line for a human.
    """

    contract: str
    contract_path: Path
    contract_digest: str
    run_dir: Path | None
    run_id: str | None
    verification: VerificationResult | None
    cells: tuple[CellDecision, ...]
    exit_code: ExitCode
    message: str

    @property
    def failed_cells(self) -> tuple[str, ...]:
        """Required cells that are neither ``PASS`` nor an allowed ``NOT_RUN``."""
        return tuple(c.cell for c in self.cells if not c.ok)

    @property
    def allowed_not_run(self) -> tuple[str, ...]:
        """Required cells that are ``NOT_RUN`` and allowed by policy."""
        return tuple(c.cell for c in self.cells if c.ok and c.verdict == "NOT_RUN")

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"contract": self.contract, "contract_path": str(self.contract_path),
                "contract_digest": self.contract_digest,
                "run_dir": str(self.run_dir) if self.run_dir else None, "run_id": self.run_id,
                "exit_code": int(self.exit_code), "message": self.message,
                "verification": None if self.verification is None
                else self.verification.to_dict(),
                "cells": [c.to_dict() for c in self.cells],
                "failed_cells": list(self.failed_cells),
                "allowed_not_run": list(self.allowed_not_run)}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GateResult:
    """The gate's decision over every contract (``bool()`` is :attr:`passed`).

    Attributes:
        evidence_dir: the directory searched.
        allow_not_run: the policy globs.
        contracts: one decision per contract, in command-line order.
        created: when the decision was made (ISO-8601 UTC).
    """

    evidence_dir: Path
    allow_not_run: tuple[str, ...]
    contracts: tuple[ContractDecision, ...]
    created: str

    @property
    def exit_code(self) -> ExitCode:
        """The worst contract's code: 3 over 1 over 0."""
        codes = [c.exit_code for c in self.contracts] or [ExitCode.QUALIFICATION_FAILED]
        if ExitCode.INTEGRITY_ERROR in codes:
            return ExitCode.INTEGRITY_ERROR
        return max(codes)

    @property
    def passed(self) -> bool:
        """Exit code 0."""
        return self.exit_code == ExitCode.OK

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict[str, Any]:
        """The gate JSON document (schema ``gate.schema.json``)."""
        result = {ExitCode.OK: "PASS", ExitCode.QUALIFICATION_FAILED: "FAIL",
                  ExitCode.INTEGRITY_ERROR: "INTEGRITY_ERROR"}[self.exit_code]
        return {"schema_version": 1, "created": self.created,
                "evidence_dir": str(self.evidence_dir), "result": result,
                "exit_code": int(self.exit_code),
                "policy": {"allow_not_run": list(self.allow_not_run)},
                "contracts": [c.to_dict() for c in self.contracts]}

    def summary_lines(self) -> list[str]:
        """The short human summary printed on stdout."""
        word = {ExitCode.OK: "PASS", ExitCode.QUALIFICATION_FAILED: "FAIL",
                ExitCode.INTEGRITY_ERROR: "INTEGRITY ERROR"}[self.exit_code]
        out = [f"qualify gate: {word} (exit {int(self.exit_code)})"]
        for c in self.contracts:
            out.append(f"[{c.contract} {c.contract_digest[:12]}] {c.message}")
            v = c.verification
            if v is not None and not v.passed:
                out += [f"  {p}" for p in v.problems]
            for cell in c.cells:
                if cell.ok and cell.verdict == "PASS":
                    continue
                if cell.ok:
                    out.append(f"  NOT_RUN  {cell.cell}: allowed by --allow-not-run "
                               f"{cell.allowed_not_run!r} ({cell.reason})")
                else:
                    out.append(f"  {cell.verdict:<8} {cell.cell}: {cell.reason}")
        return out


def required_cells(contract: Contract) -> list[str]:
    """``matrix.required_cells`` if the contract sets it, else every cell of the matrix."""
    if contract.matrix.required_cells is not None:
        return list(contract.matrix.required_cells)
    return [c.cell_id for c in contract.matrix.cells()]


def _runs_of(found: Sequence[EvidenceDir], contract_name: str) -> list[EvidenceDir]:
    return [e for e in found if e.kind == RUN_KIND and e.contract == contract_name
            and INCOMPLETE_INFIX not in e.path.name]


def latest_run(evidence_dir: str | Path, contract_name: str) -> EvidenceDir | None:
    """The newest candidate run of ``contract_name`` at or below ``evidence_dir``.

    Moved-aside ``*.incomplete-*`` directories are never chosen; any other incomplete run
    is (and then fails the gate). Newest = latest ``run.json`` ``started``, then name.
    """
    runs = _runs_of(find_evidence(evidence_dir), contract_name)
    if not runs:
        return None
    return max(runs, key=lambda e: (e.date or "", e.path.name))


def blocking_dirs(found: Sequence[EvidenceDir], contract_name: str, *,
                  chosen: EvidenceDir | None = None) -> list[tuple[EvidenceDir, str]]:
    """Directories beside the gated run that fail the gate of ``contract_name``.

    An unsealed directory of this contract, or of no known contract, that carries the
    ``INCOMPLETE`` marker (a run being written or interrupted, committed as evidence), and
    any directory whose records were refused (:attr:`EvidenceDir.problems`: a symbolic
    link, special file, oversized or unparsable document: a hostile or broken stray
    directory) are integrity errors. Moved-aside ``*.incomplete-*`` directories with
    readable records are not. ``chosen`` (the newest run, verified in full) is left out.

    Returns:
        ``(directory, why)`` pairs, sorted by path.
    """
    out: list[tuple[EvidenceDir, str]] = []
    for e in found:
        if chosen is not None and e.path == chosen.path:
            continue
        if e.contract not in (None, contract_name) and not e.problems:
            continue
        if e.problems:
            out.append((e, "unreadable evidence directory: " + "; ".join(e.problems)))
        elif e.state == "incomplete" and e.marker and INCOMPLETE_INFIX not in e.path.name:
            out.append((e, f"incomplete: {e.reason}"))
    return sorted(out, key=lambda x: str(x[0].path))


def _decide(evidence_dir: Path, contract_path: Path, allow: Sequence[str], *,
            trusted_keys_dir: str | Path | None,
            reference_dir: str | Path | None) -> ContractDecision:
    contract = load_contract(contract_path)
    found = find_evidence(evidence_dir)
    runs = _runs_of(found, contract.name)
    run = max(runs, key=lambda e: (e.date or "", e.path.name)) if runs else None
    blocking = blocking_dirs(found, contract.name, chosen=run)

    def decision(*, code: ExitCode, message: str, verification: VerificationResult | None = None,
                 cells: Sequence[CellDecision] = ()) -> ContractDecision:
        return ContractDecision(contract=contract.name, contract_path=contract_path,
                                contract_digest=contract.digest,
                                run_dir=run.path if run else None,
                                run_id=run.run_id if run else None, verification=verification,
                                cells=tuple(cells), exit_code=code, message=message)

    if blocking:
        blocker, why = blocking[0]
        more = f" (and {len(blocking) - 1} more)" if len(blocking) > 1 else ""
        return decision(code=ExitCode.INTEGRITY_ERROR,
                        message=f"{blocker.path}: {why}{more}")
    if run is None:
        return decision(code=ExitCode.QUALIFICATION_FAILED,
                        message=f"no candidate run of {contract.name} under {evidence_dir}")
    if run.state != "sealed":
        return decision(code=ExitCode.INTEGRITY_ERROR,
                        message=f"newest run {run.path} is incomplete: {run.reason}")
    result = verify(run.path, trusted_keys_dir=trusted_keys_dir, contract=contract_path,
                    reference_dir=reference_dir)
    if not result.passed:
        first = result.failed_steps[0] if result.failed_steps else None
        what = f"step {first.number} ({first.name})" if first else "verification"
        return decision(code=ExitCode.INTEGRITY_ERROR, verification=result,
                        message=f"run {run.path} fails verification at {what}")
    report = read_json(run.path / REPORT_JSON)
    by_id = {str(c.get("cell")): c for c in report.get("cells", [])}
    cells: list[CellDecision] = []
    for cid in required_cells(contract):
        entry = by_id.get(cid)
        verdict = str(entry.get("verdict")) if entry else "NOT_RUN"
        reason = (entry.get("reason") if entry else "absent from the report") or None
        glob = next((g for g in allow if fnmatch.fnmatchcase(cid, g)), None)
        ok = verdict == "PASS" or (verdict == "NOT_RUN" and glob is not None)
        cells.append(CellDecision(cell=cid, verdict=verdict, allowed_not_run=glob, ok=ok,
                                  reason=reason))
    bad = [c.cell for c in cells if not c.ok]
    n_pass = sum(c.verdict == "PASS" for c in cells)
    n_allowed = sum(c.ok and c.verdict == "NOT_RUN" for c in cells)
    keyids = ", ".join(k[:16] for k in result.keyids)
    head = (f"run {run.path} verified (9 steps, keyid {keyids}); {len(cells)} required "
            f"cells: {n_pass} PASS, {n_allowed} NOT_RUN allowed by policy")
    if bad:
        return decision(code=ExitCode.QUALIFICATION_FAILED, verification=result, cells=cells,
                        message=f"{head}, {len(bad)} not passed: {', '.join(bad)}")
    return decision(code=ExitCode.OK, verification=result, cells=cells, message=head)


def gate(evidence_dir: str | Path, contracts: Sequence[str | Path], *,
         allow_not_run: Sequence[str] = (), trusted_keys_dir: str | Path | None = None,
         reference_dir: str | Path | None = None, json_out: str | Path | None = None,
         ) -> GateResult:
    """Decide whether committed evidence qualifies every contract.

    Args:
        evidence_dir: a run directory, or a directory holding runs (``evidence/``).
        contracts: committed contract files (at least one).
        allow_not_run: cell-id globs (``fnmatch``) that may be ``NOT_RUN``.
        trusted_keys_dir: trusted ``*.pub`` directory (default ``contracts/keys``).
        reference_dir: the reference of the runs (default from each ``run.json``).
        json_out: write the decision JSON there (validated against ``gate.schema.json``).

    Returns:
        The :class:`GateResult`; integrity problems are reported there, never raised.

    Raises:
        ContractError: a contract file is missing or invalid.
        UsageError: no contract given, or a trusted key file is malformed.
    """
    if not contracts:
        raise UsageError("gate: give at least one --contract")
    ev = Path(evidence_dir)
    if not ev.is_dir():
        raise UsageError(f"{ev}: evidence directory not found")
    decisions = tuple(_decide(ev, Path(c), list(allow_not_run),
                              trusted_keys_dir=trusted_keys_dir, reference_dir=reference_dir)
                      for c in contracts)
    result = GateResult(evidence_dir=ev, allow_not_run=tuple(allow_not_run),
                        contracts=decisions, created=utc_now_iso())
    if json_out is not None:
        store.atomic_write_json(json_out, result.to_dict(), schema=GATE_SCHEMA)
    return result
