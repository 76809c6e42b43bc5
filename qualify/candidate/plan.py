"""``qualify plan``'s candidate steps: each trainer launch and the sampler cells.

What the candidate stage's launches need before they run, in the terms of
:mod:`qualify.reference.plan_core`: one :class:`~qualify.reference.plan_core.Step` per
trainer launch, in the stage's order (:func:`launch_steps`: per rank, the role's training
state sharded by TP, its activations and the interpreter; with the sampler cells beside it
where they run there, and one more interpreter where the next launcher imports ahead), then
the sampler cells as one host step (:func:`plan_sampler`). The candidate stage asks the same
plan for each launch's host peak before it starts a launcher ahead
(:func:`launch_host_peaks`). The reference stage's steps and the whole plan are
:mod:`qualify.reference.plan`'s.

This module imports neither torch nor any engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from qualify_harness.protocol import FULL_DISTRIBUTION_MAX_VOCAB

from qualify.contract import Contract
from qualify.errors import UsageError
from qualify.reference.plan_core import (
    INTERPRETER_BYTES,
    LOGIT_COPIES,
    SAFETENSORS_HEADER_BYTES,
    THROUGHPUT,
    VLLM_ENGINE_BYTES,
    Machine,
    ModelShape,
    Step,
    activation_elements,
    model_shape,
    rollout_ids_bound,
    rollout_shape,
    sampled_elements,
    vllm_processes,
)

if TYPE_CHECKING:
    from qualify.candidate.launches import Launch

__all__ = ["CANDIDATE_KINDS", "VLLM_SAMPLER_KV_BYTES", "launch_host_peaks", "launch_steps",
           "plan_sampler"]

CANDIDATE_KINDS: Final = ("launch", "sampler")
"""The kinds of the candidate stage's steps: trainer launches (a device per rank on GPUs)
and the sampler cells (:func:`plan_sampler`, on the host)."""


VLLM_SAMPLER_KV_BYTES: Final = 128 * 1024 * 1024
"""Each candidate sampler engine's KV cache (``harnesses.vllm.harness.KV_CACHE_BYTES``)."""


def plan_sampler(contract: Contract, machine: Machine) -> Step | None:
    """The candidate stage's sampler cells (``[sampler]``) as one step; else ``None``.

    One harness process starts an engine per TP size ``t`` of ``sampler.tp_sizes`` and keeps them
    all until each has scored (:mod:`harnesses.vllm.harness`): a TP 1 engine in that process, an
    engine of ``t > 1`` in ``t`` ranks forked from it
    (:func:`~qualify.reference.plan_core.vllm_processes`). Host memory, all alive at once: the
    processes (:data:`~qualify.reference.plan_core.VLLM_ENGINE_BYTES` each), each engine's ``4 P``
    parameters and ``t`` KV caches of :data:`VLLM_SAMPLER_KV_BYTES`, one mapped checkpoint
    (``4 P``), in every process that runs an engine's rank the round-1 and initial weights its
    probes read from their files (``8 P``), and per such process the decode path's next-token
    distributions (:data:`harnesses.vllm.decode.PASSES`, three, and round 2's: four FP32
    ``[B, R, V]``). Planned on the host whatever the devices (the pinned vLLM is the CPU build; see
    :func:`qualify.reference.plan.plan_rollout`); its kind is ``sampler`` (a host step, no device
    per rank). Written per cell: the raw and tempered distributions, ``[B, R, V]`` FP32 up to
    :data:`qualify_harness.protocol.FULL_DISTRIBUTION_MAX_VOCAB`, above it their top
    ``bounds.distribution_topk`` (FP32 logprobs and int64 ids ``[B, R, k]``), and ten ``[B, R]``
    tensors of at most 8 bytes per element. Time: three passes of ``2 P`` FLOPs per rollout token
    per engine (each response token scored with its prefix cached, the decode path, a new rollout).
    On CPU the candidate stage runs the sampler beside the trainer launches
    (:func:`qualify.candidate.beside.jobs`), so :func:`launch_steps` adds its host memory to
    theirs.
    """
    sampler = contract.sampler
    if sampler is None:
        return None
    shape = model_shape(contract)
    p = shape.count("actor")
    n_seq, prompt, resp, _ = rollout_shape(contract)
    tps = list(sampler.tp_sizes)
    ranks = sum(tps)  # processes that run an engine's rank
    distribution = 4 * n_seq * resp * shape.vocab_size  # one FP32 [B, R, V]
    terms = {"vllm_processes": vllm_processes(tps) * VLLM_ENGINE_BYTES,
             "weights": 4 * p * len(tps), "checkpoint_map": 4 * p,
             "kv_cache": ranks * VLLM_SAMPLER_KV_BYTES, "probe_weights": 8 * p * ranks,
             "decode_distributions": 4 * distribution * ranks}
    seconds = len(tps) * 3 * 2 * p * n_seq * (prompt + resp) / (
        THROUGHPUT["cpu-fp32"] * max(min(max(tps), machine.cores), 1))
    per_position = (4 * shape.vocab_size if shape.vocab_size <= FULL_DISTRIBUTION_MAX_VOCAB
                    else 12 * contract.bounds.distribution_topk)
    written = len(tps) * (2 * per_position * n_seq * resp + 10 * 8 * n_seq * resp
                          + 10 * SAFETENSORS_HEADER_BYTES)
    tags = "-".join(f"tp{t}" for t in tps)
    return Step(name=f"sampler {sampler.engine}-{tags} ({len(tps)} cells, {ranks} ranks)",
                kind="sampler", device_peak=0, host_peak=sum(terms.values()),
                written=written, seconds=seconds, terms=terms,
                processes=vllm_processes(tps))


