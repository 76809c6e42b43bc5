"""Append-only evidence directories: atomic writes, manifests, sealing, attempts.

Every file qualify writes goes through this module (DESIGN.md section 7):

- **Atomic writes.** A file is written to a temporary file in the same directory,
  flushed, ``fsync``-ed and renamed over its name with :func:`os.replace`, then the
  directory is ``fsync``-ed. A reader sees the old file or the new one, never a part.
  A writer that fails removes its temporary file.
- **Incomplete marker.** A directory being written carries ``INCOMPLETE`` (JSON: pid,
  host, start time, kind), created first by :func:`claim_dir` / :func:`new_attempt`
  and removed by :func:`seal` right before the manifest is written. An interrupted
  run therefore never looks sealed.
- **Manifest, written last.** ``MANIFEST.json`` (schema ``manifest.schema.json``) lists
  the sha256 and size of every regular file under the directory except itself and the
  DSSE attestations (``*.dsse.json``, added after sealing by the signing step).
- **Seal.** :func:`seal` writes the manifest and makes every file ``0o444`` and every
  directory ``0o555``. A sealed directory is never written again: every writer here
  refuses a path under a sealed directory with :class:`~qualify.errors.EvidenceIntegrityError`
  (checked explicitly, so the refusal holds for root too). Only attestations are added,
  through :func:`add_attestation`, which never overwrites one.
- **Attempts.** ``attempt-1``, ``attempt-2``, ... under a cell directory, created with
  :func:`os.mkdir` (atomic), never reused or overwritten; a failed attempt is kept.

The product never unseals; :func:`make_writable` exists only for tests' temp-dir cleanup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import functools
import hashlib
import json
import logging
import os
import re
import socket
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Any, Final, Literal

import jsonschema
import numpy as np
import psutil
import safetensors
import safetensors.numpy

from qualify.errors import EvidenceIntegrityError, QualifyError, ReferenceDataError, UsageError
from qualify.resources import load_schema

if TYPE_CHECKING:
    import torch

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
    "is_incomplete",
    "is_sealed",
    "latest_complete_attempt",
    "load_tensors",
    "load_tensors_torch",
    "make_writable",
    "manifest_digest",
    "new_attempt",
    "next_free_dir",
    "read_manifest",
    "read_tensor_metadata",
    "save_tensors",
    "seal",
    "sealed_ancestor",
    "sha256_bytes",
    "sha256_file",
    "utc_now",
    "utc_now_iso",
    "validate_json",
    "verify_manifest",
]

_log = logging.getLogger(__name__)

MANIFEST_FILE: Final = "MANIFEST.json"
"""Name of the manifest at the top of a sealed directory."""
MANIFEST_SCHEMA_VERSION: Final = 1
INCOMPLETE_FILE: Final = "INCOMPLETE"
"""Marker present while a directory is being written."""
ATTESTATION_SUFFIX: Final = ".dsse.json"
"""DSSE attestation files: excluded from the manifest, added after sealing."""
_TMP_PREFIX: Final = ".tmp-"
_TMP_SUFFIX: Final = ".partial"
_ATTEMPT_RE: Final = re.compile(r"^attempt-([1-9][0-9]*)$")
_FILE_MODE: Final = 0o444
_DIR_MODE: Final = 0o555
_CHUNK: Final = 1 << 20
_MAX_ATTEMPT_RACES: Final = 1000

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


# --------------------------------------------------------------------------- helpers


def utc_now_iso() -> str:
    """Current time as ISO-8601 UTC with microseconds and a ``Z`` suffix."""
    now = _dt.datetime.now(_dt.UTC)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def utc_now() -> str:
    """Alias of :func:`utc_now_iso` (ISO-8601 UTC, ``Z`` suffix)."""
    return utc_now_iso()


def _utc_stamp() -> str:
    """Current UTC time for file names (no colons), e.g. ``20250131T120102Z``."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S.%fZ")


def sha256_bytes(data: bytes) -> str:
    """Return the lowercase hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    """Return the lowercase hex sha256 of a file's bytes, read in 1 MiB chunks.

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@functools.cache
def _validator(schema: str) -> jsonschema.protocols.Validator:
    return jsonschema.Draft202012Validator(load_schema(schema))


def validate_json(obj: Any, schema: str, *, what: str = "document") -> None:
    """Validate ``obj`` against ``contracts/schema/<schema>.schema.json``.

    Args:
        obj: the JSON-compatible value.
        schema: schema stem, e.g. ``manifest``.
        what: name of the document for the message (a path, usually).

    Raises:
        QualifyError: the value violates the schema (the message names the field);
            qualify produced an invalid document, which is a bug.
    """
    err = jsonschema.exceptions.best_match(_validator(schema).iter_errors(obj))
    if err is not None:
        field = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        raise QualifyError(f"{what}: {field}: {err.message} (schema {schema}.schema.json)")


