"""qualify.candidate.launch with fake harnesses (no torch in the ranks): OK, failure, timeout.

The OK and failure launches run under both single-node launchers, the warm launcher
(:mod:`qualify.candidate.warm`, the default) and torchrun; the ranks of both see the same
torchrun environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from safetensors.numpy import save_file

from qualify.candidate.launch import (
    LAUNCHERS,
    Launcher,
    check_outputs,
    launch,
    launch_command,
    launch_env,
    torchrun_command,
    validate_cell,
)
from qualify.errors import HarnessError, UsageError
from qualify.protocol import HarnessCell
from qualify.resources import repo_root

VALID_META: dict[str, Any] = {
    "schema_version": 1, "sdk_version": "1.0", "engine": "fake", "cell": {},
    "versions": {"python": "3.11", "torch": "none"}, "world_size": 2, "backend": "none",
    "device": "cpu",
    "ranks": [{"rank": 0, "role": "actor", "tp_rank": 0, "tp_group": [0, 1]},
              {"rank": 1, "role": "actor", "tp_rank": 1, "tp_group": [0, 1]}],
    "roles": {"actor": {
        "tp": 2, "global_ranks": [0, 1], "precision": "fp32",
        "dtypes": {"master_weights": "torch.float32", "grads": "torch.float32",
                   "optimizer_state": {"exp_avg": "torch.float32",
                                       "exp_avg_sq": "torch.float32"},
                   "compute": ["torch.float32"],
                   "grad_reduction": {"allreduce": "torch.float32"},
                   "grad_accumulation": {"grad": "torch.float32"}},
        "replica_consistency": {"all_equal": True, "rounds": [],
                                "params": {"w": {"equal": True, "max_abs_diff": 0.0}}},
        "lr": {"round1": 0.001},
        "role_timings": {"total_s": 0.1}}},
    "timings": {"total_s": 0.1}, "shims": [], "faults": [],
    "tensors": {"file": "outputs.safetensors", "count": 1},
}

FAKE_HARNESS = '''
import json, os, sys, time, traceback
from pathlib import Path

def record(fn):
    """What torch's @record does, without importing torch: write the rank's error file."""
    def wrapper(argv):
        try:
            return fn(argv)
        except Exception as exc:
            Path(os.environ["TORCHELASTIC_ERROR_FILE"]).write_text(json.dumps({"message": {
                "message": f"{type(exc).__name__}: {exc}",
                "extraInfo": {"py_callstack": traceback.format_exc(),
                              "timestamp": str(int(time.time()))}}}))
            raise
    return wrapper

def main(argv):
    cell = json.loads(Path(argv[0]).read_text())
    rank = int(os.environ["RANK"])
    out = Path(cell["output_dir"])
    (out / f"pid{rank}").write_text(str(os.getpid()))
    mode = cell["faults"][0] if cell["faults"] else "ok"
    print(f"rank {rank} omp={os.environ.get('OMP_NUM_THREADS')} mode={mode}", flush=True)
    if mode == "env":
        keep = [k for k in os.environ if k.startswith(("TORCHELASTIC_", "MASTER_")) or k in
                ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                 "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING")]
        (out / f"env{rank}.json").write_text(json.dumps({k: os.environ[k] for k in keep}))
    if mode == "sleep":
        time.sleep(600)
    if mode == "fail" and rank == 1:
        raise RuntimeError("boom on rank 1")
    if mode == "fail":
        time.sleep(30)
    if mode == "kill" and rank == 1:
        os.kill(os.getpid(), 9)
    if rank == 0:
        import numpy as np
        from safetensors.numpy import save_file
        save_file({"round1/actor/logprobs": np.zeros((2, 3), np.float32)},
                  str(out / "outputs.safetensors"))
        (out / "outputs.json").write_text(json.dumps(META))
    return 0

META = %s

if __name__ == "__main__":
    sys.exit(record(main)(sys.argv[1:]))
'''


@pytest.fixture
def fake(tmp_path: Path) -> dict[str, str]:
    return write_fake(tmp_path)


def write_fake(tmp_path: Path) -> dict[str, str]:
    """The fake harness package ``pkg_fake`` under ``tmp_path``; the env that finds it."""
    mod = tmp_path / "pkg_fake"
    mod.mkdir(parents=True)
    (mod / "__init__.py").write_text("")
    (mod / "harness.py").write_text(textwrap.dedent(FAKE_HARNESS % repr(VALID_META)))
    # imported by the warm launcher before it forks: a thread makes forking unsafe
    (mod / "threads.py").write_text("import threading, time\n"
                                    "threading.Thread(target=time.sleep, args=(60,), "
                                    "daemon=True).start()\n")
    return {"PYTHONPATH": str(tmp_path)}


def _cell(out: Path, mode: str | None = None) -> HarnessCell:
    return HarnessCell(engine="fake", precision="fp32", options={}, actor_tp=2, critic_tp=0,
                       rounds=2, seed=0, inputs_dir=str(out), output_dir=str(out),
                       faults=(mode,) if mode else ())


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_ok_launch_through_module_attr_entry(tmp_path: Path, fake: dict[str, str],
                                             launcher: Any) -> None:
    att = tmp_path / "attempt-1"
    res = launch(_cell(att), module="pkg_fake.harness:main", attempt_dir=att, timeout_s=120,
                 env=fake, launcher=launcher)
    assert res.status == "OK", res.reason
    assert res
    assert res.returncode == 0
    assert json.loads(res.cell_file.read_text())["engine"] == "fake"
    assert res.launcher_log.is_file()
    assert "[rank1]" in res.launcher_log.read_text() or "rank 1" in res.launcher_log.read_text()
    stdouts = [p for p in res.rank_logs if p.name == "stdout.log"]
    assert len(stdouts) == 2
    assert all("omp=1" in p.read_text() for p in stdouts)
    with pytest.raises(HarnessError, match="already used"):
        launch(_cell(att), module="pkg_fake.harness", attempt_dir=att, timeout_s=60, env=fake)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_failing_rank_is_reported_with_its_log(tmp_path: Path, fake: dict[str, str],
                                               launcher: Any) -> None:
    res = launch(_cell(tmp_path, "fail"), module="pkg_fake.harness", attempt_dir=tmp_path,
                 timeout_s=120, env=fake, launcher=launcher)
    assert res.status == "ERROR"
    assert res.wall_s < 25  # rank 0 (asleep for 30 s) was ended when rank 1 failed
    assert not res
    assert res.returncode not in (0, None)
    assert res.failed_rank == 1
    assert "boom on rank 1" in res.reason
    assert any(p.name == "error.json" for p in res.rank_logs)


def test_warm_ranks_get_torchrun_environment(tmp_path: Path, fake: dict[str, str]) -> None:
    envs = {}
    for launcher in LAUNCHERS:
        att = tmp_path / launcher
        res = launch(_cell(att, "env"), module="pkg_fake.harness", attempt_dir=att,
                     timeout_s=120, env=fake, launcher=launcher)
        assert res.status == "OK", res.reason
        envs[launcher] = [json.loads((att / f"env{r}.json").read_text()) for r in (0, 1)]
    assert "fork; imports" in (tmp_path / "warm" / "logs" / "launcher.log").read_text()
    per_launch = {"MASTER_PORT", "MASTER_ADDR", "TORCHELASTIC_RUN_ID",
                  "TORCHELASTIC_ERROR_FILE"}
    for rank in (0, 1):
        warm, torchrun = envs["warm"][rank], envs["torchrun"][rank]
        assert sorted(warm) == sorted(torchrun)
        assert {k: v for k, v in warm.items() if k not in per_launch} == \
            {k: v for k, v in torchrun.items() if k not in per_launch}
        assert warm["RANK"] == warm["LOCAL_RANK"] == str(rank)
        assert warm["TORCHELASTIC_ERROR_FILE"].endswith(f"/ranks/{rank}/error.json")
        assert warm["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the launcher hosts it


@pytest.mark.parametrize("module", ["pkg_fake.harness", "pkg_fake.harness:main"])
def test_warm_launcher_execs_fresh_ranks_when_forking_is_unsafe(
        tmp_path: Path, fake: dict[str, str], module: str) -> None:
    res = launch(_cell(tmp_path), module=module, attempt_dir=tmp_path,
                 timeout_s=120, env=fake, launcher="warm", preload=("pkg_fake.threads",))
    assert res.status == "OK", res.reason
    assert "exec (2 threads after the imports)" in res.launcher_log.read_text()
    stdouts = [p for p in res.rank_logs if p.name == "stdout.log"]
    assert len(stdouts) == 2
    assert all("omp=1" in p.read_text() for p in stdouts)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_rank_killed_by_a_signal_fails_the_launch(tmp_path: Path, fake: dict[str, str],
                                                    launcher: Any) -> None:
    res = launch(_cell(tmp_path, "kill"), module="pkg_fake.harness", attempt_dir=tmp_path,
                 timeout_s=120, env=fake, launcher=launcher)
    assert res.status == "ERROR"
    assert res.returncode not in (0, None)
    if launcher == "warm":
        assert res.returncode == 1  # torchrun's exit code for a failed rank
        assert "rank 1 (pid" in res.launcher_log.read_text()
        assert "was killed by signal 9" in res.launcher_log.read_text()


def test_warm_launcher_sees_failures_with_sigchld_ignored(tmp_path: Path,
                                                          fake: dict[str, str]) -> None:
    """SIG_IGN for SIGCHLD survives exec and makes children unwaitable: the launcher resets
    it, so a failing rank still fails the launch (it was read as exit 0)."""
    cell = tmp_path / "cell.json"
    cell.write_text(json.dumps(_cell(tmp_path, "fail").to_dict()))
    warm = launch_command(cell, module="pkg_fake.harness", world_size=2,
                          log_dir=tmp_path / "ranks", env={})
    script = ("import os, signal, sys; signal.signal(signal.SIGCHLD, signal.SIG_IGN); "
              "os.execv(sys.executable, sys.argv[1:])")
    proc = subprocess.run([sys.executable, "-c", script, *warm], capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**launch_env(fake), "PYTHONPATH": fake["PYTHONPATH"] +
                               os.pathsep + str(repo_root())})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "rank 1 (pid" in proc.stdout


def test_launch_command_picks_the_launcher() -> None:
    cell, logs = Path("/a/cell.json"), Path("/a/logs")
    warm = launch_command(cell, module="h.m", world_size=3, log_dir=logs, env={},
                          preload=("x.y",))
    assert warm[1:3] == ["-m", "qualify.candidate.warm"]
    assert warm[3:] == ["--nproc-per-node", "3", "--log-dir", "/a/logs", "--preload", "x.y",
                        "h.m", "/a/cell.json"]
    choices: tuple[tuple[dict[str, str], Launcher | None], ...] = (
        ({"QUALIFY_LAUNCHER": "torchrun"}, None), ({}, "torchrun"))
    for env, launcher in choices:
        cmd = launch_command(cell, module="h.m", world_size=3, log_dir=logs, env=env,
                             launcher=launcher)
        assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    srun = launch_command(cell, module="h.m", world_size=4, log_dir=logs, launcher="warm",
                          env={"QUALIFY_NNODES": "2", "QUALIFY_RDZV_ENDPOINT": "n1:29500"})
    assert srun[0] == "srun"  # a multi-node allocation always takes srun + torchrun
    with pytest.raises(UsageError, match="QUALIFY_LAUNCHER='fork': must be one of warm, "
                                         "torchrun, srun"):
        launch_command(cell, module="h.m", world_size=1, log_dir=logs,
                       env={"QUALIFY_LAUNCHER": "fork"})


@pytest.mark.parametrize(("launcher", "limits"), [  # torchrun's: .ci/run's slow step
    ("warm", (5, 15)), pytest.param("torchrun", (12, 40), marks=pytest.mark.slow)])
def test_timeout_kills_the_whole_tree(tmp_path: Path, fake: dict[str, str], launcher: Any,
                                      limits: tuple[int, ...]) -> None:
    # both ranks must have started before the timeout, or there is no rank left to check.
    # The warm launcher forks them within a second, torchrun + its imports within a few on an
    # idle box, ~20 s on a loaded 2-core CI machine: the short limit first, and the long one
    # only when a rank had not started under it (the test waits out every limit it tries)
    for limit in limits:
        out, t0 = tmp_path / f"limit-{limit}", time.monotonic()
        out.mkdir()
        res = launch(_cell(out, "sleep"), module="pkg_fake.harness", attempt_dir=out,
                     timeout_s=limit, env=fake, launcher=launcher)
        assert res.status == "ERROR"
        assert res.reason.startswith(f"timeout after {limit}s")
        assert res.returncode is None
        assert time.monotonic() - t0 < limit + 30
        missing = [r for r in (0, 1) if not (out / f"pid{r}").is_file()]
        if not missing:
            break
    assert not missing, f"ranks {missing} had not started within the {limit} s timeout"
    pids = [int((out / f"pid{r}").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 5
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
              for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [p for p in pids if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], "rank processes survived the timeout"
    assert res.launcher_log.is_file()
    assert len([p for p in res.rank_logs if p.name == "stdout.log"]) == 2


# --------------------------------------------------------------------------- no launch


def _write_outputs(d: Path, meta: dict[str, Any], tensors: dict[str, Any] | None = None) -> None:
    save_file(tensors if tensors is not None else
              {"round1/actor/logprobs": np.zeros((2, 3), np.float32)},
              str(d / "outputs.safetensors"))
    (d / "outputs.json").write_text(json.dumps(meta))


BAD_OUTPUTS = {
    "missing engine": ({k: v for k, v in VALID_META.items() if k != "engine"}, None,
                       "'engine' is a required property"),
    "dtype not a dtype": (
        {**VALID_META, "roles": {"actor": {**VALID_META["roles"]["actor"],
                                           "dtypes": {**VALID_META["roles"]["actor"]["dtypes"],
                                                      "grads": "fp32"}}}},
        None, "roles.actor.dtypes.grads"),
    "bad tensor name": (VALID_META, {"logprobs": np.zeros(2, np.float32)},
                        "not a protocol tensor name"),
    "bf16 tensor": (VALID_META, {"round1/actor/logprobs": np.zeros(2, np.float16)},
                    "F16"),
    "count mismatch": (VALID_META, {"round1/actor/logprobs": np.zeros(2, np.float32),
                                    "round1/actor/entropy": np.zeros(2, np.float32)},
                       "tensors.count is 1 but"),
}


@pytest.mark.parametrize("case", list(BAD_OUTPUTS))
def test_check_outputs_refuses_bad_outputs(tmp_path: Path, case: str) -> None:
    meta, tensors, match = BAD_OUTPUTS[case]
    _write_outputs(tmp_path, meta, tensors)
    with pytest.raises(HarnessError, match=match):
        check_outputs(tmp_path)


def test_check_outputs_accepts_valid_outputs_and_needs_both_files(tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match="missing"):
        check_outputs(tmp_path)
    _write_outputs(tmp_path, VALID_META)
    check_outputs(tmp_path)


def test_cell_schema() -> None:
    good = _cell(Path("/x")).to_dict()
    validate_cell(good)
    # no trainer role left: it must be a sampler cell, which names options.rollout_tp
    for bad, field in (({**good, "actor_tp": 0}, "options: 'rollout_tp' is a required"),
                       ({**good, "actor_tp": -1}, "actor_tp"),
                       ({**good, "precision": "fp16"}, "precision"),
                       ({**good, "extra": 1}, "extra"), ({**good, "faults": ["a", "a"]},
                                                         "faults")):
        with pytest.raises(HarnessError, match=field):
            validate_cell(bad)


def test_sampler_cell_schema() -> None:
    """A sampler cell has no trainer role and must name its TP size in options.rollout_tp."""
    good = {**_cell(Path("/x")).to_dict(), "engine": "vllm", "actor_tp": 0, "critic_tp": 0,
            "options": {"rollout_tp": 2}}
    validate_cell(good)
    for bad, match in (({**good, "options": {}}, "options: 'rollout_tp' is a required"),
                       ({**good, "options": {"rollout_tp": 0}},
                        "options.rollout_tp: 0 is less than the minimum of 1")):
        with pytest.raises(HarnessError, match=match):
            validate_cell(bad)


def _sampler_meta() -> dict[str, Any]:
    install = {"version": 1, "accepted": True, "acks": [{"rank": 0, "version": 1,
                                                         "digest": "ab"}],
               "check": None, "reason": None, "installed_version": 1, "previous_version": 0}
    return {"schema_version": 1, "engine": "vllm", "role": "sampler", "tp": 1, "cell": {},
            "versions": {"python": "3.11", "torch": "2.13.0"},
            "engine_settings": {"dtype": "float32", "enable_prefix_caching": True,
                                "logprobs_mode": "processed_logprobs"},
            "weights": {"file": "/w", "sha256": "0" * 64, "from": "x", "base_dir": "/b"},
            "install": install,
            "cache_proof": {"prompt_tokens": 64, "block_size": 32,
                            "cached_tokens_first_after_update": 0,
                            "cached_tokens_same_version_replay": 32},
            "kernel_probe": {"version": 1, "previous_file": "/m/v0", "layers_probed": 9,
                             "changed": 9, "stale": [], "worst_err_new": 1e-7,
                             "tolerance": 1e-3},
            "probes": [{"name": "stale_version", "expected_check": "stale_version",
                        "rejected": True, "stayed": True, "reason": "stale",
                        "record": {**install, "accepted": False, "check": "stale_version"},
                        "version_before": 1, "version_after": 1}],
            "final": {"version": 1, "verified": True, "problem": None, "tensors_verified": 3},
            "round2": {"scoring": {}, "rollout": {}}, "timings": {"total_s": 1.0},
            "faults": []}


def test_check_sampler_outputs(tmp_path: Path) -> None:
    meta = _sampler_meta()
    _write_outputs(tmp_path, meta, {"round2/sampler/logprobs": np.zeros((2, 3), np.float32)})
    check_outputs(tmp_path, sampler=True)
    with pytest.raises(HarnessError, match="Additional properties are not allowed"):
        check_outputs(tmp_path)
    for field, value in (("probes.0.stayed", None), ("weights.sha256", "abc"),
                         ("cache_proof.cached_tokens_first_after_update", -1)):
        bad = json.loads(json.dumps(meta))
        *parents, leaf = field.split(".")
        node = bad
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        node[leaf] = value
        _write_outputs(tmp_path, bad, {"round2/sampler/logprobs": np.zeros((2, 3), np.float32)})
        with pytest.raises(HarnessError, match=f"outputs.json: {field}"):
            check_outputs(tmp_path, sampler=True)
    _write_outputs(tmp_path, meta, {"round2/sampler/logprobs": np.zeros((2, 3), np.float16)})
    with pytest.raises(HarnessError, match="is F16"):
        check_outputs(tmp_path, sampler=True)


def test_environment_and_command() -> None:
    env = launch_env({"OMP_NUM_THREADS": "4", "PYTHONPATH": "/elsewhere"})
    assert env["OMP_NUM_THREADS"] == "4"
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(repo_root()), "/elsewhere"]
    if "OMP_NUM_THREADS" not in os.environ:
        assert launch_env(None)["OMP_NUM_THREADS"] == "1"
    cmd = torchrun_command(Path("/a/cell.json"), module="harnesses.torch_tp.harness",
                           world_size=3, log_dir=Path("/a/logs"))
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "3"
    assert cmd[-3:] == ["-m", "harnesses.torch_tp.harness", "/a/cell.json"]
    assert torchrun_command(Path("c"), module="p.m:main", world_size=1,
                            log_dir=Path("l"))[-4:] == [
        "-m", "qualify.candidate.launch", "p.m:main", "c"]


def test_multi_node_launch_uses_srun_and_a_rendezvous_on_the_first_node() -> None:
    env = {"QUALIFY_NNODES": "2", "QUALIFY_RDZV_ENDPOINT": "node001:29500"}
    cell = Path("/a/launches/x/attempt-1/cell.json")
    cmd = torchrun_command(cell, module="harnesses.torch_tp.harness", world_size=4,
                           log_dir=Path("/a/logs"), env=env)
    assert cmd[:5] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                       "--kill-on-bad-exit=1"]
    assert cmd[cmd.index("--nnodes") + 1] == "2"
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"  # 4 ranks over 2 nodes
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "node001:29500"
    assert cmd[cmd.index("--rdzv-backend") + 1] == "c10d"
    assert "--standalone" not in cmd
    rdzv = cmd[cmd.index("--rdzv-id") + 1]
    other = torchrun_command(Path("/a/launches/x/attempt-2/cell.json"),
                             module="harnesses.torch_tp.harness", world_size=4,
                             log_dir=Path("/a/logs"), env=env)
    assert other[other.index("--rdzv-id") + 1] != rdzv  # one rendezvous per launch
    # 3 ranks (Actor TP2 + Critic TP1) do not split over 2 nodes: this node alone
    single = torchrun_command(cell, module="m", world_size=3, log_dir=Path("l"), env=env)
    assert single[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    forced = torchrun_command(cell, module="m", world_size=3, log_dir=Path("l"),
                              env={"QUALIFY_LAUNCHER": "srun",
                                   "QUALIFY_RDZV_ENDPOINT": "localhost:29500"})
    assert forced[0] == "srun"
    assert forced[forced.index("--nproc-per-node") + 1] == "3"


@pytest.mark.parametrize(("env", "match"), [
    ({"QUALIFY_NNODES": "two"}, "QUALIFY_NNODES='two': must be a positive integer"),
    ({"QUALIFY_NNODES": "2"}, "QUALIFY_RDZV_ENDPOINT is not set"),
])
def test_multi_node_launch_errors(env: dict[str, str], match: str) -> None:
    with pytest.raises(HarnessError, match=match):
        torchrun_command(Path("c"), module="m", world_size=2, log_dir=Path("l"), env=env)
