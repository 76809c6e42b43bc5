"""Which clip branch each token took, read from reported values and logprobs.

PPO's clipped surrogate and clipped value loss (Schulman et al. 2017; value clipping as in
OpenAI baselines ``ppo2``) are not smooth: at a switch a token's gradient jumps between
its full value and zero. Two computations whose values agree within the sealed bound can
sit on opposite sides of a switch for a token that close to it; their gradients then differ
by that token's whole contribution, which the bound of the gradient families (set by
controls that rarely flip a token) does not cover.

For a failing gradient-family row of round ``r >= 2`` the comparator lists the tokens
whose branch differs between the obtained and the expected run, as each run's own reported
``values`` / ``logprobs`` place them (the protocol's round-1 outputs are the clip centre),
reading only tensors the engines reported and the sealed training inputs. Then:

- if every such token is one the reference sealed, before any candidate ran, as
  clip-ambiguous within its sealed bounds (:func:`ambiguous_tokens`,
  :mod:`qualify.reference.branches`), the round's gradient families are judged, with the
  same sealed bounds, against the expected run moved to the obtained run's branches by the
  sealed per-token contributions (:func:`adjusted_expected`); the row says so and keeps
  the unadjusted error;
- otherwise the row keeps its verdict and its reason names the flips.

A flip moves every gradient-family metric (the gradient, its norm and clip coefficient,
AdamW's moments and the update), never a logprob, value or loss: the clipped losses are
continuous, only their gradients jump.

Switches (``old``: the round-1 value or logprob of the same run):

- Critic, ``d = v_r - v_old``: zero gradient where ``|d| > value_clip`` and the clipped
  term ``(v_old + clip(d) - R)^2`` is strictly the larger one.
- Actor, ``ratio = exp(logp_r - logp_old)``: zero policy gradient where the clipped
  surrogate strictly wins: ``ratio > 1 + clip_ratio`` with ``A > 0``, ``ratio < 1 -
  clip_ratio`` with ``A < 0``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from qualify import aggregation

if TYPE_CHECKING:
    from qualify.contract import Contract

GRADIENT_FAMILIES: Final = frozenset({"grads", "grad_norm", "clip_coef", "exp_avg",
                                      "exp_avg_sq", "updates"})
"""Families computed from the round's gradient: a branch flip moves them all."""
MAX_LISTED: Final = 5


def critic_full_gradient(values_old: npt.ArrayLike, values: npt.ArrayLike,
                         returns: npt.ArrayLike, value_clip: float) -> npt.NDArray[np.bool_]:
    """``[B, R]`` bool: the clipped value loss has its full gradient at this token.

    Args:
        values_old: ``[B, R]`` round-1 values (the clip centre).
        values: ``[B, R]`` values of this round.
        returns: ``[B, R]`` value targets.
        value_clip: the contract's ``algorithm.value_clip``.
    """
    old = np.asarray(values_old, np.float64)
    d = np.asarray(values, np.float64) - old
    rho = np.asarray(returns, np.float64) - old
    clipped = np.clip(d, -value_clip, value_clip)
    return ~((np.abs(d) > value_clip) & ((clipped - rho) ** 2 > (d - rho) ** 2))


def actor_full_gradient(logp_old: npt.ArrayLike, logp: npt.ArrayLike,
                        advantages: npt.ArrayLike, clip_ratio: float) -> npt.NDArray[np.bool_]:
    """``[B, R]`` bool: the clipped surrogate has its full policy gradient at this token.

    Args:
        logp_old: ``[B, R]`` round-1 logprobs.
        logp: ``[B, R]`` logprobs of this round.
        advantages: ``[B, R]``.
        clip_ratio: the contract's ``algorithm.clip_ratio``.
    """
    ratio = np.exp(np.asarray(logp, np.float64) - np.asarray(logp_old, np.float64))
    adv = np.asarray(advantages, np.float64)
    zero = ((adv > 0) & (ratio > 1 + clip_ratio)) | ((adv < 0) & (ratio < 1 - clip_ratio))
    return ~zero


