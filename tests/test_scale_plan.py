"""What docs/scale.md's Qwen3-8B memory plan relies on, proved on tiny-qwen3 shapes on CPU.

The plan steps AdamW on the host parameter chunk by parameter chunk (the moments of an 8B
model do not fit on the GPU beside its weights and gradients). The reference's optimizer is
``torch.optim.AdamW(foreach=False, fused=False)`` (:func:`qualify.reference.update._adamw`),
whose step is elementwise: stepping each parameter as separate chunks gives bitwise the
parameters and moments of stepping it whole, over two rounds, with weight decay.

The FP64 control keeps only the round-1 gradient ``g1`` instead of AdamW's two moments (65.5
GB instead of 131 GB at 8B): after one step from zero state, torch's moments are exactly
``(1 - b1) * g1`` (``lerp_`` from 0) and ``((1 - b2) * g1) * g1`` (``addcmul_(value=1 - b2)``
from 0), so round 2 can rebuild them chunk by chunk and step a fresh optimizer: bitwise the
uninterrupted two-step AdamW.

Activation checkpointing (recompute each decoder layer in backward instead of storing its
activations, ~3 GB per micro-batch at 8B) gives bitwise the gradients of the stored
activations on a deterministic CPU run, FP32 and BF16, and really recomputes (layer 0's
first projection runs twice).
"""

from __future__ import annotations

import pytest
import torch
from harness_outputs import TINY
from transformers import Qwen3Config, Qwen3ForCausalLM

torch.set_num_threads(1)

SHAPES = {"embed": (384, 64), "q_proj": (128, 64), "norm": (64,), "down": (64, 160)}
CHUNK = 1000  # elements; not a divisor of any size above, so the last chunk is ragged


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                             weight_decay=0.01, foreach=False, fused=False)


def test_adamw_in_parameter_chunks_is_bitwise_the_whole_step() -> None:
    g = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=g) for n, s in SHAPES.items()} for _ in range(2)]
    whole = {n: torch.nn.Parameter(v.clone()) for n, v in init.items()}
    chunks = {n: [torch.nn.Parameter(c.clone()) for c in v.reshape(-1).split(CHUNK)]
              for n, v in init.items()}
    opt_w = _adamw(list(whole.values()))
    opt_c = _adamw([p for ps in chunks.values() for p in ps])
    for step in grads:
        for n, p in whole.items():
            p.grad = step[n].clone()
            for c, gc in zip(chunks[n], step[n].reshape(-1).split(CHUNK), strict=True):
                c.grad = gc.clone()
        opt_w.step()
        opt_c.step()
    for n, p in whole.items():
        assert not torch.equal(p.detach(), init[n])
        assert torch.equal(p.detach().reshape(-1), torch.cat([c.detach() for c in chunks[n]]))
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_w.state[p][k].reshape(-1),
                               torch.cat([opt_c.state[c][k] for c in chunks[n]]))


def test_fp64_round2_from_the_round1_gradient_alone_is_bitwise_two_adamw_steps() -> None:
    n, chunk = 5000, 777  # 777: ragged chunks
    g = torch.Generator().manual_seed(0)
    p0, g1, g2 = (torch.randn(n, dtype=torch.float64, generator=g) for _ in range(3))
    p = torch.nn.Parameter(p0.clone())
    opt = _adamw([p])
    b1, b2 = opt.param_groups[0]["betas"]
    p.grad = g1.clone()
    opt.step()
    p1 = p.detach().clone()
    assert torch.equal(opt.state[p]["exp_avg"], (1 - b1) * g1)
    assert torch.equal(opt.state[p]["exp_avg_sq"], ((1 - b2) * g1) * g1)
    p.grad = g2.clone()
    opt.step()
    rebuilt = []
    for s in range(0, n, chunk):  # the plan: only p1 and g1 kept, moments rebuilt per chunk
        q = torch.nn.Parameter(p1[s:s + chunk].clone())
        fresh = _adamw([q])
        fresh.state[q] = {"step": torch.tensor(1.0), "exp_avg": (1 - b1) * g1[s:s + chunk],
                          "exp_avg_sq": ((1 - b2) * g1[s:s + chunk]) * g1[s:s + chunk]}
        q.grad = g2[s:s + chunk].clone()
        fresh.step()
        rebuilt.append(q.detach())
    assert not torch.equal(p.detach(), p1)
    assert torch.equal(torch.cat(rebuilt), p.detach())


def _tiny_grads(dtype: torch.dtype, checkpointing: bool) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of a masked mean token NLL of the seeded tiny Qwen3; the forward calls of
    layer 0's ``q_proj`` (torch's checkpoint stops recomputing once it has every tensor
    backward needs, so a module near the end of the layer, whose output nothing saves, may
    not run again: the first projection always does)."""
    cfg = Qwen3Config(**TINY, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, max_position_embeddings=128, use_cache=False)
    torch.manual_seed(1234)
    model = Qwen3ForCausalLM(cfg)
    torch.nn.Module.to(model, dtype)  # HF's typed .to() wrapper confuses mypy
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing == checkpointing
    calls = [0]
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (4, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 18:], mask[3, 10:] = 0, 0
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (-(lp * mask[:, 1:]).sum() / mask[:, 1:].sum()).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}, \
        calls[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_checkpointing_gives_bitwise_the_stored_activation_gradients(
        dtype: torch.dtype) -> None:
    stored, once = _tiny_grads(dtype, checkpointing=False)
    recomputed, twice = _tiny_grads(dtype, checkpointing=True)
    assert (once, twice) == (1, 2)  # the layer really ran again in backward
    assert len(stored) == 25
    assert sorted(stored) == sorted(recomputed)
    assert all(bool(v.abs().sum() > 0) for v in stored.values())
    differ = [k for k in stored if not torch.equal(stored[k], recomputed[k])]
    assert differ == [], differ
