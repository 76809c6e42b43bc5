"""CPU seconds of a command's process tree, per process kind (Linux ``/proc``).

``python scripts/repro/run_cpu_breakdown.py --out FILE.json -- CMD ...`` runs ``CMD``,
polls ``/proc`` every ``--poll`` seconds for every descendant of it, and keeps each
process's last seen ``utime + stime`` (``/proc/<pid>/stat`` fields 14 and 15, in clock
ticks) with its command line. A process that ends between two polls loses at most one
poll's CPU time; the total from ``os.wait4`` of ``CMD`` (``ru_utime + ru_stime`` of the
whole reaped tree) is printed beside the sum, so that loss is visible. Kinds are named
from the command line (``kind_of``). One JSON document: wall, the load average at the
start, the total, per kind (count, CPU s) and per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        tree.setdefault(ppid, []).append(int(d))
    return tree


def _descendants(root: int) -> list[int]:
    tree, out, todo = _children(), [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(tree.get(p, []))
    return out


def _sample(pid: int) -> tuple[float, str, str, int] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2:].split()
    comm = stat[stat.index("(") + 1:stat.rindex(")")]
    return (int(rest[11]) + int(rest[12])) / TICK, cmd, comm, int(rest[1])


def kind_of(cmd: str, comm: str) -> str:
    """A short name for a process of a qualify run, from its command line."""
    if "harnesses.vllm.harness" in cmd or "harnesses/vllm/harness" in cmd:
        return "vllm sampler parent"
    if "multiprocessing.spawn" in cmd or "multiprocessing.resource_tracker" in cmd:
        return "vllm spawned (TP worker / tracker): " + ("tracker" if "resource_tracker" in cmd
                                                         else "worker")
    for eng in ("deepspeed", "megatron", "torch_tp", "fsdp2", "vllm"):
        if f"harnesses.{eng}" in cmd or f"launches/{eng}-" in cmd:
            return f"{eng} launch"
    if "qualify" in cmd and "run" in cmd:
        return "qualify parent"
    return f"other: {comm}"


def main() -> int:
    """Run the command and write the breakdown."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--poll", type=float, default=0.1)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    load = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    seen: dict[int, dict[str, Any]] = {}
    status = None
    while status is None:
        for pid in _descendants(proc.pid):
            s = _sample(pid)
            if s is None:
                continue
            cpu, c, comm, ppid = s
            rec = seen.setdefault(pid, {"pid": pid, "ppid": ppid, "cmd": c[:300], "comm": comm})
            rec["cpu_s"] = cpu
            if len(c) > len(rec["cmd"]):
                rec["cmd"] = c[:300]
            rec["comm"] = comm
        time.sleep(a.poll)
        wpid, st, ru = os.wait4(proc.pid, os.WNOHANG)
        if wpid:
            status = st
            total = ru.ru_utime + ru.ru_stime
    wall = time.perf_counter() - t0
    kinds: dict[str, dict[str, float]] = {}
    for rec in seen.values():
        rec["kind"] = kind_of(rec["cmd"], rec["comm"])
    for rec in seen.values():  # a process forked by a sampler parent: an external_launcher rank
        up = seen.get(rec["ppid"])
        if (rec["kind"] == "vllm sampler parent" and up is not None
                and up["kind"] == "vllm sampler parent"):
            rec["kind"] = "vllm sampler rank (forked)"
    for rec in seen.values():
        k = kinds.setdefault(rec["kind"], {"n": 0, "cpu_s": 0.0})
        k["n"] += 1
        k["cpu_s"] = round(k["cpu_s"] + rec["cpu_s"], 2)
    doc = {"cmd": cmd, "rc": os.waitstatus_to_exitcode(status), "wall_s": round(wall, 2),
           "load_at_start": load, "cpu_total_wait4_s": round(total, 2),
           "cpu_sum_polled_s": round(sum(r["cpu_s"] for r in seen.values()), 2),
           "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["cpu_s"])),
           "processes": sorted(seen.values(), key=lambda r: -r["cpu_s"])}
    a.out.write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: doc[k] for k in ("rc", "wall_s", "load_at_start", "cpu_total_wait4_s",
                                          "cpu_sum_polled_s", "kinds")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
