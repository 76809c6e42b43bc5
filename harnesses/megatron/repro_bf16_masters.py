"""Repro of the BF16 round-2 finding: Megatron's FP32 masters are born BF16-rounded.

Diagnostic only; never part of a qualification run. Two steps:

1. ``torchrun --nproc-per-node W -m harnesses.megatron.repro_bf16_masters run CELL_JSON OUT``
   runs the harness on a launch's ``cell.json`` (``RUN/launches/megatron-*/attempt-1``)
   with one change: right after ``get_megatron_optimizer``, every FP32 master of
   ``Float16OptimizerWithFloat16Params`` is overwritten with the FP32 checkpoint's shard
   (instead of ``param.detach().clone().float()`` of the BF16 parameter,
   megatron/core/optimizer/optimizer.py:673-674). Outputs go to ``OUT``.
2. ``python -m harnesses.megatron.repro_bf16_masters compare REFERENCE ROLE ORIGINAL OUT``
   prints, per family and round, the error against the reference's BF16-parameters update
   (``reference/hf-bf16.safetensors``) of the original cell outputs and of ``OUT``: max abs
   over valid tokens (per-token families), abs (scalars), global relative L2 (per-parameter
   families). Round 1 is identical by construction; round 2 shows what the masters cause.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from harnesses import common
from harnesses.megatron import convert, harness, train


def _fp32_born_masters(engine: Any, model_dir: Path) -> None:
    """Overwrite the BF16 cell's FP32 masters with the FP32 checkpoint's shard (per rank)."""
    if not engine.bf16:
        return
    head: convert.Head = "lm" if engine.role == "actor" else "value"
    _, sd = harness.hf_state(model_dir, head)
    shard = convert.hf_to_megatron(sd, engine.shape, engine.groups.tp)[engine.groups.tp_rank]
    by_id = {id(p): n for n, p in engine.named().items()}
    with torch.no_grad():
        for opt in engine.optimizers():
            for models, masters in zip(opt.float16_groups, opt.fp32_from_float16_groups,
                                       strict=True):
                for p, master in zip(models, masters, strict=True):
                    master.copy_(shard[by_id[id(p)]])


def run_cell(cell_json: Path, out: Path) -> int:
    """Step 1 (under torchrun): the harness on ``cell_json`` with FP32-born masters, to ``out``."""
    doc = json.loads(cell_json.read_text("utf-8"))
    doc["output_dir"] = str(out)
    out.mkdir(parents=True, exist_ok=True)
    patched = out / "cell.json"
    patched.write_text(json.dumps(doc), "utf-8")
    inputs = common.read_inputs(Path(doc["inputs_dir"]))
    original = train.MegatronEngine.__post_init__

    def post_init(self: train.MegatronEngine) -> None:
        original(self)
        _fp32_born_masters(self, inputs.actor_dir if self.role == "actor"
                           else inputs.critic_dir)

    train.MegatronEngine.__post_init__ = post_init  # type: ignore[method-assign]
    return int(harness.main([str(patched)]) or 0)


def _errors(outputs: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], mask: torch.Tensor,
            role: str) -> dict[str, float]:
    res: dict[str, float] = {}
    for rd in (1, 2):
        k = f"round{rd}/{role}"
        for m in (("logprobs", "entropy") if role == "actor" else ("values",)):
            res[f"r{rd} {m}"] = float((outputs[f"{k}/{m}"] - ref[f"{k}/{m}"])[mask].abs().max())
        for m in ("grad_norm", "clip_coef"):
            res[f"r{rd} {m}"] = float((outputs[f"{k}/{m}"] - ref[f"{k}/{m}"]).abs())
        for fam in ("grads", "exp_avg", "exp_avg_sq", "updates"):
            names = sorted(n for n in ref if n.startswith(f"{k}/{fam}/"))
            a = torch.cat([outputs[n].flatten() for n in names])
            b = torch.cat([ref[n].flatten() for n in names])
            res[f"r{rd} {fam}"] = float((a - b).norm() / b.norm())
    return res


def compare(reference: Path, role: str, original: Path, fixed: Path) -> None:
    """Step 2: print the error table of the original and the FP32-born-masters outputs.

    Args:
        reference: the sealed reference directory.
        role: ``actor`` or ``critic``.
        original: the cell's ``outputs.safetensors`` (``RUN/cells/<cell>/attempt-1``).
        fixed: the ``outputs.safetensors`` step 1 wrote.
    """
    from safetensors.torch import load_file

    ref = load_file(str(reference / "reference" / "hf-bf16.safetensors"))
    mask = load_file(str(reference / "rollout.safetensors"))["response_mask"].bool()
    a = _errors(load_file(str(original)), ref, mask, role)
    b = _errors(load_file(str(fixed)), ref, mask, role)
    print(f"{'':18s} {'Megatron':>12s} {'FP32-born masters':>18s}")
    for k in a:
        print(f"{k:18s} {a[k]:12.4g} {b[k]:18.4g}")


def main(argv: Sequence[str] | None = None) -> int:
    """``run CELL_JSON OUT`` (under torchrun) or ``compare REFERENCE ROLE ORIGINAL OUT``.

    Returns:
        The harness's exit code (``run``), 0 (``compare``) or 2 on a usage error.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 3 and args[0] == "run":
        return run_cell(Path(args[1]), Path(args[2]))
    if len(args) == 5 and args[0] == "compare":
        compare(Path(args[1]), args[2], Path(args[3]), Path(args[4]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
