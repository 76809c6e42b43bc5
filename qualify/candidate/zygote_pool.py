"""Zygotes shared by every process of a session: ``QUALIFY_ZYGOTE_DIR`` (#17).

A zygote (:mod:`qualify.candidate.zygote`) saves the warm launcher's imports for the
launches of *one process*. A session that runs many ``qualify`` processes (a CI job running
several contracts one after the other, a sweep, the test suite: 127 of its 168 zygote
launches were the first of their process) paid those imports once per process. With
``QUALIFY_ZYGOTE_DIR=DIR`` set, the zygotes live in ``DIR`` and serve every process whose
launch has the same key (:func:`qualify.candidate.zygote.launch_key`): the first launch of
a key starts one there, later launches of any process are its clients.

Layout of ``DIR`` (mode 0700, this user's: only this user's processes reach the sockets):

- ``KEY.lock``: held (``flock``) while a zygote of the key is found or started, so two
  processes never start the same key twice; a start of one key does not wait for another;
- ``KEY-XXXX/``: one zygote: its socket ``s``, its pid ``pid``, ``zygote.log``, and
  ``used``, touched by every launch it is handed (the least recently used drains first);
- ``KEY.refused``: why a zygote of the key may not fork (threads after its imports); those
  launches use the plain warm launcher. A start that failed otherwise (timed out, exited)
  is not remembered: the next launch of the key tries again.

A pool zygote ends on its own: after ``QUALIFY_ZYGOTE_IDLE_S`` (default
:data:`DEFAULT_IDLE_S`) with no launch in flight, when the process named by
``QUALIFY_ZYGOTE_OWNER`` is gone (it then ends its launches in flight), or on SIGTERM
(:func:`stop_pool`; it drains); it removes its own directory. At most :data:`MAX_POOL` live
at once; a start beyond that drains the least recently used (launches in flight finish).
Slurm jobs (``SLURM_JOB_ID`` set) keep zygotes of their own process: a launch inside a job
stays in the job's processes.

What a pool zygote serves is the code it imported: the key holds the stat (size, mtime) of
every ``.py`` file of ``qualify`` and ``harnesses``
(:func:`qualify.candidate.zygote.sources_stamp`), so an edit there starts a new one; other
installed packages are not stamped (stop the pool after upgrading them). Each launch is
still a fresh fork of the zygote as it was after its imports; nothing one launch does
reaches another.

Importing this module imports neither torch nor any engine.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Final

from qualify.candidate import warm, zygote
from qualify.errors import UsageError

__all__ = ["DEFAULT_IDLE_S", "MAX_LIVE", "MAX_POOL", "Zygote", "check_pool_env", "client_command",
           "is_pool_zygote", "live", "own_command", "pool_of", "stop_all", "stop_pool"]

POOL_ENV: Final = "QUALIFY_ZYGOTE_DIR"
OWNER_ENV: Final = "QUALIFY_ZYGOTE_OWNER"
IDLE_ENV: Final = "QUALIFY_ZYGOTE_IDLE_S"
DEFAULT_IDLE_S: Final = 120.0
"""Seconds a pool zygote with no launch in flight waits for the next one."""
MAX_POOL: Final = 8
"""Zygotes live at once in one pool (about 0.3-0.5 GB resident each)."""
_LOCK_POLL_S: Final = 0.05
MAX_POOL_PATH: Final = 79
"""The longest pool directory (bytes): a zygote's socket ``DIR/KEY-XXXXXXXX/s`` (28 bytes
more) must fit the 107 bytes of a Unix socket's path (``sun_path`` less its NUL)."""
MAX_LIVE: Final = 4
"""Zygotes kept per process without a pool (each holds an imported torch, transformers and
engine: about 0.3-0.5 GB resident)."""

_STARTED: list[subprocess.Popen[bytes]] = []
"""Pool zygotes this process started (polled, so that one that ended is reaped)."""
_STARTED_LOCK = threading.Lock()


