"""The tamper set of test_verify applied to a REAL signed run of the tiny contract (issue #4).

One module fixture (:func:`real_world`) holds what
``qualify run contracts/tiny-qwen3.toml`` does (qualify/pipeline/chain.py), with a test
signing key given through ``$QUALIFY_SIGNING_KEY`` (the variable is restored after). The
expensive part, reference and candidate stage (about 3 minutes on 2 cores), is the
session's shared :func:`shared_artifacts.tiny_chain` (built once for every module and
xdist worker that needs it; test_pipeline checks the same run); this module copies it:

- ``references/tiny-qwen3-<digest12>/``: :func:`~qualify.reference.stage.run_reference_stage`
  (sealed and signed by the chain's key, the trusted key here);
- ``evidence/tiny-qwen3/<run id>/``: :func:`~qualify.candidate.stage.run_candidate_stage`
  (all 8 torch_tp cells, real torchrun + gloo launches),
  :func:`~qualify.compare.stage.compare_run`, then ``seal_and_sign`` of the run (here);
- ``evidence/tiny-qwen3/0-older-copy/``: a copy of the same compared run sealed and signed
  a moment *before* the real one (the "older run" whose attestation is replayed);
- ``contracts/tiny-qwen3.toml``: the committed contract reduced to the torch_tp engine
  and the HF sampler (:mod:`tiny_contracts`), where verify step 6 looks
  (``--contracts-dir``); ``keys/``: two trusted public keys (a third key stays untrusted).

The tree is assembled under ``build/`` and then renamed to ``world/`` (and the shared chain
was built under a directory that is renamed too): ``run.json`` names its reference by
absolute path, which then no longer exists, so every copy finds its OWN
reference through ``references/`` beside an ancestor (as committed evidence moved to
another machine does). Without that, a copy's run would still point at the pristine
reference and the mutations of the reference would go unseen.

Each mutation of test_verify's :data:`~test_verify.MUTATIONS` (except ``FAIL->PASS``,
which needs a failing run) plus two that only a real tree has is applied to a copy
(:meth:`World.copy`: ``copytree`` + ``make_writable``) and must make ``verify``, ``gate``
and ``audit`` exit 3 at the expected step.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from shared_artifacts import TinyChain, copy_tree, signing_env, tiny_chain
from test_verify import (
    MUTATIONS,
    TENSOR_CELL,
    Mutation,
    World,
    flip_byte,
    new_key,
    run_cli,
)
from tiny_contracts import torch_tp_only_text

from qualify.contract import load_contract
from qualify.errors import EvidenceIntegrityError, ExitCode
from qualify.evidence import sign as signing
from qualify.evidence import store
from qualify.evidence.verify import ReferenceBindingError, SubjectDigestError

NAME = "tiny-qwen3"
OLD_RUN = "0-older-copy"  # sorts before the UTC run id: the gate's newest run is the real one


@dataclasses.dataclass(frozen=True)
class RealWorld(World):
    """test_verify's :class:`World` over the real tree (the mutations use its paths)."""

    run_id: str = ""

    @property
    def contract(self) -> Path:
        return self.root / "contracts" / f"{NAME}.toml"

    def run(self, name: str) -> Path:
        return self.root / "evidence" / NAME / name

    @property
    def good(self) -> Path:
        return self.run(self.run_id)

    @property
    def old(self) -> Path:
        return self.run(OLD_RUN)


def _build(root: Path, chain: TinyChain) -> RealWorld:
    """The real world under ``root`` from a copy of the shared chain (reference and compared
    run), sealed and signed as ``qualify run`` does."""
    key = signing.SigningKey.from_pem(chain.pem.encode("utf-8"), source="test key trusted")
    other, untrusted = new_key("trusted-2"), new_key("untrusted")
    for part in ("references", "evidence"):
        copy_tree(chain.root / part, root / part)
    (root / "keys").mkdir(parents=True)
    for name, k in (("trusted", key), ("trusted-2", other)):
        (root / "keys" / f"{name}-{k.keyid[:16]}.pub").write_bytes(k.public_pem())
    (root / "contracts").mkdir()
    (root / "contracts" / f"{NAME}.toml").write_text(torch_tp_only_text())
    assert chain.contract.read_text() == torch_tp_only_text()
    run = root / "evidence" / NAME / chain.run.name
    with signing_env(chain.pem):
        assert signing.default_signing_key().keyid == key.keyid
        # an older signing of the same compared run, then the run itself (as `qualify run`)
        shutil.copytree(run, run.parent / OLD_RUN, symlinks=True)
        signing.seal_and_sign(run.parent / OLD_RUN, kind="candidate-run")
        time.sleep(0.01)
        signing.seal_and_sign(run, kind="candidate-run")
    return RealWorld(root=root, key=key, other_trusted=other, untrusted=untrusted,
                     run_id=run.name)


