"""vLLM's FP32 token logprobs against Hugging Face FP32 and FP64 (docs/findings.md).

Usage: ``python scripts/repro/vllm_fp32_token_logprobs.py INPUTS``

``INPUTS`` is a reference directory, sealed or interrupted, holding ``rollout.safetensors``,
``contract.json`` and ``model.json`` (the model is the contract's prepared bundle,
:func:`qualify.models.bundle.prepare_models`). For every valid response token of the frozen
rollout, at the initial weights and the contract's temperature (``log_softmax(logits / T)``
of the token, no truncation), it prints ``max`` and ``mean`` of ``|a - b|`` for:

- HF FP32 batched prefill (the reference's scoring, SDPA) against HF FP64 (the same model
  loaded in FP64; its logits rounded to FP32 once and its logprobs to FP32, as
  ``qualify.reference.distribution._prefill`` and ``_logprobs`` give them, so FP64 here
  carries about one FP32 rounding of the logprob): the FP32 reference's own rounding;
- vLLM FP32 (the sampler cell's engine as it starts it, ``harnesses.vllm.harness._start``)
  by one-token prefill requests (``harnesses.vllm.harness.score_tokens``) and on the decode
  path (the forced-trace pass, ``harnesses.vllm.decode.decode_pass``) against each of them;
- vLLM decode against vLLM prefill;

and the kernel routes vLLM reports. Nothing is judged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from sampler_start import start_sampler

from harnesses.vllm import decode, harness
from qualify.reference import rollout
from qualify.reference.distribution import _logprobs, _model, _prefill


def main() -> int:
    """Print the token-logprob differences and vLLM's routes."""
    src = Path(sys.argv[1])
    ins, started = start_sampler(src)
    contract = ins.contract
    roll = rollout.Rollout.load(src).to_tensors()
    temperature = float(contract.sampling.temperature)
    mask = roll["response_mask"].bool()

    def token_logprobs(logits: torch.Tensor) -> torch.Tensor:
        lp = _logprobs(logits, temperature, mask.long())
        return lp.gather(-1, roll["responses"][..., None])[..., 0].double()

    hf32 = token_logprobs(_prefill(_model(ins.actor_dir, "sdpa", torch.float32), roll))
    hf64 = token_logprobs(_prefill(_model(ins.actor_dir, "sdpa", torch.float64), roll))
    prefill, _ = harness.score_tokens(started.llm, ins.rows, temperature)
    decoded = decode.token_logprobs(started.dists["tempered"], ins.rows)

    def diff(a: torch.Tensor, b: torch.Tensor) -> str:
        d = (a.double() - b.double()).abs()[mask]
        return f"max {float(d.max()):.3g}  mean {float(d.mean()):.3g}  (n={int(d.numel())})"

    for label, a, b in (("HF FP32 prefill vs HF FP64", hf32, hf64),
                        ("vLLM prefill vs HF FP32", prefill, hf32),
                        ("vLLM prefill vs HF FP64", prefill, hf64),
                        ("vLLM decode vs HF FP32", decoded, hf32),
                        ("vLLM decode vs HF FP64", decoded, hf64),
                        ("vLLM decode vs vLLM prefill", decoded, prefill)):
        print(f"{label:30s} {diff(a, b)}")
    print("vLLM routes:", json.dumps(started.routes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
