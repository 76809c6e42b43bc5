"""``python -m benchmarks.cpu_breakdown``: CPU seconds of a run's process tree, per process kind.

Measure: ``python -m benchmarks.cpu_breakdown --tag NAME --out RUN.json -- CMD ...`` runs
``CMD`` (e.g. ``qualify run contracts/tiny-qwen3.toml --references references --evidence
DIR --quiet``), polls ``/proc`` every ``--poll`` seconds for every descendant of it, and
keeps each process's last seen ``utime + stime`` (``/proc/<pid>/stat`` fields 14 and 15)
with its command line. A process that ends between two polls loses at most one poll's CPU
time: the total from ``os.wait4`` of ``CMD`` (``ru_utime + ru_stime`` of the whole reaped
tree) is kept beside the sum, so that loss is visible. Kinds are named from the command
line (:func:`kind_of`). One JSON document per run: the tag, wall, the 1-minute load
average at the start, the total, per kind (count, CPU s) and per process.

Summarise: ``python -m benchmarks.cpu_breakdown --from-runs A.json B.json ... [--note N]
--out FILE`` writes a result file of :mod:`benchmarks.results` (tables ``cpu_runs``: one
row per run; ``cpu_kinds``: CPU s per process kind, one column per run), which
``python -m benchmarks --doc`` renders into ``docs/performance.md``.

On a machine shared with other work, other processes' load inflates a run's wall and,
less, its CPU seconds (spinning threads): read each run with its load, and alternate the
runs that are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd

from benchmarks import results

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


def _sample(pid: int) -> tuple[float, str, str, int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2:].split()
    comm = stat[stat.index("(") + 1:stat.rindex(")")]
    return (int(rest[11]) + int(rest[12])) / TICK, cmd, comm, int(rest[1]), cwd


def kind_of(cmd: str, comm: str, cwd: str = "") -> str:
    """A short name for a process of a qualify run, from its command line.

    A process the fork server forked (:mod:`qualify.candidate.forkserver`) keeps the
    server's command line: it is named from its ``comm``
    (:func:`~qualify.candidate.forkserver.process_name`) and working directory (a launch's
    attempt directory).
    """
    if "qualify.candidate.forkserver" in cmd:
        return _forked_kind(comm, cwd)
    if "harnesses.vllm.harness" in cmd or "harnesses/vllm/harness" in cmd:
        return "vllm sampler parent"
    if "multiprocessing.spawn" in cmd or "multiprocessing.resource_tracker" in cmd:
        return ("vllm mp: resource tracker" if "resource_tracker" in cmd
                else "vllm mp: spawned TP worker")
    for eng in ("deepspeed", "megatron", "torch_tp", "fsdp2", "vllm"):
        if f"harnesses.{eng}" in cmd or f"launches/{eng}-" in cmd:
            return f"{eng} launch"
    if "qualify" in cmd and "run" in cmd:
        return "qualify parent"
    return f"other: {comm}"


_LAUNCH_DIR = re.compile(r"/launches/([A-Za-z0-9_.]+)-[^/]*/attempt-[0-9]+(?:/|$)")
"""A launch's attempt directory (``launches/<engine>-<layout>/attempt-N``): its engine."""


def _forked_kind(comm: str, cwd: str) -> str:
    """:func:`kind_of` of the fork server and what it forked.

    The vLLM harness by its name; a launcher (a plugin engine's too) by the engine of the
    launch attempt it runs in; the server itself keeps the interpreter's name (``python``);
    anything else is ``forked: <comm>``.
    """
    if comm == "vllm.harness":
        return "vllm sampler parent"
    found = _LAUNCH_DIR.search(cwd)
    if found is not None:
        return f"{found.group(1)} launch"
    return "fork server" if comm.startswith("python") else f"forked: {comm}"


MIN_CPU_S = 0.05
"""Kinds under this many CPU seconds in every run are left out of ``cpu_kinds``."""


