"""Inside a harness process: the files it imported, written down when it ends.

A launch (:func:`qualify.candidate.launch.launch`, the sampler step
:mod:`qualify.candidate.sampler_stage`) sets :data:`IMPORTS_DIR_ENV` to a directory of its
attempt; every harness process that called :func:`install` (each forked rank of the warm
launcher, :mod:`qualify.candidate.warm`; every process that enters through the harness SDK,
:func:`harnesses.common.harness_main`, or the launch trampoline; the vLLM sampler harness)
writes there, as it ends, ``<RANK>-<pid>.json``::

    {"rank": 0, "pid": 1234, "files": ["/abs/path/of/every/imported/module/file.py", ...],
     "modules": ["harnesses", "qualify", "sitecustomize", "torch", ...],
     "prefixes": ["/usr/lib/python3.12", ...], "sys_path": ["/repo", ...],
     "executable": "/usr/bin/python3"}

``files``: the resolved ``__file__`` of every module in :data:`sys.modules` (``__main__``,
``sitecustomize``, ``usercustomize`` and what ``.pth`` files imported included) and of every
file :func:`note` was given (the entry point :mod:`runpy` ran); ``modules``:
:func:`top_level_names`; ``prefixes``: the interpreter's own trees (:func:`env_prefixes`);
``sys_path``: :data:`sys.path`, where the launcher finds the distributions of a foreign
interpreter (a venv or a container, :mod:`qualify.candidate.interpreter`) again. Nothing is
hashed here: the launcher
classifies and hashes the files once per launch, and flags every file modified after the
launch began (:func:`qualify.evidence.imports.collect`).

It is written when the interpreter exits (:mod:`atexit`) and also on ``os._exit`` (which
the warm launcher's ranks and :func:`harnesses.common.exit_now` end with; wrapped here, as
coverage.py's ``patch = _exit`` does), at most once per process. A process killed by a
signal writes nothing, and the launch then misses its rank (the record says so). Writing
never raises into the harness: a failed write is a missing rank.

Run as a script (``python .../qualify/candidate/imported.py MODULE[:ATTR] CELL_JSON``), it
is the entry of each rank of a foreign interpreter (:data:`qualify.candidate.interpreter
.RUNNER`): it installs the record, then runs ``MODULE`` as ``__main__`` with ``CELL_JSON``
as its argument, or calls ``ATTR([CELL_JSON])``; without importing the ``qualify`` package.

Importing this module imports nothing outside the standard library.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import json
import os
import runpy
import sys
import sysconfig
from pathlib import Path
from typing import Any, Final

__all__ = ["IMPORTS_DIR_ENV", "env_prefixes", "install", "loaded_files", "note", "run",
           "top_level_names", "write_record"]

IMPORTS_DIR_ENV: Final = "QUALIFY_IMPORTS_DIR"
"""Where a launch's processes write their records (unset: nothing is recorded)."""

_state: dict[str, Any] = {"installed_pid": None, "written_pid": None}
_noted: set[str] = set()


def loaded_files() -> list[str]:
    """The files of every module this process has imported (and :func:`note` was given).

    Returns:
        Sorted absolute paths (not resolved, not checked: string operations only, so that
        a rank of thousands of modules ends at once; the launcher filters and resolves):
        each module's ``__file__`` (``__spec__.origin`` when it has none), namespace
        packages and built-in modules excluded. A relative ``__file__`` names no file the
        import system loaded (torch's ``torch.ops`` / ``torch.classes`` namespaces say
        ``"_ops.py"`` and ``"_classes.py"``): it is skipped, never resolved against the
        working directory, where it would read as a missing file of the code root.
    """
    out: set[str] = set(_noted)
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str):
            spec = getattr(module, "__spec__", None)
            path = getattr(spec, "origin", None)
        if isinstance(path, str) and os.path.isabs(path):
            out.add(os.path.normpath(path))
    return sorted(out)


