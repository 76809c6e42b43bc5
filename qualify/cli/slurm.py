"""``qualify sbatch render`` and ``qualify submit``: the two stages as Slurm jobs.

``register(sub)`` adds the subcommands to the main parser (``qualify/cli/main.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from qualify.cli.outputs import output_file
from qualify.display import printable
from qualify.errors import ExitCode


def _add_cluster_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster options (default: the committed script's values)")
    g.add_argument("--partition", help="Slurm partition")
    g.add_argument("--nodes", type=int, help="nodes per job")
    g.add_argument("--gpus-per-node", type=int, help="GPUs per node")
    g.add_argument("--cpus-per-task", type=int, help="CPUs per task")
    g.add_argument("--mem", help="memory per node, e.g. 512G")
    g.add_argument("--time", help="time limit, e.g. 24:00:00 or 1-00:00:00")
    g.add_argument("--job-name", help="job name")


def _options(args: argparse.Namespace) -> Any:
    from qualify.pipeline.slurm import SbatchOptions

    return SbatchOptions(partition=args.partition, nodes=args.nodes,
                         gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task,
                         mem=args.mem, time=args.time, job_name=args.job_name)


def _cmd_render(args: argparse.Namespace) -> ExitCode:
    from qualify import atomic
    from qualify.contract import load_contract
    from qualify.errors import UsageError
    from qualify.pipeline.slurm import render_script

    contract = Path(args.contract)
    load_contract(contract)  # a script for a contract that does not load is useless
    text = render_script(args.stage, contract, _options(args))
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        out = output_file(args.output, "--output")
        try:  # atomic: a full disk leaves no truncated script that would run half
            atomic.write_with(out, lambda f: f.write(text.encode("utf-8")), mode=0o755)
        except OSError as exc:
            raise UsageError(f"{out}: --output: cannot write: {exc.strerror}") from None
        print(f"{args.stage} job script: {printable(out)}", file=sys.stderr)
    return ExitCode.OK


def _cmd_submit(args: argparse.Namespace) -> ExitCode:
    from qualify.pipeline.slurm import submit

    s = submit(Path(args.contract), options=_options(args), cells=args.cells,
               references=Path(args.references), evidence=Path(args.evidence),
               sbatch=args.sbatch)
    print(f"reference job: {s.reference_job}")
    print(f"candidate job: {s.candidate_job} (afterok:{s.reference_job}; reference "
          f"{printable(s.reference_dir)})")
    return ExitCode.OK


def register(sub: Any) -> None:
    """Add ``sbatch`` (with ``render``) and ``submit`` to the subcommand parsers.

    Args:
        sub: the ``argparse`` subparsers action of the ``qualify`` parser.
    """
    p = sub.add_parser("sbatch", help="Slurm job scripts of the two stages")
    ssub = p.add_subparsers(dest="sbatch_command", metavar="ACTION")
    ssub.required = True
    r = ssub.add_parser("render", help="write a ready job script for a contract and cluster")
    r.add_argument("contract", help="contract TOML")
    r.add_argument("--stage", required=True, choices=("reference", "candidate"),
                   help="which stage's script")
    _add_cluster_options(r)
    r.add_argument("-o", "--output", help="file to write (default: stdout)")
    r.set_defaults(func=_cmd_render)

    p = sub.add_parser("submit", help="submit the reference job and the candidate job "
                                      "(afterok dependency) to Slurm")
    p.add_argument("contract", help="contract TOML")
    _add_cluster_options(p)
    p.add_argument("--cells", nargs="*", help="cell id globs for the candidate job")
    p.add_argument("--references", default="references", help="parent of references")
    p.add_argument("--evidence", default="evidence", help="parent of evidence")
    p.add_argument("--sbatch", default="sbatch", help="the sbatch executable")
    p.set_defaults(func=_cmd_submit)


__all__ = ["register"]
