"""The engine registry: engine name -> lazy ``"module:attr"`` harness entry and its needs.

Modelled on lm-evaluation-harness ``lm_eval/api/registry.py``: engines are registered as
strings, so ``import qualify.registry`` imports no engine (nor ``torch.distributed``); the
harness module is imported only by :meth:`EngineSpec.load`, and normally only inside the
ranks that torchrun starts. Built-in engines are listed in :data:`BUILTIN_ENGINES`;
harnesses outside this repository register through the entry-point group
:data:`ENTRY_POINT_GROUP` (``[project.entry-points."qualify.harnesses"]``, name = engine,
value = ``"module:attr"`` of the harness's ``main(argv) -> int``). Duplicate names are
refused; an unknown name is answered with "did you mean ...?" and the list.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.metadata
import re
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

from qualify.errors import HarnessError, UsageError
from qualify.protocol import HarnessCell
from qualify.resources import import_repo_module

ENTRY_POINT_GROUP: Final = "qualify.harnesses"
WorldSizeRule = Literal["actor_tp+critic_tp", "rollout_tp"]
EngineKind = Literal["trainer", "sampler"]
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_ENTRY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """One engine: where its harness lives and what it needs to run.

    Attributes:
        name: engine name used in contracts and cell ids (``torch_tp``).
        entry: ``"module:attr"`` of the harness entry point ``main(argv) -> int``; the
            module also runs as ``python -m module CELL_JSON``.
        kind: ``trainer`` (runs the PPO update) or ``sampler`` (rollout engine).
        world_size_rule: how many ranks a launch needs: ``actor_tp+critic_tp`` or
            ``rollout_tp`` (``cell.options["rollout_tp"]``, default 1).
        needs_cuda: the engine cannot run on CPU; cells are ``NOT_RUN`` without CUDA.
        cpu_env: environment variables a CPU launch needs (``DS_ACCELERATOR=cpu``).
        requires: top-level modules the harness imports (probed with
            :func:`importlib.util.find_spec`, never imported): a missing one makes the
            engine's cells ``NOT_RUN`` ("not installed"), not an ``ERROR``.
        groups_variants: the harness runs every precision x options variant of one
            topology in one launch (:attr:`qualify.protocol.HarnessCell.variants`), so
            that one process group serves several cells (engines whose start is costly).
        description: one line for listings and reports.
        source: ``builtin`` or the distribution that declared the entry point.
    """

    name: str
    entry: str
    kind: EngineKind = "trainer"
    world_size_rule: WorldSizeRule = "actor_tp+critic_tp"
    needs_cuda: bool = False
    cpu_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    requires: tuple[str, ...] = ()
    groups_variants: bool = False
    description: str = ""
    source: str = "builtin"

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise HarnessError(f"engine name {self.name!r}: must match {_NAME.pattern}")
        if not _ENTRY.match(self.entry):
            raise HarnessError(f"engine {self.name!r}: entry {self.entry!r} is not "
                               f"'package.module:attr'")

    @property
    def module(self) -> str:
        """The harness module (``harnesses.torch_tp.harness``), run with ``python -m``."""
        return self.entry.split(":", 1)[0]

    def load(self) -> Callable[..., Any]:
        """Import the harness module and return its entry point (imports the engine!).

        Raises:
            HarnessError: the module or attribute cannot be imported.
        """
        mod_name, attr = self.entry.split(":", 1)
        try:
            fn = getattr(import_repo_module(mod_name), attr)
        except (ImportError, AttributeError) as exc:
            raise HarnessError(f"engine {self.name!r}: cannot load {self.entry}: {exc}") from exc
        if not callable(fn):
            raise HarnessError(f"engine {self.name!r}: {self.entry} is not callable")
        return fn

    def world_size(self, cell: HarnessCell) -> int:
        """Processes a launch of ``cell`` needs (see :attr:`world_size_rule`)."""
        if self.world_size_rule == "rollout_tp":
            return int(cell.options.get("rollout_tp", 1))
        return cell.world_size

    def unavailable_reason(self, cuda_available: bool | None = None) -> str | None:
        """Why this engine cannot run on this machine (a ``NOT_RUN`` reason), else ``None``.

        Args:
            cuda_available: override the probe (tests); ``None`` asks torch (imported
                lazily, without ``torch.distributed``).
        """
        missing = [m for m in self.requires if not _module_installed(m)]
        if missing:
            return (f"engine {self.name!r} is not installed here (no module "
                    f"{', '.join(repr(m) for m in missing)}); see README 'Engines'")
        if not self.needs_cuda:
            return None
        if cuda_available is None:
            import torch  # only to probe CUDA; never torch.distributed

            cuda_available = bool(torch.cuda.is_available())
        if cuda_available:
            return None
        return f"engine {self.name!r} needs CUDA for training; this machine has no CUDA device"


def _module_installed(name: str) -> bool:
    """Whether ``name`` is importable, without importing it (nor its parents' engines)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


BUILTIN_ENGINES: Final[tuple[EngineSpec, ...]] = (
    EngineSpec(name="torch_tp", entry="harnesses.torch_tp.harness:main",
               description="PyTorch-native tensor parallelism (DTensor, parallelize_module); "
                           "CPU (gloo) and CUDA (NCCL)"),
    EngineSpec(name="deepspeed", entry="harnesses.deepspeed.harness:main",
               cpu_env={"DS_ACCELERATOR": "cpu"}, requires=("deepspeed",),
               groups_variants=True,
               description="DeepSpeed ZeRO 0/1/2 + AutoTP; runs on CPU with DS_ACCELERATOR=cpu"),
    EngineSpec(name="megatron", entry="harnesses.megatron.harness:main",
               requires=("megatron",),
               description="Megatron-Core tensor parallelism; on CPU scoring only (its "
                           "optimizer needs CUDA: training metrics NOT_RUN)"),
    EngineSpec(name="vllm", entry="harnesses.vllm.harness:main", kind="sampler",
               world_size_rule="rollout_tp", requires=("vllm",),
               description="vLLM sampler (rollout engine, weight sync and rejection probes)"),
)
"""Engines of this repository (harness modules are imported only when launched)."""

class _Registry:
    """The registered engines, filled on first use (built-ins, then entry points)."""

    def __init__(self) -> None:
        self.specs: dict[str, EngineSpec] = {}
        self.loaded = False


_REGISTRY = _Registry()


def register_engine(spec: EngineSpec) -> EngineSpec:
    """Add an engine to the registry.

    Raises:
        HarnessError: the name is taken (duplicates are refused, never overridden).
    """
    _ensure_loaded()
    _add(spec)
    return spec


def _add(spec: EngineSpec) -> None:
    old = _REGISTRY.specs.get(spec.name)
    if old is not None:
        raise HarnessError(f"engine {spec.name!r} is registered twice: {old.entry} "
                           f"({old.source}) and {spec.entry} ({spec.source})")
    _REGISTRY.specs[spec.name] = spec


def _ensure_loaded() -> None:
    """Register the built-in engines, then the entry points (names only; nothing imported)."""
    if _REGISTRY.loaded:
        return
    _REGISTRY.loaded = True
    for spec in BUILTIN_ENGINES:
        _add(spec)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "unknown distribution"
        _add(EngineSpec(name=ep.name, entry=ep.value, source=dist,
                        description=f"third-party harness from {dist}"))


def engine_names() -> tuple[str, ...]:
    """Every registered engine name, sorted."""
    _ensure_loaded()
    return tuple(sorted(_REGISTRY.specs))


def get_engine(name: str) -> EngineSpec:
    """The engine registered as ``name``.

    Raises:
        UsageError: unknown name; the message suggests the closest names and lists all.
    """
    _ensure_loaded()
    spec = _REGISTRY.specs.get(name)
    if spec is not None:
        return spec
    close = difflib.get_close_matches(name, list(_REGISTRY.specs), n=3, cutoff=0.5)
    hint = f" did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise UsageError(f"unknown engine {name!r};{hint} registered engines: "
                     f"{', '.join(sorted(_REGISTRY.specs))}")


def _reset_for_tests() -> None:
    """Forget every registration (tests only)."""
    _REGISTRY.specs.clear()
    _REGISTRY.loaded = False
