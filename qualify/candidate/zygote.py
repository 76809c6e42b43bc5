"""One warm interpreter serves every launch of the same harness: import once per process (#17).

The warm launcher (:mod:`qualify.candidate.warm`) imports a harness, its engine and the
transformers model classes once per launch, then forks the ranks. A process that launches
the same harness many times (the test suite: 66 warm launches, 399 s of launcher imports in
one run; a contract with resume cells: the save and load launches of each engine) repeated
those imports every time. A *zygote* does them once: ``python -m qualify.candidate.zygote
serve`` imports what the warm launcher would (:func:`qualify.candidate.warm.preload`), checks
that it may fork (:func:`~qualify.candidate.warm.fork_safe`) and then waits on a Unix socket.
Each launch is then ``python -m qualify.candidate.zygote run --socket S -- WARM_ARGS``, a
client that imports neither torch nor any engine: it hands the zygote its arguments, its
environment, its working directory and its stdin / stdout / stderr (``SCM_RIGHTS``); the
zygote imports the cell's model classes (cached after the first cell) and forks a child
that *is* the warm launcher (:func:`qualify.candidate.warm.main`, in a session of its own,
with the client's fds, environment and directory): it forks the ranks, hosts their store
and supervises them exactly as a launcher started afresh would.

Independence is kept as by the warm launcher: the zygote computes nothing (it only imports,
and forks), so each launch starts from the frozen inputs with fresh model, optimizer and RNG
state; nothing a launch does reaches the zygote or a later launch (each is a forked copy of
the zygote as it was after its imports). ``tests/test_grouped_launch.py`` finds every tensor
of a launch from a zygote that already served another cell bitwise equal to a torchrun
launch of the same cell.

A zygote serves one key: harness, preload modules and the whole launch environment but
:data:`VOLATILE` (what torch and the engines read at import time must be what the ranks
would have read), so a launch with another environment gets another zygote.
:func:`client_command` keeps at most :data:`MAX_LIVE` per process; beyond that the least
recently used drains (it takes no new launch and exits when those in flight have ended). A
zygote ends when it is stopped, when its parent process is gone (checked every
:data:`POLL_S`), or at the parent's exit (``atexit``). Ending: the client forwards SIGTERM /
SIGINT / SIGHUP / SIGQUIT to the launcher (which ends the ranks, torchrun's rule); a client
that dies (``kill -9`` on a timeout) closes its socket and the launcher ends the ranks as on
SIGTERM; a zygote that dies takes its launchers with it (``PR_SET_PDEATHSIG``), and they
their ranks. A zygote that cannot start or may not fork (threads after its imports, CUDA) is
remembered, and those launches use the plain warm launcher; a client that finds no zygote
(stopped, draining) execs the plain warm launcher itself. The socket lives in a directory of
mode 0700 (:func:`tempfile.mkdtemp`): only this user's processes reach it, and a bad
request (no fds, a body over :data:`MAX_REQUEST_BYTES`, not JSON) is refused with its fds
closed while the zygote goes on serving. ``QUALIFY_ZYGOTE=0`` turns
zygotes off.

Importing this module imports neither torch nor any engine.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

from qualify.candidate import warm

MAX_LIVE: Final = 4
"""Zygotes kept per process (each holds an imported torch, transformers and engine: about
0.3-0.5 GB resident)."""
VOLATILE: Final = frozenset({"PYTEST_CURRENT_TEST"})
"""Variables left out of a zygote's key: pytest rewrites this one for every test phase and
nothing reads it at import time (the launch itself still gets the caller's value)."""
POLL_S: Final = 0.05
"""The zygote's loop period: reaping launchers, accepting requests, checking its parent."""
START_TIMEOUT_S: Final = 300.0
"""The longest a zygote may take to import and say it is ready."""
MAX_REQUEST_BYTES: Final = 16 << 20
"""The largest request body (argv, environment, cwd as JSON) a zygote reads."""
REQUEST_TIMEOUT_S: Final = 10.0
"""The longest a zygote waits for one request's bytes."""
_HEADER: Final = struct.Struct("<Q")
_ENTRY: Final = 3
"""Index of the first warm-launcher argument in :func:`qualify.candidate.launch.launch_command`'s
warm command (``python -m qualify.candidate.warm ARGS``)."""


# --------------------------------------------------------------------------- the zygote


def _read_request(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    """A client's request: (``{"argv", "env", "cwd"}``, its fds 0, 1, 2).

    Raises:
        ValueError: not 3 fds, a short or oversized body, not a JSON object with a list
            ``argv``, an object ``env`` and a string ``cwd`` (the fds received are closed).
        OSError: the socket failed or timed out (:data:`REQUEST_TIMEOUT_S`; fds closed).
    """
    conn.settimeout(REQUEST_TIMEOUT_S)
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    try:
        if len(fds) != 3:
            raise ValueError(f"request carried {len(fds)} fds, not 3")
        if len(data) < _HEADER.size:
            raise ValueError("short request")
        (size,) = _HEADER.unpack_from(data)
        if size > MAX_REQUEST_BYTES:
            raise ValueError(f"request body of {size} bytes (at most {MAX_REQUEST_BYTES})")
        body = bytearray(data[_HEADER.size:])
        while len(body) < size:
            more = conn.recv(size - len(body))
            if not more:
                raise ValueError("request cut short")
            body += more
        doc = json.loads(bytes(body))
        if not (isinstance(doc, dict) and isinstance(doc.get("argv"), list)
                and isinstance(doc.get("env"), dict) and isinstance(doc.get("cwd"), str)):
            raise ValueError("request is not {argv: list, env: object, cwd: string}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return doc, list(fds)


def _launcher_child(doc: Mapping[str, object], fds: Sequence[int], conn: socket.socket,
                    zygote: int, note: str) -> int:
    """The body of a forked launcher.

    The client's fds, environment and directory, then :func:`qualify.candidate.warm.main`
    watching the client's socket.
    """
    os.setsid()
    warm._Libc.die_with(zygote)  # PR_SET_PDEATHSIG SIGKILL: a dead zygote ends its launchers
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    argv = [str(a) for a in doc["argv"]]  # type: ignore[attr-defined]
    env = {str(k): str(v) for k, v in doc["env"].items()}  # type: ignore[attr-defined]
    os.chdir(str(doc["cwd"]))
    sys.path[0] = os.getcwd()  # as for ``python -m qualify.candidate.warm`` run there
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["qualify.candidate.warm", *argv]
    print(f"{warm.PREFIX} from zygote {zygote} ({note})", flush=True)
    return warm.main(argv, watch=conn)


def serve(socket_path: Path, *, target: str, modules: Sequence[str], parent: int) -> int:
    """Run a zygote: import, say ``ready`` on stdout, then fork a launcher per request.

    Args:
        socket_path: the Unix socket to listen on (made here).
        target: the harness entry point (``harnesses.torch_tp.harness``).
        modules: the engine's ``warm_imports``.
        parent: the process the zygote serves; it exits when that process is gone.

    A stop signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT) makes it drain: it closes and removes
    its socket (a client that comes later runs the plain warm launcher) and exits when the
    launches in flight have ended. Its parent's end ends those launches (SIGTERM) at once.

    Returns:
        0 after a stop or its parent's end; 3 when it may not fork (the reason on stdout
        instead of ``ready``).
    """
    stop: list[int] = []
    for sig in warm._FORWARDED:
        signal.signal(sig, lambda signum, _f: stop.append(signum))
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    t0 = time.monotonic()
    notes = warm.preload(target, modules, None)
    imports_s = time.monotonic() - t0
    warm._Libc.load()
    safe, why = warm.fork_safe()
    if not safe:
        print(f"unsafe {why}", flush=True)
        return 3
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path))
    listener.listen(16)
    print("ready" + "".join(f"; not preloaded: {n}" for n in notes), flush=True)
    os.dup2(2, 1)  # later lines go to the zygote's log, not to the pipe nobody reads
    launchers: dict[int, socket.socket] = {}
    served, listening = 0, True
    while os.getppid() == parent and (listening or launchers):
        if stop and listening:  # drain: no new launch, the ones in flight run to their end
            listener.close()
            with contextlib.suppress(OSError):
                socket_path.unlink()
            listening = False
        readable = select.select([listener], [], [], POLL_S)[0] if listening else []
        if not listening:
            time.sleep(POLL_S)
        if readable:
            conn, _ = listener.accept()
            fds: list[int] = []
            try:
                doc, fds = _read_request(conn)
                argv = [str(a) for a in doc["argv"]]  # type: ignore[attr-defined]
                cwd = Path(str(doc["cwd"]))
                cell = Path(argv[-1]) if argv else None
                if cell is not None and not cell.is_absolute():
                    cell = cwd / cell
                warm.preload(target, (), cell)  # the model classes, kept for later cells
                safe, why = warm.fork_safe()
                if not safe:  # an import of this cell started a thread: no fork from here on
                    stop.append(int(signal.SIGTERM))
                    raise ValueError(f"may not fork any more ({why}); draining")
            except Exception as exc:  # one request's failure; the zygote goes on
                print(f"zygote: bad request: {exc}", file=sys.stderr, flush=True)
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                conn.close()
                continue
            note = f"its imports {imports_s:.2f} s once; launch {served + 1} it serves"

            def body(doc: Mapping[str, object] = doc, fds: Sequence[int] = fds,
                     conn: socket.socket = conn, note: str = note) -> int:
                listener.close()
                for other in launchers.values():
                    other.close()
                for sig in warm._FORWARDED:
                    signal.signal(sig, signal.SIG_DFL)
                return _launcher_child(doc, fds, conn, os.getppid(), note)

            # blocked across the fork: a signal the client forwards before the launcher's
            # handlers exist stays pending until warm.main installs them and unblocks
            signal.pthread_sigmask(signal.SIG_BLOCK, warm._FORWARDED)
            try:
                pid = warm.fork_child(body)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, warm._FORWARDED)
            for fd in fds:
                os.close(fd)
            served += 1
            launchers[pid] = conn
            with contextlib.suppress(OSError):
                conn.sendall(f"pid {pid}\n".encode())
        for pid in list(launchers):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                continue
            conn = launchers.pop(pid)
            with contextlib.suppress(OSError):
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()
    for pid in launchers:  # the parent is gone with launches in flight: end them
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    if listening:
        listener.close()
        with contextlib.suppress(OSError):
            socket_path.unlink()
    if os.getppid() != parent:  # nobody will clean up after it: its directory goes too
        shutil.rmtree(socket_path.parent, ignore_errors=True)
    return 0


