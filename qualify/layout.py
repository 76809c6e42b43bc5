"""Every file and directory name of a reference, a run and an attempt, written once.

Also the typed ``run.json`` document (:class:`RunDocument`) and the one reference
resolver (:func:`resolve_reference`) that ``compare``, ``verify``, ``gate`` and ``audit``
all use. The names are on-disk protocol: changing one breaks every sealed directory
made before, so they only ever grow.

A reference directory (``references/<contract>-<digest12>/``)::

    MANIFEST.json  attestation.dsse.json  reference.json  contract.json  bounds.json
    control_errors.json  environment.json  rollout.safetensors  rollout.json
    targets.safetensors  scores/  updates/  controls/  branches.json  branches/  model/

A run directory (``evidence/<contract>/<run-id>/``)::

    MANIFEST.json  attestation.dsse.json  run.json  report.json  report.md  environment.json
    inputs/  launches/<launch-id>/attempt-N/  cells/<cell-id>/attempt-N/

An attempt directory holds the harness protocol's files (:mod:`qualify.protocol`:
``cell.json``, ``outputs.safetensors``, ``outputs.json``), ``result.json``, ``logs/``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Protocol

from qualify import registry, schema
from qualify.digests import sha256_file
from qualify.errors import ReferenceDataError
from qualify.protocol import (
    CELL_FILE,
    CONTRACT_FILE,
    MODEL_FILE,
    OUTPUTS_FILE,
    OUTPUTS_META_FILE,
    ROLLOUT_FILE,
    ROLLOUT_META_FILE,
    TRAIN_INPUTS_FILE,
)

__all__ = [
    "ATTEMPT_PREFIX",
    "ATTESTATION_FILE",
    "ATTESTATION_SUFFIX",
    "BOUNDS_FILE",
    "BRANCHES_DIR",
    "BRANCHES_FILE",
    "CELLS_DIR",
    "CELL_FILE",
    "CONTRACT_FILE",
    "CONTRACT_TOML_FILE",
    "CONTROLS_DIR",
    "CONTROL_ERRORS_FILE",
    "COVERAGE_FILE",
    "ENVIRONMENT_FILE",
    "GATES_DIR",
    "HF_REFERENCE_DIR",
    "IMPORTS_FILE",
    "IMPORTS_RAW_DIR",
    "INCOMPLETE_FILE",
    "INCOMPLETE_INFIX",
    "INPUTS_DIR",
    "LAUNCHER_LOG",
    "LAUNCHES_DIR",
    "LOGS_DIR",
    "MANIFEST_FILE",
    "MODEL_FILE",
    "OUTPUTS_FILE",
    "OUTPUTS_META_FILE",
    "RANK_LOGS_DIR",
    "REFERENCES_DIR",
    "REFERENCE_FILE",
    "REPORT_JSON",
    "REPORT_MD",
    "RESULT_FILE",
    "ROLLOUT_FILE",
    "ROLLOUT_META_FILE",
    "ROUND_TO_ROUND_FILE",
    "ROUND_TO_ROUND_TENSORS_FILE",
    "RUN_FILE",
    "SCORES_DIR",
    "SOURCES_FILE",
    "SUPERSEDED_FILE",
    "TARGETS_FILE",
    "TENSOR_INDEX_FILE",
    "TRAIN_INPUTS_FILE",
    "WRITTEN_MARKS",
    "RunDocument",
    "RunReference",
    "hf_tensors_file",
    "reference_dir_name",
    "resolve_reference",
]

# --- every sealed directory
MANIFEST_FILE: Final = "MANIFEST.json"
"""The manifest at the top of a sealed directory (written last)."""
INCOMPLETE_FILE: Final = "INCOMPLETE"
"""The marker of a directory being written (removed right before the manifest)."""
INCOMPLETE_INFIX: Final = ".incomplete-"
"""An interrupted directory moved aside is named ``<name>.incomplete-<UTC stamp>``."""
ATTESTATION_FILE: Final = "attestation.dsse.json"
"""The directory's signed attestation (DSSE envelope), added after sealing."""
ATTESTATION_SUFFIX: Final = ".dsse.json"
"""Suffix of attestation files (excluded from the manifest they sign)."""
ENVIRONMENT_FILE: Final = "environment.json"
"""Package versions, git state, hardware, source digests of the process that wrote it."""

