"""Skip a test module whose engine is not installed, without importing the engine.

``pytest.importorskip`` imports the package at collection, in every pytest-xdist worker,
whether or not that worker runs the module's tests (``import vllm`` alone is about 2.6 s of
CPU on the 2-core CI box, ``import megatron.core`` 2.7 s beyond torch's). Most of these
modules' tests run the engine in launched ranks, not in the worker. An installed package
that fails to import then fails its tests instead of skipping them.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from types import ModuleType

import pytest


def skip_unless_installed(name: str) -> None:
    """Skip the calling module (at collection) when ``name`` cannot be found.

    Args:
        name: a module name; for a submodule (``megatron.core``) its parent packages are
            imported (``megatron/__init__.py``), the submodule is not.
    """
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found:
        pytest.skip(f"{name} is not installed", allow_module_level=True)


def import_engine(name: str) -> ModuleType:
    """Import ``name`` with its import-time warnings ignored, as ``pytest.importorskip`` did.

    The suite turns warnings into errors; Megatron-Core 0.16.1's import warns that
    Transformer Engine and Apex are missing and calls the deprecated
    ``torch.jit.script_method``. Call it in a test before importing from the package.

    Raises:
        ModuleNotFoundError: the package is not installed.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)
