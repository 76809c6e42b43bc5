"""Megatron-Core checkpoint and resume: megatron-core's non-distributed (legacy) format.

What a resume cell's ``save`` launch writes, per role and TP rank, is the file Megatron-LM's
legacy ``save_checkpoint`` (``--ckpt-format torch``) writes,
``<role>/mp_rank_XX/model_optim_rng.pt``, with megatron-core's own state dicts:

- ``model``: ``DistributedDataParallel.state_dict_for_save_checkpoint()`` (this rank's TP
  shard of every parameter; BF16 in BF16 cells, through ``Float16Module``);
- ``optimizer``: ``MegatronOptimizer.state_dict()`` (``FP32Optimizer``: the inner AdamW's
  ``state_dict``; ``Float16OptimizerWithFloat16Params``: that plus
  ``fp32_from_fp16_params``, the FP32 master weights);
- ``opt_param_scheduler``: ``OptimizerParamScheduler.state_dict()`` (``num_steps``, lr and
  wd settings);
- ``rng_state``: Python, NumPy, torch CPU (and CUDA) RNG states and the tensor-parallel RNG
  tracker's states, as Megatron-LM's ``get_rng_state``;
- ``iteration`` (``k``) and ``checkpoint_version`` 3.0.

The ``load`` launch, a fresh process, restores them in Megatron-LM's ``load_checkpoint``
order: ``model.load_state_dict(strict=True)``, ``optimizer.load_state_dict``,
``opt_param_scheduler.load_state_dict`` (which steps the fresh scheduler by ``num_steps``
and so sets the next lr), then the RNG states. The round-1 rollout state and the saved
state record are not Megatron state: :mod:`harnesses.resume_state` writes them beside it.

Why not ``megatron.core.dist_checkpointing`` (measured with megatron-core 0.16.1 on CPU,
gloo, README "Resume"): ``model.sharded_state_dict(metadata={"dp_cp_group": ...})`` and
``optimizer.sharded_state_dict(model_sd)`` build, but ``dist_checkpointing.save`` stops in
``strategies/filesystem_async.py:230`` ``FileSystemWriterAsync.preload_tensors``:
``torch.cuda.synchronize()`` (called with ``non_blocking=True`` hard-coded at line 207),
``AssertionError: Torch not compiled with CUDA enabled``.

Every function here is collective over the role's TP group (the state record gathers).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from harnesses import resume_state
from harnesses.resume_state import ResumePlan
from qualify.errors import HarnessError

FAULTS: Final = ("resume_drops_optimizer_state", "resume_drops_step_counter")
"""The planted resume faults :mod:`harnesses.megatron.faults` patches in (test suite)."""
CHECKPOINT_FILE: Final = "model_optim_rng.pt"
CHECKPOINT_VERSION: Final = 3.0
FORMAT: Final = ("megatron-core non-distributed checkpoint, Megatron-LM legacy layout "
                 "mp_rank_XX/model_optim_rng.pt: model.state_dict_for_save_checkpoint(), "
                 "MegatronOptimizer.state_dict(), OptimizerParamScheduler.state_dict(), RNG "
                 "states; load_state_dict of each; rollout state by torch.save beside it")


class SchedulerPosition:
    """``OptimizerParamScheduler`` as :func:`harnesses.resume_state.state_record` reads it.

    Megatron's scheduler counts optimizer steps in ``num_steps`` (0 after ``__init__``'s
    ``step(0)``, ``k`` after ``k`` ``step(increment=1)``); the record's ``last_epoch`` is
    that position. ``state_dict`` is the scheduler's own.

    Args:
        scheduler: the ``OptimizerParamScheduler``.
    """

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    @property
    def last_epoch(self) -> int:
        """The scheduler's ``num_steps``."""
        return int(self.scheduler.num_steps)


def rank_dir(plan: ResumePlan, role: str, tp_rank: int) -> Path:
    """``<dir>/<role>/mp_rank_XX`` (created), as Megatron-LM names a TP rank's checkpoint."""
    d = plan.role_dir(role) / f"mp_rank_{tp_rank:02d}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def check_faults(names: Any) -> None:
    """Refuse a fault name this harness does not plant (a typo must not test nothing).

    Raises:
        HarnessError: an unknown name.
    """
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        raise HarnessError(f"unknown fault(s) {unknown}; megatron knows {list(FAULTS)}")


def inner_optimizers(engine: Any) -> list[Any]:
    """The ``torch.optim`` optimizers inside the engine's ``MegatronOptimizer`` (chained)."""
    return [o.optimizer for o in engine.optimizers()]


def restore_checkpoint(engine: Any, doc: dict[str, Any]) -> None:
    """Megatron-LM's ``load_checkpoint`` of the optimizer and scheduler state in ``doc``.

    ``optimizer.load_state_dict`` (under the CPU placement), then
    ``opt_param_scheduler.load_state_dict`` (which steps the fresh scheduler by
    ``num_steps``). :mod:`harnesses.megatron.faults` replaces this function in a test
    launch.
    """
    with engine.placement():
        engine.optimizer.load_state_dict(doc["optimizer"])
    engine.scheduler.load_state_dict(doc["opt_param_scheduler"])


