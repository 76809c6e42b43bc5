"""Megatron-Core trains the pad token's embedding row; HF Qwen3 does not.

Finding (docs/findings.md, "the pad token's embedding row trains"): HF ``Qwen3Model`` builds
``nn.Embedding(vocab, hidden, padding_idx=config.pad_token_id)``, so the row of the pad id
gets no gradient (``torch.nn.Embedding``: "entries at padding_idx do not contribute to the
gradient") and HF's init leaves it zero. megatron-core's ``VocabParallelEmbedding`` has no
padding index (``F.embedding(masked_input, self.weight)``), so a pad id that appears as a
real token (a sampled response token) back-propagates into that row. The row is zero, so the
first RMSNorm sees a zero vector and its input gradient is of order ``1/sqrt(eps)``.

One process, gloo world of 1, TP 1, FP32, CPU: the contract's actor (built as the harnesses
get it), one forward and backward of the summed next-token logprobs of ``--tokens`` through
HF ``Qwen3ForCausalLM`` and through the Megatron-Core ``GPTModel`` the Megatron harness
builds from it (``harnesses.megatron.convert`` / ``model``). Prints the gradient norm of the
pad row in both, the largest difference over every other embedding row, and each model's
total gradient norm.

Usage::

    python scripts/repro/megatron_pad_embedding.py                        # tiny-qwen3
    python scripts/repro/megatron_pad_embedding.py --contract C.toml --tokens 1,5,0,7,9
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def next_token_logprob_sum(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``sum_t log softmax(logits[:, t, :vocab])[ids[:, t + 1]]`` (FP32 scalar)."""
    ls = torch.log_softmax(logits[:, :-1, :vocab].float(), dim=-1)
    return ls.gather(-1, ids[:, 1:].unsqueeze(-1)).sum()


def total_norm(model: torch.nn.Module) -> float:
    """L2 norm over every parameter gradient."""
    return float(torch.stack([(p.grad.double() ** 2).sum() for p in model.parameters()
                              if p.grad is not None]).sum().sqrt())


def main() -> int:
    """Build both models, run one backward each, print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contract", default=str(ROOT / "contracts" / "tiny-qwen3.toml"))
    ap.add_argument("--tokens", default="1,5,0,7,9",
                    help="comma-separated ids of one sequence (include the pad id)")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from harnesses.megatron import convert
    from harnesses.megatron import model as mm
    from harnesses.megatron.harness import hf_state
    from qualify.contract import load_contract
    from qualify.models.bundle import prepare_models

    torch.set_num_threads(1)
    contract = load_contract(Path(args.contract))
    ids = torch.tensor([[int(x) for x in args.tokens.split(",")]])
    with tempfile.TemporaryDirectory() as tmp:
        actor = prepare_models(contract, cache_dir=Path(tmp)).actor_dir
        hf: Any = AutoModelForCausalLM.from_pretrained(str(actor), dtype=torch.float32)
        pad = int(hf.config.pad_token_id)
        vocab = int(hf.config.vocab_size)
        print(f"HF embed_tokens: {hf.model.embed_tokens}")
        print(f"tokens {ids.tolist()[0]} (pad id {pad}); |embed row {pad}| = "
              f"{float(hf.model.embed_tokens.weight[pad].detach().norm()):.3g}")
        next_token_logprob_sum(hf(input_ids=ids).logits, ids, vocab).backward()
        g_hf = hf.model.embed_tokens.weight.grad

        dist.init_process_group("gloo", rank=0, world_size=1)
        groups = mm.role_groups(1, 0, 0, 60.0)
        mm.apply_group_shims()
        mm.apply_cpu_shims()
        config, sd = hf_state(actor, "lm")
        shape = convert.Shape.from_hf_config(config, head="lm")
        mg: Any = mm.build_gpt(config, shape, groups, bf16=False, cpu=True)
        mm.load_shard(mg, convert.hf_to_megatron(sd, shape, 1)[0])
        emb = mg.embedding.word_embeddings
        print(f"Megatron word_embeddings: {type(emb).__module__}.{type(emb).__name__} "
              f"(padding_idx: {getattr(emb, 'padding_idx', 'none')})")
        t = ids.shape[1]
        out = mg(input_ids=ids, position_ids=torch.arange(t)[None],
                 attention_mask=mm.padding_mask(torch.ones_like(ids)))
        next_token_logprob_sum(out, ids, vocab).backward()
        g_mg = emb.weight.grad[:vocab]
        dist.destroy_process_group()

    others = [r for r in range(vocab) if r != pad]
    print(f"grad |embed row {pad}|   HF {float(g_hf[pad].norm()):.4g}   "
          f"Megatron-Core {float(g_mg[pad].norm()):.4g}")
    print(f"grad embed rows != {pad}: max |HF - Megatron| "
          f"{float((g_hf[others] - g_mg[others]).abs().max()):.3g} "
          f"(largest row norm {float(g_hf[others].norm(dim=1).max()):.4g})")
    print(f"total grad norm   HF {total_norm(hf):.4g}   Megatron-Core {total_norm(mg):.4g}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
