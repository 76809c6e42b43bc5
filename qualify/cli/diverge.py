"""``qualify diverge RUN_DIR CELL``: name the first layer and sub-module that diverges.

Reruns the cell's engine (its real harness, under its launcher, with layer probes) and the HF
reference of its lane with its controls on the run's frozen inputs, compares every probed
module's output and output gradient (:mod:`qualify.diverge.compare` states the bound
rule), prints the table and writes ``diverge.json`` beside the run
(``<RUN_DIR>.diverge/<CELL>/``; ``qualify report RUN_DIR`` shows it). Exit 0: no module
exceeded its bound; 1: one did (the first is named); 2: usage or input error (one line).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from qualify.cli.outputs import output_dir
from qualify.display import printable
from qualify.errors import ExitCode

__all__ = ["register"]


def _cmd_diverge(args: argparse.Namespace) -> ExitCode:
    from qualify.diverge.compare import table
    from qualify.diverge.run import DIVERGE_FILE, diverge, diverge_root

    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else diverge_root(run_dir) / args.cell
    output_dir(out, "--out")
    doc = diverge(run_dir, args.cell, out=out, round_=args.round, baseline=args.baseline)
    print(f"{doc['cell']['id']}: round {doc['round']}, lane {doc['lane']}, controls "
          f"{', '.join(doc['rule']['controls'])}; bound = k * max control error + floor "
          f"(k {doc['rule']['k']:g}, floors {doc['rule']['floor_forward']:g} forward, "
          f"{doc['rule']['floor_backward']:g} backward)")
    print(table(doc["rows"]))
    first = doc["first"]
    t = doc["timings"]
    cost = f", cost ratio {t['cost_ratio']:g} x a normal cell" if "cost_ratio" in t else ""
    print(f"timings: total {t['total_s']:g} s (engine {t['engine_s']:g} s, reference "
          f"{t['reference_s']:g} s){cost}")
    print(f"diverge.json: {printable(out / DIVERGE_FILE)}")
    if first is None:
        print("diverged: none (every module within its bound). The probes see each "
              "module's output and output gradient; a failure in the parameter gradients, "
              "grad_norm, clip coefficient or optimizer state does not show here "
              "(docs/diverge.md)")
        return ExitCode.OK
    where = (f"layer {first['layer']} {first['submodule']}" if first["layer"] is not None
             else first["submodule"])
    print(f"diverged: {first['module']} ({where}, {first['direction']}): max_abs "
          f"{first['error']:.3g} > bound {first['bound']:.3g} (margin {first['margin']:.3g})")
    return ExitCode.QUALIFICATION_FAILED


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``diverge`` to the ``qualify`` subcommands."""
    p = sub.add_parser("diverge", help="rerun a cell with layer probes beside the HF "
                                       "reference; name the first module over its bound")
    p.add_argument("run_dir", help="evidence/<contract>/<run-id> (run.json, inputs/)")
    p.add_argument("cell", help="a trainer cell id of that run")
    p.add_argument("--round", type=int, default=None,
                   help="round to probe (default: the round of the cell's root cause, else 1)")
    p.add_argument("--out", metavar="DIR",
                   help="output directory (default: <RUN_DIR>.diverge/<CELL>, beside the run)")
    p.add_argument("--baseline", action="store_true",
                   help="also launch the cell without probes and report the cost ratio")
    p.add_argument("--launcher", action="append", default=[], metavar="ENGINE=CMD",
                   help="run ENGINE's ranks with CMD instead of qualify's python (sets "
                        "QUALIFY_LAUNCHER_<ENGINE> for this command)")
    p.set_defaults(func=_cmd_diverge)
