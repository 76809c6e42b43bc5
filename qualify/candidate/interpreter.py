"""Which interpreter runs an engine's ranks: qualify's own, or a site's (a venv, a container).

A stack pins its own dependencies (verl: ``transformers<5.11``), which qualify's environment
cannot hold at once; its harness then runs in the stack's environment and talks to qualify
through files only (``cell.json`` in, ``outputs.*`` and the import record out). Where that
environment is, is a fact of the machine, not of the qualification: it is not in the
contract (whose digest the gate trusts, and which another site runs unchanged), but in the
environment of the command that launches:

- ``QUALIFY_LAUNCHER_<ENGINE>`` (``<ENGINE>`` the engine's name in upper case), the command
  prefix that stands for ``python``, split as a POSIX shell splits it: a venv's python
  (``/opt/verl/bin/python``), or a prefix that ends in one (``apptainer exec stack.sif
  python3``, ``srun --container-image=stack.sqsh python``);
- ``qualify run|candidate|diverge|harness check --launcher ENGINE=CMD`` sets that variable
  for the command (:func:`apply_options`).

Such an engine is launched by torchrun of that interpreter (``CMD -m torch.distributed.run
...``; the warm launcher forks qualify's own interpreter and is never used
for it), each rank entering through :data:`RUNNER` (this repository's
``qualify/candidate/imported.py`` run as a script: standard library only, it records the
files the rank imported, :mod:`qualify.candidate.imported`, then runs the harness). The
foreign environment needs torch (torchrun) and the harness's own dependencies; it must see
this checkout's path (a container: bind-mount it at the same path), and the launch's
``PYTHONPATH`` leads with it, as for every launch. The run's record of the engine's
distributions' versions (``sources.json``, :mod:`qualify.evidence.sources`) is read in that
interpreter, asked once (:func:`distribution_versions`).

Importing this module imports nothing outside the standard library and :mod:`qualify.errors`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Final

from qualify.errors import UsageError

__all__ = ["ENV_PREFIX", "RUNNER", "apply_options", "check_env", "distribution_versions",
           "engine_command", "env_name"]

ENV_PREFIX: Final = "QUALIFY_LAUNCHER_"
"""``QUALIFY_LAUNCHER_<ENGINE>``: the interpreter command of one engine's ranks."""
RUNNER: Final = Path(__file__).with_name("imported.py")
"""The script each rank of a foreign interpreter runs (``RUNNER MODULE[:ATTR] CELL_JSON``)."""
_ENGINE: Final = re.compile(r"^[a-z][a-z0-9_]*$")
VERSIONS_TIMEOUT_S: Final = 300.0
"""How long :func:`distribution_versions` waits for the interpreter (a container's start)."""
_VERSIONS: Final = """import importlib.metadata as md, json, sys
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
print(json.dumps({name: version(name) for name in sys.argv[1:]}))
"""


def env_name(engine: str) -> str:
    """``QUALIFY_LAUNCHER_<ENGINE>`` of ``engine`` (``torch_tp`` -> ``..._TORCH_TP``)."""
    return ENV_PREFIX + engine.upper()


def _split(name: str, value: str) -> list[str]:
    """``value`` split as a shell splits it; the first word must be a runnable program.

    Raises:
        UsageError: empty, unbalanced quotes, or a first word that is neither an
            executable file nor a program on ``PATH`` (the variable and value named).
    """
    try:
        words = shlex.split(value)
    except ValueError as exc:
        raise UsageError(f"{name}={value!r}: not a command line ({exc})") from None
    if not words:
        raise UsageError(f"{name}={value!r}: empty; give a python (a venv's bin/python) or a "
                         "command prefix ending in one")
    first = words[0]
    found = (os.path.isfile(first) and os.access(first, os.X_OK)) if os.sep in first \
        else shutil.which(first) is not None
    if not found:
        raise UsageError(f"{name}={value!r}: {first!r} is not an executable file or a program "
                         "on PATH")
    return words


def engine_command(engine: str, env: Mapping[str, str] | None = None) -> list[str] | None:
    """The interpreter command of ``engine``'s ranks, or ``None``: qualify's own.

    A first word that is a relative path (``.venv-trl/bin/python``) is made absolute against
    this process's working directory: the ranks start in their attempt directory.

    Raises:
        UsageError: the variable is set to a bad value (:func:`_split`).
    """
    e = os.environ if env is None else env
    value = e.get(env_name(engine), "")
    if not value:
        return None
    words = _split(env_name(engine), value)
    if os.sep in words[0]:
        words[0] = os.path.abspath(words[0])
    return words