def check_pool_env(env: Mapping[str, str]) -> None:
    """Check the pool settings of ``env`` (the candidate stage calls this before it writes).

    ``QUALIFY_ZYGOTE_DIR`` (when set) must be an absolute path of at most
    :data:`MAX_POOL_PATH` bytes, not a symbolic link; when it exists, a directory of this
    user that no other user may enter (mode ``0700`` or stricter), else one this user may
    make (its nearest existing parent a writable directory); ``QUALIFY_ZYGOTE_OWNER`` a
    running process; ``QUALIFY_ZYGOTE_IDLE_S`` a positive number.

    Raises:
        UsageError: one of them is not (the variable and value named).
    """
    raw = env.get(POOL_ENV, "")
    if raw:
        path = Path(raw)
        if not path.is_absolute():
            raise UsageError(f"{POOL_ENV}={raw!r}: must be an absolute path")
        if len(os.fsencode(raw)) > MAX_POOL_PATH:
            raise UsageError(f"{POOL_ENV}={raw!r}: longer than {MAX_POOL_PATH} bytes (its "
                             f"sockets' paths would not fit a Unix socket's 107)")
        if path.is_symlink():
            raise UsageError(f"{POOL_ENV}={raw!r}: is a symbolic link (name the directory "
                             f"itself)")
        if path.exists():
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode):
                raise UsageError(f"{POOL_ENV}={raw!r}: not a directory")
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise UsageError(f"{POOL_ENV}={raw!r}: must be this user's directory with "
                                 f"mode 0700 (it is {stat.filemode(st.st_mode)}, uid "
                                 f"{st.st_uid})")
        else:
            parent = next(p for p in path.parents if p.exists())
            if not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
                raise UsageError(f"{POOL_ENV}={raw!r}: cannot be made ({parent} is not a "
                                 f"directory this user may write)")
    owner = env.get(OWNER_ENV, "")
    if owner and not (owner.isdigit() and int(owner) > 0):
        raise UsageError(f"{OWNER_ENV}={owner!r}: must be a process id")
    if owner and not _running(int(owner)):
        raise UsageError(f"{OWNER_ENV}={owner!r}: no such process")
    idle = env.get(IDLE_ENV, "")
    if idle:
        try:
            ok = float(idle) > 0
        except ValueError:
            ok = False
        if not ok:
            raise UsageError(f"{IDLE_ENV}={idle!r}: must be a positive number of seconds")


def pool_of(env: Mapping[str, str]) -> Path | None:
    """The pool directory a launch with environment ``env`` uses, if any.

    ``None``: zygotes of this process (unset, inside a Slurm job, or settings
    :func:`check_pool_env` refuses).
    """
    if not env.get(POOL_ENV) or env.get("SLURM_JOB_ID"):
        return None
    try:
        check_pool_env(env)
    except UsageError:
        return None
    return Path(env[POOL_ENV])


@contextlib.contextmanager
def _flock(path: Path, deadline: float) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path`` (made 0600).

    Yields ``False`` when another holder kept it past ``deadline`` (monotonic). Threads of
    one process exclude each other too (each opens its own file description).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(_LOCK_POLL_S)
        yield True
    finally:
        os.close(fd)  # releases the lock


def _digest(key: tuple[object, ...]) -> str:
    return hashlib.sha256(json.dumps(key, default=str).encode()).hexdigest()[:16]


