"""Tests of the bound rule's resolution term (qualify.bounds).

The case that motivated it (seed 3 of ``scripts/sweep_seeds.py`` on the default contract):
the round-1 Actor grad norm of torch_tp and DeepSpeed at TP 2 differed from the HF reference
by 1.907e-6, two FP32 ulps of a value in [8, 16), while every control (micro-batch, eager
attention, FP64) gave exactly 0, so the bound was the FP32 floor alone (1e-6) and a
conforming TP 2 sum of squares failed. The expected values below are written from IEEE 754
binary32 by hand (ulp of x in [2^e, 2^(e+1)) is 2^(e-23)), not by calling numpy.spacing.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest

from qualify.bounds import Bound, compute_bounds, judge, scalar_resolutions
from qualify.contract import default_contract_path, load_contract
from qualify.statistics import ErrorMeasure, MetricKey

CONTRACT = load_contract(default_contract_path())
GRAD_NORM = MetricKey(round=1, role="actor", family="grad_norm")
LOSSES = MetricKey(round=1, role="actor", family="losses")
LOGPROBS = MetricKey(round=1, role="actor", family="logprobs")
ULP_8 = 2.0 ** (3 - 23)  # 9.5367431640625e-07, the spacing of binary32 in [8, 16)
FLOOR = 1e-6  # contracts/tiny-qwen3.toml [bounds.floors.fp32] grad_norm and losses


def _measure(value: float) -> ErrorMeasure:
    return ErrorMeasure(value=value, where="()", mismatched=int(value > 0), total=1,
                        max_abs=value, max_rel=value)


REFERENCE: dict[str, dict[str, npt.ArrayLike]] = {"fp32": {
    "round1/actor/grad_norm": np.array(8.4, dtype=np.float32),
    "round1/actor/loss/policy": np.array(-0.03, dtype=np.float32),
    "round1/actor/loss/kl": np.array(0.0, dtype=np.float32),
    "round1/actor/loss/total": np.array(-2.5, dtype=np.float32),  # largest |term|: resolution
    "round1/actor/logprobs": np.full((2, 3), -4.0, dtype=np.float32),
}}


def test_resolution_is_one_fp32_ulp_of_the_largest_reference_value() -> None:
    res = scalar_resolutions(REFERENCE)["fp32"]
    assert res[GRAD_NORM] == ULP_8
    assert res[LOSSES] == 2.0 ** (1 - 23)  # |-2.5| in [2, 4)
    assert LOGPROBS not in res  # per-token families keep the rule without resolution


def _bounds(control: float) -> dict[MetricKey, Bound]:
    errors = {"fp32": {name: {GRAD_NORM: _measure(control), LOGPROBS: _measure(control)}
                       for name in ("attn_impl", "microbatch", "fp64")}}
    out = compute_bounds(CONTRACT, errors, scalar_resolutions(REFERENCE))
    return {b.key: b for b in out if b.klass == "tp_vs_tp1"}


def test_a_zero_control_error_is_read_as_one_ulp_not_as_exact() -> None:
    b = _bounds(0.0)
    assert b[GRAD_NORM].control_error == 0.0  # the measurement is kept as measured
    assert b[GRAD_NORM].resolution == ULP_8
    assert b[GRAD_NORM].bound == pytest.approx(4 * ULP_8 + FLOOR, rel=1e-15)
    assert b[LOGPROBS].resolution == 0.0
    assert b[LOGPROBS].bound == 1e-5  # the FP32 logprobs floor alone, as before
    # seed 3: two ulps of TP 2 reduction order now pass; six ulps (5.7e-6) still fail.
    assert judge(2 * ULP_8, b[GRAD_NORM].bound)[0] == "PASS"
    assert judge(6 * ULP_8, b[GRAD_NORM].bound)[0] == "FAIL"
    # and the bound keeps its power: a 1e-6 relative grad-norm error is 9 ulps: FAIL.
    assert judge(8.4e-6, b[GRAD_NORM].bound)[0] == "FAIL"


def test_a_control_error_above_the_resolution_is_the_rule_unchanged() -> None:
    b = _bounds(3e-6)
    assert b[GRAD_NORM].bound == pytest.approx(4 * 3e-6 + FLOOR, rel=1e-15)


def test_bounds_sealed_before_the_resolution_term_are_read_as_sealed() -> None:
    row = {"precision": "fp32", "class": "tp_vs_tp1", "round": 1, "role": "actor",
           "family": "grad_norm", "statistic": "abs", "control_error": 0.0,
           "control": "microbatch", "floor": 1e-6, "k": 4.0, "bound": 1e-6}
    b = Bound.from_dict(row)
    assert b.resolution == 0.0
    assert b.bound == 1e-6
    assert Bound.from_dict(b.to_dict()) == b


def test_a_non_finite_reference_value_has_no_resolution() -> None:
    inf: dict[str, dict[str, npt.ArrayLike]] = {
        "fp32": {"round1/actor/grad_norm": np.array(math.inf, dtype=np.float32)}}
    res = scalar_resolutions(inf)
    assert res["fp32"][GRAD_NORM] == 0.0
