"""``python -m benchmarks``: the framework's own costs, measured in one run, as tables.

1. **comparator**: synthetic sealed evidence in the real layout (:mod:`benchmarks.synthetic`:
   the committed tiny-qwen3 reference and one actor cell, plus a large synthetic gradient
   tensor of ``--size-gb / 2`` and four of a 32nd of it on each side), judged by the real
   ``qualify compare`` in a child process: wall and CPU seconds, MB/s of the two tensor
   files it judges the cell from, and the child's peak RSS (its own ``VmHWM`` of
   ``/proc/self/status``: ``ru_maxrss`` of a spawned child also counts the parent's
   memory at the fork, Linux carries it over ``exec``), beside its peak RSS once its
   modules are imported and the largest tensor; CPU seconds from ``os.wait4``;
2. **verify**: the run sealed and signed with a throw-away key, then the real
   ``qualify verify`` (every file's sha256, the signature, and step 9: the report
   recomputed) and the manifests' sha256 alone, each in a child: MB/s of the bytes hashed;
3. **launches / stages**: fixed cost per launch and per cell and wall / engine compute per
   stage, read from a run's evidence (``--run``, default the committed tiny-qwen3 run;
   :mod:`benchmarks.evidence_cost`), with what the evidence does not record;
4. **teardown**: :mod:`benchmarks.teardown` (``sys.exit`` vs ``os._exit`` of a child that
   imports the trainer engines); skipped with ``--quick``.

The synthetic evidence goes under ``--workdir`` (default a new temporary directory) and is
removed afterwards unless ``--keep``. ``--out FILE`` also writes every table, the command
and the machine as a result file (:mod:`benchmarks.results`); ``--doc`` renders
``docs/performance.md`` from the committed result files in ``benchmarks/results/`` (with
``--check``: exit 1 when the page differs) and measures nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pandas as pd

from benchmarks import evidence_cost, results, teardown
from benchmarks.synthetic import COMMITTED_RUN, ROOT, Synthetic, build, sign_run

MB = 1e6

_CHILD = textwrap.dedent("""
    import json, sys
    def hwm_kb():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
    import numpy, safetensors, pandas  # noqa: F401
    import qualify.cli.main, qualify.compare.stage, qualify.evidence.verify  # noqa: F401
    base = hwm_kb()
    if sys.argv[1] == "hash":
        from qualify.evidence import store
        problems = [p for d in sys.argv[2:] for p in store.verify_manifest(d)]
        rc = 1 if problems else 0
    else:
        rc = qualify.cli.main.main(sys.argv[1:])
    print(json.dumps({"base_rss_kb": base, "peak_rss_kb": hwm_kb(), "rc": rc}))
""")


def _child(args: list[str]) -> dict[str, Any]:
    """Run the measured child: wall, CPU s, peak RSS, RSS after imports (MB), exit code.

    CPU seconds from ``os.wait4``; the RSS figures are the child's own ``VmHWM``.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    assert proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    try:
        doc = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"benchmark child {args[:2]} failed (exit {proc.returncode}): "
                           f"{err.strip()[-2000:]}") from None
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_mb": doc["peak_rss_kb"] * 1024 / MB,
            "base_rss_mb": doc["base_rss_kb"] * 1024 / MB, "rc": doc["rc"]}


def _files_bytes(*dirs: Path) -> int:
    return sum(p.stat().st_size for d in dirs for p in d.rglob("*") if p.is_file())


