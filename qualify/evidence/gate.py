"""``qualify gate``: the CI merge decision on committed, signed evidence.

For each ``--contract``, the newest candidate run of that contract under the evidence
directory is verified (:func:`qualify.evidence.verify.verify`, all nine steps, the contract digest
against that committed contract file) and its report is read. The gate's exit code:

- ``3`` (:attr:`~qualify.errors.ExitCode.INTEGRITY_ERROR`): a verification step failed;
  the newest run is incomplete (not sealed and signed); a run directory of the contract
  carries the ``INCOMPLETE`` marker (unless a later run superseded it and confirms so,
  :mod:`qualify.evidence.supersede`); or a directory under the evidence directory is
  unreadable evidence (a record refused by :mod:`qualify.jsonio`: a symbolic link, a
  special file, an oversized or unparsable document), see :func:`blocking_dirs`;
- ``1`` (:attr:`~qualify.errors.ExitCode.QUALIFICATION_FAILED`): no run for a contract, or
  a required cell offends the contract's gate policy (:mod:`qualify.evidence.policy`:
  ``contracts/gates/<name>.toml`` beside the contract, or ``--policy``; without one,
  required cells are ``matrix.required_cells``, else every cell, and nothing is expected
  to fail): a ``FAIL`` outside its expected families, a ``NOT_RUN`` without an allowance,
  an expected failure that passes (``XPASS``), or a ``STALE`` cell (a source file it
  executed changed since the run, :func:`qualify.evidence.sources.stale_cells`; a run
  without ``sources.json`` cannot prove freshness). A cell matching an ``--allow-not-run``
  glob may also be ``NOT_RUN`` (for example CUDA-only engines on a CPU runner);
- ``0``: otherwise.

A policy edited since the run (its digest differs from the one the run recorded in
``sources.json``) is reported ("policy edited since the run ... evaluating with the current
policy") and the current policy decides: a policy is updated without re-running.

With ``trust_from`` (``qualify gate --trust-from ROOT``: a git ref such as the merge base,
or a directory outside the checkout; :mod:`qualify.evidence.trust`), the trusted keys, the
gate policy and the contract come from that protected root, never from the change being
judged. A change whose ``contracts/keys/`` holds a key the root does not trust, or whose
gate policy or contract differs from the root's, is refused with exit ``3`` (one line per
file: :attr:`ContractDecision.trust_changes`); the evidence is still verified and
evaluated under the root's keys and policy, and that outcome is reported in the message
(not when the contract itself differs: then it is not judged). Without ``trust_from`` the
checkout is its own trust root. The root used heads the summary and is in the JSON.

Several contracts combine by the worst code (3 over 1 over 0). The decision is written as
JSON (``contracts/schema/gate.schema.json``) and summarised for a human.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from qualify.contract import Contract, load_contract
from qualify.display import printable_lines
from qualify.errors import EvidenceIntegrityError, ExitCode, UsageError
from qualify.evidence import store, supersede
from qualify.evidence.discover import EvidenceDir, find_evidence
from qualify.evidence.policy import CellOutcome, Policy, all_cells, evaluate, policy_for
from qualify.evidence.sources import recorded_policy_digest, stale_cells
from qualify.evidence.statement import RUN_KIND
from qualify.evidence.steps import VerificationResult
from qualify.evidence.timestamps import utc_now_iso
from qualify.evidence.trust import (
    CHECKOUT,
    TrustChange,
    TrustCheck,
    TrustRoot,
    check_change,
    resolve_trust_root,
)
from qualify.evidence.verify import verify
from qualify.jsonio import read_json
from qualify.layout import INCOMPLETE_INFIX, REPORT_JSON, REPORT_MD

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


CellDecision = CellOutcome
"""The gate's view of one cell (:class:`qualify.evidence.policy.CellOutcome`)."""


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
        cells: every cell's outcome under the policy (required and not).
        exit_code: 0, 1 or 3.
        message: one line for a human.
        policy: the policy applied (``None`` when it was not reached).
        notes: further lines for a human (an edited policy, ...).
        trust_changes: checkout files that alter the trust root (``--trust-from``): the
            gate refuses the change (exit 3) when any.
    """

    contract: str
    contract_path: Path
    contract_digest: str
    run_dir: Path | None
    run_id: str | None
    verification: VerificationResult | None
    cells: tuple[CellOutcome, ...]
    exit_code: ExitCode
    message: str
    policy: Policy | None = None
    notes: tuple[str, ...] = ()
    trust_changes: tuple[TrustChange, ...] = ()

    @property
    def failed_cells(self) -> tuple[str, ...]:
        """Required cells whose outcome fails the gate (FAIL, unallowed NOT_RUN, XPASS, ...)."""
        return tuple(c.cell for c in self.cells if c.required and not c.ok)

    @property
    def allowed_not_run(self) -> tuple[str, ...]:
        """Required cells that are ``NOT_RUN`` and allowed by policy."""
        return tuple(c.cell for c in self.cells
                     if c.required and c.ok and c.outcome == "NOT_RUN")

    @property
    def report_md(self) -> Path | None:
        """The run's ``report.md`` (``None`` without a run)."""
        return self.run_dir / REPORT_MD if self.run_dir is not None else None

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
                "allowed_not_run": list(self.allowed_not_run),
                "policy": None if self.policy is None else self.policy.to_dict(),
                "notes": list(self.notes),
                "trust_changes": [t.to_dict() for t in self.trust_changes]}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GateResult:
    """The gate's decision over every contract (``bool()`` is :attr:`passed`).

    Attributes:
        evidence_dir: the directory searched.
        allow_not_run: the policy globs.
        contracts: one decision per contract, in command-line order.
        created: when the decision was made (ISO-8601 UTC).
        trust_root: where the keys, policy and contract came from.
    """

    evidence_dir: Path
    allow_not_run: tuple[str, ...]
    contracts: tuple[ContractDecision, ...]
    created: str
    trust_root: TrustRoot = CHECKOUT

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
                "trust_root": self.trust_root.to_dict(),
                "contracts": [c.to_dict() for c in self.contracts]}

    def summary_lines(self) -> list[str]:
        """The plain-text summary, one :func:`~qualify.display.printable` line per item.

        The rich table is :mod:`qualify.cli.summary`'s.
        """
        word = {ExitCode.OK: "PASS", ExitCode.QUALIFICATION_FAILED: "FAIL",
                ExitCode.INTEGRITY_ERROR: "INTEGRITY ERROR"}[self.exit_code]
        out = [f"qualify gate: {word} (exit {int(self.exit_code)})", self.trust_root.line]
        for c in self.contracts:
            out.append(f"[{c.contract} {c.contract_digest[:12]}] {c.message}")
            out += [f"  trust: {t.line}" for t in c.trust_changes]
            out += [f"  note: {n}" for n in c.notes]
            v = c.verification
            if v is not None and not v.passed:
                out += [f"  {p}" for p in v.problems]
            for cell in c.cells:
                if not cell.required or cell.outcome == "PASS":
                    continue
                if cell.outcome == "NOT_RUN" and cell.ok:
                    out.append(f"  NOT_RUN  {cell.cell}: allowed by {cell.allowed_not_run!r} "
                               f"({cell.reason})")
                else:
                    out.append(f"  {cell.outcome:<8} {cell.cell}: {cell.reason}")
        return printable_lines(out)


