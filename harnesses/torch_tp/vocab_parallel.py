"""torch_tp's vocab-parallel log-softmax: per-token log-probs and entropy of sharded logits.

Nothing numerical is imported from :mod:`qualify` (the reference path is the independent
side of every comparison); the losses are the harness SDK's (:mod:`qualify_harness.losses`).
Shapes: ``b`` sequences of a micro-batch, ``R`` response positions, ``V`` vocabulary.

Vocab-parallel log-softmax. The Actor's ``lm_head`` is column-parallel, so each rank
holds the logits of ``V / tp`` vocabulary entries as a ``Shard(-1)`` DTensor. Instead of
all-gathering ``[b, R, V]`` logits, :func:`token_logprobs_and_entropy` reduces over the
vocabulary with three all-reduces of ``[b, R]`` values (max, sum of exponentials, the
target logit and ``Σ p z``), written with DTensor reductions (``Partial`` ->
``Replicate``), so autograd and the collectives are the library's. The same code runs on
plain tensors (TP 1 without DTensor, or a replicated head). ``torch.distributed.tensor
.parallel.loss_parallel`` is not used: its log-softmax backward is a no-op that assumes
the log-probabilities feed only ``nll_loss``, which breaks the entropy term's gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor


def _replicated(x: Tensor) -> Tensor:
    """Reduce a ``Partial`` DTensor to ``Replicate`` (all-reduce); plain tensors pass."""
    if isinstance(x, DTensor):
        return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
    return x


def _local(x: Tensor) -> Tensor:
    """The local value of a replicated DTensor (a plain tensor passes unchanged)."""
    return x.to_local() if isinstance(x, DTensor) else x


def _one_hot_like(targets: Tensor, z: Tensor) -> Tensor:
    """``one_hot(targets)`` in ``z``'s dtype and layout (sharded like ``z`` when a DTensor).

    Args:
        targets: ``[b, R]`` int64 token ids.
        z: ``[b, R, V]`` logits (``Shard(-1)`` DTensor or plain).

    Returns:
        ``[b, R, V]``; each rank builds the full one-hot and keeps its vocabulary shard
        (``src_data_rank=None``: local slicing, no communication).
    """
    oh = torch.nn.functional.one_hot(targets, num_classes=z.shape[-1]).to(z.dtype)
    if isinstance(z, DTensor):
        return distribute_tensor(oh, z.device_mesh, z.placements, src_data_rank=None)
    return oh


def logprobs_and_entropy(logits: Tensor, targets: Tensor,
                               temperature: float) -> tuple[Tensor, Tensor]:
    """Log-probability of each target token and the entropy, under ``softmax(logits / T)``.

    With ``z = logits.float() / T``, ``m = max_v z`` (no gradient: log-sum-exp does not
    depend on the shift), ``lse = log Σ_v exp(z - m)``:
    ``logprob = (z_target - m) - lse`` and ``H = lse - Σ_v p_v (z_v - m)``.

    Args:
        logits: ``[b, R, V]`` (any float dtype; upcast to FP32 here), a ``Shard(-1)``
            DTensor from the vocab-parallel head or a plain / replicated tensor.
        targets: ``[b, R]`` int64 token ids (the responses).
        temperature: the contract's sampling temperature (> 0).

    Returns:
        ``(logprobs, entropy)``, each ``[b, R]`` FP32 plain tensors, equal on all ranks.
    """
    z = logits.float() / temperature
    m = _replicated(z.detach().amax(dim=-1, keepdim=True))  # all-reduce MAX
    shifted = z - m
    lse = _replicated(shifted.exp().sum(dim=-1, keepdim=True)).log()  # all-reduce SUM
    z_target = _replicated((shifted * _one_hot_like(targets, z)).sum(dim=-1))
    probs = (shifted - lse).exp()
    p_dot_z = _replicated((probs * shifted).sum(dim=-1))
    lse = lse.squeeze(-1)
    return _local(z_target - lse), _local(lse - p_dot_z)