# --------------------------------------------------------------------------- the client


def run_client(socket_path: Path, argv: Sequence[str]) -> int:
    """Hand one launch to the zygote at ``socket_path``; the launcher's exit code.

    Forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to the launcher. When the zygote cannot be
    reached or starts no launcher (stopped, draining), the client becomes the plain warm
    launcher (``exec``) with the same arguments; 1 (with a line on stderr) when the zygote
    ends a started launch without an exit status.
    """
    received: list[int] = []
    launcher: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        for pid in launcher:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for sig in warm._FORWARDED:
        signal.signal(sig, on_signal)
    body = json.dumps({"argv": list(argv), "env": dict(os.environ),
                       "cwd": os.getcwd()}).encode()
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(socket_path))
        socket.send_fds(sock, [_HEADER.pack(len(body)) + body], [0, 1, 2])
        lines = sock.makefile("r", encoding="utf-8")
        first = lines.readline().split()
        if len(first) != 2 or first[0] != "pid":
            raise OSError("it started no launcher")
    except OSError as exc:  # nothing started: the plain warm launcher runs the launch
        if received:
            return 128 + received[0]
        print(f"{warm.PREFIX} zygote {socket_path}: {exc}; the plain warm launcher runs it",
              flush=True)
        os.execv(sys.executable, [sys.executable, "-m", warm.__name__, *argv])
    launcher.append(int(first[1]))
    for signum in received:  # a signal that came before the launcher's pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(launcher[0], signum)
    try:
        last = lines.readline().split()
    except OSError as exc:
        print(f"{warm.PREFIX} zygote {socket_path}: {exc}", file=sys.stderr, flush=True)
        return 128 + received[0] if received else 1
    if len(last) != 2 or last[0] != "exit":
        print(f"{warm.PREFIX} zygote {socket_path} ended launcher {launcher[0]} without an "
              f"exit status", file=sys.stderr, flush=True)
        return 128 + received[0] if received else 1
    code = int(last[1])
    return 128 - code if code < 0 else code


