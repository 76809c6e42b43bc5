"""Tests of the bound rule's resolution term (qualify.bounds).

The case that motivated it (seed offset 3 of ``qualify sweep --move model,sampling`` on the
default contract):
the round-1 Actor grad norm of torch_tp and DeepSpeed at TP 2 differed from the HF reference
by 1.907e-6, two FP32 ulps of a value in [8, 16), while every control (micro-batch, eager
attention, FP64) gave exactly 0, so the bound was the FP32 floor alone (1e-6) and a
conforming TP 2 sum of squares failed. The expected values below are written from IEEE 754
binary32 by hand (ulp of x in [2^e, 2^(e+1)) is 2^(e-23)), not by calling numpy.spacing.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qualify.bounds import Bound, compute_bounds, judge, scalar_resolutions
from qualify.contract import Contract, default_contract_path, load_contract
from qualify.statistics import ErrorMeasure, MetricKey


def _without_row_split(c: Contract) -> Contract:
    """The default contract with the controls these figures were measured under (no
    ``row_split``; its TP-only class has a test of its own in tests/test_bounds.py)."""
    b = c.bounds
    return dataclasses.replace(c, bounds=dataclasses.replace(
        b, controls_candidate_vs_hf=tuple(n for n in b.controls_candidate_vs_hf
                                          if n != "row_split"),
        controls_tp_vs_tp1=tuple(n for n in b.controls_tp_vs_tp1 if n != "row_split")))


CONTRACT = _without_row_split(load_contract(default_contract_path()))
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


# tiny-qwen3-vocab32k (vocab 32768, 4.3 M Actor parameters), torch_tp-fp32-actor-tp1, run
# 20261201T190027Z of this session: torch.nn.utils.clip_grad_norm_ gave 8.582355499 against the
# reference's FP64-accumulated 8.582361221 (|d| = 5.72e-6, 6 ulps in [8, 16)); the fp64 control
# was 1 ulp away, so the bound was 4 * 1 ulp + 1e-6 = 4.81e-6 and a conforming FP32 norm
# failed at margin 1.19. The reference's own FP32 evaluation of its norm sees that rounding.
NORM_32 = float(np.float32(8.4)) - 6 * ULP_8  # an FP32 evaluation 6 ulps below


def test_the_grad_norm_resolution_covers_its_own_fp32_evaluation_error() -> None:
    evals = {"fp32": {(1, "actor"): NORM_32}}
    res = scalar_resolutions(REFERENCE, evals)["fp32"]
    assert res[GRAD_NORM] == 6 * ULP_8
    assert res[LOSSES] == 2.0 ** (1 - 23)  # other families: the ulp alone
    errors = {"fp32": {name: {GRAD_NORM: _measure(ULP_8)}
                       for name in ("attn_impl", "microbatch", "fp64")}}
    b = {x.key: x for x in compute_bounds(CONTRACT, errors, {"fp32": res})
         if x.klass == "candidate_vs_hf"}
    assert b[GRAD_NORM].bound == pytest.approx(4 * 6 * ULP_8 + FLOOR, rel=1e-15)
    assert judge(6 * ULP_8, b[GRAD_NORM].bound)[0] == "PASS"
    assert judge(1e-5 * 8.4, b[GRAD_NORM].bound)[0] == "FAIL"  # a 1e-5 relative error fails
    # an evaluation within one ulp leaves the ulp term
    same = scalar_resolutions(REFERENCE, {"fp32": {(1, "actor"): float(np.float32(8.4))}})
    assert same["fp32"][GRAD_NORM] == ULP_8
    # a role or round without an evaluation keeps the ulp
    assert scalar_resolutions(REFERENCE, {"fp32": {(2, "actor"): 0.0}})["fp32"][GRAD_NORM] \
        == ULP_8


def test_the_clip_coefficient_carries_the_norm_evaluation_error() -> None:
    norm = float(np.float32(8.4))
    coef = np.float32(0.5 / (norm + 1e-6))  # clips: max_grad_norm 0.5 < 8.4
    ref = {"fp32": {**REFERENCE["fp32"], "round1/actor/clip_coef": np.array(coef)}}
    key = MetricKey(round=1, role="actor", family="clip_coef")
    res = scalar_resolutions(ref, {"fp32": {(1, "actor"): NORM_32}})["fp32"]
    e = 6 * ULP_8
    assert res[key] == pytest.approx(float(coef) * e / (norm + 1e-6), rel=1e-12)
    assert res[key] > float(np.spacing(coef))
    unclipped = {"fp32": {**REFERENCE["fp32"], "round1/actor/clip_coef": np.array(1.0)}}
    assert scalar_resolutions(unclipped, {"fp32": {(1, "actor"): NORM_32}})["fp32"][key] \
        == 2.0 ** -23  # c = 1 does not depend on the norm: one ulp of 1


def test_the_reference_fp32_norm_is_torchs_clip_grad_norm() -> None:
    """The FP32 evaluation the reference records is bitwise what
    ``torch.nn.utils.clip_grad_norm_(foreach=False)`` returns, and over millions of FP32
    gradient elements it differs from the FP64-accumulated norm (the error no control saw)."""
    import torch
    from torch import nn

    from qualify.reference.update import _grad_norm_and_clip

    g = torch.Generator().manual_seed(5)
    shapes = [(32768, 64), (64,), (160, 64), (32768, 64)]
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    twins = [nn.Parameter(torch.zeros(s)) for s in shapes]
    for p, q in zip(params, twins, strict=True):
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
        q.grad = p.grad.clone()
    grads = [p.grad for p in params if p.grad is not None]
    exact = math.sqrt(math.fsum(float(x.double().square().sum()) for x in grads))
    norm, coef, norm_fp32 = _grad_norm_and_clip([(str(i), p) for i, p in enumerate(params)], 0.5)
    torch_norm = torch.nn.utils.clip_grad_norm_(twins, 0.5, foreach=False)
    assert norm_fp32 == float(torch_norm)
    assert norm == pytest.approx(exact, rel=1e-12)
    assert coef == pytest.approx(0.5 / (exact + 1e-6), rel=1e-12)
    assert norm_fp32 != norm  # the FP32 evaluation rounds where the FP64 sum does not


@settings(max_examples=60, deadline=None)
@given(errs=st.dictionaries(st.sampled_from(["attn_impl", "microbatch", "fp64", "row_split"]),
                            st.floats(0.0, 1.0), min_size=4, max_size=4))
def test_the_row_parallel_repartition_bounds_only_the_cells_that_take_it(
        errs: dict[str, float]) -> None:
    """``row_split`` (a TP > 1 engine's row-parallel partial sums) feeds the TP = n vs TP = 1
    class and the ``candidate_vs_hf`` bound of cells at TP > 1 (``candidate_vs_hf_tp``),
    never the ``candidate_vs_hf`` bound of a TP 1 cell, which keeps the tighter bound of
    the executions a TP 1 engine can take (its power to see a 1 % gradient bug)."""
    from qualify.bounds import TP_CANDIDATE_CLASS, TP_ONLY_CONTROLS

    full = load_contract(default_contract_path())  # row_split in both classes
    assert "row_split" in full.bounds.controls_candidate_vs_hf
    errors = {"fp32": {n: {GRAD_NORM: _measure(v)} for n, v in errs.items()}}
    got = {b.klass: b for b in compute_bounds(full, errors)}
    assert set(got) == {"candidate_vs_hf", "tp_vs_tp1", TP_CANDIDATE_CLASS}
    tp1_worst = max(v for n, v in errs.items() if n not in TP_ONLY_CONTROLS)
    assert got["candidate_vs_hf"].control_error == tp1_worst
    assert got["candidate_vs_hf"].control != "row_split"
    assert got[TP_CANDIDATE_CLASS].control_error == max(errs.values())
    assert got["tp_vs_tp1"].control_error == max(
        v for n, v in errs.items() if n in full.bounds.controls_tp_vs_tp1)
    assert got[TP_CANDIDATE_CLASS].bound >= got["candidate_vs_hf"].bound
    # A contract without a TP-only control seals no TP class (its TP > 1 cells take
    # candidate_vs_hf, as before).
    assert {b.klass for b in compute_bounds(CONTRACT, {"fp32": {
        n: v for n, v in errors["fp32"].items() if n != "row_split"}})} == {
        "candidate_vs_hf", "tp_vs_tp1"}
