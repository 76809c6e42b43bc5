"""Run a command and sample the resident memory of it and of its descendants.

Usage: ``python scripts/repro/rss_trace.py OUT.json -- COMMAND...``

Every 0.2 s reads ``VmRSS`` of the command's process and of each descendant
(``/proc/<pid>/task/*/children``). Writes ``OUT.json``: the wall, the exit status, the
largest RSS of the top process and of any one descendant (KiB), and the time series
``[seconds since start, top RSS, largest descendant RSS]``. Also prints the top process's
peak. ``/usr/bin/time -v``'s "Maximum resident set size" is the largest of the process and its
waited-for children, one process at a time; the top process's peak is the figure the
reference stage's memory model predicts (the rollout sampler's child is another process).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(x) for x in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


def main() -> int:
    """Run the command, sample, write the JSON; return the command's exit status."""
    out = Path(sys.argv[1])
    cmd = sys.argv[sys.argv.index("--") + 1:]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    series: list[list[float]] = []
    while proc.poll() is None:
        todo, kids = _children(proc.pid), 0
        while todo:
            p = todo.pop()
            kids = max(kids, _rss_kib(p))
            todo += _children(p)
        series.append([round(time.monotonic() - t0, 2), _rss_kib(proc.pid), kids])
        time.sleep(0.2)
    doc = {"command": cmd, "returncode": proc.returncode,
           "wall_s": round(time.monotonic() - t0, 1),
           "peak_top_kib": max((s[1] for s in series), default=0),
           "peak_descendant_kib": max((s[2] for s in series), default=0), "series": series}
    out.write_text(json.dumps(doc))
    print(f"rss_trace: exit {proc.returncode}, wall {doc['wall_s']} s, top peak "
          f"{doc['peak_top_kib']} KiB, descendant peak {doc['peak_descendant_kib']} KiB",
          file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
