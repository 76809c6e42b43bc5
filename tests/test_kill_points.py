"""Kill a real ``qualify`` at each of 16 points; the next plain invocation finishes the job.

Issue #15, item 1. Each point SIGKILLs a real ``qualify`` process (``python -m qualify``):
from outside, when the point is a state the file system shows (a control's file, the
run's staged inputs, the ranks' logs), or by the test-only hook of
:mod:`qualify.crashpoints` (the process SIGKILLs itself between an atomic write's
temporary file and its rename, a window too short to hit from outside). Then, with no file
deleted or edited by hand, the next plain invocation runs (``qualify run`` for the
reference stage, ``qualify candidate --run-id`` + ``qualify compare`` for a run,
``qualify compare`` again for the comparator), and its signed report must equal the report
of an uninterrupted run of the same contract: every row's verdict, error, bound and
margin, every cell, the field metrics and the bounds digest, after dropping only what
names the run (run id and directory, creation time, the reference's path and manifest
digest, attempt numbers).

Each point also checks: the killed process left no process behind (every process that
inherited the run's environment tag is gone), and ``qualify audit`` / ``qualify gate`` of
the killed state never say it is good (exit 3). The contract is the default tiny-qwen3
reduced to FP32 torch_tp TP 1 (one launch, two cells), so a whole job takes ~30 s on 2
cores: the comparator's points share one uninterrupted run and stay in the default
(fast) selection; the reference's and the candidate's each rerun a stage and are
``slow``. With ``QUALIFY_KILL_TABLE=FILE`` every point appends its table row (JSON lines)
there; ``scripts/kill_table.py`` runs this file and prints the table.

Issue #43, item 5 adds seven points of ``qualify run`` itself (``run-*``): kill -9, SIGINT
and SIGTERM of the process alone mid-launch, a full disk (the ``full`` crash point raises
ENOSPC), a run of another ``--cells`` selection, a kill while sealing and one while
signing. The next plain
``qualify run`` resumes the interrupted run (or supersedes it, kept whole:
:mod:`qualify.evidence.supersede`), and then ``qualify gate`` must exit 0 and ``qualify
audit`` list the run (``ok``, or ``SUPERSEDED``) with no problem. Only ``run-seal`` (no
launch) is in the fast selection.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from tiny_contracts import torch_tp_only_text

from qualify import atomic
from qualify.contract import load_contract
from qualify.crashpoints import ENV_CRASH_AT, CrashPoint, crash_spec
from qualify.errors import ExitCode
from qualify.evidence import store, supersede
from qualify.layout import (
    ATTESTATION_FILE,
    INCOMPLETE_FILE,
    INCOMPLETE_INFIX,
    MANIFEST_FILE,
    REPORT_JSON,
    RUN_FILE,
)

pytestmark = pytest.mark.slow  # minutes: .ci/run's resume and recovery step

NAME = "tiny-kill"  # no gate policy of this name: the gate requires every cell
CELL_A, CELL_C = "torch_tp-fp32-actor-tp1", "torch_tp-fp32-critic-tp1"
LAUNCH = "torch_tp-a1c1"  # torch_tp groups its variants: one launch per topology, fp32/ inside
RUN_ID = "killed"
ENV_TAG = "QUALIFY_KILL_TEST_TAG"
ENV_TABLE = "QUALIFY_KILL_TABLE"
STAGE_TIMEOUT_S = 600
GONE_WITHIN_S = 5.0
# run-specific fields of report.json; everything else must be equal
RUN_FIELDS = ("created", "run_dir", "run_id")
SLOW = pytest.mark.slow
FOREGROUND = ("import runpy, signal, sys; "
              "signal.signal(signal.SIGINT, signal.default_int_handler); "
              "sys.argv[0] = 'qualify'; runpy.run_module('qualify', run_name='__main__')")
"""``python -m qualify`` with Python's own SIGINT handler, however SIGINT was inherited."""


def _params(points: dict[str, Any]) -> list[Any]:
    return list(points)


