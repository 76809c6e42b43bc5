"""fsdp2 harness: ``python -m harnesses.fsdp2.harness CELL_JSON`` under torchrun.

Runs the PPO update of :mod:`qualify.protocol` with PyTorch FSDP2: Hugging Face models
with ``fully_shard`` on each decoder layer and the root (:mod:`harnesses.fsdp2.parallelize`),
``torch.nn.utils.clip_grad_norm_`` over the sharded DTensor gradients and
``torch.optim.AdamW(foreach=False, fused=False)`` on the FP32 sharded DTensor parameters
(the master weights). The rounds, the losses and the output files are the harness SDK's
(:mod:`qualify_harness`): this module supplies :class:`FSDP2Engine`, the engine's parts.

Reads only ``cell.json`` and, from ``inputs_dir``: ``rollout.safetensors``,
``train_inputs.safetensors``, ``contract.json`` and ``model.json`` (never reference
scores). The cell's ``options["dp"]`` (default 1) is the shard degree and its
``actor_tp`` / ``critic_tp`` the TP degrees: ranks ``[0, actor_tp dp)`` run the Actor, the
next ``critic_tp dp`` ranks the Critic (the world is ``(actor_tp + critic_tp) * dp``), each
role on its own ``("dp",)`` mesh at TP 1 or ``("dp", "tp")`` mesh at TP > 1 (TP applied
with ``parallelize_module`` first, :mod:`harnesses.fsdp2.tensor_parallel`, then
``fully_shard`` over ``dp``). Each DP rank (all its TP ranks alike) trains on its
contiguous slice of the batch rows with losses normalised by the global valid-token count,
and the gradients are reduce-scattered once over ``dp``, as a sum. DP rank 0 / TP rank 0
of each role writes its role's part (per-token tensors all-gathered from the DP group,
per-parameter tensors gathered to the HF layout with ``DTensor.full_tensor()`` over both
mesh dims); global rank 0 merges the parts into ``outputs.safetensors`` + ``outputs.json``.

Precision ``bf16`` is FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)``: each forward all-gathers BF16 copies of the FP32 sharded
masters and computes in BF16 (the ``params`` BF16 style, :mod:`qualify.lanes`); the BF16
gradients are cast to FP32 for the reduce-scatter and accumulate in the FP32 sharded
``.grad``; AdamW state is FP32. Log-softmax, losses and value head output are upcast to
FP32. Buffers (the rotary ``inv_freq``) stay FP32: the policy casts parameters only. The
dtypes actually held are read from the tensors and recorded, the reduce-scatter and
accumulation dtypes from FSDP2's parameter groups
(:func:`harnesses.fsdp2.parallelize.reduction_dtypes`).
"""

from __future__ import annotations

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

from harnesses import common, hf_schedule
from harnesses import resume_state as rs
from harnesses.common import Batch, Inputs
from harnesses.fsdp2 import parallelize, resume, tensor_parallel
from harnesses.fsdp2 import state_dict_adapter as sda
from qualify.errors import HarnessError
from qualify.protocol import ACTOR_ROUND1_WEIGHTS, HarnessCell

ENGINE: Final = "fsdp2"
PACKAGES: Final = ("torch", "transformers", "safetensors")
DP_OPTION: Final = "dp"
BF16_MECHANISM: Final = ("torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                         "reduce_dtype=torch.float32): BF16 parameters all-gathered from FP32 "
                         "sharded masters; FP32 reduce-scatter and gradients; losses in FP32")
REPLICA_CHECK: Final = ("not applicable: fully_shard places every parameter as Shard(0) over "
                        "the dp mesh (no parameter is replicated across ranks, so there is "
                        "no replica to compare); a Replicate parameter would be compared "
                        "bitwise here")
REPLICA_CHECK_TP: Final = ("bitwise over each TP group: the local dp shards of every parameter "
                           "replicated along tp (embeddings, norms, value head) after each step")


# --------------------------------------------------------------------------- the engine


