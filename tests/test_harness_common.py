"""The trainer harnesses' shared scaffolding (``harnesses/common.py``): inputs, output files,
rank tables and the entry point. No engine and no process group is needed."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import qualify_harness as sdk
import torch
from qualify_harness.outputs import rank_table, versions
from safetensors.torch import load_file, save_file

from harnesses import common
from qualify.contract import load_contract
from qualify.errors import HarnessError
from qualify.protocol import HarnessCell
from qualify.resources import contracts_dir

B, P, R = 3, 4, 5


def _write_inputs(d: Path, *, drop: str | None = None, bad_shape: str | None = None) -> None:
    """Inputs for ``B`` rows: prompts left-padded, responses right-padded."""
    d.mkdir(parents=True, exist_ok=True)
    prompts = torch.arange(B * P).reshape(B, P) + 10
    responses = torch.arange(B * R).reshape(B, R) + 100
    am = torch.ones(B, P + R, dtype=torch.int64)
    am[0, 0] = 0  # row 0: one left pad
    am[1, P + 3:] = 0  # row 1: two right pads
    rollout = {"prompts": prompts, "responses": responses, "attention_mask": am,
               "position_ids": torch.clamp(am.cumsum(1) - 1, min=0),
               "response_mask": am[:, P:].bool(), "behavior_logprobs": torch.zeros(B, R),
               "eos_terminated": torch.zeros(B, dtype=torch.bool),
               "group_index": torch.arange(B)}
    train = {"advantages": torch.randn(B, R, dtype=torch.float64).float(),
             "returns": torch.randn(B, R)}
    if bad_shape is not None:
        rollout[bad_shape] = rollout[bad_shape][:, :-1].contiguous()
    for tensors in (rollout, train):
        tensors.pop(drop or "", None)
    save_file(rollout, str(d / "rollout.safetensors"))
    save_file(train, str(d / "train_inputs.safetensors"))
    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    (d / "contract.json").write_text(json.dumps(contract.to_dict()))
    (d / "model.json").write_text(json.dumps({"actor_dir": "/m/actor", "critic_dir": "/m/c"}))


def test_read_inputs_builds_the_batch(tmp_path: Path) -> None:
    _write_inputs(tmp_path)
    inputs = common.read_inputs(tmp_path)
    batch = inputs.batch
    assert batch.input_ids.shape == (B, P + R)
    assert batch.prompt_len == P
    assert batch.response_len == R
    assert batch.input_ids[2, P] == 100 + 2 * R  # the first response token of row 2
    assert batch.mask.dtype == torch.bool
    assert int(batch.mask.sum()) == B * R - 2
    assert inputs.ref_dir == inputs.actor_dir == Path("/m/actor")
    assert inputs.contract.name == "tiny-qwen3"
    assert batch.window().tolist() == [P - 1 + t for t in range(R)]


@pytest.mark.parametrize(("kw", "match"), [
    ({"drop": "response_mask"}, r"rollout.safetensors: missing tensors \['response_mask'\]"),
    ({"drop": "returns"}, r"train_inputs.safetensors: missing tensors \['returns'\]"),
    ({"bad_shape": "position_ids"}, r"position_ids has shape \(3, 8\), expected \(3, 9\)"),
], ids=["rollout-tensor", "train-tensor", "shape"])
def test_read_inputs_names_the_bad_file(tmp_path: Path, kw: dict[str, str], match: str) -> None:
    _write_inputs(tmp_path, **kw)
    with pytest.raises(HarnessError, match=match):
        common.read_inputs(tmp_path)


def test_read_inputs_missing_file_and_model_dir(tmp_path: Path) -> None:
    _write_inputs(tmp_path)
    (tmp_path / "model.json").write_text(json.dumps({"actor_dir": "/a"}))
    with pytest.raises(HarnessError, match=r"model.json: missing 'critic_dir'"):
        common.read_inputs(tmp_path)
    (tmp_path / "train_inputs.safetensors").unlink()
    with pytest.raises(HarnessError, match=r"train_inputs.safetensors: missing harness input"):
        common.read_inputs(tmp_path)


def test_right_padding_keeps_the_response_window(tmp_path: Path) -> None:
    _write_inputs(tmp_path)
    batch = common.read_inputs(tmp_path).batch
    padded = batch.right_padded(3, pad_token_id=7)
    assert padded.input_ids.shape == (B, P + R + 3)
    assert (padded.input_ids[:, -3:] == 7).all()
    assert (padded.attention_mask[:, -3:] == 0).all()
    assert torch.equal(padded.input_ids[:, :P + R], batch.input_ids)
    # positions of the real tokens are unchanged; pads repeat the last real position
    assert torch.equal(padded.position_ids[:, :P + R], batch.position_ids)
    assert padded.position_ids[0, -1] == P + R - 2  # row 0 has one left pad
    assert torch.equal(padded.responses, batch.responses)
    assert padded.response_len == R
    rows = padded.rows(slice(1, 3))
    assert rows.input_ids.shape == (2, P + R + 3)
    assert rows.prompt_len == P
    assert torch.equal(rows.advantages, batch.advantages[1:3])


@pytest.mark.parametrize(("n", "size", "want"), [
    (8, 4, [(0, 4), (4, 8)]), (7, 4, [(0, 4), (4, 7)]), (3, 4, [(0, 3)]), (0, 4, []),
])
def test_micro_slices(n: int, size: int, want: list[tuple[int, int]]) -> None:
    assert [(s.start, s.stop) for s in common.micro_slices(n, size)] == want


def test_rank_table() -> None:
    assert rank_table(2, 1) == [
        {"rank": 0, "role": "actor", "tp_rank": 0, "tp_group": [0, 1]},
        {"rank": 1, "role": "actor", "tp_rank": 1, "tp_group": [0, 1]},
        {"rank": 2, "role": "critic", "tp_rank": 0, "tp_group": [2]}]
    assert [r["role"] for r in rank_table(0, 2)] == ["critic", "critic"]


def test_merge_parts_waits_for_every_role(tmp_path: Path) -> None:
    sdk.write_part("x", tmp_path, "actor", {"round1/actor/a": torch.ones(2)},
                   {"tp": 2, "not_run": [], "engine_info": {"shims": ["s-actor"]}})

    def late_critic() -> None:
        time.sleep(0.3)
        sdk.write_part("x", tmp_path, "critic", {"round1/critic/v": torch.zeros(3)},
                       {"tp": 1, "not_run": []})

    t = threading.Thread(target=late_critic)
    t.start()
    head = {"engine": "x", "shims": ["s-run"], "timings": {"init_s": 1.0}}
    sdk.merge_parts("x", ["actor", "critic"], tmp_path, head)
    t.join()
    meta = json.loads((tmp_path / "outputs.json").read_text())
    assert meta["roles"] == {"actor": {"tp": 2, "not_run": [],
                                       "engine_info": {"shims": ["s-actor"]}},
                             "critic": {"tp": 1, "not_run": []}}
    assert meta["shims"] == ["s-actor", "s-run"]
    assert meta["tensors"] == {"file": "outputs.safetensors", "count": 2}
    assert meta["timings"]["merge_s"] >= 0.2  # it waited for the critic's part
    tensors = load_file(str(tmp_path / "outputs.safetensors"))
    assert set(tensors) == {"round1/actor/a", "round1/critic/v"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs.json", "outputs.safetensors"]


def test_merge_parts_gives_up_on_a_missing_part(tmp_path: Path) -> None:
    sdk.write_part("x", tmp_path, "actor", {"a": torch.ones(1)}, {"not_run": []})
    with pytest.raises(sdk.OutputError, match=r"\.part-critic\.json: the critic part never"):
        sdk.merge_parts("x", ["actor", "critic"], tmp_path, {"timings": {}}, wait_s=0.2)
    assert not (tmp_path / "outputs.json").exists()  # nothing that could pass for complete


def test_atomic_json_refuses_nan(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Out of range float"):
        common.atomic_json(tmp_path / "a.json", {"x": float("nan")})
    assert not (tmp_path / "a.json").exists()


def test_env_int_needs_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(HarnessError, match=r"\$RANK is not set: run this harness under torchrun"):
        common.env_int("RANK")
    monkeypatch.setenv("RANK", "3")
    assert common.env_int("RANK") == 3


def test_cpu_device_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUALIFY_DEVICE", "cpu")
    assert common.device_and_backend() == (torch.device("cpu"), "gloo")


def test_versions_names_missing_packages() -> None:
    v = versions(("torch", "no-such-package-qualify"))
    assert v["torch"] == torch.__version__.split("+")[0] or v["torch"] == torch.__version__
    assert v["no-such-package-qualify"] == "not installed"
    assert "python" in v


def test_harness_main_usage_and_engine(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[HarnessCell] = []
    assert common.harness_main([], engine="torch_tp", module="m", run=ran.append) == 2
    assert "usage: python -m m cell.json" in capsys.readouterr().err
    cell = HarnessCell(engine="deepspeed", precision="fp32", options={}, actor_tp=1,
                       critic_tp=0, rounds=2, seed=0, inputs_dir=str(tmp_path),
                       output_dir=str(tmp_path / "o"))
    path = tmp_path / "cell.json"
    path.write_text(json.dumps(cell.to_dict()))
    with pytest.raises(HarnessError, match="engine 'deepspeed' is not 'torch_tp'"):
        common.harness_main([str(path)], engine="torch_tp", module="m", run=ran.append)
    assert common.harness_main([str(path)], engine="deepspeed", module="m",
                               run=ran.append) == 0
    assert ran == [cell]


def test_outputs_head_and_roles(tmp_path: Path) -> None:
    cell = HarnessCell(engine="torch_tp", precision="fp32", options={}, actor_tp=2,
                       critic_tp=1, rounds=2, seed=0, inputs_dir=str(tmp_path),
                       output_dir=str(tmp_path), faults=("x",))
    head = sdk.outputs_head(engine="torch_tp", cell=cell.to_dict(), packages=("torch",),
                            world=3, backend="gloo", device=torch.device("cpu"),
                            timings={"init_s": 1.0}, shims=("s",), faults=cell.faults)
    assert head["ranks"] == rank_table(2, 1)
    assert (head["world_size"], head["device"], head["shims"], head["faults"]) == (
        3, "cpu", ["s"], ["x"])
    assert set(head["versions"]) == {"python", "torch"}
    assert common.roles(2, 1) == ["actor", "critic"]
    assert common.roles(0, 2) == ["critic"]