def small_contract_text() -> str:
    """tiny-qwen3 (renamed) with torch_tp only, FP32 only, TP 1 only: one launch, two cells."""
    text = torch_tp_only_text()
    text, n = re.subn(r'(?m)^precisions = \[.*\]$', 'precisions = ["fp32"]', text, count=1)
    assert n == 1, "precisions line not found"
    text, n = re.subn(r'(?m)^tp_sizes = \[.*\]$', "tp_sizes = [1]", text, count=1)
    assert n == 1, "tp_sizes line not found"
    topo = '[[matrix.topologies]]\nname = "a1c1"\nactor_tp = 1\ncritic_tp = 1\n\n'
    text, n = re.subn(r"(?ms)^\[\[matrix\.topologies\]\]\n.*?(?=^\[(?!\[matrix\.topologies))",
                      topo, text, count=1)
    assert n == 1, "topologies not found"
    text, n = re.subn(r'(?m)^name = "tiny-qwen3"$', f'name = "{NAME}"', text, count=1)
    assert n == 1, "contract name not found"
    return re.sub(r"(?ms)^\[bounds\.floors\.bf16\]\n.*?(?=^\[|\Z)", "", text)


# --------------------------------------------------------------------------- processes


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Kit:
    """What every invocation shares: the contract, the keys, the environment."""

    root: Path
    contract: Path
    contracts_dir: Path
    keys: Path
    ref_name: str
    env: dict[str, str]

    def cmd(self, *args: str | Path) -> list[str]:
        return [sys.executable, "-m", "qualify", *map(str, args)]

    def run(self, *args: str | Path) -> tuple[int, str]:
        res = subprocess.run(self.cmd(*args), env=self.env, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=STAGE_TIMEOUT_S,
                             check=False)
        return res.returncode, res.stdout + res.stderr

    def start(self, *args: str | Path, crash: tuple[CrashPoint, Path] | None = None,
              foreground: bool = False) -> tuple[subprocess.Popen[bytes], str]:
        """Start ``qualify ARGS``; ``foreground``: SIGINT handled as in a terminal's
        foreground job (a background job of a shell inherits SIGINT ignored)."""
        tag = uuid.uuid4().hex
        env = {**self.env, ENV_TAG: tag}
        if crash is not None:
            env[ENV_CRASH_AT] = crash_spec(*crash)
        cmd = self.cmd(*args)
        if foreground:
            cmd[1:3] = ["-c", FOREGROUND]
        with (self.root / f"{tag}.stderr").open("wb") as err:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err)
        return proc, tag

    def stderr(self, tag: str) -> str:
        return (self.root / f"{tag}.stderr").read_text(errors="replace")


