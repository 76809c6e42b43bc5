"""Run a command and sample the resident memory of it and of its descendants.

Usage: ``python scripts/repro/rss_trace.py OUT.json [--match TEXT] -- COMMAND...``

Every 0.2 s reads ``VmRSS`` of the command's process and of each descendant
(``/proc/<pid>/task/*/children``), and the ``Pss`` (``/proc/<pid>/smaps_rollup``: each
shared page divided among the processes mapping it, so a sum over processes counts the
machine's memory once) of the whole tree and of the processes whose command line contains
``TEXT`` with their descendants. Writes ``OUT.json``: the wall, the exit status, the largest
RSS of the top process and of any one descendant, the largest tree and matched PSS sums
(KiB), and the time series ``[seconds since start, top RSS, largest descendant RSS, tree
PSS, matched PSS]``. Also prints the peaks. Reading ``smaps_rollup`` walks each process's
mappings under its memory lock, every 0.2 s: it can slow a process of many GB a little, so
wall times beside it are not clean timings. ``/usr/bin/time -v``'s "Maximum resident set
size" is the largest of the process and its waited-for children, one process at a time;
the top process's peak is the figure the reference stage's memory model predicts for the
steps it runs itself (the rollout sampler's child is another process; the plan's rollout
step is the stage's process and that child together: the tree's PSS).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path


def _kib(pid: int, file: str, field: str) -> int:
    """The KiB of ``field`` (``VmRSS:``, ``Pss:``) in ``/proc/<pid>/<file>``; 0 if gone."""
    try:
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _rss_kib(pid: int) -> int:
    return _kib(pid, "status", "VmRSS:")


def _pss_kib(pid: int) -> int:
    return _kib(pid, "smaps_rollup", "Pss:")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(x) for x in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


def _matches(pid: int, text: str) -> bool:
    try:
        return text in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False


def main() -> int:
    """Run the command, sample, write the JSON; return the command's exit status."""
    out = Path(sys.argv[1])
    sep = sys.argv.index("--")
    opts = sys.argv[2:sep]
    if opts not in ([], ["--match", *opts[1:2]]) or opts == ["--match"]:
        raise SystemExit("usage: rss_trace.py OUT.json [--match TEXT] -- COMMAND...")
    match = opts[1] if opts else None
    cmd = sys.argv[sep + 1:]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    series: list[list[float]] = []
    while proc.poll() is None:
        todo = [(c, match is not None and _matches(c, match)) for c in _children(proc.pid)]
        top = _pss_kib(proc.pid)
        kids, tree = 0, top
        matched = top if match is not None and _matches(proc.pid, match) else 0
        while todo:
            p, inside = todo.pop()
            kids = max(kids, _rss_kib(p))
            pss = _pss_kib(p)
            tree += pss
            inside = inside or (match is not None and _matches(p, match))
            matched += pss if inside else 0
            todo += [(c, inside) for c in _children(p)]
        series.append([round(time.monotonic() - t0, 2), _rss_kib(proc.pid), kids, tree,
                       matched])
        time.sleep(0.2)
    doc = {"command": cmd, "match": match, "returncode": proc.returncode,
           "wall_s": round(time.monotonic() - t0, 1),
           "peak_top_kib": max((s[1] for s in series), default=0),
           "peak_descendant_kib": max((s[2] for s in series), default=0),
           "peak_tree_pss_kib": max((s[3] for s in series), default=0),
           "peak_matched_pss_kib": max((s[4] for s in series), default=0), "series": series}
    out.write_text(json.dumps(doc))
    print(f"rss_trace: exit {proc.returncode}, wall {doc['wall_s']} s, top peak "
          f"{doc['peak_top_kib']} KiB, descendant peak {doc['peak_descendant_kib']} KiB, tree "
          f"PSS peak {doc['peak_tree_pss_kib']} KiB, matched PSS peak "
          f"{doc['peak_matched_pss_kib']} KiB", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
