"""The one bounded, strict JSON reader for evidence.

Evidence directories are read before their signature is checked (the envelope, the
manifest) and ``discover`` / ``audit`` read whatever a tree holds, so every evidence JSON
read goes through :func:`read_json`, which refuses, before parsing anything:

- a symbolic link or any non-regular file (``lstat``, then ``open`` with ``O_NOFOLLOW``
  and ``O_NONBLOCK`` and an ``fstat`` of the opened file: a FIFO, a device such as
  ``/dev/zero`` or a link swapped in between is refused, never read);
- a file over a per-kind size limit (:func:`limit_for`): at most ``max_bytes + 1`` bytes
  are ever read, so a file that grows while read is refused too;
- text that is not UTF-8 JSON, nests deeper than Python's parser can (``RecursionError``),
  or holds a duplicate key in any object (``object_pairs_hook``): a document two readers
  may read differently is no evidence. ``NaN`` / ``Infinity`` literals are refused too
  (qualify writes JSON with ``allow_nan=False``; non-finite numbers are strings).

Every refusal is an :class:`~qualify.errors.EvidenceIntegrityError` (exit code 3) naming
the file.

Size limits, measured on the default tiny-qwen3 contract's real run (26 cells):
``report.json`` 680 KB, ``attestation.dsse.json`` 161 KB, ``MANIFEST.json`` 126 KB,
``run.json`` 13 KB, reference ``bounds.json`` 45 KB. The limits leave about 100x room for
larger contracts while keeping a hostile file from costing more than a bounded read.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Final

from qualify.errors import EvidenceIntegrityError, QualifyError
from qualify.layout import ATTESTATION_SUFFIX, BOUNDS_FILE, MANIFEST_FILE, REPORT_JSON
from qualify.userfiles import _read_fd_bounded

__all__ = ["MAX_LISTING_BYTES", "MAX_RECORD_BYTES", "MAX_REPORT_BYTES", "json_number", "limit_for",
           "loads_strict", "read_bytes", "read_json"]

MAX_RECORD_BYTES: Final = 4 * 1024 * 1024
"""Small records: ``run.json``, ``reference.json``, ``contract.json``, ``result.json``,
``outputs.json``, ``environment.json``, ``INCOMPLETE`` markers, ... (measured: 13 KB)."""
MAX_LISTING_BYTES: Final = 32 * 1024 * 1024
"""Documents that grow with the number of files: ``MANIFEST.json`` and ``*.dsse.json``
(measured: 126 KB and 161 KB for a 26-cell run)."""
MAX_REPORT_BYTES: Final = 128 * 1024 * 1024
"""Documents that grow with cells x metrics: ``report.json``, ``bounds.json``
(measured: 680 KB and 45 KB)."""

_LIMITS: Final[dict[str, int]] = {
    MANIFEST_FILE: MAX_LISTING_BYTES,
    REPORT_JSON: MAX_REPORT_BYTES,
    BOUNDS_FILE: MAX_REPORT_BYTES,
}


def limit_for(path: str | Path) -> int:
    """The size limit, in bytes, of the evidence file ``path`` (by its name).

    Returns:
        :data:`MAX_LISTING_BYTES` for ``MANIFEST.json`` and ``*.dsse.json``,
        :data:`MAX_REPORT_BYTES` for ``report.json`` and ``bounds.json``, else
        :data:`MAX_RECORD_BYTES`.
    """
    name = Path(path).name
    if name.endswith(ATTESTATION_SUFFIX):
        return MAX_LISTING_BYTES
    return _LIMITS.get(name, MAX_RECORD_BYTES)


def read_bytes(path: str | Path, *, max_bytes: int | None = None, what: str = "") -> bytes:
    """The bytes of a regular file of at most ``max_bytes`` bytes, never following a link.

    Args:
        path: the file.
        max_bytes: the size limit (default :func:`limit_for` of ``path``).
        what: how to name the file in errors (default the path).

    Returns:
        The file's bytes.

    Raises:
        FileNotFoundError: ``path`` does not exist (callers decide what missing means).
        EvidenceIntegrityError: a symbolic link, not a regular file, over the limit, or
            unreadable.
    """
    p = Path(path)
    name = what or str(p)
    limit = limit_for(p) if max_bytes is None else max_bytes
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise EvidenceIntegrityError(f"{name}: cannot stat: {exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise EvidenceIntegrityError(f"{name}: a symbolic link; evidence files must be "
                                     "regular files (refused, not followed)")
    if not stat.S_ISREG(st.st_mode):
        raise EvidenceIntegrityError(f"{name}: not a regular file (refused, not read)")
    if st.st_size > limit:
        raise EvidenceIntegrityError(f"{name}: {st.st_size} bytes, over the {limit}-byte "
                                     "limit for this file (refused, not read)")
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise EvidenceIntegrityError(f"{name}: cannot open: {exc.strerror or exc} "
                                     "(a link or special file swapped in?)") from None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError as exc:
        os.close(fd)
        raise EvidenceIntegrityError(f"{name}: unreadable: {exc}") from None
    if not regular:
        os.close(fd)
        raise EvidenceIntegrityError(f"{name}: not a regular file (refused, not read)")
    return _read_fd_bounded(
        fd, limit, error=EvidenceIntegrityError,
        unreadable=lambda exc: f"{name}: unreadable: {exc}",
        too_large=f"{name}: over the {limit}-byte limit for this file (it grew while read)")


class _RefusedError(Exception):
    """A duplicate key or a non-standard constant met while parsing (message: the problem)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _RefusedError(f"duplicate key {k!r} in a JSON object")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise _RefusedError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _RefusedError(f"number {text[:40]} overflows to infinity")
    return value


