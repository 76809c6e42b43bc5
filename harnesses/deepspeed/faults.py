"""Deliberate bugs for the test suite (its resume only): each must be caught by the comparator.

Never active in a real run (``cell.faults`` is empty). :func:`install` patches
:func:`harnesses.deepspeed.resume.restore_checkpoint` in the launch's process; the names are
checked by :func:`harnesses.deepspeed.resume.check_faults`:

- ``resume_drops_optimizer_state``: ``load_checkpoint`` with ``load_optimizer_states=False,
  load_lr_scheduler_states=False`` (the module only: a fresh optimizer and scheduler,
  NeMo-RL #3171);
- ``resume_drops_step_counter``: everything restored, then the inner torch optimizer's
  ``step`` of every parameter set to 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harnesses.deepspeed import resume
from harnesses.faults import reset_step_counters


def install(names: Sequence[str]) -> None:
    """Patch the named faults into this process (a test-only plugin).

    Raises:
        HarnessError: an unknown fault name.
    """
    resume.check_faults(names)
    restore = resume.restore_checkpoint
    if "resume_drops_optimizer_state" in names:

        def model_only(engine: Any, d: Any) -> None:
            path, _client = engine.load_checkpoint(str(d), tag=resume.TAG,
                                                   load_optimizer_states=False,
                                                   load_lr_scheduler_states=False)
            if path is None:
                raise RuntimeError(f"DeepSpeed load_checkpoint found no checkpoint in {d}")

        restore = model_only
    if "resume_drops_step_counter" in names:
        inner = restore

        def reset_steps(engine: Any, d: Any) -> None:
            inner(engine, d)
            reset_step_counters(resume.inner_optimizer(engine))

        restore = reset_steps
    resume.restore_checkpoint = restore
