"""Per-token outputs and their parameter gradients ``J_t``, one sequence at a time.

The reference stage seals, for each clip-ambiguous token, the gradient ``J_t`` of its logprob
(Actor) or value (Critic) (:mod:`qualify.reference.branches`), and the Gram ``<J_s, J_t>`` of
those tokens (:mod:`qualify.reference.gram`). Both need a token's output only, not the
round's whole micro-batch: the models are causal and every sequence is its own row of the
batch, so the output at sequence position ``P - 1 + t`` is a function of sequence ``b``'s
positions ``0 .. P - 1 + t`` alone. :func:`token_outputs` therefore runs only the rows
that hold a wanted token, cut after the last wanted position: :func:`token_gradients` one
sequence at a time (each ``J_t`` is one backward through that sequence alone, not through the
micro-batch's other sequences and later positions), :func:`qualify.reference.gram.jvp_row`
groups of up to a micro-batch of sequences (a forward with tangents reads every weight and
its tangent once per call, so fewer, larger calls are cheaper). The outputs are the same
function as the whole micro-batch's; they differ by FP32 rounding of other matrix shapes
(figures in ``docs/scale.md``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from qualify.contract import Contract
from qualify.reference.update import (
    Batch,
    UpdateSettings,
    _positions,
    _Precision,
    _token_logprobs_entropy,
)

__all__ = ["token_gradients", "token_outputs"]


def token_outputs(model: nn.Module, batch: Batch, tokens: Sequence[tuple[int, int]], *,
                  role: str, temperature: float, head_at_tokens: bool = False,
                  params: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The logprob (Actor) or value (Critic) of each listed token.

    One forward of the rows of the batch that hold a listed token, cut after the last
    listed position. Protocol convention: response position ``t`` is read at sequence
    position ``P - 1 + t`` (``P`` the padded prompt length); position ids from the attention
    mask, as the update does. The module's mode is the caller's: put it in eval mode first
    (dropout off, as the run's forward; a critic's classifier dropout defaults to 0.1);
    both callers here do.

    ``head_at_tokens`` (Actor) takes the language-model head only at the listed tokens'
    positions (``logits_to_keep``): each logit is its own dot product, so the outputs are
    unchanged (bitwise on SmolLM2-135M, ``docs/scale.md``) and a forward with tangents skips
    the head's product at every other position. A backward through it is not: with one
    position kept, the hidden state's gradient is a one-row product over the 49,152-word
    vocabulary, and SmolLM2-135M's FP32 ``J_t`` came out eight times farther from its FP64
    value than with the head at every position (``docs/scale.md``), so
    :func:`token_gradients` leaves it off.

    Args:
        model: a causal LM (Actor) or a ``*ForTokenClassification`` critic with one label.
        batch: the batch as the run padded it.
        tokens: ``(b, t)`` response positions (``0 <= b < B``, ``0 <= t < R``), at least one.
        role: ``actor`` or ``critic``.
        temperature: the sampling temperature (Actor: ``log softmax(logits / T)``).
        head_at_tokens: Actor only: the head at the listed positions only (above).
        params: parameters (and buffers) to call ``model`` with instead of its own
            (``torch.func.functional_call``; names as ``model.named_parameters()``), e.g.
            forward-mode duals.

    Returns:
        ``[len(tokens)]``, FP32 (FP64 for an FP64 model), in the order of ``tokens``.

    Raises:
        ValueError: a token lies outside the batch, or ``tokens`` is empty.
    """
    n_seq, p_len = batch.prompts.shape
    r_len = batch.responses.shape[1]
    toks = [(int(b), int(t)) for b, t in tokens]
    if not toks or not all(0 <= b < n_seq and 0 <= t < r_len for b, t in toks):
        raise ValueError(f"token_outputs: tokens {toks} outside a batch of {n_seq} x {r_len} "
                         "response positions")
    rows = sorted({b for b, _ in toks})
    length = p_len + max(t for _, t in toks)
    ids = torch.cat([batch.prompts[rows], batch.responses[rows]], dim=1)[:, :length]
    mask = batch.attention_mask[rows, :length]
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask,
                              "position_ids": _positions(mask), "use_cache": False}
    seq_pos = [p_len - 1 + t for _, t in toks]
    if head_at_tokens and role == "actor":
        kept = sorted(set(seq_pos))
        kwargs["logits_to_keep"] = torch.tensor(kept, dtype=torch.long)
        seq_pos = [kept.index(q) for q in seq_pos]
    out = (model(**kwargs) if params is None
           else torch.func.functional_call(model, dict(params), (), kwargs))
    y: torch.Tensor = out.logits
    row = torch.tensor([rows.index(b) for b, _ in toks], dtype=torch.long)
    at = torch.tensor(seq_pos, dtype=torch.long)
    if role == "actor":
        picked = y[row, at].unsqueeze(1)  # [n, 1, V]
        words = batch.responses[[b for b, _ in toks], [t for _, t in toks]].unsqueeze(1)
        return _token_logprobs_entropy(picked, words, temperature)[0][:, 0]
    return y[row, at, 0].to(torch.promote_types(y.dtype, torch.float32))


