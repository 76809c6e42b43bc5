"""The update parts of an engine that steps a plain ``torch.optim`` optimizer itself.

A harness whose role holds one ``nn.Module``, a ``torch.optim`` optimizer over its trainable
parameters (plain tensors or ``DTensor`` shards) and an lr scheduler stepped once after each
optimizer step derives its :class:`~qualify_harness.driver.Engine` from
:class:`TorchOptimEngine`: the pre-clip gradients, ``torch.nn.utils.clip_grad_norm_``, the
master weights, the applied lr, the step, the scheduler step, ``zero_grad`` and the
optimizer state come from here, read the same way for every such engine. What the engine
dictates (its forwards, gradient reductions, replica check, which parameters are gathered)
stays in the engine.

The ``full_*`` functions gather each tensor to its full, unsharded FP32 CPU copy
(``DTensor.full_tensor()``: a collective over the tensor's mesh, so every rank of it calls
them with the same parameters, in the same order).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from qualify_harness.driver import Engine
from qualify_harness.errors import OutputError
from qualify_harness.routes import optimizer_route

NamedParams = Iterable[tuple[str, Tensor]]
"""``(Hugging Face name, parameter)`` pairs, in the order every rank gathers them."""


def full_fp32(x: Tensor) -> Tensor:
    """Full, unsharded FP32 CPU copy of ``x`` (all-gather for a sharded ``DTensor``).

    Args:
        x: a ``DTensor`` or a plain tensor.

    Returns:
        A contiguous FP32 CPU tensor with the global shape.
    """
    from torch.distributed.tensor import DTensor

    full = x.full_tensor() if isinstance(x, DTensor) else x
    return full.detach().to(device="cpu", dtype=torch.float32).contiguous().clone()


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every parameter of ``model`` that requires a gradient."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def full_params(named: NamedParams) -> dict[str, Tensor]:
    """Name -> full FP32 copy of each parameter (the master weights)."""
    return {n: full_fp32(p) for n, p in named}


def full_grads(named: NamedParams) -> dict[str, Tensor]:
    """Name -> full FP32 copy of each parameter's ``.grad`` (FP32 zeros where it is ``None``)."""
    return {n: full_fp32(p.grad) if p.grad is not None else torch.zeros(p.shape)
            for n, p in named}


def full_optimizer_state(named: NamedParams, optimizer: torch.optim.Optimizer,
                         key: str) -> dict[str, Tensor]:
    """Name -> full FP32 copy of ``optimizer.state[param][key]`` (``exp_avg``...).

    A parameter without state (never stepped) is reported as FP32 zeros of its shape.
    """
    out: dict[str, Tensor] = {}
    for n, p in named:
        st = optimizer.state.get(p, {})
        out[n] = full_fp32(st[key]) if key in st else torch.zeros(p.shape)
    return out


def state_dtypes(optimizer: torch.optim.Optimizer, key: str) -> set[torch.dtype]:
    """Dtypes of ``optimizer.state[*][key]`` actually held (empty before the first step)."""
    return {st[key].dtype for st in optimizer.state.values() if key in st}


def applied_lr(optimizer: Any) -> float:
    """The lr the next ``optimizer.step()`` applies: ``param_groups[*]["lr"]`` (all equal).

    Raises:
        OutputError: the param groups hold different lrs (no one lr to report).
    """
    lrs = {float(g["lr"]) for g in optimizer.param_groups}
    if len(lrs) != 1:
        raise OutputError(f"optimizer param groups hold different lrs {sorted(lrs)}")
    return lrs.pop()


class TorchOptimEngine(Engine):
    """An :class:`~qualify_harness.driver.Engine` whose update is a plain ``torch.optim`` step.

    A subclass supplies the fields below (a dataclass declares them) and the parts the
    engine dictates (forwards, :meth:`check_replicas`, and where needed
    :meth:`prepare_grads`, :meth:`engine_dtypes`, :meth:`trained`).

    Attributes:
        model: the trained module; its trainable parameters are the optimizer's.
        optimizer: the ``torch.optim.Optimizer`` over them.
        lr_scheduler: the lr scheduler, stepped once after each optimizer step.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any

    def trained(self) -> list[tuple[str, nn.Parameter]]:
        """``(HF name, parameter)`` of every trained parameter, as the ``full_*`` gather them.

        By default every parameter of :attr:`model` that requires a gradient; an engine
        that must check their placement first overrides this.
        """
        return trainable(self.model)

    def params(self) -> list[Tensor]:
        """Trainable parameters of :attr:`model` (as the optimizer holds them)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def full_grads(self) -> dict[str, Tensor]:
        """Full FP32 gradients (:func:`full_grads` of :meth:`trained`)."""
        return full_grads(self.trained())

    def clip(self, max_norm: float) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over :meth:`params`; the full FP32 norm."""
        return full_fp32(torch.nn.utils.clip_grad_norm_(self.params(), max_norm))

    def full_params(self) -> dict[str, Tensor]:
        """Full FP32 master weights (:func:`full_params` of :meth:`trained`)."""
        return full_params(self.trained())

    def applied_lr(self) -> float:
        """The lr in the optimizer's param groups (:func:`applied_lr`)."""
        return applied_lr(self.optimizer)

    def optimizer_step(self) -> None:
        """``optimizer.step()``."""
        self.optimizer.step()

    def scheduler_step(self) -> None:
        """``lr_scheduler.step()``."""
        self.lr_scheduler.step()

    def zero_grad(self) -> None:
        """``optimizer.zero_grad(set_to_none=True)``."""
        self.optimizer.zero_grad(set_to_none=True)

    def state_dtypes(self, key: str) -> set[torch.dtype]:
        """Dtypes of the optimizer's ``key`` state (:func:`state_dtypes`)."""
        return state_dtypes(self.optimizer, key)

    def full_optimizer_state(self, key: str) -> dict[str, Tensor]:
        """Full FP32 optimizer state ``key`` (:func:`full_optimizer_state` of :meth:`trained`)."""
        return full_optimizer_state(self.trained(), self.optimizer, key)

    def routes(self) -> dict[str, Any]:
        """The optimizer actually built, with its ``fused`` / ``foreach`` flags."""
        return {"optimizer": optimizer_route(self.optimizer)}