# --------------------------------------------------------------------------- the registry


class Zygote:
    """A running zygote of this process (:func:`client_command` starts and stops them).

    Args:
        proc: the ``serve`` process.
        socket_path: its socket.
        workdir: the temporary directory holding the socket and ``zygote.log``.
    """

    def __init__(self, proc: subprocess.Popen[bytes], socket_path: Path,
                 workdir: tempfile.TemporaryDirectory[str]) -> None:
        self.proc, self.socket_path, self.workdir = proc, socket_path, workdir

    def alive(self) -> bool:
        """Whether the zygote still runs."""
        return self.proc.poll() is None

    def drain(self) -> None:
        """SIGTERM: the zygote takes no new launch and exits after those in flight."""
        if self.proc.poll() is None:
            self.proc.terminate()

    def stop(self, grace_s: float = warm.KILL_GRACE_S) -> None:
        """Drain, wait up to ``grace_s``, then SIGKILL; the socket directory removed.

        A SIGKILLed zygote's launchers die with it (``PR_SET_PDEATHSIG``), and their ranks.
        """
        self.drain()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.workdir.cleanup()


_LOCK = threading.Lock()
_LIVE: collections.OrderedDict[tuple[object, ...], Zygote] = collections.OrderedDict()
_REFUSED: dict[tuple[object, ...], str] = {}
_DRAINING: list[Zygote] = []
"""Zygotes evicted from :data:`_LIVE` that may still serve launches in flight."""


