"""Evidence written before the redesign (commit e8a6716) still verifies and gates the same.

``tests/fixtures/pre_redesign/`` was written by the pre-redesign code (flat ``qualify/``
layout; see its README.md): a sealed, signed reference and two sealed, signed candidate runs
(``run-1-good``, ``run-2-fail``) of the ``gate-tiny`` contract of ``tests/test_verify.py``,
signed with a throw-away Ed25519 key whose public half is ``keys/*.pub`` (the private half
was never written to disk). ``expected.json`` holds what the old ``qualify verify`` and
``qualify gate`` said about it (exit codes, step statuses, verdicts). Every test runs the
*current* command line, in-process, on a fresh copy of the fixture, and asserts the same
answers: a refactor that changes a file name, a JSON key, a tensor name, the statement or a
verdict rule breaks them.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from qualify.cli.main import main

FIXTURE = Path(__file__).parent / "fixtures" / "pre_redesign"
EXPECTED: dict[str, Any] = json.loads((FIXTURE / "expected.json").read_text(encoding="utf-8"))
CONTRACT = "gate-tiny"
MAX_FIXTURE_BYTES = 1 << 20


@pytest.fixture
def world(tmp_path: Path) -> Path:
    """A writable copy of the fixture (verification must not depend on where it lies)."""
    dest = tmp_path / "pre_redesign"
    shutil.copytree(FIXTURE, dest)
    return dest


def cli(argv: list[str]) -> tuple[int, str]:
    """``qualify ARGV`` in-process: the exit code and stdout."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    return code, buf.getvalue()


def test_fixture_is_small_and_holds_no_private_key() -> None:
    files = [p for p in FIXTURE.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < MAX_FIXTURE_BYTES
    keys = sorted((FIXTURE / "keys").iterdir())
    assert [p.suffix for p in keys] == [".pub"]
    for p in files:
        text = p.read_bytes()
        assert b"PRIVATE KEY" not in text, p
    assert b"BEGIN PUBLIC KEY" in keys[0].read_bytes()
    assert EXPECTED["commit"] == "e8a6716"


# Evidence sealed before the power check and the coverage record (issue #15) verifies through
# the versioned recomputation of step 9: its report.json lacks the `coverage` and `power`
# sections, so the report is recomputed without them (qualify.compare.verdicts
# .OPTIONAL_SECTIONS), every row's verdict, error, bound and margin compared as before.


@pytest.mark.parametrize("target", sorted(EXPECTED["verify"]))
def test_verify_passes_every_step_as_before(world: Path, target: str, tmp_path: Path) -> None:
    want = EXPECTED["verify"][target]
    out = tmp_path / "verify.json"
    code, text = cli(["verify", str(world / target), "--keys", str(world / "keys"),
                      "--contracts-dir", str(world / "contracts"), "--json", str(out)])
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert code == want["exit_code"] == 0, text
    assert doc["passed"] is want["passed"] is True, text
    assert doc["kind"] == want["kind"]
    assert [[s["step"], s["name"], s["status"]] for s in doc["steps"]] == want["steps"], text
    assert doc["problems"] == []


@pytest.mark.parametrize("case", EXPECTED["gate"],
                         ids=lambda c: f"{c['target'].rsplit('/', 1)[-1]}"
                                       f"{'-allow' if c['allow_not_run'] else ''}")
def test_gate_keeps_the_old_verdicts_but_cannot_prove_freshness(
        world: Path, case: dict[str, Any], tmp_path: Path) -> None:
    """The gate decides differently by design since #16: a run without ``sources.json``
    cannot prove that it ran this checkout's code, so every required cell is STALE and
    the gate fails (exit 1), whatever the old decision (``expected.json``). The evidence
    itself still verifies and carries exactly the old verdicts, cell by cell."""
    out = tmp_path / "gate.json"
    argv = ["gate", str(world / case["target"]), "--keys", str(world / "keys"),
            "--contract", str(world / "contracts" / f"{CONTRACT}.toml"), "--json", str(out)]
    for glob in case["allow_not_run"]:
        argv += ["--allow-not-run", glob]
    code, text = cli(argv)
    assert code == 1, text
    assert text.splitlines()[0] == "qualify gate: FAIL (exit 1)"
    assert "verified (9 steps" in text
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["result"] == "FAIL"
    (c,) = doc["contracts"]
    assert c["run_id"] == case["run_id"]
    assert {x["cell"]: x["verdict"] for x in c["cells"]} == \
        {cell: v for cell, (v, _ok) in case["cells"].items()}
    assert {x["outcome"] for x in c["cells"]} == {"STALE"}
    assert {x["reason"] for x in c["cells"]} == \
        {"stale: sources not recorded: cannot prove freshness"}
    assert sorted(c["failed_cells"]) == sorted(case["cells"])


def test_an_edited_fixture_no_longer_verifies(world: Path) -> None:
    """The fixture is live evidence, not a string match: one flipped byte is caught."""
    run = world / "evidence" / CONTRACT / "run-1-good"
    tensors = run / "cells" / "torch_tp-fp32-actor-tp1" / "attempt-1" / "outputs.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-10] ^= 0x01
    tensors.write_bytes(bytes(data))
    code, text = cli(["verify", str(run), "--keys", str(world / "keys"),
                      "--contracts-dir", str(world / "contracts")])
    assert code == 3, text
