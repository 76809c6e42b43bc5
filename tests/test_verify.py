"""Tests of qualify.evidence.verify on real signed evidence, and the tamper set.

The evidence world (built once per session by :func:`signed_world`, then copied per test
with :func:`shutil.copytree` and made writable with :func:`qualify.evidence.store.make_writable`):

- ``contracts/gate-tiny.toml``: the committed tiny-qwen3 contract, renamed, FP32 only,
  with a CUDA-only engine (``deepspeed``) in the matrix (4 torch_tp cells, 4 deepspeed
  cells);
- ``keys/``: two trusted Ed25519 public keys (a third key stays untrusted);
- ``references/gate-tiny-<digest12>/``: a reference written through the store API (rollout,
  HF FP32 tensors, control errors that put each bound at ``BOUND`` and ``bounds.json`` from
  them by the contract's rule, so that verification recomputes them), sealed with
  :func:`qualify.evidence.store.seal` and signed;
- ``evidence/gate-tiny/run-1-old``, ``run-2-good``, ``run-3-fail``: candidate runs with
  sealed per-cell attempts (synthetic tensors: B = 3, R = 4, an actor and a critic of two
  parameters, two rounds), deepspeed cells ``NOT_RUN`` (no CUDA), compared with the real
  :func:`qualify.compare.compare_run`, sealed (``kind="candidate-run"``) and signed.
  ``run-3-fail`` has a logprob of ``torch_tp-fp32-actor-tp2`` off by 0.1 (bound 1e-3).
  The contract sets no ``matrix.required_cells``, so every matrix cell is required: the
  deepspeed cells that did not run keep every report from passing on its own (each cell
  that ran in ``run-2-good`` passes); only the gate's ``--allow-not-run`` policy excuses
  them (test_gate.py).

The tamper set (:data:`MUTATIONS`) names each mutation, the directory it targets and the
verification step that must catch it; every one is checked through ``verify``, ``gate``
and ``audit`` (the last two in test_gate.py / test_audit.py).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import json
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file
from tiny_contracts import torch_tp_only_text

from qualify import jsonio
from qualify.bounds import (
    bf16_quanta,
    bounds_document,
    compute_bounds,
    measure_controls,
    scalar_resolutions,
)
from qualify.cli import main as cli
from qualify.cli.evidence import register
from qualify.compare.stage import compare_run
from qualify.contract import Contract, load_contract
from qualify.errors import EvidenceIntegrityError, ExitCode, QualifyError
from qualify.evidence import sign as signing
from qualify.evidence import store
from qualify.evidence.verify import (
    ContractDigestError,
    EnvelopeFormatError,
    ReferenceBindingError,
    SealOrderError,
    SignatureVerificationError,
    StatementTypeError,
    SubjectDigestError,
    UnlistedFileError,
    VerdictMismatchError,
    VerificationResult,
    find_evidence,
    verify,
)
from qualify.protocol import ROLLOUT_KEYS
from qualify.reference.controls import control_errors_document, control_settings
from qualify.statistics import FAMILY_STATISTIC, group_tensors

CONTRACT = "gate-tiny"
B, R = 3, 4
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=np.int64)
PARAMS = {"model.w": (4, 3), "model.b": (3,)}
BOUND = {"logprobs": 1e-3, "entropy": 1e-3, "values": 1e-3, "rewards": 1e-3, "losses": 1e-4,
         "grad_norm": 1e-4, "clip_coef": 1e-4, "grads": 1e-2, "exp_avg": 1e-2,
         "exp_avg_sq": 1e-2, "updates": 1e-2}
FP32 = "torch.float32"
FAIL_CELL = "torch_tp-fp32-actor-tp2"
TENSOR_CELL = "torch_tp-fp32-actor-tp1"
CUDA_ONLY = "deepspeed"


# --------------------------------------------------------------------------- the world


def write_contract(directory: Path) -> Path:
    """The committed tiny contract (torch_tp only, HF sampler), renamed, FP32 only, with a
    second engine whose cells the tests record as NOT_RUN ("needs CUDA")."""
    text = torch_tp_only_text()
    for old, new in (('name = "tiny-qwen3"', f'name = "{CONTRACT}"'),
                     ('engines = ["torch_tp"]', f'engines = ["torch_tp", "{CUDA_ONLY}"]'),
                     ('precisions = ["fp32", "bf16"]', 'precisions = ["fp32"]')):
        assert old in text, old
        text = text.replace(old, new)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{CONTRACT}.toml"
    path.write_text(text)
    return path


def new_key(name: str) -> signing.SigningKey:
    key = Ed25519PrivateKey.generate()
    return signing.SigningKey(private_key=key, keyid=signing.key_id(key.public_key()),
                              source=f"test key {name}")


def hf_tensors(seed: int) -> dict[str, np.ndarray]:
    """HF reference tensors of both roles, two rounds (masked tokens 0, as written)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for r in (1, 2):
        out[f"round{r}/actor/logprobs"] = (-rng.uniform(0.5, 3.0, (B, R)) * MASK).astype(
            np.float32)
        out[f"round{r}/actor/entropy"] = (rng.uniform(1, 2, (B, R)) * MASK).astype(np.float32)
        out[f"round{r}/critic/values"] = (rng.normal(size=(B, R)) * MASK).astype(np.float32)
        for term in ("policy", "kl", "entropy", "total"):
            out[f"round{r}/actor/loss/{term}"] = np.array(rng.normal(), dtype=np.float32)
        for term in ("value", "total"):
            out[f"round{r}/critic/loss/{term}"] = np.array(rng.normal(), dtype=np.float32)
        for role in ("actor", "critic"):
            out[f"round{r}/{role}/grad_norm"] = np.array(rng.uniform(1, 2), dtype=np.float32)
            out[f"round{r}/{role}/clip_coef"] = np.array(rng.uniform(0.2, 1), dtype=np.float32)
            for metric in ("grads", "exp_avg", "exp_avg_sq", "updates"):
                for name, shape in PARAMS.items():
                    out[f"round{r}/{role}/{metric}/{name}"] = rng.normal(size=shape).astype(
                        np.float32)
    out["round1/reward/rewards"] = rng.normal(size=(B,)).astype(np.float32)
    return out


