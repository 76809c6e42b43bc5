"""A CPU platform for verl 0.9.1, registered through verl's own ``verl.plugin.platform``.

verl knows the nvidia, huawei and amd platforms; with no accelerator it falls back to
nvidia, whose ``current_device()`` is ``torch.cuda.current_device()`` (an assert on a CPU
build). :func:`install` registers :class:`PlatformCPU` under the name ``cpu`` with
``PlatformRegistry.register`` and makes it the process's platform with ``set_platform``,
before any verl engine module is imported; no verl source is edited. The platform's device
is ``cpu`` (``current_device()`` is ``"cpu"``, not an index), its collective backend
gloo, its memory statistics 0 (CPU has no allocator statistics), its profiler hooks no-ops.

Importing this module imports torch only (every module of the repository imports in
qualify's own environment); :func:`install` imports verl, inside verl's venv.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator
from typing import Any, Final

import torch

NAME: Final = "cpu"
ENGINE_DEVICE_ENV: Final = {"VERL_ENGINE_DEVICE": "cuda"}
"""verl registers its FSDP engines for cuda / npu only; this knob makes the registry pick
them (``verl.workers.engine.base.EngineRegistry``) while the tensors stay on CPU."""


def _zero(*_: Any, **__: Any) -> int:
    return 0


def _none(*_: Any, **__: Any) -> None:
    return None


def _device_module() -> types.ModuleType:
    """``torch.cpu`` plus the ``torch.cuda``-style calls verl makes on its device module."""
    mod = types.ModuleType("verl_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(mod, name, getattr(torch.cpu, name))
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated",
                 "memory_reserved"):
        setattr(mod, name, _zero)
    for name in ("empty_cache", "reset_peak_memory_stats", "ipc_collect", "set_device",
                 "manual_seed", "manual_seed_all"):
        setattr(mod, name, _none)
    mod.current_device = lambda: "cpu"  # type: ignore[attr-defined]
    mod.device_count = lambda: 1  # type: ignore[attr-defined]
    mod.is_available = lambda: True  # type: ignore[attr-defined]
    mod.mem_get_info = lambda *_: (0, 0)  # type: ignore[attr-defined]
    mod.get_device_name = lambda *_: "CPU"  # type: ignore[attr-defined]
    return mod


class PlatformCPU:
    """verl's platform interface on CPU (gloo); :func:`install` mixes it into ``PlatformBase``."""

    _module: Final = _device_module()

    @property
    def device_name(self) -> str:
        """``PlatformBase.device_name`` on CPU."""
        return "cpu"

    @property
    def vendor_name(self) -> str:
        """``PlatformBase.vendor_name`` on CPU."""
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        """``PlatformBase.device_module`` on CPU."""
        return self._module

    def is_available(self) -> bool:
        """``PlatformBase.is_available`` on CPU."""
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        """``PlatformBase.is_platform_available`` on CPU."""
        return True

    def current_device(self) -> str:
        """``"cpu"``: verl passes it as a ``device=`` (an index would name a CUDA device)."""
        return "cpu"

    def device_count(self) -> int:
        """``PlatformBase.device_count`` on CPU."""
        return 1

    def set_device(self, device_index: int) -> None:
        """``PlatformBase.set_device`` on CPU."""
        return

    def synchronize(self, device_index: int | None = None) -> None:
        """``PlatformBase.synchronize`` on CPU."""
        return

    def manual_seed(self, seed: int) -> None:
        """``PlatformBase.manual_seed`` on CPU."""
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """``PlatformBase.manual_seed_all`` on CPU."""
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        """``PlatformBase.set_allocator_settings`` on CPU."""
        return

    def empty_cache(self) -> None:
        """``PlatformBase.empty_cache`` on CPU."""
        return

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        """``PlatformBase.get_device_capability`` on CPU."""
        return None, None

    def communication_backend_name(self) -> str:
        """``PlatformBase.communication_backend_name`` on CPU."""
        return "gloo"

    def visible_devices_envvar(self) -> str:
        """``PlatformBase.visible_devices_envvar`` on CPU."""
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        """``PlatformBase.nvtx_range`` on CPU."""
        yield

    def profiler_start(self) -> None:
        """``PlatformBase.profiler_start`` on CPU."""
        return

    def profiler_stop(self) -> None:
        """``PlatformBase.profiler_stop`` on CPU."""
        return

    def ray_resource_name(self) -> str:
        """``PlatformBase.ray_resource_name`` on CPU."""
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        """``PlatformBase.ray_noset_envvars`` on CPU."""
        return []

    def is_ipc_supported(self) -> bool:
        """``PlatformBase.is_ipc_supported`` on CPU."""
        return False

    def cudart(self) -> Any:
        """``PlatformBase.cudart`` on CPU."""
        return None


def install() -> Any:
    """Register the CPU platform as ``cpu``, make it verl's platform, set the engine knob.

    The platform is ``PlatformCPU`` mixed into verl's ``PlatformBase`` (its abstract methods
    implemented by the mixin). Call before importing ``verl.workers`` (the engine registry
    and the device helpers read the platform on first use).

    Returns:
        The platform instance.
    """
    from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform

    os.environ.update(ENGINE_DEVICE_ENV)
    cls = PlatformRegistry.register(platform=NAME)(
        type("PlatformCPU", (PlatformCPU, PlatformBase), {}))
    platform = cls()
    set_platform(platform)
    return platform
