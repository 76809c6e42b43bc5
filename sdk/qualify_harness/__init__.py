"""qualify's harness SDK: what an engine harness imports to speak the harness protocol.

A harness reads its frozen inputs (:func:`read_inputs`: rollout, training inputs, contract,
model directories), supplies an :class:`Engine` for each role it runs (the placed model and
its forward, backward, clip, optimizer step and gathers; :class:`TorchOptimEngine` holds
the update parts of an engine that steps a plain ``torch.optim`` optimizer), lets
:func:`run_actor` / :func:`run_critic` run the contract's rounds with the losses of
:mod:`qualify_harness.losses`, and writes its outputs with :func:`role_meta`,
:func:`write_part`, :func:`merge_parts` and :func:`outputs_head` (``outputs.json`` carries
:data:`SDK_VERSION`).

Depends on torch, numpy, safetensors and the standard library only, so it installs into a
training stack's own environment; it never imports ``qualify``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qualify_harness.driver import Engine, actor_objective, run_actor, run_critic, update
    from qualify_harness.errors import HarnessSDKError, InputError, OutputError
    from qualify_harness.inputs import Batch, Inputs, Recipe, micro_slices, read_inputs
    from qualify_harness.optim import TorchOptimEngine
    from qualify_harness.outputs import (
        ROLE_REQUIRED,
        Recorder,
        merge_parts,
        outputs_head,
        role_meta,
        write_part,
    )
    from qualify_harness.protocol import ParamSampling, tensor_name
    from qualify_harness.version import SDK_MAJOR, SDK_VERSION

_WHERE = {
    "driver": ("Engine", "actor_objective", "run_actor", "run_critic", "update"),
    "errors": ("HarnessSDKError", "InputError", "OutputError"),
    "inputs": ("Batch", "Inputs", "Recipe", "micro_slices", "read_inputs"),
    "optim": ("TorchOptimEngine",),
    "outputs": ("ROLE_REQUIRED", "Recorder", "merge_parts", "outputs_head", "role_meta",
                "write_part"),
    "protocol": ("ParamSampling", "tensor_name"),
    "version": ("SDK_MAJOR", "SDK_VERSION"),
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}

__all__ = ["ROLE_REQUIRED", "SDK_MAJOR", "SDK_VERSION", "Batch", "Engine", "HarnessSDKError",
           "InputError", "Inputs", "OutputError", "ParamSampling", "Recipe", "Recorder",
           "TorchOptimEngine", "actor_objective", "merge_parts", "micro_slices", "outputs_head",
           "read_inputs", "role_meta", "run_actor", "run_critic", "tensor_name", "update",
           "write_part"]


def __getattr__(name: str) -> Any:
    """The SDK name ``name``, its submodule imported on first use (PEP 562).

    ``import qualify_harness.protocol`` (what qualify itself reads) then imports no torch.

    Raises:
        AttributeError: ``name`` is not an SDK name.
    """
    module = _MODULE.get(name)
    if module is None:
        raise AttributeError(f"module 'qualify_harness' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"qualify_harness.{module}"), name)
    globals()[name] = value
    return value
