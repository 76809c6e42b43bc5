"""torch_tp harness: ``python -m harnesses.torch_tp.harness CELL_JSON`` under torchrun.

Runs the PPO update of :mod:`qualify.protocol` with PyTorch-native tensor parallelism:
Hugging Face models sharded by :mod:`harnesses.torch_tp.parallelize`, the vocab-parallel
log-softmax of :mod:`harnesses.torch_tp.vocab_parallel`, ``torch.nn.utils.clip_grad_norm_``
over DTensor gradients and ``torch.optim.AdamW(foreach=False, fused=False)`` on FP32 DTensor
master weights. The rounds, the losses and the output files are the harness SDK's
(:mod:`qualify_harness`): this module supplies :class:`TorchTPEngine`, the engine's parts.

Reads only ``cell.json`` and, from ``inputs_dir``: ``rollout.safetensors``,
``train_inputs.safetensors``, ``contract.json`` and ``model.json`` (never reference
scores). Ranks ``[0, actor_tp)`` run the Actor, the next ``critic_tp`` ranks the Critic,
each role in its own TP group; the roles never communicate with each other. TP rank 0 of
each role writes its role's part; global rank 0 waits for every part and merges them into
``outputs.safetensors`` + ``outputs.json`` (atomic renames, JSON last).

Precision ``bf16`` is BF16 compute with FP32 master weights, FP32 gradients and FP32
AdamW state: the forward runs under ``torch.autocast(device_type, dtype=torch.bfloat16)``
over the FP32 DTensor parameters (torchtitan's mechanism for TP without FSDP), so autograd
produces FP32 gradients for the FP32 leaves; the log-softmax, losses and value head output
are upcast to FP32. The dtypes actually held are read from the tensors and recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import qualify_harness as sdk
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.elastic.multiprocessing.errors import record

from harnesses import common, hf_schedule, layer_probe
from harnesses import resume_state as rs
from harnesses.common import Batch, Inputs
from harnesses.torch_tp import parallelize, resume, vocab_parallel
from harnesses.torch_tp import state_dict_adapter as sda
from qualify.errors import HarnessError
from qualify.protocol import ACTOR_ROUND1_WEIGHTS, HarnessCell

ENGINE: Final = "torch_tp"
PACKAGES: Final = ("torch", "transformers", "safetensors")
BF16_MECHANISM: Final = ("torch.autocast(device_type, dtype=torch.bfloat16) over FP32 DTensor "
                         "parameters; losses in FP32")


# --------------------------------------------------------------------------- models


def response_hidden(model: nn.Module, batch: Batch, shift: int = 0) -> Tensor:
    """Backbone output at sequence positions ``P - 1 + shift + t`` for ``t < R``.

    Returns:
        ``[b, R, hidden]`` (local, equal on all ranks).
    """
    backbone = getattr(model, str(model.base_model_prefix))
    out = backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids, use_cache=False)
    start = batch.prompt_len - 1 + shift
    hidden: Tensor = out.last_hidden_state[:, start:start + batch.response_len]
    return hidden


# --------------------------------------------------------------------------- the engine


@dataclasses.dataclass(kw_only=True)
class TorchTPEngine(sdk.TorchOptimEngine):
    """One role on one rank: a DTensor-sharded HF model, AdamW on FP32 DTensor masters.

    Attributes:
        model: the trained, parallelized model.
        optimizer: ``torch.optim.AdamW(foreach=False, fused=False)``.
        lr_scheduler: the contract's HF scheduler (:mod:`harnesses.hf_schedule`).
        mesh: the role's TP group and mesh.
        precision: ``fp32`` or ``bf16``.
        temperature: the contract's sampling temperature.
        rec: where compute dtypes are recorded.
        partial_grads: parameters whose gradients arrived ``Partial`` and were reduced.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    mesh: parallelize.RoleMesh
    device: torch.device
    precision: str
    temperature: float
    rec: sdk.Recorder
    pad_token_id: int = 0
    partial_grads: list[str] = dataclasses.field(default_factory=list)
    _dtypes: tuple[dict[str, set[torch.dtype]], dict[str, set[torch.dtype]]] = \
        dataclasses.field(default_factory=lambda: ({}, {}))

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """BF16 autocast for ``bf16`` cells; nothing for ``fp32``."""
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def logits_divisor(self) -> float:
        """The logits divisor (the contract's sampling temperature)."""
        return self.temperature

    def actor_hidden(self, model: nn.Module, batch: Batch) -> Tensor:
        """The backbone output that scores the response tokens (``[b, R, hidden]``)."""
        return response_hidden(model, batch)

    def head_logits(self, model: Any, batch: Batch) -> Tensor:
        """The ``lm_head`` output on the response window, ``[b, R, V]`` in the compute dtype.

        A ``Shard(-1)`` DTensor from the vocab-parallel head under TP (a plain tensor at TP 1
        without DTensor, or from a replicated head).
        """
        with self.autocast():
            logits: Tensor = model.get_submodule("lm_head")(self.actor_hidden(model, batch))
        self.rec.compute_dtypes.add(logits.dtype)
        return logits

    def logprobs_and_entropy(self, model: Any, batch: Batch) -> tuple[Tensor, Tensor]:
        """Log-probs and entropy ``[b, R]`` FP32 through the vocab-parallel head."""
        return vocab_parallel.logprobs_and_entropy(self.head_logits(model, batch),
                                                   batch.responses, self.logits_divisor())

    def response_logits(self, model: Any, batch: Batch) -> Tensor:
        """:meth:`head_logits` whole, ``[b, R, V]``, on every TP rank.

        ``DTensor.full_tensor()``: the vocabulary shards all-gathered over the role's TP group.
        """
        logits = self.head_logits(model, batch)
        full = getattr(logits, "full_tensor", None)
        whole: Tensor = full() if callable(full) else logits
        return whole

    def values(self, model: Any, batch: Batch) -> Tensor:
        """Values ``V(s_t)`` ``[b, R]`` FP32 (value head on the response window)."""
        with self.autocast():
            v = model.get_submodule("score")(response_hidden(model, batch))  # [b, R, 1]
        self.rec.compute_dtypes.add(v.dtype)
        values: Tensor = v.float().squeeze(-1)
        return values

    def prepare_grads(self) -> None:
        """Read the reduction dtypes, then reduce gradients autograd left ``Partial``."""
        self._dtypes = parallelize.reduction_dtypes(self.model)
        self.partial_grads = parallelize.reduce_partial_grads(self.model)

    def engine_dtypes(self) -> tuple[dict[str, set[torch.dtype]], dict[str, set[torch.dtype]]]:
        """DTensor reduction and accumulation dtypes (:func:`parallelize.reduction_dtypes`)."""
        return self._dtypes

    def check_replicas(self) -> tuple[dict[str, bool], dict[str, float]]:
        """Replicated DTensor parameters bitwise equal on every TP rank."""
        check = parallelize.check_replicas(self.model, self.mesh)
        return dict(check.equal), dict(check.max_abs_diff)


