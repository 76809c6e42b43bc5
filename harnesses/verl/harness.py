"""The verl stack adapter: verl 0.9.1's own PPO actor and critic update (FSDP2, CPU, gloo).

The ``verl`` engine's harness (:mod:`harnesses.verl.spec`), ``python -m harnesses.verl.harness
CELL_JSON`` in verl's own venv (``scripts/install_verl.sh``; the launcher starts it there under
``--launcher verl=.venv-verl/bin/python``, this checkout on ``PYTHONPATH``). The world is
``(actor_tp + critic_tp) * dp`` ranks: ranks ``[0, dp)`` run the Actor, the next ``dp`` the
Critic; each role's ranks form their own default process group (gloo, a file store in the
cell's output directory), since verl's FSDP engine meshes over the whole default group.

Per role, what verl's ``RayPPOTrainer`` runs, without Ray (its single controller's dispatch is
a contiguous row split over the dp ranks, done here):

1. ``TrainingWorker(TrainingWorkerConfig(model_type, HFModelConfig, FSDPEngineConfig(strategy
   "fsdp2", mixed_precision fp32 | bf16 params), FSDPOptimizerConfig))``, ``.reset()``,
   ``.set_loss_fn(partial(ppo_loss | value_loss, config=FSDPActorConfig | FSDPCriticConfig))``
   with the contract's loss settings (:mod:`harnesses.verl.translate`);
2. the batch a ``DataProto`` (``prompts``, ``responses``, ``input_ids``, ``attention_mask``,
   ``position_ids``, ``response_mask``, ``advantages`` / ``returns``), ``to_tensordict()`` and
   ``left_right_2_no_padding``, as ``ray_trainer`` does;
3. before round 1, ``infer_batch`` (``compute_log_prob`` / ``compute_values``): the Actor's
   ``old_log_probs`` (and ``ref_log_prob``: the reference policy is the initial actor), the
   Critic's ``values``; the padding rerun is the same call with
   :data:`EXTRA_RIGHT_PADDING` more pad columns (attention 0);
4. per round, ``train_mini_batch`` (one mini-batch = the whole batch, one epoch, no shuffle):
   verl's micro-batches of ``micro_batch_size`` rows, its loss, backward, ``clip_grad_norm_``,
   AdamW step and lr-scheduler step.

Read from verl's own objects, never recomputed: the logprobs / entropies / values its loss
received and the loss terms it reported (the loss function wrapped, :class:`_LossTap`;
:func:`loss_terms`), the pre-clip gradients, the clip, the lr, AdamW's moments and the
updates (the engine's ``optimizer_step`` wrapped, :class:`_StepTap`), the grad norm verl
returns, the dtypes FSDP2 holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import qualify_harness as sdk
import torch
import torch.distributed as dist
from torch import Tensor, nn

from harnesses import common
from harnesses.verl import translate
from qualify.errors import HarnessError
from qualify.protocol import HarnessCell

ENGINE: Final = "verl"
PACKAGES: Final = ("torch", "verl", "transformers", "tensordict")
EXTRA_RIGHT_PADDING: Final = 3
"""Pad columns appended for the padding-invariance rerun (attention 0)."""
SHIMS: Final = ("verl.utils.model.load_valuehead_model: attn_implementation sdpa (verl "
                "hard-codes flash_attention_2)",
                "verl.plugin.platform: a CPU platform registered (harnesses/verl/platform_cpu.py)")
"""What the adapter sets in verl from outside (no verl source is edited)."""


def response_loss_mask(response_mask: Tensor) -> Tensor:
    """The ``response_mask`` verl gets (its loss mask), int64 ``[B, R]``."""
    return response_mask.long()


def advantages_in(advantages: Tensor) -> Tensor:
    """The ``advantages`` verl gets, FP32 ``[B, R]`` (the frozen training inputs, as given)."""
    return advantages.float()


# --------------------------------------------------------------------------- process groups


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """This rank's role and its place in the role's own process group."""

    role: str
    dp: int
    dp_rank: int
    global_rank: int
    world: int

    @property
    def writer(self) -> bool:
        """Dp rank 0 keeps and writes the role's outputs."""
        return self.dp_rank == 0


