"""``qualify report RUN_DIR [--html PATH] [--contract C [--policy P]]``: a run's ``report.html``.

The page (:mod:`qualify.compare.html`) is made from the run's ``report.json`` and its
stored tensors only, so it can be made for any compared run, signed or not, at any time.
It is written beside the run directory by default (``<run-id>.report.html``), never inside
it: a sealed run's every file is in its signed manifest. The command prints each failing
cell's root cause, one line per cell, and the page's path; it exits 0 when the page was
written (it judges nothing), 2 when ``RUN_DIR`` is not a compared run. With ``--contract``
the page also shows the gate's decision by the contract's gate policy (``--policy`` or
``contracts/gates/<name>.toml``), as ``qualify run`` writes it: expected failures XFAIL.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from qualify.display import printable
from qualify.errors import ExitCode, UsageError

__all__ = ["register"]


def _cmd_report(args: argparse.Namespace) -> ExitCode:
    from qualify.compare.diff import read_run_report
    from qualify.compare.html import write_html
    from qualify.compare.rootcause import causes_of_report
    from qualify.layout import REPORT_JSON

    run_dir = Path(args.run_dir)
    doc = read_run_report(run_dir)
    from qualify.cli.outputs import output_file
    from qualify.compare.html import default_html_path

    output_file(args.html or default_html_path(run_dir), "--html")
    gate = None
    if args.contract:
        from qualify.contract import load_contract
        from qualify.evidence.policy import policy_for
        from qualify.pipeline.chain import gate_view, run_decision

        contract = load_contract(args.contract)
        if (doc.get("contract"), doc.get("contract_digest")) != (contract.name,
                                                                 contract.digest):
            got = (doc.get("contract"), str(doc.get("contract_digest"))[:12])
            raise UsageError(f"{args.contract}: contract {contract.name} ({contract.digest12}) "
                             f"is not the run's ({got[0]}, {got[1]}; {run_dir / REPORT_JSON} "
                             "contract / contract_digest)")
        policy = policy_for(contract, args.policy)
        gate = gate_view(*run_decision(run_dir, contract, policy), policy, verified=False)
    elif args.policy:
        raise UsageError("--policy needs --contract (the policy judges that contract's cells)")
    path = write_html(run_dir, Path(args.html) if args.html else None, gate=gate)
    for rc in causes_of_report(doc):
        print(f"root cause: {printable(rc.line())}")
    print(f"report.html: {printable(path)}")
    return ExitCode.OK


def _cmd_diff(args: argparse.Namespace) -> ExitCode:
    from qualify.compare.diff import diff_runs
    from qualify.evidence import store

    if args.json:
        out = Path(args.json)
        if out.is_dir() or not out.parent.is_dir():
            raise UsageError(f"{out}: --json: not a writable file path")
    result = diff_runs(args.run_a, args.run_b, factor=args.factor, min_margin=args.min_margin)
    for line in result.lines():
        print(line)
    if args.json:
        store.atomic_write_json(args.json, result.to_dict())
    return ExitCode.QUALIFICATION_FAILED if result.changed else ExitCode.OK


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``report`` and ``diff`` to the ``qualify`` subcommands."""
    from qualify.compare.diff import DEFAULT_FACTOR, DEFAULT_MIN_MARGIN

    p = sub.add_parser("diff", help="what changed between two compared runs: cell verdicts, "
                                    "moved margins, new and vanished rows, bounds "
                                    "(exit 1 if a cell's verdict changed)")
    p.add_argument("run_a", help="the baseline run (e.g. the last accepted run)")
    p.add_argument("run_b", help="the run to compare with it")
    p.add_argument("--factor", type=float, default=DEFAULT_FACTOR,
                   help=f"report rows whose margin moved by more than this factor "
                        f"(default {DEFAULT_FACTOR:g})")
    p.add_argument("--min-margin", type=float, default=DEFAULT_MIN_MARGIN,
                   help=f"ignore rows below this margin on both sides "
                        f"(default {DEFAULT_MIN_MARGIN:g})")
    p.add_argument("--json", metavar="OUT", help="also write the diff as JSON")
    p.set_defaults(func=_cmd_diff)

    p = sub.add_parser("report", help="write a compared run's report.html (plots, root "
                                      "causes) from its report.json and stored tensors")
    p.add_argument("run_dir", help="evidence/<contract>/<run-id> (holds report.json)")
    p.add_argument("--html", metavar="PATH",
                   help="where to write it (default: <run-id>.report.html beside the run "
                        "directory, outside its sealed set)")
    p.add_argument("--contract", metavar="CONTRACT",
                   help="show the gate's decision by this contract's gate policy on the page")
    p.add_argument("--policy", metavar="POLICY",
                   help="the gate policy file (default: contracts/gates/<name>.toml if any)")
    p.set_defaults(func=_cmd_report)
