"""Rows a harness or a contract declares not run, and how they count in a cell's verdict.

The class of defect: a check that could not fail passing for one that ran. A harness whose
stack returns its loss whole (TRL) reports ``loss/total`` and declares the other terms
(:func:`qualify.compare.rows.declared_terms`): its ``losses`` row is then measured on the
terms it reported, so a wrong total still fails it, and a term missing without a
declaration is still an infinite error (``FAIL``), never a skipped one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qualify.bounds import Bound
from qualify.compare.rows import compare_rows, declared_not_run, declared_terms
from qualify.protocol import ACTOR_LOSS_TERMS
from qualify.statistics import MetricKey

MASK = np.ones((2, 3), dtype=np.int64)
BOUND = 1e-3
REASON = "the stack returns one loss"


def _bounds(rounds: int = 2) -> list[Bound]:
    return [Bound(precision="fp32", klass="candidate_vs_hf",
                  key=MetricKey(round=r, role="actor", family="losses"), statistic="max_abs",
                  control_error=0.0, control="fp64", floor=BOUND, k=4.0, bound=BOUND)
            for r in range(1, rounds + 1)]


def _losses(values: dict[str, float], round_: int = 1) -> dict[str, Any]:
    return {f"round{round_}/actor/loss/{t}": np.asarray(v, dtype=np.float32)
            for t, v in values.items()}


def _rows(obtained: dict[str, Any], expected: dict[str, Any],
          meta: dict[str, Any] | None) -> list[Any]:
    return compare_rows(cell="trl-fp32-actor-tp1", klass="candidate_vs_hf", precision="fp32",
                        bounds=_bounds(), obtained=obtained, expected=expected, mask=MASK,
                        meta=meta, power_cache={})


TERMS = st.fixed_dictionaries({t: st.floats(-10, 10, width=32) for t in ACTOR_LOSS_TERMS})


@settings(max_examples=20, deadline=None, derandomize=True)
@given(want=TERMS, reported=st.sets(st.sampled_from(ACTOR_LOSS_TERMS), min_size=1),
       declared=st.sets(st.sampled_from(ACTOR_LOSS_TERMS)),
       off=st.sampled_from([0.0, 0.5 * BOUND, 10 * BOUND]), whole=st.booleans())
def test_a_losses_row_is_measured_on_the_reported_terms_only_when_the_rest_is_declared(
        want: dict[str, float], reported: set[str], declared: set[str], off: float,
        whole: bool) -> None:
    """Reported terms judged under the family's bound; an undeclared gap is a FAIL."""
    got = {t: want[t] + off for t in reported}
    entry: dict[str, Any] = {"round": None, "family": "losses", "reason": REASON}
    if not whole:
        entry["terms"] = sorted(declared)
    meta = {"not_run": [entry]} if declared or whole else None
    (row,) = _rows(_losses(got), _losses(want), meta)
    missing = set(ACTOR_LOSS_TERMS) - reported
    covered = not missing or (not whole and missing <= declared)
    worst = max(abs(np.float32(want[t] + off) - np.float32(want[t])) for t in reported)
    if not covered:  # a term missing and not declared: never judged on the rest
        assert row.verdict == "FAIL", row
        assert row.error == float("inf"), row
    else:
        assert row.verdict == ("PASS" if worst <= BOUND else "FAIL"), row
        assert row.error == pytest.approx(worst, abs=1e-6)
        if missing:
            assert f"{', '.join(sorted(missing))} declared not reported: {REASON}" in row.where
            assert f"[{', '.join(sorted(reported))} compared;" in row.where


def test_a_terms_entry_declares_the_terms_never_the_family() -> None:
    """The whole family absent with only a terms entry is a FAIL, not NOT_RUN."""
    meta = {"not_run": [{"round": None, "family": "losses", "terms": ["policy", "kl"],
                         "reason": REASON}]}
    assert declared_not_run(meta, 1, "losses") is None
    assert declared_terms(meta, 1, ["policy", "kl"]) == REASON
    assert declared_terms(meta, 1, ["policy", "entropy"]) is None
    want = _losses(dict.fromkeys(ACTOR_LOSS_TERMS, 1.0))
    (row,) = _rows({}, want, meta)
    assert row.verdict == "FAIL"
    round2 = {"not_run": [{"round": 2, "family": "losses", "terms": ["policy", "kl",
                                                                     "entropy"],
                           "reason": REASON}]}
    (row,) = _rows(_losses({"total": 1.0}), want, round2)  # declared for round 2 only
    assert row.verdict == "FAIL"
    assert row.error == float("inf")