def _fsync_dir(directory: Path) -> None:
    """``fsync`` a directory so a rename in it is durable (best effort off POSIX)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _manifest_valid(directory: Path) -> bool:
    try:
        doc = json.loads((directory / MANIFEST_FILE).read_bytes())
    except (OSError, ValueError):
        return False
    return bool(_validator("manifest").is_valid(doc))


def is_incomplete(directory: str | Path) -> bool:
    """True if ``directory`` carries the ``INCOMPLETE`` marker (being written or interrupted)."""
    return os.path.lexists(Path(directory) / INCOMPLETE_FILE)


def is_sealed(directory: str | Path) -> bool:
    """True if ``directory`` has a schema-valid ``MANIFEST.json`` and no ``INCOMPLETE`` marker.

    This checks the manifest's form only, not the files' digests: use
    :func:`verify_manifest` / :func:`check_sealed` for that. Never raises.
    """
    d = Path(directory)
    try:
        if not d.is_dir() or is_incomplete(d):
            return False
    except OSError:
        return False
    return _manifest_valid(d)


def sealed_ancestor(path: str | Path) -> Path | None:
    """The nearest sealed directory containing ``path`` (``path`` itself excluded), if any.

    Args:
        path: a file or directory path (need not exist).
    """
    p = Path(os.path.abspath(path))
    for parent in p.parents:
        if os.path.lexists(parent / MANIFEST_FILE) and is_sealed(parent):
            return parent
    return None


def _refuse_if_sealed(path: Path) -> None:
    owner = sealed_ancestor(path)
    if owner is not None:
        raise EvidenceIntegrityError(
            f"{path}: refusing to write into sealed directory {owner}; "
            "a sealed directory is never written again"
        )


# --------------------------------------------------------------------------- atomic writes


def _atomic_write(path: Path, write: Callable[[IO[bytes]], object], *, check_sealed_: bool) -> None:
    if check_sealed_:
        _refuse_if_sealed(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f"{_TMP_PREFIX}{path.name}.",
                                    suffix=_TMP_SUFFIX)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same directory, fsync, rename).

    Parent directories are created. An existing file at ``path`` is replaced whole.

    Args:
        path: destination file.
        data: the bytes.

    Raises:
        EvidenceIntegrityError: ``path`` lies under a sealed directory.
        OSError: the write failed (no temporary file is left behind, the old file, if
            any, is untouched).
    """
    _atomic_write(Path(path), lambda f: f.write(data), check_sealed_=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically; see :func:`atomic_write_bytes`.

    Raises:
        EvidenceIntegrityError: ``path`` lies under a sealed directory.
        OSError: the write failed.
    """
    atomic_write_bytes(path, text.encode("utf-8"))


def _json_bytes(obj: Any) -> bytes:
    text = json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False)
    return (text + "\n").encode("utf-8")


def atomic_write_json(path: str | Path, obj: Any, *, schema: str | None = None) -> None:
    """Write ``obj`` as JSON (sorted keys, indent 2, trailing newline, UTF-8) atomically.

    Args:
        path: destination file.
        obj: a JSON-compatible value. NaN and infinities are not JSON and are refused;
            encode them yourself (``null`` or a string) where a schema allows.
        schema: if given, ``obj`` is validated against
            ``contracts/schema/<schema>.schema.json`` before anything is written.

    Raises:
        QualifyError: ``obj`` violates ``schema`` (nothing is written).
        ValueError: ``obj`` holds NaN or an infinity.
        TypeError: ``obj`` is not JSON-serialisable.
        EvidenceIntegrityError: ``path`` lies under a sealed directory.
        OSError: the write failed.
    """
    if schema is not None:
        validate_json(obj, schema, what=str(path))
    atomic_write_bytes(path, _json_bytes(obj))


def _is_torch_tensor(value: object) -> bool:
    torch_mod = sys.modules.get("torch")
    return torch_mod is not None and isinstance(value, torch_mod.Tensor)


def _check_tensor_args(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None) -> None:
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if not (_is_torch_tensor(value) or isinstance(value, np.ndarray)):
            raise TypeError(f"tensor {name!r}: expected torch.Tensor or numpy.ndarray, "
                            f"got {type(value).__name__}")
    if metadata is not None:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"safetensors metadata must be dict[str, str]; got {k!r}: {v!r}")


def _torch_ready(tensors: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Make detached, contiguous, CPU tensors that own their storage.

    safetensors refuses tensors that share memory, so views and duplicates are cloned.
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, value in tensors.items():
        t = torch.from_numpy(np.require(value, requirements="C")) if isinstance(value, np.ndarray) \
            else value.detach().to("cpu")
        storage = t.untyped_storage()
        exclusive = (
            t.is_contiguous()
            and t.storage_offset() == 0
            and storage.nbytes() == t.numel() * t.element_size()
            and storage.data_ptr() not in seen
        )
        if not exclusive:
            t = t.clone(memory_format=torch.contiguous_format)
        if t.numel() > 0:
            seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def save_tensors(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor | np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write tensors to a safetensors file atomically.

    Torch tensors (any dtype safetensors supports, bfloat16 included) are detached,
    moved to CPU and made contiguous; numpy arrays are made contiguous. If every value
    is a numpy array the numpy API is used and torch is not imported.

    Args:
        path: destination ``.safetensors`` file.
        tensors: name -> tensor (any shape, 0-d included).
        metadata: free ``str -> str`` header metadata.

    Raises:
        TypeError: a name, value or metadata entry has the wrong type.
        EvidenceIntegrityError: ``path`` lies under a sealed directory.
        OSError: the write failed (no temporary file is left, the old file is untouched).
    """
    p = Path(path)
    _check_tensor_args(tensors, metadata)
    meta = dict(metadata) if metadata is not None else None
    _refuse_if_sealed(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=p.parent, prefix=f"{_TMP_PREFIX}{p.name}.",
                                    suffix=_TMP_SUFFIX)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        if all(isinstance(v, np.ndarray) for v in tensors.values()):
            arrays = {k: np.require(v, requirements="C") for k, v in tensors.items()}
            safetensors.numpy.save_file(arrays, tmp_name, metadata=meta)
        else:
            from safetensors.torch import save_file

            save_file(_torch_ready(tensors), tmp_name, metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(p.parent)


def _wrap_load_error(path: Path, exc: Exception) -> EvidenceIntegrityError:
    return EvidenceIntegrityError(f"{path}: cannot read safetensors file: {exc}")


def load_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Read a safetensors file into numpy arrays.

    Args:
        path: the ``.safetensors`` file.

    Returns:
        name -> array, dtypes and shapes as stored.

    Raises:
        EvidenceIntegrityError: the file is missing, truncated or not safetensors, or
            holds a dtype numpy lacks (bfloat16: use :func:`load_tensors_torch`).
    """
    p = Path(path)
    try:
        result: dict[str, np.ndarray] = safetensors.numpy.load_file(str(p))
    except Exception as exc:  # safetensors raises its own error types and TypeError
        raise _wrap_load_error(p, exc) from exc
    return result


def load_tensors_torch(path: str | Path, *, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Read a safetensors file into torch tensors (bfloat16 supported).

    Args:
        path: the ``.safetensors`` file.
        device: torch device to load onto.

    Returns:
        name -> tensor, dtypes and shapes as stored.

    Raises:
        EvidenceIntegrityError: the file is missing, truncated or not safetensors.
    """
    from safetensors.torch import load_file

    p = Path(path)
    try:
        result: dict[str, torch.Tensor] = load_file(str(p), device=device)
    except Exception as exc:  # safetensors raises its own error types
        raise _wrap_load_error(p, exc) from exc
    return result


def read_tensor_metadata(path: str | Path) -> dict[str, str]:
    """Return the ``str -> str`` header metadata of a safetensors file (empty if none).

    Raises:
        EvidenceIntegrityError: the file is missing or not safetensors.
    """
    p = Path(path)
    try:
        with safetensors.safe_open(str(p), framework="np") as f:
            meta = f.metadata()
    except Exception as exc:  # safetensors raises its own error types
        raise _wrap_load_error(p, exc) from exc
    return dict(meta or {})


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
        if full.name.startswith(_TMP_PREFIX) and full.name.endswith(_TMP_SUFFIX):
            raise EvidenceIntegrityError(
                f"{full}: leftover temporary file of an interrupted write; cannot seal {d}"
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

    Order: hash every file, make files ``0o444``, remove ``INCOMPLETE``, write the
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
            sealed directory, or holds a non-regular or leftover temporary file.
        QualifyError: ``kind`` is not a valid kind (lowercase id).
    """
    d = Path(directory)
    if not d.is_dir():
        raise EvidenceIntegrityError(f"{d}: cannot seal, not a directory")
    if is_sealed(d):
        raise EvidenceIntegrityError(f"{d}: already sealed")
    _refuse_if_sealed(d / MANIFEST_FILE)
    if os.path.lexists(d / MANIFEST_FILE):
        # An invalid leftover manifest (interrupted or hand-made): replaced below.
        _log.warning("%s: replacing an invalid %s while sealing", d, MANIFEST_FILE)
    manifest = build_manifest(d, kind=kind)
    validate_json(manifest, "manifest", what=str(d / MANIFEST_FILE))
    for rel in manifest["files"]:
        os.chmod(d / rel, _FILE_MODE)
    with contextlib.suppress(FileNotFoundError):
        (d / INCOMPLETE_FILE).unlink()
    data = _json_bytes(manifest)
    _atomic_write(d / MANIFEST_FILE, lambda f: f.write(data), check_sealed_=False)
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

    Raises:
        EvidenceIntegrityError: the manifest is missing, not JSON or fails its schema.
    """
    path = Path(directory) / MANIFEST_FILE
    try:
        doc: dict[str, Any] = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise EvidenceIntegrityError(f"{path}: missing; the directory is not sealed") from None
    except (OSError, ValueError) as exc:
        raise EvidenceIntegrityError(f"{path}: unreadable or not JSON: {exc}") from None
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


def add_attestation(directory: str | Path, name: str, data: bytes) -> Path:
    """Add a DSSE attestation file to a sealed directory (the signing step's only write).

    The directory's write bit is lifted for the time of the write and restored; the
    file is written atomically and made ``0o444``. An existing attestation is never
    overwritten: use a different name (e.g. one per key).

    Args:
        directory: a sealed directory.
        name: file name ending in ``.dsse.json`` (no path separator).
        data: the envelope bytes.

    Returns:
        The path of the attestation.

    Raises:
        EvidenceIntegrityError: ``directory`` is not sealed, or ``name`` exists already.
        ValueError: ``name`` is not a bare ``*.dsse.json`` file name.
    """
    d = Path(directory)
    if "/" in name or os.sep in name or not name.endswith(ATTESTATION_SUFFIX) \
            or name == ATTESTATION_SUFFIX:
        raise ValueError(f"attestation name must be a bare '*{ATTESTATION_SUFFIX}' name: "
                         f"{name!r}")
    if not is_sealed(d):
        raise EvidenceIntegrityError(f"{d}: not sealed; attestations are added after sealing")
    target = d / name
    if os.path.lexists(target):
        raise EvidenceIntegrityError(f"{target}: exists; an attestation is never overwritten")
    mode = stat.S_IMODE(d.stat().st_mode)
    os.chmod(d, mode | stat.S_IWUSR)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)  # reserve the name: a concurrent signer cannot take it
        try:
            _atomic_write(target, lambda f: f.write(data), check_sealed_=False)
            os.chmod(target, _FILE_MODE)
        except BaseException:
            with contextlib.suppress(OSError):
                target.unlink()
            raise
    finally:
        os.chmod(d, mode)
    return target


# --------------------------------------------------------------------------- directories


def _marker(kind: str) -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": utc_now_iso(),
            "kind": kind}


def _write_marker(directory: Path, kind: str) -> None:
    atomic_write_json(directory / INCOMPLETE_FILE, _marker(kind))


def next_free_dir(base: str | Path) -> Path:
    """``base`` if nothing exists there, else the first free ``base-2``, ``base-3``, ...

    Used for ``--new``. Checking is not reserving: :func:`claim_dir` creates it.
    """
    b = Path(base)
    if not os.path.lexists(b):
        return b
    n = 2
    while os.path.lexists(b.with_name(f"{b.name}-{n}")):
        n += 1
    return b.with_name(f"{b.name}-{n}")


def _live_writer(directory: Path) -> int | None:
    """Pid of a live process on this host that is writing ``directory``, per its marker.

    A pid is taken as alive only if a process with that pid exists and started no later
    than the marker (so a recycled pid does not count). Unreadable markers, other hosts
    and this very process give ``None``.
    """
    try:
        marker = json.loads((directory / INCOMPLETE_FILE).read_bytes())
        pid, host = int(marker["pid"]), str(marker["host"])
        started = _dt.datetime.strptime(marker["started"], "%Y-%m-%dT%H:%M:%S.%fZ")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname() or pid == os.getpid() or pid <= 0:
        return None
    try:
        proc_start = psutil.Process(pid).create_time()
    except psutil.Error:  # NoSuchProcess, AccessDenied, ZombieProcess
        return None
    marker_ts = started.replace(tzinfo=_dt.UTC).timestamp()
    return pid if proc_start <= marker_ts + 1.0 else None


def _move_aside(path: Path) -> Path:
    stem = f"{path.name}.incomplete-{_utc_stamp()}"
    target = path.with_name(stem)
    n = 2
    while os.path.lexists(target):
        target = path.with_name(f"{stem}-{n}")
        n += 1
    os.rename(path, target)
    return target


def claim_dir(path: str | Path, *, kind: str) -> Path:
    """Create a fresh directory for a new stage and mark it ``INCOMPLETE``.

    If ``path`` exists unsealed (an interrupted run, or a non-directory), it is renamed
    to ``<path>.incomplete-<UTC timestamp>`` (kept, never deleted or overwritten) and a
    fresh directory is created.

    Args:
        path: the directory to claim; its parents are created.
        kind: what it will hold, written in the marker (``reference``, ``candidate-run``...).

    Returns:
        ``path``, now an empty directory holding only ``INCOMPLETE``.

    Raises:
        ReferenceDataError: ``path`` is sealed (exit code 2): pass ``--new`` to write a
            new directory instead.
        UsageError: a live process on this host is still writing ``path`` (its marker
            names it).
        EvidenceIntegrityError: ``path`` lies under a sealed directory, or another
            process created it at the same moment.
    """
    p = Path(path)
    if is_sealed(p):
        raise ReferenceDataError(
            f"{p}: already sealed and never written again; pass --new to write a new "
            f"directory ({next_free_dir(p)})"
        )
    _refuse_if_sealed(p)
    if os.path.lexists(p):
        writer = _live_writer(p) if p.is_dir() else None
        if writer is not None:
            raise UsageError(f"{p}: still being written by process {writer} on this host; "
                             "wait for it, or pass --new to write a new directory "
                             f"({next_free_dir(p)})")
        aside = _move_aside(p)
        _log.warning("%s: unsealed (interrupted) directory moved aside to %s", p, aside)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(p)
    except FileExistsError:
        raise EvidenceIntegrityError(f"{p}: created by another process while claiming it") \
            from None
    _write_marker(p, kind)
    return p


def attempt_number(path: str | Path) -> int:
    """N of an ``attempt-N`` directory.

    Raises:
        ValueError: the name is not ``attempt-N`` with N >= 1.
    """
    m = _ATTEMPT_RE.match(Path(path).name)
    if m is None:
        raise ValueError(f"not an attempt directory name: {Path(path).name!r}")
    return int(m.group(1))


def attempts(cell_dir: str | Path) -> list[Path]:
    """Every ``attempt-N`` directory under ``cell_dir``, sorted by N (empty if none)."""
    d = Path(cell_dir)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    found = [d / n for n in names if _ATTEMPT_RE.match(n) and (d / n).is_dir()]
    return sorted(found, key=attempt_number)


def new_attempt(cell_dir: str | Path) -> Path:
    """Create the next ``attempt-N`` under ``cell_dir`` (N = 1 + highest existing).

    Uses :func:`os.mkdir`, which fails if the name exists, and retries with the next N
    on a race, so concurrent callers get distinct directories and no attempt is reused
    or overwritten. The new attempt carries the ``INCOMPLETE`` marker (kind ``attempt``);
    seal it with ``seal(path, kind="attempt")``.

    Args:
        cell_dir: the cell directory (created if missing).

    Returns:
        The new attempt directory.

    Raises:
        EvidenceIntegrityError: ``cell_dir`` lies under a sealed directory, or a free
            number could not be taken after many races.
    """
    d = Path(cell_dir)
    _refuse_if_sealed(d / "attempt-1")
    d.mkdir(parents=True, exist_ok=True)
    for _ in range(_MAX_ATTEMPT_RACES):
        existing = [attempt_number(a) for a in attempts(d)]
        n = max(existing, default=0) + 1
        # Any entry named attempt-N (even a stray file) blocks N: never overwrite.
        while os.path.lexists(d / f"attempt-{n}"):
            n += 1
        target = d / f"attempt-{n}"
        try:
            os.mkdir(target)
        except FileExistsError:
            continue
        _write_marker(target, "attempt")
        return target
    raise EvidenceIntegrityError(f"{d}: could not create a new attempt after "
                                 f"{_MAX_ATTEMPT_RACES} races")


def latest_complete_attempt(cell_dir: str | Path) -> Path | None:
    """The highest-numbered attempt that is sealed (valid manifest, no ``INCOMPLETE``).

    Checks the manifest's form, not file digests (use :func:`check_sealed` for that).

    Returns:
        The attempt directory, or ``None`` if no attempt is complete.
    """
    for attempt in reversed(attempts(cell_dir)):
        if is_sealed(attempt):
            return attempt
    return None


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
