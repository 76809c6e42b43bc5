"""Signed evidence: in-toto Statement v1 in a DSSE envelope, Ed25519 keys.

Every sealed reference and every sealed candidate run gets one attestation,
``attestation.dsse.json``, added after sealing with :func:`qualify.store.add_attestation`
(DESIGN.md section 7):

- **Statement** (https://github.com/in-toto/attestation/blob/main/spec/v1/statement.md):
  ``_type`` ``https://in-toto.io/Statement/v1``; ``subject`` = every file of the
  directory's ``MANIFEST.json`` and ``MANIFEST.json`` itself, each
  ``{"name": relpath, "digest": {"sha256": hex}}``; ``predicateType``
  :data:`PREDICATE_TYPE`; the predicate binds the contract digest, the manifest digest,
  the bounds digest (sha256 of the ``bounds.json`` bytes), the reference the run was judged
  against (manifest, bounds and attestation digests, sealing and signing times), the git
  commit and dirty flag of the source tree, an environment summary, the verdicts and the
  sealing time. Candidate runs also carry the in-toto test-result v0.1 fields
  (``result``, ``configuration``, ``passedTests``, ``warnedTests``, ``failedTests``).
  Schema: ``contracts/schema/statement.schema.json``.
- **Envelope** (https://github.com/secure-systems-lab/dsse/blob/master/envelope.md):
  ``{"payload": base64, "payloadType": "application/vnd.in-toto+json",
  "signatures": [{"keyid", "sig"}]}``; each signature is over
  ``PAE(payloadType, payload)`` (:func:`pae`), as ``securesystemslib/dsse.py`` does.
- **Keys**: Ed25519 through ``cryptography``; the key id is the hex sha256 of the raw
  32-byte public key. Trusted public keys are committed as ``contracts/keys/*.pub``
  (PEM ``SubjectPublicKeyInfo``; the key id in the file name ``<name>-<keyid16>.pub``
  and in a ``# keyid:`` comment line), read by :func:`trusted_keys`.

The signing key comes from :func:`default_signing_key`: the PEM in ``QUALIFY_SIGNING_KEY``,
else the file named by ``QUALIFY_SIGNING_KEY_FILE``, else a per-user development key
(``~/.config/qualify/dev-signing-key.pem``, created on first use), whose public key is not
trusted unless a user commits it.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime as _dt
import hashlib
import json
import logging
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

import qualify
from qualify.evidence import store
from qualify.errors import (
    EvidenceIntegrityError,
    ReferenceDataError,
    SignatureError,
    UsageError,
)

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
    "locate_reference",
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

PAYLOAD_TYPE: Final = "application/vnd.in-toto+json"
"""DSSE payloadType of an in-toto statement."""
STATEMENT_TYPE: Final = "https://in-toto.io/Statement/v1"
"""``_type`` of an in-toto Statement v1."""
PREDICATE_TYPE: Final = "https://qualify.dev/attestation/qualification/v1"
"""``predicateType`` of qualify's qualification predicate."""
TEST_RESULT_PREDICATE_TYPE: Final = "https://in-toto.io/attestation/test-result/v0.1"
"""The standard predicate whose fields (result, configuration, *Tests) ours also carries."""
ATTESTATION_FILE: Final = "attestation.dsse.json"
"""The attestation of a sealed directory, at its top level."""
ENV_SIGNING_KEY: Final = "QUALIFY_SIGNING_KEY"
"""Environment variable holding a PEM (PKCS#8) Ed25519 private key."""
ENV_SIGNING_KEY_FILE: Final = "QUALIFY_SIGNING_KEY_FILE"
"""Environment variable naming a PEM private key file."""
DEV_KEY_FILE: Final = "dev-signing-key.pem"
REFERENCE_KIND: Final = "reference"
RUN_KIND: Final = "candidate-run"
REFERENCE_FILE: Final = "reference.json"
RUN_FILE: Final = "run.json"
REPORT_FILE: Final = "report.json"
BOUNDS_FILE: Final = "bounds.json"
CONTRACT_JSON: Final = "contract.json"
ENVIRONMENT_FILE: Final = "environment.json"
_ENVELOPE_KEYS: Final = frozenset({"payload", "payloadType", "signatures"})
_KEYID_RE: Final = re.compile(r"^[0-9a-f]{64}$")
_FILE_KEYID_RE: Final = re.compile(r"-([0-9a-f]{16,64})$")
_COMMENT_KEYID_RE: Final = re.compile(r"^#\s*keyid:\s*([0-9a-f]{64})\s*$", re.MULTILINE)


