"""Crash recovery by the tool alone: each kill point of a hostile session, then a resume.

Every kill is real (a child process SIGKILLed at the point, or the exact leftover an older
version left), and every resume goes through qualify's own calls or CLI: no test deletes a
leftover by hand.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from test_signing import pem_of
from test_verify import World, run_cli, signed_world, world

from qualify import atomic, procs
from qualify.candidate.stage import check_run_id, run_candidate_stage
from qualify.contract import load_contract
from qualify.errors import EvidenceIntegrityError, ExitCode, UsageError, WriterBusyError
from qualify.evidence import sign as signing
from qualify.evidence import store
from qualify.layout import INCOMPLETE_FILE, MANIFEST_FILE

__all__ = ["signed_world", "world"]  # fixtures shared with test_verify

# A writer that is SIGKILLed in the middle of an atomic write: it writes half a file into
# the temporary file, says so, and waits to be killed.
HALF_WRITER = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    from qualify import atomic
    def write(f):
        f.write(b'{"half": ')
        f.flush()
        Path(sys.argv[2]).write_text(str(os.getpid()))
        time.sleep(120)
    atomic.write_with(sys.argv[1], write)
''')

# A signer that is SIGKILLed after writing its envelope's temporary file, before the rename.
KILLED_SIGNER = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    from qualify import atomic
    from qualify.evidence import store
    def hang(src, dst):
        Path(sys.argv[2]).write_text(str(os.getpid()))
        time.sleep(120)
    atomic.rename_noreplace = hang
    store.add_attestation(Path(sys.argv[1]), "x.dsse.json", b'{"payload": "x"}')
''')

# A process that holds a directory's writer lock until it is killed.
LOCK_HOLDER = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    from qualify.evidence import store
    with store.hold_writer_lock(Path(sys.argv[1]), kind="candidate-run"):
        Path(sys.argv[2]).write_text(str(os.getpid()))
        time.sleep(120)
''')

# A candidate stage killed before its first launch: it stops (and waits to be killed)
# where it would stage the run's inputs, after its first write.
KILLED_CANDIDATE = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    import qualify.candidate.stage as stage
    from qualify.contract import load_contract
    def hang(*args, **kwargs):
        Path(sys.argv[4]).write_text(str(os.getpid()))
        time.sleep(120)
    stage._stage_inputs = hang
    stage.run_candidate_stage(load_contract(Path(sys.argv[1])), reference=Path(sys.argv[2]),
                              root=Path(sys.argv[3]), run_id="r-killed", quiet=True)
''')

# A qualify-like parent: runs a launch-like tree through qualify.procs.run and waits. The
# tree: torchrun with two ranks (``torchrun``), qualify's warm launcher with two forked
# ranks (``warm``), or a child that forks grandchildren in sessions of their own and ends
# them on SIGTERM, as torchrun does (``tree``).
PARENT = textwrap.dedent('''
    import os, signal, sys
    from pathlib import Path
    from qualify import procs
    # as in a terminal's foreground job (a background job of a script inherits SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out, kind = sys.argv[1], sys.argv[2]
    env = None
    if kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", "2", "--max-restarts", "0", sys.argv[3], out]
    elif kind == "warm":  # qualify's own launcher: the rank script as a module, forked
        script = Path(sys.argv[3])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent),
                                                            os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "qualify.candidate.warm", "--nproc-per-node", "2",
               "--log-dir", str(Path(out) / "logs"), script.stem, out]
    else:
        cmd = [sys.executable, sys.argv[3], out]
    procs.run(cmd, timeout_s=300, env=env)
''')
RANK = textwrap.dedent('''
    import os, sys, time
    from pathlib import Path
    Path(sys.argv[1], "rank" + os.environ["RANK"]).write_text(str(os.getpid()))
    time.sleep(120)
''')
TREE = textwrap.dedent('''
    import os, signal, sys, time
    from pathlib import Path
    out = Path(sys.argv[1])
    kids = []
    for i in range(2):
        pid = os.fork()
        if pid == 0:
            os.setsid()
            (out / f"grandchild{i}").write_text(str(os.getpid()))
            time.sleep(120)
            os._exit(0)
        kids.append(pid)
    def end(signum, frame):
        for k in kids:
            os.kill(k, signal.SIGKILL)
        os._exit(1)
    signal.signal(signal.SIGTERM, end)
    (out / "child").write_text(str(os.getpid()))
    time.sleep(120)
''')


def _spawn(script: str, *args: str | Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                            stdin=subprocess.DEVNULL)


def _wait_for(path: Path, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while not path.is_file() or not path.read_text():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)
    return int(path.read_text())


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def _partials(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if atomic.is_temporary(p.name))


@pytest.fixture
def claimed(tmp_path: Path) -> Iterator[Path]:
    d = store.claim_dir(tmp_path / "ref", kind="reference")
    store.atomic_write_json(d / "a.json", {"a": 1})
    yield d
    store.make_writable(tmp_path)


# --------------------------------------------------------------------------- 1. .partial


def test_partial_of_a_killed_writer_is_removed_when_sealing(claimed: Path, tmp_path: Path
                                                            ) -> None:
    child = _spawn(HALF_WRITER, claimed / "b.json", tmp_path / "ready")
    pid = _wait_for(tmp_path / "ready")
    (partial,) = _partials(claimed)
    writer = atomic.temp_writer(partial.name)
    assert writer == atomic.TempWriter(name="b.json", host=atomic.host_tag(), pid=pid)
    assert atomic.writer_alive(partial) is True
    with pytest.raises(EvidenceIntegrityError, match=f"process {pid} .*still running"):
        store.seal(claimed, kind="reference")  # a live writer's temp is never touched
    assert partial.is_file()
    _kill(child)
    assert atomic.writer_alive(partial) is False
    digest = store.seal(claimed, kind="reference")  # the retry seals by itself
    assert store.is_sealed(claimed)
    assert _partials(claimed) == []
    assert sorted(store.read_manifest(claimed)["files"]) == ["a.json"]
    assert store.check_sealed(claimed) == digest
    assert not (claimed / "b.json").exists()  # the interrupted write never happened


def test_next_write_of_the_same_file_removes_only_its_dead_partial(claimed: Path,
                                                                   tmp_path: Path) -> None:
    child = _spawn(HALF_WRITER, claimed / "b.json", tmp_path / "ready")
    _wait_for(tmp_path / "ready")
    _kill(child)
    (dead,) = _partials(claimed)
    other = _spawn(HALF_WRITER, claimed / "c.json", tmp_path / "ready-2")
    _wait_for(tmp_path / "ready-2")
    try:
        store.atomic_write_json(claimed / "b.json", {"b": 2})
        assert not dead.exists()
        (live,) = _partials(claimed)
        assert atomic.temp_writer(live.name).name == "c.json"  # type: ignore[union-attr]
        assert json.loads((claimed / "b.json").read_text()) == {"b": 2}
    finally:
        _kill(other)


def test_a_recycled_pid_is_not_the_writer_and_an_unknown_writer_is_kept(tmp_path: Path
                                                                        ) -> None:
    newer = _spawn("import time; time.sleep(60)")
    try:
        old = tmp_path / f".tmp-x.json.{atomic.host_tag()}.{newer.pid}.abc123.partial"
        old.write_text("")
        past = psutil.Process(newer.pid).create_time() - 60
        os.utime(old, (past, past))  # written a minute before that pid's process started
        assert atomic.writer_alive(old) is False
        remote = tmp_path / f".tmp-x.json.elsewhere.{newer.pid}.abc123.partial"
        legacy = tmp_path / ".tmp-x.json.abc123.partial"
        for p in (remote, legacy):
            p.write_text("")
            assert atomic.writer_alive(p) is None
        assert atomic.remove_stale_temporaries(tmp_path) == [old]
        assert remote.exists()
        assert legacy.exists()
    finally:
        _kill(newer)


def test_recursive_removal_takes_a_dead_writers_directory_whole(tmp_path: Path) -> None:
    """``recursive=True`` (:func:`qualify.evidence.store` claims a directory so): a dead
    writer's temporary directory at any depth goes whole, its own temporary-named contents
    included (reported once, as the directory); a live writer's directory stays, while a
    dead writer's file inside it goes."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          check=True, capture_output=True, text=True).stdout.strip()
    host = atomic.host_tag()
    deep = tmp_path / "a" / "b"
    dead = deep / f".tmp-spill.{host}.{gone}.abc.partial"
    (dead / "tok").mkdir(parents=True)
    (dead / "tok" / f".tmp-x.json.{host}.{gone}.def.partial").write_text("x")
    live = tmp_path / "a" / f"{atomic.temp_prefix('spill')}ghi.partial"
    live.mkdir()
    inside = live / f".tmp-y.json.{host}.{gone}.jkl.partial"
    inside.write_text("y")
    kept = deep / "kept.json"
    kept.write_text("{}")
    assert atomic.remove_stale_temporaries(tmp_path, recursive=True) == sorted([dead, inside])
    assert not dead.exists()
    assert live.is_dir()
    assert not inside.exists()
    assert kept.is_file()