def role_outputs(hf: Mapping[str, np.ndarray], role: str) -> dict[str, np.ndarray]:
    """A perfect candidate of ``role``: the HF tensors plus an identical padding rerun."""
    out = {k: v.copy() for k, v in hf.items() if k.split("/")[1] == role}
    main = "logprobs" if role == "actor" else "values"
    out[f"round1/{role}/{main}_padded"] = out[f"round1/{role}/{main}"].copy()
    return out


def good_meta(role: str, tp: int) -> dict[str, Any]:
    return {"dtypes": {"master_weights": FP32, "grads": FP32,
                       "optimizer_state": {"exp_avg": FP32, "exp_avg_sq": FP32},
                       "grad_reduction": {"engine.reduce": FP32},
                       "grad_accumulation": {"engine.accumulate": FP32},
                       "compute": [FP32]},
            "replica_consistency": {"all_equal": True, "params": {
                "model.w": {"equal": True, "max_abs_diff": 0.0}}},
            "versions": {"torch": "2.x"}, "timings": {"total_s": 1.0}, "role": role, "tp": tp}


def save_tensors(path: Path, tensors: Mapping[str, np.ndarray]) -> None:
    """safetensors directly: ``store.save_tensors`` turns 0-d numpy arrays into shape (1,)
    (``np.ascontiguousarray``), which the comparator then rejects."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(dict(tensors), str(path))


def control_runs(contract: Contract, hf: Mapping[str, np.ndarray],
                 ) -> dict[str, dict[str, np.ndarray]]:
    """Control runs whose measured errors put each bound at :data:`BOUND` (``k * e +
    floor``, within rounding): every FP32 control of the contract is the HF run moved by
    ``e = (BOUND - floor) / k`` in its family's statistic (every valid token and loss term
    by ``e``, a scalar by ``e``, a per-parameter tensor scaled by ``1 + e``, so its relative
    L2 error is ``e``), in FP64 so that the move is not rounded to FP32."""
    b = contract.bounds
    out: dict[str, np.ndarray] = {}
    for name, x in hf.items():
        (key,) = group_tensors({name: x})
        e = (BOUND[key.family] - float(b.floors["fp32"][key.family])) / b.k
        x64 = x.astype(np.float64)
        out[name] = np.asarray(x64 * (1.0 + e) if FAMILY_STATISTIC[key.family] == "max_rel_l2"
                               else x64 + e * MASK if x.shape == MASK.shape else x64 + e)
    return {n: dict(out) for n in control_settings(contract, "fp32")}


def make_reference(root: Path, contract: Contract, key: signing.SigningKey,
                   hf: Mapping[str, np.ndarray]) -> Path:
    """A sealed, signed reference directory written through the store API."""
    ref = store.claim_dir(root / "references" / f"{CONTRACT}-{contract.digest12}",
                          kind="reference")
    assert contract.path is not None
    store.atomic_write_text(ref / "contract.toml", contract.path.read_text())
    store.atomic_write_json(ref / "contract.json", contract.to_dict())
    rollout: dict[str, np.ndarray] = {k: np.zeros((B, R), dtype=np.int64) for k in ROLLOUT_KEYS}
    rollout["response_mask"] = MASK
    rollout["behavior_logprobs"] = (hf["round1/actor/logprobs"] - 0.05 * MASK).astype(
        np.float32)
    rollout["eos_terminated"] = np.ones(B, dtype=np.int64)
    rollout["group_index"] = np.arange(B, dtype=np.int64)
    save_tensors(ref / "rollout.safetensors", rollout)
    store.atomic_write_json(ref / "rollout.json", {"logprobs_mode": "processed"})
    save_tensors(ref / "reference" / "hf-fp32.safetensors", hf)
    controls = control_runs(contract, hf)
    for name, tensors in controls.items():
        save_tensors(ref / "controls" / f"{name}-fp32.safetensors", tensors)
    save_tensors(ref / "train_inputs.safetensors",
                 {"advantages": np.zeros((B, R), np.float32),
                  "returns": np.zeros((B, R), np.float32)})
    store.atomic_write_json(ref / "branches.json", {"schema_version": 1, "precisions": {}})
    errors = measure_controls({"fp32": dict(hf)}, {"fp32": controls}, MASK)
    bounds = compute_bounds(contract, errors, scalar_resolutions({"fp32": dict(hf)}),
                            {"fp32": {}}, bf16_quanta({"fp32": dict(hf)}))
    store.atomic_write_json(ref / "control_errors.json", control_errors_document(errors))
    store.atomic_write_json(ref / "bounds.json", bounds_document(contract, bounds),
                            schema="bounds")
    store.atomic_write_json(ref / "reference.json", {
        "schema_version": 1, "contract": contract.name, "contract_digest": contract.digest,
        "created": store.utc_now_iso(), "lanes": ["fp32"], "update_meta": {"hf-fp32": {}}})
    signing.seal_and_sign(ref, kind="reference", key=key)
    return ref


def make_run(root: Path, contract: Contract, ref: Path, key: signing.SigningKey,
             hf: Mapping[str, np.ndarray], run_id: str, *,
             fail_cell: str | None = None, crashed_attempt: str | None = None) -> Path:
    """A compared, sealed and signed candidate run (deepspeed cells NOT_RUN: no CUDA).

    ``crashed_attempt``: that cell first gets a failed ``attempt-1`` (kept, as the store
    keeps every attempt), its outputs are in ``attempt-2``.
    """
    run = root / "evidence" / CONTRACT / run_id
    run.mkdir(parents=True)
    cells: dict[str, Any] = {}
    for c in contract.matrix.cells():
        entry = {"engine": c.engine, "precision": c.precision, "options": dict(c.options),
                 "role": c.role, "tp": c.tp, "status": "NOT_RUN",
                 "reason": "CUDA is not available on this machine", "attempt": None}
        if c.engine != CUDA_ONLY:
            if c.cell_id == crashed_attempt:
                crashed = store.new_attempt(run / "cells" / c.cell_id)
                store.atomic_write_text(crashed / "logs" / "rank1.log", "gloo timeout\n")
                store.atomic_write_json(crashed / "result.json", {
                    "status": "ERROR", "reason": "collective timed out", "wall_s": 120.0,
                    "returncode": 1})
                store.seal(crashed, kind="cell-attempt")
            attempt = store.new_attempt(run / "cells" / c.cell_id)
            out = role_outputs(hf, c.role)
            if c.cell_id == fail_cell:
                out["round1/actor/logprobs"] += (0.1 * MASK).astype(np.float32)
                out["round1/actor/logprobs_padded"] += (0.1 * MASK).astype(np.float32)
            save_tensors(attempt / "outputs.safetensors", out)
            store.atomic_write_json(attempt / "outputs.json", good_meta(c.role, c.tp))
            store.atomic_write_text(attempt / "logs" / "rank0.log", f"{c.cell_id} ok\n")
            store.atomic_write_json(attempt / "result.json", {
                "status": "COMPLETE", "reason": None, "wall_s": 0.1, "returncode": 0})
            store.seal(attempt, kind="cell-attempt")
            entry.update(status="COMPLETE", reason=None,
                         attempt=attempt.relative_to(run).as_posix())
        cells[c.cell_id] = entry
    rel_ref = Path("..", "..", "..", "references", ref.name).as_posix()
    store.atomic_write_json(run / "run.json", {
        "schema_version": 1, "contract": contract.name, "contract_digest": contract.digest,
        "reference": {"path": rel_ref, "manifest_digest": store.manifest_digest(ref),
                      "sealed": store.read_manifest(ref)["created"]},
        "run_id": run_id, "started": store.utc_now_iso(), "faults": [], "cells": cells,
        "finished": store.utc_now_iso()})
    compare_run(run, reference_dir=ref, write=True)
    signing.seal_and_sign(run, kind="candidate-run", key=key)
    return run


@dataclasses.dataclass(frozen=True)
class World:
    """Paths of one copy of the evidence world, and the keys."""

    root: Path
    key: signing.SigningKey
    other_trusted: signing.SigningKey
    untrusted: signing.SigningKey

    @property
    def contract(self) -> Path:
        return self.root / "contracts" / f"{CONTRACT}.toml"

    @property
    def contracts(self) -> Path:
        return self.root / "contracts"

    @property
    def keys(self) -> Path:
        return self.root / "keys"

    @property
    def reference(self) -> Path:
        (ref,) = (self.root / "references").iterdir()
        return ref

    def run(self, name: str) -> Path:
        return self.root / "evidence" / CONTRACT / name

    @property
    def good(self) -> Path:
        return self.run("run-2-good")

    @property
    def failing(self) -> Path:
        return self.run("run-3-fail")

    @property
    def old(self) -> Path:
        return self.run("run-1-old")

    def copy(self, dest: Path) -> World:
        shutil.copytree(self.root, dest, symlinks=True)
        store.make_writable(dest)
        return dataclasses.replace(self, root=dest)

    def verify(self, path: Path, **kw: Any) -> VerificationResult:
        return verify(path, trusted_keys_dir=self.keys, contracts_dir=self.contracts, **kw)


_WORLD: dict[str, World] = {}


def build_world(root: Path) -> World:
    key, other, untrusted = new_key("trusted"), new_key("trusted-2"), new_key("untrusted")
    for name, k in (("trusted", key), ("trusted-2", other)):
        (root / "keys").mkdir(parents=True, exist_ok=True)
        (root / "keys" / f"{name}-{k.keyid[:16]}.pub").write_bytes(k.public_pem())
    contract = load_contract(write_contract(root / "contracts"))
    hf = hf_tensors(1)
    ref = make_reference(root, contract, key, hf)
    for run_id, fail, crash in (("run-1-old", None, TENSOR_CELL), ("run-2-good", None, None),
                                ("run-3-fail", FAIL_CELL, None)):
        time.sleep(0.002)  # distinct, ordered start times
        make_run(root, contract, ref, key, hf, run_id, fail_cell=fail, crashed_attempt=crash)
    return World(root=root, key=key, other_trusted=other, untrusted=untrusted)


@pytest.fixture(scope="session")
def signed_world(tmp_path_factory: pytest.TempPathFactory) -> World:
    """The read-only world, built once per session (shared by test_gate / test_audit)."""
    if "world" not in _WORLD:
        _WORLD["world"] = build_world(tmp_path_factory.mktemp("signed-world"))
    return _WORLD["world"]


@pytest.fixture
def world(signed_world: World, tmp_path: Path) -> Iterator[World]:
    """A writable copy of the world for one test."""
    w = signed_world.copy(tmp_path / "world")
    yield w
    store.make_writable(tmp_path)


# --------------------------------------------------------------------------- CLI helper


def run_cli(argv: Sequence[str]) -> tuple[int, str]:
    """Run ``qualify ARGV`` in-process; the exit code and stdout.

    Uses :func:`qualify.cli.main` once it registers the evidence subcommands, else a parser
    holding only :func:`qualify.cli.evidence.register`'s subcommands with ``main``'s error
    handling.
    """
    buf = io.StringIO()
    top = cli.build_parser()
    subs = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    with redirect_stdout(buf):
        if subs and "gate" in subs[0].choices:
            return cli.main(list(argv)), buf.getvalue()
        parser = argparse.ArgumentParser(prog="qualify")
        register(parser.add_subparsers(dest="command", required=True))
        try:
            args = parser.parse_args(list(argv))
        except SystemExit as exc:  # argparse: usage error
            return int(exc.code or 0), buf.getvalue()
        try:
            code = int(args.func(args))
        except QualifyError as exc:
            code = int(exc.exit_code)
    return code, buf.getvalue()


# --------------------------------------------------------------------------- mutations


def flip_byte(path: Path, offset: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def load_envelope(d: Path) -> dict[str, Any]:
    return json.loads((d / signing.ATTESTATION_FILE).read_text())


def save_envelope(d: Path, env: Mapping[str, Any]) -> None:
    (d / signing.ATTESTATION_FILE).write_text(json.dumps(env))


def resign_statement(d: Path, edit: Callable[[dict[str, Any]], None],
                     key: signing.SigningKey, *, payload_type: str = signing.PAYLOAD_TYPE,
                     ) -> None:
    """Edit the statement and sign it again with ``key`` (an insider with a key)."""
    stmt = json.loads(signing.read_envelope(d).payload)
    edit(stmt)
    payload = signing.statement_bytes(stmt)
    sig = key.sign(signing.pae(payload_type, payload))
    env = signing.Envelope(payload=payload, payload_type=payload_type,
                           signatures=(signing.Signature(keyid=key.keyid, sig=sig),))
    (d / signing.ATTESTATION_FILE).write_bytes(env.to_json())


def reseal_and_resign(d: Path, key: signing.SigningKey, kind: str) -> None:
    """Seal and sign again after editing (an insider with a trusted key)."""
    store.make_writable(d)
    (d / store.MANIFEST_FILE).unlink()
    (d / signing.ATTESTATION_FILE).unlink()
    signing.seal_and_sign(d, kind=kind, key=key)


def edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _attempt(w: World, run: Path, cell: str) -> Path:
    return run / "cells" / cell / "attempt-1"


def m_tensor_byte(w: World) -> Path:
    flip_byte(_attempt(w, w.good, TENSOR_CELL) / "outputs.safetensors")
    return w.good


def m_report_byte(w: World) -> Path:
    flip_byte(w.good / "report.json", 40)
    return w.good


def m_bounds_byte(w: World) -> Path:
    flip_byte(w.reference / "bounds.json", 60)
    return w.good


def m_rollout_byte(w: World) -> Path:
    flip_byte(w.reference / "rollout.safetensors")
    return w.good


def m_file_deleted(w: World) -> Path:
    (_attempt(w, w.good, TENSOR_CELL) / "outputs.json").unlink()
    return w.good


def m_file_renamed(w: World) -> Path:
    (w.good / "report.md").rename(w.good / "REPORT.md")
    return w.good


def m_file_added(w: World) -> Path:
    (w.good / "notes.txt").write_text("looks fine to me\n")
    return w.good


def m_file_added_in_attempt(w: World) -> Path:
    (_attempt(w, w.good, TENSOR_CELL) / "extra.safetensors").write_bytes(b"\0" * 16)
    return w.good


def m_nested_attestation(w: World) -> Path:
    (_attempt(w, w.good, TENSOR_CELL) / "smuggled.dsse.json").write_text("{}")
    return w.good


def m_incomplete_marker(w: World) -> Path:
    (w.good / store.INCOMPLETE_FILE).write_text("{}")
    return w.good


def m_manifest_deleted(w: World) -> Path:
    (w.good / store.MANIFEST_FILE).unlink()
    return w.good


def m_attempts_swapped(w: World) -> Path:
    a = w.good / "cells" / "torch_tp-fp32-actor-tp1" / "attempt-1"
    b = w.good / "cells" / "torch_tp-fp32-critic-tp1" / "attempt-1"
    tmp = w.good / "cells" / "swap"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    return w.good


def m_old_attestation_replayed(w: World) -> Path:
    (w.good / signing.ATTESTATION_FILE).unlink()
    shutil.copyfile(w.old / signing.ATTESTATION_FILE, w.good / signing.ATTESTATION_FILE)
    return w.good


def m_bounds_regenerated(w: World) -> Path:
    def loosen(doc: dict[str, Any]) -> None:
        for b in doc["bounds"]:
            b["bound"] *= 100
    edit_json(w.reference / "bounds.json", loosen)
    reseal_and_resign(w.reference, w.key, "reference")
    return w.good


def m_contract_edited(w: World) -> Path:
    text = w.contract.read_text()
    w.contract.write_text(text.replace("clip_ratio = 0.2", "clip_ratio = 0.3"))
    return w.good


def m_untrusted_signature(w: World) -> Path:
    resign_statement(w.good, lambda s: None, w.untrusted)
    return w.good


def m_wrong_predicate_type(w: World) -> Path:
    resign_statement(w.good, lambda s: s.update(predicateType=signing.TEST_RESULT_PREDICATE_TYPE),
                     w.key)
    return w.good


def m_wrong_statement_type(w: World) -> Path:
    resign_statement(w.good, lambda s: s.update(_type="https://in-toto.io/Statement/v0.1"),
                     w.key)
    return w.good


def m_wrong_payload_type(w: World) -> Path:
    resign_statement(w.good, lambda s: None, w.key, payload_type="application/json")
    return w.good


def m_signature_missing(w: World) -> Path:
    env = load_envelope(w.good)
    env["signatures"] = []
    save_envelope(w.good, env)
    return w.good


def m_signature_duplicated(w: World) -> Path:
    env = load_envelope(w.good)
    env["signatures"] = env["signatures"] * 2
    save_envelope(w.good, env)
    return w.good


def m_signature_corrupted(w: World) -> Path:
    env = load_envelope(w.good)
    sig = bytearray(base64.b64decode(env["signatures"][0]["sig"]))
    sig[5] ^= 0x40
    env["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
    save_envelope(w.good, env)
    return w.good


def m_payload_edited(w: World) -> Path:
    env = load_envelope(w.good)
    stmt = json.loads(base64.b64decode(env["payload"]))
    stmt["predicate"]["run"]["runId"] = "forged"
    env["payload"] = base64.b64encode(signing.statement_bytes(stmt)).decode()
    save_envelope(w.good, env)
    return w.good


def m_keyid_swapped(w: World) -> Path:
    env = load_envelope(w.good)
    env["signatures"][0]["keyid"] = w.other_trusted.keyid
    save_envelope(w.good, env)
    return w.good


def m_attestation_deleted(w: World) -> Path:
    (w.good / signing.ATTESTATION_FILE).unlink()
    return w.good


def m_envelope_not_json(w: World) -> Path:
    path = w.good / signing.ATTESTATION_FILE
    path.write_bytes(path.read_bytes()[:-40])
    return w.good


def m_envelope_extra_field(w: World) -> Path:
    env = load_envelope(w.good)
    env["note"] = "trust me"
    save_envelope(w.good, env)
    return w.good


def m_verdict_pass_to_fail(w: World) -> Path:
    def flip(doc: dict[str, Any]) -> None:
        for c in doc["cells"]:
            if c["cell"] == TENSOR_CELL:
                c["verdict"] = "FAIL"
        doc["passed"] = False
    edit_json(w.good / "report.json", flip)
    reseal_and_resign(w.good, w.key, "candidate-run")
    return w.good


def m_verdict_fail_to_pass(w: World) -> Path:
    def flip(doc: dict[str, Any]) -> None:
        for c in doc["cells"]:
            if c["cell"] == FAIL_CELL:
                c["verdict"], c["reason"] = "PASS", None
        for r in doc["rows"]:
            if r["verdict"] == "FAIL":
                r["verdict"] = "PASS"
        doc["passed"] = True
    edit_json(w.failing / "report.json", flip)
    reseal_and_resign(w.failing, w.key, "candidate-run")
    return w.failing


def m_run_before_reference(w: World) -> Path:
    edit_json(w.good / "run.json", lambda d: d.update(started="2000-01-01T00:00:00.000000Z"))
    reseal_and_resign(w.good, w.key, "candidate-run")
    return w.good


def m_reference_reattested(w: World) -> Path:
    store.make_writable(w.reference)
    (w.reference / signing.ATTESTATION_FILE).unlink()
    signing.sign_directory(w.reference, w.key)
    return w.good


def m_reference_statement_replaced(w: World) -> Path:
    resign_statement(w.reference,
                     lambda s: s["predicate"].update(boundsDigest="0" * 64), w.key)
    return w.good


def m_attestation_oversized(w: World) -> Path:
    # Trailing whitespace keeps it valid JSON and the attestation is in no manifest: only
    # the size limit, checked before anything is parsed, catches it.
    with (w.good / signing.ATTESTATION_FILE).open("ab") as f:
        f.write(b" " * jsonio.MAX_LISTING_BYTES)
    return w.good


def m_run_json_dev_zero(w: World) -> Path:
    (w.good / "run.json").unlink()
    (w.good / "run.json").symlink_to("/dev/zero")
    return w.good


def _resign_manifest(d: Path, data: bytes, key: signing.SigningKey) -> None:
    """Write ``data`` as MANIFEST.json and sign a statement naming its digest (an insider)."""
    (d / store.MANIFEST_FILE).write_bytes(data)
    digest = store.sha256_file(d / store.MANIFEST_FILE)

    def edit(stmt: dict[str, Any]) -> None:
        stmt["predicate"]["manifestDigest"] = digest
        for s in stmt["subject"]:
            if s["name"] == store.MANIFEST_FILE:
                s["digest"]["sha256"] = digest
    resign_statement(d, edit, key)


def m_manifest_duplicate_key(w: World) -> Path:
    # A reader keeping the last "kind" sees the true one; a reader keeping the first sees
    # a reference: two readers, two manifests.
    data = (w.good / store.MANIFEST_FILE).read_bytes()
    assert data.startswith(b"{\n")
    _resign_manifest(w.good, b'{\n  "kind": "reference",\n' + data[2:], w.key)
    return w.good


def m_statement_duplicate_key(w: World) -> Path:
    payload = signing.statement_bytes(json.loads(signing.read_envelope(w.good).payload))
    payload = b'{"predicateType":"https://example.com/other",' + payload[1:]
    sig = w.key.sign(signing.pae(signing.PAYLOAD_TYPE, payload))
    env = signing.Envelope(payload=payload, payload_type=signing.PAYLOAD_TYPE,
                           signatures=(signing.Signature(keyid=w.key.keyid, sig=sig),))
    (w.good / signing.ATTESTATION_FILE).write_bytes(env.to_json())
    return w.good


def m_extra_attestation(w: World) -> Path:
    # a valid copy of the run's own attestation: nothing verifies a second one
    shutil.copyfile(w.good / signing.ATTESTATION_FILE, w.good / "x.dsse.json")
    return w.good


def _measured_row(doc: dict[str, Any], *, positive: bool = False) -> dict[str, Any]:
    """The first row with a numeric margin (``positive``: above 0)."""
    return next(r for r in doc["rows"] if isinstance(r["margin"], float)
                and (r["margin"] > 0 or not positive))


def m_margin_rewritten(w: World) -> Path:
    def rewrite(doc: dict[str, Any]) -> None:  # the verdict (PASS) still agrees
        r = _measured_row(doc)
        assert r["verdict"] == "PASS"
        r["margin"] = r["margin"] / 10 if r["margin"] else 0.5
    edit_json(w.good / "report.json", rewrite)
    reseal_and_resign(w.good, w.key, "candidate-run")
    return w.good


def m_error_and_margin_rewritten(w: World) -> Path:
    """A consistent lie (error / bound = margin) on a row with a real error: a FAIL row of
    the failing run (synthetic world; still FAIL at a tenth), else of the good run."""
    run = w.failing if w.failing.is_dir() else w.good

    def shrink(doc: dict[str, Any]) -> None:
        r = _measured_row(doc, positive=True)
        assert r["verdict"] == "PASS" or r["margin"] > 10  # the verdict stays
        r["error"], r["margin"] = r["error"] / 10, r["margin"] / 10
    edit_json(run / "report.json", shrink)
    reseal_and_resign(run, w.key, "candidate-run")
    return run


def m_gate_decision_flipped(w: World) -> Path:
    """The sealed headline forged: the failing run's gate decision said to PASS."""
    def flip(doc: dict[str, Any]) -> None:
        gate = doc["gate"]
        assert (gate["result"], gate["exit_code"]) == ("FAIL", 1)
        gate.update(result="PASS", exit_code=0)
    edit_json(w.failing / "report.json", flip)
    reseal_and_resign(w.failing, w.key, "candidate-run")
    return w.failing