def top_level_names() -> list[str]:
    """The top-level names this process imported, and the names ``site`` probes.

    A file of one of these names added later at the front of the path (the code root,
    first on the launch's ``PYTHONPATH``) would shadow what ran: ``sitecustomize`` and
    ``usercustomize`` are always listed, imported or not.
    """
    names = {str(n).split(".", 1)[0] for n in list(sys.modules)} | {"sitecustomize",
                                                                     "usercustomize"}
    return sorted(n for n in names if n.isidentifier() and n != "__main__")


def env_prefixes() -> list[str]:
    """This interpreter's own trees: stdlib, site-packages and the prefixes, resolved.

    Files below them are the environment's, not code of a checkout that holds them (a
    ``.venv`` inside the repository).
    """
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return sorted({os.path.realpath(d) for d in dirs})


def note(path: str | os.PathLike[str] | None) -> None:
    """Count ``path`` among this process's imported files even once it left ``sys.modules``.

    For the entry point a launcher runs as ``__main__`` through :mod:`runpy` (which takes
    it out of ``sys.modules`` again when it returns). ``None`` is ignored.
    """
    if path is not None:
        _noted.add(os.path.abspath(path))


def write_record(directory: str | Path | None = None) -> Path | None:
    """Write this process's record into ``directory`` (default: :data:`IMPORTS_DIR_ENV`).

    At most once per process (a forked child writes its own). Never raises.

    Returns:
        The file written, or ``None`` (no directory set, already written, or the write
        failed).
    """
    where = directory if directory is not None else os.environ.get(IMPORTS_DIR_ENV, "")
    if not where or _state["written_pid"] == os.getpid():
        return None
    _state["written_pid"] = os.getpid()
    try:
        rank = os.environ.get("RANK", "")
        doc = {"rank": int(rank) if rank.isdigit() else None, "pid": os.getpid(),
               "files": loaded_files(), "modules": top_level_names(),
               "prefixes": env_prefixes(), "sys_path": [p for p in sys.path if p],
               "executable": sys.executable}
        folder = Path(where)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{rank if rank.isdigit() else 'p'}-{os.getpid()}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(doc), encoding="utf-8")
        os.replace(tmp, path)
    except Exception:  # a missing record is reported by the launcher as a missing rank
        return None
    return path


def install() -> None:
    """Arrange for this process to write its record when it ends (see the module doc).

    A no-op when :data:`IMPORTS_DIR_ENV` is unset or it was already installed in this
    process (a forked child of an installed process installs again: its own pid).
    """
    if not os.environ.get(IMPORTS_DIR_ENV) or _state["installed_pid"] == os.getpid():
        return
    first = _state["installed_pid"] is None
    _state["installed_pid"] = os.getpid()
    if not first:  # the exit hooks are in place already, inherited through the fork
        return
    atexit.register(write_record)
    real_exit = os._exit

    def _exit(code: int) -> None:  # what os._exit skips: the atexit hooks
        with contextlib.suppress(Exception):
            write_record()
        real_exit(code)

    os._exit = _exit  # type: ignore[assignment]


def run(argv: list[str]) -> int:
    """``MODULE[:ATTR] CELL_JSON``: install the record, then run the harness (module doc).

    Returns:
        The harness's exit status (``ATTR``'s return value, 0 for ``None``; a module run as
        ``__main__`` exits through :class:`SystemExit` itself); 2 for bad arguments.
    """
    if len(argv) != 2:
        print("usage: python imported.py MODULE[:ATTR] CELL_JSON", file=sys.stderr)
        return 2
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # no shadowing
    install()
    target, cell = argv
    module, _, attr = target.partition(":")
    if attr:
        fn = getattr(importlib.import_module(module), attr)
        return int(fn([cell]) or 0)
    spec = importlib.util.find_spec(module)
    if spec is not None:
        note(spec.origin)
    sys.argv = [module, cell]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
