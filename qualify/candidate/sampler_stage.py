"""The candidate stage's sampler step: install the round-1 Actor weights into the sampler.

Runs once the trainer launch that exports the weights is done (beside the other trainer
launches, :func:`qualify.candidate.stage.run_candidate_stage`), once per
TP size of the contract's ``[sampler]`` section (cell ``{engine}-fp32-sampler-tp{n}``, the
engine a registered one of kind ``sampler``):

1. find the round-1-updated Actor weights that the ``sampler.weights_from`` cell exported
   (``actor_round1.safetensors`` in that cell's sealed launch attempt; the candidate stage
   asks that launch to export, :func:`export_wanted`);
2. write ``cell.json`` and ``sampler_request.json`` (weights file, its sha256, the source
   cell) into a new attempt ``cells/<cell>/attempt-N/`` and run the sampler harness
   (``python -m <the engine's harness module> cell.json``, a child process with a
   wall-clock limit; stdout/stderr in ``logs/``);
3. record ``result.json`` and seal the attempt (:func:`qualify.evidence.store.seal`); the cell's
   entry in ``run.json`` is ``COMPLETE``, ``ERROR`` (with the reason and logs) or
   ``NOT_RUN`` (no ``[sampler]`` cell selected, or the weights source did not complete).

The harness installs, verifies, probes and scores; the verdicts are the comparator's
(:mod:`qualify.compare.sampler`). The sampler engine is never imported in this process.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Final

from qualify import procs
from qualify.candidate import imported
from qualify.candidate.launch import check_outputs, validate_cell
from qualify.contract import CellSpec, Contract
from qualify.errors import HarnessError
from qualify.evidence import imports, store
from qualify.layout import CELLS_DIR, LOGS_DIR, RESULT_FILE, RUN_FILE, RunDocument
from qualify.protocol import (
    ACTOR_ROUND1_WEIGHTS,
    CELL_FILE,
    HarnessCell,
    variant_tag,
)
from qualify.registry import EngineSpec, get_engine
from qualify.resources import repo_root

REQUEST_FILE: Final = "sampler_request.json"
CELL_ATTEMPT_KIND: Final = "cell-attempt"
DEFAULT_TIMEOUT_S: Final = 1800.0


def sampler_cells(contract: Contract) -> list[tuple[str, int]]:
    """``(cell id, TP)`` of every sampler cell of the contract (none without ``[sampler]``)."""
    s = contract.sampler
    if s is None:
        return []
    return list(zip(s.cell_ids(), s.tp_sizes, strict=True))


def selected(contract: Contract, patterns: Sequence[str] | None) -> list[tuple[str, int]]:
    """The sampler cells matched by ``--cells`` globs (all of them when ``None``)."""
    cells = sampler_cells(contract)
    if not patterns or contract.sampler is None:
        return cells
    out = []
    for cid, tp in cells:
        for pat in patterns:
            engine, glob = pat.split(":", 1) if ":" in pat else ("", pat)
            if engine in ("", contract.sampler.engine) and fnmatch.fnmatch(cid, glob):
                out.append((cid, tp))
                break
    return out


def export_wanted(contract: Contract, cells: Sequence[CellSpec]) -> bool:
    """Whether a launch producing ``cells`` must export the Actor's round-1 weights."""
    s = contract.sampler
    return s is not None and any(c.cell_id == s.weights_from for c in cells)


