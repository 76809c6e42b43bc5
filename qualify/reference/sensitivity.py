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

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from qualify.reference.bound_inputs import LOSS_SENSITIVITY_META

__all__ = ["LOSS_SENSITIVITY_META", "LossSensitivity"]



class LossSensitivity:
    """``S = sum_t (d term / d x_t)^2`` per round, term and per-token family, accumulated.

    Attributes:
        rounds: ``{"round<r>": {term: {family: S}}}``; ``S >= 0`` (a float; 0 for a family a
            term does not depend on).
    """

    def __init__(self) -> None:
        self.rounds: dict[str, dict[str, dict[str, float]]] = {}
        self._curvature: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def add(self, round_: int, terms: dict[str, torch.Tensor],
            inputs: dict[str, torch.Tensor], rows: slice | None = None) -> None:
        """Add one micro-batch's share.

        Args:
            round_: the round (1-based).
            terms: term name -> this micro-batch's share of the loss term (a scalar whose
                graph is kept: it is differentiated with ``retain_graph=True``).
            inputs: family name -> the ``[b, R]`` per-token tensor (logprobs, entropy,
                values) the terms are computed from; padding positions have derivative 0.

            rows: the micro-batch's rows of the batch: with it, the ``total`` term's
                per-token second derivative ``d^2 total / d x_t^2`` is kept for
                :meth:`grad_norm` (the loss is a sum of per-token terms, so its Hessian in
                ``x`` is diagonal).

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
        if rows is None or "total" not in terms:
            return
        curv: dict[str, torch.Tensor] = {}
        for f in fams:
            (d1,) = torch.autograd.grad(terms["total"], [inputs[f]], retain_graph=True,
                                        create_graph=True, allow_unused=True)
            if d1 is None or not d1.requires_grad:  # linear in x_t (entropy): no curvature
                continue
            (d2,) = torch.autograd.grad(d1.sum(), [inputs[f]], retain_graph=True,
                                        allow_unused=True)
            if d2 is not None:
                curv[f] = d2.detach().double()
        self._curvature[(round_, int(rows.start or 0))] = curv

    def grad_norm(self, round_: int, master: nn.Module, batch: Any, micro_batch_size: int,
                  forward: Callable[[nn.Module, Any], torch.Tensor], *,
                  step: float = 1e-3, saved_on_host: bool = False,
                  grad_of: Callable[[nn.Parameter], torch.Tensor | None] | None = None,
                  ) -> None:
        """Record ``G_x = sum_t (d^2 L / d x_t^2 * (ĝ . d x_t / d theta))^2`` for the norm.

        A per-token error ``d_t`` of ``x_t`` moves the loss weight ``dL/dx_t`` by
        ``(d^2 L / d x_t^2) d_t`` and so the gradient ``g = sum_t (dL/dx_t) dx_t/dtheta`` by
        ``sum_t (d^2 L / d x_t^2) d_t dx_t/dtheta``; its norm by the projection on
        ``ĝ = g / |g|`` (first order). ``ĝ . dx_t/dtheta`` is the directional derivative of
        ``x_t`` along ``ĝ``: a central difference of ``forward`` on the FP32 (or FP64) master
        at ``theta +- step * ĝ`` (``step`` in parameter units along the unit vector; the
        parameters are restored bitwise). With the k3 KL at ``e^r = 6.9e4`` (seed offset 3)
        the norm follows one token's logprob this way. Stored as
        ``rounds["round<r>"]["grad_norm"][family]``; nothing when the gradient is 0.

        Args:
            round_: the round (1-based); :meth:`add` was called with ``rows`` for it.
            master: the module whose ``.grad`` holds the round's whole pre-clip gradient.
            batch: the batch as the run padded it (``micro_batches(size)``).
            micro_batch_size: the run's micro-batch size (the rows :meth:`add` saw).
            forward: ``(module, micro_batch) -> [b, R]`` per-token tensor (logprobs or
                values) under ``torch.no_grad``.
            step: the central-difference step.
            saved_on_host: keep the ``saved`` copy of the parameters on the host (the placed
                stage's ``optimizer_state = "host"``); each parameter's value is copied back
                to its device for the arithmetic (the same operations on host parameters:
                bitwise the copy kept with the parameters). ``False``: with the parameters.
            grad_of: ``p -> its gradient`` (``None``: none) instead of ``p.grad`` (a streamed
                run's host copies, :class:`qualify.reference.update._GradStream`); each
                direction is formed where the gradient is and moved to the parameter's
                device (the same operations: bitwise on host parameters).
        """
        # One copy of the parameters (``saved``) and one parameter's temporaries at a time:
        # the unit direction is recomputed per parameter and side instead of held, and the
        # FP64 gradient only per parameter (on SmolLM2's FP64 control, held directions and
        # FP64 gradients were a model copy each at the reference stage's peak, issue #17).
        def grad(p: nn.Parameter) -> torch.Tensor | None:
            if grad_of is not None:
                return grad_of(p)
            return None if p.grad is None else p.grad.detach()

        params = [p for p in master.parameters() if p.requires_grad and grad(p) is not None]
        grads = [g for g in map(grad, params) if g is not None]
        norm = torch.zeros((), dtype=torch.float64)
        for g in grads:
            norm = norm + g.double().square().sum().cpu()  # placed: on the host
        norm = torch.sqrt(norm)
        if not params or float(norm) == 0.0:
            return
        saved = [p.detach().to("cpu", copy=True) if saved_on_host else p.detach().clone()
                 for p in params]
        acc: dict[str, float] = {}
        training = master.training
        master.eval()
        try:
            with torch.no_grad():
                for s, mb in batch.micro_batches(micro_batch_size):
                    curv = self._curvature.get((round_, int(s.start or 0)), {})
                    if not curv:
                        continue
                    side = []
                    for sign in (1.0, -1.0):
                        for p, p0, g in zip(params, saved, grads, strict=True):
                            p.copy_(p0.to(p.device) + sign * step
                                    * (g.double() / norm).to(p.dtype).to(p.device))
                        side.append(forward(master, mb).double())
                    jvp = (side[0] - side[1]) / (2.0 * step)
                    for f, c in curv.items():
                        acc[f] = acc.get(f, 0.0) + float((c * jvp).square().sum())
        finally:
            with torch.no_grad():
                for p, p0 in zip(params, saved, strict=True):
                    p.copy_(p0)
            master.train(training)
        self.rounds.setdefault(f"round{round_}", {})["grad_norm"] = acc
