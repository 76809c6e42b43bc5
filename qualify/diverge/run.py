"""``qualify diverge RUN_DIR CELL``: rerun one cell with layer probes; name what diverges.

It names the first module whose output (or output gradient) leaves its bound.

Steps (each timed, the times go into ``diverge.json``):

1. Resolve the cell from ``RUN_DIR/run.json`` (engine, precision, options, role, TP) and
   the round: ``--round``, else the round of the cell's root cause in
   ``RUN_DIR/report.json``, else 1.
2. Engine: launch the engine's real harness under the same launcher as a normal cell
   (:func:`qualify.candidate.launch.launch_engine`: the warm launcher on CPU, torchrun on
   CUDA, the engine's world size and CPU environment) with the run's frozen inputs
   (``RUN_DIR/inputs``), the run's faults, and
   ``probe = {"round": r, "dir": ...}``; the harness writes ``probe/<role>/probe.*`` in
   the HF layout (``harnesses/layer_probe.py``).
3. Reference: the HF update of the cell's lane and of each of its controls on the same
   inputs (:mod:`qualify.diverge.capture`).
4. Compare module by module (:mod:`qualify.diverge.compare`); write ``diverge.json``
   (``contracts/schema/diverge.schema.json``).

Nothing is written into ``RUN_DIR`` (a sealed run's files are all in its signed manifest):
the output goes to ``--out`` or ``<RUN_DIR>.diverge/<CELL>/``, beside it, where ``qualify
report`` finds it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Final

from qualify import atomic, jsonio, schema
from qualify.errors import UsageError

DIVERGE_FILE: Final = "diverge.json"
PROBE_DIR: Final = "probe"


def diverge_root(run_dir: Path) -> Path:
    """``<RUN_DIR>.diverge``: where every cell's diverge result lives by default."""
    run_dir = Path(run_dir)
    return run_dir.parent / f"{run_dir.name}.diverge"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CellRef:
    """One trainer cell of a run (``run.json``'s ``cells.<id>``)."""

    cell_id: str
    engine: str
    precision: str
    options: dict[str, int]
    role: str
    tp: int


def resolve_cell(run_dir: Path, cell_id: str) -> tuple[CellRef, list[str]]:
    """The cell and the run's faults.

    Raises:
        UsageError: no ``run.json``, an unknown cell, a sampler cell, an engine without
            probes.
    """
    run_file = run_dir / "run.json"
    if not run_file.is_file():
        raise UsageError(f"{run_file}: missing; RUN_DIR must be a candidate run directory")
    doc = jsonio.read_json(run_file)
    cells = doc.get("cells", {})
    if cell_id not in cells:
        raise UsageError(f"{run_file}: cells: no cell {cell_id!r} (the run has "
                         f"{len(cells)} cells, e.g. {sorted(cells)[:3]})")
    c = cells[cell_id]
    role = str(c.get("role", ""))
    if role not in ("actor", "critic"):
        raise UsageError(f"{run_file}: cells.{cell_id}.role is {role!r}: qualify diverge "
                         f"probes trainer cells (actor or critic) only")
    engine = str(c["engine"])
    if not _probes(engine):
        raise UsageError(f"{run_file}: cells.{cell_id}.engine is {engine!r}: its spec does not "
                         f"declare diverge (its harness has no layer probes); engines that "
                         f"do: {', '.join(supported()) or 'none'}")
    ref = CellRef(cell_id=cell_id, engine=engine, precision=str(c["precision"]),
                  options={str(k): int(v) for k, v in dict(c.get("options", {})).items()},
                  role=role, tp=int(c["tp"]))
    return ref, [str(f) for f in doc.get("faults", [])]


def _probes(engine: str) -> bool:
    """Whether the registered ``engine`` declares :attr:`~qualify.registry.EngineSpec.diverge`.

    An engine this checkout does not register has no probes.
    """
    from qualify.registry import ENGINES

    return engine in ENGINES and ENGINES.get(engine).diverge


