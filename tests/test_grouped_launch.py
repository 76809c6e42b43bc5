"""One process group serves every variant of a torch_tp launch, and the order does not matter.

A grouped launch (``EngineSpec.groups_variants``, issue #17) runs the BF16 variant and then
the FP32 variant of topology a2c1 (Actor TP 2 + Critic TP 1) in one torchrun. Each variant
must start from the frozen inputs with a fresh model, optimizer and RNG state, so every
tensor it writes is bitwise the tensor of the same variant launched alone (the cached
``fp32-a2c1`` / ``bf16-a2c1`` launches of tests/test_torch_tp.py, shared through the
session's temporary root). CPU gloo, deterministic kernels: equality is exact.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_torch_tp import LAUNCH_TIMEOUT_S, MODULE, Runs

from qualify.candidate.launch import launch
from qualify.protocol import OUTPUTS_FILE, variant_tag
from qualify.registry import get_engine


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Runs:
    base = tmp_path_factory.getbasetemp()
    return Runs((base.parent if worker_id != "master" else base) / "torch_tp_runs")


def test_torch_tp_groups_its_variants() -> None:
    assert get_engine("torch_tp").groups_variants


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
