"""The six rejection probes of the sampler cell.

Each probe attempts one bad update through :meth:`harnesses.vllm.weights.WeightSync.install`
against the real engine and records whether the protocol refused it, why, and whether the
sampler stayed on its previous version (version counter unchanged, and after a rollback
every rank's reinstalled shards verified against that version's expected digests):

- ``stale_version``: a version not greater than the installed one; refused by
  ``stale_version`` before the engine is touched.
- ``wrong_shard``: the file vLLM loads has, in the last layer, the last row of ``up_proj``
  replaced by the last row of ``gate_proj`` (a gate/up mix-up; that row lives on the last
  TP rank only); refused by ``digest_mismatch``.
- ``missing_ack``: the last rank's acknowledgement is lost; refused by ``missing_ack``.
- ``duplicate_ack``: rank 0's acknowledgement arrives twice (in place of the last rank's
  at TP > 1); refused by ``duplicate_ack``.
- ``warm_cache``: the prefix cache is not reset after the update; refused by
  ``warm_cache``.
- ``partial_install``: the weights file lacks one tensor, the last layer's
  ``mlp.down_proj.weight`` (:func:`partial_payload`); refused by ``missing_tensor`` before
  the engine is touched. Without that check vLLM's in-place reload keeps the absent
  tensor's previous kernel and the expected digests, computed from the same file, do not
  name it: the install would be accepted (:mod:`harnesses.vllm.weights`).

The update payload of the probes (except ``stale_version``) is a valid weights file other
than the installed one (``partial_install``: less one tensor), at the next version, so a
probe that is not refused would change what the sampler serves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from safetensors.torch import load_file, save_file

from harnesses.vllm.weights import InstallRecord, WeightSync

PROBES: Final = ("stale_version", "wrong_shard", "missing_ack", "duplicate_ack", "warm_cache",
                  "partial_install")
"""Probe name = the check that must refuse it (except ``wrong_shard``: ``digest_mismatch``;
``partial_install``: ``missing_tensor``)."""
EXPECTED_CHECK: Final = {"stale_version": "stale_version", "wrong_shard": "digest_mismatch",
                         "missing_ack": "missing_ack", "duplicate_ack": "duplicate_ack",
                         "warm_cache": "warm_cache", "partial_install": "missing_tensor"}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ProbeResult:
    """One probe's outcome.

    Attributes:
        name: probe name (:data:`PROBES`).
        expected_check: the check that must refuse it.
        rejected: the install was refused **by** ``expected_check``.
        stayed: the sampler is on its previous version afterwards (counter unchanged and,
            after a rollback, the reinstalled shards verified on every rank).
        reason: the recorded refusal reason (``None`` if it was accepted).
        version_before: installed version before the probe.
        version_after: installed version after it.
        record: the install record.
    """

    name: str
    expected_check: str
    rejected: bool
    stayed: bool
    reason: str | None
    version_before: int
    version_after: int
    record: InstallRecord

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``outputs.json`` ``probes``)."""
        return {"name": self.name, "expected_check": self.expected_check,
                "rejected": self.rejected, "stayed": self.stayed, "reason": self.reason,
                "version_before": self.version_before, "version_after": self.version_after,
                "record": self.record.to_dict()}


def wrong_shard_tamper(path: Path) -> None:
    """Replace the last row of the last layer's ``up_proj`` by the last row of its ``gate_proj``.

    Raises:
        KeyError: the file has no ``mlp.up_proj`` / ``mlp.gate_proj`` weights.
    """
    sd = load_file(str(path))
    layers = sorted({int(k.split(".")[2]) for k in sd if k.startswith("model.layers.")})
    up = f"model.layers.{layers[-1]}.mlp.up_proj.weight"
    gate = f"model.layers.{layers[-1]}.mlp.gate_proj.weight"
    t = sd[up].clone()
    t[-1] = sd[gate][-1]
    sd[up] = t
    save_file(sd, str(path), metadata={"format": "pt"})


def partial_payload(payload: Path, out: Path) -> str:
    """Write ``payload`` without the last layer's ``mlp.down_proj.weight`` to ``out``.

    Returns:
        The name of the tensor left out.

    Raises:
        KeyError: the file has no ``mlp.down_proj`` weight.
    """
    sd = load_file(str(payload))
    layers = sorted({int(k.split(".")[2]) for k in sd if k.startswith("model.layers.")})
    gone = f"model.layers.{layers[-1]}.mlp.down_proj.weight"
    del sd[gone]
    save_file(sd, str(out), metadata={"format": "pt"})
    return gone


def _drop_last(acks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    last = max(int(a["rank"]) for a in acks)
    return [a for a in acks if int(a["rank"]) != last]


def _duplicate_first(acks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    first = min(acks, key=lambda a: int(a["rank"]))
    if len(acks) == 1:
        return [first, dict(first)]
    last = max(int(a["rank"]) for a in acks)
    return [a if int(a["rank"]) != last else dict(first) for a in acks]


def run_probe(sync: WeightSync, name: str, payload: Path) -> ProbeResult:
    """Run one probe against the engine behind ``sync``.

    Args:
        sync: the sampler's install protocol (a version already installed).
        name: one of :data:`PROBES`.
        payload: a valid HF ``model.safetensors`` other than the installed one.

    Raises:
        ValueError: unknown probe name.
    """
    before = sync.version
    kw: dict[str, Any] = {}
    version = before + 1
    weights = payload
    if name == "stale_version":
        version, weights = before, sync.current_dir / "model.safetensors"
    elif name == "wrong_shard":
        kw["tamper"] = wrong_shard_tamper
    elif name == "missing_ack":
        kw["acks_filter"] = _drop_last
    elif name == "duplicate_ack":
        kw["acks_filter"] = _duplicate_first
    elif name == "warm_cache":
        kw["skip_cache_reset"] = True
    elif name == "partial_install":
        weights = sync.workdir / "partial_install.safetensors"
        partial_payload(payload, weights)
    else:
        raise ValueError(f"unknown probe {name!r}; probes are {PROBES}")
    rec = sync.install(weights, version, **kw)
    want = EXPECTED_CHECK[name]
    rolled = rec.rollback is None or bool(rec.rollback.get("verified"))
    return ProbeResult(name=name, expected_check=want,
                       rejected=(not rec.accepted) and rec.check == want,
                       stayed=sync.version == before and rolled and not rec.accepted,
                       reason=rec.reason, version_before=before, version_after=sync.version,
                       record=rec)


def run_probes(sync: WeightSync, payload: Path,
               names: tuple[str, ...] = PROBES,
               on_done: Callable[[ProbeResult], None] | None = None) -> list[ProbeResult]:
    """Run the probes in order (see :func:`run_probe`); ``on_done`` sees each result."""
    out = []
    for n in names:
        r = run_probe(sync, n, payload)
        if on_done is not None:
            on_done(r)
        out.append(r)
    return out
