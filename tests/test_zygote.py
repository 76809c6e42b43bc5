"""qualify.candidate.zygote with the fake harness of tests/test_launch.py: reuse, ending, limits.

The numerical half (a zygote that already served a launch gives every tensor bitwise as a
torchrun launch of the same cell) is in tests/test_grouped_launch.py, whose warm ``ab`` and
``ba`` launches of each engine come from one zygote.
"""

from __future__ import annotations

import gc
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
from test_launch import _cell, write_fake

from qualify.candidate import warm, zygote, zygote_pool
from qualify.candidate.launch import launch, launch_command, launch_env
from qualify.resources import repo_root

PER_LAUNCH = {"MASTER_PORT", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return write_fake(tmp_path / "pkg")


@pytest.fixture(autouse=True)
def no_zygotes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no zygote of this process (and leaves none); zygotes of this
    process, not the session's pool (tests/test_zygote_pool.py)."""
    monkeypatch.delenv("QUALIFY_ZYGOTE_DIR", raising=False)
    zygote_pool.stop_all()
    yield
    zygote_pool.stop_all()


def _zygote_of(cmd: list[str]) -> zygote_pool.Zygote:
    """The live zygote a client command ``cmd`` talks to."""
    sock = Path(cmd[cmd.index("--socket") + 1])
    (found,) = [z for z in zygote_pool._LIVE.values() if z.socket_path == sock]
    return found


def _origin(log: Path) -> str:
    """The ``[warm] from zygote P (...)`` line of a launcher log."""
    lines = [x for x in log.read_text().splitlines() if x.startswith("[warm] from zygote ")]
    assert len(lines) == 1, log.read_text()
    return lines[0]


def _gone(pids: list[int], within_s: float) -> list[int]:
    """Those of ``pids`` still running (not zombies) after up to ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _attempt(att: Path, mode: str) -> tuple[Path, list[str]]:
    """An attempt directory with a fake cell of ``mode``; (its cell.json, the warm command)."""
    (att / "logs" / "ranks").mkdir(parents=True)
    cell = att / "cell.json"
    cell.write_text(json.dumps(_cell(att, mode).to_dict()))
    return cell, launch_command(cell, module="pkg_fake.harness", world_size=2,
                                log_dir=att / "logs" / "ranks")


def _start_sleeping(att: Path, cmd: list[str],
                    env: dict[str, str]) -> tuple[subprocess.Popen[bytes], list[int]]:
    """Run the client ``cmd`` of a sleeping launch; (the client, its 2 ranks' pids) once both
    ranks run."""
    with (att / "client.log").open("wb") as log:
        client = subprocess.Popen(cmd, cwd=att, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    deadline = time.monotonic() + 60
    while not all((att / f"pid{r}").is_file() for r in (0, 1)):
        assert time.monotonic() < deadline, (att / "client.log").read_text()
        time.sleep(0.1)
    return client, [int((att / f"pid{r}").read_text()) for r in (0, 1)]


def test_launches_of_one_key_share_one_zygote(tmp_path: Path, env: dict[str, str]) -> None:
    envs = []
    for n in (1, 2):
        att = tmp_path / f"attempt-{n}"
        res = launch(_cell(att, "env"), module="pkg_fake.harness", attempt_dir=att,
                     timeout_s=120, env=env, launcher="warm")
        assert res.status == "OK", res.reason
        log = res.launcher_log.read_text()
        assert log.startswith(f"$ {sys.executable} -m qualify.candidate.zygote run --socket ")
        assert "fork; imports" in log
        assert f"launch {n} it serves" in _origin(res.launcher_log)
        envs.append([json.loads((att / f"env{r}.json").read_text()) for r in (0, 1)])
    one, two = (_origin(tmp_path / f"attempt-{n}" / "logs" / "launcher.log") for n in (1, 2))
    assert one.split(" (")[0] == two.split(" (")[0]  # the same zygote pid
    for rank in (0, 1):  # each launch its own store and run id, the rest the same
        first, second = envs[0][rank], envs[1][rank]
        assert sorted(first) == sorted(second)
        assert {k: v for k, v in first.items() if k not in PER_LAUNCH} == \
            {k: v for k, v in second.items() if k not in PER_LAUNCH}
        assert first["TORCHELASTIC_RUN_ID"] != second["TORCHELASTIC_RUN_ID"]


def test_off_switch_and_other_launchers_keep_their_command(tmp_path: Path,
                                                           env: dict[str, str]) -> None:
    cell = tmp_path / "cell.json"
    warm = launch_command(cell, module="pkg_fake.harness", world_size=2, log_dir=tmp_path)
    torchrun = launch_command(cell, module="pkg_fake.harness", world_size=2,
                              log_dir=tmp_path, launcher="torchrun")
    full = launch_env(env)
    assert zygote_pool.client_command(warm, {**full, "QUALIFY_ZYGOTE": "0"}) == warm
    assert zygote_pool.client_command(torchrun, full) == torchrun
    served = zygote_pool.client_command(warm, full)
    assert served[1:4] == ["-m", "qualify.candidate.zygote", "run"]
    assert served[served.index("--") + 1:] == warm[3:]


def test_a_zygote_that_may_not_fork_is_refused_once(tmp_path: Path,
                                                    env: dict[str, str]) -> None:
    cell = tmp_path / "cell.json"
    warm = launch_command(cell, module="pkg_fake.harness", world_size=2, log_dir=tmp_path,
                          preload=("pkg_fake.threads",))
    full = launch_env(env)
    t0 = time.monotonic()
    assert zygote_pool.client_command(warm, full) == warm
    assert zygote_pool.client_command(warm, full) == warm  # remembered: no second start
    assert time.monotonic() - t0 < 60
    refused = [why for key, why in zygote_pool._REFUSED.items()
               if "pkg_fake.threads" in str(key[2])]
    assert any("threads after the imports" in why for why in refused), zygote_pool._REFUSED


def test_at_most_max_live_zygotes(tmp_path: Path, env: dict[str, str]) -> None:
    cell = tmp_path / "cell.json"
    warm = launch_command(cell, module="pkg_fake.harness", world_size=1, log_dir=tmp_path)
    started = []
    for n in range(zygote_pool.MAX_LIVE + 1):
        cmd = zygote_pool.client_command(warm, {**launch_env(env), "QUALIFY_TEST_KEY": str(n)})
        sock = Path(cmd[cmd.index("--socket") + 1])
        started.append(next(z for z in zygote_pool._LIVE.values() if z.socket_path == sock))
    assert len(zygote_pool._LIVE) <= zygote_pool.MAX_LIVE
    first = started[0]
    assert first in zygote_pool._DRAINING  # the least recently used drains: nothing in flight,
    first.proc.wait(timeout=10)  # so it exits at once and removes its socket
    assert not first.socket_path.exists()
    assert all(z.alive() for z in started[1:])


def test_a_killed_client_ends_the_launcher_and_its_ranks(tmp_path: Path,
                                                         env: dict[str, str]) -> None:
    att = tmp_path / "attempt-1"
    _, warm = _attempt(att, "sleep")
    full = launch_env(env)
    cmd = zygote_pool.client_command(warm, full)
    client, ranks = _start_sleeping(att, cmd, full)
    launcher = psutil.Process(ranks[0]).ppid()
    assert psutil.Process(launcher).ppid() == _zygote_of(cmd).proc.pid  # not the client's
    client.send_signal(signal.SIGKILL)
    client.wait(timeout=10)
    assert _gone([launcher, *ranks], within_s=15) == []
    assert "the zygote client is gone" in (att / "client.log").read_text()


def test_a_bad_request_leaves_the_zygote_serving(tmp_path: Path, env: dict[str, str]) -> None:
    cell = tmp_path / "cell.json"
    full = {**launch_env(env), "QUALIFY_TEST_KEY": "bad-request"}
    warm = launch_command(cell, module="pkg_fake.harness", world_size=2, log_dir=tmp_path)
    cmd = zygote_pool.client_command(warm, full)
    sock = cmd[cmd.index("--socket") + 1]
    (served,) = [z for z in zygote_pool._LIVE.values() if str(z.socket_path) == sock]
    fds_before = len(os.listdir(f"/proc/{served.proc.pid}/fd"))
    huge = (1 << 40).to_bytes(8, "little")
    with open(os.devnull, "rb") as null:
        for fds, data in (([], b"\x05\x00\x00\x00\x00\x00\x00\x00{}"),  # no fds
                          ([null.fileno()] * 3, huge + b"{"),  # a body of 1 TiB announced
                          ([null.fileno()] * 3, b"\x02\x00\x00\x00\x00\x00\x00\x00[]"),
                          ([null.fileno()] * 3, b"\x09\x00\x00\x00\x00\x00\x00\x00{"),  # cut
                          ([null.fileno()] * 3, (200_000).to_bytes(8, "little") +
                           b"[" * 200_000)):  # nesting past the JSON decoder's recursion
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(sock)
                socket.send_fds(s, [data], fds)
                s.shutdown(socket.SHUT_WR)
                assert s.recv(100) == b""  # refused: no launcher's pid comes back
    log = (Path(sock).parent / "zygote.log").read_text()
    for why in ("carried 0 fds", "request body of 1099511627776 bytes", "is not {argv",
                "cut short", "recursion"):
        assert why in log, log
    assert len(os.listdir(f"/proc/{served.proc.pid}/fd")) == fds_before  # none kept
    att = tmp_path / "attempt-1"
    res = launch(_cell(att), module="pkg_fake.harness", attempt_dir=att, timeout_s=120,
                 env=full, launcher="warm")
    assert res.status == "OK", res.reason
    assert "launch 1 it serves" in _origin(res.launcher_log)


def test_a_zygote_ends_when_its_parent_is_gone(tmp_path: Path, env: dict[str, str]) -> None:
    script = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from qualify.candidate import zygote, zygote_pool
        from qualify.candidate.launch import launch_command, launch_env
        warm = launch_command(Path("c.json"), module="pkg_fake.harness", world_size=1,
                              log_dir=Path("."))
        zygote_pool.client_command(warm, launch_env({env!r}))
        (z,) = zygote_pool._LIVE.values()
        print(z.proc.pid, z.socket_path, flush=True)
        os._exit(0)  # no atexit: the zygote must notice on its own
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(repo_root())})
    pid, sock = done.stdout.split()
    assert _gone([int(pid)], within_s=10) == []
    assert not Path(sock).exists()


def test_a_client_whose_zygote_is_gone_runs_the_plain_warm_launcher(
        tmp_path: Path, env: dict[str, str]) -> None:
    att = tmp_path / "attempt-1"
    _, warm = _attempt(att, "env")
    full = {**launch_env(env), "QUALIFY_TEST_KEY": "gone"}
    cmd = zygote_pool.client_command(warm, full)
    sock = Path(cmd[cmd.index("--socket") + 1])
    (gone,) = [z for z in zygote_pool._LIVE.values() if z.socket_path == sock]
    gone.stop()
    done = subprocess.run(cmd, cwd=att, env=full, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the plain warm launcher runs it" in done.stdout
    assert "fork; imports" in done.stdout
    assert "from zygote" not in done.stdout
    assert all((att / f"env{r}.json").is_file() for r in (0, 1))


def test_an_evicted_zygote_lets_its_launch_in_flight_finish(tmp_path: Path,
                                                            env: dict[str, str]) -> None:
    att = tmp_path / "attempt-1"
    _, warm = _attempt(att, "sleep")
    full = {**launch_env(env), "QUALIFY_TEST_KEY": "evicted"}
    cmd = zygote_pool.client_command(warm, full)
    client, ranks = _start_sleeping(att, cmd, full)
    try:
        for n in range(zygote_pool.MAX_LIVE):  # newer keys push this one out of the registry
            zygote_pool.client_command(warm, {**full, "QUALIFY_TEST_KEY": f"evicted-{n}"})
        (drained,) = [z for z in zygote_pool._DRAINING if str(z.socket_path) in cmd]
        time.sleep(1.0)
        assert client.poll() is None  # the launch in flight goes on
        assert _gone(ranks, within_s=0) == ranks
        assert not drained.socket_path.exists()  # no new launch: the socket is gone
        again = zygote_pool.client_command(warm, full)  # the key gets a new zygote
        assert again != cmd
    finally:
        client.send_signal(signal.SIGTERM)  # forwarded: the launcher ends the ranks
        rc = client.wait(timeout=30)
    assert rc == 128 + signal.SIGTERM
    assert _gone(ranks, within_s=15) == []
    deadline = time.monotonic() + 10
    while drained.alive():  # its last launch over, the drained zygote exits
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_signal_forwarded_at_once_reaches_the_launcher(tmp_path: Path,
                                                         env: dict[str, str]) -> None:
    """The client forwards a signal as soon as it has the launcher's pid, before the forked
    launcher has its handlers: the zygote forks with the signals blocked, so each is
    delivered once warm.main handles them (the launch ends 128 + SIGTERM, promptly)."""
    full = {**launch_env(env), "QUALIFY_TEST_KEY": "early-signal"}
    for n in range(5):
        att = tmp_path / f"attempt-{n}"
        _, warm = _attempt(att, "sleep")
        cmd = zygote_pool.client_command(warm, full)
        body = json.dumps({"argv": cmd[cmd.index("--") + 1:], "env": full,
                           "cwd": str(att)}).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, \
                open(os.devnull, "rb") as null, (att / "client.log").open("wb") as log:
            s.connect(cmd[cmd.index("--socket") + 1])
            socket.send_fds(s, [len(body).to_bytes(8, "little") + body],
                            [null.fileno(), log.fileno(), log.fileno()])
            lines = s.makefile("r")
            first = lines.readline().split()
            assert first[0] == "pid"
            os.kill(int(first[1]), signal.SIGTERM)  # at once, as run_client replays it
            s.settimeout(30)
            t0 = time.monotonic()
            last = lines.readline().split()
        assert last == ["exit", str(128 + signal.SIGTERM)], (att / "client.log").read_text()
        assert time.monotonic() - t0 < 15


def test_an_import_that_prints_does_not_refuse_the_zygote(tmp_path: Path,
                                                          env: dict[str, str]) -> None:
    noisy = Path(env["PYTHONPATH"]) / "pkg_fake" / "noisy.py"
    noisy.write_text("print('hello from an import', flush=True)\n")
    warm = launch_command(tmp_path / "c.json", module="pkg_fake.harness", world_size=1,
                          log_dir=tmp_path, preload=("pkg_fake.noisy",))
    cmd = zygote_pool.client_command(warm, launch_env(env))
    assert cmd[1:4] == ["-m", "qualify.candidate.zygote", "run"], zygote_pool._REFUSED


def test_a_silent_connection_holds_up_no_launch(tmp_path: Path, env: dict[str, str]) -> None:
    """A client that connects and sends nothing (or half a request) does not stall the
    zygote: the launch behind it is served at once."""
    full = {**launch_env(env), "QUALIFY_TEST_KEY": "silent"}
    att = tmp_path / "attempt-0"
    first = launch(_cell(att), module="pkg_fake.harness", attempt_dir=att, timeout_s=120,
                   env=full, launcher="warm")
    assert first.status == "OK", first.reason
    sock = first.launcher_log.read_text().split("--socket ", 1)[1].split()[0]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as half, \
            open(os.devnull, "rb") as null:
        silent.connect(sock)
        half.connect(sock)
        socket.send_fds(half, [(100).to_bytes(8, "little") + b'{"argv"'], [null.fileno()] * 3)
        att = tmp_path / "attempt-1"
        t0 = time.monotonic()
        res = launch(_cell(att), module="pkg_fake.harness", attempt_dir=att, timeout_s=120,
                     env=full, launcher="warm")
        took = time.monotonic() - t0
    assert res.status == "OK", res.reason
    assert "launch 2 it serves" in _origin(res.launcher_log)
    assert took < zygote.REQUEST_TIMEOUT_S / 2, took


def test_a_forked_child_freezes_what_it_inherited() -> None:
    """``warm.fork_child``: the child's full collections skip the inherited heap (DeepSpeed's
    ``see_memory_usage`` runs ``gc.collect()`` four times per BF16 ZeRO-1 initialize: 0.25 s
    each over torch + transformers + DeepSpeed); the parent's heap stays collectable."""
    marker: list[object] = [object()]  # a container: tracked by the collector
    assert any(o is marker for o in gc.get_objects())

    def child() -> int:
        inherited = any(o is marker for o in gc.get_objects())  # permanent: not listed
        made_here: list[object] = [object()]
        own = any(o is made_here for o in gc.get_objects())
        return 0 if (not inherited and own) else 10 + inherited + 2 * own

    pid = warm.fork_child(child)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert any(o is marker for o in gc.get_objects())  # the parent froze nothing
