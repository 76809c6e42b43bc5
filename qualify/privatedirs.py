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
ends it) before it leaves the block. So each directory's name carries the pid of the
process that made it (``<prefix><pid>-<random>``), and each :func:`private_dirs` first
removes the directories of its prefixes that this user owns and whose maker is no longer
running (:func:`sweep`): what a killed run left is removed by the next one.

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping

__all__ = ["private_dirs", "sweep"]


@contextlib.contextmanager
def private_dirs(prefixes: Mapping[str, str],
                 env: Mapping[str, str] | None = None) -> Iterator[dict[str, str]]:
    """Give each variable of ``prefixes`` that ``env`` leaves unset a fresh directory.

    Each directory is ``tempfile.mkdtemp(prefix=f"{prefix}{pid}-")``: mode 0700, directly under the
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
                sweep(prefix)
                made[name] = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
        yield dict(made)
    finally:
        for path in made.values():
            shutil.rmtree(path, ignore_errors=True)


def sweep(prefix: str) -> list[str]:
    """Remove what killed makers left: the ``<prefix><pid>-*`` directories of this user.

    A directory directly under ``tempfile.gettempdir()`` whose name is ``prefix``, a decimal
    pid, ``-`` and more, that this user owns and whose pid runs no process (``kill(pid,
    0)`` fails with ``ESRCH``) is removed with everything in it. A directory of a process
    still running (or of a pid reused since: a live process of that pid) is left, as is
    anything of another user or another name; a failure to remove is ignored.

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
    uid = os.geteuid()
    for name in names:
        pid_text, dash, _ = name.removeprefix(prefix).partition("-")
        if not name.startswith(prefix) or not dash or not pid_text.isdigit():
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
    """Whether a process of ``pid`` exists (one of another user counts: ``EPERM``)."""
    if pid <= 0:
        return True  # not a maker's pid: never treated as gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
