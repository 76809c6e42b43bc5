"""Run one update run of the reference stage alone, for its peak memory (docs/scale.md).

Usage: ``python scripts/repro/plan_step.py CONTRACT DIR LANE CONTROL``

``DIR`` is a reference directory (sealed or interrupted) holding the rollout and
``train_inputs.safetensors``; ``CONTROL`` is a control name of
:func:`qualify.reference.controls.control_settings` for ``LANE``, or ``reference`` for the
lane's own update. Runs :func:`qualify.reference.stage._update_run` exactly as the stage does
(fresh models from the prepared bundle) and nothing else, so a process-level peak RSS
(``scripts/repro/rss_trace.py``) is that step's peak plus the interpreter, to set beside
``qualify plan``'s prediction for the step.
"""

from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import load_file

from qualify.contract import load_contract
from qualify.lanes import lane_bf16_mode, lane_precision
from qualify.models import bundle as models
from qualify.reference import rollout
from qualify.reference.controls import control_settings
from qualify.reference.stage import _batch, _update_run
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
    _update_run(contract, bundle, batch, settings, attn)
    print(f"plan_step: ran {settings.label} ({attn})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