def token_gradients(work: nn.Module, master: nn.Module, batch: Batch, contract: Contract,
                    settings: UpdateSettings, *, role: str,
                    tokens: Sequence[tuple[int, int]],
                    ) -> Iterator[tuple[tuple[int, int], dict[str, torch.Tensor]]]:
    """The parameter gradient of each listed token's logprob (actor) or value (critic).

    A token that a clip switch turns on or off (:mod:`qualify.branches`) moves the round's
    gradient by its unclipped term's gradient, ``s_t * J_t`` with ``J_t`` computed here:

    - Actor: ``J_t = d logp_t / d theta``, ``s_t = -c_t w_t A_t exp(logp_t - old_t)`` (the
      unclipped surrogate, Schulman et al. 2017 eq. 7; the KL and entropy terms are smooth).
    - Critic: ``J_t = d V_t / d theta``, ``s_t = c_t (V_t - G_t)`` (the unclipped value
      loss ``0.5 c_t (V_t - G_t)^2``).

    ``c_t`` is the aggregation factor (``1 / N`` for ``token-mean``,
    :func:`qualify.aggregation.token_scale`), ``w_t`` decoupled PPO's behavior weight (1
    otherwise). The scalar ``s_t`` is left to the comparator, which takes it from the run it
    adjusts (its own values and logprobs). Each sequence that holds a listed token runs
    forward once on ``work`` (:func:`token_outputs`: cut after its last listed token) at
    this run's precision (autocast as the run does) in eval mode (dropout off, as in the
    run; the module's mode is restored after); each ``J_t`` is ``torch.autograd.grad``
    (``.grad`` is not touched), cast to FP32 like the run's gradients. The generator drops
    its own references to a ``J_t`` when the consumer asks for the next one, so a consumer
    that drops its references too holds one ``J_t`` during each backward, not two.

    Args:
        work: the module the round ran forward on (from a :data:`RoundHook`).
        master: the FP32 master (its trainable parameter names key the result).
        batch: the batch as the run padded it (from the hook).
        contract: supplies the temperature.
        settings: this run's settings (precision).
        role: ``actor`` or ``critic``.
        tokens: ``(b, t)`` response positions, each valid.

    Yields:
        ``((b, t), {parameter name: FP32 tensor shaped like the parameter})`` per token,
        in batch order (by ``b``, then ``t``).

    Raises:
        ValueError: a token lies outside the batch (before anything is yielded).
    """
    names = [n for n, p in master.named_parameters() if p.requires_grad]
    params = dict(work.named_parameters())
    prec = _Precision(master, settings)
    wanted = sorted({(int(b), int(t)) for b, t in tokens})
    n_seq, r_len = batch.responses.shape
    outside = [k for k in wanted if not (0 <= k[0] < n_seq and 0 <= k[1] < r_len)]
    if outside:
        raise ValueError(f"tokens {outside} are outside the batch")
    training = work.training
    work.eval()  # dropout off, as in the run (an FP32 master may still be in train mode)
    try:
        for b in sorted({b for b, _ in wanted}):
            here = [t for bb, t in wanted if bb == b]
            with prec.autocast():
                x = token_outputs(work, batch, [(b, t) for t in here], role=role,
                                  temperature=contract.sampling.temperature)
            for i, t in enumerate(here):
                grads = torch.autograd.grad(x[i], [params[n] for n in names],
                                            retain_graph=i + 1 < len(here), allow_unused=True)
                yield (b, t), {
                    n: (torch.zeros(params[n].shape, device=params[n].device) if g is None
                        else g.detach().to(torch.float32))
                    for n, g in zip(names, grads, strict=True)}
                # the consumer is done with this J_t: without this the next backward would
                # run beside it (two J_t, two models' bytes, instead of one)
                del grads
    finally:
        work.train(training)
