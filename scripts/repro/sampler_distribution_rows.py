"""A sampler cell's round-1 decode-path rows without a sealed reference (docs/mismatch.md).

Usage: ``python scripts/repro/sampler_distribution_rows.py INPUTS DIST_DIR OUT.json
[--tp N] [--fault NAME]``

``INPUTS`` is a reference directory, sealed or interrupted, holding ``rollout.safetensors``,
``contract.json`` and ``model.json`` (what a sampler cell reads: ``sampler_start.py``);
``DIST_DIR`` holds the ``distribution.json`` / ``distribution.safetensors`` that
:func:`qualify.reference.distribution.seal_distribution` wrote for that rollout. The
sampler harness's own code runs: the engine started as a cell starts it
(``harnesses.vllm.harness._start``: FP32, the initial weights, the forced-trace decode
passes), its round-1 tensors built as a cell writes them
(:func:`harnesses.vllm.harness.round1_decode_tensors`), judged by the comparator's own
:func:`qualify.compare.distribution.distribution_rows` against ``DIST_DIR``'s sealed bounds.
``--fault sampler_decode_double_temperature`` plants the test-only decode fault. Writes the
rows (cell, family, statistic, error, bound, verdict, where) to ``OUT.json`` and prints them.

This is for a model whose whole reference stage is too long to run beside other work (the
round-2 decode-vs-prefill row needs round-1-updated weights and is not given); a candidate
run of a sealed reference gives the same rows through ``qualify run``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from sampler_start import start_sampler

from harnesses.vllm import harness
from qualify.compare.distribution import distribution_rows


def main() -> int:
    """Run the cell's round-1 decode passes, judge them, write and print the rows."""
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs", type=Path)
    ap.add_argument("dist_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--fault", action="append", default=[])
    args = ap.parse_args()
    name = f"vllm-fp32-sampler-tp{args.tp}"
    t0 = time.perf_counter()
    ins, started = start_sampler(args.inputs, tp=args.tp, faults=args.fault,
                                 output_dir=args.out.parent)
    tensors = harness.round1_decode_tensors(started.dists, ins.rows, ins.contract,
                                            ins.spec.vocab_size)
    mask = np.array([m for _, _, m in ins.rows])
    responses = np.array([r for _, r, _ in ins.rows])
    rows = distribution_rows(cell=name, tensors={k: v.numpy() for k, v in tensors.items()},
                             ref_dir=args.dist_dir, mask=mask, responses=responses)
    out = [{"cell": r.cell, "class": r.klass, "family": r.family, "statistic": r.statistic,
            "error": r.error, "bound": r.bound, "verdict": r.verdict, "where": r.where}
           for r in rows]
    doc = {"inputs": str(args.inputs), "dist_dir": str(args.dist_dir), "faults": args.fault,
           "wall_s": round(time.perf_counter() - t0, 1), "timings": started.timings,
           "decode": started.decode_facts, "routes": started.routes, "rows": out}
    args.out.write_text(json.dumps(doc, indent=1), "utf-8")
    for r in out:
        print(f"{r['family']:22s} {r['statistic']:26s} {r['error']!s:<24.24} "
              f"{r['bound']!s:<24.24} {r['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