def _pid(instance: Path) -> int | None:
    """The pid of the zygote of ``instance`` while it runs, else ``None``.

    It runs while that process is ``serve`` on the instance's socket (its command line says
    so: a reused pid does not; a forked launcher has the command line but not the pid).
    """
    try:
        pid = int((instance / "pid").read_text())
    except (OSError, ValueError):
        return None
    argv = _cmdline(pid)
    serving = _is_serve(argv) and _socket_of(argv) == str(instance / "s")
    return pid if serving and _running(pid) else None


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [os.fsdecode(a) for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return []


def _is_serve(argv: Sequence[str]) -> bool:
    return list(argv[1:4]) == ["-m", zygote.__name__, "serve"]


def _socket_of(argv: Sequence[str]) -> str | None:
    return argv[argv.index("--socket") + 1] if "--socket" in argv[:-1] else None


def live(pool: Path, digest: str = "") -> list[Path]:
    """The zygote directories of ``pool`` (of one key digest, or all) that serve.

    Their socket is there and their process runs. A draining zygote has removed its
    socket; one killed with SIGKILL left both, but its pid runs no zygote of that socket.
    """
    return [d for d in sorted(pool.glob(f"{digest}*-*"))
            if (d / "s").exists() and _pid(d) is not None]


def _reap() -> None:
    with _STARTED_LOCK:
        for proc in [p for p in _STARTED if p.poll() is not None]:
            _STARTED.remove(proc)


def _evict(pool: Path, keep: Path) -> None:
    """Drain the least recently used zygotes of ``pool`` beyond :data:`MAX_POOL` (not ``keep``)."""
    with _flock(pool / ".pool.lock", time.monotonic() + 10) as got:
        if not got:
            return
        others = [d for d in live(pool) if d != keep]
        excess = len(others) + 1 - MAX_POOL
        if excess <= 0:
            return
        by_use = sorted(others, key=lambda d: _mtime(d / "used"))
        for instance in by_use[:excess]:
            pid = _pid(instance)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGTERM)  # drains: its launches in flight finish


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def client_command(warm_cmd: Sequence[str], env: Mapping[str, str],
                   timeout_s: float = zygote.START_TIMEOUT_S, *,
                   inputs: Path | None = None, ahead: bool = False) -> list[str]:
    """The command that runs the warm launch ``warm_cmd`` through a zygote.

    The pool's zygote of its key when ``env`` names a pool (:func:`pool_of`), else this
    process's (:func:`own_command`).

    Returns ``warm_cmd`` itself when zygotes are off (``QUALIFY_ZYGOTE=0``), when it is not a
    warm launch, when the key's zygote may not fork (``KEY.refused``) or could not start, or
    when another process kept the key's start lock past ``timeout_s``.

    Args:
        warm_cmd: :func:`qualify.candidate.launch.launch_command`'s warm command.
        env: the whole launch environment (:func:`qualify.candidate.launch.launch_env`).
        timeout_s: the longest to wait for the key's zygote (its lock and its imports).
        inputs: a run's ``inputs/``: a zygote started now also imports its model classes
            (``serve --inputs``; not part of the key).
        ahead: a zygote started now is started ahead of its launches
            (:func:`qualify.candidate.launch.prestart`; ``serve --ahead``: its launchers' logs
            say so).
    """
    pool = pool_of(env)
    if pool is None:
        return own_command(warm_cmd, env, timeout_s, inputs=inputs, ahead=ahead)
    cmd = list(warm_cmd)
    key = zygote.launch_key(cmd, env)
    if key is None:
        return cmd
    _reap()
    try:
        return _pooled(cmd, key, env, pool, timeout_s, extra=_serve_args(inputs, ahead))
    except OSError:  # the pool cannot be used (gone, unwritable): this process's zygotes
        return own_command(cmd, env, timeout_s, inputs=inputs, ahead=ahead)


def _serve_args(inputs: Path | None, ahead: bool) -> list[str]:
    return ([] if inputs is None else ["--inputs", str(inputs)]) + (["--ahead"] if ahead else [])


def _pooled(cmd: list[str], key: tuple[object, ...], env: Mapping[str, str], pool: Path,
            timeout_s: float, *, extra: Sequence[str] = ()) -> list[str]:
    """:func:`client_command` with a pool (its ``OSError`` falls back to this process's)."""
    pool.mkdir(mode=0o700, parents=True, exist_ok=True)
    digest = _digest(key)
    refused = pool / f"{digest}.refused"
    if refused.exists():
        return cmd
    deadline = time.monotonic() + timeout_s
    with _flock(pool / f"{digest}.lock", deadline) as got:
        if not got:
            return cmd
        serving = live(pool, digest)
        for dead in pool.glob(f"{digest}-*"):  # left by a killed zygote or a killed start:
            if _pid(dead) is None:  # no start of this key runs now (we hold its lock)
                shutil.rmtree(dead, ignore_errors=True)
        if serving:
            instance = serving[-1]
        else:
            instance = Path(_mkdtemp(pool, digest))
            (instance / "used").touch()  # before the start: not the least recently used
            idle = env.get(IDLE_ENV) or str(DEFAULT_IDLE_S)
            owner = env.get(OWNER_ENV, "")
            args = ["--idle-s", idle, "--remove-dir", *(["--parent", owner] if owner else []),
                    *extra]
            started = zygote.spawn(*zygote.launch_target(cmd), env,
                                   timeout_s=max(deadline - time.monotonic(), 0.1),
                                   workdir=instance, serve_args=args)
            if isinstance(started, str):
                if started.startswith("unsafe "):
                    refused.write_text(started + "\n")
                shutil.rmtree(instance, ignore_errors=True)
                return cmd
            with _STARTED_LOCK:
                _STARTED.append(started)
            _evict(pool, instance)
        (instance / "used").touch()  # the zygote writes its pid itself, first of all
    return zygote.run_command(cmd, instance / "s")


def _mkdtemp(pool: Path, digest: str) -> str:
    return tempfile.mkdtemp(prefix=f"{digest}-", dir=pool)


