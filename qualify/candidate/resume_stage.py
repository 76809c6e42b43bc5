"""The resume cells of the candidate stage (the contract's ``[resume]`` section, issue #18).

For each selected trainer cell ``C`` (:class:`qualify.matrix.ResumeSpec`), the cell
``C-resume`` is made by two launches of ``C``'s topology, one variant each:

    launches/<launch-id>-resume-save/attempt-N/   rounds 1..k, then the engine's own
                                                  checkpoint under checkpoint/<role>/
    launches/<launch-id>-resume-load/attempt-N/   a fresh launch (new rank processes, no
                                                  state of the save launch's) that
                                                  restores it and runs rounds k+1..rounds
    cells/<C>-resume/attempt-N/                   the load launch's share for C's role

The load launch's ``outputs.json`` role meta carries ``resume`` (the state record measured
before the save and after the restore, :mod:`harnesses.resume_state`);
:mod:`qualify.compare.resume` judges the cell against ``C``'s own rounds k+1..rounds. An
engine whose spec does not declare ``resumes`` gets ``NOT_RUN`` resume cells naming it; a
save launch that fails makes its cells ``ERROR`` without a load launch.

This module imports no engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qualify.candidate.launch import LaunchResult, launch_engine
from qualify.contract import CellSpec, Contract
from qualify.evidence import store
from qualify.layout import CELLS_DIR, LAUNCHES_DIR, RESULT_FILE, RunDocument
from qualify.matrix import RESUME_SUFFIX
from qualify.protocol import HarnessCell
from qualify.registry import get_engine

CHECKPOINT_DIR = "checkpoint"
"""Subdirectory of the save launch's attempt that holds the engine's checkpoint."""

Split = Callable[..., tuple[str, str | None]]
Entry = Callable[[CellSpec, str, str | None, str | None], dict[str, Any]]


def resume_cell_id(cell: CellSpec) -> str:
    """``torch_tp-fp32-actor-tp2`` -> ``torch_tp-fp32-actor-tp2-resume``."""
    return cell.cell_id + RESUME_SUFFIX


def selected(contract: Contract, wanted: Sequence[CellSpec]) -> list[CellSpec]:
    """The trainer cells of ``wanted`` that get a resume cell (none without ``[resume]``)."""
    spec = contract.resume
    return [] if spec is None else [c for c in wanted if spec.selects(c.cell_id)]


def _entry(entry: Entry, cell: CellSpec, status: str, reason: str | None,
           attempt: str | None, *, after_round: int) -> dict[str, Any]:
    return {**entry(cell, status, reason, attempt), "resume_of": cell.cell_id,
            "after_round": after_round}


def run_resume_cells(contract: Contract, *, run_dir: Path, run: RunDocument,
                     wanted: Sequence[CellSpec], plan: Callable[..., Sequence[Any]],
                     base_cell: HarnessCell, split: Split, entry: Entry,
                     launch_timeout_s: float, cuda: bool,
                     write_run: Callable[[], None]) -> None:
    """Run the resume cells of ``wanted`` not yet COMPLETE in ``run``; record them in ``run``.

    Args:
        contract: the contract (its ``resume`` section; nothing is done without one).
        run_dir: the run directory.
        run: the run document (its ``cells`` are filled in).
        wanted: the trainer cells selected for this run.
        plan: :func:`qualify.candidate.stage.plan_launches` (topology launches of cells).
        base_cell: the launch's :class:`~qualify.protocol.HarnessCell` template (rounds,
            seed, inputs, faults, timeouts); engine, TPs, precision and options are set here.
        split: :func:`qualify.candidate.stage._split_outputs` (one cell's share, sealed;
            ``consumed``: the save launch attempt, whose import record the cell inherits).
        entry: :func:`qualify.candidate.stage._cell_entry` (the ``run.json`` entry).
        launch_timeout_s: wall-clock limit of each launch.
        cuda: whether this machine has a CUDA device
            (:func:`qualify.candidate.launch.launch_engine`).
        write_run: writes ``run.json``.
    """
    spec = contract.resume
    if spec is None:
        return
    k = spec.after_round
    todo = [c for c in selected(contract, wanted)
            if run.cells.get(resume_cell_id(c), {}).get("status") != "COMPLETE"]
    for lc in plan(contract, todo):
        engine = get_engine(lc.engine)
        why_not = engine.unavailable_reason(variants=contract.algorithm.variants())
        if why_not is None and not engine.resumes:
            why_not = (f"the {lc.engine} harness does not implement resume (its spec does not "
                       "declare resumes: no checkpoint save / restore in its own format)")
        if why_not is not None:
            for cell in lc.cells:
                run.cells[resume_cell_id(cell)] = _entry(entry, cell, "NOT_RUN", why_not, None,
                                                         after_round=k)
            write_run()
            continue
        hc = dataclasses.replace(
            base_cell, engine=lc.engine, precision=lc.precision, options=dict(lc.options),
            actor_tp=lc.actor.tp if lc.actor else 0, critic_tp=lc.critic.tp if lc.critic else 0,
            variants=(), export_weights=False)
        save = store.new_attempt(run_dir / LAUNCHES_DIR / f"{lc.launch_id}-resume-save")
        ckpt = str((save / CHECKPOINT_DIR).resolve())
        saved = _launch(dataclasses.replace(hc, output_dir=str(save.resolve()),
                                            resume={"phase": "save", "after_round": k,
                                                    "dir": ckpt}),
                        engine, save, launch_timeout_s, cuda)
        result: LaunchResult | None = None
        attempt = save
        if saved:
            attempt = store.new_attempt(run_dir / LAUNCHES_DIR / f"{lc.launch_id}-resume-load")
            result = _launch(dataclasses.replace(hc, output_dir=str(attempt.resolve()),
                                                 resume={"phase": "load", "after_round": k,
                                                         "dir": ckpt}),
                             engine, attempt, launch_timeout_s, cuda)
        else:
            saved = dataclasses.replace(saved, reason=f"save launch (rounds 1..{k}): "
                                                      f"{saved.reason}")
        for cell in lc.cells:
            cell_attempt = store.new_attempt(run_dir / CELLS_DIR / resume_cell_id(cell))
            status, why = split(result if result is not None else saved, attempt, lc, cell,
                                cell_attempt, consumed=(save,) if attempt != save else ())
            run.cells[resume_cell_id(cell)] = _entry(
                entry, cell, status, why, str(cell_attempt.relative_to(run_dir)), after_round=k)
        store.seal(save, kind="launch-attempt")
        if result is not None:
            store.seal(attempt, kind="launch-attempt")
        write_run()


def _launch(cell: HarnessCell, engine: Any, attempt: Path, timeout_s: float,
            cuda: bool) -> LaunchResult:
    """One launch of a resume phase, its ``result.json`` written."""
    result = launch_engine(cell, engine=engine, attempt_dir=attempt, timeout_s=timeout_s,
                           cuda=cuda)
    store.atomic_write_json(attempt / RESULT_FILE, {
        "status": result.status, "reason": result.reason, "wall_s": result.wall_s,
        "returncode": result.returncode, "resume_phase": (cell.resume or {}).get("phase"),
        "started": result.started})
    return result
