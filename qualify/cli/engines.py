"""``qualify engines`` (the registered engines) and ``qualify harness check ENGINE``.

``engines`` lists every registered trainer engine and sampler (built-in, or the
distribution and version that declared its ``qualify.engines`` entry point), its parallel
axes, its number-changing options, its capabilities
(:attr:`qualify.registry.EngineSpec.capabilities`), the interpreter its ranks run in
(``QUALIFY_LAUNCHER_<ENGINE>``, :mod:`qualify.candidate.interpreter`) and whether it can run
here. ``harness check`` runs the conformance check (:mod:`qualify.candidate.conformance`):
exit 0 when the outputs hold everything the comparator reads, 1 when anything is missing or
wrong (each problem on its own line), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from qualify.display import printable
from qualify.errors import ExitCode


def engine_rows() -> list[dict[str, Any]]:
    """One record per registered engine (imports every ``spec`` module, never a harness).

    A spec that cannot be loaded is listed with its error instead of its fields.
    """
    from qualify.candidate.interpreter import engine_command
    from qualify.errors import QualifyError
    from qualify.registry import ENGINES

    rows: list[dict[str, Any]] = []
    for name in ENGINES.names():
        try:
            spec = ENGINES.get(name)
        except QualifyError as exc:
            rows.append({"name": name, "error": str(exc)})
            continue
        source = spec.source
        if source != "builtin":
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                source = f"{source} {importlib.metadata.version(source)}"
        try:
            interp = engine_command(name)
        except QualifyError as exc:
            interp = [f"invalid: {exc}"]
        rows.append({
            "name": name, "kind": spec.kind, "source": source, "entry": spec.entry,
            "axes": {a.name: list(a.degrees) for a in spec.axes},
            "options": {o.name: {"key": o.key, "values": list(o.values),
                                 "default": list(o.default)} for o in spec.options},
            "capabilities": list(spec.capabilities),
            "interpreter": " ".join(interp) if interp else "qualify's own",
            "runs_here": spec.unavailable_reason() or "yes",
            "description": spec.description})
    return rows


def _cmd_engines(args: argparse.Namespace) -> ExitCode:
    rows = engine_rows()
    if args.json:
        print(json.dumps(rows, indent=1))
        return ExitCode.OK
    for r in rows:
        if "error" in r:
            print(f"{r['name']}: cannot load its spec: {printable(r['error'])}")
            continue
        axes = ", ".join(f"{k} {'/'.join(map(str, v))}" for k, v in r["axes"].items())
        opts = ", ".join(f"{k} {'/'.join(map(str, o['values']))}"
                         for k, o in r["options"].items()) or "none"
        print(f"{r['name']} ({r['kind']}, {r['source']})")
        print(f"  axes: {axes}; options: {opts}")
        print(f"  capabilities: {', '.join(r['capabilities']) or 'none'}")
        print(f"  interpreter: {printable(r['interpreter'])}; runs here: "
              f"{printable(r['runs_here'])}")
    return ExitCode.OK


def _cmd_harness_check(args: argparse.Namespace) -> ExitCode:
    from qualify.candidate.conformance import check_engine

    result = check_engine(args.engine, contract_path=Path(args.contract) if args.contract
                          else None, reference=Path(args.reference) if args.reference
                          else None, out=output_dir_or_none(args.out),
                          timeout_s=args.timeout)
    for key, value in result.versions.items():
        print(f"{key}: {printable(value)}")
    for finding in result.findings:
        print(printable(str(finding)))
    verdict = "conforms" if result else f"{len(result.findings)} problem(s)"
    print(f"harness check {args.engine}: {verdict} ({result.wall_s:.1f}s; outputs in "
          f"{printable(result.attempt_dir)})")
    return ExitCode.OK if result else ExitCode.QUALIFICATION_FAILED


def output_dir_or_none(value: str | None) -> Path | None:
    """``--out``, checked like every output directory (``None``: a temporary one)."""
    from qualify.cli.outputs import output_dir

    return None if value is None else output_dir(value, "--out")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``engines`` and ``harness`` to the subcommands."""
    p = sub.add_parser("engines", help="list the registered engines: source, axes, options, "
                                       "capabilities, interpreter")
    p.add_argument("--json", action="store_true", help="one JSON array instead of text")
    p.set_defaults(func=_cmd_engines)

    p = sub.add_parser("harness", help="harness tools: `harness check ENGINE` runs one cell "
                                       "of a tiny contract and names every missing output")
    hs = p.add_subparsers(dest="harness_command", metavar="ACTION")
    hs.required = True
    c = hs.add_parser("check", help="run one FP32 TP 1 cell; name every missing, mis-shaped "
                                    "or mis-typed output; exit 1 if any")
    c.add_argument("engine", help="a registered trainer engine")
    c.add_argument("--contract", help="contract TOML (default: embedded tiny-qwen3)")
    c.add_argument("--reference", metavar="DIR",
                   help="its sealed reference (default: references/<name>-<digest12>)")
    c.add_argument("--out", metavar="DIR", help="where the launch goes (default: a new "
                                                "temporary directory)")
    c.add_argument("--launcher", action="append", default=[], metavar="ENGINE=CMD",
                   help="run ENGINE's ranks with CMD instead of qualify's python (sets "
                        "QUALIFY_LAUNCHER_<ENGINE> for this command)")
    c.add_argument("--timeout", type=float, default=600.0, help="launch limit in seconds")
    c.set_defaults(func=_cmd_harness_check)