def test_host_tag_has_no_dot() -> None:
    assert atomic.host_tag("node-1.cluster.example") == "node-1-cluster-example"
    assert "." not in atomic.host_tag()


# --------------------------------------------------------------------------- 2. signing


def test_a_truncated_attestation_is_kept_not_resigned(world: World, tmp_path: Path) -> None:
    """Content that is not a whole envelope is damaged or tampered evidence: never replaced."""
    run = world.good
    store.make_writable(run)
    att = run / signing.ATTESTATION_FILE
    att.write_bytes(att.read_bytes()[:100])
    os.chmod(att, 0o444)
    for sub in [run, *[p for p in run.rglob("*") if p.is_dir()]]:
        os.chmod(sub, 0o555)
    assert not signing.needs_signature(run)
    key_file = tmp_path / "k.pem"
    key_file.write_bytes(pem_of(world.key))
    key_file.chmod(0o600)
    before = att.read_bytes()
    code, _ = run_cli(["sign", str(run), "--key", str(key_file)])
    assert code == ExitCode.INTEGRITY_ERROR
    assert att.read_bytes() == before
    assert not world.verify(run)


@pytest.mark.parametrize("leftover", [b""])
def test_partial_attestation_is_resigned_by_qualify_sign(world: World, tmp_path: Path,
                                                         leftover: bytes) -> None:
    """A signer killed mid-write (an older qualify left a 0-byte file) is signed again."""
    run = world.good
    store.make_writable(run)
    att = run / signing.ATTESTATION_FILE
    att.write_bytes(leftover)
    os.chmod(att, 0o444)
    for sub in [run, *[p for p in run.rglob("*") if p.is_dir()]]:
        os.chmod(sub, 0o555)
    assert store.is_sealed(run)
    assert signing.needs_signature(run)
    assert not world.verify(run)
    key_file = tmp_path / "k.pem"
    key_file.write_bytes(pem_of(world.key))
    key_file.chmod(0o600)
    code, _ = run_cli(["sign", str(run), "--key", str(key_file)])
    assert code == ExitCode.OK
    assert world.verify(run), world.verify(run).summary_lines()
    assert not signing.needs_signature(run)
    assert _partials(run) == []
    before = att.read_bytes()
    code, _ = run_cli(["sign", str(run), "--key", str(key_file)])
    assert code == ExitCode.INTEGRITY_ERROR  # a valid attestation is never overwritten
    assert att.read_bytes() == before


