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

A zygote serves one key (:func:`launch_key`): harness, preload modules, the whole launch
environment but :data:`VOLATILE` and a default :data:`INDUCTOR_CACHE_ENV` (what torch and
the engines read at import time must be what the ranks would have read) and the stat of
every source file of ``qualify`` and ``harnesses``, and of a plugin harness's package
outside them (:func:`sources_stamp`: an edit gets a new zygote). Which zygote serves a
launch, how many live and when they are started and stopped is
:mod:`qualify.candidate.zygote_pool`'s business: this process's own, or a session's pool.
A zygote ends when it is stopped (it drains: no new launch, those in flight finish), when
the process it serves is gone (checked every :data:`POLL_S`; it then ends its launches in
flight), or after an idle time (pool zygotes). Ending a launch: the client forwards
SIGTERM / SIGINT / SIGHUP / SIGQUIT to the launcher (which ends the ranks, torchrun's
rule); a client that dies (``kill -9`` on a timeout) closes its socket and the launcher
ends the ranks as on SIGTERM; a zygote that dies takes its launchers with it
(``PR_SET_PDEATHSIG``), and they their ranks. A client that finds no zygote (stopped,
draining) execs the plain warm launcher itself. The socket lives in a directory of mode
0700: only this user's processes reach it. The zygote reads every connection without
blocking (:class:`_Request`), so a client that sends nothing holds up no other; a bad
request (no fds, a body over :data:`MAX_REQUEST_BYTES`, not JSON, nothing whole within
:data:`REQUEST_TIMEOUT_S`) is refused with its fds closed while the zygote goes on
serving. ``QUALIFY_ZYGOTE=0`` turns zygotes off.

Importing this module imports neither torch nor any engine.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import os
import re
import select
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

from qualify.candidate import owner, warm

VOLATILE: Final = frozenset({"PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "_", "PWD", "OLDPWD",
                             "SHLVL", "PS1", "QUALIFY_IMPORTS_DIR"})
"""Variables left out of a zygote's key: pytest rewrites the first for every test phase, the
second differs per xdist worker, the shell sets the others per command and directory, the
launch sets the last per attempt (:mod:`qualify.candidate.imported`: read when a rank ends),
and nothing reads them at import time (the launch itself still gets the caller's values)."""
INDUCTOR_CACHE_ENV: Final = "TORCHINDUCTOR_CACHE_DIR"
"""Set by importing ``torch._inductor`` (to torch's default when unset; a value set is made
absolute): at torch's default it counts in no key (:func:`launch_key`), so a zygote started
before this process imported torch (:mod:`qualify.candidate.ahead`) serves the launches
after (its own imports set the same default; a launch still gets the caller's value)."""
INDUCTOR_DEFAULT_INPUTS: Final = ("TMPDIR", "TEMP", "TMP", "LOGNAME", "USER", "LNAME", "USERNAME")
"""What torch's default reads (``tempfile.gettempdir``, ``getpass.getuser``): the variable
leaves a launch's key only if the launch's environment has this process's values of these
(:func:`inductor_default` computes the default here)."""
POLL_S: Final = 0.05
"""The zygote's loop period: reaping launchers, accepting requests, checking its parent."""
START_TIMEOUT_S: Final = 300.0
"""The longest a zygote may take to import and say it is ready."""
MAX_REQUEST_BYTES: Final = 16 << 20
"""The largest request body (argv, environment, cwd as JSON) a zygote reads."""
REQUEST_TIMEOUT_S: Final = 10.0
"""The longest a zygote waits for one request's bytes."""
MAX_PENDING: Final = 64
"""Connections a zygote reads at once; one beyond is closed at once (its client runs the
plain warm launcher)."""
_HEADER: Final = struct.Struct("<Q")
_ENTRY: Final = 3
"""Index of the first warm-launcher argument in :func:`qualify.candidate.launch.launch_command`'s
warm command (``python -m qualify.candidate.warm ARGS``)."""


# --------------------------------------------------------------------------- the zygote


