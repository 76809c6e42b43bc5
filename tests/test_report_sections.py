"""Versioned recomputation: a report holds the optional sections of the comparator that made it.

``qualify verify`` step 9 recomputes a stored report with the sections it holds
(:func:`qualify.compare.verdicts.sections_of`), so evidence sealed before a section existed
still verifies (tests/test_pre_redesign.py: the pre-redesign fixture, without ``coverage``
and ``power``), while every row's verdict, error, bound and margin is still recomputed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from test_compare import BF16_TP1, World, good_meta, rows_of
from test_report import VALIDATOR, failing  # noqa: F401  (the fixture)

from qualify.compare.report import render_markdown
from qualify.compare.verdicts import OPTIONAL_SECTIONS, Report, sections_of
from qualify.evidence import store


@pytest.fixture(autouse=True)
def _writable(tmp_path: Path) -> Iterator[None]:
    yield
    store.make_writable(tmp_path)


def test_todays_report_holds_every_section(failing: tuple[World, Report]) -> None:  # noqa: F811
    _, report = failing
    doc = report.to_dict()
    assert sections_of(doc) == (OPTIONAL_SECTIONS, True)
    assert OPTIONAL_SECTIONS == ("coverage", "power", "root_causes", "behavior_weights",
                                 "clip_band", "lr_schedule", "gate_note", "reduction_dtypes",
                                 "gate_decision", "routes", "route_pins",
                                 "distribution_positions", "trainer_distribution",
                                 "bf16_ties", "trainer_vs_sampler_topk")
    assert doc["sections"] == list(OPTIONAL_SECTIONS)
    assert doc["gate"]["result"] == "FAIL"  # the decision the comparator sealed
    assert all("power" in r for r in doc["rows"])


def test_a_report_without_the_sections_is_the_earlier_document(
        failing: tuple[World, Report]) -> None:  # noqa: F811
    _, report = failing
    old = dataclasses.replace(report, sections=(), sections_recorded=False)
    doc = old.to_dict()
    assert "coverage" not in doc
    assert "power" not in doc
    assert "root_causes" not in doc
    assert all("power" not in r for r in doc["rows"])
    assert sections_of(doc) == ((), False)
    assert "sections" not in doc
    # everything that decides is unchanged
    new = report.to_dict()
    for key in ("passed", "summary", "cells"):
        assert doc[key] == new[key]
    assert [{k: v for k, v in r.items() if k != "power"} for r in new["rows"]] == doc["rows"]
    md, md_new = render_markdown(old), render_markdown(report)
    assert "## Power" not in md
    assert "## Coverage" not in md
    assert "## Root causes" not in md
    assert "in causal order" not in md
    assert md.split("## Failures")[1].lstrip().startswith("### 1.")  # file order, as sealed
    assert "## Power" in md_new
    assert "## Coverage" in md_new
    assert "## Root causes" in md_new
    with pytest.raises(jsonschema.ValidationError):  # today's schema wants both sections
        VALIDATOR.validate(doc)


def test_a_report_sealed_before_lr_schedules_renders_as_then(
        failing: tuple[World, Report]) -> None:  # noqa: F811
    """The sections of the comparator before lr schedules: no ``lr_schedule`` key, and
    report.md's causal chain and sections as that comparator wrote them (byte for byte is
    what ``qualify verify`` checks of committed evidence)."""
    _, report = failing
    then = dataclasses.replace(report, sections=("coverage", "power", "root_causes",
                                                 "behavior_weights"))
    doc, md = then.to_dict(), render_markdown(then)
    assert "lr_schedule" not in doc
    assert sections_of(doc) == (then.sections, True)
    assert "clip_coef -> exp_avg / exp_avg_sq -> updates" in md
    assert "## Learning-rate schedule" not in md
    md_new = render_markdown(report)
    assert "clip_coef -> lr -> exp_avg / exp_avg_sq -> updates" in md_new
    assert "## Learning-rate schedule" in md_new
    assert report.to_dict()["lr_schedule"]["rule"].startswith("lr: |lr_obtained - lr_sealed|")


def test_a_failed_report_says_the_gate_policy_comes_after(
        failing: tuple[World, Report]) -> None:  # noqa: F811
    """Today's failed ``report.md`` says its verdict precedes the contract's gate policy
    (a new user read "Result: FAILED" where ``qualify run`` had exited 0); one sealed
    before ``gate_note`` renders as then, byte for byte, without it. Since ``gate_decision``
    the decision itself heads the page, the comparator's verdict beneath it."""
    _, today = failing
    assert not today.passed
    md_today = render_markdown(today)
    assert md_today.splitlines()[2].startswith("**Gate decision: FAIL** (exit 1)")
    assert md_today.splitlines()[4].startswith("Comparator verdict (before the policy): FAILED")
    report = dataclasses.replace(today, sections=tuple(s for s in today.sections
                                                       if s != "gate_decision"))
    md = render_markdown(report)
    start = md.index("\n\nThis is the comparator's own verdict, before any gate policy")
    end = md.index("\n\n", start + 2)
    note = md[start:end]
    assert start < md.index("| item ")  # under the result, above the table
    assert "`qualify gate RUN_DIR --contract CONTRACT`" in note
    then = dataclasses.replace(report, sections=tuple(s for s in report.sections
                                                      if s != "gate_note"))
    md_then = render_markdown(then)
    assert "gate policy" not in md_then
    assert md_then == md[:start] + md[end:]
    assert "gate_note" not in then.to_dict()["sections"]


