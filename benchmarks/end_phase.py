"""``python -m benchmarks.end_phase RUN [--reps N]``: the wall of ``qualify run``'s end phase.

The end phase is what ``qualify.pipeline.chain.run_all`` does after the candidate stage:
compare (``report.json``, ``report.md``), seal and sign, the gate decision and
``report.html``. Each repetition copies ``RUN`` (a run directory after its candidate stage,
or a compared run: its ``report.*``, ``MANIFEST.json`` and attestation are dropped from the
copy), then times those four steps in a fresh interpreter with the code on ``PYTHONPATH``
(run it from two checkouts in turn to compare them in one sitting). It signs with
``QUALIFY_SIGNING_KEY_FILE`` or the per-user development key, as ``qualify run`` does.

Prints one JSON line per repetition: seconds per step and the page's size in bytes.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from qualify.evidence.store import make_writable
from qualify.layout import ATTESTATION_FILE, MANIFEST_FILE, REPORT_JSON, REPORT_MD

_DROP = (REPORT_JSON, REPORT_MD, MANIFEST_FILE, ATTESTATION_FILE)

_CHILD = textwrap.dedent("""
    import inspect, json, sys, time
    from pathlib import Path
    t0 = time.perf_counter()
    from qualify.compare.html import write_html
    from qualify.compare.stage import compare_run
    from qualify.contract import load_contract
    from qualify.evidence.policy import policy_for
    from qualify.evidence.sign import seal_and_sign
    from qualify.jsonio import read_json
    from qualify.pipeline import chain
    run, contract_path = Path(sys.argv[1]), Path(sys.argv[2])
    t1 = time.perf_counter()
    contract = load_contract(contract_path)
    policy = policy_for(contract)
    compare_run(run)
    t2 = time.perf_counter()
    seal_and_sign(run, kind="candidate-run")
    t3 = time.perf_counter()
    if "doc" in inspect.signature(write_html).parameters:  # what run_all does now
        doc = read_json(run / "report.json")
        code, ev = chain.run_decision(run, contract, policy, report=doc)
        page = write_html(run, gate=chain.gate_view(code, ev, policy), doc=doc)
    else:  # a checkout before write_html took the validated document
        code, ev = chain.run_decision(run, contract, policy)
        page = write_html(run, gate=chain.gate_view(code, ev, policy))
    t4 = time.perf_counter()
    print(json.dumps({"imports_s": round(t1 - t0, 2), "compare_s": round(t2 - t1, 2),
                      "seal_sign_s": round(t3 - t2, 2), "decision_html_s": round(t4 - t3, 2),
                      "end_phase_s": round(t4 - t1, 2), "html_bytes": page.stat().st_size}))
""")


def _copy(run: Path, dest: Path) -> None:
    shutil.copytree(run, dest)
    make_writable(dest)  # a sealed run is read-only
    for name in _DROP:
        (dest / name).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """Time the end phase ``--reps`` times on copies of ``RUN``; one JSON line each."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.end_phase", description=__doc__)
    ap.add_argument("run", type=Path, help="a run directory (its candidate stage done)")
    ap.add_argument("--contract", type=Path, default=Path("contracts/tiny-qwen3.toml"))
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args(argv)
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="qualify-end-phase-") as tmp:
            work = Path(tmp) / args.run.name
            _copy(args.run, work)
            out = subprocess.run([sys.executable, "-c", _CHILD, str(work), str(args.contract)],
                                 check=True, capture_output=True, text=True)
            print(out.stdout.strip().splitlines()[-1])
            make_writable(work)  # sealed again by the child: let the temp dir go
    return 0


if __name__ == "__main__":
    sys.exit(main())
