"""Evidence store: atomic writes, seal, manifest verification, incomplete dirs, attempts."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import SafetensorError

from qualify.errors import (
    EvidenceIntegrityError,
    ExitCode,
    QualifyError,
    ReferenceDataError,
    UsageError,
)
from qualify.evidence import store


@pytest.fixture(autouse=True)
def _writable_teardown(tmp_path: Path) -> Iterator[None]:
    """Restore write bits so pytest can delete sealed temp dirs (non-root CI)."""
    yield
    store.make_writable(tmp_path)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def _populate(d: Path) -> None:
    store.atomic_write_bytes(d / "data" / "a.bin", b"\x00\x01\x02\x03" * 8)
    store.atomic_write_text(d / "notes.txt", "hello\n")
    store.atomic_write_json(d / "meta.json", {"b": 1, "a": [1, 2]})
    store.save_tensors(d / "data" / "t.safetensors", {"x": np.arange(6, dtype=np.float32)})


def _sealed_dir(tmp_path: Path) -> Path:
    d = store.claim_dir(tmp_path / "ref", kind="reference")
    _populate(d)
    store.seal(d, kind="reference")
    return d


# --------------------------------------------------------------------------- atomic writes

class _Crash(BaseException):
    """Stands for a kill arriving mid-write (not an Exception: cleanup must still run)."""


WRITERS: dict[str, Callable[[Path], object]] = {
    "bytes": lambda p: store.atomic_write_bytes(p, b"new contents " * 100),
    "text": lambda p: store.atomic_write_text(p, "new text\n" * 100),
    "json": lambda p: store.atomic_write_json(p, {"new": list(range(100))}),
    "tensors-numpy": lambda p: store.save_tensors(p, {"a": np.ones((4, 4), np.float32)}),
    "tensors-torch": lambda p: store.save_tensors(p, {"a": torch.ones(4, 4, dtype=torch.bfloat16)}),
}


def _raise(exc: BaseException) -> Callable[..., None]:
    def f(*_a: Any, **_k: Any) -> None:
        raise exc
    return f


CRASHES: dict[str, tuple[str, BaseException]] = {
    "fsync-oserror": ("fsync", OSError(5, "I/O error")),
    "replace-oserror": ("replace", OSError(28, "No space left on device")),
    "replace-killed": ("replace", _Crash()),
    "fsync-killed": ("fsync", _Crash()),
}


@pytest.mark.parametrize("writer", list(WRITERS), ids=list(WRITERS))
@pytest.mark.parametrize("crash", list(CRASHES), ids=list(CRASHES))
def test_atomic_write_crash_leaves_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str, crash: str
) -> None:
    target = tmp_path / "out.file"
    target.write_bytes(b"old")
    attr, exc = CRASHES[crash]
    monkeypatch.setattr(os, attr, _raise(exc))
    with pytest.raises(type(exc)):
        WRITERS[writer](target)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["out.file"]
    assert target.read_bytes() == b"old"


@pytest.mark.parametrize("writer", list(WRITERS), ids=list(WRITERS))
def test_atomic_write_creates_file_and_no_temp(tmp_path: Path, writer: str) -> None:
    target = tmp_path / "sub" / "out.file"
    WRITERS[writer](target)
    assert os.listdir(target.parent) == ["out.file"]
    assert _mode(target) == 0o644


def test_writer_error_inside_safetensors_leaves_nothing(tmp_path: Path) -> None:
    bad = {"a": np.array([object()], dtype=object)}
    with pytest.raises(SafetensorError, match="dtype"):
        store.save_tensors(tmp_path / "t.safetensors", bad)
    assert os.listdir(tmp_path) == []


def test_json_format_sorted_indented_trailing_newline(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    store.atomic_write_json(p, {"b": 1, "a": {"d": 2, "c": "é"}})
    assert p.read_text(encoding="utf-8") == (
        '{\n  "a": {\n    "c": "é",\n    "d": 2\n  },\n  "b": 1\n}\n'
    )


JSON_REFUSED: dict[str, tuple[Any, str | None, type[Exception]]] = {
    "schema-violation": ({"schema_version": 2}, "manifest", QualifyError),
    "nan": ({"x": float("nan")}, None, ValueError),
    "not-serialisable": ({"x": object()}, None, TypeError),
}


@pytest.mark.parametrize("case", list(JSON_REFUSED), ids=list(JSON_REFUSED))
def test_atomic_write_json_refuses_without_writing(tmp_path: Path, case: str) -> None:
    obj, schema, exc = JSON_REFUSED[case]
    with pytest.raises(exc):
        store.atomic_write_json(tmp_path / "x.json", obj, schema=schema)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- tensors

def test_tensors_roundtrip_numpy_and_torch(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors: dict[str, torch.Tensor | np.ndarray] = {
        "np/f64": np.linspace(0, 1, 5),
        "np/i64": np.arange(3, dtype=np.int64),
        "np/transposed": np.arange(6, dtype=np.float32).reshape(2, 3).T,
        "t/scalar": torch.tensor(3.5),
        "t/view": base[1:3, ::2],  # non-contiguous view sharing storage
        "t/base": base,
        "t/again": base,  # same tensor twice
        "t/bf16": torch.tensor([1.0, 2.5], dtype=torch.bfloat16),
        "t/grad": torch.ones(2, requires_grad=True),
    }
    p = tmp_path / "x.safetensors"
    store.save_tensors(p, tensors, {"who": "test"})
    back = store.load_tensors_torch(p)
    assert set(back) == set(tensors)
    for name, value in tensors.items():
        expected = torch.as_tensor(value) if isinstance(value, np.ndarray) else value.detach()
        assert back[name].dtype == expected.dtype, name
        assert torch.equal(back[name], expected), name
    assert store.read_tensor_metadata(p) == {"who": "test"}


def test_numpy_only_roundtrip(tmp_path: Path) -> None:
    p = tmp_path / "x.safetensors"
    arrays: dict[str, np.ndarray] = {
        "a": np.arange(12, dtype=np.float32).reshape(3, 4),
        "m": np.ones(3, np.int64),
    }
    store.save_tensors(p, arrays)
    back = store.load_tensors(p)
    assert set(back) == {"a", "m"}
    np.testing.assert_array_equal(back["a"], arrays["a"])
    assert back["m"].dtype == np.int64
    assert store.read_tensor_metadata(p) == {}


def _truncated(p: Path) -> None:
    store.save_tensors(p, {"a": np.ones(100, np.float32)})
    p.write_bytes(p.read_bytes()[:-10])


LOAD_ERRORS: dict[str, Callable[[Path], object]] = {
    "missing": lambda p: None,
    "truncated": _truncated,
    "garbage": lambda p: p.write_bytes(b"not a safetensors file"),
    "bf16-in-numpy": lambda p: store.save_tensors(p, {"a": torch.ones(2, dtype=torch.bfloat16)}),
}


@pytest.mark.parametrize("case", list(LOAD_ERRORS), ids=list(LOAD_ERRORS))
def test_load_tensors_errors(tmp_path: Path, case: str) -> None:
    p = tmp_path / "x.safetensors"
    LOAD_ERRORS[case](p)
    with pytest.raises(EvidenceIntegrityError, match=r"x\.safetensors"):
        store.load_tensors(p)


def test_save_tensors_type_errors(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"expected torch\.Tensor"):
        store.save_tensors(tmp_path / "x.safetensors", {"a": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="metadata"):
        store.save_tensors(tmp_path / "x.safetensors", {"a": np.ones(1)},
                           {"k": 1})  # type: ignore[dict-item]
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- seal

def test_seal_manifest_modes_and_digest(tmp_path: Path) -> None:
    d = store.claim_dir(tmp_path / "ref", kind="reference")
    assert store.is_incomplete(d)
    assert not store.is_sealed(d)
    _populate(d)
    (d / "sig.dsse.json").write_text("{}")  # an attestation is never listed
    digest = store.seal(d, kind="reference")

    assert store.is_sealed(d)
    assert not store.is_incomplete(d)
    raw = (d / store.MANIFEST_FILE).read_bytes()
    assert digest == hashlib.sha256(raw).hexdigest() == store.manifest_digest(d)
    manifest = json.loads(raw)
    assert manifest["kind"] == "reference"
    assert manifest["schema_version"] == 1
    assert manifest["created"].endswith("Z")
    assert list(manifest["files"]) == ["data/a.bin", "data/t.safetensors", "meta.json",
                                       "notes.txt"]
    a = manifest["files"]["data/a.bin"]
    assert a == {"sha256": hashlib.sha256(b"\x00\x01\x02\x03" * 8).hexdigest(), "size": 32}
    assert raw.endswith(b"}\n")
    for root, dirs, files in os.walk(d):
        assert _mode(Path(root)) == 0o555
        for name in files:
            if name != "sig.dsse.json":
                assert _mode(Path(root) / name) == 0o444, name
        assert all(_mode(Path(root) / x) == 0o555 for x in dirs)
    assert store.verify_manifest(d) == []
    assert store.check_sealed(d) == digest


SEALED_WRITES: dict[str, Callable[[Path], object]] = {
    "bytes-new": lambda d: store.atomic_write_bytes(d / "new.bin", b"x"),
    "bytes-overwrite": lambda d: store.atomic_write_bytes(d / "notes.txt", b"x"),
    "text-nested": lambda d: store.atomic_write_text(d / "data" / "n.txt", "x"),
    "json-new-subdir": lambda d: store.atomic_write_json(d / "deep" / "er" / "x.json", {}),
    "tensors": lambda d: store.save_tensors(d / "data" / "t.safetensors", {"a": np.ones(1)}),
    "new-attempt": lambda d: store.new_attempt(d / "cells" / "c"),
    "claim-inside": lambda d: store.claim_dir(d / "sub", kind="reference"),
    "seal-again": lambda d: store.seal(d, kind="reference"),
}


@pytest.mark.parametrize("case", list(SEALED_WRITES), ids=list(SEALED_WRITES))
def test_sealed_directory_refuses_every_write(tmp_path: Path, case: str) -> None:
    d = _sealed_dir(tmp_path)
    before = sorted(p.relative_to(d).as_posix() for p in d.rglob("*"))
    with pytest.raises(EvidenceIntegrityError) as info:
        SEALED_WRITES[case](d)
    assert info.value.exit_code == ExitCode.INTEGRITY_ERROR
    assert sorted(p.relative_to(d).as_posix() for p in d.rglob("*")) == before
    assert store.verify_manifest(d) == []


def _flip_byte(d: Path) -> None:
    data = bytearray((d / "data/a.bin").read_bytes())
    data[5] ^= 0xFF
    (d / "data/a.bin").write_bytes(bytes(data))


def _edit_manifest(d: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads((d / "MANIFEST.json").read_text())
    fn(doc)
    (d / "MANIFEST.json").write_text(json.dumps(doc))


def _symlink_over(d: Path) -> None:
    (d / "notes.txt").unlink()
    (d / "notes.txt").symlink_to(d / "meta.json")


TAMPER: dict[str, tuple[Callable[[Path], object], list[tuple[str, str]]]] = {
    "byte-flipped": (_flip_byte, [("modified", "data/a.bin")]),
    "file-deleted": (lambda d: (d / "notes.txt").unlink(), [("missing", "notes.txt")]),
    "file-added": (lambda d: (d / "data/new.bin").write_bytes(b"x"), [("extra", "data/new.bin")]),
    "file-renamed": (lambda d: (d / "notes.txt").rename(d / "notes2.txt"),
                     [("missing", "notes.txt"), ("extra", "notes2.txt")]),
    "size-changed": (lambda d: (d / "notes.txt").write_text("hello, longer\n"),
                     [("size", "notes.txt")]),
    "symlink-swapped-in": (_symlink_over, [("modified", "notes.txt")]),
    "manifest-missing": (lambda d: (d / "MANIFEST.json").unlink(),
                         [("no-manifest", "MANIFEST.json")]),
    "manifest-not-json": (lambda d: (d / "MANIFEST.json").write_text("{not json"),
                          [("bad-manifest", "MANIFEST.json")]),
    "manifest-bad-schema": (
        lambda d: _edit_manifest(d, lambda m: m["files"]["notes.txt"].update(sha256="XYZ")),
        [("bad-manifest", "MANIFEST.json")]),
    "manifest-unsafe-path": (
        lambda d: _edit_manifest(d, lambda m: m["files"].update(
            {"../escape": {"sha256": "0" * 64, "size": 0}})),
        [("bad-manifest", "MANIFEST.json")]),
    "manifest-digest-edited": (
        lambda d: _edit_manifest(d, lambda m: m["files"]["notes.txt"].update(sha256="0" * 64)),
        [("modified", "notes.txt")]),
    "incomplete-marker-added": (lambda d: (d / store.INCOMPLETE_FILE).write_text("{}"),
                                [("extra", "INCOMPLETE")]),
    "leftover-temp-file": (lambda d: (d / ".tmp-x.partial").write_text(""),
                           [("extra", ".tmp-x.partial")]),
    "attestation-added": (lambda d: (d / "run.dsse.json").write_text("{}"), []),
    "nested-attestation-added": (lambda d: (d / "data" / "k.dsse.json").write_text("{}"), []),
}


@pytest.mark.parametrize("case", list(TAMPER), ids=list(TAMPER))
def test_verify_manifest_detects_tampering(tmp_path: Path, case: str) -> None:
    d = _sealed_dir(tmp_path)
    mutate, expected = TAMPER[case]
    store.make_writable(d)
    mutate(d)
    problems = store.verify_manifest(d)
    assert [(p.kind, p.path) for p in problems] == expected
    if expected:
        with pytest.raises(EvidenceIntegrityError) as info:
            store.check_sealed(d)
        message = str(info.value)
        assert "\n" not in message
        assert expected[0][1] in message
        assert str(d) in message
    else:
        store.check_sealed(d)


def test_verify_manifest_on_missing_dir(tmp_path: Path) -> None:
    problems = store.verify_manifest(tmp_path / "nope")
    assert [p.kind for p in problems] == ["no-manifest"]
    assert not store.is_sealed(tmp_path / "nope")


def test_problem_is_frozen_and_prints_one_line() -> None:
    p = store.Problem(kind="missing", path="a/b", detail="gone")
    assert str(p) == "a/b: missing: gone"
    with pytest.raises(AttributeError):
        p.kind = "extra"  # type: ignore[misc]


def test_seal_refuses_symlink_and_leftover_temp(tmp_path: Path) -> None:
    d = store.claim_dir(tmp_path / "a", kind="reference")
    (d / "link").symlink_to(tmp_path)
    with pytest.raises(EvidenceIntegrityError, match="not a regular file"):
        store.seal(d, kind="reference")
    (d / "link").unlink()
    (d / ".tmp-x.json.abc.partial").write_text("")
    with pytest.raises(EvidenceIntegrityError, match="leftover temporary"):
        store.seal(d, kind="reference")
    assert not store.is_sealed(d)


def test_seal_rejects_bad_kind(tmp_path: Path) -> None:
    d = store.claim_dir(tmp_path / "a", kind="reference")
    with pytest.raises(QualifyError, match="kind"):
        store.seal(d, kind="Not A Kind")
    assert not store.is_sealed(d)
    assert store.is_incomplete(d)


def test_interrupted_seal_is_not_sealed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = store.claim_dir(tmp_path / "ref", kind="reference")
    _populate(d)
    (d / "reference.json").write_text("{}")
    monkeypatch.setattr(os, "replace", _raise(_Crash()))
    with pytest.raises(_Crash):
        store.seal(d, kind="reference")
    monkeypatch.undo()
    assert not store.is_sealed(d)
    assert not (d / store.MANIFEST_FILE).exists()
    assert [p.kind for p in store.verify_manifest(d)] == ["no-manifest"]
    # killed between removing the marker and writing the manifest: neither is there, but
    # reference.json says qualify wrote it: an interrupted reference, not a stray folder
    assert not store.is_incomplete(d)
    assert store.not_sealed_reason(d, "reference") == \
        f"{d}: reference is not sealed (interrupted or still running)"


# --------------------------------------------------------------------------- claim / incomplete

def test_valid_manifest_with_marker_is_not_sealed(tmp_path: Path) -> None:
    d = _sealed_dir(tmp_path)
    store.make_writable(d)
    (d / store.INCOMPLETE_FILE).write_text("{}")
    assert not store.is_sealed(d)


def test_claim_dir_moves_interrupted_dir_aside_and_keeps_it(tmp_path: Path) -> None:
    d = store.claim_dir(tmp_path / "ref", kind="reference")
    marker = json.loads((d / store.INCOMPLETE_FILE).read_text())
    assert marker["pid"] == os.getpid()
    assert marker["host"] == socket.gethostname()
    assert marker["kind"] == "reference"
    _populate(d)  # ... and the process dies here: no seal

    again = store.claim_dir(tmp_path / "ref", kind="reference")
    assert again == d
    assert os.listdir(again) == [store.INCOMPLETE_FILE]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("ref.incomplete-")]
    assert len(aside) == 1
    assert (aside[0] / "notes.txt").read_text() == "hello\n"
    assert not store.is_sealed(aside[0])

    store.claim_dir(tmp_path / "ref", kind="reference")  # a second interruption
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("ref.incomplete-")]) == 2


def test_claim_dir_refuses_sealed(tmp_path: Path) -> None:
    d = _sealed_dir(tmp_path)
    with pytest.raises(ReferenceDataError, match="--new") as info:
        store.claim_dir(d, kind="reference")
    assert info.value.exit_code == ExitCode.USAGE_ERROR
    assert str(tmp_path / "ref-2") in str(info.value)
    assert store.check_sealed(d)


def test_claim_dir_refuses_dir_of_live_writer(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        d = tmp_path / "ref"
        d.mkdir()
        marker = {"pid": child.pid, "host": socket.gethostname(),
                  "started": store.utc_now_iso(), "kind": "reference"}
        (d / store.INCOMPLETE_FILE).write_text(json.dumps(marker))
        with pytest.raises(UsageError, match=f"process {child.pid}"):
            store.claim_dir(d, kind="reference")
        assert (d / store.INCOMPLETE_FILE).exists()
    finally:
        child.kill()
        child.wait()
    store.claim_dir(d, kind="reference")  # the writer is gone: interrupted, moved aside


def test_next_free_dir(tmp_path: Path) -> None:
    base = tmp_path / "run"
    assert store.next_free_dir(base) == base
    base.mkdir()
    assert store.next_free_dir(base) == tmp_path / "run-2"
    (tmp_path / "run-2").write_text("a file counts too")
    assert store.next_free_dir(base) == tmp_path / "run-3"


# --------------------------------------------------------------------------- attempts

def test_attempts_are_append_only(tmp_path: Path) -> None:
    cell = tmp_path / "cells" / "hf-fp32-actor-tp1"
    assert store.attempts(cell) == []
    assert store.latest_complete_attempt(cell) is None
    a1 = store.new_attempt(cell)
    assert a1.name == "attempt-1"
    assert store.is_incomplete(a1)
    store.atomic_write_text(a1 / "rank0.log", "crashed\n")  # failed attempt: kept, unsealed
    a2 = store.new_attempt(cell)
    store.atomic_write_text(a2 / "outputs.json", "{}")
    store.seal(a2, kind="attempt")
    a3 = store.new_attempt(cell)  # in progress
    assert [a.name for a in store.attempts(cell)] == ["attempt-1", "attempt-2", "attempt-3"]
    assert store.latest_complete_attempt(cell) == a2
    assert (a1 / "rank0.log").read_text() == "crashed\n"
    store.seal(a3, kind="attempt")
    assert store.latest_complete_attempt(cell) == a3


def test_attempt_numbering_skips_strays_and_sorts_numerically(tmp_path: Path) -> None:
    cell = tmp_path / "c"
    for n in (1, 2, 9, 10):
        (cell / f"attempt-{n}").mkdir(parents=True)
    for stray in ("attempt-0", "attempt-01", "attempt-x", "notes"):
        (cell / stray).mkdir()
    (cell / "attempt-11").write_text("a stray file blocks the name")
    assert [store.attempt_number(a) for a in store.attempts(cell)] == [1, 2, 9, 10]
    assert store.new_attempt(cell).name == "attempt-12"
    assert (cell / "attempt-11").read_text() == "a stray file blocks the name"
    with pytest.raises(ValueError, match="attempt"):
        store.attempt_number(cell / "attempt-01")


def test_concurrent_new_attempt_gives_distinct_dirs(tmp_path: Path) -> None:
    cell = tmp_path / "c"
    n_threads = 16
    barrier = threading.Barrier(n_threads)
    results: list[Path] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work() -> None:
        try:
            barrier.wait()
            p = store.new_attempt(cell)
            with lock:
                results.append(p)
        except BaseException as exc:
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(store.attempt_number(p) for p in results) == list(range(1, n_threads + 1))
    assert all(store.is_incomplete(p) for p in results)


# --------------------------------------------------------------------------- attestations

def test_add_attestation_after_seal(tmp_path: Path) -> None:
    d = _sealed_dir(tmp_path)
    digest = store.manifest_digest(d)
    p = store.add_attestation(d, "reference.dsse.json", b'{"payload": "x"}')
    assert p.read_bytes() == b'{"payload": "x"}'
    assert _mode(p) == 0o444
    assert _mode(d) == 0o555
    assert store.manifest_digest(d) == digest
    assert store.verify_manifest(d) == []
    with pytest.raises(EvidenceIntegrityError, match="never overwritten"):
        store.add_attestation(d, "reference.dsse.json", b"{}")
    assert p.read_bytes() == b'{"payload": "x"}'


ATTESTATION_REFUSED: dict[str, tuple[str, bool, type[Exception]]] = {
    "unsealed-dir": ("a.dsse.json", False, EvidenceIntegrityError),
    "wrong-suffix": ("a.json", True, ValueError),
    "path-separator": ("sub/a.dsse.json", True, ValueError),
    "bare-suffix": (".dsse.json", True, ValueError),
}


@pytest.mark.parametrize("case", list(ATTESTATION_REFUSED), ids=list(ATTESTATION_REFUSED))
def test_add_attestation_refusals(tmp_path: Path, case: str) -> None:
    name, sealed, exc = ATTESTATION_REFUSED[case]
    d = _sealed_dir(tmp_path) if sealed else store.claim_dir(tmp_path / "x", kind="reference")
    with pytest.raises(exc):
        store.add_attestation(d, name, b"{}")


def test_import_store_does_not_import_engines() -> None:
    code = ("import sys, qualify.evidence.store; "
            "bad = [m for m in ('torch', 'vllm', 'deepspeed', 'megatron') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_small_helpers() -> None:
    assert store.sha256_bytes(b"abc") == hashlib.sha256(b"abc").hexdigest()
    stamp = store.utc_now()
    assert stamp.endswith("Z")
    assert "T" in stamp


# --------------------------------------------------------------------------- module seams

# The names store re-exports from the modules split out of it (issue #14), for callers
# outside qualify/evidence. Pinned so that removing one is a deliberate change.
STORE_REEXPORTS: dict[str, tuple[str, ...]] = {
    "qualify.digests": ("sha256_bytes", "sha256_file"),
    "qualify.evidence.attempts": ("attempt_number", "attempts", "claim_dir",
                                  "latest_complete_attempt", "new_attempt", "next_free_dir"),
    "qualify.evidence.sealed": ("atomic_write_bytes", "atomic_write_json", "atomic_write_text",
                                "is_incomplete", "is_sealed", "sealed_ancestor"),
    "qualify.evidence.tensors": ("load_tensors", "load_tensors_torch", "read_tensor_metadata",
                                 "save_tensors"),
    "qualify.evidence.timestamps": ("utc_now", "utc_now_iso"),
    "qualify.layout": ("ATTESTATION_SUFFIX", "INCOMPLETE_FILE", "MANIFEST_FILE"),
}


@pytest.mark.parametrize("module", sorted(STORE_REEXPORTS))
def test_store_reexports_are_the_defining_modules_objects(module: str) -> None:
    import importlib

    mod = importlib.import_module(module)
    for name in STORE_REEXPORTS[module]:
        assert name in store.__all__, name
        assert getattr(store, name) is getattr(mod, name), name


def test_evidence_modules_import_no_cycle() -> None:
    """The qualify.evidence modules import one another without a cycle (docs/engine-guide.md)."""
    import ast

    pkg = Path(store.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in sorted(pkg.glob("*.py")):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "qualify.evidence":
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("qualify.evidence."):
                deps.add(node.module.rsplit(".", 1)[1])
        graph[path.stem] = deps
    state: dict[str, int] = {}

    def visit(m: str, trail: tuple[str, ...]) -> None:
        assert state.get(m) != 1, f"import cycle: {' -> '.join((*trail, m))}"
        if state.get(m) == 2:
            return
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            visit(d, (*trail, m))
        state[m] = 2

    for m in sorted(graph):
        visit(m, ())
    assert {"store", "sealed", "attempts", "tensors", "dsse", "keys", "statement", "sign",
            "verify", "discover", "gate", "audit"} <= set(graph)


def test_parse_time_reads_what_utc_now_writes() -> None:
    from qualify.evidence.timestamps import parse_time

    stamp = store.utc_now_iso()
    t = parse_time(stamp, "now")
    assert t.tzinfo is not None
    assert t.strftime("%Y-%m-%dT%H:%M:%S.%fZ") == stamp
    for bad in (None, 3, "yesterday"):
        with pytest.raises(EvidenceIntegrityError):
            parse_time(bad, "bad")


def test_a_folder_of_sealed_directories_is_named_as_such(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """``--reference`` given the folder that holds references (``qualify reference --out``'s
    parent) is refused in one line that names the sealed directories inside, not as an
    interrupted reference; an interrupted one still reads "not sealed"."""
    from qualify.cli.main import main
    from qualify.evidence import store

    refs = Path(__file__).resolve().parents[1] / "references"
    code = main(["candidate", "--reference", str(refs), "--out", str(tmp_path / "ev")])
    captured = capsys.readouterr()
    assert code == 2
    (line,) = captured.err.strip().splitlines()
    assert f"{refs}: not a reference directory but a folder holding sealed directories (" \
        in line, line
    assert "tiny-qwen3-" in line
    assert line.endswith("name one of them"), line  # no "run it to completion" after it
    assert not (tmp_path / "ev").exists()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / store.INCOMPLETE_FILE).write_text("")
    (broken / "sub").mkdir()
    assert store.not_sealed_reason(broken, "reference") == \
        f"{broken}: reference is not sealed (interrupted or still running)"
    assert store.not_sealed_reason(tmp_path / "broken" / "sub", "run") == \
        f"{broken / 'sub'}: run is not sealed (interrupted or still running)"
    stray = tmp_path / "docs"  # a folder qualify never wrote: no manifest, no marker
    stray.mkdir()
    assert store.not_sealed_reason(stray, "reference") == (
        f"{stray}: not a reference directory (no MANIFEST.json, and not marked as a "
        "reference being written or interrupted)")
