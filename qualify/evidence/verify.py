"""``qualify verify``: ordered verification of a signed reference or candidate run.

Modelled on in-toto's ``verifylib.in_toto_verify``: numbered ``verify_*`` steps, each
raising exactly one error type (all :class:`~qualify.errors.EvidenceIntegrityError`,
exit code 3), gathered into a :class:`VerificationResult` (python-tuf style: ``bool()``,
the steps that passed, the problems):

1. :func:`verify_envelope` - ``attestation.dsse.json`` is a DSSE envelope
   (:class:`~qualify.signing.EnvelopeFormatError`);
2. :func:`verify_signature` - at least one signature, every one by a trusted key, no key
   twice, each verifies over PAE (:class:`~qualify.signing.SignatureVerificationError`);
3. :func:`verify_statement_types` - ``payloadType``, ``_type``, ``predicateType`` and the
   statement schema (:class:`StatementTypeError`);
4. :func:`verify_subjects` - every subject digest equals the manifest and the file on disk,
   every manifest file is a subject (:class:`SubjectDigestError`);
5. :func:`verify_no_unlisted_files` - no file on disk outside the manifest
   (:class:`UnlistedFileError`);
6. :func:`verify_contract` - the contract digest equals the committed contract's and the
   directory's own records (:class:`ContractDigestError`);
7. :func:`verify_reference` (runs) - the reference verifies (steps 1-6), is the one the run
   names, and its ``bounds.json`` digest is the run's (:class:`ReferenceBindingError`);
8. :func:`verify_seal_order` (runs) - the reference was sealed before the run started and
   attested before the run was (:class:`SealOrderError`);
9. :func:`verify_verdicts` (runs) - the verdicts recomputed from the raw outputs and the
   sealed bounds (``compare_run(..., write=False)``) equal the report's and the
   statement's (:class:`VerdictMismatchError`).

Steps 1-3 are prerequisites (a failure skips the rest); 4-8 all run so every problem is
listed; 9 runs only when 1-8 passed.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import jsonschema
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from qualify.evidence import store
from qualify.errors import EvidenceIntegrityError, ExitCode, QualifyError, SignatureError
from qualify.evidence.sign import (
    ATTESTATION_FILE,
    BOUNDS_FILE,
    CONTRACT_JSON,
    PAYLOAD_TYPE,
    PREDICATE_TYPE,
    REFERENCE_FILE,
    REFERENCE_KIND,
    REPORT_FILE,
    RUN_FILE,
    RUN_KIND,
    STATEMENT_TYPE,
    Envelope,
    EnvelopeFormatError,
    SignatureVerificationError,
    locate_reference,
    parse_time,
    read_envelope,
    trusted_keys,
    verify_envelope_signatures,
)

__all__ = [
    "STEPS",
    "ContractDigestError",
    "EnvelopeFormatError",
    "EvidenceDir",
    "ReferenceBindingError",
    "SealOrderError",
    "SignatureVerificationError",
    "StatementTypeError",
    "StepOutcome",
    "SubjectDigestError",
    "UnlistedFileError",
    "VerdictMismatchError",
    "VerificationResult",
    "committed_contract_path",
    "find_evidence",
    "verify",
    "verify_contract",
    "verify_envelope",
    "verify_no_unlisted_files",
    "verify_reference",
    "verify_seal_order",
    "verify_signature",
    "verify_statement_types",
    "verify_subjects",
    "verify_verdicts",
]

STEPS: Final[tuple[tuple[int, str], ...]] = (
    (1, "envelope format"),
    (2, "signature by a trusted key"),
    (3, "payload, statement and predicate types"),
    (4, "subject digests match manifest and disk"),
    (5, "no file outside the manifest"),
    (6, "contract digest equals the committed contract"),
    (7, "bounds and reference bound to the run"),
    (8, "reference sealed before the run"),
    (9, "verdicts recomputed from raw evidence"),
)
"""The verification steps, in order: ``(number, name)``."""

INCOMPLETE_INFIX: Final = ".incomplete-"
"""Moved-aside interrupted directories are named ``<name>.incomplete-<UTC stamp>``."""
_MAX_LISTED: Final = 8


class StatementTypeError(SignatureError):
    """Wrong payloadType, ``_type`` or predicateType, or a statement off its schema (step 3)."""


class SubjectDigestError(EvidenceIntegrityError):
    """A subject, the manifest and the files on disk disagree (step 4)."""


class UnlistedFileError(EvidenceIntegrityError):
    """A file on disk is not in the manifest (step 5)."""


class ContractDigestError(EvidenceIntegrityError):
    """The evidence's contract digest is not the committed contract's (step 6)."""


class ReferenceBindingError(EvidenceIntegrityError):
    """The run's reference does not verify or is not the run's (step 7)."""


class SealOrderError(EvidenceIntegrityError):
    """The reference was sealed or attested after the run (step 8)."""


class VerdictMismatchError(EvidenceIntegrityError):
    """The report's verdicts do not follow from the raw evidence and sealed bounds (step 9)."""


