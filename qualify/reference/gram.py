"""The Gram matrix ``<J_s, J_t>`` of the sealed clip-branch tokens, exact at any model size.

The comparator moves an expected run to another run's clip branches
(:func:`qualify.branches.adjusted_expected`) and reads the sealed ``J_t`` only at the
gradient elements every run reports (exact, or the protocol's seeded sample of a large
parameter: :func:`qualify.protocol.param_sample_indices`), so storing ``J_t`` at exactly
those elements loses nothing. The one quantity that needs the whole ``J_t`` is the moved
gradient norm, ``|g'|^2 = |g|^2 + 2 sum w_t <g, J_t> + sum_s sum_t w_s w_t <J_s, J_t>``: the
diagonal and ``<g, J_t>`` are computed in FP64 from the whole tensors as each ``J_t`` is
produced; the off-diagonal ``<J_s, J_t>`` is computed here, in one of two exact ways, or
from each token's backward factors (:mod:`qualify.reference.gram_factors`, used between the
two: when the whole ``J_t`` do not fit but the factors do):

- ``fp64``: while the tokens' whole ``J_t`` fit :data:`FULL_BUDGET_BYTES` (tiny-qwen3: 0.64
  MB per token), they are kept and every pair's dot product is summed in FP64, parameter by
  parameter (no approximation; this is what the default contract uses).
- ``jvp``: otherwise, one forward-mode product per sealed token ``s`` and group of up to a
  micro-batch of sequences holding sealed tokens: forward-mode differentiation
  (``torch.autograd.forward_ad``) of the group's token outputs
  (:func:`qualify.reference.jacobian.token_outputs`: cut after its last sealed token) in the
  direction ``J_s`` gives ``<J_s, J_t>`` for every ``t`` in it at once (``J_t = d x_t / d
  theta``, so ``J v`` at ``v = J_s``), with one ``J_s`` in memory at a time (Qwen3-8B: 32.8
  GB FP32, on CPU). Cost: one FP32 forward with tangents (about 2-3 forwards) per token and
  group, next to the one backward per token already paid for ``J_t``. It
  runs with eager attention (PyTorch has no forward-mode rule for the CPU flash SDPA
  kernel; eager and sdpa attention are the same function, they differ by FP32 rounding).
  Row ``s`` covers only the tokens from ``s`` on (the upper triangle: about half the
  passes). Its error is FP32 rounding of one forward pass: each row's diagonal entry is
  checked against the exact FP64 ``|J_s|^2`` (and a pair computed in both rows against its
  transpose), and the largest discrepancy relative to the Gram's scale ``max_u |J_u|^2``
  (the largest entry any pair can have, by Cauchy-Schwarz) is sealed as ``gram_rel_error``
  (asserted below 1e-5 on tiny-qwen3 by ``tests/test_branch_gram.py``); a value above
  :data:`MAX_REL_ERROR` is refused.

Why the Gram's scale and not each pair's own ``|J_s| |J_t|``: a token the policy is sure of
(``1 - p_t`` small) has a tiny ``J_t`` (the logprob's gradient carries the factor ``1 -
p_t``) that FP32 computes as a difference of two near-equal numbers, by backward and by
forward mode alike, so both are exact only to FP32 rounding of the logits' scale, not of
their own; the ratio to ``|J_t|^2`` grows without bound as ``p_t -> 1`` at any finite
precision, while against the Gram's scale the two passes agree to FP32 rounding
(``tests/test_branch_gram.py::test_confident_token_is_exact_to_the_gram_scale``; figures in
``docs/scale.md``). What the comparator moves is ``|g'|^2``, and its error from the Gram is
at most ``sum_s sum_t |w_s| |w_t| |err(s, t)| <= gram_rel_error * max_u |J_u|^2 * (sum_t
|w_t|)^2``.

The earlier estimate (``numel / samples * <sample_s, sample_t>`` over the protocol's samples)
had no bound in terms of what was sealed; the Gram computed here is exact (``fp64``) or
exact to the sealed ``gram_rel_error`` (``jvp``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd import forward_ad as fwad

from qualify.contract import Contract
from qualify.errors import ReferenceDataError
from qualify.reference.jacobian import token_outputs
from qualify.reference.update import Batch

__all__ = ["FULL_BUDGET_BYTES", "MAX_REL_ERROR", "exact_gram", "jvp_row", "symmetrize"]

FULL_BUDGET_BYTES = 1 << 30
"""Keep the tokens' whole FP32 ``J_t`` for an exact FP64 Gram up to this many bytes per
precision, role and round (128 tokens of tiny-qwen3: 82 MB; one of SmolLM2-135M: 538 MB)."""
MAX_REL_ERROR = 1e-4
"""The largest ``|jvp - exact| / max_u |J_u|^2`` accepted (FP32 rounding is ~1e-7)."""


def exact_gram(full: Mapping[str, Mapping[str, torch.Tensor]],
               norm_sq: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """``<J_s, J_t>`` for every pair, summed in FP64 parameter by parameter.

    Args:
        full: ``{token key: {parameter name: FP32 J_t shaped like the parameter}}``.
        norm_sq: ``{token key: |J_t|^2}`` (FP64, the diagonal, taken as is).

    Returns:
        The symmetric ``{key: {key: float}}`` matrix.
    """
    keys = list(full)
    gram: dict[str, dict[str, float]] = {k: {} for k in keys}
    for i, a in enumerate(keys):
        gram[a][a] = float(norm_sq[a])
        for b in keys[i + 1:]:
            v = 0.0
            for p, x in full[a].items():
                v += float((x.double() * full[b][p].double()).sum())
            gram[a][b] = gram[b][a] = v
    return gram


@contextlib.contextmanager
def _eager_attention(model: nn.Module) -> Iterator[None]:
    """Run ``model`` with eager attention inside the block (its config is restored after)."""
    cfg: Any = model.config
    was = cfg._attn_implementation
    cfg._attn_implementation = "eager"
    try:
        yield
    finally:
        cfg._attn_implementation = was


def jvp_row(model: nn.Module, batch: Batch, contract: Contract, *, role: str,
            micro_batch_size: int, tokens: Sequence[tuple[int, int]],
            direction: Mapping[str, torch.Tensor]) -> dict[tuple[int, int], float]:
    """``<J_t, direction>`` for every listed token, by forward-mode differentiation.

    The outputs are those of :func:`qualify.reference.jacobian.token_gradients` (actor: the
    token's logprob at the contract's temperature; critic: its value), in FP32, eval mode,
    with eager attention: the sequences that hold a listed token, in batch order, in groups
    of ``micro_batch_size``, one forward with tangents per group
    (:func:`qualify.reference.jacobian.token_outputs`: the group cut after its last listed
    token, the Actor's head at the listed positions only).

    Args:
        model: the FP32 module ``J_t`` was taken of (its parameters are not changed).
        batch: the batch as the run padded it.
        contract: supplies the temperature.
        role: ``actor`` or ``critic``.
        micro_batch_size: at most this many sequences per forward (the run's micro-batch
            size: the run's own activation memory).
        tokens: ``(b, t)`` response positions.
        direction: ``{trainable parameter name: FP32 tensor shaped like it}`` (``J_s``).

    Returns:
        ``{(b, t): float}``.

    Raises:
        ValueError: a token lies outside the batch, or ``micro_batch_size < 1``.
    """
    if micro_batch_size < 1:
        raise ValueError(f"jvp_row: micro_batch_size {micro_batch_size} < 1")
    primals = {n: p.detach() for n, p in model.named_parameters()}
    tangents = {n: (direction[n].to(p.dtype) if n in direction else torch.zeros_like(p))
                for n, p in primals.items()}
    wanted = sorted({(int(b), int(t)) for b, t in tokens})
    out: dict[tuple[int, int], float] = {}
    training = model.training
    model.eval()
    try:
        with _eager_attention(model):
            seqs = sorted({b for b, _ in wanted})
            for i in range(0, len(seqs), micro_batch_size):
                group = set(seqs[i:i + micro_batch_size])
                here = [k for k in wanted if k[0] in group]
                with fwad.dual_level(), warnings.catch_warnings():
                    # torch loads its forward-mode decompositions on first use through
                    # torch.jit.script, which warns that it is deprecated (torch's own code).
                    warnings.filterwarnings("ignore", category=DeprecationWarning,
                                            message=r"`torch\.jit\.script` is deprecated")
                    duals = {n: fwad.make_dual(p, tangents[n]) for n, p in primals.items()}
                    y = token_outputs(model, batch, here, role=role, head_at_tokens=True,
                                      temperature=contract.sampling.temperature, params=duals)
                    jv = fwad.unpack_dual(y).tangent
                for j, k in enumerate(here):  # no tangent: no output depends on the parameters
                    out[k] = 0.0 if jv is None else float(jv[j])
    finally:
        model.train(training)
    return out


def symmetrize(rows: Mapping[str, Mapping[str, float]],
               norm_sq: Mapping[str, float]) -> tuple[dict[str, dict[str, float]], float]:
    """The Gram from forward-mode rows, and its largest error relative to the Gram's scale.

    Args:
        rows: ``{s: {t: <J_s, J_t> by jvp}}``, diagonal included, each pair in at least
            one of its two rows (the reference stage computes row ``s`` over the tokens from
            ``s`` on, in the order :func:`qualify.reference.jacobian.token_gradients` yields
            them: the upper triangle, half the passes).
        norm_sq: ``{t: |J_t|^2}`` exact in FP64.

    Returns:
        ``(gram, rel_error)``: the diagonal is ``norm_sq``; an off-diagonal entry is the mean
        of ``(s, t)`` and ``(t, s)`` where both were computed, else the one; ``rel_error`` is
        the largest of ``|jvp(s, s) - |J_s|^2|`` and, where both were computed, ``|jvp(s, t)
        - jvp(t, s)|``, divided by ``max_u |J_u|^2`` (module docstring: why not by each
        pair's ``|J_s| |J_t|``); 0 when every ``J_u`` is zero.

    Raises:
        ReferenceDataError: ``rel_error`` exceeds :data:`MAX_REL_ERROR`, or a pair or a
            diagonal entry is missing.
    """
    keys = list(rows)
    scale = max((float(norm_sq[k]) for k in keys), default=0.0)
    gram: dict[str, dict[str, float]] = {k: {} for k in keys}
    worst = 0.0
    for i, a in enumerate(keys):
        gram[a][a] = float(norm_sq[a])
        if a not in rows[a]:
            raise ReferenceDataError(f"clip-branch Gram by forward mode: no jvp({a}, {a})")
        worst = max(worst, abs(rows[a][a] - gram[a][a]))
        for b in keys[i + 1:]:
            both = [v for v in (rows[a].get(b), rows[b].get(a)) if v is not None]
            if not both:
                raise ReferenceDataError(f"clip-branch Gram by forward mode: no <J_{a}, J_{b}>")
            gram[a][b] = gram[b][a] = sum(both) / len(both)
            if len(both) == 2:
                worst = max(worst, abs(both[0] - both[1]))
    err = worst / scale if scale > 0.0 else (0.0 if worst == 0.0 else float("inf"))
    if not err <= MAX_REL_ERROR:
        raise ReferenceDataError(
            f"clip-branch Gram by forward mode: discrepancy {err:.3g} of max |J_u|^2 exceeds "
            f"{MAX_REL_ERROR:g}; the sealed <J_s, J_t> would not be exact to FP32 rounding")
    return gram, err
