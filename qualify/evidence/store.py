"""Append-only evidence directories: the public face of :mod:`qualify.evidence`'s storage.

Every file qualify writes goes through this module (docs/concepts.md):

- **Atomic writes** (:func:`atomic_write_bytes`, :func:`atomic_write_text`,
  :func:`atomic_write_json`): :mod:`qualify.atomic`'s one atomic write (temp file, fsync,
  rename, fsync of the directory) under the sealed-directory guard of
  :mod:`qualify.evidence.sealed`.
- **Incomplete marker.** A directory being written carries ``INCOMPLETE`` (JSON: pid,
  host, start time, kind), created first by :func:`claim_dir` / :func:`new_attempt`
  (:mod:`qualify.evidence.attempts`) and removed by :func:`seal` right before the manifest
  is written. An interrupted run therefore never looks sealed.
- **Manifest, written last.** ``MANIFEST.json`` (schema ``manifest.schema.json``) lists
  the sha256 and size of every regular file under the directory except itself and the
  DSSE attestations (``*.dsse.json``, added after sealing by the signing step).
- **Seal.** :func:`seal` writes the manifest and makes every file ``0o444`` and every
  directory ``0o555``. A sealed directory is never written again: every writer refuses a
  path under a sealed directory with :class:`~qualify.errors.EvidenceIntegrityError`
  (checked explicitly, so the refusal holds for root too). Only attestations are added,
  through :func:`add_attestation`, which never overwrites one.
- **Attempts** (:mod:`qualify.evidence.attempts`) and **tensors**
  (:mod:`qualify.evidence.tensors`) live in their own modules; their names are
  re-exported here for the stages that call ``store.new_attempt``, ``store.save_tensors``.

The product never unseals; :func:`make_writable` exists only for tests' temp-dir cleanup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, Final, Literal

from qualify import atomic
from qualify.atomic import json_bytes, write_bytes
from qualify.digests import sha256_bytes, sha256_file
from qualify.display import printable
from qualify.errors import EvidenceIntegrityError, QualifyError
from qualify.evidence.attempts import (
    attempt_number,
    attempts,
    claim_dir,
    hold_writer_lock,
    latest_complete_attempt,
    new_attempt,
    next_free_dir,
    refuse_if_locked,
    sealing_lock,
)
from qualify.evidence.sealed import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    is_incomplete,
    is_sealed,
    not_sealed_reason,
    refuse_if_sealed,
    sealed_ancestor,
)
from qualify.evidence.tensors import (
    load_tensors,
    load_tensors_torch,
    read_tensor_metadata,
    save_tensors,
)
from qualify.evidence.timestamps import utc_now, utc_now_iso
from qualify.jsonio import read_json
from qualify.layout import ATTESTATION_SUFFIX, INCOMPLETE_FILE, MANIFEST_FILE
from qualify.schema import validate

__all__ = [
    "ATTESTATION_SUFFIX",
    "INCOMPLETE_FILE",
    "MANIFEST_FILE",
    "MANIFEST_SCHEMA_VERSION",
    "Problem",
    "ProblemKind",
    "add_attestation",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "attempt_number",
    "attempts",
    "build_manifest",
    "check_sealed",
    "claim_dir",
    "hold_writer_lock",
    "is_incomplete",
    "is_partial_attestation",
    "is_sealed",
    "latest_complete_attempt",
    "load_tensors",
    "load_tensors_torch",
    "make_writable",
    "manifest_digest",
    "new_attempt",
    "next_free_dir",
    "not_sealed_reason",
    "read_manifest",
    "read_tensor_metadata",
    "refuse_if_locked",
    "save_tensors",
    "seal",
    "sealed_ancestor",
    "sealing_lock",
    "sha256_bytes",
    "sha256_file",
    "utc_now",
    "utc_now_iso",
    "validate_json",
    "verify_manifest",
]

_log = logging.getLogger(__name__)

MANIFEST_SCHEMA_VERSION: Final = 1
_FILE_MODE: Final = 0o444
_DIR_MODE: Final = 0o555

ProblemKind = Literal["missing", "modified", "extra", "size", "no-manifest", "bad-manifest"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """One discrepancy between a directory and its manifest.

    Attributes:
        kind: ``missing`` (listed, not on disk), ``modified`` (sha256 differs or not a
            regular file), ``extra`` (on disk, not listed), ``size`` (size differs),
            ``no-manifest`` (no ``MANIFEST.json`` or no directory), ``bad-manifest``
            (not JSON or fails ``manifest.schema.json``).
        path: the file concerned, relative POSIX path (``MANIFEST.json`` or ``.`` for
            directory-level problems).
        detail: one line for a human.
    """

    kind: ProblemKind
    path: str
    detail: str

    def __str__(self) -> str:
        return f"{self.path}: {self.kind}: {self.detail}"


def validate_json(obj: Any, schema: str, *, what: str = "document") -> None:
    """Validate ``obj`` against ``contracts/schema/<schema>.schema.json``.

    A thin call of :func:`qualify.schema.validate` (kept for the stages that call
    ``store.validate_json``).

    Args:
        obj: the JSON-compatible value.
        schema: schema stem, e.g. ``manifest``.
        what: name of the document for the message (a path, usually).

    Raises:
        QualifyError: the value violates the schema (the message names the field);
            qualify produced an invalid document, which is a bug.
    """
    validate(obj, schema, what=what)


# --------------------------------------------------------------------------- manifest


def _walk_entries(directory: Path) -> Iterator[tuple[str, Path]]:
    """Yield ``(relative POSIX path, path)`` of every non-directory entry, sorted."""
    entries: list[tuple[str, Path]] = []
    for root, dirs, files in os.walk(directory, followlinks=False):
        rootp = Path(root)
        # os.walk lists symlinks to directories in ``dirs``; they are entries, not subtrees.
        names = list(files) + [d for d in dirs if (rootp / d).is_symlink()]
        for name in names:
            full = rootp / name
            entries.append((PurePosixPath(*full.relative_to(directory).parts).as_posix(), full))
    yield from sorted(entries)


def _excluded(rel: str) -> bool:
    return rel == MANIFEST_FILE or rel.rsplit("/", 1)[-1].endswith(ATTESTATION_SUFFIX)


def build_manifest(directory: str | Path, *, kind: str) -> dict[str, Any]:
    """Compute the manifest document of ``directory`` (does not write it).

    Args:
        directory: the directory.
        kind: what it holds (``reference``, ``candidate-run``, ``attempt``, ...).

    Returns:
        ``{"schema_version": 1, "kind", "created", "files": {relpath: {"sha256", "size"}}}``.

    Raises:
        EvidenceIntegrityError: a non-regular file (symlink, fifo...) or a leftover
            temporary file from an interrupted write is present.
    """
    d = Path(directory)
    files: dict[str, dict[str, Any]] = {}
    for rel, full in _walk_entries(d):
        if _excluded(rel) or rel == INCOMPLETE_FILE:
            continue
        st = full.lstat()
        if not stat.S_ISREG(st.st_mode):
            raise EvidenceIntegrityError(f"{full}: not a regular file; cannot seal {d}")
        if atomic.is_temporary(full.name):
            writer = atomic.temp_writer(full.name)
            who = ("a writer that cannot be told (another host or no pid in its name); "
                   "remove it once no process writes it" if writer is None
                   or atomic.writer_alive(full) is None
                   else f"process {writer.pid} on {writer.host}, still running")
            raise EvidenceIntegrityError(
                f"{full}: leftover temporary file of an interrupted write by {who}; "
                f"cannot seal {d}"
            )
        files[rel] = {"sha256": sha256_file(full), "size": st.st_size}
    return {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "kind": kind,
        "created": utc_now_iso(),
        "files": files,
    }


def seal(directory: str | Path, *, kind: str) -> str:
    """Seal ``directory``: write ``MANIFEST.json`` last and make everything read-only.

    Order: remove the temporary files of dead writers
    (:func:`qualify.atomic.remove_stale_temporaries`: a ``kill -9`` during an atomic write
    leaves one), hash every file, make files ``0o444``, remove ``INCOMPLETE`` (unless a
    live process holds its lock: :func:`qualify.evidence.attempts.hold_writer_lock`), write the
    manifest atomically (validated against ``manifest.schema.json``), then make the
    manifest ``0o444`` and every directory ``0o555`` (bottom-up). A crash at any point
    leaves a directory that :func:`is_sealed` reports as not sealed, or a complete seal.

    Args:
        directory: the directory to seal.
        kind: what it holds (``reference``, ``candidate-run``, ``attempt``, ...).

    Returns:
        The manifest digest (hex sha256 of the ``MANIFEST.json`` bytes).

    Raises:
        EvidenceIntegrityError: ``directory`` is missing, already sealed, lies under a
            sealed directory, or holds a non-regular file or a temporary file of a live
            (or unknown) writer.
        WriterBusyError: a live process still writes ``directory`` (it holds the lock of
            its ``INCOMPLETE`` marker; the message names its pid and host).
        QualifyError: ``kind`` is not a valid kind (lowercase id).
        OSError: a stale temporary file could not be removed.
    """
    d = Path(directory)
    if not d.is_dir():
        raise EvidenceIntegrityError(f"{d}: cannot seal, not a directory")
    if is_sealed(d):
        raise EvidenceIntegrityError(f"{d}: already sealed")
    refuse_if_sealed(d / MANIFEST_FILE)
    if os.path.lexists(d / MANIFEST_FILE):
        # An invalid leftover manifest (interrupted or hand-made): replaced below.
        _log.warning("%s: replacing an invalid %s while sealing", printable(d),
                     MANIFEST_FILE)
    with sealing_lock(d):
        atomic.remove_stale_temporaries(d, recursive=True)
        manifest = build_manifest(d, kind=kind)
        validate_json(manifest, "manifest", what=str(d / MANIFEST_FILE))
        for rel in manifest["files"]:
            os.chmod(d / rel, _FILE_MODE)
        with contextlib.suppress(FileNotFoundError):
            (d / INCOMPLETE_FILE).unlink()
        data = json_bytes(manifest)
        write_bytes(d / MANIFEST_FILE, data)
        os.chmod(d / MANIFEST_FILE, _FILE_MODE)
        for root, dirs, _files in os.walk(d, topdown=False, followlinks=False):
            for name in dirs:
                sub = Path(root) / name
                if not sub.is_symlink():
                    os.chmod(sub, _DIR_MODE)
        os.chmod(d, _DIR_MODE)
    return sha256_bytes(data)


def manifest_digest(directory: str | Path) -> str:
    """Hex sha256 of the ``MANIFEST.json`` bytes of ``directory``.

    Raises:
        EvidenceIntegrityError: there is no manifest.
    """
    path = Path(directory) / MANIFEST_FILE
    try:
        return sha256_file(path)
    except FileNotFoundError:
        raise EvidenceIntegrityError(f"{path}: missing; the directory is not sealed") from None


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """Read and validate ``MANIFEST.json`` of ``directory``.

    Read through :func:`qualify.jsonio.read_json`: bounded, never following a link,
    duplicate keys refused.

    Raises:
        EvidenceIntegrityError: the manifest is missing, a symbolic link or special file,
            over its size limit, not JSON, has a duplicate key or fails its schema.
    """
    path = Path(directory) / MANIFEST_FILE
    if not os.path.lexists(path):
        raise EvidenceIntegrityError(f"{path}: missing; the directory is not sealed")
    doc = read_json(path)
    if not isinstance(doc, dict):
        raise EvidenceIntegrityError(f"{path}: not a JSON object")
    try:
        validate_json(doc, "manifest", what=str(path))
    except QualifyError as exc:
        raise EvidenceIntegrityError(str(exc)) from None
    return doc


def verify_manifest(directory: str | Path) -> list[Problem]:
    """Compare ``directory`` with its manifest; an empty list means it is intact.

    Every listed file must exist as a regular file with the listed size and sha256;
    every file on disk must be listed, except ``MANIFEST.json`` and ``*.dsse.json``
    attestations. An ``INCOMPLETE`` marker next to a manifest is reported as extra.
    A renamed file shows as one ``missing`` and one ``extra``.

    Args:
        directory: the directory to check.

    Returns:
        Problems sorted by path then kind. A missing or invalid manifest gives a
        single ``no-manifest`` / ``bad-manifest`` problem (nothing else is checked).
    """
    d = Path(directory)
    if not d.is_dir():
        return [Problem(kind="no-manifest", path=".", detail=f"{d} is not a directory")]
    mpath = d / MANIFEST_FILE
    if not os.path.lexists(mpath):
        return [Problem(kind="no-manifest", path=MANIFEST_FILE,
                        detail="no manifest; the directory was never sealed or is incomplete")]
    try:
        doc = read_manifest(d)
    except EvidenceIntegrityError as exc:
        return [Problem(kind="bad-manifest", path=MANIFEST_FILE, detail=str(exc))]
    listed: dict[str, dict[str, Any]] = doc["files"]
    problems: list[Problem] = []
    for rel, entry in listed.items():
        full = d / rel
        try:
            st = full.lstat()
        except FileNotFoundError:
            problems.append(Problem(kind="missing", path=rel, detail="listed in the manifest, "
                                    "not on disk"))
            continue
        except OSError as exc:
            problems.append(Problem(kind="missing", path=rel, detail=f"cannot stat: {exc}"))
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(Problem(kind="modified", path=rel, detail="not a regular file"))
        elif st.st_size != entry["size"]:
            problems.append(Problem(kind="size", path=rel,
                                    detail=f"size {st.st_size}, manifest says {entry['size']}"))
        else:
            try:
                digest = sha256_file(full)
            except OSError as exc:
                problems.append(Problem(kind="modified", path=rel, detail=f"unreadable: {exc}"))
                continue
            if digest != entry["sha256"]:
                problems.append(Problem(kind="modified", path=rel,
                                        detail=f"sha256 {digest}, manifest says "
                                        f"{entry['sha256']}"))
    for rel, full in _walk_entries(d):
        if rel in listed or _excluded(rel):
            continue
        what = "regular file" if stat.S_ISREG(full.lstat().st_mode) else "non-regular entry"
        problems.append(Problem(kind="extra", path=rel, detail=f"{what} not in the manifest"))
    return sorted(problems, key=lambda p: (p.path, p.kind))


def check_sealed(directory: str | Path) -> str:
    """Require ``directory`` to be sealed and intact.

    Args:
        directory: the directory to check.

    Returns:
        The manifest digest.

    Raises:
        EvidenceIntegrityError: :func:`verify_manifest` found a problem (one line naming
            the directory, the first file and the count of further problems), or the
            ``INCOMPLETE`` marker is present.
    """
    d = Path(directory)
    problems = verify_manifest(d)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise EvidenceIntegrityError(f"{d}: {problems[0]}{more}")
    return manifest_digest(d)


def is_partial_attestation(path: str | Path) -> bool:
    """True if ``path`` is the leftover of an interrupted attestation write: a 0-byte file.

    Only an older signer left that (it reserved the name with an empty file before writing;
    the current one renames a whole envelope into place, never overwriting). Anything with
    content, valid or not, is kept: a truncated or edited attestation is evidence, shown by
    ``verify``, never replaced. A missing file, a link or a special file is not partial.
    """
    p = Path(path)
    try:
        st = os.lstat(p)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == 0


def add_attestation(directory: str | Path, name: str, data: bytes) -> Path:
    """Add a DSSE attestation file to a sealed directory (the signing step's only write).

    The directory's write bit is lifted for the time of the write, then every write bit
    is cleared (a signer killed meanwhile left it writable). The
    envelope is written to a temporary file (fsync-ed) and renamed to ``name`` without
    replacing (:func:`qualify.atomic.rename_noreplace`), which fails if ``name`` exists:
    the attestation appears whole or not at all, and an existing one is never
    overwritten (use a different name, e.g. one per key). The one exception is a *partial*
    attestation (:func:`is_partial_attestation`: the empty file an interrupted older
    signer left), which is replaced. Temporary files of dead signers are removed.

    Args:
        directory: a sealed directory.
        name: file name ending in ``.dsse.json`` (no path separator).
        data: the envelope bytes.

    Returns:
        The path of the attestation.

    Raises:
        EvidenceIntegrityError: ``directory`` is not sealed, or ``name`` exists already
            (and is not partial).
        ValueError: ``name`` is not a bare ``*.dsse.json`` file name.
        OSError: the write failed (nothing is left behind).
    """
    d = Path(directory)
    if "/" in name or os.sep in name or not name.endswith(ATTESTATION_SUFFIX) \
            or name == ATTESTATION_SUFFIX:
        raise ValueError(f"attestation name must be a bare '*{ATTESTATION_SUFFIX}' name: "
                         f"{name!r}")
    if not is_sealed(d):
        raise EvidenceIntegrityError(f"{d}: not sealed; attestations are added after sealing")
    target = d / name
    partial = is_partial_attestation(target)
    if os.path.lexists(target) and not partial:
        raise EvidenceIntegrityError(f"{target}: exists; an attestation is never overwritten")
    mode = stat.S_IMODE(d.stat().st_mode)
    os.chmod(d, mode | stat.S_IWUSR)
    try:
        atomic.remove_stale_temporaries(d, name=name)
        if partial:
            _log.warning("%s: replacing a partial attestation (interrupted signing)",
                         printable(target))
            write_bytes(target, data)  # atomic replace of the partial file
        else:
            _link_new(target, data)
        os.chmod(target, _FILE_MODE)
    finally:  # read-only again (also after a signer killed while it was writable)
        os.chmod(d, mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    return target


def _link_new(target: Path, data: bytes) -> None:
    """Create ``target`` holding ``data``, whole, failing if it exists.

    Raises:
        EvidenceIntegrityError: ``target`` exists (another signer took the name).
        OSError: the write failed.
    """
    tmp = target.with_name(f"{atomic.TMP_PREFIX}{target.name}.{atomic.host_tag()}."
                           f"{os.getpid()}.{os.urandom(4).hex()}{atomic.TMP_SUFFIX}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            atomic.rename_noreplace(tmp, target)
        except FileExistsError:
            raise EvidenceIntegrityError(f"{target}: exists; an attestation is never "
                                         "overwritten") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    atomic.fsync_dir(target.parent)


def make_writable(directory: str | Path) -> None:
    """Restore owner write bits under ``directory`` (files ``0o644``, dirs ``0o755``).

    For tests' temporary-directory cleanup only: the product never unseals a directory.
    Symlinks are not followed. A missing directory is ignored.
    """
    d = Path(directory)
    if not d.is_dir() or d.is_symlink():
        return
    os.chmod(d, 0o755)
    for root, dirs, files in os.walk(d, followlinks=False):
        for name in dirs:
            sub = Path(root) / name
            if not sub.is_symlink():
                os.chmod(sub, 0o755)
        for name in files:
            f = Path(root) / name
            if not f.is_symlink():
                os.chmod(f, 0o644)
