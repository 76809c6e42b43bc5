"""Fixed cost per launch and per cell, and wall / engine compute per stage, from a run's evidence.

Read only what the evidence records (nothing is run):

- each launch attempt's ``result.json`` ``wall_s`` (the launcher's wall, torchrun included;
  for a launch started ahead of its turn, ``ahead`` true, from its gate on: its launcher's
  imports, from ``launcher_started``, ran beside the launch before it and are not in it,
  :mod:`qualify.candidate.ahead`);
- each cell's ``outputs.json``: trainer cells ``role_timings`` (``load_s``,
  ``parallelize_s`` / ``initialize_s``, ``scoring_s``, ``round1_s``, ``round2_s``,
  ``export_weights_s``) and ``timings`` (``init_s``, ``merge_s``, ``variant_s``,
  ``rank0_total_s``); sampler cells ``timings`` (``engine_start_s``, ``install_s``,
  ``kernel_probe_s``, ``probes_s``, ``round2_sampling_s``, ``round2_scoring_s``,
  ``total_s``; ``weights_wait_s``, the time one sampler process for every TP size waited,
  engines started, for the weights it installs: in its wall, noted per run);
- the reference's ``reference.json`` ``step_started_s`` (seconds from the stage's start to
  each step's start).

Engine compute of a trainer cell is ``scoring_s + round1_s + round2_s + export_weights_s``
(the engine's forward, backward and optimizer work and the weight export); its setup is
``load_s + parallelize_s + initialize_s`` (model load and sharding in the engine). A cell
computes on its role's ranks of its topology (``result.json`` ``launch_variant``, such as
``fp32-a2c1``: the Actor on ranks 0-1, the Critic on rank 2), and a rank runs its cells one
after another, so a launch's compute is that of its busiest rank: the largest sum, over the
ranks, of the compute of the cells each took part in. That never counts two cells that ran
at the same time on different ranks twice: no barrier separates a launch's variants, and a
faster role's ranks may begin the next variant while the slower role computes. Its fixed
cost is its wall minus that. A sampler cell's compute is
``round2_sampling_s + round2_scoring_s``.

Not recorded (so not derived): the interpreter start and import time of each rank, the
teardown after the outputs are written (:mod:`benchmarks.teardown` measures it), the
comparator's and the signing's wall, and the reference stage's engine compute (its steps
are timed only as a whole, and its last step, ``seal``, has no end time).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["launch_table", "stage_table"]

_COMPUTE = ("scoring_s", "round1_s", "round2_s", "export_weights_s")
_SETUP = ("load_s", "parallelize_s", "initialize_s")
_SAMPLER_COMPUTE = ("round2_sampling_s", "round2_scoring_s")
_TOPOLOGY = re.compile(r"a(\d+)c(\d+)$")


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _cells(run: Path) -> list[dict[str, Any]]:
    """One record per COMPLETE cell: launch, wall, ranks, role, compute, setup and init."""
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
            else sum(float(rt.get(k, 0.0)) for k in _SETUP)
        launch = str(res.get("launch", cid))
        out.append({"cell": cid, "launch": launch,
                    "wall_s": float(res.get("wall_s", float("nan"))),
                    "started": str(res.get("started") or ""),
                    "ranks": _ranks(str(e.get("role")), str(res.get("launch_variant") or launch)),
                    "sampler": sampler, "compute_s": compute, "setup_s": setup,
                    "init_s": float(t.get("init_s", 0.0))})
    return out


def _ranks(role: str, variant: str) -> tuple[str, ...]:
    """The ranks a trainer cell computed on, from its topology; else its role.

    ``variant`` is ``result.json`` ``launch_variant`` (``fp32-a2c1``; since commit 6db5e59
    one launch runs every topology of its world size) or, before, the launch's name
    (``torch_tp-a1c2``): the Actor on ranks ``[0, actor_tp)``, the Critic after
    (:func:`qualify_harness.outputs.rank_table`).
    """
    m = _TOPOLOGY.search(variant)
    if m is None or role not in ("actor", "critic"):
        return (role,)
    actor_tp, critic_tp = int(m.group(1)), int(m.group(2))
    first, n = (0, actor_tp) if role == "actor" else (actor_tp, critic_tp)
    return tuple(f"rank{r}" for r in range(first, first + n))


def _busiest(cells: list[dict[str, Any]], key: str) -> float:
    """The largest sum of ``key`` over the cells one rank ran (a rank runs them in turn)."""
    per_rank: dict[str, float] = defaultdict(float)
    for c in cells:
        for r in c["ranks"]:
            per_rank[r] += c[key]
    return max(per_rank.values(), default=0.0)


def launch_table(run: Path) -> pd.DataFrame:
    """Per launch: cells, wall, engine compute, fixed cost, fixed cost per cell.

    A launch's engine compute is that of its busiest rank: the largest sum, over the ranks,
    of the compute of the cells each rank took part in (the module docstring).

    Columns: ``launch``, ``kind`` (trainer / sampler), ``cells``, ``wall_s``,
    ``compute_s``, ``fixed_s`` (wall - compute), ``fixed_per_cell_s``, ``setup_s`` (the
    busiest rank's recorded model load and sharding, plus the launch's process-group
    ``init_s`` once), ``wall_over_compute``.
    """
    by_launch: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in _cells(run):
        by_launch[c["launch"]].append(c)
    rows = []
    for launch, cells in sorted(by_launch.items()):
        compute = _busiest(cells, "compute_s")
        setup = _busiest(cells, "setup_s") + max(c["init_s"] for c in cells)
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
    waits = _sampler_waits(run)
    if waits:
        notes.append("sampler: its launch starts with the candidate stage and waits, engines "
                     "started, for the weights it installs (outputs.json timings "
                     "weights_wait_s: " + ", ".join(f"{c} {w:.1f} s" for c, w in waits.items())
                     + "); that wait is in its wall, beside the trainer launches")
    notes.append("not recorded: per-rank interpreter start and imports, teardown after the "
                 "outputs (benchmarks.teardown), compare and sign wall")
    return pd.DataFrame(rows), notes


def _sampler_waits(run: Path) -> dict[str, float]:
    """Per COMPLETE sampler cell that records it, ``timings.weights_wait_s`` (seconds)."""
    out = {}
    for cid, e in sorted(_read(run / "run.json").get("cells", {}).items()):
        if e.get("role") == "sampler" and e.get("status") == "COMPLETE" and e.get("attempt"):
            t = _read(run / str(e["attempt"]) / "outputs.json").get("timings") or {}
            if "weights_wait_s" in t:
                out[cid] = float(t["weights_wait_s"])
    return out
