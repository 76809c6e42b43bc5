"""Which code made a run: source digests at run start, and staleness against a checkout.

:func:`write_sources` records, in a run's ``sources.json`` (:data:`~qualify.layout.SOURCES_FILE`,
sealed and signed with the run), the sha256 of every source file a cell executes:

- ``qualify``: every ``qualify/**/*.py`` (the comparator, the stages, the evidence code);
- per engine: ``harnesses/<engine>/**/*.py`` plus ``harnesses/common.py`` and
  ``harnesses/__init__.py``, and the versions of the engine's distributions
  (:attr:`qualify.registry.EngineSpec.distributions`, read with :mod:`importlib.metadata`
  in the interpreter that runs the engine's ranks: qualify's own, or the one its
  ``QUALIFY_LAUNCHER_<ENGINE>`` names, asked once,
  :func:`qualify.candidate.interpreter.distribution_versions`; no engine is imported;
  ``null`` when not installed there);
- the contract's name and digest, and the gate policy's path and digest.

:func:`stale_cells` compares a run with a checkout. The authority for what a cell's harness
ran is the run-time record of its attempt (``imports.json``, :mod:`qualify.evidence.imports`:
every file its processes imported from the code root, a ``sitecustomize.py`` on the launch
path included, or from the distribution that provided a plugin engine); a cell made before
that record is checked against its engine's folder set above. Every cell is also checked
against ``qualify/`` (the stages around the harness), and inherits the staleness of every
cell whose outputs it consumed (:data:`CONSUMES`: a sampler cell that installed a trainer
cell's weights). A run without ``sources.json`` (made before it existed) cannot prove its
freshness, and every cell is STALE. Distribution versions are recorded for the reader but
not compared: the verifying machine (a CPU CI runner) need not have the engines installed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from qualify.contract import Contract
from qualify.digests import sha256_file
from qualify.errors import EvidenceIntegrityError, UsageError
from qualify.evidence import imports
from qualify.evidence.environment import package_versions
from qualify.evidence.sealed import atomic_write_bytes
from qualify.jsonio import read_json
from qualify.layout import IMPORTS_FILE, RUN_FILE, SOURCES_FILE
from qualify.resources import repo_root

__all__ = [
    "NOT_RECORDED",
    "QUALIFY_SET",
    "check_resume_sources",
    "consumed_cells",
    "engine_files",
    "sources_document",
    "stale_cells",
    "write_sources",
]

QUALIFY_SET: Final = "qualify"
"""The key of the qualification code's file set in ``sources.json``."""
NOT_RECORDED: Final = "sources not recorded: cannot prove freshness"
"""The stale reason of every cell of a run without ``sources.json``."""
CONSUMES: Final = ("weights_from", "resume_of")
"""``run.json`` cell fields that name a cell whose outputs this one consumed: a sampler
cell's ``weights_from`` (it installed that trainer cell's round-1 weights), a resume cell's
``resume_of`` (its rows compare it with that uninterrupted cell). A consumed cell's
staleness is the consumer's too (:func:`stale_cells`)."""
HARNESS_SHARED: Final = ("harnesses/__init__.py", "harnesses/common.py",
                         "harnesses/faults.py", "harnesses/hf_schedule.py",
                         "harnesses/layer_probe.py", "harnesses/resume_state.py")
"""Harness modules outside an engine's folder that engines import (``faults``: what their
test-only fault plugins share; ``hf_schedule``: the HF lr scheduler of torch_tp, fsdp2 and
DeepSpeed; ``layer_probe``: the probes of ``qualify diverge``, around every micro-batch of
torch_tp, DeepSpeed and Megatron; ``resume_state``: the resume cells' state record); each
engine's cells are stale when one changes (``tests/test_staleness.py`` derives the set from the
harnesses' imports)."""


def _digests(root: Path, rels: Iterable[str]) -> dict[str, str]:
    return {r: sha256_file(root / r) for r in sorted(set(rels)) if (root / r).is_file()}


def _py_under(root: Path, folder: str) -> list[str]:
    base = root / folder
    if not base.is_dir():
        return []
    return [p.relative_to(root).as_posix() for p in base.rglob("*.py")
            if "__pycache__" not in p.parts and p.is_file()]


