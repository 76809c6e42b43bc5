"""The round-to-round term of the bound rule: round-1 per-token noise carried to round 2.

A round-``r`` per-token row (``logprobs`` and ``entropy`` of the Actor, ``values`` of the
Critic, ``r >= 2``) compares values computed after ``r - 1`` updates, so an engine's error
there holds its own round-``r`` forward noise and the response of the update to its earlier
per-token noise. The controls measure both as one realisation: their round-``r - 1`` noise
lands on some tokens and misses others. A token whose round-``r`` value is sensitive to its
own round-``r - 1`` value (on tiny-qwen3 seed variant 6, a sequence with one response token
whose logprob the first update moves from -0.69 to -3.96) fails round ``r`` when an engine's
legitimate noise lands on it and a control's did not (``docs/findings.md``).

The term measures that response directly, with perturbed reference updates (the lane's own
reference settings; no linear estimate, since the first AdamW step ``m / sqrt(v)`` is
close to ``sign(g)`` and a small gradient change flips whole elements):

- size: ``e``, the largest round-``r - 1`` control error of the perturbed family over every
  control the lane measures (``logprobs`` for the Actor, ``values`` for the Critic; the
  control errors of :func:`qualify.bounds.measure_controls`). It is the noise one honest
  execution was measured to put on one token, not the round-``r - 1`` bound: the bound is
  ``k`` times it, and the term is itself multiplied by ``k`` in the rule.
- perturbation: in round ``r - 1`` only, one valid token gets ``s e`` (``s = +1`` and
  ``-1``, one update per token and sign; nothing else is perturbed): the Actor through its
  target logit, ``+ s T e / max(1 - p, 1/16)`` (``T`` the sampling temperature, ``p`` the
  reference's round-``r - 1`` probability of the target; a logprob change of ``s e`` to
  first order, less where ``p > 15/16``), so the per-token gradient moves as a noisy
  forward's does; the Critic on the value.
- response: per token, the largest ``|x_r - x_r^0|`` of the perturbed token itself over
  its two updates, against an unperturbed update run the same way (``x^0``): a ``[B, R]``
  FP64 tensor per lane, round, role and family (:data:`RESPONDING`; 0 at padding), the same
  for every bound class of the lane, sealed in ``round_to_round.safetensors``
  (:func:`round_to_round_tensors`), its largest entry and that token in
  ``round_to_round.json`` (:func:`round_to_round_document`). One token at a time:
  perturbing a whole response column at once (every sequence's token ``j``) missed the
  case it must hold (variant 12, token ``(1, 1)``: its own response 0.034, with the seven
  other tokens of its column perturbed too 0.004), since the first AdamW
  step answers the sum of the perturbations' gradients, not each.

Each token ``t`` of a responding row is judged against its own bound
``b_t = k * max(control_error, resolution, propagated, response_t) + quantum + floor``
(:meth:`qualify.bounds.Bound.token_bounds`); a token with no response keeps the row's
bound. Cost: ``2 x`` (the valid response tokens) ``+ 1``
updates of ``r`` rounds (the last forward only) per lane, role and round ``r >= 2``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from qualify.reference.bound_inputs import tensor_key
from qualify.statistics import ErrorMeasure, MetricKey

__all__ = ["PERTURBED", "RESPONDING", "Response", "UpdateFn", "measure", "perturbation_size",
           "round_to_round_document", "round_to_round_tensors", "terms"]

PERTURBED: Final = {"actor": "logprobs", "critic": "values"}
"""Role -> the round-``r - 1`` per-token family perturbed (its control error is the size)."""

RESPONDING: Final = {"actor": ("logprobs", "entropy"), "critic": ("values",)}
"""Role -> the round-``r`` per-token families whose response the term holds."""

MIN_ONE_MINUS_P: Final = 1.0 / 16.0
"""Smallest ``1 - p`` the Actor's logit offset divides by (module docstring)."""

