"""Synthetic sealed evidence in the real layout, sized for the comparator benchmark.

:func:`build` copies the committed tiny-qwen3 reference and one COMPLETE actor cell of the
committed run (``torch_tp-fp32-actor-tp1``), adds synthetic round-1 gradient parameters to
the reference's ``reference/hf-fp32.safetensors`` (and, equal to them, to its FP32 control
runs ``controls/*-fp32.safetensors``, whose errors verify measures again) and to the cell's
``outputs.safetensors`` (one large one and a few medium ones, FP32), and seals and signs
both with a throw-away Ed25519 key, so ``qualify compare`` and ``qualify verify`` run their
real code paths on it (the ``max_rel_l2`` statistic of ``round1/actor/grads``, its power
check, the manifest hashes). The candidate's values are the reference's times
``1 + 1e-9 * u`` (``u`` standard normal): far inside the FP32 bound, so the row passes.

The tensors are written chunk by chunk (the safetensors format: an 8-byte little-endian
header length, the JSON header, then the data in offset order), so building 2 GB needs a
few MB of memory. Nothing here is committed evidence; it lives under ``out`` only.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import numpy as np

from qualify import atomic, jsonio
from qualify.evidence import store
from qualify.evidence.keys import SigningKey, generate_key
from qualify.evidence.sign import sign_directory
from qualify.layout import CONTROLS_DIR, HF_REFERENCE_DIR, OUTPUTS_FILE, RUN_FILE, hf_tensors_file

__all__ = ["Synthetic", "build", "sign_run"]

ROOT: Final = Path(__file__).resolve().parent.parent


def _newest(pattern: str, base: Path) -> Path:
    """The last directory of ``base`` matching ``pattern`` by name, else ``base / pattern``.

    Run ids are UTC timestamps, so the last by name is the newest; callers check
    ``is_dir()`` when none exists.
    """
    found = sorted(p for p in base.glob(pattern) if p.is_dir()) if base.is_dir() else []
    return found[-1] if found else base / pattern


COMMITTED_RUN: Final = _newest("2*Z", ROOT / "evidence" / "tiny-qwen3")
"""The committed default run (the newest run directory under ``evidence/tiny-qwen3/``)."""
COMMITTED_REFERENCE: Final = _newest("tiny-qwen3-" + "[0-9a-f]" * 12, ROOT / "references")
"""The committed default reference."""
CELL: Final = "torch_tp-fp32-actor-tp1"
MEDIUM: Final = 4
"""Medium synthetic parameters per file besides the large one, each ``largest / 32``."""
_CHUNK_ELEMS: Final = 1 << 22  # 16 MiB of FP32 per generated chunk
_ALIGN: Final = 8


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Synthetic:
    """What :func:`build` made.

    Attributes:
        reference: the sealed, signed reference directory.
        run: the candidate run directory (``run.json`` and one sealed cell attempt; not
            compared, sealed or signed yet: :func:`sign_run` after ``qualify compare``).
        keys: directory holding the throw-away key's public half (``verify --keys``).
        key: the signing key.
        largest_bytes: bytes of the largest synthetic tensor.
        compared_bytes: bytes of the two tensor files the comparator judges the cell from
            (the reference's ``hf-fp32`` file and the cell's outputs).
    """

    reference: Path
    run: Path
    keys: Path
    key: SigningKey
    largest_bytes: int
    compared_bytes: int


def _read_header(path: Path) -> tuple[dict[str, dict[str, object]], int]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def _raw_tensors(path: Path) -> Iterator[tuple[str, str, list[int], bytes]]:
    """``(name, dtype, shape, data bytes)`` of every tensor of a (small) safetensors file."""
    header, base = _read_header(path)
    with path.open("rb") as f:
        for name, e in sorted(header.items()):
            if name == "__metadata__":
                continue
            start, end = (int(x) for x in e["data_offsets"])  # type: ignore[attr-defined]
            f.seek(base + start)
            yield name, str(e["dtype"]), list(e["shape"]), f.read(end - start)  # type: ignore[call-overload]


Chunks = Callable[[], Iterator[bytes]]


def _write_safetensors(path: Path, entries: list[tuple[str, str, list[int], int, Chunks]],
                       metadata: dict[str, str] | None) -> None:
    """Write ``(name, dtype, shape, nbytes, chunks)`` entries as one safetensors file."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    off = 0
    for name, dtype, shape, nbytes, _ in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, _, _, nbytes, chunks in entries:
            wrote = 0
            for c in chunks():
                f.write(c)
                wrote += len(c)
            if wrote != nbytes:
                raise RuntimeError(f"{name}: wrote {wrote} bytes, declared {nbytes}")