def launch_steps(contract: Contract, machine: Machine) -> list[Step]:
    """One step per candidate launch, the launches the candidate stage makes.

    The matrix's cells grouped as :func:`qualify.candidate.launches.plan_launches` groups
    them for the candidate stage, in its order
    (:func:`qualify.candidate.launches.in_stage_order`; each engine's ``groups_variants`` and
    ``groups_topologies``, :mod:`qualify.registry`): one launch per topology, or per world
    size, its ranks the Actor's TP ranks and the Critic's side by side (``actor_tp +
    critic_tp``, times the degrees of the cells' other axes, e.g. FSDP2's ``dp``), so a
    launch needs that many devices at once. Per rank, the training state of the role the
    rank runs sharded by TP (``16 P / tp`` bytes at FP32: weights, gradients, AdamW moments;
    ``20 P / tp`` at BF16 with an FP32 master and a BF16 copy and gradient), its activations
    over TP and the interpreter; the launch's per-rank peak is the largest over its variants
    (a grouped launch runs them one after the other, each on fresh models). With devices
    each rank holds one device; on the host every rank is a process (all of them at once).
    The engines' own buffers (NCCL, DeepSpeed's flat buffers) are not counted. ``cpu``
    devices (``Machine.device_kind``: the reference stage's device budget on the host) hold
    no launch: the candidate's ranks are host processes there, planned as on the host.
    Ranks are counted by the engine's world-size rule
    (:meth:`qualify.registry.EngineSpec.launch_world`), as the launcher counts them.

    The sampler cells (:func:`plan_sampler`) come last, as one step; where they run beside
    the trainer launches (on CPU, :func:`qualify.candidate.beside.jobs`) each trainer
    launch's host peak includes theirs (the ``sampler_beside`` term). Where the next
    launch's launcher imports beside a launch (on CPU under the same setting,
    :mod:`qualify.candidate.ahead`), every launch but the last also holds one more
    interpreter (the ``launcher_ahead`` term,
    :data:`~qualify.reference.plan_core.INTERPRETER_BYTES`), and on CPU the run's fork server
    holds one more beside every launch (the ``fork_server`` term,
    :mod:`qualify.candidate.forkserver`).
    """
    from qualify.candidate.launches import in_stage_order, launches_for

    launches = in_stage_order(contract, launches_for(contract, list(contract.matrix.cells())))
    sampler = plan_sampler(contract, machine)
    beside, ahead = _beside(machine, sampler)
    steps: list[Step] = []
    if launches:
        shape = model_shape(contract)
        steps = [_launch_step(contract, machine, shape, lc, beside=beside,
                              ahead=ahead and i + 1 < len(launches))
                 for i, lc in enumerate(launches)]
    return steps + ([sampler] if sampler is not None else [])


def launch_host_peaks(contract: Contract, machine: Machine,
                      launches: Sequence[Launch]) -> dict[str, int]:
    """``{launch_id: host peak bytes}`` of ``launches`` as :func:`launch_steps` plans them.

    Without the ``launcher_ahead`` term: what the launch holds (with the sampler cells
    beside it where they run there), for the candidate stage's check that one more
    interpreter fits beside it (:func:`qualify.candidate.ahead.room_ahead`).
    """
    beside, _ = _beside(machine, plan_sampler(contract, machine))
    if not launches:
        return {}
    shape = model_shape(contract)
    return {lc.launch_id: _launch_step(contract, machine, shape, lc, beside=beside,
                                       ahead=False).host_peak for lc in launches}