def required_cells(contract: Contract) -> list[str]:
    """The default policy's required cells: ``matrix.required_cells``, else every cell."""
    if contract.matrix.required_cells is not None:
        return list(contract.matrix.required_cells)
    return all_cells(contract)


def _runs_of(found: Sequence[EvidenceDir], contract_name: str) -> list[EvidenceDir]:
    """The runs the gate may choose: never moved-aside nor superseded (unsealed) runs."""
    return [e for e in found if e.kind == RUN_KIND and e.contract == contract_name
            and INCOMPLETE_INFIX not in e.path.name and e.superseded_by is None]


def latest_run(evidence_dir: str | Path, contract_name: str) -> EvidenceDir | None:
    """The newest candidate run of ``contract_name`` at or below ``evidence_dir``.

    Moved-aside ``*.incomplete-*`` directories and superseded runs are never chosen; any
    other incomplete run is (and then fails the gate). Newest = latest ``run.json``
    ``started``, then name.
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
    readable records are not, nor is an unsealed run superseded by a later one
    (``superseded.json``) when that run confirms it in its ``run.json``
    (:func:`qualify.evidence.supersede.check`); an unconfirmed marker is an integrity
    error. ``chosen`` (the newest run, verified in full) is left out.

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
        elif e.superseded_by is not None:
            _, problem = supersede.check(e.path, listing=False)
            if problem is not None:
                out.append((e, f"superseded marker not confirmed: {problem}"))
        elif e.state == "incomplete" and e.marker and INCOMPLETE_INFIX not in e.path.name:
            out.append((e, f"incomplete: {e.reason}"))
    return sorted(out, key=lambda x: str(x[0].path))


def _policy_note(run_dir: Path, policy: Policy) -> str | None:
    """A line when the policy differs from the one the run recorded (``None``: same)."""
    recorded, digest = recorded_policy_digest(run_dir)
    if not recorded or digest == policy.digest:
        return None
    was = digest[:12] if digest else "none"
    now = policy.digest[:12] if policy.digest else "none"
    return (f"policy edited since the run (recorded {was}, now {now}): evaluating with the "
            "current policy")


def _evaluate(run_dir: Path, contract: Contract, policy: Policy, allow: Sequence[str], *,
              sources_root: str | Path | None) -> tuple[tuple[CellOutcome, ...], list[str]]:
    """Every cell's outcome on a verified run, and the notes (edited policy)."""
    report = read_json(run_dir / REPORT_JSON)
    stale = stale_cells(run_dir, sources_root)
    note = _policy_note(run_dir, policy)
    ev = evaluate(report, policy, allow_not_run=allow, stale=stale, cells=all_cells(contract))
    return ev.cells, [note] if note else []


