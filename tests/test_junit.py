"""``qualify gate --junit-xml / --summary`` and ``qualify audit --junit-xml``.

The XML is validated against the JUnit report format CI servers read
(``tests/fixtures/junit-surefire.xsd``, with ``xmlschema``), and read back with the
standard library to check that it says what the gate decided: one testcase per cell, XFAIL
and allowed NOT_RUN as skipped with their reason, every cell that fails the gate as a
failure whose message is its first failing quantity, an integrity problem as an error.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import xmlschema
from shared_artifacts import committed_gate as shared_committed_gate

from qualify.cli.main import main
from qualify.errors import ExitCode
from qualify.evidence.gate import ContractDecision, GateResult
from qualify.evidence.junit import gate_junit, gate_summary_markdown
from qualify.evidence.policy import CellOutcome

ROOT = Path(__file__).resolve().parent.parent
XSD = xmlschema.XMLSchema(ROOT / "tests" / "fixtures" / "junit-surefire.xsd")


def _cell(cell: str, outcome: str, *, ok: bool, required: bool = True,
          reason: str | None = None, **kw: object) -> CellOutcome:
    return CellOutcome(cell=cell, engine=cell.split("-", maxsplit=1)[0], required=required,
                       verdict="FAIL" if outcome in ("FAIL", "XFAIL") else outcome,
                       outcome=outcome, ok=ok, reason=reason, **kw)  # type: ignore[arg-type]


CELLS = (
    _cell("torch_tp-fp32-actor-tp1", "PASS", ok=True),
    _cell("deepspeed-bf16-zero0-actor-tp2", "XFAIL", ok=True, reason="known finding"),
    _cell("megatron-bf16-actor-tp1", "FAIL", ok=False, reason="regressed",
          first={"family": "grad_norm", "round": 2, "statistic": "abs", "margin": 4.56}),
    _cell("vllm-fp32-sampler-tp1", "STALE", ok=False, reason="code changed",
          stale_files=("harnesses/torch_tp/harness.py",)),
    _cell("fsdp2-fp32-actor-tp1", "NOT_RUN", ok=True, reason="not installed",
          allowed_not_run="fsdp2-*"),
    _cell("deepspeed-fp32-zero0-critic-tp1", "XPASS", ok=False,
          reason="expected failure now passes"),
    _cell("torch_tp-bf16-critic-tp2", "FAIL", ok=True, required=False),
    # a name that would break XML 1.0 and forge a Markdown line if written raw
    _cell("torch_tp-fp32-\x1b[32mactor\n| ok |-tp2", "FAIL", ok=False, reason="a\x00b|c\nd"),
)


def _decision(**kw: object) -> ContractDecision:
    base: dict[str, object] = {
        "contract": "tiny-qwen3", "contract_path": Path("c.toml"), "contract_digest": "ab" * 32,
        "run_dir": Path("/r"), "run_id": "20261205T000000Z", "verification": None,
        "cells": CELLS, "exit_code": ExitCode.QUALIFICATION_FAILED, "message": "5 cells"}
    base.update(kw)
    return ContractDecision(**base)  # type: ignore[arg-type]


def _result(*decisions: ContractDecision) -> GateResult:
    return GateResult(evidence_dir=Path("evidence"), allow_not_run=(), contracts=decisions,
                      created="2026-12-05T00:00:00Z")


def _cases(xml: str) -> dict[str, ET.Element]:
    root = ET.fromstring(xml)
    return {c.get("name", ""): c for c in root.iter("testcase")}


def test_every_gate_outcome_maps_to_a_valid_junit_testcase() -> None:
    xml = gate_junit(_result(_decision()))
    XSD.validate(xml)
    cases = _cases(xml)
    assert len(cases) == len(CELLS)
    outcome = {name: (c[0].tag, c[0].get("type")) if len(c) else ("pass", None)
               for name, c in cases.items()}
    assert outcome["torch_tp-fp32-actor-tp1"] == ("pass", None)
    assert outcome["deepspeed-bf16-zero0-actor-tp2"] == ("skipped", "XFAIL")
    assert outcome["megatron-bf16-actor-tp1"] == ("failure", "FAIL")
    assert outcome["vllm-fp32-sampler-tp1"] == ("failure", "STALE")
    assert outcome["fsdp2-fp32-actor-tp1"] == ("skipped", "NOT_RUN")
    assert outcome["deepspeed-fp32-zero0-critic-tp1"] == ("failure", "XPASS")
    assert outcome["torch_tp-bf16-critic-tp2"] == ("skipped", "NOT_REQUIRED")
    fail = cases["megatron-bf16-actor-tp1"][0]
    assert fail.get("message") == "FAIL: first failing: grad_norm abs, round 2, margin 4.56"
    assert "harnesses/torch_tp/harness.py" in (cases["vllm-fp32-sampler-tp1"][0].text or "")
    assert "known finding" in (cases["deepspeed-bf16-zero0-actor-tp2"][0].get("message") or "")
    suite = ET.fromstring(xml).find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"),
            suite.get("skipped")) == (str(len(CELLS)), "4", "0", "3")


def test_control_characters_cannot_break_the_xml_or_forge_a_summary_line() -> None:
    xml = gate_junit(_result(_decision()))
    XSD.validate(xml)
    names = list(_cases(xml))
    forged = [n for n in names if "actor" in n and "tp2" in n and "torch_tp-fp32" in n]
    assert forged == ["torch_tp-fp32-\\x1b[32mactor\n| ok |-tp2"]
    md = gate_summary_markdown(_result(_decision()))
    assert "\x1b" not in md
    assert "\x00" not in md
    for line in md.splitlines():  # every table row has exactly the table's columns
        if line.startswith("| `"):
            assert len(re.findall(r"(?<!\\)\|", line)) == 5, line


def test_an_integrity_failure_is_an_error_testcase_not_hidden_among_cells() -> None:
    xml = gate_junit(_result(_decision(exit_code=ExitCode.INTEGRITY_ERROR, cells=(),
                                       message="signature by an untrusted key")))
    XSD.validate(xml)
    case = _cases(xml)["verification"]
    assert case[0].tag == "error"
    assert case[0].get("message") == "signature by an untrusted key"
    root = ET.fromstring(xml)
    assert root.get("errors") == "1"


def test_the_summary_heads_with_the_decision_and_lists_what_did_not_pass() -> None:
    md = gate_summary_markdown(_result(_decision()))
    assert md.startswith("## qualify gate: FAIL (exit 1)\n")
    assert "| `megatron-bf16-actor-tp1` | FAIL | NO | first failing: grad_norm abs, round 2, " \
           "margin 4.56 |" in md
    assert "| `deepspeed-bf16-zero0-actor-tp2` | XFAIL | yes | known finding |" in md
    assert "torch_tp-fp32-actor-tp1" not in md  # a plain pass is counted, not listed


@pytest.fixture(scope="module")
def committed_gate(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, Path]:
    """The session's gate of the committed runs (:func:`shared_artifacts.committed_gate`)."""
    out = shared_committed_gate(tmp_path_factory)
    return int((out / "rc.txt").read_text()), out / "gate.xml", out / "summary.md"


