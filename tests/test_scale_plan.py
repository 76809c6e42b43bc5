"""What docs/scale.md's Qwen3-8B memory plan relies on, proved on tiny-qwen3 shapes on CPU.

The plan steps AdamW on the host parameter chunk by parameter chunk (the moments of an 8B
model do not fit on the GPU beside its weights and gradients). The reference's optimizer is
``torch.optim.AdamW(foreach=False, fused=False)`` (:func:`qualify.reference.update._adamw`),
whose step is elementwise: this test shows that stepping each parameter as separate chunks
gives bitwise the parameters and moments of stepping it whole, over two rounds, with weight
decay.
"""

from __future__ import annotations

import torch

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
