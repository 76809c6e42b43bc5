"""Tests of qualify.evidence.{dsse,keys,statement,sign}: envelopes, keys, signing, the CLI."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from hypothesis import given, settings
from hypothesis import strategies as st
from test_verify import CONTRACT, World, new_key, run_cli, signed_world, world

from qualify.cli.evidence import register
from qualify.errors import (
    EvidenceIntegrityError,
    ExitCode,
    ReferenceDataError,
    SignatureError,
    UsageError,
)
from qualify.evidence import sign as signing
from qualify.evidence import store
from qualify.evidence.sign import (
    Envelope,
    EnvelopeFormatError,
    Signature,
    SignatureVerificationError,
    SigningKey,
)

__all__ = ["signed_world", "world"]  # fixtures shared with test_verify


@pytest.fixture(autouse=True)
def _no_ambient_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tests never see the developer's keys or environment."""
    monkeypatch.delenv(signing.ENV_SIGNING_KEY, raising=False)
    monkeypatch.delenv(signing.ENV_SIGNING_KEY_FILE, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def pem_of(key: SigningKey) -> bytes:
    return key.private_key.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption())


# --------------------------------------------------------------------------- DSSE


def test_envelope_round_trip_and_multiple_signers() -> None:
    a, b = new_key("a"), new_key("b")
    env = signing.sign_statement({"_type": "x"}, [a, b])
    again = Envelope.from_json(env.to_json())
    assert again == env
    assert signing.verify_envelope_signatures(
        again, {a.keyid: a.public_key, b.keyid: b.public_key}) == (a.keyid, b.keyid)
    with pytest.raises(SignatureVerificationError, match="not a trusted key"):
        signing.verify_envelope_signatures(again, {a.keyid: a.public_key})


def test_key_id_is_sha256_of_the_raw_public_key() -> None:
    k = new_key("k")
    raw = k.public_key.public_bytes(serialization.Encoding.Raw,
                                    serialization.PublicFormat.Raw)
    assert k.keyid == hashlib.sha256(raw).hexdigest()
    assert len(raw) == 32


def _env_doc(**change: Any) -> bytes:
    k = new_key("k")
    doc = json.loads(signing.sign_statement({"_type": "x"}, k).to_json())
    doc.update(change)
    return json.dumps(doc).encode()


INVALID_ENVELOPES: dict[str, Callable[[], bytes]] = {
    "not JSON": lambda: b"{not json",
    "not UTF-8": lambda: b"\xff\xfe",
    "a list": lambda: b"[]",
    "no payload": lambda: json.dumps({"payloadType": "t", "signatures": []}).encode(),
    "unknown field": lambda: _env_doc(extra=1),
    "payload not base64": lambda: _env_doc(payload="***"),
    "payloadType empty": lambda: _env_doc(payloadType=""),
    "signatures not a list": lambda: _env_doc(signatures={}),
    "signature without keyid": lambda: _env_doc(signatures=[{"sig": "AAAA"}]),
    "signature not base64": lambda: _env_doc(signatures=[{"keyid": "k", "sig": "%%"}]),
    "signature with extra field": lambda: _env_doc(
        signatures=[{"keyid": "k", "sig": "AAAA", "cert": "x"}]),
}


@pytest.mark.parametrize("name", sorted(INVALID_ENVELOPES))
def test_invalid_envelopes_are_format_errors(name: str) -> None:
    with pytest.raises(EnvelopeFormatError) as info:
        Envelope.from_json(INVALID_ENVELOPES[name]())
    assert isinstance(info.value, SignatureError)
    assert info.value.exit_code == ExitCode.INTEGRITY_ERROR


def test_url_safe_base64_is_accepted() -> None:
    k = new_key("k")
    env = signing.sign_statement({"_type": "?>?>" * 10}, k)
    doc = json.loads(env.to_json())
    doc["payload"] = base64.urlsafe_b64encode(env.payload).decode()
    assert Envelope.from_json(json.dumps(doc).encode()).payload == env.payload


