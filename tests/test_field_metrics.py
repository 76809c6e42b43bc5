"""Tests of qualify.compare.mismatch: hand-derived goldens, comparability notes, invariants.

Golden provenance: the formulas of the module docstring (NeMo-RL's token_mult_prob_error
= mean exp(|d|), k3 = mean(exp(d) - d - 1)), evaluated by hand below; exp values from
the Taylor series to 16 digits (e^0.1 = 1.1051709180756477, e^0.3 = 1.3498588075760032,
e^-0.3 = 0.7408182206817179).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qualify.compare.mismatch import (
    FieldMismatch,
    clip_band_tail,
    comparability_note,
    field_mismatch,
    is_like_for_like,
)

E01, E03, EM03 = 1.1051709180756477, 1.3498588075760032, 0.7408182206817179


def fm(train: Any, gen: Any, mask: Any) -> FieldMismatch:
    return field_mismatch(train, gen, mask, source="s", precision="fp32",
                          logprobs_mode="raw", like_for_like=True)


def test_two_tokens_golden() -> None:
    # d = train - gen = (-1.0 - -1.1, -2.0 - -1.7) = (0.1, -0.3); |d| = (0.1, 0.3).
    # The third token is masked and holds garbage that must not be read.
    train = np.array([[-1.0, -2.0, 50.0]])
    gen = np.array([[-1.1, -1.7, -np.inf]])
    mask = np.array([[1, 1, 0]])
    r = field_mismatch(train, gen, mask, source="s", precision="fp32",
                       logprobs_mode="raw", like_for_like=True)
    assert (r.n_valid, r.n_nonfinite) == (2, 0)
    assert r.mean_abs == pytest.approx(0.2, rel=1e-14)           # (0.1 + 0.3) / 2
    assert r.max_abs == pytest.approx(0.3, rel=1e-14)
    assert r.worst == "(0, 1)"
    assert r.mean_signed == pytest.approx(-0.1, rel=1e-13)       # (0.1 - 0.3) / 2
    assert r.p99_abs == pytest.approx(0.298, rel=1e-13)          # 0.1 + 0.99 * (0.3 - 0.1)
    # NeMo-RL: mean of exp(|d|) = (e^0.1 + e^0.3) / 2 = 1.2275148628258255 ...
    assert r.token_mult_prob_error == pytest.approx((E01 + E03) / 2, rel=1e-14)
    # ... which is not exp(mean |d|) = e^0.2 = 1.2214027581601699.
    assert r.token_mult_prob_error != pytest.approx(math.exp(0.2), rel=1e-6)
    # k3 = ((e^0.1 - 0.1 - 1) + (e^-0.3 + 0.3 - 1)) / 2 = (0.00517091807564771 +
    #      0.04081822068171788) / 2 = 0.022994569378682795
    assert r.k3_kl == pytest.approx(((E01 - 1.1) + (EM03 - 0.7)) / 2, rel=1e-12)
    # two points, both sides decreasing: correlation +1
    assert r.prob_pearson == pytest.approx(1.0, abs=1e-12)


def test_identical_logprobs() -> None:
    lp = np.array([[-0.5, -1.5, -2.5], [-0.1, -3.0, 0.0]])
    mask = np.array([[1, 1, 1], [1, 0, 0]])
    r = fm(lp, lp.copy(), mask)
    assert (r.mean_abs, r.max_abs, r.p99_abs, r.mean_signed) == (0.0, 0.0, 0.0, 0.0)
    assert r.token_mult_prob_error == 1.0
    assert r.k3_kl == 0.0
    assert r.prob_pearson == pytest.approx(1.0, abs=1e-12)


def test_no_valid_token_gives_none() -> None:
    r = fm(np.zeros((2, 3)), np.ones((2, 3)), np.zeros((2, 3), dtype=int))
    assert r.n_valid == 0
    assert r.mean_abs is None
    assert r.token_mult_prob_error is None
    assert r.prob_pearson is None


def test_non_finite_valid_tokens_are_counted_and_left_out() -> None:
    train = np.array([[-1.0, np.nan, -2.0]])
    gen = np.array([[-1.0, -1.0, -2.5]])
    r = fm(train, gen, np.ones((1, 3), dtype=int))
    assert (r.n_valid, r.n_nonfinite) == (3, 1)
    assert r.max_abs == pytest.approx(0.5)
    assert r.mean_abs == pytest.approx(0.25)


def test_constant_side_has_no_correlation() -> None:
    r = fm(np.array([[-1.0, -1.0]]), np.array([[-1.0, -2.0]]), np.ones((1, 2), dtype=int))
    assert r.prob_pearson is None


@pytest.mark.parametrize(("train", "gen", "mask"), [
    (np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3))),
    (np.zeros((2, 3)), np.zeros((2, 3)), np.ones((2, 4))),
    (np.zeros(3), np.zeros(3), np.ones(3)),
])
def test_bad_shapes_raise(train: object, gen: object, mask: object) -> None:
    with pytest.raises(ValueError, match="shapes"):
        fm(train, gen, mask)


@pytest.mark.parametrize(("mode", "temperature", "top_k", "top_p", "like", "needle"), [
    ("processed", 0.9, 64, 0.95, False, "NOT like-for-like"),
    ("processed", 0.9, 0, 1.0, True, "like with like"),
    ("processed", 1.0, 0, 0.9, False, "top-k/top-p"),
    ("raw", 1.0, 64, 0.95, True, "like with like"),
    ("raw", 0.9, 0, 1.0, False, "NOT like-for-like"),
])
def test_comparability(mode: str, temperature: float, top_k: int, top_p: float, like: bool,
                       needle: str) -> None:
    assert is_like_for_like(mode, temperature=temperature, top_k=top_k, top_p=top_p) is like
    note = comparability_note(mode, temperature=temperature, top_k=top_k, top_p=top_p)
    assert needle in note
    assert f"logprobs_mode = {mode}" in note


def test_unknown_mode_raises() -> None:
    with pytest.raises(ValueError, match="logprobs_mode"):
        is_like_for_like("sampled", temperature=1.0, top_k=0, top_p=1.0)


_lp = st.floats(min_value=-20.0, max_value=0.0, allow_nan=False)


@given(st.integers(1, 4), st.integers(1, 6), st.data())
@settings(max_examples=80, deadline=None)
def test_invariants(b: int, r: int, data: st.DataObject) -> None:
    train = data.draw(hnp.arrays(np.float64, (b, r), elements=_lp))
    gen = data.draw(hnp.arrays(np.float64, (b, r), elements=_lp))
    mask = data.draw(hnp.arrays(np.int64, (b, r), elements=st.integers(0, 1)))
    res = fm(train, gen, mask)
    # masked tokens are never read: garbage there changes nothing
    g_train = np.where(mask == 1, train, np.nan)
    g_gen = np.where(mask == 1, gen, 1e9)
    assert fm(g_train, g_gen, mask) == res
    if res.n_valid:
        assert res.token_mult_prob_error is not None
        assert res.token_mult_prob_error >= 1.0
        assert res.k3_kl is not None
        assert res.k3_kl >= 0.0
        assert res.mean_abs is not None
        assert res.max_abs is not None
        assert res.mean_abs <= res.max_abs * (1 + 1e-12)  # a mean may round 1 ulp up
        # |d| symmetric in its arguments
        swapped = fm(gen, train, mask)
        assert swapped.mean_abs == res.mean_abs
        assert swapped.max_abs == res.max_abs
        assert swapped.token_mult_prob_error == res.token_mult_prob_error


def test_clip_band_tail_golden() -> None:
    # d = train - gen per token: 0.1 (r = e^0.1 = 1.105, inside [0.8, 1.2]), 0.3 (r = 1.350,
    # above), -0.3 (r = 0.741, below), log(1.2) exactly on the upper edge (inside: strict),
    # and a masked token with garbage. 4 valid tokens, 1 below, 1 above: fraction 0.5.
    edge = math.log(1.2)
    train = np.array([[-1.0, -1.0, -1.0], [-1.0 + edge, 9.0, -1.0]])
    gen = np.array([[-1.1, -1.3, -0.7], [-1.0, np.nan, -1.0 - edge - 1e-12]])
    mask = np.array([[1, 1, 1], [1, 0, 0]])
    row = clip_band_tail(train, gen, mask, source="s", precision="fp32", clip_ratio=0.2)
    assert row == {"source": "s", "precision": "fp32", "clip_low": 0.8, "clip_high": 1.2,
                   "tokens": 4, "below": 1, "above": 1, "fraction_outside": 0.5}
    # unmasking the last token (r = 1.2 * e^1e-12 > 1.2) adds one above
    mask[1, 2] = 1
    row = clip_band_tail(train, gen, mask, source="s", precision="fp32", clip_ratio=0.2)
    assert (row["tokens"], row["above"], row["fraction_outside"]) == (5, 2, 0.6)


def test_clip_band_tail_empty_and_bad() -> None:
    row = clip_band_tail(np.zeros((1, 2)), np.zeros((1, 2)), np.zeros((1, 2)), source="s",
                         precision="bf16", clip_ratio=0.1)
    assert (row["tokens"], row["fraction_outside"]) == (0, None)
    with pytest.raises(ValueError, match="clip_ratio"):
        clip_band_tail(np.zeros((1, 2)), np.zeros((1, 2)), np.ones((1, 2)), source="s",
                       precision="fp32", clip_ratio=0.0)
    with pytest.raises(ValueError, match="shapes"):
        clip_band_tail(np.zeros((1, 2)), np.zeros((2, 1)), np.ones((1, 2)), source="s",
                       precision="fp32", clip_ratio=0.2)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.floats(0.01, 0.9), st.data())
def test_clip_band_tail_invariants(b: int, r: int, eps: float, data: st.DataObject) -> None:
    lp = hnp.arrays(np.float64, (b, r), elements=st.floats(-8.0, 0.0))
    train, gen = data.draw(lp), data.draw(lp)
    mask = data.draw(hnp.arrays(np.int8, (b, r), elements=st.integers(0, 1)))
    row = clip_band_tail(train, gen, mask, source="s", precision="fp32", clip_ratio=eps)
    assert row["tokens"] == int(mask.sum())
    assert row["below"] + row["above"] <= row["tokens"]
    # swapping the two sides maps r to 1/r: above 1+eps -> below 1/(1+eps) > 1-eps, so the
    # swapped "below" count is at most the original "above" count
    swapped = clip_band_tail(gen, train, mask, source="s", precision="fp32", clip_ratio=eps)
    assert swapped["below"] <= row["above"]
    same = clip_band_tail(train, train, mask, source="s", precision="fp32", clip_ratio=eps)
    assert same["below"] == same["above"] == 0
