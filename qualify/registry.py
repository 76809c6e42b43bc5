"""The engine registry: one generic lazy registry for trainer engines, samplers and rollouts.

Modelled on lm-evaluation-harness ``lm_eval/api/registry.py``: entries are registered as
lazy ``"module:attr"`` strings, so ``import qualify.registry`` imports no engine (nor
``torch.distributed``). Each engine folder declares its own :class:`EngineSpec` in
``harnesses/<engine>/spec.py`` (its harness entry, parallel axes, number-changing options,
distributions); a new engine is that folder plus one line of :data:`BUILTIN_ENGINES`.
Looking a name up imports only that light ``spec`` module; the harness module itself is
imported only by :meth:`EngineSpec.load`, normally only inside the ranks a launcher starts
(and by the warm launcher, :mod:`qualify.candidate.warm`, before it forks them).

:class:`Registry` is the one implementation: lazy strings or ready objects, entry-point
groups for packages outside this repository, duplicate names refused, the loaded object's
type and name checked, and an unknown name answered with "did you mean ...?" and the list.
Two instances serve the stages:

- :data:`ENGINES`: trainer engines and candidate samplers (``matrix.engines``,
  ``sampler.engine``); entry points :data:`ENGINE_ENTRY_POINT_GROUP` (``qualify.engines``,
  value = ``"module:attr"`` of an :class:`EngineSpec`) and, for harnesses that only give
  their program, :data:`HARNESS_ENTRY_POINT_GROUP` (``qualify.harnesses``, value = the
  harness's ``main(argv) -> int``; the spec gets the default TP axis and no options).
- :data:`ROLLOUT_BACKENDS`: reference-stage rollout backends (``sampling.engine``); entry
  points :data:`ROLLOUT_ENTRY_POINT_GROUP` (``qualify.rollout_backends``).
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import importlib
import importlib.metadata
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Generic, Literal, TypeVar

from qualify.errors import ContractError, HarnessError, QualifyError, UsageError
from qualify.lanes import BF16_STYLES
from qualify.protocol import HarnessCell
from qualify.resources import import_repo_module

ENGINE_ENTRY_POINT_GROUP: Final = "qualify.engines"
HARNESS_ENTRY_POINT_GROUP: Final = "qualify.harnesses"
ROLLOUT_ENTRY_POINT_GROUP: Final = "qualify.rollout_backends"
ENTRY_POINT_GROUP: Final = HARNESS_ENTRY_POINT_GROUP
"""The entry-point group of harness programs (kept under its old name)."""
WorldSizeRule = Literal["actor_tp+critic_tp", "(actor_tp+critic_tp)*dp", "rollout_tp"]
EngineKind = Literal["trainer", "sampler", "rollout"]
TOPOLOGY_AXIS: Final = "tp"
"""The axis whose per-role degrees come from the contract's topologies (``actor_tp``...)."""
BASE_DEGREE: Final = 1
"""The base degree of every parallel axis (no parallelism along it)."""
DEFAULT_INSTALL_HINT: Final = "see README 'Engines'"
"""The end of an engine's "not installed" reason when its spec gives no ``install_hint``."""
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_ENTRY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Axis:
    """A parallel axis of an engine: its name in cell ids and the degrees it runs.

    A cell's id carries ``-{name}{degree}`` for each axis (``-tp2``, ``-dp2``); the axis
    :data:`TOPOLOGY_AXIS` takes its per-role degree from the contract's topologies, every
    other axis from ``matrix.engine_options.<engine>.<name>`` (default: the base degree).

    Attributes:
        name: axis name (``tp``, ``dp``), lowercase.
        degrees: the degrees the engine runs (positive, distinct; must hold
            :data:`BASE_DEGREE`, the degree comparisons across degrees are made against).
        description: one line for listings.
    """

    name: str
    degrees: tuple[int, ...]
    description: str = ""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise HarnessError(f"axis name {self.name!r}: must match {_NAME.pattern}")
        if (not self.degrees or len(set(self.degrees)) != len(self.degrees)
                or any(type(d) is not int or d < 1 for d in self.degrees)):
            raise HarnessError(f"axis {self.name!r}: degrees {self.degrees!r} must be distinct "
                               f"positive integers")
        if BASE_DEGREE not in self.degrees:
            raise HarnessError(f"axis {self.name!r}: degrees {self.degrees!r} must include the "
                               f"base degree {BASE_DEGREE}")


