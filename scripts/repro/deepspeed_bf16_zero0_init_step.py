"""DeepSpeed BF16 at ZeRO 0 takes one AdamW step on zero gradients while it is built.

Finding (issue #18, found by the resume cells): with ``bf16.enabled`` and ZeRO stage 0 and a
client-visible ``torch_adam`` AdamW, ``deepspeed.initialize`` wraps the optimizer in
``FP16_UnfusedOptimizer`` (deepspeed 0.19.8 ``runtime/fp16/unfused_optimizer.py``), whose
constructor calls ``initialize_optimizer_states()``: it sets every gradient to zeros and calls
``self.optimizer.step()``. ``torch.optim.AdamW`` then

- counts that step (``state["step"] == 1`` before any training), so the first real update
  uses the bias corrections of step 2: the update of a parameter with gradient ``g`` is
  ``lr * (g / (1 + β1)) / sqrt(g² / (1 + β2))`` instead of ``lr * g / |g|``, a factor
  ``sqrt(1 + β2) / (1 + β1)`` (0.735 for the default contract's betas (0.9, 0.95)) when
  ``|g| >> eps``;
- applies its decoupled weight decay ``p *= 1 - lr * wd`` to the FP32 master weights once
  before training.

ZeRO 1 and 2 (``BF16_Optimizer`` / ZeRO optimizer) and FP32 do neither. This prints, for
each of ``fp32-zero0``, ``bf16-zero0`` and ``bf16-zero1``: AdamW's step counter after
``deepspeed.initialize`` (``[]``: no state yet), the master weights' largest change from the
initial FP32 weights before any training (at BF16 the masters are born from the BF16 module,
so this is their BF16 rounding, far above the one weight-decay factor), and the first update
of a parameter with a constant gradient divided by the update ``torch.optim.AdamW`` takes from
the same master weights (1.0 for a correct step).

Measured on this CPU (2026-12-01)::

    variant      step after init  master change before training  first update / AdamW
    fp32-zero0                   []                      0.000e+00                1.0000
    bf16-zero0                [1.0]                      9.128e-04                0.7334
    bf16-zero1                   []                      9.212e-04                1.0000

In the default run the round-1 Actor updates of ``deepspeed-bf16-zero0-actor-tp1`` are 0.285
max relative L2 from the reference (``deepspeed-bf16-zero1``: 0.035) and still PASS: the
BF16 round-1 update bound is 0.805 (issue #15's BF16 power gap).

Usage (one process, gloo, CPU; about 20 s)::

    DS_ACCELERATOR=cpu python scripts/repro/deepspeed_bf16_zero0_init_step.py
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

BETAS = (0.9, 0.95)
LR, EPS, WD = 3e-4, 1e-6, 0.1


def _engine(precision: str, zero: int) -> tuple[Any, torch.nn.Linear]:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4, bias=False)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "train_batch_size": 1, "steps_per_print": 2**31 - 1,
        "optimizer": {"type": "AdamW", "params": {
            "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
            "torch_adam": True}},
        "zero_optimization": {"stage": zero},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        if zero:
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    return engine, model


def _adamw_steps(engine: Any) -> list[float]:
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    return [float(s["step"]) for s in inner.state.values() if "step" in s]


def _master(engine: Any) -> torch.Tensor:
    opt = engine.optimizer
    for attr in ("fp32_groups", "fp32_groups_flat_partition", "single_partition_of_fp32_groups"):
        groups = getattr(opt, attr, None)
        if groups:
            return torch.cat([p.detach().float().reshape(-1) for p in
                              (groups[0] if isinstance(groups[0], list) else groups)])
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])


def main() -> int:
    """Print the table; exit 0."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        print("set DS_ACCELERATOR=cpu", file=sys.stderr)
        return 2
    import deepspeed
    # as the harness does (harnesses/deepspeed/parallelize.skip_shm_comm_build): no JIT build
    # of the CPU shared-memory all-reduce op, which one process does not use
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    ratio_ok = (1 + BETAS[1]) ** 0.5 / (1 + BETAS[0])
    print(f"sqrt(1 + b2) / (1 + b1) = {ratio_ok:.4f}; 1 - lr*wd = {1 - LR * WD:.8f}")
    print(f"{'variant':<11} {'step after init':>16} {'master change before training':>30} "
          f"{'first update / AdamW':>21}")
    for precision, zero in (("fp32", 0), ("bf16", 0), ("bf16", 1)):
        torch.manual_seed(0)
        w0 = torch.nn.Linear(8, 4, bias=False).weight.detach().clone().float()
        engine, _ = _engine(precision, zero)
        steps = _adamw_steps(engine)
        before = _master(engine).clone()
        init_change = float((before - w0.reshape(-1)).abs().max())
        # one step with the gradient of sum(x @ W^T) for x = ones: d/dW = ones, |g| >> eps
        x = torch.ones(1, 8, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
        loss = engine(x).float().sum()
        engine.backward(loss)
        engine.step()
        after = _master(engine)
        ref = before.clone().requires_grad_(True)
        opt = torch.optim.AdamW([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        ref.grad = torch.ones_like(ref)
        opt.step()
        ratio = float(((after - before) / (ref.detach() - before)).median())
        print(f"{precision}-zero{zero:<5} {steps[:1] or steps!s:>16} {init_change:>30.3e} "
              f"{ratio:>21.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
