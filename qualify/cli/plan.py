"""``qualify plan CONTRACT``: memory, bytes and time of the reference stage and the launches.

One row per step of the reference stage and per candidate launch
(:func:`qualify.reference.plan.build_plan`), with devices a line saying where the plan keeps
the AdamW state (on the devices unless only the host fits it:
:attr:`qualify.reference.plan_core.Plan.optimizer_state`); ``--json`` prints the same as JSON. A
contract that cannot fit the machine is refused with one line naming the step and the
shortfall, exit 2 (:class:`qualify.reference.plan.DoesNotFitError`), after the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qualify.errors import ExitCode, UsageError


def _gb(x: str) -> int:
    """``--device-memory`` / ``--host-memory`` in bytes.

    The grammar of ``$QUALIFY_REFERENCE_DEVICE_MEMORY``
    (:func:`qualify.reference.devices.gb_bytes`).

    Raises:
        argparse.ArgumentTypeError: :func:`~qualify.reference.devices.gb_bytes` refuses it.
    """
    from qualify.reference.devices import gb_bytes

    try:
        return gb_bytes(x)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _cmd_plan(args: argparse.Namespace) -> ExitCode:
    from rich.console import Console
    from rich.table import Table

    from qualify.candidate.plan import CANDIDATE_KINDS
    from qualify.contract import default_contract_path, load_contract
    from qualify.reference.plan import DoesNotFitError, build_plan
    from qualify.reference.plan_core import GB, Machine, machine_defaults

    here = machine_defaults()
    devices, kind = (args.devices, "gpu") if args.devices is not None else \
        _env_devices(here.devices)
    if devices < 0:
        raise UsageError(f"--devices {devices}: must be 0 (host only) or more")
    if args.cores is not None and args.cores < 1:
        raise UsageError(f"--cores {args.cores}: must be 1 or more")
    from qualify.reference import devices as reference_devices

    env_memory = reference_devices.device_memory()
    if env_memory is not None and args.devices is None and not devices:
        # as the stage refuses it (qualify.reference.stage.run_reference_stage)
        raise UsageError(f"{reference_devices.MEMORY_ENV}: nothing is placed (no CUDA device, "
                         f"or {reference_devices.ENV}=host); give {reference_devices.ENV}="
                         "cpu,cpu,... for the placed path on the host, or --devices N")
    dev_bytes = args.device_memory if args.device_memory is not None else (
        env_memory if env_memory is not None else here.device_bytes)
    if devices and not dev_bytes:
        raise UsageError("--devices: give --device-memory GB (no CUDA device seen here)")
    machine = Machine(devices=devices, device_bytes=dev_bytes if devices else 0,
                      host_bytes=args.host_memory if args.host_memory is not None
                      else here.host_bytes,
                      cores=args.cores if args.cores is not None else here.cores,
                      device_kind=kind)
    contract = load_contract(Path(args.contract) if args.contract else default_contract_path())
    plan = build_plan(contract, machine)
    shorts = plan.short_steps()
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        m = plan.machine
        where = (f"{m.devices} device(s) x {m.device_bytes / GB:.3g} GB, " if m.devices
                 else "host only, ")
        table = Table(title=f"qualify plan {contract.name}: {where}"
                            f"{m.host_bytes / GB:.0f} GB host, {m.cores} cores; "
                            f"Actor {plan.params['actor'] / 1e6:,.1f} M, Critic "
                            f"{plan.params['critic'] / 1e6:,.1f} M parameters",
                      title_justify="left")
        for col in ("step", "device peak GB", "host peak GB", "written MB", "read MB", "time",
                    "host peak at (phase): largest terms, GB"):
            table.add_column(col, justify="right" if col.endswith(("GB", "MB", "time"))
                             else "left", no_wrap=True, overflow="ellipsis")
        for s in plan.steps:
            largest = sorted(s.terms.items(), key=lambda kv: -kv[1])[:3]
            table.add_row(s.name, f"{s.device_peak / GB:.2f}" if m.devices else "-",
                          f"{s.host_peak / GB:.2f}", f"{s.written / 1e6:.2f}",
                          f"{s.read / 1e6:.2f}" if s.read else "-", _duration(s.seconds),
                          (f"{s.phase}: " if s.phase else "")
                          + ", ".join(f"{k} {v / GB:.2f}" for k, v in largest))
        Console(width=200).print(table)
        ref = [s for s in plan.steps if s.kind == "reference"]
        top = max(ref, key=lambda s: s.host_peak)
        line = (f"reference stage: host peak {top.host_peak / GB:.2f} GB ({top.name}, "
                f"{top.phase})")
        if m.devices:
            dtop = max(ref, key=lambda s: s.device_peak)
            line += (f", device peak {dtop.device_peak / GB:.2f} GB ({dtop.name}, "
                     f"{dtop.device_phase})")
        print(f"{line}; time {_duration(sum(s.seconds for s in ref))} (compute and model "
              "loading only)")
        print(f"cost model: {plan.cost_model}")
        if m.devices:
            where = "devices" if plan.optimizer_state == "device" else "host"
            print(f"AdamW state and sensitivity copy: on the {where} "
                  f"({plan.optimizer_state_why})")
            grads = "devices" if plan.gradients == "device" else "host, streamed"
            print(f"update gradients: on the {grads} ({plan.gradients_why})")
            print(f"between rounds 1 and 2 the host AdamW keeps: {plan.round2_state} "
                  f"({plan.round2_state_why})")
        ref_short = next((line for s, line in shorts if s.kind == "reference"), None)
        print("reference stage: " + ("fits this machine" if ref_short is None else
                                     f"does not fit: {ref_short}"))
        launches = [s for s in plan.steps if s.kind in CANDIDATE_KINDS]
        short_launches = [line for s, line in shorts if s.kind in CANDIDATE_KINDS]
        print(f"candidate launches: all {len(launches)} fit" if not short_launches else
              f"candidate launches: {len(short_launches)} of {len(launches)} do not fit:\n"
              + "\n".join(f"  - {line}" for line in short_launches))
        print("candidate launch times: compute only (a launch's start, its ranks' imports "
              "and process groups, and each variant's setup are not counted: docs/scale.md)")
    if shorts:
        others = [s.name for s, _ in shorts[1:]]
        named = "; ".join(others[:3]) + ("; ..." if len(others) > 3 else "")
        more = f" (and {len(others)} more: {named})" if others else ""
        raise DoesNotFitError(f"{contract.path or contract.name}: does not fit: {shorts[0][1]}"
                              f"{more}")
    return ExitCode.OK


def _env_devices(default: int) -> tuple[int, str]:
    """The reference stage's devices as ``$QUALIFY_REFERENCE_DEVICES`` sets them, and their kind.

    Parsed as the stage parses it (:func:`qualify.reference.devices.parse`): ``cuda:N,...``
    or ``cuda`` is that many ``gpu`` devices; ``host`` runs on the host, no devices; a ``cpu``
    list is that many ``cpu`` devices (timed at the host's rates, :class:`qualify.reference.
    plan_core.Machine`) under ``$QUALIFY_REFERENCE_DEVICE_MEMORY`` (the device-budget mode), else
    none (the stage's own plan check, :func:`qualify.reference.stage._plan_check`, counts
    them so). Unset: ``default`` ``gpu`` devices.

    Raises:
        UsageError: the setting is refused (:func:`qualify.reference.devices.parse`,
            :func:`qualify.reference.devices.device_memory`).
    """
    import os

    from qualify.reference import devices as reference_devices

    value = os.environ.get(reference_devices.ENV, "")
    if not value:
        return default, "gpu"
    listed = reference_devices.parse(value)
    if listed and listed[0] == "cpu":
        return (len(listed) if reference_devices.device_memory() is not None else 0), "cpu"
    return len(listed), "gpu"


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``plan`` to the ``qualify`` subcommands."""
    p = sub.add_parser("plan", help="memory, bytes written and time of the reference stage "
                                    "and the candidate launches; refuse what cannot fit")
    p.add_argument("contract", nargs="?", help="contract TOML (default: embedded tiny-qwen3)")
    p.add_argument("--devices", type=int, help="accelerators (default: those "
                                               "$QUALIFY_REFERENCE_DEVICES names, host and cpu "
                                               "lists 0, else the CUDA devices here; 0: host "
                                               "only); overrides $QUALIFY_REFERENCE_DEVICES")
    p.add_argument("--device-memory", type=_gb, metavar="GB",
                   help="memory of each device, GB (default: "
                        "$QUALIFY_REFERENCE_DEVICE_MEMORY, else the devices here)")
    p.add_argument("--host-memory", type=_gb, metavar="GB",
                   help="host memory, GB (default: this machine's MemTotal)")
    p.add_argument("--cores", type=int, help="CPU cores (default: those usable here)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)
