"""The sealed-directory guard and the guarded atomic writes.

A directory is *sealed* when it holds a schema-valid ``MANIFEST.json`` and no
``INCOMPLETE`` marker (:func:`is_sealed`). A sealed directory is never written again:
every writer of :mod:`qualify.evidence` refuses a path under one
(:func:`refuse_if_sealed`, checked explicitly, so the refusal holds for root too). The
writes themselves are :mod:`qualify.atomic`'s (temp file, fsync, rename, fsync of the
directory); this module only puts the guard on top. Public through
:mod:`qualify.evidence.store`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from qualify import atomic, jsonio
from qualify.errors import EvidenceIntegrityError, QualifyError
from qualify.layout import INCOMPLETE_FILE, MANIFEST_FILE, WRITTEN_MARKS
from qualify.schema import validate, validator

__all__ = [
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "is_incomplete",
    "is_sealed",
    "refuse_if_sealed",
    "sealed_ancestor",
]


def _manifest_valid(directory: Path) -> bool:
    try:
        doc = jsonio.read_json(directory / MANIFEST_FILE)
    except (OSError, ValueError, QualifyError):
        return False  # absent, unreadable, a symlink or special file, oversized, or invalid
    return bool(validator("manifest").is_valid(doc))


def is_incomplete(directory: str | Path) -> bool:
    """True if ``directory`` carries the ``INCOMPLETE`` marker (being written or interrupted)."""
    return os.path.lexists(Path(directory) / INCOMPLETE_FILE)


def is_sealed(directory: str | Path) -> bool:
    """True if ``directory`` has a schema-valid ``MANIFEST.json`` and no ``INCOMPLETE`` marker.

    This checks the manifest's form only, not the files' digests: use
    :func:`qualify.evidence.store.verify_manifest` / ``check_sealed`` for that. Never raises.
    """
    d = Path(directory)
    try:
        if not d.is_dir() or is_incomplete(d):
            return False
    except OSError:
        return False
    return _manifest_valid(d)


def not_sealed_reason(directory: str | Path, what: str, *, advice: str = "") -> str:
    """Why ``directory`` is not a sealed ``what``: one line for a user error.

    A folder with no ``MANIFEST.json``, no ``INCOMPLETE`` marker and none of
    :data:`~qualify.layout.WRITTEN_MARKS` whose subdirectories are sealed (an ``--out`` /
    ``--references`` parent) is named as such, with the sealed subdirectories to choose from;
    any other such folder, inside no ``INCOMPLETE`` directory, is "not a ``what`` directory"
    (qualify marks a directory ``INCOMPLETE`` before its first write); the rest (the marker,
    a manifest that is not valid, a run or reference file without either, as a seal
    interrupted between removing the marker and writing the manifest leaves it, a folder
    inside an interrupted directory) is "not sealed (interrupted or still running)".

    Args:
        directory: an existing directory that :func:`is_sealed` refused.
        what: the noun of the message (``reference``, ``run``).
        advice: appended (after ``"; "``) to the "not sealed" line only, not to the folder's.
    """
    d = Path(directory)
    if not os.path.lexists(d / MANIFEST_FILE) and not is_incomplete(d) \
            and not any(os.path.lexists(d / m) for m in WRITTEN_MARKS):
        try:
            inside = sorted(c.name for c in d.iterdir() if c.is_dir() and is_sealed(c))
        except OSError:
            inside = []
        if inside:
            shown = ", ".join(inside[:3]) + (f" and {len(inside) - 3} more"
                                             if len(inside) > 3 else "")
            return (f"{d}: not a {what} directory but a folder holding sealed directories "
                    f"({shown}): name one of them")
        if not any(is_incomplete(p) for p in Path(os.path.abspath(d)).parents):
            return (f"{d}: not a {what} directory (no {MANIFEST_FILE}, and not marked as a "
                    f"{what} being written or interrupted)")
    return f"{d}: {what} is not sealed (interrupted or still running)" + (
        f"; {advice}" if advice else "")


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


def refuse_if_sealed(path: str | Path) -> None:
    """Refuse to write ``path`` when it lies under a sealed directory.

    Raises:
        EvidenceIntegrityError: a sealed directory contains ``path``.
    """
    owner = sealed_ancestor(path)
    if owner is not None:
        raise EvidenceIntegrityError(
            f"{path}: refusing to write into sealed directory {owner}; "
            "a sealed directory is never written again"
        )


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
    refuse_if_sealed(path)
    atomic.write_bytes(path, data)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically; see :func:`atomic_write_bytes`.

    Raises:
        EvidenceIntegrityError: ``path`` lies under a sealed directory.
        OSError: the write failed.
    """
    atomic_write_bytes(path, text.encode("utf-8"))


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
        validate(obj, schema, what=str(path))
    atomic_write_bytes(path, atomic.json_bytes(obj))