def comparator_and_verify(syn: Synthetic) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Measure ``qualify compare`` and ``qualify verify`` on the synthetic evidence.

    Returns:
        The comparator table (``command``, ``MB``, ``wall_s``, ``cpu_s``, ``MB_per_s_wall``,
        ``MB_per_s_cpu``, ``peak_rss_mb``, ``base_rss_mb``, ``largest_tensor_mb``,
        ``peak_over_largest``, ``growth_over_largest`` ((peak - base) / largest)) and the
        verify table (``command``, ``MB``, ``wall_s``, ``cpu_s``, ``MB_per_s_wall``,
        ``MB_per_s_cpu``, ``peak_rss_mb``).

    Raises:
        RuntimeError: a child failed (its stderr tail in the message).
    """
    largest = syn.largest_bytes / MB
    c = _child(["compare", str(syn.run), "--no-seal", "--reference", str(syn.reference)])
    if c["rc"] not in (0, 1):
        raise RuntimeError(f"qualify compare exited {c['rc']}")
    mb = syn.compared_bytes / MB
    comp = pd.DataFrame([{
        "command": "qualify compare", "MB": mb, "wall_s": c["wall_s"], "cpu_s": c["cpu_s"],
        "MB_per_s_wall": mb / c["wall_s"], "MB_per_s_cpu": mb / c["cpu_s"],
        "peak_rss_mb": c["peak_rss_mb"], "base_rss_mb": c["base_rss_mb"],
        "largest_tensor_mb": largest, "peak_over_largest": c["peak_rss_mb"] / largest,
        "growth_over_largest": (c["peak_rss_mb"] - c["base_rss_mb"]) / largest}])
    sign_run(syn)
    hashed = _files_bytes(syn.reference, syn.run) / MB
    rows = []
    v = _child(["verify", str(syn.run), "--keys", str(syn.keys), "--contracts-dir",
                str(ROOT / "contracts"), "--reference", str(syn.reference)])
    if v["rc"] != 0:
        raise RuntimeError(f"qualify verify exited {v['rc']} on the synthetic run")
    h = _child(["hash", str(syn.reference), str(syn.run)])
    if h["rc"] != 0:
        raise RuntimeError("the synthetic run's manifests do not verify")
    for name, m in (("qualify verify (hashes + step 9 recompute)", v),
                    ("sha256 of every manifest file", h)):
        rows.append({"command": name, "MB": hashed, "wall_s": m["wall_s"], "cpu_s": m["cpu_s"],
                     "MB_per_s_wall": hashed / m["wall_s"], "MB_per_s_cpu": hashed / m["cpu_s"],
                     "peak_rss_mb": m["peak_rss_mb"]})
    return comp, pd.DataFrame(rows)


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    """Every benchmark of the suite; name -> table (``notes``: a list of strings)."""
    out: dict[str, Any] = {}
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="qbench-"))
    target = work / "synthetic"
    try:
        syn = build(target, size_bytes=int(args.size_gb * 1e9))
        out["comparator"], out["verify"] = comparator_and_verify(syn)
    finally:
        if not args.keep:
            shutil.rmtree(target, ignore_errors=True)
            if not args.workdir:
                shutil.rmtree(work, ignore_errors=True)
    run = Path(args.run)
    out["launches"] = evidence_cost.launch_table(run)
    out["stages"], out["notes"] = evidence_cost.stage_table(run, out["launches"])
    return out


def _fmt(x: float) -> str:
    return f"{x:.2f}"


def main(argv: list[str] | None = None) -> int:
    """Print every table; returns 0 (a failed child raises)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=2.0,
                    help="largest synthetic tensor is half of this (default 2: 1 GB)")
    ap.add_argument("--run", default=str(COMMITTED_RUN),
                    help="run directory whose launches and stages are tabulated")
    ap.add_argument("--quick", action="store_true", help="skip the teardown benchmark")
    ap.add_argument("--workdir", help="where the synthetic evidence goes (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic evidence")
    ap.add_argument("--out", metavar="FILE",
                    help="also write the tables, the command and the machine as JSON "
                         "(commit it under benchmarks/results/)")
    ap.add_argument("--doc", action="store_true",
                    help="render docs/performance.md from benchmarks/results/*.json; measure "
                         "nothing")
    ap.add_argument("--check", action="store_true",
                    help="with --doc: exit 1 when docs/performance.md differs from the files")
    args = ap.parse_args(argv)
    if args.doc:
        return results.write_doc(check=args.check)
    if args.check:
        print("--check: only with --doc", file=sys.stderr)
        return 2
    if args.out and not Path(args.out).absolute().parent.is_dir():
        print(f"--out: {args.out}: its directory does not exist", file=sys.stderr)
        return 2
    command = ["python", "-m", "benchmarks", *(argv if argv is not None else sys.argv[1:])]
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if args.size_gb <= 0:
        print(f"--size-gb: {args.size_gb} is not positive", file=sys.stderr)
        return 2
    if not (Path(args.run) / "run.json").is_file():
        print(f"--run: {args.run}/run.json not found", file=sys.stderr)
        return 2
    print(f"# benchmarks {created}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}")
    res = run_suite(args)
    tables = {name: res[name] for name in ("comparator", "verify", "launches", "stages")}
    for name in ("comparator", "verify", "launches", "stages"):
        print(f"\n## {name}")
        print(res[name].to_string(index=False, float_format=_fmt))
    for n in res["notes"]:
        print(f"note: {n}")
    if not args.quick:
        print("\n## teardown")
        tables["teardown"] = teardown.table(3)
        print(tables["teardown"].to_string(index=False, float_format=_fmt))
    if args.out:
        results.write_result(args.out, results.result_document(
            command=command, created=created, run=str(args.run), tables=tables,
            notes=res["notes"]))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