def flipped_tokens(obtained: Mapping[str, Any], expected: Mapping[str, Any], *, role: str,
                   round_: int, train: Mapping[str, Any], mask: npt.ArrayLike,
                   value_clip: float, clip_ratio: float) -> list[dict[str, Any]] | None:
    """Valid tokens whose clip branch differs between two runs in ``round_``.

    Args:
        obtained: protocol tensors of the run judged (``round{r}/{role}/values`` or
            ``.../logprobs`` of rounds 1 and ``round_``).
        expected: the same names from the run it is judged against.
        role: ``actor`` or ``critic``.
        round_: the round (``>= 2``; round 1 has no clipping: its ratio is 1).
        train: the sealed ``advantages`` and ``returns``, ``[B, R]``.
        mask: ``[B, R]`` valid tokens.
        value_clip: the contract's ``algorithm.value_clip``.
        clip_ratio: the contract's ``algorithm.clip_ratio``.

    Returns:
        One ``{"index": [b, t], "obtained": "full"|"zero", "expected": ..., "obtained_x",
        "expected_x"}`` per flipped token (``x``: ``d = v_r - v_old`` or the log ratio), or
        ``None`` when a needed tensor is missing.
    """
    metric = "values" if role == "critic" else "logprobs"
    names = (f"round1/{role}/{metric}", f"round{round_}/{role}/{metric}")
    if round_ < 2 or any(n not in obtained or n not in expected for n in names):
        return None
    valid = np.asarray(mask).astype(bool)
    full: list[npt.NDArray[np.bool_]] = []
    xs: list[npt.NDArray[np.float64]] = []
    for run in (obtained, expected):
        old, cur = np.asarray(run[names[0]]), np.asarray(run[names[1]])
        if role == "critic":
            full.append(critic_full_gradient(old, cur, train["returns"], value_clip))
        else:
            full.append(actor_full_gradient(old, cur, train["advantages"], clip_ratio))
        xs.append(np.asarray(cur, np.float64) - np.asarray(old, np.float64))
    flips = valid & (full[0] != full[1])
    side = {True: "full", False: "zero"}
    return [{"index": [int(b), int(t)], "obtained": side[bool(full[0][b, t])],
             "expected": side[bool(full[1][b, t])], "obtained_x": float(xs[0][b, t]),
             "expected_x": float(xs[1][b, t])}
            for b, t in zip(*np.nonzero(flips), strict=True)]


def earlier_flip_rounds(obtained: Mapping[str, Any], expected: Mapping[str, Any], *,
                        role: str, round_: int, train: Mapping[str, Any], mask: npt.ArrayLike,
                        value_clip: float, clip_ratio: float) -> list[int]:
    """Rounds ``2 .. round_ - 1`` in which the two runs' clip branches already differ.

    A round-``round_`` adjustment moves only that round's gradient; it cannot carry an
    earlier round's different step, so a flip in such a round rules the adjustment out (the
    comparator and the controls' adjustment both refuse it). Arguments as
    :func:`flipped_tokens`.
    """
    return [r for r in range(2, round_) if flipped_tokens(
        obtained, expected, role=role, round_=r, train=train, mask=mask,
        value_clip=value_clip, clip_ratio=clip_ratio)]


def inherited_flips_note(earlier: list[int]) -> str:
    """Why a round with earlier-round flips is not adjusted."""
    return f"branches also differ in round(s) {earlier}, whose steps this round inherits"


def explain(flips: list[dict[str, Any]], *, role: str, round_: int) -> str:
    """One sentence for a failing gradient-family row (empty when nothing flipped)."""
    if not flips:
        return ""
    what = "v_r - v_old" if role == "critic" else "log ratio"
    listed = ", ".join(
        f"({f['index'][0]}, {f['index'][1]}) {f['obtained']} vs {f['expected']} "
        f"({what} {f['obtained_x']:.6g} vs {f['expected_x']:.6g})"
        for f in flips[:MAX_LISTED])
    more = f" and {len(flips) - MAX_LISTED} more" if len(flips) > MAX_LISTED else ""
    return (f"clip branch differs at {len(flips)} round-{round_} {role} token(s), as the two "
            f"runs' own reported values place them (gradient obtained vs expected): "
            f"{listed}{more}; a flip moves the gradient by that token's whole contribution, "
            f"which the controls behind this bound do not produce")


# --------------------------------------------------------------------------- sealed flips

GRID: Final = 17
"""Points per axis of the critic's ambiguity box (both ends included)."""


