"""Deliberate bugs for the test suite: each must later be caught by the comparator.

Never active in a real run (``cell.faults`` is empty). The harness's numerical path holds no
fault: a launch whose cell names faults calls :func:`install`, which patches the parts they
replace (methods of :class:`harnesses.torch_tp.harness.TorchTPEngine`, the SDK's loss
assembly, the checkpoint restore) in that process only. Names:

- ``grad_norm_replicated_per_rank``: the gradient norm sums the squares of every local
  gradient over the TP group, so replicated parameters (norms, embeddings, value head)
  count ``tp`` times (Megatron's ``param_is_not_tensor_parallel_duplicate`` forgotten).
- ``logprobs_shift_one``: log-probs read one position late (the output at ``P + t``
  instead of ``P - 1 + t``).
- ``bf16_optimizer_state``: AdamW moments stored in BF16 between steps.
- ``value_loss_unclipped``: value loss ``0.5 Σ (V - G)^2`` without the clipped branch.
- ``no_temperature``: logits not divided by the sampling temperature.
- ``entropy_bonus_dropped``: the entropy bonus is left out of the Actor's backward (its
  value is still reported): a gradient change of about ``entropy_coef`` relative.
- ``kl_loss_sign_flipped``: the KL-to-reference loss term is subtracted instead of added.
- ``layer1_mlp_scaled``: decoder layer 1's MLP output is multiplied by ``1 + 1e-3`` (a
  fault in one sub-module of one layer, for ``qualify diverge`` to name).
- ``lr_scheduler_stepped_first``: the lr scheduler is stepped before the optimizer step
  instead of after it (the pre-PyTorch-1.1 order), so step ``s`` applies ``lambda(s)``
  instead of ``lambda(s - 1)``: every step's lr one step late.
- ``resume_drops_optimizer_state``: a resumed launch restores the model only and starts a
  fresh AdamW (no moments, step counters, or checkpointed lr; NeMo-RL #3171).
- ``resume_drops_step_counter``: a resumed launch restores AdamW's moments but resets every
  parameter's ``step`` to 0, so the next step's bias correction is the first step's.
- ``hang_rank1``: rank 1 skips one collective of its TP group (and then stays alive,
  as a desynchronised rank does), so its peers wait until the collective timeout.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import Tensor, nn

from harnesses import faults as shared
from qualify.errors import HarnessError

KNOWN: Final = (
    "grad_norm_replicated_per_rank",
    "logprobs_shift_one",
    "bf16_optimizer_state",
    "value_loss_unclipped",
    "no_temperature",
    "entropy_bonus_dropped",
    "kl_loss_sign_flipped",
    "hang_rank1",
    "layer1_mlp_scaled",
    "lr_scheduler_stepped_first",
    "resume_drops_optimizer_state",
    "resume_drops_step_counter",
)
LAYER_FAULT_MODULE: Final = "layers.1.mlp"
"""The backbone sub-module ``layer1_mlp_scaled`` perturbs."""
LAYER_FAULT_SCALE: Final = 1.0 + 1e-3


class Faults(shared.Faults):
    """The torch_tp faults a cell asks for (:data:`KNOWN`; an unknown name is refused)."""

    ENGINE = "torch_tp"
    KNOWN = KNOWN


def grad_norm_replicated_per_rank(params: Sequence[nn.Parameter], max_norm: float,
                                  group: dist.ProcessGroup) -> Tensor:
    """FAULT: clip with a norm that counts replicated gradients once per rank.

    Args:
        params: the role's parameters (DTensors).
        max_norm: clipping threshold.
        group: the role's TP group.

    Returns:
        The (wrong) pre-clip norm, 0-d FP32; gradients are scaled in place by
        ``min(1, max_norm / (norm + 1e-6))``.
    """
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    sq = torch.stack([x.float().square().sum() for x in local]).sum()
    dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    for g in grads:
        g.mul_(coef)
    return norm


@contextlib.contextmanager
def bf16_optimizer_state(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """FAULT: keep AdamW's moments in BF16 between steps (upcast for the step itself).

    ``torch.optim.AdamW`` refuses mixed-dtype state in its update, so the moments are
    upcast before ``step()`` and rounded to BF16 storage after it, which is what a BF16
    optimizer state amounts to.
    """
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key] = state[key].float()
    yield
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key] = state[key].to(torch.bfloat16)


def unclipped_value_loss_sum(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """FAULT: ``0.5 Σ (V - G)^2`` over valid tokens, the clipped branch forgotten.

    Args:
        values: ``[b, R]`` FP32 with gradient.
        returns: ``[b, R]`` FP32.
        mask: ``[b, R]`` bool.
    """
    sq = (values - returns).square()
    return 0.5 * torch.where(mask, sq, torch.zeros_like(sq)).sum()


def skip_collective_and_stall(rank: int) -> None:
    """FAULT ``hang_rank1``: global rank 1 never reaches the next collective.

    Returns at once on every other rank (they run the collective and wait for rank 1).
    Rank 1 sleeps until torchrun tears the job down after a peer's collective timeout;
    it stays alive so that its peers see a missing participant, not a closed socket.
    """
    if rank != 1:
        return
    while True:  # pragma: no cover - killed from outside
        time.sleep(1.0)


def scale_layer_output(model: nn.Module) -> None:
    """FAULT ``layer1_mlp_scaled``: scale ``<backbone>.layers.1.mlp``'s output.

    The output is multiplied by :data:`LAYER_FAULT_SCALE` (a forward hook registered once,
    at load time).

    Raises:
        HarnessError: the model has fewer than two decoder layers.
    """
    prefix = str(getattr(model, "base_model_prefix", "model"))
    try:
        mlp = model.get_submodule(f"{prefix}.{LAYER_FAULT_MODULE}")
    except AttributeError:
        raise HarnessError(f"layer1_mlp_scaled: {type(model).__name__} has no "
                           f"{prefix}.{LAYER_FAULT_MODULE}") from None

    def hook(_m: nn.Module, _i: object, out: Tensor) -> Tensor:
        return out * LAYER_FAULT_SCALE

    mlp.register_forward_hook(hook)


def install(names: Sequence[str], harness: Any) -> Faults:
    """Patch the named faults into this process's harness (a test-only plugin).

    Args:
        names: ``cell.faults``.
        harness: the running harness module (``__main__`` under ``python -m``, so it is
            passed in rather than imported a second time).

    Raises:
        HarnessError: an unknown fault name.
    """
    from qualify_harness import driver, losses, optim

    from harnesses.torch_tp import resume

    active = Faults(names)
    engine = harness.TorchTPEngine
    if "no_temperature" in active:
        engine.logits_divisor = lambda self: 1.0
    if "logprobs_shift_one" in active:
        engine.actor_hidden = (
            lambda self, model, batch: harness.response_hidden(model, batch, 1))
    if "grad_norm_replicated_per_rank" in active:
        engine.clip = (
            lambda self, max_norm: optim.full_fp32(grad_norm_replicated_per_rank(
                self.params(), max_norm, self.mesh.group)))
    if "lr_scheduler_stepped_first" in active:
        applied = engine.applied_lr

        def stepped_first(self: Any) -> float:
            self.lr_scheduler.step()
            return applied(self)

        engine.applied_lr = stepped_first
        engine.scheduler_step = lambda self: None
    if "bf16_optimizer_state" in active:
        step = engine.optimizer_step

        def bf16_step(self: Any) -> None:
            with bf16_optimizer_state(self.optimizer):
                step(self)

        engine.optimizer_step = bf16_step
    if "value_loss_unclipped" in active:
        def unclipped(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                      value_clip: float, *, weight: Tensor | None = None) -> Tensor:
            del old_values, value_clip, weight
            return unclipped_value_loss_sum(values, returns, mask)

        losses.value_loss_sum = unclipped
    flip, drop = "kl_loss_sign_flipped" in active, "entropy_bonus_dropped" in active
    if flip or drop:
        objective = driver.actor_objective

        def faulty(policy: Tensor, kl: Tensor, entropy: Tensor) -> Tensor:
            return objective(policy, -kl if flip else kl, 0.0 * entropy if drop else entropy)

        driver.actor_objective = faulty
    if "layer1_mlp_scaled" in active:
        probe_for = harness.RoleRun.probe_for

        def scaled(self: Any, model: nn.Module) -> Any:
            scale_layer_output(model)
            return probe_for(self, model)

        harness.RoleRun.probe_for = scaled
    if "hang_rank1" in active:
        groups_up = harness.groups_up

        def hang(group: Any, rank: int) -> None:
            skip_collective_and_stall(rank)
            groups_up(group, rank)

        harness.groups_up = hang
    shared.plant_dcp_resume_faults(active, resume)
    return active