# --- a reference
REFERENCES_DIR: Final = "references"
"""The folder of sealed references (beside ``evidence/`` in a checkout)."""
DISTRIBUTION_FILE: Final = "distribution.safetensors"
"""The reference's next-token distributions (:mod:`qualify.reference.distribution`)."""
DISTRIBUTION_JSON: Final = "distribution.json"
"""Their controls, ceilings and routes (:mod:`qualify.reference.distribution`)."""
REFERENCE_FILE: Final = "reference.json"
BOUNDS_FILE: Final = "bounds.json"
CONTROL_ERRORS_FILE: Final = "control_errors.json"
ROUND_TO_ROUND_FILE: Final = "round_to_round.json"
"""The bound rule's round-to-round responses (:mod:`qualify.reference.round_to_round`)."""
ROUND_TO_ROUND_TENSORS_FILE: Final = "round_to_round.safetensors"
"""The per-token round-to-round responses, ``<lane>/round<r>/<role>/<family>`` ``[B, R]``
FP64 (:func:`qualify.reference.round_to_round.round_to_round_tensors`)."""
SCORES_DIR: Final = "scores"
CONTROLS_DIR: Final = "controls"
BRANCHES_DIR: Final = "branches"
BRANCHES_FILE: Final = "branches.json"
COVERAGE_FILE: Final = "coverage.json"
"""What the contract's rules exercise on the frozen data (:mod:`qualify.reference.coverage`)."""

# --- a run
RUN_FILE: Final = "run.json"
REPORT_JSON: Final = "report.json"
REPORT_MD: Final = "report.md"
WRITTEN_MARKS: Final = (RUN_FILE, REPORT_JSON, REFERENCE_FILE, BOUNDS_FILE)
"""Files at the top of a run or reference that only qualify writes: with one of them, a
directory without ``MANIFEST.json`` or ``INCOMPLETE`` is an interrupted (or stripped) one, not
a folder qualify never wrote (:func:`qualify.evidence.store.seal` removes the marker just
before it writes the manifest)."""
INPUTS_DIR: Final = "inputs"
LAUNCHES_DIR: Final = "launches"
CELLS_DIR: Final = "cells"

# --- an attempt
ATTEMPT_PREFIX: Final = "attempt-"
RESULT_FILE: Final = "result.json"
LOGS_DIR: Final = "logs"
RANK_LOGS_DIR: Final = "ranks"
"""Per-rank logs of a launch, under ``logs/``."""
LAUNCHER_LOG: Final = "launcher.log"
"""The launcher's (warm launcher's or torchrun's) combined stdout / stderr, under ``logs/``."""
TENSOR_INDEX_FILE: Final = "tensor_index.json"
"""A launch attempt's record of the outputs its harness wrote and the cells that hold them
(:mod:`qualify.evidence.tensor_index`): each tensor is stored once, in its cell."""