def ambiguous_tokens(*, role: str, old: npt.ArrayLike, cur: npt.ArrayLike,
                     train: Mapping[str, Any], mask: npt.ArrayLike, tol_old: float,
                     tol_cur: float, value_clip: float, clip_ratio: float,
                     limit: int | None = None) -> list[tuple[int, int]]:
    """Valid tokens whose clip branch can change within the sealed bounds.

    A candidate whose round-1 and round-``r`` values (or logprobs) are each within the
    sealed ``max_abs`` bound of the reference's can sit on either side of a switch for
    these tokens, and only for these. The reference stage lists them before any candidate
    runs (:mod:`qualify.reference.branches`).

    - Actor (the switch depends on ``x = logp_r - logp_old`` and the sign of ``A``): the
      branch at ``x - tol`` and at ``x + tol`` differ, ``tol = tol_old + tol_cur``.
    - Critic (the switch depends on ``v_old`` and ``v_r`` separately): the branch is not
      constant on a :data:`GRID` x :data:`GRID` grid over ``[v_old +- tol_old] x [v_r +-
      tol_cur]``.

    Args:
        role: ``actor`` or ``critic``.
        old: ``[B, R]`` the reference's round-1 logprobs or values.
        cur: ``[B, R]`` the reference's round-``r`` logprobs or values.
        train: the sealed ``advantages`` and ``returns``, ``[B, R]``.
        mask: ``[B, R]`` valid tokens.
        tol_old: the sealed round-1 bound of the family (candidate_vs_hf).
        tol_cur: the sealed round-``r`` bound.
        value_clip: the contract's ``algorithm.value_clip``.
        clip_ratio: the contract's ``algorithm.clip_ratio``.
        limit: keep at most this many, those nearest a switch first (actor: distance of
            ``x`` to the edge over ``tol``; critic: the share of grid points on the other
            branch than the token's own, larger first).

    Returns:
        ``(b, t)`` pairs in row-major order.
    """
    o, c = np.asarray(old, np.float64), np.asarray(cur, np.float64)
    valid = np.asarray(mask).astype(bool)
    if role == "actor":
        adv = np.asarray(train["advantages"], np.float64)
        tol = tol_old + tol_cur
        lo = actor_full_gradient(np.zeros_like(o), c - o - tol, adv, clip_ratio)
        hi = actor_full_gradient(np.zeros_like(o), c - o + tol, adv, clip_ratio)
        amb = lo != hi
        edge = np.where(adv > 0, np.log1p(clip_ratio), np.log1p(-clip_ratio))
        near = -np.abs(c - o - edge) / max(tol, 1e-300)
    else:
        ret = np.asarray(train["returns"], np.float64)[..., None, None]
        steps = np.linspace(-1.0, 1.0, GRID)
        olds = o[..., None, None] + tol_old * steps[:, None]
        curs = c[..., None, None] + tol_cur * steps[None, :]
        full = critic_full_gradient(olds, curs, ret, value_clip)
        amb = full.any(axis=(-2, -1)) & ~full.all(axis=(-2, -1))
        centre = critic_full_gradient(o, c, ret[..., 0, 0], value_clip)
        near = (full != centre[..., None, None]).mean(axis=(-2, -1))
    picked = [(int(b), int(t)) for b, t in zip(*np.nonzero(amb & valid), strict=True)]
    if limit is not None and len(picked) > limit:
        keep = sorted(picked, key=lambda bt: -float(near[bt]))[:limit]
        picked = sorted(keep)
    return picked


def token_key(b: int, t: int) -> str:
    """The name of a sealed token: ``"b_t"``."""
    return f"{b}_{t}"


def loss_factors(run: Mapping[str, Any], *, role: str, mask: npt.ArrayLike,
                 loss_agg_mode: str, behavior_logprobs: npt.ArrayLike | None = None,
                 behavior_weight_cap: float | None = None,
                 cap_mode: str = "truncate",
                 scale_factor: float | None = None) -> npt.NDArray[np.float64]:
    """``[B, R]`` FP64 per-token factor of a token's loss term in ``run``: ``c_t`` (· ``w_t``).

    ``c_t`` is the aggregation factor of ``loss_agg_mode``
    (:func:`qualify.aggregation.token_scale`; ``1 / N`` for ``token-mean``). For the actor
    of a decoupled PPO run (``behavior_logprobs`` given) it is multiplied by the behavior
    weight ``w_t`` of ``run``'s own round-1 logprobs (:func:`qualify.aggregation
    .behavior_weights`; Hilton et al. 2022, AReaL ``ppo_actor_loss_fn``).

    Args:
        run: protocol tensors (``round1/actor/logprobs`` read for the weight).
        role: ``actor`` or ``critic``.
        mask: ``[B, R]`` response mask of the whole batch.
        loss_agg_mode: the contract's ``algorithm.loss_agg_mode``.
        behavior_logprobs: ``[B, R]`` the rollout's behavior logprobs (decoupled PPO only).
        behavior_weight_cap: the contract's cap (``None``: uncapped).
        cap_mode: ``truncate`` or ``filter``.
        scale_factor: the contract's ``loss_scale_factor`` (``seq-mean-token-sum-norm``).

    Raises:
        KeyError: the actor run lacks ``round1/actor/logprobs`` (decoupled PPO).
    """
    c = aggregation.token_scale(mask, loss_agg_mode, scale_factor)
    if role != "actor" or behavior_logprobs is None:
        return c
    w = aggregation.behavior_weights(run["round1/actor/logprobs"], behavior_logprobs, mask,
                                     cap=behavior_weight_cap, cap_mode=cap_mode)
    return c * w