def qualify_files(root: Path) -> dict[str, str]:
    """sha256 (hex) of every ``qualify/**/*.py`` below ``root``, by posix relative path."""
    return _digests(root, _py_under(root, "qualify"))


def engine_files(root: Path, engine: str) -> dict[str, str]:
    """sha256 of an engine's harness files, the shared harness modules and the harness SDK.

    That is ``harnesses/<engine>/**/*.py``, :data:`HARNESS_SHARED` and
    ``sdk/qualify_harness/**/*.py`` (which runs in every engine).
    """
    return _digests(root, [*_py_under(root, f"harnesses/{engine}"), *HARNESS_SHARED,
                           *_py_under(root, "sdk/qualify_harness")])


def _distributions(engine: str) -> dict[str, str | None]:
    """The engine's distributions' versions in the interpreter that runs its ranks.

    Raises:
        UsageError: ``QUALIFY_LAUNCHER_<ENGINE>`` is bad, or its interpreter cannot report
            them (:func:`qualify.candidate.interpreter.distribution_versions`).
    """
    from qualify import registry
    from qualify.candidate import interpreter

    try:
        names: Sequence[str] = registry.get_engine(engine).distributions
    except Exception:  # an engine this checkout no longer knows: nothing to read
        names = ()
    command = interpreter.engine_command(engine)
    if command is None or not names:
        return package_versions(list(names))
    from qualify.candidate.launch import launch_env

    return interpreter.distribution_versions(command, names, env=launch_env(None),
                                             what=interpreter.env_name(engine))


def contract_engines(contract: Contract) -> list[str]:
    """The trainer engines of the matrix, then the sampler's engine (if any)."""
    engines = list(contract.matrix.engines)
    if contract.sampler is not None and contract.sampler.engine not in engines:
        engines.append(contract.sampler.engine)
    return engines


def sources_document(contract: Contract, engines: Sequence[str] | None = None, *,
                     root: Path | None = None, policy: Path | None = None) -> dict[str, Any]:
    """The ``sources.json`` document for a run of ``contract``.

    Args:
        contract: the run's contract.
        engines: engines to record (default: :func:`contract_engines`).
        root: the code's root (default :func:`qualify.resources.repo_root`).
        policy: the gate policy file (default: :func:`qualify.evidence.policy.find_policy`).

    Raises:
        ContractError: the contract's gate policy file is invalid.
        UsageError: an engine's ``QUALIFY_LAUNCHER_<ENGINE>`` interpreter cannot report its
            distributions' versions.
    """
    from qualify.evidence.policy import find_policy, load_policy

    r = root if root is not None else repo_root()
    pol = policy if policy is not None else find_policy(contract)
    digest = load_policy(pol, contract).digest if pol is not None else None
    return {"schema_version": 1,
            "contract": {"name": contract.name, "digest": contract.digest},
            "policy": None if pol is None else {"path": str(pol), "digest": digest},
            QUALIFY_SET: {"files": qualify_files(r)},
            "engines": {e: {"files": engine_files(r, e), "distributions": _distributions(e)}
                        for e in (engines if engines is not None
                                  else contract_engines(contract))}}


def write_sources(run_dir: str | Path, engines: Sequence[str] | None = None, *,
                  contract: Contract, root: Path | None = None,
                  policy: Path | None = None) -> Path:
    """Write ``<run_dir>/sources.json`` (atomically; see :func:`sources_document`).

    Returns:
        The file written.

    Raises:
        ContractError: the contract's gate policy file is invalid.
        UsageError: an engine's ``QUALIFY_LAUNCHER_<ENGINE>`` interpreter cannot report its
            distributions' versions.
    """
    import json

    doc = sources_document(contract, engines, root=root, policy=policy)
    path = Path(run_dir) / SOURCES_FILE
    atomic_write_bytes(path, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())
    return path


def read_sources(run_dir: str | Path) -> dict[str, Any] | None:
    """A run's ``sources.json`` (``None`` when absent).

    Raises:
        EvidenceIntegrityError: the file is refused by :mod:`qualify.jsonio` or is not of
            the recorded shape.
    """
    path = Path(run_dir) / SOURCES_FILE
    if not path.exists() and not path.is_symlink():
        return None
    doc = read_json(path)
    ok = isinstance(doc, dict) and isinstance(doc.get(QUALIFY_SET), dict) \
        and isinstance(doc[QUALIFY_SET].get("files"), dict) \
        and isinstance(doc.get("engines"), dict)
    if not ok:
        raise EvidenceIntegrityError(f"{path}: not a sources record (qualify.files, engines)")
    return doc


