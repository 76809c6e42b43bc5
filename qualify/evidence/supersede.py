"""Superseding an interrupted run: kept whole, recorded as replaced, accepted by the gate.

A candidate run interrupted before its seal (``kill -9``, Ctrl-C, SIGTERM, a full disk)
stays unsealed with its ``INCOMPLETE`` marker, which fails ``qualify gate``. When a later
``qualify run`` cannot resume it (another contract digest or reference, changed sources,
another cell selection, an unreadable ``run.json``), that run supersedes it:

1. :func:`prepare` computes ``superseded.json`` (:data:`~qualify.layout.SUPERSEDED_FILE`):
   the superseding run id, the reason, when, and the sha256 of the interrupted run's file
   listing (every file's sha256 and size); a run a live process writes is refused;
2. the superseding run records ``{run_id, reason, marker_sha256}`` in its own ``run.json``
   (:attr:`qualify.layout.RunDocument.supersedes`), which is sealed and signed with it;
3. :func:`write` writes the marker into the interrupted run, atomically and under its
   writer lock; nothing is deleted or moved.

:func:`check` accepts a marker only when it confirms: the directory is unsealed (no
``MANIFEST.json``: a sealed run, passing or failing, is never superseded and a marker in
it is an unlisted file that verification refuses), the superseding run exists beside it
and its ``run.json`` lists this run with the sha256 of these very marker bytes, and the
interrupted run's files are still those the marker listed. So a marker cannot hide a
complete run, cannot point at nothing, and the gate still chooses the newest complete run
(:mod:`qualify.evidence.gate`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any, Final

from qualify.atomic import json_bytes
from qualify.errors import EvidenceIntegrityError, ReferenceDataError, UsageError
from qualify.evidence import store
from qualify.evidence.timestamps import utc_now_iso
from qualify.jsonio import read_bytes, read_json
from qualify.layout import (
    INCOMPLETE_FILE,
    MANIFEST_FILE,
    RUN_FILE,
    SUPERSEDED_FILE,
    RunDocument,
)

__all__ = ["MARKER_SCHEMA_VERSION", "Marker", "Pending", "check", "listing_digest",
           "marker_sha256", "prepare", "read_marker", "refuse", "supersede", "write"]

MARKER_SCHEMA_VERSION: Final = 1
_KEYS: Final = ("superseded_by", "reason", "created", "listing_sha256")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Marker:
    """A run's ``superseded.json``.

    Attributes:
        run_id: the superseded run (its directory name).
        superseded_by: the id of the run that supersedes it (a sibling directory).
        reason: why it could not be resumed (one line).
        created: when it was superseded (ISO-8601 UTC).
        listing_sha256: sha256 (hex) of the run's file listing then (:func:`listing_digest`).
        sha256: sha256 (hex) of the marker file's bytes.
    """

    run_id: str
    superseded_by: str
    reason: str
    created: str
    listing_sha256: str
    sha256: str


def listing_digest(run_dir: str | Path) -> str:
    """sha256 (hex) of the canonical JSON of every file's ``{sha256, size}`` in ``run_dir``.

    The ``INCOMPLETE`` marker (rewritten by each writer), ``superseded.json`` and temporary
    files of dead writers are listed by name only (their content may change or vanish
    when a later write of the same destination cleans them).

    Raises:
        EvidenceIntegrityError: a special file or a symbolic link in the run.
    """
    from qualify import atomic
    from qualify.digests import sha256_file

    d = Path(run_dir)
    files: dict[str, Any] = {}
    for root, dirs, names in os.walk(d, followlinks=False):
        rootp = Path(root)
        for name in sorted([*names, *(x for x in dirs if (rootp / x).is_symlink())]):
            full = rootp / name
            rel = full.relative_to(d).as_posix()
            st = full.lstat()
            if not full.is_file() or full.is_symlink():
                raise EvidenceIntegrityError(f"{full}: not a regular file in run {d}")
            if rel in (INCOMPLETE_FILE, SUPERSEDED_FILE) or atomic.is_temporary(name):
                continue
            files[rel] = {"sha256": sha256_file(full), "size": st.st_size}
    blob = json.dumps(files, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def marker_sha256(run_dir: str | Path) -> str:
    """sha256 (hex) of ``run_dir/superseded.json``'s bytes.

    Raises:
        EvidenceIntegrityError: refused by :mod:`qualify.jsonio` (a link, a special file).
        FileNotFoundError: no marker.
    """
    return hashlib.sha256(read_bytes(Path(run_dir) / SUPERSEDED_FILE)).hexdigest()


def read_marker(run_dir: str | Path) -> Marker | None:
    """The run's ``superseded.json`` (``None`` when absent).

    Raises:
        EvidenceIntegrityError: refused by :mod:`qualify.jsonio`, not JSON, or a field
            missing or not a string (the file and field named).
    """
    d = Path(run_dir)
    path = d / SUPERSEDED_FILE
    if not os.path.lexists(path):
        return None
    doc = read_json(path)
    if not isinstance(doc, dict):
        raise EvidenceIntegrityError(f"{path}: not a JSON object")
    for key in _KEYS:
        if not isinstance(doc.get(key), str):
            raise EvidenceIntegrityError(f"{path}: {key}: expected a string")
    return Marker(run_id=d.name, superseded_by=doc["superseded_by"], reason=doc["reason"],
                  created=doc["created"], listing_sha256=doc["listing_sha256"],
                  sha256=marker_sha256(d))


def refuse(run_dir: str | Path) -> None:
    """Refuse to write (resume, compare, seal) a run that a later run superseded.

    Raises:
        UsageError: ``run_dir`` holds ``superseded.json`` (one line naming the superseding
            run and the reason), or a marker that cannot be read.
    """
    d = Path(run_dir)
    try:
        marker = read_marker(d)
    except EvidenceIntegrityError as exc:
        raise UsageError(f"{d / SUPERSEDED_FILE}: a superseded run is never written again "
                         f"({exc})") from None
    if marker is not None:
        raise UsageError(f"{d}: superseded by run {marker.superseded_by} ({marker.reason}); "
                         "it is kept as it is: start a new --run-id")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Pending:
    """A marker computed and not yet written (:func:`prepare`, then :func:`write`).

    Attributes:
        run_dir: the run to supersede.
        data: the exact bytes of its ``superseded.json``.
        listing_sha256: the run's file listing when prepared.
        entry: ``{run_id, reason, marker_sha256}`` for the superseding run's ``run.json``.
    """

    run_dir: Path
    data: bytes
    listing_sha256: str
    entry: dict[str, str]


def prepare(run_dir: str | Path, *, by: str, reason: str) -> Pending:
    """Compute the marker by which run ``by`` (a sibling directory) supersedes ``run_dir``.

    Nothing is written: the superseding run records :attr:`Pending.entry` in its
    ``run.json`` first, then :func:`write` writes the marker; an interruption between the
    two leaves ``run_dir`` as it was (unsuperseded, to be resumed or superseded later).

    Args:
        run_dir: an unsealed candidate run.
        by: the superseding run's id.
        reason: why ``run_dir`` is not resumed (one line).

    Raises:
        EvidenceIntegrityError: ``run_dir`` is sealed (a sealed run is never superseded),
            holds a special file, or is ``by`` itself.
        WriterBusyError: a live process writes ``run_dir``.
    """
    d = Path(run_dir)
    if os.path.lexists(d / MANIFEST_FILE) or store.is_sealed(d):
        raise EvidenceIntegrityError(f"{d}: sealed; only an unsealed (interrupted) run can be "
                                     "superseded")
    if d.name == by:
        raise EvidenceIntegrityError(f"{d}: a run cannot supersede itself")
    store.refuse_if_locked(d)
    line = " ".join(reason.split())
    listing = listing_digest(d)
    doc = {"schema_version": MARKER_SCHEMA_VERSION, "kind": "superseded-run",
           "run_id": d.name, "superseded_by": by, "reason": line,
           "created": utc_now_iso(), "listing_sha256": listing,
           "writer": {"pid": os.getpid(), "host": socket.gethostname()}}
    data = json_bytes(doc)
    return Pending(run_dir=d, data=data, listing_sha256=listing,
                   entry={"run_id": d.name, "reason": line,
                          "marker_sha256": hashlib.sha256(data).hexdigest()})


def write(pending: Pending) -> bool:
    """Write a prepared marker atomically, under the run's writer lock.

    An earlier marker (one no run confirmed) is replaced. Nothing is written when the run
    changed since :func:`prepare` (a writer came back: it is not superseded).

    Returns:
        Whether the marker was written.

    Raises:
        WriterBusyError: a live process writes the run.
        OSError: the marker cannot be written (a full disk, a read-only directory).
    """
    d = pending.run_dir
    with store.sealing_lock(d):
        if os.path.lexists(d / MANIFEST_FILE) or listing_digest(d) != pending.listing_sha256:
            return False
        store.atomic_write_bytes(d / SUPERSEDED_FILE, pending.data)
    return True


def supersede(run_dir: str | Path, *, by: str, reason: str) -> dict[str, str]:
    """:func:`prepare` and :func:`write` at once (the entry is for ``by``'s ``run.json``).

    Raises:
        EvidenceIntegrityError: see :func:`prepare`; or the run changed meanwhile.
        WriterBusyError: a live process writes ``run_dir``.
        OSError: the marker cannot be written.
    """
    pending = prepare(run_dir, by=by, reason=reason)
    if not write(pending):
        raise EvidenceIntegrityError(f"{run_dir}: changed while superseding it")
    return pending.entry


def _unconfirmed(d: Path, marker: Marker) -> str | None:
    """Why the run ``marker`` names does not confirm it (``None``: it does)."""
    path = d / SUPERSEDED_FILE
    by = d.parent / marker.superseded_by
    if os.path.lexists(d / MANIFEST_FILE):
        return f"{path}: in a sealed run (a sealed run is never superseded)"
    if marker.superseded_by in ("", ".", "..") or "/" in marker.superseded_by \
            or not by.is_dir() or by.is_symlink():
        return f"{path}: superseded_by {marker.superseded_by!r}: no such run beside it"
    try:
        run = RunDocument.from_dict(read_json(by / RUN_FILE), where=str(by / RUN_FILE))
    except (OSError, EvidenceIntegrityError, ReferenceDataError) as exc:
        return f"superseding run {marker.superseded_by} unreadable: {exc}"
    if not any(s["run_id"] == d.name and s["marker_sha256"] == marker.sha256
               for s in run.supersedes):
        return (f"{path}: run {marker.superseded_by} does not record superseding {d.name} "
                f"with this marker (sha256 {marker.sha256[:12]})")
    return None


def check(run_dir: str | Path, *, listing: bool = True) -> tuple[Marker | None, str | None]:
    """Whether ``run_dir``'s supersession is confirmed.

    Args:
        run_dir: a candidate run directory.
        listing: also recompute the run's file listing (the audit does; the gate, which
            never judges a superseded run's files, need not).

    Returns:
        ``(marker, problem)``: ``(None, None)`` without a marker; ``problem`` is ``None``
        when the marker is confirmed, else one line saying why not.
    """
    d = Path(run_dir)
    try:
        marker = read_marker(d)
    except EvidenceIntegrityError as exc:
        return None, f"superseded marker refused: {exc}"
    if marker is None:
        return None, None
    problem = _unconfirmed(d, marker)
    if problem is None and listing:
        try:
            if listing_digest(d) != marker.listing_sha256:
                problem = f"{d}: files changed since it was superseded by {marker.superseded_by}"
        except (OSError, EvidenceIntegrityError) as exc:
            problem = f"superseded run unreadable: {exc}"
    return marker, problem