def _tagged(tag: str) -> list[psutil.Process]:
    """Every live process whose environment carries ``tag`` (the killed one's descendants)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(ENV_TAG) == tag:
                found.append(p)
        except psutil.Error:
            continue
    return found


def _survivors_after_kill(tag: str) -> tuple[int, float]:
    """Wait until no process of ``tag`` lives; return (survivors, seconds waited)."""
    t0 = time.monotonic()
    while (left := _tagged(tag)) and time.monotonic() - t0 < GONE_WITHIN_S:
        time.sleep(0.05)
    for p in left:  # never leave a stray process behind, even when failing
        p.kill()
    return len(left), time.monotonic() - t0


def _await_kill(kit: Kit, proc: subprocess.Popen[bytes], tag: str,
                when: Callable[[], bool] | None) -> tuple[int, int, float]:
    """Kill ``proc`` when ``when()`` holds (``None``: it kills itself at its crash point).

    Returns:
        (descendants alive at the kill, survivors, seconds until none was left).
    """
    deadline = time.monotonic() + STAGE_TIMEOUT_S
    family = 0
    if when is not None:
        while not when():
            assert proc.poll() is None, f"qualify ended before its kill point: {kit.stderr(tag)}"
            assert time.monotonic() < deadline, "the kill point never came"
            time.sleep(0.005)
        family = len(psutil.Process(proc.pid).children(recursive=True))
        proc.send_signal(signal.SIGKILL)
    rc = proc.wait(timeout=STAGE_TIMEOUT_S)
    assert rc == -signal.SIGKILL, f"qualify exited {rc}, not killed: {kit.stderr(tag)}"
    left, waited = _survivors_after_kill(tag)
    return family, left, waited


# --------------------------------------------------------------------------- evidence


def normal_report(run_dir: Path) -> dict[str, Any]:
    """``report.json`` without what names the run (see the module docstring)."""
    rep = copy.deepcopy(json.loads((run_dir / REPORT_JSON).read_text()))
    for key in RUN_FIELDS:
        rep.pop(key)
    rep["reference"].pop("path")
    rep["reference"].pop("manifest_digest")
    for cell in rep["cells"]:
        if cell.get("attempt"):
            cell["attempt"] = re.sub(r"attempt-[0-9]+$", "attempt-N", cell["attempt"])
    text = json.dumps(rep, sort_keys=True).replace(str(run_dir.resolve()), "RUN")
    out: dict[str, Any] = json.loads(text)
    return out


def _temporaries(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d).parent / (w.name if (w := atomic.temp_writer(p.name))
                                                 else p.name))
                  for p in d.rglob("*") if atomic.is_temporary(p.name))


def _finished_file_in(d: Path) -> bool:
    """Whether ``d`` holds a file whose atomic write finished (not a temporary file)."""
    try:
        return any(not atomic.is_temporary(n) for n in os.listdir(d))
    except FileNotFoundError:
        return False


def describe(d: Path) -> str:
    """The state a kill left in directory ``d``, in a few words."""
    if not d.exists():
        return "nothing"
    parts = ["sealed" if store.is_sealed(d) else "unsealed"]
    if (d / INCOMPLETE_FILE).exists():
        parts.append("INCOMPLETE")
    if store.is_sealed(d):
        parts.append("signed" if (d / ATTESTATION_FILE).exists() else "unsigned")
    parts += [f"temp of {t}" for t in _temporaries(d)]
    return ", ".join(parts)


def _sealed_files(d: Path, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    files: dict[str, Any] = store.read_manifest(d)["files"]
    return {k: v for k, v in files.items() if k not in skip}


@dataclasses.dataclass(slots=True, kw_only=True)
class Row:
    """One line of the kill table."""

    point: str
    killed: str
    state: str = ""
    after_kill: str = ""
    next_did: str = ""
    next_rc: str = ""
    equal: str = "no"
    gate: str = ""
    audit: str = ""

    def record(self) -> None:
        path = os.environ.get(ENV_TABLE)
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(dataclasses.asdict(self)) + "\n")


# --------------------------------------------------------------------------- fixtures


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Clean:
    """The uninterrupted job: its reference, its compared run, that run before compare."""

    reference: Path
    run: Path
    uncompared: Path
    report: dict[str, Any]


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kit]:
    root = tmp_path_factory.mktemp("kill")
    contracts = root / "contracts"
    contracts.mkdir()
    contract = contracts / f"{NAME}.toml"
    contract.write_text(small_contract_text(), encoding="utf-8")
    env = {**os.environ, "XDG_CONFIG_HOME": str(root / "xdg")}  # never the user's keys
    env.pop(ENV_CRASH_AT, None)
    keys = root / "keys"
    keys.mkdir()
    k = Kit(root=root, contract=contract, contracts_dir=contracts, keys=keys, env=env,
            ref_name=f"{NAME}-{load_contract(contract).digest12}")
    private = root / "signing-key.pem"
    rc, out = k.run("keygen", "--name", "kill-test", "--private-key", private,
                    "--public-dir", keys)
    assert rc == 0, out
    k.env["QUALIFY_SIGNING_KEY_FILE"] = str(private)
    yield k
    store.make_writable(root)


@pytest.fixture(scope="module")
def clean(kit: Kit) -> Clean:
    rc, out = kit.run("reference", kit.contract, "--out", kit.root / "clean-refs", "--quiet")
    assert rc == 0, out
    (ref,) = (kit.root / "clean-refs").iterdir()
    evidence = kit.root / "clean-evidence"
    rc, out = kit.run("candidate", kit.contract, "--reference", ref, "--out", evidence,
                      "--run-id", RUN_ID, "--quiet")
    assert rc == 0, out
    run = evidence / NAME / RUN_ID
    uncompared = kit.root / "uncompared"
    shutil.copytree(run, uncompared, symlinks=True)
    rc, out = kit.run("compare", run)
    assert rc == ExitCode.OK, out
    report = normal_report(run)
    assert report["passed"] is True
    assert {c["cell"]: c["verdict"] for c in report["cells"]} == {CELL_A: "PASS",
                                                                  CELL_C: "PASS"}
    return Clean(reference=ref, run=run, uncompared=uncompared, report=report)


@pytest.fixture
def row(request: pytest.FixtureRequest) -> Iterator[Row]:
    """The test's table row, recorded however the test ends (a failing point shows why)."""
    r = Row(point=request.node.callspec.params["point"], killed="")
    yield r
    r.record()