def place(cell: HarnessCell) -> Placement:
    """The rank's role: ranks ``[0, dp)`` the Actor, ``[dp, 2 dp)`` the Critic.

    Raises:
        HarnessError: ``WORLD_SIZE`` is not ``(actor_tp + critic_tp) * dp``, or a TP above 1.
    """
    dp = int(cell.options.get("dp", 1))
    rank, world = common.env_int("RANK"), common.env_int("WORLD_SIZE")
    if cell.actor_tp not in (0, 1) or cell.critic_tp not in (0, 1):
        raise HarnessError(f"cell {cell.actor_tp=} {cell.critic_tp=}: verl's FSDP engine here "
                           "runs TP 1 per role")
    roles = common.roles(cell.actor_tp, cell.critic_tp)
    if world != len(roles) * dp:
        raise HarnessError(f"WORLD_SIZE = {world} but the cell needs (actor_tp + critic_tp) * "
                           f"dp = {len(roles) * dp}")
    return Placement(role=roles[rank // dp], dp=dp, dp_rank=rank % dp, global_rank=rank,
                     world=world)


@contextlib.contextmanager
def role_group(p: Placement, out_dir: Path) -> Iterator[None]:
    """The role's ranks as verl's default process group (gloo over a file store).

    verl reads ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (its ``Worker``) and meshes over
    ``torch.distributed.get_world_size()`` (its ``FSDPEngine``): both are the role's inside
    the block. torchrun's values are restored after it (the rank's import record is written
    under its global ``RANK``, :mod:`qualify.candidate.imported`), the group destroyed and
    its store file removed.
    """
    store = out_dir / f".verl-pg-{p.role}"
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({"RANK": str(p.dp_rank), "WORLD_SIZE": str(p.dp),
                       "LOCAL_RANK": str(p.dp_rank), "LOCAL_WORLD_SIZE": str(p.dp)})
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=p.dp_rank,
                            world_size=p.dp)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if p.dp_rank == 0:
            store.unlink(missing_ok=True)


# --------------------------------------------------------------------------- verl objects


def _sdpa_valuehead(local_path: str, torch_dtype: torch.dtype, model_config: Any,
                    trust_remote_code: bool) -> nn.Module:
    """Verl's ``load_valuehead_model`` first branch, with SDPA instead of flash-attention 2."""
    from transformers import AutoModelForTokenClassification

    model: nn.Module = AutoModelForTokenClassification.from_pretrained(
        pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
        attn_implementation="sdpa", trust_remote_code=trust_remote_code)
    return model


def build_worker(*, role: str, model_dir: Path, precision: str, micro_batch_size: int,
                 opt_fields: dict[str, Any], loss_fn: Callable[..., Any]) -> Any:
    """Verl's ``TrainingWorker`` for ``role``, reset, its loss function set."""
    import verl.utils.model as verl_model
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        TrainingWorkerConfig,
    )
    from verl.workers.engine_workers import TrainingWorker

    verl_model.load_valuehead_model = _sdpa_valuehead
    dtype = "fp32" if precision == "fp32" else "bf16"
    model_config = HFModelConfig(path=str(model_dir), load_tokenizer=False,
                                 override_config={"attn_implementation": "sdpa"},
                                 use_remove_padding=False, enable_gradient_checkpointing=False)
    engine_config = FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False,
                                     use_dynamic_bsz=False,
                                     micro_batch_size_per_gpu=micro_batch_size,
                                     infer_micro_batch_size_per_gpu=micro_batch_size,
                                     mixed_precision={"param_dtype": dtype, "reduce_dtype": "fp32",
                                                      "buffer_dtype": "fp32"},
                                     model_dtype="fp32")
    worker = TrainingWorker(TrainingWorkerConfig(
        model_type="language_model" if role == "actor" else "value_model",
        model_config=model_config, engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(**opt_fields),
        checkpoint_config=CheckpointConfig()))
    worker.reset()
    worker.set_loss_fn(loss_fn)
    return worker


