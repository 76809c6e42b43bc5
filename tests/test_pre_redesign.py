"""Evidence written before the redesign (commit e8a6716) still verifies and gates the same.

``tests/fixtures/pre_redesign/`` was written by the pre-redesign code (flat ``qualify/``
layout; see its README.md): a sealed, signed reference and two sealed, signed candidate runs
(``run-1-good``, ``run-2-fail``) of the ``gate-tiny`` contract of ``tests/test_verify.py``,
signed with a throw-away Ed25519 key whose public half is ``keys/*.pub`` (the private half
was never written to disk). ``expected.json`` holds what the old ``qualify verify`` and
``qualify gate`` said about it (exit codes, step statuses, verdicts). Every test runs the
*current* command line, in-process, on a fresh copy of the fixture, and asserts the same
answers: a refactor that changes a file name, a JSON key, a tensor name, the statement or a
verdict rule breaks them. Where an issue changed a decision by design (the gate's freshness,
the recomputation of the bounds), the test says which and asserts the new answer.
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


# Evidence sealed before the power check and the coverage record (issue #15) recomputes
# through the versioned recomputation of step 9: its report.json lacks the `coverage` and
# `power` sections, so the report is recomputed without them
# (qualify.compare.verdicts.OPTIONAL_SECTIONS), every row's verdict, error, bound and margin
# compared as before.
#
# Since issue #43 verify recomputes every sealed bound from the reference's sealed control
# errors (step 9 of a reference). This reference's bounds were written by hand (control
# "hand-made", no control_errors.json): they cannot be recomputed, so verify refuses the
# reference, and every run through it (step 7), instead of taking the bounds on faith. Every
# other step still answers as expected.json records.

NOT_RECOMPUTABLE = ("bounds.json: 70 sealed bounds not recomputable from sealed data: "
                    "control_errors.json: missing (the reference was sealed without it)")


@pytest.mark.parametrize("target", sorted(EXPECTED["verify"]))
def test_verify_refuses_the_hand_made_bounds_and_nothing_else(world: Path, target: str,
                                                              tmp_path: Path) -> None:
    want = EXPECTED["verify"][target]
    out = tmp_path / "verify.json"
    code, text = cli(["verify", str(world / target), "--keys", str(world / "keys"),
                      "--contracts-dir", str(world / "contracts"), "--json", str(out)])
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert want["exit_code"] == 0
    assert code == 3, text
    assert doc["passed"] is False
    assert doc["kind"] == want["kind"]
    steps = [[s["step"], s["name"], s["status"]] for s in doc["steps"]]
    assert steps[:6] == want["steps"][:6], text  # signature, digests, contract: as before
    statuses = [s["status"] for s in doc["steps"][6:]]
    (problem,) = doc["problems"]
    if want["kind"] == "reference":
        assert statuses == ["not-applicable", "passed", "failed"], text
        assert problem == f"step 9 (bounds and verdicts recomputed from sealed evidence): " \
                          f"{NOT_RECOMPUTABLE}"
    else:
        assert statuses == ["failed", "skipped", "skipped"], text
        assert problem.startswith("step 7 (bounds and reference bound to the run): reference ")
        assert problem.endswith(f"does not verify: step 9 (bounds and verdicts recomputed "
                                f"from sealed evidence): {NOT_RECOMPUTABLE}")


@pytest.mark.parametrize("run", ["run-1-good", "run-2-fail"])
def test_the_old_runs_still_recompute_and_keep_their_seal_order(world: Path, run: str) -> None:
    """Steps 8 and 9 of the runs, run directly on the reference verify now refuses: the old
    seal order and the versioned recomputation of the old reports still hold."""
    from qualify.evidence.dsse import read_envelope
    from qualify.evidence.recompute import verify_verdicts
    from qualify.evidence.verify import verify_seal_order, verify_seal_times
    from qualify.jsonio import loads_strict

    d = world / "evidence" / CONTRACT / run
    (ref,) = (world / "references").iterdir()
    statement = loads_strict(read_envelope(d).payload, what="run")
    ref_statement = loads_strict(read_envelope(ref).payload, what="reference")
    verify_seal_times(d, statement)
    verify_seal_times(ref, ref_statement)
    verify_seal_order(d, statement, ref, ref_statement)
    assert verify_verdicts(d, statement, ref) == 8


@pytest.mark.parametrize("case", EXPECTED["gate"],
                         ids=lambda c: f"{c['target'].rsplit('/', 1)[-1]}"
                                       f"{'-allow' if c['allow_not_run'] else ''}")
def test_gate_refuses_the_hand_made_bounds(world: Path, case: dict[str, Any],
                                           tmp_path: Path) -> None:
    """The gate decides differently by design: since #16 a run without ``sources.json``
    cannot prove that it ran this checkout's code (exit 1, every required cell STALE); since
    #43 its reference's hand-made bounds cannot be recomputed, so the run fails
    verification first (exit 3), whatever the old decision (``expected.json``)."""
    out = tmp_path / "gate.json"
    argv = ["gate", str(world / case["target"]), "--keys", str(world / "keys"),
            "--contract", str(world / "contracts" / f"{CONTRACT}.toml"), "--json", str(out)]
    for glob in case["allow_not_run"]:
        argv += ["--allow-not-run", glob]
    code, text = cli(argv)
    assert code == 3, text
    assert text.splitlines()[0] == "qualify gate: INTEGRITY ERROR (exit 3)"
    assert NOT_RECOMPUTABLE in text
    doc = json.loads(out.read_text(encoding="utf-8"))
    (c,) = doc["contracts"]
    assert c["run_id"] == case["run_id"]
    assert c["exit_code"] == 3
    assert c["message"].endswith("fails verification at step 7 (bounds and reference bound "
                                 "to the run)")


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
