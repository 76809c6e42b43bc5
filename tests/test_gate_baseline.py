"""``qualify gate --baseline``: what changed since the last accepted run of the same contract.

On the signed evidence world of :mod:`fresh_world` (real sealed, signed, compared runs:
``run-1-old``, ``run-2-good`` and the newest, ``run-3-fail``, whose ``FAIL_CELL`` fails):

- without ``--trust-from`` the baseline is the newest older run whose sealed decision is
  PASS and that verifies (``run-2-good``); a tampered one is skipped, and said so;
- with ``--trust-from REF`` it is the newest run of the contract in REF's tree, read from
  git objects (nothing checked out), i.e. what was merged;
- the section never changes the exit code, the decision JSON carries it
  (``gate.schema.json``) and ``--summary`` appends it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fresh_world import fresh_world, signed_world  # noqa: F401  (session fixtures)
from test_trust_root import BASE, Repo, commit_all, git, make_repo
from test_verify import CONTRACT, FAIL_CELL, World, flip_byte, reseal_and_resign

from qualify.compare.stage import compare_run
from qualify.contract import load_contract
from qualify.errors import ExitCode
from qualify.evidence import sign as signing
from qualify.evidence import store
from qualify.evidence.policy import load_policy

HEAD = "changed since the last accepted run"


def _repo(fresh_world: World, tmp_path: Path) -> Repo:  # noqa: F811
    """The world in git; ``base`` holds run-1 and run-2 only, the change adds run-3.

    run-1 and run-2 are compared again under the repository's gate policy (which allows
    the CUDA-only cells NOT_RUN), so their sealed decisions are PASS, and re-signed with
    the world's key, as ``qualify run`` would have sealed them.
    """
    r = make_repo(fresh_world, tmp_path / "repo")
    aside = tmp_path / "aside"
    git(r.root, "checkout", "-q", BASE)
    contract = load_contract(r.contract)
    for run in (r.w.run("run-1-old"), r.w.good):
        store.make_writable(run)
        for sealed in (store.MANIFEST_FILE, signing.ATTESTATION_FILE):
            (run / sealed).unlink()
        compare_run(run, policy=load_policy(r.policy, contract))
        signing.seal_and_sign(run, kind="candidate-run", key=r.w.key)
        assert json.loads((run / "report.json").read_text())["gate"]["exit_code"] == 0
    shutil.move(r.w.failing, aside)
    commit_all(r.root, "base: run-3 not merged")
    git(r.root, "checkout", "-q", "-b", "change-2")
    shutil.move(aside, r.w.failing)
    return r


@pytest.fixture(scope="module")
def shared(fresh_world: World, tmp_path_factory: pytest.TempPathFactory) -> Repo:  # noqa: F811
    """One repository for the tests that change nothing in it."""
    return _repo(fresh_world, tmp_path_factory.mktemp("baseline"))


@pytest.fixture
def repo(fresh_world: World, tmp_path: Path) -> Repo:  # noqa: F811
    """A repository for one test that changes it."""
    return _repo(fresh_world, tmp_path)


def _gate(r: Repo, *extra: str, trust: str | None = None) -> tuple[int, str]:
    return r.gate(r.root / "evidence", *extra, trust=trust)


def test_the_local_baseline_is_the_newest_older_accepted_run(shared: Repo,
                                                              tmp_path: Path) -> None:
    repo = shared
    out_json, summary = tmp_path / "gate.json", tmp_path / "summary.md"
    code, out = _gate(repo, "--json", str(out_json), "--summary", str(summary))
    none_code, none_out = _gate(repo, "--baseline", "none")
    assert code == none_code == ExitCode.QUALIFICATION_FAILED  # the diff decides nothing
    assert HEAD not in none_out
    assert f"baseline: {repo.w.good} (the newest older run of {CONTRACT}" in out
    assert f"{FAIL_CELL}: PASS -> FAIL" in out  # the comparator verdict and the outcome
    assert "cells whose gate outcome changed: 1" in out
    doc = json.loads(out_json.read_text())
    (b,) = doc["baselines"]
    assert b["baseline"] == str(repo.w.good)
    assert b["judged"] is True
    assert [c["cell"] for c in b["diff"]["cells"]] == [FAIL_CELL]
    assert b["diff"]["bounds"] == []  # the same sealed reference
    assert b["diff"]["same_reference"] is True
    md = summary.read_text()
    assert md.index("## qualify gate: FAIL") < md.index("### Changed since the last accepted")


def test_a_baseline_that_does_not_verify_is_skipped_and_said_so(repo: Repo) -> None:
    flip_byte(next(repo.w.good.rglob("*.safetensors")))  # no longer what was signed
    code, out = _gate(repo)
    assert code == ExitCode.QUALIFICATION_FAILED
    assert f"baseline: {repo.w.run('run-1-old')} (the newest older run" in out
    assert "newer ones skipped: run-2-good: does not verify)" in out


def test_a_refused_run_shows_no_outcome_changes(repo: Repo) -> None:
    """A gated run signed by an untrusted key is refused before its cells are judged: the
    section says the changes are not known, instead of every cell changed to no outcome."""
    reseal_and_resign(repo.w.failing, repo.w.untrusted, "candidate-run")
    out_json = repo.root.parent / "gate-refused.json"
    code, out = _gate(repo, "--json", str(out_json))
    assert code == ExitCode.INTEGRITY_ERROR
    assert "cells whose gate outcome changed: not known (the gate refused the run before " \
           "judging its cells)" in out
    assert "-> None" not in out
    (b,) = json.loads(out_json.read_text())["baselines"]  # the JSON says so as well
    assert b["judged"] is False
    assert b["outcomes"] == []
    for older in (repo.w.good, repo.w.run("run-1-old")):  # and with no accepted run at all
        shutil.rmtree(older)
    code, out = _gate(repo, "--json", str(out_json))
    assert code == ExitCode.INTEGRITY_ERROR
    (b,) = json.loads(out_json.read_text())["baselines"]
    assert (b["baseline"], b["judged"]) == (None, False), b


def test_the_ref_baseline_is_what_was_merged_read_from_git_objects(shared: Repo) -> None:
    repo = shared
    code, out = _gate(repo, trust=BASE)
    assert code == ExitCode.QUALIFICATION_FAILED
    assert f"baseline: {BASE}:evidence/{CONTRACT}/run-2-good (the newest run of {CONTRACT} " \
           f"in {BASE}" in out
    assert f"{FAIL_CELL}: PASS -> FAIL" in out
    assert git(repo.root, "rev-parse", "--abbrev-ref", "HEAD") == "change-2"  # no checkout
    assert git(repo.root, "status", "--porcelain", "--", "evidence") == \
        f"?? evidence/{CONTRACT}/run-3-fail/"


def test_no_accepted_run_is_said_and_an_explicit_baseline_is_used(repo: Repo) -> None:
    shutil.rmtree(repo.w.good)
    shutil.rmtree(repo.w.run("run-1-old"))
    code, out = _gate(repo)
    assert code == ExitCode.QUALIFICATION_FAILED
    assert f"{HEAD} [{CONTRACT}]: no accepted run found (0 older runs" in out
    code, out = _gate(repo, "--baseline", str(repo.w.failing))
    assert f"baseline: {repo.w.failing} (given by --baseline)" in out
    assert "cells whose verdict changed: 0" in out
    code, out = _gate(repo, "--baseline", str(repo.root / "contracts"))  # not a run
    assert code == ExitCode.QUALIFICATION_FAILED  # the gate's own code, whatever the baseline
    assert f"{HEAD} [{CONTRACT}]: no accepted run found (the baseline could not be read: " \
           "UsageError: " in out
    code, out = _gate(repo, "--baseline", str(repo.root / "nope"))
    assert code == ExitCode.USAGE_ERROR