class _Request:
    """One client's request, read a piece at a time as its socket is readable.

    The zygote reads every connection without blocking, so a client that sends nothing (or
    half a request) holds up no other: it is refused once :data:`REQUEST_TIMEOUT_S` has
    passed. A whole request is ``header + body``: the body's length (``<Q``), then JSON
    ``{"argv": [...], "env": {...}, "cwd": "..."}``; the client's fds 0, 1, 2 come with
    its first bytes (``SCM_RIGHTS``).
    """

    def __init__(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        self.conn, self.data, self.fds = conn, bytearray(), list[int]()
        self.deadline = time.monotonic() + REQUEST_TIMEOUT_S
        self.first = True

    def feed(self) -> bool:
        """Read what has come; whether the request is whole.

        Raises:
            ValueError: not 3 fds with the first bytes, a body over
                :data:`MAX_REQUEST_BYTES`, the connection closed before the end.
            OSError: the socket failed.
        """
        try:
            if self.first:
                data, fds, _, _ = socket.recv_fds(self.conn, 1 << 16, 3)
                self.fds, self.first = list(fds), False
                if len(self.fds) != 3:
                    raise ValueError(f"request carried {len(self.fds)} fds, not 3")
            else:
                data = self.conn.recv(1 << 16)
        except BlockingIOError:
            return False
        if not data:
            raise ValueError("request cut short")
        self.data += data
        if len(self.data) < _HEADER.size:
            return False
        (size,) = _HEADER.unpack_from(self.data)
        if size > MAX_REQUEST_BYTES:
            raise ValueError(f"request body of {size} bytes (at most {MAX_REQUEST_BYTES})")
        return len(self.data) >= _HEADER.size + size

    def doc(self) -> dict[str, object]:
        """The whole request's body; the socket is blocking again (for the launcher).

        Raises:
            ValueError: not a JSON object with a list ``argv``, an object ``env`` and a
                string ``cwd``.
        """
        (size,) = _HEADER.unpack_from(self.data)
        doc = json.loads(bytes(self.data[_HEADER.size:_HEADER.size + size]))
        if not (isinstance(doc, dict) and isinstance(doc.get("argv"), list)
                and isinstance(doc.get("env"), dict) and isinstance(doc.get("cwd"), str)):
            raise ValueError("request is not {argv: list, env: object, cwd: string}")
        self.conn.setblocking(True)
        return doc

    def refuse(self, why: object) -> None:
        """Log ``why``; close the fds received and the connection (no pid: plain warm)."""
        print(f"zygote: bad request: {why}", file=sys.stderr, flush=True)
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        self.conn.close()


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


def _fork_launcher(doc: Mapping[str, object], req: _Request,
                   others: Sequence[socket.socket | selectors.BaseSelector], note: str) -> int:
    """Fork the launcher of one whole request; its pid (the request's fds closed here).

    The forwarded signals are blocked across the fork: one the client forwards before the
    launcher's handlers exist stays pending until :func:`qualify.candidate.warm.main`
    installs them and unblocks it.
    """
    fds, conn = req.fds, req.conn

    def body() -> int:
        for other in others:  # the zygote's selector, listener and other connections
            other.close()
        for sig in warm._FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        return _launcher_child(doc, fds, conn, os.getppid(), note)

    signal.pthread_sigmask(signal.SIG_BLOCK, warm._FORWARDED)
    try:
        pid = warm.fork_child(body)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, warm._FORWARDED)
    for fd in fds:
        os.close(fd)
    req.fds = []
    return pid


def _loaded_sources() -> dict[str, tuple[int, int]]:
    """(size, mtime in ns) of every loaded module's file outside stdlib and site-packages.

    The harness's own package, ``qualify`` in a checkout: what a zygote must never serve
    edited.
    """
    import sysconfig

    paths = sysconfig.get_paths()
    skip = tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "purelib", "platlib")})
    out = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or os.path.realpath(path).startswith(skip):
            continue
        with contextlib.suppress(OSError):
            st = os.stat(path)
            out[path] = (st.st_size, st.st_mtime_ns)
    return out


def _changed(sources: Mapping[str, tuple[int, int]]) -> list[str]:
    """The files of ``sources`` whose size or mtime is no longer the recorded one."""
    out = []
    for path, seen in sources.items():
        try:
            st = os.stat(path)
        except OSError:
            out.append(path)
            continue
        if (st.st_size, st.st_mtime_ns) != seen:
            out.append(path)
    return out


