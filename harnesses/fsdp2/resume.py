"""fsdp2 checkpoint and resume: ``torch.distributed.checkpoint`` (DCP) of the model + AdamW.

FSDP2's own format, the way torchtitan's ``components/checkpoint.py`` checkpoints a
``fully_shard``-ed model: ``get_state_dict(model, optimizer)`` gives FQN-keyed (HF name)
state dicts whose entries are the sharded DTensors themselves (the FP32 masters, ``Shard(0)``
over ``dp``, and at TP > 1 also placed over ``tp``; AdamW's ``step``, ``exp_avg`` and
``exp_avg_sq`` placed like their parameter); ``dcp.save`` writes every rank's local shards
plus the global metadata, with the role's process group (its ``tp x dp`` ranks) as the
coordinating group, so the Actor and the Critic checkpoint independently. In the fresh
process ``get_state_dict`` of the new (FSDP2-sharded) model and its fresh AdamW gives the
state dicts to load into (on an empty AdamW ``get_state_dict`` first initialises its
state, a zero-gradient step at lr 0, so the loaded moments and counters have somewhere to
go); ``dcp.load`` fills them in place and ``set_state_dict`` installs them.

Beside DCP, by :mod:`harnesses.resume_state` (TP rank 0 / DP rank 0 writes, every rank
reads): the lr scheduler's ``state_dict``, the torch and Python RNG states, the saved state
record, and the rollout state of the later rounds. The rollout state (round-1 old logprobs
or values, the decoupled-PPO behavior weights) is per DP rank in the run (each rank holds
its rows): it is all-gathered over ``dp`` to the whole batch ``[B, R]`` before it is
written, and each DP rank of the restored run takes its rows back (``rows``).

Every function here is collective over the role's process group.

The test suite's resume faults (:mod:`harnesses.fsdp2.faults`) replace :func:`restore`:
``resume_drops_optimizer_state`` restores the model only (a fresh AdamW, NeMo-RL #3171);
``resume_drops_step_counter`` restores the optimizer and then resets every ``step`` to 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_state_dict,
)

from harnesses import resume_state
from harnesses.fsdp2 import state_dict_adapter as sda
from harnesses.resume_state import ResumePlan

DCP_DIR: Final = "dcp"
FORMAT: Final = ("torch.distributed.checkpoint: dcp.save / dcp.load of get_state_dict(model, "
                 "AdamW) of the fully_shard-ed model (sharded DTensor FP32 masters and AdamW "
                 "state, FQN keys), set_state_dict; lr scheduler, RNG and rollout state "
                 "(all DP rows) by torch.save beside it")


def record(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """The live state's :func:`harnesses.resume_state.state_record`.

    Collective over the role's ranks (full tensors by ``DTensor.full_tensor()``); the model
    must be resharded (between steps).
    """
    steps = [float(st["step"]) for st in optimizer.state.values() if "step" in st]
    held = bool(optimizer.state)
    return resume_state.state_record(
        steps=steps, lrs=[g["lr"] for g in optimizer.param_groups], scheduler=scheduler,
        master=sda.full_params(model),
        exp_avg=sda.full_optimizer_state(model, optimizer, "exp_avg") if held else {},
        exp_avg_sq=sda.full_optimizer_state(model, optimizer, "exp_avg_sq") if held else {})


def save(plan: ResumePlan, *, role: str, writer: bool, group: Any, model: nn.Module,
         optimizer: torch.optim.Optimizer, scheduler: Any,
         rollout_state: Mapping[str, Tensor]) -> None:
    """Checkpoint the role after round ``plan.after_round`` (every rank of the role calls it).

    Args:
        plan: the save plan.
        role: ``actor`` or ``critic`` (its subdirectory).
        writer: DP rank 0, TP rank 0 (writes the trainer state file).
        group: the role's process group (all its ``tp x dp`` ranks).
        model: the role's ``fully_shard``-ed model, resharded.
        optimizer: its AdamW.
        scheduler: its lr scheduler.
        rollout_state: whole-batch tensors ``[B, R]`` FP32 the later rounds read (already
            gathered over ``dp``: equal on every rank of the role).
    """
    d = plan.role_dir(role)
    saved = record(model, optimizer, scheduler)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(d / DCP_DIR),
             process_group=group)
    if writer:
        resume_state.write_trainer_state(d / resume_state.TRAINER_STATE_FILE,
                                         scheduler=scheduler, rollout_state=rollout_state,
                                         record=saved)
    dist.barrier(group=group)


def restore(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: Path, group: Any) -> None:
    """Load the model and AdamW state of the DCP checkpoint ``ckpt`` (collective)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt),
             process_group=group)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def load(plan: ResumePlan, *, role: str, group: Any, model: nn.Module,
         optimizer: torch.optim.Optimizer, scheduler: Any,
         ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Restore the role in a fresh process before round ``plan.after_round + 1``.

    Args:
        plan: the load plan.
        role: ``actor`` or ``critic``.
        group: the role's process group.
        model: the freshly loaded and ``fully_shard``-ed model (resharded).
        optimizer: its fresh AdamW (no state yet).
        scheduler: its fresh lr scheduler.

    Returns:
        ``(rollout_state, resume record)``: the saved whole-batch rollout tensors (CPU),
        and the role meta's ``resume`` entry (``after_round``, ``format``, ``saved`` and
        ``loaded`` state records, the checkpoint's files and bytes).

    Raises:
        FileNotFoundError: no trainer state file beside the checkpoint (DCP raises its own
            error for a missing checkpoint).
    """
    d = plan.role_dir(role)
    ckpt = d / DCP_DIR
    restore(model, optimizer, ckpt, group)
    state = resume_state.read_trainer_state(d / resume_state.TRAINER_STATE_FILE)
    if state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    resume_state.restore_rng(state["rng"])
    loaded = record(model, optimizer, scheduler)
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    meta = {"after_round": plan.after_round, "format": FORMAT, "saved": state["record"],
            "loaded": loaded, "checkpoint_files": len(files),
            "checkpoint_bytes": sum(p.stat().st_size for p in files)}
    return dict(state["rollout_state"]), meta


def checkpoint_path(plan: ResumePlan, role: str) -> Path:
    """Where the role's DCP checkpoint lies."""
    return plan.dir / role / DCP_DIR