def kinds_of(processes: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Name each process's kind (``kind`` key, set here); count and CPU s per kind.

    A process forked by a vLLM sampler harness with the same command line is one of its
    ``external_launcher`` ranks.
    """
    by_pid = {int(p["pid"]): p for p in processes}
    for rec in processes:
        rec["kind"] = kind_of(rec["cmd"], rec["comm"], rec.get("cwd", ""))
    for rec in processes:
        up = by_pid.get(int(rec["ppid"]))
        if (rec["kind"] == "vllm sampler parent" and up is not None
                and up["kind"] == "vllm sampler parent"):
            rec["kind"] = "vllm sampler rank (forked)"
    kinds: dict[str, dict[str, float]] = {}
    for rec in processes:
        k = kinds.setdefault(rec["kind"], {"n": 0, "cpu_s": 0.0})
        k["n"] += 1
        k["cpu_s"] = round(k["cpu_s"] + rec["cpu_s"], 2)
    return kinds


def summarize(files: list[Path], notes: list[str], out: Path) -> None:
    """Write the result file of the runs in ``files`` (module docstring)."""
    docs = [json.loads(f.read_text("utf-8")) for f in files]
    for d in docs:  # named again with this module's kinds
        d["kinds"] = kinds_of(d["processes"])
    tags = [str(d.get("tag") or f.stem) for d, f in zip(docs, files, strict=True)]
    runs = pd.DataFrame([{"run": t, "code": d.get("code", ""), "rc": d["rc"],
                          "load_1m_at_start": round(d["load_at_start"][0], 2),
                          "wall_s": d["wall_s"], "cpu_s": d["cpu_total_wait4_s"],
                          "cpu_polled_s": d["cpu_sum_polled_s"]}
                         for t, d in zip(tags, docs, strict=True)])
    kinds = sorted({k for d in docs for k in d["kinds"]},
                   key=lambda k: -max(d["kinds"].get(k, {}).get("cpu_s", 0.0) for d in docs))
    kinds = [k for k in kinds if max(d["kinds"].get(k, {}).get("cpu_s", 0.0)
                                     for d in docs) >= MIN_CPU_S]
    sampler = [k for k in kinds if k.startswith("vllm")]
    rows = [{"kind": k, **{t: d["kinds"].get(k, {}).get("cpu_s", 0.0)
                           for t, d in zip(tags, docs, strict=True)}} for k in kinds]
    rows.append({"kind": "vllm sampler, all its processes", **{
        t: round(sum(d["kinds"].get(k, {}).get("cpu_s", 0.0) for k in sampler), 2)
        for t, d in zip(tags, docs, strict=True)}})
    table = pd.DataFrame(rows)
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    command = ["python", "-m", "benchmarks.cpu_breakdown", "--from-runs", *map(str, files),
               *(x for n in notes for x in ("--note", n)), "--out", str(out)]
    doc = results.result_document(command=command, created=created, run="",
                                  tables={"cpu_runs": runs, "cpu_kinds": table}, notes=notes)
    doc["run"] = None
    results.write_result(out, doc)


def main() -> int:
    """Measure one run, or summarise several (module docstring)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--poll", type=float, default=0.1)
    ap.add_argument("--tag", default="", help="the run's name in the tables")
    ap.add_argument("--code", default="", help="what code ran (a commit, a checkout)")
    ap.add_argument("--from-runs", type=Path, nargs="*", default=None,
                    help="summarise these measured runs into a result file")
    ap.add_argument("--note", action="append", default=[], help="a note for the result file")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    if a.from_runs:
        summarize(a.from_runs, a.note, a.out)
        return 0
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
            cpu, c, comm, ppid, cwd = s
            rec = seen.setdefault(pid, {"pid": pid, "ppid": ppid, "cmd": c[:300], "comm": comm})
            rec["cwd"] = cwd
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
    kinds = kinds_of(list(seen.values()))
    doc = {"tag": a.tag, "code": a.code, "cmd": cmd, "rc": os.waitstatus_to_exitcode(status),
           "wall_s": round(wall, 2),
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
