"""torch_tp harness: ``python -m harnesses.torch_tp.harness CELL_JSON`` under torchrun.

Runs the PPO update of :mod:`qualify.protocol` with PyTorch-native tensor parallelism:
Hugging Face models sharded by :mod:`harnesses.torch_tp.parallelize`, losses from
:mod:`harnesses.torch_tp.losses`, ``torch.nn.utils.clip_grad_norm_`` over DTensor gradients
and ``torch.optim.AdamW(foreach=False, fused=False)`` on FP32 DTensor master weights.

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
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.elastic.multiprocessing.errors import record

from harnesses import common, hf_schedule, layer_probe
from harnesses import resume_state as rs
from harnesses.common import Batch, Inputs
from harnesses.torch_tp import faults, losses, parallelize, resume
from harnesses.torch_tp import state_dict_adapter as sda
from qualify.errors import HarnessError
from qualify.protocol import (
    ACTOR_ROUND1_WEIGHTS,
    EXTRA_RIGHT_PADDING,
    HarnessCell,
)

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


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass(kw_only=True)
class RoleRun(common.RoleOutputs):
    """State of one role on one rank, and what it reports.

    Attributes:
        cell: the cell.
        rank: global rank.
        mesh: the role's TP group and mesh.
        inputs: the harness inputs.
        device: compute device.
        faults: active faults.
        tensors, timings: what it reports (:class:`harnesses.common.RoleOutputs`).
        partial_grads: parameters whose gradients arrived ``Partial`` and were reduced.
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
    replica_rounds: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    lr_scheduler: Any = None
    lrs: dict[str, float] = dataclasses.field(default_factory=dict)
    replica_params: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    partial_grads: list[str] = dataclasses.field(default_factory=list)
    reduce_dtypes: dict[str, set[torch.dtype]] = dataclasses.field(default_factory=dict)
    accum_dtypes: dict[str, set[torch.dtype]] = dataclasses.field(default_factory=dict)
    resume_meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def role(self) -> str:
        """``actor`` or ``critic``."""
        return self.mesh.role

    @property
    def writer(self) -> bool:
        """TP rank 0 keeps and writes the role's tensors."""
        return self.mesh.tp_rank == 0

    def probe_for(self, model: nn.Module) -> layer_probe.LayerProbe:
        """The cell's layer probe over ``model`` (inactive without ``cell.probe``).

        Layout: every probed output is a local full tensor (``ReplicateParallel`` norms and
        embeddings, ``RowwiseParallel``'s all-reduced ``o_proj`` / ``down_proj``), except
        the vocab-parallel ``lm_head`` logits, a ``Shard(-1)`` DTensor (and its gradient),
        gathered with ``full_tensor()`` (collective over the role's TP group).
        """
        # FAULT(layer1_mlp_scaled): one decoder layer's MLP output scaled.
        if "layer1_mlp_scaled" in self.faults:
            faults.scale_layer_output(model)

        def to_full(_name: str, t: Tensor) -> Tensor:
            full = getattr(t, "full_tensor", None)
            return full() if callable(full) else t

        return layer_probe.LayerProbe(self.cell.probe, role=self.role, writer=self.writer,
                                      modules=layer_probe.hf_modules(model), to_full=to_full)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """BF16 autocast for ``bf16`` cells; nothing for ``fp32``."""
        if self.cell.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


    # ----------------------------------------------------------------- update step

    def optimizer_for(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        """``torch.optim.AdamW`` with the contract's settings (single-tensor path) and lr scheduler.

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
        for into, got in zip((self.reduce_dtypes, self.accum_dtypes),
                             parallelize.reduction_dtypes(model), strict=True):
            for name, dtypes in got.items():
                into.setdefault(name, set()).update(dtypes)
        self.partial_grads = parallelize.reduce_partial_grads(model)
        self.grad_dtypes |= {p.grad.dtype for p in params if p.grad is not None}
        self.master_dtypes |= {p.dtype for p in params}
        for name, g in sda.full_grads(model).items():
            self.put(round_, "grads", g, name)
        # FAULT(grad_norm_replicated_per_rank): replicated gradients counted per rank.
        if "grad_norm_replicated_per_rank" in self.faults:
            norm = faults.grad_norm_replicated_per_rank(params, max_norm, self.mesh.group)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norm_local = sda.full_fp32(norm).reshape(())
        self.put(round_, "grad_norm", norm_local)
        self.put(round_, "clip_coef", torch.clamp(max_norm / (norm_local + 1e-6), max=1.0))
        before = sda.full_params(model)
        # FAULT(lr_scheduler_stepped_first): scheduler.step() before optimizer.step().
        late = "lr_scheduler_stepped_first" in self.faults
        if late:
            self.lr_scheduler.step()
        self.lrs[f"round{round_}"] = hf_schedule.applied_lr(optimizer)
        # FAULT(bf16_optimizer_state): moments stored in BF16 between steps.
        with (faults.bf16_optimizer_state(optimizer) if "bf16_optimizer_state" in self.faults
              else contextlib.nullcontext()):
            optimizer.step()
        if not late:
            self.lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        for key in ("exp_avg", "exp_avg_sq"):
            self.state_dtypes[key] |= sda.state_dtypes(optimizer, key)
            for name, t in sda.full_optimizer_state(model, optimizer, key).items():
                self.put(round_, key, t, name)
        for name, after in sda.full_params(model).items():
            self.put(round_, "updates", after - before[name], name)
        check = parallelize.check_replicas(model, self.mesh)
        self.replica_rounds.append({"round": round_, "all_equal": check.all_equal,
                                    "max_abs_diff": max(check.max_abs_diff.values(), default=0.0)})
        for name, eq in check.equal.items():
            entry = self.replica_params.setdefault(name, {"equal": True, "max_abs_diff": 0.0})
            entry["equal"] = bool(entry["equal"] and eq)
            entry["max_abs_diff"] = max(float(entry["max_abs_diff"]), check.max_abs_diff[name])

    # ----------------------------------------------------------------- actor

    def temperature(self) -> float:
        """The contract's sampling temperature (logits divisor)."""
        # FAULT(no_temperature): logits not divided by the temperature.
        return faults.effective_temperature(self.inputs.contract.sampling.temperature,
                                            ignore="no_temperature" in self.faults)

    def actor_scores(self, model: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
        """Log-probs and entropy ``[b, R]`` FP32 of ``batch.responses`` under ``model``."""
        # FAULT(logprobs_shift_one): the response window read one position late.
        shift = faults.window_shift("logprobs_shift_one" in self.faults)
        with self.autocast():
            hidden = response_hidden(model, batch, shift)
            logits = model.get_submodule("lm_head")(hidden)  # [b, R, V], vocab-sharded
        self.compute_dtypes.add(logits.dtype)
        return losses.token_logprobs_and_entropy(logits, batch.responses, self.temperature())

    def run_actor(self) -> dict[str, Any]:
        """Round 1..rounds of the Actor update; returns the role's ``outputs.json`` part."""
        c = self.inputs.contract
        alg = c.algorithm
        with self.timed("load_s"):
            model = common.load_hf_model("causal_lm", self.inputs.actor_dir, self.device)
            ref = common.load_hf_model("causal_lm", self.inputs.ref_dir, self.device)
            ref.requires_grad_(False)
        with self.timed("parallelize_s"):
            info = parallelize.parallelize_model(model, self.mesh.mesh)
            parallelize.parallelize_model(ref, self.mesh.mesh)
        probe = self.probe_for(model)
        optimizer = self.optimizer_for(model, c.optimizer.actor_lr)
        batch = self.inputs.batch.to(self.device)
        n_valid = float(batch.mask.sum())
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
            self.put(1, "logprobs_padded", torch.where(batch.mask, padded, 0.0))
        old_lp = torch.zeros(b, r_len, device=self.device)
        # loss_agg_mode: per-row weight and global denominator; decoupled PPO's weight.
        row_w, denom = losses.aggregation_terms(batch.mask, alg.loss_agg_mode)
        decoupled = alg.name == "decoupled_ppo"
        w_behav = torch.ones(b, r_len, device=self.device)
        w_raw = torch.ones(b, r_len, device=self.device)
        plan = rs.ResumePlan.of(self.cell)
        if plan.loading:  # a resume cell's second launch: restore, then round k + 1
            got = self.resume_load(plan, model, optimizer)
            old_lp, w_behav, w_raw = got["old_logprobs"], got["w_behav"], got["w_raw"]
        for round_ in plan.rounds(alg.rounds):
            with self.timed(f"round{round_}_s"):
                lp_r = torch.zeros(b, r_len, device=self.device)
                ent_r = torch.zeros(b, r_len, device=self.device)
                sums = {"policy": 0.0, "kl": 0.0, "entropy": 0.0}
                for s in slices:
                    mb = batch.rows(s)
                    with probe.capture(round_, prompt_len=mb.prompt_len,
                                       seq_len=mb.input_ids.shape[1]):
                        lp, ent = self.actor_scores(model, mb)
                        old = lp.detach() if round_ == 1 else old_lp[s]
                        if decoupled and round_ == 1:  # proximal = this engine's round 1
                            assert mb.behavior_logprobs is not None
                            w_behav[s], w_raw[s] = losses.behavior_weight(
                                lp, mb.behavior_logprobs, alg.behavior_weight_cap,
                                alg.behavior_weight_cap_mode)
                        rw = row_w[s, None]
                        weight = rw * w_behav[s] if decoupled else \
                            (None if alg.loss_agg_mode == "token-mean" else rw)
                        policy = losses.policy_loss_sum(lp, old, mb.advantages, mb.mask,
                                                        alg.clip_ratio, weight=weight) / denom
                        kl = alg.kl_loss_coef * losses.masked_sum(
                            losses.kl_penalty(lp, ref_lp[s], alg.kl_loss_estimator) * rw,
                            mb.mask) / denom
                        entropy = -alg.entropy_coef * losses.masked_sum(ent * rw, mb.mask) / denom
                        # FAULT(kl_loss_sign_flipped) and FAULT(entropy_bonus_dropped).
                        kl_term = -kl if "kl_loss_sign_flipped" in self.faults else kl
                        ent_term = 0.0 * entropy if "entropy_bonus_dropped" in self.faults \
                            else entropy
                        (policy + kl_term + ent_term).backward()
                    sums["policy"] += float(policy.detach())
                    sums["kl"] += float(kl.detach())
                    sums["entropy"] += float(entropy.detach())
                    lp_r[s] = torch.where(mb.mask, lp.detach(), 0.0)
                    ent_r[s] = torch.where(mb.mask, ent.detach(), 0.0)
                if round_ == 1:
                    old_lp = lp_r.clone()
                self.put(round_, "logprobs", lp_r)
                self.put(round_, "entropy", ent_r)
                for term, v in sums.items():
                    self.put(round_, f"loss/{term}", torch.tensor(v))
                self.put(round_, "loss/total", torch.tensor(sum(sums.values())))
                self.step(round_, model, optimizer)
                if plan.saves_after(round_):
                    self.resume_save(plan, model, optimizer, {
                        "old_logprobs": old_lp, "w_behav": w_behav, "w_raw": w_raw})
                if round_ == 1 and self.cell.export_weights:
                    self.export_weights(model, Path(self.cell.output_dir) / ACTOR_ROUND1_WEIGHTS)
        probe.save(ENGINE)
        meta = self.role_meta(model, info, n_valid, len(slices))
        meta["loss_agg_mode"] = alg.loss_agg_mode
        meta.update(self.resume_meta)
        if decoupled:  # fixed by round 1 (the proximal policy), used in every round
            stats = losses.weight_stats(w_raw, batch.mask, alg.behavior_weight_cap)
            meta["behavior_weight"] = {f"round{r}": stats for r in range(1, alg.rounds + 1)}
        return meta

    def export_weights(self, model: nn.Module, path: Path) -> None:
        """Write the full HF-layout FP32 weights (``safetensors``) for the sampler cell.

        Collective over the role's TP group: every parameter is gathered with
        ``DTensor.full_tensor()`` (:func:`state_dict_adapter.full_params`, HF names, no
        permutation: a column-parallel ``Shard(0)`` concatenates in HF row order); TP rank 0
        writes ``path`` atomically (temp file + rename). A tied LM head is the embedding
        (``named_parameters`` lists it once), as in the HF checkpoint.
        """
        with self.timed("export_weights_s"):
            full = sda.full_params(model)
            if self.writer:
                path.parent.mkdir(parents=True, exist_ok=True)
                common.atomic_tensors(path, full, {"format": "pt", "engine": ENGINE,
                                                   "what": "actor weights after round 1"})

    # ----------------------------------------------------------------- critic

    def critic_values(self, model: nn.Module, batch: Batch) -> Tensor:
        """Values ``V(s_t)`` ``[b, R]`` FP32 (value head on the response window)."""
        with self.autocast():
            v = model.get_submodule("score")(response_hidden(model, batch))  # [b, R, 1]
        self.compute_dtypes.add(v.dtype)
        values: Tensor = v.float().squeeze(-1)
        return values

    def run_critic(self) -> dict[str, Any]:
        """Round 1..rounds of the Critic update; returns the role's ``outputs.json`` part."""
        c = self.inputs.contract
        alg = c.algorithm
        with self.timed("load_s"):
            model = common.load_hf_model("value", self.inputs.critic_dir, self.device)
        with self.timed("parallelize_s"):
            info = parallelize.parallelize_model(model, self.mesh.mesh)
        probe = self.probe_for(model)
        optimizer = self.optimizer_for(model, c.optimizer.critic_lr)
        batch = self.inputs.batch.to(self.device)
        n_valid = float(batch.mask.sum())
        slices = common.micro_slices(batch.input_ids.shape[0], alg.micro_batch_size)
        b, r_len = batch.responses.shape
        pad_id = common.pad_token_id(model)
        with self.timed("scoring_s"), torch.no_grad():
            padded = torch.zeros(b, r_len, device=self.device)
            for s in slices:
                padded[s] = self.critic_values(
                    model, batch.rows(s).right_padded(EXTRA_RIGHT_PADDING, pad_id))
            self.put(1, "values_padded", torch.where(batch.mask, padded, 0.0))
        old_v = torch.zeros(b, r_len, device=self.device)
        row_w, denom = losses.aggregation_terms(batch.mask, alg.loss_agg_mode)
        plan = rs.ResumePlan.of(self.cell)
        if plan.loading:
            old_v = self.resume_load(plan, model, optimizer)["old_values"]
        for round_ in plan.rounds(alg.rounds):
            with self.timed(f"round{round_}_s"):
                v_r = torch.zeros(b, r_len, device=self.device)
                total = 0.0
                for s in slices:
                    mb = batch.rows(s)
                    with probe.capture(round_, prompt_len=mb.prompt_len,
                                       seq_len=mb.input_ids.shape[1]):
                        values = self.critic_values(model, mb)
                        old = values.detach() if round_ == 1 else old_v[s]
                        # FAULT(value_loss_unclipped): the clipped branch forgotten.
                        if "value_loss_unclipped" in self.faults:
                            vsum = faults.unclipped_value_loss_sum(values, mb.returns, mb.mask)
                        else:
                            vw = None if alg.loss_agg_mode == "token-mean" else row_w[s, None]
                            vsum = losses.value_loss_sum(values, old, mb.returns, mb.mask,
                                                         alg.value_clip, weight=vw)
                        loss = vsum / denom
                        loss.backward()
                    total += float(loss.detach())
                    v_r[s] = torch.where(mb.mask, values.detach(), 0.0)
                if round_ == 1:
                    old_v = v_r.clone()
                self.put(round_, "values", v_r)
                self.put(round_, "loss/value", torch.tensor(total))
                self.put(round_, "loss/total", torch.tensor(total))
                self.step(round_, model, optimizer)
                if plan.saves_after(round_):
                    self.resume_save(plan, model, optimizer, {"old_values": old_v})
        probe.save(ENGINE)
        return {**self.role_meta(model, info, n_valid, len(slices)), **self.resume_meta}

    # ----------------------------------------------------------------- resume

    def resume_save(self, plan: rs.ResumePlan, model: nn.Module,
                    optimizer: torch.optim.Optimizer, rollout_state: dict[str, Tensor]) -> None:
        """Checkpoint after round ``plan.after_round`` (:mod:`harnesses.torch_tp.resume`)."""
        with self.timed("checkpoint_save_s"):
            resume.save(plan, role=self.role, writer=self.writer, group=self.mesh.group,
                        model=model, optimizer=optimizer, scheduler=self.lr_scheduler,
                        rollout_state=rollout_state)

    def resume_load(self, plan: rs.ResumePlan, model: nn.Module,
                    optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
        """Restore the checkpoint (fresh process); returns the saved rollout state."""
        with self.timed("checkpoint_load_s"):
            state, self.resume_meta["resume"] = resume.load(
                plan, role=self.role, group=self.mesh.group, model=model, optimizer=optimizer,
                scheduler=self.lr_scheduler, active=self.faults)
        return {k: v.to(self.device) for k, v in state.items()}

    # ----------------------------------------------------------------- meta

    def role_meta(self, model: nn.Module, info: parallelize.ShardingInfo, n_valid: float,
                  n_micro: int) -> dict[str, Any]:
        """The role's part of ``outputs.json`` (merged under ``roles.<role>``)."""
        return {
            "tp": self.mesh.tp,
            "global_ranks": list(self.mesh.ranks),
            "model_class": type(model).__name__,
            "parallelism": {
                "mesh_dim_names": ["tp"],
                "lm_head": info.lm_head,
                "sharded_params": list(info.sharded),
                "replicated_params": list(info.replicated),
                "partial_grads_reduced": self.partial_grads,
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
    active = faults.Faults(cell.faults)
    inputs = common.read_inputs(Path(cell.inputs_dir))
    device, backend, device_id = common.launch_device(cell)
    timeout = timedelta(seconds=cell.collective_timeout_s)
    dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    try:
        for (actor_tp, critic_tp), variants in topologies:
            mesh = parallelize.build_role_mesh(
                actor_tp=actor_tp, critic_tp=critic_tp, rank=rank,
                device_type=device.type, timeout_s=cell.collective_timeout_s)
            # FAULT(hang_rank1): global rank 1 skips this collective and stalls.
            if "hang_rank1" in active:
                faults.skip_collective_and_stall(rank)
            dist.barrier(group=mesh.group)  # the TP group is up before anything is loaded
            init_s = init_s or time.perf_counter() - t0  # start-up: to the first groups
            for vcell in variants:
                _run_variant(vcell, rank=rank, world=world, mesh=mesh, inputs=inputs,
                             device=device, backend=backend, active=active,
                             t0=t0, init_s=init_s)
    finally:
        dist.destroy_process_group()


def _run_variant(vcell: HarnessCell, *, rank: int, world: int, mesh: parallelize.RoleMesh,
                 inputs: Inputs, device: torch.device, backend: str, active: faults.Faults,
                 t0: float, init_s: float) -> None:
    """Run one single-variant cell on this rank and write its outputs (rank 0 merges)."""
    tv = time.perf_counter()
    print(f"[torch_tp] rank {rank}/{world}: {mesh.role} tp_rank {mesh.tp_rank}/"
          f"{mesh.tp} ranks {list(mesh.ranks)} on {device} ({backend}), "
          f"{vcell.precision}", flush=True)
    torch.manual_seed(vcell.seed)
    runner = RoleRun(cell=vcell, rank=rank, mesh=mesh, inputs=inputs, device=device,
                     faults=active)
    with runner.timed("total_s"):
        meta = runner.run_actor() if mesh.role == "actor" else runner.run_critic()
    print(f"[torch_tp] rank {rank}: {mesh.role} {vcell.precision} done, timings "
          f"{runner.timings}", flush=True)
    output_dir = Path(vcell.output_dir)
    if runner.writer:  # a resumed launch reports only the rounds it ran
        common.write_part(ENGINE, output_dir, mesh.role,
                          rs.ResumePlan.of(vcell).keep(runner.tensors), meta)
    if rank == 0:
        head = common.outputs_head(
            engine=ENGINE, cell=vcell.to_dict(), packages=PACKAGES, world=world,
            backend=backend, device=device,
            timings={"init_s": round(init_s, 4),
                     "variant_s": round(time.perf_counter() - tv, 4),
                     "rank0_total_s": round(time.perf_counter() - t0, 4)},
            shims=[], faults=vcell.faults)
        common.merge_parts(ENGINE, common.roles(vcell.actor_tp, vcell.critic_tp),
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