class EnvelopeFormatError(SignatureError):
    """An attestation is missing, not JSON, or not a DSSE envelope (verification step 1)."""


class SignatureVerificationError(SignatureError):
    """No signature, a duplicated, corrupted or untrusted one (verification step 2)."""


# --------------------------------------------------------------------------- DSSE


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
        return (json.dumps(doc, sort_keys=True, indent=2) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes, *, what: str = "envelope") -> Envelope:
        """Parse and check the form of an envelope (no signature is checked here).

        Args:
            data: the file's bytes.
            what: name for messages (the path).

        Raises:
            EnvelopeFormatError: not UTF-8 JSON, not an object with exactly ``payload``,
                ``payloadType`` and ``signatures``, a field of the wrong type, bad base64,
                or a signature without ``keyid`` / ``sig``.
        """
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise EnvelopeFormatError(f"{what}: not JSON: {exc}") from None
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
        EnvelopeFormatError: the file is missing (the directory is unsigned), unreadable
            or not a DSSE envelope.
    """
    path = Path(directory) / ATTESTATION_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise EnvelopeFormatError(f"{path}: missing; the directory is not signed "
                                  "(qualify sign DIR)") from None
    except OSError as exc:
        raise EnvelopeFormatError(f"{path}: unreadable: {exc}") from None
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


# --------------------------------------------------------------------------- keys


def key_id(public_key: Ed25519PublicKey) -> str:
    """Hex sha256 of the raw 32-byte Ed25519 public key."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def _public_pem(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.PEM,
                                   serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SigningKey:
    """An Ed25519 private key and where it came from.

    Attributes:
        private_key: the key.
        keyid: hex sha256 of the raw public key.
        source: where it was loaded from (for messages; never the key itself).
        development: whether it is the per-user development key.
    """

    private_key: Ed25519PrivateKey = dataclasses.field(repr=False)
    keyid: str
    source: str
    development: bool = False

    @classmethod
    def from_pem(cls, data: bytes, *, source: str, development: bool = False) -> SigningKey:
        """Load a PEM (PKCS#8, unencrypted) Ed25519 private key.

        Raises:
            UsageError: not a PEM private key, encrypted, or not Ed25519.
        """
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise UsageError(f"{source}: not an unencrypted PEM private key: {exc}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise UsageError(f"{source}: not an Ed25519 key ({type(key).__name__})")
        return cls(private_key=key, keyid=key_id(key.public_key()), source=source,
                   development=development)

    @property
    def public_key(self) -> Ed25519PublicKey:
        """The matching public key."""
        return self.private_key.public_key()

    def public_pem(self) -> bytes:
        """The public key file's content: ``# keyid:`` comment lines and the PEM."""
        head = f"# qualify Ed25519 public key\n# keyid: {self.keyid}\n".encode()
        return head + _public_pem(self.public_key)

    def sign(self, data: bytes) -> bytes:
        """Raw Ed25519 signature of ``data``."""
        return self.private_key.sign(data)


def load_signing_key(path: str | Path) -> SigningKey:
    """Load a PEM Ed25519 private key file.

    Raises:
        UsageError: the file is missing, unreadable or not an Ed25519 PEM private key.
    """
    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise UsageError(f"{p}: cannot read signing key: {exc}") from None
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        _log.warning("%s: signing key is readable by others (mode %o); chmod 600 it", p, mode)
    return SigningKey.from_pem(data, source=str(p))


def _write_private(path: Path, key: Ed25519PrivateKey) -> None:
    """Write a PKCS#8 PEM private key with mode 0600; never overwrite."""
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)


