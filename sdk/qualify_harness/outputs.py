"""What a role reports, and the one writer of ``outputs.safetensors`` + ``outputs.json``.

:class:`Recorder` keeps a role's protocol tensors (FP32, CPU, per-parameter tensors at the
seeded sample of :class:`~qualify_harness.protocol.ParamSampling`) and everything the
comparator reads from ``outputs.json`` for that role (:data:`ROLE_REQUIRED`): dtypes,
replica consistency and the lr each step applied. :func:`role_meta` builds the role's
meta and refuses one without them; TP rank 0 of each role writes its part
(:func:`write_part`: ``.part-<role>.safetensors`` then ``.part-<role>.json``, each by
atomic rename, the JSON last) and global rank 0 merges the parts (:func:`merge_parts`)
under :func:`outputs_head`, which carries :data:`qualify_harness.SDK_VERSION`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import os
import platform
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import torch
from safetensors.torch import load_file, save
from torch import Tensor

from qualify_harness.errors import OutputError
from qualify_harness.protocol import (
    OUTPUTS_FILE,
    OUTPUTS_META_FILE,
    ParamSampling,
    tensor_name,
)
from qualify_harness.routes import sdpa_summary
from qualify_harness.version import SDK_VERSION

OUTPUTS_SCHEMA_VERSION: Final = 1
ROLE_REQUIRED: Final = ("tp", "global_ranks", "precision", "dtypes", "replica_consistency",
                        "lr", "role_timings")
"""Keys of ``outputs.json`` ``roles.<role>`` the comparator reads; the schema requires them."""
DTYPE_REQUIRED: Final = ("master_weights", "grads", "optimizer_state", "compute",
                         "grad_reduction", "grad_accumulation")
"""Keys of a role's ``dtypes`` (the comparator's precision-policy row)."""
PART_WAIT_S: Final = 24 * 3600.0
"""Upper bound of rank 0's wait for the other role's part."""


def dtype_name(dtypes: set[torch.dtype]) -> str | list[str]:
    """``str(dtype)`` of a single dtype, else the sorted list of every one seen."""
    names = sorted(str(d) for d in dtypes)
    return names[0] if len(names) == 1 else names


@dataclasses.dataclass(kw_only=True)
class Recorder:
    """What one role reports on one rank: protocol tensors, dtypes, replicas, lrs, timings.

    Attributes:
        role: ``actor`` or ``critic``.
        writer: whether this rank keeps and writes the role's tensors (TP rank 0).
        sampling: the launch's per-parameter sampling (``cell.json`` ``param_sampling``).
        tensors: protocol name -> FP32 (token ids: int64) CPU tensor (kept on the writer
            rank only).
        timings: wall seconds per phase.
        lrs: ``round<r>`` -> the lr the optimizer step of round ``r`` applied.
        sdpa: ``"<backend> <device> <dtype>"`` -> SDPA calls of the role's forwards, read
            back as they ran (:func:`qualify_harness.routes.sdpa_recorder`).
        routes: the engine's other kernel routes read back from its live objects
            (:meth:`qualify_harness.Engine.routes`).
    """

    role: str
    writer: bool
    sampling: ParamSampling = dataclasses.field(default_factory=ParamSampling)
    tensors: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    lrs: dict[str, float] = dataclasses.field(default_factory=dict)
    compute_dtypes: set[torch.dtype] = dataclasses.field(default_factory=set)
    master_dtypes: set[torch.dtype] = dataclasses.field(default_factory=set)
    grad_dtypes: set[torch.dtype] = dataclasses.field(default_factory=set)
    state_dtypes: dict[str, set[torch.dtype]] = dataclasses.field(
        default_factory=lambda: {"exp_avg": set(), "exp_avg_sq": set()})
    reduce_dtypes: dict[str, set[torch.dtype]] = dataclasses.field(default_factory=dict)
    accum_dtypes: dict[str, set[torch.dtype]] = dataclasses.field(default_factory=dict)
    replica_rounds: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    replica_params: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    sdpa: dict[str, int] = dataclasses.field(default_factory=dict)
    routes: dict[str, Any] = dataclasses.field(default_factory=dict)

    def put(self, round_: int, metric: str, value: Tensor, param: str | None = None) -> None:
        """Keep a copy of ``value`` (CPU) under its protocol name on the writer rank.

        Floating and bool tensors are kept as FP32, integer ones (token ids) as int64. A
        copy: an engine may hand its live tensors (a parameter, an optimizer state that
        the next step changes in place). A per-parameter tensor (``param`` given) of a large
        parameter is kept at the seeded sample of :attr:`sampling`.
        """
        if not self.writer:
            return
        integer = not value.is_floating_point() and value.dtype != torch.bool
        out = value.detach().to("cpu", torch.int64 if integer else torch.float32, copy=True)
        idx = self.sampling.indices(param, out.numel()) if param is not None else None
        if idx is not None:
            out = out.reshape(-1)[torch.from_numpy(idx)]
        self.tensors[tensor_name(round_, self.role, metric, param)] = out.contiguous()

    @contextlib.contextmanager
    def timed(self, key: str) -> Iterator[None]:
        """Record the wall time of the block under ``key``."""
        t0 = time.perf_counter()
        yield
        self.timings[key] = round(time.perf_counter() - t0, 4)

    def engine_dtypes(self, reduction: Mapping[str, set[torch.dtype]],
                      accumulation: Mapping[str, set[torch.dtype]]) -> None:
        """Add the dtypes the engine reduced and accumulated gradients in (name -> dtypes)."""
        for into, got in ((self.reduce_dtypes, reduction), (self.accum_dtypes, accumulation)):
            for name, dtypes in got.items():
                into.setdefault(name, set()).update(dtypes)

    def replicas(self, round_: int, equal: Mapping[str, bool],
                 max_abs_diff: Mapping[str, float]) -> None:
        """Record the replica check after round ``round_``'s step (HF name -> result)."""
        self.replica_rounds.append({"round": round_, "all_equal": all(equal.values()),
                                    "max_abs_diff": max(max_abs_diff.values(), default=0.0)})
        for name, eq in equal.items():
            entry = self.replica_params.setdefault(name, {"equal": True, "max_abs_diff": 0.0})
            entry["equal"] = bool(entry["equal"] and eq)
            entry["max_abs_diff"] = max(float(entry["max_abs_diff"]), max_abs_diff[name])


