"""``qualify gate --trust-from``: keys, gate policy and contract from a protected root.

Each test makes a git repository of test_verify's signed world (:func:`repo`): the world's
contract under ``contracts/``, its trusted keys under ``contracts/keys/``, a gate policy
``contracts/gates/gate-tiny.toml`` that allows the CUDA-only cells not to run, the
reference and the runs (fresh against the world's code snapshot), committed on branch
``base``. A change is then made in the work tree, as a pull request would: the gate with
``--trust-from base`` must judge it by ``base``'s keys, policy and contract only.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from fresh_world import code_root, fresh_world
from test_verify import CONTRACT, CUDA_ONLY, FAIL_CELL, World, new_key, run_cli, signed_world

from qualify.errors import ExitCode
from qualify.evidence import sign as signing
from qualify.evidence import store
from qualify.evidence.gate import gate
from qualify.resources import load_schema

__all__ = ["fresh_world", "signed_world"]  # shared session fixtures

BASE = "base"
POLICY = f"""# the protected base's policy
schema_version = 1
contract = "{CONTRACT}"

[[allowed_not_run]]
cells = "{CUDA_ONLY}-*"
reason = "CUDA-only engine on a CPU runner"
"""
_GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env={**os.environ, **_GIT_ENV}).stdout.strip()


def commit_all(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


class Repo:
    """A git repository of the signed world, ``base`` committed.

    Attributes:
        w: the world, rooted at the repository (keys moved to ``contracts/keys``).
        code: the code snapshot the world's runs are fresh against (outside the repository).
    """

    def __init__(self, w: World, code: Path) -> None:
        self.w = w
        self.root = w.root
        self.code = code

    @property
    def contracts(self) -> Path:
        return self.root / "contracts"

    @property
    def contract(self) -> Path:
        return self.contracts / f"{CONTRACT}.toml"

    @property
    def keys(self) -> Path:
        return self.contracts / "keys"

    @property
    def policy(self) -> Path:
        return self.contracts / "gates" / f"{CONTRACT}.toml"

    def gate(self, evidence: Path, *extra: str, trust: str | None = BASE) -> tuple[int, str]:
        argv = ["gate", str(evidence), "--contract", str(self.contract),
                "--sources-root", str(self.code)]
        argv += ["--trust-from", trust] if trust is not None else ["--keys", str(self.keys)]
        return run_cli([*argv, *extra])


def make_repo(src: World, dest: Path) -> Repo:
    """The world's contract, keys, reference and runs (not its code) in a git repository."""
    for part in ("contracts", "references", "evidence"):
        shutil.copytree(src.root / part, dest / part)
    shutil.copytree(src.root / "keys", dest / "contracts" / "keys")
    store.make_writable(dest)
    r = Repo(dataclasses.replace(src, root=dest), code_root(src))
    r.policy.parent.mkdir()
    r.policy.write_text(POLICY)
    git(r.root, "init", "-q", "-b", BASE)
    commit_all(r.root, "base: contract, keys, policy, signed evidence")
    git(r.root, "checkout", "-q", "-b", "change")
    return r


@pytest.fixture
def repo(fresh_world: World, tmp_path: Path) -> Repo:
    """A writable repository for one test (the change is made in its work tree)."""
    return make_repo(fresh_world, tmp_path / "repo")


@pytest.fixture(scope="module")
def base_repo(fresh_world: World, tmp_path_factory: pytest.TempPathFactory) -> Repo:
    """One repository for the tests that change nothing in it."""
    return make_repo(fresh_world, tmp_path_factory.mktemp("base") / "repo")


def resign(run: Path, key: signing.SigningKey) -> None:
    """Seal and sign ``run`` again with ``key`` (its content unchanged)."""
    store.make_writable(run)
    (run / store.MANIFEST_FILE).unlink()
    (run / signing.ATTESTATION_FILE).unlink()
    signing.seal_and_sign(run, kind="candidate-run", key=key)


def self_added_key(r: Repo) -> signing.SigningKey:
    """The change adds its own key to contracts/keys/ and signs the good run with it."""
    mine = new_key("mine")
    (r.keys / f"mine-{mine.keyid[:16]}.pub").write_bytes(mine.public_pem())
    resign(r.w.good, mine)
    return mine


# --------------------------------------------------------------------------- keys


