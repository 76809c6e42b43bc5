"""Peak RSS of one reference-update run (actor + critic, every round) of a sealed reference.

Usage: ``python scripts/repro/fp64_control_peak.py REF_DIR fp64|fp32|bf16 OUT.pt``; the
tensors go to ``OUT.pt`` so two code states can be compared bitwise (run the older one from
``git worktree add /tmp/old COMMIT`` with ``PYTHONPATH=/tmp/old``). Measured 2026-12-03 on
SmolLM2-135M's sealed reference, FP64 control: 8.77 GB peak RSS at 1067e06, 7.77 GB at
5a77fc8, the same tensors bitwise (README.md).
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import torch
from safetensors.numpy import load_file

from qualify.compare.stage import _load_contract
from qualify.models import bundle as models
from qualify.reference.rollout import Rollout
from qualify.reference.stage import _batch, _update_run
from qualify.reference.update import UpdateSettings

ref, prec = Path(sys.argv[1]), sys.argv[2]
contract = _load_contract(ref)
bundle = models.prepare_models(contract)
roll = Rollout.load(ref)
train = {k: torch.as_tensor(v)
         for k, v in load_file(str(ref / "train_inputs.safetensors")).items()}
batch = _batch(roll, train, bundle.pad_token_id)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
t0 = time.time()
s = UpdateSettings(precision=prec,  # type: ignore[arg-type]  # __post_init__ checks it
                   micro_batch_size=contract.algorithm.micro_batch_size, label=f"x-{prec}")
out, _ = _update_run(contract, bundle, batch, s, "sdpa")
print(f"{prec}: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB "
      f"(before the run {base:.2f} GB), {time.time() - t0:.0f} s, {len(out)} tensors")
torch.save(out, sys.argv[3])
