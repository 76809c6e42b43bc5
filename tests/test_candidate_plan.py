"""Launch planning of the candidate stage: topology launches and grouped variants."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qualify.candidate.stage import plan_launches
from qualify.contract import Contract, cells_matching, loads_contract
from qualify.protocol import HarnessCell, variant_tag
from qualify.resources import contracts_dir


def _contract(engines: str) -> Contract:
    """The committed tiny-qwen3 contract (ZeRO 0/1/2) with ``engines`` as its engines."""
    text = (contracts_dir() / "tiny-qwen3.toml").read_text()
    text, n = re.subn(r"(?m)^engines = \[.*\]$", f"engines = {engines}", text, count=1)
    assert n == 1
    assert "zero_stage = [0, 1, 2]" in text
    return loads_contract(text)


def test_plain_engine_gets_one_launch_per_topology_and_variant() -> None:
    c = _contract('["torch_tp"]')
    wanted = cells_matching(c, None)
    launches = plan_launches(c, wanted)
    # 2 precisions x 2 topologies; each launch yields its Actor and its Critic cell
    assert [lc.launch_id for lc in launches] == [
        "torch_tp-fp32-a2c1", "torch_tp-fp32-a1c2", "torch_tp-bf16-a2c1", "torch_tp-bf16-a1c2"]
    assert all(not lc.grouped and len(lc.parts) == 1 for lc in launches)
    covered = sorted(cell.cell_id for lc in launches for cell in lc.cells)
    assert covered == sorted(cell.cell_id for cell in wanted)


def test_grouped_engine_gets_one_launch_per_topology_with_every_variant() -> None:
    c = _contract('["torch_tp", "deepspeed"]')
    wanted = cells_matching(c, ["deepspeed-*"])
    assert len(wanted) == 2 * 3 * 2 * 2  # precisions x ZeRO x roles x TP sizes
    launches = plan_launches(c, wanted, grouped_engines=["deepspeed"])
    assert [lc.launch_id for lc in launches] == ["deepspeed-a2c1", "deepspeed-a1c2"]
    first = launches[0]
    assert [p.tag for p in first.parts] == [
        "fp32-zero0", "fp32-zero1", "fp32-zero2", "bf16-zero0", "bf16-zero1", "bf16-zero2"]
    assert first.actor is not None
    assert first.actor.tp == 2
    assert first.critic is not None
    assert first.critic.tp == 1
    cell = next(x for x in first.cells if x.cell_id == "deepspeed-bf16-zero1-critic-tp1")
    assert first.part_of(cell).tag == "bf16-zero1"
    covered = sorted(x.cell_id for lc in launches for x in lc.cells)
    assert covered == sorted(x.cell_id for x in wanted)  # each cell in exactly one launch


def test_resume_plans_only_missing_cells() -> None:
    c = _contract('["torch_tp", "deepspeed"]')
    wanted = cells_matching(c, ["deepspeed-bf16-zero2-critic-tp2"])
    (only,) = plan_launches(c, wanted, grouped_engines=["deepspeed"])
    assert only.launch_id == "deepspeed-a1c2"
    assert only.actor is None
    assert [x.cell_id for x in only.cells] == ["deepspeed-bf16-zero2-critic-tp2"]


def test_cell_json_variants_round_trip(tmp_path: Path) -> None:
    hc = HarnessCell(engine="deepspeed", precision="fp32", options={"zero": 0}, actor_tp=2,
                     critic_tp=1, rounds=2, seed=1, inputs_dir="i", output_dir=str(tmp_path),
                     variants=({"precision": "fp32", "options": {"zero": 0}},
                               {"precision": "bf16", "options": {"zero": 2}}))
    back = HarnessCell.from_dict(hc.to_dict())
    assert back == hc
    assert back.variant_runs() == [("fp32", {"zero": 0}, "fp32-zero0"),
                                   ("bf16", {"zero": 2}, "bf16-zero2")]
    single = HarnessCell(engine="torch_tp", precision="bf16", options={}, actor_tp=1,
                         critic_tp=0, rounds=2, seed=1, inputs_dir="i", output_dir="o")
    assert single.variant_runs() == [("bf16", {}, "")]
    assert variant_tag("bf16", {"zero": 1}) == "bf16-zero1"



def test_launch_options_are_the_cell_json_options() -> None:
    """Without extra axes a part's cell.json options are its engine options, byte for byte."""
    c = _contract('["torch_tp", "deepspeed"]')
    ds = plan_launches(c, cells_matching(c, ["deepspeed-*"]), grouped_engines=["deepspeed"])[0]
    assert [p.harness_options for p in ds.parts] == [{"zero": z} for _ in range(2)
                                                     for z in (0, 1, 2)]
    assert all(p.axes == () for p in ds.parts)
    assert ds.options == (("zero", 0),)
    tp = plan_launches(c, cells_matching(c, ["torch_tp-*"]))[0]
    assert tp.options == ()
    assert tp.parts[0].harness_options == {}
    assert tp.launch_id == "torch_tp-fp32-a2c1"


