"""``qualify verify``: ordered verification of a signed reference or candidate run.

Modelled on in-toto's ``verifylib.in_toto_verify``: numbered ``verify_*`` steps, each
raising exactly one error type (all :class:`~qualify.errors.EvidenceIntegrityError`,
exit code 3), gathered into a :class:`VerificationResult` (python-tuf style: ``bool()``,
the steps that passed, the problems):

1. :func:`verify_envelope` - ``attestation.dsse.json`` is a DSSE envelope
   (:class:`~qualify.errors.EnvelopeFormatError`);
2. :func:`verify_signature` - at least one signature, every one by a trusted key, no key
   twice, each verifies over PAE (:class:`~qualify.errors.SignatureVerificationError`);
3. :func:`verify_statement_types` - ``payloadType``, ``_type``, ``predicateType`` and the
   statement schema (:class:`~qualify.errors.StatementTypeError`);
4. :func:`verify_subjects` - every subject digest equals the manifest and the file on disk,
   every manifest file is a subject (:class:`~qualify.errors.SubjectDigestError`);
5. :func:`verify_no_unlisted_files` - no file on disk outside the manifest but the one
   ``attestation.dsse.json`` (:class:`~qualify.errors.UnlistedFileError`);
6. :func:`verify_contract` - the contract digest equals the committed contract's and the
   directory's own records (:class:`~qualify.errors.ContractDigestError`);
7. :func:`verify_reference` (runs) - the reference verifies (steps 1-6), is the one the run
   names, and its ``bounds.json`` digest is the run's
   (:class:`~qualify.errors.ReferenceBindingError`);
8. :func:`verify_seal_times` - the statement's sealing time is the manifest's, no later
   than its signing time, and no earlier than the directory's own record
   (``reference.json`` ``created``); for a run also :func:`verify_seal_order`: the reference
   was sealed before the run started and attested before the run was
   (:class:`~qualify.errors.SealOrderError`);
9. for a reference, :func:`~qualify.evidence.bounds_check.verify_bounds`: every sealed bound
   is the contract's rule applied again to the sealed control errors, floors, k and terms,
   and the control errors are the sealed control runs measured again against the sealed
   reference (:class:`~qualify.errors.BoundsMismatchError`); for a run, :func:`verify_verdicts`: the
   report recomputed from the raw outputs and the sealed bounds
   (``compare_run(..., write=False)``) equals ``report.json`` (every row's error, bound,
   margin and verdict), ``report.md`` is its rendering byte for byte, and the statement's
   verdicts are the report's (:class:`~qualify.errors.VerdictMismatchError`). A run's
   reference passes all nine steps within step 7, so its bounds are recomputed too.

Every JSON document is read through :mod:`qualify.jsonio` (bounded, no link followed,
duplicate keys refused), so a hostile file fails its step and never exhausts memory.

Steps 1-3 are prerequisites (a failure skips the rest); 4-8 all run so every problem is
listed; 9 runs only when 1-8 passed. The steps as data (numbers, names, errors, the
result) are :mod:`qualify.evidence.steps`; finding directories to verify is
:mod:`qualify.evidence.discover`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from qualify.digests import sha256_file
from qualify.errors import (
    ContractDigestError,
    EnvelopeFormatError,
    EvidenceIntegrityError,
    QualifyError,
    ReferenceBindingError,
    SealOrderError,
    SignatureVerificationError,
    StatementTypeError,
    SubjectDigestError,
    UnlistedFileError,
    VerdictMismatchError,
)
from qualify.evidence import store
from qualify.evidence.bounds_check import verify_bounds
from qualify.evidence.discover import EvidenceDir, find_evidence
from qualify.evidence.dsse import (
    PAYLOAD_TYPE,
    Envelope,
    read_envelope,
    verify_envelope_signatures,
)
from qualify.evidence.keys import trusted_keys
from qualify.evidence.recompute import verify_verdicts
from qualify.evidence.statement import (
    PREDICATE_TYPE,
    REFERENCE_KIND,
    RUN_KIND,
    STATEMENT_TYPE,
    read_json,
    read_run,
)
from qualify.evidence.steps import (
    STEPS,
    StepOutcome,
    StepRunner,
    VerificationResult,
    listing,
    predicate,
)
from qualify.evidence.timestamps import parse_time
from qualify.jsonio import loads_strict
from qualify.layout import (
    ATTESTATION_FILE,
    ATTESTATION_SUFFIX,
    BOUNDS_FILE,
    CONTRACT_FILE,
    MANIFEST_FILE,
    REFERENCE_FILE,
    REPORT_JSON,
    REPORT_MD,
    RUN_FILE,
    resolve_reference,
)
from qualify.schema import first_error

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
    "stray_attestations",
    "verify",
    "verify_contract",
    "verify_envelope",
    "verify_no_unlisted_files",
    "verify_reference",
    "verify_seal_order",
    "verify_seal_times",
    "verify_signature",
    "verify_statement_types",
    "verify_subjects",
    "verify_verdicts",
]



# --------------------------------------------------------------------------- helpers


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
            from qualify.evidence.supersede import check

            marker, _ = check(directory, listing=False)
            later = f"; superseded by run {marker.superseded_by}: verify that run" \
                if marker is not None else ""
            raise EnvelopeFormatError(f"{directory}: incomplete (INCOMPLETE marker) and "
                                      f"unsigned{later}") from None
        raise


def verify_signature(envelope: Envelope,
                     trusted: Mapping[str, Ed25519PublicKey]) -> tuple[str, ...]:
    """Step 2: signatures against the trusted keys.

    See :func:`qualify.evidence.dsse.verify_envelope_signatures` for the policy.

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
        StatementTypeError: any of them is wrong, or the payload is not strict JSON (a
            duplicate key: two readers could read two statements).
    """
    if envelope.payload_type != PAYLOAD_TYPE:
        raise StatementTypeError(f"payloadType is {envelope.payload_type!r}, expected "
                                 f"{PAYLOAD_TYPE!r}")
    try:
        statement = loads_strict(envelope.payload, what="payload")
    except EvidenceIntegrityError as exc:
        raise StatementTypeError(f"payload is not strict JSON: {exc}") from None
    if not isinstance(statement, dict):
        raise StatementTypeError("payload is not a JSON object")
    if statement.get("_type") != STATEMENT_TYPE:
        raise StatementTypeError(f"_type is {statement.get('_type')!r}, expected "
                                 f"{STATEMENT_TYPE!r}")
    if statement.get("predicateType") != PREDICATE_TYPE:
        raise StatementTypeError(f"predicateType is {statement.get('predicateType')!r}, "
                                 f"expected {PREDICATE_TYPE!r}")
    problem = first_error(statement, "statement")
    if problem is not None:
        raise StatementTypeError(f"statement {problem} (schema statement.schema.json)")
    return statement


def verify_subjects(directory: Path, statement: Mapping[str, Any],
                    problems: Sequence[store.Problem] | None = None) -> int:
    """Step 4: subjects = manifest files + ``MANIFEST.json``, digests equal, files intact.

    Args:
        directory: the directory.
        statement: the statement from step 3.
        problems: :func:`qualify.evidence.store.verify_manifest` of ``directory`` (computed if
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
        raise SubjectDigestError(f"{directory}: {listing(bad)}")
    manifest = store.read_manifest(directory)
    mdigest = store.manifest_digest(directory)
    listed = {rel: e["sha256"] for rel, e in manifest["files"].items()}
    listed[MANIFEST_FILE] = mdigest
    subjects: dict[str, str] = {}
    for s in statement["subject"]:
        if s["name"] in subjects:
            bad.append(f"{s['name']}: subject listed twice")
        subjects[s["name"]] = s["digest"]["sha256"]
    bad += [f"{n}: in the manifest, not a subject" for n in sorted(set(listed) - set(subjects))]
    bad += [f"{n}: a subject, not in the manifest" for n in sorted(set(subjects) - set(listed))]
    bad += [f"{n}: subject sha256 {subjects[n][:12]}, manifest {listed[n][:12]}"
            for n in sorted(set(listed) & set(subjects)) if subjects[n] != listed[n]]
    pred = predicate(statement)
    if pred.get("manifestDigest") != mdigest:
        bad.append(f"{MANIFEST_FILE}: digest {mdigest[:12]}, the statement says "
                   f"{str(pred.get('manifestDigest'))[:12]}")
    own = {REFERENCE_KIND: ("boundsDigest", BOUNDS_FILE), RUN_KIND: ("reportDigest", REPORT_JSON)}
    if pred.get("kind") in own:
        field, name = own[str(pred["kind"])]
        claimed = (pred.get("verdicts") or {}).get(field) if field == "reportDigest" \
            else pred.get(field)
        if claimed != listed.get(name):
            bad.append(f"{name}: manifest sha256 {str(listed.get(name))[:12]}, the statement's "
                       f"{field} is {str(claimed)[:12]}")
    if manifest["kind"] != pred.get("kind"):
        bad.append(f"{MANIFEST_FILE}: kind {manifest['kind']!r}, the statement says "
                   f"{pred.get('kind')!r}")
    if bad:
        raise SubjectDigestError(f"{len(bad)} problem(s): {listing(sorted(set(bad)))}")
    return len(subjects)


def stray_attestations(directory: Path) -> tuple[str, ...]:
    """Every ``*.dsse.json`` under ``directory`` but its own ``attestation.dsse.json``."""
    out: list[str] = []
    for root, _dirs, files in os.walk(directory, followlinks=False):
        for name in files:
            rel = (Path(root) / name).relative_to(directory).as_posix()
            if name.endswith(ATTESTATION_SUFFIX) and rel != ATTESTATION_FILE:
                out.append(rel)
    return tuple(sorted(out))


def verify_no_unlisted_files(directory: Path,
                             problems: Sequence[store.Problem] | None = None) -> int:
    """Step 5: every file on disk is in the manifest, except the one attestation.

    The only file a manifest cannot list is the directory's own ``attestation.dsse.json``
    (written after sealing). Any other ``*.dsse.json`` (:func:`stray_attestations`), at the
    top or below, is an unlisted file like any other: nothing verifies it, so nothing may
    carry it.

    Returns:
        The number of files in the manifest.

    Raises:
        UnlistedFileError: files on disk outside the manifest (all are named).
    """
    probs = list(store.verify_manifest(directory)) if problems is None else list(problems)
    extra = {p.path for p in probs if p.kind == "extra"} | set(stray_attestations(directory))
    if extra:
        raise UnlistedFileError(f"{len(extra)} file(s) not in the manifest: "
                                f"{listing(sorted(extra))}")
    return len(store.read_manifest(directory)["files"])


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

    pred = predicate(statement)
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
        records.append((CONTRACT_FILE,
                        sha256_hex(canonical_json(read_json(directory / CONTRACT_FILE)))))
        for name in (REFERENCE_FILE, BOUNDS_FILE):
            records.append((name, _field(directory, name, "contract_digest",
                                         ContractDigestError)))
    else:
        records.append((RUN_FILE, read_run(directory).contract_digest))
        records.append((REPORT_JSON, _field(directory, REPORT_JSON, "contract_digest",
                                            ContractDigestError)))
    bad = [f"{f}: contract digest {str(v)[:12]}" for f, v in records if v != digest]
    if bad:
        raise ContractDigestError(f"statement says {digest[:12]}, but {listing(bad)}")
    return str(path)


def _field(directory: Path, name: str, key: str,
           error: type[EvidenceIntegrityError]) -> Any:
    """``key`` of the JSON document ``name`` of ``directory`` (``None`` if absent).

    Raises:
        EvidenceIntegrityError: ``error``: the document is not a JSON object (named with
            what it is).
    """
    doc = read_json(directory / name)
    if not isinstance(doc, dict):
        raise error(f"{name}: not a JSON object (a JSON {type(doc).__name__})")
    return doc.get(key)


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
    pred = predicate(statement)
    run_doc = read_run(run_dir)
    try:
        ref_dir = resolve_reference(run_dir, run_doc, reference_dir)
    except QualifyError as exc:
        raise ReferenceBindingError(str(exc)) from None
    ref = verify(ref_dir, trusted=trusted, contract=contract, contracts_dir=contracts_dir)
    if ref.kind != REFERENCE_KIND and ref.passed:
        raise ReferenceBindingError(f"{ref_dir}: not a reference (kind {ref.kind!r})")
    if not ref.passed:
        raise ReferenceBindingError(f"reference {ref_dir} does not verify: "
                                    f"{listing(list(ref.problems))}")
    assert ref.statement is not None
    ref_pred = predicate(ref.statement)
    bound = pred["reference"]
    mdigest = store.manifest_digest(ref_dir)
    bounds = sha256_file(ref_dir / BOUNDS_FILE)
    report = read_json(run_dir / REPORT_JSON)
    checks = [
        ("reference manifest digest (statement)", bound["manifestDigest"], mdigest),
        ("reference manifest digest (run.json)", run_doc.reference.manifest_digest, mdigest),
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
        raise ReferenceBindingError(f"{listing(bad)}: the bounds or the reference changed "
                                    "after the run")
    return ref_dir, ref.statement


def verify_seal_order(run_dir: Path, statement: Mapping[str, Any], ref_dir: Path,
                      ref_statement: Mapping[str, Any]) -> None:
    """Step 8: the reference was sealed before the run started and attested before it.

    Checks: reference ``sealed`` < ``run.json`` ``started`` (= the statement's); the
    run was sealed after it started; reference ``signed`` <= run ``signed``; the reference
    attestation on disk is the one the run statement names (digest), with the same
    sealing and signing times; the run's own times (:func:`verify_seal_times`).

    Raises:
        SealOrderError: any of these fails.
    """
    pred, ref_pred = predicate(statement), predicate(ref_statement)
    run_doc = read_run(run_dir)
    bad = _seal_time_problems(run_dir, pred)
    started_raw = run_doc.started
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
    att = sha256_file(ref_dir / ATTESTATION_FILE)
    if bound["attestationDigest"] != att:
        bad.append(f"reference attestation digest {att[:12]}, the run was signed against "
                   f"{bound['attestationDigest'][:12]} (reference re-attested later)")
    for k in ("sealed", "signed"):
        if bound[k] != ref_pred[k]:
            bad.append(f"reference {k} {ref_pred[k]}, the run statement says {bound[k]}")
    if bad:
        raise SealOrderError(listing(bad))


def verify_seal_times(directory: Path, statement: Mapping[str, Any]) -> str:
    """Step 8 of a reference (and part of a run's): its own sealing time is in order.

    Checks: the statement's ``sealed`` is ``MANIFEST.json``'s ``created``; it is no later
    than the statement's ``signed`` (a directory is attested after it is sealed); for a
    reference, ``reference.json``'s ``created`` (written just before sealing) is no later
    than ``sealed``.

    Returns:
        The step's detail line.

    Raises:
        SealOrderError: any of these fails (all are named).
    """
    pred = predicate(statement)
    bad = _seal_time_problems(directory, pred)
    if bad:
        raise SealOrderError(listing(bad))
    return f"sealed {pred['sealed']}, attested {pred['signed']}"


def _seal_time_problems(directory: Path, pred: Mapping[str, Any]) -> list[str]:
    bad: list[str] = []
    created = store.read_manifest(directory)["created"]
    if pred["sealed"] != created:
        bad.append(f"statement sealed {pred['sealed']}, {MANIFEST_FILE} created {created}")
    sealed = parse_time(pred["sealed"], f"{directory}: statement sealed")
    if sealed > parse_time(pred["signed"], f"{directory}: statement signed"):
        bad.append(f"sealed {pred['sealed']}, after it was attested {pred['signed']}")
    if pred["kind"] == REFERENCE_KIND:
        written = _field(directory, REFERENCE_FILE, "created", SealOrderError)
        if written is not None and \
                parse_time(written, f"{directory / REFERENCE_FILE}: created") > sealed:
            bad.append(f"{REFERENCE_FILE} created {written}, after the reference was sealed "
                       f"{pred['sealed']}")
    return bad


# --------------------------------------------------------------------------- orchestration


def verify(path: str | Path, *, trusted: Mapping[str, Ed25519PublicKey] | None = None,
           trusted_keys_dir: str | Path | None = None, contract: str | Path | None = None,
           contracts_dir: str | Path | None = None, reference_dir: str | Path | None = None,
           recompute: bool = True) -> VerificationResult:
    """Run the verification steps on a signed reference or candidate run.

    Args:
        path: the directory.
        trusted: trusted keys (default: :func:`qualify.evidence.keys.trusted_keys` of
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
    steps = StepRunner()
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
        n = verify_no_unlisted_files(d, problems)
        return f"every file but {ATTESTATION_FILE} is in the manifest ({n} files)"

    steps.run(5, s5)

    def s6() -> str:
        where = verify_contract(d, statement, contract=contract, contracts_dir=contracts_dir)
        return f"{statement['predicate']['contract']['digest'][:12]} = {where}"

    steps.run(6, s6)
    ref_dir: Path | None = None
    if kind == REFERENCE_KIND:
        steps.mark(7, "not-applicable", "a reference")
        steps.run(8, lambda: verify_seal_times(d, statement))
        if not recompute:
            steps.mark(9, "skipped", "recomputation not requested")
        elif any(steps.outcomes[n].status == "failed" for n in range(1, 9)):
            steps.mark(9, "skipped", "an earlier step failed")
        else:
            steps.run(9, lambda: verify_bounds(d))
    elif kind != RUN_KIND:
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
                return "run sealed before attested; reference sealed and attested before " \
                       "the run"

            steps.run(8, s8)
            if not recompute:
                steps.mark(9, "skipped", "recomputation not requested")
            elif any(steps.outcomes[n].status == "failed" for n in range(1, 9)):
                steps.mark(9, "skipped", "an earlier step failed")
            else:
                steps.run(9, lambda: f"{verify_verdicts(d, statement, rd)} cells recomputed: "
                                     f"{REPORT_JSON} and {REPORT_MD} equal")
        else:
            steps.mark(8, "skipped", "the reference did not verify")
            steps.mark(9, "skipped", "the reference did not verify")
    extra = tuple(sorted(p.path for p in problems if p.kind == "extra"))
    return VerificationResult(path=d, kind=kind, steps=steps.done(),
                              keyids=tuple(got.get("keyids", ())), statement=statement,
                              reference=ref_dir, extra_files=extra,
                              other_attestations=stray_attestations(d))