def test_signature_policy() -> None:
    k, other = new_key("k"), new_key("other")
    trusted = {k.keyid: k.public_key, other.keyid: other.public_key}
    env = signing.sign_statement({"_type": "x"}, k)
    (sig,) = env.signatures
    cases: dict[str, Envelope] = {
        "no signature": Envelope(payload=env.payload, payload_type=env.payload_type,
                                 signatures=()),
        "duplicated": Envelope(payload=env.payload, payload_type=env.payload_type,
                               signatures=(sig, sig)),
        "keyid swapped": Envelope(payload=env.payload, payload_type=env.payload_type,
                                  signatures=(Signature(keyid=other.keyid, sig=sig.sig),)),
        "payload edited": Envelope(payload=env.payload + b" ", payload_type=env.payload_type,
                                   signatures=env.signatures),
        "payloadType edited": Envelope(payload=env.payload, payload_type="text/plain",
                                       signatures=env.signatures),
    }
    for name, bad in cases.items():
        with pytest.raises(SignatureVerificationError):
            signing.verify_envelope_signatures(bad, trusted)
        assert name
    with pytest.raises(SignatureVerificationError, match="no trusted public keys"):
        signing.verify_envelope_signatures(env, {})
    assert signing.verify_envelope_signatures(env, trusted) == (k.keyid,)


# --------------------------------------------------------------------------- keys


def test_keygen_cli_writes_0600_private_and_labelled_public(tmp_path: Path) -> None:
    priv = tmp_path / "secret" / "ci.pem"
    pubdir = tmp_path / "keys"
    code, out = run_cli(["keygen", "--name", "proj-ci", "--private-key", str(priv),
                         "--public-dir", str(pubdir)])
    assert code == ExitCode.OK
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    assert stat.S_IMODE(priv.parent.stat().st_mode) == 0o700
    key = signing.load_signing_key(priv)
    (pub,) = pubdir.glob("*.pub")
    assert pub.name == f"proj-ci-{key.keyid[:16]}.pub"
    assert f"# keyid: {key.keyid}" in pub.read_text()
    assert f"keyid {key.keyid}" in out
    assert list(signing.trusted_keys(pubdir)) == [key.keyid]
    code, _ = run_cli(["keygen", "--private-key", str(priv), "--public-dir", str(pubdir)])
    assert code == ExitCode.USAGE_ERROR  # never overwrites a key


