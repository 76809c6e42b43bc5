"""Which clip branch each token took, read from reported values and logprobs.

PPO's clipped surrogate and clipped value loss (Schulman et al. 2017; value clipping as in
OpenAI baselines ``ppo2``) are not smooth: at a switch a token's gradient jumps between
its full value and zero. Two computations whose values agree within the sealed bound can
sit on opposite sides of a switch for a token that close to it; their gradients then differ
by that token's whole contribution, which the bound of the gradient families (set by
controls that rarely flip a token) does not cover.

The comparator uses this module to *explain* such a failure, never to pass it: for a
failing gradient-family row of round ``r >= 2`` it lists the tokens whose branch differs
between the obtained and the expected run, as each run's own reported ``values`` /
``logprobs`` place them (the protocol's round-1 outputs are the clip centre). It reads
only tensors the engines reported and the sealed training inputs; it changes no verdict.

Switches (``old``: the round-1 value or logprob of the same run):

- Critic, ``d = v_r - v_old``: zero gradient where ``|d| > value_clip`` and the clipped
  term ``(v_old + clip(d) - R)^2`` is strictly the larger one.
- Actor, ``ratio = exp(logp_r - logp_old)``: zero policy gradient where the clipped
  surrogate strictly wins: ``ratio > 1 + clip_ratio`` with ``A > 0``, ``ratio < 1 -
  clip_ratio`` with ``A < 0``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import numpy.typing as npt

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