def supported() -> tuple[str, ...]:
    """The registered engines whose spec declares ``diverge``, sorted."""
    from qualify.registry import ENGINES

    out = []
    for name in ENGINES.names():
        try:
            if ENGINES.get(name).diverge:
                out.append(name)
        except Exception:  # a plugin whose spec cannot be imported: it has no probes here
            continue
    return tuple(out)


def root_cause_round(run_dir: Path, cell_id: str) -> int | None:
    """The round of the cell's root cause in ``report.json`` (``None``: none recorded)."""
    report = run_dir / "report.json"
    if not report.is_file():
        return None
    for rc in jsonio.read_json(report).get("root_causes", []):
        if rc.get("cell") == cell_id and isinstance(rc.get("round"), int):
            return int(rc["round"])
    return None


def _fresh(parent: Path, stem: str) -> Path:
    n = 1
    while (parent / f"{stem}-{n}").exists():
        n += 1
    return parent / f"{stem}-{n}"


def launch_engine(cell: CellRef, *, run_dir: Path, out: Path, round_: int,
                  faults: list[str], probe: bool = True,
                  timeout_s: float = 1800.0) -> tuple[Path, float]:
    """Run the cell's harness (with the probe unless ``probe`` is False).

    Returns:
        ``(attempt directory, launch wall seconds)``.

    Raises:
        UsageError: the launch failed (its reason, first line, and the attempt's logs).
    """
    from qualify.candidate.launch import launch_engine
    from qualify.contract import Contract
    from qualify.protocol import HarnessCell
    from qualify.registry import get_engine, has_cuda
    from qualify.sampling import rollout_sampling

    inputs = (run_dir / "inputs").resolve()
    contract = Contract.from_dict(jsonio.read_json(inputs / "contract.json"))
    engine = get_engine(cell.engine)
    attempt = _fresh(out, "engine" if probe else "baseline")
    hc = HarnessCell(
        engine=cell.engine, precision=cell.precision,  # type: ignore[arg-type]
        options=dict(cell.options), actor_tp=cell.tp if cell.role == "actor" else 0,
        critic_tp=cell.tp if cell.role == "critic" else 0,
        rounds=contract.algorithm.rounds, seed=contract.sampling.seed,
        inputs_dir=str(inputs), output_dir=str(attempt), faults=tuple(faults),
        param_sampling=rollout_sampling(contract.evidence, inputs),
        probe={"round": round_, "dir": str(attempt / PROBE_DIR)} if probe else None)
    result = launch_engine(hc, engine=engine, attempt_dir=attempt, timeout_s=timeout_s,
                           cuda=has_cuda())
    if not result:
        first = result.reason.strip().splitlines()[0] if result.reason.strip() else "failed"
        raise UsageError(f"{attempt}: the {cell.engine} launch failed: {first} (logs in "
                         f"{attempt / 'logs'})")
    return attempt, result.wall_s