def _last_line(out: str) -> str:
    """The last line of ``out``, paths cut to their last component."""
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    return re.sub(r"/[^\s:]*/", "", lines[-1])[:160] if lines else ""


def _verified(kit: Kit, d: Path, row: Row | None = None) -> None:
    """``qualify verify`` of the resumed evidence exits 0 (and the row says so)."""
    rc, out = kit.run("verify", d, "--keys", kit.keys, "--contract", kit.contract)
    if row is not None:
        failed = [ln for ln in out.splitlines() if "[FAIL]" in ln]
        row.equal += f"; verify {rc}" + (f" ({_last_line(failed[0])})" if failed else "")
    assert rc == ExitCode.OK, out


def _audit_gate(kit: Kit, where: Path, evidence: Path | None) -> str:
    """``qualify audit`` (and ``gate`` of ``evidence``) of a killed state: both exit 3."""
    rc, out = kit.run("audit", where, "--keys", kit.keys, "--contracts-dir", kit.contracts_dir)
    assert rc == ExitCode.INTEGRITY_ERROR, out
    problems = re.search(r"([0-9]+) problem", out)
    assert problems is not None, out
    assert int(problems.group(1)) > 0, out
    said = f"audit {rc}"
    if evidence is not None:
        rc, out = kit.run("gate", evidence, "--contract", kit.contract, "--keys", kit.keys)
        assert rc == ExitCode.INTEGRITY_ERROR, out
        said += f", gate {rc}"
    return said


def _equal(clean: Clean, run: Path, row: Row) -> None:
    got = normal_report(run)
    assert got == clean.report
    row.equal = f"yes ({len(got['rows'])} rows)"


# --------------------------------------------------------------------------- reference


REFERENCE_POINTS: dict[str, tuple[str, tuple[CrashPoint, str] | None]] = {
    "ref-controls": ("`qualify run` SIGKILLed once its first control's file is written "
                     "(mid-controls)", None),
    "ref-write": ("`qualify run` SIGKILLed inside the atomic write of bounds.json",
                  ("write", "bounds.json")),
    "ref-sign": ("`qualify run` SIGKILLed while signing the sealed reference",
                 ("rename", ATTESTATION_FILE)),
}


@SLOW
@pytest.mark.parametrize("point", _params(REFERENCE_POINTS))
def test_reference_killed_then_qualify_run_finishes(kit: Kit, clean: Clean, row: Row,
                                                    point: str) -> None:
    what, hook = REFERENCE_POINTS[point]
    row.killed = what
    refs, evidence = kit.root / point / "refs", kit.root / point / "evidence"
    ref = refs / kit.ref_name
    crash = (hook[0], ref / hook[1]) if hook else None
    proc, tag = kit.start("run", kit.contract, "--references", refs, "--evidence", evidence,
                          "--quiet", crash=crash)
    controls = ref / "controls"
    _, left, _ = _await_kill(
        kit, proc, tag, None if hook else lambda: _finished_file_in(controls))
    assert left == 0, f"{left} processes outlived the kill"
    row.state = describe(ref)
    assert not (evidence.exists() and any(evidence.rglob(RUN_FILE)))  # no run started
    if point == "ref-sign":
        assert store.is_sealed(ref)
        assert not (ref / ATTESTATION_FILE).exists()
        assert _temporaries(ref) == [ATTESTATION_FILE]
        sealed_digest = store.manifest_digest(ref)
    else:
        assert not store.is_sealed(ref)
        assert (ref / INCOMPLETE_FILE).exists()
        if point == "ref-write":
            assert "bounds.json" in _temporaries(ref)
            assert not (ref / "bounds.json").exists()
    row.after_kill = _audit_gate(kit, refs, None)
    if point == "ref-sign":  # the reference stage alone, rerun: never rebuilds a sealed one
        rc, out = kit.run("reference", kit.contract, "--out", refs, "--quiet")
        assert rc in (ExitCode.OK, ExitCode.USAGE_ERROR), out
        assert store.manifest_digest(ref) == sealed_digest
        said = "signed it" if (ref / ATTESTATION_FILE).exists() else \
            f"did not sign it ({_last_line(out)})"
        row.next_did = f"`qualify reference`: exit {rc}, {said}; then `qualify run`: "
        row.next_rc = f"{rc}, "

    rc, out = kit.run("run", kit.contract, "--references", refs, "--evidence", evidence,
                      "--quiet")
    row.next_rc += str(rc)
    if rc != ExitCode.OK:
        row.next_did += f"`qualify run` failed: {_last_line(out)}"
    assert rc == ExitCode.OK, out
    assert store.is_sealed(ref)
    assert _temporaries(ref) == []
    _verified(kit, ref)
    if point == "ref-sign":
        assert store.manifest_digest(ref) == sealed_digest  # the same sealed files, signed
        row.next_did += "reused the sealed reference, signed it; ran candidate + compare"
    else:
        (aside,) = [p for p in refs.iterdir() if INCOMPLETE_INFIX in p.name]
        assert not store.is_sealed(aside)  # the interrupted reference is kept, never reused
        row.next_did = ("moved the killed reference aside (*.incomplete-*), rebuilt and "
                        "sealed it; ran candidate + compare")
    skip = ("reference.json", "environment.json")
    assert _sealed_files(ref, skip=skip) == _sealed_files(clean.reference, skip=skip)
    (run,) = [p.parent for p in evidence.rglob(RUN_FILE)]
    _equal(clean, run, row)
    row.equal += "; reference files identical but reference.json, environment.json"
    _verified(kit, run, row)


