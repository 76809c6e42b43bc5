"""What a launch's harness processes imported: collected, hashed, and checked against code.

Each harness process of a launch writes the files it imported when it ends
(:mod:`qualify.candidate.imported`, into ``<attempt>/logs/imports/``). :func:`collect`, run
by the launcher once the launch is over, turns those lists into the attempt's
``imports.json`` (:data:`~qualify.layout.IMPORTS_FILE`, schema ``imports.schema.json``) and
removes them. A file is kept when it is

- under the code root (:func:`qualify.resources.repo_root`, a checkout: any file there,
  a ``sitecustomize.py`` at the root on the launch's ``PYTHONPATH`` included, but not the
  interpreter's own prefix or site-packages should they lie inside it; a wheel install:
  its ``qualify/`` and ``harnesses/`` only): ``checkout``, by posix path relative to it;
- a file of the distribution that provided the engine's harness module (a plugin
  installed from outside this repository; :func:`engine_distributions`): under
  ``distributions``, with the distribution's version, by its path in the distribution's
  ``RECORD``. When the ranks ran in another interpreter (a venv or a container,
  :mod:`qualify.candidate.interpreter`; its processes' records name their own
  ``prefixes`` and ``sys_path``), the distribution is looked up on that interpreter's
  ``sys_path``, and its entry also names the ``site`` directory it was found in, where
  :func:`record_changes` looks for it again; the launch's ``interpreter`` entry names that
  interpreter and the versions of every distribution there whose modules the ranks
  imported (torch, transformers: qualify's own environment record cannot see them).
  Files of that interpreter's own trees are
  never ``checkout`` files, even when the venv lies inside the checkout. A plugin of
  another interpreter installed in editable mode from this checkout (``examples/``) is
  ``checkout`` code like any file there.

Files of other installed packages (torch, transformers, the engines' upstream libraries)
are not hashed: their versions are in the environment record. Each kept file's sha256 is
taken here, after the launch; a file whose mtime is later than the launch's start is listed
in ``modified_during_launch`` (what ran cannot be told from what is on disk). The top-level
names the processes imported (and ``sitecustomize`` / ``usercustomize``) are kept too: a
module file of such a name added at the code root later would shadow what ran. A process
that wrote no record (killed, or a harness that never called
:func:`qualify.candidate.imported.install`) shows as ``ranks_recorded`` short of
``processes_expected``.

:func:`record_changes` checks a record against a checkout (and the installed
distributions): the changed, removed and unverifiable files, which
:func:`qualify.evidence.sources.stale_cells` reports as the cell's staleness.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any, Final

from qualify import atomic, schema
from qualify.digests import sha256_file
from qualify.errors import EvidenceIntegrityError
from qualify.jsonio import read_json
from qualify.layout import IMPORTS_FILE, IMPORTS_RAW_DIR, LOGS_DIR
from qualify.resources import is_checkout, repo_root

__all__ = ["collect", "engine_distributions", "inherit", "merge_records", "raw_dir",
           "read_record", "record_changes"]

SCHEMA: Final = "imports"


def raw_dir(attempt_dir: Path) -> Path:
    """Where the processes of a launch into ``attempt_dir`` write their lists."""
    return attempt_dir / LOGS_DIR / IMPORTS_RAW_DIR


def _foreign(raw: Sequence[Mapping[str, Any]]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(prefixes, sys_path)`` of the records made by another interpreter (else empty).

    A record is another interpreter's when it names ``prefixes`` other than this one's
    (:func:`_env_prefixes`); records made before those fields carry none (this one's).
    """
    ours = {p.rstrip(os.sep) for p in _env_prefixes()}
    prefixes: dict[str, None] = {}
    path: dict[str, None] = {}
    for doc in raw:
        theirs = [str(p) for p in doc.get("prefixes") or () if isinstance(p, str)]
        if theirs and set(theirs) != ours:
            prefixes.update(dict.fromkeys(os.path.realpath(p) + os.sep for p in theirs))
            path.update(dict.fromkeys(str(p) for p in doc.get("sys_path") or ()
                                      if isinstance(p, str) and p))
    return tuple(prefixes), tuple(path)