def generate_key(private_path: str | Path, public_dir: str | Path | None, *,
                 name: str = "qualify") -> tuple[SigningKey, Path | None]:
    """Create an Ed25519 key pair (``qualify keygen``).

    Args:
        private_path: where the PEM private key goes (mode 0600, parents created 0700).
        public_dir: directory for the public key ``<name>-<keyid16>.pub`` (``None``: none).
        name: label used in the public key's file name.

    Returns:
        The new key and the public key path.

    Raises:
        UsageError: ``private_path`` or the public key file exists (never overwritten),
            or ``name`` is not a plain lowercase label.
    """
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,63}", name):
        raise UsageError(f"--name: {name!r} must be a lowercase label ([a-z0-9._-])")
    priv = Path(private_path).expanduser()
    if os.path.lexists(priv):
        raise UsageError(f"{priv}: exists; a key is never overwritten")
    key = Ed25519PrivateKey.generate()
    sk = SigningKey(private_key=key, keyid=key_id(key.public_key()), source=str(priv))
    pub_path: Path | None = None
    if public_dir is not None:
        pub_path = Path(public_dir) / f"{name}-{sk.keyid[:16]}.pub"
        if os.path.lexists(pub_path):
            raise UsageError(f"{pub_path}: exists; a key is never overwritten")
    try:
        _write_private(priv, key)
    except FileExistsError:
        raise UsageError(f"{priv}: exists; a key is never overwritten") from None
    if pub_path is not None:
        pub_path.parent.mkdir(parents=True, exist_ok=True)
        store.atomic_write_bytes(pub_path, sk.public_pem())
    return sk, pub_path


def _config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "qualify"


def dev_key_path() -> Path:
    """``$XDG_CONFIG_HOME/qualify/dev-signing-key.pem`` (default ``~/.config/qualify/...``)."""
    return _config_dir() / DEV_KEY_FILE


def default_signing_key() -> SigningKey:
    """The signing key of this process.

    Order: the PEM text in ``QUALIFY_SIGNING_KEY``; the file named by
    ``QUALIFY_SIGNING_KEY_FILE``; the per-user development key :func:`dev_key_path`
    (created with mode 0600 on first use, its public key written beside it as
    ``dev-signing-key.pub``). Using the development key logs one warning line: its public
    key is not trusted unless the user adds it to ``contracts/keys/``.

    Raises:
        UsageError: the variable or file does not hold an Ed25519 PEM private key.
    """
    pem = os.environ.get(ENV_SIGNING_KEY)
    if pem:
        return SigningKey.from_pem(pem.encode("utf-8"), source=f"${ENV_SIGNING_KEY}")
    path = os.environ.get(ENV_SIGNING_KEY_FILE)
    if path:
        return load_signing_key(path)
    dev = dev_key_path()
    if not dev.exists():
        try:
            key = Ed25519PrivateKey.generate()
            _write_private(dev, key)
            sk = SigningKey(private_key=key, keyid=key_id(key.public_key()), source=str(dev))
            pub = dev.with_suffix(".pub")
            if not pub.exists():
                store.atomic_write_bytes(pub, sk.public_pem())
        except FileExistsError:
            pass  # another process created it first: load theirs
    sk = dataclasses.replace(load_signing_key(dev), development=True)
    _log.warning("qualify: signing with the per-user development key %s (keyid %s); its "
                 "public key %s is NOT trusted unless you add it to contracts/keys/ "
                 "(set %s or %s to sign with a project key)", dev, sk.keyid[:16],
                 dev.with_suffix(".pub"), ENV_SIGNING_KEY, ENV_SIGNING_KEY_FILE)
    return sk


def default_keys_dir() -> Path:
    """``contracts/keys/`` of the qualify checkout (the committed trusted keys)."""
    from qualify.resources import contracts_dir

    return contracts_dir() / "keys"


