"""qualify.candidate.ahead: ``qualify run`` starts its trainer zygotes before it imports torch.

What is checked here: the order and the inputs of those starts, when none is made, that
``run_all`` makes them before torch is imported and only for a reused reference, that a
zygote started before ``torch._inductor`` set ``TORCHINDUCTOR_CACHE_DIR`` has the key of
the launches after, and that a models-cache bundle gives the model classes. That the
launches are then served by those zygotes: tests/test_pipeline.py
(``test_the_run_launches_through_the_zygotes_it_started_ahead``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from qualify.candidate import ahead, zygote
from qualify.candidate.launch import launch_command, launch_env
from qualify.contract import load_contract
from qualify.resources import contracts_dir, repo_root

TINY = contracts_dir() / "tiny-qwen3.toml"


def _started(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def fake(engines: Any, *, inputs: Path | None, cuda: bool) -> None:
        calls.append({"engines": [e.name for e in engines], "inputs": inputs, "cuda": cuda})

    monkeypatch.setattr(ahead, "prestart", fake)
    return calls


def test_the_weights_source_first_then_contract_order(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    contract = load_contract(TINY)
    assert contract.sampler is not None
    assert contract.sampler.weights_from.startswith("torch_tp-")
    monkeypatch.setenv("QUALIFY_CACHE", str(tmp_path / "cache"))
    calls = _started(monkeypatch)
    ahead.prestart_run(contract, None, dev=tmp_path)
    assert calls == [{"engines": ["torch_tp", "deepspeed", "megatron"], "inputs": None,
                      "cuda": False}]
    # the launch exporting the weights first, whatever the contract order
    calls.clear()
    moved = dataclasses.replace(contract, sampler=dataclasses.replace(
        contract.sampler, weights_from="megatron-fp32-actor-tp1"))
    ahead.prestart_run(moved, None, dev=tmp_path)
    assert calls[0]["engines"] == ["megatron", "torch_tp", "deepspeed"]
    calls.clear()
    ahead.prestart_run(contract, ["megatron:*", "deepspeed:*"], dev=tmp_path)
    assert calls[0]["engines"] == ["deepspeed", "megatron"]


def test_a_bundle_in_the_models_cache_gives_the_model_classes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    contract = load_contract(TINY)
    bundle = tmp_path / "cache" / "models" / contract.digest12
    bundle.mkdir(parents=True)
    monkeypatch.setenv("QUALIFY_CACHE", str(tmp_path / "cache"))
    calls = _started(monkeypatch)
    ahead.prestart_run(contract, None, dev=tmp_path)
    assert calls[0]["inputs"] == bundle


def test_nothing_is_started_beside_a_gpu_or_for_cells_that_match_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    contract = load_contract(TINY)
    calls = _started(monkeypatch)
    for node in ("nvidia0", "kfd", "dxg"):  # NVIDIA, ROCm, WSL2
        (tmp_path / node).touch()
        assert ahead.prestart_run(contract, None, dev=tmp_path) is None
        (tmp_path / node).unlink()
    assert ahead.prestart_run(contract, ["no-such-cell-*"], dev=tmp_path) is None
    assert calls == []
    ahead.prestart_run(contract, None, dev=tmp_path)
    assert len(calls) == 1


def test_a_default_inductor_cache_dir_is_not_part_of_the_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``import torch._inductor`` sets ``TORCHINDUCTOR_CACHE_DIR`` to torch's default: a
    zygote started before that import serves the launches after it. Another value is
    another key."""
    from torch._inductor.runtime import cache_dir_utils  # sets the variable here

    default = os.path.abspath(cache_dir_utils.default_cache_dir())
    assert zygote.inductor_default() == default  # torch's formula, without torch
    env = launch_env(None)
    env.pop(zygote.INDUCTOR_CACHE_ENV, None)
    cmd = launch_command(tmp_path / "cell.json", module="harnesses.torch_tp.harness",
                         world_size=1, log_dir=tmp_path, env=env, launcher="warm")
    before = zygote.launch_key(cmd, env)
    assert before is not None
    assert zygote.launch_key(cmd, {**env, zygote.INDUCTOR_CACHE_ENV: default}) == before
    assert zygote.launch_key(cmd, {**env, zygote.INDUCTOR_CACHE_ENV: str(tmp_path)}) != before
    # the default of another TMPDIR or user is not this process's: the variable stays
    other = {**env, "TMPDIR": str(tmp_path), zygote.INDUCTOR_CACHE_ENV: default}
    assert zygote.launch_key(cmd, other) != zygote.launch_key(cmd, {**env, "TMPDIR": str(tmp_path)})


def _child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], check=False,
                          capture_output=True, text=True, cwd=repo_root(), timeout=300,
                          env={**os.environ, "PYTHONPATH": str(repo_root())})


def test_run_all_starts_them_before_it_imports_torch(tmp_path: Path) -> None:
    """With a sealed reference to reuse, the start comes before torch is imported (the
    point: the zygotes import on the other core meanwhile); without one, none is made
    (the reference stage runs first, for minutes)."""
    def child(refs: Path, stop_reference: bool) -> subprocess.CompletedProcess[str]:
        return _child(textwrap.dedent(f"""
            import sys
            from pathlib import Path
            import qualify.candidate.ahead as ahead
            def record(contract, cells):
                print("torch" in sys.modules, contract.name, *cells, flush=True)
                raise SystemExit(0)
            ahead.prestart_run = record
            if {stop_reference!r}:
                import qualify.reference.stage as rs
                def stop(*args, **kwargs):
                    raise SystemExit(7)
                rs.run_reference_stage = stop
            from qualify.pipeline.chain import run_all
            run_all(Path({str(TINY)!r}), references=Path({str(refs)!r}),
                    evidence=Path({str(tmp_path)!r}), cells=["torch_tp:*"])
        """))

    ours = child(repo_root() / "references", stop_reference=False)
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert ours.stdout.split() == ["False", "tiny-qwen3", "torch_tp:*"]
    none = child(tmp_path / "none", stop_reference=True)
    assert none.returncode == 7, (none.stdout, none.stderr[-2000:])
    assert none.stdout == ""


def test_a_bundle_directory_preloads_its_model_classes(tmp_path: Path) -> None:
    """``warm.preload_models`` of a models-cache bundle (no ``model.json``): the modeling
    module of each ``*/config.json``'s ``model_type``."""
    for role in ("actor", "critic"):
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    proc = _child(textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from qualify.candidate import warm
        warm.preload_models(Path({str(tmp_path)!r}))
        print("transformers.models.qwen3.modeling_qwen3" in sys.modules)
    """))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True"]
