"""torch_tp checkpoint and resume: ``torch.distributed.checkpoint`` (DCP) of model + AdamW.

The model and optimizer state are saved and restored the way PyTorch documents for
DTensor-sharded training (torchtitan's ``CheckpointManager`` does the same):
``get_state_dict(model, optimizer)`` gives FQN-keyed state dicts whose sharded entries are
DTensors; ``dcp.save`` writes every rank's shards (with the role's TP group as the
coordinating process group, so the Actor and the Critic checkpoint independently);
``dcp.load`` reads them back in place into the fresh process's state dicts and
``set_state_dict`` installs them (``get_state_dict`` first initialises an empty AdamW's
state, so the loaded ``step``, ``exp_avg`` and ``exp_avg_sq`` have somewhere to go). The lr
scheduler, the RNG states and the rollout state of the later rounds are not DCP state:
:mod:`harnesses.resume_state` writes them beside it.

Every function here is collective over the role's TP group.

The test suite's resume faults (:mod:`harnesses.torch_tp.faults`) replace :func:`restore`:
``resume_drops_optimizer_state`` restores the model only (a fresh AdamW, NeMo-RL #3171);
``resume_drops_step_counter`` restores the optimizer and then resets every ``step`` to 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_state_dict,
)

from harnesses import resume_state
from harnesses.resume_state import ResumePlan
from harnesses.torch_tp import state_dict_adapter as sda

DCP_DIR: Final = "dcp"
FORMAT: Final = ("torch.distributed.checkpoint: dcp.save / dcp.load of get_state_dict(model, "
                 "AdamW) (DTensor shards, FQN keys), set_state_dict; lr scheduler, RNG and "
                 "rollout state by torch.save beside it")


def record(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """The live state's :func:`harnesses.resume_state.state_record` (collective: full tensors)."""
    steps = [float(st["step"]) for st in optimizer.state.values() if "step" in st]
    held = bool(optimizer.state)
    return resume_state.state_record(
        steps=steps, lrs=[g["lr"] for g in optimizer.param_groups], scheduler=scheduler,
        master=sda.full_params(model),
        exp_avg=sda.full_optimizer_state(model, optimizer, "exp_avg") if held else {},
        exp_avg_sq=sda.full_optimizer_state(model, optimizer, "exp_avg_sq") if held else {})


def save(plan: ResumePlan, *, role: str, writer: bool, group: Any, model: nn.Module,
         optimizer: torch.optim.Optimizer, scheduler: Any,
         rollout_state: dict[str, Tensor]) -> None:
    """Checkpoint the role after round ``plan.after_round``.

    Args:
        plan: the save plan.
        role: ``actor`` or ``critic`` (its subdirectory).
        writer: TP rank 0 (writes the trainer state file).
        group: the role's TP process group.
        model: the role's DTensor-parallel model.
        optimizer: its AdamW.
        scheduler: its lr scheduler.
        rollout_state: tensors later rounds read (equal on every rank of the role).
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
    torch.distributed.barrier(group=group)


def load(plan: ResumePlan, *, role: str, group: Any, model: nn.Module,
         optimizer: torch.optim.Optimizer, scheduler: Any,
         ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Restore the role in a fresh process before round ``plan.after_round + 1``.

    Returns:
        ``(rollout_state, resume record)``: the saved rollout tensors, and the role meta's
        ``resume`` entry (``after_round``, ``format``, ``saved`` and ``loaded`` state
        records, the checkpoint's files and bytes).
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


def restore(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: Path, group: Any) -> None:
    """Load the model and AdamW state of the DCP checkpoint ``ckpt`` (collective)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt),
             process_group=group)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def checkpoint_path(plan: ResumePlan, role: str) -> Path:
    """Where the role's DCP checkpoint lies."""
    return plan.dir / role / DCP_DIR
