"""One warm interpreter that imports torch and transformers once and forks each launcher (#48).

Every launcher of a CPU candidate run (the warm launcher of each trainer launch,
:mod:`qualify.candidate.warm`, and the vLLM sampler harness) starts by importing the same
modules: torch, transformers, the model's HF classes, ``torch._dynamo`` and
``torch._inductor.compile_fx`` (DeepSpeed and Megatron-Core call ``torch.compile`` at import,
vLLM imports both). Those imports are most of each launcher's own CPU time. The fork server
is started first (:func:`qualify.candidate.launch.start_fork_server`, by
:func:`qualify.pipeline.chain.run_all` before its own imports, so the two import side by
side), imports :data:`BASE_IMPORTS` and the model
classes (:func:`model_modules`) once, then forks each launcher on request
(:meth:`ForkServer.spawn`): the child gets the request's argv, environment, working
directory and stdin / stdout / stderr, starts a session of its own, and runs
``python -m MODULE ARGS`` as the interpreter runs it (:func:`_child_main`). It computes
nothing: the child imports its engine and harness itself and starts from the frozen inputs,
as a fresh interpreter would.

Supervision. The launcher is the server's child, not qualify's, so :meth:`ForkServer.spawn`
returns a :class:`Child` that :func:`qualify.procs.run` drives as it drives a
:class:`subprocess.Popen`: its pid (its own process group: ``setsid``), ``poll`` / ``wait``
/ ``communicate`` on a status pipe whose write end the server holds and fills with the
``waitpid`` status when it reaps the child, ``send_signal``. A child dies with the server
(``PR_SET_PDEATHSIG`` SIGTERM, the signal :func:`qualify.procs.run` binds to qualify), and
the server with the qualify thread that started it (the same), or when qualify closes its
end of the control socket (:meth:`ForkServer.close`): so nothing outlives qualify. A status
pipe that closes without a status (the server died first) gives :data:`LOST_EXIT`.

What the child shares with a fresh interpreter and what it does not. The modules the
server imported, with their import-time environment: :meth:`ForkServer.spawn` refuses, with
``None``, a request whose import-relevant variables (:data:`IMPORT_ENV_PREFIXES`) differ
from the server's, and the caller starts a fresh interpreter. The hash seed
(``PYTHONHASHSEED``) and numpy's global RNG state as the imports left it (``random``
reseeds itself in a forked child; every harness seeds torch itself per variant), as the
warm launcher's forked ranks share them already. Records: a forked launch's imported-files
record (:mod:`qualify.candidate.imported`) also names what the server imported and the
launch did not (``torch._inductor``'s dependencies for a torch_tp launch), and can miss a
top-level name that only an exit hook of a preloaded module imports after the record was
written (``tabulate``, which ``torch._dynamo``'s hook imports: the server registered that
hook first, so it runs last); its checkout files are a fresh launch's, and each launch's
imports are checked against the server's start (:attr:`ForkServer.started_ns`).
Import-time warnings of the preloaded modules go to qualify's stderr once, not to each
launch's log; a child's stdout is write-through.
Only a single-threaded server forks (:func:`qualify.candidate.warm.fork_safe`); where the
imports left threads or initialised CUDA, or on a machine with an NVIDIA device, it forks
nothing and every request is refused (the run does not start one there,
:func:`qualify.candidate.launch.start_fork_server`). A request it cannot serve (a failed
``fork``) is refused, and that launch starts fresh; a server that does not answer within
:data:`REPLY_TIMEOUT_S` is retired.

``QUALIFY_FORKSERVER=0`` turns it off (each launcher is a fresh interpreter, as before).

Importing this module imports neither torch nor any engine.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
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
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

from qualify.candidate import warm

if TYPE_CHECKING:
    from qualify.contract import Contract

__all__ = ["BASE_IMPORTS", "ENV", "FORKED_NOTE", "IMPORT_ENV_PREFIXES", "LOST_EXIT",
           "READ_LATER", "RELATIVE_PATH",
           "REPLY_TIMEOUT_S", "Child", "ForkServer", "contract_model_types", "current",
           "enabled", "import_env", "model_modules", "process_name", "serving", "start"]

ENV: Final = "QUALIFY_FORKSERVER"
"""``0`` turns the fork server off (``1``, the default, leaves it to :func:`enabled`)."""
BASE_IMPORTS: Final = ("torch", "transformers", "torch._dynamo", "torch._inductor.compile_fx")
"""What every launcher imports first (the model classes come from :func:`model_modules`)."""
IMPORT_ENV_PREFIXES: Final = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "NPY_", "TORCH",
                              "PYTORCH_", "ATEN_", "DNNL_", "ONEDNN_", "TRITON_", "CUDA_",
                              "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "USE_TF",
                              "USE_TORCH", "USE_JAX", "XDG_CACHE_HOME", "HOME", "PYTHON",
                              "LD_", "LANG", "LC_", "TZ", "MALLOC_", "GLIBC_TUNABLES")
"""Variables that may be read while :data:`BASE_IMPORTS` are imported (libgomp reads
``OMP_*`` when torch loads it, numpy its ``NPY_*``, huggingface_hub its ``HF_*`` and
``HOME`` / ``XDG_CACHE_HOME``, transformers ``USE_*``, the C library the locale): a request
must have the server's values of each (``PYTHONPATH`` compared without empty entries; one
with a relative entry, which a fresh interpreter resolves against its own working
directory, never matches)."""
RELATIVE_PATH: Final = "PYTHONPATH (relative)"
""":func:`import_env`'s key for a ``PYTHONPATH`` with a relative entry: a request with it is
never forked."""
READ_LATER: Final = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                               "PYTHONUNBUFFERED"})
"""Variables of those prefixes left out of the comparison. torch reads its cache
directories when it first compiles, never at import, and sets them itself then
(``torch/_inductor/runtime/cache_dir_utils.py``), so a qualify process that compiled once
passes them on. ``PYTHONUNBUFFERED`` sets only how stdout buffers: a child's stdout is the
server's, write-through (the server runs with it set), which changes no output, only when
lines reach the log."""
REPLY_TIMEOUT_S: Final = 600.0
"""Seconds :meth:`ForkServer.spawn` waits for the server's reply (its imports first): past
it the server is retired and the launch starts fresh."""
FORKED_NOTE: Final = "[qualify] forked by the fork server"
"""The first line a forked child writes to its stdout (a launch's ``launcher.log``, the
sampler's ``stdout.txt``): what started it."""
LOST_EXIT: Final = 255
"""A child's exit code when its status never arrived (the server died before reaping it)."""
_MAX_MESSAGE: Final = 1 << 20
_PR_SET_NAME: Final = 15


def process_name(module: str) -> str:
    """The name (``/proc/PID/comm``, 15 bytes) a child running ``module`` gets.

    Its command line stays the server's (no exec), so the name tells what it runs:
    ``module`` without a leading ``harnesses.`` / ``qualify.``, its last 15 characters
    (``vllm.harness``, ``candidate.warm``).
    """
    for prefix in ("harnesses.", "qualify."):
        module = module.removeprefix(prefix)
    return module[-15:]


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``QUALIFY_FORKSERVER`` lets a run start a fork server (unset: yes).

    The run starts one only where its launches use the warm launcher
    (:func:`qualify.candidate.launch.start_fork_server`).

    Raises:
        UsageError: ``QUALIFY_FORKSERVER`` is not ``0`` or ``1``.
    """
    from qualify.errors import UsageError

    raw = (os.environ if env is None else env).get(ENV, "")
    if raw not in ("", "0", "1"):
        raise UsageError(f"{ENV}={raw!r}: must be 0 or 1")
    return raw != "0"


def model_modules(model_types: Sequence[str]) -> list[str]:
    """The transformers modeling modules of ``model_types`` (``qwen3`` -> ``...modeling_qwen3``).

    transformers' layout (``transformers/models/<type>/modeling_<type>.py``); a type without
    such a module is imported by the launcher itself (the server notes the failure).
    """
    return [f"transformers.models.{t}.modeling_{t}" for t in model_types
            if t.replace("_", "").isalnum()]


def contract_model_types(contract: Contract) -> list[str]:
    """The HF ``model_type`` of a contract's models where known without reading them.

    ``tiny-qwen3``: ``qwen3``; ``smollm2-135m``: ``llama`` (its GGUF conversion); an HF
    directory: none (its launchers import its classes themselves).
    """
    return {"tiny-qwen3": ["qwen3"], "smollm2-135m": ["llama"]}.get(contract.model.source, [])


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that the server's imports read.

    Those of :data:`IMPORT_ENV_PREFIXES` but :data:`READ_LATER`.
    """
    out = {k: v for k, v in env.items()
           if k.startswith(IMPORT_ENV_PREFIXES) and k not in READ_LATER}
    if "PYTHONPATH" in out:
        parts = [p for p in out["PYTHONPATH"].split(os.pathsep) if p]
        out["PYTHONPATH"] = os.pathsep.join(parts)
        if not parts:
            del out["PYTHONPATH"]
        elif not all(os.path.isabs(p) for p in parts):
            out[RELATIVE_PATH] = out["PYTHONPATH"]
    return out


class Child:
    """A process the fork server forked, driven as :func:`qualify.procs.run` drives a Popen.

    Attributes:
        pid: its process id (it leads its own session and process group).
        args: the command it runs.
        returncode: ``None`` while it runs; then its exit code (negative: the signal that
            killed it, as :mod:`subprocess` reports it; :data:`LOST_EXIT` if unknown).
        stdout: always ``None`` (no pipes: a child writes to files).
        stderr: always ``None``.
    """

    def __init__(self, pid: int, args: Sequence[str], status_fd: int) -> None:
        self.pid, self.args, self._status = pid, list(args), status_fd
        self.returncode: int | None = None
        self.stdout: IO[bytes] | None = None
        self.stderr: IO[bytes] | None = None
        self._buf = b""
        self._lock = threading.Lock()

    def _read(self, timeout: float | None) -> None:
        """Read the status pipe for up to ``timeout`` seconds (``None``: until it closes)."""
        with self._lock:
            if self.returncode is not None:
                return
            deadline = None if timeout is None else time.monotonic() + timeout
            poller = select.poll()
            poller.register(self._status, select.POLLIN | select.POLLHUP)
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not poller.poll(None if left is None else int(left * 1000)):
                    return
                chunk = os.read(self._status, 64)
                if chunk:
                    self._buf += chunk
                    continue
                os.close(self._status)
                self._status = -1
                text = self._buf.decode().strip()
                self.returncode = (os.waitstatus_to_exitcode(int(text)) if text.lstrip("-")
                                   .isdigit() else LOST_EXIT)
                return

    def poll(self) -> int | None:
        """Its exit code, or ``None`` while it runs."""
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to end; its exit code.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def communicate(self, input: Any = None,
                    timeout: float | None = None) -> tuple[None, None]:
        """:meth:`wait`, as :meth:`subprocess.Popen.communicate` with no pipes.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        self.wait(timeout)
        return None, None

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to it while it has not been reaped."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


class ForkServer:
    """qualify's end of one fork server: start it, send it requests, close it.

    Thread-safe: one request at a time over the control socket.
    """

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket,
                 env: Mapping[str, str]) -> None:
        self._proc, self._sock, self._env = proc, sock, import_env(env)
        sock.settimeout(REPLY_TIMEOUT_S)
        self._lock = threading.Lock()
        self.executable = sys.executable
        self.pid = proc.pid
        self.started_ns = time.time_ns()
        """When it started (``time.time_ns``): its imports are no older than this, so a
        forked launch's imported files are checked against it
        (:func:`qualify.evidence.imports.collect`'s ``started_ns``)."""
        self.retired: str | None = None
        """Why this end sends the server no more requests, else ``None``: the server forks
        nothing (its reply says ``retire``), did not reply, is gone, or was closed. A reply
        that refuses one request only (a failed fork) leaves it ``None``."""

    def spawn(self, cmd: Sequence[str], *, env: Mapping[str, str], cwd: str | Path | None,
              stdin: int, stdout: int, stderr: int,
              imports_under: Mapping[str, str] | None = None) -> Child | None:
        """Fork ``cmd`` (``[sys.executable, "-m", MODULE, *ARGS]``) from the server.

        Args:
            cmd: the command a fresh interpreter would run.
            env: its whole environment.
            cwd: its working directory (``None``: this process's).
            stdin: the fd its stdin is a copy of.
            stdout: the fd its stdout is a copy of.
            stderr: the fd its stderr is a copy of.
            imports_under: variables the program sets itself before its first import (the
                vLLM harness's ``OMP_NUM_THREADS=1``): compared in place of ``env``'s.

        Returns:
            The :class:`Child`; ``None`` where the server cannot run it as that interpreter
            would (another interpreter or not ``-m``, another import-time environment), or
            did not fork it (refused, :attr:`retired`): the caller starts it fresh.
        """
        wanted = import_env({**env, **(imports_under or {})})
        if (len(cmd) < 3 or cmd[0] != self.executable or cmd[1] != "-m"
                or wanted != self._env or RELATIVE_PATH in wanted
                or self.retired is not None):
            return None
        for fd in (stdin, stdout, stderr):
            os.fstat(fd)  # a bad fd is the caller's error (OSError), not the server's
        read_end, write_end = os.pipe()
        request = {"op": "spawn", "argv": list(cmd[2:]), "env": dict(env),
                   "cwd": str(Path(cwd or os.getcwd()).resolve())}
        reply: dict[str, Any] = {}
        try:
            with self._lock:
                if self.retired is None:
                    socket.send_fds(self._sock, [json.dumps(request).encode()],
                                    [stdin, stdout, stderr, write_end])
                    # past here an unread reply would answer the next request: any failure
                    # retires the server (close ends it, and with it a child it forked)
                    try:
                        reply = json.loads(self._sock.recv(_MAX_MESSAGE) or b"{}")
                    except BaseException:
                        self.retired = "fork server: no reply to a request"
                        raise
        except (OSError, ValueError):
            reply = {}
        finally:
            os.close(write_end)
        if isinstance(reply.get("pid"), int):
            return Child(reply["pid"], cmd, read_end)
        os.close(read_end)
        if not isinstance(reply.get("refused"), str) or reply.get("retire") is not False:
            self.retired = self.retired or str(reply.get("refused", "fork server gone"))
        return None

    def close(self, grace_s: float = 1.0) -> None:
        """End the server (its children get SIGTERM); reap it.

        Shuts the control socket down (a :meth:`spawn` waiting for a reply in another thread
        returns ``None``), closes it; the server exits at once unless it is still importing,
        and is killed after ``grace_s``. Safe to call more than once, from any thread; a
        :meth:`spawn` after it returns ``None``.
        """
        self.retired = self.retired or "fork server closed"
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with self._lock, contextlib.suppress(OSError):
            self._sock.close()
        try:
            self._proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def start(*, modules: Sequence[str] = BASE_IMPORTS,
          env: Mapping[str, str] | None = None) -> ForkServer:
    """Start a fork server that imports ``modules``.

    Args:
        modules: what it imports before it forks anything (:data:`BASE_IMPORTS` and
            :func:`model_modules`).
        env: its environment (default: this process's); children must match its
            import-time variables (:meth:`ForkServer.spawn`).

    Raises:
        OSError: the interpreter cannot be started.
    """
    from qualify import procs

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    e = dict(os.environ if env is None else env)
    cmd = [sys.executable, "-m", __name__, str(theirs.fileno()), *modules]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=e, pass_fds=(theirs.fileno(),),
                            start_new_session=True,
                            preexec_fn=procs.death_signal_hook())  # noqa: PLW1509
    theirs.close()
    return ForkServer(proc, ours, e)


_current: list[ForkServer] = []


def current() -> ForkServer | None:
    """The fork server of this run (:func:`serving`), or ``None``."""
    return _current[-1] if _current else None


@contextlib.contextmanager
def serving(server: ForkServer | None) -> Iterator[ForkServer | None]:
    """Make ``server`` :func:`current` inside the block; close it when the block ends."""
    if server is None:
        yield None
        return
    _current.append(server)
    try:
        yield server
    finally:
        _current.remove(server)
        server.close()


# --- the server process ---------------------------------------------------------------


def _set_name(name: str) -> None:
    """``prctl(PR_SET_NAME, name)`` (best effort: a name only)."""
    from qualify import libc

    prctl = libc.function("prctl")
    if prctl is not None:
        prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def _child_main(request: dict[str, Any], fds: list[int], close: Sequence[int],
                server: int) -> int:
    """The forked child: its session, fds, directory, environment, then ``python -m``.

    ``__main__`` is a new module the program's code runs in, as ``python -m`` makes it
    (:func:`runpy._run_module_as_main`), and the module itself is dropped from
    ``sys.modules`` and its package (the server may have imported it), so an
    ``import`` of it inside loads it again, as in a fresh interpreter; every other name of
    the server's ``__main__`` (``__mp_main__``) names the new one. Its file is noted for the
    imported-files record (:func:`qualify.candidate.imported.note`, as the warm launcher's
    ranks note their entry point). The ``atexit`` hooks the preloaded modules registered
    stay (they would have registered them here).

    Runs in the child :func:`qualify.candidate.warm.fork_child` forked (what it inherited
    frozen out of the garbage collector; the returned code its exit status). Ends as an
    interpreter does: ``SystemExit`` gives its code, an uncaught exception its
    traceback (``sys.excepthook``) and 1, ``KeyboardInterrupt`` death by SIGINT; then
    :func:`threading._shutdown` (``concurrent.futures``' exit hooks, the non-daemon threads)
    and the ``atexit`` hooks.
    """
    signal.set_wakeup_fd(-1)  # the server's wake-up pipe is not the child's
    os.setsid()
    warm.die_with_parent(server, signal.SIGTERM)
    _set_name(process_name(request["argv"][0]))
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stdin, stdout, stderr, status = fds
    os.close(status)
    for target, fd in ((0, stdin), (1, stdout), (2, stderr)):
        os.dup2(fd, target)
    with contextlib.suppress(OSError):  # first in its log, before anything it writes
        os.write(1, f"{FORKED_NOTE} (pid {os.getpid()} of fork server {server}; "
                    f"qualify.candidate.forkserver)\n".encode())
    for fd in {stdin, stdout, stderr, *close}:
        if fd > 2:
            with contextlib.suppress(OSError):
                os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    module, args = request["argv"][0], request["argv"][1:]
    sys.path[0] = request["cwd"]  # ``python -m``'s first entry: the working directory
    sys.modules.pop(module, None)  # its body runs once, as __main__
    parent, _, leaf = module.rpartition(".")
    if parent in sys.modules and hasattr(sys.modules[parent], leaf):
        delattr(sys.modules[parent], leaf)
    main, old = types.ModuleType("__main__"), sys.modules["__main__"]
    for name, mod in list(sys.modules.items()):  # "__main__", and "__mp_main__" torch made
        if mod is old:
            sys.modules[name] = main
    with contextlib.suppress(ImportError, ValueError):  # runpy reports a bad module
        from qualify.candidate import imported

        imported.note(getattr(importlib.util.find_spec(module), "origin", None))
    sys.argv = [module, *args]
    code = 0
    interrupted = False
    try:
        runpy._run_module_as_main(module, alter_argv=True)  # type: ignore[attr-defined]
    except SystemExit as exc:
        code = warm.exit_code(exc)
    except KeyboardInterrupt:
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    if interrupted:  # as the interpreter ends on an uncaught KeyboardInterrupt
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _serve(sock: socket.socket, refused: str | None) -> None:
    """Answer requests until qualify closes the socket; report each child's status.

    A reply is ``{"pid": N}``, or ``{"refused": WHY, "retire": BOOL}``: ``retire`` when
    the server forks nothing (``refused``, for every request), not for one request it could
    not serve (a bad request, a failed fork). A child's end wakes the loop at once
    (``SIGCHLD`` through :func:`signal.set_wakeup_fd`).
    """
    statuses: dict[int, int] = {}  # pid -> the write end of its status pipe
    server = os.getpid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        while statuses:  # reap whatever ended, and say how
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            fd = statuses.pop(pid, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.write(fd, f"{status}\n".encode())
                os.close(fd)
        ready, _, _ = select.select([sock.fileno(), wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 512)
        if sock.fileno() not in ready:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 4)
        if not msg:
            return
        try:
            request = json.loads(msg)
            why = refused or (None if len(fds) == 4 and request.get("op") == "spawn"
                              else "bad request")
            if why is None:  # the child never returns here (warm.fork_child)
                pid = warm.fork_child(functools.partial(
                    _child_main, request, fds,
                    [sock.fileno(), wake_r, wake_w, *statuses.values()], server))
        except Exception as exc:  # a failed fork (EAGAIN, ENOMEM): this launch starts fresh
            why = f"fork server: {type(exc).__name__}: {exc}"
        if why is not None:
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"refused": why, "retire": refused is not None}).encode())
            continue
        for fd in fds[:3]:
            os.close(fd)
        statuses[pid] = fds[3]
        sock.send(json.dumps({"pid": pid}).encode())


def main(argv: Sequence[str]) -> int:
    """``python -m qualify.candidate.forkserver FD MODULE ...``: import, then serve on FD."""
    sock = socket.socket(fileno=int(argv[0]))
    for name in argv[1:]:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the launcher imports it again and reports the error
            print(f"[forkserver] not imported: {name}: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
    safe, why = warm.fork_safe()
    torch = sys.modules.get("torch")
    if safe and torch is not None and torch.version.cuda is not None and any(
            Path("/dev").glob("nvidia[0-9]*")):
        safe, why = False, "a CUDA machine (its launches start fresh interpreters)"
    _serve(sock, None if safe else f"fork server cannot fork: {why}")
    return 0


if __name__ == "__main__":
    _code = main(sys.argv[1:])
    for _stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            _stream.flush()
    os._exit(_code)  # no interpreter teardown of torch's modules: a second of nothing

