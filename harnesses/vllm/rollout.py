"""The ``vllm`` rollout backend (the default rollout engine; :mod:`qualify.reference.sampling`).

:class:`VllmRolloutBackend` samples with the real vLLM engine in a child process
(``python -m harnesses.vllm.capture``, see that module for the request/result files and
the seeding policy), so the process that runs the reference stage never imports vllm. The
result is laid out by :func:`qualify.reference.rollout.build_rollout`, the layout shared with the HF
sampler; token ids and logprobs are the engine's own, unchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Final

from harnesses.vllm import capture
from harnesses.vllm.spec import PRIVATE_DIRS
from qualify import procs
from qualify.candidate.launch import launch_env
from qualify.contract import SamplingSpec
from qualify.errors import ContractError, HarnessError
from qualify.privatedirs import private_dirs
from qualify.reference.rollout import Rollout, build_rollout

DEFAULT_TIMEOUT_S: Final = 900.0
"""Wall-clock limit of one capture child (engine start + sampling)."""

_FINISH: Final = {"stop": 1, "length": 0}


class VllmRolloutBackend:
    """Sample a rollout with vLLM (``LLM.generate``) in a child process.

    Engine: :func:`harnesses.vllm.engine.build_llm` (in-process engine core, eager mode,
    no tokenizer, prefix caching off, the checkpoint's generation config ignored), TP =
    ``sampling.tp``, ``dtype`` as given (FP32 by default). Behavior logprobs are vLLM's
    ``processed_logprobs`` (the sampling distribution, after temperature and top-k/top-p)
    when ``sampling.logprobs_mode == "processed"``, ``raw_logprobs`` (``log_softmax`` of the
    logits) when ``raw``. vLLM's finish reason (``stop`` on the EOS stop token, ``length``)
    must agree with the layout's ``eos_terminated``; otherwise :class:`HarnessError`.

    The child gets a private ``VLLM_RPC_BASE_PATH`` directory for vLLM's ZeroMQ IPC sockets
    (unless the user set the variable), removed once the child has ended
    (:data:`harnesses.vllm.spec.PRIVATE_DIRS`, :func:`qualify.privatedirs.private_dirs`).

    Args:
        model_dir: HF model directory, or ``None`` to pass it to :meth:`sample` instead.
        dtype: engine dtype (``float32``, ``bfloat16``).
        kv_cache_memory_bytes: KV cache size (``None``: the engine module's default).
        threads_bind: ``VLLM_CPU_OMP_THREADS_BIND`` (``None``: one core group per rank).
        timeout_s: wall-clock limit of the child process; past it the child's whole process
            tree (vLLM's engine workers included) is ended (:func:`qualify.procs.run`).
        python: interpreter of the child (default: this one).
    """

    def __init__(self, model_dir: str | Path | None = None, *, dtype: str = "float32",
                 kv_cache_memory_bytes: int | None = None, threads_bind: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, python: str | None = None) -> None:
        self.model_dir = model_dir
        self.dtype = dtype
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.threads_bind = threads_bind
        self.timeout_s = timeout_s
        self.python = python or sys.executable
        self.last_result: dict[str, Any] | None = None
        """The child's result document of the last :meth:`sample` call (timings, engine)."""

    @property
    def name(self) -> str:
        """``vllm``."""
        return "vllm"

    @property
    def version(self) -> str:
        """The installed vllm distribution's version (``vllm-cpu`` or ``vllm``), or ``unknown``."""
        for dist in ("vllm-cpu", "vllm"):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
        return "unknown"

    def sample(
        self,
        prompts: list[list[int]],
        sampling: SamplingSpec,
        *,
        pad_token_id: int,
        eos_token_id: int,
        model: Any = None,
    ) -> Rollout:
        """Sample ``samples_per_prompt`` responses per prompt with vLLM.

        Args:
            prompts: prompt token ids, one unpadded list per prompt.
            sampling: the contract's sampling settings (``tp`` = vLLM's TP size).
            pad_token_id: padding id.
            eos_token_id: end-of-sequence id (vLLM stop token).
            model: the model directory for this call (overrides the constructor's).

        Returns:
            The rollout (``R = max_new_tokens``); ``sampler_details`` records the engine
            arguments, environment, vLLM / torch versions, per-sequence seeds, vLLM finish
            reasons and cached-token counts, and the timings.

        Raises:
            ContractError: a sampling setting out of range.
            ValueError: no model directory, or empty prompts.
            HarnessError: the child failed or timed out (its log tail in the message), or
                vLLM's finish reasons disagree with the EOS positions.
        """
        if not sampling.temperature > 0 or not 0 < sampling.top_p <= 1 or sampling.top_k < 0:
            raise ContractError("sampling: temperature must be > 0, top_p in (0, 1], top_k >= 0")
        model_dir = model if model is not None else self.model_dir
        if model_dir is None or not isinstance(model_dir, (str, Path)):
            raise ValueError("VllmRolloutBackend: give a model directory (str or Path), got "
                             f"{type(model_dir).__name__}")
        if not prompts or any(not q for q in prompts):
            raise ValueError("prompts: need at least one prompt and no empty prompt")
        fields = ("engine", "tp", "temperature", "top_p", "top_k", "max_new_tokens",
                  "samples_per_prompt", "seed", "logprobs_mode")
        with tempfile.TemporaryDirectory(prefix="qualify-vllm-") as tmp:
            req = capture.write_request(
                Path(tmp) / "request.json", model_dir=model_dir, prompts=prompts,
                sampling={k: getattr(sampling, k) for k in fields}, eos_token_id=eos_token_id,
                dtype=self.dtype, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                threads_bind=self.threads_bind)
            out = Path(tmp) / "result.json"
            log = Path(tmp) / "capture.log"
            env = launch_env(None)
            t0, launched = time.perf_counter(), time.time()
            with log.open("wb") as fh, private_dirs(PRIVATE_DIRS, env) as dirs:
                ran = procs.run(
                    [self.python, "-m", "harnesses.vllm.capture", str(req), str(out)],
                    stdout=fh, stderr=subprocess.STDOUT, env={**env, **dirs},
                    timeout_s=self.timeout_s)
            if ran.timed_out:
                raise HarnessError(f"vllm capture: timed out after {self.timeout_s} s (process "
                                   f"tree ended); log tail:\n{_tail(log)}")
            wall, ended = time.perf_counter() - t0, time.time()
            if ran.returncode != 0 or not out.exists():
                raise HarnessError(f"vllm capture: exit code {ran.returncode}; log tail:\n"
                                   f"{_tail(log)}")
            result: dict[str, Any] = json.loads(out.read_text())
        clock = result.pop("wall_clock", {})
        result["timings_s"]["child_wall"] = round(wall, 3)
        if clock:
            result["timings_s"]["child_startup"] = round(clock["main_started"] - launched, 3)
            result["timings_s"]["child_exit"] = round(ended - clock["result_written"], 3)
        self.last_result = result
        seqs = result["sequences"]
        n = sampling.samples_per_prompt
        order = [(s["prompt_index"], s["sample_index"]) for s in seqs]
        if order != [(i, j) for i in range(len(prompts)) for j in range(n)]:
            raise HarnessError("vllm capture: sequences out of prompt-major order")
        roll = build_rollout(
            prompts=prompts,
            generated=[s["token_ids"] for s in seqs],
            logprobs=[s["logprobs"] for s in seqs],
            sampling=sampling,
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            sampler=self.name,
            sampler_version=str(result["vllm_version"]),
            sampler_details={
                "distribution": self.version,
                "torch_version": result["torch_version"],
                "engine": result["engine"],
                "logprobs_source": "CompletionOutput.logprobs[t][token_id].logprob, "
                                   "SamplingParams(logprobs=0)",
                "seed_policy": "one request per sample, SamplingParams(n=1, seed=seed + "
                               "prompt_index * samples_per_prompt + sample_index)",
                "eos_policy": "stop_token_ids=[eos_token_id] (engine built without tokenizer)",
                "finish_reasons_vllm": [s["finish_reason"] for s in seqs],
                "num_cached_tokens": [s["num_cached_tokens"] for s in seqs],
                "timings_s": result["timings_s"],
                "process": "child: python -m harnesses.vllm.capture",
            },
        )
        got = [_FINISH.get(s["finish_reason"], -1) for s in seqs]
        if got != roll.eos_terminated.tolist():
            raise HarnessError(f"vllm capture: finish reasons {[s['finish_reason'] for s in seqs]} "
                               f"disagree with EOS positions {roll.eos_terminated.tolist()}")
        return roll


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return "(no log)"