# --------------------------------------------------------------------------- candidate


CANDIDATE_POINTS = {
    "cand-start": "`qualify candidate` SIGKILLed as its first launch starts (cell.json "
                  "written), before that launch finishes",
    "cand-ranks": "`qualify candidate` SIGKILLed mid-launch, torchrun and its ranks alive",
    "cand-split": "`qualify candidate` SIGKILLed inside the write of the first cell's "
                  "outputs (the launch finished, run.json not yet listing its cells)",
}


@SLOW
@pytest.mark.parametrize("point", list(CANDIDATE_POINTS))
def test_candidate_killed_then_resumed_by_run_id(kit: Kit, clean: Clean, row: Row,
                                                 point: str) -> None:
    row.killed = CANDIDATE_POINTS[point]
    evidence = kit.root / point / "evidence"
    run = evidence / NAME / RUN_ID
    candidate = ("candidate", kit.contract, "--reference", clean.reference, "--out",
                 evidence, "--run-id", RUN_ID, "--quiet")
    when: Callable[[], bool] | None = None
    crash: tuple[CrashPoint, Path] | None = None
    if point == "cand-start":
        when = (run / "launches" / LAUNCH / "attempt-1" / "cell.json").is_file
    elif point == "cand-ranks":
        def when() -> bool:
            return any((run / "launches").glob("*/attempt-1/logs/ranks/**/stdout.log"))
    else:
        crash = ("write", run / "cells" / CELL_A / "attempt-1" / "outputs.safetensors")
    proc, tag = kit.start(*candidate, crash=crash)
    family, left, waited = _await_kill(kit, proc, tag, when)
    assert left == 0, f"{left} processes outlived the kill"
    row.state = describe(run)
    if point == "cand-ranks":
        assert family >= 2, "torchrun and its ranks were not running at the kill"
        row.state += (f"; {family} descendant processes alive at the kill, none left "
                      f"after {waited:.1f} s")
    assert (run / INCOMPLETE_FILE).exists()
    # run.json is written before the first launch; no cell is recorded before it is sealed
    assert not any(c["status"] == "COMPLETE"
                   for c in json.loads((run / RUN_FILE).read_text())["cells"].values())
    first = run / "launches" / LAUNCH / "attempt-1"
    row.state += f"; launch attempt-1 {describe(first).split(',')[0]}"
    if point == "cand-split":
        assert (first / "fp32" / "outputs.json").is_file()  # the launch had finished
        assert "cells/torch_tp-fp32-actor-tp1/attempt-1/outputs.safetensors" in \
            _temporaries(run)
    row.after_kill = _audit_gate(kit, evidence, evidence)

    rc, out = kit.run(*candidate)
    row.next_rc = str(rc)
    if rc != ExitCode.OK:
        row.next_did = f"`qualify candidate` failed: {_last_line(out)}"
    assert rc == ExitCode.OK, out
    rc2, out = kit.run("compare", run)
    row.next_rc += f", {rc2}"
    if rc2 != ExitCode.OK:
        row.next_did = f"`qualify compare` failed: {_last_line(out)}"
    assert rc2 == ExitCode.OK, out
    assert store.is_sealed(run)
    launches = store.attempts(run / "launches" / LAUNCH)
    assert store.is_sealed(launches[-1])
    kept = [f"{a.name} ({'sealed' if store.is_sealed(a) else 'unsealed'})"
            for a in launches[:-1]]
    if point == "cand-start":
        row.next_did = "resumed the run id (took the dead writer's lock over)"
    else:
        assert kept, "the killed launch attempt was not kept"
        row.next_did = "resumed the run id"
    row.next_did += (f"; killed launch attempts kept: {', '.join(kept) or 'none'}; "
                     f"launched {launches[-1].name}; compare sealed + signed the run")
    assert _temporaries(run) == []
    _equal(clean, run, row)
    _verified(kit, run, row)