UpdateFn = Callable[[str, int, Mapping[int, torch.Tensor] | None], Mapping[str, torch.Tensor]]
"""``update(role, rounds, offsets)``: the lane's reference update of ``role`` run for
``rounds`` rounds with :data:`qualify.reference.update.Offsets` (``None``: unperturbed);
protocol tensors ``round<r>/<role>/<family>`` of shape ``[B, R]``."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Response:
    """One measured term.

    Attributes:
        value: the largest response over the perturbed tokens (>= 0).
        where: ``"(b, t)"`` of that token (``"none"`` when nothing was perturbed).
        perturbation: ``e``, the round-``r - 1`` size.
        runs: perturbed updates run (two per valid token).
        tokens: ``[B, R]`` FP64, each valid token's own response (the larger over its two
            updates; ``inf`` where one was not finite), 0 at padding and where nothing
            was perturbed; ``value`` is its largest entry and ``where`` a token holding it.
    """

    value: float
    where: str
    perturbation: float
    runs: int
    tokens: torch.Tensor


def perturbation_size(errors: Mapping[str, Mapping[MetricKey, ErrorMeasure]],
                      controls: Iterable[str], round_: int, role: str) -> float:
    """``e``: the largest round-``round_`` control error of ``role``'s perturbed family.

    Args:
        errors: one lane's ``{control: {metric: error}}``.
        controls: the controls taken (every control of every class measured in the lane).
        round_: the perturbed round (``r - 1``).
        role: ``actor`` or ``critic``.

    Returns:
        The largest ``value`` over ``controls`` of :data:`PERTURBED` ``[role]`` at that round;
        0 where none measured it or it is not finite.
    """
    key = MetricKey(round=round_, role=role, family=PERTURBED[role])
    e = max((errors[n][key].value for n in controls if key in errors.get(n, {})), default=0.0)
    return e if math.isfinite(e) else 0.0


def _offsets(role: str, sign: float, size: float, token: tuple[int, int], *,
             shape: tuple[int, int], logprobs: torch.Tensor | None,
             temperature: float) -> torch.Tensor:
    """``[B, R]`` FP64, zero but at ``token``: ``sign * size`` (module docstring)."""
    out = torch.zeros(shape, dtype=torch.float64)
    if role == "actor":
        assert logprobs is not None
        one_minus_p = max(1.0 - math.exp(float(logprobs[token])), MIN_ONE_MINUS_P)
        out[token] = sign * temperature * size / one_minus_p
    else:
        out[token] = sign * size
    return out


def measure(update: UpdateFn, *, roles: Iterable[str], rounds: int,
            sizes: Mapping[tuple[int, str], float], mask: torch.Tensor,
            logprobs: Mapping[int, torch.Tensor], temperature: float,
            ) -> dict[MetricKey, Response]:
    """Run the perturbed updates of one lane and measure the round-to-round responses.

    Args:
        update: the lane's :data:`UpdateFn`.
        roles: the roles the lane updates (``actor``, ``critic``).
        rounds: the contract's rounds; rounds ``2..rounds`` get a term.
        sizes: ``{(r - 1, role): e}`` (:func:`perturbation_size`); 0 or missing: no runs, 0.
        mask: ``[B, R]`` valid response tokens.
        logprobs: ``{r - 1: [B, R]}`` the reference's Actor logprobs of that round (the
            target probability of the logit offset).
        temperature: the sampling temperature the logprobs are taken at.

    Returns:
        ``{MetricKey(r, role, family): Response}`` for every round ``r >= 2``, role and
        family of :data:`RESPONDING`.

    Raises:
        KeyError: ``update`` did not return a responding family.
    """
    out: dict[MetricKey, Response] = {}
    tokens = [(int(b), int(t)) for b, t in mask.bool().nonzero().tolist()]
    shape = (int(mask.shape[0]), int(mask.shape[1]))
    for role in roles:
        base: Mapping[str, torch.Tensor] | None = None
        for r in range(2, rounds + 1):
            e = float(sizes.get((r - 1, role), 0.0))
            keys = [MetricKey(round=r, role=role, family=f) for f in RESPONDING[role]]
            best = dict.fromkeys(keys, (0.0, "none"))
            per_token = {k: torch.zeros(shape, dtype=torch.float64) for k in keys}
            runs = 0
            if e > 0.0 and tokens:
                base = base if base is not None else update(role, rounds, None)
                for sign in (1.0, -1.0):
                    for token in tokens:
                        offs = {r - 1: _offsets(role, sign, e, token, shape=shape,
                                                logprobs=logprobs.get(r - 1),
                                                temperature=temperature)}
                        got = update(role, r, offs)
                        runs += 1
                        for k in keys:
                            v = abs(float(got[k.label][token]) - float(base[k.label][token]))
                            v = v if math.isfinite(v) else math.inf
                            per_token[k][token] = max(float(per_token[k][token]), v)
                            if v > best[k][0]:
                                best[k] = (v, f"({token[0]}, {token[1]})")
            for k in keys:
                out[k] = Response(value=best[k][0], where=best[k][1], perturbation=e,
                                  runs=runs, tokens=per_token[k])
    return out


def terms(responses: Mapping[str, Mapping[MetricKey, Response]],
          ) -> dict[str, dict[MetricKey, npt.NDArray[np.float64]]]:
    """The per-token responses :func:`qualify.bounds.compute_bounds` takes.

    Returns:
        ``{lane: {metric: [B, R] FP64}}`` (:attr:`Response.tokens`).
    """
    return {lane: {k: r.tokens.numpy() for k, r in by_key.items()}
            for lane, by_key in responses.items()}


def round_to_round_tensors(responses: Mapping[str, Mapping[MetricKey, Response]],
                           ) -> dict[str, torch.Tensor]:
    """The tensors of ``round_to_round.safetensors``.

    Returns:
        ``{<lane>/<metric label>: [B, R] FP64}``
        (:func:`qualify.reference.bound_inputs.tensor_key`, :attr:`Response.tokens`).
    """
    return {tensor_key(lane, k): r.tokens.contiguous()
            for lane, by_key in responses.items()
            for k, r in sorted(by_key.items(), key=lambda kv: kv[0].label)}


def round_to_round_document(responses: Mapping[str, Mapping[MetricKey, Response]],
                            ) -> dict[str, Any]:
    """The JSON document ``round_to_round.json``.

    Returns:
        ``{lane: {metric label: {"value", "where", "perturbation", "runs"}}}``.
    """
    return {lane: {k.label: {"value": r.value, "where": r.where,
                             "perturbation": r.perturbation, "runs": r.runs}
                   for k, r in sorted(by_key.items(), key=lambda kv: kv[0].label)}
            for lane, by_key in responses.items()}
