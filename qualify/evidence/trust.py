"""Trust roots of the gate: where its trusted keys, gate policy and contract come from.

A pull request's checkout holds the files that decide whether its own evidence passes:
the trusted public keys (``contracts/keys/*.pub``), the gate policy
(``contracts/gates/<contract>.toml``) and the contract (``contracts/<contract>.toml``).
Read from the checkout, a change can add its own key and sign its own evidence, or relax
its own policy. ``qualify gate --trust-from ROOT`` reads them from a protected root
instead (:func:`resolve_trust_root`):

- a **git ref** (``origin/main``, the merge base): the same paths in that commit, read with
  ``git ls-tree`` / ``git cat-file`` from the repository holding the contract, never by
  checking it out. The contracts directory of the checkout (the directory of the
  ``--contract`` file) maps to the same path in the ref;
- a **directory** outside the checkout, laid out as ``contracts/`` is: ``keys/*.pub``,
  ``gates/<contract>.toml``, ``<contract>.toml``. A directory inside the checkout's git
  work tree is refused (it travels with the change).

:func:`check_change` then compares the checkout with the root (:class:`TrustCheck`). A
:class:`TrustChange` (the gate refuses: exit 3, :attr:`~qualify.errors.ExitCode.
INTEGRITY_ERROR`) is:

- a key file whose key id the root does not hold (added, or a root file's content replaced
  by another key), or an unreadable key file;
- a gate policy added, altered (another canonical digest: comments and layout do not
  count) or removed;
- the contract added or altered (another contract digest): a contract decides the required
  cells, the bound rule's ``k`` and floors, so it is a trust root too.

A key the checkout removes is a note, not a refusal: the root still trusts it until the
removal lands there. Root files that are unreadable or invalid are the operator's input
error (:class:`~qualify.errors.UsageError`, exit 2), as are a bad ref or a missing
directory.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from qualify import jsonio
from qualify.contract import Contract
from qualify.errors import ContractError, EvidenceIntegrityError, UsageError
from qualify.evidence.keys import (
    KEYS_DIR,
    MAX_PUBLIC_KEY_BYTES,
    PUBLIC_KEY_SUFFIX,
    load_public_key,
    parse_public_key,
)
from qualify.evidence.policy import (
    Policy,
    default_policy,
    parse_policy,
    policy_digest,
    policy_document,
)
from qualify.layout import GATES_DIR

__all__ = [
    "CHECKOUT",
    "MAX_ROOT_FILE_BYTES",
    "RootFiles",
    "RootKeys",
    "TrustChange",
    "TrustCheck",
    "TrustRoot",
    "check_change",
    "resolve_trust_root",
    "root_keys",
]

MAX_ROOT_FILE_BYTES: Final = 16 * 1024 * 1024
"""A policy or contract file of a trust root larger than this is refused unread."""
_GIT_TIMEOUT_S: Final = 60.0
_SYMLINK_MODE: Final = "120000"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TrustRoot:
    """Where the gate's keys, policy and contract come from.

    Attributes:
        kind: ``"checkout"`` (no ``--trust-from``: they travel with the change),
            ``"git-ref"`` or ``"directory"``.
        spec: the ``--trust-from`` value as given (``None`` for the checkout).
        commit: the commit a git ref resolved to (40 hex digits).
        repo: the top level of the git repository the ref was read from.
        directory: the root directory (``"directory"`` only), absolute.
    """

    kind: str
    spec: str | None = None
    commit: str | None = None
    repo: Path | None = None
    directory: Path | None = None

    @property
    def line(self) -> str:
        """The line every gate prints: which root it used."""
        if self.kind == "git-ref":
            return f"trust root: git ref {self.spec} (commit {self.commit})"
        if self.kind == "directory":
            return f"trust root: directory {self.directory}"
        return ("trust root: this checkout (no --trust-from: keys and policy travel with the "
                "change)")

    @property
    def name(self) -> str:
        """Short name in messages (``origin/main``, the directory, ``this checkout``)."""
        if self.kind == "git-ref":
            return str(self.spec)
        if self.kind == "directory":
            return str(self.directory)
        return "this checkout"

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``gate.schema.json`` ``trust_root``)."""
        return {"kind": self.kind, "spec": self.spec, "commit": self.commit,
                "path": str(self.directory if self.directory is not None else self.repo)
                if self.kind != "checkout" else None,
                "line": self.line}

    def files(self, contracts_dir: Path, contract_name: str | None) -> RootFiles:
        """The root's keys, policy and contract for the checkout's ``contracts_dir``.

        Args:
            contracts_dir: the checkout's directory of the contract (``contracts/``).
            contract_name: the contract's name (``<name>.toml``, ``gates/<name>.toml``);
                ``None``: the keys only (``policy`` and ``contract`` are ``None``).

        Raises:
            UsageError: the root cannot be read there (the contracts directory outside the
                ref's repository, a symbolic link or oversized file in the root, git fails).
        """
        if self.kind == "git-ref":
            return self._git_files(contracts_dir, contract_name)
        if self.kind == "directory":
            assert self.directory is not None
            return _dir_files(self.directory, contract_name)
        raise UsageError("the checkout is no trust root to compare with")

    def _git_files(self, contracts_dir: Path, name: str | None) -> RootFiles:
        assert self.repo is not None
        assert self.commit is not None
        try:
            rel = contracts_dir.resolve().relative_to(self.repo)
        except ValueError:
            raise UsageError(f"{contracts_dir}: not inside the git repository {self.repo} "
                             f"that --trust-from {self.spec} names") from None
        base = "" if rel == Path(".") else rel.as_posix() + "/"
        keys = []
        for mode, oid, path in _ls_tree(self.repo, self.commit, f"{base}{KEYS_DIR}/"):
            if path.endswith(PUBLIC_KEY_SUFFIX) and mode != "040000":
                keys.append((f"{self.spec}:{path}",
                             self._blob(mode, oid, path, MAX_PUBLIC_KEY_BYTES)))
        if name is None:
            return RootFiles(keys=tuple(keys), policy=None, contract=None)
        return RootFiles(keys=tuple(keys),
                         policy=self._file(f"{base}{GATES_DIR}/{name}.toml"),
                         contract=self._file(f"{base}{name}.toml"))

    def _file(self, path: str) -> tuple[str, bytes] | None:
        assert self.repo is not None
        assert self.commit is not None
        found = [e for e in _ls_tree(self.repo, self.commit, path) if e[2] == path]
        if not found:
            return None
        mode, oid, _ = found[0]
        return f"{self.spec}:{path}", self._blob(mode, oid, path, MAX_ROOT_FILE_BYTES)

    def _blob(self, mode: str, oid: str, path: str, limit: int) -> bytes:
        label = f"{self.spec}:{path}"
        if mode == _SYMLINK_MODE or not mode.startswith("100"):
            raise UsageError(f"{label}: not a regular file in the trust root (mode {mode})")
        size = self.blob_size(oid)
        if size > limit:
            raise UsageError(f"{label}: {size} bytes, over the {limit}-byte limit of a "
                             "trust-root file")
        return self.read_blob(oid)

    def tree(self) -> dict[str, str]:
        """``{path: blob oid}`` of every file in a git-ref root's commit (``ls-tree -r``).

        Raises:
            UsageError: git fails (or is not installed).
        """
        assert self.repo is not None
        assert self.commit is not None
        out: dict[str, str] = {}
        for entry in _git(self.repo, "ls-tree", "-r", "-z", self.commit).split(b"\0"):
            head, _, name = entry.partition(b"\t")
            parts = head.decode().split(" ")
            if len(parts) == 3 and parts[1] == "blob":
                out[name.decode("utf-8", "replace")] = parts[2]
        return out

    def blob_size(self, oid: str) -> int:
        """Bytes of the blob ``oid`` of a git-ref root's repository (``cat-file -s``).

        Raises:
            UsageError: git fails (or is not installed).
        """
        assert self.repo is not None
        return int(_git(self.repo, "cat-file", "-s", oid).decode().strip())

    def read_blob(self, oid: str) -> bytes:
        """The bytes of the blob ``oid`` of a git-ref root's repository (``cat-file blob``).

        Raises:
            UsageError: git fails (or is not installed).
        """
        assert self.repo is not None
        return _git(self.repo, "cat-file", "blob", oid)


