"""The Actor's own next-token distributions on the response window, as the protocol stores them.

Recorded once, at the initial weights (round 1's no-gradient scoring pass of
:func:`qualify_harness.run_actor`), from the logits an engine's
:meth:`~qualify_harness.Engine.response_logits` returns: the same response positions
``logprobs_and_entropy`` scores, the whole vocabulary ``V`` (the model's
``config.vocab_size``, a padded vocabulary cut), in the engine's compute dtype. The
comparator judges them against the reference's sealed distributions
(``qualify/reference/distribution.py``). Shapes: ``b`` sequences, ``R`` response positions,
``V`` vocabulary, ``k`` the top-k path's width.

Full path (``V <=`` :data:`~qualify_harness.protocol.FULL_DISTRIBUTION_MAX_VOCAB`), metric
names under ``round1/actor/``:

- ``prefill_raw`` ``[b, R, V]`` FP32: ``log_softmax(logits.double(), -1).float()``;
- ``prefill_tempered`` ``[b, R, V]`` FP32: ``log_softmax(logits.double() / T, -1).float()``.

The log-softmax is taken in FP64 and rounded once, as the reference forms its own
(``qualify/reference/distribution.py``): an FP32 log-softmax of the same logits differs by
its own rounding, which at logits of magnitude 30 reaches a total variation of 2e-6,
above the statistic's floor. The engine's numbers are its logits.

Top-k path (``V >`` the limit), for ``kind`` in ``raw``, ``tempered`` (the same
log-softmax, then reduced):

- ``prefill_<kind>_topk_logprobs`` ``[b, R, k]`` FP32: the ``k`` largest logprobs, largest
  first, equal values by the smaller token id (``qualify.distmetrics.topk_of``'s order);
- ``prefill_<kind>_topk_ids`` ``[b, R, k]`` int64: their token ids;
- ``prefill_<kind>_logprobs`` ``[b, R]`` FP32: the response token's logprob.

On both paths:

- ``prefill_top_logit`` ``[b, R]`` FP32: the largest raw logit of each position (before
  the temperature), exact (a BF16 or FP32 logit is an FP32 value). The comparator resolves
  a BF16 cell's top-1 ties at that magnitude (BF16 spacings there; ``qualify.distmetrics
  .tie_resolution``). Optional for a harness (:data:`TOP_LOGIT`, not in
  :func:`metric_names`): without it a BF16 cell's ties are counted by the FP32 rule.

Every value is 0 (ids: 0) at masked positions (``mask == 0``), as the reference's are.
:func:`use_topk` decides the path, once, for every caller.
"""

from __future__ import annotations

from typing import Final

import torch
from torch import Tensor

from qualify_harness.protocol import DISTRIBUTION_KINDS, FULL_DISTRIBUTION_MAX_VOCAB

PREFIX: Final = "prefill"
"""The metric names' prefix: ``prefill_<kind>...`` (teacher-forced, one batched forward)."""
TOP_LOGIT: Final = f"{PREFIX}_top_logit"
"""The metric name of the top raw logit per position ``[b, R]`` (both paths; optional for a
harness, so not in :func:`metric_names`)."""


def use_topk(vocab: int, topk: bool | None = None) -> bool:
    """Whether a vocabulary of ``vocab`` is stored on the top-k path.

    ``topk`` forces a path (``None``: the top-k path iff ``vocab >``
    :data:`FULL_DISTRIBUTION_MAX_VOCAB`). The one place the path is decided.
    """
    return vocab > FULL_DISTRIBUTION_MAX_VOCAB if topk is None else topk


def metric_names(vocab: int, *, topk: bool | None = None) -> tuple[str, ...]:
    """The metric names (under ``round1/actor/``) a vocabulary of ``vocab`` must be stored as.

    ``topk``: as :func:`use_topk`. :data:`TOP_LOGIT`, optional, is not among them.
    """
    if not use_topk(vocab, topk):
        return tuple(f"{PREFIX}_{kind}" for kind in DISTRIBUTION_KINDS)
    return tuple(f"{PREFIX}_{kind}_{part}" for kind in DISTRIBUTION_KINDS
                 for part in ("topk_logprobs", "topk_ids", "logprobs"))


def distribution_tensors(logits: Tensor, responses: Tensor, mask: Tensor, *,
                         temperature: float, k: int, topk: bool | None = None,
                         ) -> dict[str, Tensor]:
    """The protocol's distribution tensors of one micro-batch (module docstring).

    Args:
        logits: ``[b, R, V]`` the engine's logits on the response window (any float dtype;
            cast to FP32 before the log-softmax), the whole vocabulary, ``V`` the model's
            ``config.vocab_size``.
        responses: ``[b, R]`` int64 response token ids (``< V`` where ``mask``).
        mask: ``[b, R]`` bool, the valid response positions.
        temperature: the contract's sampling temperature ``T`` (> 0).
        k: the top-k path's width (``contract.json`` ``bounds.distribution_topk``); unused on
            the full path.
        topk: force the top-k path (``True``) or the full path (``False``); ``None``: by
            ``V`` (:func:`use_topk`).

    Returns:
        Metric name -> tensor on ``logits``' device: FP32, ids int64, the names of
        :func:`metric_names` and :data:`TOP_LOGIT`.

    Raises:
        ValueError: shapes disagree, ``temperature <= 0``, or on the top-k path ``k`` not in
            ``[1, V]``.
    """
    b, r_len, vocab = logits.shape
    if tuple(responses.shape) != (b, r_len) or tuple(mask.shape) != (b, r_len):
        raise ValueError(f"logits {tuple(logits.shape)}, responses {tuple(responses.shape)} "
                         f"and mask {tuple(mask.shape)} disagree on [b, R]")
    if not temperature > 0:
        raise ValueError(f"temperature {temperature} is not > 0")
    top_k_path = use_topk(vocab, topk)
    if top_k_path and not 1 <= k <= vocab:
        raise ValueError(f"k = {k} is not in [1, V = {vocab}]")
    z = logits.detach().double()  # the log-softmax in FP64, rounded once to FP32
    valid = mask.bool()
    out: dict[str, Tensor] = {}
    for kind in DISTRIBUTION_KINDS:
        lp = torch.log_softmax(z if kind == "raw" else z / temperature, dim=-1).float()
        if not top_k_path:
            out[f"{PREFIX}_{kind}"] = torch.where(valid[..., None], lp, 0.0)
            continue
        # A stable descending sort keeps equal values in id order (smaller id first).
        vals, ids = torch.sort(lp, dim=-1, descending=True, stable=True)
        token = lp.gather(-1, torch.where(valid, responses, 0).long()[..., None])[..., 0]
        out[f"{PREFIX}_{kind}_topk_logprobs"] = torch.where(valid[..., None], vals[..., :k], 0.0)
        out[f"{PREFIX}_{kind}_topk_ids"] = torch.where(valid[..., None], ids[..., :k], 0)
        out[f"{PREFIX}_{kind}_logprobs"] = torch.where(valid, token, 0.0)
    # a BF16 or FP32 logit is exact in FP64 and in FP32: the max is the engine's own value
    out[TOP_LOGIT] = torch.where(valid, z.amax(dim=-1), 0.0).float()
    return out