def test_self_added_key_is_refused_and_passes_once_the_base_trusts_it(repo: Repo) -> None:
    mine = self_added_key(repo)
    code, text = repo.gate(repo.w.good, trust=None)  # the checkout as its own root: the hole
    assert code == ExitCode.OK, text
    assert "trust root: this checkout (no --trust-from: keys and policy travel" in text

    code, text = repo.gate(repo.w.good)
    commit = git(repo.root, "rev-parse", BASE)
    assert code == ExitCode.INTEGRITY_ERROR, text
    assert f"trust root: git ref {BASE} (commit {commit})" in text.splitlines()[1]
    pub = repo.keys / f"mine-{mine.keyid[:16]}.pub"
    assert f"  trust: {pub}: key added: keyid {mine.keyid} is not trusted by the trust " \
           f"root {BASE}" in text
    assert "under the trust root (exit 3)" in text
    assert "fails verification at step 2" in text  # signed by a key base does not hold

    # the key lands on the protected base first (a reviewed change), then the evidence
    commit_all(repo.root, "the change: a key and evidence signed by it")
    git(repo.root, "checkout", "-q", BASE)
    git(repo.root, "checkout", "-q", "change", "--", str(pub))
    commit_all(repo.root, "trust mine")
    git(repo.root, "checkout", "-q", "change")
    code, text = repo.gate(repo.w.good)
    assert code == ExitCode.OK, text
    assert "trust:" not in text
    assert f"keyid {mine.keyid[:16]}" in text


def test_a_key_file_replaced_by_another_key_is_refused(repo: Repo) -> None:
    signer = repo.keys / f"trusted-{repo.w.key.keyid[:16]}.pub"
    mine = new_key("mine")
    signer.write_bytes(mine.public_pem())  # base's file name, another key
    code, text = repo.gate(repo.w.good)
    assert code == ExitCode.INTEGRITY_ERROR, text
    assert f"  trust: {signer}: key altered: not a valid key file" in text
    signer.rename(repo.keys / "trusted.pub")  # and under a name that names no keyid
    code, text = repo.gate(repo.w.good)
    assert code == ExitCode.INTEGRITY_ERROR, text
    assert f"  trust: {repo.keys / 'trusted.pub'}: key added: keyid {mine.keyid}" in text


def test_a_removed_key_is_a_note_and_still_trusted(repo: Repo) -> None:
    (signer,) = repo.keys.glob(f"trusted-{repo.w.key.keyid[:16]}.pub")
    signer.unlink()
    code, text = repo.gate(repo.w.good)
    assert code == ExitCode.OK, text
    assert f"key {repo.w.key.keyid[:16]} removed by this change; still trusted here" in text


@pytest.mark.parametrize("command", ["verify", "audit"])
def test_verify_and_audit_trust_only_the_roots_keys(repo: Repo, command: str,
                                                    capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    """A change that adds its own key and signs with it passes ``verify`` / ``audit`` under
    the checkout's keys (the hole) and fails them under ``--trust-from`` (signature step),
    naming the untrusted key; a key the root holds verifies either way."""
    def argv(*extra: str) -> list[str]:
        target = [str(repo.w.good)] if command == "verify" else [str(repo.w.good.parent)]
        return [command, *target, "--contracts-dir", str(repo.contracts), *extra]

    code, text = run_cli(argv("--trust-from", BASE))  # nothing changed yet
    assert code == ExitCode.OK, text
    assert f"trust root: git ref {BASE}" in text
    mine = self_added_key(repo)
    code, text = run_cli(argv("--keys", str(repo.keys)))
    if command == "verify":
        assert code == ExitCode.OK, text
    code, text = run_cli(argv("--trust-from", BASE))
    assert code == ExitCode.INTEGRITY_ERROR, text
    assert f"key added: keyid {mine.keyid} is not trusted by the trust root {BASE}" in text
    code, _ = run_cli(argv("--trust-from", BASE, "--keys", str(repo.keys)))
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE_ERROR
    assert "--trust-from takes the trusted keys from the trust root; drop --keys" in err


# --------------------------------------------------------------------------- policy

PolicyEdit = Callable[[Repo], str]


def _add_expected_failure(r: Repo) -> str:
    with r.policy.open("a") as f:
        f.write(f'\n[[expected_failures]]\ncells = "{FAIL_CELL}"\nfamilies = ["logprobs"]\n'
                'max_margin = 1e6\nreason = "mine"\nupstream = "https://example.org/1"\n')
    return f"policy altered: expected_failures: added '{FAIL_CELL}' (logprobs)"


def _allow_not_run(r: Repo) -> str:
    with r.policy.open("a") as f:
        f.write(f'\n[[allowed_not_run]]\ncells = "{FAIL_CELL}"\nreason = "mine"\n')
    return f"policy altered: allowed_not_run: added '{FAIL_CELL}'"


def _narrow_required(r: Repo) -> str:
    r.policy.write_text(POLICY.replace("schema_version = 1",
                                       'schema_version = 1\nrequired = ["*-tp1"]'))
    return "policy altered: required: added '*-tp1'"


def _policy_removed(r: Repo) -> str:
    r.policy.unlink()
    return "policy removed: the trust root base holds"


RELAXATIONS: dict[str, PolicyEdit] = {
    "expected-failure-added": _add_expected_failure,
    "allowed-not-run-added": _allow_not_run,
    "required-narrowed": _narrow_required,
    "policy-removed": _policy_removed,
}


@pytest.mark.parametrize("edit", RELAXATIONS.values(), ids=RELAXATIONS.keys())
def test_a_change_to_its_own_policy_is_refused(repo: Repo, edit: PolicyEdit,
                                               tmp_path: Path) -> None:
    how = edit(repo)
    out = tmp_path / "gate.json"
    code, text = repo.gate(repo.w.failing, "--json", str(out))
    assert code == ExitCode.INTEGRITY_ERROR, text
    assert f"  trust: {repo.policy}: {how}" in text, text
    assert "under the trust root (exit 1)" in text  # judged by base's policy all the same
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, load_schema("gate"))
    (c,) = doc["contracts"]
    assert [t["what"] for t in c["trust_changes"]] == ["policy"]
    assert c["policy"]["path"] == f"{BASE}:contracts/gates/{CONTRACT}.toml"
    assert doc["trust_root"]["kind"] == "git-ref"


