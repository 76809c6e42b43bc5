"""CPU placement shims for megatron-core 0.16.1's optimizer path (harness processes only).

megatron-core 0.16.1's non-distributed optimizer (``get_megatron_optimizer`` ->
``ChainedOptimizer`` of ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` around
``torch.optim.AdamW``, its ``clip_grad_norm`` and the local multi-tensor fallbacks used
without Transformer Engine or Apex) hard-codes CUDA in two ways, listed with their upstream
lines in :data:`OPTIMIZER_SHIMS`:

1. constant tensors created with ``device='cuda'`` (loss-scale ones, the multi-tensor
   applier's overflow flag, the grad-norm scalar of ``local_multi_tensor_l2_norm``);
2. legacy type-string checks ``param.type() == 'torch.cuda.FloatTensor'`` (an assertion in
   ``clip_grad_by_total_norm_fp32`` and the float16 / fp32 parameter split of
   ``Float16OptimizerWithFloat16Params.__init__``).

:func:`optimizer_placement` maps both to the CPU, for the duration of a ``with`` block and
only as seen from the named megatron modules:

- :class:`CpuPlacedTorch` replaces the module-level name ``torch`` of those modules: every
  attribute is torch's own object, except the factories ``tensor`` and ``zeros``, which
  put a tensor asked for on ``cuda`` on the CPU (same data, dtype and shape);
- ``torch.Tensor.type()`` called without arguments *from those modules* on a CPU tensor
  returns the CUDA legacy name of the same dtype (``torch.FloatTensor`` ->
  ``torch.cuda.FloatTensor``); every other call is torch's.

Neither can change a number: on a CPU-only build each ``device='cuda'`` factory call raises
and each type check fails, so the shims only let code that otherwise stops run with the same
constants on the CPU; the dtype part of a type string is never rewritten. The shims record
each upstream line they served (:attr:`Placement.served`), so ``outputs.json`` names the
lines that actually ran. ``torch.cuda.current_device`` (``ChainedOptimizer.get_loss_scale``,
``param_and_grad_buffer``) is already ``"cpu"`` through
:func:`harnesses.megatron.model.apply_cpu_shims`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, Final

import torch

SHIMMED_MODULES: Final = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
)
"""The megatron modules whose module-level ``torch`` :func:`optimizer_placement` replaces."""

TYPE_CHECK_MODULES: Final = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
)
"""The megatron modules whose ``Tensor.type()`` calls see CUDA legacy names."""

OPTIMIZER_SHIMS: Final = (
    {"patches": "torch.tensor / torch.zeros (device='cuda') as seen from "
                "megatron.core.optimizer.optimizer, .clip_grads and megatron.core.utils",
     "to": "the same call with device='cpu' (same data, dtype, shape)",
     "upstream": ["megatron/core/optimizer/optimizer.py:907 FP32Optimizer._scale = [1.0]",
                  "megatron/core/optimizer/optimizer.py:485 MixedPrecisionOptimizer._scale_one "
                  "= [1.0]",
                  "megatron/core/optimizer/optimizer.py:481 _dummy_overflow_buf = [0] (fp16 "
                  "only; BF16 sets None)",
                  "megatron/core/optimizer/optimizer.py:473 found_inf = [0.0] (with a grad "
                  "scaler only; BF16 without loss_scale has none)",
                  "megatron/core/optimizer/clip_grads.py:103 get_grad_norm_fp32 "
                  "dummy_overflow_buf = zeros(1, int)",
                  "megatron/core/optimizer/clip_grads.py:115 grad_norm = zeros(1) (no grads "
                  "on the rank)",
                  "megatron/core/optimizer/clip_grads.py:174 clip_grad_by_total_norm_fp32 "
                  "dummy_overflow_buf = zeros(1, int)",
                  "megatron/core/utils.py:1207 local_multi_tensor_l2_norm returns "
                  "tensor([float(norm)]) on cuda"],
     "why": "constants and the grad-norm scalar are created with device='cuda', which raises "
            "on a CPU-only torch; the values, dtypes and shapes are upstream's, only the "
            "device differs (the overflow flags are never read by the local fallbacks)"},
    {"patches": "torch.Tensor.type() without arguments, called from "
                "megatron.core.optimizer.optimizer and .clip_grads on a CPU tensor",
     "to": "the CUDA legacy name of the same dtype (torch.FloatTensor -> "
           "torch.cuda.FloatTensor, torch.BFloat16Tensor -> torch.cuda.BFloat16Tensor)",
     "upstream": ["megatron/core/optimizer/optimizer.py:671 float16 params: type() in "
                  "[torch.cuda.HalfTensor, torch.cuda.BFloat16Tensor]",
                  "megatron/core/optimizer/optimizer.py:690 fp32 params: type() == "
                  "torch.cuda.FloatTensor",
                  "megatron/core/optimizer/clip_grads.py:167 assert param.grad.type() == "
                  "torch.cuda.FloatTensor"],
     "why": "the legacy type string encodes dtype and device; Megatron uses it to split "
            "BF16 from FP32 parameters and to assert FP32 grads. The dtype part is "
            "unchanged, so every parameter lands in the group its dtype selects on CUDA"},
)
"""What :func:`optimizer_placement` patches, the upstream lines, and why (``outputs.json``)."""


def shim_texts() -> list[str]:
    """:data:`OPTIMIZER_SHIMS` as ``outputs.json`` ``shims`` strings (what, to, upstream, why)."""
    return [f"{s['patches']} -> {s['to']} (stands in for: {'; '.join(s['upstream'])}): "
            f"{s['why']}" for s in OPTIMIZER_SHIMS]


def cpu_device(device: Any) -> Any:
    """``device`` with a CUDA placement mapped to ``torch.device("cpu")``; else unchanged.

    Args:
        device: ``None``, a string (``"cuda"``, ``"cuda:0"``, ``"cpu"``), an int (a CUDA
            ordinal, as ``torch.cuda.current_device()`` returns) or a ``torch.device``.
    """
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


def _caller_line(depth: int = 2) -> str:
    frame = sys._getframe(depth)
    path = frame.f_code.co_filename.replace("\\", "/")
    tail = path[path.rfind("megatron/core/"):] if "megatron/core/" in path else path
    return f"{tail}:{frame.f_lineno}"


@dataclasses.dataclass(kw_only=True)
class Placement:
    """What one :func:`optimizer_placement` block served.

    Attributes:
        served: ``{"megatron/core/<file>.py:<line>": count}`` of each call the shims
            redirected (a factory placed on the CPU, a type string renamed).
    """

    served: dict[str, int] = dataclasses.field(default_factory=dict)

    def note(self, where: str) -> None:
        """Count one redirected call at ``where`` (``file:line``)."""
        self.served[where] = self.served.get(where, 0) + 1


class CpuPlacedTorch:
    """``torch`` as a shimmed megatron module sees it inside :func:`optimizer_placement`.

    Every attribute is torch's own (``__getattr__``), except :meth:`tensor` and
    :meth:`zeros`, which call torch's with a CUDA ``device`` mapped to the CPU
    (:func:`cpu_device`) and record the calling line.

    Args:
        placement: where to record the calls served.
    """

    def __init__(self, placement: Placement) -> None:
        self._placement = placement

    def __getattr__(self, name: str) -> Any:
        """Torch's attribute ``name``."""
        return getattr(torch, name)

    def _place(self, device: Any) -> Any:
        mapped = cpu_device(device)
        if mapped is not device:
            self._placement.note(_caller_line(3))
        return mapped

    def tensor(self, data: Any, *, device: Any = None, **kwargs: Any) -> torch.Tensor:
        """``torch.tensor(data, ...)`` with ``device`` mapped by :func:`cpu_device`.

        Keyword options only (every megatron-core call site passes them so).
        """
        return torch.tensor(data, device=self._place(device), **kwargs)

    def zeros(self, *size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        """``torch.zeros(*size, ...)`` with ``device`` mapped by :func:`cpu_device`."""
        return torch.zeros(*size, device=self._place(device), **kwargs)


def cuda_type_name(cpu_name: str) -> str:
    """CUDA legacy type name of a CPU one: ``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``.

    Raises:
        ValueError: ``cpu_name`` is not a CPU legacy name ``torch.<Dtype>Tensor``.
    """
    head, _, tail = cpu_name.rpartition(".")
    if head != "torch" or not tail.endswith("Tensor"):
        raise ValueError(f"{cpu_name!r} is not a CPU legacy tensor type name")
    return f"torch.cuda.{tail}"


def _type_shim(original: Callable[..., Any], placement: Placement) -> Callable[..., Any]:
    modules = frozenset(TYPE_CHECK_MODULES)

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or self.device.type != "cpu":
            return original(self, *args, **kwargs)
        caller = sys._getframe(1)
        if caller.f_globals.get("__name__") not in modules:
            return original(self)
        placement.note(_caller_line(2))
        return cuda_type_name(original(self))

    type_.__doc__ = original.__doc__
    return type_


@contextlib.contextmanager
def optimizer_placement() -> Iterator[Placement]:
    """Run megatron-core's optimizer code on the CPU inside the block (:data:`OPTIMIZER_SHIMS`).

    Installs :class:`CpuPlacedTorch` as ``torch`` of :data:`SHIMMED_MODULES` and the
    ``Tensor.type`` rename for calls from :data:`TYPE_CHECK_MODULES`; restores both on exit
    (also on an exception). Not re-entrant; one block at a time per process.

    Yields:
        The :class:`Placement` recording each upstream line served.

    Raises:
        RuntimeError: a block is already active in this process.
    """
    if "type" in torch.Tensor.__dict__:
        raise RuntimeError("optimizer_placement is already active (torch.Tensor.type patched)")
    placement = Placement()
    proxy = CpuPlacedTorch(placement)
    modules = [importlib.import_module(m) for m in SHIMMED_MODULES]
    saved = [m.__dict__["torch"] for m in modules]
    original_type = torch.Tensor.type
    try:
        for m in modules:
            m.torch = proxy  # type: ignore[attr-defined]
        torch.Tensor.type = _type_shim(original_type, placement)  # type: ignore[method-assign]
        yield placement
    finally:
        for m, t in zip(modules, saved, strict=True):
            m.torch = t  # type: ignore[attr-defined]
        if "type" in torch.Tensor.__dict__:
            del torch.Tensor.type
