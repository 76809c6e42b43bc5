"""Standard tooling: qualify's attestations verify with securesystemslib's DSSE, and back.

securesystemslib (the Secure Systems Lab's reference implementation, used by in-toto and
TUF) is an independent implementation of the DSSE envelope and of the Ed25519 check: the
test builds its key object from the committed-style public key file (PEM
SubjectPublicKeyInfo) and the key id qualify names (sha256 of the raw 32-byte key,
recomputed here), and calls ``dsse.Envelope.verify``. The run is test_verify's signed world
(a real candidate run compared, sealed and signed by qualify's own code).
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from test_verify import World, signed_world

from qualify.evidence import sign as signing
from qualify.evidence.keys import trusted_keys

dsse = pytest.importorskip("securesystemslib.dsse")
sslib_signer = pytest.importorskip("securesystemslib.signer")
sslib_exc = pytest.importorskip("securesystemslib.exceptions")

__all__ = ["signed_world"]


def sslib_key(pub_file: Path) -> Any:
    """securesystemslib's key object from a qualify ``*.pub`` file, key id recomputed."""
    public = serialization.load_pem_public_key(pub_file.read_bytes())
    assert isinstance(public, Ed25519PublicKey)
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    keyid = hashlib.sha256(raw).hexdigest()
    return sslib_signer.SSlibKey.from_crypto(public, keyid=keyid, scheme="ed25519")


def envelope_dict(run: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((run / "attestation.dsse.json").read_bytes())
    return doc


def trusted_pub(w: World) -> Path:
    (pub,) = w.keys.glob(f"trusted-{w.key.keyid[:16]}.pub")
    return pub


def test_real_run_attestation_verifies_with_securesystemslib(signed_world: World) -> None:
    key = sslib_key(trusted_pub(signed_world))
    assert key.keyid == signed_world.key.keyid  # qualify's key id is sha256(raw key)
    env = dsse.Envelope.from_dict(envelope_dict(signed_world.good))
    accepted = env.verify([key], threshold=1)
    assert list(accepted) == [signed_world.key.keyid]
    stmt = json.loads(env.payload)
    assert env.payload_type == "application/vnd.in-toto+json"
    assert stmt["_type"] == "https://in-toto.io/Statement/v1"
    # the statement binds the manifest: its subject digest is the file's sha256, recomputed
    manifest = signed_world.good / "MANIFEST.json"
    subjects = {s["name"]: s["digest"]["sha256"] for s in stmt["subject"]}
    assert subjects["MANIFEST.json"] == hashlib.sha256(manifest.read_bytes()).hexdigest()
    # and the reference's attestation, too
    ref_env = dsse.Envelope.from_dict(envelope_dict(signed_world.reference))
    assert list(ref_env.verify([key], threshold=1)) == [signed_world.key.keyid]


def _edited_payload(doc: dict[str, Any]) -> dict[str, Any]:
    stmt = json.loads(base64.b64decode(doc["payload"]))
    stmt["predicate"]["kind"] = "reference"
    return {**doc, "payload": base64.b64encode(json.dumps(stmt).encode()).decode()}


def _flipped_payload_byte(doc: dict[str, Any]) -> dict[str, Any]:
    raw = bytearray(base64.b64decode(doc["payload"]))
    raw[len(raw) // 2] ^= 0x01
    return {**doc, "payload": base64.b64encode(bytes(raw)).decode()}


def _other_payload_type(doc: dict[str, Any]) -> dict[str, Any]:
    return {**doc, "payloadType": "application/json"}


def _corrupted_signature(doc: dict[str, Any]) -> dict[str, Any]:
    (sig,) = doc["signatures"]
    raw = bytearray(base64.b64decode(sig["sig"]))
    raw[0] ^= 0x80
    return {**doc, "signatures": [{**sig, "sig": base64.b64encode(bytes(raw)).decode()}]}


TAMPER = {"edited-payload": _edited_payload, "flipped-payload-byte": _flipped_payload_byte,
          "payload-type": _other_payload_type, "corrupted-signature": _corrupted_signature}


@pytest.mark.parametrize("name", list(TAMPER), ids=list(TAMPER))
def test_securesystemslib_rejects_a_tampered_envelope(signed_world: World, name: str) -> None:
    key = sslib_key(trusted_pub(signed_world))
    env = dsse.Envelope.from_dict(TAMPER[name](envelope_dict(signed_world.good)))
    with pytest.raises(sslib_exc.VerificationError):
        env.verify([key], threshold=1)


def test_securesystemslib_rejects_another_key(signed_world: World, tmp_path: Path) -> None:
    other = tmp_path / "other.pub"
    other.write_bytes(signed_world.untrusted.public_pem())
    key = sslib_key(other)
    doc = envelope_dict(signed_world.good)
    # the signature under the other key's id: its own key id matches, the signature not
    doc["signatures"][0]["keyid"] = key.keyid
    with pytest.raises(sslib_exc.VerificationError):
        dsse.Envelope.from_dict(doc).verify([key], threshold=1)


def test_envelope_signed_by_securesystemslib_verifies_in_qualify(signed_world: World) -> None:
    """The other direction: securesystemslib signs qualify's statement with a CryptoSigner
    of the world's private key; qualify's step-2 check accepts the envelope."""
    from securesystemslib.signer import CryptoSigner

    signer = CryptoSigner(signed_world.key.private_key,
                          sslib_key(trusted_pub(signed_world)))
    payload = signing.read_envelope(signed_world.good).payload
    env = dsse.Envelope(payload=payload, payload_type="application/vnd.in-toto+json",
                        signatures={})
    env.sign(signer)
    ours = signing.Envelope.from_json(json.dumps(env.to_dict()).encode())
    keyids = signing.verify_envelope_signatures(ours, trusted_keys(signed_world.keys))
    assert keyids == (signed_world.key.keyid,)
