"""Finding evidence: every reference and candidate-run directory below a root, classified.

:func:`find_evidence` walks a tree (``evidence/``, ``references/``, a checkout) and labels
each directory that is evidence (:class:`EvidenceDir`): its kind, whether it is sealed (to
be verified) or incomplete (and why), and the contract, run id and date its own records
name. Nothing here verifies anything: ``verify``, ``gate`` and ``audit`` do, on what this
finds. Every record is read through :mod:`qualify.jsonio` (bounded, no link followed); a
refused or broken document gives a label of ``None`` and a line in
:attr:`EvidenceDir.problems`, never an exception.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

from qualify.errors import EvidenceIntegrityError, QualifyError
from qualify.evidence.dsse import read_envelope
from qualify.evidence.statement import REFERENCE_KIND, RUN_KIND
from qualify.jsonio import loads_strict, read_bytes
from qualify.layout import (
    ATTESTATION_FILE,
    INCOMPLETE_FILE,
    INCOMPLETE_INFIX,
    MANIFEST_FILE,
    REFERENCE_FILE,
    RUN_FILE,
    SUPERSEDED_FILE,
)

__all__ = ["EvidenceDir", "find_evidence"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EvidenceDir:
    """A reference or candidate-run directory found under a root.

    Attributes:
        path: the directory.
        kind: ``reference``, ``candidate-run`` or ``unknown``.
        state: ``sealed`` (a manifest or an attestation is present: verify it),
            ``incomplete`` (``INCOMPLETE`` marker, moved aside as ``*.incomplete-*``, or
            never sealed).
        reason: why it is ``incomplete``.
        contract: contract name (``run.json`` / ``reference.json`` / statement / parent).
        contract_digest: the digest its own records name (``None`` if unknown).
        run_id: a run's id.
        date: run start or reference creation time (ISO-8601) if known.
        marker: the directory carries the ``INCOMPLETE`` marker.
        superseded_by: an unsealed run's ``superseded.json`` names this superseding run
            (:mod:`qualify.evidence.supersede`; whether that run confirms it is
            :func:`qualify.evidence.supersede.check`'s question); ``None`` otherwise.
        problems: records that were refused while labelling it (a symbolic link, a
            special file, an oversized or unparsable ``run.json`` / ``MANIFEST.json`` /
            attestation, ...): a hostile or broken directory, reported, never read further.
    """

    path: Path
    kind: str
    state: Literal["sealed", "incomplete"]
    reason: str = ""
    contract: str | None = None
    contract_digest: str | None = None
    run_id: str | None = None
    date: str | None = None
    marker: bool = False
    problems: tuple[str, ...] = ()
    superseded_by: str | None = None


def _read(path: Path, problems: list[str], *, lenient: bool = False) -> dict[str, Any]:
    """A JSON object of ``d`` for labels, through :mod:`qualify.jsonio` (``{}`` if absent).

    A refused file (symbolic link, special file, over its size limit) is recorded in
    ``problems``; so is one that is not a JSON object, unless ``lenient`` (an
    ``INCOMPLETE`` marker's content is advisory).
    """
    try:
        data = read_bytes(path)
    except FileNotFoundError:
        return {}
    except EvidenceIntegrityError as exc:
        problems.append(str(exc))
        return {}
    try:
        doc = loads_strict(data, what=str(path))
    except EvidenceIntegrityError as exc:
        if not lenient:
            problems.append(str(exc))
        return {}
    if not isinstance(doc, dict):
        if not lenient:
            problems.append(f"{path}: not a JSON object")
        return {}
    return doc


def _statement_unverified(d: Path, problems: list[str]) -> dict[str, Any]:
    """The statement of an attestation, unverified (for labels only)."""
    try:
        stmt = loads_strict(read_envelope(d).payload, what=f"{d / ATTESTATION_FILE}: payload")
    except QualifyError as exc:
        problems.append(str(exc))
        return {}
    return stmt if isinstance(stmt, dict) else {}


def _classify(d: Path) -> EvidenceDir | None:
    names = set(os.listdir(d))
    problems: list[str] = []
    marker = _read(d / INCOMPLETE_FILE, problems, lenient=True) \
        if INCOMPLETE_FILE in names else {}
    manifest = _read(d / MANIFEST_FILE, problems) if MANIFEST_FILE in names else {}
    moved = INCOMPLETE_INFIX in d.name
    kind = None
    if RUN_FILE in names:
        kind = RUN_KIND
    elif REFERENCE_FILE in names:
        kind = REFERENCE_KIND
    elif manifest.get("kind") in (RUN_KIND, REFERENCE_KIND):
        kind = str(manifest["kind"])
    elif marker.get("kind") in (RUN_KIND, REFERENCE_KIND):
        kind = str(marker["kind"])
    elif ATTESTATION_FILE in names or INCOMPLETE_FILE in names or \
            (moved and (marker or manifest)):
        kind = "unknown"
    elif problems:
        kind = "unknown"  # a refused manifest: hostile or broken, reported
    if kind is None:
        return None
    stmt = _statement_unverified(d, problems) if ATTESTATION_FILE in names else {}
    raw_pred = stmt.get("predicate")
    pred: dict[str, Any] = raw_pred if isinstance(raw_pred, dict) else {}
    if kind == "unknown" and pred.get("kind") in (RUN_KIND, REFERENCE_KIND):
        kind = str(pred["kind"])
    raw_contract = pred.get("contract")
    pcontract: dict[str, Any] = raw_contract if isinstance(raw_contract, dict) else {}
    contract = pcontract.get("name")
    digest = pcontract.get("digest")
    run_id = date = None
    if kind == RUN_KIND:
        doc = _read(d / RUN_FILE, problems)
        contract = doc.get("contract", contract) or d.parent.name
        digest = doc.get("contract_digest", digest)
        run_id = str(doc.get("run_id", d.name))
        date = doc.get("started") or manifest.get("created")
    elif kind == REFERENCE_KIND:
        doc = _read(d / REFERENCE_FILE, problems)
        contract = doc.get("contract", contract)
        digest = doc.get("contract_digest", digest)
        date = doc.get("created") or manifest.get("created")
    reason = ""
    superseded_by = None
    if kind == RUN_KIND and SUPERSEDED_FILE in names and MANIFEST_FILE not in names:
        sup = _read(d / SUPERSEDED_FILE, problems)
        by, why = sup.get("superseded_by"), sup.get("reason")
        if isinstance(by, str) and isinstance(why, str):
            superseded_by = by
            reason = f"superseded by run {by}: {why}"
        elif sup:
            problems.append(f"{d / SUPERSEDED_FILE}: superseded_by, reason: expected strings")
    if superseded_by is not None:
        pass  # the reason says so; gate and audit check the marker (supersede.check)
    elif moved:
        reason = "moved aside as an interrupted directory (*.incomplete-*)"
    elif INCOMPLETE_FILE in names and MANIFEST_FILE not in names:
        reason = "INCOMPLETE marker: interrupted or still being written"
    elif MANIFEST_FILE not in names and ATTESTATION_FILE not in names:
        reason = "no manifest: never sealed (not finished or not compared)"
    return EvidenceDir(path=d, kind=kind, state="incomplete" if reason else "sealed",
                       reason=reason, contract=str(contract) if contract else None,
                       contract_digest=str(digest) if digest else None, run_id=run_id,
                       date=str(date) if date else None, marker=INCOMPLETE_FILE in names,
                       problems=tuple(problems), superseded_by=superseded_by)


def find_evidence(root: str | Path) -> list[EvidenceDir]:
    """Every reference and candidate-run directory at or below ``root``.

    A directory holding ``run.json``, ``reference.json``, a manifest of kind
    ``reference`` / ``candidate-run``, an ``INCOMPLETE`` marker, an attestation, or named
    ``*.incomplete-*`` is evidence; its subdirectories are not searched further. Hidden
    directories and symbolic links are skipped.

    Returns:
        The directories, sorted by path.
    """
    out: list[EvidenceDir] = []
    r = Path(root)
    if not r.is_dir():
        return out
    stack = [r]
    while stack:
        d = stack.pop()
        try:
            found = _classify(d)
        except OSError:
            continue
        if found is not None:
            out.append(found)
            continue
        try:
            subs = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        stack.extend(Path(e.path) for e in reversed(subs)
                     if e.is_dir(follow_symlinks=False) and not e.name.startswith("."))
    return sorted(out, key=lambda e: str(e.path))
