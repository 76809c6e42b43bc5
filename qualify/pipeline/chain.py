"""``qualify run CONTRACT``: reference (if missing) -> candidate -> compare, on one machine."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from qualify.contract import load_contract
from qualify.evidence import store
from qualify.layout import REPORT_MD
from qualify.reference.stage import reference_dir_name, run_reference_stage


def find_sealed_reference(references: Path, name: str) -> Path | None:
    """The newest sealed ``<name>``, ``<name>-2``, ... directory under ``references``."""
    found = [p for p in sorted(references.glob(f"{name}*"))
             if p.is_dir() and (p.name == name or p.name[len(name):].lstrip("-").isdigit())
             and store.is_sealed(p)]
    return found[-1] if found else None


def run_all(contract_path: Path, *, references: Path, evidence: Path,
            cells: Sequence[str] | None = None, quiet: bool = False) -> bool:
    """Run the whole job for one contract and return whether it qualified.

    Args:
        contract_path: the contract TOML.
        references: parent of reference directories (an existing sealed reference for this
            contract digest is reused, never rewritten).
        evidence: parent of candidate runs.
        cells: cell globs (``None`` = all).
        quiet: no progress bars.

    Returns:
        ``True`` if every required cell passed.

    Raises:
        QualifyError: any stage's error (see the stages).
    """
    from qualify.candidate.stage import run_candidate_stage
    from qualify.compare.stage import compare_run
    from qualify.evidence.sign import ensure_signed, seal_and_sign

    contract = load_contract(contract_path)
    ref = find_sealed_reference(references, reference_dir_name(contract))
    if ref is None:
        ref = run_reference_stage(contract, root=references, quiet=quiet)
    ensure_signed(ref)
    print(f"reference: {ref}", file=sys.stderr)
    run_dir = run_candidate_stage(contract, reference=ref, root=evidence, cells=cells,
                                  quiet=quiet)
    report = compare_run(run_dir)
    seal_and_sign(run_dir, kind="candidate-run")
    print(f"report: {run_dir / REPORT_MD}: {report.summary}")
    return bool(report.passed)