def role_meta(rec: Recorder, *, tp: int, global_ranks: Sequence[int], precision: str,
              **engine: Any) -> dict[str, Any]:
    """The role's part of ``outputs.json``: :data:`ROLE_REQUIRED` from ``rec``, then ``engine``.

    Args:
        rec: the role's recorder after its last round.
        tp: the role's TP size.
        global_ranks: its global ranks.
        precision: ``fp32`` or ``bf16``.
        engine: engine-specific keys (``parallelism``, ``model_class``, ``bf16_mechanism``,
            ``engine_info``...), added as given.

    The meta's ``routes`` is ``{"sdpa_backends": ...}`` (:func:`~qualify_harness.routes.
    sdpa_summary` of :attr:`Recorder.sdpa`) and :attr:`Recorder.routes`.

    Raises:
        OutputError: no round recorded an lr, a replica check or a compute dtype (named).
    """
    missing = [k for k, v in (("lr", rec.lrs), ("replica_consistency", rec.replica_rounds),
                              ("dtypes.compute", rec.compute_dtypes),
                              ("dtypes.master_weights", rec.master_dtypes),
                              ("dtypes.grads", rec.grad_dtypes),
                              *((f"dtypes.optimizer_state.{k}", v)
                                for k, v in rec.state_dtypes.items())) if not v]
    if missing:
        raise OutputError(f"{rec.role}: nothing recorded for {', '.join(missing)}")
    return {
        "tp": tp,
        "global_ranks": list(global_ranks),
        "precision": precision,
        "dtypes": {
            "master_weights": dtype_name(rec.master_dtypes),
            "grads": dtype_name(rec.grad_dtypes),
            "optimizer_state": {k: dtype_name(v) for k, v in rec.state_dtypes.items()},
            "compute": sorted(str(d) for d in rec.compute_dtypes),
            "grad_reduction": {k: dtype_name(v) for k, v in rec.reduce_dtypes.items()},
            "grad_accumulation": {k: dtype_name(v) for k, v in rec.accum_dtypes.items()},
        },
        "lr": dict(rec.lrs),
        "replica_consistency": {
            "all_equal": all(r["all_equal"] for r in rec.replica_rounds),
            "rounds": rec.replica_rounds,
            "params": rec.replica_params,
        },
        "role_timings": dict(rec.timings),
        "routes": {"sdpa_backends": sdpa_summary(rec.sdpa), **rec.routes},
        **engine,
    }


# --------------------------------------------------------------------------- files


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file, fsync, rename, fsync the dir."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}.",
                               suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_json(path: Path, doc: Any) -> None:
    """Write ``doc`` as sorted JSON (indent 1, no NaN) to ``path`` atomically."""
    write_bytes(path, (json.dumps(doc, indent=1, sort_keys=True, allow_nan=False)
                       + "\n").encode("utf-8"))


def write_tensors(path: Path, tensors: Mapping[str, Tensor], meta: dict[str, str]) -> None:
    """Write ``tensors`` (safetensors, with ``meta``) to ``path`` atomically."""
    write_bytes(path, save(dict(tensors), metadata=meta))


