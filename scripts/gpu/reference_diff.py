"""How far a reference sealed on CUDA lies from the same contract's reference sealed on CPU.

Usage: ``python scripts/gpu/reference_diff.py CPU_REF CUDA_REF --json OUT.json``

Both are sealed reference directories of one contract (``qualify reference``; the CUDA one
with the models on the GPU, ``qualify.reference.devices``). For every safetensors file the
two share (``reference/``, ``controls/``, ``branches/``, ``scores/`` and the top level) and
every tensor in both: whether it is bitwise equal, its largest absolute difference and that
over the CPU tensor's largest magnitude. For every bound of ``bounds.json`` (matched by
class, precision, control, round, role, family and statistic) the ratio CUDA / CPU. Each
reference's ``environment.json`` ``reference_devices`` is copied as is. Nothing is judged:
a CUDA reference is its own device kind's reference (its bounds are not mixed with the CPU
one's); this shows how different the two are. Exit 0 when both were read, 2 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

GLOBS = ("reference/*.safetensors", "controls/*.safetensors", "branches/*.safetensors",
         "scores/*.safetensors", "*.safetensors")
BOUND_KEY = ("class", "precision", "control", "round", "role", "family", "statistic")


def tensor_diff(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """``bitwise``, ``max_abs`` and ``max_rel`` (over ``max |a|``) of two same-shape arrays."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"bitwise": False, "max_abs": None, "max_rel": None,
                "mismatch": f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"}
    if a.tobytes() == b.tobytes():
        return {"bitwise": True, "max_abs": 0.0, "max_rel": 0.0}
    x, y = a.astype(np.float64), b.astype(np.float64)
    d = float(np.nanmax(np.abs(x - y))) if x.size else 0.0
    scale = float(np.nanmax(np.abs(x))) if x.size else 0.0
    return {"bitwise": False, "max_abs": d, "max_rel": d / scale if scale > 0 else None}


def diff(cpu: Path, cuda: Path) -> dict[str, Any]:
    """The comparison document (module docstring)."""
    from safetensors.numpy import load_file

    files: dict[str, Any] = {}
    for g in GLOBS:
        for p in sorted(cuda.glob(g)):
            rel = str(p.relative_to(cuda))
            if not (cpu / rel).is_file():
                files[rel] = {"missing_in_cpu": True}
        for p in sorted(cpu.glob(g)):
            rel = str(p.relative_to(cpu))
            other = cuda / rel
            if not other.is_file():
                files[rel] = {"missing_in_cuda": True}
                continue
            x, y = load_file(p), load_file(other)
            per = {k: tensor_diff(x[k], y[k]) for k in sorted(x.keys() & y.keys())}
            rels = [v["max_rel"] for v in per.values() if v["max_rel"] is not None]
            worst = max(per, key=lambda k: per[k]["max_rel"] or 0.0, default=None)
            files[rel] = {"tensors": len(per), "bitwise": sum(v["bitwise"] for v in per.values()),
                          "only_cpu": sorted(x.keys() - y.keys()),
                          "only_cuda": sorted(y.keys() - x.keys()),
                          "max_rel": max(rels, default=0.0), "worst": worst}
    bounds: dict[str, Any] = {}
    try:
        bx, by = (json.loads((d / "bounds.json").read_text("utf-8"))["bounds"]
                  for d in (cpu, cuda))

        def key(b: dict[str, Any]) -> str:
            return "/".join(str(b.get(k)) for k in BOUND_KEY)

        # float(): bounds.json writes a non-finite bound as a string
        cx = {key(b): float(b["bound"]) for b in bx}
        cy = {key(b): float(b["bound"]) for b in by}
        ratios = {k: (cy[k] / v if v and math.isfinite(v) and math.isfinite(cy[k]) else None)
                  for k, v in cx.items() if k in cy}
        dup = len(bx) - len(cx) + len(by) - len(cy)
        finite = [r for r in ratios.values() if r is not None]
        bounds = {"matched": len(ratios), "cpu": len(bx), "cuda": len(by),
                  "duplicate_keys": dup,
                  "ratio_min": min(finite, default=None), "ratio_max": max(finite, default=None),
                  "ratios": ratios}
    except (OSError, KeyError, ValueError, TypeError) as e:
        bounds = {"error": str(e)}

    def devices(d: Path) -> Any:
        try:
            return json.loads((d / "environment.json").read_text("utf-8")).get(
                "reference_devices")
        except (OSError, ValueError):
            return None

    return {"cpu": str(cpu), "cuda": str(cuda), "files": files, "bounds": bounds,
            "reference_devices": {"cpu": devices(cpu), "cuda": devices(cuda)}}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cpu", type=Path)
    p.add_argument("cuda", type=Path)
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    for d in (args.cpu, args.cuda):
        if not (d / "reference.json").is_file():
            print(f"reference_diff: {d}: not a sealed reference directory", file=sys.stderr)
            return 2
    doc = diff(args.cpu, args.cuda)
    args.json.write_text(json.dumps(doc, indent=1) + "\n", "utf-8")
    worst = max((f.get("max_rel") or 0.0 for f in doc["files"].values()), default=0.0)
    print(f"reference_diff: {len(doc['files'])} files, largest relative difference "
          f"{worst:.3g}; bounds CUDA/CPU {doc['bounds'].get('ratio_min')} .. "
          f"{doc['bounds'].get('ratio_max')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
