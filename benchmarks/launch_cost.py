"""``python -m benchmarks.launch_cost``: what each CPU launch speed-up saves on the default run.

Runs ``qualify run CONTRACT --references REFS`` (the default contract, its sealed reference
reused) once per configuration and round: every speed-up on, then each turned off alone by
its switch (:data:`MECHANISMS`), the configurations of a round in an order rotated by one
per round, so that the load of a shared machine falls on each alike. A mechanism's
``saved_s`` is the mean over rounds of (wall with it off - wall with everything on, the same
round); ``ratio_off_on`` the mean of their ratios (above 1: it saves time). Every run's
verdict table (``report.json``: cell -> verdict) must equal the all-on run's, else the run
is marked. ``--from-nothing`` adds one run with a new, empty references directory (the
reference stage too). ``lines`` is ``wc -l`` of each mechanism's modules, plus the lines of
the functions named (a mechanism that lives inside another module).

``--out FILE`` writes a result file of :mod:`benchmarks.results` (tables ``launch_mechanisms``
and ``launch_runs``), which ``python -m benchmarks --doc`` renders into
``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import pandas as pd

from benchmarks import results

ROOT: Final = results.ROOT
CONTRACT: Final = "contracts/tiny-qwen3.toml"


MECHANISMS: Final[dict[str, dict[str, Any]]] = {
    "warm launcher": {
        "off": {"QUALIFY_LAUNCHER": "torchrun"},
        "files": ["qualify/candidate/warm.py"], "functions": [],
        "what": "one interpreter imports the harness once and forks every rank (off: "
                "torchrun)"},
    "beside": {
        "off": {"QUALIFY_JOBS": "1"},
        "files": ["qualify/candidate/beside.py"], "functions": [],
        "what": "the sampler cells run beside the trainer launches (two launches at once)"},
    "ahead": {
        "off": {"QUALIFY_AHEAD": "0"},
        "files": ["qualify/candidate/ahead.py"],
        "functions": ["qualify.candidate.warm:wait_for_start", "qualify.procs:_communicate",
                      "qualify.candidate.plan:launch_host_peaks",
                      "qualify.candidate.plan:_beside"],
        "what": "each trainer launch's launcher imports while the launch before it runs"},
}
"""Each mechanism: the environment that turns it off, its modules, the functions of other
modules that are its lines, and what it does."""


def lines_of(spec: Mapping[str, Any]) -> int:
    """``wc -l`` of the mechanism's files, plus its functions' lines."""
    import importlib

    def fn_lines(ref: str) -> int:
        mod, attr = ref.split(":")
        return len(inspect.getsourcelines(getattr(importlib.import_module(mod), attr))[0])

    total = sum(len((ROOT / f).read_text(encoding="utf-8").splitlines()) for f in spec["files"])
    return total + sum(fn_lines(r) for r in spec["functions"])


def one_run(name: str, env_over: Mapping[str, str], *, references: Path, evidence: Path
            ) -> dict[str, Any]:
    """One ``qualify run`` in a child: wall seconds, exit code, the verdict table, the load."""
    env = {**os.environ, **env_over}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "qualify", "run", CONTRACT, "--references",
                           str(references), "--evidence", str(evidence), "--quiet"],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    verdicts: dict[str, str] = {}
    for report in evidence.glob("*/2*Z/report.json"):
        doc = json.loads(report.read_text(encoding="utf-8"))
        verdicts = {c["cell"]: c["verdict"] for c in doc["cells"]}
    if proc.returncode not in (0, 1):
        print(proc.stderr[-3000:], file=sys.stderr)
    return {"config": name, "env": " ".join(f"{k}={v}" for k, v in env_over.items()),
            "wall_s": wall, "rc": proc.returncode, "load_1m_at_start": load,
            "verdicts": verdicts}


def measure(rounds: int, references: Path, work: Path, *, from_nothing: bool,
            names: Sequence[str], log: Path | None) -> list[dict[str, Any]]:
    """The runs (interleaved rounds); each also appended to ``log`` (JSON lines) when given."""
    configs = ["all on", *names]
    runs: list[dict[str, Any]] = []

    def keep(row: dict[str, Any]) -> None:
        runs.append(row)
        if log is not None:
            with log.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    for r in range(rounds):
        shift = r % len(configs)
        for name in configs[shift:] + configs[:shift]:
            over = dict(MECHANISMS.get(name, {}).get("off", {}))
            row = one_run(name, over, references=references,
                          evidence=work / f"ev-{r}-{name.replace(' ', '_')}")
            row["round"] = r + 1
            keep(row)
            print(f"round {r + 1} {name}: {row['wall_s']:.1f} s (rc {row['rc']}, load "
                  f"{row['load_1m_at_start']:.1f})", flush=True)
    if from_nothing:
        fresh = work / "fresh-references"
        row = one_run("all on, from nothing", {}, references=fresh,
                      evidence=work / "ev-fresh")
        row["round"] = 0
        keep(row)
        print(f"from nothing: {row['wall_s']:.1f} s (rc {row['rc']})", flush=True)
    return runs


def summarize(runs: list[dict[str, Any]], names: Sequence[str]
              ) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """The per-mechanism table from the runs (paired within rounds), the runs table, notes."""
    notes: list[str] = []
    base = {r["round"]: r for r in runs if r["config"] == "all on"}
    for row in runs:
        ref = base.get(row["round"], next(iter(base.values())))
        row["same_verdicts"] = row["verdicts"] == ref["verdicts"] and bool(row["verdicts"])
    table = []
    for name in names:
        spec = MECHANISMS[name]
        mine = [r for r in runs if r["config"] == name and r["round"] in base]
        if not mine:
            continue
        # saved = (mechanism off) - (mechanism on), paired within each round
        pairs = [(r["wall_s"], base[r["round"]]["wall_s"]) for r in mine]
        saved = [off - on for off, on in pairs]
        table.append({"mechanism": name, "lines": lines_of(spec),
                      "switch_off": " ".join(f"{k}={v}" for k, v in spec["off"].items()),
                      "saved_s": sum(saved) / len(saved),
                      "saved_s_each_round": ", ".join(f"{s:.1f}" for s in saved),
                      "ratio_off_on": sum(off / on for off, on in pairs) / len(pairs),
                      "verdicts_same": all(r["same_verdicts"] for r in mine),
                      "what": spec["what"]})
    runs_df = pd.DataFrame([{k: v for k, v in r.items() if k != "verdicts"} for r in runs])
    if not all(r["same_verdicts"] for r in runs):
        notes.append("some run's verdict table differs from its round's all-on run "
                     "(same_verdicts false)")
    return pd.DataFrame(table), runs_df, notes


def main(argv: list[str] | None = None) -> int:
    """Measure, print the tables, optionally write the result file; 0."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.launch_cost",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--references", default="references",
                    help="the sealed references reused (default: the committed ones)")
    ap.add_argument("--from-nothing", action="store_true",
                    help="also one run with a new, empty references directory")
    ap.add_argument("--only", nargs="*", default=[], help="mechanisms to measure (default all)")
    ap.add_argument("--note", action="append", default=[], help="a note for the result file")
    ap.add_argument("--out", metavar="FILE", help="write a result file (benchmarks/results/)")
    ap.add_argument("--runs-log", metavar="FILE",
                    help="append each run to FILE as a JSON line as it ends")
    ap.add_argument("--from-runs", metavar="FILE",
                    help="measure nothing: the tables from the runs of a --runs-log FILE")
    args = ap.parse_args(argv)
    unknown = set(args.only) - set(MECHANISMS)
    if unknown:
        print(f"--only: unknown {sorted(unknown)}; known: {list(MECHANISMS)}", file=sys.stderr)
        return 2
    command = ["python", "-m", "benchmarks.launch_cost",
               *(argv if argv is not None else sys.argv[1:])]
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    doc_head = {**results.result_document(command=command, created=created, run="",
                                          tables={}, notes=[]),  # machine, commit: at start
                "run": None}
    names = [m for m in MECHANISMS if not args.only or m in args.only]
    if args.from_runs:
        rows = [json.loads(ln) for ln in Path(args.from_runs).read_text("utf-8").splitlines()
                if ln.strip()]
    else:
        work = Path(tempfile.mkdtemp(prefix="qlaunch-"))
        try:
            rows = measure(args.rounds, Path(args.references).absolute(), work,
                           from_nothing=args.from_nothing, names=names,
                           log=Path(args.runs_log) if args.runs_log else None)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    mech, runs, notes = summarize(rows, names)
    with pd.option_context("display.width", 200, "display.max_colwidth", 60):
        print(mech.drop(columns=["what"]).to_string(index=False))
    if args.out:
        doc = {**doc_head, "tables": {"launch_mechanisms": results.records(mech),
                                      "launch_runs": results.records(runs)},
               "notes": [*notes, *args.note]}
        results.write_result(args.out, doc)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
