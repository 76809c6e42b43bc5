"""Where the reference stage's models run: the one place that decides their devices.

Every model the reference stage loads for scoring, its updates and controls, the
round-to-round term and the clip-branch reruns comes from :func:`load_role`, which loads it
on the host (:mod:`qualify.models.roles`) and then places it as the active
:class:`ReferenceDevices` says (:func:`qualify.reference.placement.place_model`: whole decoder
layers per device, the embedding on the first, the final norm and the head with the last
layer). The rollout's sampler and the decode rows of ``distribution.json`` stay on the host.

Which devices (:func:`resolve`):

- ``$QUALIFY_REFERENCE_DEVICES`` set: its comma-separated list, each ``cpu`` or ``cuda:N``
  (one kind per list; ``cuda`` alone is every CUDA device). ``cpu,cpu,cpu`` runs the placed
  path on the host: the same hooks and moves as on CUDA, every module on the host. ``host``
  alone: nothing placed, even where CUDA is present (the stage as it runs without CUDA).
- else, CUDA present: every CUDA device (one device: the whole model on it).
- else: none; the models stay where they load (the host), untouched.

Placed models give their logits (values) back to the device of their ``input_ids``
(:func:`~qualify.reference.placement.place_model`'s hooks). The updates, the sensitivities
and the clip-branch passes give host inputs, so their per-token tensors and losses stay on
the host; scoring gives its inputs on the model's first device and copies its per-token
results to the host, as it always has. The parameters, their gradients and the clip-branch
``J_t`` stay with their layer; the AdamW state and the sensitivity copy too, or on the host
(:attr:`ReferenceDevices.optimizer_state`, read by the update through
:func:`optimizer_state`); what the stage seals from them is copied to the host where it is
taken (:mod:`qualify.reference.update`, :mod:`qualify.reference.branches`; the factored Gram
keeps its factors on the host, :mod:`qualify.reference.gram_factors`).

The assignment (:func:`qualify.reference.placement.stage_assignment`) balances the
parameters' element counts over the devices, uncapped: the devices' memory is the plan's
check (:mod:`qualify.reference.plan`, which computes its device peaks from the same
function), run before the stage writes anything, with the devices' own memory or
``$QUALIFY_REFERENCE_DEVICE_MEMORY`` (:func:`device_memory`; with it a ``cpu`` list is planned
as devices of that memory). The plan also chooses ``optimizer_state`` (on the host only when
the devices cannot hold the state), and the stage runs with it.

On CUDA, :func:`active` sets torch's numerics once for the stage and restores them after:
no TF32 (cuBLAS and cuDNN), FP32 matmul precision ``highest``, cuDNN deterministic and not
benchmarking, ``torch.use_deterministic_algorithms(True, warn_only=True)`` (deterministic
kernels where torch has them; a warning, not an error, where it has none, and each such op
recorded: :func:`recording_nondeterministic_kernels`) and
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless set (cuBLAS's deterministic workspace). BF16
lanes run as they do on the host (BF16 parameters or autocast, FP32 masters).

The CUDA path has not run on a GPU: on CPU, ``cpu,cpu,cpu`` runs every hook and move of it
(``tests/test_reference_devices.py``: the sealed tensors are bitwise those of the unplaced
run), but not a host copy of a CUDA tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Final

import torch
from torch import nn

from qualify.errors import ReferenceDataError, UsageError
from qualify.models import roles
from qualify.reference.placement import place_for_devices

__all__ = ["ENV", "GRADIENTS", "MEMORY_ENV", "OPTIMIZER_STATES", "ROUND2_STATES",
           "ReferenceDevices", "active", "check_memory_setting", "check_setting",
           "device_memory", "gradients", "load_role", "note_step", "optimizer_state", "parse",
           "parse_memory", "resolve", "round2_state"]

ENV: Final = "QUALIFY_REFERENCE_DEVICES"

_NONDETERMINISTIC: Final = re.compile(
    r"(?P<op>.+?) does not have a deterministic implementation, but you set "
    r"'torch\.use_deterministic_algorithms\(True, warn_only=True\)'", re.DOTALL)
"""torch's warning for a kernel without a deterministic implementation under ``warn_only``
(``at::Context::alertNotDeterministic``, ``torch._prims_common.alert_not_deterministic``)."""

MEMORY_ENV: Final = "QUALIFY_REFERENCE_DEVICE_MEMORY"
"""Each device's memory in GB (10^9 bytes) for the stage's plan check (:func:`device_memory`):
under it a ``cpu,cpu,...`` placement is planned as that many devices of that memory (the
device-budget mode on the host), and a CUDA placement with that memory instead of the
device's own."""

