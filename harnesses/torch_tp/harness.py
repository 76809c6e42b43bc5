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
import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.elastic.multiprocessing.errors import record
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
from transformers.utils import logging as hf_logging

from harnesses.torch_tp import faults, losses, parallelize
from harnesses.torch_tp import state_dict_adapter as sda
from qualify.contract import Contract
from qualify.errors import HarnessError
from qualify.protocol import (
    ACTOR_ROUND1_WEIGHTS,
    CELL_FILE,
    EXTRA_RIGHT_PADDING,
    OUTPUTS_FILE,
    OUTPUTS_META_FILE,
    ROLLOUT_FILE,
    ROLLOUT_KEYS,
    TRAIN_INPUT_KEYS,
    TRAIN_INPUTS_FILE,
    HarnessCell,
    param_sample_indices,
    tensor_name,
)

ENGINE: Final = "torch_tp"
CONTRACT_JSON: Final = "contract.json"
MODEL_JSON: Final = "model.json"
BF16_MECHANISM: Final = ("torch.autocast(device_type, dtype=torch.bfloat16) over FP32 DTensor "
                         "parameters; losses in FP32")
PART_WAIT_S: Final = 24 * 3600.0
"""Upper bound of rank 0's wait for the other role's part (torchrun ends the job first
when a rank fails; the launcher's wall-clock timeout ends a stuck one)."""


# --------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """Rollout rows as the engine consumes them (``b`` rows, ``T = P + R`` columns).

    Attributes:
        input_ids: ``[b, T]`` int64, prompt (left-padded) then response (right-padded).
        attention_mask: ``[b, T]`` int64.
        position_ids: ``[b, T]`` int64.
        responses: ``[b, R]`` int64 target tokens.
        mask: ``[b, R]`` bool, response tokens that count in losses.
        advantages: ``[b, R]`` FP32.
        returns: ``[b, R]`` FP32.
        prompt_len: ``P``.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    responses: Tensor
    mask: Tensor
    advantages: Tensor
    returns: Tensor
    prompt_len: int

    @property
    def response_len(self) -> int:
        """``R``."""
        return int(self.responses.shape[1])

    def rows(self, s: slice) -> Batch:
        """The sub-batch of rows ``s``."""
        return dataclasses.replace(
            self, input_ids=self.input_ids[s], attention_mask=self.attention_mask[s],
            position_ids=self.position_ids[s], responses=self.responses[s], mask=self.mask[s],
            advantages=self.advantages[s], returns=self.returns[s])

    def right_padded(self, extra: int, pad_token_id: int) -> Batch:
        """``extra`` more pad columns on the right (attention 0), for padding invariance.

        The response window (``responses``, ``mask``...) is unchanged: only the sequence
        the model sees grows. Positions follow ``clamp(cumsum(mask) - 1, min=0)``.
        """
        b = self.input_ids.shape[0]
        ids = torch.cat([self.input_ids, self.input_ids.new_full((b, extra), pad_token_id)], 1)
        am = torch.cat([self.attention_mask, self.attention_mask.new_zeros((b, extra))], 1)
        pos = torch.clamp(torch.cumsum(am, dim=1) - 1, min=0)
        return dataclasses.replace(self, input_ids=ids, attention_mask=am, position_ids=pos)

    def to(self, device: torch.device) -> Batch:
        """The batch on ``device``."""
        return dataclasses.replace(
            self, **{f.name: getattr(self, f.name).to(device)
                     for f in dataclasses.fields(self) if f.name != "prompt_len"})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Inputs:
    """What the harness reads from ``inputs_dir`` (and nothing else).

    Attributes:
        batch: the rollout with the training inputs.
        contract: the contract (``contract.json``).
        actor_dir, critic_dir, ref_dir: HF model directories (``model.json``).
    """

    batch: Batch
    contract: Contract
    actor_dir: Path
    critic_dir: Path
    ref_dir: Path