def stop_pool(pool: Path, grace_s: float = warm.KILL_GRACE_S) -> None:
    """End every zygote of ``pool``: SIGTERM (each drains), SIGKILL after ``grace_s``.

    The directory is left (the caller made it; remove it after).
    """
    pids = [p for d in sorted(pool.glob("*-*")) if (p := _pid(d)) is not None]
    for pid in pids:  # draining ones too: their launches in flight end
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        _reap()
        time.sleep(_LOCK_POLL_S)
    for pid in pids:
        if _running(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    _reap()


def is_pool_zygote(pid: int) -> bool:
    """Whether process ``pid`` is a pool zygote, not one of its launchers or ranks.

    ``serve ... --remove-dir`` with the pid its directory names: its forked launchers and
    ranks share its command line but not its pid.

    Such a process outlives the one that started it by design: a check for processes left
    behind by a killed ``qualify`` leaves it out (its launchers and ranks are not).
    """
    argv = _cmdline(pid)
    sock = _socket_of(argv)
    if not (_is_serve(argv) and "--remove-dir" in argv and sock):
        return False
    try:
        return int((Path(sock).parent / "pid").read_text()) == pid
    except (OSError, ValueError):
        return False


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# --------------------------------------------------------------------------- this process's own


class Zygote:
    """A running zygote of this process (:func:`own_command` starts and stops them).

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
_KEY_LOCKS: dict[tuple[object, ...], threading.Lock] = {}
_KEY_LOCKS_LOCK = threading.Lock()


def _start(target: str, modules: Sequence[str], env: Mapping[str, str],
           timeout_s: float, extra: Sequence[str] = ()) -> Zygote | str:
    """Start a zygote of this process; it, or why it could not serve."""
    workdir = tempfile.TemporaryDirectory(prefix="qualify-zygote-")
    proc = zygote.spawn(target, modules, env, timeout_s=timeout_s, workdir=Path(workdir.name),
                        serve_args=["--parent", str(os.getpid()), *extra])
    if isinstance(proc, str):
        workdir.cleanup()
        return proc
    return Zygote(proc, Path(workdir.name) / "s", workdir)


def own_command(warm_cmd: Sequence[str], env: Mapping[str, str],
                timeout_s: float = zygote.START_TIMEOUT_S, *,
                inputs: Path | None = None, ahead: bool = False) -> list[str]:
    """The command that runs the warm launch ``warm_cmd`` through this process's zygote.

    Starts the zygote of the launch's key (:func:`qualify.candidate.zygote.launch_key`)
    when none runs; beyond :data:`MAX_LIVE` the least recently used drains (its launches in
    flight finish). A start of one key does not hold up the launches of another. Returns
    ``warm_cmd`` itself when zygotes are off (``QUALIFY_ZYGOTE=0``), when ``warm_cmd`` is
    not a warm launch, or when the key's zygote may not fork (remembered) or could not
    start this time (the next launch of the key tries again).

    Args:
        warm_cmd: :func:`qualify.candidate.launch.launch_command`'s warm command.
        env: the whole launch environment (:func:`qualify.candidate.launch.launch_env`).
        timeout_s: the longest to wait for a new zygote's imports.
        inputs: as :func:`client_command`.
        ahead: as :func:`client_command`.
    """
    cmd = list(warm_cmd)
    key = zygote.launch_key(cmd, env)
    if key is None:
        return cmd
    with _KEY_LOCKS_LOCK:
        key_lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    with key_lock:  # one start per key; other keys go on meanwhile
        with _LOCK:
            if key in _REFUSED:
                return cmd
            own = _LIVE.get(key)
            if own is not None and not own.alive():
                del _LIVE[key]
                own.stop()
                own = None
        if own is None:
            started = _start(*zygote.launch_target(cmd), env, timeout_s,
                             _serve_args(inputs, ahead))
            if isinstance(started, str):
                if started.startswith("unsafe "):
                    with _LOCK:
                        _REFUSED[key] = started
                return cmd
            own = started
        with _LOCK:
            _LIVE[key] = own
            while len(_LIVE) > MAX_LIVE:  # the least recently used drains: launches in
                _, old = _LIVE.popitem(last=False)  # flight finish, later ones start plain
                old.drain()
                _DRAINING.append(old)
            for done in [z for z in _DRAINING if not z.alive()]:
                _DRAINING.remove(done)
                done.stop()
            _LIVE.move_to_end(key)
            return zygote.run_command(cmd, own.socket_path)


@atexit.register
def stop_all() -> None:
    """Stop every zygote of this process (also at its exit)."""
    with _LOCK:
        every = [*_LIVE.values(), *_DRAINING]
        _LIVE.clear()
        _DRAINING.clear()
        for own in every:
            own.drain()
        for own in every:
            own.stop()