_STEP_ERRORS: Final[dict[int, type[EvidenceIntegrityError]]] = {
    1: EnvelopeFormatError, 2: SignatureVerificationError, 3: StatementTypeError,
    4: SubjectDigestError, 5: UnlistedFileError, 6: ContractDigestError,
    7: ReferenceBindingError, 8: SealOrderError, 9: VerdictMismatchError,
}

StepStatus = Literal["passed", "failed", "skipped", "not-applicable"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepOutcome:
    """What one verification step found.

    Attributes:
        number: 1..9 (:data:`STEPS`).
        name: the step's name.
        status: ``passed``, ``failed``, ``skipped`` (an earlier step failed) or
            ``not-applicable`` (steps 7-9 of a reference).
        detail: one line: what was verified, the problem, or why it was skipped.
        error: the step's error when ``failed``.
    """

    number: int
    name: str
    status: StepStatus
    detail: str
    error: EvidenceIntegrityError | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"step": self.number, "name": self.name, "status": self.status,
                "detail": self.detail,
                "error": type(self.error).__name__ if self.error is not None else None}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class VerificationResult:
    """The outcome of :func:`verify` (``bool(result)`` is :attr:`passed`).

    Attributes:
        path: the verified directory.
        kind: ``reference`` or ``candidate-run`` (from the statement; ``None`` if unread).
        steps: one outcome per step of :data:`STEPS`, in order.
        keyids: the trusted key ids that signed.
        statement: the verified-signature statement (``None`` before step 3 passes).
        reference: for a run, the reference directory used in steps 7-9.
        extra_files: files on disk outside the manifest (step 5).
        other_attestations: further top-level ``*.dsse.json`` files (not verified).
    """

    path: Path
    kind: str | None
    steps: tuple[StepOutcome, ...]
    keyids: tuple[str, ...] = ()
    statement: Mapping[str, Any] | None = None
    reference: Path | None = None
    extra_files: tuple[str, ...] = ()
    other_attestations: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """No step failed and the signature and statement were verified."""
        return all(s.status != "failed" for s in self.steps) and \
            all(s.status == "passed" for s in self.steps[:6])

    def __bool__(self) -> bool:
        return self.passed

    @property
    def verified(self) -> tuple[str, ...]:
        """``"<n> <name>"`` of each step that passed."""
        return tuple(f"{s.number} {s.name}" for s in self.steps if s.status == "passed")

    @property
    def failed_steps(self) -> tuple[StepOutcome, ...]:
        """The steps that failed, in order."""
        return tuple(s for s in self.steps if s.status == "failed")

    @property
    def problems(self) -> tuple[str, ...]:
        """``step <n> (<name>): <detail>`` of each failed step."""
        return tuple(f"step {s.number} ({s.name}): {s.detail}" for s in self.failed_steps)

    @property
    def first_error(self) -> EvidenceIntegrityError | None:
        """The error of the first failed step (``None`` if none failed)."""
        failed = self.failed_steps
        return failed[0].error if failed else None

    @property
    def exit_code(self) -> ExitCode:
        """``OK`` or ``INTEGRITY_ERROR``."""
        return ExitCode.OK if self.passed else ExitCode.INTEGRITY_ERROR

    def raise_for_problems(self) -> None:
        """Raise the first failed step's error.

        Raises:
            EvidenceIntegrityError: a step failed (the step's own subclass).
        """
        err = self.first_error
        if err is not None:
            raise err
        if not self.passed:
            raise EvidenceIntegrityError(f"{self.path}: verification incomplete")

    def summary_lines(self) -> list[str]:
        """The numbered steps for a human, one line each."""
        mark = {"passed": "ok  ", "failed": "FAIL", "skipped": "skip", "not-applicable": "n/a "}
        head = f"{self.path}: {'VERIFIED' if self.passed else 'NOT VERIFIED'}" + (
            f" ({self.kind})" if self.kind else "")
        if self.keyids:
            head += f", signed by keyid {', '.join(k[:16] for k in self.keyids)}"
        out = [head]
        out += [f"  [{mark[s.status]}] {s.number}. {s.name}: {s.detail}" for s in self.steps]
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"path": str(self.path), "kind": self.kind, "passed": self.passed,
                "exit_code": int(self.exit_code), "keyids": list(self.keyids),
                "reference": str(self.reference) if self.reference else None,
                "steps": [s.to_dict() for s in self.steps], "problems": list(self.problems),
                "extra_files": list(self.extra_files),
                "other_attestations": list(self.other_attestations)}


