"""The power check of comparison rows (:mod:`qualify.compare.power`).

The null errors are derived by hand: for ``max_abs`` over valid tokens, ``-b`` is ``2
max|b|`` away and zeros ``max|b|``; for ``max_rel_l2`` they are 2 and 1 exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from qualify.bounds import Bound
from qualify.compare.power import NULLS, PowerCache, null_alternatives, power_from, power_of
from qualify.compare.rows import compare_rows
from qualify.statistics import MetricKey

MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0]])
LOGP = np.array([[-1.0, -2.0, -0.5, 9.0], [-3.0, -0.25, 7.0, 7.0]])
"""Valid values -1, -2, -0.5, -3, -0.25 (max |b| = 3); the padding entries must not move."""
LP_KEY = MetricKey(round=1, role="actor", family="logprobs")


def test_per_token_nulls_by_hand() -> None:
    nulls = null_alternatives(LP_KEY, {"": LOGP}, MASK)
    perm = nulls["permuted"]
    assert perm is not None
    p = perm[""]
    valid = MASK.astype(bool)
    assert np.array_equal(p[~valid], LOGP[~valid])  # padding untouched
    assert sorted(p[valid]) == sorted(LOGP[valid])  # a permutation of the valid values
    assert not np.array_equal(p, LOGP)
    pw = power_of(LP_KEY, {"": LOGP}, MASK, bound=1e-5)
    assert pw.sign_flipped == pytest.approx(6.0)  # |-(-3) - (-3)|
    assert pw.zeros == pytest.approx(3.0)
    assert pw.permuted == pytest.approx(float(np.max(np.abs(p - LOGP)[valid])))
    assert pw.has_power
    assert pw.accepted == ()


def test_a_bound_wide_enough_to_accept_a_shuffle_has_no_power() -> None:
    perm_err = power_of(LP_KEY, {"": LOGP}, MASK, bound=1e-5).permuted
    assert perm_err is not None
    assert 0 < perm_err < 3.0
    wide = power_of(LP_KEY, {"": LOGP}, MASK, bound=perm_err)  # accepts the shuffle only
    assert not wide.has_power
    assert wide.accepted == ("permuted",)
    wider = power_of(LP_KEY, {"": LOGP}, MASK, bound=6.0)
    assert wider.accepted == NULLS


def test_scalars_have_no_permutation() -> None:
    key = MetricKey(round=2, role="actor", family="clip_coef")
    pw = power_of(key, {"": np.array(0.25)}, MASK, bound=1e-6)
    assert pw.permuted is None
    assert pw.sign_flipped == pytest.approx(0.5)
    assert pw.zeros == pytest.approx(0.25)
    assert pw.has_power
    # clip_coef == 0 exactly: -0 and 0 are the expected value; no bound can reject them.
    zero = power_of(key, {"": np.array(0.0)}, MASK, bound=1e-6)
    assert not zero.has_power
    assert zero.accepted == ("sign_flipped", "zeros")
    losses = MetricKey(round=1, role="actor", family="losses")
    lp = power_of(losses, {"policy": np.array(0.5), "kl": np.array(-0.1)}, MASK, bound=0.01)
    assert lp.permuted is None
    assert lp.sign_flipped == pytest.approx(1.0)


def test_per_parameter_nulls_and_seeds() -> None:
    rng = np.random.default_rng(3)
    grads = {"w": rng.normal(size=(4, 5)), "b": rng.normal(size=5)}
    key = MetricKey(round=1, role="actor", family="grads")
    a = power_of(key, grads, MASK, bound=0.1)
    assert a.sign_flipped == pytest.approx(2.0)
    assert a.zeros == pytest.approx(1.0)
    assert a.permuted is not None
    assert a.permuted > 0.1
    assert a.has_power
    b = power_of(key, {k: v.copy() for k, v in grads.items()}, MASK, bound=0.1)
    assert a == b  # the permutation seed is the metric and member, nothing random
    other = power_of(MetricKey(round=2, role="actor", family="grads"), grads, MASK, bound=0.1)
    assert other.permuted != a.permuted
    # A constant tensor is its own permutation: the bound cannot reject the shuffle.
    const = power_of(key, {"w": np.full((3, 3), 0.5)}, MASK, bound=0.1)
    assert const.permuted == 0.0
    assert const.accepted == ("permuted",)


def test_cache_gives_the_same_numbers() -> None:
    cache: PowerCache = {}
    exp = {"": LOGP}
    first = power_of(LP_KEY, exp, MASK, bound=0.5, cache=cache)
    again = power_of(LP_KEY, exp, MASK, bound=10.0, cache=cache)
    assert len(cache) == 1
    assert (again.permuted, again.sign_flipped, again.zeros) == (
        first.permuted, first.sign_flipped, first.zeros)
    assert again == power_from({"permuted": first.permuted, "sign_flipped": first.sign_flipped,
                                "zeros": first.zeros}, 10.0)


def test_rows_carry_power_and_keep_their_verdict() -> None:
    bounds = [Bound(precision="fp32", klass="candidate_vs_hf", key=LP_KEY, statistic="max_abs",
                    control_error=0.0, control="microbatch", floor=10.0, k=4.0, bound=10.0)]
    expected = {"round1/actor/logprobs": LOGP.astype(np.float32)}
    obtained = {"round1/actor/logprobs": (LOGP + 1e-3).astype(np.float32)}
    (row,) = compare_rows(cell="c", klass="candidate_vs_hf", precision="fp32", bounds=bounds,
                          obtained=obtained, expected=expected, mask=MASK)
    assert row.verdict == "PASS"  # a bound of 10 passes the candidate...
    assert row.power is not None
    assert not row.power.has_power
    assert row.to_dict()["power"]["accepted"] == list(NULLS)
