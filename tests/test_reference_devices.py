"""The reference stage's devices (:mod:`qualify.reference.devices`), on CPU.

The CUDA path has not run on a GPU. Here ``QUALIFY_REFERENCE_DEVICES=cpu,cpu,cpu`` runs the
placed path on the host (the same hooks and moves): the stage's update runs give bitwise the
unplaced tensors, with the placement applied (hooks present, the assignment recorded), and
the whole tiny reference stage seals bitwise the unplaced files (slow).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from shared_artifacts import assert_sealed_bitwise_equal, tiny_reference
from tiny_contracts import torch_tp_only_text
from tiny_models import THREE_LAYER_CFG, seeded_batch, seeded_qwen3

from qualify.contract import Contract, load_contract
from qualify.errors import UsageError
from qualify.models import roles
from qualify.reference import devices
from qualify.reference.update import Batch, UpdateSettings
from qualify.resources import contracts_dir, repo_root

CFG = THREE_LAYER_CFG
THREE = devices.ReferenceDevices(("cpu", "cpu", "cpu"), devices.ENV)




@pytest.mark.parametrize(("value", "why"), [
    ("gpu", "not a device"), ("cpu,,cpu", "empty entry"), ("cpu,cuda:0", "one device kind"),
    ("cuda:1", "torch sees 1 CUDA"), ("cuda", "sees no CUDA"), ("cuda:x", "not a device"),
    ("cpu:0", "not a device"), ("cuda,cuda", "not a device"), ("host,cpu", "not a device"),
    # digits str.isdigit() takes and int() or torch.device() do not, a leading zero, a device
    # twice
    ("cuda:\u00b2", "not a device"), ("cuda:\uff10", "not a device"), ("cuda:01", "not a device"),
    ("cuda:0,cuda:0", "named twice")])
def test_a_bad_device_list_is_one_line_naming_the_variable(value: str, why: str) -> None:
    count = 0 if value == "cuda" else 1
    with pytest.raises(UsageError, match=re.escape(f"{devices.ENV}={value!r}")) as e:
        devices.parse(value, cuda_count=count)
    assert why in str(e.value)
    assert "\n" not in str(e.value)


def test_good_device_lists() -> None:
    assert devices.parse("cpu,cpu,cpu", cuda_count=0) == ("cpu", "cpu", "cpu")
    assert devices.parse("cuda:1,cuda:0", cuda_count=2) == ("cuda:1", "cuda:0")
    assert devices.parse("cuda", cuda_count=3) == ("cuda:0", "cuda:1", "cuda:2")
    assert devices.resolve({devices.ENV: "cpu,cpu"}) == devices.ReferenceDevices(
        ("cpu", "cpu"), devices.ENV)
    assert devices.parse("host", cuda_count=2) == ()
    assert devices.resolve({devices.ENV: "host"}) is None  # nothing placed, CUDA or not
    if not torch.cuda.is_available():
        assert devices.resolve({}) is None  # the host, unplaced


def test_every_model_the_stage_loads_goes_through_the_one_place() -> None:
    """No reference-stage module loads a role model around :func:`devices.load_role` (such a
    load would run unplaced on CUDA). The rollout's sampler and the decode rows stay on the
    host by design (the module docstring)."""
    host_by_design = {"devices.py", "sampling.py", "distribution.py"}
    direct = re.compile(r"roles\.load_(actor|critic|reward|reference)\b"
                        r"|(AutoModel\w*|For\w+)\.from_pretrained\(")
    offenders = [f"{p.name}:{n}" for p in sorted((repo_root() / "qualify" / "reference")
                                                  .glob("*.py"))
                 if p.name not in host_by_design
                 for n, line in enumerate(p.read_text("utf-8").splitlines(), 1)
                 if direct.search(line)]
    assert offenders == []


def _batch() -> Batch:
    return cast(Batch, seeded_batch(96, short={0: 4}, masked_targets=False))


@pytest.mark.parametrize(("precision", "mode"), [("fp32", "params"), ("bf16", "autocast"),
                                                 ("bf16", "castmasters"), ("fp64", "params")])
@pytest.mark.usefixtures("one_thread")
def test_update_run_placed_on_three_devices_is_bitwise_the_unplaced_one(
        precision: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage's update run (:func:`qualify.reference.stage._update_run`: Actor, reference
    policy and Critic loaded through the one place) under three ``cpu`` devices gives bitwise
    the unplaced run's tensors; every model it loaded was placed (a pre-hook on each
    decoder layer, more than one device in the recorded assignment), so a skipped placement
    fails here."""
    from qualify.reference import stage

    loaded: list[torch.nn.Module] = []

    def load(role: str) -> Any:
        def loader(path: Any, **kw: Any) -> torch.nn.Module:
            m = seeded_qwen3(role, CFG).requires_grad_(kw["requires_grad"]).eval()
            loaded.append(m)
            return m
        return loader

    monkeypatch.setattr(roles, "load_actor", load("actor"))
    monkeypatch.setattr(roles, "load_critic", load("critic"))
    contract: Contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    bundle: Any = SimpleNamespace(actor_dir=Path("actor"), critic_dir=Path("critic"))
    settings = UpdateSettings(precision=precision,  # type: ignore[arg-type]
                              bf16_mode=mode, micro_batch_size=2,  # type: ignore[arg-type]
                              label="t")
    plain, _ = stage._update_run(contract, bundle, _batch(), settings, "sdpa")
    assert loaded
    assert not any(m._forward_pre_hooks for m in loaded)
    loaded.clear()
    with devices.active(THREE) as record:
        placed, _ = stage._update_run(contract, bundle, _batch(), settings, "sdpa")
    assert len(loaded) == 3  # actor, reference policy, critic
    for m in loaded:
        layers: Any = m.get_submodule("model").layers
        assert all(len(layer._forward_pre_hooks) == 1 for layer in layers)
    assert record["kind"] == "cpu"
    assert record["devices"] == [{"device": "cpu", "name": "cpu"}] * 3
    for role in ("actor", "critic"):
        assert len(set(record["placed"][role]["assignment"])) > 1, record
    assert plain.keys() == placed.keys()
    assert plain
    for k, v in plain.items():
        assert placed[k].device.type == "cpu"
        assert torch.equal(v, placed[k]), k