def m_report_md_rewritten(w: World) -> Path:
    path = w.good / "report.md"
    text = path.read_text()
    assert "## Cells\n" in text
    path.write_text(text.replace("## Cells\n", "## Cells (reviewed: all fine)\n", 1))
    reseal_and_resign(w.good, w.key, "candidate-run")
    return w.good


@dataclasses.dataclass(frozen=True)
class Mutation:
    """A named tamper: what it does, the step that must catch it and its error type."""

    name: str
    apply: Callable[[World], Path]
    step: int
    error: type[EvidenceIntegrityError]


MUTATIONS: tuple[Mutation, ...] = (
    Mutation("byte flipped in a tensor file", m_tensor_byte, 4, SubjectDigestError),
    Mutation("byte flipped in report.json", m_report_byte, 4, SubjectDigestError),
    Mutation("byte flipped in the reference's bounds.json", m_bounds_byte, 7,
             ReferenceBindingError),
    Mutation("byte flipped in the reference's rollout", m_rollout_byte, 7,
             ReferenceBindingError),
    Mutation("file deleted", m_file_deleted, 4, SubjectDigestError),
    Mutation("file renamed", m_file_renamed, 4, SubjectDigestError),
    Mutation("file added", m_file_added, 5, UnlistedFileError),
    Mutation("file added inside a sealed attempt", m_file_added_in_attempt, 5,
             UnlistedFileError),
    Mutation("nested *.dsse.json smuggled in", m_nested_attestation, 5, UnlistedFileError),
    Mutation("INCOMPLETE marker added", m_incomplete_marker, 5, UnlistedFileError),
    Mutation("MANIFEST.json deleted", m_manifest_deleted, 4, SubjectDigestError),
    Mutation("cell attempts swapped", m_attempts_swapped, 4, SubjectDigestError),
    Mutation("older run's attestation replayed", m_old_attestation_replayed, 4,
             SubjectDigestError),
    Mutation("bounds regenerated after the run (re-sealed, re-signed)", m_bounds_regenerated,
             7, ReferenceBindingError),
    Mutation("contract edited after sealing", m_contract_edited, 6, ContractDigestError),
    Mutation("signature by an untrusted key", m_untrusted_signature, 2,
             SignatureVerificationError),
    Mutation("wrong predicate type (re-signed)", m_wrong_predicate_type, 3,
             StatementTypeError),
    Mutation("wrong statement _type (re-signed)", m_wrong_statement_type, 3,
             StatementTypeError),
    Mutation("wrong payloadType (re-signed)", m_wrong_payload_type, 3, StatementTypeError),
    Mutation("signature missing", m_signature_missing, 2, SignatureVerificationError),
    Mutation("signature duplicated", m_signature_duplicated, 2, SignatureVerificationError),
    Mutation("signature corrupted", m_signature_corrupted, 2, SignatureVerificationError),
    Mutation("payload edited, signature kept", m_payload_edited, 2,
             SignatureVerificationError),
    Mutation("keyid swapped to another trusted key", m_keyid_swapped, 2,
             SignatureVerificationError),
    Mutation("attestation deleted", m_attestation_deleted, 1, EnvelopeFormatError),
    Mutation("envelope truncated (not JSON)", m_envelope_not_json, 1, EnvelopeFormatError),
    Mutation("envelope with an unknown field", m_envelope_extra_field, 1,
             EnvelopeFormatError),
    Mutation("verdict PASS->FAIL in report.json (re-sealed, re-signed)",
             m_verdict_pass_to_fail, 9, VerdictMismatchError),
    Mutation("verdict FAIL->PASS in report.json (re-sealed, re-signed)",
             m_verdict_fail_to_pass, 9, VerdictMismatchError),
    Mutation("run started before the reference was sealed (re-signed)",
             m_run_before_reference, 8, SealOrderError),
    Mutation("reference re-attested after the run", m_reference_reattested, 8,
             SealOrderError),
    Mutation("reference statement edited and re-signed", m_reference_statement_replaced, 7,
             ReferenceBindingError),
    Mutation("attestation padded past its size limit", m_attestation_oversized, 1,
             EnvelopeFormatError),
    Mutation("run.json replaced by a symlink to /dev/zero", m_run_json_dev_zero, 4,
             SubjectDigestError),
    Mutation("duplicate key in MANIFEST.json (re-signed)", m_manifest_duplicate_key, 4,
             SubjectDigestError),
    Mutation("duplicate key in the statement (re-signed)", m_statement_duplicate_key, 3,
             StatementTypeError),
    Mutation("extra x.dsse.json beside the attestation", m_extra_attestation, 5,
             UnlistedFileError),
    Mutation("margin rewritten in report.json (re-sealed, re-signed)", m_margin_rewritten,
             9, VerdictMismatchError),
    Mutation("error and margin rewritten in report.json (re-sealed, re-signed)",
             m_error_and_margin_rewritten, 9, VerdictMismatchError),
    Mutation("report.md rewritten (re-sealed, re-signed)", m_report_md_rewritten, 9,
             VerdictMismatchError),
    Mutation("sealed gate decision flipped (re-sealed, re-signed)", m_gate_decision_flipped,
             9, VerdictMismatchError),
)
"""The tamper set: each caught by ``verify`` at ``step`` with ``error`` (exit code 3)."""

