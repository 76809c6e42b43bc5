"""The fork server (qualify.candidate.forkserver): children run as ``python -m`` would, under
:func:`qualify.procs.run`'s supervision, and die with it; refusals fall back to a fresh one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from qualify import procs
from qualify.candidate import forkserver
from qualify.errors import UsageError

HOOK = textwrap.dedent("""
    import atexit, sys
    atexit.register(lambda: print("preloaded module's exit hook ran", flush=True))
""")

PROBE = textwrap.dedent("""
    import atexit, json, os, sys
    atexit.register(lambda: print("__main__ at exit:", sys.modules["__main__"].__file__,
                                  flush=True))
    preloaded = "email.mime.text" in sys.modules  # imported by the server, never here before
    out = {"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
           "env": os.environ.get("PROBE_VALUE"), "preloaded": preloaded,
           "name": __name__, "stdin": sys.stdin.read(), "sid": os.getsid(0) == os.getpid(),
           "comm": open("/proc/self/comm").read().strip()}
    print(json.dumps(out), flush=True)
    if len(sys.argv) > 1 and sys.argv[1] == "raise":
        raise RuntimeError("planted")
    if len(sys.argv) > 1 and sys.argv[1] == "pool":  # a live executor: its exit hook joins it
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(2)
        pool.submit(print, "pool task", flush=True)
    if len(sys.argv) > 1 and sys.argv[1] == "sleep":
        if os.fork() == 0:  # a grandchild: the tree is ended with it
            os.execvp("sleep", ["sleep", "60"])
        import time
        time.sleep(60)
    sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
""")


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("probe")
    (d / "fs_probe.py").write_text(PROBE)
    (d / "fs_hook.py").write_text(HOOK)
    return d


def _env(probe_dir: Path, **more: str) -> dict[str, str]:
    path = os.pathsep.join([str(probe_dir), *[p for p in sys.path if os.path.isabs(p)]])
    return {**os.environ, "PYTHONPATH": path, **more}


@pytest.fixture(scope="module")
def server(probe_dir: Path) -> Iterator[forkserver.ForkServer]:
    s = forkserver.start(modules=("email.mime.text", "fs_hook"),
                         env=_env(probe_dir, OMP_NUM_THREADS="1"))
    yield s
    s.close()


def _run(server: forkserver.ForkServer, probe_dir: Path, tmp_path: Path, *args: str,
         env: dict[str, str] | None = None, **kw: object) -> tuple[procs.ProcResult, str]:
    out = tmp_path / "out.log"
    with out.open("wb") as log, (tmp_path / "in.txt").open("w+b") as stdin:
        stdin.write(b"from stdin")
        stdin.seek(0)
        ran = procs.run([sys.executable, "-m", "fs_probe", *args], cwd=tmp_path,
                        env=env or _env(probe_dir, PROBE_VALUE="v1", OMP_NUM_THREADS="1"),
                        stdout=log,
                        stderr=subprocess.STDOUT, stdin=stdin, spawn=server.spawn,
                        **kw)  # type: ignore[arg-type]
    return ran, out.read_text()


def test_a_child_runs_as_python_dash_m_would(server: forkserver.ForkServer, probe_dir: Path,
                                              tmp_path: Path) -> None:
    ran, text = _run(server, probe_dir, tmp_path, "a", "3", timeout_s=60)
    assert ran.spawned
    assert ran.returncode == 3
    assert not ran.timed_out
    note, line = text.splitlines()[:2]
    assert note.startswith(forkserver.FORKED_NOTE)
    got = json.loads(line)
    assert got == {"argv": ["a", "3"], "cwd": str(tmp_path), "path0": str(tmp_path),
                   "env": "v1", "preloaded": True, "name": "__main__",
                   "stdin": "from stdin", "sid": True, "comm": "fs_probe"}
    # as after `python -m fs_probe`: __main__ is the program at exit (the imported-files
    # record is written then), and exit hooks of modules the server imported still run
    assert f"__main__ at exit: {probe_dir / 'fs_probe.py'}" in text
    assert "preloaded module's exit hook ran" in text


def test_a_live_thread_pool_ends_as_at_interpreter_exit(
        server: forkserver.ForkServer, probe_dir: Path, tmp_path: Path) -> None:
    ran, text = _run(server, probe_dir, tmp_path, "pool", "0", timeout_s=30)
    assert ran.spawned
    assert ran.returncode == 0
    assert "pool task" in text


def test_stdin_is_a_pipe_only_the_child_holds(server: forkserver.ForkServer, probe_dir: Path,
                                              tmp_path: Path) -> None:
    """A launch's start gate: end of file reaches the child once qualify closes its ends."""
    read_end, write_end = os.pipe()
    with (tmp_path / "out.log").open("wb") as log:
        child = server.spawn([sys.executable, "-m", "fs_probe"],
                             env=_env(probe_dir, OMP_NUM_THREADS="1"), cwd=tmp_path,
                             stdin=read_end, stdout=log.fileno(), stderr=log.fileno())
    os.close(read_end)
    assert child is not None
    os.write(write_end, b"go")
    os.close(write_end)
    assert child.wait(30) == 0
    assert json.loads((tmp_path / "out.log").read_text().splitlines()[1])["stdin"] == "go"


