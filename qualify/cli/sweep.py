"""``qualify sweep CONTRACT --out DIR``: the contract over seed variants, judged by its policy.

Exit 0 when every variant wrote a report, gates 0 under the contract's gate policy and no
failure is unexplained; 1 otherwise (the table says which variant and cell); 2 for a usage
error. ``--write-policy PATH`` writes the policy derived from what the variants (and the
runs given with ``--include``) measured (:func:`qualify.pipeline.sweep.derive_policy`);
``--summary-dir DIR`` writes ``sweep.json`` and ``sweep.md`` there.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from qualify.errors import ExitCode, UsageError

__all__ = ["register"]


def _cmd_sweep(args: argparse.Namespace) -> ExitCode:
    from qualify.atomic import write_with
    from qualify.contract import default_contract_path, load_contract
    from qualify.evidence.policy import policy_for
    from qualify.jsonio import read_json
    from qualify.layout import REPORT_JSON
    from qualify.pipeline.sweep import (
        SEED_FIELDS,
        policy_toml,
        run_sweep,
        summary_markdown,
        write_summary,
    )

    contract_path = Path(args.contract) if args.contract else default_contract_path()
    contract = load_contract(contract_path)
    policy = policy_for(contract, args.policy)
    offsets = args.offsets if args.offsets is not None else list(range(1, args.variants + 1))
    if any(k < 0 for k in offsets) or len(set(offsets)) != len(offsets):
        raise UsageError(f"--offsets: {offsets}: distinct integers >= 0")
    move = [m.strip() for m in args.move.split(",") if m.strip()]
    if any(m not in SEED_FIELDS for m in move):
        raise UsageError(f"--move: {args.move!r}: comma-separated from "
                         f"{','.join(SEED_FIELDS)}")
    extra = []
    for run in args.include:
        report = Path(run) / REPORT_JSON
        if not report.is_file():
            raise UsageError(f"{run}: --include: no {REPORT_JSON} (a compared run directory)")
        read_json(report)
        extra.append(report)
    for option, value in (("--write-policy", args.write_policy),):
        if value is not None and not Path(value).parent.is_dir():
            raise UsageError(f"{value}: {option}: directory {Path(value).parent} does not exist")
    result = run_sweep(Path(contract_path), offsets=offsets, out=Path(args.out), policy=policy,
                       move=move, factor=args.factor, coverage=args.coverage, cells=args.cells,
                       report_only=args.report_only, extra_reports=extra, progress=print)
    print(summary_markdown(result), end="")
    if args.summary_dir:
        for path in write_summary(result, Path(args.summary_dir)):
            print(f"wrote {path}")
    if args.write_policy and result.derived is not None:
        command = shlex.join(["qualify", "sweep", str(args.contract or ""), "--out", "DIR",
                              "--offsets", *map(str, offsets), "--move", ",".join(move),
                              "--factor", f"{args.factor:g}", "--coverage",
                              f"{args.coverage:g}", *(["--include", *args.include]
                                                      if args.include else []),
                              "--write-policy", str(args.write_policy)])
        doc = {**result.derived, "comment": result.derived.get("comment", "")
               + f"\nRegenerate with: {command}"}
        text = policy_toml(doc)
        write_with(args.write_policy, lambda f: f.write(text.encode("utf-8")))
        print(f"derived policy: {args.write_policy}")
    return result.exit_code


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``sweep`` to the ``qualify`` subcommands."""
    p = sub.add_parser("sweep", help="run the contract over seed variants, judge each by its "
                                     "gate policy, derive a policy from what they measured")
    p.add_argument("contract", nargs="?", help="contract TOML (default: embedded tiny-qwen3)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="working directory: variant contracts, references, evidence, logs")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--variants", type=int, default=5,
                   help="seed offsets 1..N (default 5; offset 0 is the contract itself)")
    g.add_argument("--offsets", type=int, nargs="+", help="explicit seed offsets")
    p.add_argument("--move", default="model,sampling,critic_head,reward",
                   help="the seeds each variant moves (default: all four)")
    p.add_argument("--policy", metavar="FILE",
                   help="gate policy to judge by (default contracts/gates/<name>.toml)")
    p.add_argument("--factor", type=float, default=1.5,
                   help="derived ceiling >= factor x the largest margin seen (default 1.5)")
    p.add_argument("--coverage", type=float, default=0.99,
                   help="probability with which a derived ceiling covers the next seed, from "
                        "the runs' spread of margins (default 0.99; qualify.pipeline.sweep."
                        "ceiling)")
    p.add_argument("--cells", nargs="*", help="cell id globs passed to qualify run")
    p.add_argument("--include", nargs="*", default=[], metavar="RUN_DIR",
                   help="compared runs of the base contract the derived policy also covers")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing; judge the reports already under --out")
    p.add_argument("--write-policy", metavar="PATH", help="write the derived gate policy")
    p.add_argument("--summary-dir", metavar="DIR", help="write sweep.json and sweep.md there")
    p.set_defaults(func=_cmd_sweep)
