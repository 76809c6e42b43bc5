"""The gate's decision sealed with a run: ``report.json`` ``gate`` (section ``gate_decision``).

The comparator judges rows against sealed bounds; the contract's gate policy
(:mod:`qualify.evidence.policy`) turns those verdicts into the decision that ``qualify run``,
``qualify gate`` and ``qualify audit`` act on. So that every view of a run leads with the
same answer, the comparator also records the decision under the policy it found at compare
time, with that policy's parsed document, so that ``qualify verify`` recomputes the decision
from the recomputed rows and the embedded document (never from a policy file that may have
been edited since). ``qualify gate`` and ``qualify audit`` decide again under the policy
current when they run (and with the run's freshness); the sealed decision is what the run
said of itself.

The section::

    {"policy": {"path": str | None, "digest": hex sha256 | None, "document": {...} | None},
     "result": "PASS" | "FAIL", "exit_code": 0 | 1,
     "counts": {outcome: required cells, ...},          # qualify.evidence.policy.OUTCOMES
     "cells": [{"cell", "required", "outcome", "ok", "reason"}, ...]}   # every cell

``policy`` all ``None``: the contract had no policy file; then the comparator's verdict
decides (every required cell ``PASS``), as ``qualify run`` does without one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qualify.contract import Contract
from qualify.errors import ContractError, EvidenceIntegrityError, ExitCode
from qualify.evidence.policy import (
    Policy,
    PolicyEvaluation,
    default_policy,
    evaluate,
    load_policy,
    policy_digest,
    policy_from_document,
)

__all__ = ["decision_section", "policy_of_section", "recorded_policy", "section_code"]


def recorded_policy(run_dir: Path, contract: Contract) -> Policy:
    """The policy a run recorded at its start (``sources.json`` ``policy.path``), as it is now.

    Default policy when the run recorded none or has no ``sources.json`` (a run from before
    policies, or a hand-made fixture), or when the recorded file is gone.

    Raises:
        ContractError: the recorded policy file is invalid (one line naming it).
    """
    from qualify.evidence.sources import read_sources

    try:
        doc = read_sources(run_dir)
    except EvidenceIntegrityError:
        doc = None
    pol = doc.get("policy") if isinstance(doc, Mapping) else None
    path = Path(str(pol["path"])) if isinstance(pol, Mapping) and pol.get("path") else None
    if path is None or not path.is_file():
        return default_policy(contract)
    return load_policy(path, contract)


def section_code(policy: Policy, ev: PolicyEvaluation, passed: bool) -> ExitCode:
    """The decision's exit code: the policy's, or without a policy file the report's verdict."""
    if policy.path is None:
        return ExitCode.OK if passed else ExitCode.QUALIFICATION_FAILED
    return ev.exit_code


def decision_section(report: Mapping[str, Any], policy: Policy,
                     cells: Sequence[str]) -> dict[str, Any]:
    """The ``gate`` section of ``report`` (a ``report.json`` document) under ``policy``.

    Args:
        report: the report document (``cells``, ``rows``, ``passed``).
        policy: the policy found at compare time (:func:`recorded_policy`) or embedded.
        cells: every cell id of the contract, in matrix order.

    Returns:
        The section (module docstring); no cell is STALE (a compare-time decision).
    """
    ev = evaluate(report, policy, cells=cells)
    code = section_code(policy, ev, bool(report.get("passed")))
    return {"policy": {"path": str(policy.path) if policy.path else None,
                       "digest": policy.digest,
                       "document": dict(policy.document) if policy.document is not None
                       else None},
            "result": "PASS" if code == ExitCode.OK else "FAIL", "exit_code": int(code),
            "counts": ev.counts(),
            "cells": [{"cell": c.cell, "required": c.required, "outcome": c.outcome,
                       "ok": c.ok, "reason": c.reason} for c in ev.cells]}


def policy_of_section(section: Any, contract: Contract, *, what: str) -> Policy:
    """The policy a sealed ``gate`` section embeds, validated against ``contract``.

    Raises:
        ContractError: the embedded document is not a valid policy of ``contract``, or its
            digest is not the recorded one (``what`` names the file).
    """
    pol = section.get("policy") if isinstance(section, Mapping) else None
    if not isinstance(pol, Mapping):
        raise ContractError(f"{what}: gate.policy: not an object")
    doc = pol.get("document")
    if doc is None:
        return default_policy(contract)
    policy = policy_from_document(doc, contract, path=str(pol.get("path") or what))
    if policy_digest(doc) != pol.get("digest"):
        raise ContractError(f"{what}: gate.policy.digest is not the digest of its document")
    return policy