@pytest.fixture(scope="module")
def real_world(tmp_path_factory: pytest.TempPathFactory) -> RealWorld:
    chain = tiny_chain(tmp_path_factory)
    base = tmp_path_factory.mktemp("real-run")
    built = _build(base / "build", chain)
    (base / "build").rename(base / "world")  # the absolute reference path goes stale
    return dataclasses.replace(built, root=base / "world")


@pytest.fixture
def real_copy(real_world: RealWorld, tmp_path: Path) -> Iterator[RealWorld]:
    w = real_world.copy(tmp_path / "world")
    assert isinstance(w, RealWorld)
    yield w
    store.make_writable(tmp_path)


# --------------------------------------------------------------------------- mutations


def m_launch_output_byte(w: World) -> Path:
    """A byte of a (sealed) launch attempt's tensor index: the per-tensor sha256 of what the
    harness wrote (the launch keeps no tensors of its own since compact evidence)."""
    launch = sorted((w.good / "launches").rglob("tensor_index.json"))[0]
    flip_byte(launch)
    return w.good


def m_reference_scores_byte(w: World) -> Path:
    """A byte of the reference's HF FP32 scores (the real reference's own tensors)."""
    flip_byte(w.reference / "scores" / "hf-fp32.safetensors")
    return w.good


NEEDS_FAILING_RUN = {"verdict FAIL->PASS in report.json (re-sealed, re-signed)",
                     "sealed gate decision flipped (re-sealed, re-signed)"}
REAL_MUTATIONS: tuple[Mutation, ...] = (
    *(m for m in MUTATIONS if m.name not in NEEDS_FAILING_RUN),
    Mutation("byte flipped in a launch attempt's tensor index", m_launch_output_byte, 4,
             SubjectDigestError),
    Mutation("byte flipped in the reference's HF scores", m_reference_scores_byte, 7,
             ReferenceBindingError),
)
REAL_IDS = [m.name for m in REAL_MUTATIONS]


def verify_cli(w: World, target: Path, out: Path) -> tuple[int, str, dict[str, Any]]:
    """``qualify verify TARGET --json OUT``: exit code, stdout and the result document."""
    code, text = run_cli(["verify", str(target), "--keys", str(w.keys),
                          "--contracts-dir", str(w.contracts), "--json", str(out)])
    return code, text, json.loads(out.read_text())


def gate_cli(w: World, evidence: Path, out: Path) -> tuple[int, str]:
    return run_cli(["gate", str(evidence), "--contract", str(w.contract), "--keys",
                    str(w.keys), "--json", str(out)])


def audit_cli(w: World, *dirs: Path) -> tuple[int, list[dict[str, object]]]:
    code, text = run_cli(["audit", *map(str, dirs), "--keys", str(w.keys),
                          "--contracts-dir", str(w.contracts), "--format", "json"])
    rows: list[dict[str, object]] = json.loads(text)["rows"]
    return code, rows


# --------------------------------------------------------------------------- tests


def test_real_run_is_the_whole_tiny_matrix(real_world: RealWorld) -> None:
    w = real_world
    contract = load_contract(w.contract)
    cells = {c.cell_id for c in contract.matrix.cells()}
    assert len(cells) == 8
    assert all(c.startswith("torch_tp-") for c in cells)
    report = json.loads((w.good / "report.json").read_text())
    assert {c["cell"]: c["verdict"] for c in report["cells"]} == dict.fromkeys(cells, "PASS")
    assert report["passed"] is True
    stmt = json.loads(signing.read_envelope(w.good).payload)
    assert stmt["predicate"]["result"] == "PASSED"
    assert sorted(stmt["predicate"]["passedTests"]) == sorted(cells)
    # the run's recorded reference path is stale: the reference is found beside an ancestor
    run_doc = json.loads((w.good / "run.json").read_text())
    assert not Path(run_doc["reference"]["path"]).exists()
    assert (w.good / "cells" / TENSOR_CELL / "attempt-1" / "outputs.safetensors").is_file()
    assert (w.reference / "rollout.safetensors").is_file()
    assert (w.good / "report.md").is_file()


