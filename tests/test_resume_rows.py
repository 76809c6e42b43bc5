"""The ``[resume]`` contract section and the resume rows (issue #18), without an engine.

The real-engine checks (torch_tp's DCP checkpoint restored in a fresh torchrun, bitwise,
and the planted resume faults) are in ``tests/test_resume_torch_tp.py``.
"""

from __future__ import annotations

import copy
import math
import tomllib
import types
from typing import Any

import numpy as np
import pytest

from qualify.bounds import Bound
from qualify.compare.resume import resume_required, resume_rows
from qualify.contract import Contract, default_contract_path, load_contract
from qualify.errors import ContractError
from qualify.resources import contracts_dir, repo_root
from qualify.statistics import MetricKey

K = 1
REC = {"step": {"min": 1.0, "max": 1.0}, "lr": [1.65e-4], "scheduler_last_epoch": 1,
       "master_weights": "a" * 64, "exp_avg": "b" * 64, "exp_avg_sq": "c" * 64,
       "rng_state": "d" * 64}


def _doc() -> dict[str, Any]:
    return tomllib.loads((contracts_dir() / "tiny-qwen3-resume.toml").read_text())


def test_default_contract_has_no_resume_and_keeps_its_digest() -> None:
    c = load_contract(default_contract_path())
    assert c.resume is None
    assert "resume" not in c.raw
    # the committed reference of the default contract names its digest
    assert any(p.name == f"tiny-qwen3-{c.digest12}" for p in (repo_root() / "references")
               .iterdir())


def test_resume_section_is_loaded_and_changes_the_digest() -> None:
    c = Contract.from_dict(_doc())
    assert c.resume is not None
    assert c.resume.after_round == 1
    assert c.resume.required
    ids = c.resume.cell_ids(c.matrix.cells())
    assert "torch_tp-fp32-actor-tp2-resume" in ids
    assert len(ids) == len(c.matrix.cells())
    assert resume_required(c) == tuple(ids)
    doc = _doc()
    del doc["resume"]
    assert Contract.from_dict(doc).digest != c.digest


def test_only_required_cells_make_their_resume_cells_required() -> None:
    doc = _doc()
    doc["matrix"]["required_cells"] = ["torch_tp-fp32-actor-tp2",
                                       "deepspeed-fp32-zero0-critic-tp1"]
    c = Contract.from_dict(doc)
    assert resume_required(c) == ("torch_tp-fp32-actor-tp2-resume",
                                  "deepspeed-fp32-zero0-critic-tp1-resume")
    assert c.resume is not None
    assert len(c.resume.cell_ids(c.matrix.cells())) == len(c.matrix.cells())  # still all run


@pytest.mark.parametrize(("edit", "field"), [
    ({"after_round": 3}, "resume.after_round"),
    ({"after_round": 0}, "resume.after_round"),
    ({"cells": ["nope-*"]}, "resume.cells.0"),
    ({"extra": 1}, "resume"),
])
def test_bad_resume_section_names_the_field(edit: dict[str, Any], field: str) -> None:
    doc = _doc()
    doc["resume"] = {**doc["resume"], **edit}
    with pytest.raises(ContractError, match=field.replace(".", r"\.")):
        Contract.from_dict(doc)


def _out(tensors: dict[str, Any], meta: dict[str, Any]) -> types.SimpleNamespace:
    """A loaded cell as the comparator holds it (tensors, outputs.json, its problem)."""
    return types.SimpleNamespace(tensors=tensors, meta=meta, meta_problem="")


def _cell(rng: np.random.Generator) -> tuple[dict[str, Any], dict[str, Any]]:
    tensors = {"round2/actor/logprobs": rng.standard_normal((4, 10)).astype(np.float32),
               "round2/actor/grad_norm": np.float32(0.7).reshape(()),
               "round2/actor/updates/w": rng.standard_normal(8).astype(np.float32),
               "round1/actor/logprobs": rng.standard_normal((4, 10)).astype(np.float32)}
    meta = {"device": "cpu", "lr": {"round1": 3e-4, "round2": 1.65e-4}}
    return tensors, meta


