"""The in-toto Statement v1 of a sealed reference or candidate run, and its predicate.

https://github.com/in-toto/attestation/blob/main/spec/v1/statement.md: ``_type``
``https://in-toto.io/Statement/v1``; ``subject`` = every file of the directory's
``MANIFEST.json`` and ``MANIFEST.json`` itself, each ``{"name": relpath, "digest":
{"sha256": hex}}``; ``predicateType`` :data:`PREDICATE_TYPE`; the predicate binds the
contract digest, the manifest digest, the bounds digest (sha256 of the ``bounds.json``
bytes), the reference the run was judged against (manifest, bounds and attestation
digests, sealing and signing times), the git commit and dirty flag of the source tree, an
environment summary, the verdicts and the sealing time. Candidate runs also carry the
in-toto test-result v0.1 fields (``result``, ``configuration``, ``passedTests``,
``warnedTests``, ``failedTests``). Schema: ``contracts/schema/statement.schema.json``.
The payload of the DSSE envelope is :func:`statement_bytes`.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import qualify
from qualify import jsonio
from qualify.digests import sha256_file
from qualify.errors import EvidenceIntegrityError, ReferenceDataError, UsageError
from qualify.evidence import store
from qualify.evidence.dsse import read_envelope
from qualify.evidence.timestamps import utc_now_iso
from qualify.layout import (
    ATTESTATION_FILE,
    BOUNDS_FILE,
    CONTRACT_FILE,
    ENVIRONMENT_FILE,
    MANIFEST_FILE,
    REFERENCE_FILE,
    REPORT_JSON,
    RUN_FILE,
    RunDocument,
    resolve_reference,
)
from qualify.schema import validate

__all__ = [
    "PREDICATE_TYPE",
    "REFERENCE_KIND",
    "RUN_KIND",
    "STATEMENT_TYPE",
    "TEST_RESULT_PREDICATE_TYPE",
    "build_statement",
    "environment_summary",
    "read_json",
    "read_run",
    "statement_bytes",
]

STATEMENT_TYPE: Final = "https://in-toto.io/Statement/v1"
"""``_type`` of an in-toto Statement v1."""
PREDICATE_TYPE: Final = "https://qualify.dev/attestation/qualification/v1"
"""``predicateType`` of qualify's qualification predicate."""
TEST_RESULT_PREDICATE_TYPE: Final = "https://in-toto.io/attestation/test-result/v0.1"
"""The standard predicate whose fields (result, configuration, *Tests) ours also carries."""
REFERENCE_KIND: Final = "reference"
"""Manifest kind of a sealed reference."""
RUN_KIND: Final = "candidate-run"
"""Manifest kind of a sealed candidate run."""


def read_json(path: Path) -> Any:
    """Read a JSON document of an evidence directory (:func:`qualify.jsonio.read_json`).

    Raises:
        EvidenceIntegrityError: missing, a symbolic link or special file, over its size
            limit, unreadable, not JSON, or with a duplicate key.
    """
    return jsonio.read_json(path)


def read_run(run_dir: Path) -> RunDocument:
    """``run.json`` of ``run_dir``, typed (:class:`qualify.layout.RunDocument`).

    Raises:
        EvidenceIntegrityError: missing, unreadable or not JSON.
        ReferenceDataError: a field is missing or of the wrong type.
    """
    return RunDocument.from_dict(read_json(run_dir / RUN_FILE),
                                 where=str(run_dir / RUN_FILE))


