"""The warm launcher changes no number: every engine's outputs equal torchrun's, bitwise.

:mod:`qualify.candidate.warm` (the default single-node CPU launcher, issue #17) imports the
harness, the engine's ``warm_imports`` and the model classes in one interpreter and forks
the ranks; torchrun starts a fresh interpreter per rank. FSDP2 here runs the same cell
under both launchers (tests/test_torch_tp.py's tiny Qwen3 inputs, real gloo ranks), and
every tensor of the warm launch must be bitwise the torchrun launch's (CPU: deterministic
kernels, so equality is exact). The warm launch must really have forked (its
``launcher.log`` says ``fork``), or the test proves nothing. torch_tp, DeepSpeed and
Megatron-Core (FP32 and BF16 variants, two topologies in one launch) get the same proof in
tests/test_grouped_launch.py, whose order test launches each under both launchers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_torch_tp import LAUNCH_TIMEOUT_S, Runs

from qualify.candidate.launch import LAUNCHERS, launch
from qualify.layout import LAUNCHER_LOG, LOGS_DIR
from qualify.protocol import OUTPUTS_FILE, HarnessCell, variant_dir
from qualify.registry import get_engine

ENGINES: dict[str, tuple[dict[str, int], str | None]] = {"fsdp2": ({"dp": 1}, None)}
"""Engine -> (its cell's options, the module it needs). torch_tp, DeepSpeed and Megatron-Core
are compared warm vs torchrun, bitwise, by tests/test_grouped_launch.py's order test (the
same launch of three variants under both launchers)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Runs:
    base = tmp_path_factory.getbasetemp()
    return Runs((base.parent if worker_id != "master" else base) / "torch_tp_runs")


def _outputs(out: Path, cell: HarnessCell) -> dict[str, dict[str, torch.Tensor]]:
    if not cell.variants:
        return {"": load_file(str(out / OUTPUTS_FILE))}
    return {variant_dir(v): load_file(str(out / variant_dir(v) / OUTPUTS_FILE))
            for v in cell.variants}


@pytest.mark.parametrize("engine", [  # FSDP2's pair: seconds of torchrun, .ci/run's slow step
    pytest.param(e, marks=pytest.mark.slow) if e == "fsdp2" else e for e in sorted(ENGINES)])
def test_warm_launch_equals_torchrun_bitwise(runs: Runs, engine: str, tmp_path: Path) -> None:
    options, needs = ENGINES[engine]
    if needs is not None:
        pytest.importorskip(needs)
    spec = get_engine(engine)
    variants: tuple[dict[str, Any], ...] = ()
    if spec.groups_variants:  # FP32 and BF16 in one launch, as the stage groups them
        variants = tuple({"precision": p, "options": options} for p in ("fp32", "bf16"))
    outputs = {}
    for launcher in LAUNCHERS:
        out = tmp_path / launcher
        cell = HarnessCell(engine=engine, precision="fp32", options=dict(options),
                           actor_tp=2, critic_tp=1, rounds=2, seed=0,
                           inputs_dir=str(runs.inputs_dir), output_dir=str(out),
                           collective_timeout_s=120.0, variants=variants)
        res = launch(cell, module=spec.module, attempt_dir=out,
                     env={**spec.cpu_env, "QUALIFY_DEVICE": "cpu"},
                     timeout_s=2 * LAUNCH_TIMEOUT_S, world_size=spec.world_size(cell),
                     launcher=launcher, preload=spec.warm_imports)
        assert res.status == "OK", res.reason
        print(f"\n[{engine}] {launcher} launch: {res.wall_s:.1f} s wall")
        outputs[launcher] = _outputs(out, cell)
    assert "fork; imports" in (tmp_path / "warm" / LOGS_DIR / LAUNCHER_LOG).read_text()
    for sub, warm in outputs["warm"].items():
        fresh = outputs["torchrun"][sub]
        assert len(warm) > 20
        assert sorted(warm) == sorted(fresh)
        assert {k.split("/")[1] for k in warm} == {"actor", "critic"}
        differ = [k for k in warm if not torch.equal(warm[k], fresh[k])]
        assert differ == [], f"{engine} {sub}: {len(differ)} tensors differ, e.g. {differ[:3]}"
