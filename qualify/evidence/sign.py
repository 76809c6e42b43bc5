"""Signing a sealed directory: its statement in a DSSE envelope, Ed25519 keys.

Every sealed reference and every sealed candidate run gets one attestation,
``attestation.dsse.json``, added after sealing with
:func:`qualify.evidence.store.add_attestation` (docs/concepts.md). The pieces live in
their own modules: the envelope in :mod:`qualify.evidence.dsse`, the keys in
:mod:`qualify.evidence.keys`, the statement and its predicate in
:mod:`qualify.evidence.statement`; this module signs (:func:`sign_statement`,
:func:`sign_directory`, :func:`ensure_signed`, :func:`seal_and_sign`) and re-exports
their public names for the callers of ``qualify.evidence.sign``.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qualify import atomic
from qualify.display import printable
from qualify.errors import (
    EnvelopeFormatError,
    EvidenceIntegrityError,
    SignatureVerificationError,
    UsageError,
)
from qualify.evidence import store
from qualify.evidence.dsse import (
    PAYLOAD_TYPE,
    Envelope,
    Signature,
    pae,
    read_envelope,
    verify_envelope_signatures,
)
from qualify.evidence.keys import (
    ENV_SIGNING_KEY,
    ENV_SIGNING_KEY_FILE,
    SigningKey,
    default_keys_dir,
    default_signing_key,
    dev_key_path,
    generate_key,
    key_id,
    load_public_key,
    load_signing_key,
    trusted_keys,
)
from qualify.evidence.statement import (
    PREDICATE_TYPE,
    REFERENCE_KIND,
    RUN_KIND,
    STATEMENT_TYPE,
    TEST_RESULT_PREDICATE_TYPE,
    build_statement,
    environment_summary,
    statement_bytes,
)
from qualify.evidence.timestamps import parse_time
from qualify.layout import ATTESTATION_FILE, BOUNDS_FILE, REFERENCE_FILE, RUN_FILE
from qualify.layout import REPORT_JSON as REPORT_FILE

__all__ = [
    "ATTESTATION_FILE",
    "BOUNDS_FILE",
    "ENV_SIGNING_KEY",
    "ENV_SIGNING_KEY_FILE",
    "PAYLOAD_TYPE",
    "PREDICATE_TYPE",
    "REFERENCE_FILE",
    "REFERENCE_KIND",
    "REPORT_FILE",
    "RUN_FILE",
    "RUN_KIND",
    "STATEMENT_TYPE",
    "TEST_RESULT_PREDICATE_TYPE",
    "Envelope",
    "EnvelopeFormatError",
    "Signature",
    "SignatureVerificationError",
    "SigningKey",
    "build_statement",
    "default_keys_dir",
    "default_signing_key",
    "dev_key_path",
    "ensure_signed",
    "environment_summary",
    "generate_key",
    "key_id",
    "load_public_key",
    "load_signing_key",
    "needs_signature",
    "pae",
    "parse_time",
    "read_envelope",
    "seal_and_sign",
    "sign_directory",
    "sign_statement",
    "statement_bytes",
    "trusted_keys",
    "verify_envelope_signatures",
]

_log = logging.getLogger(__name__)


def sign_statement(statement: Mapping[str, Any], keys: SigningKey | Sequence[SigningKey],
                   ) -> Envelope:
    """Wrap a statement in a DSSE envelope signed by ``keys``.

    Args:
        statement: the in-toto statement.
        keys: one key, or several (one signature each).

    Returns:
        The envelope.
    """
    ks = [keys] if isinstance(keys, SigningKey) else list(keys)
    payload = statement_bytes(statement)
    message = pae(PAYLOAD_TYPE, payload)
    return Envelope(payload=payload, payload_type=PAYLOAD_TYPE,
                    signatures=tuple(Signature(keyid=k.keyid, sig=k.sign(message)) for k in ks))


def _remove_dead_signers_temporaries(d: Path) -> None:
    """Remove the attestation temporary of a signer killed before its rename.

    A signer writes ``attestation.dsse.json`` through a temporary in the sealed (read-only)
    directory; killed before the rename, it leaves that temporary, which the manifest check
    of :func:`~qualify.evidence.statement.build_statement` refuses as an unlisted file, so no
    later ``sign``, ``compare`` or ``run`` could attest the directory. Only a temporary of
    the attestation whose writer is known dead (:func:`qualify.atomic.writer_alive`) is
    removed (``tests/test_kill_points.py``: the ``ref-sign`` and ``cmp-sign`` points).
    """
    stale = [p for p in d.iterdir() if atomic.is_temporary(p.name)
             and (w := atomic.temp_writer(p.name)) is not None and w.name == ATTESTATION_FILE
             and atomic.writer_alive(p) is False] if d.is_dir() else []
    if not stale:
        return
    mode = stat.S_IMODE(d.stat().st_mode)
    os.chmod(d, mode | stat.S_IWUSR)
    try:
        atomic.remove_stale_temporaries(d, name=ATTESTATION_FILE)
    finally:
        os.chmod(d, mode)


def sign_directory(directory: str | Path, key: SigningKey | None = None, *,
                   reference_dir: str | Path | None = None) -> Path:
    """Attest a sealed reference or candidate run: write its ``attestation.dsse.json``.

    Args:
        directory: the sealed directory.
        key: the signing key (default :func:`default_signing_key`).
        reference_dir: for a run, its reference (default: :func:`qualify.layout.resolve_reference`).

    Returns:
        The attestation path.

    Raises:
        EvidenceIntegrityError: the directory is not sealed or not intact, or already has
            an attestation (never overwritten; only a partial one, the empty or unparsable
            leftover of an interrupted signing
            (:func:`qualify.evidence.store.is_partial_attestation`), is replaced).
        ReferenceDataError: a run that was not compared, or whose reference is missing or
            unsigned.
        UsageError: the directory is neither a reference nor a candidate run.
    """
    d = Path(directory)
    _remove_dead_signers_temporaries(d)
    if os.path.lexists(d / ATTESTATION_FILE) and not store.is_partial_attestation(
            d / ATTESTATION_FILE):
        raise EvidenceIntegrityError(f"{d / ATTESTATION_FILE}: exists; an attestation is "
                                     "never overwritten")
    statement = build_statement(d, reference_dir=reference_dir)
    k = key if key is not None else default_signing_key()
    envelope = sign_statement(statement, k)
    path = store.add_attestation(d, ATTESTATION_FILE, envelope.to_json())
    _log.info("%s: signed by keyid %s (%s)", printable(path), k.keyid[:16],
              printable(k.source))
    return path


def ensure_signed(directory: str | Path, key: SigningKey | None = None) -> Path:
    """Sign a sealed directory unless it carries an attestation already.

    A partial attestation, left by an interrupted signing, does not count: it is replaced.

    For the pipeline: a reference sealed before signing existed (or by another machine) is
    signed before the runs judged against it are (verification step 8 wants the reference
    attested no later than the run).

    Returns:
        The attestation path.

    Raises:
        EvidenceIntegrityError: see :func:`sign_directory`.
        ReferenceDataError: see :func:`sign_directory`.
        UsageError: see :func:`sign_directory`.
    """
    path = Path(directory) / ATTESTATION_FILE
    if path.is_file() and not store.is_partial_attestation(path):
        return path
    return sign_directory(directory, key)


def needs_signature(directory: str | Path) -> bool:
    """True if sealed ``directory`` has no attestation, or only a partial one.

    For resuming: a ``qualify compare`` killed while signing leaves a sealed, unsigned run
    (or one with the partial attestation of an older signer); it is signed again, never
    compared again.
    """
    path = Path(directory) / ATTESTATION_FILE
    return store.is_sealed(directory) and (not os.path.lexists(path)
                                           or store.is_partial_attestation(path))


def seal_and_sign(directory: str | Path, *, kind: str, key: SigningKey | None = None,
                  reference_dir: str | Path | None = None) -> Path:
    """Seal ``directory`` (:func:`qualify.evidence.store.seal`), then :func:`sign_directory` it.

    A run directory holding already-sealed attempt directories seals fine: the run's
    manifest lists the attempts' files and their ``MANIFEST.json``.

    Args:
        directory: the finished directory.
        kind: ``reference`` or ``candidate-run``.
        key: signing key (default :func:`default_signing_key`).
        reference_dir: for a run, its reference.

    Returns:
        The attestation path.

    Raises:
        EvidenceIntegrityError: see :func:`qualify.evidence.store.seal` and :func:`sign_directory`.
        ReferenceDataError: see :func:`sign_directory`.
        UsageError: ``kind`` is not signable.
    """
    if kind not in (REFERENCE_KIND, RUN_KIND):
        raise UsageError(f"kind {kind!r}: only '{REFERENCE_KIND}' and '{RUN_KIND}' are signed")
    store.seal(directory, kind=kind)
    return sign_directory(directory, key, reference_dir=reference_dir)