def find_weights(run_dir: Path, run: RunDocument, cell_id: str) -> tuple[Path | None, str]:
    """The round-1 weights file exported by ``cell_id`` in this run, or ``None`` and why.

    Looks in the cell's launch attempt (``result.json`` ``launch_attempt``): the file itself,
    or, for a grouped launch, the cell's variant subdirectory (``result.json``
    ``launch_variant``; in a run without it, the tag of the cell's precision / options).
    """
    entry = run.cells.get(cell_id)
    if not isinstance(entry, dict):
        return None, f"weights source {cell_id} is not in {RUN_FILE}"
    if entry.get("status") != "COMPLETE":
        return None, (f"weights source {cell_id} did not complete "
                      f"({entry.get('status')}: {entry.get('reason')})")
    attempt = run_dir / str(entry.get("attempt"))
    try:
        result = json.loads((attempt / RESULT_FILE).read_text("utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"{attempt / RESULT_FILE}: unreadable: {exc}"
    launch = Path(str(result.get("launch_attempt", "")))
    tag = str(result.get("launch_variant") or variant_tag(str(entry.get("precision")),
                                                          dict(entry.get("options") or {})))
    for cand in (launch / ACTOR_ROUND1_WEIGHTS, launch / tag / ACTOR_ROUND1_WEIGHTS):
        if cand.is_file():
            return cand, ""
    return None, (f"weights source {cell_id}: no {ACTOR_ROUND1_WEIGHTS} in its launch attempt "
                  f"{launch} (was the launch run with export_weights?)")


def _entry(engine: str, tp: int, status: str, *, reason: str | None, attempt: str | None,
           weights_from: str) -> dict[str, Any]:
    return {"engine": engine, "precision": "fp32", "options": {"rollout_tp": tp},
            "role": "sampler", "tp": tp, "status": status, "reason": reason,
            "attempt": attempt, "weights_from": weights_from}


def run_sampler_cells(contract: Contract, *, run_dir: Path, run: RunDocument, inputs: Path,
                      cells: Sequence[str] | None = None, faults: Sequence[str] = (),
                      timeout_s: float = DEFAULT_TIMEOUT_S,
                      lock: AbstractContextManager[Any] | None = None,
                      stop: threading.Event | None = None) -> None:
    """Run every selected, not yet complete sampler cell; update ``run`` and ``run.json``.

    Args:
        contract: the contract (its ``[sampler]`` section).
        run_dir: the run directory.
        run: the typed ``run.json`` document (mutated: one entry per sampler cell).
        inputs: the run's ``inputs/`` directory.
        cells: ``--cells`` globs (``None``: all).
        faults: deliberate faults (recorded in ``cell.json``).
        timeout_s: wall-clock limit of one sampler cell.
        lock: held around every read and write of ``run`` (the candidate stage runs this
            beside the trainer launches, in a thread of its own); ``None``: no other writer.
        stop: when set (the stage failed), no further cell starts and the running one's
            process tree is ended (that cell is recorded ``ERROR``, cancelled).
    """
    s = contract.sampler
    if s is None:
        return
    guard = lock if lock is not None else contextlib.nullcontext()
    engine = get_engine(s.engine)
    for cid, tp in selected(contract, cells):
        if stop is not None and stop.is_set():
            return
        with guard:
            if run.cells.get(cid, {}).get("status") == "COMPLETE":
                continue
            why_not = engine.unavailable_reason()
            weights, why = find_weights(run_dir, run, s.weights_from)
            if why_not is not None or weights is None:
                run.cells[cid] = _entry(s.engine, tp, "NOT_RUN", reason=why_not or why,
                                        attempt=None, weights_from=s.weights_from)
                store.atomic_write_json(run_dir / RUN_FILE, run.to_dict())
                continue
        attempt = store.new_attempt(run_dir / CELLS_DIR / cid)
        status, reason = _run_one(contract, attempt, inputs=inputs, tp=tp, weights=weights,
                                  weights_from=s.weights_from, engine=engine,
                                  faults=faults, timeout_s=timeout_s, stop=stop)
        with guard:
            run.cells[cid] = _entry(s.engine, tp, status, reason=reason,
                                    attempt=str(attempt.relative_to(run_dir)),
                                    weights_from=s.weights_from)
            store.atomic_write_json(run_dir / RUN_FILE, run.to_dict())


def _run_one(contract: Contract, attempt: Path, *, inputs: Path, tp: int, weights: Path,
             weights_from: str, engine: EngineSpec, faults: Sequence[str],
             timeout_s: float, stop: threading.Event | None = None) -> tuple[str, str | None]:
    """Run one sampler cell into ``attempt`` and seal it; returns ``(status, reason)``."""
    hc = HarnessCell(engine=engine.name, precision="fp32", options={"rollout_tp": tp}, actor_tp=0,
                     critic_tp=0, rounds=contract.algorithm.rounds, seed=contract.sampling.seed,
                     inputs_dir=str(inputs.resolve()), output_dir=str(attempt.resolve()),
                     faults=tuple(faults))
    validate_cell(hc.to_dict())
    store.atomic_write_json(attempt / CELL_FILE, hc.to_dict())
    store.atomic_write_json(attempt / REQUEST_FILE, {
        "weights_file": str(weights.resolve()), "weights_sha256": store.sha256_file(weights),
        "weights_from": weights_from})
    logs = attempt / LOGS_DIR
    logs.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(repo_root()), os.environ.get("PYTHONPATH", "")]),
        imported.IMPORTS_DIR_ENV: str(imports.raw_dir(attempt).resolve())}
    t0, started, started_ns = time.perf_counter(), store.utc_now_iso(), time.time_ns()
    status, reason = "COMPLETE", None
    with (logs / "stdout.txt").open("wb") as out, (logs / "stderr.txt").open("wb") as err:
        ran = procs.run([sys.executable, "-m", engine.module, str(attempt / CELL_FILE)],
                        stdout=out, stderr=err, env=env, timeout_s=timeout_s, cancel=stop)
    rc = ran.returncode  # None on timeout: the harness's whole process tree was ended
    imports.collect(attempt, module=engine.module, expected=1, started_ns=started_ns,
                    label=f"{attempt.parent.name}/{attempt.name}")
    if ran.timed_out:
        status, reason = "ERROR", f"sampler harness exceeded {timeout_s:.0f} s"
    elif ran.cancelled:
        status, reason = "ERROR", "cancelled: the candidate stage failed beside it"
    elif rc != 0:
        status, reason = "ERROR", f"sampler harness exited with code {rc}"
    if status == "COMPLETE":
        try:
            check_outputs(attempt, sampler=True)
        except HarnessError as exc:
            status, reason = "ERROR", f"sampler harness exited 0 but its outputs are bad: {exc}"
    if status == "ERROR":
        tail = (logs / "stderr.txt").read_text("utf-8", errors="replace").strip().splitlines()
        last = next((ln for ln in reversed(tail) if ln.strip()), "")
        reason = f"{reason}: {last[-300:]}" if last else reason
    store.atomic_write_json(attempt / RESULT_FILE, {
        "status": status, "reason": reason, "wall_s": round(time.perf_counter() - t0, 3),
        "returncode": rc, "launch": f"{engine.name}-sampler-tp{tp}", "weights_from": weights_from,
        "started": started,
        "weights_file": str(weights.resolve())})
    store.seal(attempt, kind=CELL_ATTEMPT_KIND)
    return status, reason
