"""Slurm job scripts, ``qualify sbatch render`` / ``qualify submit``, and real Slurm jobs.

The unit tests need no Slurm (a fake ``sbatch`` records its arguments). The integration
tests submit real jobs to a one-node Slurm started by ``.ci/slurm-setup.sh`` and are
skipped when no controller answers; run them with ``-s`` to see the job lines
(job id, end state, reason, durations) in the log. The jobs that run a stage use tiny-qwen3
reduced to torch_tp with the HF sampler (``tiny_contracts.torch_tp_only``, same name): they
test Slurm's chaining, cancellation and time limit, and a vLLM engine start in each
reference job only added CPU beside the rest of the suite (the vLLM rollout has tests of
its own).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from shared_artifacts import shared_root
from slurm_cluster import REPO, JobEnd, controller_up, wait_job
from tiny_contracts import torch_tp_only

from qualify.cli.slurm import register
from qualify.errors import ReferenceDataError, UsageError
from qualify.evidence import store
from qualify.pipeline.slurm import (
    SbatchOptions,
    parse_header,
    parse_job_id,
    render_script,
    sbatch_stage,
    submit,
    template_path,
)

CONTRACT = REPO / "contracts" / "tiny-qwen3.toml"
CELL = "torch_tp-fp32-actor-tp1"
HEADER_KEYS = ("job-name", "partition", "nodes", "ntasks-per-node", "gpus-per-node",
               "cpus-per-task", "mem", "time", "output", "error")
FOUR_GPU = SbatchOptions(partition="gpu", gpus_per_node=4, cpus_per_task=32, mem="512G",
                         time="24:00:00")

_no_controller = pytest.mark.skipif(
    not controller_up(), reason="no Slurm controller answers (.ci/slurm-setup.sh)")


def needs_slurm(func: Any) -> Any:
    """Mark a test ``slurm`` and skip it when no controller answers."""
    return pytest.mark.slurm(_no_controller(func))


# --------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("stage", ["reference", "candidate"])
def test_committed_script_header(stage: str) -> None:
    text = template_path(stage).read_text()  # type: ignore[arg-type]
    header = parse_header(text)
    assert tuple(header) == HEADER_KEYS
    assert header["job-name"] == f"qualify-{stage}"
    assert text.startswith("#!/usr/bin/env bash\n")
    assert os.access(template_path(stage), os.X_OK)  # type: ignore[arg-type]
    proc = subprocess.run(["bash", "-n", str(template_path(stage))],  # type: ignore[arg-type]
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("stage", ["reference", "candidate"])
def test_render_four_gpu_cluster(stage: str) -> None:
    committed = template_path(stage).read_text()  # type: ignore[arg-type]
    text = render_script(stage, "contracts/qwen3-8b.toml", FOUR_GPU)  # type: ignore[arg-type]
    header = parse_header(text)
    assert tuple(header) == HEADER_KEYS
    assert header["partition"] == "gpu"
    assert header["gpus-per-node"] == "4"
    assert header["cpus-per-task"] == "32"
    assert header["mem"] == "512G"
    assert header["time"] == "24:00:00"
    old = parse_header(committed)
    for key in ("job-name", "nodes", "output", "error"):
        assert header[key] == old[key]
    assert "QUALIFY_CONTRACT_DEFAULT=contracts/qwen3-8b.toml " in text
    # Only the header values and the contract default differ from the committed script.
    changed = [(a, b) for a, b in zip(committed.splitlines(), text.splitlines(), strict=True)
               if a != b]
    assert len(changed) == 6
    assert all(b.startswith(("#SBATCH --", "QUALIFY_CONTRACT_DEFAULT=")) for _, b in changed)


def test_render_adds_missing_option_and_keeps_others() -> None:
    template = "#!/bin/bash\n#SBATCH --job-name=x\n#SBATCH --time=5\necho hi\n"
    text = render_script("reference", None, SbatchOptions(time="10", nodes=2),
                         template=template)
    assert text == "#!/bin/bash\n#SBATCH --job-name=x\n#SBATCH --time=10\n" \
                   "#SBATCH --nodes=2\necho hi\n"
    with pytest.raises(UsageError, match="no #SBATCH header"):
        render_script("reference", None, SbatchOptions(), template="echo hi\n")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"nodes": 0}, "--nodes: 0"),
    ({"gpus_per_node": -1}, "--gpus-per-node: -1"),
    ({"cpus_per_task": 0}, "--cpus-per-task: 0"),
    ({"mem": "lots"}, "--mem: 'lots'"),
    ({"time": "1 day"}, "--time: '1 day'"),
    ({"partition": "a b"}, "--partition: 'a b'"),
    ({"job_name": ""}, "--job-name: ''"),
], ids=["nodes", "gpus", "cpus", "mem", "time", "partition", "job-name"])
def test_options_reject_bad_values(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        SbatchOptions(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["30", "24:00:00", "1-00:00:00", "2-12"])
def test_options_accept_slurm_times(value: str) -> None:
    assert SbatchOptions(time=value).to_args() == [f"--time={value}"]


def test_parse_job_id() -> None:
    assert parse_job_id("1234\n") == "1234"
    assert parse_job_id("1234;cluster\n") == "1234"
    with pytest.raises(UsageError, match="expected a job id"):
        parse_job_id("sbatch: error: nope\n")


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="qualify")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    return parser.parse_args(argv)


def test_cli_render_writes_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ref.sbatch"
    args = _cli(["sbatch", "render", str(CONTRACT), "--stage", "reference", "--partition",
                 "gpu", "--gpus-per-node", "4", "--mem", "512G", "--time", "24:00:00",
                 "-o", str(out)])
    assert args.func(args) == 0
    header = parse_header(out.read_text())
    assert (header["partition"], header["gpus-per-node"], header["mem"], header["time"]) \
        == ("gpu", "4", "512G", "24:00:00")
    assert os.access(out, os.X_OK)
    args = _cli(["sbatch", "render", str(CONTRACT), "--stage", "candidate"])
    assert args.func(args) == 0
    assert parse_header(capsys.readouterr().out)["job-name"] == "qualify-candidate"


def _fake_sbatch(tmp_path: Path, *, fail: bool = False) -> Path:
    """A fake ``sbatch`` that logs its argv and prints increasing job ids."""
    exe = tmp_path / "bin" / "sbatch"
    exe.parent.mkdir()
    body = ('echo "sbatch: error: Batch job submission failed: Invalid partition" >&2\n'
            "exit 1\n") if fail else (
        'n=$(( $(wc -l < "$LOG" 2>/dev/null || echo 0) + 100 ))\n'
        'echo "$*" >> "$LOG"\necho "$n;qualify-ci"\n')
    exe.write_text(f"#!/usr/bin/env bash\nLOG={tmp_path}/sbatch.log\n{body}")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_submit_chains_candidate_after_reference(tmp_path: Path) -> None:
    exe = _fake_sbatch(tmp_path)
    s = submit(CONTRACT, options=FOUR_GPU, cells=[CELL], references=tmp_path / "refs",
               evidence=tmp_path / "ev", sbatch=str(exe))
    assert (s.reference_job, s.candidate_job) == ("100", "101")
    assert s.reference_dir.parent == tmp_path / "refs"
    ref_call, cand_call = (tmp_path / "sbatch.log").read_text().splitlines()
    assert ref_call.startswith("--parsable --partition=gpu --gpus-per-node=4 ")
    assert ref_call.endswith(f"qualify_reference.sbatch {CONTRACT}")
    assert cand_call.startswith("--parsable --dependency=afterok:100 "
                                "--kill-on-invalid-dep=yes --partition=gpu")
    assert cand_call.endswith(f"qualify_candidate.sbatch {CONTRACT} {s.reference_dir} "
                              f"-- --cells {CELL}")


def test_submit_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not found on PATH"):
        submit(CONTRACT, sbatch=str(tmp_path / "no-sbatch"))
    exe = _fake_sbatch(tmp_path, fail=True)
    with pytest.raises(UsageError, match=r"^sbatch failed: sbatch: error: .*Invalid partition$"):
        submit(CONTRACT, sbatch=str(exe))


def test_cli_submit_prints_job_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    exe = _fake_sbatch(tmp_path)
    args = _cli(["submit", str(CONTRACT), "--sbatch", str(exe), "--cells", CELL,
                 "--time", "24:00:00"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "reference job: 100" in out
    assert "candidate job: 101 (afterok:100" in out


# --------------------------------------------------------------------------- job scripts


def _job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
           "QUALIFY": str(Path(venv_bin) / "qualify"), "QUALIFY_PYTHON": sys.executable,
           "QUALIFY_REFERENCES": str(tmp_path / "refs"),
           "QUALIFY_EVIDENCE": str(tmp_path / "ev")}
    env.pop("QUALIFY_ALLOW_DIRTY", None)
    env.update(extra)
    return env


def test_script_refuses_dirty_tree(tmp_path: Path) -> None:
    repo = tmp_path / "src"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    (repo / "f.txt").write_text("a\n")
    for cmd in (["init", "-q"], ["add", "f.txt"], ["commit", "-q", "-m", "x"]):
        subprocess.run([*git, *cmd], check=True, capture_output=True)
    (repo / "f.txt").write_text("b\n")
    script = str(template_path("reference"))
    env = _job_env(tmp_path, QUALIFY="echo")
    done = subprocess.run(["bash", script, str(CONTRACT)], cwd=repo, env=env,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2, done.stderr
    assert "source tree has modified tracked files" in done.stderr
    assert not list((tmp_path / "refs").glob("*.job.json"))

    done = subprocess.run(["bash", script, str(CONTRACT)], cwd=repo,
                          env={**env, "QUALIFY_ALLOW_DIRTY": "1"},
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert f"reference {CONTRACT} --out {tmp_path / 'refs'} --quiet" in done.stdout
    (record,) = (tmp_path / "refs").glob("slurm-local-*.job.json")
    doc = json.loads(record.read_text())
    assert doc["git"]["dirty"] is True
    assert doc["allow_dirty"] is True
    assert len(doc["git"]["commit"]) == 40
    assert doc["stage"] == "reference"
    assert isinstance(doc["gpus"], list)


def test_candidate_script_runs_qualify_candidate(tmp_path: Path) -> None:
    script = str(template_path("candidate"))
    env = _job_env(tmp_path, QUALIFY="echo", QUALIFY_ALLOW_DIRTY="1")
    done = subprocess.run(["bash", script, str(CONTRACT), "REF", "--", "--cells", CELL],
                          cwd=REPO, env=env, capture_output=True, text=True, check=False)
    assert (f"candidate {CONTRACT} --reference REF --out {tmp_path / 'ev'} --run-id "
            f"slurm-local-") in done.stdout
    assert f"--quiet --cells {CELL}" in done.stdout
    # `echo` made no run.json: the job stops before comparing and says it failed
    (record,) = (tmp_path / "ev" / "tiny-qwen3").glob("slurm-local-*.job.json")
    assert json.loads(record.read_text())["stage"] == "candidate"
    assert "qualify compare" not in done.stdout
    assert done.returncode == 4


# --------------------------------------------------------------------------- real Slurm


def _options(tmp_path: Path, **kw: object) -> SbatchOptions:
    return SbatchOptions(output=str(tmp_path / "%x-%j.out"), error=str(tmp_path / "%x-%j.err"),
                         **{"mem": "4G", "cpus_per_task": 1, "time": "30", **kw})  # type: ignore[arg-type]


def _show(end: JobEnd, label: str) -> JobEnd:
    end.report(label)
    return end


def _logs(tmp_path: Path, job: str) -> str:
    return "\n".join(p.read_text() for p in sorted(tmp_path.glob(f"*-{job}.*")))


def _slow_qualify(tmp_path: Path, before: str = "scoring") -> Path:
    """A ``qualify`` whose reference stage stops for 10 minutes before the step ``before``."""
    exe = tmp_path / "slow-qualify"
    exe.write_text(f"#!{sys.executable}\n"
                   "import sys, time\n"
                   "import qualify.reference.stage as r\n"
                   "real = r.run_reference_stage\n"
                   "def hook(step):\n"
                   f"    if step == {before!r}:\n"
                   "        print(f'slow-qualify: stopped before {step}', flush=True)\n"
                   "        time.sleep(600)\n"
                   "r.run_reference_stage = lambda *a, **k: real(*a, on_step=hook, **k)\n"
                   "from qualify.cli.main import main\n"
                   "sys.exit(main(sys.argv[1:]))\n")
    exe.chmod(0o755)
    return exe


def _assert_partial_reference(refs: Path, *, rollout: bool = True) -> Path:
    from qualify.evidence.audit import audit
    from qualify.reference.documents import load_sealed_reference

    (ref,) = [p for p in refs.iterdir() if p.is_dir()]
    assert store.is_incomplete(ref)
    assert not (ref / "MANIFEST.json").exists()
    assert (ref / "contract.json").exists()  # the partial evidence is kept
    if rollout:
        assert (ref / "rollout.safetensors").exists()
    rows = audit(refs).rows
    assert [r.integrity for r in rows] == ["INCOMPLETE"], rows
    with pytest.raises(ReferenceDataError, match="not sealed"):
        load_sealed_reference(ref)
    return ref


@needs_slurm
def test_slurm_two_stages_real_jobs(tmp_path: Path) -> None:
    from qualify.reference.documents import load_sealed_reference

    # QUALIFY_LAUNCHER=srun: the candidate's harness launch takes the multi-node path
    # (srun + torchrun with a c10d rendezvous on the first node of the allocation)
    env = _job_env(tmp_path, QUALIFY_ALLOW_DIRTY="1", QUALIFY_LAUNCHER="srun")
    t0 = time.monotonic()
    s = submit(torch_tp_only(tmp_path / "contract"), options=_options(tmp_path), cells=[CELL],
               references=tmp_path / "refs", evidence=tmp_path / "ev", env=env, cwd=REPO)
    ref = _show(wait_job(s.reference_job, timeout_s=900, since=t0), "reference")
    assert ref.state == "COMPLETED", _logs(tmp_path, s.reference_job)
    cand = _show(wait_job(s.candidate_job, timeout_s=600, since=t0), "candidate")
    assert cand.state == "COMPLETED", _logs(tmp_path, s.candidate_job)

    meta = load_sealed_reference(s.reference_dir)  # sealed, every digest intact
    assert meta["contract"] == "tiny-qwen3"
    env_doc = json.loads((s.reference_dir / "environment.json").read_text())
    assert env_doc["slurm"]["job_id"] == s.reference_job
    run_dir = tmp_path / "ev" / "tiny-qwen3" / f"slurm-{s.candidate_job}"
    run = json.loads((run_dir / "run.json").read_text())
    assert run["cells"][CELL]["status"] == "COMPLETE", run["cells"][CELL]
    assert store.is_sealed(run_dir / run["cells"][CELL]["attempt"])
    (launcher_log,) = run_dir.glob("launches/*/attempt-1/logs/launcher.log")
    first = launcher_log.read_text().splitlines()[0]
    assert first.startswith("$ srun --nodes=1 ")
    assert "--rdzv-backend c10d --rdzv-endpoint localhost:29500" in first
    # the job compared, sealed and signed the run: the other matrix cells were not asked
    # for, so the report is NOT_RUN for them and the job still ends COMPLETED
    report = json.loads((run_dir / "report.json").read_text())
    assert next(c for c in report["cells"] if c["cell"] == CELL)["verdict"] == "PASS"
    assert store.is_sealed(run_dir)
    assert "qualify compare: exit 1" in _logs(tmp_path, s.candidate_job)
    for job, record in ((s.reference_job, tmp_path / "refs"),
                        (s.candidate_job, tmp_path / "ev" / "tiny-qwen3")):
        doc = json.loads((record / f"slurm-{job}.job.json").read_text())
        assert doc["slurm"]["job_id"] == job
        assert doc["slurm"]["job_nodelist"] == "localhost"
        assert len(doc["git"]["commit"]) == 40


@needs_slurm
def test_slurm_failed_reference_never_runs_candidate(tmp_path: Path) -> None:
    env = _job_env(tmp_path, QUALIFY_ALLOW_DIRTY="1")
    t0 = time.monotonic()
    ref_id = sbatch_stage("reference", [str(tmp_path / "missing.toml")],
                          options=_options(tmp_path), env=env, cwd=REPO)
    cand_id = sbatch_stage("candidate", [str(CONTRACT), str(tmp_path / "refs" / "x")],
                           options=_options(tmp_path), dependency=ref_id, env=env, cwd=REPO)
    ref = _show(wait_job(ref_id, timeout_s=300, since=t0), "reference, missing contract")
    assert ref.state == "FAILED", _logs(tmp_path, ref_id)
    assert ref.exit_code == "2:0"
    cand = _show(wait_job(cand_id, timeout_s=120, since=t0), "candidate, afterok")
    assert cand.state == "CANCELLED"
    assert cand.reason == "DependencyNeverSatisfied"
    # The job never started: slurmd never opened its stdout/stderr files and it wrote no
    # evidence. (RunTime is not a usable witness: for a job cancelled while pending some
    # Slurm versions print now - epoch, e.g. "20787-12:19:47".)
    assert not list(tmp_path.glob(f"*-{cand_id}.*")), _logs(tmp_path, cand_id)
    assert not (tmp_path / "ev").exists()


@needs_slurm
def test_slurm_cancelled_reference_keeps_partial_evidence(tmp_path: Path) -> None:
    env = _job_env(tmp_path, QUALIFY_ALLOW_DIRTY="1", QUALIFY=str(_slow_qualify(tmp_path)))
    t0 = time.monotonic()
    contract = torch_tp_only(tmp_path / "contract")
    ref_id = sbatch_stage("reference", [str(contract)], options=_options(tmp_path),
                          env=env, cwd=REPO)
    deadline = time.monotonic() + 600
    while "stopped before scoring" not in _logs(tmp_path, ref_id):
        assert time.monotonic() < deadline, _logs(tmp_path, ref_id)
        time.sleep(1)
    subprocess.run(["scancel", ref_id], check=True)
    ref = _show(wait_job(ref_id, timeout_s=120, since=t0), "reference, scancel")
    assert ref.state == "CANCELLED"
    ref_dir = _assert_partial_reference(tmp_path / "refs")

    # A manual candidate submission on the unsealed reference cannot bypass the boundary.
    t1 = time.monotonic()
    cand_id = sbatch_stage("candidate", [str(contract), str(ref_dir), "--", "--cells", CELL],
                           options=_options(tmp_path), env=_job_env(
                               tmp_path, QUALIFY_ALLOW_DIRTY="1"), cwd=REPO)
    cand = _show(wait_job(cand_id, timeout_s=300, since=t1), "candidate, unsealed reference")
    assert cand.state == "FAILED"
    assert cand.exit_code == "2:0"
    assert "reference is not sealed" in _logs(tmp_path, cand_id)
    run_dir = tmp_path / "ev" / "tiny-qwen3" / f"slurm-{cand_id}"
    assert not (run_dir / "cells").exists()


TIMEOUT_TEST = "test_slurm_timeout.py::test_slurm_timeout_keeps_partial_evidence"


def submit_timeout_job(tmp_path: Path) -> str:
    """Submit a reference job with ``--time=1`` (Slurm's least) whose stage stops before
    its rollout (the cancel test keeps a rollout; this job computes little while other jobs
    run beside it); its files go to ``tmp_path``. Returns the job id.

    Raises:
        UsageError: ``sbatch`` failed.
    """
    env = _job_env(tmp_path, QUALIFY_ALLOW_DIRTY="1",
                   QUALIFY=str(_slow_qualify(tmp_path, before="rollout")))
    return sbatch_stage("reference", [str(torch_tp_only(tmp_path / "contract"))],
                        options=_options(tmp_path, time="1"), env=env, cwd=REPO)


def timeout_record(factory: pytest.TempPathFactory) -> Path:
    """The file, shared by the session's xdist workers, that names the job
    :func:`_submit_timeout_job_first` submitted: ``{"job", "dir", "t0"}`` (``t0`` from
    ``time.monotonic()``, one clock for every process on Linux)."""
    return shared_root(factory) / "slurm-timeout.json"


@pytest.fixture(scope="module", autouse=True)
def _submit_timeout_job_first(request: pytest.FixtureRequest,
                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """Submit the job of ``tests/test_slurm_timeout.py`` as this module starts, when that
    test is selected and a controller answers, and name it in :func:`timeout_record`.

    Its time limit (60-90 s: slurmctld checks limits every 30 s) then passes while this
    module's other real jobs and the rest of the suite run; the timeout test, handed out
    last (``tests/conftest.py``), finds it ended. A failed submission is left to that test,
    which then submits its own job and waits for it.
    """
    if not any(item.nodeid.endswith(TIMEOUT_TEST) for item in request.session.items) \
            or not controller_up():
        return
    job_dir = tmp_path_factory.mktemp("slurm-timeout")
    t0 = time.monotonic()
    with contextlib.suppress(UsageError):
        job = submit_timeout_job(job_dir)
        store.atomic_write_json(timeout_record(tmp_path_factory),
                                {"job": job, "dir": str(job_dir), "t0": t0})