@dataclasses.dataclass(kw_only=True)
class FSDP2Engine(sdk.TorchOptimEngine):
    """One role on one rank: a ``fully_shard`` HF model, AdamW on the FP32 sharded masters.

    Attributes:
        model: the trained, sharded model.
        optimizer: ``torch.optim.AdamW(foreach=False, fused=False)``.
        lr_scheduler: the contract's HF scheduler (:mod:`harnesses.hf_schedule`).
        mesh: the role's DP (and TP) meshes and groups.
        temperature: the contract's sampling temperature.
        rec: where compute dtypes are recorded.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    mesh: parallelize.RoleMesh
    device: torch.device
    temperature: float
    rec: sdk.Recorder
    pad_token_id: int = 0

    def response_logits(self, model: Any, batch: Batch) -> Tensor:
        """Logits ``[b, R, V]`` of ``model`` on the response window, in the policy's dtype.

        The root module's forward runs (FSDP2's hooks unshard the root's parameters there),
        with ``logits_to_keep`` = the response window ``P - 1 + t``; the whole vocabulary is
        on every rank (TP's ``lm_head`` output gathered, :mod:`harnesses.fsdp2
        .tensor_parallel`).
        """
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False,
                    logits_to_keep=batch.window())
        logits: Tensor = out.logits  # [b, R, V] in the policy's param dtype
        self.rec.compute_dtypes.add(logits.dtype)
        return logits

    def values(self, model: Any, batch: Batch) -> Tensor:
        """Values ``V(s_t)`` ``[b, R]`` FP32 (the root forward, value head at ``P - 1 + t``)."""
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False)
        v = out.logits[:, batch.window()]  # [b, R, 1]
        self.rec.compute_dtypes.add(v.dtype)
        values: Tensor = v.float().squeeze(-1)
        return values

    def after_scoring(self, models: list[Any]) -> None:
        """Reshard every model the scoring pass unsharded."""
        for m in models:
            parallelize.reshard(m)

    def gather_rows(self, local: Tensor) -> Tensor:
        """All-gather ``[b_local, ...]`` rows from the DP group: ``[B, ...]`` in row order."""
        if self.mesh.dp == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.mesh.dp)]
        dist.all_gather(parts, local.contiguous(), group=self.mesh.dp_group)
        return torch.cat(parts, dim=0)

    def sum_over_ranks(self, shares: dict[str, float]) -> dict[str, float]:
        """All-reduce (sum) per-rank loss shares over the DP group (FP64), by sorted name."""
        keys = sorted(shares)
        t = torch.tensor([shares[k] for k in keys], dtype=torch.float64)
        if self.mesh.dp > 1:  # TP ranks of a DP rank hold the same (replicated) shares
            dist.all_reduce(t, group=self.mesh.dp_group)
        return {k: float(v) for k, v in zip(keys, t.tolist(), strict=True)}

    def engine_dtypes(self) -> tuple[dict[str, set[torch.dtype]], dict[str, set[torch.dtype]]]:
        """FSDP2's reduce-scatter and accumulation dtypes (its parameter groups)."""
        return parallelize.reduction_dtypes(self.model)

    def trained(self) -> list[tuple[str, nn.Parameter]]:
        """Trainable parameters, each checked a sharded DTensor (:func:`sda.sharded`)."""
        return sda.sharded(self.model)

    def check_replicas(self) -> tuple[dict[str, bool], dict[str, float]]:
        """Compare replicated parameters bitwise: along ``tp`` at TP > 1, else over ``dp``.

        At TP > 1 the local ``dp`` shards of each parameter replicated along ``tp`` are
        all-gathered over the TP group; at TP 1 the fully ``Replicate`` parameters (none
        under FSDP2) over the DP group.
        """
        if self.mesh.tp > 1:
            reps = parallelize.tp_replicated_parameters(self.model)
            group, size = self.mesh.tp_group, self.mesh.tp
        else:
            reps = parallelize.replicated_parameters(self.model)
            group, size = self.mesh.dp_group, self.mesh.dp
        equal: dict[str, bool] = {}
        diffs: dict[str, float] = {}
        for name, p in reps:
            local = p.to_local().detach().float().reshape(-1).cpu()
            parts = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(parts, local, group=group)
            diffs[name] = max(float((x - parts[0]).abs().max()) if x.numel() else 0.0
                              for x in parts)
            equal[name] = all(torch.equal(x.view(torch.int32), parts[0].view(torch.int32))
                              for x in parts)
        return equal, diffs


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass(kw_only=True)
class RoleRun:
    """One role on one rank: build, run the SDK's rounds on this DP rank's rows, report.

    Attributes:
        cell: the cell.
        rank: global rank.
        mesh: the role's DP group and mesh.
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
    reduction: dict[str, Any] = dataclasses.field(default_factory=dict)
    tp_info: tensor_parallel.TpInfo | None = None
    resume_meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def load(self, kind: str, path: Path) -> tuple[nn.Module, parallelize.ShardingInfo]:
        """Load an HF model in FP32; TP over ``tp`` (TP > 1), then ``fully_shard`` over ``dp``.

        Gradients are reduce-scattered as a sum (divide factor 1: every loss is already
        normalised by the whole batch's denominator).
        """
        model = common.load_hf_model(kind, path, self.device)
        if self.mesh.tp_mesh is not None:  # torchtitan's order: TP first, then FSDP
            self.tp_info = tensor_parallel.apply_tp(model, self.mesh.tp_mesh)
        info = parallelize.shard_model(model, self.mesh.dp_mesh,
                                       parallelize.mp_policy(self.cell.precision))
        self.reduction = parallelize.set_sum_reduction(model, divide_factor=1.0)
        return model, info

    def run(self) -> dict[str, Any]:
        """The role's rounds (:func:`qualify_harness.run_actor` / ``run_critic``); its meta."""
        actor = self.mesh.role == "actor"
        o = self.inputs.contract.optimizer
        with self.rec.timed("load_s"):
            model, info = self.load("causal_lm" if actor else "value",
                                    self.inputs.actor_dir if actor else self.inputs.critic_dir)
            ref = self.load("causal_lm", self.inputs.ref_dir)[0] if actor else None
            if ref is not None:
                ref.requires_grad_(False)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      lr=o.actor_lr if actor else o.critic_lr, betas=o.betas,
                                      eps=o.eps, weight_decay=o.weight_decay, foreach=False,
                                      fused=False)
        engine = FSDP2Engine(model=model, optimizer=optimizer,
                             lr_scheduler=hf_schedule.hf_scheduler(optimizer, o),
                             mesh=self.mesh, device=self.device,
                             temperature=self.inputs.contract.sampling.temperature,
                             rec=self.rec, pad_token_id=common.pad_token_id(model))
        whole = self.inputs.batch.to(self.device)
        rows = parallelize.dp_rows(whole.input_ids.shape[0], self.mesh.dp, self.mesh.dp_rank,
                                   self.inputs.recipe.micro_batch_size)
        plan = rs.ResumePlan.of(self.cell)

        def restore() -> dict[str, Tensor]:
            return self.resume_load(plan, engine, rows)

        def after_round(round_: int, rollout_state: dict[str, Tensor]) -> None:
            if plan.saves_after(round_):
                self.resume_save(plan, engine, rollout_state)
            if actor and round_ == 1 and self.cell.export_weights:
                self.export_weights(model, Path(self.cell.output_dir) / ACTOR_ROUND1_WEIGHTS)

        recipe = self.inputs.recipe
        kw: dict[str, Any] = {
            "rec": self.rec, "rounds": plan.rounds(recipe.rounds),
            "restore": restore if plan.loading else None, "after_round": after_round,
            "whole_mask": self.inputs.batch.mask, "rows": rows}
        if actor:
            meta = sdk.run_actor(engine, model, ref, whole.rows(rows), recipe, **kw)
        else:
            meta = sdk.run_critic(engine, model, whole.rows(rows), recipe, **kw)
        return sdk.role_meta(
            self.rec, tp=self.mesh.tp, global_ranks=self.mesh.ranks,
            precision=self.cell.precision, model_class=type(model).__name__,
            parallelism=self.parallelism(model, info, rows, meta["valid_tokens"]),
            bf16_mechanism=BF16_MECHANISM if self.cell.precision == "bf16" else None,
            lr_scheduler=hf_schedule.SCHEDULER_NOTE, dropout="off (eval mode)",
            **meta, **self.resume_meta)

    def parallelism(self, model: nn.Module, info: parallelize.ShardingInfo, rows: slice,
                    n_valid: int) -> dict[str, Any]:
        """The role meta's ``parallelism``: meshes, shard units, placements, DP rows."""
        per = rows.stop - rows.start
        return {
            "mesh_dim_names": list(self.mesh.mesh_dim_names),
            "dp": self.mesh.dp,
            "rank_grid_dp_by_tp": parallelize.grid(self.mesh.ranks, self.mesh.tp),
            "tensor_parallel": self.tp_info.to_dict() if self.tp_info else None,
            "fully_shard_units": list(info.units),
            "sharded_params": list(info.sharded),
            "replicated_params": list(info.replicated),
            "tp_replicated_params": list(info.tp_replicated),
            "placements": info.placements if self.mesh.tp > 1 else {},
            "mixed_precision": {"param_dtype": info.param_dtype,
                                "reduce_dtype": info.reduce_dtype},
            "gradient_reduction": self.reduction,
            "dp_rows": {"rows_per_rank": per, "valid_tokens_global": n_valid,
                        "row_range_by_dp_rank": [[d * per, (d + 1) * per]
                                                 for d in range(self.mesh.dp)]},
            "local_shard_shapes_dp_rank0": sda.local_shapes(model) if self.rec.writer else {},
            "replica_check": (REPLICA_CHECK_TP if self.mesh.tp > 1 else
                              REPLICA_CHECK if not info.replicated else "bitwise"),
        }

    def export_weights(self, model: nn.Module, path: Path) -> None:
        """Write the full HF-layout FP32 weights (``safetensors``) for a sampler cell.

        Collective over the role's DP group (``full_tensor()`` of every sharded parameter,
        HF names, no permutation); DP rank 0 writes ``path`` atomically.
        """
        with self.rec.timed("export_weights_s"):
            full = sda.full_params(model)
            if self.rec.writer:
                path.parent.mkdir(parents=True, exist_ok=True)
                common.atomic_tensors(path, full, {"format": "pt", "engine": ENGINE,
                                                   "what": "actor weights after round 1"})

    def resume_save(self, plan: rs.ResumePlan, engine: FSDP2Engine,
                    rollout_state: dict[str, Tensor]) -> None:
        """Checkpoint after round ``plan.after_round`` (:mod:`harnesses.fsdp2.resume`).

        ``rollout_state`` holds this DP rank's rows ``[b, R]`` FP32 of the tensors later
        rounds read; all-gathered over ``dp`` to ``[B, R]`` here (collective).
        """
        with self.rec.timed("checkpoint_save_s"):
            whole = {k: engine.gather_rows(v) for k, v in rollout_state.items()}
            resume.save(plan, role=self.rec.role, writer=self.rec.writer,
                        group=self.mesh.group, model=engine.model, optimizer=engine.optimizer,
                        scheduler=engine.lr_scheduler, rollout_state=whole)

    def resume_load(self, plan: rs.ResumePlan, engine: FSDP2Engine,
                    rows: slice) -> dict[str, Tensor]:
        """Restore the checkpoint (fresh process); this DP rank's ``rows`` of its state."""
        with self.rec.timed("checkpoint_load_s"):
            state, self.resume_meta["resume"] = resume.load(
                plan, role=self.rec.role, group=self.mesh.group, model=engine.model,
                optimizer=engine.optimizer, scheduler=engine.lr_scheduler)
        return {k: v[rows].to(self.device) for k, v in state.items()}


def rank_table(actor_tp: int, critic_tp: int, dp: int) -> list[dict[str, Any]]:
    """``outputs.json`` ``ranks``: role, TP rank and TP group of each rank.

    The schema's fields only; a rank's DP rank is its TP group's row in the role's
    ``parallelism.rank_grid_dp_by_tp``.
    """
    tps = {"actor": actor_tp, "critic": critic_tp}
    out: list[dict[str, Any]] = []
    for role, ranks in parallelize.role_ranks(actor_tp, critic_tp, dp).items():
        rows = parallelize.grid(ranks, tps[role])
        for row in rows:
            out.extend({"rank": r, "role": role, "tp_rank": t, "tp_group": row}
                       for t, r in enumerate(row))
    return out


def dp_degree(cell: HarnessCell) -> int:
    """The cell's DP degree (``options["dp"]``, default 1).

    Raises:
        HarnessError: another option, a DP degree below 1, or a negative TP (a TP that
            does not divide the heads is refused when the model loads).
    """
    extra = sorted(set(cell.options) - {DP_OPTION})
    if extra:
        raise HarnessError(f"fsdp2 takes only the option {DP_OPTION!r}, got {extra}")
    dp = int(cell.options.get(DP_OPTION, 1))
    if dp < 1:
        raise HarnessError(f"dp = {dp}: must be at least 1")
    for field in ("actor_tp", "critic_tp"):
        if getattr(cell, field) < 0:
            raise HarnessError(f"{field} = {getattr(cell, field)}: must be 0 (absent) or more")
    return dp


def run(cell: HarnessCell) -> None:
    """Run ``cell`` on this rank (the process group must not exist yet).

    Raises:
        HarnessError: not under torchrun, a world size that is not ``(actor_tp +
            critic_tp) * dp``, bad options, bad inputs, unknown faults, a batch that the
            DP degree does not divide.
    """
    t0 = time.perf_counter()
    rank, world = common.env_int("RANK"), common.env_int("WORLD_SIZE")
    dp = dp_degree(cell)
    if world != cell.world_size * dp:
        raise HarnessError(
            f"WORLD_SIZE = {world} but the cell needs (actor_tp + critic_tp) * dp = "
            f"({cell.actor_tp} + {cell.critic_tp}) * {dp} = {cell.world_size * dp} (the "
            f"launcher must start EngineSpec.world_size(cell) ranks, rule "
            f"'(actor_tp+critic_tp)*dp')")
    if cell.precision not in ("fp32", "bf16"):
        raise HarnessError(f"precision {cell.precision!r}: fsdp2 runs fp32 or bf16")
    if cell.faults:  # the test suite's deliberate bugs, patched in (harnesses/fsdp2/faults.py)
        from harnesses.fsdp2 import faults
        faults.install(cell.faults, sys.modules[__name__])
    inputs = common.read_inputs(Path(cell.inputs_dir))
    output_dir = Path(cell.output_dir)
    device, backend = common.device_and_backend()
    timeout = timedelta(seconds=cell.collective_timeout_s)
    dist.init_process_group(backend, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    try:
        mesh = parallelize.build_role_mesh(
            actor_tp=cell.actor_tp, critic_tp=cell.critic_tp, dp=dp, rank=rank,
            device_type=device.type, timeout_s=cell.collective_timeout_s)
        dist.barrier(group=mesh.group)  # the DP group is up before anything is loaded
        print(f"[fsdp2] rank {rank}/{world}: {mesh.role} dp_rank {mesh.dp_rank}/{mesh.dp} "
              f"tp_rank {mesh.tp_rank}/{mesh.tp} ranks {list(mesh.ranks)} on {device} "
              f"({backend}), {cell.precision}", flush=True)
        torch.manual_seed(cell.seed)
        init_s = time.perf_counter() - t0
        rec = sdk.Recorder(role=mesh.role, writer=mesh.dp_rank == 0 and mesh.tp_rank == 0,
                           sampling=sdk.ParamSampling.from_dict(cell.param_sampling.to_dict()))
        runner = RoleRun(cell=cell, rank=rank, mesh=mesh, inputs=inputs, device=device,
                         rec=rec)
        with rec.timed("total_s"):
            meta = runner.run()
        print(f"[fsdp2] rank {rank}: {mesh.role} done, timings {rec.timings}", flush=True)
        if rec.writer:  # a resumed launch reports only the rounds it ran
            sdk.write_part(ENGINE, output_dir, mesh.role,
                           rs.ResumePlan.of(cell).keep(rec.tensors), meta)
        if rank == 0:
            head = sdk.outputs_head(
                engine=ENGINE, cell=cell.to_dict(), packages=PACKAGES, world=world,
                backend=backend, device=device,
                timings={"init_s": round(init_s, 4),
                         "rank0_total_s": round(time.perf_counter() - t0, 4)},
                shims=[], faults=cell.faults)
            head["ranks"] = rank_table(cell.actor_tp, cell.critic_tp, dp)
            sdk.merge_parts(ENGINE, common.roles(cell.actor_tp, cell.critic_tp),
                               output_dir, head)
    finally:
        dist.destroy_process_group()


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m harnesses.fsdp2.harness CELL_JSON``.

    Returns:
        0 on success, 2 on a usage error (exceptions propagate so torchrun records them).
    """
    return common.harness_main(argv, engine=ENGINE, module="harnesses.fsdp2.harness", run=run)


if __name__ == "__main__":
    common.exit_now(main())