def _beside(machine: Machine, sampler: Step | None) -> tuple[Step | None, bool]:
    """``sampler`` (:func:`plan_sampler`) where it runs beside the launches, else ``None``.

    The second: whether the next launch's launcher imports beside each launch
    (:func:`qualify.candidate.beside.ahead`).
    """
    from qualify.candidate.beside import ahead as enabled
    from qualify.candidate.beside import jobs

    dev = machine.devices > 0 and machine.device_kind == "gpu"
    # on CPU the sampler's engines run beside every trainer launch (QUALIFY_JOBS 2)
    try:
        at_once = jobs(cuda=dev)
    except UsageError:  # a bad QUALIFY_JOBS is the candidate stage's error, not the plan's
        at_once = 1 if dev else 2
    try:
        ahead = enabled(cuda=dev)
    except UsageError:  # as above (QUALIFY_AHEAD, QUALIFY_JOBS)
        ahead = not dev and at_once >= 2
    return (sampler if sampler is not None and at_once >= 2 else None, ahead)


def _fork_server_on() -> bool:
    """Whether a CPU run holds a fork server beside its launches (``fork_server`` term).

    :func:`qualify.candidate.launch.start_fork_server`'s rule; a bad setting counts as on
    (the run refuses it, not the plan).
    """
    from qualify.candidate import forkserver
    from qualify.candidate.launch import check_launch_env

    try:
        return forkserver.enabled() and check_launch_env() == "warm"
    except UsageError:
        return True


def _launch_step(contract: Contract, machine: Machine, shape: ModelShape, lc: Launch, *,
                 beside: Step | None, ahead: bool) -> Step:
    """One launch's :class:`~qualify.reference.plan_core.Step` (:func:`launch_steps`).

    ``shape``: the contract's model (:func:`~qualify.reference.plan_core.model_shape`).
    """
    from qualify.registry import get_engine

    n_seq, prompt, resp, _ = rollout_shape(contract)
    positions = prompt + resp
    mbs = contract.algorithm.micro_batch_size
    rounds = contract.algorithm.rounds
    ev = contract.evidence
    dev = machine.devices > 0 and machine.device_kind == "gpu"
    world = get_engine(lc.engine).launch_world(lc.actor_tp, lc.critic_tp, dict(lc.options))
    per_rank, written, flops = 0, 0, 0.0
    for cell in lc.cells:
        pr = shape.count(cell.role)
        per_param = 20 if cell.precision == "bf16" else 16
        elem = 2 if cell.precision == "bf16" else 4
        act = (activation_elements(shape) * mbs * positions * elem
               * shape.num_hidden_layers // cell.tp)
        logits = (LOGIT_COPIES * mbs * resp * shape.vocab_size * 4 // cell.tp
                  if cell.role == "actor" else 0)
        per_rank = max(per_rank, per_param * pr // cell.tp + act + logits)
        rep = sampled_elements(shape.params(cell.role), ev.exact_elements,
                               ev.sample_elements,
                               vocab_rows=rollout_ids_bound(contract, shape.vocab_size),
                               vocab_size=shape.vocab_size)
        written += 4 * rounds * 4 * rep + SAFETENSORS_HEADER_BYTES * rounds * 4 * len(
            shape.params(cell.role))
        flops += rounds * 6 * pr * n_seq * positions
    rk = ("gpu" if dev else "cpu") + ("-bf16" if all(c.precision == "bf16"
                                                    for c in lc.cells) else "-fp32")
    units = min(world, machine.devices) if dev else min(world, machine.cores)
    seconds = flops / (THROUGHPUT[rk] * max(units, 1))
    host = (INTERPRETER_BYTES * world + (0 if dev else per_rank * world))
    terms = {"per_rank": per_rank, "interpreter": INTERPRETER_BYTES}
    if beside is not None:
        host += beside.host_peak
        terms["sampler_beside"] = beside.host_peak
    if ahead:
        host += INTERPRETER_BYTES
        terms["launcher_ahead"] = INTERPRETER_BYTES
    if not dev and _fork_server_on():
        host += INTERPRETER_BYTES
        terms["fork_server"] = INTERPRETER_BYTES
    return Step(name=f"launch {lc.launch_id} ({len(lc.cells)} cells, {world} ranks)",
                kind="launch", device_peak=per_rank if dev else 0, host_peak=host,
                written=written, seconds=seconds, processes=world, terms=terms)