def read_inputs(inputs_dir: Path) -> Inputs:
    """Load the frozen rollout, training inputs, contract and model paths.

    Raises:
        HarnessError: a file or tensor is missing, or shapes disagree.
        ContractError: ``contract.json`` fails validation.
    """
    for name in (ROLLOUT_FILE, TRAIN_INPUTS_FILE, CONTRACT_JSON, MODEL_JSON):
        if not (inputs_dir / name).is_file():
            raise HarnessError(f"{inputs_dir / name}: missing harness input")
    rollout = load_file(str(inputs_dir / ROLLOUT_FILE))
    train = load_file(str(inputs_dir / TRAIN_INPUTS_FILE))
    for file, tensors, keys in ((ROLLOUT_FILE, rollout, ROLLOUT_KEYS),
                                (TRAIN_INPUTS_FILE, train, TRAIN_INPUT_KEYS)):
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise HarnessError(f"{inputs_dir / file}: missing tensors {missing}")
    contract = Contract.from_dict(json.loads((inputs_dir / CONTRACT_JSON).read_text("utf-8")))
    models = json.loads((inputs_dir / MODEL_JSON).read_text("utf-8"))
    prompts, responses = rollout["prompts"], rollout["responses"]
    b, p = prompts.shape
    r = responses.shape[1]
    for key, shape in (("attention_mask", (b, p + r)), ("position_ids", (b, p + r)),
                       ("response_mask", (b, r))):
        if tuple(rollout[key].shape) != shape:
            raise HarnessError(f"{ROLLOUT_FILE}: {key} has shape {tuple(rollout[key].shape)}, "
                               f"expected {shape}")
    for key in TRAIN_INPUT_KEYS:
        if tuple(train[key].shape) != (b, r):
            raise HarnessError(f"{TRAIN_INPUTS_FILE}: {key} has shape "
                               f"{tuple(train[key].shape)}, expected {(b, r)}")
    batch = Batch(
        input_ids=torch.cat([prompts, responses], dim=1).long(),
        attention_mask=rollout["attention_mask"].long(),
        position_ids=rollout["position_ids"].long(),
        responses=responses.long(),
        mask=rollout["response_mask"].bool(),
        advantages=train["advantages"].float(),
        returns=train["returns"].float(),
        prompt_len=int(p),
    )
    try:
        dirs = {k: Path(models[k]) for k in ("actor_dir", "critic_dir")}
    except KeyError as exc:
        raise HarnessError(f"{inputs_dir / MODEL_JSON}: missing {exc.args[0]!r}") from None
    return Inputs(batch=batch, contract=contract, actor_dir=dirs["actor_dir"],
                  critic_dir=dirs["critic_dir"],
                  ref_dir=Path(models.get("ref_dir", models["actor_dir"])))


# --------------------------------------------------------------------------- models


