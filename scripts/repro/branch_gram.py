"""The clip-branch Gram on the committed default evidence: estimated (before) vs exact (now).

docs/scale.md section 4. Reruns this checkout's :func:`qualify.reference.branches
.seal_branches` on the committed reference's own data (rollout, train inputs, reference
updates, bounds), then prints: whether the sealed ``J_t`` tensors are byte-identical to the
committed ones, how far the committed (sample-estimated) off-diagonal Gram was from the
exact one, the control adjustments with either ``branches.json``, and every row of the
committed run judged by :func:`qualify.compare.stage.compare_run` (``write=False``) with
either ``branches.json`` (the sealed tensors are the committed ones in both).

Usage (from the repository root, ~5 min on 2 CPU cores)::

    python scripts/repro/branch_gram.py [--out DIR]
    python scripts/repro/branch_gram.py --jvp --seal-only --out DIR2   # the forward-mode path
    python scripts/repro/branch_gram.py --against DIR/branches.json --jvp --seal-only ...
    python scripts/repro/branch_gram.py --reference REF_DIR --against REF_DIR/branches.json \
        --jvp --seal-only --out DIR3   # a reference sealed on this machine
    python scripts/repro/branch_gram.py --factored --seal-only --out DIR4   # factored Gram

The rerun must reproduce the sealed reference update (:data:`qualify.reference.branches
.REPRODUCE_FRACTION`): on another CPU the BF16-autocast lane may not (2026-12-03, the
committed Intel-made reference rerun on an AVX2-only AMD EPYC: round-2 logprobs 0.026 from
the sealed run, allowed 0.0123, refused); ``--reference`` then names one sealed here.

``--jvp`` sets :data:`qualify.reference.gram.FULL_BUDGET_BYTES` and
:data:`qualify.reference.gram_factors.BUDGET_BYTES` to 0, so every Gram is taken by forward
mode (the path of models whose ``J_t`` and factors do not fit in memory); ``--factored`` sets
only the first, so every Gram is rebuilt from the tokens' backward factors (the path of
SmolLM2-sized models); ``--against``
compares the Gram with another ``branches.json`` (e.g. the FP64 one of a first run).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qualify.bounds import measure_controls
from qualify.compare import reflip
from qualify.compare.stage import _load_bounds, _load_contract, compare_run
from qualify.compare.verdicts import Report
from qualify.evidence import store
from qualify.models import bundle as models
from qualify.reference import gram, gram_factors
from qualify.reference.branches import adjust_control_errors, seal_branches
from qualify.reference.rollout import Rollout
from qualify.reference.stage import _batch

COMMITTED_REF = Path("references/tiny-qwen3-9cd85d5fbd99")
REF = COMMITTED_REF  # main() sets it from --reference
RUN = sorted(Path("evidence/tiny-qwen3").glob("2*Z"))[-1]  # the committed default run


def _numpy(path: Path) -> dict[str, Any]:
    return {k: np.asarray(v) for k, v in store.load_tensors(path).items()}


def _gram_gap(old: dict[str, Any], new: dict[str, Any]) -> None:
    for prec, by_role in new["precisions"].items():
        for role, by_round in by_role.items():
            for rk, v in by_round.items():
                if not v["tokens"]:
                    continue
                o = old["precisions"][prec][role][rk]
                worst = max((abs(o["gram"][s][t] - v["gram"][s][t])
                             / math.sqrt(v["tokens"][s]["norm_sq"] * v["tokens"][t]["norm_sq"])
                             for s in v["gram"] for t in v["gram"][s] if s != t), default=0.0)
                print(f"{prec} {role} {rk}: {len(v['tokens'])} tokens (tokens, dot_grad, "
                      f"norm_sq identical: {o['tokens'] == v['tokens']}); its "
                      f"off-diagonal off by up to {worst:.3g} of |J_s||J_t|; now "
                      f"{v['gram_off_diagonal']}")


def _judge(doc: dict[str, Any]) -> Report:
    """``compare_run`` of the committed run with ``doc`` as the sealed ``branches.json``."""
    orig = reflip._sealed_branches

    def patched(ctx: reflip.SealedBranches, precision: str) -> tuple[dict[str, Any],
                                                                     dict[str, Any]]:
        ctx.cache.setdefault("doc", doc)
        return orig(ctx, precision)

    reflip._sealed_branches = patched
    try:
        return compare_run(RUN, write=False)
    finally:
        reflip._sealed_branches = orig


def main() -> None:
    """Print the comparison (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/qualify-branch-gram"))
    ap.add_argument("--jvp", action="store_true", help="forward-mode Gram for every token")
    ap.add_argument("--factored", action="store_true",
                    help="the Gram from each token's backward factors for every token")
    ap.add_argument("--seal-only", action="store_true", help="skip controls and rows")
    ap.add_argument("--against", type=Path, help="a branches.json to compare the Gram with")
    ap.add_argument("--reference", type=Path, default=COMMITTED_REF,
                    help=f"the sealed reference to rerun (default {COMMITTED_REF}; with "
                         "--seal-only, one sealed on this machine: a BF16 rerun must "
                         "reproduce it)")
    args = ap.parse_args()
    global REF  # noqa: PLW0603  # the module's functions read the reference it names
    REF = args.reference
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.jvp or args.factored:
        gram.FULL_BUDGET_BYTES = 0
    if args.jvp:
        gram_factors.BUDGET_BYTES = 0
    t0 = time.time()
    contract = _load_contract(REF)
    bounds, _, _ = _load_bounds(REF, contract)
    roll = Rollout.load(REF)
    train = _numpy(REF / "train_inputs.safetensors")
    bundle = models.prepare_models(contract)
    batch = _batch(roll, {k: torch.as_tensor(v) for k, v in train.items()}, bundle.pad_token_id)
    lanes = contract.matrix.lanes()
    ref_np = {lane: _numpy(REF / "reference" / f"hf-{lane}.safetensors") for lane in lanes}
    mask = roll.response_mask.numpy()
    new = seal_branches(contract, bundle, batch, bounds=bounds, train=train, mask=mask, out=out,
                        ref_runs={lane: {k: torch.as_tensor(v) for k, v in t.items()}
                                  for lane, t in ref_np.items()})
    old = json.loads((REF / "branches.json").read_text())
    print(f"seal_branches rerun {time.time() - t0:.0f} s")
    for lane in lanes:
        was = (REF / "branches" / f"hf-{lane}.safetensors").read_bytes()
        now = (out / "branches" / f"hf-{lane}.safetensors").read_bytes()
        print(f"branches/hf-{lane}.safetensors: {len(was)} B committed, {len(now)} B now, "
              f"identical bytes: {was == now}")
    print(f"against {REF / 'branches.json'}:")
    _gram_gap(old, new)
    if args.against is not None:
        print(f"against {args.against}:")
        _gram_gap(json.loads(args.against.read_text()), new)
    for prec, by_role in new["precisions"].items():
        for role, by_round in by_role.items():
            for rk, v in by_round.items():
                if v["tokens"]:
                    print(f"{prec} {role} {rk}: gram_rel_error {v['gram_rel_error']!r}")
    if args.seal_only:
        return
    ctrl: dict[str, dict[str, dict[str, Any]]] = {lane: {} for lane in lanes}
    for f in sorted((REF / "controls").glob("*.safetensors")):
        name, lane = f.stem.split("-", 1)
        ctrl[lane][name] = _numpy(f)
    recs = [adjust_control_errors(contract, measure_controls(ref_np, ctrl, mask),
                                  ref_runs=ref_np, control_runs=ctrl, doc=doc, out=where,
                                  train=train, mask=mask,
                                  behavior=roll.behavior_logprobs.double().numpy())
            for doc, where in ((old, REF), (new, out))]
    committed = json.loads((REF / "reference.json").read_text())
    same = (json.dumps(recs[0], sort_keys=True)
            == json.dumps(committed["control_clip_branch_adjustments"], sort_keys=True))
    print(f"control adjustments with the committed doc == committed reference.json: {same}")
    for rb, ra in zip(*recs, strict=True):
        for fam, v in rb["families"].items():
            print(f"  control {rb['control']} {rb['precision']} {rb['role']} r{rb['round']} "
                  f"{fam}: adjusted error {v['adjusted']!r} -> {ra['families'][fam]['adjusted']!r}")
    rep_b, rep_a = _judge(old), _judge(new)
    b = {(r.cell, r.klass, r.metric, r.variant, r.where): r for r in rep_b.rows}
    a = {(r.cell, r.klass, r.metric, r.variant, r.where): r for r in rep_a.rows}
    print(f"rows {len(b)} {len(a)}, same keys {set(a) == set(b)}")
    print("cell verdicts identical:",
          [(c.cell, c.verdict) for c in rep_b.cells] == [(c.cell, c.verdict) for c in rep_a.cells],
          {v: sum(c.verdict == v for c in rep_a.cells) for v in ("PASS", "FAIL", "NOT_RUN")})
    print("row verdict differences:", sum(b[k].verdict != a[k].verdict for k in b))
    changed = [k for k in b if (b[k].margin, b[k].bound, b[k].error)
               != (a[k].margin, a[k].bound, a[k].error)]
    print(f"rows whose error/bound/margin differ: {len(changed)}; adjusted rows: "
          f"{sum(1 for r in a.values() if r.adjustment)}")
    for k in changed:
        print(f"  {k[0]} {k[2]}: margin {b[k].margin!r} -> {a[k].margin!r} "
              f"({b[k].verdict} -> {a[k].verdict})")
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