def test_a_policy_where_the_base_has_none_is_refused(repo: Repo) -> None:
    git(repo.root, "checkout", "-q", BASE)
    repo.policy.unlink()
    commit_all(repo.root, "no policy")
    git(repo.root, "checkout", "-q", "change")
    code, text = repo.gate(repo.w.good)
    assert code == ExitCode.INTEGRITY_ERROR, text
    assert f"{repo.policy}: policy added: the trust root base has no policy" in text


def test_comments_and_layout_of_the_policy_are_no_change(repo: Repo) -> None:
    repo.policy.write_text("# reworded\n" + POLICY.replace(" = ", "=") + "\n# end\n")
    code, text = repo.gate(repo.w.good)
    assert code == ExitCode.OK, text


# --------------------------------------------------------------------------- contract


def test_a_change_to_the_contract_is_refused_unjudged(repo: Repo) -> None:
    text0 = repo.contract.read_text()
    assert "\nk = 4.0\n" in text0
    repo.contract.write_text(text0.replace("\nk = 4.0\n", "\nk = 40.0\n"))
    code, text = repo.gate(repo.w.good)
    assert code == ExitCode.INTEGRITY_ERROR, text
    assert f"{repo.contract}: contract altered: bounds.k: 4.0 -> 40.0" in text
    assert "the contract differs, so the evidence is not judged" in text


# --------------------------------------------------------------------------- roots


def _pinned(r: Repo, dest: Path) -> Path:
    """A directory trust root outside the checkout: a copy of base's contracts/."""
    dest.mkdir()
    shutil.copy(r.contract, dest / r.contract.name)
    shutil.copytree(r.keys, dest / "keys")
    shutil.copytree(r.policy.parent, dest / "gates")
    return dest


def test_a_directory_root_outside_the_checkout(repo: Repo, tmp_path: Path) -> None:
    pinned = _pinned(repo, tmp_path / "pinned")
    out = tmp_path / "gate.json"
    code, text = repo.gate(repo.w.good, "--json", str(out), trust=str(pinned))
    assert code == ExitCode.OK, text
    assert f"trust root: directory {pinned}" in text
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, load_schema("gate"))
    assert doc["trust_root"] == {"kind": "directory", "spec": str(pinned), "commit": None,
                                 "path": str(pinned),
                                 "line": f"trust root: directory {pinned}"}
    self_added_key(repo)
    code, text = repo.gate(repo.w.good, trust=str(pinned))
    assert code == ExitCode.INTEGRITY_ERROR, text
    assert "key added" in text


