"""Print the kill table of issue #15 as Markdown: run ``tests/test_kill_points.py``, or read rows.

Usage::

    python scripts/kill_table.py                 # run every kill point (slow ones too)
    python scripts/kill_table.py -m "not slow"   # the fast points only
    python scripts/kill_table.py --rows F [F...] # print rows recorded earlier (JSON lines)

The test appends one JSON row per point that passed to ``$QUALIFY_KILL_TABLE``; a point
that failed has no row, and the table then says which are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = ROOT / "tests" / "test_kill_points.py"
COLUMNS = (("point", "point"), ("killed", "killed"), ("state", "state left"),
           ("after_kill", "audit / gate of that state"), ("next_did", "next plain invocation did"),
           ("next_rc", "exit"), ("equal", "final report equal to the clean run's"),
           ("gate", "then `qualify gate`"), ("audit", "then `qualify audit`"))
ORDER = ("ref-controls", "ref-write", "ref-sign", "cand-start", "cand-ranks", "cand-split",
         "cmp-report", "cmp-seal", "cmp-sign", "run-kill9", "run-sigint", "run-sigterm",
         "run-full", "run-cells", "run-seal", "run-sign")


def render(rows: list[dict[str, str]]) -> str:
    """The Markdown table of ``rows`` (in :data:`ORDER`), with a line for missing points."""
    rank = {p: i for i, p in enumerate(ORDER)}
    latest = {r["point"]: r for r in rows}  # a point recorded twice: its last row
    rows = sorted(latest.values(), key=lambda r: rank.get(r["point"], len(ORDER)))
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [str(r.get(k, "")).replace("|", "\\|") for k, _ in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    missing = [p for p in ORDER if p not in {r["point"] for r in rows}]
    if missing:
        lines.append(f"\nno row (failed or not selected): {', '.join(missing)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the kill test (or read ``--rows``) and print the table.

    Returns:
        The test's exit code (0 with ``--rows``).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=Path, nargs="+",
                        help="JSON-lines rows recorded by the test (later files win)")
    parser.add_argument("-m", dest="marks", help="pytest -m expression (default: every point)")
    args = parser.parse_args(argv)
    rc = 0
    if args.rows is not None:
        paths = list(args.rows)
    else:
        fd, name = tempfile.mkstemp(prefix="kill-table-", suffix=".jsonl")
        os.close(fd)
        path = Path(name)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", str(TEST)]
        if args.marks:
            cmd += ["-m", args.marks]
        rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "QUALIFY_KILL_TABLE": str(path)},
                            check=False).returncode
        paths = [path]
    rows = [json.loads(line) for p in paths
            for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    print(render(rows))
    return rc


if __name__ == "__main__":
    sys.exit(main())
