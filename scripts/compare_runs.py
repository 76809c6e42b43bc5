"""Are two runs of one contract the same numbers? Every tensor bitwise, every report row.

``python scripts/compare_runs.py RUN_A RUN_B`` (run directories, or evidence roots holding
one ``<contract>/<run id>/`` each): compares every cell attempt's ``*.safetensors`` tensor
by its bytes and every ``report.json`` row's error, bound and verdict, and prints one line;
exit 0 when all are equal, 1 otherwise. ``docs/performance.md``'s launcher measurements used it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from safetensors.numpy import load_file


def _run_dir(path: Path) -> Path:
    if (path / "run.json").is_file():
        return path
    found = sorted(p.parent for p in path.glob("*/*/run.json"))
    if len(found) != 1:
        raise SystemExit(f"{path}: expected one run directory below it, found {len(found)}")
    return found[0]


def _rows(run: Path) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    rep = json.loads((run / "report.json").read_text("utf-8"))
    return {(r["cell"], r["metric"], r["class"], r.get("variant"), r.get("where")):
            (r["error"], r["bound"], r["verdict"]) for r in rep["rows"]}


def main(argv: list[str]) -> int:
    """Compare the two runs of ``argv``; 0 when equal, 1 when not, 2 on usage."""
    if len(argv) != 2:
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    a, b = (_run_dir(Path(x)) for x in argv)
    ca = json.loads((a / "run.json").read_text("utf-8"))["cells"]
    cb = json.loads((b / "run.json").read_text("utf-8"))["cells"]
    if sorted(ca) != sorted(cb):
        print(f"cells differ: {sorted(set(ca) ^ set(cb))}")
        return 1
    tensors = differ = 0
    for cid, entry in sorted(ca.items()):
        if not entry.get("attempt") or not cb[cid].get("attempt"):
            continue
        for f in sorted((a / entry["attempt"]).glob("*.safetensors")):
            ta, tb = load_file(str(f)), load_file(str(b / cb[cid]["attempt"] / f.name))
            for k in sorted(set(ta) | set(tb)):
                tensors += 1
                if k not in ta or k not in tb or ta[k].tobytes() != tb[k].tobytes():
                    differ += 1
    ra, rb = _rows(a), _rows(b)
    same = differ == 0 and ra == rb
    print(f"{a} vs {b}: {tensors} tensors, {differ} differ; {len(ra)} / {len(rb)} report "
          f"rows, {'equal' if ra == rb else 'different'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
