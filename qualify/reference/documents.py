"""A sealed reference's JSON documents as the later stages read them back.

``qualify candidate`` and ``qualify compare`` consume a sealed reference; before either
uses it, the three documents that bind it to a contract are read strictly
(:func:`qualify.jsonio.read_json`: bounded, no link, no duplicate key, no ``NaN`` /
``Infinity``, no number that overflows to infinity) and checked:

- ``reference.json`` against ``reference.schema.json`` (``schema_version`` 1, a contract
  name, a 64-hex ``contract_digest``, an ISO-8601 ``created``);
- ``contract.json``: a valid contract (:meth:`qualify.contract.Contract.from_dict`) whose
  digest is the digest ``reference.json`` and the caller's contract name;
- ``bounds.json`` against ``bounds.schema.json`` (every bound, floor, control error and
  ``k`` a finite non-negative number) for the same contract digest.

A problem is one :class:`~qualify.errors.ReferenceDataError` (exit 2, as every other
problem with a reference a stage is given) naming the file and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qualify import jsonio
from qualify.contract import Contract, canonical_json, sha256_hex
from qualify.errors import ContractError, EvidenceIntegrityError, ReferenceDataError
from qualify.evidence import store
from qualify.evidence.statement import REFERENCE_KIND
from qualify.layout import BOUNDS_FILE, CONTRACT_FILE, REFERENCE_FILE
from qualify.schema import validate

__all__ = [
    "check_reference_documents",
    "load_sealed_reference",
    "read_bounds",
    "read_contract",
    "read_document",
    "read_reference_record",
]


def read_document(path: Path, schema: str | None) -> Any:
    """A strictly read JSON document of a reference, validated against ``schema``.

    Args:
        path: the file.
        schema: schema stem (``contracts/schema/<schema>.schema.json``), or ``None``.

    Returns:
        The parsed document.

    Raises:
        ReferenceDataError: missing, unreadable, not strict JSON, or off its schema (the
            message names the file and the field).
    """
    try:
        doc = jsonio.read_json(path)
    except EvidenceIntegrityError as exc:
        raise ReferenceDataError(str(exc)) from None
    if schema is not None:
        validate(doc, schema, what=str(path), error=ReferenceDataError)
    return doc


def read_reference_record(ref_dir: Path) -> dict[str, Any]:
    """``reference.json``, schema-checked (``reference.schema.json``).

    Raises:
        ReferenceDataError: as :func:`read_document`.
    """
    doc: dict[str, Any] = read_document(ref_dir / REFERENCE_FILE, "reference")
    return doc


def read_contract(ref_dir: Path, digest: str | None = None) -> Contract:
    """The reference's ``contract.json`` as a contract, its digest checked against ``digest``.

    Args:
        ref_dir: the reference directory.
        digest: the contract digest it must have (``None``: not checked).

    Raises:
        ReferenceDataError: missing, not strict JSON, not a valid contract, or another
            contract's (the message names ``contract.json`` and both digests).
    """
    path = ref_dir / CONTRACT_FILE
    doc = read_document(path, None)
    try:
        contract = Contract.from_dict(doc, path=path)
    except ContractError as exc:
        raise ReferenceDataError(str(exc)) from None
    have = sha256_hex(canonical_json(doc))
    if digest is not None and have != digest:
        raise ReferenceDataError(f"{path}: contract digest {have[:12]} is not {digest[:12]}: "
                                 "the reference holds another contract")
    return contract


def read_bounds(ref_dir: Path, digest: str) -> tuple[dict[str, Any], bytes]:
    """``bounds.json`` (schema-checked, of the contract ``digest``) and its bytes.

    Raises:
        ReferenceDataError: missing, not strict JSON, off ``bounds.schema.json`` (a list,
            a negative or missing bound, ...) or sealed for another contract digest.
    """
    path = ref_dir / BOUNDS_FILE
    try:
        data = jsonio.read_bytes(path)
    except FileNotFoundError:
        raise ReferenceDataError(f"{path}: missing; the reference has no sealed bounds") \
            from None
    except (OSError, EvidenceIntegrityError) as exc:
        raise ReferenceDataError(f"{path}: unreadable: {exc}") from None
    doc = jsonio.loads_strict(data, what=str(path), error=ReferenceDataError)
    validate(doc, "bounds", what=str(path), error=ReferenceDataError)
    if doc["contract_digest"] != digest:
        raise ReferenceDataError(f"{path}: contract_digest {doc['contract_digest'][:12]} is "
                                 f"not the reference contract's {digest[:12]}")
    return doc, data


def check_reference_documents(ref_dir: Path, contract: Contract) -> dict[str, Any]:
    """Check that the reference's records are well-formed and all of ``contract``.

    ``reference.json``, ``contract.json`` and ``bounds.json`` must each name
    ``contract.digest`` (the module docstring lists what else is checked).

    Returns:
        ``reference.json``.

    Raises:
        ReferenceDataError: the first problem, naming the file and the field.
    """
    meta = read_reference_record(ref_dir)
    if meta["contract_digest"] != contract.digest:
        raise ReferenceDataError(
            f"{ref_dir / REFERENCE_FILE}: contract_digest: the reference was sealed for "
            f"contract digest {meta['contract_digest'][:12]}, this contract is "
            f"{contract.digest12}")
    read_contract(ref_dir, contract.digest)
    read_bounds(ref_dir, contract.digest)
    return meta


def load_sealed_reference(path: Path, contract: Contract | None = None) -> dict[str, Any]:
    """Check that ``path`` is a sealed, intact reference and return its ``reference.json``.

    Args:
        path: the reference directory.
        contract: the contract it must be of: ``reference.json``, ``contract.json`` and
            ``bounds.json`` are then checked (:func:`qualify.reference.documents
            .check_reference_documents`: schemas, finite non-negative bounds, the digest
            of ``contract`` in each). ``None``: ``reference.json``'s schema only.

    Raises:
        ReferenceDataError: not a directory, not sealed (interrupted or still running),
            sealed but not a reference (a candidate run or an attempt directory), a
            document off its schema, or of another contract (file and field named).
        EvidenceIntegrityError: a file differs from the manifest.
    """
    if not path.is_dir():
        raise ReferenceDataError(f"{path}: reference directory not found")
    if not store.is_sealed(path):
        raise ReferenceDataError(store.not_sealed_reason(
            path, "reference", advice="run `qualify reference` to completion first"))
    kind = store.read_manifest(path).get("kind")
    if kind != REFERENCE_KIND or not (path / REFERENCE_FILE).is_file():
        raise ReferenceDataError(f"{path}: not a reference directory (its manifest's kind is "
                                 f"{kind!r}; a reference holds {REFERENCE_FILE}): name the "
                                 "sealed directory `qualify reference` printed")
    store.check_sealed(path)
    if contract is None:
        return read_reference_record(path)
    return check_reference_documents(path, contract)