# --------------------------------------------------------------------------- helpers


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EvidenceIntegrityError(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise EvidenceIntegrityError(f"{path}: unreadable or not JSON: {exc}") from None


def _listing(items: Sequence[str]) -> str:
    more = f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return "; ".join(items[:_MAX_LISTED]) + more


def _predicate(statement: Mapping[str, Any]) -> Mapping[str, Any]:
    pred = statement.get("predicate")
    if not isinstance(pred, Mapping):
        raise EvidenceIntegrityError("statement has no predicate object")
    return pred


def committed_contract_path(name: str, *, contract: str | Path | None = None,
                            contracts_dir: str | Path | None = None) -> Path | None:
    """Where the committed contract ``name`` lives.

    Args:
        name: contract name (``contracts/<name>.toml``).
        contract: an explicit contract file (returned as is).
        contracts_dir: a directory of committed contracts; default ``./contracts`` then
            the qualify checkout's ``contracts/``.

    Returns:
        The path, or ``None`` when no ``<name>.toml`` is found.
    """
    if contract is not None:
        return Path(contract)
    from qualify.resources import contracts_dir as default_dir

    dirs = [Path(contracts_dir)] if contracts_dir is not None else \
        [Path.cwd() / "contracts", default_dir()]
    for d in dirs:
        p = d / f"{name}.toml"
        if p.is_file():
            return p
    return None


# --------------------------------------------------------------------------- the steps


@functools.cache
def _statement_validator() -> jsonschema.protocols.Validator:
    from qualify.resources import load_schema

    return jsonschema.Draft202012Validator(load_schema("statement"))


def verify_envelope(directory: Path) -> Envelope:
    """Step 1: ``attestation.dsse.json`` exists and is a DSSE envelope.

    Raises:
        EnvelopeFormatError: missing (unsigned), not JSON, or not a DSSE envelope.
    """
    if not directory.is_dir():
        raise EnvelopeFormatError(f"{directory}: not a directory")
    try:
        return read_envelope(directory)
    except EnvelopeFormatError:
        if store.is_incomplete(directory):
            raise EnvelopeFormatError(f"{directory}: incomplete (INCOMPLETE marker) and "
                                      "unsigned") from None
        raise


def verify_signature(envelope: Envelope,
                     trusted: Mapping[str, Ed25519PublicKey]) -> tuple[str, ...]:
    """Step 2: signatures against the trusted keys.

    See :func:`qualify.signing.verify_envelope_signatures` for the policy.

    Returns:
        The key ids that signed.

    Raises:
        SignatureVerificationError: missing, duplicated, corrupted or untrusted signature.
    """
    return verify_envelope_signatures(envelope, trusted)


def verify_statement_types(envelope: Envelope) -> dict[str, Any]:
    """Step 3: ``payloadType``, ``_type``, ``predicateType`` and the statement schema.

    Returns:
        The statement.

    Raises:
        StatementTypeError: any of them is wrong.
    """
    if envelope.payload_type != PAYLOAD_TYPE:
        raise StatementTypeError(f"payloadType is {envelope.payload_type!r}, expected "
                                 f"{PAYLOAD_TYPE!r}")
    try:
        statement = json.loads(envelope.payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise StatementTypeError(f"payload is not JSON: {exc}") from None
    if not isinstance(statement, dict):
        raise StatementTypeError("payload is not a JSON object")
    if statement.get("_type") != STATEMENT_TYPE:
        raise StatementTypeError(f"_type is {statement.get('_type')!r}, expected "
                                 f"{STATEMENT_TYPE!r}")
    if statement.get("predicateType") != PREDICATE_TYPE:
        raise StatementTypeError(f"predicateType is {statement.get('predicateType')!r}, "
                                 f"expected {PREDICATE_TYPE!r}")
    err = jsonschema.exceptions.best_match(_statement_validator().iter_errors(statement))
    if err is not None:
        field = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        raise StatementTypeError(f"statement {field}: {err.message} "
                                 "(schema statement.schema.json)")
    return statement


def verify_subjects(directory: Path, statement: Mapping[str, Any],
                    problems: Sequence[store.Problem] | None = None) -> int:
    """Step 4: subjects = manifest files + ``MANIFEST.json``, digests equal, files intact.

    Args:
        directory: the directory.
        statement: the statement from step 3.
        problems: :func:`qualify.store.verify_manifest` of ``directory`` (computed if
            ``None``).

    Returns:
        The number of subjects checked.

    Raises:
        SubjectDigestError: the manifest is missing or invalid; a file is missing,
            modified or resized; a subject is absent from the manifest, has another digest,
            or a manifest file has no subject; the manifest digest or kind, or the digest
            of the directory's own ``bounds.json`` (reference) / ``report.json`` (run), is
            not the statement's.
    """
    probs = list(store.verify_manifest(directory)) if problems is None else list(problems)
    bad = [str(p) for p in probs if p.kind != "extra"]
    if any(p.kind in ("no-manifest", "bad-manifest") for p in probs):
        raise SubjectDigestError(f"{directory}: {_listing(bad)}")
    manifest = store.read_manifest(directory)
    mdigest = store.manifest_digest(directory)
    listed = {rel: e["sha256"] for rel, e in manifest["files"].items()}
    listed[store.MANIFEST_FILE] = mdigest
    subjects: dict[str, str] = {}
    for s in statement["subject"]:
        if s["name"] in subjects:
            bad.append(f"{s['name']}: subject listed twice")
        subjects[s["name"]] = s["digest"]["sha256"]
    bad += [f"{n}: in the manifest, not a subject" for n in sorted(set(listed) - set(subjects))]
    bad += [f"{n}: a subject, not in the manifest" for n in sorted(set(subjects) - set(listed))]
    bad += [f"{n}: subject sha256 {subjects[n][:12]}, manifest {listed[n][:12]}"
            for n in sorted(set(listed) & set(subjects)) if subjects[n] != listed[n]]
    pred = _predicate(statement)
    if pred.get("manifestDigest") != mdigest:
        bad.append(f"{store.MANIFEST_FILE}: digest {mdigest[:12]}, the statement says "
                   f"{str(pred.get('manifestDigest'))[:12]}")
    own = {REFERENCE_KIND: ("boundsDigest", BOUNDS_FILE), RUN_KIND: ("reportDigest", REPORT_FILE)}
    if pred.get("kind") in own:
        field, name = own[str(pred["kind"])]
        claimed = (pred.get("verdicts") or {}).get(field) if field == "reportDigest" \
            else pred.get(field)
        if claimed != listed.get(name):
            bad.append(f"{name}: manifest sha256 {str(listed.get(name))[:12]}, the statement's "
                       f"{field} is {str(claimed)[:12]}")
    if manifest["kind"] != pred.get("kind"):
        bad.append(f"{store.MANIFEST_FILE}: kind {manifest['kind']!r}, the statement says "
                   f"{pred.get('kind')!r}")
    if bad:
        raise SubjectDigestError(f"{len(bad)} problem(s): {_listing(sorted(set(bad)))}")
    return len(subjects)


def verify_no_unlisted_files(directory: Path,
                             problems: Sequence[store.Problem] | None = None,
                             ) -> tuple[str, ...]:
    """Step 5: every file on disk is in the manifest.

    Top-level ``*.dsse.json`` files are attestations (never in a manifest); one anywhere
    else is unlisted.

    Returns:
        The further top-level attestations beside ``attestation.dsse.json``.

    Raises:
        UnlistedFileError: files on disk outside the manifest (all are named).
    """
    probs = list(store.verify_manifest(directory)) if problems is None else list(problems)
    extra = [p.path for p in probs if p.kind == "extra"]
    others: list[str] = []
    for root, _dirs, files in os.walk(directory, followlinks=False):
        for name in files:
            if not name.endswith(store.ATTESTATION_SUFFIX):
                continue
            rel = (Path(root) / name).relative_to(directory).as_posix()
            if "/" in rel:
                extra.append(rel)
            elif rel != ATTESTATION_FILE:
                others.append(rel)
    if extra:
        raise UnlistedFileError(f"{len(extra)} file(s) not in the manifest: "
                                f"{_listing(sorted(extra))}")
    return tuple(sorted(others))


def verify_contract(directory: Path, statement: Mapping[str, Any], *,
                    contract: str | Path | None = None,
                    contracts_dir: str | Path | None = None) -> str:
    """Step 6: the statement's contract digest is the committed contract's.

    It must also be the digest the directory's own records name (``contract.json``,
    ``reference.json``, ``bounds.json`` of a reference; ``run.json``, ``report.json`` of a
    run).

    Args:
        directory: the directory.
        statement: the statement from step 3.
        contract: the committed contract file (default ``contracts/<name>.toml``).
        contracts_dir: where committed contracts live (see :func:`committed_contract_path`).

    Returns:
        The committed contract's path.

    Raises:
        ContractDigestError: no committed contract, another name, another digest (the
            contract was edited after sealing), or a record in the directory disagrees.
    """
    from qualify.contract import canonical_json, load_contract, sha256_hex

    pred = _predicate(statement)
    name, digest = pred["contract"]["name"], pred["contract"]["digest"]
    path = committed_contract_path(name, contract=contract, contracts_dir=contracts_dir)
    if path is None:
        raise ContractDigestError(f"no committed contract {name}.toml found")
    try:
        committed = load_contract(path)
    except QualifyError as exc:
        raise ContractDigestError(f"committed contract {path}: {exc}") from None
    if committed.name != name:
        raise ContractDigestError(f"committed contract {path} is {committed.name!r}, the "
                                  f"evidence is for {name!r}")
    if committed.digest != digest:
        raise ContractDigestError(
            f"committed contract {path} has digest {committed.digest[:12]}, the evidence "
            f"was sealed for {digest[:12]}: the contract changed after sealing (stale)")
    records: list[tuple[str, Any]] = []
    if pred["kind"] == REFERENCE_KIND:
        records.append((CONTRACT_JSON,
                        sha256_hex(canonical_json(_read_json(directory / CONTRACT_JSON)))))
        records.append((REFERENCE_FILE, _read_json(directory / REFERENCE_FILE)
                        .get("contract_digest")))
        records.append((BOUNDS_FILE, _read_json(directory / BOUNDS_FILE).get("contract_digest")))
    else:
        records.append((RUN_FILE, _read_json(directory / RUN_FILE).get("contract_digest")))
        records.append((REPORT_FILE, _read_json(directory / REPORT_FILE).get("contract_digest")))
    bad = [f"{f}: contract digest {str(v)[:12]}" for f, v in records if v != digest]
    if bad:
        raise ContractDigestError(f"statement says {digest[:12]}, but {_listing(bad)}")
    return str(path)


def verify_reference(run_dir: Path, statement: Mapping[str, Any], *,
                     reference_dir: str | Path | None,
                     trusted: Mapping[str, Ed25519PublicKey],
                     contract: str | Path | None = None,
                     contracts_dir: str | Path | None = None,
                     ) -> tuple[Path, Mapping[str, Any]]:
    """Step 7: the run's reference verifies and is bound to the run.

    The reference passes steps 1-6 itself; its manifest digest is the one ``run.json`` and
    the statement name; the sha256 of its ``bounds.json`` equals the statement's
    ``boundsDigest``, ``reference.boundsDigest``, the reference's own statement and
    ``report.json``'s ``bounds_digest``; both statements name the same contract digest.

    Returns:
        The reference directory and its verified statement.

    Raises:
        ReferenceBindingError: any of these fails (bounds regenerated, reference replaced,
            edited or unsigned).
    """
    pred = _predicate(statement)
    run_doc = _read_json(run_dir / RUN_FILE)
    try:
        ref_dir = locate_reference(run_dir, run_doc, reference_dir)
    except QualifyError as exc:
        raise ReferenceBindingError(str(exc)) from None
    ref = verify(ref_dir, trusted=trusted, contract=contract, contracts_dir=contracts_dir)
    if ref.kind != REFERENCE_KIND and ref.passed:
        raise ReferenceBindingError(f"{ref_dir}: not a reference (kind {ref.kind!r})")
    if not ref.passed:
        raise ReferenceBindingError(f"reference {ref_dir} does not verify: "
                                    f"{_listing(list(ref.problems))}")
    assert ref.statement is not None
    ref_pred = _predicate(ref.statement)
    bound = pred["reference"]
    mdigest = store.manifest_digest(ref_dir)
    bounds = store.sha256_file(ref_dir / BOUNDS_FILE)
    report = _read_json(run_dir / REPORT_FILE)
    run_ref = run_doc.get("reference") if isinstance(run_doc.get("reference"), dict) else {}
    checks = [
        ("reference manifest digest (statement)", bound["manifestDigest"], mdigest),
        ("reference manifest digest (run.json)", run_ref.get("manifest_digest"), mdigest),
        ("bounds digest (statement)", pred["boundsDigest"], bounds),
        ("bounds digest (statement reference)", bound["boundsDigest"], bounds),
        ("bounds digest (report.json)", report.get("bounds_digest"), bounds),
        ("bounds digest (reference statement)", ref_pred["boundsDigest"], bounds),
        ("contract digest (reference statement)", ref_pred["contract"]["digest"],
         pred["contract"]["digest"]),
    ]
    bad = [f"{what} is {str(got)[:12]}, {ref_dir.name} has {str(want)[:12]}"
           for what, got, want in checks if got != want]
    if bad:
        raise ReferenceBindingError(f"{_listing(bad)}: the bounds or the reference changed "
                                    "after the run")
    return ref_dir, ref.statement


def verify_seal_order(run_dir: Path, statement: Mapping[str, Any], ref_dir: Path,
                      ref_statement: Mapping[str, Any]) -> None:
    """Step 8: the reference was sealed before the run started and attested before it.

    Checks: reference ``sealed`` < ``run.json`` ``started`` (= the statement's); the
    run was sealed after it started; reference ``signed`` <= run ``signed``; the reference
    attestation on disk is the one the run statement names (digest), with the same
    sealing and signing times.

    Raises:
        SealOrderError: any of these fails.
    """
    pred, ref_pred = _predicate(statement), _predicate(ref_statement)
    run_doc = _read_json(run_dir / RUN_FILE)
    bad: list[str] = []
    started_raw = run_doc.get("started")
    if pred["run"]["started"] != started_raw:
        bad.append(f"run.json started {started_raw!r}, statement {pred['run']['started']!r}")
    started = parse_time(started_raw, f"{run_dir / RUN_FILE}: started")
    ref_sealed = parse_time(ref_pred["sealed"], f"{ref_dir}: sealed")
    if not ref_sealed < started:
        bad.append(f"reference sealed {ref_pred['sealed']}, not before the run started "
                   f"{started_raw}")
    if parse_time(pred["sealed"], "run sealed") < started:
        bad.append(f"run sealed {pred['sealed']} before it started {started_raw}")
    if parse_time(ref_pred["signed"], "reference signed") > \
            parse_time(pred["signed"], "run signed"):
        bad.append(f"reference attested {ref_pred['signed']}, after the run {pred['signed']}")
    bound = pred["reference"]
    att = store.sha256_file(ref_dir / ATTESTATION_FILE)
    if bound["attestationDigest"] != att:
        bad.append(f"reference attestation digest {att[:12]}, the run was signed against "
                   f"{bound['attestationDigest'][:12]} (reference re-attested later)")
    for k in ("sealed", "signed"):
        if bound[k] != ref_pred[k]:
            bad.append(f"reference {k} {ref_pred[k]}, the run statement says {bound[k]}")
    if bad:
        raise SealOrderError(_listing(bad))


def verify_verdicts(run_dir: Path, statement: Mapping[str, Any], ref_dir: Path) -> int:
    """Step 9: recompute the verdicts and compare them with the report and the statement.

    Returns:
        The number of cells compared.

    Raises:
        VerdictMismatchError: the recomputation fails, or a cell or row verdict, or
            ``passed``, differs between the recomputed report, ``report.json`` and the
            statement.
    """
    from qualify.compare.stage import compare_run

    try:
        again = compare_run(run_dir, reference_dir=ref_dir, write=False)
    except QualifyError as exc:
        raise VerdictMismatchError(f"verdicts cannot be recomputed: {exc}") from None
    report = _read_json(run_dir / REPORT_FILE)
    pred = _predicate(statement)
    bad: list[str] = []
    cells = {str(c.get("cell")): c.get("verdict") for c in report.get("cells", [])}
    recomputed = dict(again.verdicts)
    for cid in sorted(set(cells) | set(recomputed)):
        if cells.get(cid) != recomputed.get(cid):
            bad.append(f"{cid}: report.json says {cells.get(cid)}, recomputed "
                       f"{recomputed.get(cid)}")
    if report.get("passed") is not again.passed:
        bad.append(f"passed: report.json says {report.get('passed')}, recomputed {again.passed}")
    rows = collections.Counter((str(r.get("cell")), str(r.get("class")), str(r.get("metric")),
                                str(r.get("verdict"))) for r in report.get("rows", []))
    rows_again = collections.Counter((r.cell, r.klass, r.metric, str(r.verdict))
                                     for r in again.rows)
    if rows != rows_again:
        diff = sorted((rows - rows_again) + (rows_again - rows))
        bad.append(f"{len(diff)} row verdict(s) differ, e.g. {'/'.join(diff[0])}")
    verdicts = pred["verdicts"]
    if verdicts["cells"] != cells:
        bad.append("statement cell verdicts differ from report.json")
    if verdicts["passed"] is not report.get("passed"):
        bad.append(f"statement passed={verdicts['passed']}, report.json "
                   f"passed={report.get('passed')}")
    if bad:
        raise VerdictMismatchError(f"the report does not follow from the raw evidence: "
                                   f"{_listing(bad)}")
    return len(recomputed)


# --------------------------------------------------------------------------- orchestration


class _Steps:
    """Runs numbered steps, turning any error into the step's own error type."""

    def __init__(self) -> None:
        self.outcomes: dict[int, StepOutcome] = {}

    def run(self, number: int, fn: Callable[[], str]) -> bool:
        name = dict(STEPS)[number]
        kind = _STEP_ERRORS[number]
        try:
            detail = fn()
        except kind as exc:
            err: EvidenceIntegrityError = exc
        except (QualifyError, OSError, ValueError, KeyError, TypeError, AttributeError,
                IndexError) as exc:  # malformed documents: the step's own error
            err = kind(f"{type(exc).__name__}: {exc}")
        else:
            self.outcomes[number] = StepOutcome(number=number, name=name, status="passed",
                                                detail=detail)
            return True
        self.outcomes[number] = StepOutcome(number=number, name=name, status="failed",
                                            detail=str(err), error=err)
        return False

    def mark(self, number: int, status: StepStatus, detail: str) -> None:
        self.outcomes.setdefault(number, StepOutcome(number=number, name=dict(STEPS)[number],
                                                     status=status, detail=detail))

    def done(self) -> tuple[StepOutcome, ...]:
        for n, _ in STEPS:
            self.mark(n, "skipped", "not reached")
        return tuple(self.outcomes[n] for n, _ in STEPS)


def verify(path: str | Path, *, trusted: Mapping[str, Ed25519PublicKey] | None = None,
           trusted_keys_dir: str | Path | None = None, contract: str | Path | None = None,
           contracts_dir: str | Path | None = None, reference_dir: str | Path | None = None,
           recompute: bool = True) -> VerificationResult:
    """Run the verification steps on a signed reference or candidate run.

    Args:
        path: the directory.
        trusted: trusted keys (default: :func:`qualify.signing.trusted_keys` of
            ``trusted_keys_dir``).
        trusted_keys_dir: directory of trusted ``*.pub`` (default ``contracts/keys``).
        contract: the committed contract file (default ``contracts/<name>.toml``).
        contracts_dir: where committed contracts live.
        reference_dir: a run's reference (default from ``run.json``).
        recompute: run step 9 (the verdict recomputation).

    Returns:
        The :class:`VerificationResult`; integrity problems are reported there, never
        raised.

    Raises:
        UsageError: a trusted key file is malformed.
    """
    d = Path(path)
    keys = trusted if trusted is not None else trusted_keys(trusted_keys_dir)
    steps = _Steps()
    got: dict[str, Any] = {}

    def s1() -> str:
        got["envelope"] = verify_envelope(d)
        return f"{ATTESTATION_FILE}: DSSE envelope, {len(got['envelope'].signatures)} " \
               "signature(s)"

    def s2() -> str:
        got["keyids"] = verify_signature(got["envelope"], keys)
        return "signed by trusted keyid " + ", ".join(k[:16] for k in got["keyids"])

    def s3() -> str:
        got["statement"] = verify_statement_types(got["envelope"])
        return f"{PAYLOAD_TYPE}, {STATEMENT_TYPE}, {PREDICATE_TYPE}"

    if not (steps.run(1, s1) and steps.run(2, s2) and steps.run(3, s3)):
        return VerificationResult(path=d, kind=None, steps=steps.done(),
                                  keyids=tuple(got.get("keyids", ())))
    statement: dict[str, Any] = got["statement"]
    kind = str(statement["predicate"]["kind"])
    problems = store.verify_manifest(d)
    steps.run(4, lambda: f"{verify_subjects(d, statement, problems)} subjects match the "
                         "manifest and the files")

    def s5() -> str:
        got["others"] = verify_no_unlisted_files(d, problems)
        return "every file is in the manifest"

    steps.run(5, s5)

    def s6() -> str:
        where = verify_contract(d, statement, contract=contract, contracts_dir=contracts_dir)
        return f"{statement['predicate']['contract']['digest'][:12]} = {where}"

    steps.run(6, s6)
    ref_dir: Path | None = None
    if kind != RUN_KIND:
        for n in (7, 8, 9):
            steps.mark(n, "not-applicable", "a reference")
    else:
        def s7() -> str:
            got["ref"] = verify_reference(d, statement, reference_dir=reference_dir,
                                          trusted=keys, contract=contract,
                                          contracts_dir=contracts_dir)
            return f"{got['ref'][0]}: verified; bounds.json " \
                   f"{statement['predicate']['boundsDigest'][:12]}"

        if steps.run(7, s7):
            ref_dir, ref_statement = got["ref"]
            assert ref_dir is not None
            rd = ref_dir

            def s8() -> str:
                verify_seal_order(d, statement, rd, ref_statement)
                return "reference sealed and attested before the run"

            steps.run(8, s8)
            if not recompute:
                steps.mark(9, "skipped", "recomputation not requested")
            elif any(steps.outcomes[n].status == "failed" for n in range(1, 9)):
                steps.mark(9, "skipped", "an earlier step failed")
            else:
                steps.run(9, lambda: f"{verify_verdicts(d, statement, rd)} cell verdicts "
                                     "recomputed and equal")
        else:
            steps.mark(8, "skipped", "the reference did not verify")
            steps.mark(9, "skipped", "the reference did not verify")
    extra = tuple(sorted(p.path for p in problems if p.kind == "extra"))
    return VerificationResult(path=d, kind=kind, steps=steps.done(),
                              keyids=tuple(got.get("keyids", ())), statement=statement,
                              reference=ref_dir, extra_files=extra,
                              other_attestations=tuple(got.get("others", ())))


# --------------------------------------------------------------------------- discovery


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EvidenceDir:
    """A reference or candidate-run directory found under a root.

    Attributes:
        path: the directory.
        kind: ``reference``, ``candidate-run`` or ``unknown``.
        state: ``sealed`` (a manifest or an attestation is present: verify it),
            ``incomplete`` (``INCOMPLETE`` marker, moved aside as ``*.incomplete-*``, or
            never sealed).
        reason: why it is ``incomplete``.
        contract: contract name (``run.json`` / ``reference.json`` / statement / parent).
        contract_digest: the digest its own records name (``None`` if unknown).
        run_id: a run's id.
        date: run start or reference creation time (ISO-8601) if known.
    """

    path: Path
    kind: str
    state: Literal["sealed", "incomplete"]
    reason: str = ""
    contract: str | None = None
    contract_digest: str | None = None
    run_id: str | None = None
    date: str | None = None


def _maybe_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _statement_unverified(d: Path) -> dict[str, Any]:
    """The statement of an attestation, unverified (for labels only)."""
    try:
        stmt = json.loads(read_envelope(d).payload)
    except (QualifyError, ValueError):
        return {}
    return stmt if isinstance(stmt, dict) else {}


def _classify(d: Path) -> EvidenceDir | None:
    names = set(os.listdir(d))
    marker = _maybe_json(d / store.INCOMPLETE_FILE) if store.INCOMPLETE_FILE in names else {}
    manifest = _maybe_json(d / store.MANIFEST_FILE) if store.MANIFEST_FILE in names else {}
    moved = INCOMPLETE_INFIX in d.name
    kind = None
    if RUN_FILE in names:
        kind = RUN_KIND
    elif REFERENCE_FILE in names:
        kind = REFERENCE_KIND
    elif manifest.get("kind") in (RUN_KIND, REFERENCE_KIND):
        kind = str(manifest["kind"])
    elif marker.get("kind") in (RUN_KIND, REFERENCE_KIND):
        kind = str(marker["kind"])
    elif ATTESTATION_FILE in names or (moved and (marker or manifest)):
        kind = "unknown"
    if kind is None:
        return None
    stmt = _statement_unverified(d) if ATTESTATION_FILE in names else {}
    raw_pred = stmt.get("predicate")
    pred: dict[str, Any] = raw_pred if isinstance(raw_pred, dict) else {}
    if kind == "unknown" and pred.get("kind") in (RUN_KIND, REFERENCE_KIND):
        kind = str(pred["kind"])
    raw_contract = pred.get("contract")
    pcontract: dict[str, Any] = raw_contract if isinstance(raw_contract, dict) else {}
    contract = pcontract.get("name")
    digest = pcontract.get("digest")
    run_id = date = None
    if kind == RUN_KIND:
        doc = _maybe_json(d / RUN_FILE)
        contract = doc.get("contract", contract) or d.parent.name
        digest = doc.get("contract_digest", digest)
        run_id = str(doc.get("run_id", d.name))
        date = doc.get("started") or manifest.get("created")
    elif kind == REFERENCE_KIND:
        doc = _maybe_json(d / REFERENCE_FILE)
        contract = doc.get("contract", contract)
        digest = doc.get("contract_digest", digest)
        date = doc.get("created") or manifest.get("created")
    reason = ""
    if moved:
        reason = "moved aside as an interrupted directory (*.incomplete-*)"
    elif store.INCOMPLETE_FILE in names and store.MANIFEST_FILE not in names:
        reason = "INCOMPLETE marker: interrupted or still being written"
    elif store.MANIFEST_FILE not in names and ATTESTATION_FILE not in names:
        reason = "no manifest: never sealed (not finished or not compared)"
    return EvidenceDir(path=d, kind=kind, state="incomplete" if reason else "sealed",
                       reason=reason, contract=str(contract) if contract else None,
                       contract_digest=str(digest) if digest else None, run_id=run_id,
                       date=str(date) if date else None)


def find_evidence(root: str | Path) -> list[EvidenceDir]:
    """Every reference and candidate-run directory at or below ``root``.

    A directory holding ``run.json``, ``reference.json``, a manifest or ``INCOMPLETE``
    marker of kind ``reference`` / ``candidate-run``, an attestation, or named
    ``*.incomplete-*`` is evidence; its subdirectories are not searched further. Hidden
    directories and symbolic links are skipped.

    Returns:
        The directories, sorted by path.
    """
    out: list[EvidenceDir] = []
    r = Path(root)
    if not r.is_dir():
        return out
    stack = [r]
    while stack:
        d = stack.pop()
        try:
            found = _classify(d)
        except OSError:
            continue
        if found is not None:
            out.append(found)
            continue
        try:
            subs = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        stack.extend(Path(e.path) for e in reversed(subs)
                     if e.is_dir(follow_symlinks=False) and not e.name.startswith("."))
    return sorted(out, key=lambda e: str(e.path))
