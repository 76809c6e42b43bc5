"""Planting a fault in a launched harness from the test alone (no branch in the harness).

:func:`plant_env` writes a ``sitecustomize.py`` into a fresh directory and returns the
launch environment that puts it on ``PYTHONPATH`` (after the checkout, which
:func:`qualify.candidate.launch.launch_env` keeps first; the checkout holds no
``sitecustomize``). Every interpreter of the launch imports it at start-up: the launcher,
the warm launcher that preloads the harness before forking the ranks, and plain torchrun
ranks alike. It registers a one-shot import hook that, once ``module`` has executed, runs
``patch`` (Python source) with that module bound to ``module``: the harness then runs
exactly as shipped, with one of its seams replaced as a broken engine setup would have it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

SITE_TEMPLATE = '''\
import importlib.abc
import importlib.util
import sys

TARGET = {target!r}


def _patch(module):
{patch}


class _PlantFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PlantFinder())
'''


def plant_env(directory: Path, module: str, patch: str) -> dict[str, str]:
    """A launch environment overlay that runs ``patch`` on ``module`` after its import.

    Args:
        directory: a fresh directory for the ``sitecustomize.py`` (created).
        module: the dotted module to patch (e.g. ``harnesses.fsdp2.parallelize``).
        patch: Python statements; the imported module is bound to ``module``.

    Returns:
        ``{"PYTHONPATH": directory}`` for :func:`qualify.candidate.launch.launch_env`.
    """
    directory.mkdir(parents=True, exist_ok=True)
    body = textwrap.indent(textwrap.dedent(patch).strip() + "\n", "    ")
    (directory / "sitecustomize.py").write_text(SITE_TEMPLATE.format(target=module, patch=body),
                                                encoding="utf-8")
    return {"PYTHONPATH": str(directory)}