def test_an_unknown_section_is_refused(failing: tuple[World, Report]) -> None:  # noqa: F811
    _, report = failing
    with pytest.raises(ValueError, match="unknown report sections"):
        dataclasses.replace(report, sections=("coverage", "from-the-future"))


def test_a_report_without_the_record_must_be_a_comparator_that_existed(
        failing: tuple[World, Report]) -> None:  # noqa: F811
    """Without ``sections`` only the earlier comparators' sets are accepted (LEGACY_SECTIONS):
    a report holding ``root_causes`` but no record was never written by any comparator."""
    _, report = failing
    issue15 = dataclasses.replace(report, sections=("coverage", "power"),
                                  sections_recorded=False).to_dict()
    assert sections_of(issue15) == (("coverage", "power"), False)
    forged = dataclasses.replace(report, sections_recorded=False).to_dict()
    with pytest.raises(ValueError, match="without recording them"):
        sections_of(forged)
    bad = {**report.to_dict(), "sections": ["coverage", "from-the-future"]}
    with pytest.raises(ValueError, match="unknown"):
        sections_of(bad)


def test_clip_band_section_splits_the_matrix(failing: tuple[World, Report]) -> None:  # noqa: F811
    """Before ``clip_band`` report.md had one matrix of every cell; since, trainer and
    sampler cells are apart, and the clip-band table follows the field metrics (the layout
    before ``gate_decision``, which keeps the matrix and clip band in report.json only)."""
    _, today = failing
    report = dataclasses.replace(today, sections=tuple(
        s for s in OPTIONAL_SECTIONS if s != "gate_decision"))
    before = dataclasses.replace(report, sections=tuple(
        s for s in OPTIONAL_SECTIONS if s not in ("clip_band", "gate_decision")))
    doc = before.to_dict()
    assert "clip_band" not in doc
    assert sections_of(doc) == (before.sections, True)
    md_before, md_now = render_markdown(before), render_markdown(report)
    assert "### Trainer cells" not in md_before
    assert "Clip-band tail" not in md_before
    assert "### Trainer cells (Actor and Critic)" in md_now
    assert "Clip-band tail" in md_now
    trainer = md_now.split("### Trainer cells")[1].split("## Cells")[0]
    for c in report.cells:
        assert (f"| {c.cell} " in trainer) is (c.role != "sampler"), c.cell
    VALIDATOR.validate(report.to_dict())
    assert report.clip_band, "the fixture's actor cells give clip-band rows"
    for row in report.clip_band:
        assert row["tokens"] > 0
        assert row["clip_low"] < 1 < row["clip_high"]


def test_reduction_dtypes_apply_only_to_reports_that_hold_the_section(tmp_path: Path) -> None:
    """Outputs without ``grad_reduction`` / ``grad_accumulation`` (a harness written before
    them) fail today's ``dtypes`` row, naming the missing maps; a report sealed before the
    ``reduction_dtypes`` section is recomputed with the rule it was judged by (PASS)."""
    w = World(tmp_path)
    meta = good_meta()
    for key in ("grad_reduction", "grad_accumulation"):
        del meta["dtypes"][key]
    w.add_cell(BF16_TP1, meta=meta)
    (today,) = rows_of(w.compare(write=False), BF16_TP1, "dtypes")
    assert today.verdict == "FAIL"
    assert today.reason == ("dtypes: grad_reduction is missing, expected torch.float32 "
                            "(and 1 more)")
    before = tuple(s for s in OPTIONAL_SECTIONS if s != "reduction_dtypes")
    (then,) = rows_of(w.compare(write=False, sections=before), BF16_TP1, "dtypes")
    assert then.verdict == "PASS"
