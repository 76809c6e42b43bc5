"""fsdp2 harness: ``python -m harnesses.fsdp2.harness CELL_JSON`` under torchrun.

Runs the PPO update of :mod:`qualify.protocol` with PyTorch FSDP2: Hugging Face models
with ``fully_shard`` on each decoder layer and the root (:mod:`harnesses.fsdp2.parallelize`),
losses from :mod:`harnesses.fsdp2.losses`, ``torch.nn.utils.clip_grad_norm_`` over the
sharded DTensor gradients and ``torch.optim.AdamW(foreach=False, fused=False)`` on the FP32
sharded DTensor parameters (the master weights).

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
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.elastic.multiprocessing.errors import record

from harnesses import common, hf_schedule
from harnesses import resume_state as rs
from harnesses.common import Batch, Inputs
from harnesses.fsdp2 import faults, losses, parallelize, resume, tensor_parallel
from harnesses.fsdp2 import state_dict_adapter as sda
from qualify.errors import HarnessError
from qualify.protocol import ACTOR_ROUND1_WEIGHTS, EXTRA_RIGHT_PADDING, HarnessCell

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


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass(kw_only=True)
class RoleRun(common.RoleOutputs):
    """State of one role on one rank, and what it reports.

    Attributes:
        cell: the cell.
        rank: global rank.
        mesh: the role's DP group and mesh.
        inputs: the harness inputs.
        device: compute device.
        faults: active faults.
        tensors, timings: what it reports (:class:`harnesses.common.RoleOutputs`).
    """

    cell: HarnessCell
    rank: int
    mesh: parallelize.RoleMesh
    inputs: Inputs
    device: torch.device
    faults: faults.Faults
    compute_dtypes: set[torch.dtype] = dataclasses.field(default_factory=set)
    master_dtypes: set[torch.dtype] = dataclasses.field(default_factory=set)
    grad_dtypes: set[torch.dtype] = dataclasses.field(default_factory=set)
    state_dtypes: dict[str, set[torch.dtype]] = dataclasses.field(
        default_factory=lambda: {"exp_avg": set(), "exp_avg_sq": set()})
    reduce_dtypes: dict[str, set[torch.dtype]] = dataclasses.field(default_factory=dict)
    accum_dtypes: dict[str, set[torch.dtype]] = dataclasses.field(default_factory=dict)
    replica_rounds: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    lr_scheduler: Any = None
    lrs: dict[str, float] = dataclasses.field(default_factory=dict)
    replica_params: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    reduction: dict[str, Any] = dataclasses.field(default_factory=dict)
    tp_info: tensor_parallel.TpInfo | None = None
    resume_meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def role(self) -> str:
        """``actor`` or ``critic``."""
        return self.mesh.role

    @property
    def writer(self) -> bool:
        """DP rank 0, TP rank 0 keeps and writes the role's tensors."""
        return self.mesh.dp_rank == 0 and self.mesh.tp_rank == 0

    # ----------------------------------------------------------------- setup

    def load(self, kind: str, path: Path) -> tuple[nn.Module, parallelize.ShardingInfo]:
        """Load an HF model in FP32; TP over ``tp`` (TP > 1), then ``fully_shard`` over ``dp``."""
        model = common.load_hf_model(kind, path, self.device)
        if self.mesh.tp_mesh is not None:  # torchtitan's order: TP first, then FSDP
            self.tp_info = tensor_parallel.apply_tp(model, self.mesh.tp_mesh)
        info = parallelize.shard_model(model, self.mesh.dp_mesh,
                                       parallelize.mp_policy(self.cell.precision))
        # FAULT(grad_averaged_twice): FSDP2's default divide-by-dp left in place.
        self.reduction = parallelize.set_sum_reduction(
            model, divide_factor=faults.divide_factor("grad_averaged_twice" in self.faults))
        return model, info

    def local_batch(self) -> tuple[Batch, slice, float]:
        """This DP rank's rows of the frozen batch, their slice, and the global ``N``."""
        batch = self.inputs.batch.to(self.device)
        rows = parallelize.dp_rows(batch.input_ids.shape[0], self.mesh.dp, self.mesh.dp_rank,
                                   self.inputs.contract.algorithm.micro_batch_size)
        return batch.rows(rows), rows, float(batch.mask.sum())

    def gather_rows(self, local: Tensor) -> Tensor:
        """All-gather ``[b_local, R]`` FP32 rows from the DP group: ``[B, R]`` in row order."""
        if self.mesh.dp == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.mesh.dp)]
        dist.all_gather(parts, local.contiguous(), group=self.mesh.dp_group)
        return torch.cat(parts, dim=0)

    def sum_over_dp(self, values: dict[str, float]) -> dict[str, float]:
        """All-reduce (sum) per-rank loss shares over the DP group (FP64)."""
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        if self.mesh.dp > 1:  # TP ranks of a DP rank hold the same (replicated) shares
            dist.all_reduce(t, group=self.mesh.dp_group)
        return {k: float(v) for k, v in zip(keys, t.tolist(), strict=True)}

    # ----------------------------------------------------------------- update step

    def optimizer_for(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        """``torch.optim.AdamW`` on the sharded parameters (single-tensor path), lr scheduler.

        The contract's lr schedule (:func:`harnesses.hf_schedule.hf_scheduler`), kept as
        :attr:`lr_scheduler` and stepped after each optimizer step.
        """
        o = self.inputs.contract.optimizer
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      lr=lr, betas=o.betas, eps=o.eps,
                                      weight_decay=o.weight_decay, foreach=False, fused=False)
        # The engine's own scheduler (harnesses.hf_schedule: transformers.get_scheduler).
        self.lr_scheduler = hf_schedule.hf_scheduler(optimizer, o)
        return optimizer

    def step(self, round_: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Record pre-clip gradients, clip, step AdamW, record state, updates, replicas."""
        params = [p for p in model.parameters() if p.requires_grad]
        max_norm = self.inputs.contract.optimizer.max_grad_norm
        self.grad_dtypes |= {p.grad.dtype for p in params if p.grad is not None}
        self.master_dtypes |= {p.dtype for p in params}
        for into, got in zip((self.reduce_dtypes, self.accum_dtypes),
                             parallelize.reduction_dtypes(model), strict=True):
            for name, dtypes in got.items():
                into.setdefault(name, set()).update(dtypes)
        for name, g in sda.full_grads(model).items():
            self.put(round_, "grads", g, name)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norm_local = sda.full_fp32(norm).reshape(())
        self.put(round_, "grad_norm", norm_local)
        self.put(round_, "clip_coef", torch.clamp(max_norm / (norm_local + 1e-6), max=1.0))
        before = sda.full_params(model)
        self.lrs[f"round{round_}"] = hf_schedule.applied_lr(optimizer)
        optimizer.step()
        self.lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        for key in ("exp_avg", "exp_avg_sq"):
            self.state_dtypes[key] |= sda.state_dtypes(optimizer, key)
            for name, t in sda.full_optimizer_state(model, optimizer, key).items():
                self.put(round_, key, t, name)
        for name, after in sda.full_params(model).items():
            self.put(round_, "updates", after - before[name], name)
        self.check_replicas(round_, model)

    def check_replicas(self, round_: int, model: nn.Module) -> None:
        """Compare replicated parameters bitwise: along ``tp`` at TP > 1, else over ``dp``.

        At TP > 1 the local ``dp`` shards of each parameter replicated along ``tp`` are
        all-gathered over the TP group; at TP 1 the fully ``Replicate`` parameters (none
        under FSDP2) over the DP group.
        """
        if self.mesh.tp > 1:
            reps = parallelize.tp_replicated_parameters(model)
            group, size = self.mesh.tp_group, self.mesh.tp
        else:
            reps = parallelize.replicated_parameters(model)
            group, size = self.mesh.dp_group, self.mesh.dp
        worst = 0.0
        for name, p in reps:
            local = p.to_local().detach().float().reshape(-1).cpu()
            parts = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(parts, local, group=group)
            diff = max(float((x - parts[0]).abs().max()) if x.numel() else 0.0 for x in parts)
            equal = all(torch.equal(x.view(torch.int32), parts[0].view(torch.int32))
                        for x in parts)
            entry = self.replica_params.setdefault(name, {"equal": True, "max_abs_diff": 0.0})
            entry["equal"] = bool(entry["equal"] and equal)
            entry["max_abs_diff"] = max(float(entry["max_abs_diff"]), diff)
            worst = max(worst, diff)
        self.replica_rounds.append({
            "round": round_, "max_abs_diff": worst,
            "all_equal": all(self.replica_params[n]["equal"] for n, _ in reps)})

    # ----------------------------------------------------------------- actor

    def actor_scores(self, model: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
        """Log-probs and entropy ``[b, R]`` FP32 of ``batch.responses`` under ``model``.

        The root module's forward runs (FSDP2's hooks unshard the root's parameters there),
        with ``logits_to_keep`` = the response window ``P - 1 + t``.
        """
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False,
                    logits_to_keep=batch.window())
        logits: Tensor = out.logits  # [b, R, V] in the policy's param dtype
        self.compute_dtypes.add(logits.dtype)
        return losses.token_logprobs_and_entropy(logits, batch.responses,
                                                 self.inputs.contract.sampling.temperature)

    def run_actor(self) -> dict[str, Any]:
        """Round 1..rounds of the Actor update; returns the role's ``outputs.json`` part."""
        c = self.inputs.contract
        alg = c.algorithm
        with self.timed("load_s"):
            model, info = self.load("causal_lm", self.inputs.actor_dir)
            ref, _ = self.load("causal_lm", self.inputs.ref_dir)
            ref.requires_grad_(False)
        optimizer = self.optimizer_for(model, c.optimizer.actor_lr)
        batch, rows, n_valid = self.local_batch()
        slices = common.micro_slices(batch.input_ids.shape[0], alg.micro_batch_size)
        b, r_len = batch.responses.shape
        pad_id = common.pad_token_id(model)
        with self.timed("scoring_s"), torch.no_grad():
            ref_lp = torch.zeros(b, r_len, device=self.device)
            padded = torch.zeros(b, r_len, device=self.device)
            for s in slices:
                ref_lp[s] = self.actor_scores(ref, batch.rows(s))[0]
                padded[s] = self.actor_scores(
                    model, batch.rows(s).right_padded(EXTRA_RIGHT_PADDING, pad_id))[0]
            parallelize.reshard(ref)
            parallelize.reshard(model)
            self.put(1, "logprobs_padded",
                     self.gather_rows(torch.where(batch.mask, padded, 0.0)))
        old_lp = torch.zeros(b, r_len, device=self.device)
        # loss_agg_mode over the whole batch (global denominators), this rank's rows.
        full_w, denom = losses.aggregation_terms(self.inputs.batch.mask, alg.loss_agg_mode)
        row_w = full_w.to(self.device)[rows]
        decoupled = alg.name == "decoupled_ppo"
        w_behav = torch.ones(b, r_len, device=self.device)
        w_raw = torch.ones(b, r_len, device=self.device)
        plan = rs.ResumePlan.of(self.cell)
        if plan.loading:  # a resume cell's second launch: restore, then round k + 1
            got = self.resume_load(plan, model, optimizer, rows)
            old_lp, w_behav, w_raw = got["old_logprobs"], got["w_behav"], got["w_raw"]
        for round_ in plan.rounds(alg.rounds):
            with self.timed(f"round{round_}_s"):
                lp_r = torch.zeros(b, r_len, device=self.device)
                ent_r = torch.zeros(b, r_len, device=self.device)
                shares = {"policy": 0.0, "kl": 0.0, "entropy": 0.0}
                for s in slices:
                    mb = batch.rows(s)
                    lp, ent = self.actor_scores(model, mb)
                    old = lp.detach() if round_ == 1 else old_lp[s]
                    if decoupled and round_ == 1:  # proximal policy: this engine's round 1
                        assert mb.behavior_logprobs is not None
                        w_behav[s], w_raw[s] = losses.behavior_weight(
                            lp, mb.behavior_logprobs, alg.behavior_weight_cap,
                            alg.behavior_weight_cap_mode)
                    rw = row_w[s][:, None]
                    weight = rw * w_behav[s] if decoupled else \
                        (None if alg.loss_agg_mode == "token-mean" else rw)
                    policy = losses.policy_loss_sum(lp, old, mb.advantages, mb.mask,
                                                    alg.clip_ratio, weight=weight) / denom
                    kl = alg.kl_loss_coef * losses.masked_sum(
                        losses.kl_penalty(lp, ref_lp[s], alg.kl_loss_estimator) * rw,
                        mb.mask) / denom
                    entropy = -alg.entropy_coef * losses.masked_sum(ent * rw, mb.mask) / denom
                    (policy + kl + entropy).backward()
                    shares["policy"] += float(policy.detach())
                    shares["kl"] += float(kl.detach())
                    shares["entropy"] += float(entropy.detach())
                    lp_r[s] = torch.where(mb.mask, lp.detach(), 0.0)
                    ent_r[s] = torch.where(mb.mask, ent.detach(), 0.0)
                if round_ == 1:
                    old_lp = lp_r.clone()
                self.put(round_, "logprobs", self.gather_rows(lp_r))
                self.put(round_, "entropy", self.gather_rows(ent_r))
                sums = self.sum_over_dp(shares)
                for term in ("policy", "kl", "entropy"):
                    self.put(round_, f"loss/{term}", torch.tensor(sums[term]))
                self.put(round_, "loss/total", torch.tensor(sum(sums.values())))
                self.step(round_, model, optimizer)
                if plan.saves_after(round_):
                    self.resume_save(plan, model, optimizer, {
                        "old_logprobs": old_lp, "w_behav": w_behav, "w_raw": w_raw})
                if round_ == 1 and self.cell.export_weights:
                    self.export_weights(model, Path(self.cell.output_dir) / ACTOR_ROUND1_WEIGHTS)
        meta = self.role_meta(model, info, n_valid, len(slices), rows)
        meta["loss_agg_mode"] = alg.loss_agg_mode
        meta.update(self.resume_meta)
        if decoupled:  # fixed by round 1 (the proximal policy); statistics over all DP rows
            stats = losses.weight_stats(self.gather_rows(w_raw).cpu(), self.inputs.batch.mask,
                                        alg.behavior_weight_cap)
            meta["behavior_weight"] = {f"round{r}": stats for r in range(1, alg.rounds + 1)}
        return meta

    def export_weights(self, model: nn.Module, path: Path) -> None:
        """Write the full HF-layout FP32 weights (``safetensors``) for a sampler cell.

        Collective over the role's DP group (``full_tensor()`` of every sharded parameter,
        HF names, no permutation); DP rank 0 writes ``path`` atomically.
        """
        with self.timed("export_weights_s"):
            full = sda.full_params(model)
            if self.writer:
                path.parent.mkdir(parents=True, exist_ok=True)
                common.atomic_tensors(path, full, {"format": "pt", "engine": ENGINE,
                                                   "what": "actor weights after round 1"})

    # ----------------------------------------------------------------- critic

    def critic_values(self, model: nn.Module, batch: Batch) -> Tensor:
        """Values ``V(s_t)`` ``[b, R]`` FP32 (the root forward, value head at ``P - 1 + t``)."""
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids, use_cache=False)
        v = out.logits[:, batch.window()]  # [b, R, 1]
        self.compute_dtypes.add(v.dtype)
        values: Tensor = v.float().squeeze(-1)
        return values

    def run_critic(self) -> dict[str, Any]:
        """Round 1..rounds of the Critic update; returns the role's ``outputs.json`` part."""
        c = self.inputs.contract
        alg = c.algorithm
        with self.timed("load_s"):
            model, info = self.load("value", self.inputs.critic_dir)
        optimizer = self.optimizer_for(model, c.optimizer.critic_lr)
        batch, rows, n_valid = self.local_batch()
        slices = common.micro_slices(batch.input_ids.shape[0], alg.micro_batch_size)
        b, r_len = batch.responses.shape
        pad_id = common.pad_token_id(model)
        with self.timed("scoring_s"), torch.no_grad():
            padded = torch.zeros(b, r_len, device=self.device)
            for s in slices:
                padded[s] = self.critic_values(
                    model, batch.rows(s).right_padded(EXTRA_RIGHT_PADDING, pad_id))
            parallelize.reshard(model)
            self.put(1, "values_padded", self.gather_rows(torch.where(batch.mask, padded, 0.0)))
        old_v = torch.zeros(b, r_len, device=self.device)
        full_w, denom = losses.aggregation_terms(self.inputs.batch.mask, alg.loss_agg_mode)
        row_w = full_w.to(self.device)[rows]
        plan = rs.ResumePlan.of(self.cell)
        if plan.loading:
            old_v = self.resume_load(plan, model, optimizer, rows)["old_values"]
        for round_ in plan.rounds(alg.rounds):
            with self.timed(f"round{round_}_s"):
                v_r = torch.zeros(b, r_len, device=self.device)
                share = 0.0
                for s in slices:
                    mb = batch.rows(s)
                    values = self.critic_values(model, mb)
                    old = values.detach() if round_ == 1 else old_v[s]
                    vw = None if alg.loss_agg_mode == "token-mean" else row_w[s][:, None]
                    loss = losses.value_loss_sum(values, old, mb.returns, mb.mask,
                                                 alg.value_clip, weight=vw) / denom
                    loss.backward()
                    share += float(loss.detach())
                    v_r[s] = torch.where(mb.mask, values.detach(), 0.0)
                if round_ == 1:
                    old_v = v_r.clone()
                self.put(round_, "values", self.gather_rows(v_r))
                total = self.sum_over_dp({"value": share})["value"]
                self.put(round_, "loss/value", torch.tensor(total))
                self.put(round_, "loss/total", torch.tensor(total))
                self.step(round_, model, optimizer)
                if plan.saves_after(round_):
                    self.resume_save(plan, model, optimizer, {"old_values": old_v})
        return {**self.role_meta(model, info, n_valid, len(slices), rows), **self.resume_meta}

    # ----------------------------------------------------------------- resume

    def resume_save(self, plan: rs.ResumePlan, model: nn.Module,
                    optimizer: torch.optim.Optimizer, rollout_state: dict[str, Tensor]) -> None:
        """Checkpoint after round ``plan.after_round`` (:mod:`harnesses.fsdp2.resume`).

        Args:
            plan: the save plan.
            model: the role's sharded model (resharded: between steps).
            optimizer: its AdamW.
            rollout_state: this DP rank's rows ``[b, R]`` FP32 of the tensors later rounds
                read; all-gathered over ``dp`` to ``[B, R]`` here (collective).
        """
        with self.timed("checkpoint_save_s"):
            whole = {k: self.gather_rows(v) for k, v in rollout_state.items()}
            resume.save(plan, role=self.role, writer=self.writer, group=self.mesh.group,
                        model=model, optimizer=optimizer, scheduler=self.lr_scheduler,
                        rollout_state=whole)

    def resume_load(self, plan: rs.ResumePlan, model: nn.Module,
                    optimizer: torch.optim.Optimizer, rows: slice) -> dict[str, Tensor]:
        """Restore the checkpoint (fresh process); its record goes to the role meta.

        Returns:
            The saved rollout state, this DP rank's ``rows`` of each ``[B, R]`` tensor, on
            the run's device.
        """
        with self.timed("checkpoint_load_s"):
            state, self.resume_meta["resume"] = resume.load(
                plan, role=self.role, group=self.mesh.group, model=model, optimizer=optimizer,
                scheduler=self.lr_scheduler, active=self.faults)
        return {k: v[rows].to(self.device) for k, v in state.items()}

    # ----------------------------------------------------------------- meta

    def role_meta(self, model: nn.Module, info: parallelize.ShardingInfo, n_valid: float,
                  n_micro: int, rows: slice) -> dict[str, Any]:
        """The role's part of ``outputs.json`` (merged under ``roles.<role>``)."""
        per = rows.stop - rows.start
        return {
            "tp": self.mesh.tp,
            "global_ranks": list(self.mesh.ranks),
            "model_class": type(model).__name__,
            "parallelism": {
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
                "dp_rows": {"rows_per_rank": per, "valid_tokens_global": int(n_valid),
                            "row_range_by_dp_rank": [[d * per, (d + 1) * per]
                                                     for d in range(self.mesh.dp)]},
                "local_shard_shapes_dp_rank0": sda.local_shapes(model) if self.writer else {},
                "replica_check": (REPLICA_CHECK_TP if self.mesh.tp > 1 else
                                  REPLICA_CHECK if not info.replicated else "bitwise"),
            },
            "precision": self.cell.precision,
            "bf16_mechanism": BF16_MECHANISM if self.cell.precision == "bf16" else None,
            "dtypes": {
                "master_weights": sda.dtype_name(self.master_dtypes),
                "grads": sda.dtype_name(self.grad_dtypes),
                "optimizer_state": {k: sda.dtype_name(v) for k, v in self.state_dtypes.items()},
                "compute": sorted(str(d) for d in self.compute_dtypes),
                "grad_reduction": {k: sda.dtype_name(v) for k, v in self.reduce_dtypes.items()},
                "grad_accumulation": {k: sda.dtype_name(v)
                                      for k, v in self.accum_dtypes.items()},
            },
            "lr": dict(self.lrs),
            "lr_scheduler": hf_schedule.SCHEDULER_NOTE,
            "replica_consistency": {
                "all_equal": all(r["all_equal"] for r in self.replica_rounds),
                "rounds": self.replica_rounds,
                "params": self.replica_params,
            },
            "valid_tokens": int(n_valid),
            "micro_batches": n_micro,
            "dropout": "off (eval mode)",
            "role_timings": dict(self.timings),
        }


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
    active = faults.Faults(cell.faults)
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
        runner = RoleRun(cell=cell, rank=rank, mesh=mesh, inputs=inputs, device=device,
                         faults=active)
        with runner.timed("total_s"):
            meta = runner.run_actor() if mesh.role == "actor" else runner.run_critic()
        print(f"[fsdp2] rank {rank}: {mesh.role} done, timings {runner.timings}", flush=True)
        if runner.writer:  # a resumed launch reports only the rounds it ran
            common.write_part(ENGINE, output_dir, mesh.role,
                              rs.ResumePlan.of(cell).keep(runner.tensors), meta)
        if rank == 0:
            head = common.outputs_head(
                engine=ENGINE, cell=cell.to_dict(), packages=PACKAGES, world=world,
                backend=backend, device=device,
                timings={"init_s": round(init_s, 4),
                         "rank0_total_s": round(time.perf_counter() - t0, 4)},
                shims=[], faults=cell.faults)
            head["ranks"] = rank_table(cell.actor_tp, cell.critic_tp, dp)
            common.merge_parts(ENGINE, common.roles(cell.actor_tp, cell.critic_tp),
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
