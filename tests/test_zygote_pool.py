"""qualify.candidate.zygote_pool: one zygote per key for every process of a session.

With the fake harness of tests/test_launch.py: a launch of another process is served by the
zygote this one started; a killed zygote, an idle one, one whose owner is gone and one that
may not fork are each handled; bad pool settings are usage errors. Each test uses a pool of
its own (not the suite's, tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from test_launch import _cell, write_fake

from qualify.candidate import zygote, zygote_pool
from qualify.candidate.launch import check_launch_env, launch, launch_command, launch_env
from qualify.errors import UsageError
from qualify.resources import repo_root


def _pool_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    pool = Path(tempfile.mkdtemp(prefix="zp-"))  # short: tmp_path under xdist is too long
    env = write_fake(tmp_path / "pkg")
    env.update({"QUALIFY_ZYGOTE_DIR": str(pool), "QUALIFY_ZYGOTE_OWNER": str(os.getpid()),
                "QUALIFY_ZYGOTE_IDLE_S": "60", **extra})
    return env


@pytest.fixture
def pool_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    env = _pool_env(tmp_path)
    for name, value in env.items():
        if name.startswith("QUALIFY_ZYGOTE_"):
            monkeypatch.setenv(name, value)
    yield env
    zygote_pool.stop_pool(Path(env["QUALIFY_ZYGOTE_DIR"]))
    shutil.rmtree(env["QUALIFY_ZYGOTE_DIR"], ignore_errors=True)


def _origin(log: Path) -> str:
    lines = [x for x in log.read_text().splitlines() if x.startswith("[warm] from zygote ")]
    assert len(lines) == 1, log.read_text()
    return lines[0]


def _wait(cond: Callable[[], bool], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_a_launch_of_another_process_uses_the_same_zygote(tmp_path: Path,
                                                          pool_env: dict[str, str]) -> None:
    att = tmp_path / "attempt-1"
    res = launch(_cell(att, "env"), module="pkg_fake.harness", attempt_dir=att,
                 timeout_s=120, env=pool_env, launcher="warm")
    assert res.status == "OK", res.reason
    first = _origin(res.launcher_log)
    assert "launch 1 it serves" in first
    other = tmp_path / "attempt-2"
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(repo_root() / 'tests')!r})
        from test_launch import _cell
        from qualify.candidate.launch import launch
        att = Path({str(other)!r})
        res = launch(_cell(att, "env"), module="pkg_fake.harness", attempt_dir=att,
                     timeout_s=120, env={pool_env!r}, launcher="warm")
        assert res.status == "OK", res.reason
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=180,
                   env={**os.environ, "PYTHONPATH": str(repo_root())})
    second = _origin(other / "logs" / "launcher.log")
    assert second.split(" (")[0] == first.split(" (")[0]  # the same zygote pid
    assert "launch 2 it serves" in second
    for r in (0, 1):  # what the ranks saw: the same environment, each its own store
        one = json.loads((att / f"env{r}.json").read_text())
        two = json.loads((other / f"env{r}.json").read_text())
        assert one["TORCHELASTIC_RUN_ID"] != two["TORCHELASTIC_RUN_ID"]
    (instance,) = zygote_pool.live(Path(pool_env["QUALIFY_ZYGOTE_DIR"]))
    assert oct(instance.stat().st_mode & 0o777) == "0o700"


def test_a_zygote_killed_with_sigkill_is_replaced(tmp_path: Path,
                                                  pool_env: dict[str, str]) -> None:
    pool = Path(pool_env["QUALIFY_ZYGOTE_DIR"])
    warm = launch_command(tmp_path / "c.json", module="pkg_fake.harness", world_size=1,
                          log_dir=tmp_path)
    full = launch_env(pool_env)
    first = zygote_pool.client_command(warm, full)
    (instance,) = zygote_pool.live(pool)
    os.kill(int((instance / "pid").read_text()), signal.SIGKILL)
    assert _wait(lambda: not zygote_pool.live(pool), 10)
    assert (instance / "s").exists()  # a SIGKILL left its socket: not taken for a live one
    again = zygote_pool.client_command(warm, full)
    assert again != first
    assert again[1:4] == ["-m", "qualify.candidate.zygote", "run"]
    assert [d.name for d in zygote_pool.live(pool)] != [instance.name]


def test_an_idle_zygote_ends_and_removes_its_directory(tmp_path: Path,
                                                       pool_env: dict[str, str]) -> None:
    pool = Path(pool_env["QUALIFY_ZYGOTE_DIR"])
    warm = launch_command(tmp_path / "c.json", module="pkg_fake.harness", world_size=1,
                          log_dir=tmp_path)
    zygote_pool.client_command(warm, launch_env({**pool_env, "QUALIFY_ZYGOTE_IDLE_S": "1"}))
    (instance,) = zygote_pool.live(pool)
    assert _wait(lambda: not instance.exists(), 15)


def test_a_zygote_whose_owner_is_gone_ends(tmp_path: Path, pool_env: dict[str, str]) -> None:
    pool = Path(pool_env["QUALIFY_ZYGOTE_DIR"])
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        warm = launch_command(tmp_path / "c.json", module="pkg_fake.harness", world_size=1,
                              log_dir=tmp_path)
        env = launch_env({**pool_env, "QUALIFY_ZYGOTE_OWNER": str(owner.pid)})
        zygote_pool.client_command(warm, env)
        (instance,) = zygote_pool.live(pool)
    finally:
        owner.kill()
        owner.wait()
    assert _wait(lambda: not instance.exists(), 10)


def test_a_zygote_that_may_not_fork_is_refused_for_the_pool(tmp_path: Path,
                                                            pool_env: dict[str, str]) -> None:
    pool = Path(pool_env["QUALIFY_ZYGOTE_DIR"])
    warm = launch_command(tmp_path / "c.json", module="pkg_fake.harness", world_size=2,
                          log_dir=tmp_path, preload=("pkg_fake.threads",))
    full = launch_env(pool_env)
    assert zygote_pool.client_command(warm, full) == warm
    (refused,) = pool.glob("*.refused")
    assert "threads after the imports" in refused.read_text()
    t0 = time.monotonic()
    assert zygote_pool.client_command(warm, full) == warm  # no second start
    assert time.monotonic() - t0 < 1.0
    assert zygote_pool.live(pool) == []


def test_beyond_max_pool_the_least_recently_used_drains(tmp_path: Path,
                                                        pool_env: dict[str, str]) -> None:
    pool = Path(pool_env["QUALIFY_ZYGOTE_DIR"])
    warm = launch_command(tmp_path / "c.json", module="pkg_fake.harness", world_size=1,
                          log_dir=tmp_path)
    first = None
    for n in range(zygote_pool.MAX_POOL + 1):
        zygote_pool.client_command(warm, launch_env({**pool_env, "QUALIFY_TEST_KEY": str(n)}))
        if first is None:
            (first,) = zygote_pool.live(pool)
    assert first is not None
    assert _wait(lambda: not first.exists(), 10)  # drained: nothing in flight, so it ended
    assert len(zygote_pool.live(pool)) == zygote_pool.MAX_POOL


def test_an_edited_source_is_another_key(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for package in ("qualify", "harnesses"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "mod.py").write_text("x = 1\n")
    monkeypatch.setattr("qualify.resources.repo_root", lambda: tmp_path)
    warm = launch_command(tmp_path / "c.json", module="pkg_fake.harness", world_size=1,
                          log_dir=tmp_path)
    before = zygote.launch_key(warm, {"A": "1"})
    (tmp_path / "harnesses" / "mod.py").write_text("x = 22\n")
    after = zygote.launch_key(warm, {"A": "1"})
    assert before is not None
    assert after is not None
    assert before[:4] == after[:4]  # python, harness, preload, environment
    assert before != after  # the sources' stamp
    assert zygote.launch_key(warm, {"A": "1", "PYTEST_XDIST_WORKER": "gw1"}) == after


@pytest.mark.parametrize(("name", "value", "message"), [
    ("QUALIFY_ZYGOTE_DIR", "relative/pool", "must be an absolute path"),
    ("QUALIFY_ZYGOTE_DIR", "/" + "p" * 79, "longer than 79 bytes"),
    ("QUALIFY_ZYGOTE_DIR", "{link}", "is a symbolic link"),
    ("QUALIFY_ZYGOTE_DIR", "{file}/pool", "cannot be made"),
    ("QUALIFY_ZYGOTE_OWNER", "{gone}", "no such process"),
    ("QUALIFY_ZYGOTE_DIR", "{open}", "must be this user's directory with mode 0700"),
    ("QUALIFY_ZYGOTE_DIR", "{file}", "not a directory"),
    ("QUALIFY_ZYGOTE_OWNER", "me", "must be a process id"),
    ("QUALIFY_ZYGOTE_IDLE_S", "0", "must be a positive number of seconds"),
    ("QUALIFY_ZYGOTE_IDLE_S", "soon", "must be a positive number of seconds"),
])
def test_bad_pool_settings_are_usage_errors(name: str, value: str, message: str) -> None:
    short = Path(tempfile.mkdtemp(prefix="zb-"))  # tmp_path under xdist is over 79 bytes
    try:
        (short / "open").mkdir(mode=0o755)
        os.chmod(short / "open", 0o755)
        (short / "file").write_text("")
        (short / "private").mkdir(mode=0o700)
        (short / "link").symlink_to(short / "private")
        gone = subprocess.Popen([sys.executable, "-c", ""])
        gone.wait()
        value = value.format(open=short / "open", file=short / "file", link=short / "link",
                             gone=gone.pid)
        env = {name: value}
        with pytest.raises(UsageError, match="^" + re.escape(f"{name}={value!r}: {message}")):
            check_launch_env(env)
        assert zygote_pool.pool_of({"QUALIFY_ZYGOTE_DIR": str(short / "pool"), **env}) is None
        assert zygote_pool.pool_of({"QUALIFY_ZYGOTE_DIR": str(short / "pool")}) == \
            short / "pool"
    finally:
        shutil.rmtree(short)


def test_a_slurm_job_keeps_zygotes_of_its_own(tmp_path: Path) -> None:
    env = {"QUALIFY_ZYGOTE_DIR": str(tmp_path / "pool")}
    assert zygote_pool.pool_of(env) == tmp_path / "pool"
    assert zygote_pool.pool_of({**env, "SLURM_JOB_ID": "7"}) is None



def test_a_pool_zygote_is_told_from_its_launcher_and_ranks(pool_env: dict[str, str],
                                                           tmp_path: Path) -> None:
    """Forked launchers and ranks keep the zygote's command line; only the zygote's own pid
    counts as the pool zygote (a check for survivors of a killed qualify counts the rest)."""
    pool = Path(pool_env["QUALIFY_ZYGOTE_DIR"])
    att = tmp_path / "attempt-1"
    (att / "logs" / "ranks").mkdir(parents=True)
    cell = att / "cell.json"
    cell.write_text(json.dumps(_cell(att, "sleep").to_dict()))
    warm = launch_command(cell, module="pkg_fake.harness", world_size=2,
                          log_dir=att / "logs" / "ranks")
    full = launch_env(pool_env)
    cmd = zygote_pool.client_command(warm, full)
    with (att / "client.log").open("wb") as log:
        client = subprocess.Popen(cmd, cwd=att, env=full, stdout=log, stderr=subprocess.STDOUT)
    try:
        assert _wait(lambda: all((att / f"pid{r}").is_file() for r in (0, 1)), 60)
        ranks = [int((att / f"pid{r}").read_text()) for r in (0, 1)]
        launcher = psutil.Process(ranks[0]).ppid()
        (instance,) = zygote_pool.live(pool)
        own = int((instance / "pid").read_text())
        assert psutil.Process(launcher).ppid() == own
        assert zygote_pool.is_pool_zygote(own)
        assert not any(zygote_pool.is_pool_zygote(p) for p in (launcher, *ranks, client.pid))
    finally:
        client.send_signal(signal.SIGTERM)
        client.wait(timeout=30)


def test_an_edited_harness_module_is_never_served(tmp_path: Path,
                                                  pool_env: dict[str, str]) -> None:
    """A module of the harness's package (outside site-packages, not in the key's stamp)
    edited after the zygote imported it: the zygote refuses that launch and drains, the
    launch runs the plain warm launcher, and the next launch gets a fresh zygote."""
    util = Path(pool_env["PYTHONPATH"]) / "pkg_fake" / "util.py"
    util.write_text("TAG = 'v1'\n")
    warm = launch_command(tmp_path / "c.json", module="pkg_fake.harness", world_size=1,
                          log_dir=tmp_path, preload=("pkg_fake.util",))
    full = launch_env(pool_env)
    runs = []
    for n in range(3):
        if n == 1:
            util.write_text("TAG = 'v22'\n")
        att = tmp_path / f"attempt-{n}"
        res = launch(_cell(att), module="pkg_fake.harness", attempt_dir=att, timeout_s=120,
                     env=pool_env, launcher="warm", preload=("pkg_fake.util",))
        assert res.status == "OK", res.reason
        runs.append(res.launcher_log.read_text())
    assert "launch 1 it serves" in runs[0]
    assert "the plain warm launcher runs it" in runs[1]
    assert "from zygote" not in runs[1]
    assert "launch 1 it serves" in runs[2]  # a new zygote, with the new file
    assert zygote.launch_key(warm, full) is not None