TERM_METRICS: Final = ("actor/pg_loss", "kl_loss", "actor/entropy_loss", "critic/vf_loss")
"""The loss terms verl's ``ppo_loss`` / ``value_loss`` return per micro-batch (unweighted)."""


def _metric_value(m: Any) -> float:
    """A verl ``Metric`` (or plain number / tensor) as a float."""
    if hasattr(m, "aggregate"):  # one micro-batch's Metric: a single value
        return float(m.aggregate())
    return float(m.detach()) if isinstance(m, Tensor) else float(m)


def loss_terms(terms: list[dict[str, float]], total: float, *, actor: bool,
               kl_coef: float, entropy_coef: float) -> dict[str, float]:
    """The protocol's loss terms from verl's own per-micro-batch metrics, summed.

    ``ppo_loss`` returns ``pg_loss - entropy_coeff · entropy_loss + kl_loss_coef · kl_loss``
    and reports the three unweighted: the terms are those metrics times the coefficients
    ``ppo_loss`` applies (``value_loss``: ``vf_loss``); ``total`` is the sum of the losses it
    returned.
    """
    def s(key: str) -> float:
        return sum(t.get(key, 0.0) for t in terms)

    if not actor:
        return {"value": s("critic/vf_loss"), "total": total}
    return {"policy": s("actor/pg_loss"), "kl": kl_coef * s("kl_loss"),
            "entropy": -entropy_coef * s("actor/entropy_loss"), "total": total}


class _LossTap:
    """verl's loss function, called as is; keeps the model outputs it received, per call."""

    def __init__(self, inner: Callable[..., Any], key: str) -> None:
        self.inner = inner
        self.key = key
        self.outputs: list[dict[str, Tensor]] = []
        self.losses: list[float] = []
        self.terms: list[dict[str, float]] = []

    def __call__(self, model_output: Any, data: Any, dp_group: Any = None) -> Any:
        from verl.workers.utils.padding import no_padding_2_padding

        got = {k: no_padding_2_padding(model_output[k], data).detach().float()
               for k in (self.key, "entropy") if model_output.get(k, None) is not None}
        self.outputs.append(got)
        loss, metrics = self.inner(model_output=model_output, data=data, dp_group=dp_group)
        self.losses.append(float(loss.detach()))
        self.terms.append({k: float(_metric_value(m)) for k, m in metrics.items()
                           if k in TERM_METRICS})
        return loss, metrics

    @contextlib.contextmanager
    def fresh(self) -> Iterator[None]:
        self.outputs.clear()
        self.losses.clear()
        self.terms.clear()
        yield

    def stacked(self, key: str) -> Tensor:
        """The micro-batches' ``key`` rows in call order, ``[b_local, R]``."""
        return torch.cat([o[key] for o in self.outputs])


@dataclasses.dataclass(kw_only=True)
class _StepTap:
    """Wraps ``engine.optimizer_step`` (verl's clip + AdamW step) to read what it did."""

    engine: Any
    rec: sdk.Recorder
    max_norm: float
    round_: int = 0

    def install(self) -> None:
        inner = self.engine.optimizer_step

        @functools.wraps(inner)
        def step() -> float:
            return self.around(inner)

        self.engine.optimizer_step = step

    def around(self, inner: Callable[[], float]) -> float:
        from qualify_harness import optim as sdk_optim

        from harnesses.fsdp2 import parallelize
        from harnesses.fsdp2 import state_dict_adapter as sda

        module, opt, rec, r = self.engine.module, self.engine.optimizer, self.rec, self.round_
        params = [p for p in module.parameters() if p.requires_grad]
        rec.engine_dtypes(*parallelize.reduction_dtypes(module))
        rec.grad_dtypes |= {p.grad.dtype for p in params if p.grad is not None}
        rec.master_dtypes |= {p.dtype for p in params}
        pre = sda.full_grads(module)
        for name, g in pre.items():
            rec.put(r, "grads", g, name)
        before = sda.full_params(module)
        rec.lrs[f"round{r}"] = float(opt.param_groups[0]["lr"])
        norm = inner()
        post = sda.full_grads(module)
        rec.put(r, "grad_norm", torch.tensor(float(norm)))
        rec.put(r, "clip_coef", common.measured_clip_coef(post.values(), pre.values()))
        for key in ("exp_avg", "exp_avg_sq"):
            rec.state_dtypes[key] |= sdk_optim.state_dtypes(opt, key)
            for name, t in sda.full_optimizer_state(module, opt, key).items():
                rec.put(r, key, t, name)
        for name, after in sda.full_params(module).items():
            rec.put(r, "updates", after - before[name], name)
        reps = parallelize.replicated_parameters(module)
        rec.replicas(r, {n: True for n, _ in reps}, {n: 0.0 for n, _ in reps})
        return norm


