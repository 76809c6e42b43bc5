"""Print the distribution controls and the BF16 ceilings a reference's rollout gets.

Usage: ``python scripts/repro/distribution_bf16_controls.py REFDIR CONTRACT``

Runs :func:`qualify.reference.distribution.seal_distribution` (the reference stage's own
call) on ``REFDIR``'s frozen rollout into a scratch directory and prints, per kind and
statistic, every control's metric against the FP32 reference and the sealed BF16 ceiling
with the control it came from (docs/bound-rule.md: the BF16 distribution ceilings). Nothing
in ``REFDIR`` is written.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

from qualify.contract import load_contract
from qualify.models import bundle as models
from qualify.reference.distribution import seal_distribution

STATS = ("kl_ref_cand_max", "kl_cand_ref_max", "tv_max", "top1_mismatch", "ratio_outside_clip")


def main() -> int:
    """Print the table of the module docstring; 0."""
    ref, contract = Path(sys.argv[1]), load_contract(Path(sys.argv[2]))
    roll = load_file(str(ref / "rollout.safetensors"))
    bundle = models.prepare_models(contract)
    with tempfile.TemporaryDirectory() as out:
        doc = seal_distribution(contract, bundle.actor_dir, roll, Path(out))
    for kind in ("raw", "tempered"):
        for st in STATS:
            controls = {n: f"{float(c[st]):.3g}" for n, c in doc[kind]["controls"].items()}
            b = doc[kind]["bounds_bf16"][st]
            print(kind, st, controls, f"bounds_bf16 {b['bound']:.3g} ({b['control']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