def part_paths(output_dir: Path, role: str) -> tuple[Path, Path]:
    """``(.part-<role>.safetensors, .part-<role>.json)`` in ``output_dir``."""
    return output_dir / f".part-{role}.safetensors", output_dir / f".part-{role}.json"


def write_part(engine: str, output_dir: Path, role: str, tensors: Mapping[str, Tensor],
               meta: dict[str, Any]) -> None:
    """Write one role's tensors and meta (the JSON last: it marks the part complete).

    Raises:
        OutputError: ``meta`` lacks a key of :data:`ROLE_REQUIRED` and declares no
            ``not_run``.
    """
    if "not_run" not in meta:
        missing = [k for k in ROLE_REQUIRED if k not in meta]
        if missing:
            raise OutputError(f"{role}: outputs.json roles.{role} lacks {missing}")
    output_dir.mkdir(parents=True, exist_ok=True)
    st, js = part_paths(output_dir, role)
    write_tensors(st, tensors, {"engine": engine, "role": role})
    write_json(js, meta)


def merge_parts(engine: str, roles: Sequence[str], output_dir: Path,
                head: dict[str, Any], *, wait_s: float = PART_WAIT_S) -> None:
    """Wait for every role's part, then write ``outputs.safetensors`` and ``outputs.json``.

    ``head`` is :func:`outputs_head`'s document; each role's meta goes under ``roles``, and
    shims a role lists under ``engine_info.shims`` join the run's ``shims``. The parts are
    removed after the merge.

    Raises:
        OutputError: a part did not appear within ``wait_s`` seconds.
    """
    deadline = time.monotonic() + wait_s
    t0 = time.perf_counter()
    for role in roles:
        js = part_paths(output_dir, role)[1]
        while not js.is_file():
            if time.monotonic() > deadline:
                raise OutputError(f"{js}: the {role} part never appeared")
            time.sleep(0.05)
    tensors: dict[str, Tensor] = {}
    role_meta_: dict[str, Any] = {}
    shims = set(head.get("shims", []))
    for role in roles:
        st, js = part_paths(output_dir, role)
        tensors.update(load_file(str(st)))
        role_meta_[role] = json.loads(js.read_text("utf-8"))
        shims.update(role_meta_[role].get("engine_info", {}).get("shims", []))
    head["roles"] = role_meta_
    head["shims"] = sorted(shims)
    head["tensors"] = {"file": OUTPUTS_FILE, "count": len(tensors)}
    head.setdefault("timings", {})["merge_s"] = round(time.perf_counter() - t0, 4)
    write_tensors(output_dir / OUTPUTS_FILE, tensors, {"engine": engine})
    write_json(output_dir / OUTPUTS_META_FILE, head)
    for role in roles:
        for path in part_paths(output_dir, role):
            path.unlink()


def outputs_head(*, engine: str, cell: dict[str, Any], packages: Iterable[str], world: int,
                 backend: str, device: torch.device, timings: dict[str, float],
                 shims: Sequence[str], faults: Sequence[str]) -> dict[str, Any]:
    """The run-level part of ``outputs.json`` that rank 0 hands to :func:`merge_parts`.

    Args:
        engine: engine name.
        cell: the ``cell.json`` document this output belongs to.
        packages: packages whose versions are recorded (:func:`versions`).
        world: ``WORLD_SIZE``.
        backend: ``torch.distributed`` backend.
        device: the ranks' device.
        timings: rank 0's wall seconds (``merge_s`` is added by the merge).
        shims: patches the harness applied to the engine or the model code.
        faults: deliberate faults injected (tests only).
    """
    return {"schema_version": OUTPUTS_SCHEMA_VERSION, "sdk_version": SDK_VERSION,
            "engine": engine, "cell": cell,
            "versions": versions(packages), "world_size": world, "backend": backend,
            "device": device.type,
            "ranks": rank_table(int(cell["actor_tp"]), int(cell["critic_tp"])),
            "timings": timings, "shims": list(shims), "faults": list(faults)}


def rank_table(actor_tp: int, critic_tp: int) -> list[dict[str, Any]]:
    """``outputs.json`` ``ranks``: Actor on global ranks ``[0, actor_tp)``, Critic after."""
    spans = {"actor": list(range(actor_tp)),
             "critic": list(range(actor_tp, actor_tp + critic_tp))}
    return [{"rank": r, "role": role, "tp_rank": i, "tp_group": ranks}
            for role, ranks in spans.items() for i, r in enumerate(ranks)]


def versions(packages: Iterable[str]) -> dict[str, str]:
    """Python's version and each installed package's (``"not installed"`` when absent)."""
    out = {"python": platform.python_version()}
    for pkg in packages:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out
