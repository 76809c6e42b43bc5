"""The candidate stage's sampler step: install the round-1 Actor weights into the sampler.

Runs beside the trainer launches (:func:`qualify.candidate.stage.run_candidate_stage`), for
every TP size of the contract's ``[sampler]`` section (cell ``{engine}-fp32-sampler-tp{n}``,
the engine a registered one of kind ``sampler``), all of them in one harness process that
starts with the stage, so each engine starts once, beside the launch that exports the
weights it installs:

1. write each cell's ``cell.json`` into a new attempt ``cells/<cell>/attempt-N/`` and start
   the sampler harness on all of them (``python -m <the engine's harness module>
   cell.json ...``, a child process with a wall-clock limit; stdout/stderr in the first
   attempt's ``logs/``, copied into the others'): it starts its engines and scores what
   needs no new weights, then waits for each cell's request;
2. once the ``sampler.weights_from`` cell is recorded, find the round-1-updated Actor
   weights it exported (``actor_round1.safetensors`` in that cell's sealed launch attempt;
   the candidate stage asks that launch to export, :func:`export_wanted`) and write
   ``sampler_request.json`` into each attempt (weights file, its sha256, the source cell;
   or no weights and why);
3. record each ``result.json`` and seal the attempt (:func:`qualify.evidence.store.seal`);
   the cell's entry in ``run.json`` is ``COMPLETE``, ``ERROR`` (with the reason and logs)
   or ``NOT_RUN`` (no ``[sampler]`` cell selected, the engine unavailable, or the weights
   source did not complete).

The harness installs, verifies, probes and scores; the verdicts are the comparator's
(:mod:`qualify.compare.sampler`). The sampler engine is never imported in this process.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Final

from qualify import procs
from qualify.candidate import forkserver, imported
from qualify.candidate.launch import check_outputs, validate_cell
from qualify.contract import CellSpec, Contract
from qualify.errors import HarnessError
from qualify.evidence import imports, store
from qualify.layout import (
    CELLS_DIR,
    LOGS_DIR,
    OUTPUTS_META_FILE,
    RESULT_FILE,
    RUN_FILE,
    RunDocument,
)
from qualify.privatedirs import private_dirs
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
                      stop: threading.Event | None = None,
                      weights_ready: threading.Event | None = None) -> None:
    """Run every selected, not yet complete sampler cell; update ``run`` and ``run.json``.

    One harness process runs all of them (each TP size's engine started once, module
    docstring); it starts at once and waits for each cell's request, which is written when
    ``weights_ready`` is set (the weights source is recorded in ``run``).

    Args:
        contract: the contract (its ``[sampler]`` section).
        run_dir: the run directory.
        run: the typed ``run.json`` document (mutated: one entry per sampler cell).
        inputs: the run's ``inputs/`` directory.
        cells: ``--cells`` globs (``None``: all).
        faults: deliberate faults (recorded in ``cell.json``).
        timeout_s: wall-clock limit per sampler cell; the process gets that many seconds
            per cell it runs, its wait for the weights included.
        lock: held around every read and write of ``run`` (the candidate stage runs this
            beside the trainer launches, in a thread of its own); ``None``: no other writer.
        stop: when set (the stage failed), the harness process tree is ended (its cells
            are recorded ``ERROR``, cancelled) and no request is written.
        weights_ready: set once the ``sampler.weights_from`` cell is recorded in ``run``
            (or will never be); ``None``: it is already.
    """
    s = contract.sampler
    if s is None:
        return
    guard = lock if lock is not None else contextlib.nullcontext()
    engine = get_engine(s.engine)
    todo: list[tuple[str, int]] = []
    with guard:
        for cid, tp in selected(contract, cells):
            if run.cells.get(cid, {}).get("status") == "COMPLETE":
                continue
            why_not = engine.unavailable_reason()
            if why_not is not None:
                run.cells[cid] = _entry(s.engine, tp, "NOT_RUN", reason=why_not,
                                        attempt=None, weights_from=s.weights_from)
                store.atomic_write_json(run_dir / RUN_FILE, run.to_dict())
                continue
            todo.append((cid, tp))
    if not todo or (stop is not None and stop.is_set()):
        return
    attempts = {cid: store.new_attempt(run_dir / CELLS_DIR / cid) for cid, _ in todo}
    proc = _Process(contract, attempts, dict(todo), inputs=inputs, engine=engine,
                    faults=faults, timeout_s=timeout_s * len(todo), stop=stop)
    proc.start()
    ready = weights_ready if weights_ready is not None else threading.Event()
    if weights_ready is None:
        ready.set()
    while not ready.wait(0.05):  # the harness starts its engines meanwhile
        if (stop is not None and stop.is_set()) or not proc.is_alive():
            break
    weights, why = None, "the candidate stage stopped before the weights were recorded"
    if ready.is_set():
        with guard:
            weights, why = find_weights(run_dir, run, s.weights_from)
    if stop is None or not stop.is_set():
        request: dict[str, Any] = {"weights_file": None, "weights_sha256": None,
                                   "weights_from": s.weights_from, "reason": why}
        if weights is not None:
            request = {"weights_file": str(weights.resolve()),
                       "weights_sha256": store.sha256_file(weights),
                       "weights_from": s.weights_from}
        for attempt in attempts.values():
            store.atomic_write_json(attempt / REQUEST_FILE, request)
    proc.join()
    for cid, tp in todo:
        attempt = attempts[cid]
        status, reason = proc.judge(attempt, weights=weights, why=why)
        store.atomic_write_json(attempt / RESULT_FILE, {
            "status": status, "reason": reason, "wall_s": proc.wall_s,
            "returncode": proc.returncode, "launch": proc.launch,
            "weights_from": s.weights_from, "started": proc.started,
            "weights_file": str(weights.resolve()) if weights is not None else None})
        store.seal(attempt, kind=CELL_ATTEMPT_KIND)
        with guard:
            run.cells[cid] = _entry(s.engine, tp, status, reason=reason,
                                    attempt=(str(attempt.relative_to(run_dir))
                                             if status != "NOT_RUN" else None),
                                    weights_from=s.weights_from)
            store.atomic_write_json(run_dir / RUN_FILE, run.to_dict())


class _Process(threading.Thread):
    """The one sampler harness process of :func:`run_sampler_cells`, run in a thread.

    Its ``cell.json`` files are written, in the contract's TP order, before it starts; its
    stdout / stderr go to the first attempt's ``logs/`` and are copied into the others',
    as are its imported-files lists (:func:`qualify.evidence.imports.collect`, per attempt).
    """

    def __init__(self, contract: Contract, attempts: dict[str, Path], tps: dict[str, int], *,
                 inputs: Path, engine: EngineSpec, faults: Sequence[str], timeout_s: float,
                 stop: threading.Event | None) -> None:
        super().__init__(name="qualify-sampler-harness", daemon=True)
        self.attempts, self.engine, self.timeout_s, self.stop = attempts, engine, timeout_s, stop
        self.launch = f"{engine.name}-sampler-" + "-".join(f"tp{tps[c]}" for c in attempts)
        self.files: list[Path] = []
        for cid, attempt in attempts.items():
            hc = HarnessCell(engine=engine.name, precision="fp32",
                             options={"rollout_tp": tps[cid]}, actor_tp=0, critic_tp=0,
                             rounds=contract.algorithm.rounds, seed=contract.sampling.seed,
                             inputs_dir=str(inputs.resolve()), output_dir=str(attempt.resolve()),
                             faults=tuple(faults))
            validate_cell(hc.to_dict())
            store.atomic_write_json(attempt / CELL_FILE, hc.to_dict())
            (attempt / LOGS_DIR).mkdir(exist_ok=True)
            self.files.append(attempt / CELL_FILE)
        self.first = next(iter(attempts.values()))
        self.started, self.wall_s = store.utc_now_iso(), 0.0
        self.returncode: int | None = None
        self.timed_out = self.cancelled = False
        self.error: BaseException | None = None

    def run(self) -> None:
        """Run the harness process; keep its return code (or what running it raised).

        The process gets the engine's private directories
        (:attr:`qualify.registry.EngineSpec.private_dirs`), removed once it has ended.
        """
        logs = self.first / LOGS_DIR
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(repo_root()), os.environ.get("PYTHONPATH", "")]),
            imported.IMPORTS_DIR_ENV: str(imports.raw_dir(self.first).resolve())}
        t0, self.started, started_ns = time.perf_counter(), store.utc_now_iso(), time.time_ns()
        try:
            with (logs / "stdout.txt").open("wb") as out, \
                    (logs / "stderr.txt").open("wb") as err, \
                    private_dirs(self.engine.private_dirs, env) as dirs:
                env.update(dirs)
                server = forkserver.current()
                ran = procs.run([sys.executable, "-m", self.engine.module,
                                 *(str(f) for f in self.files)],
                                stdout=out, stderr=err, env=env, timeout_s=self.timeout_s,
                                cancel=self.stop,
                                spawn=None if server is None else functools.partial(
                                    server.spawn, imports_under=self.engine.imports_under))
            if ran.spawned and server is not None:
                started_ns = min(started_ns, server.started_ns)  # its modules' import time
            self.returncode, self.timed_out, self.cancelled = (ran.returncode, ran.timed_out,
                                                               ran.cancelled)
        except BaseException as exc:  # judged as an ERROR of every cell, in the caller
            self.error = exc
        self.wall_s = round(time.perf_counter() - t0, 3)
        raw = imports.raw_dir(self.first)
        for attempt in self.attempts.values():
            if attempt != self.first:
                for name in ("stdout.txt", "stderr.txt"):
                    if (logs / name).is_file():
                        shutil.copyfile(logs / name, attempt / LOGS_DIR / name)
                if raw.is_dir():
                    shutil.copytree(raw, imports.raw_dir(attempt), dirs_exist_ok=True)
        expected = self._expected_processes()
        for attempt in self.attempts.values():
            imports.collect(attempt, module=self.engine.module, expected=expected,
                            started_ns=started_ns,
                            label=f"{attempt.parent.name}/{attempt.name}")

    def _expected_processes(self) -> int:
        """The ranks whose import records the process's freshness needs.

        The harness itself, and, where it forked the ranks of an ``external_launcher`` engine
        of ``tp`` ranks (the cell's ``outputs.json`` says so: ``engine_settings``
        ``distributed_executor_backend``, ``tp``; :mod:`harnesses.vllm.harness`), ranks ``0
        .. tp - 1``, which each record what they imported (their engine's model code, the
        worker class): a missing one then makes the cells' freshness unprovable
        (:func:`qualify.evidence.imports.record_changes`). An unreadable meta counts as
        none (its cell is judged by :meth:`judge`).
        """
        most = 1
        for attempt in self.attempts.values():
            try:
                meta = json.loads((attempt / OUTPUTS_META_FILE).read_text("utf-8"))
                settings = meta.get("engine_settings") or {}
                if settings.get("distributed_executor_backend") == "external_launcher":
                    most = max(most, int(meta.get("tp") or 1))
            except (OSError, ValueError, TypeError, AttributeError):
                continue
        return most

    def judge(self, attempt: Path, *, weights: Path | None, why: str) -> tuple[str, str | None]:
        """``(status, reason)`` of one cell once the process has ended."""
        if self.error is not None:
            return "ERROR", f"the sampler harness could not be run: {self.error}"
        status, reason = "COMPLETE", None
        if self.timed_out:
            status, reason = "ERROR", f"sampler harness exceeded {self.timeout_s:.0f} s"
        elif self.cancelled:
            status, reason = "ERROR", "cancelled: the candidate stage failed beside it"
        elif self.returncode != 0:
            how = ("ended with no exit status" if self.returncode is None
                   else procs.exit_text(self.returncode))
            status, reason = "ERROR", f"sampler harness {how}"
        elif weights is None:
            return "NOT_RUN", why
        if status == "COMPLETE":
            try:
                check_outputs(attempt, sampler=True)
            except HarnessError as exc:
                status, reason = "ERROR", f"sampler harness exited 0 but its outputs are bad: {exc}"
        if status == "ERROR":
            tail = (attempt / LOGS_DIR / "stderr.txt").read_text(
                "utf-8", errors="replace").strip().splitlines()
            last = next((ln for ln in reversed(tail) if ln.strip()), "")
            reason = f"{reason}: {last[-300:]}" if last else reason
        return status, reason
