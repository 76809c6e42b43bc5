"""Whole decoder layers per device: where the reference puts a model on several devices.

docs/scale.md section 3: with several CUDA devices the reference's models are split by whole
decoder layers, so every matrix product and every reduction runs on one device in the order
it runs unplaced; only the activations between two layers (and their gradients) move. The
embedding sits on the first device, the final norm and the head with the last layer (a head
tied to the embedding stays with the embedding).

- :func:`assign_layers` (pure, no torch): each layer's device, contiguous, under per-device
  caps, the fullest device as light as any contiguous assignment makes it.
- :func:`stage_assignment`: the assignment the reference stage uses, from the parameters'
  element counts (:func:`parameter_counts` of a model; ``qualify plan`` counts the same
  elements from the contract's shapes and takes its devices' peaks from this function,
  :mod:`qualify.reference.plan`).
- :func:`place_model`: moves a Hugging Face Llama / Qwen3 model's modules to their devices and
  hooks each placed module to take its inputs on its device; the model's outputs come back to
  the device of its inputs, so the caller's loss code is unchanged.
- :func:`place_for_devices`: places a model across given devices, or every CUDA device when
  there are several. The reference stage places its models through
  :mod:`qualify.reference.devices`.

The CUDA path has not run on a GPU: on CPU the tests place models across devices that are all
``cpu`` (the same hooks and moves; outputs and gradients bitwise those of the unplaced
model, ``tests/test_placement.py``; the whole reference stage, ``tests/test_reference_devices.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["assign_layers", "device_loads", "layer_bytes", "parameter_counts", "place_for_devices",
           "place_model", "stage_assignment"]


def _fits(layers: Sequence[int], caps: Sequence[float], first: int,
          last: int) -> list[int] | None:
    """Greedy contiguous fill, the head glued to the last layer; ``None`` if it fails.

    Each device takes as many further layers as fit. Greedy is exact for feasibility:
    filling a device as far as it goes never leaves the later devices more to hold.
    """
    out: list[int] = []
    dev, load = 0, float(first)
    if dev >= len(caps) or load > caps[0]:
        return None
    n = len(layers)
    for k, b in enumerate(layers):
        need = b + (last if k == n - 1 else 0)
        while load + need > caps[dev]:
            dev, load = dev + 1, 0.0
            if dev >= len(caps):
                return None
        out.append(dev)
        load += need
    if n == 0 and first + last > caps[0]:
        return None
    return out


def assign_layers(layers: Sequence[int], caps: Sequence[float], *, first: int = 0,
                  last: int = 0) -> list[int]:
    """The device of each decoder layer: whole layers, in order, under each device's cap.

    Among the contiguous assignments that fit, one whose fullest device is as light as any
    (binary search on a common ceiling under the caps).

    Args:
        layers: each decoder layer's bytes, in order.
        caps: each device's bytes (``math.inf`` for no cap), at least one device.
        first: bytes only the first device holds (the embedding).
        last: bytes the last layer's device holds besides it (final norm, head, logits).

    Returns:
        ``[device index]`` per layer, non-decreasing.

    Raises:
        ValueError: no device, a negative size, or nothing fits under the caps (the message
            names the first thing that does not fit).
    """
    if not caps:
        raise ValueError("assign_layers: no device")
    if min([first, last, *layers]) < 0:
        raise ValueError("assign_layers: negative bytes")
    best = _fits(layers, caps, first, last)
    if best is None:
        if first > caps[0]:
            raise ValueError(f"the embedding ({first} bytes) does not fit the first device "
                             f"({caps[0]} bytes)")
        raise ValueError(f"{len(layers)} layers of up to {max(layers, default=0)} bytes, the "
                         f"embedding ({first}) and the head ({last}) do not fit "
                         f"{len(caps)} device(s) of {', '.join(str(c) for c in caps)} bytes")
    lo, hi = max([first, *layers], default=0), first + last + sum(layers)
    while lo < hi:
        mid = (lo + hi) // 2
        got = _fits(layers, [min(c, mid) for c in caps], first, last)
        if got is None:
            lo = mid + 1
        else:
            hi, best = mid, got
    return best


def device_loads(layers: Sequence[int], assignment: Sequence[int], devices: int, *,
                 first: int = 0, last: int = 0) -> list[int]:
    """Bytes on each device under ``assignment`` (:func:`assign_layers`)."""
    loads = [0] * devices
    loads[0] += first
    for b, d in zip(layers, assignment, strict=True):
        loads[d] += b
    loads[assignment[-1] if assignment else 0] += last
    return loads


def layer_bytes(model: nn.Module, per_element: float = 1.0) -> tuple[list[int], int, int]:
    """``(per decoder layer, embedding, final norm and head)`` bytes of ``model``.

    Its parameters' and buffers' storage times ``per_element`` (the bytes the caller's run
    holds per stored byte: 2 for FP32 weights and their gradients).
    """
    backbone: Any = model.get_submodule("model")

    def size(m: nn.Module) -> int:
        n = sum(p.numel() * p.element_size() for p in m.parameters())
        n += sum(b.numel() * b.element_size() for b in m.buffers())
        return math.ceil(n * per_element)

    layers = [size(layer) for layer in backbone.layers]
    first = size(backbone.embed_tokens) + size(backbone.rotary_emb)
    head = [m for n, m in model.named_children() if n != "model"]
    last = size(backbone.norm) + sum(size(m) for m in head)
    return layers, first, last


def parameter_counts(model: nn.Module) -> tuple[list[int], int, int]:
    """``(per decoder layer, embedding, final norm and head)`` parameter elements of ``model``.

    Each parameter counted once (a head tied to the embedding counts with the embedding);
    buffers are not counted. ``qualify plan`` counts the same elements from the contract's
    shapes (:meth:`qualify.reference.plan_core.ModelShape.params`).
    """
    backbone: Any = model.get_submodule("model")
    seen: set[int] = set()

    def count(m: nn.Module) -> int:
        n = 0
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        return n

    first = count(backbone.embed_tokens)
    layers = [count(layer) for layer in backbone.layers]
    last = count(backbone.norm) + sum(count(m) for n, m in model.named_children()
                                      if n != "model")
    return layers, first, last


def stage_assignment(layers: Sequence[int], first: int, last: int, devices: int) -> list[int]:
    """The reference stage's device of each decoder layer (module docstring).

    :func:`assign_layers` over parameter element counts (:func:`parameter_counts`), every
    device uncapped: the fullest device as light as any contiguous assignment makes it.
    Whether the devices' memory holds it is the plan's check (:mod:`qualify.reference.plan`),
    which computes its device peaks under this assignment.

    Raises:
        ValueError: ``devices < 1`` or a negative count.
    """
    return assign_layers(layers, [math.inf] * devices, first=first, last=last)


def _to(x: Any, device: torch.device) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(_to(v, device) for v in x)
    if isinstance(x, list):
        return [_to(v, device) for v in x]
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def place_model(model: nn.Module, devices: Sequence[str | torch.device],
                assignment: Sequence[int]) -> list[Any]:
    """Put a Llama / Qwen3 model's layers on ``devices[assignment[i]]`` (module docstring).

    The embedding and rotary embedding on ``devices[0]``, decoder layer ``i`` on
    ``devices[assignment[i]]``, the final norm and the head (``lm_head`` or ``score``) with
    the last layer (a head sharing a parameter with the embedding on ``devices[0]``). Each
    placed module gets a forward pre-hook that moves its tensor arguments to its device, and
    so does the backbone (``model.model``: its masks and positions are built on
    ``devices[0]``); the model a forward hook that moves ``logits`` back to the device of
    ``input_ids``.

    Args:
        model: a ``*ForCausalLM`` / ``*ForTokenClassification`` /
            ``*ForSequenceClassification`` with a ``model`` backbone.
        devices: the devices, at least one.
        assignment: per decoder layer, an index into ``devices`` (:func:`assign_layers`).

    Returns:
        The hook handles (``handle.remove()`` removes a hook; the modules stay placed).

    Raises:
        ValueError: ``assignment`` does not have one entry per layer, or an index is out of
            range.
    """
    import torch

    backbone: Any = model.get_submodule("model")
    devs = [torch.device(d) for d in devices]
    if len(assignment) != len(backbone.layers) or not all(
            0 <= a < len(devs) for a in assignment):
        raise ValueError(f"place_model: assignment {list(assignment)} is not one device index "
                         f"below {len(devs)} per each of {len(backbone.layers)} layers")
    tail = devs[assignment[-1]] if assignment else devs[0]
    handles: list[Any] = []

    def hook(module: nn.Module, device: torch.device) -> None:
        def pre(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            return _to(args, device), _to(kwargs, device)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))

    def put(module: nn.Module, device: torch.device) -> None:
        module.to(device)
        hook(module, device)

    embedding = {id(p) for p in backbone.embed_tokens.parameters()}
    # Every (module, name) of each parameter: a shared one (a tied head) is one Parameter
    # again after the moves (a move that cannot set .data, e.g. to ``meta``, makes a new one).
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for pname, prm in mod._parameters.items():
            if prm is not None:
                owners.setdefault(id(prm), []).append((mod, pname))
    hook(backbone, devs[0])
    put(backbone.embed_tokens, devs[0])
    put(backbone.rotary_emb, devs[0])
    for layer, a in zip(backbone.layers, assignment, strict=True):
        put(layer, devs[a])
    put(backbone.norm, tail)
    for name, child in model.named_children():
        if name != "model":
            tied = any(id(p) in embedding for p in child.parameters())
            put(child, devs[0] if tied else tail)
    for refs in owners.values():
        first, first_name = refs[0]
        for mod, pname in refs[1:]:
            mod._parameters[pname] = first._parameters[first_name]

    def back(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and getattr(out, "logits", None) is not None:
            out.logits = out.logits.to(ids.device)
        return out

    handles.append(model.register_forward_hook(back, with_kwargs=True))
    return handles


def place_for_devices(model: nn.Module, devices: Sequence[str] | None = None
                      ) -> list[int] | None:
    """Place ``model`` across ``devices`` by :func:`stage_assignment` (:func:`place_model`).

    Args:
        model: a Llama / Qwen3 role model.
        devices: the devices (``cpu`` or ``cuda:N``); ``None``: every CUDA device when torch
            sees several, else nothing is placed.

    Returns:
        The assignment (device index per decoder layer), or ``None`` when nothing was placed.
    """
    import torch

    if devices is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n <= 1:
            return None
        devices = [f"cuda:{i}" for i in range(n)]
    layers, first, last = parameter_counts(model)
    assignment = stage_assignment(layers, first, last, len(devices))
    place_model(model, devices, assignment)
    return assignment