def _start(target: str, modules: Sequence[str], env: Mapping[str, str],
           timeout_s: float) -> Zygote | str:
    """Start a zygote; it, or why it could not serve."""
    workdir = tempfile.TemporaryDirectory(prefix="qualify-zygote-")
    sock = Path(workdir.name) / "s"
    pre = [a for m in modules for a in ("--preload", m)]
    with (Path(workdir.name) / "zygote.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, "serve", "--socket", str(sock), "--parent",
             str(os.getpid()), *pre, target], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=log, env=dict(env), start_new_session=True,
            cwd=workdir.name)  # sys.path[0]: an empty directory, not the caller's cwd
    zygote = Zygote(proc, sock, workdir)
    assert proc.stdout is not None
    out, answer = b"", b""
    deadline = time.monotonic() + timeout_s
    while not answer and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            out += chunk
            # what an import printed comes first; the answer is a line of its own
            answer = next((ln for ln in out.split(b"\n")[:-1]
                           if ln.startswith((b"ready", b"unsafe "))), b"")
    proc.stdout.close()
    if answer.startswith(b"ready"):
        return zygote
    zygote.stop()
    text = answer.decode(errors="replace").strip()
    return text or f"no answer within {timeout_s:g} s (exit {proc.returncode})"


def client_command(warm_cmd: Sequence[str], env: Mapping[str, str],
                   timeout_s: float = START_TIMEOUT_S) -> list[str]:
    """The command that runs the warm launch ``warm_cmd`` through this process's zygote.

    Starts the zygote of the launch's key (harness, preload modules, environment) when
    none runs; beyond :data:`MAX_LIVE` the least recently used drains (its launches in
    flight finish). Returns
    ``warm_cmd`` itself when zygotes are off (``QUALIFY_ZYGOTE=0``), when ``warm_cmd`` is
    not a warm launch, or when the key's zygote could not start or may not fork.

    Args:
        warm_cmd: :func:`qualify.candidate.launch.launch_command`'s warm command.
        env: the whole launch environment (:func:`qualify.candidate.launch.launch_env`).
        timeout_s: the longest to wait for a new zygote's imports.
    """
    cmd = list(warm_cmd)
    if env.get("QUALIFY_ZYGOTE", "1") == "0" or cmd[1:_ENTRY] != ["-m", warm.__name__]:
        return cmd
    args = warm.parse_args(cmd[_ENTRY:])
    key: tuple[object, ...] = (cmd[0], args.target, tuple(args.preload),
                               tuple(sorted((k, v) for k, v in env.items()
                                            if k not in VOLATILE)))
    with _LOCK:
        if key in _REFUSED:
            return cmd
        zygote = _LIVE.get(key)
        if zygote is not None and not zygote.alive():
            del _LIVE[key]
            zygote.stop()
            zygote = None
        if zygote is None:
            started = _start(args.target, args.preload, env, timeout_s)
            if isinstance(started, str):
                _REFUSED[key] = started
                return cmd
            zygote = _LIVE[key] = started
            while len(_LIVE) > MAX_LIVE:  # the least recently used drains: launches in
                _, old = _LIVE.popitem(last=False)  # flight finish, later ones start plain
                old.drain()
                _DRAINING.append(old)
        for done in [z for z in _DRAINING if not z.alive()]:
            _DRAINING.remove(done)
            done.stop()
        _LIVE.move_to_end(key)
        return [cmd[0], "-m", __name__, "run", "--socket", str(zygote.socket_path), "--",
                *cmd[_ENTRY:]]


@atexit.register
def stop_all() -> None:
    """Stop every zygote of this process (also at its exit)."""
    with _LOCK:
        every = [*_LIVE.values(), *_DRAINING]
        _LIVE.clear()
        _DRAINING.clear()
        for zygote in every:
            zygote.drain()
        for zygote in every:
            zygote.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """``serve`` or ``run`` (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m qualify.candidate.zygote")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--socket", type=Path, required=True)
    s.add_argument("--parent", type=int, required=True)
    s.add_argument("--preload", action="append", default=[])
    s.add_argument("target")
    r = sub.add_parser("run")
    r.add_argument("--socket", type=Path, required=True)
    r.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args.socket, target=args.target, modules=args.preload,
                     parent=args.parent)
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    return run_client(args.socket, rest)


if __name__ == "__main__":
    _code = main()
    for _stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            _stream.flush()
    os._exit(_code)