def _field(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str,
           *, optional: bool = False) -> Any:
    value = doc.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ReferenceDataError(f"{where}: {key}: expected {want}, found {value!r:.60}")
    return value


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunReference:
    """The sealed reference a run was made against (``run.json`` -> ``reference``).

    Attributes:
        path: the reference directory as the candidate stage saw it (absolute, usually).
        manifest_digest: sha256 (hex) of the reference's ``MANIFEST.json`` bytes.
        sealed: the reference's seal time (ISO-8601 UTC), when known.
    """

    path: str
    manifest_digest: str
    sealed: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (as ``run.json`` has it)."""
        return {"path": self.path, "manifest_digest": self.manifest_digest,
                "sealed": self.sealed}


@dataclasses.dataclass(slots=True, kw_only=True)
class RunDocument:
    """``run.json``: the candidate run's index, rewritten atomically after each launch.

    Mutable on purpose (the candidate stage fills ``cells`` as launches finish); every
    field is type-checked when read (:meth:`from_dict`), so a hand-edited document fails
    with the field named, never deep inside the comparator.

    Attributes:
        contract: contract name.
        contract_digest: sha256 of the canonical contract (hex).
        reference: the sealed reference it ran against.
        run_id: the run's directory name.
        started: ISO-8601 UTC.
        finished: ISO-8601 UTC once every selected cell has an entry, else None.
        faults: deliberate faults switched on (test suite only).
        cells: cell id -> entry (``engine``, ``precision``, ``options``, ``role``, ``tp``,
            ``status``, ``reason``, ``attempt``; sampler cells add ``weights_from``).
        schema_version: 1.
        selection: the ``--cells`` globs of the invocation that started the run (``None``:
            every cell); meaningful only when ``selection_recorded`` (runs made before the
            field existed did not record it, and a plain rerun never resumes them).
        selection_recorded: ``run.json`` holds the ``selection`` key.
        resumed: when each later invocation resumed the run (ISO-8601 UTC, in order).
        supersedes: the interrupted runs this run supersedes, one
            ``{run_id, reason, marker_sha256}`` each: the sha256 (hex) of the
            ``superseded.json`` bytes in that run (:mod:`qualify.evidence.supersede`); sealed
            and signed with this run, so a marker no signed run confirms is refused.
    """

    contract: str
    contract_digest: str
    reference: RunReference
    run_id: str
    started: str
    finished: str | None = None
    faults: list[str] = dataclasses.field(default_factory=list)
    cells: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    schema_version: int = 1
    selection: list[str] | None = None
    selection_recorded: bool = False
    resumed: list[str] = dataclasses.field(default_factory=list)
    supersedes: list[dict[str, str]] = dataclasses.field(default_factory=list)

    @classmethod
    def from_dict(cls, doc: Any, *, where: str = RUN_FILE) -> RunDocument:
        """Read and check a ``run.json`` value against ``run.schema.json`` and the registry.

        ``schema_version`` 1 only, a ``run_id`` that is one safe path component, ISO-8601
        ``started`` / ``finished`` / ``reference.sealed``, 64-hex digests, cell ids of the
        matrix's form, known statuses, and every ``engine`` a registered one.

        Raises:
            ReferenceDataError: a field is missing, of the wrong type or off its schema, or
                an engine is not registered (named with ``where`` and the field).
        """
        if not isinstance(doc, Mapping):
            raise ReferenceDataError(f"{where}: expected a JSON object")
        ref = _field(doc, "reference", Mapping, where)
        rw = f"{where}: reference"
        cells = _field(doc, "cells", Mapping, where)
        for cid, entry in cells.items():
            ew = f"{where}: cells.{cid}"
            if not isinstance(entry, Mapping):
                raise ReferenceDataError(f"{ew}: expected an object")
            _field(entry, "status", str, ew)
            if "tp" in entry:
                _field(entry, "tp", int, ew)
            _field(entry, "attempt", str, ew, optional=True)
        faults = _field(doc, "faults", list, where) if "faults" in doc else []
        selection = _field(doc, "selection", list, where, optional=True)
        resumed = _field(doc, "resumed", list, where) if "resumed" in doc else []
        supersedes = _field(doc, "supersedes", list, where) if "supersedes" in doc else []
        for i, sup in enumerate(supersedes):
            sw = f"{where}: supersedes.{i}"
            if not isinstance(sup, Mapping):
                raise ReferenceDataError(f"{sw}: expected an object")
            for key in ("run_id", "reason", "marker_sha256"):
                _field(sup, key, str, sw)
        run = cls(
            schema_version=_field(doc, "schema_version", int, where),
            contract=_field(doc, "contract", str, where),
            contract_digest=_field(doc, "contract_digest", str, where),
            reference=RunReference(path=_field(ref, "path", str, rw),
                                   manifest_digest=_field(ref, "manifest_digest", str, rw),
                                   sealed=_field(ref, "sealed", str, rw, optional=True)),
            run_id=_field(doc, "run_id", str, where),
            started=_field(doc, "started", str, where),
            finished=_field(doc, "finished", str, where, optional=True),
            faults=[str(f) for f in faults],
            cells={str(k): dict(v) for k, v in cells.items()},
            selection=None if selection is None else [str(g) for g in selection],
            selection_recorded="selection" in doc,
            resumed=[str(t) for t in resumed],
            supersedes=[{k: str(sup[k]) for k in ("run_id", "reason", "marker_sha256")}
                        for sup in supersedes],
        )
        schema.validate(doc, "run", what=where, error=ReferenceDataError)
        for cid, entry in run.cells.items():
            if "engine" in entry and entry["engine"] not in registry.ENGINES:
                raise ReferenceDataError(f"{where}: cells.{cid}.engine: "
                                         f"{registry.ENGINES.unknown_message(entry['engine'])}")
        return run

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; ``finished`` is absent until the run finished (as before typing)."""
        out: dict[str, Any] = {
            "schema_version": self.schema_version, "contract": self.contract,
            "contract_digest": self.contract_digest, "reference": self.reference.to_dict(),
            "run_id": self.run_id, "started": self.started, "faults": list(self.faults),
            "cells": self.cells}
        if self.finished is not None:
            out["finished"] = self.finished
        if self.selection_recorded:
            out["selection"] = self.selection
        if self.resumed:
            out["resumed"] = list(self.resumed)
        if self.supersedes:
            out["supersedes"] = [dict(sup) for sup in self.supersedes]
        return out


class _NamedContract(Protocol):
    """What :func:`reference_dir_name` reads of a :class:`qualify.contract.Contract`."""

    @property
    def name(self) -> str: ...

    @property
    def digest12(self) -> str: ...


def reference_dir_name(contract: _NamedContract) -> str:
    """A contract's reference directory name: ``<contract name>-<digest12>``."""
    return f"{contract.name}-{contract.digest12}"


