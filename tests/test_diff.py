"""``qualify diff RUN_A RUN_B``: what moved between two compared runs.

Run on copies of the committed run's ``report.json`` with planted changes (a cell's verdict,
a row's margin, a row removed, one added) and on the committed run against itself; the
bound changes on two ``bounds.json`` lists, one bound widened by a control that moved.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from committed import committed_runs

from qualify.cli.main import main
from qualify.compare.diff import _bound_changes, _moved, diff_runs
from qualify.errors import ExitCode, UsageError

RUN = committed_runs()[-1]


def _copy_with(tmp: Path, name: str, change: Any = None) -> Path:
    out = tmp / name
    out.mkdir()
    doc = json.loads((RUN / "report.json").read_text())
    if change is not None:
        change(doc)
    (out / "report.json").write_text(json.dumps(doc))
    shutil.copy(RUN / "run.json", out / "run.json")
    return out


def test_a_run_against_itself_has_no_difference(capsys: pytest.CaptureFixture[str]) -> None:
    d = diff_runs(RUN, RUN)
    assert (d.cells, d.moved_rows, d.new_rows, d.vanished_rows, d.bounds) == ((),) * 5
    assert d.same_reference
    assert d.bounds_found
    assert main(["diff", str(RUN), str(RUN)]) == ExitCode.OK
    assert "the same sealed reference" in capsys.readouterr().out


def test_planted_changes_are_each_reported(tmp_path: Path) -> None:
    base = json.loads((RUN / "report.json").read_text())
    passing = next(r for r in base["rows"] if r["verdict"] == "PASS"
                   and isinstance(r["margin"], float) and r["margin"] > 0.2)
    tiny = next(r for r in base["rows"] if isinstance(r["margin"], float)
                and 0 < r["margin"] < 0.01)

    def change(doc: dict[str, Any]) -> None:
        for r in doc["rows"]:
            if (r["cell"], r["metric"], r["class"]) == (passing["cell"], passing["metric"],
                                                        passing["class"]):
                r["margin"] *= 3.0
            if (r["cell"], r["metric"], r["class"]) == (tiny["cell"], tiny["metric"],
                                                        tiny["class"]):
                r["margin"] *= 5.0  # below min_margin on both sides: noise, not reported
        cell = next(c for c in doc["cells"] if c["cell"] == passing["cell"])
        cell["verdict"] = "FAIL" if cell["verdict"] != "FAIL" else "PASS"
        gone = doc["rows"].pop()
        new = copy.deepcopy(gone)
        new["metric"] = "round9/actor/logprobs"
        doc["rows"].append(new)

    b = _copy_with(tmp_path, "b", change)
    d = diff_runs(RUN, b)
    assert [c["cell"] for c in d.cells] == [passing["cell"]]
    assert [(r["cell"], r["metric"]) for r in d.moved_rows if r["class"] == passing["class"]
            ] == [(passing["cell"], passing["metric"])]
    assert len(d.moved_rows) == 1
    assert len(d.new_rows) == 1
    assert d.new_rows[0][1] == "round9/actor/logprobs"
    assert len(d.vanished_rows) == 1
    out = tmp_path / "diff.json"
    assert main(["diff", str(RUN), str(b), "--json", str(out)]) == ExitCode.QUALIFICATION_FAILED
    assert json.loads(out.read_text())["cells"][0]["cell"] == passing["cell"]


@pytest.mark.parametrize(("a", "b", "moved"), [
    (0.5, 1.01, True), (0.5, 0.99, False), (1.0, 0.4, True), (0.01, 0.09, False),
    (0.01, 0.2, True), (None, 0.3, True), ("inf", 0.3, True), ("inf", "inf", False),
    (0.0, 0.5, True), (None, None, False),
])
def test_the_moved_rule(a: Any, b: Any, moved: bool) -> None:
    assert _moved(a, b, 2.0, 0.1) is moved


def test_a_widened_bound_names_the_control_that_moved_it() -> None:
    bounds = json.loads((Path(__file__).resolve().parent.parent / "references" /
                         json.loads((RUN / "run.json").read_text())["reference"]["path"]
                         .split("/")[-1] / "bounds.json").read_text())["bounds"]
    wider = copy.deepcopy(bounds)
    wider[3]["bound"] *= 10
    wider[3]["control"] = "row_split"
    wider[3]["control_error"] = 1.0
    changes = _bound_changes(bounds, wider)
    assert len(changes) == 1
    assert changes[0]["control_b"] == "row_split"
    assert changes[0]["bound_b"] == pytest.approx(10 * changes[0]["bound_a"])


def test_bad_arguments_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such directory"):
        diff_runs(tmp_path / "nope", RUN)
    with pytest.raises(UsageError, match=r"not a candidate run \(no run\.json\)"):
        diff_runs(tmp_path, RUN)
    (tmp_path / "run.json").write_text("{}")  # a run not compared yet
    with pytest.raises(UsageError, match=r"no report\.json; compare the run first"):
        diff_runs(tmp_path, RUN)
    with pytest.raises(UsageError, match="--factor"):
        diff_runs(RUN, RUN, factor=1.0)
    assert main(["diff", str(RUN), str(tmp_path)]) == ExitCode.USAGE_ERROR