def test_mislabelled_public_keys_are_rejected(tmp_path: Path) -> None:
    k, other = new_key("k"), new_key("other")
    wrong_name = tmp_path / f"x-{other.keyid[:16]}.pub"
    wrong_name.write_bytes(k.public_pem())
    with pytest.raises(UsageError, match="file name names keyid"):
        signing.load_public_key(wrong_name)
    wrong_comment = tmp_path / "y.pub"
    wrong_comment.write_bytes(k.public_pem().replace(k.keyid.encode(), other.keyid.encode()))
    with pytest.raises(UsageError, match="is not the key's id"):
        signing.load_public_key(wrong_comment)
    garbage = tmp_path / "z.pub"
    garbage.write_text("not a key")
    with pytest.raises(UsageError):
        signing.load_public_key(garbage)
    plain = tmp_path / "plain.pub"  # bare PEM, no comment, no id in the name: fine
    plain.write_bytes(k.public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    assert signing.load_public_key(plain)[0] == k.keyid


def test_committed_trusted_key_is_valid_and_has_no_private_key() -> None:
    keys_dir = signing.default_keys_dir()
    keys = signing.trusted_keys()
    assert keys, "contracts/keys/ must hold at least one trusted public key"
    for path in keys_dir.iterdir():
        assert path.suffix in (".pub", ".md"), path
        assert b"PRIVATE" not in path.read_bytes(), path
    assert (keys_dir / "README.md").is_file()


def test_signing_key_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    k = new_key("env")
    monkeypatch.setenv(signing.ENV_SIGNING_KEY, pem_of(k).decode())
    got = signing.default_signing_key()
    assert got.keyid == k.keyid
    assert not got.development
    monkeypatch.delenv(signing.ENV_SIGNING_KEY)
    f = tmp_path / "k.pem"
    f.write_bytes(pem_of(k))
    f.chmod(0o600)
    monkeypatch.setenv(signing.ENV_SIGNING_KEY_FILE, str(f))
    assert signing.default_signing_key().keyid == k.keyid
    f.write_text("nonsense")
    with pytest.raises(UsageError):
        signing.default_signing_key()


def test_development_key_is_created_once_and_not_trusted(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    with caplog.at_level(logging.WARNING, logger="qualify.evidence.keys"):
        first = signing.default_signing_key()
    path = tmp_path / "xdg" / "qualify" / "dev-signing-key.pem"
    assert signing.dev_key_path() == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert first.development
    assert "NOT trusted" in caplog.text
    assert str(path) in caplog.text
    assert signing.default_signing_key().keyid == first.keyid  # reused
    assert first.keyid not in signing.trusted_keys()
    assert signing.load_public_key(path.with_suffix(".pub"))[0] == first.keyid


# --------------------------------------------------------------------------- signing dirs


def test_sign_cli_on_a_sealed_reference(world: World, tmp_path: Path) -> None:
    store.make_writable(world.reference)
    (world.reference / signing.ATTESTATION_FILE).unlink()
    key_file = tmp_path / "k.pem"
    key_file.write_bytes(pem_of(world.key))
    key_file.chmod(0o600)
    code, out = run_cli(["sign", str(world.reference), "--key", str(key_file),
                         "--keys", str(world.keys)])
    assert code == ExitCode.OK
    assert world.key.keyid in out
    assert world.verify(world.reference)
    assert stat.S_IMODE((world.reference / signing.ATTESTATION_FILE).stat().st_mode) == 0o444
    code, _ = run_cli(["sign", str(world.reference), "--key", str(key_file)])
    assert code == ExitCode.INTEGRITY_ERROR  # an attestation is never overwritten


def test_sign_refuses_unsealed_and_unsigned_reference(world: World) -> None:
    unsealed = world.root / "evidence" / CONTRACT / "run-x"
    unsealed.mkdir()
    (unsealed / "run.json").write_text("{}")
    with pytest.raises(EvidenceIntegrityError):
        signing.sign_directory(unsealed, world.key)
    store.make_writable(world.reference)
    (world.reference / signing.ATTESTATION_FILE).unlink()
    store.make_writable(world.good)
    (world.good / signing.ATTESTATION_FILE).unlink()
    with pytest.raises(ReferenceDataError, match="not signed"):
        signing.sign_directory(world.good, world.key)


def test_sign_with_development_key_fails_verification(world: World) -> None:
    store.make_writable(world.good)
    (world.good / signing.ATTESTATION_FILE).unlink()
    signing.sign_directory(world.good)  # no key: the development key
    result = world.verify(world.good)
    assert result.failed_steps[0].number == 2
    assert "not a trusted key" in result.failed_steps[0].detail


def test_seal_and_sign_rejects_other_kinds(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        signing.seal_and_sign(tmp_path, kind="attempt", key=new_key("k"))


def test_ensure_signed_signs_only_once(world: World) -> None:
    store.make_writable(world.reference)
    att = world.reference / signing.ATTESTATION_FILE
    att.unlink()
    assert signing.ensure_signed(world.reference, world.key) == att
    before = att.read_bytes()
    assert signing.ensure_signed(world.reference, new_key("other")) == att
    assert att.read_bytes() == before


@settings(max_examples=25, deadline=None)
@given(payload=st.binary(max_size=256), payload_type=st.text(max_size=40))
def test_any_payload_round_trips_and_verifies(payload: bytes, payload_type: str) -> None:
    k = KEY
    sig = k.sign(signing.pae(payload_type, payload))
    env = Envelope(payload=payload, payload_type=payload_type or "t",
                   signatures=(Signature(keyid=k.keyid, sig=sig),))
    again = Envelope.from_json(env.to_json())
    assert again == env
    if payload_type:
        assert signing.verify_envelope_signatures(again, {k.keyid: k.public_key})


KEY = new_key("hypothesis")

CLI_SURFACE = {
    "keygen": ["--name", "--private-key", "--public-dir"],
    "sign": ["dir", "--key", "--reference", "--keys"],
    "verify": ["path", "--keys", "--contract", "--contracts-dir", "--reference", "--json",
               "--trust-from"],
    "gate": ["evidence_dir", "--contract", "--allow-not-run", "--policy", "--sources-root",
             "--json", "--junit-xml", "--summary", "--reference", "--trust-from", "--baseline",
             "--keys"],
    "audit": ["dirs", "--format", "--output", "--junit-xml", "--contracts-dir",
              "--sources-root", "--keys", "--trust-from"],
}


def test_cli_surface_is_pinned() -> None:
    """Adding or renaming an option of these subcommands is a deliberate change here."""
    parser = argparse.ArgumentParser(prog="qualify")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    got = {}
    for name, p in sub.choices.items():
        got[name] = [a.option_strings[0] if a.option_strings else a.dest
                     for a in p._actions if a.dest != "help"]
    assert got == CLI_SURFACE


# The names sign re-exports from the modules split out of it (issue #14), for callers of
# ``qualify.evidence.sign``. Pinned so that removing one is a deliberate change.
SIGN_REEXPORTS: dict[str, tuple[str, ...]] = {
    "qualify.errors": ("EnvelopeFormatError", "SignatureVerificationError"),
    "qualify.evidence.dsse": ("PAYLOAD_TYPE", "Envelope", "Signature", "pae", "read_envelope",
                              "verify_envelope_signatures"),
    "qualify.evidence.keys": ("ENV_SIGNING_KEY", "ENV_SIGNING_KEY_FILE", "SigningKey",
                              "default_keys_dir", "default_signing_key", "dev_key_path",
                              "generate_key", "key_id", "load_public_key", "load_signing_key",
                              "trusted_keys"),
    "qualify.evidence.statement": ("PREDICATE_TYPE", "REFERENCE_KIND", "RUN_KIND",
                                   "STATEMENT_TYPE", "TEST_RESULT_PREDICATE_TYPE",
                                   "build_statement", "environment_summary",
                                   "statement_bytes"),
    "qualify.evidence.timestamps": ("parse_time",),
    "qualify.layout": ("ATTESTATION_FILE", "BOUNDS_FILE", "REFERENCE_FILE", "RUN_FILE"),
}


@pytest.mark.parametrize("module", sorted(SIGN_REEXPORTS))
def test_sign_reexports_are_the_defining_modules_objects(module: str) -> None:
    import importlib

    mod = importlib.import_module(module)
    for name in SIGN_REEXPORTS[module]:
        assert name in signing.__all__, name
        assert getattr(signing, name) is getattr(mod, name), name
    assert signing.REPORT_FILE == "report.json"
    assert not hasattr(signing, "locate_reference")  # qualify.layout.resolve_reference


def test_errors_of_the_steps_live_in_qualify_errors() -> None:
    import qualify.errors as errors
    from qualify.evidence import steps, verify

    for number, kind in steps.STEP_ERRORS.items():
        assert getattr(errors, kind.__name__) is kind, number
        assert getattr(verify, kind.__name__) is kind, number
        assert issubclass(kind, errors.EvidenceIntegrityError)
    assert [n for n, _ in steps.STEPS] == sorted(steps.STEP_ERRORS)