CUBLAS_DETERMINISTIC: Final = ":4096:8"
"""cuBLAS's workspace setting for reproducible results (CUDA toolkit docs, "Results
reproducibility"; torch raises in ``use_deterministic_algorithms`` mode without it)."""

OPTIMIZER_STATES: Final = ("device", "host")
"""Where a placed update keeps its AdamW moments and the sensitivity copy
(:attr:`ReferenceDevices.optimizer_state`)."""

GRADIENTS: Final = ("device", "host")
"""Where a placed update accumulates its gradients (:attr:`ReferenceDevices.gradients`)."""

ROUND2_STATES: Final = ("moments", "g1")
"""What the host AdamW keeps of a parameter between its first two steps
(:attr:`ReferenceDevices.round2_state`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ReferenceDevices:
    """The devices the reference stage places its models on.

    Attributes:
        devices: each device, ``cpu`` or ``cuda:N``, all of one kind, at least one.
        source: ``QUALIFY_REFERENCE_DEVICES`` (asked for) or ``cuda`` (every CUDA device
            torch sees, the default when CUDA is present).
        optimizer_state: ``device``: the AdamW moments and the sensitivity's ``saved`` copy
            live with their parameters' layers (``torch.optim.AdamW`` over the placed
            parameters); ``host``: both on the host, the AdamW step taken one parameter at a
            time there (:class:`qualify.reference.update.HostAdamW`,
            :meth:`qualify.reference.sensitivity.LossSensitivity.grad_norm`). The stage sets
            ``host`` when its plan says the devices cannot hold the state
            (:func:`qualify.reference.plan.build_plan`).
        gradients: ``device``: each update accumulates its gradients in the parameters'
            ``.grad``, with their layers; ``host``: streamed to the host as the backward
            completes each parameter's (:class:`qualify.reference.update._GradStream`) in
            every update run but the clip-branch reruns (their hook reads ``.grad``). Only
            with ``optimizer_state = "host"``. The stage sets ``host`` when its plan says the
            devices cannot hold the gradients either.
        round2_state: ``moments``: the host AdamW keeps both moments of every parameter from
            its first step on; ``g1``: between its first two steps only its first gradient,
            the moments rebuilt from it for the second
            (:class:`qualify.reference.update.HostAdamW`, bitwise). Only with
            ``optimizer_state = "host"``. The stage sets ``g1`` when its plan says the host
            needs the memory.

    Raises:
        ValueError: ``optimizer_state`` is not one of :data:`OPTIMIZER_STATES`, ``gradients``
            not one of :data:`GRADIENTS`, ``round2_state`` not one of :data:`ROUND2_STATES`,
            or ``gradients`` ``host`` or ``round2_state`` ``g1`` with the state on the devices.
    """

    devices: tuple[str, ...]
    source: str
    optimizer_state: str = "device"
    gradients: str = "device"
    round2_state: str = "moments"

    def __post_init__(self) -> None:
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"ReferenceDevices.optimizer_state: {self.optimizer_state!r}, "
                             f"expected one of {OPTIMIZER_STATES}")
        if self.gradients not in GRADIENTS:
            raise ValueError(f"ReferenceDevices.gradients: {self.gradients!r}, expected one "
                             f"of {GRADIENTS}")
        if self.gradients == "host" and self.optimizer_state != "host":
            raise ValueError("ReferenceDevices.gradients: host streaming needs "
                             "optimizer_state host (the step reads the host copies)")
        if self.round2_state not in ROUND2_STATES:
            raise ValueError(f"ReferenceDevices.round2_state: {self.round2_state!r}, expected "
                             f"one of {ROUND2_STATES}")
        if self.round2_state == "g1" and self.optimizer_state != "host":
            raise ValueError("ReferenceDevices.round2_state: g1 needs optimizer_state host "
                             "(the host AdamW keeps it)")

    @property
    def kind(self) -> str:
        """``cpu`` or ``cuda``."""
        return self.devices[0].split(":")[0]


@dataclasses.dataclass(slots=True)
class _Active:
    devices: ReferenceDevices
    placed: dict[str, dict[str, Any]]
    memory: dict[str, Any]


MEMORY_MEASURES: Final = {
    "cuda": "torch.cuda.max_memory_allocated of each device after each optimizer step (peak "
            "since the stage entered its devices)",
    "cpu": "bytes of the stepped role's parameters, gradients and device-kept AdamW moments "
           "on each device index after each optimizer step, the largest over the stage's "
           "steps (not an allocator peak: no activations, copies or temporaries; cpu devices "
           "share the host's memory)",
}
"""What ``reference_devices.memory.bytes`` measures, per device kind (:func:`note_step`)."""


_ACTIVE: ContextVar[_Active | None] = ContextVar("qualify_reference_devices", default=None)


def parse(value: str, *, cuda_count: int | None = None) -> tuple[str, ...]:
    """The device list of ``$QUALIFY_REFERENCE_DEVICES``.

    Args:
        value: ``cpu[,cpu...]``, ``cuda:N[,cuda:M...]``, ``cuda`` (every CUDA device) or
            ``host`` (nothing placed).
        cuda_count: CUDA devices torch sees (``None``: ask torch).

    Returns:
        The devices, in order; ``()`` for ``host``.

    Raises:
        UsageError: an empty entry, an unknown device, two kinds in one list, a CUDA device
            named twice or that torch does not see, or ``cuda`` without CUDA (one line naming
            the variable).
    """
    def refuse(why: str) -> UsageError:
        return UsageError(f"{ENV}={value!r}: {why}")

    if value.strip() == "host":
        return ()
    items = [v.strip() for v in value.split(",")]
    if any(not v for v in items):
        raise refuse("an empty entry; give devices separated by commas (cpu,cpu or "
                     "cuda:0,cuda:1)")
    for v in items:
        if v == "cpu" or re.fullmatch(r"cuda:(0|[1-9][0-9]*)", v, re.ASCII) or (
                v == "cuda" and len(items) == 1):
            continue
        raise refuse(f"{v!r} is not a device; each entry is cpu or cuda:N (N a decimal "
                     "index without leading zeros; cuda alone: every CUDA device; host "
                     "alone: nothing placed)")
    if len({v.split(":")[0] for v in items}) > 1:
        raise refuse("one device kind per list (cpu, or cuda:N)")
    twice = sorted({v for v in items if v.startswith("cuda:") and items.count(v) > 1})
    if twice:
        raise refuse(f"{', '.join(twice)} named twice: each CUDA device holds its own layers")
    if items[0].startswith("cuda"):
        n = (torch.cuda.device_count() if torch.cuda.is_available() else 0) \
            if cuda_count is None else cuda_count
        if items == ["cuda"]:
            if n == 0:
                raise refuse("torch sees no CUDA device")
            return tuple(f"cuda:{i}" for i in range(n))
        missing = [v for v in items if int(v.partition(":")[2]) >= n]
        if missing:
            raise refuse(f"{', '.join(missing)}: torch sees {n} CUDA device(s)")
    return tuple(items)


def check_setting(value: str, env: Mapping[str, str]) -> None:
    """:data:`qualify.settings.SETTINGS` check of ``$QUALIFY_REFERENCE_DEVICES``.

    Raises:
        UsageError: :func:`parse` refuses it.
    """
    parse(value)


def gb_bytes(text: str) -> int:
    """A number of GB (10^9 bytes) in bytes: the one grammar of every device-memory setting.

    Args:
        text: a positive, finite decimal number such as ``141`` or ``0.5`` (no exponent, no
            sign; surrounding blanks ignored).

    Returns:
        ``int(GB x 10^9)``, at least 1.

    Raises:
        ValueError: not such a number, or under one byte.
    """
    t = text.strip()
    gb = float(t) if re.fullmatch(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", t, re.ASCII) else math.nan
    if not 1 <= gb * 1e9 < math.inf:
        raise ValueError(f"{text!r}: a positive decimal number of GB (10^9 bytes) such as 141 "
                         "or 0.5, at least one byte")
    return int(gb * 1e9)


def parse_memory(value: str) -> int:
    """``$QUALIFY_REFERENCE_DEVICE_MEMORY`` in bytes (:func:`gb_bytes`).

    Raises:
        UsageError: :func:`gb_bytes` refuses it (one line naming the variable).
    """
    try:
        return gb_bytes(value)
    except ValueError:
        raise UsageError(f"{MEMORY_ENV}={value!r}: each device's memory in GB (10^9 bytes), a "
                         "positive decimal number such as 141 or 0.5") from None


def check_memory_setting(value: str, env: Mapping[str, str]) -> None:
    """:data:`qualify.settings.SETTINGS` check of ``$QUALIFY_REFERENCE_DEVICE_MEMORY``.

    Raises:
        UsageError: :func:`parse_memory` refuses it.
    """
    parse_memory(value)


def device_memory(env: Mapping[str, str] | None = None) -> int | None:
    """Each device's memory for the stage's plan, in bytes; ``None``: unset or empty.

    Raises:
        UsageError: a bad ``$QUALIFY_REFERENCE_DEVICE_MEMORY`` (:func:`parse_memory`).
    """
    value = (os.environ if env is None else env).get(MEMORY_ENV, "")
    return parse_memory(value) if value else None


def resolve(env: Mapping[str, str] | None = None) -> ReferenceDevices | None:
    """The stage's devices (module docstring); ``None``: the host, nothing placed.

    Raises:
        UsageError: a bad ``$QUALIFY_REFERENCE_DEVICES`` (:func:`parse`).
    """
    value = (os.environ if env is None else env).get(ENV, "")
    if value:
        devices = parse(value)
        return ReferenceDevices(devices, ENV) if devices else None
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return ReferenceDevices(tuple(f"cuda:{i}" for i in range(torch.cuda.device_count())),
                                "cuda")
    return None


def note_step(role: str, held: Callable[[], list[tuple[str, int]]]) -> None:
    """Record the devices' memory after an optimizer step (the record of :func:`active`).

    On CUDA each device's ``torch.cuda.max_memory_allocated``; on ``cpu`` devices the bytes
    ``held()`` gives per parameter name, summed by the device index the placement gave the
    parameter (``model.layers.N.``: layer ``N``'s; the embedding: the first; the rest: the last
    layer's), each device's largest over the steps. Outside :func:`active`, or for a role not
    placed, nothing (``held`` is not called).

    Args:
        role: the role stepped (the key of the record's ``placed``).
        held: ``[(parameter name, bytes kept on its device)]``, called only when needed.
    """
    state = _ACTIVE.get()
    if state is None:
        return
    seen: list[int] = state.memory["bytes"]
    if state.devices.kind == "cuda":
        for i, d in enumerate(state.devices.devices):
            seen[i] = max(seen[i], int(torch.cuda.max_memory_allocated(torch.device(d))))
        return
    placed = state.placed.get(role)
    if placed is None:
        return
    assignment: list[int] = placed["assignment"]
    per = [0] * len(seen)
    for name, nbytes in held():
        m = re.search(r"(?:^|\.)layers\.([0-9]+)\.", name)
        if m is not None:
            index = assignment[int(m.group(1))]
        elif "embed_tokens" in name or not assignment:
            index = 0
        else:
            index = assignment[-1]
        per[index] += nbytes
    for i, b in enumerate(per):
        seen[i] = max(seen[i], b)


def _active_setting(field: str, *, unplaced: str) -> str:
    """The active :class:`ReferenceDevices`' ``field`` inside :func:`active`, else ``unplaced``."""
    state = _ACTIVE.get()
    return unplaced if state is None else str(getattr(state.devices, field))


def optimizer_state() -> str:
    """Where the active devices keep the AdamW moments and the sensitivity copy.

    Returns:
        The active :class:`ReferenceDevices`' ``optimizer_state`` inside :func:`active`;
        ``device`` outside it or when nothing is placed (the unplaced stage: every tensor is on
        the host already, and its optimizer is ``torch.optim.AdamW`` over the parameters).
    """
    return _active_setting("optimizer_state", unplaced="device")


def round2_state() -> str:
    """What the active devices' host AdamW keeps between a parameter's first two steps.

    Returns:
        The active :class:`ReferenceDevices`' ``round2_state`` inside :func:`active`;
        ``moments`` outside it or when nothing is placed.
    """
    return _active_setting("round2_state", unplaced="moments")


def gradients() -> str:
    """Where the active devices' update runs accumulate their gradients.

    Returns:
        The active :class:`ReferenceDevices`' ``gradients`` inside :func:`active`; ``device``
        outside it or when nothing is placed.
    """
    return _active_setting("gradients", unplaced="device")


@contextlib.contextmanager
def _cuda_numerics() -> Iterator[dict[str, Any]]:
    """TF32 off, deterministic algorithms on, for the block; restored after."""
    initialized = torch.cuda.is_initialized()
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    fallbacks: list[str] = []
    try:
        with recording_nondeterministic_kernels(fallbacks):
            yield {"cuda_matmul_allow_tf32": False, "cudnn_allow_tf32": False,
               "float32_matmul_precision": "highest", "cudnn_deterministic": True,
                   "cudnn_benchmark": False, "deterministic_algorithms": "warn_only",
                   "cublas_workspace_config": os.environ["CUBLAS_WORKSPACE_CONFIG"],
                   # cuBLAS reads CUBLAS_WORKSPACE_CONFIG when the process first initialises
                   # CUDA: set here after that, it does not take effect
                   "cuda_initialized_before": initialized,
                   # filled while the block runs: the kernels that ran nondeterministically
                   "nondeterministic_kernels": fallbacks}
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, precision,
         torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, det, warn,
         cublas) = saved
        torch.set_float32_matmul_precision(precision)
        torch.use_deterministic_algorithms(det, warn_only=warn)
        if cublas is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


@contextlib.contextmanager
def recording_nondeterministic_kernels(into: list[str]) -> Iterator[None]:
    """Append to ``into`` each op torch ran without a deterministic implementation.

    Under ``torch.use_deterministic_algorithms(True, warn_only=True)`` torch warns (a
    ``UserWarning``, :data:`_NONDETERMINISTIC`) instead of raising when an op has no
    deterministic kernel; such an op may give different bits on a rerun, so the stage
    records it (``environment.json`` ``reference_devices.numerics.nondeterministic_kernels``)
    rather than leave it to a log. Each op is recorded and shown once, in the order first
    seen, whatever the warning filters say (the block shows these warnings ``always``); every
    other warning is shown as before. The warnings module's state is restored after.

    Args:
        into: the list to append the ops' names to (torch's ``caller``, e.g.
            ``index_add_cuda_``).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("always",
                                message=r".* does not have a deterministic implementation")
        shown = warnings.showwarning

        def show(message: Warning | str, category: type[Warning], filename: str,  # noqa: PLR0917 (warnings.showwarning's signature)
                 lineno: int, file: Any = None, line: str | None = None) -> None:
            match = _NONDETERMINISTIC.match(str(message))
            if match is not None:
                if match["op"] in into:
                    return
                into.append(match["op"])
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


@contextlib.contextmanager
def active(devices: ReferenceDevices | None) -> Iterator[dict[str, Any]]:
    """Place every model :func:`load_role` loads in the block on ``devices``.

    Yields:
        The environment document's ``reference_devices``, filled in as models are placed:
        ``kind`` (``host`` when ``devices`` is ``None``), ``source``, ``devices`` (each with
        its name: the CUDA device's, or ``cpu``), ``numerics`` (the CUDA settings, ``None``
        off CUDA), ``optimizer_state`` (:attr:`ReferenceDevices.optimizer_state`; ``device``
        when nothing is placed), ``gradients`` (:attr:`ReferenceDevices.gradients`; placed
        stages only), ``round2_state`` (:attr:`ReferenceDevices.round2_state`; placed
        stages only), ``placed``: ``{role: {"assignment": [device index per
        decoder layer], "layers": n}}``, one entry per role placed (the same assignment every
        time a role is loaded: it depends on the model's shape only), and ``memory``
        (``None`` when nothing is placed): ``{"measure": MEMORY_MEASURES[kind], "bytes":
        [per device]}``, filled in after each optimizer step (:func:`note_step`).
    """
    record: dict[str, Any] = {"kind": "host", "source": None, "devices": [],
                              "numerics": None, "optimizer_state": "device", "placed": {},
                              "memory": None}
    if devices is None:
        yield record
        return
    record.update(kind=devices.kind, source=devices.source,
                  optimizer_state=devices.optimizer_state, gradients=devices.gradients,
                  round2_state=devices.round2_state,
                  devices=[{"device": d, "name": _device_name(d)} for d in devices.devices])
    record["memory"] = {"measure": MEMORY_MEASURES[devices.kind],
                        "bytes": [0] * len(devices.devices)}
    state = _Active(devices, record["placed"], record["memory"])
    if devices.kind == "cuda":
        for d in devices.devices:
            torch.cuda.reset_peak_memory_stats(torch.device(d))
    token = _ACTIVE.set(state)
    try:
        with (_cuda_numerics() if devices.kind == "cuda" else contextlib.nullcontext(None)
              ) as numerics:
            record["numerics"] = numerics
            yield record
    finally:
        _ACTIVE.reset(token)


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return str(torch.cuda.get_device_name(torch.device(device)))
    return "cpu"


def place(model: nn.Module, role: str) -> nn.Module:
    """Place ``model`` on the active devices (:func:`active`); outside it, return it as is.

    Args:
        model: a loaded Llama / Qwen3 role model (on the host).
        role: ``actor``, ``critic`` or ``reward`` (the key of the record's ``placed``).

    Returns:
        ``model``, placed in place.

    Raises:
        ReferenceDataError: the role is placed with another assignment than before (the
            assignment is a function of the shape: a defect).
    """
    state = _ACTIVE.get()
    if state is None:
        return model
    assignment = place_for_devices(model, state.devices.devices)
    assert assignment is not None
    entry = {"assignment": list(assignment), "layers": len(assignment)}
    seen = state.placed.setdefault(role, entry)
    if seen != entry:
        raise ReferenceDataError(f"reference devices: {role} placed as {entry} after {seen}")
    return model


def load_role(role: str, path: str | Path, *, dtype: torch.dtype, attn_implementation: str,
              requires_grad: bool) -> nn.Module:
    """Load one role model (:mod:`qualify.models.roles`) and :func:`place` it.

    Args:
        role: ``actor`` (the policy and the frozen reference policy), ``critic`` or
            ``reward``.
        path: the role's directory of the prepared bundle.
        dtype: as :func:`qualify.models.roles.load_actor`.
        attn_implementation: as :func:`qualify.models.roles.load_actor`.
        requires_grad: as :func:`qualify.models.roles.load_actor`.

    Raises:
        ModelSourceError: as the loaders.
        ValueError: an unknown role.
    """
    loaders = {"actor": roles.load_actor, "critic": roles.load_critic,
               "reward": roles.load_reward}
    if role not in loaders:
        raise ValueError(f"load_role: unknown role {role!r}")
    model = loaders[role](path, dtype=dtype, attn_implementation=attn_implementation,
                          requires_grad=requires_grad)
    return place(model, role)
