"""Locate the files qualify ships: JSON Schemas, committed contracts, keys, job scripts.

The repository keeps one copy of each (docs/engine-guide.md, Layout): ``contracts/`` (with
``contracts/schema/`` and ``contracts/keys/``), ``sbatch/`` and ``harnesses/`` at its root.
qualify runs in one of two layouts, and every path is asked for here:

- **a checkout** (an editable install, ``pip install -e .``, or the root on ``PYTHONPATH``):
  the files are read where they are, next to the ``qualify`` package;
- **a wheel install**: ``setup.py`` maps ``contracts/`` and ``sbatch/`` into the package as
  ``qualify/_data/contracts/`` and ``qualify/_data/sbatch/`` at build time, and
  ``harnesses`` is a top-level package beside ``qualify`` in ``site-packages``.

The layout is told by ``qualify/_data/`` alone: it exists only in a built wheel (nothing
in the repository writes it).
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Final

from qualify.errors import QualifyError

#: The package directory of the data a wheel carries (absent in a checkout).
DATA_PACKAGE_DIR: Final = "_data"


def repo_root() -> Path:
    """The directory holding the ``qualify`` package, from which ``harnesses`` imports.

    The repository root in a checkout (holding ``contracts/``, ``harnesses/``,
    ``sbatch/``); the ``site-packages`` directory in a wheel install (holding the
    ``qualify`` and ``harnesses`` packages; the data is under :func:`data_root`). Putting
    it first on ``PYTHONPATH`` makes ``harnesses`` importable in both layouts
    (:func:`qualify.candidate.launch.launch_env`).
    """
    return Path(__file__).resolve().parent.parent


def is_checkout() -> bool:
    """Whether qualify runs from a source checkout (editable or not) rather than a wheel."""
    return not (Path(__file__).resolve().parent / DATA_PACKAGE_DIR).is_dir()


def checkout_root() -> Path | None:
    """The source checkout qualify runs from, or ``None`` in a wheel install.

    The tree whose git state describes the running code: a wheel install has none (its
    ``site-packages`` may lie inside some unrelated working tree).
    """
    return repo_root() if is_checkout() else None


def data_root() -> Path:
    """The directory holding ``contracts/`` and ``sbatch/``.

    The repository root in a checkout, ``qualify/_data/`` in a wheel install.
    """
    if is_checkout():
        return repo_root()
    return Path(__file__).resolve().parent / DATA_PACKAGE_DIR


def import_repo_module(name: str) -> ModuleType:
    """Import ``name``; a ``harnesses.*`` module is found beside the ``qualify`` package.

    In a wheel install ``harnesses`` is an installed package. In a checkout it is a
    directory at the repository root: the launcher puts that root on the children's
    ``PYTHONPATH`` (:func:`qualify.candidate.launch.launch_env`), and this puts it on
    ``sys.path`` for the few harness modules imported in the qualify process itself (the
    vLLM rollout backend, which only starts a child process).

    Raises:
        ImportError: the module cannot be imported.
    """
    if name.split(".", 1)[0] == "harnesses":
        root = str(repo_root())
        if root not in sys.path:
            sys.path.insert(0, root)
    return importlib.import_module(name)


def contracts_dir() -> Path:
    """``contracts/``: committed contracts, ``schema/``, ``keys/`` (see :func:`data_root`)."""
    return data_root() / "contracts"


def sbatch_dir() -> Path:
    """``sbatch/``: the Slurm job scripts of the two stages (see :func:`data_root`)."""
    return data_root() / "sbatch"


def harnesses_dir() -> Path:
    """``harnesses/``: the repository's folder, or the installed package of a wheel."""
    return repo_root() / "harnesses"


@functools.cache
def load_schema(name: str) -> dict[str, Any]:
    """Load ``contracts/schema/<name>.schema.json``.

    Args:
        name: schema stem, e.g. ``contract``, ``outputs``, ``report``.

    Raises:
        QualifyError: the schema file is missing (a broken installation).
    """
    path = contracts_dir() / "schema" / f"{name}.schema.json"
    if not path.is_file():
        raise QualifyError(f"{path}: schema file missing; reinstall qualify from its repository")
    result: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return result
