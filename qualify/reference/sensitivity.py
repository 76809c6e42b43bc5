"""How much each reference loss term moves per unit of each per-token input it is made of.

A loss is a weighted reduction over tokens: ``L = sum_t l_t(x_t)`` with ``x`` the Actor's
logprobs and entropy or the Critic's values. A conforming engine's ``x_t`` differs from the
reference's by rounding noise ``d_t``, and its loss by ``sum_t (dL/dx_t) d_t`` (first order).
The controls measure ``d`` at every token (a per-token family's control error is the largest
over tokens) but the loss only as one realisation of that sum, which depends on the noise at
the few tokens that carry the weight: with the k3 KL estimator the weight ``c (e^r - 1) / N``
grows as ``e^r`` (``r = ref - logp``), so one token can carry most of the loss (tiny-qwen3
seed offset 3, round 2: 80 % of the KL at one token with ``e^r = 6.9e4``, 48 per unit
logprob). :mod:`qualify.bounds` therefore takes a loss's control error no smaller than its
propagated uncertainty ``sqrt(sum_x S_x e_x^2)``, ``S_x = sum_t (dL/dx_t)^2`` and ``e_x`` the
class's per-token control error of ``x`` taken as each token's standard uncertainty: the law
of propagation of uncertainty for uncorrelated inputs (JCGM 100:2008, GUM, eq. 10), with the
rule's ``k`` as its coverage factor. One dominant token gives ``|dL/dx| e_x`` (the worst case
there); weight spread over ``N`` tokens gives about ``1 / sqrt(N)`` of the worst-case sum
``sum_t |dL/dx_t| e_x``, which would assume every token's error at its largest and aligned.
``S_x`` is recorded here.

``S_x`` comes from ``torch.autograd.grad`` of each term with respect to the per-token tensors
(the elementwise loss formulas of :mod:`qualify.reference.update`, differentiated, so no
formula is written twice: clip branches, the k3 exponential, decoupled weights).
"""

from __future__ import annotations

from typing import Final

import torch

LOSS_SENSITIVITY_META: Final = "loss_sensitivity"
"""The role meta key (``reference.json`` ``update_meta``) of the sensitivities,
``{"round<r>": {term: {family: S}}}``, ``S = sum_t (d term / d x_t)^2``
(:class:`LossSensitivity`)."""


class LossSensitivity:
    """``S = sum_t (d term / d x_t)^2`` per round, term and per-token family, accumulated.

    Attributes:
        rounds: ``{"round<r>": {term: {family: S}}}``; ``S >= 0`` (a float; 0 for a family a
            term does not depend on).
    """

    def __init__(self) -> None:
        self.rounds: dict[str, dict[str, dict[str, float]]] = {}

    def add(self, round_: int, terms: dict[str, torch.Tensor],
            inputs: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's share.

        Args:
            round_: the round (1-based).
            terms: term name -> this micro-batch's share of the loss term (a scalar whose
                graph is kept: it is differentiated with ``retain_graph=True``).
            inputs: family name -> the ``[b, R]`` per-token tensor (logprobs, entropy,
                values) the terms are computed from; padding positions have derivative 0.

        Only the elementwise graph between the terms and ``inputs`` is traversed; ``.grad``
        is not touched and the model's graph is kept for the caller's backward.
        """
        sums = self.rounds.setdefault(f"round{round_}", {})
        fams = list(inputs)
        for term, loss in terms.items():
            grads = torch.autograd.grad(loss, [inputs[f] for f in fams], retain_graph=True,
                                        allow_unused=True)
            row = sums.setdefault(term, {})
            for f, g in zip(fams, grads, strict=True):
                row[f] = row.get(f, 0.0) + (0.0 if g is None
                                            else float(g.detach().double().square().sum()))