def test_untouched_real_evidence_verifies(real_world: RealWorld, tmp_path: Path) -> None:
    w = real_world
    for path, recompute in ((w.reference, True), (w.old, False)):
        result = w.verify(path, recompute=recompute)
        assert result, result.summary_lines()
        assert result.keyids == (w.key.keyid,)
    code, out, doc = verify_cli(w, w.good, tmp_path / "verify.json")
    assert code == ExitCode.OK, out
    assert "VERIFIED" in out
    assert [s["status"] for s in doc["steps"]] == ["passed"] * 9  # step 9: recomputed
    assert doc["keyids"] == [w.key.keyid]
    assert Path(doc["reference"]).resolve() == w.reference.resolve()


def test_fp32_tp_bounds_are_at_least_the_fp32_rounding_scale(real_world: RealWorld) -> None:
    """The sealed FP32 TP=n vs TP=1 bounds take the fp64 control (the FP32 rounding scale):
    no FP32 TP bound is the floor alone because the reorder controls happened to round alike,
    and each is at least k x the fp64 control's error of the same metric."""
    doc = json.loads((real_world.reference / "bounds.json").read_text())
    assert "fp64" in doc["controls"]["tp_vs_tp1"]
    rows = [b for b in doc["bounds"] if b["precision"] == "fp32"]
    fp64 = {(b["round"], b["role"], b["family"]): b["control_error"]
            for b in rows if b["class"] == "candidate_vs_hf" and b["control"] == "fp64"}
    tp = [b for b in rows if b["class"] == "tp_vs_tp1"]
    assert tp
    for b in tp:
        floor_only = b["bound"] == b["floor"]
        assert not (floor_only and fp64.get((b["round"], b["role"], b["family"]), 0.0) > 0), b
        want = fp64.get((b["round"], b["role"], b["family"]))
        if want is not None:
            assert b["control_error"] >= want, b
    norm = next(b for b in tp if (b["round"], b["role"], b["family"]) == (1, "actor", "grad_norm"))
    assert norm["control_error"] > 0, norm
    assert norm["bound"] > norm["floor"], norm


def test_untouched_real_run_passes_the_gate(real_world: RealWorld, tmp_path: Path) -> None:
    w = real_world
    out = tmp_path / "gate.json"
    code, text = gate_cli(w, w.root / "evidence", out)  # gates the newest run: the real one
    assert code == ExitCode.OK, text
    (decision,) = json.loads(out.read_text())["contracts"]
    assert Path(decision["run_dir"]).resolve() == w.good.resolve()
    assert len(decision["cells"]) == 8
    assert {c["verdict"] for c in decision["cells"]} == {"PASS"}


def test_untouched_real_evidence_audits_clean(real_world: RealWorld) -> None:
    code, rows = audit_cli(real_world, real_world.root)
    assert code == ExitCode.OK, rows
    assert sorted(str(r["kind"]) for r in rows) == ["candidate-run", "candidate-run",
                                                     "reference"]
    assert all(r["problems"] == [] for r in rows)


def test_real_tamper_set_is_large() -> None:
    assert len(REAL_MUTATIONS) >= 20
    assert {m.step for m in REAL_MUTATIONS} == set(range(1, 10))


@pytest.mark.parametrize("mutation", REAL_MUTATIONS, ids=REAL_IDS)
def test_tamper_of_the_real_run_is_caught(real_copy: RealWorld, mutation: Mutation,
                                         tmp_path: Path) -> None:
    w = real_copy
    target = mutation.apply(w)
    code, out, doc = verify_cli(w, target, tmp_path / "verify.json")
    assert code == ExitCode.INTEGRITY_ERROR, out
    assert f"[FAIL] {mutation.step}." in out
    first = next(s for s in doc["steps"] if s["status"] == "failed")
    assert first["step"] == mutation.step, out
    assert first["error"] == mutation.error.__name__
    assert issubclass(mutation.error, EvidenceIntegrityError)

    code, out = gate_cli(w, target, tmp_path / "gate.json")
    assert code == ExitCode.INTEGRITY_ERROR, out
    assert f"fails verification at step {mutation.step} " in out

    code, rows = audit_cli(w, target)
    assert code == ExitCode.INTEGRITY_ERROR
    (row,) = rows
    problems = row["problems"]
    assert isinstance(problems, list)
    assert problems
    assert str(problems[0]).startswith(f"step {mutation.step} "), problems