def test_qualify_compare_resumes_a_sealed_unsigned_run(world: World, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``qualify compare`` killed after the seal, before the signature: a rerun signs the run
    (its sealed report is recomputed, not rewritten) and exits by the verdict."""
    run = world.good
    store.make_writable(run)
    (run / signing.ATTESTATION_FILE).unlink()
    for sub in [run, *[p for p in run.rglob("*") if p.is_dir()]]:
        os.chmod(sub, 0o555)
    report = (run / "report.json").read_bytes()
    assert signing.needs_signature(run)
    key_file = tmp_path / "k.pem"
    key_file.write_bytes(pem_of(world.key))
    key_file.chmod(0o600)
    monkeypatch.setenv("QUALIFY_SIGNING_KEY_FILE", str(key_file))
    code, _ = run_cli(["compare", str(run)])
    passed = json.loads(report)["passed"]
    assert code == (ExitCode.OK if passed else ExitCode.QUALIFICATION_FAILED)
    assert not signing.needs_signature(run)
    assert (run / "report.json").read_bytes() == report
    assert world.verify(run), world.verify(run).summary_lines()


def test_a_real_attestation_is_never_replaced(world: World) -> None:
    att = world.good / signing.ATTESTATION_FILE
    store.make_writable(world.good)
    att.write_text('{"edited": true}')  # an edited attestation is evidence, not a leftover
    assert not store.is_partial_attestation(att)
    with pytest.raises(EvidenceIntegrityError, match="never overwritten"):
        signing.sign_directory(world.good, world.key)
    assert json.loads(att.read_text()) == {"edited": True}


def test_signer_killed_before_its_rename_leaves_no_attestation(claimed: Path,
                                                                tmp_path: Path) -> None:
    """SIGKILL a signer between its temporary file and the rename; the next one signs."""
    store.seal(claimed, kind="reference")
    child = _spawn(KILLED_SIGNER, claimed, tmp_path / "ready")
    pid = _wait_for(tmp_path / "ready")
    _kill(child)
    (left,) = _partials(claimed)
    assert atomic.temp_writer(left.name) == atomic.TempWriter(
        name="x.dsse.json", host=atomic.host_tag(), pid=pid)
    assert not (claimed / "x.dsse.json").exists()
    path = store.add_attestation(claimed, "x.dsse.json", b'{"payload": "y"}')
    assert path.read_bytes() == b'{"payload": "y"}'
    assert _partials(claimed) == []
    assert stat.S_IMODE(claimed.stat().st_mode) == 0o555  # read-only again
    assert store.verify_manifest(claimed) == []


def test_rename_noreplace_never_overwrites(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_text("new")
    dst.write_text("old")
    with pytest.raises(FileExistsError):
        atomic.rename_noreplace(src, dst)
    assert (src.read_text(), dst.read_text()) == ("new", "old")
    dst.unlink()
    atomic.rename_noreplace(src, dst)
    assert not src.exists()
    assert dst.read_text() == "new"


# --------------------------------------------------------------------------- 3. INCOMPLETE


def test_run_marker_lives_from_the_first_write_to_the_seal(world: World, tmp_path: Path
                                                           ) -> None:
    """A candidate killed before its first launch: incomplete for audit and gate; resumable."""
    evidence = world.root / "evidence"
    child = _spawn(KILLED_CANDIDATE, world.contract, world.reference, evidence,
                   tmp_path / "ready")
    pid = _wait_for(tmp_path / "ready")
    run = evidence / "gate-tiny" / "r-killed"
    marker = json.loads((run / INCOMPLETE_FILE).read_text())
    assert (marker["pid"], marker["host"], marker["kind"]) == (pid, socket.gethostname(),
                                                               "candidate-run")
    with pytest.raises(WriterBusyError, match=f"process {pid} on host"):
        store.seal(run, kind="candidate-run")  # a live writer's run is never sealed
    _kill(child)
    assert store.is_incomplete(run)
    assert not store.is_sealed(run)
    code, out = run_cli(["audit", str(evidence), "--keys", str(world.keys),
                         "--contracts-dir", str(world.contracts)])
    assert code == ExitCode.INTEGRITY_ERROR, out
    assert "r-killed" in out
    assert "INCOMPLETE" in out
    code, out = run_cli(["gate", str(evidence), "--keys", str(world.keys),
                         "--contract", str(world.contract)])
    assert code == ExitCode.INTEGRITY_ERROR, out
    # the next writer takes the dead writer's lock over; the marker stays until the seal
    with store.hold_writer_lock(run, kind="candidate-run") as path:
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert store.is_incomplete(run)
    store.atomic_write_json(run / "notes.json", {"resumed": True})
    store.seal(run, kind="candidate-run")
    assert store.is_sealed(run)
    assert not (run / INCOMPLETE_FILE).exists()
    assert INCOMPLETE_FILE not in store.read_manifest(run)["files"]


# --------------------------------------------------------------------------- 4. process tree


@pytest.mark.parametrize(("kind", "sig"), [("tree", signal.SIGKILL),
                                           ("torchrun", signal.SIGKILL),
                                           ("torchrun", signal.SIGINT),
                                           ("warm", signal.SIGKILL),
                                           ("warm", signal.SIGINT)])
def test_launch_tree_dies_with_a_killed_qualify(tmp_path: Path, kind: str, sig: int) -> None:
    """Kill (SIGKILL) or Ctrl-C (SIGINT) the process that called procs.run: every
    descendant is gone within seconds."""
    script = tmp_path / "child_rank.py"
    script.write_text(TREE if kind == "tree" else RANK)
    parent = _spawn(PARENT, tmp_path, kind, script)
    names = ["rank0", "rank1"] if kind != "tree" else ["child", "grandchild0", "grandchild1"]
    pids = [_wait_for(tmp_path / n, timeout_s=120) for n in names]
    family = psutil.Process(parent.pid).children(recursive=True)
    assert {p.pid for p in family} >= set(pids)
    t0 = time.monotonic()
    parent.send_signal(sig)
    parent.wait(timeout=20)
    while not all(_gone(p.pid) for p in family) and time.monotonic() - t0 < 20:
        time.sleep(0.05)
    survivors = [p.pid for p in family if not _gone(p.pid)]
    for pid in survivors:  # never leave a stray process behind, even when failing
        psutil.Process(pid).kill()
    assert survivors == [], f"{kind}: {survivors} outlived their killed parent"
    assert time.monotonic() - t0 < 10


GET_DEATH_SIGNAL = textwrap.dedent('''
    import ctypes
    sig = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
    print(sig.value)
''')


@pytest.mark.parametrize(("on", "expected"), [(True, signal.SIGTERM), (False, 0)])
def test_every_child_gets_the_death_signal(on: bool, expected: int) -> None:
    res = procs.run([sys.executable, "-c", GET_DEATH_SIGNAL], timeout_s=30,
                    stdout=subprocess.PIPE, die_with_parent=on)
    assert res
    assert res.stdout is not None
    assert int(res.stdout) == expected


# --------------------------------------------------------------------------- 5. one writer


def test_second_writer_of_a_run_is_refused_until_the_first_dies(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    holder = _spawn(LOCK_HOLDER, run, tmp_path / "ready")
    pid = _wait_for(tmp_path / "ready")
    try:
        with pytest.raises(WriterBusyError) as info, \
                store.hold_writer_lock(run, kind="candidate-run"):
            pass
        msg = str(info.value)
        assert "\n" not in msg
        assert f"process {pid} on host {socket.gethostname()}" in msg
        assert info.value.exit_code == ExitCode.USAGE_ERROR
    finally:
        _kill(holder)
    with store.hold_writer_lock(run, kind="candidate-run") as marker:  # dead: taken over
        assert json.loads(marker.read_text())["pid"] == os.getpid()


def test_second_candidate_of_one_run_id_is_refused(world: World, tmp_path: Path) -> None:
    run = world.root / "evidence" / "gate-tiny" / "shared-id"
    run.mkdir(parents=True)
    holder = _spawn(LOCK_HOLDER, run, tmp_path / "ready")
    pid = _wait_for(tmp_path / "ready")
    try:
        with pytest.raises(WriterBusyError, match=f"process {pid} on host"):
            run_candidate_stage(load_contract(world.contract), reference=world.reference,
                                root=world.root / "evidence", run_id="shared-id", quiet=True)
        assert sorted(p.name for p in run.iterdir()) == [INCOMPLETE_FILE]  # untouched
    finally:
        _kill(holder)


BAD_RUN_IDS = ["../..", "..", "a/b", ".hidden", "a..b", "", "x" * 129, "a b", "run\n",
               "/abs", "é", "fix.incomplete-2", "a.tmp-b"]


@pytest.mark.parametrize("bad", BAD_RUN_IDS)
def test_run_id_is_one_safe_path_component(bad: str) -> None:
    with pytest.raises(UsageError) as info:
        check_run_id(bad)
    assert "\n" not in str(info.value).replace(repr(bad), "")


@pytest.mark.parametrize("good", ["20261201T103000Z", "ci-42", "a.b_c-1", "x" * 128])
def test_good_run_ids_pass(good: str) -> None:
    assert check_run_id(good) == good


def test_run_id_escape_is_a_one_line_usage_error(world: World, capsys: pytest.CaptureFixture[str]
                                                 ) -> None:
    from qualify.cli.main import main

    evidence = world.root / "evidence"
    before = sorted(p.name for p in world.root.iterdir())
    code = main(["candidate", str(world.contract), "--reference", str(world.reference),
                 "--out", str(evidence), "--run-id", "../.."])
    err = capsys.readouterr().err.strip()
    assert code == ExitCode.USAGE_ERROR
    assert len(err.splitlines()) == 1
    assert "--run-id '../..'" in err
    assert sorted(p.name for p in world.root.iterdir()) == before
    assert not (world.root / MANIFEST_FILE).exists()


# --------------------------------------------------------------------------- 6. a real run

KILLED_MID_LAUNCH = textwrap.dedent('''
    import sys
    from pathlib import Path
    from qualify.candidate.stage import run_candidate_stage
    from qualify.contract import load_contract
    run_candidate_stage(load_contract(Path(sys.argv[1])), reference=Path(sys.argv[2]),
                        root=Path(sys.argv[3]), run_id="r-resumed", cells=[sys.argv[4]],
                        quiet=True)
''')


def _verdict_rows(run_dir: Path) -> list[tuple[object, ...]]:
    rows = json.loads((run_dir / "report.json").read_text())["rows"]
    return sorted(tuple(json.dumps(r.get(k), sort_keys=True) for k in
                        ("cell", "round", "role", "family", "error", "bound", "verdict"))
                  for r in rows)


@pytest.mark.slow
def test_candidate_killed_mid_launch_resumes_to_the_uninterrupted_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL a real candidate stage in its first launch; resume it; same report."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))  # never the user's keys
    from tiny_contracts import torch_tp_only

    from qualify.compare.stage import compare_run
    from qualify.reference.stage import run_reference_stage

    path = torch_tp_only(tmp_path / "contracts")
    contract = load_contract(path)
    ref = run_reference_stage(contract, root=tmp_path / "refs", quiet=True)
    cell = "torch_tp-fp32-actor-tp1"
    root = tmp_path / "evidence"
    child = _spawn(KILLED_MID_LAUNCH, path, ref, root, cell)
    run = root / contract.name / "r-resumed"
    deadline = time.monotonic() + 300
    while not any((run / "launches").glob("*/attempt-1/logs/ranks/**/stdout.log")):
        assert child.poll() is None, "the candidate ended before it could be killed"
        assert time.monotonic() < deadline, "the launch never started"
        time.sleep(0.02)
    family = psutil.Process(child.pid).children(recursive=True)
    _kill(child)
    t0 = time.monotonic()
    while not all(_gone(p.pid) for p in family) and time.monotonic() - t0 < 20:
        time.sleep(0.05)
    assert [p.pid for p in family if not _gone(p.pid)] == [], "ranks outlived the kill"
    assert store.is_incomplete(run)
    resumed = run_candidate_stage(contract, reference=ref, root=root, run_id="r-resumed",
                                  cells=[cell], quiet=True)
    (launch_dir,) = (run / "launches").iterdir()
    assert [a.name for a in store.attempts(launch_dir)] == ["attempt-1", "attempt-2"]
    assert not store.is_sealed(launch_dir / "attempt-1")  # the killed attempt is kept
    compare_run(resumed)
    signing.seal_and_sign(resumed, kind="candidate-run")
    assert store.is_sealed(resumed)
    whole = run_candidate_stage(contract, reference=ref, root=root, run_id="r-whole",
                                cells=[cell], quiet=True)
    compare_run(whole)
    assert _verdict_rows(resumed) == _verdict_rows(whole)
    store.make_writable(tmp_path)


def test_cancel_ends_the_tree_and_says_so(tmp_path: Path) -> None:
    """procs.run(cancel=...): another thread sets it, the child's tree ends within seconds."""
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    cancel = threading.Event()
    threading.Timer(2.0, cancel.set).start()
    t0 = time.monotonic()
    res = procs.run([sys.executable, str(script), str(tmp_path)], timeout_s=120, cancel=cancel)
    assert res.cancelled
    assert not res.timed_out
    assert res.returncode is None
    assert time.monotonic() - t0 < 20
    pids = [int((tmp_path / n).read_text()) for n in ("child", "grandchild0", "grandchild1")]
    assert all(_gone(p) for p in pids)
