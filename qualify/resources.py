"""Locate the files qualify ships: JSON Schemas and committed contracts.

The schemas live in ``contracts/schema/`` at the repository root (DESIGN.md section 2);
the package is installed editable (``pip install -e .``), so they are found next to it.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from qualify.errors import QualifyError


def repo_root() -> Path:
    """The repository root (the directory holding ``contracts/`` and ``harnesses/``)."""
    return Path(__file__).resolve().parent.parent


def import_repo_module(name: str) -> ModuleType:
    """Import ``name``; a ``harnesses.*`` module is found at the repository root.

    ``harnesses/`` is not an installed package: the launcher puts the repository root
    on the children's ``PYTHONPATH`` (:func:`qualify.launch.launch_env`), and this puts it
    on ``sys.path`` for the few harness modules imported in the qualify process itself
    (the vLLM rollout backend, which only starts a child process).

    Raises:
        ImportError: the module cannot be imported.
    """
    if name.split(".", 1)[0] == "harnesses":
        root = str(repo_root())
        if root not in sys.path:
            sys.path.insert(0, root)
    return importlib.import_module(name)


def contracts_dir() -> Path:
    """``contracts/`` at the repository root."""
    return repo_root() / "contracts"


def harnesses_dir() -> Path:
    """``harnesses/`` at the repository root."""
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