def environment_summary(env: Mapping[str, Any]) -> dict[str, Any]:
    """A short summary of an ``environment.schema.json`` document for the predicate.

    Returns:
        ``{"captured", "qualifyVersion", "python", "platform", "hostname", "cpu", "gpus",
        "packages"}`` (installed packages only).
    """
    plat = env.get("platform") or {}
    py = env.get("python") or {}
    cpu = env.get("cpu") or {}
    gpus = env.get("gpus") or []
    packages = env.get("packages") or {}
    system = " ".join(str(plat[k]) for k in ("system", "machine") if plat.get(k))
    return {
        "captured": env.get("captured"),
        "qualifyVersion": env.get("qualify_version"),
        "python": py.get("version"),
        "platform": system or None,
        "hostname": plat.get("hostname"),
        "cpu": cpu.get("model"),
        "gpus": [str(g.get("name", "?")) if isinstance(g, Mapping) else str(g) for g in gpus],
        "packages": {str(k): str(v) for k, v in sorted(packages.items()) if v},
    }


def _environment(directory: Path) -> dict[str, Any]:
    """The directory's own ``environment.json`` if sealed in it, else the signer's."""
    path = directory / ENVIRONMENT_FILE
    if path.is_file():
        doc = read_json(path)
        if isinstance(doc, dict):
            return doc
    from qualify.evidence.environment import capture_environment

    return capture_environment(import_torch=False)


def _source(env: Mapping[str, Any]) -> dict[str, Any]:
    git = env.get("git")
    if not isinstance(git, Mapping):
        from qualify.evidence.environment import git_state
        from qualify.resources import checkout_root

        git = git_state(checkout_root())
    return {"commit": git.get("commit"), "dirty": git.get("dirty"), "branch": git.get("branch")}


def _contract_digest_of(doc: Any, what: str) -> str:
    from qualify.contract import canonical_json, sha256_hex

    if not isinstance(doc, dict):
        raise EvidenceIntegrityError(f"{what}: not a JSON object")
    return sha256_hex(canonical_json(doc))


def _base_predicate(directory: Path, manifest: Mapping[str, Any],
                    mdigest: str) -> dict[str, Any]:
    env = _environment(directory)
    return {
        "kind": manifest["kind"],
        "qualifyVersion": qualify.__version__,
        "manifestDigest": mdigest,
        "sealed": manifest["created"],
        "signed": utc_now_iso(),
        "source": _source(env),
        "environment": environment_summary(env),
    }


def _reference_predicate(d: Path, base: dict[str, Any]) -> dict[str, Any]:
    ref_doc = read_json(d / REFERENCE_FILE)
    contract_doc = read_json(d / CONTRACT_FILE)
    digest = _contract_digest_of(contract_doc, str(d / CONTRACT_FILE))
    if not isinstance(ref_doc, dict):
        raise EvidenceIntegrityError(f"{d / REFERENCE_FILE}: not a JSON object")
    if ref_doc.get("contract_digest") != digest:
        raise EvidenceIntegrityError(f"{d / REFERENCE_FILE}: contract_digest is not the "
                                     f"digest of {CONTRACT_FILE} ({digest[:12]})")
    return {**base,
            "contract": {"name": str(contract_doc.get("name")), "digest": digest},
            "boundsDigest": sha256_file(d / BOUNDS_FILE),
            "reference": None, "run": None, "verdicts": None}