MUTATION_IDS = [m.name for m in MUTATIONS]
_TAMPERED: dict[str, tuple[World, Path]] = {}


def tampered(signed_world: World, mutation: Mutation,
             factory: pytest.TempPathFactory) -> tuple[World, Path]:
    """A copy of the world with ``mutation`` applied (once per session; used read-only by
    the verify, gate and audit tests) and the directory it targets."""
    if mutation.name not in _TAMPERED:
        w = signed_world.copy(factory.mktemp("tampered") / "world")
        _TAMPERED[mutation.name] = (w, mutation.apply(w))
    return _TAMPERED[mutation.name]


# --------------------------------------------------------------------------- tests


def test_untouched_evidence_verifies(signed_world: World) -> None:
    w = signed_world
    for path in (w.reference, w.old, w.good, w.failing):
        result = w.verify(path)
        assert result, result.summary_lines()
        assert result.exit_code == ExitCode.OK
        assert result.keyids == (w.key.keyid,)
        assert result.first_error is None
        result.raise_for_problems()
    ref = w.verify(w.reference)
    assert ref.kind == "reference"
    assert [s.status for s in ref.steps] == ["passed"] * 6 + ["not-applicable"] + \
        ["passed"] * 2  # 8: sealed before attested; 9: bounds recomputed
    run = w.verify(w.good)
    assert run.kind == "candidate-run"
    assert [s.status for s in run.steps] == ["passed"] * 9
    assert run.reference is not None
    assert run.reference.resolve() == w.reference.resolve()
    assert len(run.verified) == 9


