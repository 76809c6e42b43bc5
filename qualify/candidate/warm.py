"""Start a launch's ranks from one warm interpreter: import once, fork every rank (issue #17).

``python -m qualify.candidate.warm --nproc-per-node W --log-dir DIR [--preload MOD ...]
[--wait-stdin] TARGET [ARGS ...]`` is the single-node CPU launcher of
:func:`qualify.candidate.launch.launch` (``ARGS``: the ``cell.json``). It replaces
``torchrun --standalone`` there, where most of a launch's wall was fixed cost: torchrun's
own interpreter, then ``W`` interpreters that each imported torch, transformers' model
classes and the engine (measured in ``docs/performance.md``). Here one interpreter imports
``TARGET``'s module, every ``--preload`` module (the engine's
:attr:`~qualify.registry.EngineSpec.warm_imports`) and the transformers model classes of
the cell's model directories, then forks ``W`` ranks that share those modules.

With ``--wait-stdin`` the launcher, its imports done, waits for its start signal before it
starts any rank (:func:`wait_for_start`: a byte on stdin, the gate of a launch started ahead
of its turn, :mod:`qualify.candidate.ahead`); end of file instead exits
:data:`GATE_SHUT_EXIT` with no rank started.

Each rank gets the environment torchrun gives a worker (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_*``; PyTorch's
``torch/distributed/elastic/agent/server/local_elastic_agent.py``), so the harness's
``init_process_group`` (``env://``) is the same call as under torchrun, and, as under
torchrun, the launcher hosts the TCPStore for the whole launch (the agent store,
``TORCHELASTIC_USE_AGENT_STORE=True``; on a port the kernel picks, passed to each forked rank
through a pipe). Its stdout / stderr go to
``DIR/<rank>/stdout.log`` / ``stderr.log`` and an uncaught exception of a ``@record``
entry point to ``DIR/<rank>/error.json`` (``TORCHELASTIC_ERROR_FILE``), the files
:func:`qualify.candidate.launch._failure_tail` reads. The rank then runs ``TARGET`` as
torchrun would (:func:`_run_entry`): ``attr(ARGS)`` for ``module:attr`` (the launch
trampoline), a ``.py`` script or a module as ``__main__`` (:mod:`runpy`), and ends with
``os._exit`` after flushing.

Independence is kept: the parent computes nothing (it only imports), so each rank starts
from the frozen inputs with its own model, optimizer and RNG state as under torchrun;
``tests/test_warm_launch.py`` finds every output tensor of a warm launch bitwise equal to a
torchrun launch of the same cell. Forking is safe only from a single-threaded process that
has not initialised CUDA: when either fails (or on a CUDA build of torch without
``QUALIFY_DEVICE=cpu``), each rank execs a fresh interpreter instead (``python -m TARGET
ARGS``; :class:`subprocess.Popen`, rank 0 hosting the store), still without torchrun.
Failure handling is torchrun's: the first rank to exit non-zero (or killed by a signal)
makes the launcher SIGTERM the others, SIGKILL them after :data:`KILL_GRACE_S`, and exit 1
(each rank's code is in ``launcher.log``); SIGTERM, SIGINT, SIGHUP or SIGQUIT to the
launcher (``qualify.procs.run`` on a timeout) exits 128 + the signal: before any rank
exists (importing, or waiting for its start signal) at once, from its first line on; after,
once it has ended every rank the same way (SIGTERM, then SIGKILL). A forked rank dies with
the launcher (``PR_SET_PDEATHSIG`` SIGKILL) however the launcher dies.

What a forked rank shares with its siblings and a fresh interpreter would not: the
launcher's hash seed (``PYTHONHASHSEED``; iterating a set of strings gives the same order on
every rank, where torchrun's ranks may differ) and the global RNG states of ``random`` and
numpy as the imports left them (every harness seeds torch itself per variant). An engine
whose ranks must agree on such an order passes here and could fail under torchrun: the
periodic ``QUALIFY_LAUNCHER=torchrun`` runs and the CUDA path (always torchrun) cover it.
Modules in ``warm_imports`` are imported before any rank exists, so they must not read a
rank's environment (``RANK``, ``LOCAL_RANK``) at import time.

Importing this module imports neither torch nor any engine.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import gc
import importlib
import importlib.util
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

KILL_GRACE_S: Final = 5.0
"""Seconds between SIGTERM and SIGKILL of the surviving ranks."""
_POLL_S: Final = 0.02
_PR_SET_PDEATHSIG: Final = 1
_FORWARDED: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""The signals torchrun's agent handles (``TORCHELASTIC_SIGNALS_TO_HANDLE``): each ends the
ranks."""
GATE_SHUT_EXIT: Final = 3
"""The launcher's exit code when ``--wait-stdin``'s pipe closed before the start signal."""
PREFIX: Final = "[warm]"
"""Prefix of the launcher's own lines in ``launcher.log``."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (bound to port 0 and released), for ``MASTER_PORT``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, *, port: int, log_dir: Path,
             run_id: str) -> dict[str, str]:
    """The variables torchrun sets for a single-node worker (``local_elastic_agent.py``).

    Args:
        rank: global rank (= local rank: one node).
        world: world size (= local world size).
        port: ``MASTER_PORT`` (the launcher's agent store; a forked rank gets the real
            port through its pipe, :func:`start_ranks`).
        log_dir: the launch's rank-log directory (``error.json`` goes to ``<rank>/``).
        run_id: ``TORCHELASTIC_RUN_ID``.
    """
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCHELASTIC_ERROR_FILE": str(log_dir / str(rank) / "error.json"),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                          "1"),
    }


def preload(target: str, modules: Sequence[str], cell_file: Path | None) -> list[str]:
    """Import the entry point's module, ``modules`` and the cell's HF model classes.

    The model classes are found as ``from_pretrained`` finds them (the ``model_type`` of
    each ``config.json`` named in the cell's ``inputs_dir/model.json``, through
    transformers' auto-model mappings), and only imported: no model is built. A module
    that fails to import is left to the rank, which then reports the failure itself.

    Returns:
        One note per module that could not be imported (empty when all were).
    """
    notes: list[str] = []
    own = () if target.endswith(".py") else (target.split(":", 1)[0],)
    for name in (*own, *modules):
        try:
            importlib.import_module(name)
        except Exception as exc:  # the rank imports it again and reports the error
            notes.append(f"{name}: {type(exc).__name__}: {exc}")
    try:
        if cell_file is not None and cell_file.suffix == ".json":
            _preload_model_classes(cell_file)
    except Exception as exc:  # best effort: from_pretrained in the rank does the real work
        notes.append(f"model classes: {type(exc).__name__}: {exc}")
    return notes


def _preload_model_classes(cell_file: Path) -> None:
    cell = json.loads(cell_file.read_text("utf-8"))
    preload_models(Path(cell["inputs_dir"]))


def preload_models(inputs_dir: Path) -> None:
    """Import the HF model classes of the models a run's ``inputs_dir/model.json`` names.

    Only imports (no model is built): the modeling module of each ``config.json``'s
    ``model_type``, as :func:`preload` does for a cell. A directory without ``model.json``
    is read as a models-cache bundle (:mod:`qualify.models.cache`): the ``config.json`` of
    each of its subdirectories.

    Raises:
        OSError, ValueError, KeyError: ``model.json`` is missing (and ``inputs_dir`` is no
            directory) or malformed (callers treat this as best effort).
    """
    from qualify.layout import MODEL_FILE

    if inputs_dir.is_dir() and not (inputs_dir / MODEL_FILE).exists():
        dirs = {str(p.parent) for p in inputs_dir.glob("*/config.json")}
    else:
        models = json.loads((inputs_dir / MODEL_FILE).read_text("utf-8"))
        dirs = {str(v) for k, v in models.items() if k.endswith("_dir")}
    if not dirs:
        return
    from transformers.models.auto import configuration_auto, modeling_auto

    for d in sorted(dirs):
        config = Path(d) / "config.json"
        if not config.is_file():
            continue
        model_type = json.loads(config.read_text("utf-8")).get("model_type")
        if not isinstance(model_type, str) or model_type not in configuration_auto.CONFIG_MAPPING:
            continue
        config_class = configuration_auto.CONFIG_MAPPING[model_type]
        for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING,
                        modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING,
                        modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING):
            with contextlib.suppress(KeyError):
                mapping[config_class]  # the lazy mapping imports the modeling module


def fork_safe() -> tuple[bool, str]:
    """Whether this process may fork ranks, and why not.

    Safe: one thread (``/proc/self/task``; a forked child gets only the calling thread, so
    a lock held by another would never be released), CUDA not initialised (a forked child
    cannot use it), and no CUDA build of torch unless ``QUALIFY_DEVICE=cpu`` (the ranks
    would initialise CUDA themselves; torchrun's fresh interpreters are the tested path).
    """
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        return False, "no /proc/self/task to count threads"
    if threads != 1:
        return False, f"{threads} threads after the imports"
    torch = sys.modules.get("torch")
    if torch is not None:
        if torch.cuda.is_initialized():
            return False, "CUDA initialised by an import"
        if torch.version.cuda is not None and os.environ.get("QUALIFY_DEVICE") != "cpu":
            return False, f"CUDA build of torch ({torch.version.cuda})"
    return True, ""


class _Libc:
    """libc, loaded once in the launcher, so a forked rank only calls into it."""

    handle: ctypes.CDLL | None = None

    @classmethod
    def load(cls) -> None:
        with contextlib.suppress(OSError):
            cls.handle = ctypes.CDLL(None, use_errno=True)

    @classmethod
    def die_with(cls, parent: int, sig: int = signal.SIGKILL) -> None:
        """``prctl(PR_SET_PDEATHSIG, sig)``; exit at once if ``parent`` is gone already."""
        if cls.handle is not None:
            cls.handle.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """In a forked child: get ``sig`` when ``parent`` dies; exit if it is gone already.

    ``prctl(PR_SET_PDEATHSIG, sig)`` through libc (loaded here if the parent did not load it
    before the fork). For other forking processes: the vLLM sampler harness's
    ``external_launcher`` ranks (SIGKILL), the fork server's children (SIGTERM: a launcher
    ends its own ranks on it, :mod:`qualify.procs`).
    """
    if _Libc.handle is None:
        _Libc.load()
    _Libc.die_with(parent, sig)


def exit_code(exc: SystemExit) -> int:
    """The exit code an interpreter gives for an uncaught ``exc``.

    ``None``: 0; an int: itself; anything else is printed to stderr and gives 1.
    """
    code = exc.code
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _redirect(rank_dir: Path) -> None:
    """Point fds 0, 1, 2 at ``/dev/null``, ``stdout.log``, ``stderr.log`` of ``rank_dir``."""
    append = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, str(rank_dir / "stdout.log"), append),
                            (2, str(rank_dir / "stderr.log"), append)):
        new = os.open(name, flags, 0o644)
        os.dup2(new, fd)
        os.close(new)


def _run_entry(target: str, args: Sequence[str]) -> int:
    """Run the entry point as torchrun would; its exit code.

    ``module:attr``: ``attr(ARGS)`` (what :func:`qualify.candidate.launch._trampoline`
    does). A ``.py`` path: the script as ``__main__`` (``torchrun script.py ARGS``). A
    module: run as ``__main__`` by :mod:`runpy` (``python -m``), after dropping the copy
    the parent imported, so the module's body runs once, as ``__main__``, over the cached
    imports of everything it imports. ``SystemExit`` ends it as it ends an interpreter: its
    code, or 1 with a message printed to stderr.
    """
    from qualify.candidate import imported

    sys.argv = [target, *args]
    try:
        if ":" in target:
            mod_name, attr = target.split(":", 1)
            return int(getattr(importlib.import_module(mod_name), attr)(list(args)) or 0)
        if target.endswith(".py"):
            imported.note(target)
            runpy.run_path(target, run_name="__main__")
            return 0
        sys.modules.pop(target, None)
        with contextlib.suppress(ImportError, ValueError):  # runpy reports a bad target
            imported.note(getattr(importlib.util.find_spec(target), "origin", None))
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exit_code(exc)
    return 0


def _rank_main(rank: int, *, target: str, args: Sequence[str], env: dict[str, str],
               rank_dir: Path, parent: int, port_pipe: int) -> int:
    """The body of one forked rank: torchrun's environment, the entry point, a clean end.

    Waits for ``MASTER_PORT`` (and whether the launcher hosts the store) on ``port_pipe``,
    runs the entry point, then ends as an interpreter does: joins its non-daemon threads
    and runs its own ``atexit`` handlers (the launcher's were dropped at the fork), so a
    writer thread or an exit hook of the engine finishes before ``os._exit``.
    """
    for sig in _FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    _Libc.die_with(parent)
    atexit._clear()  # the launcher's exit hooks are not this rank's
    _redirect(rank_dir)
    with os.fdopen(port_pipe, "r") as pipe:
        port, agent = pipe.read().split()
    os.environ.update(env, MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE=agent)
    from qualify.candidate import imported

    imported.install()  # the rank's imported files, written as it ends
    try:
        rc = _run_entry(target, args)
    except BaseException:
        traceback.print_exc()
        rc = 1
    main_thread = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main_thread and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return rc


def _agent_store(world: int) -> tuple[object | None, int]:
    """Torchrun's agent store: a TCPStore server in the launcher for the whole launch.

    Made after the ranks are forked (its server threads must not be in a forked child),
    on a port the kernel picks (no free-port race). ``(None, free port)`` without torch:
    rank 0 then hosts the store (``TORCHELASTIC_USE_AGENT_STORE=False``).
    """
    try:
        from torch.distributed import TCPStore
    except ImportError:
        return None, free_port()
    store = TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False)
    return store, int(store.port)


def fork_child(body: Callable[[], int]) -> int:
    """Fork; the child runs ``body`` and ends with ``os._exit`` of its code; the child's pid.

    This process's buffered stdout / stderr are flushed before the fork (a child never
    writes the parent's pending lines again) and the child's after ``body``; an exception
    out of ``body`` is printed to the child's stderr and its code is 1. The child never
    returns into the caller's stack (no ``finally`` or ``atexit`` of the parent runs in it).
    The child starts with :func:`gc.freeze`: the objects it inherited are never collected
    in it (a cycle of them that becomes garbage there stays), and a collection costs what
    the child made, not the whole import graph.
    """
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid != 0:
        return pid
    # What the child inherited (the imported modules: about 440 K objects with torch,
    # transformers and DeepSpeed) goes to the permanent generation: a full collection then
    # scans only what the child makes (DeepSpeed's see_memory_usage calls gc.collect()).
    gc.freeze()
    code = 1
    try:
        code = body()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def start_ranks(world: int, *, target: str, args: Sequence[str], log_dir: Path,
                forked: bool) -> tuple[dict[int, int], object | None]:
    """Start ``world`` ranks; ``(pid -> rank, the agent store kept alive by the caller)``.

    Forked ranks run :func:`_rank_main` and get ``MASTER_PORT`` through a pipe once the
    launcher's agent store is up. Unsafe to fork: each rank is a fresh interpreter
    (:class:`subprocess.Popen`: no Python runs between its fork and exec), rank 0 hosting the
    store on a free port, as under torchrun without an agent store.
    """
    run_id = f"warm-{os.getpid()}"
    pids: dict[int, int] = {}
    envs = {}
    for rank in range(world):
        (log_dir / str(rank)).mkdir(parents=True, exist_ok=True)
        envs[rank] = rank_env(rank, world, port=0, log_dir=log_dir, run_id=run_id)
    if not forked:
        free = str(free_port())
        argv = ([sys.executable, "-m", "qualify.candidate.launch", target, *args]
                if ":" in target else [sys.executable, target, *args]
                if target.endswith(".py") else [sys.executable, "-m", target, *args])
        for rank in range(world):
            rank_dir = log_dir / str(rank)
            with (rank_dir / "stdout.log").open("ab") as out, \
                    (rank_dir / "stderr.log").open("ab") as err:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        env={**os.environ, **envs[rank], "MASTER_PORT": free,
                                             "TORCHELASTIC_USE_AGENT_STORE": "False"})
            pids[proc.pid] = rank
        return pids, None
    parent, pipes = os.getpid(), dict[int, int]()
    for rank in range(world):
        read_end, write_end = os.pipe()

        def body(rank: int = rank, read_end: int = read_end, write_end: int = write_end) -> int:
            os.close(write_end)
            for other in pipes.values():  # the launcher's, not the rank's
                os.close(other)
            return _rank_main(rank, target=target, args=args, env=envs[rank],
                              rank_dir=log_dir / str(rank), parent=parent, port_pipe=read_end)

        pid = fork_child(body)
        os.close(read_end)
        pids[pid], pipes[rank] = rank, write_end
    store, port = _agent_store(world)
    for write_end in pipes.values():
        with os.fdopen(write_end, "w") as pipe:
            pipe.write(f"{port} {store is not None}")
    return pids, store


def supervise(pids: dict[int, int], received: list[int], *,
              grace_s: float = KILL_GRACE_S) -> int:
    """Wait for every rank; on the first failure or a signal, end the others (torchrun's rule).

    Args:
        pids: pid -> rank.
        received: the signals the launcher got (filled by its handlers, :func:`main`).
        grace_s: seconds between SIGTERM and SIGKILL of the survivors.

    Returns:
        0 when every rank exited 0; 1 when one failed (torchrun's exit code; each rank's
        own code is in ``launcher.log``); 128 + the signal the launcher received.
    """
    t0 = time.monotonic()
    alive, failed, kill_at = dict(pids), False, None
    while alive:
        for pid in list(alive):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its exit status is unknown
                done, status = pid, -1
            if done == 0:
                continue
            rank = alive.pop(pid)
            code = os.waitstatus_to_exitcode(status) if status != -1 else None
            what = ("vanished (exit status unknown)" if code is None else
                    f"was killed by signal {-code}" if code < 0 else f"exited with {code}")
            print(f"{PREFIX} rank {rank} (pid {pid}) {what} after "
                  f"{time.monotonic() - t0:.2f} s", flush=True)
            failed = failed or code != 0
        if (failed or received) and kill_at is None and alive:
            why = f"signal {received[0]}" if received else "a rank failed"
            print(f"{PREFIX} {why}: SIGTERM to ranks {sorted(alive.values())}", flush=True)
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            kill_at = time.monotonic() + grace_s
        if kill_at is not None and time.monotonic() >= kill_at:
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            kill_at = float("inf")
        time.sleep(_POLL_S)
    if received:
        return 128 + received[0]
    return 1 if failed else 0


def wait_for_start() -> str | None:
    """Block until the start signal arrives on stdin (``--wait-stdin``); ``None`` once it has.

    The signal is one byte or more written to this process's stdin (a pipe held by the
    candidate stage, :class:`qualify.candidate.gate.Gate`); end of file without one (the
    stage closed the pipe, or died) means the launch must not start. A forwarded signal
    (:data:`_FORWARDED`) ends the launcher at once while no rank exists (``main``'s
    handler). Afterwards stdin is ``/dev/null``, as the ranks' stdin is under torchrun
    (:func:`qualify.procs.run`'s default).

    Returns:
        ``None`` to go on; else why not (the pipe closed before the start signal).
    """
    while True:
        ready, _, _ = select.select([0], [], [], _POLL_S * 5)  # PEP 475: retried on EINTR
        if ready:
            why = None if os.read(0, 64) else "start pipe closed before the start signal"
            break
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return why


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The launcher's arguments.

    ``--nproc-per-node``, ``--log-dir``, ``--preload``, ``--wait-stdin``, ``target``,
    ``args``; exits 2 with argparse's message when they are bad.
    """
    parser = argparse.ArgumentParser(prog="python -m qualify.candidate.warm")
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--preload", action="append", default=[])
    parser.add_argument("--wait-stdin", action="store_true")
    parser.add_argument("target")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (see the module docstring); the launch's exit code."""
    args = parse_args(argv)
    if args.wait_stdin:
        try:
            os.fstat(0)
        except OSError as exc:
            print(f"{PREFIX} --wait-stdin: stdin is not open: {exc.strerror}", file=sys.stderr,
                  flush=True)
            return 2
    received: list[int] = []  # a signal from here on ends the launch, never the launcher alone
    forking = threading.Event()  # set just before the first rank is forked

    def on_signal(signum: int, _frame: object) -> None:
        if not forking.is_set():  # no rank yet (importing, or waiting ahead): end now
            with contextlib.suppress(OSError):  # a closed or full stdout: exit all the same
                os.write(1, f"{PREFIX} signal {signum} before any rank started\n".encode())
            os._exit(128 + signum)
        received.append(signum)

    for sig in _FORWARDED:
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # an inherited SIG_IGN would hide exit codes
    if args.nproc_per_node > 1:  # torchrun's rule (torch/distributed/run.py), before torch
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.monotonic()
    notes = preload(args.target, args.preload, Path(args.args[0]) if args.args else None)
    if args.wait_stdin:
        imported_s = time.monotonic() - t0
        print(f"{PREFIX} imports {imported_s:.2f} s; waiting for the start signal on stdin",
              flush=True)
        go = wait_for_start()
        if go is not None:
            print(f"{PREFIX} {go}: no rank started", flush=True)
            return GATE_SHUT_EXIT
        t0 = time.monotonic() - imported_s  # the wait is not the launch's import time
    forking.set()  # from here a signal is recorded and forwarded to the ranks (supervise)
    _Libc.load()
    forked, why = fork_safe()
    mode = "fork" if forked else f"exec ({why})"
    print(f"{PREFIX} {args.nproc_per_node} ranks of {args.target}, {mode}; imports "
          f"{time.monotonic() - t0:.2f} s" + "".join(f"\n{PREFIX} not preloaded: {n}"
                                                       for n in notes), flush=True)
    pids, store = start_ranks(args.nproc_per_node, target=args.target, args=args.args,
                              log_dir=args.log_dir, forked=forked)
    try:
        return supervise(pids, received)
    finally:
        del store  # the agent store lives as long as the launch


if __name__ == "__main__":
    code = main()
    for _stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            _stream.flush()
    os._exit(code)