def test_an_uncaught_exception_is_exit_1_with_its_traceback(
        server: forkserver.ForkServer, probe_dir: Path, tmp_path: Path) -> None:
    ran, text = _run(server, probe_dir, tmp_path, "raise", timeout_s=60)
    assert ran.spawned
    assert ran.returncode == 1
    assert "RuntimeError: planted" in text
    assert "Traceback" in text


def test_a_timeout_ends_the_childs_whole_tree(server: forkserver.ForkServer, probe_dir: Path,
                                              tmp_path: Path) -> None:
    t0 = time.monotonic()
    ran, _ = _run(server, probe_dir, tmp_path, "sleep", timeout_s=3, grace_s=1)
    assert ran.spawned
    assert ran.timed_out
    assert ran.returncode is None
    assert time.monotonic() - t0 < 20
    assert not psutil.pid_exists(ran.pid) or psutil.Process(ran.pid).status() == "zombie"
    sleepers = [p for p in psutil.process_iter(["cmdline"])
                if p.info["cmdline"] == ["sleep", "60"] and os.getsid(p.pid) == ran.pid]
    assert sleepers == []


def test_another_import_environment_starts_a_fresh_interpreter(
        server: forkserver.ForkServer, probe_dir: Path, tmp_path: Path) -> None:
    env = _env(probe_dir, PROBE_VALUE="v2", OMP_NUM_THREADS="7")
    ran, text = _run(server, probe_dir, tmp_path, env=env, timeout_s=60)
    assert not ran.spawned
    assert ran.returncode == 0
    assert forkserver.FORKED_NOTE not in text
    got = json.loads(text.splitlines()[0])
    assert got["preloaded"] is False
    assert got["env"] == "v2"
    assert got["comm"] != "fs_probe"
    # a variable the program sets itself before its imports is compared in its place
    with open(os.devnull, "rb") as null:
        child = server.spawn([sys.executable, "-m", "fs_probe"], env=env, cwd=tmp_path,
                             stdin=null.fileno(), stdout=1, stderr=2,
                             imports_under={"OMP_NUM_THREADS": "1"})
    assert child is not None
    assert child.wait(60) == 0


