"""Route pins (``[routes]``) and the reference controls' routes: a cell that ran another
kernel route than the one it is qualified with is not PASS (qualify.compare.routes)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import test_compare
from hypothesis import given
from test_compare import BF16_TP1, World, good_meta, rows_of
from test_report import VALIDATOR

from qualify.compare.report import render_markdown
from qualify.compare.routes import route_row
from qualify.compare.verdicts import OPTIONAL_SECTIONS
from qualify.contract import Contract, ContractError, RoutePins, loads_contract
from qualify.resources import contracts_dir

BACKENDS = ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def _meta(*backends: str, launch: bool = False) -> dict[str, Any]:
    """A cell's ``outputs.json`` with its role's routes (``launch``: a launch's, by role)."""
    meta = good_meta()
    routes = {"sdpa_backends": {f"{b} cpu bfloat16": 4 for b in backends} or
              {"no SDPA call": 0}}
    if launch:
        meta["roles"] = {"actor": {"routes": routes}}
    else:
        meta["routes"] = routes
    return meta


def _world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, pins: dict[str, str] | None,
           reference: dict[str, dict[str, int]] | None = None) -> World:
    plain = test_compare.make_contract

    def pinned(required: list[str] | None = None) -> Contract:
        doc = plain(required).to_dict()
        if pins is not None:
            doc["routes"] = pins
        return Contract.from_dict(doc)

    monkeypatch.setattr(test_compare, "make_contract", pinned)
    if reference is not None:  # the reference's distribution.json, sealed with it
        seal = test_compare.store.seal

        def seal_with(path: Path, *, kind: str) -> Any:
            if kind == "reference":
                (path / "distribution.json").write_text(json.dumps(
                    {"routes": {"sdpa_backends": reference}}))
            return seal(path, kind=kind)

        monkeypatch.setattr(test_compare.store, "seal", seal_with)
    return World(tmp_path, required=[BF16_TP1])


@pytest.mark.parametrize("launch", [False, True])
@pytest.mark.parametrize(("pin", "ran", "verdict"), [
    ("MATH", ("MATH",), "PASS"),
    ("MATH", ("FLASH_ATTENTION",), "FAIL"),
    ("MATH", ("MATH", "FLASH_ATTENTION"), "FAIL"),
    ("MATH", (), "FAIL"),  # no SDPA call: the pin is not shown to hold
])
def test_a_cell_whose_sdpa_route_differs_from_its_pin_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pin: str, ran: tuple[str, ...],
        verdict: str, launch: bool) -> None:
    w = _world(tmp_path, monkeypatch, pins={"sdpa": pin})
    w.add_cell(BF16_TP1, meta=_meta(*ran, launch=launch))
    report = w.compare(write=False)
    (row,) = rows_of(report, BF16_TP1, "routes")
    assert row.verdict == verdict
    (cell,) = [c for c in report.cells if c.cell == BF16_TP1]
    assert cell.verdict == verdict
    VALIDATOR.validate(report.to_dict())
    if verdict == "FAIL":
        assert cell.reason == row.reason
        assert str(row.reason).startswith("routes: actor.sdpa_backends is ")
        assert f"expected {pin} (pin)" in str(row.reason)
        assert "actor.sdpa_backends" in render_markdown(report)
    # a report sealed before route pins is recomputed as then: no routes row
    before = tuple(s for s in OPTIONAL_SECTIONS if s != "route_pins")
    assert not rows_of(w.compare(write=False, sections=before), BF16_TP1, "routes")


def test_a_pinned_cell_whose_harness_records_no_routes_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = _world(tmp_path, monkeypatch, pins={"sdpa": "MATH"})
    w.add_cell(BF16_TP1, meta=good_meta())
    (row,) = rows_of(w.compare(write=False), BF16_TP1, "routes")
    assert row.verdict == "FAIL"
    assert "not recorded" in str(row.reason)