def test_statement_content(signed_world: World) -> None:
    w = signed_world
    stmt = json.loads(signing.read_envelope(w.good).payload)
    assert stmt["_type"] == "https://in-toto.io/Statement/v1"
    assert stmt["predicateType"] == signing.PREDICATE_TYPE
    manifest = store.read_manifest(w.good)
    names = {s["name"]: s["digest"]["sha256"] for s in stmt["subject"]}
    assert set(names) == set(manifest["files"]) | {store.MANIFEST_FILE}
    assert names[store.MANIFEST_FILE] == store.manifest_digest(w.good)
    assert any(n.startswith("cells/") and n.endswith("/MANIFEST.json") for n in names)
    pred = stmt["predicate"]
    contract = load_contract(w.contract)
    assert pred["contract"] == {"name": CONTRACT, "digest": contract.digest}
    assert pred["boundsDigest"] == store.sha256_file(w.reference / "bounds.json")
    assert pred["reference"]["manifestDigest"] == store.manifest_digest(w.reference)
    assert pred["sealed"] == manifest["created"]
    assert set(pred["source"]) == {"commit", "dirty", "branch"}
    assert pred["environment"]["python"]
    # every matrix cell is required: the deepspeed cells NOT_RUN (no CUDA) are no pass
    assert pred["verdicts"]["passed"] is False
    assert sorted(pred["verdicts"]["summary"]["required_not_passed"]) == pred["warnedTests"]
    # in-toto test-result v0.1 fields
    assert pred["result"] == "FAILED"  # not passed, though no cell that ran failed
    assert TENSOR_CELL in pred["passedTests"]
    assert len(pred["passedTests"]) == 4
    assert len(pred["warnedTests"]) == 4
    assert all(c.startswith(CUDA_ONLY) for c in pred["warnedTests"])
    assert pred["failedTests"] == []
    fail = json.loads(signing.read_envelope(w.failing).payload)["predicate"]
    assert fail["result"] == "FAILED"
    assert fail["failedTests"] == [FAIL_CELL]
    env = json.loads((w.good / signing.ATTESTATION_FILE).read_text())
    assert set(env) == {"payload", "payloadType", "signatures"}
    assert env["payloadType"] == "application/vnd.in-toto+json"
    assert env["signatures"][0]["keyid"] == w.key.keyid


