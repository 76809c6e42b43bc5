"""The committed evidence gates green, and goes red for the three reasons CI must catch.

``references/`` and ``evidence/`` at the repository root hold the default contract's sealed
reference and one run, signed by the project key in ``contracts/keys/``; ``.ci/run`` gates
on them (``qualify gate evidence --contract contracts/tiny-qwen3.toml``). These tests run
the same gate in-process: green on the committed tree, then red (on copies) when a
committed file is edited (exit 3), when a harness file changes without new evidence
(STALE, exit 1) and when an expected failure starts passing (XPASS, exit 1).
"""

from __future__ import annotations

import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from committed import committed_runs
from shared_artifacts import committed_gate

from qualify.cli.main import main as qualify_main
from qualify.errors import ExitCode
from qualify.resources import contracts_dir, repo_root

ROOT = repo_root()
EVIDENCE = ROOT / "evidence"
CONTRACT = contracts_dir() / "tiny-qwen3.toml"
POLICY = contracts_dir() / "gates" / "tiny-qwen3.toml"


def _runs() -> list[Path]:
    return committed_runs("tiny-qwen3")


@pytest.fixture(scope="module")
def shared_gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's gate of a copy of the committed runs (a local ``qualify run`` left out;
    :func:`shared_artifacts.committed_gate`, read by test_junit too)."""
    return committed_gate(tmp_path_factory)


@pytest.fixture(scope="module")
def committed(shared_gate: Path) -> Iterator[Path]:
    """That copy's evidence root (read-only). The gates below differ from the shared one in
    ``--sources-root`` or ``--policy`` only, which verification does not read: each
    (directory, arguments) is verified once in this module, in full the first time."""
    from qualify.evidence import gate as gate_module

    real = gate_module.verify
    done: dict[tuple[object, ...], Any] = {}

    def verify_once(run: Path, **kw: Any) -> Any:
        key = (str(run), _state(run), *sorted((k, str(v)) for k, v in kw.items()))
        if key not in done:
            done[key] = real(run, **kw)
        return done[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gate_module, "verify", verify_once)
        yield shared_gate / "evidence"


def _state(run: Path) -> tuple[tuple[str, int, int], ...]:
    """Every file of ``run`` with its size and mtime: a file changed is verified again."""
    return tuple((str(p), st.st_size, st.st_mtime_ns) for p in sorted(run.rglob("*"))
                 if p.is_file() and (st := p.stat()))


def _gate(capsys: pytest.CaptureFixture[str], evidence: Path, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = qualify_main(["gate", str(evidence), "--contract", str(CONTRACT), *extra])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_the_committed_evidence_is_there_and_gates_green(
        shared_gate: Path, committed: Path) -> None:
    runs = _runs()
    assert len(runs) == 1, f"keep exactly one committed tiny-qwen3 run: {runs}"
    assert list((ROOT / "references").glob("tiny-qwen3-" + "[0-9a-f]" * 12)), \
        "no committed reference"
    rc = int((shared_gate / "rc.txt").read_text())  # qualify gate EVIDENCE --contract C
    out = (shared_gate / "out.txt").read_text()
    assert rc == ExitCode.OK, out
    assert "XFAIL" in out
    rc = qualify_main(["audit", str(ROOT / "references"), str(committed)])
    assert rc == ExitCode.OK


def test_an_edited_committed_file_fails_verification(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run,) = _runs()
    copy = tmp_path / "evidence" / "tiny-qwen3" / run.name
    shutil.copytree(run, copy)
    report = copy / "report.md"
    report.chmod(report.stat().st_mode | stat.S_IWUSR)
    report.write_text(report.read_text().replace("FAIL", "PASS", 1))
    rc, out = _gate(capsys, tmp_path / "evidence")
    assert rc == ExitCode.INTEGRITY_ERROR, out
    assert "report.md" in out


def test_a_harness_change_without_new_evidence_is_stale(
        committed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for pkg in ("qualify", "harnesses"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "_data"))
    harness = tmp_path / "harnesses" / "deepspeed" / "harness.py"
    harness.write_text(harness.read_text() + "\n# a change the committed run did not run\n")
    rc, out = _gate(capsys, committed, "--sources-root", str(tmp_path))
    assert rc == ExitCode.QUALIFICATION_FAILED, out
    assert "STALE" in out
    assert "harnesses/deepspeed/harness.py" in out


def test_an_expected_failure_that_passes_fails_the_gate(
        committed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "tiny-qwen3.toml"
    policy.write_text(POLICY.read_text() + '''
[[expected_failures]]
cells = "torch_tp-fp32-actor-tp1"
families = ["grads"]
max_margin = 2.0
reason = "planted: a cell that passes, listed as an expected failure"
upstream = "harnesses/torch_tp/README.md"
''')
    rc, out = _gate(capsys, committed, "--policy", str(policy))
    assert rc == ExitCode.QUALIFICATION_FAILED, out
    assert "expected failure now passes: update the policy" in out
    assert "torch_tp-fp32-actor-tp1" in out