# --------------------------------------------------------------------------- the run


def groups_up(group: Any, rank: int) -> None:
    """Barrier over the role's TP group: it is up before anything is loaded."""
    dist.barrier(group=group)


@dataclasses.dataclass(kw_only=True)
class RoleRun:
    """One role of one variant on one rank: build, run the SDK's rounds, report.

    Attributes:
        cell: the single-variant cell.
        rank: global rank.
        mesh: the role's TP group and mesh.
        inputs: the harness inputs.
        device: compute device.
        rec: what the role reports.
    """

    cell: HarnessCell
    rank: int
    mesh: parallelize.RoleMesh
    inputs: Inputs
    device: torch.device
    rec: sdk.Recorder
    resume_meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def probe_for(self, model: nn.Module) -> layer_probe.LayerProbe:
        """The cell's layer probe over ``model`` (inactive without ``cell.probe``).

        Layout: every probed output is a local full tensor (``ReplicateParallel`` norms and
        embeddings, ``RowwiseParallel``'s all-reduced ``o_proj`` / ``down_proj``), except
        the vocab-parallel ``lm_head`` logits, a ``Shard(-1)`` DTensor (and its gradient),
        gathered with ``full_tensor()`` (collective over the role's TP group).
        """
        def to_full(_name: str, t: Tensor) -> Tensor:
            full = getattr(t, "full_tensor", None)
            return full() if callable(full) else t

        return layer_probe.LayerProbe(self.cell.probe, role=self.rec.role,
                                      writer=self.rec.writer,
                                      modules=layer_probe.hf_modules(model), to_full=to_full)

    def engine_for(self, model: nn.Module, lr: float) -> TorchTPEngine:
        """The role's :class:`TorchTPEngine`: AdamW (single-tensor path) and the HF scheduler."""
        c = self.inputs.contract
        o = c.optimizer
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      lr=lr, betas=o.betas, eps=o.eps,
                                      weight_decay=o.weight_decay, foreach=False, fused=False)
        return TorchTPEngine(model=model, optimizer=optimizer,
                             lr_scheduler=hf_schedule.hf_scheduler(optimizer, o),
                             mesh=self.mesh, device=self.device, precision=self.cell.precision,
                             temperature=c.sampling.temperature, rec=self.rec,
                             pad_token_id=common.pad_token_id(model))

    def run(self) -> dict[str, Any]:
        """The role's rounds (:func:`qualify_harness.run_actor` / ``run_critic``); its meta."""
        actor = self.mesh.role == "actor"
        with self.rec.timed("load_s"):
            kind = "causal_lm" if actor else "value"
            path = self.inputs.actor_dir if actor else self.inputs.critic_dir
            model = common.load_hf_model(kind, path, self.device)
            ref = common.load_hf_model("causal_lm", self.inputs.ref_dir, self.device) \
                if actor else None
            if ref is not None:
                ref.requires_grad_(False)
        with self.rec.timed("parallelize_s"):
            info = parallelize.parallelize_model(model, self.mesh.mesh)
            if ref is not None:
                parallelize.parallelize_model(ref, self.mesh.mesh)
        probe = self.probe_for(model)
        engine = self.engine_for(model, self.inputs.contract.optimizer.actor_lr if actor
                                 else self.inputs.contract.optimizer.critic_lr)
        batch = self.inputs.batch.to(self.device)
        plan = rs.ResumePlan.of(self.cell)
        restore = (lambda: self.resume_load(plan, engine)) if plan.loading else None

        def after_round(round_: int, rollout_state: dict[str, Tensor]) -> None:
            if plan.saves_after(round_):
                self.resume_save(plan, engine, rollout_state)
            if actor and round_ == 1 and self.cell.export_weights:
                self.export_weights(model, Path(self.cell.output_dir) / ACTOR_ROUND1_WEIGHTS)

        def capture(round_: int, mb: Batch) -> contextlib.AbstractContextManager[Any]:
            return probe.capture(round_, prompt_len=mb.prompt_len, seq_len=mb.input_ids.shape[1])

        recipe = self.inputs.recipe
        rounds = plan.rounds(recipe.rounds)
        if actor:
            meta = sdk.run_actor(engine, model, ref, batch, recipe, rec=self.rec, rounds=rounds,
                                 restore=restore, after_round=after_round, capture=capture)
        else:
            meta = sdk.run_critic(engine, model, batch, recipe, rec=self.rec, rounds=rounds,
                                  restore=restore, after_round=after_round, capture=capture)
        probe.save(ENGINE)
        return sdk.role_meta(
            self.rec, tp=self.mesh.tp, global_ranks=self.mesh.ranks,
            precision=self.cell.precision, model_class=type(model).__name__,
            parallelism={"mesh_dim_names": ["tp"], "lm_head": info.lm_head,
                         "sharded_params": list(info.sharded),
                         "replicated_params": list(info.replicated),
                         "partial_grads_reduced": engine.partial_grads},
            bf16_mechanism=BF16_MECHANISM if self.cell.precision == "bf16" else None,
            lr_scheduler=hf_schedule.SCHEDULER_NOTE, dropout="off (eval mode)",
            **meta, **self.resume_meta)

    def export_weights(self, model: nn.Module, path: Path) -> None:
        """Write the full HF-layout FP32 weights (``safetensors``) for the sampler cell.

        Collective over the role's TP group: every parameter is gathered with
        ``DTensor.full_tensor()`` (:func:`state_dict_adapter.full_params`, HF names, no
        permutation: a column-parallel ``Shard(0)`` concatenates in HF row order); TP rank 0
        writes ``path`` atomically (temp file + rename). A tied LM head is the embedding
        (``named_parameters`` lists it once), as in the HF checkpoint.
        """
        with self.rec.timed("export_weights_s"):
            full = sda.full_params(model)
            if self.rec.writer:
                path.parent.mkdir(parents=True, exist_ok=True)
                common.atomic_tensors(path, full, {"format": "pt", "engine": ENGINE,
                                                   "what": "actor weights after round 1"})

    def resume_save(self, plan: rs.ResumePlan, engine: TorchTPEngine,
                    rollout_state: dict[str, Tensor]) -> None:
        """Checkpoint after round ``plan.after_round`` (:mod:`harnesses.torch_tp.resume`)."""
        with self.rec.timed("checkpoint_save_s"):
            resume.save(plan, role=self.rec.role, writer=self.rec.writer, group=self.mesh.group,
                        model=engine.model, optimizer=engine.optimizer,
                        scheduler=engine.lr_scheduler, rollout_state=rollout_state)

    def resume_load(self, plan: rs.ResumePlan, engine: TorchTPEngine) -> dict[str, Tensor]:
        """Restore the checkpoint (fresh process); returns the saved rollout state."""
        with self.rec.timed("checkpoint_load_s"):
            state, self.resume_meta["resume"] = resume.load(
                plan, role=self.rec.role, group=self.mesh.group, model=engine.model,
                optimizer=engine.optimizer, scheduler=engine.lr_scheduler)
        return {k: v.to(self.device) for k, v in state.items()}