def _run_predicate(d: Path, base: dict[str, Any],
                   reference_dir: str | Path | None) -> dict[str, Any]:
    run_doc = read_run(d)
    report_path = d / REPORT_JSON
    if not report_path.is_file():
        raise ReferenceDataError(f"{report_path}: missing; compare the run before sealing and "
                                 "signing it")
    report = read_json(report_path)
    ref_dir = resolve_reference(d, run_doc, reference_dir)
    if not (ref_dir / ATTESTATION_FILE).is_file():
        raise ReferenceDataError(f"{ref_dir}: the reference is not signed; sign it first "
                                 f"(qualify sign {shlex.quote(str(ref_dir))})")
    ref_manifest = store.read_manifest(ref_dir)
    ref_stmt = jsonio.loads_strict(read_envelope(ref_dir).payload,
                                    what=f"{ref_dir}: statement")
    ref_pred = ref_stmt.get("predicate") if isinstance(ref_stmt, dict) else None
    if not isinstance(ref_pred, dict):
        raise EvidenceIntegrityError(f"{ref_dir / ATTESTATION_FILE}: no predicate")
    cells = {str(c["cell"]): str(c["verdict"]) for c in report.get("cells", [])}
    passed = sorted(c for c, v in cells.items() if v == "PASS")
    warned = sorted(c for c, v in cells.items() if v == "NOT_RUN")
    failed = sorted(c for c, v in cells.items() if v in ("FAIL", "ERROR"))
    ok = bool(report.get("passed"))
    result = "FAILED" if not ok else ("WARNED" if warned else "PASSED")
    contract = {"name": run_doc.contract, "digest": run_doc.contract_digest}
    bounds_digest = str(report.get("bounds_digest"))
    ref_mdigest = store.manifest_digest(ref_dir)
    return {**base,
            "contract": contract,
            "boundsDigest": bounds_digest,
            "reference": {"name": ref_dir.name, "manifestDigest": ref_mdigest,
                          "boundsDigest": sha256_file(ref_dir / BOUNDS_FILE),
                          "attestationDigest": sha256_file(ref_dir / ATTESTATION_FILE),
                          "sealed": ref_manifest["created"],
                          "signed": ref_pred.get("signed")},
            "run": {"runId": run_doc.run_id,
                    "started": run_doc.started, "finished": run_doc.finished},
            "verdicts": {"passed": ok, "reportDigest": sha256_file(report_path),
                         "cells": cells, "summary": report.get("summary", {})},
            "result": result,
            "configuration": [
                {"name": f"contract:{contract['name']}", "digest": {"sha256": contract["digest"]}},
                {"name": f"{ref_dir.name}/{MANIFEST_FILE}",
                 "digest": {"sha256": ref_mdigest}},
                {"name": f"{ref_dir.name}/{BOUNDS_FILE}", "digest": {"sha256": bounds_digest}},
            ],
            "passedTests": passed, "warnedTests": warned, "failedTests": failed}


def build_statement(directory: str | Path, *,
                    reference_dir: str | Path | None = None) -> dict[str, Any]:
    """The in-toto Statement v1 of a sealed reference or candidate run.

    Args:
        directory: a sealed, intact directory whose manifest kind is ``reference`` or
            ``candidate-run``.
        reference_dir: for a run, its reference (default:
            :func:`qualify.layout.resolve_reference`).

    Returns:
        The statement (validated against ``statement.schema.json``).

    Raises:
        EvidenceIntegrityError: the directory is not sealed or not intact, or a file the
            predicate needs is missing or not JSON.
        ReferenceDataError: a run that was not compared, whose reference is missing or
            unsigned, or whose ``run.json`` has a field of the wrong type.
        UsageError: the manifest kind is neither ``reference`` nor ``candidate-run``.
    """
    d = Path(directory)
    mdigest = store.check_sealed(d)
    manifest = store.read_manifest(d)
    kind = manifest["kind"]
    base = _base_predicate(d, manifest, mdigest)
    if kind == REFERENCE_KIND:
        predicate = _reference_predicate(d, base)
    elif kind == RUN_KIND:
        predicate = _run_predicate(d, base, reference_dir)
    else:
        raise UsageError(f"{d}: manifest kind {kind!r}; only '{REFERENCE_KIND}' and "
                         f"'{RUN_KIND}' directories are signed")
    subjects = [{"name": rel, "digest": {"sha256": e["sha256"]}}
                for rel, e in sorted(manifest["files"].items())]
    subjects.append({"name": MANIFEST_FILE, "digest": {"sha256": mdigest}})
    statement = {"_type": STATEMENT_TYPE, "subject": subjects,
                 "predicateType": PREDICATE_TYPE, "predicate": predicate}
    validate(statement, "statement", what=f"{d} statement")
    return statement


def statement_bytes(statement: Mapping[str, Any]) -> bytes:
    """Canonical JSON bytes of a statement (sorted keys, compact, UTF-8): the payload."""
    return json.dumps(statement, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=False).encode("utf-8")
