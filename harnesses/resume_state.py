"""What every trainer harness shares to resume a cell: the plan, the state record, RNG.

A resume cell (:mod:`qualify.candidate.resume_stage`) is two launches of the same
topology. The ``save`` launch runs rounds ``1..k`` and checkpoints in the engine's own
format (``harnesses/<engine>/resume.py``); the ``load`` launch, a fresh interpreter, loads
it and runs rounds ``k + 1..rounds``. This module holds what does not depend on the
engine:

- :class:`ResumePlan`: ``cell.json`` ``resume`` read once (which rounds run, when to save);
- :func:`state_record`: the quantities a correct resume must carry over, measured on the
  live engine objects (optimizer step counters, lr, scheduler position, digests of the
  FP32 master weights and of both Adam moments, the RNG digest). The ``save`` launch
  measures it right before it checkpoints, the ``load`` launch right after it restored,
  before round ``k + 1`` draws anything; the role's ``outputs.json`` ``resume`` holds both
  (``qualify.compare.resume`` turns each quantity into a row);
- :func:`write_trainer_state` / :func:`read_trainer_state`: the state no engine checkpoint
  holds (the lr scheduler's ``state_dict``, the torch and Python RNG states, the round-1
  old logprobs / values the clipped objectives of later rounds use, the saved record), one
  ``torch.save`` file per role written by its TP rank 0 and read by every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import torch
from torch import Tensor

from qualify.protocol import HarnessCell, parse_tensor_name

TRAINER_STATE_FILE: Final = "trainer_state.pt"
"""Per role, beside the engine's checkpoint: scheduler, RNG, rollout state, saved record."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ResumePlan:
    """``cell.json`` ``resume``, read once.

    Attributes:
        phase: ``None`` (an uninterrupted cell), ``save`` or ``load``.
        after_round: the round after which the checkpoint is taken (``k``).
        dir: the checkpoint directory (one subdirectory per role).
    """

    phase: str | None = None
    after_round: int = 0
    dir: Path = Path()

    @classmethod
    def of(cls, cell: HarnessCell) -> ResumePlan:
        """The plan of ``cell`` (``phase=None`` without ``resume``)."""
        r = cell.resume
        if r is None:
            return cls()
        return cls(phase=str(r["phase"]), after_round=int(r["after_round"]), dir=Path(r["dir"]))

    @property
    def loading(self) -> bool:
        """This launch restores the checkpoint before its first round."""
        return self.phase == "load"

    def rounds(self, total: int) -> range:
        """The rounds this launch runs: ``1..k`` (save), ``k + 1..total`` (load), else all."""
        if self.phase == "save":
            return range(1, self.after_round + 1)
        if self.phase == "load":
            return range(self.after_round + 1, total + 1)
        return range(1, total + 1)

    def saves_after(self, round_: int) -> bool:
        """Whether the checkpoint is written after round ``round_``."""
        return self.phase == "save" and round_ == self.after_round

    def role_dir(self, role: str) -> Path:
        """The role's checkpoint directory (created)."""
        d = self.dir / role
        d.mkdir(parents=True, exist_ok=True)
        return d

    def keep(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The tensors a ``load`` launch reports: those of the rounds it ran (all otherwise)."""
        if not self.loading:
            return dict(tensors)
        return {k: v for k, v in tensors.items() if parse_tensor_name(k)[0] > self.after_round}


def tensors_digest(tensors: Mapping[str, Tensor]) -> str | None:
    """sha256 over ``name, shape, FP32 bytes`` of every tensor, in name order.

    Args:
        tensors: full (unsharded) tensors by HF name; empty -> ``None`` (nothing held).
    """
    if not tensors:
        return None
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}:{tuple(t.shape)}:".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def rng_digest() -> str:
    """sha256 of the torch CPU RNG state and Python's ``random`` state (and CUDA's, if any)."""
    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    h.update(repr(random.getstate()).encode())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        h.update(torch.cuda.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    """The RNG states :func:`restore_rng` puts back (torch CPU, Python, CUDA if initialised)."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back the states of :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def state_record(*, steps: list[float], lrs: list[float], scheduler: Any,
                 master: Mapping[str, Tensor], exp_avg: Mapping[str, Tensor],
                 exp_avg_sq: Mapping[str, Tensor]) -> dict[str, Any]:
    """The quantities a correct resume carries over, as JSON (``outputs.json`` ``resume``).

    Args:
        steps: the optimizer's step counter of every parameter with state (empty: none).
        lrs: ``param_groups[*]["lr"]`` (the lr the next step applies).
        scheduler: the lr scheduler (``last_epoch``, ``get_last_lr()``), or ``None``.
        master: full FP32 master weights by HF name.
        exp_avg: full Adam first moments by HF name (empty: the optimizer holds none).
        exp_avg_sq: full Adam second moments by HF name (empty: none held).

    Returns:
        ``{"step": {"min", "max"} | None, "lr": [...], "scheduler_last_epoch": int | None,
        "master_weights": sha256, "exp_avg": sha256 | None, "exp_avg_sq": sha256 | None,
        "rng_state": sha256}``.
    """
    return {
        "step": {"min": min(steps), "max": max(steps)} if steps else None,
        "lr": [float(x) for x in lrs],
        "scheduler_last_epoch": int(scheduler.last_epoch) if scheduler is not None else None,
        "master_weights": tensors_digest(master),
        "exp_avg": tensors_digest(exp_avg),
        "exp_avg_sq": tensors_digest(exp_avg_sq),
        "rng_state": rng_digest(),
    }


def write_trainer_state(path: Path, *, scheduler: Any, rollout_state: Mapping[str, Tensor],
                        record: Mapping[str, Any]) -> None:
    """Write the role's non-engine state (``torch.save``, temp file + rename).

    Args:
        path: ``<role dir>/`` :data:`TRAINER_STATE_FILE`.
        scheduler: the lr scheduler (its ``state_dict()``), or ``None``.
        rollout_state: tensors the later rounds read (round-1 old logprobs / values...).
        record: the saved :func:`state_record`.
    """
    doc = {"scheduler": scheduler.state_dict() if scheduler is not None else None,
           "rng": rng_state(),
           "rollout_state": {k: v.detach().cpu().clone() for k, v in rollout_state.items()},
           "record": dict(record)}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(doc, tmp)
    tmp.replace(path)


def read_trainer_state(path: Path) -> dict[str, Any]:
    """Read :func:`write_trainer_state`'s file (``weights_only``: tensors, dicts, tuples)."""
    doc: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return doc
