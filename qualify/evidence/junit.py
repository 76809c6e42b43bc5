r"""CI-native views of a gate decision and of an audit: JUnit XML and a Markdown job summary.

CI servers (Jenkins, GitLab, GitHub Actions' test reporters, Buildkite) read the JUnit XML
format of Apache Surefire: ``<testsuites>`` holding one ``<testsuite>`` per group, each
holding one ``<testcase>`` per test with at most one ``<failure>``, ``<error>`` or
``<skipped>`` child. The mapping written here:

- :func:`gate_junit`: one ``<testsuite>`` per gated contract (``name`` = the contract),
  one ``<testcase>`` per cell of the contract's matrix (``classname`` =
  ``qualify.<contract>.<engine>``, ``name`` = the cell id):

  ========================  ==============================================================
  gate outcome              JUnit
  ========================  ==============================================================
  ``PASS``                  a passing testcase (no child)
  ``XFAIL``                 ``<skipped type="XFAIL">`` with the expected failure's reason
  ``NOT_RUN``, allowed      ``<skipped type="NOT_RUN">`` with the allowance and the reason
  not required              ``<skipped type="NOT_REQUIRED">``
  ``FAIL``, ``XPASS``,      ``<failure type="<outcome>">``: the message is the first failing
  ``STALE``, ``NOT_RUN``    quantity (family, round, statistic, margin) or the reason; the
  not allowed, ...          text adds the stale files
  ========================  ==============================================================

  A cell with rows the contract expects not run (``matrix.expected_not_run``) lists them,
  with their reasons, in the testcase's ``<system-out>``.
  A contract whose evidence does not verify (exit 3), or that has no run, gets one more
  testcase, ``verification``, with an ``<error>`` carrying every problem: integrity is
  never hidden among cells.
- :func:`audit_junit`: one ``<testsuite name="qualify audit">``, one ``<testcase>`` per
  audited reference or run, with a ``<failure>`` listing its problems.
- :func:`gate_summary_markdown`: the decision, a table of outcome counts per contract and
  every cell that did not plainly pass, in GitHub-flavoured Markdown (fits
  ``$GITHUB_STEP_SUMMARY``).
- :func:`run_result`: the decision ``qualify run`` exits by (the gate policy's, the one
  ``report.json`` seals, with the run's freshness) as a one-contract gate result, so that
  ``qualify run --junit-xml / --summary`` write the same documents as ``qualify gate``
  (the testsuites and the summary heading name ``qualify run``).

Text is made safe for XML 1.0 (control characters other than tab and newline are written
as ``\xNN``) and for Markdown tables (``|`` and newlines escaped), so a file or cell name
cannot break the document or forge a line in it.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from qualify.display import markdown_cell
from qualify.errors import ExitCode

if TYPE_CHECKING:
    from pathlib import Path

    from qualify.contract import Contract
    from qualify.evidence.audit import AuditResult
    from qualify.evidence.gate import ContractDecision, GateResult
    from qualify.evidence.policy import CellOutcome, Policy, PolicyEvaluation

__all__ = ["audit_junit", "gate_junit", "gate_summary_markdown", "run_result", "write_views"]

_XML_UNSAFE: Final = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff\ufffe\uffff]")
_DECISION: Final = {ExitCode.OK: "PASS", ExitCode.QUALIFICATION_FAILED: "FAIL",
                    ExitCode.INTEGRITY_ERROR: "INTEGRITY ERROR"}


def _xml_text(text: object) -> str:
    r"""``text`` as a string XML 1.0 can hold: unsafe characters become ``\xNN``."""
    return _XML_UNSAFE.sub(lambda m: f"\\x{ord(m.group(0)):02x}", str(text))


def _first_line(first: Mapping[str, Any] | None) -> str | None:
    """The first failing quantity as one phrase (``None`` when the outcome has none)."""
    if not first:
        return None
    parts = [str(first.get(k)) for k in ("family", "statistic") if first.get(k) is not None]
    where = f", round {first['round']}" if first.get("round") is not None else ""
    margin = first.get("margin")
    tail = f", margin {margin}" if margin is not None else ""
    return f"first failing: {' '.join(parts)}{where}{tail}"


def _case(suite: ET.Element, classname: str, name: str) -> ET.Element:
    return ET.SubElement(suite, "testcase", {"classname": _xml_text(classname),
                                             "name": _xml_text(name), "time": "0"})


def _child(case: ET.Element, tag: str, kind: str, message: str, text: str = "") -> None:
    node = ET.SubElement(case, tag, {"type": _xml_text(kind), "message": _xml_text(message)})
    if text:
        node.text = _xml_text(text)


def _cell_case(suite: ET.Element, contract: str, cell: CellOutcome) -> str:
    """Add ``cell``'s testcase; return which counter it adds to (``""`` for a pass).

    Its ``<system-out>``, after the outcome's child (Surefire's order), lists the rows the
    contract expects not run.
    """
    case = _case(suite, f"qualify.{contract}.{cell.engine or 'unknown'}", cell.cell)
    counter = _outcome_child(case, cell)
    if cell.expected_not_run:
        ET.SubElement(case, "system-out").text = _xml_text(
            "rows the contract expects not run:\n" + "\n".join(cell.expected_not_run))
    return counter


def _outcome_child(case: ET.Element, cell: CellOutcome) -> str:
    """Add the child of ``cell``'s outcome to ``case``; return its counter."""
    reason = cell.reason or ""
    if not cell.required:
        _child(case, "skipped", "NOT_REQUIRED",
               f"not required by the gate policy (outcome {cell.outcome})")
        return "skipped"
    if cell.ok and cell.outcome == "PASS":
        return ""
    if cell.ok:
        allowed = (f" (allowed by {cell.allowed_not_run!r})"
                   if cell.outcome == "NOT_RUN" and cell.allowed_not_run else "")
        _child(case, "skipped", cell.outcome, f"{cell.outcome}{allowed}: {reason}".rstrip(": "))
        return "skipped"
    first = _first_line(cell.first)
    message = f"{cell.outcome}: {first or reason}"
    details = [f"outcome: {cell.outcome} (report verdict {cell.verdict})"]
    if reason:
        details.append(f"reason: {reason}")
    if first:
        details.append(first)
    details += [f"changed source file: {f}" for f in cell.stale_files]
    _child(case, "failure", cell.outcome, message, "\n".join(details))
    return "failures"