BAD_ROOTS: dict[str, tuple[Callable[[Repo, Path], list[str]], str]] = {
    "unknown-ref": (lambda r, t: ["--trust-from", "origin/nope"],
                    "--trust-from origin/nope: neither a directory nor a git ref of"),
    "option-like": (lambda r, t: ["--trust-from=--output=x"], "give a git ref"),
    "missing-dir": (lambda r, t: ["--trust-from", str(t / "absent")],
                    "--trust-from: no such directory"),
    "a-file": (lambda r, t: ["--trust-from", str(r.contract)], "--trust-from: not a directory"),
    "inside-checkout": (lambda r, t: ["--trust-from", str(r.contracts)],
                        "a trust root there travels with the change"),
    "with-keys": (lambda r, t: ["--trust-from", BASE, "--keys", str(r.keys)],
                  "drop --keys / --policy"),
    "with-policy": (lambda r, t: ["--trust-from", BASE, "--policy", str(r.policy)],
                    "drop --keys / --policy"),
}


@pytest.mark.parametrize("case", BAD_ROOTS.values(), ids=BAD_ROOTS.keys())
def test_a_bad_trust_root_is_a_one_line_usage_error(
        base_repo: Repo, tmp_path: Path, case: tuple[Callable[[Repo, Path], list[str]], str],
        capsys: pytest.CaptureFixture[str]) -> None:
    argv, message = case
    r = base_repo
    code, text = run_cli(["gate", str(r.w.good), "--contract", str(r.contract),
                          *argv(r, tmp_path)])
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE_ERROR, (text, err)
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_a_symlinked_key_in_a_directory_root_is_refused(base_repo: Repo, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    pinned = _pinned(base_repo, tmp_path / "pinned")
    (pinned / "keys" / "link.pub").symlink_to(next(base_repo.keys.glob("*.pub")))
    code, _ = base_repo.gate(base_repo.w.good, trust=str(pinned))
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE_ERROR, err
    assert "link.pub: a symbolic link" in err


def test_the_api_reports_the_root(base_repo: Repo) -> None:
    r = base_repo
    result = gate(r.w.good, [r.contract], trust_from=BASE, sources_root=r.code)
    assert result.passed, result.summary_lines()
    doc: dict[str, Any] = result.to_dict()
    assert doc["trust_root"]["commit"] == git(r.root, "rev-parse", BASE)
    assert result.summary_lines()[1] == doc["trust_root"]["line"]
    plain = gate(r.w.good, [r.contract], trusted_keys_dir=r.keys, sources_root=r.code)
    assert plain.to_dict()["trust_root"]["kind"] == "checkout"


# --------------------------------------------------------------------------- CI files

ROOT = Path(__file__).resolve().parent.parent


def test_the_workflow_gates_pull_requests_from_their_base() -> None:
    """The pull-request gate names the base as its trust root, from a clone that has it."""
    text = (ROOT / ".github/workflows/qualify-gate.yml").read_text()
    checkout = text[text.index("uses: actions/checkout"):text.index("uses: actions/setup-python")]
    assert "fetch-depth: 0" in checkout
    step = text[text.index("- name: Gate\n"):text.index("- name: Gate under")]
    assert "BASE_REF: ${{ github.base_ref }}" in step
    run = step[step.index("run: |"):]
    assert "${{" not in run  # the ref reaches the script through the environment
    assert 'trust=(--trust-from "origin/$BASE_REF")' in run
    assert '"${trust[@]}"' in run
    audit = text[text.index("qualify audit") - 400:text.index("- name: Gate\n")]
    assert "BASE_REF: ${{ github.base_ref }}" in audit  # audit trusts the base's keys too
    assert 'qualify audit references evidence "${trust[@]}"' in audit


@pytest.mark.parametrize("path", ["contracts/keys/x.pub", "contracts/gates/x.toml",
                                  "contracts/x.toml", ".github/workflows/qualify-gate.yml",
                                  ".github/CODEOWNERS", ".ci/run", "qualify/evidence/gate.py"])
def test_codeowners_own_every_trust_file(path: str) -> None:
    rules = [line.split()[0] for line in (ROOT / ".github/CODEOWNERS").read_text().splitlines()
             if line.strip() and not line.startswith("#")]

    def owns(rule: str) -> bool:
        pattern = rule.lstrip("/")
        if pattern.endswith("/"):
            return path.startswith(pattern)
        return fnmatch.fnmatchcase(path, pattern) and "/" not in path[len(
            pattern.rsplit("/", 1)[0]) + 1:]

    assert any(owns(r) for r in rules), path