def test_the_gate_on_the_committed_evidence_writes_what_it_decided(
        committed_gate: tuple[int, Path, Path]) -> None:
    import json

    code, xml_path, summary = committed_gate
    xml = xml_path.read_text(encoding="utf-8")
    XSD.validate(xml)
    decision = json.loads((xml_path.parent / "gate.json").read_text())
    cells = decision["contracts"][0]["cells"]
    cases = _cases(xml)
    assert set(cases) == {c["cell"] for c in cells}
    failing = {c["cell"] for c in cells if c["required"] and not c["ok"]}
    assert {n for n, c in cases.items() if len(c) and c[0].tag == "failure"} == failing
    assert (code == 0) == (not failing)
    xfail = {c["cell"] for c in cells if c["outcome"] == "XFAIL" and c["ok"]}
    assert {n for n, c in cases.items() if len(c) and c[0].get("type") == "XFAIL"} == xfail
    text = summary.read_text(encoding="utf-8")
    assert text.startswith("earlier step\n## qualify gate: ")  # appended, not replaced


def test_audit_writes_one_testcase_per_directory(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "audit.xml"
    code = main(["audit", str(ROOT / "references"), "--junit-xml", str(out)])
    capsys.readouterr()
    xml = out.read_text(encoding="utf-8")
    XSD.validate(xml)
    cases = _cases(xml)
    assert len(cases) == len([p for p in (ROOT / "references").iterdir() if p.is_dir()])
    failures = [c for c in cases.values() if len(c)]
    assert (code == 0) == (not failures)


def test_an_unwritable_junit_path_is_a_usage_error_before_any_work(tmp_path: Path) -> None:
    code = main(["gate", str(ROOT / "evidence"), "--contract",
                 str(ROOT / "contracts" / "tiny-qwen3.toml"), "--junit-xml",
                 str(tmp_path / "missing" / "gate.xml")])
    assert code == ExitCode.USAGE_ERROR


def _shape(xml: str) -> dict[str, tuple[str | None, ...]]:
    """Each testcase: its classname and its child's tag, type and message."""
    return {name: (c.get("classname"), *((c[0].tag, c[0].get("type"), c[0].get("message"))
                                         if len(c) else ("pass", None, None)))
            for name, c in _cases(xml).items()}


def test_the_run_writes_the_gates_format_for_its_decision(
        committed_gate: tuple[int, Path, Path]) -> None:
    """``qualify run``'s documents are the gate's, built from the decision the run exits by."""
    from committed import committed_runs

    from qualify.contract import load_contract
    from qualify.evidence.junit import run_result
    from qualify.evidence.policy import policy_for
    from qualify.pipeline.chain import run_decision

    code, gate_xml, _ = committed_gate
    contract = load_contract(ROOT / "contracts" / "tiny-qwen3.toml")
    policy = policy_for(contract)
    run_dir = committed_runs()[-1]
    run_code, ev = run_decision(run_dir, contract, policy)
    result = run_result(contract=contract, run_dir=run_dir, code=run_code, ev=ev,
                        policy=policy, created="2026-12-05T00:00:00Z")
    xml = gate_junit(result, command="qualify run")
    XSD.validate(xml)
    assert ET.fromstring(xml).get("name") == "qualify run"
    assert run_code == code
    assert _shape(xml) == _shape(gate_xml.read_text(encoding="utf-8"))
    md = gate_summary_markdown(result, command="qualify run")
    assert md.startswith(f"## qualify run: {'PASS' if code == 0 else 'FAIL'} (exit {code})")


def test_run_output_files_are_checked_before_any_work(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    for option in ("--junit-xml", "--summary"):
        code = main(["run", str(tmp_path / "no-such-contract.toml"), "--references",
                     str(tmp_path / "refs"), "--evidence", str(tmp_path / "ev"), option,
                     str(tmp_path / "missing" / "out")])
        err = capsys.readouterr().err
        assert code == ExitCode.USAGE_ERROR
        assert f"{option}: directory" in err
        assert "no-such-contract" not in err
        assert not (tmp_path / "refs").exists()
        assert not (tmp_path / "ev").exists()
