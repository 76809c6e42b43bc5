"""What a plain ``qualify run`` does with the runs an interruption left behind.

After ``kill -9``, Ctrl-C, SIGTERM or a full disk, ``evidence/<contract>/`` may hold runs
that never sealed (``INCOMPLETE``), and runs sealed but not signed (killed while signing).
Before the candidate stage, :func:`plan` looks at every run directory of the contract
and decides, with nothing deleted:

- a sealed, unsigned run is signed (its seal was complete; only the signature was cut);
- an unsealed run whose writer is alive is left alone (a concurrent ``qualify``);
- the newest unsealed run that can be resumed is resumed: same contract digest, same
  sealed reference (manifest sha256), the same ``--cells`` selection, no test faults, and
  unchanged sources: the ``qualify`` files and those of every cell the resume keeps
  (:func:`qualify.evidence.sources.check_resume_sources`);
- every other unsealed run (or one whose earlier supersession no run confirms) is
  superseded by the run this invocation writes (:mod:`qualify.evidence.supersede`): it
  is kept whole and the gate and the audit accept it as such;
- with nothing to resume, a sealed run whose signing this invocation just finished is the
  result when it is the contract's newest run and would have been resumed (same contract,
  reference, selection, fresh sources): its decision is reported, no new run is made.

``--run-id ID`` names the run to write (resumed when it exists); the other unsealed runs
are superseded by it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from qualify.atomic import TMP_PREFIX
from qualify.contract import Contract
from qualify.errors import EvidenceIntegrityError, QualifyError, UsageError, WriterBusyError
from qualify.evidence import store, supersede
from qualify.evidence.sources import check_resume_sources, stale_cells
from qualify.jsonio import read_json
from qualify.layout import (
    INCOMPLETE_FILE,
    INCOMPLETE_INFIX,
    MANIFEST_FILE,
    RUN_FILE,
    SOURCES_FILE,
    RunDocument,
)

__all__ = ["Plan", "apply", "plan"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """What :func:`apply` does before the candidate stage.

    Attributes:
        run_id: the run this invocation writes (resumed, or new), or the sealed run whose
            signing it finishes (``sealed``).
        resume: ``run_id`` exists and is resumed.
        sealed: ``run_id`` is a sealed run this invocation signs and decides on, with no
            candidate stage.
        supersede: ``(run directory, reason)`` of each unsealed run to supersede.
        sign: sealed, unsigned runs to sign.
        notes: one line each, for the user (what is resumed, superseded, left alone).
    """

    run_id: str
    resume: bool
    sealed: bool = False
    supersede: tuple[tuple[Path, str], ...] = ()
    sign: tuple[Path, ...] = ()
    notes: tuple[str, ...] = ()


def _run_dirs(parent: Path) -> list[Path]:
    """The run directories of one contract, sorted by name (no link, no aside, no temp)."""
    try:
        entries = sorted(os.scandir(parent), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [Path(e.path) for e in entries
            if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")
            and INCOMPLETE_INFIX not in e.name and TMP_PREFIX not in e.name]


def _read_run(d: Path) -> tuple[RunDocument | None, str | None]:
    if not os.path.lexists(d / RUN_FILE):
        return None, "no run.json: interrupted before it recorded what it runs"
    try:
        return RunDocument.from_dict(read_json(d / RUN_FILE), where=str(d / RUN_FILE)), None
    except (OSError, QualifyError) as exc:
        return None, f"run.json unreadable ({exc})"


def _selection(cells: Sequence[str] | None) -> tuple[str, ...] | None:
    return tuple(sorted(set(cells))) if cells else None


def _why_not(d: Path, run: RunDocument, contract: Contract, ref_digest: str,
             cells: Sequence[str] | None, *, sealed: bool = False) -> str | None:
    """Why run ``d`` cannot be resumed by this invocation (``None``: it can)."""
    was = " ".join(run.selection) if run.selection else "every cell"
    now = " ".join(cells) if cells else "every cell"
    record = [
        (run.contract_digest != contract.digest,
         f"made for contract digest {run.contract_digest[:12]}, this contract is "
         f"{contract.digest12}"),
        (run.reference.manifest_digest != ref_digest, "made against another sealed reference"),
        (not run.selection_recorded, "its --cells selection was not recorded"),
        (_selection(run.selection) != _selection(cells),
         f"another --cells selection ({was}; now {now})"),
        (bool(run.faults), "made with test faults"),
    ]
    for failed, why in record:
        if failed:
            return why
    try:
        if sealed:
            if not (d / SOURCES_FILE).is_file() or stale_cells(d):
                return "its cells are stale against the code now"
        else:
            check_resume_sources(d)
    except (OSError, UsageError, EvidenceIntegrityError) as exc:
        return f"sources changed ({str(exc).split(': ', 1)[-1]})"
    return None


def plan(contract: Contract, *, reference: Path, evidence: Path,
         cells: Sequence[str] | None, run_id: str | None, new_id: str) -> Plan:
    """Decide how this invocation treats the contract's interrupted runs (reads only).

    Args:
        contract: the contract.
        reference: the sealed reference this invocation uses.
        evidence: the evidence root (runs are ``evidence/<contract>/<run-id>``).
        cells: the ``--cells`` globs (``None``: every cell).
        run_id: ``--run-id`` (``None``: resume or start, as the module docstring says).
        new_id: the id of a new run, when one is started.

    Returns:
        The :class:`Plan`.
    """
    parent = evidence / contract.name
    ref_digest = store.manifest_digest(reference)
    notes: list[str] = []
    unsigned: list[Path] = []
    interrupted: list[tuple[Path, RunDocument | None, str | None]] = []
    for d in _run_dirs(parent):
        if store.is_sealed(d):
            if _needs_signature(d):
                unsigned.append(d)
            continue
        if os.path.lexists(d / MANIFEST_FILE):
            notes.append(f"{d}: left as it is (a MANIFEST.json that does not seal it)")
            continue
        if not (os.path.lexists(d / INCOMPLETE_FILE) or os.path.lexists(d / RUN_FILE)):
            continue  # not a run qualify wrote
        marker, problem = supersede.check(d, listing=False)
        if marker is not None and problem is None:
            continue  # superseded already, and confirmed
        try:
            store.refuse_if_locked(d)
        except WriterBusyError as exc:
            notes.append(f"left alone: {exc}")
            continue
        run, unreadable = _read_run(d)
        why = unreadable
        if marker is not None:
            why = f"its supersession by {marker.superseded_by} was never confirmed"
        elif run is not None:
            why = _why_not(d, run, contract, ref_digest, cells)
        interrupted.append((d, run, why))

    def started(item: tuple[Path, RunDocument | None, str | None]) -> tuple[str, str]:
        return (item[1].started if item[1] else "", item[0].name)

    if run_id is not None:
        target, resume = run_id, (parent / run_id).is_dir()
        sealed = resume and (parent / run_id) in unsigned
    else:
        resumable = [i for i in interrupted if i[2] is None]
        target, resume, sealed = new_id, False, False
        if resumable:
            chosen = max(resumable, key=started)
            target, resume = chosen[0].name, True
            assert chosen[1] is not None
            notes.append(f"resuming interrupted run {target} (started {chosen[1].started})")
        elif not interrupted and unsigned:
            target, started_at = _sealed_to_finish(parent, unsigned, contract, ref_digest,
                                                   cells, default=new_id)
            resume = sealed = started_at is not None
            if sealed:
                notes.append(f"resuming interrupted run {target} (started {started_at}): "
                             "sealed before the interruption; signing it and deciding on it")
    out = []
    for d, _, why in interrupted:
        if d.name == target:
            continue
        reason = why or f"an earlier interrupted run; run {target} is written instead"
        out.append((d, reason))
        notes.append(f"superseding interrupted run {d.name}: {reason} (kept as it is)")
    return Plan(run_id=target, resume=resume, sealed=sealed, supersede=tuple(out),
                sign=tuple(unsigned), notes=tuple(notes))


def _needs_signature(d: Path) -> bool:
    from qualify.evidence.sign import needs_signature

    return needs_signature(d)


def _sealed_to_finish(parent: Path, unsigned: Sequence[Path], contract: Contract,
                      ref_digest: str, cells: Sequence[str] | None, *,
                      default: str) -> tuple[str, str | None]:
    """The sealed unsigned run to finish instead of starting a new one.

    Returns:
        ``(its id, its start time)`` when it is the contract's newest run and would be
        resumed, else ``(default, None)``.
    """
    newest: tuple[str, str] | None = None
    docs: dict[str, RunDocument] = {}
    for d in _run_dirs(parent):
        run, _ = _read_run(d)
        if run is not None:
            docs[d.name] = run
            key = (run.started, d.name)
            newest = key if newest is None or key > newest else newest
    if newest is None:
        return default, None
    name = newest[1]
    if parent / name not in unsigned:
        return default, None
    if _why_not(parent / name, docs[name], contract, ref_digest, cells, sealed=True):
        return default, None
    return name, newest[0]


def apply(p: Plan, parent: Path) -> list[supersede.Pending]:
    """Carry out the plan: sign the unsigned runs, prepare the supersessions.

    Prints the plan's notes (stderr). The markers are written by the candidate stage once
    the written run's ``run.json`` records them (:func:`qualify.evidence.supersede.prepare`).

    Returns:
        The prepared supersessions, for
        :func:`qualify.candidate.stage.run_candidate_stage`.

    Raises:
        QualifyError: signing failed (no key, ...).
        WriterBusyError: a writer of a run to supersede came back since :func:`plan`.
    """
    from qualify.evidence.sign import ensure_signed

    for d in p.sign:
        ensure_signed(d)
        print(f"signed sealed run {d.name} (its signing was interrupted)", file=sys.stderr)
    for line in p.notes:
        print(line, file=sys.stderr)
    return [supersede.prepare(d, by=p.run_id, reason=why) for d, why in p.supersede
            if d != parent / p.run_id]