# --------------------------------------------------------------------------- compare

COMPARE_POINTS: dict[str, tuple[str, CrashPoint, str]] = {
    "cmp-report": ("`qualify compare` SIGKILLed inside the write of report.json", "write",
                   REPORT_JSON),
    "cmp-seal": ("`qualify compare` SIGKILLed inside the write of the run's MANIFEST.json "
                 "(sealing)", "write", MANIFEST_FILE),
    "cmp-sign": ("`qualify compare` SIGKILLed while signing (before the no-replace rename "
                 "of the attestation)", "rename", ATTESTATION_FILE),
}


@pytest.mark.parametrize("point", _params(COMPARE_POINTS))
def test_compare_killed_then_compare_again(kit: Kit, clean: Clean, row: Row, point: str,
                                           ) -> None:
    what, hook, name = COMPARE_POINTS[point]
    row.killed = what
    evidence = kit.root / point / "evidence"
    run = evidence / NAME / RUN_ID
    run.parent.mkdir(parents=True)
    shutil.copytree(clean.uncompared, run, symlinks=True)  # the clean run, not yet compared
    proc, tag = kit.start("compare", run, crash=(hook, run / name))
    _, left, _ = _await_kill(kit, proc, tag, None)
    assert left == 0
    row.state = describe(run)
    assert name in _temporaries(run)
    assert not (run / name).exists()
    assert not (run / ATTESTATION_FILE).exists()
    if point == "cmp-sign":
        assert store.is_sealed(run)
        report = (run / REPORT_JSON).read_bytes()
    else:
        assert not store.is_sealed(run)
    row.after_kill = _audit_gate(kit, evidence, evidence)

    rc, out = kit.run("compare", run)
    row.next_rc = str(rc)
    if rc != ExitCode.OK:
        row.next_did = f"`qualify compare` failed: {_last_line(out)}"
    assert rc == ExitCode.OK, out
    assert store.is_sealed(run)
    assert _temporaries(run) == []
    if point == "cmp-sign":
        assert (run / REPORT_JSON).read_bytes() == report  # sealed report kept, not rewritten
        row.next_did = "signed the sealed run (report recomputed, not rewritten)"
    else:
        row.next_did = "removed the dead writer's temp, wrote the report, sealed, signed"
    _equal(clean, run, row)
    _verified(kit, run, row)


# --------------------------------------------------------------------------- qualify run
# Issue #43 item 5: ``qualify run`` interrupted (kill -9, SIGINT, SIGTERM of the process
# alone, a full disk); the next plain ``qualify run`` resumes the run, or supersedes it
# (kept whole), and then ``qualify gate`` exits 0 and ``qualify audit`` lists it, with
# nothing deleted or edited by hand.

