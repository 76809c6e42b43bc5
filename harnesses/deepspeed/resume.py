"""DeepSpeed checkpoint and resume: ``engine.save_checkpoint`` / ``engine.load_checkpoint``.

The engine's own format: ``save_checkpoint(dir, tag)`` writes the module states of each
model-parallel (AutoTP) rank, the optimizer states (inside the model states file at ZeRO 0
FP32, ``*_optim_states.pt`` files for the BF16 optimizer and ZeRO >= 1), DeepSpeed's step
counters and the client lr scheduler's ``state_dict``; ``load_checkpoint(dir, tag,
load_optimizer_states=True, load_lr_scheduler_states=True)`` in a fresh engine restores them.
RNG states and the round-1 rollout state are not DeepSpeed state:
:mod:`harnesses.resume_state` writes them beside it. ``save_checkpoint`` and
``load_checkpoint`` call collectives on the default group (``dist.barrier()``), so both roles
of a launch checkpoint at the same point (after the same round), each into its own
directory; ``save_latest=False`` and an explicit tag (only global rank 0 would write the
``latest`` file).

Faults (test suite only; ``cell.faults``, the only ones this harness takes), patched in by
:func:`harnesses.deepspeed.faults.install` over :func:`restore_checkpoint`: a load launch
with ``resume_drops_optimizer_state`` calls ``load_checkpoint`` with
``load_optimizer_states=False, load_lr_scheduler_states=False`` (the model only: a fresh
optimizer and scheduler, NeMo-RL #3171); with ``resume_drops_step_counter`` it restores
everything, then sets the inner torch optimizer's ``step`` of every parameter to 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from torch import Tensor

from harnesses import resume_state
from harnesses.deepspeed import state_dict_adapter as sda
from harnesses.resume_state import ResumePlan
from qualify.errors import HarnessError

TAG: Final = "resume"
RECORD: Final = "__record__"
"""Key of a load launch's resume record in the run's ``carry`` (never saved: set after it)."""
FORMAT: Final = ("DeepSpeed engine.save_checkpoint / engine.load_checkpoint (module, optimizer "
                 "and lr scheduler states; load_optimizer_states, load_lr_scheduler_states); "
                 "RNG and rollout state by torch.save beside it")


FAULTS: Final = ("resume_drops_optimizer_state", "resume_drops_step_counter")
"""The faults the DeepSpeed harness can inject (its resume only)."""


def check_faults(names: Sequence[str]) -> None:
    """Refuse a fault this harness cannot inject (a typo must not silently test nothing).

    Raises:
        HarnessError: an unknown fault name.
    """
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        raise HarnessError(f"the deepspeed harness injects only {list(FAULTS)}, got {unknown}")


def inner_optimizer(engine: Any) -> Any:
    """The torch optimizer that holds the Adam state (inside DeepSpeed's wrapper, if any)."""
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def record(engine: Any, et: sda.EngineTensors) -> dict[str, Any]:
    """The live engine's :func:`harnesses.resume_state.state_record` (collective: gathers)."""
    inner = inner_optimizer(engine)
    states = list(inner.state.values())
    steps = [float(st["step"]) for st in states if "step" in st]
    held = any("exp_avg" in st for st in states)
    return resume_state.state_record(
        steps=steps, lrs=[g["lr"] for g in inner.param_groups], scheduler=engine.lr_scheduler,
        master=et.full_masters(), exp_avg=et.full_state("exp_avg") if held else {},
        exp_avg_sq=et.full_state("exp_avg_sq") if held else {})


def save(plan: ResumePlan, *, role: str, writer: bool, engine: Any, et: sda.EngineTensors,
         rollout_state: dict[str, Tensor]) -> None:
    """Checkpoint the role's engine after round ``plan.after_round`` (every rank calls it).

    Args:
        plan: the save plan.
        role: ``actor`` or ``critic`` (its subdirectory).
        writer: TP rank 0 (writes the trainer state file).
        engine: the role's DeepSpeed engine.
        et: its tensor adapter.
        rollout_state: tensors later rounds read (equal on every rank of the role).
    """
    d = plan.role_dir(role)
    saved = record(engine, et)
    engine.save_checkpoint(str(d), tag=TAG, save_latest=False)
    if writer:
        resume_state.write_trainer_state(d / resume_state.TRAINER_STATE_FILE, scheduler=None,
                                         rollout_state=rollout_state, record=saved)


def restore_checkpoint(engine: Any, d: Any) -> None:
    """``engine.load_checkpoint``: module, optimizer and lr scheduler states of tag ``resume``.

    Raises:
        RuntimeError: DeepSpeed found no checkpoint to load.
    """
    path, _client = engine.load_checkpoint(str(d), tag=TAG, load_optimizer_states=True,
                                           load_lr_scheduler_states=True)
    if path is None:
        raise RuntimeError(f"DeepSpeed load_checkpoint found no checkpoint {TAG!r} in {d}")


def load(plan: ResumePlan, *, role: str, engine: Any,
         et: sda.EngineTensors) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Restore the role's fresh engine before round ``plan.after_round + 1``.

    Returns:
        ``(rollout_state, resume record)`` as :func:`harnesses.torch_tp.resume.load`.

    Raises:
        RuntimeError: DeepSpeed found no checkpoint to load.
    """
    d = plan.role_dir(role)
    restore_checkpoint(engine, d)
    state = resume_state.read_trainer_state(d / resume_state.TRAINER_STATE_FILE)
    resume_state.restore_rng(state["rng"])
    loaded = record(engine, et)
    files = [p for p in (d / TAG).rglob("*") if p.is_file()]
    meta = {"after_round": plan.after_round, "format": FORMAT, "saved": state["record"],
            "loaded": loaded, "checkpoint_files": len(files),
            "checkpoint_bytes": sum(p.stat().st_size for p in files)}
    return dict(state["rollout_state"]), meta


def save_after(run: Any, round_: int, engine: Any, et: sda.EngineTensors) -> None:
    """:func:`save` when the run's cell saves after ``round_`` (the harness's ``VariantRun``)."""
    plan = ResumePlan.of(run.cell)
    if plan.saves_after(round_):
        save(plan, role=run.role, writer=run.writer, engine=engine, et=et,
             rollout_state=run.carry)


def restore(run: Any, engine: Any, et: sda.EngineTensors) -> dict[str, Tensor]:
    """A load launch: :func:`load` into ``run`` (its record, its previous ``exp_avg``).

    Returns:
        The saved round-1 state on the run's device; ``{}`` for any other launch.
    """
    plan = ResumePlan.of(run.cell)
    if not plan.loading:
        return {}
    state, run.carry[RECORD] = load(plan, role=run.role, engine=engine, et=et)
    run._prev_exp_avg = et.full_state("exp_avg")  # the clip coefficient's previous moment
    return {k: v.to(run.device) for k, v in state.items()}


def report(run: Any, meta: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """What the writer rank reports: the rounds this launch ran, the meta with its record."""
    record = {"resume": run.carry[RECORD]} if RECORD in run.carry else {}
    return ResumePlan.of(run.cell).keep(run.tensors), {**meta, **record}