def test_children_die_with_the_server_and_their_status_is_lost_not_invented(
        probe_dir: Path, tmp_path: Path) -> None:
    s = forkserver.start(modules=(), env=_env(probe_dir))
    with (tmp_path / "out.log").open("wb") as log:
        child = s.spawn([sys.executable, "-m", "fs_probe", "sleep"], env=_env(probe_dir),
                        cwd=tmp_path, stdin=os.open(os.devnull, os.O_RDONLY),
                        stdout=log.fileno(), stderr=log.fileno())
    assert child is not None
    assert child.poll() is None
    time.sleep(0.5)
    s.close()  # the server exits; PR_SET_PDEATHSIG sends each child SIGTERM
    assert child.wait(30) == forkserver.LOST_EXIT
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(child.pid)
    assert s.spawn([sys.executable, "-m", "fs_probe"], env=_env(probe_dir), cwd=tmp_path,
                   stdin=0, stdout=1, stderr=2) is None  # closed: the caller starts it fresh


def test_a_refusal_of_one_request_leaves_the_server_serving(probe_dir: Path,
                                                             tmp_path: Path) -> None:
    """A request the server cannot serve (here a malformed one; a failed ``fork``, below)
    is refused alone: the next launch is still forked."""
    s = forkserver.start(modules=("fs_hook",), env=_env(probe_dir, OMP_NUM_THREADS="1"))
    try:
        with s._lock:  # a request spawn never sends
            socket.send_fds(s._sock, [b'{"op": "other"}'], [])
            reply = json.loads(s._sock.recv(1 << 20))
        assert reply == {"refused": "bad request", "retire": False}
        ran, _ = _run(s, probe_dir, tmp_path, "a", "0", timeout_s=60)
        assert ran.spawned
        assert ran.returncode == 0
        assert s.retired is None
    finally:
        s.close()
    assert s.retired == "fork server closed"


def test_a_failed_fork_refuses_that_launch_only(probe_dir: Path, tmp_path: Path) -> None:
    """A ``fork`` that fails in the server (``EAGAIN``, planted once by a preloaded module):
    that launch starts a fresh interpreter, the server is not retired, and the next launch
    is forked."""
    (probe_dir / "fs_failfork.py").write_text(
        "import errno, os\n"
        "_real = os.fork\n"
        "def _once():\n"
        "    os.fork = _real\n"
        "    raise OSError(errno.EAGAIN, 'planted: no process left')\n"
        "os.fork = _once\n")
    s = forkserver.start(modules=("fs_hook", "fs_failfork"),
                         env=_env(probe_dir, OMP_NUM_THREADS="1"))
    try:
        first, text = _run(s, probe_dir, tmp_path, "a", "0", timeout_s=60)
        assert not first.spawned
        assert first.returncode == 0
        assert forkserver.FORKED_NOTE not in text
        assert s.retired is None
        second, text = _run(s, probe_dir, tmp_path, "b", "0", timeout_s=60)
        assert second.spawned
        assert second.returncode == 0
        assert text.startswith(forkserver.FORKED_NOTE)
    finally:
        s.close()


