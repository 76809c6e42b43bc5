"""Megatron-Core harness: ``python -m harnesses.megatron.harness CELL_JSON`` under torchrun.

Runs the Actor and Critic of :mod:`qualify.protocol` on megatron-core's own ``GPTModel``
(local layer spec), with weights converted per TP rank by :mod:`harnesses.megatron.convert`:

- forward: Actor logprobs and entropy from the vocab-parallel output layer
  (:func:`harnesses.megatron.losses.vocab_parallel_logprobs_entropy`), Critic values from
  a replicated value head on the decoder;
- update (CPU and CUDA, :class:`harnesses.megatron.train.MegatronEngine`): Megatron's
  ``DistributedDataParallel`` with FP32 ``main_grad`` buffers, ``get_megatron_optimizer``
  (``OptimizerConfig(optimizer="adam")``: AdamW with decoupled weight decay; BF16 =
  ``Float16Module`` BF16 parameters with FP32 master weights in
  ``Float16OptimizerWithFloat16Params``), its TP-aware gradient clipping and the grad norm
  its ``step()`` returns. Gradients (``main_grad``), Adam moments and master updates are
  gathered over the TP group and converted back to the HF layout.

On CPU, Megatron's own optimizer runs (never replaced by another one) under the placement
shims of :mod:`harnesses.megatron.cpu_shims`, which map its hard-coded ``device='cuda'``
constants and legacy ``torch.cuda.*Tensor`` type checks to the CPU; every patch the CPU
path needs is listed in ``outputs.json`` ``shims``.

The rounds, the PPO / GRPO / value losses and the output files are the harness SDK's
(:mod:`qualify_harness`). Resume cells (``cell.json`` ``resume``):
:mod:`harnesses.megatron.resume` (README "Resume"); the test suite's planted faults are
patched in by :mod:`harnesses.megatron.faults`, never on the numerical path.

Reads only ``cell.json`` and, from ``inputs_dir``: ``rollout.safetensors``,
``train_inputs.safetensors``, ``contract.json`` and ``model.json`` (never reference scores).
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from harnesses import common
from harnesses.common import Batch, Inputs
from harnesses.megatron import convert, cpu_shims, resume, train
from harnesses.megatron import model as mm
from harnesses.megatron.probe import megatron_probe
from harnesses.resume_state import ResumePlan
from qualify.errors import HarnessError
from qualify.protocol import HarnessCell

ENGINE: Final = "megatron"
PACKAGES: Final = ("torch", "transformers", "safetensors", "megatron-core")
BF16_MECHANISM: Final = ("megatron Float16Module (BF16 parameters and compute); FP32 master "
                         "weights in Megatron's optimizer")


# --------------------------------------------------------------------------- the model


def hf_state(path: Path, head: convert.Head) -> tuple[Any, dict[str, Tensor]]:
    """HF config and FP32 state dict of a model directory (weights only; no HF compute).

    Args:
        path: HF directory.
        head: ``lm`` (causal LM) or ``value`` (``*ForTokenClassification``, one label).

    Raises:
        HarnessError: the directory does not exist.
    """
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not path.is_dir():
        raise HarnessError(f"{path}: model directory not found")
    if head == "value":
        m = AutoModelForTokenClassification.from_pretrained(str(path), num_labels=1,
                                                            dtype=torch.float32)
    else:
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return m.config, {k: v.detach().clone() for k, v in m.state_dict().items()}


def build(path: Path, head: convert.Head, groups: mm.RoleGroups, *, bf16: bool,
          device: torch.device) -> tuple[nn.Module, convert.Shape, int]:
    """The Megatron model of ``path`` on this rank, in eval mode.

    Converted per TP rank (:func:`harnesses.megatron.convert.hf_to_megatron`, layout
    checked); BF16 cells wrap it in ``Float16Module``.

    Returns:
        ``(model, shape, pad_token_id)`` (the HF config's pad id, 0 when unset).

    Raises:
        HarnessError: the directory is missing or the converted layout is wrong.
    """
    config, sd = hf_state(path, head)
    shape = convert.Shape.from_hf_config(config, head=head)
    shards = convert.hf_to_megatron(sd, shape, groups.tp)
    problems = convert.layout_errors(sd, shards, shape)
    if problems:
        raise HarnessError(f"converted layout check failed: {problems[:3]}")
    model = mm.build_gpt(config, shape, groups, bf16=bf16, cpu=device.type == "cpu")
    mm.load_shard(model, shards[groups.tp_rank])
    mm.check_tp_tags(model, convert.replicated_megatron_names(shape))
    model.to(device)
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    model.eval()  # dropout is 0 anyway; eval() does not stop autograd
    return model, shape, int(getattr(config, "pad_token_id", None) or 0)


# --------------------------------------------------------------------------- role run


@dataclasses.dataclass(kw_only=True)
class RoleRun:
    """One role on one rank: build the model, the engine, the SDK's rounds; the role meta.

    Attributes:
        cell: the single-variant cell.
        groups: role and process groups.
        inputs: the harness inputs.
        device: compute device.
        rec: what the role reports.
    """

    cell: HarnessCell
    groups: mm.RoleGroups
    inputs: Inputs
    device: torch.device
    rec: sdk.Recorder
    resume_meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def bf16(self) -> bool:
        """Megatron BF16 mode."""
        return self.cell.precision == "bf16"

    def run(self) -> dict[str, Any]:
        """The role's rounds (:func:`qualify_harness.run_actor` / ``run_critic``); its meta."""
        actor = self.groups.role == "actor"
        inputs, groups = self.inputs, self.groups
        ref = None
        with self.rec.timed("load_s"):
            model, shape, pad_id = build(inputs.actor_dir if actor else inputs.critic_dir,
                                         "lm" if actor else "value", groups, bf16=self.bf16,
                                         device=self.device)
            if actor:
                ref = build(inputs.ref_dir, "lm", groups, bf16=self.bf16,
                            device=self.device)[0]
                ref.requires_grad_(False)
        probe = megatron_probe(self.cell.probe, role=groups.role, writer=self.rec.writer,
                               model=model, vocab=shape.vocab, tp=groups.tp,
                               tp_group=groups.tp_group)
        engine = train.MegatronEngine(model=model, shape=shape, groups=groups,
                                      contract=inputs.contract, device=self.device,
                                      bf16=self.bf16, rec=self.rec, pad_token_id=pad_id)
        plan = ResumePlan.of(self.cell)

        def restore() -> dict[str, Tensor]:
            with self.rec.timed("checkpoint_load_s"):
                state, self.resume_meta["resume"] = resume.load(plan, engine)
            return {k: v.to(self.device) for k, v in state.items()}

        def after_round(round_: int, rollout_state: dict[str, Tensor]) -> None:
            if plan.saves_after(round_):
                with self.rec.timed("checkpoint_save_s"):
                    resume.save(plan, engine, rollout_state)

        def capture(round_: int, mb: Batch) -> contextlib.AbstractContextManager[Any]:
            return probe.capture(round_, mb.prompt_len, mb.input_ids.shape[1])

        batch, recipe = inputs.batch.to(self.device), inputs.recipe
        kw: dict[str, Any] = {"rec": self.rec, "rounds": plan.rounds(recipe.rounds),
                              "restore": restore if plan.loading else None,
                              "after_round": after_round, "capture": capture}
        if actor:
            meta = sdk.run_actor(engine, engine.ddp, ref, batch, recipe, **kw)
        else:
            meta = sdk.run_critic(engine, engine.ddp, batch, recipe, **kw)
        probe.save(ENGINE)
        return sdk.role_meta(
            self.rec, tp=groups.tp, global_ranks=groups.ranks, precision=self.cell.precision,
            model_class="megatron.core.models.gpt.GPTModel (local spec)",
            parallelism={"mesh_dim_names": ["tp"], "lm_head": "vocab_parallel" if actor else None,
                         "replicated_params": convert.replicated_megatron_names(shape)},
            bf16_mechanism=BF16_MECHANISM if self.bf16 else None,
            dropout="0 (hidden_dropout = attention_dropout = 0)",
            lr_scheduler=train.LR_SCHEDULER_NOTE,
            engine_info={
                "value_head": ("replicated Linear(hidden, 1) + bias as GPTModel.output_layer"
                               if not actor else None),
                "vocab": {"hf": shape.vocab, "padded": shape.padded_vocab(groups.tp),
                          "padding_columns": "excluded from log-softmax and entropy"},
                "rope_positions": "0..T-1 per row (GPTModel ignores position_ids for RoPE); "
                                  "left padding shifts every real token of a row by the same "
                                  "offset, which RoPE's relative form cancels",
                "process_groups": "explicit pg_collection: tp = the role's ranks, every other "
                                  "dimension this rank alone",
                "optimizer": engine.optimizer_info(),
            },
            **meta, **self.resume_meta)


def run(cell: HarnessCell) -> None:
    """Run every variant and topology of ``cell`` on this rank (creates and destroys the group).

    One process group serves every variant and topology of a grouped launch (issue #17):
    each topology's role groups (:func:`harnesses.megatron.model.role_groups`: explicit
    ``pg_collection``, every rank creates every group in the same order; Megatron's global
    ``parallel_state`` is never initialised, so there is nothing to destroy between
    topologies), then each variant from the frozen inputs with a fresh model, optimizer,
    RNG tracker and ``torch.manual_seed(cell.seed)`` (tests/test_grouped_launch.py checks
    that the order of the cells does not change a bit of their outputs).

    Raises:
        HarnessError: not under torchrun, wrong world size, engine options or an unknown
            fault given, bad inputs or a TP size the model does not allow.
    """
    t0 = time.perf_counter()
    rank, world = common.env_int("RANK"), common.env_int("WORLD_SIZE")
    if world != cell.world_size:
        raise HarnessError(f"WORLD_SIZE = {world}, the cell needs {cell.world_size}")
    topologies, init_s = common.topology_runs(cell), 0.0
    if any(v.options for _, vs in topologies for v in vs):
        raise HarnessError("the megatron harness takes no engine options")
    if cell.faults:  # the test suite's deliberate bugs, patched in (harnesses/megatron/faults.py)
        from harnesses.megatron import faults
        faults.install(cell.faults)
    inputs = common.read_inputs(Path(cell.inputs_dir))
    # With fewer GPUs than ranks, ranks share devices: fine when every NCCL group that
    # communicates holds one rank per device (TP1 roles on a one-GPU machine); NCCL refuses
    # a TP group with two ranks on one device.
    device, backend = common.device_and_backend(share_devices=True)
    # No device_id: NCCL communicators are created lazily, per group, so the world group
    # (never used for a collective) may hold two ranks sharing one GPU.
    dist.init_process_group(backend, timeout=timedelta(seconds=cell.collective_timeout_s))
    try:
        for (actor_tp, critic_tp), vcells in topologies:
            groups = mm.role_groups(actor_tp, critic_tp, rank, cell.collective_timeout_s)
            shims = mm.apply_group_shims()
            dist.barrier(group=groups.tp_group)
            init_s = init_s or time.perf_counter() - t0  # start-up: to the first groups
            for vcell in vcells:
                tv = time.perf_counter()
                if device.type == "cpu":  # also resets the RNG tracker: fresh per cell
                    shims = mm.apply_group_shims() + mm.apply_cpu_shims() + cpu_shims.shim_texts()
                else:
                    from megatron.core import tensor_parallel

                    # explicit ranks: the global parallel_state is not initialised (model.py)
                    tensor_parallel.model_parallel_cuda_manual_seed(
                        vcell.seed, tp_rank=groups.tp_rank, ep_rank=0, etp_rank=0)
                print(f"[megatron] rank {rank}/{world}: {groups.role} tp_rank "
                      f"{groups.tp_rank}/{groups.tp} on {device} ({backend}), "
                      f"{vcell.precision}", flush=True)
                torch.manual_seed(vcell.seed)
                rec = sdk.Recorder(
                    role=groups.role, writer=groups.tp_rank == 0,
                    sampling=sdk.ParamSampling.from_dict(vcell.param_sampling.to_dict()))
                runner = RoleRun(cell=vcell, groups=groups, inputs=inputs, device=device,
                                 rec=rec)
                with rec.timed("total_s"):
                    meta = runner.run()
                output_dir = Path(vcell.output_dir)
                if rec.writer:  # a resumed launch reports only the rounds it ran
                    sdk.write_part(ENGINE, output_dir, groups.role,
                                   ResumePlan.of(vcell).keep(rec.tensors), meta)
                if rank == 0:
                    head = sdk.outputs_head(
                        engine=ENGINE, cell=vcell.to_dict(), packages=PACKAGES, world=world,
                        backend=backend, device=device,
                        timings={"init_s": round(init_s, 4),
                                 "variant_s": round(time.perf_counter() - tv, 4),
                                 "rank0_total_s": round(time.perf_counter() - t0, 4)},
                        shims=shims, faults=list(vcell.faults))
                    sdk.merge_parts(ENGINE, common.roles(actor_tp, critic_tp), output_dir, head)
    finally:
        dist.destroy_process_group()


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m harnesses.megatron.harness CELL_JSON``.

    Returns:
        0 on success, 2 on a usage error (exceptions propagate so torchrun records them).
    """
    return common.harness_main(argv, engine=ENGINE, module="harnesses.megatron.harness",
                               run=run)


if __name__ == "__main__":
    common.exit_now(main())
