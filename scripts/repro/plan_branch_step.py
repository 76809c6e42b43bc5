"""Run one role's clip-branch passes of the reference stage alone, for its peak memory.

Usage: ``python scripts/repro/plan_branch_step.py CONTRACT DIR LANE ROLE``

``DIR`` is a reference directory (sealed or interrupted) holding the rollout,
``train_inputs.safetensors`` and the lane's reference update
(``reference/hf-LANE.safetensors``). Seals every valid response token of round 2 (the plan's
upper bound, ``min(MAX_SEALED_TOKENS, valid tokens)``) through
:func:`qualify.reference.branches._rerun`, the stage's own code: the lane's update rerun, one
``J_t`` backward per token and the Gram (the path the stage picks for that many tokens). The
token selection by the sealed bounds is skipped (the tolerances are set wide, so the rerun's
reproduction check cannot refuse); the memory is that of the passes, to set beside ``qualify
plan``'s ``branches hf-LANE ROLE``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from qualify.contract import load_contract
from qualify.models import bundle as models
from qualify.reference import rollout
from qualify.reference.branches import MAX_SEALED_TOKENS, _rerun
from qualify.reference.stage import _batch


def main() -> int:
    """Run the passes; print how many tokens and the Gram's path."""
    contract = load_contract(Path(sys.argv[1]))
    directory, lane, role = Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    bundle = models.prepare_models(contract)
    roll = rollout.Rollout.load(directory)
    train = load_file(str(directory / "train_inputs.safetensors"))
    batch = _batch(roll, train, bundle.pad_token_id)
    run = load_file(str(directory / "reference" / f"hf-{lane}.safetensors"))
    toks = [(int(b), int(t)) for b, t in torch.nonzero(roll.response_mask)][:MAX_SEALED_TOKENS]
    rounds_doc: dict[str, Any] = {"round2": {"tokens": {}, "gram": {}, "tol_cur": 1e30}}
    _rerun(contract, bundle, batch, prec=lane, role=role, wanted={2: toks}, run=run,
           tensors={}, rounds_doc=rounds_doc, attn="sdpa")
    rd = rounds_doc["round2"]
    print(f"plan_branch_step: {len(toks)} tokens, {rd.get('gram_off_diagonal')}, "
          f"gram_rel_error {rd.get('gram_rel_error')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