def _decide(evidence_dir: Path, contract_path: Path, allow: Sequence[str], *,
            trusted_keys_dir: str | Path | None, reference_dir: str | Path | None,
            policy_path: str | Path | None,
            sources_root: str | Path | None,
            trust: TrustCheck | None = None) -> ContractDecision:
    contract = load_contract(contract_path)
    policy = trust.policy if trust is not None else policy_for(contract, policy_path)
    found = find_evidence(evidence_dir)
    runs = _runs_of(found, contract.name)
    run = max(runs, key=lambda e: (e.date or "", e.path.name)) if runs else None
    blocking = blocking_dirs(found, contract.name, chosen=run)

    def decision(*, code: ExitCode, message: str, verification: VerificationResult | None = None,
                 cells: Sequence[CellOutcome] = (), notes: Sequence[str] = ()
                 ) -> ContractDecision:
        return ContractDecision(contract=contract.name, contract_path=contract_path,
                                contract_digest=contract.digest,
                                run_dir=run.path if run else None,
                                run_id=run.run_id if run else None, verification=verification,
                                cells=tuple(cells), exit_code=code, message=message,
                                policy=policy, notes=tuple(notes))

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
                    reference_dir=reference_dir,
                    trusted=trust.trusted if trust is not None else None)
    if not result.passed:
        first = result.failed_steps[0] if result.failed_steps else None
        what = f"step {first.number} ({first.name})" if first else "verification"
        return decision(code=ExitCode.INTEGRITY_ERROR, verification=result,
                        message=f"run {run.path} fails verification at {what}")
    try:
        cells, notes = _evaluate(run.path, contract, policy, allow, sources_root=sources_root)
    except EvidenceIntegrityError as exc:
        return decision(code=ExitCode.INTEGRITY_ERROR, verification=result,
                        message=f"run {run.path}: {exc}")
    req = [c for c in cells if c.required]
    bad = [c.cell for c in req if not c.ok]
    counts = ", ".join(f"{sum(c.outcome == o for c in req)} {o}"
                       for o in ("PASS", "XFAIL", "NOT_RUN", "FAIL", "XPASS", "STALE")
                       if any(c.outcome == o for c in req))
    n_allowed = sum(c.ok and c.outcome == "NOT_RUN" for c in req)
    keyids = ", ".join(k[:16] for k in result.keyids)
    pol = f"policy {policy.path} ({policy.digest[:12]})" if policy.path and policy.digest \
        else "no policy file"
    head = (f"run {run.path} verified (9 steps, keyid {keyids}); {pol}; {len(req)} required "
            f"cells: {counts} ({n_allowed} NOT_RUN allowed by policy)")
    return decision(code=ExitCode.QUALIFICATION_FAILED if bad else ExitCode.OK,
                    verification=result, cells=cells, notes=notes,
                    message=f"{head}, {len(bad)} not passed: {', '.join(bad)}" if bad else head)