TP_AXIS: Final = Axis(name=TOPOLOGY_AXIS, degrees=(1, 2, 4, 8), description="tensor parallel")
"""The default axes of an engine: tensor parallelism at TP 1, 2, 4, 8."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineOption:
    """An engine option that changes the numbers (a variant axis of the matrix).

    The contract lists the values to qualify in
    ``matrix.engine_options.<engine>.<name>``; each value becomes one variant, carried in
    the cell's options as ``{key: value}`` and in its id as ``-{key}{value}`` (DeepSpeed:
    ``zero_stage = [0, 1]`` gives ``{"zero": 0}`` and ``...-zero0-...``).

    Attributes:
        name: field name in the contract (``zero_stage``).
        key: key in the cell's options and prefix of its id fragment (``zero``).
        values: the allowed values (integers).
        default: the values qualified when the contract does not name the option.
        description: one line for listings.
    """

    name: str
    key: str
    values: tuple[int, ...]
    default: tuple[int, ...]
    description: str = ""

    def __post_init__(self) -> None:
        for what, text in (("name", self.name), ("key", self.key)):
            if not _NAME.match(text):
                raise HarnessError(f"option {what} {text!r}: must match {_NAME.pattern}")
        if not self.values or any(type(v) is not int for v in self.values):
            raise HarnessError(f"option {self.name!r}: values {self.values!r} must be a "
                               f"non-empty tuple of integers")
        bad = [v for v in self.default if v not in self.values]
        if not self.default or bad:
            raise HarnessError(f"option {self.name!r}: default {self.default!r} must be a "
                               f"non-empty subset of {self.values!r}")

    def tag(self, value: int) -> str:
        """The id fragment of ``value`` (``zero1``)."""
        return f"{self.key}{value}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineSpec:
    """One engine: where its harness lives, what it needs, its axes and its options.

    Attributes:
        name: engine name used in contracts and cell ids (``torch_tp``).
        entry: ``"module:attr"`` of the harness entry point ``main(argv) -> int`` (a
            rollout backend: its class); the module also runs as ``python -m module ...``.
        kind: ``trainer`` (runs the PPO update), ``sampler`` (the candidate sampler cells)
            or ``rollout`` (a reference-stage rollout backend).
        axes: the parallel axes, in cell-id order; a trainer must have
            :data:`TOPOLOGY_AXIS` (the topologies place its roles by TP).
        options: the number-changing options, in cell-id order.
        distributions: distributions (PyPI names) whose versions the environment record
            should carry for this engine.
        world_size_rule: how many ranks a launch needs: ``actor_tp+critic_tp``,
            ``(actor_tp+critic_tp)*dp`` (each role on a ``dp x tp`` mesh, ``dp`` =
            ``cell.options["dp"]``, default 1) or ``rollout_tp``
            (``cell.options["rollout_tp"]``, default 1).
        needs_cuda: the engine cannot run on CPU; cells are ``NOT_RUN`` without CUDA.
        cpu_env: environment variables a CPU launch needs (``DS_ACCELERATOR=cpu``).
        private_dirs: environment variables naming a directory the engine fills with
            files it never removes (vLLM's ZeroMQ IPC sockets, ``VLLM_RPC_BASE_PATH``),
            each with the name prefix of its directory. A sampler's harness process
            (:mod:`qualify.candidate.sampler_stage`) and a rollout backend's child (the
            backend's own doing) get each one set to a fresh directory, removed once the
            process has ended, unless the user's environment sets it
            (:func:`qualify.privatedirs.private_dirs`); trainer launches do not read it.
        imports_under: environment variables a sampler's harness sets itself before its
            first import (the vLLM harness's ``OMP_NUM_THREADS=1``): the fork server
            (:mod:`qualify.candidate.forkserver`) compares these, not the launch's, with the
            environment its own imports ran under.
        requires: top-level modules the harness imports (probed with
            :func:`importlib.util.find_spec`, never imported): a missing one makes the
            engine's cells ``NOT_RUN`` ("not installed"), not an ``ERROR``.
        groups_variants: the harness runs every precision x options variant of one
            topology in one launch (:attr:`qualify.protocol.HarnessCell.variants`), so
            that one process group serves several cells (engines whose start is costly).
        resumes: the harness runs ``cell.json`` ``resume`` (:attr:`qualify.protocol
            .HarnessCell.resume`: checkpoint after round k in the engine's own format, restore
            in a fresh launch); resume cells of an engine without it are ``NOT_RUN``.
        groups_topologies: with ``groups_variants``, one launch also carries every
            topology of the same world size (each variant names its own ``actor_tp`` /
            ``critic_tp``; the harness builds each topology's role groups inside the
            launch): one launch per world size instead of one per topology (issue #17).
        warm_imports: modules the warm launcher (:mod:`qualify.candidate.warm`) imports
            once, before it forks a CPU launch's ranks, beyond the harness module and the
            model classes (the engine modules the harness imports lazily); imported only
            there, never by qualify itself.
        bf16_style: how the engine trains at BF16 (:mod:`qualify.lanes`): ``params``
            (BF16 parameters with FP32 master weights born from the checkpoint),
            ``castmasters`` (BF16 parameters with FP32 master weights born from the
            BF16-cast parameters) or ``autocast`` (FP32 parameters under
            ``torch.autocast``); its BF16 cells are compared with the HF reference run of
            the same style, under that style's controls.
        diverge: the harness takes ``cell.json`` ``probe`` (layer probes in the HF layout,
            ``harnesses/layer_probe.py``), so ``qualify diverge`` can rerun its cells;
            other engines' cells are refused there with one line.
        algorithms: the algorithm variants beyond the protocol's base update the harness
            implements, as ``fnmatch`` patterns over
            :meth:`qualify.contract.AlgorithmSpec.variants` (``policy_loss=gspo``,
            ``clip_ratio_high=*``); a contract using one it does not match makes every
            cell of the engine ``NOT_RUN`` naming the variant (:meth:`unavailable_reason`).
        install_hint: how to make the engine runnable where its ``requires`` are missing
            (``build it with `bash scripts/install_trl.sh` and run with --launcher
            trl=.venv-trl/bin/python``): the end of that ``NOT_RUN`` reason
            (:meth:`unavailable_reason`); empty: :data:`DEFAULT_INSTALL_HINT`.
        description: one line for listings and reports.
        source: ``builtin`` or the distribution that declared the entry point.

    Raises:
        HarnessError: a malformed name or entry, duplicate axis or option names, or a
            trainer without the topology axis.
    """

    name: str
    entry: str
    kind: EngineKind = "trainer"
    axes: tuple[Axis, ...] = (TP_AXIS,)
    options: tuple[EngineOption, ...] = ()
    distributions: tuple[str, ...] = ()
    world_size_rule: WorldSizeRule = "actor_tp+critic_tp"
    needs_cuda: bool = False
    cpu_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    private_dirs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    imports_under: Mapping[str, str] = dataclasses.field(default_factory=dict)
    requires: tuple[str, ...] = ()
    groups_variants: bool = False
    resumes: bool = False
    groups_topologies: bool = False
    warm_imports: tuple[str, ...] = ()
    bf16_style: str = "params"
    diverge: bool = False
    algorithms: tuple[str, ...] = ()
    install_hint: str = ""
    description: str = ""
    source: str = "builtin"

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise HarnessError(f"engine name {self.name!r}: must match {_NAME.pattern}")
        if not _ENTRY.match(self.entry):
            raise HarnessError(f"engine {self.name!r}: entry {self.entry!r} is not "
                               f"'package.module:attr'")
        fields = ([a.name for a in self.axes] + [o.name for o in self.options])
        keys = [a.name for a in self.axes] + [o.key for o in self.options]
        for what, names in (("axis and option names", fields), ("id fragments", keys)):
            if len(set(names)) != len(names):
                raise HarnessError(f"engine {self.name!r}: duplicate {what} {names}")
        if self.bf16_style not in BF16_STYLES:
            raise HarnessError(f"engine {self.name!r}: bf16_style {self.bf16_style!r} is not "
                               f"one of {BF16_STYLES}")
        if self.kind == "trainer" and self.axis(TOPOLOGY_AXIS) is None:
            raise HarnessError(f"engine {self.name!r}: a trainer needs the "
                               f"{TOPOLOGY_AXIS!r} axis (the topologies place its roles)")

    @property
    def capabilities(self) -> tuple[str, ...]:
        """What the harness can do beyond one plain launch, by name, for listings.

        ``groups_variants``, ``groups_topologies``, ``resumes``, ``diverge`` (each a field
        of this spec) and ``cuda_only`` (:attr:`needs_cuda`), those that are true.
        """
        flags = (("groups_variants", self.groups_variants),
                 ("groups_topologies", self.groups_topologies), ("resumes", self.resumes),
                 ("diverge", self.diverge), ("cuda_only", self.needs_cuda))
        return tuple(name for name, on in flags if on)

    @property
    def module(self) -> str:
        """The harness module (``harnesses.torch_tp.harness``), run with ``python -m``."""
        return self.entry.split(":", 1)[0]

    def axis(self, name: str) -> Axis | None:
        """The axis called ``name``, or ``None``."""
        return next((a for a in self.axes if a.name == name), None)

    def option(self, name: str) -> EngineOption | None:
        """The option whose contract field is ``name``, or ``None``."""
        return next((o for o in self.options if o.name == name), None)

    @property
    def extra_axes(self) -> tuple[Axis, ...]:
        """The axes other than :data:`TOPOLOGY_AXIS` (their degrees come from the matrix)."""
        return tuple(a for a in self.axes if a.name != TOPOLOGY_AXIS)

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        """The TP degrees the engine runs (``(1,)`` without a TP axis)."""
        tp = self.axis(TOPOLOGY_AXIS)
        return tp.degrees if tp is not None else (BASE_DEGREE,)

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
        return self.launch_world(cell.actor_tp, cell.critic_tp, cell.options)

    def launch_world(self, actor_tp: int, critic_tp: int, options: Mapping[str, Any]) -> int:
        """Processes a launch needs, from its per-role TP and its options.

        ``options``: the harness options and non-TP axis degrees (``cell.json``'s
        ``options``). By :attr:`world_size_rule`: ``rollout_tp`` (default 1),
        ``(actor_tp + critic_tp) * dp`` (``dp`` default :data:`BASE_DEGREE`) or
        ``actor_tp + critic_tp``. The candidate stage's launcher and ``qualify plan`` both
        count ranks here.
        """
        if self.world_size_rule == "rollout_tp":
            return int(options.get("rollout_tp", 1))
        if self.world_size_rule == "(actor_tp+critic_tp)*dp":
            return (actor_tp + critic_tp) * int(options.get("dp", BASE_DEGREE))
        return actor_tp + critic_tp

    def unavailable_reason(self, cuda_available: bool | None = None, *,
                           variants: Sequence[str] = ()) -> str | None:
        """Why this engine cannot run on this machine (a ``NOT_RUN`` reason), else ``None``.

        A module of ``requires`` missing gives ``engine 'NAME' is not installed here (no
        module 'M', no QUALIFY_LAUNCHER_NAME): HINT``, ``HINT`` the :attr:`install_hint`
        (default :data:`DEFAULT_INSTALL_HINT`). ``requires`` is not probed for an engine
        whose ranks run in another interpreter (``QUALIFY_LAUNCHER_<ENGINE>``,
        :mod:`qualify.candidate.interpreter`): a module missing there fails the launch,
        with the rank's log.

        Args:
            cuda_available: override the probe (tests); ``None`` asks torch (imported
                lazily, without ``torch.distributed``).
            variants: the contract's algorithm variants
                (:meth:`qualify.contract.AlgorithmSpec.variants`); one that
                :attr:`algorithms` does not match is the reason.

        Raises:
            UsageError: ``QUALIFY_LAUNCHER_<ENGINE>`` is set to a bad value.
        """
        from qualify.candidate.interpreter import engine_command, env_name

        lacking = [v for v in variants
                   if not any(fnmatch.fnmatchcase(v, p) for p in self.algorithms)]
        if lacking:
            return (f"engine {self.name!r} does not implement the contract's algorithm "
                    f"variant {', '.join(lacking)}")
        # ranks in another interpreter (a venv, a container): its modules are not ours to probe
        foreign = engine_command(self.name) is not None
        missing = [] if foreign else [m for m in self.requires if not _module_installed(m)]
        if missing:
            return (f"engine {self.name!r} is not installed here (no module "
                    f"{', '.join(repr(m) for m in missing)}, no {env_name(self.name)}): "
                    f"{self.install_hint or DEFAULT_INSTALL_HINT}")
        if not self.needs_cuda:
            return None
        if cuda_available is None:
            cuda_available = has_cuda()
        if cuda_available:
            return None
        return f"engine {self.name!r} needs CUDA for training; this machine has no CUDA device"


def has_cuda() -> bool:
    """Whether this machine has a CUDA device (torch imported lazily, never its distributed)."""
    import torch

    return bool(torch.cuda.is_available())


def _module_installed(name: str) -> bool:
    """Whether ``name`` is importable, without importing it (nor its parents' engines)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


EntryPointReader = Callable[[importlib.metadata.EntryPoint, str], "str | Any"]
"""Turns an entry point and its distribution's name into a registry target."""


def _lazy_value(ep: importlib.metadata.EntryPoint, dist: str) -> str:
    """The entry point's ``"module:attr"`` string, resolved on first lookup."""
    del dist
    return ep.value


class Registry(Generic[T]):
    """Names -> objects of type ``T``, each given as a lazy ``"module:attr"`` or an object.

    Built-in entries come first, then the entry points of the given groups (read once, on
    first use; reading them imports nothing). A lookup imports the entry's module, checks
    that the attribute is a ``T`` whose ``name`` is the registered name, and caches it.

    Args:
        kind: what an entry is, for messages (``engine``, ``rollout backend``).
        cls: the type a loaded entry must have.
        builtins: name -> ``"module:attr"`` or the object itself.
        groups: entry-point group -> reader of an entry point into a target.
        unknown_error: the error an unknown name raises.
        field: prefix of the unknown-name message (``sampling.engine``), or empty.
        listing: the words before the list of names in that message.
    """

    def __init__(self, *, kind: str, cls: type[T], builtins: Mapping[str, str | T],
                 groups: Mapping[str, EntryPointReader],
                 unknown_error: type[QualifyError] = UsageError, field: str = "",
                 listing: str = "") -> None:
        self.kind = kind
        self.cls = cls
        self.builtins = dict(builtins)
        self.groups = dict(groups)
        self.unknown_error = unknown_error
        self.field = field
        self.listing = listing or f"registered {kind}s"
        self._targets: dict[str, str | T] = {}
        self._sources: dict[str, str] = {}
        self._loaded: dict[str, T] = {}
        self._ready = False

    def _ensure(self) -> None:
        if self._ready:
            return
        self._ready = True
        for name, target in self.builtins.items():
            self._add(name, target, "builtin")
        for group, read in self.groups.items():
            for ep in importlib.metadata.entry_points(group=group):
                dist = ep.dist.name if ep.dist is not None else "unknown distribution"
                self._add(ep.name, read(ep, dist), dist)

    def _add(self, name: str, target: str | T, source: str) -> None:
        if name in self._targets:
            raise HarnessError(
                f"{self.kind} {name!r} is registered twice: {_show(self._targets[name])} "
                f"({self._sources[name]}) and {_show(target)} ({source})")
        if isinstance(target, str) and not _ENTRY.match(target):
            raise HarnessError(f"{self.kind} {name!r}: {target!r} ({source}) is not "
                               f"'package.module:attr'")
        self._targets[name] = target
        self._sources[name] = source

    def register(self, name: str, target: str | T, *, source: str = "builtin") -> None:
        """Add ``name`` (a lazy ``"module:attr"`` or the object).

        Raises:
            HarnessError: the name is taken (duplicates are refused, never overridden).
        """
        self._ensure()
        self._add(name, target, source)

    def names(self) -> tuple[str, ...]:
        """Every registered name, sorted (imports nothing)."""
        self._ensure()
        return tuple(sorted(self._targets))

    def __contains__(self, name: object) -> bool:
        self._ensure()
        return name in self._targets

    def get(self, name: str) -> T:
        """The object registered as ``name``, imported on first use.

        Raises:
            QualifyError: (``unknown_error``) unknown name; the message suggests the
                closest names and lists all.
            HarnessError: the entry cannot be imported, is not a ``T``, or names itself
                differently.
        """
        self._ensure()
        if name in self._loaded:
            return self._loaded[name]
        target = self._targets.get(name)
        if target is None:
            raise self.unknown_error(self.unknown_message(name))
        obj = self._resolve(name, target)
        self._loaded[name] = obj
        return obj

    def unknown_message(self, name: str) -> str:
        """The one-line message for an unknown ``name`` (did you mean, then the list)."""
        self._ensure()
        close = difflib.get_close_matches(name, list(self._targets), n=3, cutoff=0.5)
        hint = f" did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        where = f"{self.field}: " if self.field else ""
        return (f"{where}unknown {self.kind} {name!r};{hint} {self.listing}: "
                f"{', '.join(sorted(self._targets))}")

    def _resolve(self, name: str, target: str | T) -> T:
        source = self._sources[name]
        if isinstance(target, str):
            mod_name, attr = target.split(":", 1)
            try:
                obj: Any = getattr(import_repo_module(mod_name), attr)
            except (ImportError, AttributeError) as exc:
                raise HarnessError(f"{self.kind} {name!r}: cannot load {target} ({source}): "
                                   f"{exc}") from exc
        else:
            obj = target
        if not isinstance(obj, self.cls):
            raise HarnessError(f"{self.kind} {name!r}: {_show(target)} ({source}) is a "
                               f"{type(obj).__name__}, not a {self.cls.__name__}")
        own = getattr(obj, "name", name)
        if own != name:
            raise HarnessError(f"{self.kind} {name!r}: {_show(target)} ({source}) declares "
                               f"the name {own!r}")
        if (source != "builtin" and dataclasses.is_dataclass(obj)
                and getattr(obj, "source", source) == "builtin"):
            obj = dataclasses.replace(obj, source=source)  # type: ignore[type-var]
        result: T = obj
        return result

    def reset(self) -> None:
        """Forget every registration and every loaded entry (tests only)."""
        self._targets.clear()
        self._sources.clear()
        self._loaded.clear()
        self._ready = False


def _show(target: object) -> str:
    return target if isinstance(target, str) else getattr(target, "entry", repr(target))


def _harness_main(ep: importlib.metadata.EntryPoint, dist: str) -> EngineSpec:
    """A ``qualify.harnesses`` entry point (a harness ``main``) as a default spec."""
    return EngineSpec(name=ep.name, entry=ep.value, source=dist,
                      description=f"third-party harness from {dist}")


BUILTIN_ENGINES: Final[Mapping[str, str]] = {
    "torch_tp": "harnesses.torch_tp.spec:SPEC",
    "deepspeed": "harnesses.deepspeed.spec:SPEC",
    "megatron": "harnesses.megatron.spec:SPEC",
    "fsdp2": "harnesses.fsdp2.spec:SPEC",
    "vllm": "harnesses.vllm.spec:SPEC",
    "trl": "harnesses.trl.spec:SPEC",
    "verl": "harnesses.verl.spec:SPEC",
}
"""Engines of this repository: one line per engine folder (its ``spec`` module)."""

HF_ROLLOUT: Final = EngineSpec(
    name="hf", kind="rollout", entry="qualify.reference.sampling:HfRolloutBackend",
    axes=(Axis(name=TOPOLOGY_AXIS, degrees=(1,), description="no tensor parallelism"),),
    distributions=("transformers",),
    description="transformers generate at FP32 with sdpa attention (the independent "
                "fallback; TP 1 only)")
"""The rollout backend of qualify itself (no engine folder)."""

BUILTIN_ROLLOUT_BACKENDS: Final[Mapping[str, str | EngineSpec]] = {
    "hf": HF_ROLLOUT,
    "vllm": "harnesses.vllm.spec:ROLLOUT",
}
"""Rollout backends (``sampling.engine``): their specs, lazily."""

ENGINES: Final = Registry(
    kind="engine", cls=EngineSpec, builtins=BUILTIN_ENGINES,
    groups={ENGINE_ENTRY_POINT_GROUP: _lazy_value, HARNESS_ENTRY_POINT_GROUP: _harness_main})
"""Trainer engines and candidate samplers."""

ROLLOUT_BACKENDS: Final = Registry(
    kind="rollout backend", cls=EngineSpec, builtins=BUILTIN_ROLLOUT_BACKENDS,
    groups={ROLLOUT_ENTRY_POINT_GROUP: _lazy_value}, unknown_error=ContractError,
    field="sampling.engine", listing="known backends")
"""Reference-stage rollout backends; an entry's :attr:`EngineSpec.entry` is its class."""


def register_engine(spec: EngineSpec) -> EngineSpec:
    """Add an engine to :data:`ENGINES`.

    Raises:
        HarnessError: the name is taken (duplicates are refused, never overridden).
    """
    ENGINES.register(spec.name, spec, source=spec.source)
    return spec


def engine_names() -> tuple[str, ...]:
    """Every registered engine name, sorted (imports no spec)."""
    return ENGINES.names()


def get_engine(name: str) -> EngineSpec:
    """The engine registered as ``name`` (imports its ``spec`` module, never its harness).

    Raises:
        UsageError: unknown name; the message suggests the closest names and lists all.
        HarnessError: its spec cannot be imported or is not an :class:`EngineSpec` of
            that name.
    """
    spec = ENGINES.get(name)
    if spec.kind == "rollout":
        raise HarnessError(f"engine {name!r}: its spec is of kind 'rollout'; rollout "
                           f"backends register in ROLLOUT_BACKENDS")
    return spec


def rollout_backend_names() -> tuple[str, ...]:
    """Every registered rollout backend name, sorted (imports no spec)."""
    return ROLLOUT_BACKENDS.names()


def get_rollout_backend(name: str) -> EngineSpec:
    """The spec of the rollout backend ``name`` (``entry`` = its class, loaded lazily).

    Raises:
        ContractError: unknown name ("sampling.engine: unknown rollout backend ...", with
            the closest names and the list).
        HarnessError: its spec cannot be imported, or is not of kind ``rollout``.
    """
    spec = ROLLOUT_BACKENDS.get(name)
    if spec.kind != "rollout":
        raise HarnessError(f"rollout backend {name!r}: its spec is of kind {spec.kind!r}")
    return spec


def engine_distributions() -> tuple[str, ...]:
    """The distributions every registered engine and rollout backend declares, in order.

    For the environment record (versions through :mod:`importlib.metadata`); imports only
    the ``spec`` modules, never an engine.

    Raises:
        HarnessError: a registered spec cannot be imported.
    """
    out: dict[str, None] = {}
    for reg in (ENGINES, ROLLOUT_BACKENDS):
        for name in reg.names():
            out.update(dict.fromkeys(reg.get(name).distributions))
    return tuple(out)


def _reset_for_tests() -> None:
    """Forget every registration of both registries (tests only)."""
    ENGINES.reset()
    ROLLOUT_BACKENDS.reset()