def _synthetic_chunks(numel: int, seed: int, *, candidate: bool) -> Chunks:
    """FP32 chunks of a seeded tensor, or of its candidate ``x * (1 + 1e-9 u)``."""
    def gen() -> Iterator[bytes]:
        rng = np.random.default_rng(seed)
        noise = np.random.default_rng(seed + 1_000_003)
        left = numel
        while left:
            n = min(_CHUNK_ELEMS, left)
            x = rng.standard_normal(n, dtype=np.float32)
            if candidate:
                x *= np.float32(1) + np.float32(1e-9) * noise.standard_normal(n, dtype=np.float32)
            yield x.astype("<f4", copy=False).tobytes()
            left -= n
    return gen


def _once(data: bytes) -> Chunks:
    return lambda: iter([data])


def _augmented(src: Path, dst: Path, params: list[tuple[str, int]], *, candidate: bool) -> None:
    """``src``'s tensors plus ``round1/actor/grads/<param>`` of ``numel`` FP32 each."""
    entries: list[tuple[str, str, list[int], int, Chunks]] = [
        (n, d, s, len(b), _once(b)) for n, d, s, b in _raw_tensors(src)]
    for i, (param, numel) in enumerate(params):
        entries.append((f"round1/actor/grads/{param}", "F32", [numel], 4 * numel,
                        _synthetic_chunks(numel, 1234 + i, candidate=candidate)))
    entries.sort(key=lambda e: e[0])
    meta = _read_header(src)[0].get("__metadata__")
    _write_safetensors(dst, entries,
                       {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict)
                       else None)


def _copy_writable(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, symlinks=True)
    store.make_writable(dst)
    for name in ("MANIFEST.json", "attestation.dsse.json"):
        (dst / name).unlink(missing_ok=True)


def build(out: Path, *, size_bytes: int) -> Synthetic:
    """Build the synthetic reference and run under ``out`` (which must not exist).

    Args:
        out: a new directory.
        size_bytes: the largest tensor is ``size_bytes / 2`` (1 GB at 2 GB); the reference
            and the candidate each hold one such tensor plus :data:`MEDIUM` of a 32nd of
            it, so the synthetic bytes are ``1.125 * size_bytes`` in all.

    Returns:
        The :class:`Synthetic` evidence.

    Raises:
        FileExistsError: ``out`` exists.
    """
    out.mkdir(parents=True)
    large = max(1024, size_bytes // 8)
    params = [("synthetic.large.weight", large)] + [
        (f"synthetic.medium{i}.weight", large // 32) for i in range(MEDIUM)]
    key, _pub = generate_key(out / "key" / "bench.pem", out / "keys", name="bench")
    # reference
    ref = out / COMMITTED_REFERENCE.name
    _copy_writable(COMMITTED_REFERENCE, ref)
    hf = ref / HF_REFERENCE_DIR / hf_tensors_file("fp32")
    tmp = hf.with_suffix(".new")
    _augmented(hf, tmp, params, candidate=False)
    tmp.replace(hf)
    # the FP32 control runs get the same synthetic parameters, equal to the reference's:
    # verify measures the control errors again (0 on them: the sealed errors stand)
    for control in sorted((ref / CONTROLS_DIR).glob("*-fp32.safetensors")):
        tmp = control.with_suffix(".new")
        _augmented(control, tmp, params, candidate=False)
        tmp.replace(control)
    store.seal(ref, kind="reference")
    sign_directory(ref, key)
    # run: one cell
    run = out / "evidence" / "tiny-qwen3" / "synthetic"
    run.mkdir(parents=True)
    doc = jsonio.read_json(COMMITTED_RUN / RUN_FILE)
    entry = doc["cells"][CELL]
    adir = run / str(entry["attempt"])
    adir.parent.mkdir(parents=True)
    shutil.copytree(COMMITTED_RUN / str(entry["attempt"]), adir)
    store.make_writable(adir)
    (adir / "MANIFEST.json").unlink()
    tmp = adir / "outputs.new"
    _augmented(adir / OUTPUTS_FILE, tmp, params, candidate=True)
    tmp.replace(adir / OUTPUTS_FILE)
    store.seal(adir, kind="cell-attempt")
    now = store.utc_now_iso()
    doc.update(run_id="synthetic", started=now, finished=now, faults=[], cells={CELL: entry},
               reference={"manifest_digest": store.manifest_digest(ref), "path": str(ref),
                          "sealed": store.read_manifest(ref)["created"]})
    atomic.write_json(run / RUN_FILE, doc)
    return Synthetic(reference=ref, run=run, keys=out / "keys", key=key,
                     largest_bytes=4 * large,
                     compared_bytes=hf.stat().st_size + (adir / OUTPUTS_FILE).stat().st_size)


def sign_run(syn: Synthetic) -> None:
    """Seal and sign the compared synthetic run (``qualify verify`` needs both)."""
    store.seal(syn.run, kind="candidate-run")
    sign_directory(syn.run, syn.key, reference_dir=syn.reference)
