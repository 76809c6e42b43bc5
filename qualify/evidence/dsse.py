"""DSSE envelopes: the Pre-Authentication Encoding, the envelope file, its signatures.

The envelope (https://github.com/secure-systems-lab/dsse/blob/master/envelope.md) is
``{"payload": base64, "payloadType": "application/vnd.in-toto+json",
"signatures": [{"keyid", "sig"}]}``; each signature is an Ed25519 signature over
``PAE(payloadType, payload)`` (:func:`pae`), as ``securesystemslib/dsse.py`` does. A
sealed directory's envelope is its ``attestation.dsse.json``
(:data:`qualify.layout.ATTESTATION_FILE`). Verification steps 1 and 2 of
:mod:`qualify.evidence.verify` are :meth:`Envelope.from_json` and
:func:`verify_envelope_signatures`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from qualify.atomic import json_bytes
from qualify.errors import EnvelopeFormatError, EvidenceIntegrityError, SignatureVerificationError
from qualify.jsonio import loads_strict, read_bytes
from qualify.layout import ATTESTATION_FILE

__all__ = ["PAYLOAD_TYPE", "Envelope", "Signature", "pae", "read_envelope",
           "verify_envelope_signatures"]

PAYLOAD_TYPE: Final = "application/vnd.in-toto+json"
"""DSSE payloadType of an in-toto statement."""
_ENVELOPE_KEYS: Final = frozenset({"payload", "payloadType", "signatures"})


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 Pre-Authentication Encoding, the bytes that are signed.

    ``"DSSEv1" SP LEN(type) SP type SP LEN(body) SP body``, lengths as ASCII decimal of
    the byte lengths (DSSE ``protocol.md``).

    Args:
        payload_type: the envelope's ``payloadType``.
        payload: the raw (decoded) payload bytes.

    Returns:
        The PAE bytes.
    """
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def _b64decode(text: str, what: str) -> bytes:
    """Decode standard or URL-safe base64 strictly (DSSE allows either)."""
    for decode in (lambda s: base64.b64decode(s, validate=True),
                   lambda s: base64.b64decode(s, altchars=b"-_", validate=True)):
        try:
            return decode(text.encode("ascii"))
        except (binascii.Error, ValueError, UnicodeEncodeError):
            continue
    raise EnvelopeFormatError(f"{what}: not base64")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Signature:
    """One DSSE signature.

    Attributes:
        keyid: hex sha256 of the signer's raw public key.
        sig: the raw Ed25519 signature (64 bytes) over :func:`pae`.
    """

    keyid: str
    sig: bytes


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Envelope:
    """A DSSE envelope.

    Attributes:
        payload: the decoded payload bytes (canonical JSON of the statement).
        payload_type: ``payloadType``.
        signatures: the signatures, in file order.
    """

    payload: bytes
    payload_type: str
    signatures: tuple[Signature, ...]

    def to_json(self) -> bytes:
        """The envelope file's bytes (JSON, sorted keys, indent 2, trailing newline)."""
        doc = {"payload": base64.b64encode(self.payload).decode("ascii"),
               "payloadType": self.payload_type,
               "signatures": [{"keyid": s.keyid, "sig": base64.b64encode(s.sig).decode("ascii")}
                              for s in self.signatures]}
        return json_bytes(doc)

    @classmethod
    def from_json(cls, data: bytes, *, what: str = "envelope") -> Envelope:
        """Parse and check the form of an envelope (no signature is checked here).

        Args:
            data: the file's bytes.
            what: name for messages (the path).

        Raises:
            EnvelopeFormatError: not UTF-8 JSON (or with a duplicate key), not an object
                with exactly ``payload``, ``payloadType`` and ``signatures``, a field of
                the wrong type, bad base64, or a signature without ``keyid`` / ``sig``.
        """
        try:
            doc = loads_strict(data, what=what)
        except EvidenceIntegrityError as exc:
            raise EnvelopeFormatError(str(exc)) from None
        if not isinstance(doc, dict):
            raise EnvelopeFormatError(f"{what}: not a JSON object")
        missing = sorted(_ENVELOPE_KEYS - set(doc))
        unknown = sorted(set(doc) - _ENVELOPE_KEYS)
        if missing or unknown:
            raise EnvelopeFormatError(f"{what}: DSSE envelope needs exactly payload, "
                                      f"payloadType, signatures (missing {missing}, "
                                      f"unknown {unknown})")
        if not isinstance(doc["payload"], str) or not isinstance(doc["payloadType"], str) \
                or not doc["payloadType"]:
            raise EnvelopeFormatError(f"{what}: payload and payloadType must be strings")
        if not isinstance(doc["signatures"], list):
            raise EnvelopeFormatError(f"{what}: signatures must be a list")
        payload = _b64decode(doc["payload"], f"{what}: payload")
        sigs: list[Signature] = []
        for i, s in enumerate(doc["signatures"]):
            if not isinstance(s, dict) or set(s) != {"keyid", "sig"} \
                    or not isinstance(s["keyid"], str) or not isinstance(s["sig"], str):
                raise EnvelopeFormatError(f"{what}: signatures[{i}] must be "
                                          "{\"keyid\": str, \"sig\": base64 str}")
            sigs.append(Signature(keyid=s["keyid"],
                                  sig=_b64decode(s["sig"], f"{what}: signatures[{i}].sig")))
        return cls(payload=payload, payload_type=doc["payloadType"], signatures=tuple(sigs))


