"""Run one update run of the reference stage alone, for its peak memory (docs/scale.md).

Usage: ``python scripts/repro/plan_step.py [--fixed-mmap-threshold] CONTRACT DIR LANE CONTROL
[OUT.safetensors]`` or ``python scripts/repro/plan_step.py [--fixed-mmap-threshold] CONTRACT
DIR --sequence LANE:CONTROL [LANE:CONTROL ...]``

``--fixed-mmap-threshold`` first fixes glibc's mmap threshold
(:func:`qualify.memory.fix_mmap_threshold`, which the stage does not call); without it
glibc's threshold stays dynamic, as in the stage.

``DIR`` is a reference directory (sealed or interrupted) holding the rollout and
``train_inputs.safetensors``; ``CONTROL`` is a control name of
:func:`qualify.reference.controls.control_settings` for ``LANE``, or ``reference`` for the
lane's own update. Runs :func:`qualify.reference.stage._update_run` exactly as the stage does
(fresh models from the prepared bundle) and nothing else, so a process-level peak RSS
(``scripts/repro/rss_trace.py``) is that step's peak plus the interpreter, to set beside
``qualify plan``'s prediction for the step.

The run is placed as the stage places it: on the devices of ``$QUALIFY_REFERENCE_DEVICES``,
planned under ``$QUALIFY_REFERENCE_DEVICE_MEMORY`` when set, with the AdamW state where the
stage's plan check puts it and the gradients streamed when it says so
(``qualify.reference.stage._plan_check``, not enforced: a step is
run even when another step would not fit). ``OUT.safetensors``, when given, receives the
run's tensors as the stage computes them (for the lane's own update, what it seals in
``reference/`` without the reward scores), to compare with a sealed or interrupted
reference's file; the choice of devices and state is printed.

``--sequence`` runs several update runs one after another in this one process, as the
stage's ``updates`` and ``controls`` steps do: ``release_free_memory()`` between them (the
stage's ``step`` and ``_update_run`` call it), and after each the reward scoring the stage
runs beside it (a control, or the lane update of a lane whose forwards are not the
``params`` mode; the stage reuses the scoring step's scores otherwise). It prints, for each
run, the RSS at its start (after the release), its own peak (``VmHWM``, reset through
``/proc/self/clear_refs`` before the run where the kernel allows; the process's peak so
far otherwise, marked), the RSS at its end, glibc's heap figures (``mallinfo2``: bytes in
the arenas, in use, free, and in mmapped chunks) and its wall time: the step's peak inside
a history, to set beside the same step run alone. ``$MALLOC_MMAP_THRESHOLD_`` and the
other glibc tunables reach it from the environment.
"""

from __future__ import annotations

import ctypes
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from qualify import libc
from qualify.contract import Contract, load_contract
from qualify.lanes import forward_mode, lane_bf16_mode, lane_precision
from qualify.memory import fix_mmap_threshold, release_free_memory
from qualify.models import bundle as models
from qualify.reference import devices, rollout
from qualify.reference.controls import control_settings
from qualify.reference.stage import _batch, _plan_check, _reward_scores, _update_run
from qualify.reference.update import UpdateSettings


def _settings(contract: Contract, lane: str, control: str) -> tuple[UpdateSettings, str]:
    if control == "reference":
        return UpdateSettings(precision="bf16" if lane_precision(lane) == "bf16" else "fp32",
                              bf16_mode=lane_bf16_mode(lane),
                              micro_batch_size=contract.algorithm.micro_batch_size,
                              label=f"hf-{lane}"), "sdpa"
    return control_settings(contract, lane)[control]


