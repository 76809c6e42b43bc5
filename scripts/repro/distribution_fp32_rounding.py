"""The FP32 reference's distributions against FP64 and another GEMM order (docs/mismatch.md).

Usage: ``python scripts/repro/distribution_fp32_rounding.py CONTRACT REFDIR``

``REFDIR`` holds the contract's frozen rollout (a sealed or interrupted reference
directory). The reference's batched HF FP32 prefill (SDPA,
``qualify.reference.distribution._prefill``) is compared, with
:func:`qualify.distmetrics.topk_metrics` on the top 64 (the top-k path's lumped metrics), with
the same prefill run on one thread, in FP64 (the logits rounded to FP32 once), and with every
``nn.Linear`` computed as the sum of two half-K products (another reduction order). Prints the
worst and mean token KL, the worst TV, the per-sequence max KL and the top-1 disagreements,
raw and at the contract's temperature. Nothing is judged.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from qualify.contract import load_contract
from qualify.distmetrics import topk_metrics
from qualify.models import bundle
from qualify.reference import rollout
from qualify.reference.distribution import _logprobs, _model, _prefill, _topk

STATS = ("kl_ref_cand_max", "kl_ref_cand_mean", "tv_max", "seq_max_kl_mean", "top1_mismatch")


def _ksplit(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    y = x[..., :h] @ self.weight[:, :h].T + x[..., h:] @ self.weight[:, h:].T
    return y if self.bias is None else y + self.bias


def main() -> int:
    """Print the metrics of each variant against the FP32 reference prefill."""
    contract = load_contract(Path(sys.argv[1]))
    roll = rollout.Rollout.load(Path(sys.argv[2])).to_tensors()
    actor_dir = bundle.prepare_models(contract).actor_dir
    mask = roll["response_mask"]
    toks, m = roll["responses"].numpy(), mask.numpy()
    m32 = _model(actor_dir, "sdpa", torch.float32)
    ref = _prefill(m32, roll)
    runs: dict[str, torch.Tensor] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs["one thread"] = _prefill(m32, roll)
    torch.set_num_threads(threads)
    runs["fp64"] = _prefill(_model(actor_dir, "sdpa", torch.float64), roll)
    forward = nn.Linear.forward
    nn.Linear.forward = _ksplit  # type: ignore[method-assign]
    try:
        runs["half-K GEMMs"] = _prefill(m32, roll)
    finally:
        nn.Linear.forward = forward  # type: ignore[method-assign]
    for kind, t in (("raw", 1.0), ("tempered", float(contract.sampling.temperature))):
        r = _topk(_logprobs(ref, t, mask), toks, 64)
        for name, logits in runs.items():
            mine = _topk(_logprobs(logits, t, mask), toks, 64)
            got = topk_metrics(mine["topk_logprobs"], mine["topk_ids"], r["topk_logprobs"],
                               r["topk_ids"], cand_token=mine["token_logprobs"],
                               ref_token=r["token_logprobs"], mask=m,
                               clip_ratio=float(contract.algorithm.clip_ratio))
            print(f"{kind:9s} {name:13s}", "  ".join(f"{s} {got[s]:.3g}" for s in STATS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
