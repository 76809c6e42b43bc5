"""Launch one harness cell (torchrun or the warm launcher), with a timeout and every rank's logs.

:func:`launch` writes ``cell.json`` (validated by ``contracts/schema/cell.schema.json``) into
the attempt directory and runs, in a new session (its own process group), one of
(:func:`launch_command`):

- ``warm`` (the default on one node): ``python -m qualify.candidate.warm --nproc-per-node
  <world_size> --log-dir <attempt>/logs/ranks [--preload MOD ...] <harness> <cell.json>``:
  one interpreter imports the harness, the engine and the model classes once and forks
  every rank with torchrun's environment (:mod:`qualify.candidate.warm`; issue #17);
- ``torchrun`` (``QUALIFY_LAUNCHER=torchrun``, and every launch on a CUDA machine)::

    python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node <world_size>
        --max-restarts 0 --log-dir <attempt>/logs/ranks --redirects 3 --tee 3
        -m <harness module> <attempt>/cell.json

- ``srun`` + ``torchrun`` across the nodes of a Slurm allocation (:func:`torchrun_command`).

On CUDA, under Slurm and for an engine run by a foreign interpreter every launch is
torchrun. Three speed-ups serve CPU launches only, each with the switch that turns it off
(what each saves on the default run, against its lines: ``docs/performance.md``, measured
by ``python -m benchmarks.launch_cost``):

- the warm launcher, :mod:`qualify.candidate.warm` (``QUALIFY_LAUNCHER=torchrun``);
- :mod:`qualify.candidate.beside`: the sampler cells beside the trainer launches
  (``QUALIFY_JOBS=1``);
- :mod:`qualify.candidate.ahead`: each trainer launch's warm launcher imports while the
  launch before it runs, and forks its ranks when that one has ended (``QUALIFY_AHEAD=0``;
  ``QUALIFY_JOBS=1`` too).

Every rank's stdout / stderr (and ``error.json`` when a rank raises) is kept under
``<attempt>/logs/ranks/``; the launcher's own output (torchrun's carries every rank's lines
prefixed with ``[rank]:``; the warm launcher's, one line per rank exit) goes to
``<attempt>/logs/launcher.log``. The harness is generic: any module that runs under
``python -m MODULE CELL_JSON`` (or a ``"module:attr"`` entry point, run through this
module's trampoline) and speaks :mod:`qualify.protocol` can be launched.

A launch ends in one :class:`LaunchResult`: ``OK`` when the harness exited 0 and wrote
``outputs.safetensors`` and an ``outputs.json`` valid against
``contracts/schema/outputs.schema.json``; ``ERROR`` otherwise (timeout, non-zero exit with
the failing rank's log tail, missing or invalid outputs). On timeout the whole process
tree is ended (:func:`qualify.procs.run`): SIGTERM to the launcher's process group and to
every descendant (torchrun starts each worker in a session of its own; the warm launcher's
ranks stay in its group), then SIGKILL after a grace period. If qualify itself dies
(``kill -9``, a second Ctrl-C), the kernel sends the launcher SIGTERM
(``PR_SET_PDEATHSIG``, :func:`qualify.procs.run`) and it ends its ranks (a warm rank also
gets SIGKILL from the kernel when its launcher dies): none outlives qualify or keeps
writing into the abandoned attempt (``tests/test_recovery.py`` kills a real qualify-like
parent of a real torchrun and of a real warm launcher).

This module imports neither torch nor any engine; it is safe to import anywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from qualify import atomic, procs, schema
from qualify.candidate import forkserver, imported, interpreter
from qualify.candidate.warm import GATE_SHUT_EXIT
from qualify.errors import HarnessError, QualifyError, UsageError
from qualify.evidence import imports
from qualify.evidence.timestamps import utc_now_iso
from qualify.layout import LAUNCHER_LOG, LOGS_DIR, RANK_LOGS_DIR
from qualify.protocol import (
    CELL_FILE,
    HARNESS_SDK_MAJOR,
    OUTPUTS_FILE,
    OUTPUTS_META_FILE,
    HarnessCell,
    parse_tensor_name,
)
from qualify.registry import EngineSpec
from qualify.resources import repo_root

if TYPE_CHECKING:
    from qualify.candidate.gate import Gate
    from qualify.contract import Contract

LaunchStatus = Literal["OK", "ERROR"]
Launcher = Literal["warm", "torchrun"]
LAUNCHERS: Final[tuple[Launcher, ...]] = ("warm", "torchrun")
"""The single-node launchers (``QUALIFY_LAUNCHER``; ``srun`` selects :func:`torchrun_command`'s
multi-node path)."""

KILL_GRACE_S: Final = procs.KILL_GRACE_S
"""Seconds between SIGTERM and SIGKILL when a launch is ended (:mod:`qualify.procs`)."""
TAIL_LINES: Final = 25
"""Lines of the failing rank's log quoted in an ``ERROR`` reason."""
WARM_MODULE: Final = "qualify.candidate.warm"
"""The warm launcher's module (``python -m``)."""
_SAFETENSORS_FLOATS: Final = frozenset({"F64", "F32"})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LaunchResult:
    """How one launch ended.

    Attributes:
        status: ``OK`` or ``ERROR``.
        reason: empty for ``OK``; for ``ERROR`` what went wrong (``timeout after 60s``,
            the exit code and the failing rank's log tail, or the output problem).
        wall_s: wall-clock seconds of the launch.
        returncode: the launcher's exit status (``None`` when it was killed on timeout).
        attempt_dir: the attempt directory.
        cell_file: the ``cell.json`` written.
        launcher_log: the launcher's combined stdout / stderr.
        rank_logs: every rank's ``stdout.log`` / ``stderr.log`` / ``error.json`` found.
        failed_rank: global rank of the first failure, when its ``error.json`` or a
            traceback in its ``stderr.log`` names it.
        started: UTC start of the launch (ISO 8601), so that concurrent launches can be
            laid on one time line (``benchmarks/evidence_cost.py``); for a launch started
            ahead of its turn (``ahead``, :mod:`qualify.candidate.ahead`), when its gate
            opened, from where ``wall_s`` counts too.
        launcher_started: UTC start of the launcher process (``""``: none started).
        ahead: whether the launch was started ahead of its turn: its launcher started
            before its gate opened, and what it imported before then is not in ``wall_s``.
    """

    status: LaunchStatus
    reason: str
    wall_s: float
    returncode: int | None
    attempt_dir: Path
    cell_file: Path
    launcher_log: Path
    rank_logs: tuple[Path, ...]
    failed_rank: int | None = None
    started: str = ""
    launcher_started: str = ""
    ahead: bool = False

    def __bool__(self) -> bool:
        return self.status == "OK"


