"""PPO and GRPO training targets in FP64 numpy, written independently of any engine.

The reference stage's third step (docs/concepts.md) turns the HF scores of the frozen
rollout into the targets every engine trains on: KL-shaped token rewards, masked GAE
advantages and returns with a termination-aware bootstrap, whitened advantages, and
GRPO group-normalised advantages. Everything here is float64 numpy; this module
imports no torch and shares no code with a harness.

Layout (``B`` sequences, ``R`` response length; see :mod:`qualify.protocol`):

- ``response_mask`` ``[B, R]``: 1 on response tokens that count, 0 elsewhere. Zeros may
  sit in the middle of a row (tool-output tokens of a multi-turn response) and at its
  end (right padding). Every function treats a masked token as absent: its inputs are
  never read (garbage there changes nothing) and its outputs are exactly 0.
- ``eos_terminated`` ``[B]``: 1 if the response ended with EOS, 0 if it was cut by length.
- ``scores`` ``[B]``: the reward model's score of the whole sequence.
- ``values`` ``[B, R]``: critic value ``V(s_t)`` of the state before response token ``t``.
- ``bootstrap_values`` ``[B]``: critic value of the state after the last valid token,
  read only for length-truncated rows.
- ``logprobs``, ``ref_logprobs`` ``[B, R]``: actor and reference-policy logprobs of the
  sampled tokens.

Sums that feed a result are formed so that appending padding columns does not change
them bit for bit (compressed arrays of valid values, :func:`math.fsum` per row).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Final, Literal, get_args

import numpy as np
import numpy.typing as npt

__all__ = [
    "Algorithm",
    "KlEstimator",
    "Targets",
    "compute_targets",
    "grpo_advantages",
    "kl_estimate",
    "masked_gae",
    "masked_whiten",
    "token_rewards",
]

Array = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
KlEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
Algorithm = Literal["ppo", "grpo", "decoupled_ppo"]

_KL_ESTIMATORS: Final = get_args(KlEstimator)
_ALGORITHMS: Final = get_args(Algorithm)
_GAE_ALGORITHMS: Final = ("ppo", "decoupled_ppo")
_TARGET_ARRAYS: Final = ("kl", "token_rewards", "raw_advantages", "advantages", "returns")


# --------------------------------------------------------------------------- validation


def _as_f64(name: str, x: npt.ArrayLike, ndim: int) -> Array:
    """Convert ``x`` to a float64 array of ``ndim`` dimensions or raise ValueError."""
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: cannot convert to float64 ({exc})") from exc
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {arr.shape}")
    return arr


def _as_mask(name: str, x: npt.ArrayLike, ndim: int) -> BoolArray:
    """Convert a 0/1 mask (bool, int or float) to bool or raise ValueError."""
    arr = np.asarray(x)
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {arr.shape}")
    if arr.dtype != np.bool_:
        if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
            raise ValueError(f"{name}: expected a numeric 0/1 array, got dtype {arr.dtype}")
        bad = ~((arr == 0) | (arr == 1))
        if np.any(bad):
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{name}: values must be 0 or 1, got {arr[idx]!r} at {idx}")
    return arr.astype(bool)


def _check_shape(name: str, arr: npt.NDArray[np.generic], shape: tuple[int, ...]) -> None:
    if arr.shape != shape:
        raise ValueError(f"{name}: shape {arr.shape} does not match the expected {shape}")


def _check_finite(name: str, arr: Array, where: BoolArray | None = None) -> None:
    """Raise ValueError if an element of ``arr`` that counts (``where``) is not finite."""
    bad = ~np.isfinite(arr)
    if where is not None:
        bad &= where
    if np.any(bad):
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: non-finite value {arr[idx]!r} at {idx}")


def _check_unit_interval(name: str, x: float) -> float:
    v = float(x)
    if not 0.0 <= v <= 1.0:  # also rejects NaN
        raise ValueError(f"{name}: must lie in [0, 1], got {x!r}")
    return v


def _check_non_negative(name: str, x: float) -> float:
    v = float(x)
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{name}: must be finite and >= 0, got {x!r}")
    return v


def _last_valid_index(mask: BoolArray) -> npt.NDArray[np.intp]:
    """Index of the last valid token of each row of a ``[B, R]`` mask with valid tokens."""
    r = mask.shape[1]
    return np.asarray(r - 1 - np.argmax(mask[:, ::-1], axis=1), dtype=np.intp)


# --------------------------------------------------------------------------- formulas


def kl_estimate(
    logprobs: npt.ArrayLike,
    ref_logprobs: npt.ArrayLike,
    estimator: KlEstimator,
    response_mask: npt.ArrayLike | None = None,
) -> Array:
    """Per-token estimate of KL(π || π_ref) from the logprobs of the sampled tokens.

    With ``d = logprobs - ref_logprobs`` (Schulman 2020, "Approximating KL divergence"):

    - ``k1 = d`` (unbiased, high variance, can be negative);
    - ``k2 = d² / 2`` (biased, low variance, >= 0);
    - ``k3 = exp(-d) - (-d) - 1`` (unbiased, low variance, >= 0), computed as
      ``expm1(-d) + d`` to avoid the cancellation of ``exp(-d) - 1`` for small ``d``.

    verl calls these ``kl`` (k1), ``mse`` (k2) and ``low_var_kl`` (k3 with ``-d`` clamped
    to [-20, 20] and the estimate to [-10, 10]); ``k3`` here does not clamp, ``low_var_kl``
    does, as verl.

    Args:
        logprobs: ``[B, R]`` float, logprobs of the sampled tokens under the actor.
        ref_logprobs: ``[B, R]`` float, logprobs of the same tokens under the reference policy.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"low_var_kl"``.
        response_mask: optional ``[B, R]`` 0/1; where 0, the inputs are not read and the
            output is exactly 0. ``None`` evaluates every element.

    Returns:
        ``[B, R]`` float64 per-token KL estimate.

    Raises:
        ValueError: unknown estimator, arrays that are not 2-D or differ in shape, a mask
            value outside {0, 1}, or a non-finite logprob on a counted token.
    """
    if estimator not in _KL_ESTIMATORS:
        raise ValueError(f"estimator: expected one of {list(_KL_ESTIMATORS)}, got {estimator!r}")
    lp = _as_f64("logprobs", logprobs, 2)
    ref = _as_f64("ref_logprobs", ref_logprobs, 2)
    _check_shape("ref_logprobs", ref, lp.shape)
    if response_mask is None:
        mask = np.ones(lp.shape, dtype=bool)
    else:
        mask = _as_mask("response_mask", response_mask, 2)
        _check_shape("response_mask", mask, lp.shape)
    _check_finite("logprobs", lp, mask)
    _check_finite("ref_logprobs", ref, mask)
    d = np.where(mask, lp, 0.0) - np.where(mask, ref, 0.0)
    if estimator == "k1":
        out = d
    elif estimator == "k2":
        out = 0.5 * d * d
    elif estimator == "k3":
        out = np.expm1(-d) + d
    else:
        neg = np.clip(-d, -20.0, 20.0)
        out = np.clip(np.expm1(neg) - neg, -10.0, 10.0)
    return np.where(mask, out, 0.0)


def token_rewards(
    scores: npt.ArrayLike,
    kl: npt.ArrayLike,
    response_mask: npt.ArrayLike,
    *,
    kl_coef: float,
) -> Array:
    """KL-shaped per-token rewards: ``r_t = -kl_coef · kl_t``, plus the score at the last token.

    The sequence score is added at the last valid token of each row (Ouyang et al. 2022;
    verl ``apply_kl_penalty`` / trl ``PPOTrainer``). Masked tokens, in the middle or in
    the trailing padding, get exactly 0: neither their KL nor any score leaks there.

    Args:
        scores: ``[B]`` float, reward-model score of each sequence.
        kl: ``[B, R]`` float, per-token KL estimate (:func:`kl_estimate`); masked entries
            are not read.
        response_mask: ``[B, R]`` 0/1, 1 on valid response tokens.
        kl_coef: KL penalty coefficient (finite, >= 0).

    Returns:
        ``[B, R]`` float64 token rewards, 0 on masked tokens.

    Raises:
        ValueError: shapes that differ, a mask value outside {0, 1}, a row without any
            valid token (its score would be dropped), a non-finite score or counted KL
            value, or a negative / non-finite ``kl_coef``.
    """
    coef = _check_non_negative("kl_coef", kl_coef)
    k = _as_f64("kl", kl, 2)
    mask = _as_mask("response_mask", response_mask, 2)
    _check_shape("response_mask", mask, k.shape)
    s = _as_f64("scores", scores, 1)
    _check_shape("scores", s, (k.shape[0],))
    _check_finite("scores", s)
    _check_finite("kl", k, mask)
    empty = ~mask.any(axis=1)
    if np.any(empty):
        raise ValueError(
            f"response_mask: rows {np.flatnonzero(empty).tolist()} have no valid token, "
            "so their score has no token to go to"
        )
    rewards = np.where(mask, -coef * np.where(mask, k, 0.0), 0.0)
    rows = np.arange(k.shape[0])
    rewards[rows, _last_valid_index(mask)] += s
    return rewards


def masked_gae(
    token_rewards: npt.ArrayLike,
    values: npt.ArrayLike,
    response_mask: npt.ArrayLike,
    eos_terminated: npt.ArrayLike,
    bootstrap_values: npt.ArrayLike | None = None,
    *,
    gamma: float,
    lam: float,
) -> tuple[Array, Array]:
    """Generalised advantage estimation over the valid tokens of each row.

    GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation", eq. 16) run over the valid tokens of each row in order, as if
    the masked tokens were absent (verl ``compute_gae_advantage_return`` skips masked
    observation tokens the same way). For valid token ``t`` with next valid token ``u``:

        V_next = V_u                                     (a later valid token exists)
        V_next = 0                                       (last valid token, EOS-terminated)
        V_next = bootstrap_values[b]                     (last valid token, cut by length)
        δ_t = r_t + γ · V_next - V_t
        A_t = δ_t + γ · λ · A_u                          (A_u = 0 after the last valid token)
        G_t = A_t + V_t

    An EOS-terminated response ends the episode and does not bootstrap; a length-truncated
    one was cut at an arbitrary state and bootstraps from the critic (Pardo et al. 2018,
    "Time Limits in Reinforcement Learning").

    Args:
        token_rewards: ``[B, R]`` float, per-token rewards (:func:`token_rewards`).
        values: ``[B, R]`` float, critic values ``V(s_t)``; masked entries are not read.
        response_mask: ``[B, R]`` 0/1, 1 on valid response tokens.
        eos_terminated: ``[B]`` 0/1, 1 if the row ended with EOS, 0 if cut by length.
        bootstrap_values: ``[B]`` float, value of the state after the last valid token;
            read only for truncated rows. ``None`` is allowed when every row is
            EOS-terminated.
        gamma: discount γ in [0, 1].
        lam: GAE λ in [0, 1].

    Returns:
        ``(advantages, returns)``, both ``[B, R]`` float64 and exactly 0 on masked tokens.
        A row without any valid token is all 0.

    Raises:
        ValueError: shapes that differ, a mask value outside {0, 1}, γ or λ outside [0, 1],
            a truncated row without ``bootstrap_values``, or a non-finite value that is read.
    """
    g = _check_unit_interval("gamma", gamma)
    gl = g * _check_unit_interval("lam", lam)
    r = _as_f64("token_rewards", token_rewards, 2)
    v = _as_f64("values", values, 2)
    _check_shape("values", v, r.shape)
    mask = _as_mask("response_mask", response_mask, 2)
    _check_shape("response_mask", mask, r.shape)
    eos = _as_mask("eos_terminated", eos_terminated, 1)
    _check_shape("eos_terminated", eos, (r.shape[0],))
    _check_finite("token_rewards", r, mask)
    _check_finite("values", v, mask)
    truncated = ~eos & mask.any(axis=1)
    if bootstrap_values is None:
        if np.any(truncated):
            raise ValueError(
                f"bootstrap_values: required, rows {np.flatnonzero(truncated).tolist()} "
                "were cut by length and bootstrap from the critic"
            )
        boot = np.zeros(r.shape[0])
    else:
        boot = _as_f64("bootstrap_values", bootstrap_values, 1)
        _check_shape("bootstrap_values", boot, (r.shape[0],))
        _check_finite("bootstrap_values", boot, truncated)
    r = np.where(mask, r, 0.0)
    v = np.where(mask, v, 0.0)

    next_value = np.where(truncated, boot, 0.0)
    next_adv = np.zeros(r.shape[0])
    adv = np.zeros(r.shape)
    for t in range(r.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + g * next_value - v[:, t]
        a = delta + gl * next_adv
        adv[:, t] = np.where(m, a, 0.0)
        next_value = np.where(m, v[:, t], next_value)
        next_adv = np.where(m, a, next_adv)
    returns = np.where(mask, adv + v, 0.0)
    return adv, returns


def masked_whiten(x: npt.ArrayLike, mask: npt.ArrayLike, *, eps: float = 1e-8) -> Array:
    """Whiten ``x`` over its valid elements: ``(x - mean) / sqrt(var + eps)``.

    Mean and variance are taken over all valid elements of the batch together, the
    variance with Bessel's correction (``n / (n - 1)``), as verl ``masked_whiten`` /
    ``masked_var(unbiased=True)`` and trl ``masked_whiten`` do. Masked elements are
    not read and come out exactly 0.

    Args:
        x: ``[B, R]`` (any shape) float values.
        mask: same shape, 0/1, 1 on elements that count.
        eps: added to the variance before the square root (finite, >= 0).

    Returns:
        float64 array of the shape of ``x``, 0 on masked elements.

    Raises:
        ValueError: shapes that differ, a mask value outside {0, 1}, fewer than 2 valid
            elements (the unbiased variance is undefined), a non-finite valid value, a
            negative ``eps``, or a zero variance with ``eps = 0``.
    """
    e = _check_non_negative("eps", eps)
    arr = np.asarray(x, dtype=np.float64)
    m = _as_mask("mask", mask, arr.ndim)
    _check_shape("mask", m, arr.shape)
    _check_finite("x", arr, m)
    valid = arr[m]
    n = valid.size
    if n < 2:
        raise ValueError(f"mask: whitening needs at least 2 valid elements, got {n}")
    mean = valid.mean()
    centred = valid - mean
    var = float(np.mean(centred * centred)) * n / (n - 1)
    if var + e <= 0.0:
        raise ValueError("x: zero variance over the valid elements and eps = 0")
    out = np.zeros(arr.shape)
    out[m] = centred / math.sqrt(var + e)
    return out


def grpo_advantages(
    scores: npt.ArrayLike,
    group_index: npt.ArrayLike,
    response_mask: npt.ArrayLike,
    *,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> Array:
    """GRPO outcome advantages: each score normalised within its prompt's group.

    ``A_b = (s_b - mean_g) / (std_g + eps)`` for every valid token of row ``b`` in group
    ``g`` (DeepSeekMath, Shao et al. 2024, section 4.1.2 "outcome supervision"), with the
    unbiased standard deviation (``torch.std``'s default) as verl
    ``compute_grpo_outcome_advantage`` does. A group of a single sample gets mean 0 and
    std 1, verl's convention, so its advantage is ``s_b / (1 + eps)``. A group whose
    scores are all equal gets advantage 0. With ``norm_by_std=False`` (Dr. GRPO, Liu et
    al. 2025, arXiv 2503.20783; verl ``norm_adv_by_std_in_grpo=False``) ``A_b = s_b -
    mean_g`` (a single-sample group: ``s_b``).

    Args:
        scores: ``[B]`` float, one score per sequence.
        group_index: ``[B]`` integer, the prompt (group) each sequence was sampled from.
        response_mask: ``[B, R]`` 0/1, 1 on valid response tokens.
        eps: added to the group std (finite, >= 0).
        norm_by_std: divide by ``std_g + eps`` (``False``: centre only).

    Returns:
        ``[B, R]`` float64: the row's advantage on its valid tokens, 0 elsewhere.

    Raises:
        ValueError: shapes that differ, a non-integer ``group_index``, a mask value
            outside {0, 1}, a non-finite score, a negative ``eps``, or a group with
            std 0 and ``eps = 0``.
    """
    e = _check_non_negative("eps", eps)
    mask = _as_mask("response_mask", response_mask, 2)
    s = _as_f64("scores", scores, 1)
    _check_shape("scores", s, (mask.shape[0],))
    _check_finite("scores", s)
    gi = np.asarray(group_index)
    if gi.ndim != 1 or not np.issubdtype(gi.dtype, np.integer):
        raise ValueError(
            f"group_index: expected a 1-D integer array, got dtype {gi.dtype} shape {gi.shape}"
        )
    _check_shape("group_index", gi, (mask.shape[0],))
    adv = np.zeros(s.shape)
    for g in np.unique(gi):
        rows = np.flatnonzero(gi == g)
        if rows.size == 1:
            mean, std = 0.0, 1.0
        else:
            group = s[rows]
            mean = float(group.mean())
            std = float(np.std(group, ddof=1))
        if not norm_by_std:
            adv[rows] = s[rows] - mean
            continue
        if std + e <= 0.0:
            raise ValueError(f"group_index: group {int(g)} has std 0 and eps = 0")
        adv[rows] = (s[rows] - mean) / (std + e)
    return np.where(mask, adv[:, None], 0.0)


# --------------------------------------------------------------------------- top level


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Targets:
    """FP64 training targets of one rollout; arrays are read-only.

    Attributes:
        algorithm: the algorithm they were computed for.
        whitened: whether ``advantages`` are whitened ``raw_advantages``.
        kl: ``[B, R]`` per-token KL estimate used in the reward shaping.
        token_rewards: ``[B, R]`` KL-shaped token rewards (score at the last valid token).
        raw_advantages: ``[B, R]`` GAE (PPO) or group-normalised (GRPO) advantages.
        advantages: ``[B, R]`` the advantages engines train on (``raw_advantages``,
            whitened over valid tokens when ``whitened``).
        returns: ``[B, R]`` value targets ``raw_advantages + values`` (PPO); for GRPO,
            which has no critic, ``raw_advantages`` (verl's convention).

    All arrays are float64, of one shape, and exactly 0 on masked tokens.
    """

    algorithm: Algorithm
    whitened: bool
    kl: Array
    token_rewards: Array
    raw_advantages: Array
    advantages: Array
    returns: Array

    def __post_init__(self) -> None:
        if self.algorithm not in _ALGORITHMS:
            raise ValueError(
                f"algorithm: expected one of {list(_ALGORITHMS)}, got {self.algorithm!r}"
            )
        shape = self.kl.shape
        for name in _TARGET_ARRAYS:
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.dtype != np.float64 or arr.ndim != 2:
                raise ValueError(f"{name}: expected a 2-D float64 numpy array")
            _check_shape(name, arr, shape)
            frozen = arr.copy()
            frozen.flags.writeable = False
            object.__setattr__(self, name, frozen)

    def to_tensors(self) -> dict[str, Array]:
        """Name -> contiguous, writable float64 copy of each ``[B, R]`` array, for saving."""
        return {name: np.array(getattr(self, name), dtype=np.float64) for name in _TARGET_ARRAYS}


def compute_targets(
    *,
    algorithm: Algorithm,
    scores: npt.ArrayLike,
    response_mask: npt.ArrayLike,
    logprobs: npt.ArrayLike,
    ref_logprobs: npt.ArrayLike,
    eos_terminated: npt.ArrayLike | None = None,
    values: npt.ArrayLike | None = None,
    bootstrap_values: npt.ArrayLike | None = None,
    group_index: npt.ArrayLike | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    kl_coef: float = 0.0,
    kl_estimator: KlEstimator = "k1",
    whiten: bool = True,
    whiten_eps: float = 1e-8,
    grpo_eps: float = 1e-6,
    grpo_norm_by_std: bool = True,
) -> Targets:
    """Compute the FP64 targets of one rollout for ``algorithm``.

    Steps: ``kl = kl_estimate(logprobs, ref_logprobs)`` on valid tokens; KL-shaped
    ``token_rewards``; then

    - ``ppo`` and ``decoupled_ppo`` (same targets; decoupling only changes the loss):
      :func:`masked_gae` with the termination-aware bootstrap; returns = A + V.
    - ``grpo``: :func:`grpo_advantages` of each row's total token reward
      (``score - kl_coef · Σ kl``, which is the score when ``kl_coef = 0``; verl sums
      ``token_level_rewards`` the same way); returns = advantages (no critic).

    and, if ``whiten``, :func:`masked_whiten` of the advantages over all valid tokens.
    verl whitens GAE advantages and never GRPO ones; the caller decides through ``whiten``.

    Args:
        algorithm: ``"ppo"``, ``"grpo"`` or ``"decoupled_ppo"``.
        scores: ``[B]`` float, reward-model score of each sequence.
        response_mask: ``[B, R]`` 0/1, 1 on valid response tokens (each row needs one).
        logprobs: ``[B, R]`` float, actor logprobs of the sampled tokens (verl uses the
            recomputed old logprobs).
        ref_logprobs: ``[B, R]`` float, reference-policy logprobs of the same tokens.
        eos_terminated: ``[B]`` 0/1, 1 = ended with EOS; required for PPO.
        values: ``[B, R]`` float, critic values; required for PPO, unused by GRPO.
        bootstrap_values: ``[B]`` float, critic value after the last valid token; required
            for PPO when a row is length-truncated.
        group_index: ``[B]`` integer prompt index; required for GRPO.
        gamma: discount in [0, 1] (PPO).
        lam: GAE λ in [0, 1] (PPO).
        kl_coef: coefficient of the KL penalty in the reward (>= 0).
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        whiten: whiten the advantages over valid tokens.
        whiten_eps: variance epsilon of the whitening.
        grpo_eps: std epsilon of the GRPO normalisation.
        grpo_norm_by_std: divide GRPO's centred scores by the group std (Dr. GRPO: off).

    Returns:
        The :class:`Targets`, every array ``[B, R]`` float64 and 0 on masked tokens.

    Raises:
        ValueError: an unknown algorithm or estimator, a missing input the algorithm
            needs, shapes that differ, a mask value outside {0, 1}, γ or λ outside
            [0, 1], a row without valid tokens, a non-finite value that is read, or
            whitening with fewer than 2 valid tokens.
    """
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {list(_ALGORITHMS)}, got {algorithm!r}")
    gamma = _check_unit_interval("gamma", gamma)
    lam = _check_unit_interval("lam", lam)
    mask = _as_mask("response_mask", response_mask, 2)
    kl = kl_estimate(logprobs, ref_logprobs, kl_estimator, mask)
    rewards = token_rewards(scores, kl, mask, kl_coef=kl_coef)

    if algorithm in _GAE_ALGORITHMS:
        if values is None or eos_terminated is None:
            missing = [n for n, x in (("values", values), ("eos_terminated", eos_terminated))
                       if x is None]
            raise ValueError(f"{algorithm}: needs {' and '.join(missing)}")
        raw, returns = masked_gae(rewards, values, mask, eos_terminated, bootstrap_values,
                                  gamma=gamma, lam=lam)
    else:
        if group_index is None:
            raise ValueError("grpo: needs group_index")
        totals = np.array([math.fsum(row[m]) for row, m in zip(rewards, mask, strict=True)])
        raw = grpo_advantages(totals, group_index, mask, eps=grpo_eps,
                              norm_by_std=grpo_norm_by_std)
        returns = raw.copy()

    advantages = masked_whiten(raw, mask, eps=whiten_eps) if whiten else raw.copy()
    return Targets(
        algorithm=algorithm,
        whitened=bool(whiten),
        kl=kl,
        token_rewards=rewards,
        raw_advantages=raw,
        advantages=advantages,
        returns=returns,
    )