def _decide_from_root(evidence_dir: Path, contract_path: Path, allow: Sequence[str],
                      root: TrustRoot, *, reference_dir: str | Path | None,
                      sources_root: str | Path | None) -> ContractDecision:
    """:func:`_decide` with keys, policy and contract from ``root``; a change refused."""
    contract = load_contract(contract_path)
    check = check_change(root, contract_path, contract)
    n = len(check.changes)
    refused = (f"refused: {n} trust file{'s' if n != 1 else ''} of this change "
               f"{'differ' if n != 1 else 'differs'} from the trust root {root.name}, which "
               "alone decides keys, policy and contract (land such a change there first, "
               "docs/ci-gating.md)")
    if check.contract_changed:
        return ContractDecision(contract=contract.name, contract_path=contract_path,
                                contract_digest=contract.digest, run_dir=None, run_id=None,
                                verification=None, cells=(),
                                exit_code=ExitCode.INTEGRITY_ERROR, policy=check.policy,
                                message=f"{refused}; the contract differs, so the evidence "
                                        "is not judged", notes=check.notes,
                                trust_changes=check.changes)
    d = _decide(evidence_dir, contract_path, allow, trusted_keys_dir=None,
                reference_dir=reference_dir, policy_path=None, sources_root=sources_root,
                trust=check)
    d = dataclasses.replace(d, notes=(*d.notes, *check.notes))
    if not check.changes:
        return d
    return dataclasses.replace(d, exit_code=ExitCode.INTEGRITY_ERROR,
                               trust_changes=check.changes,
                               message=f"{refused}; under the trust root (exit "
                                       f"{int(d.exit_code)}): {d.message}")


def gate(evidence_dir: str | Path, contracts: Sequence[str | Path], *,
         allow_not_run: Sequence[str] = (), trusted_keys_dir: str | Path | None = None,
         reference_dir: str | Path | None = None, json_out: str | Path | None = None,
         policy: str | Path | None = None, sources_root: str | Path | None = None,
         trust_from: str | None = None) -> GateResult:
    """Decide whether committed evidence qualifies every contract.

    Args:
        evidence_dir: a run directory, or a directory holding runs (``evidence/``).
        contracts: committed contract files (at least one).
        allow_not_run: cell-id globs (``fnmatch``) that may be ``NOT_RUN``.
        trusted_keys_dir: trusted ``*.pub`` directory (default ``contracts/keys``).
        reference_dir: the reference of the runs (default from each ``run.json``).
        json_out: write the decision JSON there (validated against ``gate.schema.json``).
        policy: the gate policy file (one ``--contract`` only; default
            ``contracts/gates/<name>.toml`` beside each contract, else none).
        sources_root: the code the runs' ``sources.json`` is compared with (default: the
            code this process runs, :func:`qualify.resources.repo_root`).
        trust_from: a protected trust root (a git ref, or a directory laid out as
            ``contracts/``; :func:`qualify.evidence.trust.resolve_trust_root`): keys,
            policy and contract come from there, and a change altering them is refused
            (exit 3). ``None``: the checkout is its own trust root.

    Returns:
        The :class:`GateResult`; integrity problems are reported there, never raised.

    Raises:
        ContractError: a contract or policy file is missing or invalid (exit 2).
        UsageError: no contract given, ``policy`` with several contracts, a trusted
            key file is malformed, ``trust_from`` with ``trusted_keys_dir`` or ``policy``
            (the root alone decides them), or a ``trust_from`` that names no readable
            root (a bad ref, a missing directory, one inside the checkout).
    """
    if not contracts:
        raise UsageError("gate: give at least one --contract")
    if policy is not None and len(contracts) > 1:
        raise UsageError("gate: --policy applies to one --contract; give one, or put each "
                         "policy at contracts/gates/<name>.toml")
    if trust_from is not None and (trusted_keys_dir is not None or policy is not None):
        raise UsageError("gate: --trust-from takes the trusted keys and the policy from the "
                         "trust root; drop --keys / --policy")
    ev = Path(evidence_dir)
    if not ev.is_dir():
        raise UsageError(f"{ev}: evidence directory not found")
    root = CHECKOUT if trust_from is None else \
        resolve_trust_root(trust_from, checkout=Path(contracts[0]).parent)
    if root is CHECKOUT:
        decisions = tuple(_decide(ev, Path(c), list(allow_not_run),
                                  trusted_keys_dir=trusted_keys_dir,
                                  reference_dir=reference_dir, policy_path=policy,
                                  sources_root=sources_root)
                          for c in contracts)
    else:
        decisions = tuple(_decide_from_root(ev, Path(c), list(allow_not_run), root,
                                            reference_dir=reference_dir,
                                            sources_root=sources_root)
                          for c in contracts)
    result = GateResult(evidence_dir=ev, allow_not_run=tuple(allow_not_run),
                        contracts=decisions, created=utc_now_iso(), trust_root=root)
    if json_out is not None:
        store.atomic_write_json(json_out, result.to_dict(), schema=GATE_SCHEMA)
    return result
