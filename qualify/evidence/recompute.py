"""Verification step 9: the report recomputed from the raw evidence (docs/ci-gating.md).

:func:`verify_verdicts` recomputes a run's report with the comparator
(:func:`qualify.compare.stage.compare_run`, ``write=False``) and requires ``report.json``,
``report.md`` and the statement's verdicts to follow from it; :mod:`qualify.evidence.verify`
runs it as step 9.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qualify import jsonio
from qualify.contract import Contract
from qualify.errors import EvidenceIntegrityError, QualifyError, VerdictMismatchError
from qualify.evidence import tensor_index
from qualify.evidence.policy import Policy
from qualify.evidence.statement import read_json
from qualify.evidence.steps import document_differences, first_line_difference, listing, predicate
from qualify.layout import REPORT_JSON, REPORT_MD

__all__ = ["verify_verdicts"]


def verify_verdicts(run_dir: Path, statement: Mapping[str, Any], ref_dir: Path) -> int:
    """Step 9: the recomputed report equals ``report.json``, ``report.md`` and the statement.

    The report is recomputed from the raw outputs and the sealed bounds
    (``compare_run(..., write=False)``) and compared with ``report.json`` field by field:
    every cell and row (error, bound, margin, verdict, reason, detail), the summary, the
    field metrics and ``passed`` (numbers within
    :data:`~qualify.evidence.steps.RECOMPUTE_REL_TOLERANCE`; only ``created``, ``run_dir``
    and the reference's path, which name when and where it was compared, are taken from
    ``report.json``). Each launch's tensor index must match its cells
    (:func:`qualify.evidence.tensor_index.check_run`). ``report.md`` is rendered again
    (:func:`qualify.compare.report.render_markdown`) and must equal the file byte for byte.
    The sealed gate decision (``gate``, section ``gate_decision``) is recomputed from the
    recomputed rows under the policy document the report embeds
    (:func:`qualify.evidence.decision.policy_of_section`), never the policy file of today.

    Returns:
        The number of cells compared.

    Raises:
        VerdictMismatchError: the recomputation fails; a cell, row or other field of
            ``report.json`` differs from the recomputed one (each named); ``report.md`` is
            not the rendering of the report; or the statement's verdicts differ.
    """
    from qualify.compare.report import render_markdown
    from qualify.compare.stage import compare_run
    from qualify.compare.verdicts import sections_of

    report = read_json(run_dir / REPORT_JSON)
    if not isinstance(report, dict):
        raise VerdictMismatchError(f"{REPORT_JSON}: not a JSON object")
    # A report sealed by an earlier comparator is recomputed with the sections it holds
    # (qualify.compare.verdicts.OPTIONAL_SECTIONS): every row's verdict, error, bound and
    # margin is compared whatever the sections; a section that adds a rule (the dtypes
    # rows' reduction_dtypes) applies only to the reports that hold it.
    try:
        sections, recorded = sections_of(report)
    except ValueError as exc:
        raise VerdictMismatchError(f"{REPORT_JSON}: {exc}") from None
    from qualify.evidence.decision import policy_of_section

    def embedded(contract: Contract) -> Policy:  # the policy the sealed decision embeds
        try:
            return policy_of_section(report.get("gate"), contract,
                                     what=str(run_dir / REPORT_JSON))
        except QualifyError as exc:
            raise VerdictMismatchError(f"the sealed gate decision cannot be recomputed: "
                                       f"{exc}") from None

    try:
        again = compare_run(run_dir, reference_dir=ref_dir, write=False, sections=sections,
                            policy=embedded)
    except VerdictMismatchError:
        raise
    except QualifyError as exc:
        raise VerdictMismatchError(f"verdicts cannot be recomputed: {exc}") from None
    pred = predicate(statement)
    ref_path = report.get("reference", {}).get("path") \
        if isinstance(report.get("reference"), dict) else None
    again = dataclasses.replace(again, created=str(report.get("created")),
                                run_dir=str(report.get("run_dir")),
                                reference_dir=str(ref_path), sections=sections,
                                sections_recorded=recorded)
    bad = [f"{REPORT_JSON} {d}" for d in document_differences(report, again.to_dict())]
    bad += tensor_index.check_run(run_dir)  # the cells hold exactly what the harnesses wrote
    rendered = render_markdown(again).encode("utf-8")
    try:
        md = jsonio.read_bytes(run_dir / REPORT_MD, max_bytes=jsonio.MAX_REPORT_BYTES)
    except (OSError, EvidenceIntegrityError) as exc:
        bad.append(f"{REPORT_MD}: unreadable: {exc}")
    else:
        if md != rendered:
            bad.append(f"{REPORT_MD}: not the rendering of the recomputed report "
                       f"({first_line_difference(md, rendered)})")
    cells = {str(c.get("cell")): c.get("verdict") for c in report.get("cells", [])
             if isinstance(c, dict)}
    verdicts = pred["verdicts"]
    if verdicts["cells"] != cells:
        bad.append(f"statement cell verdicts differ from {REPORT_JSON}")
    if verdicts["passed"] is not report.get("passed"):
        bad.append(f"statement passed={verdicts['passed']}, {REPORT_JSON} "
                   f"passed={report.get('passed')}")
    if bad:
        raise VerdictMismatchError(f"the report does not follow from the raw evidence: "
                                   f"{len(bad)} difference(s): {listing(bad)}")
    return len(again.cells)