def load_public_key(path: str | Path) -> tuple[str, Ed25519PublicKey]:
    """Read one ``*.pub`` file: ``# ...`` comment lines, then a PEM public key.

    The key id is computed from the key; a ``# keyid:`` line and a ``-<hex>`` suffix of
    the file stem, if present, must agree with it.

    Returns:
        ``(keyid, public key)``.

    Raises:
        UsageError: unreadable, not an Ed25519 PEM public key, or a key id in the name or
            the comment that is not the key's.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{p}: cannot read public key: {exc}") from None
    pem = "".join(line + "\n" for line in text.splitlines() if not line.startswith("#"))
    try:
        key = serialization.load_pem_public_key(pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise UsageError(f"{p}: not a PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise UsageError(f"{p}: not an Ed25519 public key ({type(key).__name__})")
    kid = key_id(key)
    m = _COMMENT_KEYID_RE.search(text)
    if m and m.group(1) != kid:
        raise UsageError(f"{p}: '# keyid: {m.group(1)[:16]}...' is not the key's id {kid}")
    m = _FILE_KEYID_RE.search(p.name.removesuffix(".pub"))
    if m and not kid.startswith(m.group(1)):
        raise UsageError(f"{p}: file name names keyid {m.group(1)}, the key's id is {kid}")
    return kid, key


def trusted_keys(directory: str | Path | None = None) -> dict[str, Ed25519PublicKey]:
    """The trusted public keys: every ``*.pub`` in ``directory`` (default ``contracts/keys``).

    Args:
        directory: the trusted-keys directory; missing means no trusted key.

    Returns:
        keyid -> public key (empty if the directory is missing or holds no ``*.pub``).

    Raises:
        UsageError: a ``*.pub`` file is not a valid, correctly labelled Ed25519 key.
    """
    d = Path(directory) if directory is not None else default_keys_dir()
    out: dict[str, Ed25519PublicKey] = {}
    if not d.is_dir():
        return out
    for path in sorted(d.glob("*.pub")):
        kid, key = load_public_key(path)
        out[kid] = key
    return out


# --------------------------------------------------------------------------- statement


def parse_time(value: object, what: str) -> _dt.datetime:
    """Parse an ISO-8601 UTC timestamp (``...Z``) into an aware datetime.

    Raises:
        EvidenceIntegrityError: not a string or not ISO-8601.
    """
    if not isinstance(value, str):
        raise EvidenceIntegrityError(f"{what}: timestamp missing or not a string: {value!r}")
    try:
        t = _dt.datetime.fromisoformat(value)
    except ValueError:
        raise EvidenceIntegrityError(f"{what}: not an ISO-8601 timestamp: {value!r}") from None
    return t if t.tzinfo is not None else t.replace(tzinfo=_dt.UTC)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EvidenceIntegrityError(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise EvidenceIntegrityError(f"{path}: unreadable or not JSON: {exc}") from None


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
        doc = _read_json(path)
        if isinstance(doc, dict):
            return doc
    from qualify.evidence.environment import capture_environment

    return capture_environment(import_torch=False)


def _source(env: Mapping[str, Any]) -> dict[str, Any]:
    git = env.get("git")
    if not isinstance(git, Mapping):
        from qualify.evidence.environment import git_state
        from qualify.resources import repo_root

        git = git_state(repo_root())
    return {"commit": git.get("commit"), "dirty": git.get("dirty"), "branch": git.get("branch")}


def locate_reference(run_dir: str | Path, run_doc: Mapping[str, Any],
                     given: str | Path | None = None) -> Path:
    """Find the sealed reference a candidate run names.

    Order: ``given``; ``run.json``'s ``reference.path`` (absolute, or relative to the run
    directory, then to the working directory); else, for committed evidence moved to
    another machine, a directory under a ``references/`` folder beside any ancestor of
    the run whose ``MANIFEST.json`` digest is ``reference.manifest_digest`` (then one
    with the same name).

    Args:
        run_dir: the run directory.
        run_doc: its ``run.json``.
        given: an explicit reference directory.

    Returns:
        The reference directory (not yet checked).

    Raises:
        ReferenceDataError: none is found.
    """
    if given is not None:
        return Path(given)
    rd = Path(run_dir)
    ref = run_doc.get("reference")
    ref = ref if isinstance(ref, Mapping) else {}
    raw = ref.get("path")
    want = ref.get("manifest_digest")
    name = Path(raw).name if isinstance(raw, str) and raw else None
    if isinstance(raw, str) and raw:
        p = Path(raw)
        for cand in ([p] if p.is_absolute() else [rd / p, Path.cwd() / p]):
            if cand.is_dir():
                return cand.resolve()
    for anc in rd.resolve().parents:
        refs = anc / "references"
        if not refs.is_dir():
            continue
        dirs = sorted(d for d in refs.iterdir() if d.is_dir())
        for d in dirs:
            mp = d / store.MANIFEST_FILE
            if want and mp.is_file() and store.sha256_file(mp) == want:
                return d
        if name and (refs / name).is_dir():
            return refs / name
    raise ReferenceDataError(f"{rd / RUN_FILE}: reference {raw!r} not found (pass the "
                             "reference directory explicitly)")


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
        "signed": store.utc_now_iso(),
        "source": _source(env),
        "environment": environment_summary(env),
    }


def _reference_predicate(d: Path, base: dict[str, Any]) -> dict[str, Any]:
    ref_doc = _read_json(d / REFERENCE_FILE)
    contract_doc = _read_json(d / CONTRACT_JSON)
    digest = _contract_digest_of(contract_doc, str(d / CONTRACT_JSON))
    if ref_doc.get("contract_digest") != digest:
        raise EvidenceIntegrityError(f"{d / REFERENCE_FILE}: contract_digest is not the "
                                     f"digest of {CONTRACT_JSON} ({digest[:12]})")
    return {**base,
            "contract": {"name": str(contract_doc.get("name")), "digest": digest},
            "boundsDigest": store.sha256_file(d / BOUNDS_FILE),
            "reference": None, "run": None, "verdicts": None}


def _run_predicate(d: Path, base: dict[str, Any],
                   reference_dir: str | Path | None) -> dict[str, Any]:
    run_doc = _read_json(d / RUN_FILE)
    report_path = d / REPORT_FILE
    if not report_path.is_file():
        raise ReferenceDataError(f"{report_path}: missing; compare the run before sealing and "
                                 "signing it")
    report = _read_json(report_path)
    ref_dir = locate_reference(d, run_doc, reference_dir)
    if not (ref_dir / ATTESTATION_FILE).is_file():
        raise ReferenceDataError(f"{ref_dir}: the reference is not signed; sign it first "
                                 f"(qualify sign {ref_dir})")
    ref_manifest = store.read_manifest(ref_dir)
    ref_stmt = json.loads(read_envelope(ref_dir).payload)
    ref_pred = ref_stmt.get("predicate") if isinstance(ref_stmt, dict) else None
    if not isinstance(ref_pred, dict):
        raise EvidenceIntegrityError(f"{ref_dir / ATTESTATION_FILE}: no predicate")
    cells = {str(c["cell"]): str(c["verdict"]) for c in report.get("cells", [])}
    passed = sorted(c for c, v in cells.items() if v == "PASS")
    warned = sorted(c for c, v in cells.items() if v == "NOT_RUN")
    failed = sorted(c for c, v in cells.items() if v in ("FAIL", "ERROR"))
    ok = bool(report.get("passed"))
    result = "FAILED" if not ok else ("WARNED" if warned else "PASSED")
    contract = {"name": str(run_doc.get("contract")), "digest": str(run_doc.get("contract_digest"))}
    bounds_digest = str(report.get("bounds_digest"))
    ref_mdigest = store.manifest_digest(ref_dir)
    return {**base,
            "contract": contract,
            "boundsDigest": bounds_digest,
            "reference": {"name": ref_dir.name, "manifestDigest": ref_mdigest,
                          "boundsDigest": store.sha256_file(ref_dir / BOUNDS_FILE),
                          "attestationDigest": store.sha256_file(ref_dir / ATTESTATION_FILE),
                          "sealed": ref_manifest["created"],
                          "signed": ref_pred.get("signed")},
            "run": {"runId": str(run_doc.get("run_id", d.name)),
                    "started": run_doc.get("started"), "finished": run_doc.get("finished")},
            "verdicts": {"passed": ok, "reportDigest": store.sha256_file(report_path),
                         "cells": cells, "summary": report.get("summary", {})},
            "result": result,
            "configuration": [
                {"name": f"contract:{contract['name']}", "digest": {"sha256": contract["digest"]}},
                {"name": f"{ref_dir.name}/{store.MANIFEST_FILE}",
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
        reference_dir: for a run, its reference (default: :func:`locate_reference`).

    Returns:
        The statement (validated against ``statement.schema.json``).

    Raises:
        EvidenceIntegrityError: the directory is not sealed or not intact, or a file the
            predicate needs is missing or not JSON.
        ReferenceDataError: a run that was not compared, or whose reference is missing or
            unsigned.
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
    subjects.append({"name": store.MANIFEST_FILE, "digest": {"sha256": mdigest}})
    statement = {"_type": STATEMENT_TYPE, "subject": subjects,
                 "predicateType": PREDICATE_TYPE, "predicate": predicate}
    store.validate_json(statement, "statement", what=f"{d} statement")
    return statement


def statement_bytes(statement: Mapping[str, Any]) -> bytes:
    """Canonical JSON bytes of a statement (sorted keys, compact, UTF-8): the payload."""
    return json.dumps(statement, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=False).encode("utf-8")


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


def sign_directory(directory: str | Path, key: SigningKey | None = None, *,
                   reference_dir: str | Path | None = None) -> Path:
    """Attest a sealed reference or candidate run: write its ``attestation.dsse.json``.

    Args:
        directory: the sealed directory.
        key: the signing key (default :func:`default_signing_key`).
        reference_dir: for a run, its reference (default: :func:`locate_reference`).

    Returns:
        The attestation path.

    Raises:
        EvidenceIntegrityError: the directory is not sealed or not intact, or already has
            an attestation (never overwritten).
        ReferenceDataError: a run that was not compared, or whose reference is missing or
            unsigned.
        UsageError: the directory is neither a reference nor a candidate run.
    """
    d = Path(directory)
    if os.path.lexists(d / ATTESTATION_FILE):
        raise EvidenceIntegrityError(f"{d / ATTESTATION_FILE}: exists; an attestation is "
                                     "never overwritten")
    statement = build_statement(d, reference_dir=reference_dir)
    k = key if key is not None else default_signing_key()
    envelope = sign_statement(statement, k)
    path = store.add_attestation(d, ATTESTATION_FILE, envelope.to_json())
    _log.info("%s: signed by keyid %s (%s)", path, k.keyid[:16], k.source)
    return path


def ensure_signed(directory: str | Path, key: SigningKey | None = None) -> Path:
    """Sign a sealed directory unless it carries an attestation already.

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
    return path if path.is_file() else sign_directory(directory, key)


def seal_and_sign(directory: str | Path, *, kind: str, key: SigningKey | None = None,
                  reference_dir: str | Path | None = None) -> Path:
    """Seal ``directory`` (:func:`qualify.store.seal`) and sign it (:func:`sign_directory`).

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
        EvidenceIntegrityError: see :func:`qualify.store.seal` and :func:`sign_directory`.
        ReferenceDataError: see :func:`sign_directory`.
        UsageError: ``kind`` is not signable.
    """
    if kind not in (REFERENCE_KIND, RUN_KIND):
        raise UsageError(f"kind {kind!r}: only '{REFERENCE_KIND}' and '{RUN_KIND}' are signed")
    store.seal(directory, kind=kind)
    return sign_directory(directory, key, reference_dir=reference_dir)
