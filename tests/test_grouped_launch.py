"""One process group serves every variant of a torch_tp launch, and the order does not matter.

A grouped launch (``EngineSpec.groups_variants``, issue #17) runs the BF16 variant and then
the FP32 variant of topology a2c1 (Actor TP 2 + Critic TP 1) in one torchrun. Each variant
must start from the frozen inputs with a fresh model, optimizer and RNG state, so every
tensor it writes is bitwise the tensor of the same variant launched alone (the cached
``fp32-a2c1`` / ``bf16-a2c1`` launches of tests/test_torch_tp.py, shared through the
session's temporary root). CPU gloo, deterministic kernels: equality is exact.

A launch of several topologies of one world size (``EngineSpec.groups_topologies``: a2c1 and
a1c2, 3 ranks each) builds each topology's role groups in turn; every engine that groups
topologies runs the FP32 cells of both topologies and a BF16 a2c1 cell between them in the
order A, M, B and in the order B, M, A, and each cell's outputs are bitwise the same either
way. The same A, M, B launch under torchrun (fresh interpreters) gives bitwise the warm
launcher's outputs too (the launcher half of tests/test_warm_launch.py for these engines:
one launch fewer per engine than two files each launching twice).

Both launch tests are slow-marked (a launch of each engine under both launchers: minutes on
2 cores); `.ci/run` runs them in their own step. tests/test_warm_launch.py keeps the
launcher proof for FSDP2 in the default tier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_torch_tp import LAUNCH_TIMEOUT_S, MODULE, Runs

from qualify.candidate.launch import Launcher, launch
from qualify.layout import LAUNCHER_LOG, LOGS_DIR
from qualify.protocol import OUTPUTS_FILE, HarnessCell, variant_dir, variant_tag
from qualify.registry import get_engine

ORDER_ENGINES: dict[str, tuple[dict[str, int], dict[str, int], str | None]] = {
    "torch_tp": ({}, {}, None), "megatron": ({}, {}, "megatron.core"),
    "deepspeed": ({"zero": 0}, {"zero": 1}, "deepspeed")}
"""Engine -> (its FP32 variants' options, its BF16 variant's options, the module it needs)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Runs:
    base = tmp_path_factory.getbasetemp()
    return Runs((base.parent if worker_id != "master" else base) / "torch_tp_runs")


def test_torch_tp_groups_its_variants() -> None:
    assert get_engine("torch_tp").groups_variants


@pytest.mark.slow
def test_variants_in_one_process_group_equal_separate_launches_bitwise(runs: Runs) -> None:
    out = runs.root / "grouped-bf16-then-fp32-a2c1"
    order = ("bf16", "fp32")
    variants = tuple({"precision": p, "options": {}} for p in order)
    res = launch(runs.cell(out, precision="fp32", actor_tp=2, critic_tp=1, variants=variants),
                 module=MODULE, attempt_dir=out, timeout_s=LAUNCH_TIMEOUT_S)
    assert res.status == "OK", res.reason
    for prec in order:
        grouped = load_file(str(out / variant_tag(prec, {}) / OUTPUTS_FILE))
        alone = runs.tensors(f"{prec}-a2c1")
        assert sorted(grouped) == sorted(alone)
        differ = [k for k in alone if not torch.equal(grouped[k], alone[k])]
        assert differ == [], f"{prec}: {len(differ)} tensors differ, e.g. {differ[:3]}"
    assert not (out / OUTPUTS_FILE).exists()  # a grouped launch writes per-variant only


def _tensors(out: Path, variant: dict[str, Any]) -> dict[str, torch.Tensor]:
    return load_file(str(out / variant_dir(variant) / OUTPUTS_FILE))


@pytest.mark.slow
@pytest.mark.parametrize("engine", sorted(ORDER_ENGINES))
def test_cell_order_and_launcher_do_not_change_any_output_bitwise(
        runs: Runs, engine: str, tmp_path: Path) -> None:
    """Three launches of three variants: A M B and B M A forked (warm), A M B under torchrun.

    A = FP32 a2c1, M = BF16 a2c1, B = FP32 a1c2 (3 ranks each). Order: every variant of
    ``ab`` equals ``ba``'s; launcher: every variant of the warm ``ab`` equals the torchrun
    ``ab``'s (:mod:`qualify.candidate.warm` forks the ranks from one interpreter that
    imported everything; torchrun starts a fresh interpreter per rank).
    """
    fp32, bf16, needs = ORDER_ENGINES[engine]
    if needs is not None:
        pytest.importorskip(needs)
    spec = get_engine(engine)
    assert spec.groups_variants
    assert spec.groups_topologies
    a: dict[str, Any] = {"precision": "fp32", "options": fp32, "actor_tp": 2, "critic_tp": 1}
    m: dict[str, Any] = {"precision": "bf16", "options": bf16, "actor_tp": 2, "critic_tp": 1}
    b: dict[str, Any] = {"precision": "fp32", "options": fp32, "actor_tp": 1, "critic_tp": 2}
    plan: tuple[tuple[str, Launcher, tuple[dict[str, Any], ...]], ...] = (
        ("ab", "warm", (a, m, b)), ("ba", "warm", (b, m, a)),
        ("ab-torchrun", "torchrun", (a, m, b)))
    for name, launcher, order in plan:
        out = tmp_path / name
        cell = HarnessCell(engine=engine, precision="fp32", options=dict(fp32),
                           actor_tp=order[0]["actor_tp"], critic_tp=order[0]["critic_tp"],
                           rounds=2, seed=0,
                           inputs_dir=str(runs.inputs_dir), output_dir=str(out),
                           collective_timeout_s=120.0, variants=order)
        res = launch(cell, module=spec.module, attempt_dir=out, timeout_s=2 * LAUNCH_TIMEOUT_S,
                     env={**spec.cpu_env, "QUALIFY_DEVICE": "cpu"},
                     world_size=spec.world_size(cell), launcher=launcher,
                     preload=spec.warm_imports)
        assert res.status == "OK", res.reason
        assert not (out / OUTPUTS_FILE).exists()
        print(f"\n[{engine}] {launcher} launch {name}: {res.wall_s:.1f} s wall")
    # the warm launches really forked, or the launcher half proves nothing
    for name in ("ab", "ba"):
        assert "fork; imports" in (tmp_path / name / LOGS_DIR / LAUNCHER_LOG).read_text()
    for v in (a, m, b):
        first = _tensors(tmp_path / "ab", v)
        assert len(first) > 20
        assert {k.split("/")[1] for k in first} == {"actor", "critic"}
        for other in ("ba", "ab-torchrun"):
            second = _tensors(tmp_path / other, v)
            assert sorted(first) == sorted(second)
            differ = [k for k in first if not torch.equal(first[k], second[k])]
            assert differ == [], (f"{engine} {variant_dir(v)}: ab vs {other}: {len(differ)} "
                                  f"tensors differ, e.g. {differ[:3]}")