def serve(socket_path: Path, *, target: str, modules: Sequence[str], parent: int | None,
          idle_s: float | None = None, remove_dir: bool = False,
          inputs: Path | None = None, ahead: bool = False) -> int:
    """Run a zygote: import, say ``ready`` on stdout, then fork a launcher per request.

    Args:
        socket_path: the Unix socket to listen on (bound here, before the imports, so a
            path that does not fit fails at once).
        target: the harness entry point (``harnesses.torch_tp.harness``).
        modules: the engine's ``warm_imports``.
        parent: the process the zygote serves (its parent, or a pool's owner,
            :mod:`qualify.candidate.zygote_pool`); it exits when that process is gone.
            ``None``: no owner (a pool zygote ended by ``idle_s`` or a signal alone).
        idle_s: drain after this many seconds with no launch in flight (``None``: never).
        remove_dir: a pool zygote: it writes its pid to ``pid`` beside the socket first of
            all, and removes the socket's directory at the end.
        inputs: a run's ``inputs/`` directory: the model classes of its ``model.json`` are
            imported right after ``ready``, before the first request is read (best effort;
            a prestarted zygote's first launch then imports nothing,
            :func:`qualify.candidate.launch.prestart`).
        ahead: started ahead of its launches (by that prestart): each launcher's log says so.

    A stop signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT) makes it drain: it closes and removes
    its socket (a client that comes later runs the plain warm launcher) and exits when the
    launches in flight have ended. Its parent's end ends those launches (SIGTERM) at once.
    A source file it imported from outside site-packages that changed since (the harness's
    package) refuses the request and drains it: it never serves edited code.

    Returns:
        0 after a stop or its parent's end; 3 when it may not fork (the reason on stdout
        instead of ``ready``).
    """
    owner_alive = (lambda: True) if parent is None else owner.alive_check(parent)
    stop: list[int] = []
    for sig in warm._FORWARDED:
        signal.signal(sig, lambda signum, _f: stop.append(signum))
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if remove_dir:
        (socket_path.parent / "pid").write_text(f"{os.getpid()}\n")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(socket_path))
        listener.listen(MAX_PENDING)
        t0 = time.monotonic()
        with owner.exit_when_gone(None if parent is None else owner_alive,
                                  socket_path.parent, poll_s=POLL_S):
            notes = warm.preload(target, modules, None)
        imports_s = time.monotonic() - t0
        warm._Libc.load()
        safe, why = warm.fork_safe()
        if not safe:
            print(f"unsafe {why}", flush=True)
            return 3
        sel = selectors.DefaultSelector()  # epoll: no limit on fd numbers, unlike select()
        sel.register(listener, selectors.EVENT_READ)
        print("ready" + "".join(f"; not preloaded: {n}" for n in notes), flush=True)
        os.dup2(2, 1)  # later lines go to the zygote's log, not to the pipe nobody reads
        if inputs is not None:  # after 'ready': a request waits in the backlog meanwhile,
            try:  # and is refused (the zygote drains) if these imports started a thread
                warm.preload_models(inputs)
            except Exception as exc:  # best effort: the first request imports them again
                print(f"zygote: model classes of {inputs}: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)
        return _loop(sel, listener, socket_path, target=target, imports_s=imports_s, ahead=ahead,
                     owner_alive=owner_alive, stop=stop, idle_s=idle_s)
    except BrokenPipeError:  # its starter is gone before it was ready
        return 0
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            socket_path.unlink()
        if remove_dir or not owner_alive():  # nobody will clean up after it
            shutil.rmtree(socket_path.parent, ignore_errors=True)


def _loop(sel: selectors.BaseSelector, listener: socket.socket, socket_path: Path, *,
          target: str, imports_s: float, owner_alive: Callable[[], bool], stop: list[int],
          idle_s: float | None, ahead: bool = False) -> int:
    """:func:`serve`'s loop: read requests (none blocks another), fork, reap; 0 at its end."""
    sources = _loaded_sources()
    launchers: dict[int, socket.socket] = {}
    pending: dict[socket.socket, _Request] = {}

    def drop(req: _Request, why: object) -> None:
        if pending.pop(req.conn, None) is not None:
            sel.unregister(req.conn)
        req.refuse(why)

    served, listening, last_busy = 0, True, time.monotonic()
    while owner_alive() and (listening or launchers):
        if launchers or pending:
            last_busy = time.monotonic()
        elif idle_s is not None and time.monotonic() - last_busy > idle_s and not stop:
            stop.append(int(signal.SIGTERM))  # idle: drain (a later client starts afresh)
        if stop and listening:  # drain: no new launch, the ones in flight run to their end
            sel.unregister(listener)
            listener.close()
            with contextlib.suppress(OSError):
                socket_path.unlink()
            listening = False
            for req in list(pending.values()):
                drop(req, "the zygote drains")
        events = sel.select(POLL_S) if listening else []
        if not listening:
            time.sleep(POLL_S)
        for req in [r for r in pending.values() if time.monotonic() > r.deadline]:
            drop(req, f"no whole request within {REQUEST_TIMEOUT_S:g} s")
        for key, _ in events:
            ready = key.fileobj
            if ready is listener:
                conn, _ = listener.accept()
                if len(pending) >= MAX_PENDING:
                    print(f"zygote: bad request: over {MAX_PENDING} pending", file=sys.stderr,
                          flush=True)
                    conn.close()
                    continue
                pending[conn] = _Request(conn)
                sel.register(conn, selectors.EVENT_READ)
                continue
            req = pending.get(ready)  # type: ignore[call-overload]
            if req is None:
                continue
            try:
                if not req.feed():
                    continue
                pending.pop(req.conn)
                sel.unregister(req.conn)
                doc = req.doc()
                argv = [str(a) for a in doc["argv"]]
                cwd = Path(str(doc["cwd"]))
                cell = Path(argv[-1]) if argv else None
                if cell is not None and not cell.is_absolute():
                    cell = cwd / cell
                if changed := _changed(sources):
                    stop.append(int(signal.SIGTERM))
                    raise ValueError(f"{changed[0]} changed since the zygote imported it; "
                                     f"draining")
                warm.preload(target, (), cell)  # the model classes, kept for later cells
                sources = {**_loaded_sources(), **sources}
                safe, why = warm.fork_safe()
                if not safe:  # an import of this cell started a thread: no fork from here on
                    stop.append(int(signal.SIGTERM))
                    raise ValueError(f"may not fork any more ({why}); draining")
            except Exception as exc:  # one request's failure; the zygote goes on
                drop(req, exc)
                continue
            note = (f"{'started ahead of its launches; ' if ahead else ''}its imports "
                    f"{imports_s:.2f} s once; launch {served + 1} it serves")
            pid = _fork_launcher(doc, req, [sel, listener, *launchers.values(), *pending],
                                 note)
            served += 1
            launchers[pid] = req.conn
            with contextlib.suppress(OSError):
                req.conn.sendall(f"pid {pid}\n".encode())
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


# ------------------------------------------------------------------- starting one, its key


def spawn(target: str, modules: Sequence[str], env: Mapping[str, str], *, timeout_s: float,
          workdir: Path, serve_args: Sequence[str]) -> subprocess.Popen[bytes] | str:
    """Start ``serve`` with its socket ``workdir/s``; the process once it said ``ready``.

    Args:
        target: the warm launch's harness.
        modules: its preload modules.
        env: the zygote's environment (the launch's).
        timeout_s: the longest its imports may take.
        workdir: its directory (socket, ``zygote.log``; its working directory too).
        serve_args: more ``serve`` options (``--parent PID``, ``--idle-s S``).

    Returns:
        The running zygote; or why it cannot serve (``unsafe ...``: it may not fork; else
        it did not answer in time or exited), the process ended.
    """
    pre = [a for m in modules for a in ("--preload", m)]
    with (workdir / "zygote.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, "serve", "--socket", str(workdir / "s"),
             *serve_args, *pre, target], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=log, env=dict(env), start_new_session=True,
            cwd=workdir)  # sys.path[0]: a directory of its own, not the caller's cwd
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
        return proc
    proc.terminate()
    try:
        proc.wait(timeout=warm.KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    text = answer.decode(errors="replace").strip()
    return text or f"no answer within {timeout_s:g} s (exit {proc.returncode})"


def sources_stamp(target: str = "") -> tuple[tuple[str, int, int], ...]:
    """(path, size, mtime in ns) of every ``.py`` file of qualify, harnesses and the SDK.

    The SDK is ``sdk/qualify_harness``, which every built-in engine harness runs on.

    Under :func:`qualify.resources.repo_root`; and, when ``target`` (the harness,
    ``module`` or ``module:attr``) is a package outside it (a plugin engine's
    distribution, installed or editable), every ``.py`` file of that top-level package
    (found with :func:`importlib.util.find_spec`, never imported), by absolute path. Part
    of a zygote's key, so that a zygote never serves code edited after its imports.
    """
    from qualify.resources import repo_root

    root = repo_root()
    out = []
    for package in ("qualify", "harnesses", "sdk/qualify_harness"):
        for path in sorted((root / package).rglob("*.py")):
            with contextlib.suppress(OSError):
                st = path.stat()
                out.append((str(path.relative_to(root)), st.st_size, st.st_mtime_ns))
    for path in _plugin_files(target, root):
        with contextlib.suppress(OSError):
            st = path.stat()
            out.append((str(path), st.st_size, st.st_mtime_ns))
    return tuple(out)


def _plugin_files(target: str, root: Path) -> list[Path]:
    """The ``.py`` files of ``target``'s top-level package when it lies outside ``root``."""
    import importlib.util

    top = target.split(":", 1)[0].split(".", 1)[0]
    if not top:
        return []
    spec = None
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec(top)
    if spec is None:
        return []
    base = os.path.realpath(root) + os.sep
    dirs = [Path(d) for d in spec.submodule_search_locations or ()]
    files = [Path(spec.origin)] if spec.origin and not dirs else []
    if any(os.path.realpath(p).startswith(base) for p in (*dirs, *files)):
        return []  # a package of the checkout: covered above, or not code of an engine
    return sorted({*files, *(p for d in dirs for p in d.rglob("*.py"))})


def launch_key(warm_cmd: Sequence[str], env: Mapping[str, str]) -> tuple[object, ...] | None:
    """The key of the zygote that may serve ``warm_cmd``; ``None`` if none may.

    (python, harness, preload modules, the environment but :data:`VOLATILE` and a default
    :data:`INDUCTOR_CACHE_ENV`, :func:`sources_stamp` of the harness: qualify's, the
    harnesses' and a plugin harness's own files); ``None`` when zygotes are off
    (``QUALIFY_ZYGOTE=0``) or ``warm_cmd`` is not a warm launch.
    """
    cmd = list(warm_cmd)
    if env.get("QUALIFY_ZYGOTE", "1") == "0" or cmd[1:_ENTRY] != ["-m", warm.__name__]:
        return None
    target, preload = launch_target(cmd)
    keyed = {k: v for k, v in env.items() if k not in VOLATILE}
    if (INDUCTOR_CACHE_ENV in keyed and keyed[INDUCTOR_CACHE_ENV] == inductor_default()
            and all(env.get(k) == os.environ.get(k) for k in INDUCTOR_DEFAULT_INPUTS)):
        del keyed[INDUCTOR_CACHE_ENV]
    return (cmd[0], target, tuple(preload), tuple(sorted(keyed.items())),
            sources_stamp(target))


def inductor_default() -> str:
    """Torch's default ``TORCHINDUCTOR_CACHE_DIR``, computed as torch computes it.

    ``torch/_inductor/runtime/cache_dir_utils.py`` ``default_cache_dir`` (outside fbcode),
    made absolute as its ``cache_dir`` does, without importing torch: the key of a zygote
    started before this process imported ``torch._inductor`` must equal the key after.
    ``tests/test_ahead.py`` checks it against torch's own function.
    """
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    return os.path.abspath(os.path.join(tempfile.gettempdir(), "torchinductor_" + user))


def launch_target(warm_cmd: Sequence[str]) -> tuple[str, list[str]]:
    """(harness target, preload modules) of a warm command."""
    args = warm.parse_args(list(warm_cmd)[_ENTRY:])
    return args.target, list(args.preload)


def run_command(warm_cmd: Sequence[str], socket_path: Path) -> list[str]:
    """The client command that hands the warm launch ``warm_cmd`` to a zygote's socket."""
    cmd = list(warm_cmd)
    return [cmd[0], "-m", __name__, "run", "--socket", str(socket_path), "--", *cmd[_ENTRY:]]


def main(argv: Sequence[str] | None = None) -> int:
    """``serve`` or ``run`` (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m qualify.candidate.zygote")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--socket", type=Path, required=True)
    s.add_argument("--parent", type=int, default=None)
    s.add_argument("--idle-s", type=float, default=None)
    s.add_argument("--remove-dir", action="store_true")
    s.add_argument("--preload", action="append", default=[])
    s.add_argument("--inputs", type=Path, default=None)
    s.add_argument("--ahead", action="store_true")
    s.add_argument("target")
    r = sub.add_parser("run")
    r.add_argument("--socket", type=Path, required=True)
    r.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args.socket, target=args.target, modules=args.preload,
                     parent=args.parent, idle_s=args.idle_s, remove_dir=args.remove_dir,
                     inputs=args.inputs, ahead=args.ahead)
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    return run_client(args.socket, rest)


if __name__ == "__main__":
    _code = main()
    for _stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            _stream.flush()
    os._exit(_code)
