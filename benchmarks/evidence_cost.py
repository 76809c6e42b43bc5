"""Fixed cost per launch and per cell, and wall / engine compute per stage, from a run's evidence.

Read only what the evidence records (nothing is run):

- each launch attempt's ``result.json`` ``wall_s`` (the launcher's wall, torchrun included);
- each cell's ``outputs.json``: trainer cells ``role_timings`` (``load_s``,
  ``parallelize_s`` / ``initialize_s``, ``scoring_s``, ``round1_s``, ``round2_s``,
  ``export_weights_s``) and ``timings`` (``init_s``, ``merge_s``, ``variant_s``,
  ``rank0_total_s``); sampler cells ``timings`` (``engine_start_s``, ``install_s``,
  ``kernel_probe_s``, ``probes_s``, ``round2_sampling_s``, ``round2_scoring_s``,
  ``total_s``);
- the reference's ``reference.json`` ``step_started_s`` (seconds from the stage's start to
  each step's start).

Engine compute of a trainer cell is ``scoring_s + round1_s + round2_s + export_weights_s``
(the engine's forward, backward and optimizer work and the weight export); its setup is
``load_s + parallelize_s + initialize_s`` (model load and sharding in the engine). The
cells of one launch variant (``result.json`` ``launch_variant``: a precision, options and a
topology such as ``fp32-a2c1``) run their roles side by side on their own ranks, the
variants one after another, so a launch's compute is the sum over variants of the slowest
role's compute, and its fixed cost is its wall minus that. A sampler cell's compute is
``round2_sampling_s + round2_scoring_s``.

Not recorded (so not derived): the interpreter start and import time of each rank, the
teardown after the outputs are written (:mod:`benchmarks.teardown` measures it), the
comparator's and the signing's wall, and the reference stage's engine compute (its steps
are timed only as a whole, and its last step, ``seal``, has no end time).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["launch_table", "stage_table"]

_COMPUTE = ("scoring_s", "round1_s", "round2_s", "export_weights_s")
_SETUP = ("load_s", "parallelize_s", "initialize_s")
_SAMPLER_COMPUTE = ("round2_sampling_s", "round2_scoring_s")


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _cells(run: Path) -> list[dict[str, Any]]:
    """One record per COMPLETE cell: launch, wall, variant, role, compute and setup."""
    out = []
    for cid, e in sorted(_read(run / "run.json").get("cells", {}).items()):
        if e.get("status") != "COMPLETE" or not e.get("attempt"):
            continue
        adir = run / str(e["attempt"])
        res, meta = _read(adir / "result.json"), _read(adir / "outputs.json")
        t, rt = meta.get("timings") or {}, meta.get("role_timings") or {}
        sampler = e.get("role") == "sampler"
        compute = sum(float(t.get(k, 0.0)) for k in _SAMPLER_COMPUTE) if sampler \
            else sum(float(rt.get(k, 0.0)) for k in _COMPUTE)
        setup = float(t.get("engine_start_s", 0.0)) if sampler \
            else sum(float(rt.get(k, 0.0)) for k in _SETUP) + float(t.get("init_s", 0.0))
        out.append({"cell": cid, "launch": str(res.get("launch", cid)),
                    "wall_s": float(res.get("wall_s", float("nan"))),
                    "started": str(res.get("started") or ""),
                    "variant": _variant(e, res),
                    "role": str(e.get("role")), "sampler": sampler, "compute_s": compute,
                    "setup_s": setup})
    return out


def _variant(entry: dict[str, Any], result: dict[str, Any]) -> tuple[str, ...]:
    """The launch variant a cell ran in: ``result.json`` ``launch_variant``.

    A launch runs its variants one after another, each a precision, options and a
    topology (``fp32-a2c1`` then ``fp32-a1c2``: :func:`harnesses.common.topology_runs`),
    so two cells of one precision and options but another topology never run side by side.
    Runs from before launches grouped topologies (commit 6db5e59, which also added
    ``launch_variant``) had one topology per launch: their precision and options.
    """
    if result.get("launch_variant"):
        return (str(result["launch_variant"]),)
    return (str(entry.get("precision")), json.dumps(entry.get("options") or {}, sort_keys=True))


def launch_table(run: Path) -> pd.DataFrame:
    """Per launch: cells, wall, engine compute, fixed cost, fixed cost per cell.

    Columns: ``launch``, ``kind`` (trainer / sampler), ``cells``, ``wall_s``,
    ``compute_s``, ``fixed_s`` (wall - compute), ``fixed_per_cell_s``, ``setup_s`` (the
    cells' recorded model load and sharding, summed over variants of the slowest role),
    ``wall_over_compute``.
    """
    by_launch: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in _cells(run):
        by_launch[c["launch"]].append(c)
    rows = []
    for launch, cells in sorted(by_launch.items()):
        variants: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        for c in cells:
            variants[c["variant"]].append(c)
        compute = sum(max(c["compute_s"] for c in v) for v in variants.values())
        setup = sum(max(c["setup_s"] for c in v) for v in variants.values())
        wall = cells[0]["wall_s"]
        rows.append({"launch": launch, "kind": "sampler" if cells[0]["sampler"] else "trainer",
                     "started": cells[0]["started"],
                     "cells": len(cells), "wall_s": wall, "compute_s": compute,
                     "fixed_s": wall - compute, "fixed_per_cell_s": (wall - compute) / len(cells),
                     "setup_s": setup,
                     "wall_over_compute": wall / compute if compute else float("inf")})
    return pd.DataFrame(rows)


def _elapsed(launches: pd.DataFrame) -> float | None:
    """Seconds during which at least one of ``launches`` ran (the union of their intervals).

    Launches can overlap (the sampler cells run beside the trainer launches,
    :mod:`qualify.candidate.beside`), so a stage's wall is not the sum of its launches'.
    ``None`` when a launch has no recorded ``started`` (runs made before it was recorded).
    """
    if "started" not in launches or (launches["started"] == "").any():
        return None
    starts = [pd.Timestamp(str(s)).timestamp() for s in launches["started"]]
    spans = sorted((t, t + float(w)) for t, w in zip(starts, launches["wall_s"], strict=True))
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def stage_table(run: Path, launches: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """Per stage: wall, engine compute, their ratio; and notes on what is not recorded.

    Stages: ``reference`` (from ``reference.json`` ``step_started_s``: the start of
    ``seal`` as its wall, compute not recorded), ``trainer``, ``sampler`` and ``trainer +
    sampler`` (the elapsed time of their launches, from each ``result.json`` ``started`` and
    ``wall_s``; the sum of the walls for a run without start times), and ``candidate
    (run.json)`` (``started`` to ``finished``).
    """
    notes: list[str] = []
    rows = []
    run_doc = _read(run / "run.json")
    ref_path = Path(str((run_doc.get("reference") or {}).get("path", "")))
    ref_doc = _read(ref_path / "reference.json") if ref_path.name else {}
    if not ref_doc:
        local = run.parent.parent.parent / "references"
        for cand in sorted(local.glob(f"{run_doc.get('contract', '')}-*")):
            ref_doc = _read(cand / "reference.json") or ref_doc
    steps = ref_doc.get("step_started_s") or {}
    if steps:
        rows.append({"stage": "reference", "wall_s": float(max(steps.values())),
                     "compute_s": float("nan"), "wall_over_compute": float("nan"),
                     "detail": ", ".join(f"{k} {v:.1f}" for k, v in
                                         sorted(steps.items(), key=lambda kv: kv[1]))})
        notes.append("reference: wall to the start of 'seal' (step_started_s); its steps' "
                     "engine compute and the seal's end are not recorded")
    else:
        notes.append("reference: no reference.json step_started_s found")
    for kind in ("trainer", "sampler", "trainer + sampler"):
        sub = launches[launches["kind"].isin(kind.split(" + "))] if len(launches) else launches
        if len(sub):
            summed, compute = float(sub["wall_s"].sum()), float(sub["compute_s"].sum())
            wall = _elapsed(sub)
            detail = f"{len(sub)} launches, {int(sub['cells'].sum())} cells"
            if wall is None:
                wall = summed
                detail += ", walls summed (no launch start times recorded)"
            else:
                detail += f", elapsed (launch walls summed: {summed:.1f} s)"
            rows.append({"stage": kind, "wall_s": wall, "compute_s": compute,
                         "wall_over_compute": wall / compute if compute else float("inf"),
                         "detail": detail})
    try:
        t0 = pd.Timestamp(run_doc["started"])
        t1 = pd.Timestamp(run_doc["finished"])
        total = float((t1 - t0).total_seconds())
        compute = float(launches["compute_s"].sum()) if len(launches) else float("nan")
        rows.append({"stage": "candidate (run.json)", "wall_s": total, "compute_s": compute,
                     "wall_over_compute": total / compute if compute else float("inf"),
                     "detail": "started -> finished"})
    except (KeyError, ValueError, TypeError):
        notes.append("run.json: no started/finished")
    notes.append("not recorded: per-rank interpreter start and imports, teardown after the "
                 "outputs (benchmarks.teardown), compare and sign wall")
    return pd.DataFrame(rows), notes