@pytest.mark.parametrize(("ran", "verdict"), [
    (("FLASH_ATTENTION",), "PASS"),
    (("EFFICIENT_ATTENTION",), "FAIL"),
    ((), None),  # no SDPA call (eager, Megatron): nothing to hold against the controls
])
def test_a_cell_off_the_reference_controls_route_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ran: tuple[str, ...],
        verdict: str | None) -> None:
    w = _world(tmp_path, monkeypatch, pins=None, reference={
        "fp32_sdpa": {"FLASH_ATTENTION cpu float32": 8},
        "eager": {"no SDPA call (eager attention)": 0}})
    w.add_cell(BF16_TP1, meta=_meta(*ran))
    rows = rows_of(w.compare(write=False), BF16_TP1, "routes")
    assert [r.verdict for r in rows] == ([] if verdict is None else [verdict])
    if verdict == "FAIL":
        assert "(the reference controls')" in str(rows[0].reason)


def test_without_pins_or_reference_routes_there_is_no_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = _world(tmp_path, monkeypatch, pins=None)
    w.add_cell(BF16_TP1, meta=_meta("EFFICIENT_ATTENTION"))
    report = w.compare(write=False)
    assert not rows_of(report, BF16_TP1, "routes")
    assert report.cells[0].verdict == "PASS"


@given(pin=st.sampled_from(BACKENDS),
       roles=st.dictionaries(st.sampled_from(["actor", "critic"]),
                             st.sets(st.sampled_from(BACKENDS), max_size=3), min_size=1),
       ref=st.sets(st.sampled_from(BACKENDS), max_size=3))
def test_route_row_passes_exactly_when_every_role_ran_the_pin_and_the_controls(
        pin: str, roles: dict[str, set[str]], ref: set[str]) -> None:
    routes = {r: {"sdpa_backends": {f"{b} cuda float32": 1 for b in bs} or
                  {"no SDPA call": 0}} for r, bs in roles.items()}
    row = route_row("c", "actor", "trainer", routes, pins=RoutePins(sdpa=pin), reference=ref)
    assert row is not None
    ok = all(bs == {pin} for bs in roles.values()) and \
        (not ref or all(bs <= ref for bs in roles.values()))
    assert (row.verdict == "PASS") == ok


def test_vllm_attention_pin_checks_every_worker() -> None:
    pins = RoutePins(vllm_attention="TORCH_SDPA")
    good = {"vllm": [{"rank": 0, "attention_backends": ["TORCH_SDPA"]},
                     {"rank": 1, "attention_backends": ["TORCH_SDPA"]}]}
    bad = {"vllm": [{"rank": 0, "attention_backends": ["TORCH_SDPA"]},
                    {"rank": 1, "attention_backends": ["FLASH_ATTN"]}]}
    ok = route_row("s", "sampler", "sampler", good, pins=pins, reference={"MATH"})
    assert ok is not None
    assert ok.verdict == "PASS"
    no = route_row("s", "sampler", "sampler", bad, pins=pins, reference=set())
    assert no is not None
    assert no.verdict == "FAIL"
    assert no.reason == ("routes: vllm[rank 1].attention_backends is FLASH_ATTN, "
                         "expected TORCH_SDPA (pin)")
    assert route_row("s", "sampler", "sampler", bad, pins=None, reference={"MATH"}) is None


def test_routes_section_is_optional_and_checked() -> None:
    text = (contracts_dir() / "tiny-qwen3.toml").read_text("utf-8")
    plain = loads_contract(text)
    assert plain.routes is None
    doc = tomllib.loads(text)
    pinned = Contract.from_dict({**doc, "routes": {"sdpa": "MATH"}})
    assert pinned.routes == RoutePins(sdpa="MATH")
    assert pinned.digest != plain.digest
    with pytest.raises(ContractError, match="routes"):
        Contract.from_dict({**doc, "routes": {"sdpa": "FAST"}})
    with pytest.raises(ContractError, match="routes"):
        Contract.from_dict({**doc, "routes": {}})