def diverge(run_dir: Path, cell_id: str, *, out: Path | None = None, round_: int | None = None,
            baseline: bool = False) -> dict[str, Any]:
    """Run ``qualify diverge`` for one cell; returns the written ``diverge.json`` document.

    Args:
        run_dir: a candidate run directory (``run.json``, ``inputs/``).
        cell_id: a trainer cell of that run.
        out: output directory (default ``<RUN_DIR>.diverge/<CELL>``).
        round_: the round to probe (default: the root cause's, else 1).
        baseline: also launch the same cell without probes, for the cost ratio.

    Raises:
        UsageError: bad arguments or inputs (one line), a failed launch.
    """
    import torch
    from safetensors.torch import load_file

    from qualify.contract import Contract
    from qualify.diverge import capture, compare
    from qualify.lanes import lane_of, lane_precision
    from qualify.registry import get_engine

    t_all = time.perf_counter()
    run_dir = Path(run_dir).absolute()  # the launch runs in another working directory
    cell, faults = resolve_cell(run_dir, cell_id)
    inputs_dir = run_dir / "inputs"
    try:
        contract = Contract.from_dict(jsonio.read_json(inputs_dir / "contract.json"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"{inputs_dir / 'contract.json'}: {exc}") from None
    rounds = contract.algorithm.rounds
    cause_round = root_cause_round(run_dir, cell_id)
    r = round_ if round_ is not None else (cause_round or 1)
    if not 1 <= r <= rounds:
        raise UsageError(f"--round {r}: the contract runs rounds 1..{rounds}")
    out = (Path(out) if out is not None else diverge_root(run_dir) / cell_id).absolute()
    if out.resolve().is_relative_to(run_dir.resolve()):
        raise UsageError(f"--out {out}: inside the sealed run directory; choose a path "
                         f"outside it")
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    attempt, engine_wall = launch_engine(cell, run_dir=run_dir, out=out, round_=r,
                                         faults=faults)
    timings["engine_launch_s"] = round(engine_wall, 3)
    probe_dir = attempt / PROBE_DIR / cell.role
    if not (probe_dir / "probe.json").is_file():
        raise UsageError(f"{probe_dir / 'probe.json'}: missing; the {cell.engine} harness ran "
                         f"but wrote no probe (logs in {attempt / 'logs'})")
    probe_meta = jsonio.read_json(probe_dir / "probe.json")
    engine_t = load_file(str(probe_dir / "probe.safetensors"))
    timings["engine_s"] = round(time.perf_counter() - t0, 3)

    t0 = time.perf_counter()
    lane = lane_of(cell.precision, get_engine(cell.engine).bf16_style)
    try:
        frozen = capture.read_frozen_inputs(inputs_dir, contract)
    except (OSError, KeyError, ValueError) as exc:
        raise UsageError(f"{inputs_dir}: the run's frozen inputs are unreadable "
                         f"({type(exc).__name__}: {exc})") from None
    ref, ctrl = capture.reference_captures(frozen, lane=lane, role=cell.role, round_=r)
    timings["reference_s"] = round(time.perf_counter() - t0, 3)

    t0 = time.perf_counter()
    b = frozen.batch
    frame = compare.Frame(attention_mask=b.attention_mask.bool(),
                          response_mask=b.response_mask.bool(),
                          prompt_len=int(b.prompts.shape[1]))
    floors = contract.bounds.floors[lane_precision(lane)]
    rule = compare.Rule(k=float(contract.bounds.k), floor_forward=float(floors["logprobs"]),
                        floor_backward=float(floors["grads"]))
    with torch.no_grad():
        try:
            rows = compare.compare(engine_t, list(probe_meta["modules"]), reference=ref,
                                   control_runs=ctrl, frame=frame, rule=rule)
        except ValueError as exc:
            raise UsageError(f"{probe_dir}: the engine's probe cannot be compared with the "
                             f"reference: {exc}") from None
    timings["compare_s"] = round(time.perf_counter() - t0, 3)
    if baseline:
        _, base_wall = launch_engine(cell, run_dir=run_dir, out=out, round_=r, faults=faults,
                                     probe=False)
        timings["baseline_launch_s"] = round(base_wall, 3)
    timings["total_s"] = round(time.perf_counter() - t_all - timings.get("baseline_launch_s",
                                                                         0.0), 3)
    if baseline:
        timings["cost_ratio"] = round(timings["total_s"] / timings["baseline_launch_s"], 3)
    doc = compare.document(
        cell={"id": cell.cell_id, "engine": cell.engine, "precision": cell.precision,
              "options": cell.options, "role": cell.role, "tp": cell.tp},
        rows=rows, rule=rule, controls=sorted(ctrl),
        context={"run_dir": str(run_dir), "lane": lane, "round": r,
                 "root_cause_round": cause_round, "faults": faults,
                 "engine_attempt": str(attempt), "timings": timings})
    schema.validate(doc, "diverge", what=str(out / DIVERGE_FILE))
    atomic.write_json(out / DIVERGE_FILE, doc)
    return doc