def test_pae_matches_the_dsse_spec() -> None:
    # The worked example of the DSSE protocol (protocol.md, "Test vector").
    assert signing.pae("http://example.com/HelloWorld", b"hello world") == (
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world")
    assert signing.pae("", b"") == b"DSSEv1 0  0 "


@pytest.mark.parametrize("mutation", MUTATIONS, ids=MUTATION_IDS)
def test_tamper_is_caught_by_verify(signed_world: World, mutation: Mutation,
                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    world, target = tampered(signed_world, mutation, tmp_path_factory)
    result = world.verify(target)
    assert not result
    assert result.exit_code == ExitCode.INTEGRITY_ERROR
    first = result.failed_steps[0]
    assert first.number == mutation.step, result.summary_lines()
    assert isinstance(first.error, mutation.error)
    assert isinstance(result.first_error, EvidenceIntegrityError)
    assert result.first_error.exit_code == ExitCode.INTEGRITY_ERROR
    with pytest.raises(mutation.error):
        result.raise_for_problems()
    code, out = run_cli(["verify", str(target), "--keys", str(world.keys),
                         "--contracts-dir", str(world.contracts)])
    assert code == ExitCode.INTEGRITY_ERROR
    assert f"[FAIL] {mutation.step}." in out


def test_tamper_set_is_large_and_covers_every_step() -> None:
    assert len(MUTATIONS) >= 20
    assert {m.step for m in MUTATIONS} == set(range(1, 10))
    assert len(set(MUTATION_IDS)) == len(MUTATION_IDS)


def test_unsigned_reference_and_unknown_key_dir(world: World, tmp_path: Path) -> None:
    empty = tmp_path / "no-keys"
    empty.mkdir()
    result = verify(world.good, trusted_keys_dir=empty, contracts_dir=world.contracts)
    assert result.failed_steps[0].number == 2
    assert "no trusted public keys" in result.failed_steps[0].detail


def test_steps_after_the_statement_all_run(world: World) -> None:
    # Two independent problems are both reported (audit lists every problem).
    (world.good / "notes.txt").write_text("x")
    flip_byte(world.good / "report.json", 40)
    result = world.verify(world.good)
    assert [s.number for s in result.failed_steps][:2] == [4, 5]
    assert result.extra_files == ("notes.txt",)
    assert result.steps[8].status == "skipped"


def test_a_run_stripped_of_its_seal_and_signature_is_tampering_not_a_wrong_path(
        world: World, tmp_path: Path) -> None:
    """Removing ``MANIFEST.json``, the attestation and ``run.json`` leaves ``report.json``:
    still a run qualify wrote, so verification fails (exit 3), not "not a run directory"
    (exit 2), which is kept for a folder holding nothing qualify writes at its top."""
    for name in (store.MANIFEST_FILE, signing.ATTESTATION_FILE, "run.json"):
        (world.good / name).unlink()
    assert not (world.good / store.INCOMPLETE_FILE).exists()
    code, out = run_cli(["verify", str(world.good), "--keys", str(world.keys),
                         "--contracts-dir", str(world.contracts)])
    assert code == ExitCode.INTEGRITY_ERROR, out
    assert "[FAIL] 1." in out
    stray = tmp_path / "docs"
    stray.mkdir()
    (stray / "notes.md").write_text("x")
    code, _ = run_cli(["verify", str(stray), "--keys", str(world.keys)])
    assert code == ExitCode.USAGE_ERROR


def test_verify_json_output(world: World, tmp_path: Path) -> None:
    out = tmp_path / "verify.json"
    code, text = run_cli(["verify", str(world.good), "--keys", str(world.keys),
                          "--contracts-dir", str(world.contracts), "--json", str(out)])
    assert code == ExitCode.OK
    assert "VERIFIED" in text
    doc = json.loads(out.read_text())
    assert doc["passed"] is True
    assert [s["status"] for s in doc["steps"]] == ["passed"] * 9


def test_find_evidence_lists_incomplete_directories(world: World) -> None:
    aside = world.root / "evidence" / CONTRACT / "run-9.incomplete-20250101T000000.000000Z"
    aside.mkdir()
    (aside / "run.json").write_text("{}")
    interrupted = store.claim_dir(world.root / "references" / "other-ref", kind="reference")
    found = {e.path.name: e for e in find_evidence(world.root)}
    assert found["run-2-good"].state == "sealed"
    assert found["run-2-good"].contract == CONTRACT
    assert found[aside.name].state == "incomplete"
    assert found[interrupted.name].state == "incomplete"
    assert "INCOMPLETE" in found[interrupted.name].reason
    assert not any("cells" in str(e.path) for e in found.values())


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_any_flipped_bit_of_any_file_is_caught_at_step_4(
        signed_world: World, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject,
) -> None:
    """Invariant: one bit flipped anywhere in any file of a signed run fails step 4."""
    files = sorted(store.read_manifest(signed_world.good)["files"])
    rel = data.draw(st.sampled_from([*files, store.MANIFEST_FILE]), label="file")
    w = signed_world.copy(tmp_path_factory.mktemp("flip") / "world")
    path = w.good / rel
    size = path.stat().st_size
    offset = data.draw(st.integers(0, size - 1), label="offset")
    bit = data.draw(st.integers(0, 7), label="bit")
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 1 << bit
    path.write_bytes(bytes(raw))
    result = w.verify(w.good, recompute=False)
    assert result.failed_steps[0].number == 4
    assert isinstance(result.first_error, SubjectDigestError)


def _detail(result: VerificationResult, step: int) -> str:
    return next(x.detail for x in result.steps if x.number == step)


@pytest.mark.parametrize(("apply", "names"), [
    (m_margin_rewritten, [".margin: report.json"]),
    (m_error_and_margin_rewritten, [".error: report.json", ".margin: report.json"]),
    (m_report_md_rewritten, ["report.md: not the rendering", "## Cells (reviewed"]),
    (m_gate_decision_flipped, [".result: report.json", ".exit_code: report.json"]),
], ids=["margin", "error-and-margin", "report.md", "gate-decision"])
def test_step_9_names_the_rewritten_row_or_file(
        world: World, apply: Callable[[World], Path], names: list[str]) -> None:
    target = apply(world)
    result = world.verify(target)
    assert [x.number for x in result.failed_steps] == [9]
    detail = _detail(result, 9)
    for name in names:
        assert name in detail, detail
    if apply not in (m_report_md_rewritten, m_gate_decision_flipped):
        # the row is named by cell, class and metric; its verdict still agrees
        doc = json.loads((target / "report.json").read_text())
        row = _measured_row(doc, positive=apply is m_error_and_margin_rewritten)
        assert f"{row['cell']} {row['class']} {row['metric']}" in detail
        assert ".verdict" not in detail


def test_step_9_recomputation_is_exact_on_this_machine(signed_world: World) -> None:
    """report.json holds repr floats: recomputed here, every number is bit-identical (the
    1e-9 relative tolerance of step 9 is for another CPU's BLAS)."""
    from qualify.compare.stage import compare_run as recompute
    from qualify.evidence.steps import document_differences

    w = signed_world
    doc = json.loads((w.failing / "report.json").read_text())
    again = recompute(w.failing, reference_dir=w.reference, write=False).to_dict()
    for k in ("created", "run_dir"):
        again[k] = doc[k]
    again["reference"]["path"] = doc["reference"]["path"]
    assert again == doc
    assert document_differences(doc, again) == []
    nudged = json.loads(json.dumps(doc))
    row = _measured_row(nudged, positive=True)
    row["margin"] *= 1 + 1e-12  # float noise: tolerated
    assert document_differences(doc, nudged) == []
    row["margin"] *= 1 + 1e-6  # a rewrite: named
    assert len(document_differences(doc, nudged)) == 1


def test_duplicate_key_in_manifest_is_named(signed_world: World,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    mutation = next(m for m in MUTATIONS if m.apply is m_manifest_duplicate_key)
    w, target = tampered(signed_world, mutation, tmp_path_factory)
    assert "duplicate key 'kind'" in _detail(w.verify(target), 4)
    # without the duplicate-key check the manifest reads as a valid candidate-run manifest
    doc = json.loads((target / store.MANIFEST_FILE).read_text())
    assert doc["kind"] == "candidate-run"


def test_oversized_attestation_is_refused_before_parsing(
        signed_world: World, tmp_path_factory: pytest.TempPathFactory) -> None:
    mutation = next(m for m in MUTATIONS if m.apply is m_attestation_oversized)
    w, target = tampered(signed_world, mutation, tmp_path_factory)
    t0 = time.perf_counter()
    result = w.verify(target)
    assert time.perf_counter() - t0 < 10
    assert f"over the {jsonio.MAX_LISTING_BYTES}-byte limit" in _detail(result, 1)
    json.loads((target / signing.ATTESTATION_FILE).read_text())  # still valid JSON


def test_extra_attestation_is_named(signed_world: World,
                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    mutation = next(m for m in MUTATIONS if m.apply is m_extra_attestation)
    w, target = tampered(signed_world, mutation, tmp_path_factory)
    result = w.verify(target)
    assert "x.dsse.json" in _detail(result, 5)
    assert result.other_attestations == ("x.dsse.json",)
    assert "is in the manifest (" not in "\n".join(result.summary_lines())
    assert "is in the manifest (" in _detail(signed_world.verify(signed_world.good), 5)