def test_topology_grouping_engine_gets_one_launch_per_world_size() -> None:
    """Issue #17: every topology of one world size (a2c1 and a1c2: 3 ranks) in one launch."""
    c = _contract('["torch_tp", "deepspeed"]')
    wanted = cells_matching(c, ["deepspeed-*"])
    (only,) = plan_launches(c, wanted, grouped_engines=["deepspeed"],
                            topology_engines=["deepspeed"])
    assert only.launch_id == "deepspeed-a2c1-a1c2"
    variants = ["fp32-zero0", "fp32-zero1", "fp32-zero2", "bf16-zero0", "bf16-zero1",
                "bf16-zero2"]
    # topology-major (contract order), each topology's variants in matrix order
    assert [p.tag for p in only.parts] == ([f"{v}-a2c1" for v in variants]
                                           + [f"{v}-a1c2" for v in variants])
    assert (only.actor_tp, only.critic_tp) == (2, 1)
    assert only.parts[-1].variant(False) == {"precision": "bf16", "options": {"zero": 2},
                                             "actor_tp": 1, "critic_tp": 2,
                                             "export_weights": False}
    assert sorted(x.cell_id for x in only.cells) == sorted(x.cell_id for x in wanted)


def test_topology_grouping_splits_by_world_size_on_resume() -> None:
    """A topology launching one role only has another world size: a launch of its own."""
    c = _contract('["torch_tp", "deepspeed"]')
    wanted = cells_matching(c, ["deepspeed-bf16-zero2-critic-tp2", "deepspeed-fp32-zero0-*-tp1",
                                "deepspeed-fp32-zero0-*-tp2"])
    launches = plan_launches(c, wanted, grouped_engines=["deepspeed"],
                             topology_engines=["deepspeed"])
    assert [(lc.launch_id, [p.tag for p in lc.parts]) for lc in launches] == [
        ("deepspeed-a2c1-a1c2", ["fp32-zero0-a2c1", "fp32-zero0-a1c2"]),
        ("deepspeed-a1c2", ["bf16-zero2"])]  # one topology: the layout of before
    assert (launches[1].actor_tp, launches[1].critic_tp) == (0, 2)


def test_default_contract_has_one_launch_per_trainer_engine() -> None:
    """The committed contract's builtin trainers group variants and topologies."""
    from qualify.registry import get_engine

    c = loads_contract((contracts_dir() / "tiny-qwen3.toml").read_text())
    wanted = cells_matching(c, None)
    trainers = [w for w in wanted if get_engine(w.engine).kind == "trainer"]
    grouped = sorted({w.engine for w in trainers if get_engine(w.engine).groups_variants})
    by_world = [e for e in grouped if get_engine(e).groups_topologies]
    assert {"torch_tp", "deepspeed", "megatron"} <= set(by_world)
    launches = plan_launches(c, trainers, grouped_engines=grouped, topology_engines=by_world)
    engines = [lc.engine for lc in launches]
    assert len(engines) == len(set(engines))  # one launch per engine (one world size here)


def test_cell_json_variant_topologies(tmp_path: Path) -> None:
    from qualify.candidate.launch import validate_cell

    variants = ({"precision": "fp32", "options": {}, "actor_tp": 2, "critic_tp": 1},
                {"precision": "bf16", "options": {}, "actor_tp": 1, "critic_tp": 2,
                 "export_weights": True})
    hc = HarnessCell(engine="torch_tp", precision="fp32", options={}, actor_tp=2, critic_tp=1,
                     rounds=2, seed=1, inputs_dir="i", output_dir=str(tmp_path),
                     variants=variants)
    validate_cell(hc.to_dict())
    back = HarnessCell.from_dict(hc.to_dict())
    assert back == hc
    assert [sub for _, _, sub in back.variant_runs()] == ["fp32-a2c1", "bf16-a1c2"]
    cells = back.variant_cells()
    assert [(x.precision, x.actor_tp, x.critic_tp, x.export_weights, x.variants)
            for x in cells] == [("fp32", 2, 1, False, ()), ("bf16", 1, 2, True, ())]
    assert cells[1].output_dir == str(tmp_path / "bf16-a1c2")
    wrong = HarnessCell.from_dict({**hc.to_dict(), "variants": [
        {"precision": "fp32", "options": {}, "actor_tp": 2, "critic_tp": 2}]})
    with pytest.raises(ValueError, match="actor_tp \\+ critic_tp = 4"):
        wrong.variant_cells()


def test_topology_grouping_gives_each_launch_its_own_id() -> None:
    """a1c2 with both roles (3 ranks) and a1c2 with the Critic only (2 ranks): two launches."""
    c = _contract('["torch_tp", "deepspeed"]')
    wanted = cells_matching(c, ["deepspeed-fp32-zero0-critic-tp2", "deepspeed-fp32-zero0-actor-tp1",
                                "deepspeed-bf16-zero0-critic-tp2"])
    launches = plan_launches(c, wanted, grouped_engines=["deepspeed"],
                             topology_engines=["deepspeed"])
    assert [(lc.launch_id, lc.actor_tp, lc.critic_tp) for lc in launches] == [
        ("deepspeed-a1c2", 1, 2), ("deepspeed-a1c2-w2", 0, 2)]
    # one world size, two topologies that each launch one role: (2, 0) then (0, 2)
    two = cells_matching(c, ["deepspeed-fp32-zero0-actor-tp2", "deepspeed-fp32-zero0-critic-tp2"])
    (both,) = plan_launches(c, two, grouped_engines=["deepspeed"], topology_engines=["deepspeed"])
    assert both.launch_id == "deepspeed-a2c1-a1c2"
    assert [p.tag for p in both.parts] == ["fp32-zero0-a2c0", "fp32-zero0-a0c2"]