def load_model(kind: str, path: Path, device: torch.device) -> nn.Module:
    """Load an HF model in FP32 with SDPA attention, dropout off (``eval()`` mode).

    Args:
        kind: ``causal_lm`` (actor, reference policy) or ``value`` (critic:
            ``AutoModelForTokenClassification``, ``num_labels=1``: backbone + ``score``).
        path: HF directory.
        device: where the model lives.

    Raises:
        HarnessError: the directory does not exist.
    """
    hf_logging.disable_progress_bar()
    if not path.is_dir():
        raise HarnessError(f"{path}: model directory not found")
    kw: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if kind == "value":
        model = AutoModelForTokenClassification.from_pretrained(str(path), num_labels=1, **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    model.to(device)
    model.eval()  # dropout off; autograd is unaffected by eval mode
    model.config.use_cache = False
    return model


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


def micro_slices(n: int, size: int) -> list[slice]:
    """Row slices of at most ``size`` sequences, in order."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass(kw_only=True)
class RoleRun:
    """State of one role on one rank, and what it reports.

    Attributes:
        cell: the cell.
        rank: global rank.
        mesh: the role's TP group and mesh.
        inputs: the harness inputs.
        device: compute device.
        faults: active faults.
        tensors: protocol name -> FP32 CPU tensor (kept on the writer rank only).
        timings: wall seconds per phase.
        partial_grads: parameters whose gradients arrived ``Partial`` and were reduced.
    """

    cell: HarnessCell
    rank: int
    mesh: parallelize.RoleMesh
    inputs: Inputs
    device: torch.device
    faults: faults.Faults
    tensors: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    compute_dtypes: set[torch.dtype] = dataclasses.field(default_factory=set)
    master_dtypes: set[torch.dtype] = dataclasses.field(default_factory=set)
    grad_dtypes: set[torch.dtype] = dataclasses.field(default_factory=set)
    state_dtypes: dict[str, set[torch.dtype]] = dataclasses.field(
        default_factory=lambda: {"exp_avg": set(), "exp_avg_sq": set()})
    replica_rounds: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    replica_params: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    partial_grads: list[str] = dataclasses.field(default_factory=list)

    @property
    def role(self) -> str:
        """``actor`` or ``critic``."""
        return self.mesh.role

    @property
    def writer(self) -> bool:
        """TP rank 0 keeps and writes the role's tensors."""
        return self.mesh.tp_rank == 0

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """BF16 autocast for ``bf16`` cells; nothing for ``fp32``."""
        if self.cell.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def put(self, round_: int, metric: str, value: Tensor, param: str | None = None) -> None:
        """Keep ``value`` (FP32, CPU) under its protocol name on the writer rank.

        Per-parameter tensors of large parameters are reported at the protocol's seeded
        sample of elements (:func:`qualify.protocol.param_sample_indices`).
        """
        if self.writer:
            out = value.detach().to("cpu", torch.float32)
            idx = param_sample_indices(param, out.numel()) if param is not None else None
            if idx is not None:
                out = out.reshape(-1)[torch.from_numpy(idx)]
            self.tensors[tensor_name(round_, self.role, metric, param)] = out.contiguous()

    @contextlib.contextmanager
    def timed(self, key: str) -> Iterator[None]:
        """Record the wall time of the block under ``key``."""
        t0 = time.perf_counter()
        yield
        self.timings[key] = round(time.perf_counter() - t0, 4)

    # ----------------------------------------------------------------- update step

    def optimizer_for(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        """``torch.optim.AdamW`` with the contract's settings (single-tensor path)."""
        o = self.inputs.contract.optimizer
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                 betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                 foreach=False, fused=False)

    def step(self, round_: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Record pre-clip gradients, clip, step AdamW, record state, updates, replicas."""
        params = [p for p in model.parameters() if p.requires_grad]
        max_norm = self.inputs.contract.optimizer.max_grad_norm
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
        # FAULT(bf16_optimizer_state): moments stored in BF16 between steps.
        with (faults.bf16_optimizer_state(optimizer) if "bf16_optimizer_state" in self.faults
              else contextlib.nullcontext()):
            optimizer.step()
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
            model = load_model("causal_lm", self.inputs.actor_dir, self.device)
            ref = load_model("causal_lm", self.inputs.ref_dir, self.device)
            ref.requires_grad_(False)
        with self.timed("parallelize_s"):
            info = parallelize.parallelize_model(model, self.mesh.mesh)
            parallelize.parallelize_model(ref, self.mesh.mesh)
        optimizer = self.optimizer_for(model, c.optimizer.actor_lr)
        batch = self.inputs.batch.to(self.device)
        n_valid = float(batch.mask.sum())
        slices = micro_slices(batch.input_ids.shape[0], alg.micro_batch_size)
        b, r_len = batch.responses.shape
        pad_id = _pad_token_id(model)
        with self.timed("scoring_s"), torch.no_grad():
            ref_lp = torch.zeros(b, r_len, device=self.device)
            padded = torch.zeros(b, r_len, device=self.device)
            for s in slices:
                ref_lp[s] = self.actor_scores(ref, batch.rows(s))[0]
                padded[s] = self.actor_scores(
                    model, batch.rows(s).right_padded(EXTRA_RIGHT_PADDING, pad_id))[0]
            self.put(1, "logprobs_padded", torch.where(batch.mask, padded, 0.0))
        old_lp = torch.zeros(b, r_len, device=self.device)
        for round_ in range(1, alg.rounds + 1):
            with self.timed(f"round{round_}_s"):
                lp_r = torch.zeros(b, r_len, device=self.device)
                ent_r = torch.zeros(b, r_len, device=self.device)
                sums = {"policy": 0.0, "kl": 0.0, "entropy": 0.0}
                for s in slices:
                    mb = batch.rows(s)
                    lp, ent = self.actor_scores(model, mb)
                    old = lp.detach() if round_ == 1 else old_lp[s]
                    policy = losses.policy_loss_sum(lp, old, mb.advantages, mb.mask,
                                                    alg.clip_ratio) / n_valid
                    kl = alg.kl_loss_coef * losses.masked_sum(
                        losses.kl_penalty(lp, ref_lp[s], alg.kl_loss_estimator), mb.mask) / n_valid
                    entropy = -alg.entropy_coef * losses.masked_sum(ent, mb.mask) / n_valid
                    (policy + kl + entropy).backward()
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
                if round_ == 1 and self.cell.export_weights:
                    self.export_weights(model, Path(self.cell.output_dir) / ACTOR_ROUND1_WEIGHTS)
        return self.role_meta(model, info, n_valid, len(slices))

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
                _atomic_tensors(path, full, {"format": "pt", "engine": ENGINE,
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
            model = load_model("value", self.inputs.critic_dir, self.device)
        with self.timed("parallelize_s"):
            info = parallelize.parallelize_model(model, self.mesh.mesh)
        optimizer = self.optimizer_for(model, c.optimizer.critic_lr)
        batch = self.inputs.batch.to(self.device)
        n_valid = float(batch.mask.sum())
        slices = micro_slices(batch.input_ids.shape[0], alg.micro_batch_size)
        b, r_len = batch.responses.shape
        pad_id = _pad_token_id(model)
        with self.timed("scoring_s"), torch.no_grad():
            padded = torch.zeros(b, r_len, device=self.device)
            for s in slices:
                padded[s] = self.critic_values(
                    model, batch.rows(s).right_padded(EXTRA_RIGHT_PADDING, pad_id))
            self.put(1, "values_padded", torch.where(batch.mask, padded, 0.0))
        old_v = torch.zeros(b, r_len, device=self.device)
        for round_ in range(1, alg.rounds + 1):
            with self.timed(f"round{round_}_s"):
                v_r = torch.zeros(b, r_len, device=self.device)
                total = 0.0
                for s in slices:
                    mb = batch.rows(s)
                    values = self.critic_values(model, mb)
                    old = values.detach() if round_ == 1 else old_v[s]
                    # FAULT(value_loss_unclipped): the clipped branch forgotten.
                    if "value_loss_unclipped" in self.faults:
                        vsum = faults.unclipped_value_loss_sum(values, mb.returns, mb.mask)
                    else:
                        vsum = losses.value_loss_sum(values, old, mb.returns, mb.mask,
                                                     alg.value_clip)
                    loss = vsum / n_valid
                    loss.backward()
                    total += float(loss.detach())
                    v_r[s] = torch.where(mb.mask, values.detach(), 0.0)
                if round_ == 1:
                    old_v = v_r.clone()
                self.put(round_, "values", v_r)
                self.put(round_, "loss/value", torch.tensor(total))
                self.put(round_, "loss/total", torch.tensor(total))
                self.step(round_, model, optimizer)
        return self.role_meta(model, info, n_valid, len(slices))

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
            },
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


def _pad_token_id(model: nn.Module) -> int:
    pad = getattr(model.config, "pad_token_id", None)
    return int(pad) if pad is not None else 0


# --------------------------------------------------------------------------- output files


def _part_paths(output_dir: Path, role: str) -> tuple[Path, Path]:
    return output_dir / f".part-{role}.safetensors", output_dir / f".part-{role}.json"


def _atomic_json(path: Path, doc: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n", "utf-8")
    os.replace(tmp, path)


def _atomic_tensors(path: Path, tensors: dict[str, Tensor], meta: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def write_part(output_dir: Path, role: str, tensors: dict[str, Tensor],
               meta: dict[str, Any]) -> None:
    """Write one role's tensors and meta (the JSON last: it marks the part complete)."""
    st, js = _part_paths(output_dir, role)
    _atomic_tensors(st, tensors, {"engine": ENGINE, "role": role})
    _atomic_json(js, meta)


def merge_parts(cell: HarnessCell, output_dir: Path, head: dict[str, Any]) -> None:
    """Wait for every role's part, then write ``outputs.safetensors`` and ``outputs.json``.

    Raises:
        HarnessError: a part did not appear within :data:`PART_WAIT_S`.
    """
    roles = list(parallelize.role_ranks(cell.actor_tp, cell.critic_tp))
    deadline = time.monotonic() + PART_WAIT_S
    t0 = time.perf_counter()
    for role in roles:
        js = _part_paths(output_dir, role)[1]
        while not js.is_file():
            if time.monotonic() > deadline:
                raise HarnessError(f"{js}: the {role} part never appeared")
            time.sleep(0.05)
    tensors: dict[str, Tensor] = {}
    role_meta: dict[str, Any] = {}
    for role in roles:
        st, js = _part_paths(output_dir, role)
        tensors.update(load_file(str(st)))
        role_meta[role] = json.loads(js.read_text("utf-8"))
    head["roles"] = role_meta
    head["tensors"] = {"file": OUTPUTS_FILE, "count": len(tensors)}
    head["timings"]["merge_s"] = round(time.perf_counter() - t0, 4)
    _atomic_tensors(output_dir / OUTPUTS_FILE, tensors, {"engine": ENGINE})
    _atomic_json(output_dir / OUTPUTS_META_FILE, head)
    for role in roles:
        for path in _part_paths(output_dir, role):
            path.unlink()


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "safetensors"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise HarnessError(f"${name} is not set: run this harness under torchrun "
                           f"(qualify.launch.launch)")
    return int(value)


def _device() -> tuple[torch.device, str]:
    """CUDA (NCCL) when available and not disabled by ``QUALIFY_DEVICE=cpu``; else CPU (gloo)."""
    if torch.cuda.is_available() and os.environ.get("QUALIFY_DEVICE", "") != "cpu":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise HarnessError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA "
                               f"device(s): NCCL needs one device per rank (QUALIFY_DEVICE=cpu "
                               f"runs on CPU with gloo)")
        torch.cuda.set_device(local)
        return torch.device("cuda", local), "nccl"
    return torch.device("cpu"), "gloo"


def run(cell: HarnessCell) -> None:
    """Run ``cell`` on this rank (the process group must not exist yet).

    Raises:
        HarnessError: not under torchrun, a world size that is not the cell's, engine
            options given, bad inputs, unknown faults, a TP size that does not divide the
            model.
    """
    t0 = time.perf_counter()
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if world != cell.world_size:
        raise HarnessError(f"WORLD_SIZE = {world} but the cell needs actor_tp + critic_tp = "
                           f"{cell.world_size}")
    if cell.options:
        raise HarnessError(f"torch_tp takes no engine options, got {cell.options}")
    if cell.precision not in ("fp32", "bf16"):
        raise HarnessError(f"precision {cell.precision!r}: torch_tp runs fp32 or bf16")
    active = faults.Faults(cell.faults)
    inputs = read_inputs(Path(cell.inputs_dir))
    output_dir = Path(cell.output_dir)
    device, backend = _device()
    timeout = timedelta(seconds=cell.collective_timeout_s)
    dist.init_process_group(backend, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    try:
        mesh = parallelize.build_role_mesh(
            actor_tp=cell.actor_tp, critic_tp=cell.critic_tp, rank=rank,
            device_type=device.type, timeout_s=cell.collective_timeout_s)
        # FAULT(hang_rank1): global rank 1 skips this collective and stalls.
        if "hang_rank1" in active:
            faults.skip_collective_and_stall(rank)
        dist.barrier(group=mesh.group)  # the TP group is up before anything is loaded
        print(f"[torch_tp] rank {rank}/{world}: {mesh.role} tp_rank {mesh.tp_rank}/{mesh.tp} "
              f"ranks {list(mesh.ranks)} on {device} ({backend}), {cell.precision}", flush=True)
        torch.manual_seed(cell.seed)
        init_s = time.perf_counter() - t0
        runner = RoleRun(cell=cell, rank=rank, mesh=mesh, inputs=inputs, device=device,
                         faults=active)
        with runner.timed("total_s"):
            meta = runner.run_actor() if mesh.role == "actor" else runner.run_critic()
        print(f"[torch_tp] rank {rank}: {mesh.role} done, timings {runner.timings}", flush=True)
        if runner.writer:
            output_dir.mkdir(parents=True, exist_ok=True)
            write_part(output_dir, mesh.role, runner.tensors, meta)
        if rank == 0:
            ranks = [{"rank": r, "role": role, "tp_rank": i, "tp_group": list(rs)}
                     for role, rs in parallelize.role_ranks(cell.actor_tp, cell.critic_tp).items()
                     for i, r in enumerate(rs)]
            head: dict[str, Any] = {
                "schema_version": 1,
                "engine": ENGINE,
                "cell": cell.to_dict(),
                "versions": _versions(),
                "world_size": world,
                "backend": backend,
                "device": device.type,
                "ranks": ranks,
                "timings": {"init_s": round(init_s, 4),
                            "rank0_total_s": round(time.perf_counter() - t0, 4)},
                "shims": [],
                "faults": list(cell.faults),
            }
            merge_parts(cell, output_dir, head)
    finally:
        dist.destroy_process_group()


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m harnesses.torch_tp.harness CELL_JSON``.

    Returns:
        0 on success, 2 on a usage error (exceptions propagate so torchrun records them).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(f"usage: python -m harnesses.torch_tp.harness {CELL_FILE}", file=sys.stderr)
        return 2
    cell = HarnessCell.from_dict(json.loads(Path(args[0]).read_text("utf-8")))
    if cell.engine != ENGINE:
        raise HarnessError(f"{args[0]}: engine {cell.engine!r} is not {ENGINE!r}")
    run(cell)
    return 0


if __name__ == "__main__":
    sys.exit(main())