def loads_strict(data: bytes | str, *, what: str,
                 error: type[QualifyError] = EvidenceIntegrityError) -> Any:
    """Parse JSON strictly: UTF-8, no duplicate key, no ``NaN`` / ``Infinity``.

    A number literal too large for a float (``1e400``, which Python's parser turns into
    ``inf``) is refused as ``Infinity`` is.

    Args:
        data: the document (bytes are decoded as UTF-8).
        what: how to name the document in errors.
        error: the class raised: :class:`~qualify.errors.EvidenceIntegrityError` (exit 3)
            for evidence, a user-input class such as
            :class:`~qualify.errors.ContractError` (exit 2) for a file the user wrote.

    Returns:
        The parsed document.

    Raises:
        EvidenceIntegrityError: (or ``error``) not UTF-8, not JSON, nested too deep, a
            duplicate key, a non-standard constant or an infinite number; the message
            starts with ``what``.
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
                          parse_float=_finite_float)
    except _RefusedError as exc:
        raise error(f"{what}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{what}: not UTF-8: {exc}") from None
    except RecursionError:
        raise error(f"{what}: JSON nested too deep") from None
    except ValueError as exc:
        raise error(f"{what}: not JSON: {exc}") from None


def read_json(path: str | Path, *, max_bytes: int | None = None, what: str = "") -> Any:
    """Read an evidence JSON document: bounded, no link, strict (see the module docstring).

    Args:
        path: the file.
        max_bytes: the size limit (default :func:`limit_for` of ``path``).
        what: how to name the file in errors (default the path).

    Returns:
        The parsed document.

    Raises:
        EvidenceIntegrityError: missing, a symbolic link or special file, over the size
            limit, unreadable, not UTF-8 JSON, nested too deep, or with a duplicate key.
    """
    name = what or str(path)
    try:
        data = read_bytes(path, max_bytes=max_bytes, what=name)
    except FileNotFoundError:
        raise EvidenceIntegrityError(f"{name}: missing") from None
    except EvidenceIntegrityError:
        raise
    except OSError as exc:
        raise EvidenceIntegrityError(f"{name}: unreadable: {exc}") from None
    return loads_strict(data, what=name)


def json_number(x: float | None) -> float | str | None:
    """A float for JSON: finite as is, ``inf`` / ``-inf`` / ``nan`` as strings, ``None`` kept.

    qualify writes JSON with ``allow_nan=False`` (a reader of :func:`read_json` refuses the
    ``NaN`` / ``Infinity`` literals), so a non-finite error or margin is a string.
    """
    if x is None:
        return None
    if math.isfinite(x):
        return float(x)
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")

