"""Deliberate resume bugs for the test suite (the Megatron harness's only faults).

Never active in a real run (``cell.faults`` is empty). :func:`install` patches
:func:`harnesses.megatron.resume.restore_checkpoint` in the launch's process; the names
(the same as :mod:`harnesses.torch_tp.faults`'s, so one test shape serves every engine) are
checked by :func:`harnesses.megatron.resume.check_faults`:

- ``resume_drops_optimizer_state``: a resumed launch restores the model only, as
  Megatron-LM's ``load_checkpoint`` does under ``--no-load-optim``: neither
  ``optimizer.load_state_dict`` nor ``opt_param_scheduler.load_state_dict`` runs, and
  ``optimizer.reload_model_params()`` refreshes the FP32 master copies of the BF16 model
  parameters from the loaded weights (NeMo-RL #3171's shape: no moments, no step counters,
  the scheduler at step 0).
- ``resume_drops_step_counter``: a resumed launch restores the optimizer, then resets the
  ``step`` of every parameter of every inner ``torch.optim.AdamW`` to 0, so the next step's
  bias correction is the first step's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from harnesses.faults import reset_step_counters
from harnesses.megatron import resume


def install(names: Sequence[str]) -> None:
    """Patch the named faults into this process (a test-only plugin).

    Raises:
        HarnessError: an unknown fault name.
    """
    resume.check_faults(names)
    restore = resume.restore_checkpoint
    if "resume_drops_optimizer_state" in names:

        def model_only(engine: Any, doc: dict[str, Any]) -> None:
            del doc  # Megatron-LM's --no-load-optim path
            with engine.placement():
                engine.optimizer.reload_model_params()

        restore = model_only
    if "resume_drops_step_counter" in names:
        inner = restore

        def reset_steps(engine: Any, doc: dict[str, Any]) -> None:
            inner(engine, doc)
            for opt in resume.inner_optimizers(engine):
                reset_step_counters(opt)

        restore = reset_steps
    resume.restore_checkpoint = restore