def check_cell(cell: HarnessCell) -> list[tuple[tuple[int, int], list[HarnessCell]]]:
    """The variants of ``cell`` to run, each as a single-variant cell, by topology, validated.

    A cell without ``variants`` is its own single variant; a grouped launch's cell
    (:attr:`qualify.protocol.HarnessCell.variants`) gives one cell per variant, with
    ``output_dir /`` :func:`~qualify.protocol.variant_dir` as its output directory,
    consecutive variants of one topology together (:func:`harnesses.common.topology_runs`).

    Raises:
        HarnessError: engine options given, a precision other than fp32 / bf16, a variant
            topology of another world size.
    """
    runs = common.topology_runs(cell)
    for _, vcells in runs:
        for vcell in vcells:
            if vcell.options:
                raise HarnessError(f"torch_tp takes no engine options, got {vcell.options}")
            if vcell.precision not in ("fp32", "bf16"):
                raise HarnessError(f"precision {vcell.precision!r}: torch_tp runs fp32 or bf16")
    return runs


def run(cell: HarnessCell) -> None:
    """Run every variant of ``cell`` on this rank (the process group must not exist yet).

    One process group serves every variant and topology of a grouped launch (issue #17):
    each topology's role groups are built in turn (:func:`parallelize.build_role_mesh`,
    every rank, same order), and each variant starts from the frozen inputs with a fresh
    model, optimizer and ``torch.manual_seed(cell.seed)``, so its outputs do not depend on
    the variants before it (tests/test_grouped_launch.py checks this bitwise).

    Raises:
        HarnessError: not under torchrun, a world size that is not the cell's, engine
            options given, bad inputs, unknown faults, a TP size that does not divide the
            model.
    """
    t0 = time.perf_counter()
    rank, world = common.env_int("RANK"), common.env_int("WORLD_SIZE")
    if world != cell.world_size:
        raise HarnessError(f"WORLD_SIZE = {world} but the cell needs actor_tp + critic_tp = "
                           f"{cell.world_size}")
    topologies, init_s = check_cell(cell), 0.0
    if cell.faults:  # the test suite's deliberate bugs, patched in (harnesses/torch_tp/faults.py)
        from harnesses.torch_tp import faults
        faults.install(cell.faults, sys.modules[__name__])
    inputs = common.read_inputs(Path(cell.inputs_dir))
    device, backend, device_id = common.launch_device(cell)
    timeout = timedelta(seconds=cell.collective_timeout_s)
    dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    try:
        for (actor_tp, critic_tp), variants in topologies:
            mesh = parallelize.build_role_mesh(
                actor_tp=actor_tp, critic_tp=critic_tp, rank=rank,
                device_type=device.type, timeout_s=cell.collective_timeout_s)
            groups_up(mesh.group, rank)
            init_s = init_s or time.perf_counter() - t0  # start-up: to the first groups
            for vcell in variants:
                _run_variant(vcell, rank=rank, world=world, mesh=mesh, inputs=inputs,
                             device=device, backend=backend,
                             t0=t0, init_s=init_s)
    finally:
        dist.destroy_process_group()