def _diff(recorded: Mapping[str, Any], now: Mapping[str, str]) -> list[str]:
    out = []
    for rel in sorted(set(recorded) | set(now)):
        if rel not in now:
            out.append(f"{rel} (removed)")
        elif rel not in recorded:
            out.append(f"{rel} (added)")
        elif recorded[rel] != now[rel]:
            out.append(rel)
    return out


def _cell_entries(run_dir: Path) -> dict[str, dict[str, Any]]:
    doc = read_json(run_dir / RUN_FILE)
    cells = doc.get("cells", {}) if isinstance(doc, dict) else {}
    return {str(c): e for c, e in cells.items() if isinstance(e, dict)} \
        if isinstance(cells, dict) else {}


def _engine_of(cid: str, entry: Mapping[str, Any]) -> str:
    return str(entry.get("engine") or cid.split("-", 1)[0])


def _import_record(run_dir: Path, entry: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``imports.json`` of a cell's attempt (``None``: no attempt, or made before it)."""
    attempt = entry.get("attempt")
    if not isinstance(attempt, str) or not attempt:
        return None
    return imports.read_record(run_dir / attempt / IMPORTS_FILE)


def consumed_cells(entries: Mapping[str, Mapping[str, Any]], cid: str) -> list[str]:
    """The cells whose outputs ``cid`` consumed, followed transitively (``cid`` excluded).

    The edges are the ``run.json`` fields of :data:`CONSUMES` (a sampler cell's
    ``weights_from``: the trainer cell whose round-1 weights it installed; a resume cell's
    ``resume_of``: the uninterrupted cell its rows are compared with). In discovery order.
    """
    out: list[str] = []
    todo = [cid]
    while todo:
        entry = entries.get(todo.pop(0), {})
        for field in CONSUMES:
            src = entry.get(field)
            if isinstance(src, str) and src != cid and src not in out and src in entries:
                out.append(src)
                todo.append(src)
    return out


def stale_cells(run_dir: str | Path, checkout_root: str | Path | None = None
                ) -> dict[str, list[str]]:
    """The cells of a run whose executed sources differ from ``checkout_root``'s.

    A cell is STALE when

    - a ``qualify/**/*.py`` file differs from the run's ``sources.json`` (the code of the
      stages that staged its inputs and split its outputs);
    - its attempt's ``imports.json`` (the files its harness processes imported, recorded at
      run time; :mod:`qualify.evidence.imports`) names a file that changed, vanished, was
      modified during the launch or cannot be checked here, or, for a ``COMPLETE`` cell, a
      process that recorded nothing (:func:`qualify.evidence.imports.record_changes`: the
      ranks of a killed launch record nothing, and its cells are ``ERROR``, not STALE for
      that); a cell without that record (a run made before it, or a cell never launched) is
      checked against its engine's folder set of ``sources.json`` instead
      (:func:`engine_files`);
    - a cell whose outputs it consumed (:func:`consumed_cells`) is stale: each of that
      cell's lines is repeated as ``via <cell>: <line>``.

    Args:
        run_dir: a candidate run (``run.json``, ``sources.json``).
        checkout_root: the code to compare with (default :func:`~qualify.resources.repo_root`,
            the code this process runs).

    Returns:
        cell id -> changed files (``path``, ``path (added)``, ``path (removed)``, relative
        to the root, and the lines above); only stale cells appear. A run without
        ``sources.json`` gives every cell ``[NOT_RECORDED]``.

    Raises:
        EvidenceIntegrityError: ``run.json``, ``sources.json`` or an ``imports.json`` is
            refused or malformed.
        FileNotFoundError: the run has no ``run.json``.
    """
    return _Staleness.of(Path(run_dir), checkout_root).stale()


@dataclasses.dataclass(frozen=True)
class _Staleness:
    """What changed for each cell of a run, before it is propagated to its consumers.

    ``entries``: ``run.json``'s cells; ``common``: the changed ``qualify`` files; ``own``: cell
    id -> its own changed files (:func:`stale_cells`' first two rules); ``recorded``: the
    cells judged by their attempt's ``imports.json`` (launched), not by their engine's set.
    """

    entries: dict[str, dict[str, Any]]
    common: list[str]
    own: dict[str, list[str]]
    recorded: frozenset[str]

    @classmethod
    def of(cls, rd: Path, checkout_root: str | Path | None) -> _Staleness:
        root = Path(checkout_root) if checkout_root is not None else repo_root()
        entries = _cell_entries(rd)
        doc = read_sources(rd)
        if doc is None:
            return cls(entries, [], {c: [NOT_RECORDED] for c in entries}, frozenset())
        common = _diff(doc[QUALIFY_SET]["files"], qualify_files(root))
        per_engine: dict[str, list[str]] = {}
        cache: dict[str, Any] = {}
        own: dict[str, list[str]] = {}
        recorded: set[str] = set()
        for cid, entry in entries.items():
            record = _import_record(rd, entry)
            if record is not None:
                own[cid] = imports.record_changes(
                    record, root, cache, completed=entry.get("status") == "COMPLETE")
                recorded.add(cid)
                continue
            engine = _engine_of(cid, entry)
            if engine not in per_engine:
                rec = doc["engines"].get(engine)
                if not isinstance(rec, dict) or not isinstance(rec.get("files"), dict):
                    per_engine[engine] = [f"sources of engine {engine} not recorded"]
                else:
                    per_engine[engine] = _diff(rec["files"], engine_files(root, engine))
            own[cid] = per_engine[engine]
        return cls(entries, common, own, frozenset(recorded))

    def stale(self, skip: frozenset[str] = frozenset()) -> dict[str, list[str]]:
        """:func:`stale_cells`' result, leaving out the cells ``skip`` and lines via them."""
        out: dict[str, list[str]] = {}
        for cid in self.entries:
            if cid in skip:
                continue
            own = self.own[cid]
            via = [f"via {src}: {line}" for src in consumed_cells(self.entries, cid)
                   if src not in skip for line in self.own[src]]
            changed = own + [c for c in self.common if c not in own] + via
            if changed:
                out[cid] = changed
        return out


def recorded_policy_digest(run_dir: str | Path) -> tuple[bool, str | None]:
    """``(recorded, digest)`` of the gate policy a run recorded at its start.

    ``recorded`` is False for a run without ``sources.json``; ``digest`` is ``None`` when
    the run's contract had no policy file then.

    Raises:
        EvidenceIntegrityError: ``sources.json`` is refused or malformed.
    """
    doc = read_sources(run_dir)
    if doc is None:
        return False, None
    pol = doc.get("policy")
    return True, (str(pol["digest"]) if isinstance(pol, dict) and pol.get("digest") else None)


def check_resume_sources(run_dir: str | Path, root: Path | None = None) -> None:
    """Refuse to resume a run whose recorded sources differ from the code now.

    A run without ``sources.json`` is not checked (it predates the record). Checked, as
    :func:`stale_cells` judges them: the ``qualify`` files (the run's own staging and
    splitting code) and every cell but those a resume launches again with their own record,
    the cells not ``COMPLETE`` whose attempt has an ``imports.json``; nor does a cell that
    consumed one's outputs inherit its lines. Such a cell's next attempt records what it
    imports then (a cell cancelled mid-import, its ranks unrecorded, would otherwise turn an
    interrupted run that can be resumed into one that is superseded). A cell without that
    record (never launched: ``NOT_RUN`` with no attempt) stays judged by its engine's files,
    as the gate judges it after the resume.

    Raises:
        UsageError: (exit 2) one line: ``sources changed since run X began: start a new
            --run-id`` with the first changed files.
    """
    rd = Path(run_dir)
    if not (rd / SOURCES_FILE).is_file():
        return
    st = _Staleness.of(rd, root)
    again = frozenset(cid for cid in st.recorded
                      if st.entries[cid].get("status") != "COMPLETE")
    files = sorted(set(st.common).union(*st.stale(skip=again).values()))
    if files:
        more = f" (and {len(files) - 3} more)" if len(files) > 3 else ""
        raise UsageError(f"{rd / SOURCES_FILE}: sources changed since run {rd.name} began "
                         f"({', '.join(files[:3])}{more}): start a new --run-id")
