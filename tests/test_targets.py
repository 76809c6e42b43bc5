"""Tests of qualify.reference.targets: hand-derived goldens, invalid inputs, hypothesis invariants.

Every golden below is derived by hand in the comment next to it; inputs are chosen so
that the arithmetic is exact in binary floating point wherever possible, so the
comparisons are exact (or within 1 ulp where a transcendental function is involved).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from qualify.reference.targets import (
    Targets,
    compute_targets,
    grpo_advantages,
    kl_estimate,
    masked_gae,
    masked_whiten,
    token_rewards,
)

GARBAGE = 1.0e6  # what padded positions hold in the "garbage" tests

# --------------------------------------------------------------------------- KL


@pytest.mark.parametrize(
    ("lp", "ref", "estimator", "expected"),
    [
        # d = lp - ref = -1 - (-2) = 1
        (-1.0, -2.0, "k1", 1.0),  # k1 = d = 1
        (-1.0, -2.0, "k2", 0.5),  # k2 = d^2 / 2 = 1/2
        (-1.0, -2.0, "k3", math.exp(-1.0)),  # k3 = e^(ref-lp) - (ref-lp) - 1 = e^-1 + 1 - 1
        # d = -2 - (-1) = -1
        (-2.0, -1.0, "k1", -1.0),  # k1 = -1 (k1 can be negative)
        (-2.0, -1.0, "k2", 0.5),  # k2 = (-1)^2 / 2
        (-2.0, -1.0, "k3", math.e - 2.0),  # k3 = e^1 - 1 - 1 = e - 2
        (-0.5, -0.5, "k3", 0.0),  # equal logprobs: every estimator is 0
    ],
)
def test_kl_goldens(lp: float, ref: float, estimator: Any, expected: float) -> None:
    out = kl_estimate([[lp]], [[ref]], estimator)
    assert out.dtype == np.float64
    assert out.shape == (1, 1)
    assert out[0, 0] == pytest.approx(expected, rel=4e-16, abs=0.0)


def test_kl_masked_positions_are_zero_and_not_read() -> None:
    lp = np.array([[-1.0, -GARBAGE, -1.0]])
    ref = np.array([[-2.0, GARBAGE, -2.0]])
    mask = np.array([[1, 0, 1]])
    for est in ("k1", "k2", "k3"):
        out = kl_estimate(lp, ref, est, mask)  # no overflow warning (warnings are errors)
        assert out[0, 1] == 0.0
        assert out[0, 0] == out[0, 2] == kl_estimate([[-1.0]], [[-2.0]], est)[0, 0]


@given(
    st.lists(st.floats(-60.0, 0.0), min_size=1, max_size=16),
    st.lists(st.floats(-60.0, 0.0), min_size=1, max_size=16),
)
def test_k2_k3_are_non_negative(a: list[float], b: list[float]) -> None:
    n = min(len(a), len(b))
    lp, ref = np.array([a[:n]]), np.array([b[:n]])
    assert np.all(kl_estimate(lp, ref, "k3") >= 0.0)
    assert np.all(kl_estimate(lp, ref, "k2") >= 0.0)


@given(st.lists(st.floats(-60.0, 0.0), min_size=1, max_size=16),
       st.sampled_from(["k1", "k2", "k3"]))
def test_kl_is_zero_when_logprobs_equal(lp: list[float], estimator: Any) -> None:
    out = kl_estimate([lp], [lp], estimator)
    assert np.all(out == 0.0)


# --------------------------------------------------------------------------- token rewards


def test_token_rewards_golden() -> None:
    # row 0: valid [1, 1, 0(middle), 1, 0(pad)]; last valid token is t = 3.
    # row 1: valid [1, 0, 0, 0, 0];               last valid token is t = 0.
    kl = np.array([[0.5, 0.25, GARBAGE, 1.0, GARBAGE],
                   [2.0, GARBAGE, GARBAGE, GARBAGE, GARBAGE]])
    mask = np.array([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0]])
    out = token_rewards([3.0, -1.0], kl, mask, kl_coef=0.5)
    # r = -0.5 * kl on valid tokens; + score at the last valid token; 0 elsewhere.
    expected = np.array([
        [-0.25, -0.125, 0.0, -0.5 + 3.0, 0.0],
        [-1.0 + -1.0, 0.0, 0.0, 0.0, 0.0],
    ])
    np.testing.assert_array_equal(out, expected)


# --------------------------------------------------------------------------- GAE goldens


def test_gae_gamma1_lam1_is_reward_to_go_minus_value() -> None:
    r = [[1.0, 2.0, 3.0]]
    v = [[0.5, 1.0, 2.0]]
    adv, ret = masked_gae(r, v, [[1, 1, 1]], [1], gamma=1.0, lam=1.0)
    # reward-to-go: [1+2+3, 2+3, 3] = [6, 5, 3]; A = G - V = [5.5, 4, 1]
    np.testing.assert_array_equal(adv, [[5.5, 4.0, 1.0]])
    np.testing.assert_array_equal(ret, [[6.0, 5.0, 3.0]])


@pytest.mark.parametrize("eos", [1, 0])
def test_gae_gamma0_is_reward_minus_value(eos: int) -> None:
    # gamma = 0: delta_t = r_t - V_t and the recursion term gamma*lam*A vanishes, so
    # A = [1 - 0.5, 2 - 1, 3 - 2] = [0.5, 1, 1] whether or not the row bootstraps.
    adv, ret = masked_gae([[1.0, 2.0, 3.0]], [[0.5, 1.0, 2.0]], [[1, 1, 1]], [eos], [10.0],
                          gamma=0.0, lam=0.7)
    np.testing.assert_array_equal(adv, [[0.5, 1.0, 1.0]])
    np.testing.assert_array_equal(ret, [[1.0, 2.0, 3.0]])  # returns = A + V = r


# gamma = lam = 0.5 (gamma*lam = 0.25), rewards [1, 0, 2], values [1, 2, 4], EOS-terminated:
#   t=2: delta = 2 + 0.5*0 - 4 = -2;    A2 = -2
#   t=1: delta = 0 + 0.5*4 - 2 =  0;    A1 = 0 + 0.25*(-2)   = -0.5
#   t=0: delta = 1 + 0.5*2 - 1 =  1;    A0 = 1 + 0.25*(-0.5) =  0.875
EOS_ADV = [0.875, -0.5, -2.0]
# Same row cut by length, bootstrap value 8:
#   t=2: delta = 2 + 0.5*8 - 4 =  2;    A2 = 2
#   t=1: delta = 0;                     A1 = 0 + 0.25*2      =  0.5
#   t=0: delta = 1;                     A0 = 1 + 0.25*0.5    =  1.125
TRUNC_ADV = [1.125, 0.5, 2.0]


def test_gae_eos_vs_truncated_differ_by_the_bootstrap_term() -> None:
    r = [[1.0, 0.0, 2.0]] * 2
    v = [[1.0, 2.0, 4.0]] * 2
    adv, ret = masked_gae(r, v, [[1, 1, 1]] * 2, [1, 0], [8.0, 8.0], gamma=0.5, lam=0.5)
    np.testing.assert_array_equal(adv, [EOS_ADV, TRUNC_ADV])
    np.testing.assert_array_equal(ret, [[1.875, 1.5, 2.0], [2.125, 2.5, 6.0]])
    # The difference is gamma * V_boot * (gamma*lam)^(T-1-t) = 4 * 0.25^k = [0.25, 1, 4].
    np.testing.assert_array_equal(adv[1] - adv[0], [0.25, 1.0, 4.0])


def test_gae_eos_row_ignores_bootstrap_value() -> None:
    a1, _ = masked_gae([[1.0, 0.0, 2.0]], [[1.0, 2.0, 4.0]], [[1, 1, 1]], [1], [GARBAGE],
                       gamma=0.5, lam=0.5)
    a2, _ = masked_gae([[1.0, 0.0, 2.0]], [[1.0, 2.0, 4.0]], [[1, 1, 1]], [1], None,
                       gamma=0.5, lam=0.5)
    np.testing.assert_array_equal(a1, [EOS_ADV])
    np.testing.assert_array_equal(a2, [EOS_ADV])


def test_gae_middle_masked_tokens_equal_compressed_sequence() -> None:
    # The compressed row is the golden above; masked tokens hold garbage and are skipped:
    # the "next value" of t=1 is the value at t=3 (4), not the garbage at t=2.
    r = [[1.0, 0.0, GARBAGE, 2.0, GARBAGE, GARBAGE]]
    v = [[1.0, 2.0, GARBAGE, 4.0, GARBAGE, GARBAGE]]
    mask = [[1, 1, 0, 1, 0, 0]]
    for eos, expected in ((1, EOS_ADV), (0, TRUNC_ADV)):
        adv, ret = masked_gae(r, v, mask, [eos], [8.0], gamma=0.5, lam=0.5)
        a0, a1, a2 = expected
        np.testing.assert_array_equal(adv, [[a0, a1, 0.0, a2, 0.0, 0.0]])
        np.testing.assert_array_equal(ret, [[a0 + 1, a1 + 2, 0.0, a2 + 4, 0.0, 0.0]])


def test_gae_row_without_valid_tokens_is_zero() -> None:
    adv, ret = masked_gae([[GARBAGE, 1.0]], [[GARBAGE, 2.0]], [[0, 0]], [0], [GARBAGE],
                          gamma=0.9, lam=0.9)
    assert np.all(adv == 0.0)
    assert np.all(ret == 0.0)


# --------------------------------------------------------------------------- whitening


def test_masked_whiten_golden() -> None:
    # valid values [1, 2, 3, 6]: mean 3, deviations [-2, -1, 0, 3], sum of squares 14,
    # unbiased variance 14 / 3, so whitened = deviation / sqrt(14/3 + eps).
    x = np.array([[1.0, 2.0, 99.0], [3.0, -50.0, 6.0]])
    mask = np.array([[1, 1, 0], [1, 0, 1]])
    for eps in (0.0, 1e-8):
        s = math.sqrt(14.0 / 3.0 + eps)
        out = masked_whiten(x, mask, eps=eps)
        np.testing.assert_allclose(out, [[-2 / s, -1 / s, 0.0], [0.0, 0.0, 3 / s]],
                                   rtol=1e-15, atol=0.0)
        assert out[0, 2] == 0.0
        assert out[1, 1] == 0.0
    out = masked_whiten(x, mask, eps=0.0)
    valid = out[mask.astype(bool)]
    assert valid.mean() == pytest.approx(0.0, abs=1e-15)
    assert valid.var(ddof=1) == pytest.approx(1.0, rel=1e-14)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-10.0, 10.0), min_size=3, max_size=24),
    st.floats(0.1, 100.0),
    st.floats(-100.0, 100.0),
)
def test_masked_whiten_is_affine_invariant(xs: list[float], a: float, b: float) -> None:
    x = np.array([xs])
    mask = np.ones_like(x)
    mask[0, 1] = 0  # one masked element in the middle
    assume(np.std(x[mask == 1]) > 1e-2)
    w1 = masked_whiten(x, mask, eps=0.0)
    w2 = masked_whiten(a * x + b, mask, eps=0.0)
    np.testing.assert_allclose(w2, w1, rtol=1e-9, atol=1e-9)
    assert w2[0, 1] == 0.0


# --------------------------------------------------------------------------- GRPO


def test_grpo_golden_two_groups_and_a_singleton() -> None:
    scores = [1.0, 0.0, 3.0, 0.0, 3.0, 5.0]
    groups = [0, 1, 0, 1, 1, 2]
    mask = np.ones((6, 2))
    mask[1, 1] = 0
    eps = 1e-6
    out = grpo_advantages(scores, groups, mask, eps=eps)
    # group 0: scores [1, 3], mean 2, unbiased std sqrt((1 + 1) / 1) = sqrt(2)
    s0 = math.sqrt(2.0) + eps
    # group 1: scores [0, 0, 3], mean 1, deviations [-1, -1, 2], unbiased var 6/2 = 3
    s1 = math.sqrt(3.0) + eps
    # group 2: one sample: verl's convention mean 0, std 1 -> 5 / (1 + eps)
    expected = np.array([-1 / s0, -1 / s1, 1 / s0, -1 / s1, 2 / s1, 5 / (1 + eps)])
    np.testing.assert_allclose(out, np.stack([expected, expected], axis=1) * mask,
                               rtol=1e-15, atol=0.0)
    assert out[1, 1] == 0.0


def test_grpo_equal_scores_give_zero_advantage() -> None:
    out = grpo_advantages([2.0, 2.0], [7, 7], [[1, 1], [1, 0]])
    assert np.all(out == 0.0)


# --------------------------------------------------------------------------- top level


def _batch(rng: np.random.Generator, b: int = 4, r: int = 7) -> dict[str, Any]:
    """Generic data: varied lengths, a masked middle token, truncated and EOS rows."""
    lengths = [r, r - 2, 3, r - 1][:b]
    mask = np.zeros((b, r), dtype=np.int64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    mask[0, 2] = 0  # a tool-output token in the middle
    return {
        "scores": rng.normal(size=b),
        "response_mask": mask,
        "logprobs": rng.uniform(-3.0, -0.1, size=(b, r)),
        "ref_logprobs": rng.uniform(-3.0, -0.1, size=(b, r)),
        "values": rng.normal(size=(b, r)),
        "eos_terminated": np.array([1, 0, 1, 0][:b]),
        "bootstrap_values": rng.normal(size=b),
        "group_index": np.array([0, 0, 1, 1][:b]),
    }


@pytest.mark.parametrize("algorithm", ["ppo", "grpo", "decoupled_ppo"])
def test_count_of_nonzero_whitened_advantages_equals_valid_tokens(algorithm: Any) -> None:
    data = _batch(np.random.default_rng(0))
    t = compute_targets(algorithm=algorithm, gamma=0.99, lam=0.95, kl_coef=0.1,
                        kl_estimator="k3", whiten=True, **data)
    n_valid = int(data["response_mask"].sum())
    assert np.count_nonzero(t.advantages) == n_valid
    for name, arr in t.to_tensors().items():
        assert arr.dtype == np.float64, name
        assert arr.shape == data["response_mask"].shape, name
        assert np.all(arr[data["response_mask"] == 0] == 0.0), name


def test_padding_garbage_does_not_leak() -> None:
    rng = np.random.default_rng(1)
    clean = _batch(rng, r=7)
    # Same batch with 4 more padding columns; every padded position holds garbage.
    extra = 4
    dirty = dict(clean)
    mask = np.pad(clean["response_mask"], ((0, 0), (0, extra)))
    dirty["response_mask"] = mask
    pad = mask == 0
    for key, sign in (("logprobs", -1.0), ("ref_logprobs", 1.0), ("values", 1.0)):
        arr = np.pad(clean[key], ((0, 0), (0, extra)))
        arr[pad] = sign * GARBAGE
        dirty[key] = arr
    for algorithm in ("ppo", "grpo"):
        kw: dict[str, Any] = {"algorithm": algorithm, "gamma": 0.9, "lam": 0.8,
                              "kl_coef": 0.2, "kl_estimator": "k3"}
        a, b = compute_targets(**kw, **clean), compute_targets(**kw, **dirty)
        for name, arr in b.to_tensors().items():
            np.testing.assert_array_equal(arr[:, :7], getattr(a, name), err_msg=name)
            assert np.all(arr[pad] == 0.0), name


def test_ppo_targets_by_hand() -> None:
    # One EOS row, gamma = lam = 0.5, kl_coef = 0.5, k1 estimator.
    # kl = lp - ref = [0, 0, 1] (exact); token rewards = -0.5*kl + score(2.5) at t=2
    #    = [0, 0, -0.5 + 2.5] = [0, 0, 2].
    # values [1, 2, 4] -> with rewards [0, 0, 2]:
    #   t=2: delta = 2 - 4 = -2;             A2 = -2
    #   t=1: delta = 0 + 0.5*4 - 2 = 0;      A1 = 0.25*(-2) = -0.5
    #   t=0: delta = 0 + 0.5*2 - 1 = 0;      A0 = 0.25*(-0.5) = -0.125
    t = compute_targets(algorithm="ppo", scores=[2.5], response_mask=[[1, 1, 1]],
                        logprobs=[[-1.0, -1.0, -1.0]], ref_logprobs=[[-1.0, -1.0, -2.0]],
                        values=[[1.0, 2.0, 4.0]], eos_terminated=[1], gamma=0.5, lam=0.5,
                        kl_coef=0.5, kl_estimator="k1", whiten=False)
    np.testing.assert_array_equal(t.kl, [[0.0, 0.0, 1.0]])
    np.testing.assert_array_equal(t.token_rewards, [[0.0, 0.0, 2.0]])
    np.testing.assert_array_equal(t.raw_advantages, [[-0.125, -0.5, -2.0]])
    np.testing.assert_array_equal(t.advantages, t.raw_advantages)
    np.testing.assert_array_equal(t.returns, [[0.875, 1.5, 2.0]])
    assert t.algorithm == "ppo"
    assert not t.whitened


def test_decoupled_ppo_uses_ppo_targets() -> None:
    data = _batch(np.random.default_rng(2))
    kw: dict[str, Any] = {"gamma": 0.95, "lam": 0.9, "kl_coef": 0.05}
    a = compute_targets(algorithm="ppo", **kw, **data).to_tensors()
    b = compute_targets(algorithm="decoupled_ppo", **kw, **data).to_tensors()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_grpo_targets_use_group_normalised_scores() -> None:
    data = _batch(np.random.default_rng(3))
    t = compute_targets(algorithm="grpo", kl_coef=0.0, whiten=False, **data)
    expected = grpo_advantages(data["scores"], data["group_index"], data["response_mask"])
    np.testing.assert_array_equal(t.advantages, expected)
    np.testing.assert_array_equal(t.returns, expected)  # no critic: returns = advantages


def test_float32_and_int_inputs_are_converted() -> None:
    data = _batch(np.random.default_rng(4))
    data32 = {k: (v.astype(np.float32) if v.dtype == np.float64 else v)
              for k, v in data.items()}
    data32["response_mask"] = data["response_mask"].astype(bool)
    t = compute_targets(algorithm="ppo", **data32)
    assert all(a.dtype == np.float64 for a in t.to_tensors().values())


def test_targets_are_frozen_and_read_only() -> None:
    t = compute_targets(algorithm="ppo", **_batch(np.random.default_rng(5)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.kl = t.kl  # type: ignore[misc]
    with pytest.raises(ValueError, match="read-only"):
        t.advantages[0, 0] = 1.0
    tensors = t.to_tensors()
    assert set(tensors) == {"kl", "token_rewards", "raw_advantages", "advantages", "returns"}
    tensors["advantages"][0, 0] = 12345.0  # copies are writable and independent
    assert t.advantages[0, 0] != 12345.0


# --------------------------------------------------------------------------- invalid inputs


def _good() -> dict[str, Any]:
    return _batch(np.random.default_rng(6))


def _with(**changes: Any) -> dict[str, Any]:
    d = _good()
    d.update(changes)
    return d


INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "unknown algorithm": ({"algorithm": "reinforce"}, "algorithm"),
    "unknown estimator": ({"kl_estimator": "k4"}, "estimator"),
    "gamma above 1": ({"gamma": 1.5}, "gamma"),
    "negative lam": ({"lam": -0.1}, "lam"),
    "nan gamma": ({"gamma": float("nan")}, "gamma"),
    "negative kl_coef": ({"kl_coef": -1.0}, "kl_coef"),
    "mask value 2": ({"response_mask": np.full((4, 7), 2)}, "0 or 1"),
    "mask 1-D": ({"response_mask": np.ones(7)}, "dimensions"),
    "logprobs shape": ({"logprobs": np.zeros((4, 6))}, "shape"),
    "values shape": ({"values": np.zeros((3, 7))}, "values"),
    "scores shape": ({"scores": np.zeros(5)}, "scores"),
    "eos value": ({"eos_terminated": np.array([1, 2, 0, 0])}, "eos_terminated"),
    "empty row": ({"response_mask": np.vstack([np.zeros((1, 7)), np.ones((3, 7))])},
                  "no valid token"),
    "nan score": ({"scores": np.array([np.nan, 0.0, 0.0, 0.0])}, "non-finite"),
    "nan valid value": ({"values": np.full((4, 7), np.nan)}, "non-finite"),
    "missing values": ({"values": None}, "needs values"),
    "missing eos": ({"eos_terminated": None}, "needs eos_terminated"),
    "missing bootstrap": ({"bootstrap_values": None}, "bootstrap_values"),
    "grpo without groups": ({"algorithm": "grpo", "group_index": None}, "group_index"),
    "float group index": ({"algorithm": "grpo", "group_index": np.zeros(4)}, "integer"),
    "string array": ({"logprobs": [["a"] * 7] * 4}, "float64"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_inputs_raise_value_error(case: str) -> None:
    changes, match = INVALID[case]
    kw: dict[str, Any] = {"algorithm": "ppo", **_with(**changes)}
    with pytest.raises(ValueError, match=match):
        compute_targets(**kw)


def test_whiten_needs_two_valid_tokens() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten([[1.0, 5.0]], [[1, 0]])
    with pytest.raises(ValueError, match="zero variance"):
        masked_whiten([[1.0, 1.0]], [[1, 1]], eps=0.0)


def test_grpo_zero_std_without_eps_raises() -> None:
    with pytest.raises(ValueError, match="std 0"):
        grpo_advantages([1.0, 1.0], [0, 0], [[1], [1]], eps=0.0)


# --------------------------------------------------------------------------- hypothesis


@st.composite
def batches(draw: st.DrawFn) -> dict[str, Any]:
    """A random batch: arbitrary masks (each row has a valid token), EOS flags, values."""
    b = draw(st.integers(1, 4))
    r = draw(st.integers(1, 6))
    fin = st.floats(-5.0, 5.0)
    mask = np.array([draw(st.lists(st.integers(0, 1), min_size=r, max_size=r))
                     for _ in range(b)])
    for i in range(b):
        if not mask[i].any():
            mask[i, draw(st.integers(0, r - 1))] = 1

    def mat(elements: st.SearchStrategy[float]) -> np.ndarray:
        return np.array([draw(st.lists(elements, min_size=r, max_size=r)) for _ in range(b)])

    return {
        "scores": np.array(draw(st.lists(fin, min_size=b, max_size=b))),
        "response_mask": mask,
        "logprobs": mat(st.floats(-8.0, 0.0)),
        "ref_logprobs": mat(st.floats(-8.0, 0.0)),
        "values": mat(fin),
        "eos_terminated": np.array(draw(st.lists(st.integers(0, 1), min_size=b, max_size=b))),
        "bootstrap_values": np.array(draw(st.lists(fin, min_size=b, max_size=b))),
        "group_index": np.array(draw(st.lists(st.integers(0, 2), min_size=b, max_size=b))),
    }


@settings(max_examples=60, deadline=None)
@given(batches(), st.integers(0, 5), st.sampled_from(["ppo", "grpo"]),
       st.sampled_from(["k1", "k2", "k3"]), st.floats(0.0, 1.0), st.floats(0.0, 1.0),
       st.floats(-GARBAGE, GARBAGE))
def test_padding_invariance(data: dict[str, Any], extra: int, algorithm: Any, est: Any,
                            gamma: float, lam: float, garbage: float) -> None:
    mask = data["response_mask"]
    whiten = int(mask.sum()) >= 2
    kw: dict[str, Any] = {"algorithm": algorithm, "gamma": gamma, "lam": lam,
                          "kl_coef": 0.1, "kl_estimator": est, "whiten": whiten}
    base = compute_targets(**kw, **data)
    padded = dict(data)
    padded["response_mask"] = np.pad(mask, ((0, 0), (0, extra)))
    for key in ("logprobs", "ref_logprobs", "values"):
        padded[key] = np.pad(data[key], ((0, 0), (0, extra)), constant_values=garbage)
    out = compute_targets(**kw, **padded)
    r = mask.shape[1]
    for name, arr in out.to_tensors().items():
        np.testing.assert_array_equal(arr[:, :r], getattr(base, name), err_msg=name)
        assert np.all(arr[:, r:] == 0.0), name


def _gae_by_hand(rewards: list[float], values: list[float], v_last: float, gamma: float,
                 lam: float) -> list[float]:
    """GAE on a compressed row, straight from the definition A_t = Σ (γλ)^k δ_{t+k}."""
    n = len(rewards)
    nxt = [*values[1:], v_last]
    deltas = [rewards[t] + gamma * nxt[t] - values[t] for t in range(n)]
    return [sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, n)) for t in range(n)]


@settings(max_examples=60, deadline=None)
@given(batches(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_gae_matches_definition_on_compressed_rows(data: dict[str, Any], gamma: float,
                                                   lam: float) -> None:
    mask = data["response_mask"].astype(bool)
    rewards = np.where(mask, data["values"][::-1, ::-1], 0.0)  # any rewards will do
    adv, ret = masked_gae(rewards, data["values"], mask, data["eos_terminated"],
                          data["bootstrap_values"], gamma=gamma, lam=lam)
    for i in range(mask.shape[0]):
        v_last = 0.0 if data["eos_terminated"][i] else float(data["bootstrap_values"][i])
        expected = _gae_by_hand(list(rewards[i][mask[i]]), list(data["values"][i][mask[i]]),
                                v_last, gamma, lam)
        np.testing.assert_allclose(adv[i][mask[i]], expected, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(ret[i][mask[i]], adv[i][mask[i]] + data["values"][i][mask[i]],
                                   rtol=0, atol=0)
        assert np.all(adv[i][~mask[i]] == 0.0)
        assert np.all(ret[i][~mask[i]] == 0.0)


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(["k1", "k2", "k3"]), st.floats(0.0, 1.0))
def test_gamma1_lam1_returns_are_future_reward_sums(data: dict[str, Any], est: Any,
                                                    kl_coef: float) -> None:
    t = compute_targets(algorithm="ppo", gamma=1.0, lam=1.0, kl_coef=kl_coef, kl_estimator=est,
                        whiten=False, **data)
    mask = data["response_mask"].astype(bool)
    for i in range(mask.shape[0]):
        rew = t.token_rewards[i][mask[i]]
        boot = 0.0 if data["eos_terminated"][i] else float(data["bootstrap_values"][i])
        expected = [math.fsum(rew[k:]) + boot for k in range(rew.size)]
        np.testing.assert_allclose(t.returns[i][mask[i]], expected, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(["k1", "k2", "k3"]), st.floats(0.0, 1.0))
def test_zero_kl_when_logprobs_equal_reference(data: dict[str, Any], est: Any,
                                               kl_coef: float) -> None:
    data["ref_logprobs"] = data["logprobs"]
    t = compute_targets(algorithm="ppo", kl_coef=kl_coef, kl_estimator=est, whiten=False, **data)
    assert np.all(t.kl == 0.0)
    # rewards are then the score alone, at the last valid token of each row.
    mask = data["response_mask"].astype(bool)
    for i in range(mask.shape[0]):
        last = int(np.flatnonzero(mask[i])[-1])
        expected = np.zeros(mask.shape[1])
        expected[last] = data["scores"][i]
        np.testing.assert_array_equal(t.token_rewards[i], expected)


def test_targets_validates_and_copies_its_arrays() -> None:
    z = np.zeros((2, 3))
    t = Targets(algorithm="grpo", whitened=False, kl=z, token_rewards=z, raw_advantages=z,
                advantages=z, returns=z)
    assert z.flags.writeable  # the caller's array is copied, not frozen in place
    assert not t.kl.flags.writeable
    with pytest.raises(ValueError, match="returns"):
        Targets(algorithm="ppo", whitened=False, kl=z, token_rewards=z, raw_advantages=z,
                advantages=z, returns=np.zeros((2, 4)))
    with pytest.raises(ValueError, match="float64"):
        Targets(algorithm="ppo", whitened=False, kl=z, token_rewards=z, raw_advantages=z,
                advantages=z, returns=z.astype(np.float32))
    with pytest.raises(ValueError, match="algorithm"):
        Targets(algorithm="a2c", whitened=False, kl=z, token_rewards=z,  # type: ignore[arg-type]
                raw_advantages=z, advantages=z, returns=z)
