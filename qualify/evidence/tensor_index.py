"""Each tensor stored once: a launch's outputs live in its cells, its index proves they are its.

A harness launch writes ``outputs.safetensors`` (one per variant of a grouped launch); the
candidate stage splits it into the cells' own attempts (``cells/<cell>/attempt-N/``, what
the comparator and ``verify`` read). Keeping the launch's file too stored every tensor
twice (tiny-qwen3: 148 MB of 297 MB). Instead, before the split, the launch attempt records
:data:`~qualify.layout.TENSOR_INDEX_FILE`: for every outputs file the harness wrote, its
sha256, size, tensor count and *content digest* (:func:`content_digest`: over every
tensor's name, dtype, shape and sha256 of its data bytes), and for each cell attempt that
takes a share of it, that share's count and content digest. Once every tensor of a file is
in a sealed cell attempt with the same bytes (:func:`drop_stored_copies`), the launch's file
is removed and the launch attempt is sealed with the index in its manifest.

:func:`check_run` (``qualify verify`` step 9, before the verdicts are recomputed) proves
from what is stored that the cells' tensors are exactly what the harness wrote: each cell
share's content digest equals its cell's file (same names, dtypes, shapes and bytes, nothing
added), the shares of a file are disjoint and together are the whole file (their merged
content digest is the file's), and a launch file still on disk has the indexed sha256.

The index is written after the split, naming only cells sealed COMPLETE. A crash during the
split or before the drop leaves the launch attempt unsealed (``INCOMPLETE``) with its file
(and perhaps its index), and ``run.json`` without the launch's cells; the next ``qualify
candidate`` of the run launches those cells again (a new launch attempt, new cell attempts),
and the old attempts are kept as failed ones, as after any interrupted launch.
:func:`check_run` reads the indexes of sealed launch attempts only.

Per-tensor digests are over the tensor's data bytes as safetensors stores them (row-major,
little endian), so they do not depend on the order or header layout of the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from qualify import jsonio
from qualify.digests import sha256_file
from qualify.errors import EvidenceIntegrityError
from qualify.evidence.sealed import atomic_write_json, is_sealed
from qualify.layout import CELLS_DIR, LAUNCHES_DIR, TENSOR_INDEX_FILE
from qualify.protocol import OUTPUTS_FILE

__all__ = ["INDEX_SCHEMA_VERSION", "build_index", "check_run", "content_digest",
           "drop_stored_copies", "tensor_digests", "write_index"]

INDEX_SCHEMA_VERSION: Final = 1
_MAX_HEADER: Final = 100 * 1024 * 1024
_CHUNK: Final = 1 << 20


def tensor_digests(path: Path) -> dict[str, dict[str, Any]]:
    """The dtype, shape and sha256 of every tensor's data bytes in a safetensors file.

    Reads the header directly (8-byte little-endian length, then JSON; the safetensors
    format) and hashes each tensor's ``data_offsets`` slice in 1 MiB chunks, so memory
    stays at one chunk whatever the file size.

    Args:
        path: a ``.safetensors`` file.

    Returns:
        ``{name: {"dtype": "F32", "shape": [..], "sha256": hex}}`` (header metadata left out).

    Raises:
        EvidenceIntegrityError: not a readable safetensors file, or a tensor's offsets
            lie outside it.
    """
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER:
                raise ValueError(f"header of {n} bytes")
            raw = f.read(n)
            if len(raw) != n:
                raise ValueError(f"header of {n} bytes, file ends after {len(raw)}")
            header = json.loads(raw)
            base = 8 + n
            size = os.fstat(f.fileno()).st_size
            out: dict[str, dict[str, Any]] = {}
            for name, entry in sorted(header.items()):
                if name == "__metadata__":
                    continue
                start, end = (int(x) for x in entry["data_offsets"])
                if not 0 <= start <= end or base + end > size:
                    raise ValueError(f"tensor {name!r}: offsets {start}..{end} outside the file")
                f.seek(base + start)
                h, left = hashlib.sha256(), end - start
                while left:
                    chunk = f.read(min(_CHUNK, left))
                    if not chunk:
                        raise ValueError(f"tensor {name!r}: file ends inside its data")
                    h.update(chunk)
                    left -= len(chunk)
                out[name] = {"dtype": str(entry["dtype"]), "shape": list(entry["shape"]),
                             "sha256": h.hexdigest()}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise EvidenceIntegrityError(f"{path}: cannot index safetensors file: {exc}") from None
    return out


def content_digest(tensors: Mapping[str, Mapping[str, Any]]) -> str:
    """sha256 of a set of tensors, independent of file layout and order.

    Args:
        tensors: :func:`tensor_digests` entries (or a subset, or a union of several).

    Returns:
        Hex sha256 of the UTF-8 lines ``name TAB dtype TAB shape (comma separated) TAB
        sha256 of data`` + newline, sorted by name.
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        shape = ",".join(str(int(d)) for d in t["shape"])
        h.update(f"{name}\t{t['dtype']}\t{shape}\t{t['sha256']}\n".encode())
    return h.hexdigest()