def validate_cell(doc: Mapping[str, Any]) -> None:
    """Validate a ``cell.json`` document against ``cell.schema.json``.

    Raises:
        HarnessError: the first schema violation, naming the field.
    """
    _validate(doc, "cell", CELL_FILE)


def validate_outputs_meta(doc: Mapping[str, Any]) -> None:
    """Validate an ``outputs.json`` document against ``outputs.schema.json``.

    Raises:
        HarnessError: the first schema violation, naming the field.
    """
    _validate(doc, "outputs", OUTPUTS_META_FILE)


def validate_sampler_outputs_meta(doc: Mapping[str, Any]) -> None:
    """Validate a sampler cell's ``outputs.json`` against ``sampler_outputs.schema.json``.

    Raises:
        HarnessError: the first schema violation, naming the field.
    """
    _validate(doc, "sampler_outputs", OUTPUTS_META_FILE)


def _validate(doc: Mapping[str, Any], schema_name: str, what: str) -> None:
    problem = schema.first_error(doc, schema_name)
    if problem is not None:
        raise HarnessError(f"{what}: {problem}")


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, offsets).

    Read directly (8-byte little-endian length, then JSON) so the launcher needs no torch.

    Raises:
        HarnessError: not a safetensors file.
    """
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 * 2**20:
                raise HarnessError(f"{path}: safetensors header of {n} bytes is implausible")
            header: dict[str, Any] = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as exc:
        raise HarnessError(f"{path}: not a readable safetensors file: {exc}") from None
    header.pop("__metadata__", None)
    return header


def check_outputs(output_dir: Path, *, sampler: bool = False) -> None:
    """Check that a harness left protocol-conforming outputs in ``output_dir``.

    ``outputs.json`` must validate against ``outputs.schema.json`` (a trainer launch) or
    ``sampler_outputs.schema.json`` (``sampler``: a sampler cell); ``outputs.safetensors``
    must hold at least one tensor (a trainer's ``tensors.count``), every name must follow
    ``round{r}/{role}/{metric}`` and every floating tensor must be F32 or F64
    (:mod:`qualify.protocol`).

    Raises:
        HarnessError: the first problem found.
    """
    meta_path, tensors_path = output_dir / OUTPUTS_META_FILE, output_dir / OUTPUTS_FILE
    for p in (tensors_path, meta_path):
        if not p.is_file():
            raise HarnessError(f"{p}: missing (the harness exited 0 without writing it)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HarnessError(f"{meta_path}: not readable JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise HarnessError(f"{meta_path}: not a JSON object")
    if sampler:
        validate_sampler_outputs_meta(meta)
    else:
        sdk = str(meta.get("sdk_version", ""))
        if sdk and sdk.split(".", maxsplit=1)[0] != str(HARNESS_SDK_MAJOR):
            raise HarnessError(f"{meta_path}: sdk_version {sdk} is not supported: qualify reads "
                               f"harness SDK {HARNESS_SDK_MAJOR}.x outputs")
        validate_outputs_meta(meta)
    header = read_safetensors_header(tensors_path)
    if not header:
        raise HarnessError(f"{tensors_path}: holds no tensors")
    if not sampler and meta["tensors"]["count"] != len(header):
        raise HarnessError(f"{meta_path}: tensors.count is {meta['tensors']['count']} but "
                           f"{tensors_path.name} holds {len(header)} tensors")
    for name, info in header.items():
        try:
            parse_tensor_name(name)
        except ValueError as exc:
            raise HarnessError(f"{tensors_path}: {exc}") from None
        dtype = str(info.get("dtype", ""))
        if (dtype.startswith(("F", "BF")) and dtype not in _SAFETENSORS_FLOATS):
            raise HarnessError(f"{tensors_path}: {name} is {dtype}; the protocol stores "
                               f"floating tensors as F32 (or F64)")


def torchrun_command(cell_file: Path, *, module: str, world_size: int,
                     log_dir: Path, env: Mapping[str, str] | None = None,
                     python: Sequence[str] | None = None) -> list[str]:
    """The command line of a launch: ``torchrun`` on this node, or ``srun`` + ``torchrun``.

    Single node (default): ``torchrun --standalone --nnodes 1 --nproc-per-node W``.

    Multi-node, inside a Slurm allocation (the candidate sbatch script exports
    ``QUALIFY_NNODES`` = ``$SLURM_NNODES`` and ``QUALIFY_RDZV_ENDPOINT`` = first node of
    the allocation ``:29500``): when ``QUALIFY_NNODES`` = ``N`` > 1 and ``N`` divides ``W``,
    ``srun --nodes=N --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun --nnodes N
    --nproc-per-node W/N --rdzv-backend c10d --rdzv-endpoint EP --rdzv-id ID``: one
    torchrun per node, rendezvous on the first node (PyTorch's documented multi-node
    recipe). ``ID`` is unique per launch (the attempt directory), so two launches never
    share a rendezvous. A world size that ``N`` does not divide (an Actor TP2 + Critic TP1
    launch on 2 nodes) runs on this node alone. ``QUALIFY_LAUNCHER=srun`` forces the
    srun + rendezvous path also for ``N`` = 1 (the one-node Slurm test of CI uses it).

    Args:
        cell_file: the ``cell.json`` passed to the harness.
        module: harness module (``harnesses.torch_tp.harness``) or ``"module:attr"``
            (run through :func:`_trampoline`).
        world_size: processes to start, in all nodes together.
        log_dir: torchrun's ``--log-dir``.
        env: the launch environment (default: this process's).
        python: the interpreter command of the ranks (a foreign environment,
            :mod:`qualify.candidate.interpreter`): it runs torchrun, and each rank enters
            through :data:`~qualify.candidate.interpreter.RUNNER`; ``None``:
            :data:`sys.executable`.

    Raises:
        HarnessError: ``QUALIFY_NNODES`` is not a positive integer, or the srun path is
            asked for without ``QUALIFY_RDZV_ENDPOINT``.
    """
    e = os.environ if env is None else env
    exe = [sys.executable] if python is None else list(python)
    target = ([str(interpreter.RUNNER), module] if python is not None
              else ["-m", __name__, module] if ":" in module else ["-m", module])
    tail = ["--max-restarts", "0", "--log-dir", str(log_dir), "--redirects", "3",
            "--tee", "3", *target, str(cell_file)]
    nnodes = _nnodes(e, HarnessError)
    use_srun = (nnodes > 1 and world_size % nnodes == 0) or e.get("QUALIFY_LAUNCHER") == "srun"
    if not use_srun:
        return [*exe, "-m", "torch.distributed.run", "--standalone", "--nnodes",
                "1", "--nproc-per-node", str(world_size), *tail]
    endpoint = e.get("QUALIFY_RDZV_ENDPOINT", "")
    if not endpoint:
        raise HarnessError("QUALIFY_RDZV_ENDPOINT is not set: a multi-node launch needs the "
                           "rendezvous host:port (the candidate sbatch script exports it)")
    rdzv_id = "q" + hashlib.sha256(str(cell_file.resolve()).encode()).hexdigest()[:16]
    # srun's --kill-on-bad-exit takes an optional value: only the `=` form binds it
    return ["srun", f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1",
            *exe, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc-per-node", str(world_size // nnodes), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id, *tail]


def launch_command(cell_file: Path, *, module: str, world_size: int, log_dir: Path,
                   env: Mapping[str, str] | None = None, launcher: Launcher | None = None,
                   preload: Sequence[str] = (), python: Sequence[str] | None = None,
                   wait_stdin: bool = False) -> list[str]:
    """The command line of a launch: the warm launcher, torchrun, or srun + torchrun.

    The srun path of :func:`torchrun_command` wins whenever it applies (a multi-node
    allocation, or ``QUALIFY_LAUNCHER=srun``). Otherwise ``launcher`` decides, or, when it
    is ``None``, ``QUALIFY_LAUNCHER`` (``warm`` when unset).

    Args:
        cell_file: the ``cell.json`` passed to the harness.
        module: harness module or ``"module:attr"``.
        world_size: processes to start.
        log_dir: the rank-log directory.
        env: the launch environment (default: this process's).
        launcher: ``warm`` or ``torchrun``; ``None``: from ``QUALIFY_LAUNCHER``.
        preload: modules the warm launcher imports before it forks the ranks
            (:attr:`qualify.registry.EngineSpec.warm_imports`).
        python: a foreign interpreter command (:func:`torchrun_command`): always torchrun
            (the warm launcher forks qualify's own interpreter, never another).
        wait_stdin: the warm launcher waits for its start signal on stdin after its
            imports (``--wait-stdin``, :mod:`qualify.candidate.ahead`); no effect on the
            other launchers (:func:`is_warm` tells which the command is).

    Raises:
        UsageError: ``QUALIFY_LAUNCHER`` or ``QUALIFY_NNODES`` is bad
            (:func:`check_launch_env`).
        HarnessError: as :func:`torchrun_command`.
    """
    e = os.environ if env is None else env
    chosen = check_launch_env(e)
    torchrun = torchrun_command(cell_file, module=module, world_size=world_size,
                                log_dir=log_dir, env=e, python=python)
    if torchrun[0] == "srun" or (launcher or chosen) == "torchrun" or python is not None:
        return torchrun
    pre = [arg for mod in preload for arg in ("--preload", mod)]
    return [sys.executable, "-m", WARM_MODULE, "--nproc-per-node", str(world_size),
            "--log-dir", str(log_dir), *pre, *(["--wait-stdin"] if wait_stdin else []),
            module, str(cell_file)]


def is_warm(cmd: Sequence[str]) -> bool:
    """Whether ``cmd`` (from :func:`launch_command`) runs the warm launcher."""
    return list(cmd[1:3]) == ["-m", WARM_MODULE]


def check_launch_env(env: Mapping[str, str] | None = None) -> str:
    """Check the launch settings of the environment; the launcher they name.

    ``QUALIFY_LAUNCHER`` (``warm`` when unset) must be ``warm``, ``torchrun`` or ``srun``,
    ``QUALIFY_NNODES`` (when set) a positive integer, ``QUALIFY_RDZV_ENDPOINT`` ``HOST:PORT``
    (required with ``srun`` or more than one node: the srun path), and each engine's
    interpreter (:func:`qualify.candidate.interpreter.check_env`). The candidate stage calls
    this before it writes anything, so a bad value leaves no run behind.

    Raises:
        UsageError: a value is not one of those (the variable and value named).
    """
    e = os.environ if env is None else env
    chosen = e.get("QUALIFY_LAUNCHER", "") or "warm"
    if chosen not in (*LAUNCHERS, "srun"):
        raise UsageError(f"QUALIFY_LAUNCHER={chosen!r}: must be one of "
                         f"{', '.join((*LAUNCHERS, 'srun'))}")
    nnodes = _nnodes(e, UsageError)
    endpoint = e.get("QUALIFY_RDZV_ENDPOINT", "")
    if endpoint or chosen == "srun" or nnodes > 1:
        _check_endpoint(endpoint, "QUALIFY_LAUNCHER=srun" if chosen == "srun"
                        else f"QUALIFY_NNODES={nnodes}")
    interpreter.check_env(e)
    return chosen


def _check_endpoint(endpoint: str, why: str) -> None:
    """``QUALIFY_RDZV_ENDPOINT`` is ``HOST:PORT`` (port 1-65535).

    Raises:
        UsageError: unset (``why`` says what needs it) or not ``HOST:PORT``.
    """
    if not endpoint:
        raise UsageError(f"QUALIFY_RDZV_ENDPOINT is not set: {why} launches through srun and "
                         "needs the rendezvous HOST:PORT (the candidate sbatch script "
                         "exports it)")
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 \
            or any(c.isspace() for c in endpoint):
        raise UsageError(f"QUALIFY_RDZV_ENDPOINT={endpoint!r}: must be HOST:PORT")


def _nnodes(env: Mapping[str, str], error: type[QualifyError]) -> int:
    """``QUALIFY_NNODES`` (1 when unset or empty); ``error`` when not a positive integer."""
    raw = env.get("QUALIFY_NNODES", "1") or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise error(f"QUALIFY_NNODES={raw!r}: must be a positive integer")
    return int(raw)


def start_fork_server(contract: Contract) -> forkserver.ForkServer | None:
    """The fork server of a CPU candidate run of ``contract``, or ``None``.

    Started where the launches use the warm launcher (``QUALIFY_LAUNCHER`` unset or
    ``warm``), ``QUALIFY_FORKSERVER`` is not ``0`` (:func:`forkserver.enabled
    <qualify.candidate.forkserver.enabled>`) and the machine has no NVIDIA device
    (``/dev/nvidiaN``: there the launches are torchrun's and the sampler a fresh
    interpreter; the server itself also refuses to fork on one). It imports
    :data:`~qualify.candidate.forkserver.BASE_IMPORTS` and the contract's model classes
    (:func:`~qualify.candidate.forkserver.contract_model_types`) under a launch's
    environment (:func:`launch_env`) with ``QUALIFY_DEVICE=cpu`` (a CUDA build of torch may
    then fork for CPU ranks, :func:`qualify.candidate.warm.fork_safe`).

    Raises:
        UsageError: ``QUALIFY_FORKSERVER``, ``QUALIFY_LAUNCHER`` or ``QUALIFY_NNODES`` is bad.
        OSError: the interpreter cannot be started.
    """
    if (not forkserver.enabled() or check_launch_env() != "warm"
            or any(Path("/dev").glob("nvidia[0-9]*"))):  # a CUDA machine: torchrun's launches
        return None
    types = forkserver.contract_model_types(contract)
    return forkserver.start(modules=(*forkserver.BASE_IMPORTS, *forkserver.model_modules(types)),
                            env=launch_env({"QUALIFY_DEVICE": "cpu"}))


def launch_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """The environment of a launch: ours, overlaid by ``env``, plus what every rank needs.

    ``OMP_NUM_THREADS=1`` unless set (one thread per rank), ``PYTHONUNBUFFERED=1`` (logs
    arrive as written), the directory holding the ``qualify`` and ``harnesses`` packages
    first on ``PYTHONPATH`` (the checkout, or ``site-packages`` of a wheel install).
    """
    out = dict(os.environ)
    out.update(env or {})
    out.setdefault("OMP_NUM_THREADS", "1")
    out.setdefault("PYTHONUNBUFFERED", "1")
    root = str(repo_root())
    parts = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    out["PYTHONPATH"] = os.pathsep.join([root, *[p for p in parts if p != root]])
    return out


def launch(cell: HarnessCell, *, module: str, attempt_dir: Path, timeout_s: float,
           env: Mapping[str, str] | None = None,
           world_size: int | None = None, launcher: Launcher | None = None,
           preload: Sequence[str] = (), python: Sequence[str] | None = None,
           gate: Gate | None = None) -> LaunchResult:
    """Run ``cell`` under the launcher of :func:`launch_command` and report how it ended.

    Args:
        cell: what to run; its ``output_dir`` is where the harness writes ``outputs.*``
            (usually ``attempt_dir``).
        module: harness module, e.g. ``harnesses.torch_tp.harness`` (see
            :attr:`qualify.registry.EngineSpec.module`), or ``"module:attr"``.
        attempt_dir: a fresh attempt directory (``cell.json`` and ``logs/`` go here);
            attempts are never reused.
        timeout_s: wall-clock limit (> 0) of the whole launch.
        env: environment variables set for the launch (over this process's environment).
        world_size: ranks to start (the engine's rule,
            :meth:`qualify.registry.EngineSpec.world_size`: ``(actor_tp + critic_tp) * dp``
            for a data-parallel engine); ``None``: ``cell.world_size`` (``actor_tp +
            critic_tp``).
        launcher: ``warm`` or ``torchrun`` (:func:`launch_command`; ``None``: from
            ``QUALIFY_LAUNCHER``, ``warm`` when unset).
        preload: modules the warm launcher imports once before forking the ranks.
        python: the ranks' interpreter command when not qualify's own
            (:func:`torchrun_command`).
        gate: start the launch ahead of its turn (:mod:`qualify.candidate.ahead`): the warm
            launcher starts now, imports, and forks its ranks when ``gate`` opens; any other
            launcher starts when it opens. ``timeout_s``, ``wall_s`` and ``started`` count
            from the gate. A gate shut before it opened gives ``ERROR`` ("not started"),
            one shut after, ``ERROR`` ("cancelled"). The caller opens or shuts it.

    Returns:
        The :class:`LaunchResult` (``ERROR`` for every harness failure: none raises).

    Raises:
        HarnessError: the cell is invalid, the attempt directory was used before, or
            ``timeout_s`` is not positive (caller bugs, not harness failures).
    """
    try:
        return _launch(cell, module=module, attempt_dir=attempt_dir, timeout_s=timeout_s,
                       env=env, world_size=world_size, launcher=launcher, preload=preload,
                       python=python, gate=gate)
    finally:
        if gate is not None:
            gate.release()  # the launcher has its copy of the read end, or never will


def _launch(cell: HarnessCell, *, module: str, attempt_dir: Path, timeout_s: float,
            env: Mapping[str, str] | None, world_size: int | None, launcher: Launcher | None,
            preload: Sequence[str], python: Sequence[str] | None,
            gate: Gate | None) -> LaunchResult:
    """:func:`launch`, whose ``gate`` read end the caller releases."""
    if not timeout_s > 0:
        raise HarnessError(f"timeout_s must be > 0, got {timeout_s}")
    doc = cell.to_dict()
    validate_cell(doc)
    attempt_dir = Path(attempt_dir)
    cell_file = attempt_dir / CELL_FILE
    if cell_file.exists():
        raise HarnessError(f"{cell_file}: attempt directory already used; attempts are "
                           f"append-only (use a new attempt-N)")
    logs = attempt_dir / LOGS_DIR
    rank_dir = logs / RANK_LOGS_DIR
    rank_dir.mkdir(parents=True, exist_ok=True)
    Path(cell.output_dir).mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(cell_file, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
    launch_environment = launch_env(env)
    launch_environment[imported.IMPORTS_DIR_ENV] = str(imports.raw_dir(attempt_dir).resolve())
    world = cell.world_size if world_size is None else world_size
    cmd = launch_command(cell_file, module=module, world_size=world, log_dir=rank_dir,
                         env=launch_environment, launcher=launcher, preload=preload,
                         python=python, wait_stdin=gate is not None)
    warm_gate = gate if gate is not None and is_warm(cmd) else None
    # a gate not the warm launcher's is waited for here; a shut gate starts nothing
    if gate is not None and ((warm_gate is None and not gate.wait())
                             or gate.cancelled.is_set()):
        return _not_started(attempt_dir, cell_file, logs)
    launcher_log, started_ns = logs / LAUNCHER_LOG, time.time_ns()
    t0, started = time.monotonic(), utc_now_iso()
    launcher_started = started
    with launcher_log.open("wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        server = forkserver.current() if is_warm(cmd) else None  # None on a CUDA machine
        ran = procs.run(cmd, cwd=attempt_dir, env=launch_environment, stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=warm_gate.stdin if warm_gate else subprocess.DEVNULL,
                        new_session=True, timeout_s=timeout_s, grace_s=KILL_GRACE_S,
                        cancel=gate.cancelled if gate else None,
                        clock_from=warm_gate.opened if warm_gate else None,
                        spawn=server.spawn if server is not None else None)
    end = time.monotonic()
    left = procs.end_group(ran.pid, grace_s=KILL_GRACE_S)  # nothing outlives its launch
    if left:
        with launcher_log.open("ab") as log:
            log.write(f"[qualify] {left} process(es) of the launch's group outlived its "
                      f"launcher: ended (SIGTERM, then SIGKILL)\n".encode())
    rc, wall = ran.returncode, end - t0
    opened = warm_gate.opened_at if warm_gate is not None else None
    # ahead: its launcher started (and imported) before its gate opened; its turn, and
    # so its wall-clock time, began at the gate
    ran_ahead = opened is not None and t0 < opened
    if warm_gate is not None and opened is not None and t0 < opened < end:
        wall, started = end - opened, warm_gate.opened_utc or started
    if ran.spawned and server is not None:  # its modules were imported when the server started
        started_ns = min(started_ns, server.started_ns)
    imports.collect(attempt_dir, module=module, expected=world, started_ns=started_ns)
    rank_logs = tuple(sorted(p for p in rank_dir.rglob("*") if p.is_file()))

    def result(status: LaunchStatus, reason: str, failed: int | None = None) -> LaunchResult:
        return LaunchResult(status=status, reason=reason, wall_s=wall, returncode=rc,
                            attempt_dir=attempt_dir, cell_file=cell_file,
                            launcher_log=launcher_log, rank_logs=rank_logs, failed_rank=failed,
                            started=started, launcher_started=launcher_started,
                            ahead=ran_ahead)

    if ran.cancelled or (warm_gate is not None and rc == GATE_SHUT_EXIT
                         and not warm_gate.opened.is_set()):
        what = ("cancelled: the candidate stage stopped" if gate is None or gate.opened.is_set()
                else "not started: the candidate stage stopped before this launch's turn")
        return result("ERROR", f"{what} (process tree ended; logs kept in {logs})")
    if rc is None:
        return result("ERROR", f"timeout after {timeout_s:g}s (process tree ended; logs "
                               f"kept in {logs})")
    if rc != 0:
        failed, tail = _failure_tail(rank_dir, launcher_log)
        where = f"rank {failed}" if failed is not None else "the launcher"
        return result("ERROR", f"harness {procs.exit_text(rc)}; first failure on {where}:\n"
                               f"{tail}", failed)
    try:
        for _, _, sub in cell.variant_runs():  # each variant of a grouped launch
            check_outputs(Path(cell.output_dir) / sub)
    except HarnessError as exc:
        return result("ERROR", f"harness exited 0 but its outputs are not valid: {exc}")
    return result("OK", "")


def _not_started(attempt_dir: Path, cell_file: Path, logs: Path) -> LaunchResult:
    """The result of a gated launch whose gate was shut before its launcher started."""
    now = utc_now_iso()
    return LaunchResult(status="ERROR", reason="not started: the candidate stage stopped "
                        "before this launch's turn", wall_s=0.0, returncode=None,
                        attempt_dir=attempt_dir, cell_file=cell_file,
                        launcher_log=logs / LAUNCHER_LOG, rank_logs=(), failed_rank=None,
                        started=now, launcher_started="")


def launch_engine(cell: HarnessCell, *, engine: EngineSpec, attempt_dir: Path,
                  timeout_s: float, cuda: bool, gate: Gate | None = None) -> LaunchResult:
    """:func:`launch` of an engine's harness, as every stage launches it.

    The engine's module and world-size rule; on a CPU machine (``cuda`` false) its
    ``cpu_env`` with ``QUALIFY_DEVICE=cpu`` (the ranks run on CPU, which also lets the warm
    launcher fork under a CUDA build of torch) and the warm launcher with its
    ``warm_imports``; on a CUDA machine torchrun
    (fresh interpreters per rank: the path the GPU checks ran). An engine given its own
    interpreter (``QUALIFY_LAUNCHER_<ENGINE>``, :mod:`qualify.candidate.interpreter`) runs
    under torchrun of that interpreter.

    Args:
        cell: what to run (see :func:`launch`).
        engine: the engine's spec (:func:`qualify.registry.get_engine`).
        attempt_dir: a fresh attempt directory.
        timeout_s: wall-clock limit of the launch.
        cuda: whether this machine has a CUDA device.
        gate: start it ahead of its turn (:func:`launch`).

    Raises:
        HarnessError: as :func:`launch`.
        UsageError: ``QUALIFY_LAUNCHER_<ENGINE>`` is bad.
    """
    return launch(cell, module=engine.module, attempt_dir=attempt_dir, timeout_s=timeout_s,
                  env=_engine_env(engine, cuda), world_size=engine.world_size(cell),
                  launcher="torchrun" if cuda else None, preload=engine.warm_imports,
                  python=interpreter.engine_command(engine.name), gate=gate)


def _engine_env(engine: EngineSpec, cuda: bool) -> dict[str, str] | None:
    """:func:`launch_engine`'s ``env``: the engine's ``cpu_env`` on CPU, nothing on CUDA."""
    return None if cuda else {**engine.cpu_env, "QUALIFY_DEVICE": "cpu"}  # CUDA torch may fork


def _failure_tail(rank_dir: Path, launcher_log: Path) -> tuple[int | None, str]:
    """The first failing rank and what it said: its exception, then its log tail.

    The first failure is the earliest ``error.json`` (torchrun's record of an uncaught
    exception); failing that, the first rank whose stderr holds a traceback; failing
    that, torchrun's own log.
    """
    found: list[tuple[float, int, Path, str]] = []
    for err in rank_dir.rglob("error.json"):
        stamp, message = err.stat().st_mtime, ""
        with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
            info = json.loads(err.read_text(encoding="utf-8"))["message"]
            message = str(info.get("message", ""))
            stamp = float(info.get("extraInfo", {}).get("timestamp", stamp))
        with contextlib.suppress(ValueError):
            found.append((stamp, int(err.parent.name), err.parent, message))
    if not found:
        for stderr in sorted(rank_dir.rglob("stderr.log")):
            if "Traceback" in stderr.read_text(encoding="utf-8", errors="replace"):
                with contextlib.suppress(ValueError):
                    found.append((stderr.stat().st_mtime, int(stderr.parent.name),
                                  stderr.parent, ""))
    if not found:
        return None, _tail(launcher_log)
    _, rank, folder, message = min(found)
    tail = _tail(folder / "stderr.log")
    return rank, f"{message}\n{tail}" if message else tail


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return f"({path} unreadable)"
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _trampoline(argv: Sequence[str]) -> int:
    """``python -m qualify.candidate.launch module:attr CELL_JSON``: call ``attr([CELL_JSON])``."""
    if len(argv) != 2 or ":" not in argv[0]:
        print("usage: python -m qualify.candidate.launch MODULE:ATTR CELL_JSON", file=sys.stderr)
        return 2
    imported.install()
    mod_name, attr = argv[0].split(":", 1)
    fn = getattr(importlib.import_module(mod_name), attr)
    return int(fn([argv[1]]) or 0)


if __name__ == "__main__":
    sys.exit(_trampoline(sys.argv[1:]))