RUN_POINTS: dict[str, tuple[str, signal.Signals | None]] = {
    "run-kill9": ("`qualify run` SIGKILLed (kill -9, the process alone) mid-launch, torchrun "
                  "and its ranks alive", signal.SIGKILL),
    "run-sigint": ("`qualify run` sent SIGINT (Ctrl-C, the process alone) mid-launch",
                   signal.SIGINT),
    "run-sigterm": ("`qualify run` sent SIGTERM (the process alone) mid-launch",
                    signal.SIGTERM),
    "run-full": ("`qualify run --run-id killed`: the disk is full (ENOSPC) when it writes the "
                 "first cell's outputs", None),
    "run-cells": ("`qualify run --cells <actor>` SIGKILLed mid-launch; the plain rerun "
                  "selects every cell, so it cannot resume that run", signal.SIGKILL),
    "run-seal": ("`qualify run` (resuming a run whose candidate stage had finished) "
                 "SIGKILLed inside the write of the run's MANIFEST.json", None),
    "run-sign": ("`qualify run` (resuming a run whose candidate stage had finished) "
                 "SIGKILLed while signing the sealed run", None),
}
# the exit of the interrupted process: by the signal, or qualify's own one-line exit
RUN_EXITS = {signal.SIGKILL: -signal.SIGKILL, signal.SIGTERM: -signal.SIGTERM,
             signal.SIGINT: ExitCode.INTERRUPTED}


def _ranks_alive(evidence: Path) -> Callable[[], bool]:
    def when() -> bool:
        return any(evidence.glob(f"{NAME}/*/launches/*/attempt-1/logs/ranks/**/stdout.log"))
    return when


def _audit_rows(kit: Kit, evidence: Path) -> tuple[int, list[dict[str, Any]]]:
    rc, out = kit.run("audit", evidence, "--keys", kit.keys, "--contracts-dir",
                      kit.contracts_dir, "--format", "json")
    start = out.index("{")
    rows: list[dict[str, Any]] = json.loads(out[start:out.rindex("}") + 1])["rows"]
    return rc, rows


@pytest.mark.parametrize("point", [pytest.param(p, marks=() if p == "run-seal" else SLOW)
                                   for p in RUN_POINTS])
