"""``qualify run CONTRACT``: reference (if missing) -> candidate -> compare, on one machine.

The run ends with the summary table (:mod:`qualify.cli.summary`) and exits by the
contract's gate policy (:mod:`qualify.evidence.policy`) when one exists
(``contracts/gates/<name>.toml``): known failures XFAIL, allowed cells NOT_RUN, exit 0; any
other failure, unallowed NOT_RUN or expected failure that passes, exit 1. Without a policy
file the report's own verdict decides (every required cell ``PASS``). The comparator's
verdict is printed beneath the decision; ``report.md`` seals the same decision (the policy is
passed to the comparator).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qualify.contract import Contract, load_contract
from qualify.display import printable
from qualify.errors import ExitCode
from qualify.evidence import store
from qualify.evidence.policy import Policy, PolicyEvaluation, all_cells, evaluate, policy_for
from qualify.jsonio import read_json
from qualify.layout import REPORT_JSON, REPORT_MD, SOURCES_FILE, reference_dir_name

if TYPE_CHECKING:
    from qualify.candidate.forkserver import ForkServer

__all__ = ["comparator_line", "find_sealed_reference", "gate_view", "run_all",
           "run_decision"]


def find_sealed_reference(references: Path, name: str) -> Path | None:
    """The newest sealed ``<name>``, ``<name>-2``, ... directory under ``references``."""
    found = [p for p in sorted(references.glob(f"{name}*"))
             if p.is_dir() and (p.name == name or p.name[len(name):].lstrip("-").isdigit())
             and store.is_sealed(p)]
    return found[-1] if found else None


def gate_view(code: ExitCode, ev: PolicyEvaluation, policy: Policy, *,
              verified: bool = True) -> dict[str, Any]:
    """What ``report.html`` shows of the gate's decision (:func:`run_decision`'s result).

    Args:
        code: the decision's exit code.
        ev: the policy evaluation.
        policy: the policy.
        verified: the run was just sealed by this process (``qualify run``); ``False`` for
            ``qualify report --contract``, which decides on a run it did not verify (the
            page says so: ``qualify gate`` verifies the signed evidence first).

    Returns:
        ``{policy, exit_code, counts, cells, verified}``: the policy file (``None``: no
        policy file, the report's verdict decides), the exit code, the required cells per
        outcome (:data:`qualify.evidence.policy.OUTCOMES` order) and each required cell's
        ``{cell, outcome, ok, reason}``.
    """
    return {"verified": verified,
            "policy": str(policy.path) if policy.path else None, "exit_code": int(code),
            "counts": ev.counts(),
            "cells": [{"cell": c.cell, "outcome": c.outcome, "ok": c.ok, "reason": c.reason}
                      for c in ev.cells if c.required]}


def comparator_line(doc: Mapping[str, Any], ev: PolicyEvaluation) -> str:
    """The comparator's verdict beneath the decision, saying how much the policy expects."""
    fails = [c for c in ev.cells if c.required and c.verdict != "PASS"]
    xfail = sum(c.outcome == "XFAIL" for c in fails)
    raw = "PASSED" if doc.get("passed") else "FAILED"
    return (f"comparator verdict (before the policy): {raw} ({len(fails)} required cells not "
            f"PASS; {xfail} of them expected by the policy)")


def run_decision(run_dir: Path, contract: Contract, policy: Policy, *,
                 report: Mapping[str, Any] | None = None,
                 ) -> tuple[ExitCode, PolicyEvaluation]:
    """The exit code of ``qualify run`` on a compared run, and every cell's outcome.

    With a policy file (``policy.path``), the policy evaluation decides; cells are STALE
    only if the run recorded ``sources.json`` and the code changed while it ran. Without
    one, the report's ``passed`` decides (the semantics before policies).

    Args:
        run_dir: the compared run.
        contract: its contract.
        policy: :func:`qualify.evidence.policy.policy_for` of the contract.
        report: its ``report.json`` document (default: read from ``run_dir``).

    Returns:
        ``(exit code 0 or 1, evaluation)``.

    Raises:
        EvidenceIntegrityError: ``report.json`` or ``sources.json`` is unreadable.
    """
    from qualify.evidence.sources import stale_cells

    doc = report if report is not None else read_json(run_dir / REPORT_JSON)
    stale = stale_cells(run_dir) if (run_dir / SOURCES_FILE).is_file() else {}
    ev = evaluate(doc, policy, stale=stale, cells=all_cells(contract))
    if policy.path is None:
        code = ExitCode.OK if doc.get("passed") else ExitCode.QUALIFICATION_FAILED
    else:
        code = ev.exit_code
    return code, ev


def run_all(contract_path: Path, *, references: Path, evidence: Path,
            cells: Sequence[str] | None = None, quiet: bool = False,
            run_id: str | None = None, junit_xml: Path | None = None,
            summary: Path | None = None) -> ExitCode:
    """Run the whole job for one contract and return its exit code.

    An interrupted earlier run of the contract is resumed, or superseded and kept
    (:mod:`qualify.pipeline.recovery`), so the gate needs no hand edit after a ``kill -9``,
    Ctrl-C, SIGTERM or a full disk.

    Args:
        contract_path: the contract TOML.
        references: parent of reference directories (an existing sealed reference for this
            contract digest is reused, never rewritten).
        evidence: parent of candidate runs.
        cells: cell globs (``None`` = all).
        quiet: no progress bars.
        run_id: resume or name this run (default: resume the newest interrupted run that
            can be resumed, else a new timestamped id).
        junit_xml: write the decision there as JUnit XML (:mod:`qualify.evidence.junit`,
            the format of ``qualify gate --junit-xml``); checked writable by the caller.
        summary: append the decision there as a Markdown job summary.

    Returns:
        ``OK`` when it qualified (by the gate policy when the contract has one, see
        :func:`run_decision`), else ``QUALIFICATION_FAILED``.

    Raises:
        QualifyError: any stage's error (see the stages); ``ContractError`` for an invalid
            gate policy, before anything runs.
    """
    contract = load_contract(contract_path)
    policy = policy_for(contract)
    ref = find_sealed_reference(references, reference_dir_name(contract))
    from qualify.candidate import forkserver
    from qualify.candidate.launch import start_fork_server

    # a reused reference: the launchers' shared imports start now, beside this process's
    with forkserver.serving(None if ref is None else start_fork_server(contract)) as server:
        return _run_all(contract, policy, ref, contract_path=contract_path,
                        references=references, evidence=evidence, cells=cells, quiet=quiet,
                        run_id=run_id, junit_xml=junit_xml, summary=summary, server=server)


def _run_all(contract: Contract, policy: Policy, ref: Path | None, *, contract_path: Path,
             references: Path, evidence: Path, cells: Sequence[str] | None, quiet: bool,
             run_id: str | None, junit_xml: Path | None, summary: Path | None,
             server: ForkServer | None) -> ExitCode:
    """:func:`run_all` past its reference lookup; ``server`` is closed once the cells ran."""
    from qualify.candidate.stage import check_run_id, new_run_id, run_candidate_stage
    from qualify.cli.summary import print_evaluation
    from qualify.compare.html import write_html
    from qualify.compare.stage import compare_run
    from qualify.evidence.sign import ensure_signed, seal_and_sign

    if run_id is not None:  # before a reference stage of minutes
        check_run_id(run_id)
    if ref is None:
        from qualify.reference.stage import run_reference_stage

        ref = run_reference_stage(contract, root=references, quiet=quiet)
    ensure_signed(ref)
    print(f"reference: {printable(ref)}", file=sys.stderr)
    from qualify.pipeline import recovery

    parent = evidence.resolve() / contract.name
    plan = recovery.plan(contract, reference=ref, evidence=evidence.resolve(), cells=cells,
                         run_id=run_id, new_id=new_run_id(parent))
    supersedes = recovery.apply(plan, parent)
    if plan.sealed:  # killed while signing: signed now, its sealed report decides
        run_dir = parent / plan.run_id
        report = compare_run(run_dir, write=False)
    else:
        run_dir = run_candidate_stage(contract, reference=ref, root=evidence, cells=cells,
                                      quiet=quiet, run_id=plan.run_id,
                                      supersedes=supersedes)
        if server is not None:
            server.close()  # its memory back before the comparator's
        report = compare_run(run_dir, policy=policy)  # report.md leads with its decision
        seal_and_sign(run_dir, kind="candidate-run")
    # read once, validated once: compare_run validated the document before writing it
    doc = read_json(run_dir / REPORT_JSON)
    code, ev = run_decision(run_dir, contract, policy, report=doc)
    try:  # a view beside the sealed run, never evidence: its failure must not decide the exit
        html: Path | None = write_html(run_dir, gate=gate_view(code, ev, policy), doc=doc)
    except Exception as exc:
        print(printable(f"qualify: warning: report.html not written ({type(exc).__name__}: "
                        f"{exc}); `qualify report {shlex.quote(str(run_dir))} --contract "
                        f"{shlex.quote(str(contract_path))}` makes it again"),
              file=sys.stderr)
        html = None
    causes = report.root_causes
    del report  # sealed and signed; the summary below is the policy's view of it
    pol = f"gate policy {policy.path}" if policy.path else "no gate policy (report verdict)"
    print(printable(f"{contract.name}: exit {int(code)} by {pol}"))
    print(comparator_line(doc, ev))
    print_evaluation(ev, report_md=run_dir / REPORT_MD, report_html=html, causes=causes)
    if junit_xml is not None or summary is not None:
        from qualify.evidence.junit import run_result, write_views
        from qualify.evidence.timestamps import utc_now_iso

        write_views(run_result(contract=contract, run_dir=run_dir, code=code, ev=ev,
                               policy=policy, created=utc_now_iso()),
                    junit_xml=junit_xml, summary=summary, command="qualify run")
    return code