def build_index(attempt: Path, owners: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
    """The index document of a launch attempt.

    Args:
        attempt: the launch attempt directory.
        owners: ``{outputs file relative to attempt: {tensor name: cell attempt relative
            to the run directory}}``; a tensor absent from its file's mapping has no cell
            (it is listed under ``unowned`` and its file is never dropped).

    Returns:
        ``{"schema_version": 1, "files": {rel: {"sha256", "size", "tensors", "content",
        "cells": {cell attempt: {"tensors", "content"}}, "unowned": [names]}}}``
        (``tensors`` counts, ``content`` :func:`content_digest`).

    Raises:
        EvidenceIntegrityError: an outputs file is unreadable.
    """
    files: dict[str, Any] = {}
    for rel, mine in sorted(owners.items()):
        path = attempt / rel
        tensors = tensor_digests(path)
        shares: dict[str, dict[str, Any]] = {}
        for name, entry in tensors.items():
            cell = mine.get(name)
            if cell is not None:
                shares.setdefault(cell, {})[name] = entry
        files[rel] = {
            "sha256": sha256_file(path), "size": path.stat().st_size,
            "tensors": len(tensors), "content": content_digest(tensors),
            "cells": {c: {"tensors": len(t), "content": content_digest(t)}
                      for c, t in sorted(shares.items())},
            "unowned": sorted(n for n in tensors if n not in mine)}
    return {"schema_version": INDEX_SCHEMA_VERSION, "files": files}


def write_index(attempt: Path, doc: Mapping[str, Any]) -> None:
    """Write ``doc`` as the attempt's :data:`~qualify.layout.TENSOR_INDEX_FILE` (atomic).

    Raises:
        EvidenceIntegrityError: the attempt is sealed.
    """
    atomic_write_json(attempt / TENSOR_INDEX_FILE, dict(doc))


def drop_stored_copies(attempt: Path, run_dir: Path, doc: Mapping[str, Any]) -> list[str]:
    """Remove each launch outputs file whose every tensor is in its cell with the same bytes.

    Called after the cells' attempts are sealed and before the launch attempt is. A file
    with an unowned tensor, or a cell share that differs from its cell's file, is kept.

    Args:
        attempt: the (unsealed) launch attempt.
        run_dir: the run directory.
        doc: the attempt's index (:func:`build_index`).

    Returns:
        The removed files, relative to ``attempt``.

    Raises:
        EvidenceIntegrityError: a cell's outputs file is unreadable.
    """
    removed: list[str] = []
    for rel, entry in doc["files"].items():
        if entry["unowned"] or not (attempt / rel).is_file():
            continue
        if all(content_digest(tensor_digests(run_dir / cell / OUTPUTS_FILE)) == share["content"]
               for cell, share in entry["cells"].items()):
            (attempt / rel).unlink()
            removed.append(rel)
    return removed


def _read_index(path: Path) -> dict[str, Any]:
    doc = jsonio.read_json(path)
    if not isinstance(doc, dict) or doc.get("schema_version") != INDEX_SCHEMA_VERSION \
            or not isinstance(doc.get("files"), dict):
        raise EvidenceIntegrityError(f"{path}: not a tensor index (schema_version "
                                     f"{INDEX_SCHEMA_VERSION} with files)")
    return doc


def check_run(run_dir: Path) -> list[str]:
    """Prove the cells' tensors are the harness's: one problem per line, none when they are.

    For every sealed launch attempt with an index (runs made before indexes existed have
    none and keep their launch files; an unsealed one is a killed attempt, kept as a failed
    one, whose cells were launched again): a launch file on disk must have the indexed sha256; each
    cell share must equal its cell attempt's ``outputs.safetensors`` (content digest and
    count: same tensors, bytes, dtypes and shapes, none added); no cell attempt takes two
    shares, no tensor is in two shares, and a dropped file's shares together are the file
    (their merged content digest and count are the file's).

    Args:
        run_dir: the run directory.

    Returns:
        Problems, each naming the index, the file and the cell (empty: every check held).
    """
    problems: list[str] = []
    root = run_dir.resolve()
    claimed: dict[str, str] = {}
    launches = run_dir / LAUNCHES_DIR
    index_paths = sorted(launches.glob(f"*/*/{TENSOR_INDEX_FILE}")) if launches.is_dir() else []
    for ipath in index_paths:
        if not is_sealed(ipath.parent):
            continue  # a killed launch attempt: kept as a failed one, its index claims nothing
        where = ipath.relative_to(run_dir).as_posix()
        try:
            doc = _read_index(ipath)
            for rel, entry in sorted(doc["files"].items()):
                problems += _check_file(run_dir, root, f"{where}: {rel}", ipath.parent / rel,
                                        entry=entry, claimed=claimed)
        except (OSError, KeyError, TypeError, AttributeError, EvidenceIntegrityError) as exc:
            problems.append(f"{where}: unreadable or malformed: {exc}")
    return problems


def _check_file(run_dir: Path, root: Path, where: str, path: Path, *,
                entry: Mapping[str, Any], claimed: dict[str, str]) -> list[str]:
    """The problems of one indexed outputs file (see :func:`check_run`)."""
    bad: list[str] = []
    on_disk = path.is_file()
    if on_disk and sha256_file(path) != entry["sha256"]:
        bad.append(f"{where}: on disk with another sha256 than indexed")
    if not on_disk and entry["unowned"]:
        bad.append(f"{where}: dropped, but {len(entry['unowned'])} tensor(s) have no cell")
    merged: dict[str, dict[str, Any]] = {}
    overlap = False
    for cell, share in sorted(entry["cells"].items()):
        if not (root / cell).resolve().is_relative_to(root / CELLS_DIR):
            bad.append(f"{where}: cell attempt {cell!r} lies outside {CELLS_DIR}/")
            continue
        if cell in claimed:
            bad.append(f"{cell}: a share of {claimed[cell]} and of {where}")
        claimed[cell] = where
        got = tensor_digests(run_dir / cell / OUTPUTS_FILE)
        if len(got) != share["tensors"] or content_digest(got) != share["content"]:
            bad.append(f"{cell}/{OUTPUTS_FILE}: not the {share['tensors']} tensor(s) the "
                       f"harness wrote ({where}: {len(got)} stored, content "
                       f"{content_digest(got)[:12]}, indexed {str(share['content'])[:12]})")
        overlap |= bool(set(got) & set(merged))
        merged.update(got)
    if overlap:
        bad.append(f"{where}: a tensor is in two cells")
    if not on_disk and not entry["unowned"] and (
            len(merged) != entry["tensors"] or content_digest(merged) != entry["content"]):
        bad.append(f"{where}: its cells together are not the file the harness wrote "
                   f"({len(merged)} of {entry['tensors']} tensor(s))")
    return bad
