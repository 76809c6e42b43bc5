"""How far one token's FP32 ``J_t`` lies from its FP64 value, by how the forward is cut.

Usage: ``python scripts/repro/head_rows_precision.py [CONTRACT] [B] [T]`` (default
``contracts/smollm2-135m.toml``, sequence 4, response position 8).

On a batch shaped like the contract's rollout (seeded response ids, the untrained Actor;
``rollout_shaped_batch.py``, as ``branch_token_cost.py``), the gradient of token ``(B, T)``'s
logprob in FP32 is compared with the same gradient in FP64 (relative L2 over every
parameter) for: the whole micro-batch, the one sequence, the sequence cut after ``T``
(what :func:`qualify.reference.jacobian.token_gradients` runs), and the cut sequence with the
head at position ``T`` only (``logits_to_keep``; what it does not run). Measured 2026-12-03
on SmolLM2-135M: 2.2e-5, 2.2e-5, 2.3e-5 and 1.8e-4 (``docs/scale.md``).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
from rollout_shaped_batch import rollout_shaped_batch

from qualify.contract import load_contract
from qualify.models import bundle as models
from qualify.models import roles
from qualify.reference.update import _positions, _token_logprobs_entropy

contract = load_contract(sys.argv[1] if len(sys.argv) > 1 else "contracts/smollm2-135m.toml")
b = int(sys.argv[2]) if len(sys.argv) > 2 else 4
t = int(sys.argv[3]) if len(sys.argv) > 3 else 8
bundle = models.prepare_models(contract)
batch = rollout_shaped_batch(contract, bundle)
(n, p_len), r_len = batch.prompts.shape, batch.responses.shape[1]
ids = torch.cat([batch.prompts, batch.responses], 1)
mask = batch.attention_mask
fp32 = roles.load_actor(bundle.actor_dir, dtype=torch.float32, attn_implementation="sdpa",
                        requires_grad=True).eval()
fp64 = copy.deepcopy(fp32).double().eval()
mbs = contract.algorithm.micro_batch_size
first = b // mbs * mbs


def jt(model: torch.nn.Module, rows: list[int], length: int, head_at_t: bool) -> torch.Tensor:
    """Token ``(b, t)``'s logprob gradient over every parameter, ``[numel]`` FP64.

    From a forward of ``rows`` of the batch cut to ``length`` positions (the head at ``t``
    only with ``head_at_t``).
    """
    kw: dict[str, Any] = {"input_ids": ids[rows, :length], "attention_mask": mask[rows, :length],
                          "position_ids": _positions(mask[rows, :length]), "use_cache": False}
    if head_at_t:
        kw["logits_to_keep"] = torch.tensor([p_len - 1 + t])
    y = model(**kw).logits[rows.index(b), 0 if head_at_t else p_len - 1 + t]
    x = _token_logprobs_entropy(y[None, None], ids[b, p_len + t][None, None],
                                contract.sampling.temperature)[0][0, 0]
    ps = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([g.flatten() for g in torch.autograd.grad(x, ps)]).double()


exact = jt(fp64, [b], p_len + t, False)
for name, rows, length, head in (
        ("micro-batch", list(range(first, min(first + mbs, n))), p_len + r_len, False),
        ("one sequence", [b], p_len + r_len, False),
        ("one sequence, cut after t", [b], p_len + t, False),
        ("cut, head at t only", [b], p_len + t, True)):
    g = jt(fp32, rows, length, head)
    print(f"{contract.name} token ({b}, {t}) {name:28s} FP32 J_t relative L2 from FP64: "
          f"{float((g - exact).norm() / exact.norm()):.2e}")