def loss_factors_of(contract: Contract, run: Mapping[str, Any], role: str,
                    mask: npt.ArrayLike,
                    behavior: npt.ArrayLike | None) -> npt.NDArray[np.float64] | None:
    """The contract's per-token loss factors of ``run`` (:func:`loss_factors`).

    ``None`` for ``token-mean`` PPO / GRPO (``adjusted_expected`` then divides by ``N``, as
    it always did); otherwise ``[B, R]`` FP64.

    Raises:
        ValueError: decoupled PPO without ``behavior``.
    """
    alg = contract.algorithm
    decoupled = alg.name == "decoupled_ppo"
    if alg.loss_agg_mode == "token-mean" and not decoupled:
        return None
    if decoupled and behavior is None:
        raise ValueError("decoupled_ppo: the behavior logprobs are needed for the loss factors")
    return loss_factors(run, role=role, mask=mask, loss_agg_mode=alg.loss_agg_mode,
                                 behavior_logprobs=behavior if decoupled else None,
                                 behavior_weight_cap=alg.behavior_weight_cap,
                                 cap_mode=alg.behavior_weight_cap_mode,
                                 scale_factor=alg.loss_scale_factor)


def contribution_scale(run: Mapping[str, Any], *, role: str, round_: int, b: int, t: int,
                       train: Mapping[str, Any], n_valid: float,
                       factors: npt.ArrayLike | None = None) -> float:
    """``s_t``: the factor of ``J_t`` in token ``(b, t)``'s unclipped-term gradient in ``run``.

    Actor ``-f_t * A_t * exp(logp_t - old_t)``; critic ``f_t * (V_t - G_t)``, from ``run``'s
    own round-1 and round-``r`` logprobs / values (see
    :func:`qualify.reference.jacobian.token_gradients`), with ``f_t = factors[b, t]``
    (:func:`loss_factors`) or, when ``factors`` is ``None``, ``1 / N`` (``token-mean``).
    """
    f = 1.0 / n_valid if factors is None else float(np.asarray(factors)[b, t])
    if role == "actor":
        old = float(np.asarray(run[f"round1/{role}/logprobs"])[b, t])
        cur = float(np.asarray(run[f"round{round_}/{role}/logprobs"])[b, t])
        adv = float(np.asarray(train["advantages"])[b, t])
        return -adv * float(np.exp(cur - old)) * f
    v = float(np.asarray(run[f"round{round_}/{role}/values"])[b, t])
    return (v - float(np.asarray(train["returns"])[b, t])) * f


def branch_offsets(run: Mapping[str, Any], reference: Mapping[str, Any], *, role: str,
                   round_: int, train: Mapping[str, Any], mask: npt.ArrayLike, n_valid: float,
                   value_clip: float, clip_ratio: float,
                   factors: npt.ArrayLike | None = None) -> dict[str, float]:
    """``{"b_t": o_t}``: how ``run``'s round-``r`` gradient differs from the reference's by branch.

    ``g_run = g_ref + sum_t o_t J_t`` over the tokens whose clip branch ``run`` took
    differently from the reference (:func:`flipped_tokens` with the reference as the
    expected side): ``o_t = +s_t`` where ``run`` took the full branch and the reference the
    zero one, ``-s_t`` in the other case, ``s_t`` the reference's own contribution scale
    (:func:`contribution_scale`).

    Raises:
        KeyError: a tensor the scale needs is missing from ``reference``.
    """
    flips = flipped_tokens(run, reference, role=role, round_=round_, train=train, mask=mask,
                           value_clip=value_clip, clip_ratio=clip_ratio) or []
    return {token_key(*f["index"]): (1.0 if f["obtained"] == "full" else -1.0)
            * contribution_scale(reference, role=role, round_=round_, b=f["index"][0],
                                 t=f["index"][1], train=train, n_valid=n_valid,
                                 factors=factors)
            for f in flips}


