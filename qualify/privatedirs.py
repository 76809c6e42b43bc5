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

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping

__all__ = ["private_dirs"]


@contextlib.contextmanager
def private_dirs(prefixes: Mapping[str, str],
                 env: Mapping[str, str] | None = None) -> Iterator[dict[str, str]]:
    """Give each variable of ``prefixes`` that ``env`` leaves unset a fresh directory.

    Each directory is ``tempfile.mkdtemp(prefix=prefix)``: mode 0700, directly under the
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
                made[name] = tempfile.mkdtemp(prefix=prefix)
        yield dict(made)
    finally:
        for path in made.values():
            shutil.rmtree(path, ignore_errors=True)