# --------------------------------------------------------------------------- batches


def verl_batch(b: sdk.Batch, *, extra: int = 0, pad: int = 0,
               fields: dict[str, Tensor] | None = None, temperature: float = 1.0) -> Any:
    """The rows as verl's trainer hands them over: ``left_right_2_no_padding`` of a DataProto.

    Args:
        b: the rows (prompt left-padded, response right-padded).
        extra: pad columns appended to the responses (attention 0, response mask 0).
        pad: the pad token id.
        fields: further ``[b, R]`` tensors (``advantages``, ``returns``...), zero-padded by
            ``extra`` columns.
        temperature: verl's ``meta_info["temperature"]``.
    """
    from verl import DataProto
    from verl.workers.utils.padding import left_right_2_no_padding

    n, p = b.input_ids.shape[0], b.prompt_len
    responses = torch.cat([b.responses, b.responses.new_full((n, extra), pad)], 1)
    am = torch.cat([b.attention_mask, b.attention_mask.new_zeros((n, extra))], 1)
    pos = torch.clamp(torch.cumsum(am, dim=1) - 1, min=0) if extra else b.position_ids
    mask = torch.cat([response_loss_mask(b.mask), b.mask.new_zeros((n, extra)).long()], 1)
    tensors = {"prompts": b.input_ids[:, :p], "responses": responses,
               "input_ids": torch.cat([b.input_ids[:, :p], responses], 1),
               "attention_mask": am, "position_ids": pos, "response_mask": mask}
    for k, v in (fields or {}).items():
        tensors[k] = torch.cat([v.float(), v.new_zeros((n, extra)).float()], 1)
    proto = DataProto.from_dict(tensors=tensors, meta_info={"temperature": temperature})
    return left_right_2_no_padding(proto.to_tensordict())


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass(kw_only=True)
class RoleRun:
    """One role on one rank: verl's worker on this dp rank's rows, and what it reports."""

    cell: HarnessCell
    inputs: common.Inputs
    placement: Placement
    rec: sdk.Recorder

    @property
    def actor(self) -> bool:
        """Whether this rank runs the Actor."""
        return self.placement.role == "actor"

    def rows(self) -> slice:
        """This dp rank's contiguous rows (verl's dispatch chunks the batch in order)."""
        n, dp = int(self.inputs.batch.input_ids.shape[0]), self.placement.dp
        mbs = self.inputs.contract.algorithm.micro_batch_size
        if n % (dp * mbs):
            raise HarnessError(f"the batch's {n} rows do not split into dp {dp} x micro-batches "
                               f"of {mbs} (verl chunks equal micro-batches per rank)")
        k = n // dp
        return slice(self.placement.dp_rank * k, (self.placement.dp_rank + 1) * k)

    def gather(self, local: Tensor) -> Tensor:
        """All-gather ``[b_local, R]`` rows over the role's dp ranks, in row order."""
        if self.placement.dp == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.placement.dp)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, 0)

    def run(self) -> dict[str, Any]:
        """Every round (module docstring); returns the role's ``outputs.json`` part."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.config import FSDPActorConfig, FSDPCriticConfig
        from verl.workers.utils.losses import ppo_loss, value_loss
        from verl.workers.utils.padding import no_padding_2_padding

        c, rec = self.inputs.contract, self.rec
        alg, n_rows = c.algorithm, int(self.inputs.batch.input_ids.shape[0])
        whole = self.inputs.batch
        b = whole.rows(self.rows())
        mask = b.mask
        key = "log_probs" if self.actor else "values"
        temp = translate.sampling_temperature(c.sampling.temperature)
        if self.actor:
            cfg = FSDPActorConfig(strategy="fsdp2", rollout_n=1, use_torch_compile=False,
                                  ppo_mini_batch_size=n_rows,
                                  ppo_micro_batch_size_per_gpu=alg.micro_batch_size,
                                  **translate.actor_fields(alg))
            tap = _LossTap(functools.partial(ppo_loss, config=cfg), key)
            model_dir = self.inputs.actor_dir
            if self.inputs.ref_dir != self.inputs.actor_dir:
                raise HarnessError(f"reference policy {self.inputs.ref_dir} is not the initial "
                                   "actor: the verl adapter scores the reference with the actor")
        else:
            cfg = FSDPCriticConfig(strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=n_rows,
                                   ppo_micro_batch_size_per_gpu=alg.micro_batch_size,
                                   **translate.critic_fields(alg))
            tap = _LossTap(functools.partial(value_loss, config=cfg), key)
            model_dir = self.inputs.critic_dir
        with rec.timed("load_s"):
            worker = build_worker(role=self.placement.role, model_dir=model_dir,
                                  precision=self.cell.precision,
                                  micro_batch_size=alg.micro_batch_size,
                                  opt_fields=translate.optimizer_fields(
                                      c.optimizer, role=self.placement.role, rounds=alg.rounds),
                                  loss_fn=tap)
        engine = worker.engine
        hooks = common.compute_dtype_hooks(engine.module, rec.compute_dtypes)
        pad = int(getattr(engine.model_config.hf_config, "pad_token_id", None) or 0)

        def infer(extra: int) -> dict[str, Tensor]:
            """Verl's ``infer_batch`` (compute_log_prob / compute_values), padded back."""
            td = verl_batch(b, extra=extra, pad=pad, temperature=temp)
            tu.assign_non_tensor(td, compute_loss=False, calculate_entropy=self.actor)
            out = worker.infer_batch(td)
            return {k: no_padding_2_padding(tu.get(out, k), td).float()[:, :b.response_len]
                    for k in (key, "entropy") if (k == key or self.actor)}

        with rec.timed("scoring_s"):
            padded = infer(EXTRA_RIGHT_PADDING)[key]
            scored = infer(0)
        padded_name = "logprobs_padded" if self.actor else "values_padded"
        rec.put(1, padded_name, self.gather(torch.where(mask, padded, 0.0)))
        fields: dict[str, Tensor] = {}
        if self.actor:
            fields = {"advantages": advantages_in(b.advantages),
                      "old_log_probs": scored[key]}
            if alg.kl_loss_coef != 0:
                fields["ref_log_prob"] = scored[key]
        else:
            fields = {"returns": b.returns.float(), "values": scored[key]}
        steps = _StepTap(engine=engine, rec=rec, max_norm=c.optimizer.max_grad_norm)
        steps.install()
        totals: dict[str, float] = {}
        metrics: dict[str, Any] = {}
        for round_ in range(1, alg.rounds + 1):
            steps.round_ = round_
            with rec.timed(f"round{round_}_s"), tap.fresh():
                td = verl_batch(b, pad=pad, fields=fields, temperature=temp)
                tu.assign_non_tensor(td, calculate_entropy=self.actor, global_batch_size=n_rows,
                                     mini_batch_size=n_rows, epochs=1, seed=self.cell.seed,
                                     dataloader_kwargs={"shuffle": False}, compute_loss=True)
                out = worker.train_mini_batch(td)
                if out is not None:
                    metrics[f"round{round_}"] = {
                        k: v for k, v in tu.get(out, "metrics").items()
                        if k in ("grad_norm", "lr", "loss", "actor/pg_loss", "kl_loss",
                                 "actor/entropy_loss", "critic/vf_loss")}
                got = tap.stacked(key)
                name = "logprobs" if self.actor else "values"
                rec.put(round_, name, self.gather(torch.where(mask, got, 0.0)))
                if self.actor:
                    rec.put(round_, "entropy",
                            self.gather(torch.where(mask, tap.stacked("entropy"), 0.0)))
                terms = loss_terms(tap.terms, sum(tap.losses), actor=self.actor,
                                   kl_coef=alg.kl_loss_coef, entropy_coef=alg.entropy_coef)
                names = sorted(terms)
                shares = torch.tensor([terms[k] for k in names], dtype=torch.float64)
                if self.placement.dp > 1:  # each rank's loss is scaled by dp (FSDP averages)
                    dist.all_reduce(shares)
                    shares /= self.placement.dp
                for k, v in zip(names, shares.tolist(), strict=True):
                    rec.put(round_, f"loss/{k}", torch.tensor(v))
                totals[f"round{round_}"] = float(shares[names.index("total")])
        for h in hooks:
            h.remove()
        return sdk.role_meta(
            rec, tp=1, global_ranks=[self.placement.global_rank - self.placement.dp_rank + i
                                     for i in range(self.placement.dp)],
            precision=self.cell.precision,
            model_class=type(engine.module).__name__, loss_agg_mode=alg.loss_agg_mode,
            parallelism={"dp": self.placement.dp, "strategy": "fsdp2"},
            engine_info={"worker": "verl.workers.engine_workers.TrainingWorker",
                         "loss_fn": "ppo_loss" if self.actor else "value_loss",
                         "loss_total": totals, "verl_metrics": metrics,
                         "shims": list(SHIMS),
                         **({k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                             for k, v in (translate.actor_fields(alg) if self.actor
                                          else translate.critic_fields(alg)).items()})})