def adjusted_expected(expected: Mapping[str, Any], *, role: str, round_: int,
                      flips: list[dict[str, Any]], jacobians: Mapping[str, Any],
                      scalars: Mapping[str, Any], train: Mapping[str, Any], n_valid: float,
                      lr: float, betas: tuple[float, float], eps: float,
                      max_grad_norm: float, factors: npt.ArrayLike | None = None,
                      offsets: Mapping[str, float] | None = None,
                      ) -> tuple[dict[str, Any], str] | tuple[None, str]:
    """The expected run's round-``r`` gradient families, moved to the obtained run's branches.

    A flipped token's contribution is ``c_t = s_t J_t``: ``J_t`` sealed by the reference
    (:func:`qualify.reference.jacobian.token_gradients`), ``s_t`` from the expected run's own
    values (:func:`contribution_scale`). It is added where the obtained run took the full
    branch and the expected run the zero one (``sign = +1``) and subtracted in the other
    case (``sign = -1``). Then, in FP64, with ``w_t = sign_t s_t``:

    - ``g' = g + sum w_t J_t`` (pre-clip gradients, reported elements);
    - ``|g'|^2 = |g|^2 + 2 sum w_t <g, J_t> + sum_s sum_t w_s w_t <J_s, J_t>`` (the sealed
      scalars; ``|g|`` is the expected run's reported ``grad_norm``). The sealed
      ``<g_ref, J_t>`` is the reference's; when the expected run is another candidate that
      itself took other branches than the reference (``offsets``: ``g = g_ref + sum_u o_u
      J_u``), ``<g, J_t> = <g_ref, J_t> + sum_u o_u <J_u, J_t>``. Without that correction a
      TP = 1 run that left out a token the reference kept, moved to a TP = n run's branch
      that keeps it, counted ``|J_t|^2`` three times instead of once;
    - ``coef' = min(1, max_grad_norm / (|g'| + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``);
    - ``m' = m + (1 - b1)(coef' g' - coef g)``, ``v' = v + (1 - b2)((coef' g')^2 -
      (coef g)^2)`` (AdamW's moments after step ``r``; Loshchilov & Hutter 2019);
    - ``u' = u - lr / (1 - b1^r) * (m' / (sqrt(v' / (1 - b2^r)) + eps) - m / (sqrt(v / (1 -
      b2^r)) + eps))`` (the step's Adam part; decoupled weight decay does not change).

    Every other tensor is the expected run's own. Against the reference itself this is
    exact: ``J_t`` is read only at the elements both runs report, and the sealed Gram
    matrix is over the whole ``J_t`` (:mod:`qualify.reference.gram`; its sealed
    ``gram_rel_error``, 0 when summed in FP64); against
    another candidate (TP = n vs TP = 1) ``J_t`` and ``<g, J_t>`` are the reference's, an
    approximation of the order of the precision's own noise in one token's term.

    Args:
        expected: protocol tensors of the run judged against (``round{r}/{role}/...``).
        role: ``actor`` or ``critic``.
        round_: the round of the flips (>= 2).
        flips: :func:`flipped_tokens` of the two runs in this round.
        jacobians: ``{"{b}_{t}/{param}": array}`` sealed for this precision, role and
            round, shaped like the reported gradients (exact or the protocol's sample).
        scalars: ``{"tokens": {"b_t": {"dot_grad": <g, J_t>}}, "gram": {"b_t": {"b_t":
            <J_s, J_t>}}}`` sealed with them.
        train: the sealed ``advantages`` and ``returns``.
        n_valid: the number of valid response tokens ``N``.
        lr: the role's learning rate.
        betas: AdamW ``(b1, b2)``.
        eps: AdamW epsilon.
        max_grad_norm: the clipping threshold.
        factors: ``[B, R]`` per-token loss factors of the expected run (:func:`loss_factors`:
            the aggregation and, for decoupled PPO, the behavior weight); ``None``:
            ``1 / n_valid`` (``token-mean`` PPO).
        offsets: ``{"b_t": o_t}``, the expected run's own branch offsets from the reference
            (:func:`branch_offsets`); ``None`` or empty: the expected run is the reference
            or took its branches.

    Returns:
        ``(tensors, note)``; ``(None, why)`` when a flipped token is not sealed or a needed
        tensor is missing.
    """
    tok = scalars.get("tokens", {})
    keys = [token_key(*f["index"]) for f in flips] + list(offsets or {})
    unsealed = [k for k in keys if k not in tok]
    if unsealed:
        return None, (f"flipped token(s) {', '.join(unsealed[:MAX_LISTED])} are not among the "
                      "tokens the reference sealed as clip-ambiguous")
    base = f"round{round_}/{role}/"
    grads = {k[len(base) + 6:]: np.asarray(v, np.float64) for k, v in expected.items()
             if k.startswith(base + "grads/")}
    need = [base + "grad_norm", base + "clip_coef"]
    if not grads or any(n not in expected for n in need):
        return None, "the expected run lacks this round's gradients, grad_norm or clip_coef"
    try:
        weight = {token_key(*f["index"]): (1.0 if f["obtained"] == "full" else -1.0)
                  * contribution_scale(expected, role=role, round_=round_, b=f["index"][0],
                                       t=f["index"][1], train=train, n_valid=n_valid,
                                       factors=factors)
                  for f in flips}
    except KeyError as exc:
        return None, f"the expected run lacks {exc}"
    g_new: dict[str, npt.NDArray[np.float64]] = {}
    for p, g in grads.items():
        acc = g.copy()
        for k, w in weight.items():
            j = jacobians.get(f"{k}/{p}")
            if j is None or np.shape(j) != g.shape:
                return None, f"sealed gradient {k}/{p} missing or of another shape"
            acc += w * np.asarray(j, np.float64)
        g_new[p] = acc
    norm = float(np.asarray(expected[base + "grad_norm"], np.float64))
    coef = float(np.asarray(expected[base + "clip_coef"], np.float64))
    gram = scalars.get("gram", {})
    try:
        dot = {k: float(tok[k]["dot_grad"]) + sum(o * float(gram[u][k])
                                                 for u, o in (offsets or {}).items())
               for k in weight}
    except KeyError as exc:
        return None, f"the sealed Gram lacks {exc}"
    sq = norm * norm + sum(2.0 * w * dot[k] for k, w in weight.items())
    sq += sum(w1 * w2 * float(gram[k1][k2]) for k1, w1 in weight.items()
              for k2, w2 in weight.items())
    norm_new = float(np.sqrt(max(sq, 0.0)))
    coef_new = min(1.0, max_grad_norm / (norm_new + 1e-6))
    b1, b2 = betas
    bc1, bc2 = 1.0 - b1**round_, 1.0 - b2**round_

    def adam(m_: npt.NDArray[np.float64], v_: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        return m_ / (np.sqrt(np.maximum(v_, 0.0) / bc2) + eps)  # v >= 0 in any real run

    out: dict[str, Any] = dict(expected)
    out[base + "grad_norm"] = np.asarray(norm_new)
    out[base + "clip_coef"] = np.asarray(coef_new)
    for p, g in grads.items():
        out[base + "grads/" + p] = g_new[p]
        m_name, v_name, u_name = (f"{base}{f}/{p}" for f in ("exp_avg", "exp_avg_sq", "updates"))
        if m_name not in expected or v_name not in expected:
            continue
        m, v = np.asarray(expected[m_name], np.float64), np.asarray(expected[v_name], np.float64)
        gc, gc_new = coef * g, coef_new * g_new[p]
        m_new = m + (1.0 - b1) * (gc_new - gc)
        v_new = np.maximum(v + (1.0 - b2) * (gc_new**2 - gc**2), 0.0)
        out[m_name], out[v_name] = m_new, v_new
        if u_name in expected:
            out[u_name] = (np.asarray(expected[u_name], np.float64)
                           - lr / bc1 * (adam(m_new, v_new) - adam(m, v)))
    listed = ", ".join(f"({f['index'][0]}, {f['index'][1]}) "
                       f"{'added' if f['obtained'] == 'full' else 'removed'}"
                       for f in flips[:MAX_LISTED])
    more = f" and {len(weight) - MAX_LISTED} more" if len(weight) > MAX_LISTED else ""
    note = (f"expected moved to the obtained run's clip branches by the reference's sealed "
            f"gradients of {len(weight)} round-{round_} {role} token(s): {listed}{more}; "
            f"grad_norm {norm:.6g} -> {norm_new:.6g}")
    return out, note