CHECKOUT: Final = TrustRoot(kind="checkout")
"""The trust root without ``--trust-from``: the checkout itself."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RootFiles:
    """What a trust root holds for one contract.

    Attributes:
        keys: ``(label, bytes)`` of every ``keys/*.pub`` (label: a path or ``REF:path``).
        policy: ``(label, bytes)`` of ``gates/<name>.toml``, ``None`` when absent.
        contract: ``(label, bytes)`` of ``<name>.toml``, ``None`` when absent.
    """

    keys: tuple[tuple[str, bytes], ...]
    policy: tuple[str, bytes] | None
    contract: tuple[str, bytes] | None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TrustChange:
    """A checkout file that alters a trust root (the gate refuses the change).

    Attributes:
        file: the checkout's file.
        what: ``"key"``, ``"policy"`` or ``"contract"``.
        change: ``"added"``, ``"altered"`` or ``"removed"``.
        detail: how, for a person (the key id, the fields that differ).
    """

    file: str
    what: str
    change: str
    detail: str

    @property
    def line(self) -> str:
        """One line: file, what and how."""
        return f"{self.file}: {self.what} {self.change}: {self.detail}"

    def to_dict(self) -> dict[str, str]:
        """JSON form (``gate.schema.json`` ``trust_changes``)."""
        return {"file": self.file, "what": self.what, "change": self.change,
                "detail": self.detail}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TrustCheck:
    """The checkout against its trust root, for one contract.

    Attributes:
        root: the trust root.
        trusted: the root's keys, keyid -> public key (the only keys the gate accepts).
        policy: the root's gate policy (the default policy when the root holds none).
        changes: checkout files that alter the root (the gate refuses when any).
        notes: differences that do not refuse (a key removed by the change).
    """

    root: TrustRoot
    trusted: Mapping[str, Ed25519PublicKey]
    policy: Policy
    changes: tuple[TrustChange, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def contract_changed(self) -> bool:
        """Whether the contract itself differs (the evidence is then not judged)."""
        return any(c.what == "contract" for c in self.changes)


def _git(repo: Path, *args: str) -> bytes:
    """``git -C repo ARGS`` stdout; a failure is a one-line usage error."""
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True,
                              timeout=_GIT_TIMEOUT_S, check=False,
                              env={**os.environ, "GIT_OPTIONAL_LOCKS": "0",
                                   "GIT_TERMINAL_PROMPT": "0"})
    except FileNotFoundError:
        raise UsageError("--trust-from: git is not installed (needed to read a git ref)") \
            from None
    except subprocess.TimeoutExpired:
        raise UsageError(f"--trust-from: git {' '.join(args[:2])} in {repo} did not finish "
                         f"in {_GIT_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        err = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise UsageError(f"--trust-from: git {' '.join(args[:2])} in {repo} failed: "
                         f"{err[-1] if err else 'exit ' + str(done.returncode)}")
    return done.stdout


def _ls_tree(repo: Path, commit: str, path: str) -> list[tuple[str, str, str]]:
    """``(mode, oid, path)`` of each entry ``git ls-tree COMMIT -- PATH`` lists."""
    out = []
    for entry in _git(repo, "ls-tree", "-z", commit, "--", path).split(b"\0"):
        if not entry:
            continue
        head, _, name = entry.partition(b"\t")
        mode, _kind, oid = head.decode().split(" ")
        out.append((mode, oid, name.decode("utf-8", "replace")))
    return out


def _read_root_file(path: Path, limit: int) -> bytes | None:
    """A regular file of a trust-root directory (``None`` when absent)."""
    try:
        return jsonio.read_bytes(path, max_bytes=limit, what=str(path))
    except FileNotFoundError:
        return None
    except EvidenceIntegrityError as exc:
        raise UsageError(f"trust root: {exc}") from None


def _dir_files(root: Path, name: str | None) -> RootFiles:
    keys = []
    kdir = root / KEYS_DIR
    if kdir.is_dir():
        for p in sorted(kdir.glob(f"*{PUBLIC_KEY_SUFFIX}")):
            data = _read_root_file(p, MAX_PUBLIC_KEY_BYTES)
            if data is not None:
                keys.append((str(p), data))
    if name is None:
        return RootFiles(keys=tuple(keys), policy=None, contract=None)
    out: dict[str, tuple[str, bytes] | None] = {}
    for field, p in (("policy", root / GATES_DIR / f"{name}.toml"),
                     ("contract", root / f"{name}.toml")):
        data = _read_root_file(p, MAX_ROOT_FILE_BYTES)
        out[field] = None if data is None else (str(p), data)
    return RootFiles(keys=tuple(keys), policy=out["policy"], contract=out["contract"])


def _git_toplevel(directory: Path) -> Path | None:
    """The top level of the git work tree holding ``directory`` (``None``: not in one)."""
    try:
        done = subprocess.run(["git", "-C", str(directory), "rev-parse", "--show-toplevel"],
                              capture_output=True, timeout=_GIT_TIMEOUT_S, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return Path(done.stdout.decode().strip()).resolve()


def resolve_trust_root(spec: str, *, checkout: Path) -> TrustRoot:
    """The trust root ``--trust-from SPEC`` names.

    An existing path, or a value that starts like one (``/``, ``./``, ``../``, ``~``), is a
    directory; anything else is a git ref of the repository holding ``checkout``.

    Args:
        spec: the ``--trust-from`` value.
        checkout: the checkout's contracts directory (the directory of ``--contract``).

    Returns:
        The :class:`TrustRoot`.

    Raises:
        UsageError: (exit 2, one line) an empty value or one starting with ``-``; a path that
            does not exist or is no directory; a directory inside the checkout's git work
            tree; a ref that git does not resolve to a commit; no git repository.
    """
    if not spec or spec.startswith("-"):
        raise UsageError(f"--trust-from {spec!r}: give a git ref (origin/main) or a directory")
    top = _git_toplevel(checkout) if checkout.is_dir() else None
    path = Path(spec).expanduser()
    if spec.startswith(("/", "./", "../", "~")) or os.path.lexists(path):
        if not path.exists():
            raise UsageError(f"{spec}: --trust-from: no such directory")
        if not path.is_dir():
            raise UsageError(f"{spec}: --trust-from: not a directory")
        d = path.resolve()
        if top is not None and (d == top or top in d.parents):
            raise UsageError(f"{spec}: --trust-from: inside the checkout {top}: a trust root "
                             "there travels with the change; name a git ref or a directory "
                             "outside it")
        return TrustRoot(kind="directory", spec=spec, directory=d)
    if top is None:
        raise UsageError(f"--trust-from {spec}: not a directory, and {checkout} is not in a git "
                         "repository to read a ref from")
    try:
        commit = _git(top, "rev-parse", "--verify", "--quiet", "--end-of-options",
                      f"{spec}^{{commit}}").decode().strip()
    except UsageError:
        raise UsageError(f"--trust-from {spec}: neither a directory nor a git ref of {top} "
                         "(a shallow clone may lack it: fetch it, e.g. actions/checkout with "
                         "fetch-depth: 0)") from None
    return TrustRoot(kind="git-ref", spec=spec, commit=commit, repo=top)


def _describe(entry: Any) -> str:
    if isinstance(entry, Mapping):
        cells = entry.get("cells")
        fams = entry.get("families")
        return repr(cells) + (f" ({', '.join(map(str, fams))})" if isinstance(fams, list)
                              else "")
    return repr(entry)


def _diff(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "",
          limit: int = 6) -> list[str]:
    """How ``new`` differs from ``old``: dotted keys, list entries added and removed."""
    out: list[str] = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        key = f"{prefix}{k}"
        if a is None and isinstance(b, list | Mapping):
            a = type(b)() if isinstance(b, list) else {}
        if b is None and isinstance(a, list | Mapping):
            b = type(a)() if isinstance(a, list) else {}
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += _diff(a, b, key + ".", limit)
        elif isinstance(a, list) and isinstance(b, list):
            plus = [_describe(e) for e in b if e not in a]
            minus = [_describe(e) for e in a if e not in b]
            parts = ([f"added {', '.join(plus)}"] if plus else []) + \
                ([f"removed {', '.join(minus)}"] if minus else [])
            out.append(f"{key}: {'; '.join(parts) or 'reordered'}")
        elif k not in old:
            out.append(f"{key}: added {_describe(b)}")
        elif k not in new:
            out.append(f"{key}: removed (was {_describe(a)})")
        else:
            out.append(f"{key}: {a!r} -> {b!r}")
    if len(out) > limit:
        out = [*out[:limit], f"and {len(out) - limit} more"]
    return out


def _toml(data: bytes, label: str) -> dict[str, Any]:
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as exc:
        raise ContractError(f"{label}: not valid TOML: {exc}") from None


def _key_changes(root: TrustRoot, files: RootFiles, kdir: Path,
                 ) -> tuple[dict[str, Ed25519PublicKey], list[TrustChange], list[str]]:
    trusted: dict[str, Ed25519PublicKey] = {}
    root_names: dict[str, str] = {}
    for label, data in files.keys:
        kid, key = parse_public_key(data, label)
        trusted[kid] = key
        root_names[label.rsplit("/", 1)[-1]] = kid
    changes: list[TrustChange] = []
    held: set[str] = set()
    for p in sorted(kdir.glob(f"*{PUBLIC_KEY_SUFFIX}")) if kdir.is_dir() else []:
        change = "altered" if p.name in root_names else "added"
        try:
            kid, _ = load_public_key(p)
        except UsageError as exc:
            changes.append(TrustChange(file=str(p), what="key", change=change,
                                       detail=f"not a valid key file ({exc})"))
            continue
        held.add(kid)
        if kid in trusted:
            continue
        was = f" (the root's file holds keyid {root_names[p.name][:16]})" \
            if p.name in root_names else ""
        changes.append(TrustChange(
            file=str(p), what="key", change=change,
            detail=f"keyid {kid} is not trusted by the trust root {root.name}{was}; land the "
                   "key there first (a reviewed change), then evidence signed by it"))
    notes = [f"{kdir}: key {kid[:16]} removed by this change; still trusted here (the trust "
             f"root {root.name} holds it) until the removal lands there"
             for kid in trusted if kid not in held]
    return trusted, changes, notes


def check_change(root: TrustRoot, contract_path: Path, contract: Contract) -> TrustCheck:
    """Compare the checkout's keys, policy and contract with ``root``'s.

    Args:
        root: a ``git-ref`` or ``directory`` root (:func:`resolve_trust_root`).
        contract_path: the checkout's contract file (its directory is ``contracts/``).
        contract: that contract, loaded.

    Returns:
        The :class:`TrustCheck`: the root's keys and policy, and every difference.

    Raises:
        UsageError: the root cannot be read, or one of its key files is invalid.
        ContractError: the root's policy is invalid against the contract.
    """
    cdir = contract_path.parent
    files = root.files(cdir, contract.name)
    trusted, changes, notes = _key_changes(root, files, cdir / KEYS_DIR)

    mine = cdir / GATES_DIR / f"{contract.name}.toml"
    root_doc: dict[str, Any] | None = None
    if files.policy is not None:
        label, data = files.policy
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ContractError(f"{label}: not UTF-8 text: {exc}") from None
        policy = parse_policy(text, contract, path=Path(label))
        root_doc = policy_document(text, path=label)
    else:
        policy = default_policy(contract)
    if os.path.lexists(mine):
        try:
            doc = policy_document(jsonio.read_bytes(mine, max_bytes=MAX_ROOT_FILE_BYTES)
                                  .decode("utf-8"), path=mine)
        except (ContractError, EvidenceIntegrityError, OSError, UnicodeDecodeError) as exc:
            changes.append(TrustChange(file=str(mine), what="policy",
                                       change="added" if root_doc is None else "altered",
                                       detail=f"unreadable ({exc})"))
        else:
            if root_doc is None:
                changes.append(TrustChange(
                    file=str(mine), what="policy", change="added",
                    detail=f"the trust root {root.name} has no policy for {contract.name}: "
                           + "; ".join(_diff({}, doc))))
            elif policy_digest(doc) != policy_digest(root_doc):
                changes.append(TrustChange(
                    file=str(mine), what="policy", change="altered",
                    detail="; ".join(_diff(root_doc, doc)) + f" (digest "
                    f"{policy_digest(root_doc)[:12]} in {root.name}, {policy_digest(doc)[:12]} "
                    "here)"))
    elif root_doc is not None:
        changes.append(TrustChange(file=str(mine), what="policy", change="removed",
                                   detail=f"the trust root {root.name} holds {policy.path}"))

    if files.contract is None:
        changes.append(TrustChange(file=str(contract_path), what="contract", change="added",
                                   detail=f"the trust root {root.name} holds no "
                                          f"{contract.name}.toml"))
    else:
        label, data = files.contract
        rdoc = _toml(data, label)
        try:
            rdigest: str | None = Contract.from_dict(rdoc, path=Path(label)).digest
        except ContractError:
            rdigest = None
        if rdigest != contract.digest:
            mine_doc = _toml(contract_path.read_bytes(), str(contract_path))
            how = "; ".join(_diff(rdoc, mine_doc)) or "same fields, another canonical form"
            changes.append(TrustChange(
                file=str(contract_path), what="contract", change="altered",
                detail=f"{how} (digest {(rdigest or 'invalid')[:12]} in {root.name}, "
                       f"{contract.digest[:12]} here)"))
    return TrustCheck(root=root, trusted=trusted, policy=policy, changes=tuple(changes),
                      notes=tuple(notes))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RootKeys:
    """The trusted keys of a protected root, for ``qualify verify`` and ``qualify audit``.

    Attributes:
        root: the trust root.
        trusted: the root's keys, keyid -> public key (the only keys accepted).
        changes: checkout key files the root does not trust (evidence signed by them fails
            verification at its signature step).
        notes: root keys the checkout removed (still trusted until the removal lands).
    """

    root: TrustRoot
    trusted: Mapping[str, Ed25519PublicKey]
    changes: tuple[TrustChange, ...] = ()
    notes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """The root line, then one line per untrusted checkout key and per note."""
        return [self.root.line, *(f"  trust: {c.line}" for c in self.changes),
                *(f"  note: {n}" for n in self.notes)]


def root_keys(spec: str, *, contracts_dir: Path) -> RootKeys:
    """The trusted keys of the root ``--trust-from SPEC`` names (never the checkout's).

    Args:
        spec: the ``--trust-from`` value (:func:`resolve_trust_root`).
        contracts_dir: the checkout's contracts directory (``contracts/``): a git ref's
            keys are read at the same path in the ref, and the checkout's
            ``contracts/keys/`` is compared with them.

    Returns:
        The :class:`RootKeys`.

    Raises:
        UsageError: the root cannot be read, or one of its key files is invalid.
    """
    root = resolve_trust_root(spec, checkout=contracts_dir)
    files = root.files(contracts_dir, None)
    trusted, changes, notes = _key_changes(root, files, contracts_dir / KEYS_DIR)
    return RootKeys(root=root, trusted=trusted, changes=tuple(changes), notes=tuple(notes))
