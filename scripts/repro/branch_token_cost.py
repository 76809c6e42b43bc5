"""Wall time of the clip-branch sealing's per-token work on a contract's real model.

Usage: ``python scripts/repro/branch_token_cost.py CONTRACT ROLE OUT.pt [PER_SEQ] [--factored]``.

Runs what :func:`qualify.reference.branches.seal_branches` runs per sealed token (``J_t`` by
one FP32 backward, its FP64 ``|J_t|^2``, and the forward-mode row over the tokens from it
on: the upper triangle)
for ``PER_SEQ`` tokens of every sequence of a batch shaped like the contract's rollout
(``rollout_shaped_batch.py``), with the untrained models of the contract, and
prints the seconds per token of each part. ``--factored`` takes the Gram from each token's
backward factors instead (:mod:`qualify.reference.gram_factors`: the capture hooks around the
backward, the rebuilt ``J_t`` checked against autograd's, then the FP64 Gram). The Gram and
the ``J_t`` go to ``OUT.pt``, so two code states or ways can be compared (run the older one
from ``git worktree add /tmp/old COMMIT`` with ``PYTHONPATH=/tmp/old``). Figures measured
with it: ``docs/scale.md``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rollout_shaped_batch import rollout_shaped_batch

from qualify import branches
from qualify.contract import load_contract
from qualify.errors import ReferenceDataError
from qualify.models import bundle as models
from qualify.models import roles
from qualify.reference import gram
from qualify.reference.update import UpdateSettings

try:  # moved out of update.py at 2026-12-03's commit
    from qualify.reference.jacobian import token_gradients
except ImportError:
    from qualify.reference.update import token_gradients  # type: ignore[attr-defined,no-redef]

factored = "--factored" in sys.argv
argv = [a for a in sys.argv if a != "--factored"]
contract = load_contract(argv[1])
role, out_path = argv[2], argv[3]
per_seq = int(argv[4]) if len(argv) > 4 else 4
bundle = models.prepare_models(contract)
batch = rollout_shaped_batch(contract, bundle)
n, r_len = batch.responses.shape
p_len = batch.prompts.shape[1]
load = roles.load_actor if role == "actor" else roles.load_critic
model = load(bundle.actor_dir if role == "actor" else bundle.critic_dir, dtype=torch.float32,
             attn_implementation="sdpa", requires_grad=True)
step = max(1, r_len // per_seq)
toks = [(b, t) for b in range(n) for t in list(range(0, r_len, step))[:per_seq]]
settings = UpdateSettings(precision="fp32", micro_batch_size=contract.algorithm.micro_batch_size)
row_kw: dict[str, Any] = {}
if "micro_batch_size" in inspect.signature(gram.jvp_row).parameters:
    row_kw["micro_batch_size"] = settings.micro_batch_size
norm_sq: dict[str, float] = {}
rows: dict[str, dict[str, float]] = {}
jt: dict[str, torch.Tensor] = {}
t_back = t_norm = t_row = 0.0
dots: dict[str, float] = {}
grads = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(3))  # a stand-in g
         for n, p in model.named_parameters() if p.requires_grad}
cap = None
if factored:
    from qualify.reference import gram_factors
    spill = tempfile.TemporaryDirectory(prefix="qualify-gram-factors-")  # as branches.py
    cap = gram_factors.FactorCapture(model, [k for k, p in model.named_parameters()
                                             if p.requires_grad], spill=Path(spill.name))
with cap.hooks() if cap is not None else contextlib.nullcontext():
    t0 = time.perf_counter()
    for (bi, ti), c in token_gradients(model, model, batch, contract, settings, role=role,
                                       tokens=toks):
        t1 = time.perf_counter()
        t_back += t1 - t0
        key = branches.token_key(bi, ti)
        norm_sq[key] = sum(float(v.double().square().sum()) for v in c.values())
        jt[key] = torch.cat([v.flatten()[:4096] for v in c.values()])
        t2 = time.perf_counter()
        t_norm += t2 - t1
        if cap is not None:  # the factors (and the parameters they do not cover)
            cap.take(key, c)
            dots[key] = sum(float((grads[n].double() * c[n].double()).sum()) for n in c)
        else:
            row = gram.jvp_row(model, batch, contract, role=role, direction=c,
                               tokens=[t for t in toks if t >= (bi, ti)], **row_kw)
            rows[key] = {branches.token_key(*k): v for k, v in row.items()}
        del c
        t0 = time.perf_counter()
        t_row += t0 - t2
t_gram = time.perf_counter()
try:
    full, err = (cap.gram(norm_sq, dots, grads) if cap is not None
                 else gram.symmetrize(rows, norm_sq))
except ReferenceDataError as e:  # still report the times, and keep the rows
    full, err = rows, float("nan")
    print(f"refused: {e}")
t_gram = time.perf_counter() - t_gram
how = "factors, <g, J_t>" if cap is not None else "jvp row"
print(f"{contract.name} {role}: {len(toks)} tokens of {n} sequences (P={p_len}, R={r_len}), "
      f"{torch.get_num_threads()} threads: J_t backward {t_back / len(toks):.2f} s/token, "
      f"FP64 |J_t|^2 {t_norm / len(toks):.2f} s/token, {how} {t_row / len(toks):.2f} "
      f"s/token, Gram {t_gram:.1f} s, total {(t_back + t_norm + t_row + t_gram) / 60:.2f} "
      f"min; gram_rel_error {err:.3g}")
torch.save({"gram": full, "norm_sq": norm_sq, "jt": jt, "tokens": toks}, out_path)