def test_outside_the_stage_nothing_is_placed() -> None:
    m = seeded_qwen3("actor", CFG)
    assert devices.place(m, "actor") is m
    assert not m._forward_pre_hooks
    with devices.active(None) as record:
        assert devices.place(m, "actor") is m
        assert not m._forward_pre_hooks
    assert record == {"kind": "host", "source": None, "devices": [], "numerics": None,
                      "optimizer_state": "device", "placed": {}, "memory": None}


@pytest.mark.slow
def test_tiny_reference_placed_on_three_cpus_seals_the_unplaced_tensors(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole reference stage of the tiny torch_tp contract with
    ``QUALIFY_REFERENCE_DEVICES=cpu,cpu,cpu`` seals the same update, control, branch and
    score tensors and the same bounds, byte for byte, as the unplaced shared reference; its
    environment document records the placement."""
    from qualify.reference.stage import run_reference_stage

    plain = next(p for p in (tiny_reference(tmp_path_factory) / "references").iterdir()
                 if p.is_dir())
    path = tmp_path / "tiny-qwen3.toml"
    path.write_text(torch_tp_only_text(), encoding="utf-8")
    monkeypatch.setenv(devices.ENV, "cpu,cpu,cpu")
    placed = run_reference_stage(load_contract(path), root=tmp_path / "references", quiet=True)
    files = assert_sealed_bitwise_equal(plain, placed)
    assert any(f.startswith("reference/") for f in files)
    assert any(f.startswith("controls/") for f in files)
    assert any(f.startswith("branches/") for f in files)
    env = json.loads((placed / "environment.json").read_text())["reference_devices"]
    assert env["kind"] == "cpu"
    assert len(env["devices"]) == 3
    assert {"actor", "critic"} <= env["placed"].keys()
    assert all(len(set(v["assignment"])) > 1 for v in env["placed"].values())
    plain_env = json.loads((plain / "environment.json").read_text())["reference_devices"]
    assert plain_env["kind"] == "host"
    assert plain_env["placed"] == {}


@pytest.mark.parametrize(("kind", "cells", "flagged"), [
    (None, {"a": "cpu", "b": "cpu"}, []), (None, {"a": "cpu", "b": "cuda:0"}, ["b"]),
    ("host", {"a": "cuda:1"}, ["a"]), ("cpu", {"a": "cpu"}, []),
    ("cuda", {"a": "cuda:0", "b": "cuda:3"}, []), ("cuda", {"a": "cpu", "b": "cuda:0"}, ["a"])])
def test_compare_flags_cells_of_another_device_kind_than_the_bounds(
        tmp_path: Path, kind: str | None, cells: dict[str, str], flagged: list[str]) -> None:
    """The report notes the cells that ran on another device kind than the reference's bounds
    were sealed on (``reference_devices.kind``; a reference without it ran on the host)."""
    from qualify.compare.stage import _device_kind_notes, _Outputs

    env: dict[str, Any] = {"schema_version": 1}
    if kind is not None:
        env["reference_devices"] = {"kind": kind}
    (tmp_path / "environment.json").write_text(json.dumps(env))
    loaded: Any = {c: _Outputs(tensors=None, meta={"device": d},  # type: ignore[arg-type]
                               meta_problem="") for c, d in cells.items()}
    notes = _device_kind_notes(tmp_path, loaded)
    if not flagged:
        assert notes == []
    else:
        (note,) = notes
        ref = "cuda" if kind == "cuda" else "cpu"
        assert note.startswith(f"device kinds differ: the bounds were sealed on {ref}")
        assert f"{len(flagged)} cell(s) ran on another kind ({', '.join(flagged)})" in note


def test_the_plan_check_plans_the_stages_own_devices(capsys: pytest.CaptureFixture[str]) -> None:
    """``qualify reference`` plans its CUDA devices as the stage will use them, and the host
    (``host``, a ``cpu`` placement, no CUDA) without devices."""
    from qualify.reference import stage

    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    two = devices.ReferenceDevices(("cuda:0", "cuda:1"), devices.ENV)
    assert stage._plan_check(contract, False, two)["devices"] == 2
    assert stage._plan_check(contract, False, THREE)["devices"] == 0
    assert stage._plan_check(contract, False, None)["devices"] == 0
    capsys.readouterr()


def test_cuda_numerics_are_set_for_the_block_and_restored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the stage runs without TF32 and with deterministic algorithms (warn-only where
    torch has none), cuBLAS's deterministic workspace unless set; everything as it was
    after. Off CUDA nothing is touched."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled())
    with devices.active(THREE) as record:
        assert record["numerics"] is None
        assert torch.are_deterministic_algorithms_enabled() == before[3]
    with devices._cuda_numerics() as numerics:
        assert not torch.backends.cuda.matmul.allow_tf32
        assert not torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic
        assert numerics["cublas_workspace_config"] == ":4096:8"
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision(),
            torch.are_deterministic_algorithms_enabled()) == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_kernels_without_a_deterministic_implementation_are_recorded_once_each(
        recwarn: pytest.WarningsRecorder) -> None:
    """Under ``warn_only`` torch warns where an op has no deterministic kernel; the CUDA
    numerics block records each such op once, in order, from torch's own warning, whatever
    the filters, shows it once, passes other warnings through, and restores the warnings
    module after."""
    from torch._prims_common import alert_not_deterministic

    shown, filters = warnings.showwarning, list(warnings.filters)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a user's -W ignore must not hide them from the record
        with devices._cuda_numerics() as numerics:
            alert_not_deterministic("index_add_cuda_")
            alert_not_deterministic("index_add_cuda_")
            alert_not_deterministic("scatter_add_cuda_kernel")
    assert numerics["nondeterministic_kernels"] == ["index_add_cuda_",
                                                    "scatter_add_cuda_kernel"]
    assert warnings.showwarning is shown
    assert warnings.filters == filters
    assert sum("index_add_cuda_" in str(w.message) for w in recwarn.list) == 1
    recwarn.clear()
    into: list[str] = []
    with devices.recording_nondeterministic_kernels(into):
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            alert_not_deterministic("index_add_cuda_")
            alert_not_deterministic("index_add_cuda_")
            warnings.warn("another warning", UserWarning, stacklevel=1)
        finally:
            torch.use_deterministic_algorithms(False)
    assert into == ["index_add_cuda_"]
    messages = [str(w.message) for w in recwarn.list]
    assert sum("index_add_cuda_" in m for m in messages) == 1
    assert "another warning" in messages