def test_qualify_run_interrupted_then_plain_rerun_gates_green(kit: Kit, clean: Clean,
                                                              row: Row, point: str) -> None:
    what, sig = RUN_POINTS[point]
    row.killed = what
    refs, evidence = kit.root / point / "refs", kit.root / point / "evidence"
    refs.mkdir(parents=True)
    shutil.copytree(clean.reference, refs / clean.reference.name, symlinks=True)
    runs = evidence / NAME
    run_args: tuple[str | Path, ...] = ("run", kit.contract, "--references", refs,
                                        "--evidence", evidence, "--quiet")
    first = run_args
    crash: tuple[CrashPoint, Path] | None = None
    if point == "run-full":
        first = (*run_args, "--run-id", RUN_ID)
        crash = ("full", runs / RUN_ID / "cells" / CELL_A / "attempt-1" / "outputs.safetensors")
    elif point == "run-cells":
        first = (*run_args, "--cells", CELL_A)
    elif point in ("run-seal", "run-sign"):
        runs.mkdir(parents=True)
        shutil.copytree(clean.uncompared, runs / RUN_ID, symlinks=True)
        crash = ("write", runs / RUN_ID / MANIFEST_FILE) if point == "run-seal" \
            else ("rename", runs / RUN_ID / ATTESTATION_FILE)
    proc, tag = kit.start(*first, crash=crash, foreground=sig == signal.SIGINT)
    if sig is None:
        rc = proc.wait(timeout=STAGE_TIMEOUT_S)
    else:
        when = _ranks_alive(evidence)
        deadline = time.monotonic() + STAGE_TIMEOUT_S
        while not when():
            assert proc.poll() is None, f"qualify ended before its kill point: {kit.stderr(tag)}"
            assert time.monotonic() < deadline, "the kill point never came"
            time.sleep(0.005)
        proc.send_signal(sig)  # the process alone, not its group
        rc = proc.wait(timeout=STAGE_TIMEOUT_S)
    left, waited = _survivors_after_kill(tag)
    assert left == 0, f"{left} processes outlived the interruption"
    err = [ln for ln in kit.stderr(tag).strip().splitlines() if ln.strip()]
    if point == "run-full":
        assert rc == ExitCode.USAGE_ERROR, err
        assert err[-1].startswith("qualify: error: "), err
        assert "ENOSPC" in err[-1], err
        assert not any("Traceback" in ln for ln in err), err
    elif point in ("run-seal", "run-sign"):
        assert rc == -signal.SIGKILL, err
    else:
        assert sig is not None
        assert rc == RUN_EXITS[sig], err
    (killed,) = [p for p in runs.iterdir() if p.is_dir()]
    assert store.is_sealed(killed) == (point == "run-sign")
    assert not (killed / ATTESTATION_FILE).exists()
    said = f"exit {rc}" + (f" ({_last_line(err[-1])})" if rc >= 0 and err else "")
    row.state = f"{said}; run {describe(killed)}; no process left after {waited:.1f} s"
    row.after_kill = _audit_gate(kit, evidence, evidence)

    views = kit.root / point / "views"  # run-seal (the default tier): its CI documents
    views.mkdir()
    ci_views: tuple[str | Path, ...] = ("--junit-xml", views / "run.xml", "--summary",
                                        views / "summary.md") if point == "run-seal" else ()
    rc, out = kit.run(*run_args, *ci_views)
    row.next_rc = str(rc)
    assert rc == ExitCode.OK, out
    dirs = sorted(p.name for p in runs.iterdir() if p.is_dir())
    if point == "run-cells":
        (new,) = [d for d in dirs if d != killed.name]
        assert f"superseding interrupted run {killed.name}: another --cells selection" in out
        marker = supersede.read_marker(killed)
        assert marker is not None
        assert marker.superseded_by == new
        assert (killed / INCOMPLETE_FILE).exists()  # kept whole, nothing deleted
        row.next_did = (f"superseded {killed.name} (another --cells selection; kept, "
                        f"superseded.json), ran {new}, sealed + signed it")
        run = runs / new
    else:
        assert dirs == [killed.name], dirs  # resumed: no second run
        line = f"resuming interrupted run {killed.name} (started "
        assert line in out, out
        row.next_did = f"'{line}...)'; " + ("signed it (sealed before the kill), decided on "
                                            "it" if point == "run-sign" else
                                            "sealed + signed it")
        run = killed
    assert store.is_sealed(run)
    assert _temporaries(run) == []
    _equal(clean, run, row)
    _verified(kit, run, row)

    rc, out = kit.run("gate", evidence, "--contract", kit.contract, "--keys", kit.keys,
                      *(("--junit-xml", views / "gate.xml") if ci_views else ()))
    row.gate = f"{rc}: {_last_line(out.splitlines()[1] if len(out.splitlines()) > 1 else out)}"
    assert rc == ExitCode.OK, out
    if ci_views:  # qualify run --junit-xml / --summary: the gate's documents, its decision
        from test_junit import XSD, _shape

        run_xml = (views / "run.xml").read_text(encoding="utf-8")
        XSD.validate(run_xml)
        assert _shape(run_xml) == _shape((views / "gate.xml").read_text(encoding="utf-8"))
        assert set(_shape(run_xml)) == {CELL_A, CELL_C}
        assert (views / "summary.md").read_text(encoding="utf-8").startswith(
            "## qualify run: PASS (exit 0)")
    rc, rows = _audit_rows(kit, evidence)
    row.audit = f"exit {rc}; " + "; ".join(
        f"{r['run_id']}: {r['integrity']}, {r['verdict']}, {len(r['problems'])} problems"
        for r in rows)
    assert rc == ExitCode.OK, rows
    assert {r["run_id"]: r["integrity"] for r in rows} == (
        {killed.name: "SUPERSEDED", run.name: "ok"} if run != killed else {run.name: "ok"})


# --------------------------------------------------------------------------- the hook


def test_crash_hook_kills_only_at_its_point_and_path(tmp_path: Path) -> None:
    """The hook is inert unless its point and exact path match; then it is a real SIGKILL."""
    target, other = tmp_path / "a.json", tmp_path / "b.json"
    with pytest.raises(ValueError, match="crash point 'seal'"):
        crash_spec("seal", target)  # type: ignore[arg-type]
    script = ("import sys; from qualify import atomic; "
              "atomic.write_json(sys.argv[1], {'b': 1}); atomic.write_json(sys.argv[2], {'a': 1})")
    env = {**os.environ, ENV_CRASH_AT: crash_spec("rename", target)}
    res = subprocess.run([sys.executable, "-c", script, other, target], env=env, check=False)
    assert res.returncode == 0  # a write is not a rename: inert
    target.unlink()
    env[ENV_CRASH_AT] = crash_spec("write", target)
    res = subprocess.run([sys.executable, "-c", script, other, target], env=env, check=False)
    assert res.returncode == -signal.SIGKILL
    assert json.loads(other.read_text()) == {"b": 1}  # another path: written
    assert not target.exists()
    assert _temporaries(tmp_path) == ["a.json"]  # killed between the temp and the rename
