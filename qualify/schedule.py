"""The contract's learning-rate schedule: the lr used by optimizer step ``s`` (1-based).

The reference's own formula (no engine is imported; harnesses use their engine's scheduler
and report the lr they applied, the comparator checks it against what this gives).

Semantics (HF transformers ``get_scheduler``, transformers 4.x ``optimization.py``:
``get_constant_schedule``, ``get_linear_schedule_with_warmup``,
``get_cosine_with_min_lr_schedule_with_warmup`` with ``num_cycles = 0.5``): a ``LambdaLR``
multiplies the base lr by ``lambda(c)``, where ``c`` is the scheduler's step count. The
scheduler is built before the first optimizer step (``lambda(0)`` is set at construction)
and stepped after each optimizer step, so **optimizer step s uses c = s - 1**. With
``W = warmup_steps``, ``T = total_steps``, ``r = min_lr_ratio``:

- ``constant``: ``lambda(c) = 1``;
- warmup (``linear`` and ``cosine``, ``c < W``): ``lambda(c) = c / W`` (HF: warmup starts at
  0, so a contract with ``W > 0`` takes a zero step 1);
- ``linear`` (``c >= W``): ``lambda(c) = r + (1 - r) * (T - c) / (T - W)`` (HF's linear
  decay to ``r = 0``; Megatron-Core ``OptimizerParamScheduler`` ``linear`` decays to
  ``min_lr = r * lr`` by the same line);
- ``cosine`` (``c >= W``): ``p = (c - W) / (T - W)``,
  ``lambda(c) = r + (1 - r) * 0.5 * (1 + cos(pi * p))`` (HF ``min_lr_rate = r``).

The contract requires ``W < T`` and ``rounds <= T`` (:mod:`qualify.contract`), so every
step of a run has ``c <= T - 1``: ``p < 1``, no clamping, where engines' behaviour after
the horizon differs (HF's cosine rises again, Megatron's holds ``min_lr``) never matters.
The lr is ``base_lr * lambda(c)`` in Python float (IEEE FP64).
"""

from __future__ import annotations

import math
from typing import Any, Final

__all__ = ["LR_SCHEDULES", "lr_at", "lr_factor", "lr_of", "rounds_problem", "schedule_problem"]

LR_SCHEDULES: Final = ("constant", "linear", "cosine")


def lr_factor(schedule: str, step: int, *, warmup_steps: int = 0, total_steps: int | None = None,
              min_lr_ratio: float = 0.0) -> float:
    """``lambda(s - 1)``: the multiplier of the base lr for optimizer step ``step``.

    Args:
        schedule: one of :data:`LR_SCHEDULES`.
        step: the optimizer step, 1-based (round ``r`` of the protocol is step ``r``).
        warmup_steps: ``W >= 0`` (linear / cosine only).
        total_steps: ``T > W`` (linear / cosine; ignored for constant).
        min_lr_ratio: ``r`` in ``[0, 1]``, the factor the decay ends at (step ``T + 1``).

    Returns:
        The factor (a Python float).

    Raises:
        ValueError: an unknown schedule, ``step < 1``, ``W < 0``, ``T <= W`` or ``T`` absent,
            a step beyond ``T``, or ``r`` outside ``[0, 1]``.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule: {schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
    if step < 1:
        raise ValueError(f"step {step}: optimizer steps are 1-based")
    if schedule == "constant":
        return 1.0
    if total_steps is None or warmup_steps < 0 or total_steps <= warmup_steps:
        raise ValueError(f"lr_schedule {schedule!r}: needs 0 <= warmup_steps < total_steps "
                         f"(got {warmup_steps}, {total_steps})")
    if step > total_steps:
        raise ValueError(f"step {step}: beyond total_steps = {total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio {min_lr_ratio}: not in [0, 1]")
    c, w, t, r = step - 1, warmup_steps, total_steps, min_lr_ratio
    if c < w:
        return c / w
    if schedule == "linear":
        return r + (1.0 - r) * (t - c) / (t - w)
    return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * (c - w) / (t - w)))


def lr_at(base_lr: float, schedule: str, step: int, *, warmup_steps: int = 0,
          total_steps: int | None = None, min_lr_ratio: float = 0.0) -> float:
    """The lr of optimizer step ``step`` (1-based): ``base_lr * lr_factor(...)``.

    Raises:
        ValueError: as :func:`lr_factor`.
    """
    return base_lr * lr_factor(schedule, step, warmup_steps=warmup_steps,
                               total_steps=total_steps, min_lr_ratio=min_lr_ratio)


def lr_of(spec: Any, role: str, step: int) -> float:
    """The lr of ``role``'s optimizer step ``step`` under a contract's ``[optimizer]``.

    Args:
        spec: a :class:`qualify.contract.OptimizerSpec` (``actor_lr`` / ``critic_lr``,
            ``lr_schedule``, ``warmup_steps``, ``total_steps``, ``min_lr_ratio``).
        role: ``actor`` or ``critic``.
        step: 1-based optimizer step.

    Raises:
        ValueError: as :func:`lr_factor`.
    """
    base = spec.actor_lr if role == "actor" else spec.critic_lr
    return lr_at(base, spec.lr_schedule, step, warmup_steps=spec.warmup_steps,
                 total_steps=spec.total_steps, min_lr_ratio=spec.min_lr_ratio)


def schedule_problem(spec: Any) -> str | None:
    """What is wrong with a contract's ``[optimizer]`` schedule settings, else ``None``.

    ``constant`` takes none of ``warmup_steps`` / ``total_steps`` / ``min_lr_ratio`` (they
    would be ignored); ``linear`` / ``cosine`` need ``total_steps`` above ``warmup_steps``.
    (The schema checks types and ranges; :func:`rounds_problem` the rounds.)

    Args:
        spec: a :class:`qualify.contract.OptimizerSpec`.

    Returns:
        A one-line message naming the ``optimizer.<field>``, or ``None``.
    """
    if spec.lr_schedule == "constant":
        for name, default in (("warmup_steps", 0), ("total_steps", None),
                              ("min_lr_ratio", 0.0)):
            if getattr(spec, name) != default:
                return (f"optimizer.{name}: set with lr_schedule = 'constant' (it would be "
                        "ignored); use 'linear' or 'cosine'")
        return None
    if spec.total_steps is None:
        return f"optimizer.total_steps: required with lr_schedule = {spec.lr_schedule!r}"
    if spec.warmup_steps >= spec.total_steps:
        return (f"optimizer.warmup_steps: {spec.warmup_steps} must be below "
                f"optimizer.total_steps = {spec.total_steps}")
    if spec.min_lr_ratio >= 1.0:
        # A decay to the lr itself is no decay; transformers' polynomial decay (the linear
        # schedule's engine mapping) refuses lr_end == lr with a ValueError.
        return (f"optimizer.min_lr_ratio: 1 with lr_schedule = {spec.lr_schedule!r} decays "
                "to the lr itself (no decay); use a ratio below 1 or lr_schedule = 'constant'")
    return None


def rounds_problem(spec: Any, rounds: int) -> str | None:
    """The message when ``optimizer.total_steps`` is below ``algorithm.rounds``, else None."""
    total = spec.total_steps
    if total is not None and rounds > total:
        return (f"optimizer.total_steps: {total} is below algorithm.rounds = {rounds} (the "
                "schedule must cover every step)")
    return None
