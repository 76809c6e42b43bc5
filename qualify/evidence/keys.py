"""Ed25519 keys: the signing key of this process, key files, key ids, the trusted keys.

The key id is the hex sha256 of the raw 32-byte public key (:func:`key_id`). Trusted
public keys are committed as ``contracts/keys/*.pub`` (PEM ``SubjectPublicKeyInfo``; the
key id in the file name ``<name>-<keyid16>.pub`` and in a ``# keyid:`` comment line), read
by :func:`trusted_keys`; private keys never are.

The signing key comes from :func:`default_signing_key`: the PEM in ``QUALIFY_SIGNING_KEY``,
else the file named by ``QUALIFY_SIGNING_KEY_FILE``, else a per-user development key
(``~/.config/qualify/dev-signing-key.pem``, created on first use), whose public key is not
trusted unless a user commits it.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
import stat
from pathlib import Path
from typing import Final

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from qualify import jsonio
from qualify.digests import sha256_bytes
from qualify.display import printable
from qualify.errors import EvidenceIntegrityError, UsageError
from qualify.evidence.sealed import atomic_write_bytes
from qualify.userfiles import read_input_bytes

__all__ = [
    "DEV_KEY_FILE",
    "ENV_SIGNING_KEY",
    "ENV_SIGNING_KEY_FILE",
    "KEYS_DIR",
    "PRIVATE_KEY_SUFFIX",
    "PUBLIC_KEY_SUFFIX",
    "SigningKey",
    "default_keys_dir",
    "default_signing_key",
    "dev_key_path",
    "generate_key",
    "key_id",
    "load_public_key",
    "load_signing_key",
    "parse_public_key",
    "trusted_keys",
]

_log = logging.getLogger(__name__)

ENV_SIGNING_KEY: Final = "QUALIFY_SIGNING_KEY"
"""Environment variable holding a PEM (PKCS#8) Ed25519 private key."""
ENV_SIGNING_KEY_FILE: Final = "QUALIFY_SIGNING_KEY_FILE"
"""Environment variable naming a PEM private key file."""
PRIVATE_KEY_SUFFIX: Final = "-signing-key.pem"
"""Suffix of a private key file ``<name>-signing-key.pem`` (``qualify keygen``)."""
DEV_KEY_FILE: Final = f"dev{PRIVATE_KEY_SUFFIX}"
"""File name of the per-user development key (under :func:`dev_key_path`'s directory)."""
KEYS_DIR: Final = "keys"
"""The trusted-keys folder under ``contracts/``."""
PUBLIC_KEY_SUFFIX: Final = ".pub"
"""Suffix of a public key file."""
_FILE_KEYID_RE: Final = re.compile(r"-([0-9a-f]{16,64})$")
_COMMENT_KEYID_RE: Final = re.compile(r"^#\s*keyid:\s*([0-9a-f]{64})\s*$", re.MULTILINE)


MAX_PUBLIC_KEY_BYTES: Final = 64 * 1024
"""A ``*.pub`` file larger than this is refused unread (an Ed25519 PEM is about 113 bytes)."""
MAX_KEY_BYTES: Final = 64 * 1024
"""A private key file larger than this is refused unread (an Ed25519 PKCS#8 PEM is about
119 bytes)."""


def key_id(public_key: Ed25519PublicKey) -> str:
    """Hex sha256 of the raw 32-byte Ed25519 public key."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return sha256_bytes(raw)


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
        UsageError: the file is missing, not a regular file, over :data:`MAX_KEY_BYTES`,
            unreadable or not an Ed25519 PEM private key.
    """
    p = Path(path).expanduser()
    data = read_input_bytes(p, what="signing key", max_bytes=MAX_KEY_BYTES)
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        _log.warning("%s: signing key is readable by others (mode %o); chmod 600 it",
                     printable(p), mode)
    return SigningKey.from_pem(data, source=str(p))


def _write_private(path: Path, key: Ed25519PrivateKey) -> None:
    """Write a PKCS#8 PEM private key with mode 0600; never overwrite."""
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        if os.write(fd, pem) != len(pem):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        os.fsync(fd)
    except OSError as exc:  # a full disk: no truncated key is left to be loaded later
        os.close(fd)
        path.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
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
        pub_path = Path(public_dir) / f"{name}-{sk.keyid[:16]}{PUBLIC_KEY_SUFFIX}"
        if os.path.lexists(pub_path):
            raise UsageError(f"{pub_path}: exists; a key is never overwritten")
    try:
        _write_private(priv, key)
    except FileExistsError:
        raise UsageError(f"{priv}: exists; a key is never overwritten") from None
    if pub_path is not None:
        pub_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(pub_path, sk.public_pem())
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
            pub = dev.with_suffix(PUBLIC_KEY_SUFFIX)
            if not pub.exists():
                atomic_write_bytes(pub, sk.public_pem())
        except FileExistsError:
            pass  # another process created it first: load theirs
    sk = dataclasses.replace(load_signing_key(dev), development=True)
    _log.warning("qualify: signing with the per-user development key %s (keyid %s); its "
                 "public key %s is NOT trusted unless you add it to contracts/keys/ "
                 "(set %s or %s to sign with a project key)", printable(dev), sk.keyid[:16],
                 printable(dev.with_suffix(PUBLIC_KEY_SUFFIX)), ENV_SIGNING_KEY,
                 ENV_SIGNING_KEY_FILE)
    return sk


def default_keys_dir() -> Path:
    """``contracts/keys/`` of the qualify checkout (the committed trusted keys)."""
    from qualify.resources import contracts_dir

    return contracts_dir() / KEYS_DIR


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
        data = jsonio.read_bytes(p, max_bytes=MAX_PUBLIC_KEY_BYTES)
    except (OSError, EvidenceIntegrityError) as exc:
        # a link, a FIFO, /dev/zero or an oversized file: refused before reading it whole
        raise UsageError(f"{p}: cannot read public key: {exc}") from None
    return parse_public_key(data, str(p))


def parse_public_key(data: bytes, source: str) -> tuple[str, Ed25519PublicKey]:
    """The key of a ``*.pub`` file's content (:func:`load_public_key`'s checks).

    Args:
        data: the file's bytes (at most :data:`MAX_PUBLIC_KEY_BYTES`).
        source: where they came from, for messages; its last ``/`` component is the file
            name whose ``-<hex>`` suffix must agree with the key id (a path, or a git
            ``REF:path``).

    Returns:
        ``(keyid, public key)``.

    Raises:
        UsageError: oversized, not UTF-8, not an Ed25519 PEM public key, or a key id in the
            name or the comment that is not the key's.
    """
    if len(data) > MAX_PUBLIC_KEY_BYTES:
        raise UsageError(f"{source}: cannot read public key: {len(data)} bytes, over the "
                         f"{MAX_PUBLIC_KEY_BYTES}-byte limit of a key file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{source}: cannot read public key: {exc}") from None
    pem = "".join(line + "\n" for line in text.splitlines() if not line.startswith("#"))
    try:
        key = serialization.load_pem_public_key(pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise UsageError(f"{source}: not a PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise UsageError(f"{source}: not an Ed25519 public key ({type(key).__name__})")
    kid = key_id(key)
    m = _COMMENT_KEYID_RE.search(text)
    if m and m.group(1) != kid:
        raise UsageError(f"{source}: '# keyid: {m.group(1)[:16]}...' is not the key's id {kid}")
    name = source.rsplit("/", 1)[-1]
    m = _FILE_KEYID_RE.search(name.removesuffix(PUBLIC_KEY_SUFFIX))
    if m and not kid.startswith(m.group(1)):
        raise UsageError(f"{source}: file name names keyid {m.group(1)}, the key's id is {kid}")
    return kid, key


def trusted_keys(directory: str | Path | None = None) -> dict[str, Ed25519PublicKey]:
    """The trusted public keys: every ``*.pub`` in ``directory`` (default ``contracts/keys``).

    Args:
        directory: the trusted-keys directory a user named (``--keys``): it must exist.
            ``None``: ``contracts/keys``, whose absence means no trusted key.

    Returns:
        keyid -> public key (empty if the default directory is missing, or a directory
        holds no ``*.pub``).

    Raises:
        UsageError: a named directory is missing or not a directory; a ``*.pub`` file is not
            a valid, correctly labelled Ed25519 key.
    """
    d = Path(directory) if directory is not None else default_keys_dir()
    out: dict[str, Ed25519PublicKey] = {}
    if directory is not None and not os.path.lexists(d):
        raise UsageError(f"{d}: trusted-keys directory: no such file or directory")
    if directory is not None and not d.is_dir():
        raise UsageError(f"{d}: trusted-keys directory: not a directory")
    if not d.is_dir():
        return out
    for path in sorted(d.glob(f"*{PUBLIC_KEY_SUFFIX}")):
        kid, key = load_public_key(path)
        out[kid] = key
    return out