def record(engine: Any) -> dict[str, Any]:
    """The live state's :func:`harnesses.resume_state.state_record` (collective: gathers).

    Args:
        engine: the role's :class:`harnesses.megatron.train.MegatronEngine` (its
            ``optimizer``, ``scheduler``, master weights and Adam state by Megatron name,
            ``full_hf``).

    Returns:
        The record; ``exp_avg`` / ``exp_avg_sq`` are ``None`` while the optimizer holds no
        state for some parameter (a fresh optimizer).
    """
    masters = engine.masters()
    states = [st for opt in inner_optimizers(engine) for st in opt.state.values()]
    steps = [float(st["step"]) for st in states if "step" in st]
    local = {k: len(engine.state(k)) == len(masters) for k in ("exp_avg", "exp_avg_sq")}
    held = {}
    for key, full in local.items():  # every TP rank must agree before gathering
        flag = torch.tensor([int(full)], device=engine.device)  # NCCL: on the device
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=engine.groups.tp_group)
        held[key] = engine.full_hf(engine.state(key)) if int(flag) else {}
    return resume_state.state_record(
        steps=steps, lrs=[g["lr"] for g in engine.optimizer.param_groups],
        scheduler=SchedulerPosition(engine.scheduler),
        master=engine.full_hf(masters), exp_avg=held["exp_avg"],
        exp_avg_sq=held["exp_avg_sq"])


def rng_state() -> dict[str, Any]:
    """Megatron-LM's ``get_rng_state`` of this rank (CUDA only when initialised)."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    out: dict[str, Any] = {"random_rng_state": random.getstate(),
                           "np_rng_state": np.random.get_state(),
                           "torch_rng_state": torch.get_rng_state(),
                           "rng_tracker_states": tracker.get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_rng_state"] = torch.cuda.get_rng_state()
    return out


def restore_rng(state: dict[str, Any]) -> None:
    """Put back :func:`rng_state`'s states (Megatron-LM's ``load_checkpoint`` order)."""
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def save(plan: ResumePlan, engine: Any, rollout_state: dict[str, Tensor]) -> None:
    """Checkpoint the role after round ``plan.after_round`` (every rank of the role).

    Each TP rank writes its ``mp_rank_XX/model_optim_rng.pt`` (``torch.save``, temp file +
    rename); TP rank 0 writes the role's trainer state (rollout state, saved record).

    Args:
        plan: the save plan.
        engine: the role's :class:`harnesses.megatron.train.MegatronEngine`.
        rollout_state: tensors later rounds read (equal on every rank of the role).
    """
    saved = record(engine)
    with engine.placement():
        optim_sd = engine.optimizer.state_dict()
    doc = {"model": engine.ddp.state_dict_for_save_checkpoint(), "optimizer": optim_sd,
           "opt_param_scheduler": engine.scheduler.state_dict(), "rng_state": rng_state(),
           "iteration": plan.after_round, "checkpoint_version": CHECKPOINT_VERSION}
    path = rank_dir(plan, engine.role, engine.groups.tp_rank) / CHECKPOINT_FILE
    tmp = path.with_name(path.name + ".tmp")
    torch.save(doc, tmp)
    tmp.replace(path)
    if engine.groups.tp_rank == 0:
        resume_state.write_trainer_state(
            plan.role_dir(engine.role) / resume_state.TRAINER_STATE_FILE, scheduler=None,
            rollout_state=rollout_state, record=saved)
    dist.barrier(group=engine.groups.tp_group)


def load(plan: ResumePlan, engine: Any) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Restore the role in a fresh process before round ``plan.after_round + 1``.

    Args:
        plan: the load plan.
        engine: the role's fresh :class:`harnesses.megatron.train.MegatronEngine`.

    Returns:
        ``(rollout_state, resume record)``: the saved rollout tensors (CPU), and the role
        meta's ``resume`` entry (``after_round``, ``format``, ``saved`` and ``loaded`` state
        records, the role's checkpoint files and bytes).

    Raises:
        FileNotFoundError: this rank's checkpoint file is missing.
        RuntimeError: ``load_state_dict`` found missing or unexpected keys (strict).
    """
    d = plan.role_dir(engine.role)
    path = rank_dir(plan, engine.role, engine.groups.tp_rank) / CHECKPOINT_FILE
    # The engine's own pickle (RNG tuples, NumPy state), as Megatron-LM loads it.
    doc = torch.load(path, map_location="cpu", weights_only=False)
    engine.ddp.load_state_dict(doc["model"], strict=True)
    restore_checkpoint(engine, doc)
    restore_rng(doc["rng_state"])
    state = resume_state.read_trainer_state(d / resume_state.TRAINER_STATE_FILE)
    loaded = record(engine)
    files = [p for p in d.rglob("*") if p.is_file()
             and p.name != resume_state.TRAINER_STATE_FILE]
    meta = {"after_round": plan.after_round, "format": FORMAT, "saved": state["record"],
            "loaded": loaded, "checkpoint_files": len(files),
            "checkpoint_bytes": sum(p.stat().st_size for p in files)}
    return dict(state["rollout_state"]), meta