def _top_levels_on(path: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """Top-level module name -> {distribution: version} of the distributions on ``path``.

    ``path``: another interpreter's ``sys.path``; each distribution's ``top_level.txt``
    and the first part of each file it installed (what
    :func:`importlib.metadata.packages_distributions` reads, for a foreign path).
    """
    out: dict[str, dict[str, str]] = {}
    for dist in importlib.metadata.distributions(path=list(path)):
        name = dist.metadata["Name"]
        if not name:
            continue
        names = set((dist.read_text("top_level.txt") or "").split())
        for rel in dist.files or ():
            parts = Path(str(rel)).parts
            if len(parts) > 1 and not parts[0].endswith((".dist-info", ".data")):
                names.add(parts[0])
            elif parts and parts[0].endswith(".py"):
                names.add(parts[0][:-3])
        for top in names:
            out.setdefault(top, {}).setdefault(str(name), str(dist.version))
    return out


def _env_prefixes() -> tuple[str, ...]:
    """The interpreter's own trees (a ``.venv`` inside the checkout is not code of it)."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return tuple({os.path.realpath(d) + os.sep for d in dirs})


def _own_roots(root: Path) -> tuple[str, ...]:
    base = os.path.realpath(root)
    if is_checkout() or root != repo_root():
        return (base + os.sep,)
    return tuple(os.path.join(base, pkg) + os.sep for pkg in ("qualify", "harnesses"))


def engine_distributions(module: str, root: Path | None = None) -> tuple[str, ...]:
    """The distributions that provide ``module``'s top-level package, when not under ``root``.

    A built-in harness (``harnesses.torch_tp.harness``, under the code root) has none, nor
    has a module this process cannot find; a plugin's harness module, the distribution(s)
    whose files hold its package (:func:`importlib.metadata.packages_distributions`, read
    once per ``sys.path``). Nothing is imported.
    """
    top = module.split(".", 1)[0].split(":", 1)[0]
    base = os.path.realpath(root if root is not None else repo_root()) + os.sep
    spec = None
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec(top)
    if spec is None:  # not importable here: no installed distribution provides it
        return ()
    origins = [*(spec.submodule_search_locations or []), spec.origin]
    if any(isinstance(o, str) and os.path.realpath(o).startswith(base) for o in origins):
        return ()
    return _providers(top, tuple(sys.path))


@functools.lru_cache(maxsize=64)
def _providers(top: str, _path: tuple[str, ...]) -> tuple[str, ...]:
    """The distributions whose files hold top-level package ``top`` (one scan per path)."""
    return tuple(sorted(set(importlib.metadata.packages_distributions().get(top, []))))


def _find_distribution(name: str, site: str | None = None
                       ) -> importlib.metadata.Distribution | None:
    """The installed distribution ``name``: in this interpreter, or in directory ``site``."""
    if site is None:
        try:
            return importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            return None
    return next(iter(importlib.metadata.distributions(name=name, path=[site])), None)


def _distribution_files(name: str, path: tuple[str, ...] | None = None
                        ) -> tuple[str, dict[str, str], str | None] | None:
    """``(version, path -> RECORD path, site)`` of an installed distribution, or ``None``.

    Each file is listed by its absolute and its resolved path. ``path``: another
    interpreter's ``sys_path`` to find it on (``site``: the directory it was found in);
    ``None``: this interpreter's (``site`` is ``None``).
    """
    site: str | None = None
    if path is None:
        dist = _find_distribution(name)
    else:
        dist = next(iter(importlib.metadata.distributions(name=name, path=list(path))), None)
        if dist is not None:
            site = os.path.abspath(str(dist.locate_file("")))
    if dist is None:
        return None
    files = {}
    for rel in dist.files or ():
        where = str(dist.locate_file(rel))
        for key in (os.path.abspath(where), os.path.realpath(where)):
            files[key] = Path(str(rel)).as_posix()
    return str(dist.version), files, site


def _read_raw(folder: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads(path.read_text("utf-8"))
            if isinstance(doc, dict) and isinstance(doc.get("files"), list):
                out.append(doc)
    return out


def collect(attempt_dir: Path, *, module: str, expected: int, started_ns: int,
            label: str | None = None, root: Path | None = None) -> dict[str, Any]:
    """Turn a launch's per-process lists into ``<attempt_dir>/imports.json``; the document.

    Args:
        attempt_dir: the launch attempt (its ``logs/imports/`` is read, then removed).
        module: the harness module the launch ran (which distribution is the engine's,
            :func:`engine_distributions`).
        expected: the processes the launch started (its world size).
        started_ns: ``time.time_ns()`` taken before the launch started.
        label: the launch's name in the record (default ``<launch>/<attempt>``).
        root: the code root (default :func:`qualify.resources.repo_root`).

    Raises:
        OSError: the record cannot be written.
    """
    base = root if root is not None else repo_root()
    raw = _read_raw(raw_dir(attempt_dir))
    real_base = os.path.realpath(base)
    own = _own_roots(base)
    foreign_prefixes, foreign_path = _foreign(raw)
    env = tuple(p for p in (*_env_prefixes(), *foreign_prefixes)
                if p.startswith(real_base + os.sep))
    interpreter: dict[str, Any] | None = None
    if foreign_path:
        top = module.split(".", 1)[0].split(":", 1)[0]
        tops = _top_levels_on(foreign_path)
        dists = {d: f for d in sorted(tops.get(top, {}))
                 if (f := _distribution_files(d, foreign_path)) is not None}
        imported_tops = {str(n) for d in raw for n in d.get("modules") or ()}
        interpreter = {
            "executables": sorted({str(d["executable"]) for d in raw
                                   if isinstance(d.get("executable"), str)}),
            "packages": dict(sorted((dist, version) for t in imported_tops
                                    for dist, version in tops.get(t, {}).items()))}
    else:
        dists = {d: f for d in engine_distributions(module, base)
                 if (f := _distribution_files(d)) is not None}
    by_path = {p: (d, rel) for d, (_, files, _) in dists.items() for p, rel in files.items()}
    dist_roots = tuple({os.path.dirname(p) + os.sep for p in by_path})
    plain_base = os.path.abspath(base) + os.sep
    checkout: dict[str, str] = {}
    in_dists: dict[str, dict[str, str]] = {d: {} for d in dists}
    modified: set[str] = set()
    for path in sorted({str(f) for doc in raw for f in doc["files"]}):
        if not path.startswith((*own, plain_base, *dist_roots)):
            continue  # neither the code nor the engine's distribution (a cheap test first)
        real = os.path.realpath(path)
        if real.startswith(own) and not real.startswith(env):
            name, bucket = Path(os.path.relpath(real, real_base)).as_posix(), checkout
        elif real in by_path or path in by_path:
            dist, name = by_path.get(real) or by_path[path]
            bucket = in_dists[dist]
        else:
            continue
        if not name.isprintable():  # kept, escaped: no such file, so the cell is stale
            name = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in name)
        try:
            stat = os.stat(real)
            bucket[name] = sha256_file(real)
        except OSError:
            modified.add(name)  # gone before it could be hashed: not what ran
            continue
        if stat.st_mtime_ns > started_ns:
            modified.add(name)
    ranks = sorted({int(d["rank"]) for d in raw if isinstance(d.get("rank"), int)})
    names = sorted({str(n) for d in raw for n in d.get("modules") or () if str(n).isidentifier()})
    doc = {"schema_version": 1, "launches": [{
        "launch": label or f"{attempt_dir.parent.name}/{attempt_dir.name}",
        "processes_expected": max(1, expected),
        "ranks_recorded": ranks if ranks else list(range(min(len(raw), max(1, expected)))),
        "processes_recorded": len(raw),
        "checkout": checkout,
        "distributions": {d: {"version": v, "files": in_dists[d],
                              **({"site": site} if site is not None else {})}
                          for d, (v, _, site) in dists.items()},
        "modified_during_launch": sorted(modified), "top_level": names,
        **({"interpreter": interpreter} if interpreter is not None else {})}]}
    schema.validate(doc, SCHEMA, what=str(attempt_dir / IMPORTS_FILE))
    atomic.write_json(attempt_dir / IMPORTS_FILE, doc)
    shutil.rmtree(raw_dir(attempt_dir), ignore_errors=True)
    return doc


def merge_records(docs: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One record holding every launch of ``docs`` (a cell that consumed several launches)."""
    return {"schema_version": 1,
            "launches": [launch for doc in docs for launch in doc["launches"]]}


def inherit(cell_attempt: Path, launches: Sequence[Path]) -> dict[str, Any] | None:
    """Write ``<cell_attempt>/imports.json``: the records of the launch attempts it consumed.

    Args:
        cell_attempt: a cell's attempt directory (before it is sealed).
        launches: the launch attempts whose outputs (or checkpoint) the cell holds; those
            without ``imports.json`` are skipped.

    Returns:
        The merged record, or ``None`` (none of them has one: nothing is written).

    Raises:
        EvidenceIntegrityError: a launch's record is malformed.
        OSError: the record cannot be written.
    """
    records = [r for a in launches if (r := read_record(a / IMPORTS_FILE)) is not None]
    if not records:
        return None
    doc = merge_records(records)
    atomic.write_json(cell_attempt / IMPORTS_FILE, doc)
    return doc


def read_record(path: Path) -> dict[str, Any] | None:
    """An ``imports.json`` (``None`` when absent).

    Raises:
        EvidenceIntegrityError: refused by :mod:`qualify.jsonio` or not of the schema.
    """
    if not os.path.lexists(path):
        return None
    doc = read_json(path)
    problem = schema.first_error(doc, SCHEMA)
    if problem is not None:
        raise EvidenceIntegrityError(f"{path}: {problem} (schema {SCHEMA}.schema.json)")
    assert isinstance(doc, dict)
    return doc


def _digest(path: Path, cache: MutableMapping[str, Any]) -> str | None:
    key = str(path)
    if key not in cache:
        try:
            cache[key] = sha256_file(path) if path.is_file() else None
        except OSError:
            cache[key] = None
    found: str | None = cache[key]
    return found


def _shadows(root: Path, name: str, cache: MutableMapping[str, Any]) -> list[str]:
    """Files at ``root`` that ``import name`` would find first (``root`` leads the path)."""
    key = f"shadows:{root}:{name}"
    if key not in cache:
        suffixes = importlib.machinery.all_suffixes()
        cands = [f"{name}{s}" for s in suffixes] + [f"{name}/__init__{s}" for s in suffixes]
        cache[key] = [c for c in cands if (root / c).is_file()]
    found: list[str] = cache[key]
    return found


def record_changes(doc: Mapping[str, Any], root: Path,
                   cache: MutableMapping[str, Any] | None = None, *,
                   completed: bool = True) -> list[str]:
    """What in ``doc`` differs from the code at ``root`` and the installed distributions.

    Args:
        doc: an ``imports.json`` document (:func:`read_record`).
        root: the checkout the ``checkout`` files are compared with.
        cache: shared between calls (path -> sha256, ``None``: not a file; the files that
            shadow a name).
        completed: the cell is ``COMPLETE`` (its ``run.json`` status). A cell that is not
            (its launch killed or crashed, its outputs refused) is ``ERROR`` whatever ran, and
            a killed launch leaves ranks that recorded nothing, so no "imports not recorded"
            line is given for it; a file that changed is still given.

    Returns:
        One line per problem, sorted: ``path`` (changed), ``path (removed)``, ``path
        (modified during launch L)``, ``dist: path`` / ``dist: path (removed)`` for a
        plugin's files (looked up in its recorded ``site`` when it ran in another
        interpreter), ``dist not installed here: N imported files cannot be checked``,
        ``path (added on the launch path)`` (a module file now at ``root`` under a
        top-level name the processes imported or ``site`` probed, ``sitecustomize``: it
        would shadow what ran), and ``imports not recorded by ranks ... of launch L:
        cannot prove freshness``.
    """
    memo: MutableMapping[str, Any] = cache if cache is not None else {}
    out: set[str] = set()
    for launch in doc["launches"]:
        label = launch["launch"]
        for rel, sha in launch["checkout"].items():
            now = _digest(root / rel, memo)
            if now != sha:
                out.add(f"{rel} (removed)" if now is None else rel)
        for dist, rec in launch["distributions"].items():
            site = rec.get("site")
            installed = _find_distribution(dist, site)
            if installed is None:
                where = f" (in {site})" if site else ""
                out.add(f"{dist} not installed here{where}: {len(rec['files'])} imported "
                        f"files cannot be checked")
                continue
            for rel, sha in rec["files"].items():
                now = _digest(Path(str(installed.locate_file(rel))), memo)
                if now != sha:
                    out.add(f"{dist}: {rel}" + (" (removed)" if now is None else ""))
        out.update(f"{rel} (modified during launch {label})"
                   for rel in launch["modified_during_launch"])
        out.update(f"{rel} (added on the launch path)"
                   for name in launch.get("top_level", ())
                   for rel in _shadows(root, name, memo) if rel not in launch["checkout"])
        missing = sorted(set(range(launch["processes_expected"]))
                         - set(launch["ranks_recorded"]))
        if missing and completed:
            out.add(f"imports not recorded by rank(s) {', '.join(map(str, missing))} of "
                    f"launch {label}: cannot prove freshness")
    return sorted(out)
