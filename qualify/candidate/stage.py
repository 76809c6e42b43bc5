"""The candidate stage: ``qualify candidate CONTRACT --reference DIR``.

Runs every selected engine x precision x options x role x TP cell of the contract's matrix
against a sealed reference, through the harness protocol (:mod:`qualify.protocol`). One
launch runs one topology (Actor TP ``a`` + Critic TP ``c``, separate process groups) and
yields the outputs of two cells; an engine that groups (:class:`Launch`) runs several
variants, and topologies of one world size, in one launch. The stage splits the outputs
into append-only per-cell attempts:

    evidence/<contract>/<run-id>/
        run.json                        cell index: status, reason, attempt of each cell
        inputs/                         what harnesses may read: rollout, train inputs,
                                        contract.json, model.json (no reference scores)
        launches/<launch-id>/attempt-N/ raw launch: cell.json, outputs.json, rank logs,
                                        tensor_index.json (the harness's outputs files:
                                        sha256, per-tensor digests, owning cell)
        cells/<cell-id>/attempt-N/      that cell's outputs.safetensors / outputs.json /
                                        result.json, sealed (MANIFEST.json)

Each tensor is stored once: once the cells' attempts are sealed, a launch outputs file whose
every tensor is in its cell with the same bytes is removed before the launch attempt is
sealed (:mod:`qualify.evidence.tensor_index`; ``verify`` checks the cells against the index).

Re-running with the same ``--run-id`` resumes: cells with a complete attempt are skipped,
failed attempts are kept and a new attempt is added.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import re
import shutil
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

from qualify import jsonio
from qualify.atomic import TMP_PREFIX
from qualify.candidate import ahead, beside, resume_stage, sampler_stage
from qualify.candidate.launch import LaunchResult, launch_engine, read_safetensors_header
from qualify.candidate.launches import Launch, in_stage_order, launches_for, plan_launches
from qualify.candidate.plan import launch_host_peaks
from qualify.contract import CellSpec, Contract, cells_matching
from qualify.errors import (
    ContractError,
    EvidenceIntegrityError,
    ReferenceDataError,
    UsageError,
    WriterBusyError,
)
from qualify.evidence import imports, store, supersede, tensor_index
from qualify.evidence.sources import check_resume_sources, write_sources
from qualify.layout import (
    CELLS_DIR,
    CONTRACT_FILE,
    INCOMPLETE_INFIX,
    INPUTS_DIR,
    LAUNCHES_DIR,
    LOGS_DIR,
    MODEL_FILE,
    RESULT_FILE,
    RUN_FILE,
    RunDocument,
    RunReference,
)
from qualify.progress import Progress
from qualify.protocol import (
    OUTPUTS_FILE,
    OUTPUTS_META_FILE,
    PER_PARAM_METRICS,
    ROLLOUT_FILE,
    ROLLOUT_META_FILE,
    TRAIN_INPUTS_FILE,
    HarnessCell,
    parse_tensor_name,
)
from qualify.reference.documents import load_sealed_reference, read_document
from qualify.reference.plan_core import INTERPRETER_BYTES, machine_defaults
from qualify.registry import EngineSpec, get_engine, has_cuda
from qualify.sampling import rollout_sampling, sampling_summary

RUN_KIND = "candidate-run"
CELL_ATTEMPT_KIND = "cell-attempt"
_RUN_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_run_id(run_id: str) -> str:
    """Require ``run_id`` to be one safe path component (it names a directory).

    Allowed: 1 to 128 of ``A-Z a-z 0-9 . _ -``, starting with a letter or digit, without
    ``..``; so no ``/``, no ``..`` and no hidden name, and the run stays under the
    evidence root. Nor the names qualify gives directories it sets aside
    (``.incomplete-``, ``.tmp-``): ``gate`` never picks those, so a run named like one would
    hide from it.

    Returns:
        ``run_id``.

    Raises:
        UsageError: any other value (one line naming it).
    """
    if (not _RUN_ID_RE.fullmatch(run_id) or ".." in run_id or INCOMPLETE_INFIX in run_id
            or TMP_PREFIX in run_id):
        raise UsageError(f"--run-id {run_id!r}: must be one path component of 1 to 128 "
                         "letters, digits, '.', '_' or '-', starting with a letter or digit, "
                         f"without '..', {INCOMPLETE_INFIX!r} (moved-aside runs) or "
                         f"{TMP_PREFIX!r}")
    return run_id


def new_run_id(parent: Path) -> str:
    """A new UTC timestamp run id (``20261201T103000Z``) naming nothing under ``parent``.

    A second run started within the same second gets ``-2``, ``-3``, ... appended, so a
    new run never resumes (or collides with) an existing directory.
    """
    base = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    rid, n = base, 2
    while os.path.lexists(parent / rid):
        rid, n = f"{base}-{n}", n + 1
    return rid


def _stage_inputs(contract: Contract, reference: Path, run_dir: Path) -> Path:
    """Copy what a harness may read into ``run_dir/inputs`` (never the reference scores).

    The role models are prepared from the contract (manifest verified) and must be the
    very files the reference was built with (same sha256 per file).

    Raises:
        ReferenceDataError: the local models differ from the reference's.
    """
    from qualify.models import bundle as models

    inputs = run_dir / INPUTS_DIR
    ref_model = read_document(reference / MODEL_FILE, None)
    if not isinstance(ref_model, dict) or not isinstance(ref_model.get("files"), dict):
        raise ReferenceDataError(f"{reference / MODEL_FILE}: files: not an object of files")
    bundle = models.prepare_models(contract)
    if dict(bundle.files) != dict(ref_model.get("files", {})):
        changed = sorted(set(bundle.files.items()) ^ set(ref_model.get("files", {}).items()))
        raise ReferenceDataError(
            f"{reference / MODEL_FILE}: files: the local role models differ from the ones "
            f"the reference was built with (first difference: {changed[0][0]})")
    if (inputs / MODEL_FILE).exists():
        return inputs
    inputs.mkdir(parents=True, exist_ok=True)
    for name in (ROLLOUT_FILE, ROLLOUT_META_FILE, TRAIN_INPUTS_FILE, CONTRACT_FILE):
        shutil.copyfile(reference / name, inputs / name)
    store.atomic_write_json(inputs / MODEL_FILE, {
        "actor_dir": str(bundle.actor_dir.resolve()),
        "ref_dir": str(bundle.actor_dir.resolve()),
        "critic_dir": str(bundle.critic_dir.resolve()),
        "files": dict(bundle.files),
    })
    return inputs


def _read_run(run_dir: Path) -> RunDocument | None:
    """The run's ``run.json`` to resume, typed; ``None`` for a new run.

    Raises:
        ReferenceDataError: unreadable, not strict JSON, or a field of the wrong type.
    """
    path = run_dir / RUN_FILE
    if not os.path.lexists(path):
        return None
    try:
        raw = jsonio.read_json(path)
    except (OSError, EvidenceIntegrityError) as exc:
        raise ReferenceDataError(f"{path}: cannot resume: {exc}") from None
    return RunDocument.from_dict(raw, where=str(path))


def _split_outputs(result: LaunchResult, attempt: Path, launch_: Launch, cell: CellSpec,
                   cell_attempt: Path, *, contract: Contract, numels: dict[str, int],
                   consumed: Sequence[Path] = ()) -> tuple[str, str | None]:
    """Write one cell's share of a launch into its own attempt directory and seal it.

    The cell's ``outputs.json`` gains ``param_sampling``
    (:func:`qualify.sampling.sampling_summary`: which per-parameter statistics are exact,
    which estimated from the contract's sample, with each sample's standard-error factor).
    Its ``imports.json`` holds the import records of the launch and of ``consumed`` (a
    resume cell's save launch, :func:`qualify.evidence.imports.inherit`).

    Returns:
        The cell's ``(status, reason)``: ``COMPLETE``, or ``ERROR`` when the launch
        failed or did not write this cell's variant.
    """
    status, reason = result.status, result.reason
    src = attempt / launch_.part_of(cell).tag if launch_.grouped else attempt
    if status == "OK" and not (src / OUTPUTS_FILE).is_file():
        status, reason = "ERROR", (f"harness exited 0 but wrote no {src / OUTPUTS_FILE} "
                                   f"for variant {launch_.part_of(cell).tag}")
    if status == "OK":
        tensors = store.load_tensors(src / OUTPUTS_FILE)
        mine = {k: v for k, v in tensors.items() if k.split("/")[1] == cell.role}
        meta = json.loads((src / OUTPUTS_META_FILE).read_text())
        role_meta = meta.get("roles", {}).get(cell.role, {})
        store.save_tensors(cell_attempt / OUTPUTS_FILE, mine)
        store.atomic_write_json(cell_attempt / OUTPUTS_META_FILE, {
            **{k: v for k, v in meta.items() if k != "roles"}, **role_meta,
            "role": cell.role, "tp": cell.tp,
            "param_sampling": sampling_summary(contract.evidence, numels,
                                               _stored_elements(mine))})
    imports.inherit(cell_attempt, (attempt, *consumed))
    logs = attempt / LOGS_DIR
    if logs.is_dir() and status != "OK":  # a complete cell's logs stay in its launch attempt
        shutil.copytree(logs, cell_attempt / LOGS_DIR, dirs_exist_ok=True)
    store.atomic_write_json(cell_attempt / RESULT_FILE, {
        "status": "COMPLETE" if status == "OK" else "ERROR",
        "reason": reason,
        "wall_s": result.wall_s, "started": result.started,
        "launcher_started": result.launcher_started, "ahead": result.ahead,
        "returncode": result.returncode,
        "launch": launch_.launch_id,
        "launch_attempt": str(attempt),
        "launch_variant": launch_.part_of(cell).tag if launch_.grouped else "",
    })
    store.seal(cell_attempt, kind=CELL_ATTEMPT_KIND)
    return "COMPLETE" if status == "OK" else "ERROR", reason


def _index_launch(result: LaunchResult, attempt: Path, launch_: Launch,
                  cell_attempts: dict[str, Path], run_dir: Path) -> dict[str, Any] | None:
    """Write the launch attempt's tensor index (:mod:`qualify.evidence.tensor_index`).

    Written after the split, naming only the cells whose attempts were sealed COMPLETE
    (``cell_attempts``): each tensor ``round{r}/{role}/...`` of a variant's
    ``outputs.safetensors`` is owned by that variant's cell of ``role``; a tensor no such
    cell takes keeps its file.

    Returns:
        The index, or ``None`` when the launch failed or wrote no outputs file.

    Raises:
        EvidenceIntegrityError: an outputs file is unreadable.
    """
    if result.status != "OK":
        return None
    owners: dict[str, dict[str, str]] = {}
    for part in launch_.parts:
        rel = f"{part.tag}/{OUTPUTS_FILE}" if launch_.grouped else OUTPUTS_FILE
        if rel in owners or not (attempt / rel).is_file():
            continue
        cells: dict[str, str] = {c.role: cell_attempts[c.cell_id].relative_to(run_dir).as_posix()
                                 for c in (part.actor, part.critic)
                                 if c is not None and c.cell_id in cell_attempts}
        names = [k for k in read_safetensors_header(attempt / rel) if k != "__metadata__"]
        owners[rel] = {k: cells[k.split("/")[1]] for k in names
                       if len(k.split("/")) > 1 and k.split("/")[1] in cells}
    if not owners:
        return None
    doc = tensor_index.build_index(attempt, owners)
    tensor_index.write_index(attempt, doc)
    return doc


def _model_numels(inputs: Path) -> dict[str, int]:
    """``{HF parameter name: elements}`` of the run's Actor and Critic models.

    Read from the safetensors headers of the model directories named in
    ``inputs/model.json`` (no tensor is loaded); a name in both (the shared backbone) has
    the same shape in both. Empty when a directory holds no safetensors file.
    """
    doc = json.loads((inputs / MODEL_FILE).read_text("utf-8"))
    out: dict[str, int] = {}
    for key in ("actor_dir", "critic_dir"):
        for f in sorted(Path(str(doc.get(key, ""))).glob("*.safetensors")):
            for name, entry in read_safetensors_header(f).items():
                if name != "__metadata__":
                    n = 1
                    for d in entry["shape"]:
                        n *= int(d)
                    out.setdefault(name, n)
    return out


def _stored_elements(tensors: dict[str, Any]) -> dict[str, int]:
    """``{parameter: elements stored}`` over the per-parameter families of one cell."""
    out: dict[str, int] = {}
    for name, arr in tensors.items():
        try:
            _r, _role, metric, param = parse_tensor_name(name)
        except ValueError:
            continue
        if metric in PER_PARAM_METRICS and param is not None:
            out[param] = max(out.get(param, 0), int(arr.size))
    return out


def run_candidate_stage(
    contract: Contract,
    *,
    reference: Path,
    root: Path,
    cells: Sequence[str] | None = None,
    run_id: str | None = None,
    quiet: bool = False,
    faults: Sequence[str] = (),
    launch_timeout_s: float = 900.0,
    collective_timeout_s: float = 120.0,
    supersedes: Sequence[supersede.Pending] = (),
) -> Path:
    """Run the selected cells against a sealed reference; return the run directory.

    The run directory carries the ``INCOMPLETE`` marker from its first write until
    ``qualify compare`` seals it, and this process holds the marker's writer lock while it
    runs (:func:`qualify.evidence.attempts.hold_writer_lock`). The sampler cells run beside
    the trainer launches once the weights they install exist (:mod:`qualify.candidate.beside`),
    and each trainer launch's launcher starts one turn ahead: it imports while the launch
    before it runs and forks its ranks once that one has ended (:mod:`qualify.candidate.ahead`).

    Args:
        contract: the loaded contract (its digest must equal the reference's).
        reference: sealed reference directory.
        root: evidence root (``evidence/``).
        cells: cell globs (``None`` = every cell).
        run_id: resume this run (default: a new UTC timestamp id).
        quiet: no progress bars.
        faults: deliberate engine faults (test suite only; recorded in run.json).
        launch_timeout_s: wall-clock limit of one launch.
        collective_timeout_s: timeout of every collective inside a harness.
        supersedes: the interrupted runs this run supersedes
            (:func:`qualify.evidence.supersede.prepare`): recorded in ``run.json``, then
            their markers written (:func:`qualify.evidence.supersede.write`).

    ``run.json`` is written before the first launch (with the ``--cells`` selection, so a
    later plain ``qualify run`` can tell whether it may resume the run); each resume
    appends its time to ``resumed``. A new run id never names an existing directory.

    Raises:
        UsageError: ``run_id`` is not one safe path component (:func:`check_run_id`), or
            names a run that a later run superseded (``superseded.json``).
        WriterBusyError: another live process writes this run (the message names its pid
            and host).
        ReferenceDataError: the reference is missing or unsealed, its ``reference.json``,
            ``contract.json`` or ``bounds.json`` is off its schema (a non-finite or negative
            bound, a list for a document) or of another contract
            (:func:`qualify.reference.documents.load_sealed_reference`).
        EvidenceIntegrityError: the reference was edited, or the run is sealed already.
    """
    if run_id is not None:
        check_run_id(run_id)
    reference, root = reference.resolve(), root.resolve()
    # every document binding the reference to the contract, before anything is launched
    ref_meta = load_sealed_reference(reference, contract)
    wanted = cells_matching(contract, cells)
    beside.check_settings()  # bad launch settings: refused before the run directory exists
    rid = run_id or new_run_id(root / contract.name)
    run_dir = root / contract.name / rid
    if store.is_sealed(run_dir):
        raise EvidenceIntegrityError(f"{run_dir}: run is sealed (compared); start a new run")
    supersede.refuse(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # INCOMPLETE from the first write until compare seals the run; its lock makes
    # this process the run's one writer (a dead writer's lock is taken over)
    with store.hold_writer_lock(run_dir, kind=RUN_KIND):
        supersede.refuse(run_dir)  # superseded while this process waited for the lock
        previous = _read_run(run_dir)
        run = previous or RunDocument(
            contract=contract.name, contract_digest=contract.digest,
            reference=RunReference(path=str(reference.resolve()),
                                   manifest_digest=store.manifest_digest(reference),
                                   sealed=ref_meta.get("created")),
            run_id=rid, started=store.utc_now(), faults=list(faults),
            selection=list(cells) if cells else None, selection_recorded=True)
        if run.contract_digest != contract.digest:
            raise ReferenceDataError(f"{run_dir / RUN_FILE}: contract_digest: run belongs to "
                                     f"another contract digest")
        # What code runs the cells (qualify.evidence.sources): recorded once, before the
        # first cell; a resume is refused once qualify/ or the files a kept cell ran changed
        # (check_resume_sources: a cell launched again records its own). A resumed run made
        # before sources.json existed stays unrecorded (STALE at the gate).
        if run.cells:
            check_resume_sources(run_dir)
        else:
            write_sources(run_dir, contract=contract)
        if previous is not None:
            run.resumed.append(store.utc_now())
        known = {(s["run_id"], s["marker_sha256"]) for s in run.supersedes}
        run.supersedes += [dict(p.entry) for p in supersedes
                           if (p.entry["run_id"], p.entry["marker_sha256"]) not in known]
        store.atomic_write_json(run_dir / RUN_FILE, run.to_dict())
        for pending in supersedes:  # recorded first: a marker is never left unconfirmed
            with contextlib.suppress(WriterBusyError):  # a writer came back: not superseded
                supersede.write(pending)
        inputs = _stage_inputs(contract, reference, run_dir)
        numels = _model_numels(inputs)
        todo = [c for c in wanted
                if run.cells.get(c.cell_id, {}).get("status") != "COMPLETE"]
        # the launch exporting the sampler's weights first; the sampler cells then run
        # beside the other trainer launches (qualify.candidate.beside), under one lock
        source = contract.sampler.weights_from if contract.sampler is not None else ""
        launches = in_stage_order(contract, launches_for(contract, todo))
        lock, cuda = threading.Lock(), has_cuda()

        weights_ready = threading.Event()  # the sampler's weights source is recorded

        def sampler_cells(stop: threading.Event | None = None) -> None:
            sampler_stage.run_sampler_cells(contract, run_dir=run_dir, run=run, inputs=inputs,
                                            cells=cells, faults=faults, lock=lock, stop=stop,
                                            weights_ready=weights_ready)

        ahead_on = beside.ahead(cuda=cuda)
        peaks: dict[str, int] = {}
        if ahead_on:
            try:
                peaks = launch_host_peaks(contract, machine_defaults(), launches)
            except ContractError:  # a model the plan cannot size runs unplanned: one at a time
                ahead_on = False
        gates: list[ahead.Gate] = []

        def start(lc: Launch, engine: EngineSpec, before: _Started | None) -> _Started:
            """Start ``lc``'s launch ahead of its turn (after ``before``), or run it here.

            Run here: one launch at a time (``pool`` is ``None``).
            """
            hc = HarnessCell(
                param_sampling=rollout_sampling(contract.evidence, inputs),
                engine=lc.engine, precision=lc.precision,  # type: ignore[arg-type]
                options=dict(lc.options), actor_tp=lc.actor_tp, critic_tp=lc.critic_tp,
                rounds=contract.algorithm.rounds, seed=contract.sampling.seed,
                inputs_dir=str(inputs.resolve()), output_dir="",
                collective_timeout_s=collective_timeout_s, faults=tuple(faults),
                export_weights=sampler_stage.export_wanted(contract, lc.cells),
                variants=tuple(p.variant(sampler_stage.export_wanted(
                    contract, [c for c in (p.actor, p.critic) if c is not None]))
                    for p in lc.parts) if lc.grouped else (),
            )
            attempt = store.new_attempt(run_dir / LAUNCHES_DIR / lc.launch_id)
            hc = dataclasses.replace(hc, output_dir=str(attempt.resolve()))
            timeout_s = launch_timeout_s * len(lc.parts)
            if pool is None:  # one launch after the other, in this thread
                bar.advance(lc.launch_id)
                done: Future[LaunchResult] = Future()
                done.set_result(launch_engine(hc, engine=engine, attempt_dir=attempt,
                                              timeout_s=timeout_s, cuda=cuda))
                return _Started(lc, attempt, done)
            gate = ahead.Gate()
            gates.append(gate)
            if before is None:  # its turn now: open before its launcher starts
                gate.open()
            future = pool.submit(launch_engine, hc, engine=engine, attempt_dir=attempt,
                                 timeout_s=timeout_s, cuda=cuda, gate=gate)
            if before is not None:  # its ranks start the moment the launch before it ended
                before.future.add_done_callback(gate.open_after)
            return _Started(lc, attempt, future)

        def finish(started: _Started) -> None:
            """Wait for a started launch; split, index and seal it; record its cells."""
            lc, attempt = started.launch, started.attempt
            if pool is not None:  # announced as the launch this thread now waits for
                bar.advance(lc.launch_id)
            result = started.future.result()
            store.atomic_write_json(attempt / RESULT_FILE, {
                "status": result.status, "reason": result.reason, "wall_s": result.wall_s,
                "returncode": result.returncode, "started": result.started,
                "launcher_started": result.launcher_started, "ahead": result.ahead})
            cell_attempts = {c.cell_id: store.new_attempt(run_dir / CELLS_DIR / c.cell_id)
                             for c in lc.cells}
            entries = {}
            for cell in lc.cells:
                cell_attempt = cell_attempts[cell.cell_id]
                status, why = _split_outputs(result, attempt, lc, cell, cell_attempt,
                                             contract=contract, numels=numels)
                entries[cell.cell_id] = _cell_entry(
                    cell, status, why, str(cell_attempt.relative_to(run_dir)))
            # after the split (the launch files are untouched until the drop): the index
            # names only sealed cells; a crash before the seal leaves an unsealed launch
            # attempt whose index nothing reads (tensor_index.check_run skips it)
            complete = {cid: a for cid, a in cell_attempts.items()
                        if entries[cid]["status"] == "COMPLETE"}
            index = _index_launch(result, attempt, lc, complete, run_dir)
            if index is not None:  # every tensor is in a sealed cell: drop the copy
                tensor_index.drop_stored_copies(attempt, run_dir, index)
            store.seal(attempt, kind="launch-attempt")
            with lock:  # COMPLETE in run.json only once the launch attempt is sealed
                run.cells.update(entries)
                store.atomic_write_json(run_dir / RUN_FILE, run.to_dict())
            if source in entries:
                weights_ready.set()  # the weights are recorded: the sampler installs them

        with Progress(total=max(1, len(launches)), description=f"candidate {contract.name}",
                      quiet=quiet) as bar, beside.running(sampler_cells, cuda=cuda) as sampler:
            if not any(source in {c.cell_id for c in lc.cells} for lc in launches):
                weights_ready.set()  # none of them exports: the weights are there, or never
            if sampler is not None:
                sampler.go()  # the sampler engines start now, beside the trainer launches
            pool = (ThreadPoolExecutor(max_workers=2, thread_name_prefix="qualify-launch")
                    if ahead_on else None)
            current: _Started | None = None  # the launch running (or about to)
            try:
                for lc in launches:
                    engine = get_engine(lc.engine)
                    why_not = engine.unavailable_reason(variants=contract.algorithm.variants())
                    if why_not is not None:
                        bar.advance(lc.launch_id)
                        with lock:
                            for cell in lc.cells:
                                run.cells[cell.cell_id] = _cell_entry(cell, "NOT_RUN", why_not,
                                                                      None)
                            store.atomic_write_json(run_dir / RUN_FILE, run.to_dict())
                        continue
                    if current is not None and (
                            pool is None or ahead.raised(current.future) or not ahead.room_ahead(
                                peaks.get(current.launch.launch_id, 0), INTERPRETER_BYTES,
                                available=ahead.mem_available())):
                        finish(current)  # one at a time, no room beside it, or it failed
                        current = None
                    started = start(lc, engine, current)
                    if current is not None:
                        finish(current)
                    current = started
                if current is not None:
                    finish(current)
            except BaseException:
                for gate in gates:  # no launch starts, or goes on, after the stage failed
                    with contextlib.suppress(Exception):
                        gate.shut()
                if pool is not None:
                    pool.shutdown(wait=True, cancel_futures=True)
                raise
            if pool is not None:
                pool.shutdown(wait=True)
            weights_ready.set()
            if sampler is not None:
                sampler.result()
        if sampler is None:
            sampler_cells()
        # the resume cells ([resume]): save after round k, a fresh launch restores and goes on
        resume_stage.run_resume_cells(
            contract, run_dir=run_dir, run=run, wanted=wanted, plan=plan_launches,
            base_cell=HarnessCell(
                param_sampling=rollout_sampling(contract.evidence, inputs), engine="",
                precision="fp32", options={},
                actor_tp=0, critic_tp=0, rounds=contract.algorithm.rounds,
                seed=contract.sampling.seed, inputs_dir=str(inputs.resolve()), output_dir="",
                collective_timeout_s=collective_timeout_s, faults=tuple(faults)),
            split=lambda result, attempt, lc, cell, cell_attempt, consumed=(): _split_outputs(
                result, attempt, lc, cell, cell_attempt, contract=contract, numels=numels,
                consumed=consumed),
            entry=_cell_entry, launch_timeout_s=launch_timeout_s, cuda=cuda,
            write_run=lambda: store.atomic_write_json(run_dir / RUN_FILE, run.to_dict()))
        for c in wanted:
            run.cells.setdefault(c.cell_id, _cell_entry(c, "NOT_RUN", "not launched", None))
        for c in resume_stage.selected(contract, wanted):
            run.cells.setdefault(resume_stage.resume_cell_id(c),
                                 _cell_entry(c, "NOT_RUN", "not launched", None))
        run.finished = store.utc_now()
        store.atomic_write_json(run_dir / RUN_FILE, run.to_dict())
    return run_dir


@dataclasses.dataclass(frozen=True)
class _Started:
    """A trainer launch started (or waiting ahead of its turn) and its attempt directory."""

    launch: Launch
    attempt: Path
    future: Future[LaunchResult]


def _cell_entry(cell: CellSpec, status: str, reason: str | None,
                attempt: str | None) -> dict[str, Any]:
    return {"engine": cell.engine, "precision": cell.precision, "options": cell.harness_options,
            "role": cell.role, "tp": cell.tp, "status": status, "reason": reason,
            "attempt": attempt}