def _status_kib() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
                if k in ("VmRSS", "VmHWM")}


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _heap_mb() -> dict[str, float]:
    fn = libc.function("mallinfo2")
    if fn is None:
        return {}
    fn.restype = _Mallinfo2
    m = fn()
    return {"arena": m.arena / 1e6, "in_use": m.uordblks / 1e6, "free": m.fordblks / 1e6,
            "mmapped": m.hblkhd / 1e6, "mmapped_chunks": float(m.hblks)}


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _prepare(contract: Contract, directory: Path) -> tuple[Any, Any, Any, Any]:
    """``(bundle, rollout, batch, placement)`` as the stage prepares them for an update run."""
    bundle = models.prepare_models(contract)
    roll = rollout.Rollout.load(directory)
    train = load_file(str(directory / "train_inputs.safetensors"))
    batch = _batch(roll, train, bundle.pad_token_id)
    placed = devices.resolve()
    record = _plan_check(contract, False, placed, devices.device_memory())
    if placed is not None and record["optimizer_state"] == "host":
        placed = dataclasses.replace(placed, optimizer_state="host",
                                     gradients=record["gradients"],
                                     round2_state=record["round2_state"])
    return bundle, roll, batch, placed


def _sequence(contract: Contract, directory: Path, steps: list[str]) -> int:
    runs = []
    for item in steps:  # every item resolved before any model is loaded
        lane, sep, control = item.partition(":")
        if not sep or not lane or not control:
            raise SystemExit(f"plan_step: --sequence {item!r}: expected LANE:CONTROL")
        runs.append((item, control, *_settings(contract, lane, control)))
    bundle, roll, batch, placed = _prepare(contract, directory)
    rows: list[dict[str, Any]] = []
    with devices.active(placed):
        for item, control, settings, attn in runs:
            release_free_memory()  # the stage's step() and _update_run do the same
            start = _status_kib()["VmRSS"]
            reset = _reset_peak()
            t0 = time.perf_counter()
            tensors, _ = _update_run(contract, bundle, batch, settings, attn)
            if control != "reference" or forward_mode(settings.bf16_mode) != "params":
                tensors["round1/reward/rewards"] = _reward_scores(
                    contract, bundle, roll, precision=settings.precision,
                    bf16_mode=settings.bf16_mode, attn=attn,
                    micro_batch_size=settings.micro_batch_size,
                    extra_left=settings.extra_left_padding,
                    extra_right=settings.extra_right_padding)
            wall = time.perf_counter() - t0
            status = _status_kib()
            del tensors
            row = {"step": item, "label": settings.label, "attn": attn,
                   "rss_start_kib": start, "peak_kib": status["VmHWM"],
                   "peak_is_step_own": reset, "rss_end_kib": status["VmRSS"],
                   "wall_s": round(wall, 1), "heap_end_mb": _heap_mb()}
            rows.append(row)
            print(f"plan_step: {row}", flush=True)
    release_free_memory()
    print(f"plan_step: after the last release RSS {_status_kib()['VmRSS']} KiB, heap "
          f"{_heap_mb()}", flush=True)
    return 0


def main() -> int:
    """Run the named update run (or the ``--sequence``); print its label."""
    if "--fixed-mmap-threshold" in sys.argv:
        sys.argv.remove("--fixed-mmap-threshold")
        print(f"plan_step: mmap threshold fixed: {fix_mmap_threshold()}", flush=True)
    contract = load_contract(Path(sys.argv[1]))
    if sys.argv[3] == "--sequence":
        return _sequence(contract, Path(sys.argv[2]), sys.argv[4:])
    directory, lane, control = Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    settings, attn = _settings(contract, lane, control)  # before any model is loaded
    bundle, _, batch, placed = _prepare(contract, directory)
    with devices.active(placed) as where:
        tensors, _ = _update_run(contract, bundle, batch, settings, attn)
    if len(sys.argv) > 5:
        save_file({k: v.contiguous() for k, v in tensors.items()}, sys.argv[5])
    print(f"plan_step: ran {settings.label} ({attn}) on {where['kind']} devices "
          f"{[d['device'] for d in where['devices']]}, AdamW state "
          f"{where.get('optimizer_state', 'device')}, gradients "
          f"{where.get('gradients', 'device')}, placed {where['placed']}, "
          f"noted {where.get('memory')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