def _contract_suite(root: ET.Element, decision: ContractDecision, trust_root: str) -> None:
    suite = ET.SubElement(root, "testsuite", {"name": _xml_text(decision.contract)})
    counts: Counter[str] = Counter()
    props = ET.SubElement(suite, "properties")
    for name, value in (("contract_digest", decision.contract_digest),
                        ("run_id", decision.run_id or ""),
                        ("exit_code", str(int(decision.exit_code))),
                        ("decision", _DECISION.get(decision.exit_code, "?")),
                        ("trust_root", trust_root)):
        ET.SubElement(props, "property", {"name": name, "value": _xml_text(value)})
    verification = decision.verification
    if decision.exit_code == ExitCode.INTEGRITY_ERROR or decision.run_dir is None or (
            verification is not None and not verification.passed):
        case = _case(suite, f"qualify.{decision.contract}", "verification")
        problems = list(verification.problems) if verification is not None else []
        problems += [f"trust: {t.line}" for t in decision.trust_changes]
        _child(case, "error", "INTEGRITY_ERROR" if decision.exit_code
               == ExitCode.INTEGRITY_ERROR else "NO_EVIDENCE",
               decision.message, "\n".join(problems))
        counts["errors"] += 1
    for cell in decision.cells:
        counts[_cell_case(suite, decision.contract, cell) or "passed"] += 1
    _set_counts(suite, counts)


def _set_counts(suite: ET.Element, counts: Counter[str]) -> None:
    """The suite's ``tests`` (every counted testcase), ``failures``, ``errors``, ``skipped``."""
    suite.set("tests", str(sum(counts.values())))
    for attr in ("failures", "errors", "skipped"):
        suite.set(attr, str(counts[attr]))
    suite.set("time", "0")


def _document(root: ET.Element) -> str:
    for attr in ("tests", "failures", "errors"):
        root.set(attr, str(sum(int(s.get(attr, "0")) for s in root.iter("testsuite"))))
    ET.indent(root)
    return ('<?xml version="1.0" encoding="UTF-8"?>\n'
            + ET.tostring(root, encoding="unicode") + "\n")


def gate_junit(result: GateResult, *, command: str = "qualify gate") -> str:
    """The gate decision as a JUnit XML document (the mapping is the module's docstring).

    Args:
        result: :func:`qualify.evidence.gate.gate`'s decision (or :func:`run_result`).
        command: the ``<testsuites>`` name (the command that decided).

    Returns:
        The document, UTF-8 text with its XML declaration.
    """
    root = ET.Element("testsuites", {"name": _xml_text(command)})
    for decision in result.contracts:
        _contract_suite(root, decision, result.trust_root.line)
    return _document(root)


def audit_junit(result: AuditResult) -> str:
    """An audit as a JUnit XML document: one testcase per reference or run, failing on problems.

    Args:
        result: :func:`qualify.evidence.audit.audit`'s table.

    Returns:
        The document, UTF-8 text with its XML declaration.
    """
    root = ET.Element("testsuites", {"name": "qualify audit"})
    suite = ET.SubElement(root, "testsuite", {"name": "qualify audit"})
    counts: Counter[str] = Counter()
    for row in result.rows:
        case = _case(suite, f"qualify.audit.{row.kind}", row.path)
        if row.problems:
            _child(case, "failure", "PROBLEM", row.problems[0], "\n".join(row.problems))
        counts["failures" if row.problems else "passed"] += 1
    _set_counts(suite, counts)
    return _document(root)


