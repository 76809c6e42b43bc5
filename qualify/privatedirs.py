"""Private directories for an engine's process: made before it starts, removed after it ends.

Some engines put files into a directory that an environment variable names, shared by
default, and never remove them: vLLM binds its ZeroMQ IPC sockets at
``ipc://$VLLM_RPC_BASE_PATH/<uuid4>`` (``get_open_zmq_ipc_path``,
``vllm/utils/network_utils.py``), ``VLLM_RPC_BASE_PATH`` defaulting to the system temporary
directory, and leaves each socket file there when the engine ends. An engine's spec names
such variables, with the prefix of the directory each gets
(:attr:`qualify.registry.EngineSpec.private_dirs`), and whoever starts a process that runs
the engine runs it inside :func:`private_dirs`: each variable then names a fresh directory
of its own, and the directory, with whatever the process left in it, is removed once the
``with`` block is left. The starting process removes it, not the engine's own: a process
that ends through ``os._exit``, a signal or a killed process tree runs none of its own
clean-up.

A variable already set (non-empty) in the environment the process is given is the user's
choice: it is left as it is, and nothing is made or removed for it.

The starting process itself may be killed (``kill -9``, or a signal whose default action
ends it) before it leaves the block. So each directory's name carries where and by whom it
was made, ``<prefix><tag>-<pid>-<random>``: ``tag`` names this boot of this machine and this
pid namespace (:func:`host_tag`), ``pid`` the process that made it. Each
:func:`private_dirs` first removes the directories of its prefixes that this user owns,
whose tag is this one's and whose maker runs no more (:func:`sweep`): what a killed run
left is removed by the next one, and a directory made on another machine or in another
container sharing the temporary directory (whose pids this one cannot see) is never
touched. The sweep never stops a block from starting.

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping

__all__ = ["host_tag", "private_dirs", "sweep"]


@contextlib.contextmanager
def private_dirs(prefixes: Mapping[str, str],
                 env: Mapping[str, str] | None = None) -> Iterator[dict[str, str]]:
    """Give each variable of ``prefixes`` that ``env`` leaves unset a fresh directory.

    Each directory is ``tempfile.mkdtemp(prefix=f"{prefix}{tag}-{pid}-")`` (module
    docstring): mode 0700, directly under the
    system temporary directory (``tempfile.gettempdir()``), so its path stays short (a Unix
    socket's path is limited to 107 bytes). On leaving the block, however it is left, each
    directory made is removed with everything in it; a failure to remove is ignored.

    Args:
        prefixes: variable name -> the prefix of its directory's name
            (``{"VLLM_RPC_BASE_PATH": "qualify-vllm-ipc-"}``).
        env: the environment the process will be given (default ``os.environ``): a
            variable set and non-empty there is left alone.

    Yields:
        The variables to add to the process's environment, name -> absolute directory
        path; empty when ``env`` sets every one.

    Raises:
        OSError: a directory could not be made (those made before it are removed).
    """
    given = os.environ if env is None else env
    made: dict[str, str] = {}
    try:
        for name, prefix in prefixes.items():
            if not given.get(name):
                with contextlib.suppress(Exception):  # a clean-up: never a launch's failure
                    sweep(prefix)
                made[name] = tempfile.mkdtemp(prefix=f"{prefix}{host_tag()}-{os.getpid()}-")
        yield dict(made)
    finally:
        for path in made.values():
            shutil.rmtree(path, ignore_errors=True)


def host_tag() -> str:
    """8 hex digits naming this boot of this machine and this process's pid namespace.

    The SHA-256 of the kernel's boot id (``/proc/sys/kernel/random/boot_id``, else the host
    name) and the pid namespace's inode (``/proc/self/ns/pid``, else none): two processes
    with the same tag see each other's pids.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        import socket

        boot = socket.gethostname()
    try:
        ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        ns = ""
    return hashlib.sha256(f"{boot}/{ns}".encode()).hexdigest()[:8]


def sweep(prefix: str) -> list[str]:
    """Remove what killed makers left: this user's ``<prefix><tag>-<pid>-*`` directories.

    A directory directly under ``tempfile.gettempdir()`` whose name is ``prefix``, this
    machine's and pid namespace's :func:`host_tag`, ``-``, a pid (1 to 10 ASCII digits), ``-``
    and more, that this user owns and whose pid runs no process (``kill(pid, 0)`` fails
    with ``ESRCH``) is removed with everything in it. A directory of a process still
    running (or of a pid reused since: a live process of that pid), of another tag (another
    machine or container sharing the directory), of another user or of another name is left,
    as is anything not a directory (a symbolic link included); a failure to remove is
    ignored.

    Args:
        prefix: a :func:`private_dirs` prefix (``"qualify-vllm-ipc-"``).

    Returns:
        The directories removed.
    """
    removed: list[str] = []
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    mine = f"{prefix}{host_tag()}-"
    uid = os.geteuid()
    for name in names:
        pid_text, dash, _ = name.removeprefix(mine).partition("-")
        if (not name.startswith(mine) or not dash or not pid_text.isascii()
                or not pid_text.isdigit() or len(pid_text) > 10):
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or _running(int(pid_text)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _running(pid: int) -> bool:
    """Whether a process of ``pid`` may exist: only a definite ``ESRCH`` is "gone".

    One of another user counts (``EPERM``), as does a pid the kernel cannot take.
    """
    if pid <= 0:
        return True  # not a maker's pid: never treated as gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):
        return True
    return True
