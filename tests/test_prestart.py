"""qualify.candidate.launch.prestart: a stage's zygotes start ahead of their launches (#17).

With the fake harness of tests/test_launch.py, as an engine spec: the zygote that
:func:`~qualify.candidate.launch.prestart` starts is the one the engine's launch then uses
(this process's own and the session pool's), nothing is started where the launch would
not use a zygote, the model classes of the run's inputs are imported (``serve --inputs``,
right after ``ready``), a zygote whose owner is killed during its imports ends at once
instead of after them, and one with an owner still forks with one thread.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from test_launch import _cell, write_fake
from test_zygote import _origin

from qualify.candidate import zygote_pool
from qualify.candidate.launch import launch_engine, prestart
from qualify.registry import EngineSpec
from qualify.resources import repo_root


@pytest.fixture(autouse=True)
def no_zygotes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No zygote of this process before or after a test, and not the suite's pool."""
    monkeypatch.delenv("QUALIFY_ZYGOTE_DIR", raising=False)
    monkeypatch.delenv("QUALIFY_PRESTART", raising=False)
    zygote_pool.stop_all()
    yield
    zygote_pool.stop_all()


def _spec(tmp_path: Path, **extra: object) -> EngineSpec:
    return EngineSpec(name="fake", entry="pkg_fake.harness:main",
                      cpu_env=write_fake(tmp_path / "pkg"), **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize("where", ["own", "pool"])
def test_the_launch_uses_the_prestarted_zygote(tmp_path: Path, where: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Path(tempfile.mkdtemp(prefix="zp-")) if where == "pool" else None
    if pool is not None:  # short path: a socket path has at most 107 bytes
        for name, value in {"QUALIFY_ZYGOTE_DIR": str(pool),
                            "QUALIFY_ZYGOTE_OWNER": str(os.getpid()),
                            "QUALIFY_ZYGOTE_IDLE_S": "60"}.items():
            monkeypatch.setenv(name, value)
    spec, inputs = _spec(tmp_path), tmp_path / "inputs"
    inputs.mkdir()
    try:
        thread = prestart([spec, spec], inputs=inputs, cuda=False)  # one engine, one zygote
        assert thread is not None
        thread.join(120)
        assert not thread.is_alive()
        if pool is None:
            (z,) = zygote_pool._LIVE.values()
            pid = z.proc.pid
        else:
            (instance,) = zygote_pool.live(pool)
            pid = int((instance / "pid").read_text())
        cmdline = psutil.Process(pid).cmdline()
        assert cmdline[cmdline.index("--inputs") + 1] == str(inputs)
        att = tmp_path / "attempt-1"
        res = launch_engine(_cell(att, "env"), engine=spec, attempt_dir=att, timeout_s=120,
                            cuda=False)
        assert res.status == "OK", res.reason
        origin = _origin(res.launcher_log)
        assert origin.startswith(f"[warm] from zygote {pid} (")
        assert "launch 1 it serves" in origin
    finally:
        if pool is not None:
            zygote_pool.stop_pool(pool)
            shutil.rmtree(pool, ignore_errors=True)


@pytest.mark.parametrize("case", ["cuda", "off", "torchrun", "zygotes off", "unavailable",
                                  "multi-node"])
def test_nothing_is_started_where_no_launch_would_use_it(tmp_path: Path, case: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(tmp_path, requires=("no_such_module_here",) if case == "unavailable" else ())
    env = {"off": ("QUALIFY_PRESTART", "0"), "torchrun": ("QUALIFY_LAUNCHER", "torchrun"),
           "zygotes off": ("QUALIFY_ZYGOTE", "0"), "multi-node": ("QUALIFY_NNODES", "2")}.get(case)
    if env is not None:
        monkeypatch.setenv(*env)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert prestart([spec], inputs=tmp_path, cuda=case == "cuda") is None
    assert not zygote_pool._LIVE
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_the_model_classes_of_the_inputs_are_imported(tmp_path: Path) -> None:
    model = tmp_path / "actor"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (tmp_path / "model.json").write_text(json.dumps({"actor_dir": str(model)}))
    script = ("import sys; from pathlib import Path; from qualify.candidate import warm; "
              "name = 'transformers.models.qwen3.modeling_qwen3'; before = name in sys.modules; "
              f"warm.preload_models(Path({str(tmp_path)!r})); "
              "print(before, name in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=repo_root(), timeout=300)
    assert out.stdout.split() == ["False", "True"]


def test_a_zygote_whose_owner_dies_during_its_imports_ends_at_once(tmp_path: Path) -> None:
    env = write_fake(tmp_path / "pkg")
    (tmp_path / "pkg" / "pkg_slow.py").write_text("import time\ntime.sleep(60)\n")
    work = Path(tempfile.mkdtemp(prefix="zs-"))
    owner = subprocess.Popen(["sleep", "120"])
    zyg = subprocess.Popen(
        [sys.executable, "-m", "qualify.candidate.zygote", "serve", "--socket",
         str(work / "s"), "--parent", str(owner.pid), "--preload", "pkg_slow",
         "pkg_fake.harness"], cwd=work, stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(repo_root()), env["PYTHONPATH"]])})
    try:
        deadline = time.monotonic() + 60
        while not (work / "s").exists():  # bound before its imports
            assert time.monotonic() < deadline
            assert zyg.poll() is None
            time.sleep(0.05)
        time.sleep(1.0)  # in pkg_slow's 60 s import by now
        assert zyg.poll() is None
        owner.kill()
        owner.wait()
        t0 = time.monotonic()
        assert zyg.wait(timeout=20) == 0  # not after the 60 s import
        assert time.monotonic() - t0 < 5
        assert not work.exists()
    finally:
        for proc in (owner, zyg):
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def test_a_zygote_with_an_owner_forks_with_one_thread(tmp_path: Path) -> None:
    # The owner watcher's OS thread outlives Thread.join by a little: a zygote checking
    # /proc/self/task at once counted it and called itself unsafe (about 1 start in 6 on a
    # trivial harness, review of 2026-12-04), a refusal the pool keeps for the session.
    env = {**os.environ, "PYTHONPATH": str(repo_root())}
    refused = []
    for _ in range(12):
        started = zygote_pool._start("json", [], env, 120.0)  # --parent: this process
        if isinstance(started, str):
            refused.append(started)
        else:
            started.stop()
    assert refused == []
