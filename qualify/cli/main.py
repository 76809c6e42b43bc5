"""The ``qualify`` command line (argparse, one subcommand per stage).

User errors (bad contract, missing file, digest mismatch) print one line naming the file
and field and exit with a distinct code from :class:`qualify.errors.ExitCode`; ``--debug``
shows the traceback. Heavy modules are imported inside the subcommands so ``qualify
--help`` and ``import qualify.cli.main`` stay fast and engine-free.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import os
import select
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, NoReturn

from qualify.cli.outputs import MACHINE_ERRNOS, output_dir
from qualify.display import printable
from qualify.errors import ExitCode, QualifyError, UsageError
from qualify.layout import REPORT_MD

__all__ = ["UsageError", "build_parser", "console", "main"]


def _contract_arg(value: str | None) -> Path:
    from qualify.contract import default_contract_path

    return Path(value) if value else default_contract_path()


def _cmd_validate(args: argparse.Namespace) -> ExitCode:
    from qualify.contract import load_contract

    c = load_contract(_contract_arg(args.contract))
    print(f"{printable(c.path)}: valid contract {c.name!r}, digest {c.digest}")
    for cell in c.matrix.cells():
        print(f"  cell {cell.cell_id}")
    if c.sampler is not None:
        for cell_id in c.sampler.cell_ids():
            print(f"  cell {cell_id} (sampler: {c.sampler.weights_from}'s round-1 weights)")
    return ExitCode.OK


def _cmd_reference(args: argparse.Namespace) -> ExitCode:
    from qualify.contract import load_contract
    from qualify.reference.stage import run_reference_stage

    root = output_dir(args.out, "--out")
    contract = load_contract(_contract_arg(args.contract))
    out = run_reference_stage(contract, root=root, new=args.new,
                              quiet=args.quiet, plan_check=not args.no_plan_check)
    print(f"sealed reference: {printable(out)}")
    return ExitCode.OK


def _cmd_candidate(args: argparse.Namespace) -> ExitCode:
    from qualify.candidate.stage import run_candidate_stage
    from qualify.contract import load_contract

    root = output_dir(args.out, "--out")
    contract = load_contract(_contract_arg(args.contract))
    run_dir = run_candidate_stage(contract, reference=Path(args.reference),
                                  root=root, cells=args.cells, run_id=args.run_id,
                                  quiet=args.quiet)
    print(f"candidate run: {printable(run_dir)}")
    return ExitCode.OK


def _cmd_compare(args: argparse.Namespace) -> ExitCode:
    from qualify.compare.stage import compare_run
    from qualify.evidence.sign import ensure_signed, needs_signature, seal_and_sign
    from qualify.evidence.supersede import refuse

    run_dir = Path(args.run_dir)
    reference = Path(args.reference) if args.reference else None
    refuse(run_dir)  # a superseded run is kept as it is, never compared into evidence
    if not args.no_seal and needs_signature(run_dir):
        # A compare killed while signing left the run sealed but unsigned: sign it; the
        # sealed report is recomputed (not rewritten) for the summary.
        ensure_signed(run_dir)
        report = compare_run(run_dir, reference_dir=reference, write=False)
    else:
        report = compare_run(run_dir, reference_dir=reference)
        if not args.no_seal:
            seal_and_sign(run_dir, kind="candidate-run")
    cells = report.summary.get("cells", {})
    counts = ", ".join(f"{k} {v}" for k, v in cells.items() if v) if isinstance(cells, dict) \
        else ""
    print(f"report: {printable(run_dir / REPORT_MD)} (cells: {counts})")
    return ExitCode.OK if report.passed else ExitCode.QUALIFICATION_FAILED


def _cmd_run(args: argparse.Namespace) -> ExitCode:
    from qualify.cli.outputs import output_file
    from qualify.pipeline.chain import run_all

    junit_xml = output_file(args.junit_xml, "--junit-xml") if args.junit_xml else None
    summary = output_file(args.summary, "--summary") if args.summary else None
    return run_all(_contract_arg(args.contract),
                   references=output_dir(args.references, "--references"),
                   evidence=output_dir(args.evidence, "--evidence"), cells=args.cells,
                   quiet=args.quiet, run_id=args.run_id, junit_xml=junit_xml, summary=summary)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (pinned by ``tests/test_cli.py``)."""
    parser = argparse.ArgumentParser(
        prog="qualify",
        description="Numerical qualification of LLM RL training stacks against a sealed "
                    "Hugging Face reference.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    from qualify import __version__

    parser.add_argument("--version", action="version", version=f"qualify {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("validate", help="validate a contract and list its cells")
    p.add_argument("contract", nargs="?", help="contract TOML (default: embedded tiny-qwen3)")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("reference", help="capture, score, compute targets and controls; seal")
    p.add_argument("contract", nargs="?", help="contract TOML (default: embedded tiny-qwen3)")
    p.add_argument("--out", "--references", dest="out", default="references",
                   help="parent directory of references (--references: as qualify run names it)")
    p.add_argument("--new", action="store_true",
                   help="make a new reference directory beside a sealed one")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--no-plan-check", action="store_true",
                   help="run even if `qualify plan` says it does not fit (recorded in "
                        "environment.json)")
    p.set_defaults(func=_cmd_reference)

    p = sub.add_parser("candidate", help="run engine cells against a sealed reference")
    p.add_argument("contract", nargs="?", help="contract TOML (default: embedded tiny-qwen3)")
    p.add_argument("--reference", required=True, help="sealed reference directory")
    p.add_argument("--out", "--evidence", dest="out", default="evidence",
                   help="parent directory of evidence (--evidence: as qualify run names it)")
    p.add_argument("--cells", nargs="*", help="cell id globs, or ENGINE:GLOB")
    p.add_argument("--run-id", help="resume or name a run (default: new timestamped id)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _launcher_option(p)
    p.set_defaults(func=_cmd_candidate)

    p = sub.add_parser("compare", help="apply the sealed bounds to a candidate run; report")
    p.add_argument("run_dir", help="evidence/<contract>/<run-id>")
    p.add_argument("--reference", metavar="DIR",
                   help="the sealed reference directory (default: the one run.json names, "
                        "found again if it moved)")
    p.add_argument("--no-seal", action="store_true",
                   help="write the report but do not seal and sign the run")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("run", help="reference (if missing) -> candidate -> compare; exit by "
                                   "the contract's gate policy (contracts/gates/) if any")
    p.add_argument("contract", nargs="?", help="contract TOML (default: embedded tiny-qwen3)")
    p.add_argument("--references", default="references", help="parent of references")
    p.add_argument("--evidence", default="evidence", help="parent of evidence")
    p.add_argument("--cells", nargs="*", help="cell id globs, or ENGINE:GLOB")
    p.add_argument("--run-id", help="resume or name a run (default: resume the interrupted "
                                    "run of the same contract, reference and cells, else a "
                                    "new timestamped id)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _launcher_option(p)
    p.add_argument("--junit-xml", metavar="PATH",
                   help="write the run's decision as JUnit XML, as qualify gate does: one "
                        "testcase per cell (XFAIL and allowed NOT_RUN as skipped, the first "
                        "failing quantity as the failure)")
    p.add_argument("--summary", metavar="PATH",
                   help="append a Markdown job summary (e.g. \"$GITHUB_STEP_SUMMARY\")")
    p.set_defaults(func=_cmd_run)

    from qualify.cli.diverge import register as register_diverge
    from qualify.cli.engines import register as register_engines
    from qualify.cli.evidence import register
    from qualify.cli.plan import register as register_plan
    from qualify.cli.report import register as register_report
    from qualify.cli.slurm import register as register_slurm
    from qualify.cli.sweep import register as register_sweep

    register(sub)
    register_report(sub)
    register_diverge(sub)
    register_slurm(sub)
    register_sweep(sub)
    register_engines(sub)
    register_plan(sub)
    return parser


def _launcher_option(p: argparse.ArgumentParser) -> None:
    """``--launcher ENGINE=CMD`` (repeatable): :mod:`qualify.candidate.interpreter`."""
    p.add_argument("--launcher", action="append", default=[], metavar="ENGINE=CMD",
                   help="run ENGINE's ranks with CMD (a venv's python, or a prefix ending in "
                        "one: 'apptainer exec IMG python3') instead of qualify's python; "
                        "sets QUALIFY_LAUNCHER_<ENGINE> for this command")


UNWRITABLE_ERRNOS: Final = MACHINE_ERRNOS
"""``OSError`` numbers that mean the machine cannot take what qualify does (a full disk or
quota, a file too large, a read-only or forbidden directory, open-file limits): the user's
environment, exit 2 with one line; what was written stays unsealed (``INCOMPLETE``), never
evidence that can pass (:data:`qualify.cli.outputs.MACHINE_ERRNOS`)."""


def unwritable_message(exc: OSError) -> str:
    """One line for an :data:`UNWRITABLE_ERRNOS` error: the file, the cause, what to do."""
    name = errno.errorcode.get(exc.errno or 0, "?")
    where = f"{printable(exc.filename)}: " if exc.filename else ""
    return (f"{where}{exc.strerror or os.strerror(exc.errno or 0)} ({name}); nothing "
            "unfinished was sealed: free space or make the directory writable, then run the "
            "same command again (an interrupted `qualify run` is resumed)")


BROKEN_PIPE_EXIT = 141
"""Exit status when stdout's reader closed the pipe: 128 + SIGPIPE, the shell convention."""


def _broken_pipe() -> int:
    """The exit of a ``BrokenPipeError`` that ended a command.

    The reader of stdout went away (``qualify gate ... | head``): point stdout at /dev/null
    so the interpreter's final flush cannot raise again, and exit as a writer killed by
    SIGPIPE would in a shell (128 + 13): the output was cut, so the command's own verdict is
    not claimed (Python docs, "Note on SIGPIPE"). A broken pipe that is not stdout's (a
    child process, a socket) is an internal error, with its traceback.
    """
    if not _stdout_closed():
        traceback.print_exc()
        print("qualify: internal error: BrokenPipeError (not stdout)", file=sys.stderr)
        return int(ExitCode.INTERNAL_ERROR)
    _stdout_to_devnull()
    return BROKEN_PIPE_EXIT


def _stdout_to_devnull() -> None:
    """Point stdout's file descriptor at /dev/null (its reader is gone), if it can be."""
    with contextlib.suppress(OSError, ValueError):
        fd = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        if devnull != fd:  # fd was closed: the open took its number, nothing to move
            os.dup2(devnull, fd)
            os.close(devnull)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (``poll`` reports ``POLLERR``).

    Linux and the BSDs flag the write end of a pipe without readers with ``POLLERR``; a
    terminal or a file never is, so a ``BrokenPipeError`` from elsewhere is not mistaken for
    a closed stdout.
    """
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qualify`` console script.

    Returns:
        The :class:`ExitCode` value.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    func: Callable[[argparse.Namespace], ExitCode] = args.func
    try:
        from qualify.settings import check_environment

        if getattr(args, "launcher", None):  # site-specific: the environment, not the contract
            from qualify.candidate.interpreter import apply_options
            from qualify.registry import engine_names

            apply_options(args.launcher, known=engine_names())
        check_environment(args.command)  # a bad variable: refused before anything is written
        return int(func(args))
    except QualifyError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"qualify: error: {printable(exc)}", file=sys.stderr)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        print("qualify: interrupted; partial output is left unsealed (the same command "
              "again resumes it)", file=sys.stderr)
        return int(ExitCode.INTERRUPTED)
    except BrokenPipeError:
        return _broken_pipe()
    except Exception as exc:
        return _unexpected(exc, debug=args.debug)


def _unexpected(exc: Exception, *, debug: bool) -> int:
    """The exit of an exception that is no :class:`QualifyError`.

    An :data:`UNWRITABLE_ERRNOS` ``OSError`` is the machine's state, not a bug: one line
    naming the file, exit 2 (the traceback with ``--debug``; what was written stays
    unsealed: an ``INCOMPLETE`` directory never passes). Anything else is an internal
    error: its traceback and one line, exit 4.
    """
    if isinstance(exc, OSError) and exc.errno in UNWRITABLE_ERRNOS:
        if debug:
            traceback.print_exc()
        print(f"qualify: error: {unwritable_message(exc)}", file=sys.stderr)
        return int(ExitCode.USAGE_ERROR)
    traceback.print_exc()
    print(f"qualify: internal error: {type(exc).__name__}: {printable(exc)}", file=sys.stderr)
    return int(ExitCode.INTERNAL_ERROR)


def console(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``qualify`` console script and ``python -m qualify``: :func:`main`, then exit.

    Once the command's outputs are flushed and the ``atexit`` handlers have run, the process
    ends with :func:`os._exit` instead of the interpreter's own finalisation, which frees
    the thousands of modules a run imports (torch, transformers, matplotlib) one by one and
    writes nothing; ``benchmarks/`` times the difference. Whatever an ``atexit`` handler
    prints is flushed too. While another Python thread is alive the normal exit joins it
    instead. A command that succeeded but whose last output found stdout's reader gone
    exits 141, as :func:`main` does for one cut earlier (:data:`BROKEN_PIPE_EXIT`); a
    failing command keeps its code.
    """
    code = main(argv)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the reader went away (or the stream was closed)
            if stream is sys.stdout:
                _stdout_to_devnull()
                code = code or BROKEN_PIPE_EXIT
    if threading.active_count() > 1:
        sys.exit(code)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)  # CPython's, since 3.0
    if run_exit_handlers is None:
        sys.exit(code)
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
