"""``qualify plan`` with devices: the placed stage's per-device terms, and its devices setting.

The expected bytes are written here from the model's shape (Qwen3-8B: hidden 4096, MLP
12288, 36 layers, 32 query and 8 key/value heads of 128, vocabulary 151,936, untied head),
not taken from the planner: what the placed stage (:mod:`qualify.reference.devices`) keeps on
the devices in an update's sensitivity pass is, per parameter element, the FP32 master (4),
its ``.grad`` (4), ``torch.optim.AdamW``'s two moments (8, on the placed parameters), the
sensitivity's ``saved`` copy (4), and in the BF16-parameter and autocast lanes a BF16 copy or
cast (2); plus the FP64 arithmetic of one parameter at a time (``3 x 8`` bytes per element of
the largest, the 622 M-element embedding on the first device).
"""

from __future__ import annotations

import json

import pytest
from qwen3_8b_shape import ACTOR, EMBED, QWEN3_8B, activations

from qualify.contract import load_contract
from qualify.errors import ExitCode
from qualify.reference import plan, plan_core
from qualify.resources import contracts_dir

TINY = contracts_dir() / "tiny-qwen3.toml"


def _steps(contract: str, devices: int) -> dict[str, plan_core.Step]:
    machine = plan_core.Machine(devices=devices, device_bytes=10**15 if devices else 0,
                                host_bytes=10**15, cores=2)
    return {s.name: s for s in plan.plan_reference(load_contract(contract), machine)}


def test_hand_counted_shape() -> None:
    """The shape constants above are the contract's (8,190.7 M Actor parameters)."""
    assert plan_core.model_shape(load_contract(QWEN3_8B)).count("actor") == ACTOR


def test_one_device_holds_the_whole_sensitivity_pass() -> None:
    """On one device the FP32 update's peak is its sensitivity pass, exactly: 20 bytes per
    parameter, the FP64 temporaries of the embedding, the head's output and one layer's
    activations (a forward without a graph). Each BF16 lane adds its 2-byte copy."""
    elements, head = activations()
    steps = _steps(str(QWEN3_8B), 1)
    fp32 = 20 * ACTOR + 24 * EMBED + head + elements * 4
    assert steps["updates hf-fp32"].device_peak == fp32
    bf16 = 22 * ACTOR + 24 * EMBED + head + elements * 2
    assert steps["updates hf-bf16-castmasters"].device_peak == bf16
    # autocast: FP32 parameters (activations FP32), the BF16 weight casts alive
    assert steps["updates hf-bf16-autocast"].device_peak == (
        22 * ACTOR + 24 * EMBED + head + elements * 4)
    # the clip-branch rerun of the FP32 lane holds the same state
    assert steps["branches hf-fp32 actor"].device_peak >= 20 * ACTOR + 24 * EMBED


@pytest.mark.parametrize("devices", [1, 2, 3, 8, 36])
def test_the_devices_together_hold_the_whole_state(devices: int) -> None:
    """Whatever the split, the devices together hold every byte the placed stage keeps on
    them: ``devices x`` the fullest device is at least 20 bytes per parameter (22 with a BF16
    copy) plus one parameter's FP64 temporaries; and the fullest device at least its even
    share."""
    steps = _steps(str(QWEN3_8B), devices)
    for name, per_param in (("updates hf-fp32", 20), ("updates hf-bf16-castmasters", 22),
                            ("control microbatch-fp32", 20), ("branches hf-fp32 actor", 20),
                            ("branches hf-bf16-castmasters actor", 22)):
        peak = steps[name].device_peak
        assert devices * peak >= per_param * ACTOR + 24 * EMBED, (name, peak)
        assert peak >= per_param * ACTOR // devices, (name, peak)


def test_fp64_control_is_fp64_state_on_the_devices() -> None:
    """The FP64 control's placed models are FP64 with FP64 gradients, moments and saved copy:
    40 bytes per parameter in its sensitivity pass (tiny-qwen3's shape, from its contract)."""
    shape = plan_core.model_shape(load_contract(TINY))
    h, i, v, n = shape.hidden_size, shape.intermediate_size, shape.vocab_size, \
        shape.num_hidden_layers
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    layer = h * q + 2 * h * kv + q * h + 2 * shape.head_dim + 3 * h * i + 2 * h
    actor = v * h + n * layer + h + (0 if shape.tie_word_embeddings else v * h)
    assert actor == shape.count("actor")
    steps = _steps(str(TINY), 1)
    assert steps["control fp64-fp32"].device_peak >= 40 * actor + 24 * v * h
    assert steps["updates hf-fp32"].device_peak >= 20 * actor + 24 * v * h


def test_host_holds_the_load_and_not_the_moved_state() -> None:
    """With devices, an update's host peak is its load: the mapped FP32 checkpoint and the
    FP32 model read from it before it is placed (4 + 4 bytes per Actor parameter) over the
    interpreter; the moments and the saved copy are on the devices."""
    steps = _steps(str(QWEN3_8B), 8)
    for name in ("updates hf-fp32", "updates hf-bf16-castmasters", "control row_split-fp32"):
        assert steps[name].host_peak == plan_core.INTERPRETER_BYTES + 8 * ACTOR, name


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict | None, str]:
    from qualify.cli.main import main

    code = main(["plan", str(QWEN3_8B), "--device-memory", "141", "--host-memory", "2000",
                 "--json", *argv])
    out = capsys.readouterr()
    return code, json.loads(out.out) if out.out.strip() else None, out.err


def test_devices_come_from_the_setting_and_devices_overrides(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``$QUALIFY_REFERENCE_DEVICES`` gives the plan its devices as the stage parses it (a
    machine with 8 CUDA devices stood in: the CUDA count torch reports); ``host`` and a
    ``cpu`` list are no devices; ``--devices`` wins over the setting; a bad setting is one
    line, exit 2."""
    import torch

    monkeypatch.setattr(plan_core, "machine_defaults", lambda: plan_core.Machine(
        devices=8, device_bytes=141 * 10**9, host_bytes=2000 * 10**9, cores=2))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for value, want in (("cuda:0,cuda:1", 2), ("cuda:3", 1), ("cuda", 8), ("host", 0),
                        ("cpu,cpu,cpu", 0)):
        monkeypatch.setenv("QUALIFY_REFERENCE_DEVICES", value)
        _, doc, _ = _plan_json(capsys)
        assert doc is not None
        assert doc["machine"]["devices"] == want, value
        _, doc, _ = _plan_json(capsys, "--devices", "4")
        assert doc is not None
        assert doc["machine"]["devices"] == 4, value
    monkeypatch.delenv("QUALIFY_REFERENCE_DEVICES")
    _, doc, _ = _plan_json(capsys)
    assert doc is not None
    assert doc["machine"]["devices"] == 8  # unset: the CUDA devices here
    for bad in ("gpu:0", "cuda:0,cpu", "cuda:9", "cpu,,cpu"):
        monkeypatch.setenv("QUALIFY_REFERENCE_DEVICES", bad)
        code, doc, err = _plan_json(capsys)
        assert code == ExitCode.USAGE_ERROR, bad
        assert doc is None, bad
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert "QUALIFY_REFERENCE_DEVICES" in lines[0], err
        assert "Traceback" not in err
