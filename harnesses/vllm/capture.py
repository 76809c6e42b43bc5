"""Rollout capture with vLLM in a child process: ``python -m harnesses.vllm.capture REQ OUT``.

The reference stage never imports vllm: :class:`harnesses.vllm.rollout.VllmRolloutBackend`
writes a request file, runs this module in a fresh interpreter and reads the result back.

Request (JSON, :func:`write_request` / ``REQ``)::

    {"model_dir": str, "prompts": [[int, ...], ...], "sampling": {SamplingSpec fields},
     "eos_token_id": int, "dtype": "float32" | "bfloat16",
     "kv_cache_memory_bytes": int, "threads_bind": str | null}

Result (JSON, ``OUT``, written atomically; :data:`RESULT_VERSION`)::

    {"result_version": 1, "vllm_version": str, "torch_version": str,
     "sequences": [{"prompt_index": int, "sample_index": int, "seed": int,
                    "token_ids": [int, ...], "logprobs": [float, ...],
                    "finish_reason": "stop" | "length", "stop_reason": int | null,
                    "num_cached_tokens": int}, ...],
     "engine": {engine arguments and environment variables set},
     "timings_s": {"import_vllm": float, "engine_start": float, "generate": float},
     "wall_clock": {"main_started": float, "result_written": float}}   (time.time())

What the engine computes is reported as computed: ``token_ids`` are vLLM's
``CompletionOutput.token_ids``; ``logprobs`` are, per sampled token, the ``Logprob.logprob``
vLLM returned for that token id (``SamplingParams(logprobs=0)``: the sampled token only),
in the engine's ``logprobs_mode`` (``processed_logprobs`` or ``raw_logprobs``). Python
floats survive JSON bit for bit (``repr`` round-trips a double; vLLM's values are float32
widened to double).

Seeding: sequence ``s = i * n + j`` (prompt ``i``, sample ``j``, ``n`` samples per prompt)
is its own request (``SamplingParams(n=1, seed=sampling.seed + s)``), so each sample's
random stream depends on its seed only, not on batching or on vLLM's fan-out of ``n``.
EOS: the engine is built without a tokenizer, so the contract's EOS id is passed as
``stop_token_ids=[eos]``; vLLM keeps the stop token in ``token_ids`` and stops there
(``finish_reason == "stop"``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from qualify import atomic

RESULT_VERSION: Final = 1
"""``result_version`` of the result file."""


def write_request(
    path: Path,
    *,
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    sampling: Mapping[str, Any],
    eos_token_id: int,
    dtype: str = "float32",
    kv_cache_memory_bytes: int | None = None,
    threads_bind: str | None = None,
) -> Path:
    """Write the request file read by :func:`main`.

    Args:
        path: request file to write.
        model_dir: HF model directory the engine loads.
        prompts: prompt token ids, one unpadded list per prompt.
        sampling: the contract's ``[sampling]`` fields (``SamplingSpec`` as a dict).
        eos_token_id: end-of-sequence id (passed as a stop token id).
        dtype: engine dtype (``float32``, ``bfloat16``).
        kv_cache_memory_bytes: KV cache size; ``None``: the engine module's default.
        threads_bind: ``VLLM_CPU_OMP_THREADS_BIND``; ``None``: one core group per rank.

    Returns:
        ``path``.
    """
    doc = {
        "model_dir": str(model_dir),
        "prompts": [list(map(int, q)) for q in prompts],
        "sampling": dict(sampling),
        "eos_token_id": int(eos_token_id),
        "dtype": dtype,
        "kv_cache_memory_bytes": kv_cache_memory_bytes,
        "threads_bind": threads_bind,
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def capture(request: Mapping[str, Any]) -> dict[str, Any]:
    """Build the engine, sample every sequence of the request and return the result document.

    Args:
        request: the request document (see the module docstring).

    Returns:
        The result document (see the module docstring).

    Raises:
        ValueError: an unsupported head size or sampling setting (from the engine builder
            or vLLM's ``SamplingParams``).
        RuntimeError: vLLM returned a number of outputs or logprobs that does not match the
            request.
    """
    from harnesses.vllm import engine

    sampling = request["sampling"]
    tp = int(sampling.get("tp", 1))
    kv_bytes = request.get("kv_cache_memory_bytes") or engine.DEFAULT_KV_CACHE_BYTES
    t0 = time.perf_counter()
    engine.configure_env(tp, threads_bind=request.get("threads_bind"))
    # vllm (and torch) only here, in the child, after its environment variables are set.
    import torch
    import vllm

    t_import = time.perf_counter() - t0
    llm = engine.build_llm(
        request["model_dir"], tp=tp, dtype=request.get("dtype", "float32"),
        seed=int(sampling["seed"]), enable_prefix_caching=False,
        kv_cache_memory_bytes=int(kv_bytes), logprobs_mode=sampling["logprobs_mode"],
        threads_bind=request.get("threads_bind"),
    )
    t_start = time.perf_counter() - t0 - t_import

    n = int(sampling["samples_per_prompt"])
    eos = int(request["eos_token_id"])
    prompts: list[list[int]] = request["prompts"]
    inputs: list[Any] = []
    params: list[Any] = []
    keys: list[tuple[int, int, int]] = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            seed = int(sampling["seed"]) + i * n + j
            inputs.append({"prompt_token_ids": list(prompt)})
            params.append(vllm.SamplingParams(
                n=1, temperature=float(sampling["temperature"]), top_p=float(sampling["top_p"]),
                top_k=int(sampling["top_k"]), max_tokens=int(sampling["max_new_tokens"]),
                seed=seed, logprobs=0, stop_token_ids=[eos], detokenize=False,
            ))
            keys.append((i, j, seed))
    t1 = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    t_generate = time.perf_counter() - t1
    if len(outputs) != len(keys):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(keys)} requests")
    sequences = []
    for (i, j, seed), out in zip(keys, outputs, strict=True):
        if len(out.outputs) != 1:
            raise RuntimeError(f"request {i}/{j}: {len(out.outputs)} completions, expected 1")
        comp = out.outputs[0]
        ids = [int(t) for t in comp.token_ids]
        if comp.logprobs is None or len(comp.logprobs) != len(ids):
            got = None if comp.logprobs is None else len(comp.logprobs)
            raise RuntimeError(f"request {i}/{j}: {len(ids)} tokens but {got} logprob entries")
        lps = [float(entry[tok].logprob) for tok, entry in zip(ids, comp.logprobs, strict=True)]
        sequences.append({
            "prompt_index": i, "sample_index": j, "seed": seed, "token_ids": ids,
            "logprobs": lps, "finish_reason": str(comp.finish_reason),
            "stop_reason": comp.stop_reason if isinstance(comp.stop_reason, int) else None,
            "num_cached_tokens": int(out.num_cached_tokens or 0),
        })
    env_keys = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND")
    return {
        "result_version": RESULT_VERSION,
        "vllm_version": str(vllm.__version__),
        "torch_version": str(torch.__version__),
        "sequences": sequences,
        "engine": {
            "tensor_parallel_size": tp,
            "dtype": request.get("dtype", "float32"),
            "enforce_eager": True,
            "enable_prefix_caching": False,
            "kv_cache_memory_bytes": int(kv_bytes),
            "logprobs_mode": engine.LOGPROBS_MODES[sampling["logprobs_mode"]],
            "skip_tokenizer_init": True,
            "generation_config": "vllm",
            "env": {k: os.environ[k] for k in env_keys if k in os.environ},
        },
        "timings_s": {"import_vllm": round(t_import, 3), "engine_start": round(t_start, 3),
                      "generate": round(t_generate, 3)},
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m harnesses.vllm.capture REQUEST_JSON RESULT_JSON``.

    Args:
        argv: the two paths (default ``sys.argv[1:]``).

    Returns:
        0 on success (the result file is written), 2 on a usage error.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m harnesses.vllm.capture REQUEST_JSON RESULT_JSON", file=sys.stderr)
        return 2
    started = time.time()
    request = json.loads(Path(args[0]).read_text())
    result = capture(request)
    result["wall_clock"] = {"main_started": started, "result_written": time.time()}
    atomic.write_bytes(Path(args[1]), (json.dumps(result, indent=1) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