def _run_variant(vcell: HarnessCell, *, rank: int, world: int, mesh: parallelize.RoleMesh,
                 inputs: Inputs, device: torch.device, backend: str,
                 t0: float, init_s: float) -> None:
    """Run one single-variant cell on this rank and write its outputs (rank 0 merges)."""
    tv = time.perf_counter()
    print(f"[torch_tp] rank {rank}/{world}: {mesh.role} tp_rank {mesh.tp_rank}/"
          f"{mesh.tp} ranks {list(mesh.ranks)} on {device} ({backend}), "
          f"{vcell.precision}", flush=True)
    torch.manual_seed(vcell.seed)
    rec = sdk.Recorder(role=mesh.role, writer=mesh.tp_rank == 0,
                       sampling=sdk.ParamSampling.from_dict(vcell.param_sampling.to_dict()))
    runner = RoleRun(cell=vcell, rank=rank, mesh=mesh, inputs=inputs, device=device, rec=rec)
    with rec.timed("total_s"):
        meta = runner.run()
    print(f"[torch_tp] rank {rank}: {mesh.role} {vcell.precision} done, timings "
          f"{rec.timings}", flush=True)
    output_dir = Path(vcell.output_dir)
    if rec.writer:  # a resumed launch reports only the rounds it ran
        sdk.write_part(ENGINE, output_dir, mesh.role, rs.ResumePlan.of(vcell).keep(rec.tensors),
                       meta)
    if rank == 0:
        head = sdk.outputs_head(
            engine=ENGINE, cell=vcell.to_dict(), packages=PACKAGES, world=world,
            backend=backend, device=device,
            timings={"init_s": round(init_s, 4),
                     "variant_s": round(time.perf_counter() - tv, 4),
                     "rank0_total_s": round(time.perf_counter() - t0, 4)},
            shims=[], faults=vcell.faults)
        sdk.merge_parts(ENGINE, common.roles(vcell.actor_tp, vcell.critic_tp),
                           output_dir, head)


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m harnesses.torch_tp.harness CELL_JSON``.

    Returns:
        0 on success, 2 on a usage error (exceptions propagate so torchrun records them).
    """
    return common.harness_main(argv, engine=ENGINE, module="harnesses.torch_tp.harness",
                               run=run)


if __name__ == "__main__":
    common.exit_now(main())
