"""Expensive real artifacts built once per test session and shared by the xdist workers.

A real reference stage or a real candidate run of the tiny contract takes minutes on 2
cores. Modules that need the same one (and pytest-xdist workers that both collect such a
module) used to build it each: the tamper set's real run and test_pipeline's "every
torch_tp cell passes" ran the same 8-cell candidate stage on the same contract. Here each
artifact is built once, by whichever worker asks first, into a directory of the session's
shared temporary root named for what it depends on (the contract digest); a
:class:`filelock.FileLock` makes the other worker wait and then read the same files. A
build that raises leaves a ``.failed`` file, so the next consumer fails at once with the
same reason instead of rebuilding for minutes.

The artifacts are built under ``<name>.build/`` and then renamed to ``<name>/``: a run
names its reference by absolute path, which then no longer exists, so a copy of the tree
finds its OWN reference through ``references/`` beside an ancestor (test_tamper_real_run
relies on that). Consumers never write into a shared artifact: they copy it
(:func:`copy_tree`) and work on the copy.

- :func:`tiny_reference`: the sealed reference of ``tiny-qwen3`` reduced to torch_tp and the
  HF sampler (:mod:`tiny_contracts`), signed with a session test key (its PEM is kept);
- :func:`tiny_chain`: that reference (a copy) plus the real candidate stage of all 8 cells
  and :func:`~qualify.compare.stage.compare_run` (compared, not sealed: what
  ``qualify run`` holds before it seals and signs);
- :func:`default_reference`: the sealed reference of the committed default contract
  (vLLM rollout, every lane), signed with the default key (as ``qualify reference`` does);
- :func:`committed_gate`: ``qualify gate`` of a copy of the committed tiny-qwen3 runs (a
  full verification of the committed run), with ``--json``, ``--junit-xml`` and
  ``--summary``, its exit code and its output (test_junit and test_committed_evidence read
  the same decision).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from filelock import FileLock
from tiny_contracts import torch_tp_only_text

from qualify.contract import Contract, default_contract_path, load_contract
from qualify.evidence import sign as signing
from qualify.evidence import store

__all__ = ["GATE_SUMMARY_BEFORE", "TinyChain", "committed_gate", "copy_tree",
           "default_reference", "shared_root", "signing_env", "tiny_chain", "tiny_reference"]

KEY_FILE = "signing-key.pem"
CHAIN_FILE = "chain.json"
CONTRACT_FILE = "tiny-qwen3.toml"


def shared_root(factory: pytest.TempPathFactory) -> Path:
    """The temporary root every xdist worker of this session shares (the parent of each
    worker's base temp); without xdist, this process's own base temp."""
    base = factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(parents=True, exist_ok=True)
    return root


def build_once(factory: pytest.TempPathFactory, name: str,
               build: Callable[[Path], None]) -> Path:
    """``<shared root>/<name>``, built by ``build(<shared root>/<name>.build)`` the first
    time any worker of the session asks, then renamed; read-only for every consumer."""
    root = shared_root(factory)
    done, work, failed = root / name, root / f"{name}.build", root / f"{name}.failed"
    with FileLock(str(root / f"{name}.lock")):
        if failed.is_file():
            pytest.fail(f"shared artifact {name} failed to build earlier in this session:\n"
                        f"{failed.read_text(encoding='utf-8')}")
        if not done.is_dir():
            if work.exists():
                store.make_writable(work)
                shutil.rmtree(work)
            work.mkdir()
            try:
                build(work)
            except BaseException:
                failed.write_text(traceback.format_exc(), encoding="utf-8")
                raise
            work.rename(done)
    return done


def copy_tree(src: Path, dest: Path) -> Path:
    """A copy of a shared artifact's directory (modes kept: sealed files stay read-only)."""
    shutil.copytree(src, dest, symlinks=True)
    return dest


@contextlib.contextmanager
def signing_env(pem: str) -> Iterator[None]:
    """``$QUALIFY_SIGNING_KEY`` = ``pem`` (and no key file) inside; restored after."""
    names = (signing.ENV_SIGNING_KEY, signing.ENV_SIGNING_KEY_FILE)
    saved = {v: os.environ.pop(v, None) for v in names}
    os.environ[signing.ENV_SIGNING_KEY] = pem
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def _tiny_digest12() -> str:
    """The digest12 of the torch_tp-only tiny contract (the artifacts' key)."""
    return load_contract_text(torch_tp_only_text()).digest12


def load_contract_text(text: str) -> Contract:
    """A contract loaded from ``text`` (through a file: the loader takes paths)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / CONTRACT_FILE
        path.write_text(text, encoding="utf-8")
        return load_contract(path)


def _only(directory: Path) -> Path:
    (one,) = [p for p in directory.iterdir() if p.is_dir()]
    return one


def tiny_reference(factory: pytest.TempPathFactory) -> Path:
    """The shared tiny torch_tp-only reference tree: ``contracts/tiny-qwen3.toml``,
    ``signing-key.pem`` (the session test key that signed it) and
    ``references/tiny-qwen3-<digest12>/`` (sealed, signed). Copy it before use."""
    def build(work: Path) -> None:
        from qualify.reference.stage import run_reference_stage

        (work / "contracts").mkdir()
        (work / "contracts" / CONTRACT_FILE).write_text(torch_tp_only_text(), encoding="utf-8")
        contract = load_contract(work / "contracts" / CONTRACT_FILE)
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()).decode()
        (work / KEY_FILE).write_text(pem, encoding="utf-8")
        with signing_env(pem):
            ref = run_reference_stage(contract, root=work / "references", quiet=True)
            signing.ensure_signed(ref)

    return build_once(factory, f"tiny-reference-{_tiny_digest12()}", build)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TinyChain:
    """The shared tiny chain (read-only): paths, the signing key, what the build saw."""

    root: Path
    doc: dict[str, Any]

    @property
    def contract(self) -> Path:
        return self.root / "contracts" / CONTRACT_FILE

    @property
    def pem(self) -> str:
        return (self.root / KEY_FILE).read_text(encoding="utf-8")

    @property
    def reference(self) -> Path:
        return _only(self.root / "references")

    @property
    def run(self) -> Path:
        return self.root / "evidence" / self.doc["contract"] / self.doc["run_id"]


def tiny_chain(factory: pytest.TempPathFactory) -> TinyChain:
    """The shared tiny chain: :func:`tiny_reference` (copied), then the real candidate
    stage of every cell of the contract (real torchrun + gloo launches) and
    :func:`~qualify.compare.stage.compare_run`, as ``qualify run`` does before sealing.

    ``chain.json`` records the run id, the reference's manifest digest before the
    candidate stage ran, and the comparator's verdicts, ``passed`` and summary.
    """
    ref_tree = tiny_reference(factory)

    def build(work: Path) -> None:
        from qualify.candidate.stage import run_candidate_stage
        from qualify.compare.stage import compare_run

        for part in ("contracts", "references"):
            copy_tree(ref_tree / part, work / part)
        contract = load_contract(work / "contracts" / CONTRACT_FILE)
        shutil.copy2(ref_tree / KEY_FILE, work / KEY_FILE)
        ref = _only(work / "references")
        before = store.manifest_digest(ref)
        with signing_env((work / KEY_FILE).read_text(encoding="utf-8")):
            run = run_candidate_stage(contract, reference=ref, root=work / "evidence",
                                      quiet=True)
            report = compare_run(run)
        (work / CHAIN_FILE).write_text(json.dumps({
            "contract": contract.name, "run_id": run.name,
            "reference_digest_before_candidate": before,
            "verdicts": dict(report.verdicts), "passed": report.passed,
            "summary": report.summary}, default=str), encoding="utf-8")

    root = build_once(factory, f"tiny-chain-{_tiny_digest12()}", build)
    return TinyChain(root=root, doc=json.loads((root / CHAIN_FILE).read_text("utf-8")))


def default_reference(factory: pytest.TempPathFactory) -> Path:
    """The shared sealed reference of the committed default contract
    (``references/<name>-<digest12>/`` under the returned tree's ``references/``), built
    by the real reference stage with its vLLM rollout. Copy it before use."""
    contract = load_contract(default_contract_path())

    def build(work: Path) -> None:
        from qualify.reference.stage import run_reference_stage

        run_reference_stage(contract, root=work / "references", quiet=True)

    return build_once(factory, f"default-reference-{contract.digest12}", build)


GATE_SUMMARY_BEFORE = "earlier step\n"
"""What :func:`committed_gate`'s ``summary.md`` held before the gate appended to it."""


def committed_gate(factory: pytest.TempPathFactory) -> Path:
    """The shared gate of the committed tiny-qwen3 runs (read-only): ``evidence/`` (a copy
    of the runs git tracks, :func:`committed.committed_evidence_copy`), ``gate.json``,
    ``gate.xml``, ``summary.md`` (:data:`GATE_SUMMARY_BEFORE`, then the gate's summary),
    ``out.txt`` (stdout and stderr) and ``rc.txt`` (the exit code) of
    ``qualify gate evidence --contract contracts/tiny-qwen3.toml``."""
    from committed import ROOT, committed_evidence_copy

    def build(work: Path) -> None:
        import io
        from contextlib import redirect_stderr, redirect_stdout

        from qualify.cli.main import main

        evidence = committed_evidence_copy(work / "evidence")
        (work / "summary.md").write_text(GATE_SUMMARY_BEFORE, encoding="utf-8")
        buf = io.StringIO()
        with redirect_stdout(buf), redirect_stderr(buf):
            rc = main(["gate", str(evidence), "--contract",
                       str(ROOT / "contracts" / "tiny-qwen3.toml"), "--junit-xml",
                       str(work / "gate.xml"), "--summary", str(work / "summary.md"),
                       "--json", str(work / "gate.json")])
        (work / "out.txt").write_text(buf.getvalue(), encoding="utf-8")
        (work / "rc.txt").write_text(str(rc), encoding="utf-8")

    return build_once(factory, "committed-gate", build)


def assert_sealed_bitwise_equal(plain: Path, other: Path) -> list[str]:
    """Assert two reference directories seal the same bytes; return the tensor files.

    The same ``*.safetensors`` files with the same tensors byte for byte (dtype and shape
    included), and ``bounds.json``, ``control_errors.json`` and ``branches.json`` byte for
    byte. Signatures, timings and the environment document are not compared.
    """
    from qualify.evidence.tensors import load_tensors
    from qualify.layout import BOUNDS_FILE, BRANCHES_FILE, CONTROL_ERRORS_FILE

    files = sorted(str(p.relative_to(plain)) for p in plain.rglob("*.safetensors"))
    assert files == sorted(str(p.relative_to(other)) for p in other.rglob("*.safetensors"))
    for f in files:
        a, b = load_tensors(plain / f), load_tensors(other / f)
        assert a.keys() == b.keys(), f
        for k in a:
            assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), (f, k)
            assert a[k].tobytes() == b[k].tobytes(), (f, k)
    for doc in (BOUNDS_FILE, CONTROL_ERRORS_FILE, BRANCHES_FILE):
        assert (plain / doc).read_bytes() == (other / doc).read_bytes(), doc
    return files