def _md(text: object) -> str:
    """``text`` for one Markdown table cell (:func:`qualify.display.markdown_cell`)."""
    return markdown_cell(text)


def gate_summary_markdown(result: GateResult, *, command: str = "qualify gate") -> str:
    """The gate decision as a Markdown job summary (``$GITHUB_STEP_SUMMARY``).

    Args:
        result: :func:`qualify.evidence.gate.gate`'s decision (or :func:`run_result`).
        command: the command that decided, in the headline.

    Returns:
        Markdown text: the decision headline, per contract a table of outcome counts and a
        table of every required cell that did not plainly pass (outcome, first failing
        quantity or reason).
    """
    word = _DECISION.get(result.exit_code, "?")
    lines = [f"## {_md(command)}: {word} (exit {int(result.exit_code)})", "",
             _md(result.trust_root.line), ""]
    for c in result.contracts:
        lines += [f"### {_md(c.contract)} `{c.contract_digest[:12]}`", "",
                  _md(c.message), ""]
        lines += [f"- trust: {_md(t.line)}" for t in c.trust_changes]
        lines += [f"- note: {_md(n)}" for n in c.notes]
        if c.verification is not None and not c.verification.passed:
            lines += [f"- problem: {_md(p)}" for p in c.verification.problems]
        if c.notes or c.trust_changes or (c.verification is not None and not c.verification.passed):
            lines.append("")
        counts = Counter(cell.outcome for cell in c.cells if cell.required)
        if counts:
            lines += ["| outcome | required cells |", "| --- | --- |"]
            lines += [f"| {o} | {n} |" for o, n in sorted(counts.items())]
            lines.append("")
        rows = [cell for cell in c.cells if cell.required and cell.outcome != "PASS"]
        if rows:
            lines += ["| cell | outcome | gate ok | first failing quantity or reason |",
                      "| --- | --- | --- | --- |"]
            lines += [f"| `{_md(cell.cell)}` | {cell.outcome} | {'yes' if cell.ok else 'NO'} | "
                      f"{_md(_first_line(cell.first) or cell.reason or '')} |" for cell in rows]
            lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def run_result(*, contract: Contract, run_dir: Path, code: ExitCode, ev: PolicyEvaluation,
               policy: Policy, created: str) -> GateResult:
    """The decision ``qualify run`` exits by, as a one-contract gate result.

    Args:
        contract: the run's contract.
        run_dir: the sealed, signed run.
        code: the run's exit code (:func:`qualify.pipeline.chain.run_decision`).
        ev: every cell's outcome under ``policy``.
        policy: the contract's gate policy (``policy.path`` ``None``: the report's verdict
            decides).
        created: when the decision was made (ISO-8601 UTC).

    Returns:
        A :class:`~qualify.evidence.gate.GateResult` with one
        :class:`~qualify.evidence.gate.ContractDecision` (no verification: the run was
        sealed and signed by this process; the trust root is the checkout, whose policy
        the run used).
    """
    from pathlib import Path

    from qualify.evidence.gate import ContractDecision, GateResult

    pol = f"gate policy {policy.path}" if policy.path else "no gate policy (report verdict)"
    counts = ", ".join(f"{n} {o}" for o, n in ev.counts().items() if n)
    bad = [c.cell for c in ev.offending]
    message = f"run {run_dir} sealed; {pol}; required cells: {counts}" + (
        f"; {len(bad)} not passed: {', '.join(bad)}" if bad else "")
    decision = ContractDecision(contract=contract.name,
                                contract_path=contract.path or Path(f"{contract.name}.toml"),
                                contract_digest=contract.digest, run_dir=run_dir,
                                run_id=run_dir.name, verification=None, cells=ev.cells,
                                exit_code=code, message=message, policy=policy)
    return GateResult(evidence_dir=run_dir.parent, allow_not_run=(), contracts=(decision,),
                      created=created)


def write_views(result: GateResult, *, junit_xml: str | Path | None,
                summary: str | Path | None, command: str, extra_markdown: str = "") -> None:
    """Write ``junit_xml`` (atomically replaced) and append to ``summary`` (as CI summaries are).

    Args:
        result: the decision.
        junit_xml: the JUnit XML file (``None``: not written).
        summary: the Markdown summary file (``None``: not written).
        command: ``qualify gate`` or ``qualify run``, named in both documents.
        extra_markdown: appended to the summary after the decision.
    """
    from pathlib import Path

    from qualify.evidence import store

    if junit_xml:
        store.atomic_write_text(junit_xml, gate_junit(result, command=command))
    if summary:
        with Path(summary).open("a", encoding="utf-8") as f:
            f.write(gate_summary_markdown(result, command=command) + extra_markdown)