def read_envelope(directory: str | Path) -> Envelope:
    """Read ``attestation.dsse.json`` of ``directory``.

    Raises:
        EnvelopeFormatError: the file is missing (the directory is unsigned), a symbolic
            link or special file, over its size limit (:mod:`qualify.jsonio`), unreadable
            or not a DSSE envelope.
    """
    path = Path(directory) / ATTESTATION_FILE
    try:
        data = read_bytes(path)
    except FileNotFoundError:
        raise EnvelopeFormatError(f"{path}: missing; the directory is not signed "
                                  "(qualify sign DIR)") from None
    except EvidenceIntegrityError as exc:
        raise EnvelopeFormatError(str(exc)) from None
    return Envelope.from_json(data, what=str(path))


def verify_envelope_signatures(envelope: Envelope,
                               trusted: Mapping[str, Ed25519PublicKey]) -> tuple[str, ...]:
    """Check every signature of ``envelope`` against the trusted keys.

    Policy: at least one signature; every signature names a trusted key id, no key id
    appears twice, and every signature verifies over ``PAE(payloadType, payload)``.

    Args:
        envelope: the parsed envelope.
        trusted: key id -> public key (:func:`trusted_keys`).

    Returns:
        The key ids that signed, in envelope order.

    Raises:
        SignatureVerificationError: no trusted keys are configured, no signature, a
            duplicated key id, a signature by an untrusted key, or one that does not verify
            (corrupted signature, edited payload, swapped key id).
    """
    if not trusted:
        raise SignatureVerificationError("no trusted public keys configured "
                                         "(contracts/keys/*.pub)")
    if not envelope.signatures:
        raise SignatureVerificationError("the envelope carries no signature")
    seen: set[str] = set()
    for s in envelope.signatures:
        if s.keyid in seen:
            raise SignatureVerificationError(f"duplicated signature by keyid {s.keyid[:16]}")
        seen.add(s.keyid)
    message = pae(envelope.payload_type, envelope.payload)
    for i, s in enumerate(envelope.signatures):
        key = trusted.get(s.keyid)
        if key is None:
            raise SignatureVerificationError(
                f"signatures[{i}]: keyid {s.keyid[:16]} is not a trusted key "
                f"(trusted: {', '.join(k[:16] for k in sorted(trusted))})")
        try:
            key.verify(s.sig, message)
        except InvalidSignature:
            raise SignatureVerificationError(
                f"signatures[{i}]: signature by keyid {s.keyid[:16]} does not verify "
                "(corrupted signature, edited payload or wrong keyid)") from None
    return tuple(s.keyid for s in envelope.signatures)
