"""Launch planning of the candidate stage: topology launches and grouped variants."""

from __future__ import annotations

import re
from pathlib import Path

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