def run(cell: HarnessCell) -> None:
    """Run this rank's role of ``cell`` (verl venv, CPU, gloo).

    Raises:
        HarnessError: a topology or precision the adapter does not run, a variant verl does
            not implement (:func:`harnesses.verl.translate.unsupported`), bad inputs.
    """
    t0 = time.perf_counter()
    inputs = common.stack_inputs(  # cell.faults: harnesses/verl/faults.py, patched in
        cell, stack="verl", faults="harnesses.verl.faults", harness=__name__,
        lacking=lambda c: translate.unsupported(c.algorithm, c.optimizer, tuple(c.matrix.roles)))
    if cell.precision not in ("fp32", "bf16"):
        raise HarnessError(f"cell precision {cell.precision!r}: the verl adapter runs fp32 or bf16")
    placement = place(cell)
    out_dir = Path(cell.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from harnesses.verl import platform_cpu

    platform_cpu.install()
    with role_group(placement, out_dir):
        torch.manual_seed(cell.seed)
        rec = sdk.Recorder(role=placement.role, writer=placement.writer,
                           sampling=sdk.ParamSampling.from_dict(cell.param_sampling.to_dict()))
        runner = RoleRun(cell=cell, inputs=inputs, placement=placement, rec=rec)
        with rec.timed("total_s"):
            meta = runner.run()
        if placement.writer:
            sdk.write_part(ENGINE, out_dir, placement.role, rec.tensors, meta)
    if placement.global_rank == 0:
        common.merge_stack_outputs(cell, engine=ENGINE, packages=PACKAGES, world=placement.world,
                                   backend="gloo", shims=SHIMS, t0=t0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m harnesses.verl CELL_JSON``.

    Returns:
        0 on success, 2 on a usage error.
    """
    return common.harness_main(argv, engine=ENGINE, module="harnesses.verl", run=run)


if __name__ == "__main__":
    sys.exit(main())
