"""Run one update run of the reference stage alone, for its peak memory (docs/scale.md).

Usage: ``python scripts/repro/plan_step.py CONTRACT DIR LANE CONTROL [OUT.safetensors]``

``DIR`` is a reference directory (sealed or interrupted) holding the rollout and
``train_inputs.safetensors``; ``CONTROL`` is a control name of
:func:`qualify.reference.controls.control_settings` for ``LANE``, or ``reference`` for the
lane's own update. Runs :func:`qualify.reference.stage._update_run` exactly as the stage does
(fresh models from the prepared bundle) and nothing else, so a process-level peak RSS
(``scripts/repro/rss_trace.py``) is that step's peak plus the interpreter, to set beside
``qualify plan``'s prediction for the step.

The run is placed as the stage places it: on the devices of ``$QUALIFY_REFERENCE_DEVICES``,
planned under ``$QUALIFY_REFERENCE_DEVICE_MEMORY`` when set, with the AdamW state where the
stage's plan check puts it and the gradients streamed when it says so
(``qualify.reference.stage._plan_check``, not enforced: a step is
run even when another step would not fit). ``OUT.safetensors``, when given, receives the
run's tensors as the stage computes them (for the lane's own update, what it seals in
``reference/`` without the reward scores), to compare with a sealed or interrupted
reference's file; the choice of devices and state is printed.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from qualify.contract import load_contract
from qualify.lanes import lane_bf16_mode, lane_precision
from qualify.models import bundle as models
from qualify.reference import devices, rollout
from qualify.reference.controls import control_settings
from qualify.reference.stage import _batch, _plan_check, _update_run
from qualify.reference.update import UpdateSettings


def main() -> int:
    """Run the named update run; print its label."""
    contract = load_contract(Path(sys.argv[1]))
    directory, lane, control = Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    bundle = models.prepare_models(contract)
    roll = rollout.Rollout.load(directory)
    train = load_file(str(directory / "train_inputs.safetensors"))
    batch = _batch(roll, train, bundle.pad_token_id)
    if control == "reference":
        settings = UpdateSettings(precision="bf16" if lane_precision(lane) == "bf16" else "fp32",
                                  bf16_mode=lane_bf16_mode(lane),
                                  micro_batch_size=contract.algorithm.micro_batch_size,
                                  label=f"hf-{lane}")
        attn = "sdpa"
    else:
        settings, attn = control_settings(contract, lane)[control]
    placed = devices.resolve()
    record = _plan_check(contract, False, placed, devices.device_memory())
    if placed is not None and record["optimizer_state"] == "host":
        placed = dataclasses.replace(placed, optimizer_state="host",
                                     gradients=record["gradients"],
                                     round2_state=record["round2_state"])
    with devices.active(placed) as where:
        tensors, _ = _update_run(contract, bundle, batch, settings, attn)
    if len(sys.argv) > 5:
        save_file({k: v.contiguous() for k, v in tensors.items()}, sys.argv[5])
    print(f"plan_step: ran {settings.label} ({attn}) on {where['kind']} devices "
          f"{[d['device'] for d in where['devices']]}, AdamW state "
          f"{where.get('optimizer_state', 'device')}, gradients "
          f"{where.get('gradients', 'device')}, placed {where['placed']}, "
          f"noted {where.get('memory')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
