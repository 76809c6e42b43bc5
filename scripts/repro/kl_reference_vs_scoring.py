"""Compare a reference's scoring logprobs with the update runs' KL reference logprobs.

Usage: ``python scripts/repro/kl_reference_vs_scoring.py CONTRACT DIR``

``DIR`` is a reference directory (sealed or interrupted) holding the rollout, the train
inputs and ``scores/``. For each lane's settings (FP32; BF16 parameters, castmasters,
autocast), takes :func:`qualify.reference.update.kl_reference_logprobs` of the frozen policy
(:func:`qualify.reference.update.reference_policy`) as the stage's update runs do, and
compares it on the valid response tokens with the scoring's ``reference/logprobs`` of that
precision: bitwise or not, and the largest absolute difference. Prints one line per lane.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from qualify.contract import load_contract
from qualify.layout import SCORES_DIR, hf_tensors_file
from qualify.models import bundle as models
from qualify.protocol import TRAIN_INPUTS_FILE
from qualify.reference import rollout, stage, update
from qualify.reference.update import UpdateSettings, kl_reference_logprobs


def main() -> int:
    """Print, per lane, whether scoring's reference logprobs are the KL reference's."""
    contract = load_contract(Path(sys.argv[1]))
    directory = Path(sys.argv[2])
    bundle = models.prepare_models(contract)
    roll = rollout.Rollout.load(directory)
    batch = stage._batch(roll, load_file(str(directory / TRAIN_INPUTS_FILE)),
                         bundle.pad_token_id)
    mask = roll.response_mask.bool()
    for prec, mode in (("fp32", "params"), ("bf16", "params"), ("bf16", "castmasters"),
                       ("bf16", "autocast")):
        settings = UpdateSettings(precision=prec, bf16_mode=mode,  # type: ignore[arg-type]
                                  micro_batch_size=contract.algorithm.micro_batch_size)
        ref = update.reference_policy(bundle.actor_dir, "sdpa")
        kl = kl_reference_logprobs(ref, batch, contract, settings)[:, :mask.shape[1]]
        scored = load_file(str(directory / SCORES_DIR / hf_tensors_file(prec)))
        sc = scored["reference/logprobs"].to(kl.dtype)
        diff = float((kl.double() - sc.double()).abs()[mask].max())
        print(f"{prec} {mode}: bitwise {torch.equal(kl[mask], sc[mask])}, max |diff| {diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
