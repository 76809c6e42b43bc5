r"""A round-1 logprob difference inside its bound, at one token, fails that token in round 2.

Finding (issue #49, seed variant 6 of ``contracts/tiny-qwen3.toml``): ``megatron-bf16-actor-tp2``
fails one round-2 Actor logprob, token ``(2, 0)`` (error 0.127, bound 0.113), while every
round-1 row of the cell passes (worst margin 0.37). The chain, each link measured:

1. Round 1, forward: Megatron TP 2's logprob at ``(2, 0)`` is 0.0171 above the reference
   (bound 0.145; Megatron TP 1 is 0.0000 there). ``scripts/repro/megatron_bf16_tp.py
   --inputs RUN/inputs`` on that run's inputs: TP 1 with its ``RowParallelLinear`` outputs
   computed as two BF16 partial products summed in BF16 gives TP 2's logits bit for bit
   (``tp1_split_vs_tp2`` 0), and TP 2 with an FP32 all-reduce gives TP 1's. The difference
   is the row-parallel double rounding, the legitimate TP 2 execution the ``row_split``
   control stands for. The HF ``row_split`` control rounds HF's own separate projections
   twice and lands its noise on other tokens: 1.1e-5 at ``(2, 0)``, 0.034 at ``(4, 2)``.
2. Round 1 -> round 2: this script perturbs the reference update (HF, the cell's BF16
   style) at that one token in round 1 only, by adding ``delta`` to the target token's
   logit there (a round-1 logprob change of ``delta (1 - p)``), and prints how far the
   token's round-2 logprob moves. Sequence 2 has a single response token whose logprob
   the update moves from -0.69 to -3.96, and its own loss derivatives (the KL and entropy
   terms depend on the logprob) steer that step: a round-1 change of +0.0171 moves its
   round-2 logprob by +0.093, -0.0174 by -0.188 (the other tokens move by at most 0.065).

So a round-1 difference 8x inside the round-1 bound reaches the round-2 bound at the one
token whose round-2 logprob is most sensitive to its own round-1 value. The bound rule
measures round-2 per-token noise as the controls' own realisation, whose round-1 noise
happens to miss that token (the ``attn_impl`` control: 4.6e-5 there in round 1, 0.026 in
round 2). Not a Megatron defect and not noise the Megatron cell adds: a gap in how round-1
per-token noise carried into round 2, closed by the bound rule's round-to-round term
(``qualify/reference/round_to_round.py``, which perturbs the same way one token at a time;
``docs/findings.md``, "Explained: round-2 rows and round-1 noise"). The script prints the
round-2 entropy change too (variant 12: ``--token 1 1``).

Usage (a sealed reference of the contract, e.g. one ``qualify sweep`` wrote)::

    python scripts/repro/round1_token_amplification.py REF_DIR CONTRACT.toml \\
        --token 2 0 --delta 0.0344 -0.0344 [--lane bf16-castmasters]

``delta 0`` reproduces the sealed reference bit for bit (checked first).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def main() -> None:
    """Run the perturbed reference updates and print the round-1 / round-2 changes."""
    from qualify.contract import load_contract
    from qualify.lanes import lane_bf16_mode, lane_precision
    from qualify.layout import hf_tensors_file
    from qualify.models import bundle as models
    from qualify.models import roles
    from qualify.reference import rollout, stage, update
    from qualify.reference.update import Batch, UpdateSettings, run_actor

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", type=Path, help="sealed reference directory")
    ap.add_argument("contract", type=Path, help="the contract it was sealed from")
    ap.add_argument("--token", type=int, nargs=2, default=[2, 0], metavar=("ROW", "POS"))
    ap.add_argument("--delta", type=float, nargs="+", default=[0.0344, -0.0344],
                    help="round-1 logit perturbations of the target token")
    ap.add_argument("--lane", default="bf16-castmasters")
    args = ap.parse_args()
    contract = load_contract(args.contract)
    bundle = models.prepare_models(contract)
    roll = rollout.Rollout.load(args.reference)
    batch = stage._batch(roll, load_file(str(args.reference / "train_inputs.safetensors")),
                         bundle.pad_token_id)
    sealed = load_file(str(args.reference / "reference" / hf_tensors_file(args.lane)))
    row, pos = args.token
    mask = roll.response_mask.bool()
    target = int(batch.responses[row, pos])

    def run(delta: float) -> dict[str, torch.Tensor]:
        def probe(round_: int, work: torch.nn.Module, mb: Batch
                  ) -> contextlib.AbstractContextManager[Any]:
            hits = [i for i in range(mb.responses.shape[0])
                    if torch.equal(mb.responses[i], batch.responses[row])
                    and torch.equal(mb.prompts[i][mb.attention_mask[i, :mb.prompts.shape[1]]
                                                  .bool()],
                                    batch.prompts[row][batch.attention_mask[
                                        row, :batch.prompts.shape[1]].bool()])]
            if round_ != 1 or delta == 0.0 or not hits:
                return contextlib.nullcontext()
            at = mb.prompts.shape[1] - 1 + pos

            def hook(_m: torch.nn.Module, _a: Any, out: torch.Tensor) -> torch.Tensor:
                out = out.clone()
                for i in hits:
                    out[i, at, target] += delta
                return out

            @contextlib.contextmanager
            def registered() -> Iterator[None]:
                handle = work.get_submodule("lm_head").register_forward_hook(hook)
                try:
                    yield
                finally:
                    handle.remove()
            return registered()

        settings = UpdateSettings(precision="bf16" if lane_precision(args.lane) == "bf16"
                                  else "fp32", bf16_mode=lane_bf16_mode(args.lane),
                                  micro_batch_size=contract.algorithm.micro_batch_size,
                                  label=f"perturbed-{args.lane}")
        actor = roles.load_actor(bundle.actor_dir, dtype=torch.float32,
                                 attn_implementation="sdpa", requires_grad=True)
        torch.manual_seed(0)
        ref = update.reference_policy(bundle.actor_dir, "sdpa")
        out, _ = run_actor(actor, ref, batch, contract, settings, probe=probe)
        return out

    base = run(0.0)
    r = mask.shape[1]
    key = "round2/actor/logprobs"
    same = torch.equal(base[key][:, :r], sealed[key])
    print(f"unperturbed run equals the sealed {args.lane} reference: {same}")
    for fam in ("logprobs", "entropy"):
        k1, k2 = f"round1/actor/{fam}", f"round2/actor/{fam}"
        print(f"token ({row}, {pos}) {fam}: round 1 {float(sealed[k1][row, pos]):.4f}, "
              f"round 2 {float(sealed[k2][row, pos]):.4f}")
    for delta in args.delta:
        out = run(delta)
        for fam in ("logprobs", "entropy"):
            k1, k2 = f"round1/actor/{fam}", f"round2/actor/{fam}"
            d1 = float(out[k1][row, pos] - base[k1][row, pos])
            d2 = (out[k2][:, :r] - base[k2][:, :r]) * mask
            other = d2.clone()
            other[row, pos] = 0.0
            print(f"delta logit {delta:+.4f}: round-1 {fam} change {d1:+.5f}, round-2 change "
                  f"{float(d2[row, pos]):+.5f} (other tokens: at most "
                  f"{float(other.abs().max()):.5f})")

if __name__ == "__main__":
    main()