def test_a_server_that_cannot_fork_is_retired_at_its_first_reply(probe_dir: Path,
                                                                  tmp_path: Path) -> None:
    """Its imports left a thread running: it forks nothing, says so once, and every launch
    starts a fresh interpreter (none is sent to it again)."""
    (probe_dir / "fs_thread.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    s = forkserver.start(modules=("fs_thread",), env=_env(probe_dir, OMP_NUM_THREADS="1"))
    try:
        ran, text = _run(s, probe_dir, tmp_path, "a", "0", timeout_s=60)
        assert not ran.spawned
        assert ran.returncode == 0
        assert s.retired is not None
        assert s.retired.startswith("fork server cannot fork: ")
        assert forkserver.FORKED_NOTE not in text
    finally:
        s.close()


def test_the_server_dies_with_the_qualify_process_that_started_it(
        probe_dir: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path[:0] = {[str(probe_dir), str(Path(__file__).parents[1])]!r}
        from qualify.candidate import forkserver
        path = os.pathsep.join(p for p in sys.path if os.path.isabs(p))
        s = forkserver.start(modules=(), env=dict(os.environ, PYTHONPATH=path))
        c = s.spawn([sys.executable, "-m", "fs_probe", "sleep"],
                    env=dict(os.environ, PYTHONPATH=path),
                    cwd={str(tmp_path)!r}, stdin=os.open(os.devnull, os.O_RDONLY), stdout=1,
                    stderr=2)
        print(s.pid, c.pid, flush=True)
        time.sleep(60)
    """)
    qualify = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    assert qualify.stdout is not None
    with qualify.stdout:
        server_pid, child_pid = (int(x) for x in qualify.stdout.readline().split())
    qualify.send_signal(signal.SIGKILL)  # no except clause, no atexit
    qualify.wait()
    deadline = time.monotonic() + 15
    while (psutil.pid_exists(server_pid) or psutil.pid_exists(child_pid)) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(server_pid)
    assert not psutil.pid_exists(child_pid)


def test_only_the_warm_launcher_uses_it_and_its_switch_is_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from qualify.candidate.launch import start_fork_server
    from qualify.contract import load_contract

    assert forkserver.enabled({}) is True
    assert forkserver.enabled({"QUALIFY_FORKSERVER": "0"}) is False
    with pytest.raises(UsageError, match="QUALIFY_FORKSERVER='yes'"):
        forkserver.enabled({"QUALIFY_FORKSERVER": "yes"})
    contract = load_contract(Path(__file__).parents[1] / "contracts" / "tiny-qwen3.toml")
    assert forkserver.contract_model_types(contract) == ["qwen3"]
    monkeypatch.setenv("QUALIFY_LAUNCHER", "torchrun")
    assert start_fork_server(contract) is None
    monkeypatch.setenv("QUALIFY_LAUNCHER", "warm")
    monkeypatch.setenv("QUALIFY_FORKSERVER", "0")
    assert start_fork_server(contract) is None


def test_import_environment_compares_what_imports_read() -> None:
    base = {"PYTHONPATH": "/a::/b:", "OMP_NUM_THREADS": "1", "HOME": "/x",
            "TORCHINDUCTOR_CACHE_DIR": "/tmp/t", "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu"}
    assert forkserver.import_env(base) == {"PYTHONPATH": "/a:/b", "OMP_NUM_THREADS": "1",
                                           "HOME": "/x"}
    # a relative entry resolves against each child's own directory: never forked
    assert forkserver.RELATIVE_PATH in forkserver.import_env({"PYTHONPATH": "/a:rel"})
    assert forkserver.process_name("harnesses.vllm.harness") == "vllm.harness"
    assert forkserver.process_name("qualify.candidate.warm") == "candidate.warm"
    assert forkserver.model_modules(["qwen3", "../x"]) == [
        "transformers.models.qwen3.modeling_qwen3"]


def test_the_plan_holds_the_fork_server_beside_every_cpu_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from qualify.candidate.plan import launch_steps
    from qualify.contract import load_contract
    from qualify.reference.plan_core import INTERPRETER_BYTES, Machine

    contract = load_contract(Path(__file__).parents[1] / "contracts" / "tiny-qwen3.toml")
    cpu = Machine(devices=0, device_bytes=0, host_bytes=24 * 10**9, cores=2)
    gpu = Machine(devices=4, device_bytes=80 * 10**9, host_bytes=10**12, cores=16)
    monkeypatch.delenv("QUALIFY_FORKSERVER", raising=False)
    monkeypatch.delenv("QUALIFY_LAUNCHER", raising=False)
    on = [s for s in launch_steps(contract, cpu) if s.kind == "launch"]
    assert on
    assert all(s.terms["fork_server"] == INTERPRETER_BYTES for s in on)
    assert all("fork_server" not in s.terms for s in launch_steps(contract, gpu))
    monkeypatch.setenv("QUALIFY_FORKSERVER", "0")
    off = [s for s in launch_steps(contract, cpu) if s.kind == "launch"]
    assert [s.host_peak + INTERPRETER_BYTES for s in off] == [s.host_peak for s in on]