def check_env(env: Mapping[str, str] | None = None) -> None:
    """Check every ``QUALIFY_LAUNCHER_<ENGINE>`` set (non-empty) in ``env``.

    The engine need not be registered here (a variable for an engine the contract does not
    run is not read), but its name must be one an engine can have.

    Raises:
        UsageError: a bad engine part of the name, or a bad command (one line).
    """
    e = os.environ if env is None else env
    for key in sorted(e):
        if key.startswith(ENV_PREFIX) and e[key]:
            engine = key[len(ENV_PREFIX):].lower()
            if not _ENGINE.match(engine):
                raise UsageError(f"{key}: {engine!r} is not an engine name (lowercase "
                                 "letters, digits, _)")
            _split(key, e[key])


def apply_options(options: Sequence[str], env: MutableMapping[str, str] | None = None,
                  known: Sequence[str] | None = None) -> dict[str, str]:
    """Turn ``--launcher ENGINE=CMD`` options into ``QUALIFY_LAUNCHER_<ENGINE>`` settings.

    Args:
        options: the option values, each ``ENGINE=CMD``.
        env: where to set them (default :data:`os.environ`), overriding a value there.
        known: the registered engine names; an option for another name is refused
            (``None``: not checked).

    Returns:
        variable -> value, as set.

    Raises:
        UsageError: a value without ``=``, an unknown engine, the same engine twice, or a
            bad command.
    """
    e = os.environ if env is None else env
    out: dict[str, str] = {}
    for opt in options:
        engine, sep, cmd = opt.partition("=")
        if not sep or not _ENGINE.match(engine):
            raise UsageError(f"--launcher {opt!r}: must be ENGINE=COMMAND (ENGINE in "
                             "lowercase, e.g. torch_tp=/opt/venv/bin/python)")
        if known is not None and engine not in known:
            raise UsageError(f"--launcher {opt!r}: unknown engine {engine!r}; registered "
                             f"engines: {', '.join(sorted(known))}")
        name = env_name(engine)
        if name in out:
            raise UsageError(f"--launcher {opt!r}: engine {engine!r} given twice")
        _split(f"--launcher {engine}", cmd)
        out[name] = cmd
    e.update(out)
    return out


def distribution_versions(command: Sequence[str], names: Sequence[str], *, what: str,
                          env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The versions of distributions ``names`` as the interpreter ``command`` sees them.

    Runs ``COMMAND -c SCRIPT NAME...`` once (:mod:`importlib.metadata` there; nothing is
    imported), so that a record of what an engine's ranks ran names their environment's
    versions, not qualify's.

    Args:
        command: the interpreter command (:func:`engine_command`).
        names: distribution names (PyPI spelling).
        what: the setting that named the command (``QUALIFY_LAUNCHER_TRL``), for errors.
        env: the environment it runs in (default this process's).

    Returns:
        name -> version, or ``None`` where that interpreter has no such distribution.

    Raises:
        UsageError: the command cannot start, fails, outlasts :data:`VERSIONS_TIMEOUT_S`
            or prints no such mapping (one line: ``what``, the command, the cause).
    """
    cmd = [*command, "-c", _VERSIONS, *names]
    where = f"{what}={shlex.join(command)}: cannot read its distributions' versions"
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                              timeout=VERSIONS_TIMEOUT_S,
                              env=None if env is None else dict(env))
    except (OSError, subprocess.SubprocessError) as exc:
        raise UsageError(f"{where} ({type(exc).__name__}: {exc})") from None
    lines = done.stdout.strip().splitlines()
    try:
        got = json.loads(lines[-1]) if done.returncode == 0 and lines else None
    except ValueError:
        got = None
    if not (isinstance(got, dict) and set(got) == set(names)
            and all(v is None or isinstance(v, str) for v in got.values())):
        tail = (done.stderr.strip().splitlines() or lines or ["no output"])[-1]
        raise UsageError(f"{where} (exit {done.returncode}: {tail})")
    return {name: got[name] for name in names}
