"""DeepSpeed engine state -> Hugging Face layout: full FP32 tensors under HF parameter names.

Two layers of partitioning are undone, each with DeepSpeed's own code:

1. ZeRO (stages 1 and 2 partition the FP32 master weights, gradients and AdamW state over
   the data-parallel group; BF16 ZeRO 1 uses ``BF16_Optimizer`` with FP32 ``_hp_grad``
   buffers): ``deepspeed.utils.safe_get_full_fp32_param``, ``safe_get_full_grad`` and
   ``safe_get_full_optimizer_state`` return this rank's (TP-local) full tensor. Where an
   engine keeps no ``_hp_mapping`` (ZeRO 0), these APIs return ``None`` / the module's
   ``.grad`` and the state is read where the engine holds it: for FP32 the module parameter
   *is* the master and ``torch.optim.AdamW.state[param]`` its state; for BF16 ZeRO 0
   (``FP16_UnfusedOptimizer``) the FP32 master is the matching entry of ``fp32_groups`` and
   the state ``optimizer.optimizer.state[master]``. Every tensor's source is recorded.
2. AutoTP (a ``LinearLayer`` shards dim 0, a ``LinearAllreduce`` dim 1 of its weight):
   ``TensorParallel_Layer._all_gather_shards(shard, layer._partition_sizes, dim)``, the
   layer's own reassembly (all-gather over the TP group, uneven shards trimmed), so the
   result is in HF row / column order (AutoTP keeps heads contiguous). Replicated
   parameters are taken as they are on this rank.

Every function that gathers is collective over the role's TP group: all its ranks must call
it for the same parameters, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import torch
from torch import Tensor, nn

from harnesses.deepspeed.parallelize import ParamLayout
from qualify.errors import HarnessError

API_FP32_PARAM: Final = "deepspeed.utils.safe_get_full_fp32_param"
API_GRAD: Final = "deepspeed.utils.safe_get_full_grad"
API_STATE: Final = "deepspeed.utils.safe_get_full_optimizer_state"
API_UNFUSED_MASTER: Final = "FP16_UnfusedOptimizer.fp32_groups (BF16 ZeRO 0 master copy)"
API_UNFUSED_STATE: Final = "FP16_UnfusedOptimizer.optimizer.state[fp32 master]"
API_MODULE_PARAM: Final = "module parameter (FP32 ZeRO 0: the parameter is the master)"
API_TORCH_STATE: Final = "torch.optim.AdamW.state[param] (FP32 ZeRO 0)"
API_TP_GATHER: Final = "TensorParallel_Layer._all_gather_shards (AutoTP)"


def dtype_name(dtypes: Iterable[torch.dtype]) -> str | list[str]:
    """``"torch.float32"`` when one dtype was observed, else the sorted list of names."""
    names = sorted({str(d) for d in dtypes})
    return names[0] if len(names) == 1 else names


class EngineTensors:
    """Reads the engine's FP32 masters, gradients and optimizer state, per HF parameter.

    Args:
        engine: the ``DeepSpeedEngine`` of this role.
        layout: :func:`harnesses.deepspeed.parallelize.tp_layout` of ``engine.module``.

    Attributes:
        sources: metric -> the API each value came from (``grads``, ``master``, ``state``).
    """

    def __init__(self, engine: Any, layout: list[ParamLayout]) -> None:
        self.engine = engine
        self.layout = layout
        params = dict(engine.module.named_parameters())
        self.params: dict[str, nn.Parameter] = {pl.name: params[pl.name] for pl in layout}
        self.sources: dict[str, set[str]] = {"grads": set(), "master": set(), "state": set()}
        self._unfused: dict[int, Tensor] = {}
        opt = engine.optimizer
        if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"):
            for lo, hi in zip(opt.fp16_groups, opt.fp32_groups, strict=True):
                for p16, p32 in zip(lo, hi, strict=True):
                    self._unfused[id(p16)] = p32

    # ----------------------------------------------------------------- local (TP shard)

    def local_master(self, name: str) -> Tensor:
        """This rank's FP32 master of ``name`` (TP-local shape), as the engine holds it."""
        p = self.params[name]
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(p)
        if full is not None:
            self.sources["master"].add(API_FP32_PARAM)
            return full
        if id(p) in self._unfused:
            self.sources["master"].add(API_UNFUSED_MASTER)
            return self._unfused[id(p)]
        self.sources["master"].add(API_MODULE_PARAM)
        return p.data

    def local_grad(self, name: str) -> Tensor | None:
        """This rank's accumulated gradient of ``name`` before the step (``None`` if none).

        Call between the last micro-batch's ``engine.backward`` and ``engine.step``.
        """
        from deepspeed.utils import safe_get_full_grad

        self.sources["grads"].add(API_GRAD)
        g: Tensor | None = safe_get_full_grad(self.params[name])
        return g

    def local_state(self, name: str, key: str) -> Tensor | None:
        """This rank's optimizer state ``key`` (``exp_avg`` / ``exp_avg_sq``) of ``name``."""
        p = self.params[name]
        if hasattr(p, "_hp_mapping") or hasattr(p, "ds_id"):
            from deepspeed.utils import safe_get_full_optimizer_state

            self.sources["state"].add(API_STATE)
            st: Tensor | None = safe_get_full_optimizer_state(p, key)
            return st
        opt = self.engine.optimizer
        if id(p) in self._unfused:
            self.sources["state"].add(API_UNFUSED_STATE)
            state = opt.optimizer.state.get(self._unfused[id(p)], {})
        else:
            self.sources["state"].add(API_TORCH_STATE)
            state = opt.state.get(p, {})
        value: Tensor | None = state.get(key)
        return value

    # ----------------------------------------------------------------- HF layout

    def gather(self, pl: ParamLayout, local: Tensor | None) -> Tensor:
        """Full HF-layout FP32 CPU copy of a TP-local tensor of parameter ``pl``.

        Args:
            pl: the parameter's layout.
            local: its TP-local value (``None``: zeros of the parameter's shape, still
                joining the collective so every rank calls it the same number of times).

        Raises:
            HarnessError: a local shape that is not the parameter's.
        """
        p = self.params[pl.name]
        if local is None:
            local = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if local.numel() != p.numel():
            raise HarnessError(f"{pl.name}: engine tensor has {local.numel()} elements, the "
                               f"parameter {p.numel()}")
        local = local.detach().reshape(p.shape).to(torch.float32).contiguous()
        if pl.dim is not None:
            layer: Any = pl.layer  # an AutoTP TensorParallel_Layer
            local = layer._all_gather_shards(local, layer._partition_sizes, pl.dim)
        return local.to("cpu").contiguous().clone()

    def full_masters(self) -> dict[str, Tensor]:
        """HF name -> full FP32 master weight."""
        return {pl.name: self.gather(pl, self.local_master(pl.name)) for pl in self.layout}

    def full_grads(self) -> dict[str, Tensor]:
        """HF name -> full gradient (FP32 copy of the engine's buffer) before the step."""
        return {pl.name: self.gather(pl, self.local_grad(pl.name)) for pl in self.layout}

    def full_state(self, key: str) -> dict[str, Tensor]:
        """HF name -> full optimizer state ``key`` after the step."""
        return {pl.name: self.gather(pl, self.local_state(pl.name, key)) for pl in self.layout}

    def dtypes(self) -> dict[str, set[torch.dtype]]:
        """Dtypes the engine actually holds: ``master``, ``grads``, ``exp_avg``, ``exp_avg_sq``.

        ``grads`` is read between backward and step (call it there); the others any time
        after the first step.
        """
        out: dict[str, set[torch.dtype]] = {"master": set(), "exp_avg": set(),
                                            "exp_avg_sq": set()}
        for pl in self.layout:
            out["master"].add(self.local_master(pl.name).dtype)
            for key in ("exp_avg", "exp_avg_sq"):
                st = self.local_state(pl.name, key)
                if st is not None:
                    out[key].add(st.dtype)
        return out

    def grad_dtypes(self) -> set[torch.dtype]:
        """Dtypes of the gradient buffers the engine holds (call between backward and step)."""
        out: set[torch.dtype] = set()
        for pl in self.layout:
            g = self.local_grad(pl.name)
            if g is not None:
                out.add(g.dtype)
        return out