def _rows(loaded: dict[str, Any] | None = None, change: str | None = None,
          device: str = "cpu") -> list[Any]:
    base_t, base_m = _cell(np.random.default_rng(0))
    mine = {k: v.copy() for k, v in base_t.items() if k.startswith("round2/")}
    if change is not None:
        mine[change] = np.nextafter(mine[change], np.float32(np.inf)).astype(np.float32)
    meta = {"device": device, "lr": {"round2": 1.65e-4},
            "resume": {"after_round": K, "format": "x", "saved": REC,
                       "loaded": loaded if loaded is not None else copy.deepcopy(REC)}}
    bounds = [Bound(precision="fp32", klass="tp_vs_tp1", key=MetricKey(round=2, role="actor",
                                                                        family=f),
                    statistic=s, control_error=0.0, control="microbatch", floor=1e-5, k=4.0,
                    bound=1e-5)
              for f, s in (("logprobs", "max_abs"), ("grad_norm", "abs"),
                           ("updates", "max_rel_l2"))]
    return resume_rows(cell="torch_tp-fp32-actor-tp1-resume", entry={
        "role": "actor", "after_round": K, "resume_of": "torch_tp-fp32-actor-tp1"},
        outputs=_out(mine, meta), loaded={"torch_tp-fp32-actor-tp1": _out(
            base_t, {**base_m, "device": "cpu"})},
        bounds=bounds, mask=np.ones((4, 10), bool), lane="fp32")


def test_identical_resume_passes_every_row_bitwise() -> None:
    rows = _rows()
    assert rows
    assert all(r.verdict == "PASS" for r in rows)
    assert {r.family for r in rows if r.round == 2} == {"lr", "logprobs", "grad_norm",
                                                        "updates"}
    assert not any(r.round == 1 for r in rows)  # round 1 is before the checkpoint


def test_one_ulp_is_a_bitwise_fail_on_cpu_and_within_the_bound_elsewhere() -> None:
    bad = [r for r in _rows(change="round2/actor/logprobs") if r.verdict != "PASS"]
    assert [(r.family, r.statistic) for r in bad] == [("logprobs", "bitwise")]
    assert bad[0].error is not None
    assert 0 < bad[0].error < 1e-5
    off_cpu = _rows(change="round2/actor/logprobs", device="cuda")
    lp = next(r for r in off_cpu if r.family == "logprobs")
    assert lp.verdict == "PASS"
    assert lp.statistic == "max_abs"
    assert lp.bound == 1e-5


@pytest.mark.parametrize(("loaded", "quantity"), [
    ({**REC, "exp_avg": None, "exp_avg_sq": None, "step": None}, "exp_avg"),
    ({**REC, "step": {"min": 0.0, "max": 0.0}}, "step"),
    ({**REC, "rng_state": "e" * 64}, "rng_state"),
    ({**REC, "scheduler_last_epoch": 0}, "scheduler"),
])
def test_a_lost_quantity_fails_by_name(loaded: dict[str, Any], quantity: str) -> None:
    rows = {r.family: r for r in _rows(loaded=loaded) if r.round is None}
    row = rows[quantity]
    assert row.verdict == "FAIL"
    assert row.klass == "resume"
    assert row.error == math.inf
    assert row.reason is not None
    assert row.reason.startswith(f"resume {quantity}:")
    assert rows["master_weights"].verdict == "PASS"


def test_missing_uninterrupted_cell_is_not_run() -> None:
    rows = resume_rows(cell="c-resume", entry={"role": "actor", "after_round": 1,
                                               "resume_of": "c"},
                       outputs=_out({}, {"resume": {"saved": REC, "loaded": REC}}),
                       loaded={"c": "not COMPLETE"}, bounds=[],
                       mask=np.ones((1, 1), bool), lane="fp32")
    assert rows[-1].verdict == "NOT_RUN"
    assert "not COMPLETE" in str(rows[-1].reason)