def resolve_reference(run_dir: str | Path, run: RunDocument | Mapping[str, Any],
                      given: str | Path | None = None) -> Path:
    """Find the sealed reference a candidate run names: the one resolver of qualify.

    Order: ``given``; ``run.json``'s ``reference.path`` when relative, to the run directory;
    a directory under a ``references/`` folder beside an ancestor of the run (nearest
    first) whose ``MANIFEST.json`` sha256 is ``reference.manifest_digest``; the recorded
    path itself (absolute, or relative to the working directory); else a directory of the
    recorded name under such a ``references/`` folder. A copy beside the evidence comes
    before the recorded absolute path: a checkout audits its own committed reference, not
    whatever another checkout holds at the path the run was made under (a clone of an
    older commit gated its run against a reference re-signed in the checkout at that
    path). Whether the found directory is sealed and intact is the caller's check.

    Args:
        run_dir: the run directory.
        run: its ``run.json`` (typed, or the raw mapping).
        given: an explicit reference directory (``--reference``).

    Returns:
        The reference directory (not yet checked).

    Raises:
        ReferenceDataError: none is found.
    """
    if given is not None:
        return Path(given)
    rd = Path(run_dir)
    if isinstance(run, RunDocument):
        raw: Any = run.reference.path
        want: Any = run.reference.manifest_digest
    else:
        ref = run.get("reference")
        ref = ref if isinstance(ref, Mapping) else {}
        raw, want = ref.get("path"), ref.get("manifest_digest")
    recorded = Path(raw) if isinstance(raw, str) and raw else None
    if recorded is not None and not recorded.is_absolute() and (rd / recorded).is_dir():
        return (rd / recorded).resolve()
    found = _beside(rd, want, None)
    if found is not None:
        return found
    if recorded is not None:
        cand = recorded if recorded.is_absolute() else Path.cwd() / recorded
        if cand.is_dir():
            return cand.resolve()
    found = _beside(rd, None, recorded.name if recorded is not None else None)
    if found is not None:
        return found
    raise ReferenceDataError(f"{rd / RUN_FILE}: reference {raw!r} not found (pass the "
                             "reference directory explicitly with --reference)")


def _beside(run_dir: Path, digest: object, name: str | None) -> Path | None:
    """A reference directory beside ``run_dir``'s evidence, or ``None``.

    Under a ``references/`` beside an ancestor of ``run_dir`` (nearest first): the directory
    whose ``MANIFEST.json`` sha256 is ``digest``, or the one called ``name``.
    """
    for anc in run_dir.resolve().parents:
        refs = anc / REFERENCES_DIR
        if not refs.is_dir():
            continue
        if digest:
            for d in sorted(d for d in refs.iterdir() if d.is_dir()):
                mp = d / MANIFEST_FILE
                if mp.is_file() and sha256_file(mp) == digest:
                    return d
        if name and (refs / name).is_dir():
            return refs / name
    return None


# --- a reference: the HF reference run's tensors (appended; the comparator reads them)
HF_REFERENCE_DIR: Final = "reference"
"""The HF reference run's scores and update per precision: ``reference/hf-{precision}
.safetensors`` (tensors ``round{r}/{role}/{metric}``, :func:`hf_tensors_file`)."""


def hf_tensors_file(precision: str) -> str:
    """``hf-{precision}.safetensors``: the HF reference's tensor file at one precision.

    The same name is used under :data:`HF_REFERENCE_DIR`, :data:`SCORES_DIR` and
    :data:`BRANCHES_DIR` of a reference directory.
    """
    return f"hf-{precision}.safetensors"


# --- a reference: the stage's inputs and targets (appended)
CONTRACT_TOML_FILE: Final = "contract.toml"
"""The contract's TOML text as given (empty for a contract loaded from a string)."""
TARGETS_FILE: Final = "targets.safetensors"
"""The FP64 PPO / GRPO targets (:mod:`qualify.reference.targets`)."""


# --- staleness and gate policies (appended)
SOURCES_FILE: Final = "sources.json"
"""A run's record of the code it executed (:mod:`qualify.evidence.sources`): sha256 of
every ``qualify/`` and harness source file per engine, the engines' distribution versions,
the contract and gate-policy digests; written at run start."""
IMPORTS_FILE: Final = "imports.json"
"""A launch attempt's (and each of its cells' attempts') record of the files its harness
processes imported, with their sha256 (:mod:`qualify.evidence.imports`): what
:func:`qualify.evidence.sources.stale_cells` checks a cell against when present."""
IMPORTS_RAW_DIR: Final = "imports"
"""Under an attempt's ``logs/``: each harness process's list of imported files
(:mod:`qualify.candidate.imported`), removed once merged into :data:`IMPORTS_FILE`."""
GATES_DIR: Final = "gates"
"""The folder of gate policies beside the contracts: ``contracts/gates/<contract>.toml``
(:mod:`qualify.evidence.policy`)."""
SUPERSEDED_FILE: Final = "superseded.json"
"""An interrupted run's record that a later run superseded it (:mod:`qualify.evidence.supersede`):
written into the unsealed run, which is kept whole; ``gate`` and ``audit`` accept it only
when the run it names confirms it in its own ``run.json``."""
