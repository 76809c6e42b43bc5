"""Run TRL cells by hand against a sealed reference and judge them with qualify's own rows.

Until the ``trl`` engine is registered (it needs its own interpreter), this is how a TRL
cell is qualified: run in qualify's environment, it stages the reference's harness inputs
(as ``qualify candidate`` does), writes one ``cell.json`` per precision, launches
``python -m harnesses.trl`` with TRL's venv interpreter, and judges the outputs with
:func:`qualify.compare.rows.compare_rows` against the reference run of the cell's lane::

    qualify reference harnesses/trl/contracts/tiny-qwen3-trl-dapo.toml --out /tmp/refs
    python -m harnesses.trl.check harnesses/trl/contracts/tiny-qwen3-trl-dapo.toml
        /tmp/refs/tiny-qwen3-trl-dapo-<digest12> --work /tmp/trl-work [--fault NAME]

(one command line)

Exit status 0 when every judged row is ``PASS`` or declared ``NOT_RUN``, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from safetensors.numpy import load_file

from qualify.bounds import Bound
from qualify.compare.rows import compare_rows
from qualify.contract import load_contract
from qualify.lanes import lane_of
from qualify.protocol import HarnessCell
from qualify.sampling import rollout_sampling


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m harnesses.trl.check")
    ap.add_argument("contract", type=Path)
    ap.add_argument("reference", type=Path, help="the sealed reference directory")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--python", default=".venv-trl/bin/python")
    ap.add_argument("--fault", action="append", default=[])
    args = ap.parse_args(argv)
    from qualify.candidate.stage import _stage_inputs

    contract = load_contract(args.contract)
    inputs = _stage_inputs(contract, args.reference, args.work)
    bounds = [Bound.from_dict(b) for b in
              json.loads((args.reference / "bounds.json").read_text("utf-8"))["bounds"]]
    mask = load_file(str(args.reference / "rollout.safetensors"))["response_mask"]
    env = {**os.environ, "PYTHONPATH": str(Path.cwd()), "HF_HUB_OFFLINE": "1"}
    failed = False
    for prec in contract.matrix.precisions:
        out = args.work / f"out-{prec}"
        cell = HarnessCell(engine="trl", precision=prec, options={}, actor_tp=1, critic_tp=0,
                           rounds=contract.algorithm.rounds, seed=contract.sampling.seed,
                           inputs_dir=str(inputs.resolve()), output_dir=str(out.resolve()),
                           collective_timeout_s=600.0, faults=tuple(args.fault),
                           param_sampling=rollout_sampling(contract.evidence, inputs))
        cell_file = args.work / f"cell-{prec}.json"
        cell_file.write_text(json.dumps(cell.to_dict()), "utf-8")
        t0 = time.perf_counter()
        subprocess.run([args.python, "-m", "harnesses.trl", str(cell_file)], env=env,
                       check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        lane = lane_of(prec, "autocast")
        expected = load_file(str(args.reference / "reference" / f"hf-{lane}.safetensors"))
        meta = json.loads((out / "outputs.json").read_text("utf-8"))["roles"]["actor"]
        rows = compare_rows(cell=f"trl-{prec}-actor-tp1", klass="candidate_vs_hf",
                            precision=lane, bounds=bounds,
                            obtained=load_file(str(out / "outputs.safetensors")),
                            expected=expected, mask=mask, meta=meta)
        verdicts = collections.Counter(r.verdict for r in rows)
        worst = max((r for r in rows if r.margin is not None), key=lambda r: r.margin or 0.0)
        print(f"trl-{prec}-actor-tp1 (lane {lane}, {wall:.1f} s): {dict(verdicts)}; worst "
              f"margin {worst.margin:.3g} ({worst.family}, round {worst.round})")
        for r in rows:
            if r.verdict not in ("PASS", "NOT_RUN"):
                print(f"  {r.verdict} round {r.round} {r.family}: {r.reason}")
        failed |= any(r.verdict not in ("PASS", "NOT_RUN") for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
