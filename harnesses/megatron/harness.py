"""Megatron-Core harness: ``python -m harnesses.megatron.harness CELL_JSON`` under torchrun.

Runs the Actor and Critic of :mod:`qualify.protocol` on megatron-core's own ``GPTModel``
(local layer spec), with weights converted per TP rank by :mod:`harnesses.megatron.convert`:

- scoring (every device): Actor logprobs and entropy from the vocab-parallel output layer
  (:func:`harnesses.megatron.losses.vocab_parallel_logprobs_entropy`), Critic values from
  a replicated value head on the decoder, and the padding-invariance reruns;
- training (CPU and CUDA): Megatron's ``DistributedDataParallel`` with FP32 ``main_grad``
  buffers, ``get_megatron_optimizer`` (``OptimizerConfig(optimizer="adam")``: AdamW with
  decoupled weight decay; BF16 = ``Float16Module`` BF16 parameters with FP32 master
  weights in ``Float16OptimizerWithFloat16Params``), its TP-aware gradient clipping and the
  grad norm its ``step()`` returns. Gradients (``main_grad``), Adam moments and master
  updates are gathered over the TP group and converted back to the HF layout.

On CPU, Megatron's own optimizer runs (never replaced by another one) under the placement
shims of :mod:`harnesses.megatron.cpu_shims`, which map its hard-coded ``device='cuda'``
constants and legacy ``torch.cuda.*Tensor`` type checks to the CPU; every patch the CPU
path needs is listed in ``outputs.json`` ``shims``.

Resume cells (``cell.json`` ``resume``): :mod:`harnesses.megatron.resume` (README "Resume").

Reads only ``cell.json`` and, from ``inputs_dir``: ``rollout.safetensors``,
``train_inputs.safetensors``, ``contract.json`` and ``model.json`` (never reference scores).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
from qualify_harness.routes import optimizer_route, sdpa_recorder, sdpa_summary
from torch import Tensor, nn
from torch.distributed.elastic.multiprocessing.errors import record

from harnesses import common
from harnesses.common import Batch
from harnesses.megatron import convert, cpu_shims, faults, losses
from harnesses.megatron import model as mm
from harnesses.resume_state import ResumePlan
from qualify.contract import Contract
from qualify.errors import HarnessError
from qualify.protocol import (
    EXTRA_RIGHT_PADDING,
    HarnessCell,
)

ENGINE: Final = "megatron"
PACKAGES: Final = ("torch", "transformers", "safetensors", "megatron-core")


# --------------------------------------------------------------------------- inputs


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


# --------------------------------------------------------------------------- role run


@dataclasses.dataclass(kw_only=True)
class RoleRun(common.RoleOutputs):
    """One role on one rank: the Megatron model, its scores, its update, what it reports.

    Attributes:
        cell: the cell.
        groups: role and process groups.
        batch, contract, dirs: the inputs.
        device: compute device.
        faults: the cell's planted faults (test suite only; none by default).
        tensors, timings: what it reports (:class:`harnesses.common.RoleOutputs`).
        sdpa, routes: the kernel routes read back as the role ran (:func:`megatron_routes`;
            ``sdpa``: :func:`qualify_harness.routes.sdpa_recorder`'s counts).
    """

    cell: HarnessCell
    groups: mm.RoleGroups
    batch: Batch
    contract: Contract
    dirs: dict[str, Path]
    device: torch.device
    faults: faults.Faults = dataclasses.field(default_factory=lambda: faults.Faults(()))
    compute_dtypes: set[str] = dataclasses.field(default_factory=set)
    extra_meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    sdpa: dict[str, int] = dataclasses.field(default_factory=dict)
    routes: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def role(self) -> str:
        """``actor`` or ``critic``."""
        return self.groups.role

    @property
    def writer(self) -> bool:
        """TP rank 0 keeps and writes the role's tensors."""
        return self.groups.tp_rank == 0

    @property
    def bf16(self) -> bool:
        """Megatron BF16 mode."""
        return self.cell.precision == "bf16"

    @property
    def cpu(self) -> bool:
        """Running on CPU (gloo; the optimizer under :mod:`~harnesses.megatron.cpu_shims`)."""
        return self.device.type == "cpu"


    # ----------------------------------------------------------------- model

    def build(self, path: Path, head: convert.Head) -> tuple[nn.Module, convert.Shape]:
        """Megatron model of ``path`` on this rank (BF16 cells: wrapped in ``Float16Module``)."""
        config, sd = hf_state(path, head)
        shape = convert.Shape.from_hf_config(config, head=head)
        shards = convert.hf_to_megatron(sd, shape, self.groups.tp)
        problems = convert.layout_errors(sd, shards, shape)
        if problems:
            raise HarnessError(f"converted layout check failed: {problems[:3]}")
        model = mm.build_gpt(config, shape, self.groups, bf16=self.bf16, cpu=self.cpu)
        mm.load_shard(model, shards[self.groups.tp_rank])
        mm.check_tp_tags(model, convert.replicated_megatron_names(shape))
        model.to(self.device)
        if self.bf16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(model.config, model)
        model.eval()  # dropout is 0 anyway; eval() does not stop autograd
        self.extra_meta["pad_token_id"] = int(getattr(config, "pad_token_id", None) or 0)
        self.extra_meta["padded_vocab"] = shape.padded_vocab(self.groups.tp)
        self.extra_meta["hf_vocab"] = shape.vocab
        return model, shape

    def window(self, model: nn.Module, batch: Batch) -> Tensor:
        """Model output at positions ``P - 1 + t``, ``t < R``.

        Returns:
            ``[b, R, V'/tp]`` (actor: this rank's vocab shard) or ``[b, R, 1]`` (critic).
        """
        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                    attention_mask=mm.padding_mask(batch.attention_mask))
        self.compute_dtypes.add(str(out.dtype))
        r = batch.responses.shape[1]
        start = batch.prompt_len - 1
        window: Tensor = out[:, start:start + r]
        return window

    def actor_scores(self, model: nn.Module, shape: convert.Shape,
                     batch: Batch) -> tuple[Tensor, Tensor]:
        """Logprobs and entropy ``[b, R]`` FP32 (vocab-parallel, the contract's temperature)."""
        return losses.vocab_parallel_logprobs_entropy(
            self.window(model, batch), batch.responses, vocab=shape.vocab,
            tp_rank=self.groups.tp_rank, group=self.groups.tp_group,
            temperature=self.contract.sampling.temperature)

    def critic_values(self, model: nn.Module, batch: Batch) -> Tensor:
        """Values ``[b, R]`` FP32 (replicated value head; identical on every TP rank)."""
        return self.window(model, batch).float().squeeze(-1)

    # ----------------------------------------------------------------- scoring

    def run(self) -> dict[str, Any]:
        """Score and train this role; return its ``outputs.json`` part."""
        head: convert.Head = "lm" if self.role == "actor" else "value"
        src = self.dirs["actor_dir" if self.role == "actor" else "critic_dir"]
        with self.timed("load_s"):
            model, shape = self.build(src, head)
            ref = None
            if self.role == "actor":
                ref, _ = self.build(self.dirs["ref_dir"], "lm")
                ref.requires_grad_(False)
        batch = self.batch.to(self.device)
        with sdpa_recorder(self.sdpa):
            return self._score_and_train(model, ref, shape, batch)

    def _score_and_train(self, model: nn.Module, ref: nn.Module | None, shape: convert.Shape,
                         batch: Batch) -> dict[str, Any]:
        """:meth:`run` after the load: scoring, then training (SDPA calls counted)."""
        alg = self.contract.algorithm
        b, r_len = batch.responses.shape
        slices = common.micro_slices(b, alg.micro_batch_size)
        pad_id = int(self.extra_meta["pad_token_id"])
        metric = "logprobs" if self.role == "actor" else "values"
        with self.timed("scoring_s"), torch.no_grad():
            first = torch.zeros(b, r_len, device=self.device)
            ent = torch.zeros(b, r_len, device=self.device)
            padded = torch.zeros(b, r_len, device=self.device)
            for s in slices:
                mb = batch.rows(s)
                if self.role == "actor":
                    first[s], ent[s] = self.actor_scores(model, shape, mb)
                    padded[s] = self.actor_scores(
                        model, shape, mb.right_padded(EXTRA_RIGHT_PADDING, pad_id))[0]
                else:
                    first[s] = self.critic_values(model, mb)
                    padded[s] = self.critic_values(
                        model, mb.right_padded(EXTRA_RIGHT_PADDING, pad_id))
            self.put(1, f"{metric}_padded", torch.where(batch.mask, padded, 0.0))
        from harnesses.megatron import train
        from harnesses.megatron.probe import megatron_probe

        probe = megatron_probe(self.cell.probe, role=self.role, writer=self.writer, model=model,
                               vocab=shape.vocab, tp=self.groups.tp,
                               tp_group=self.groups.tp_group)
        trainer = train.Trainer(run=self, model=model, shape=shape, ref=ref, probe=probe)
        trainer.train(batch, slices)
        self.routes = megatron_routes(model, trainer.optimizer)
        return self.meta(shape, not_run=[], training=trainer.meta())

    def meta(self, shape: convert.Shape, *, not_run: list[dict[str, Any]],
             training: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The role's part of ``outputs.json``."""
        out: dict[str, Any] = {
            "tp": self.groups.tp,
            "global_ranks": list(self.groups.ranks),
            "model_class": "megatron.core.models.gpt.GPTModel (local spec)",
            "parallelism": {
                "mesh_dim_names": ["tp"],
                "lm_head": "vocab_parallel" if self.role == "actor" else None,
                "replicated_params": convert.replicated_megatron_names(shape),
            },
            "precision": self.cell.precision,
            "bf16_mechanism": ("megatron Float16Module (BF16 parameters and compute); FP32 "
                               "master weights in Megatron's optimizer") if self.bf16 else None,
            "valid_tokens": int(self.batch.mask.sum()),
            "micro_batches": len(common.micro_slices(self.batch.input_ids.shape[0],
                                              self.contract.algorithm.micro_batch_size)),
            "dropout": "0 (hidden_dropout = attention_dropout = 0)",
            "not_run": not_run,
            "role_timings": dict(self.timings),
            "routes": {"sdpa_backends": sdpa_summary(self.sdpa), **self.routes},
            "engine_info": {
                "compute": sorted(self.compute_dtypes),
                "value_head": ("replicated Linear(hidden, 1) + bias as GPTModel.output_layer"
                               if self.role == "critic" else None),
                "vocab": {"hf": shape.vocab, "padded": shape.padded_vocab(self.groups.tp),
                          "padding_columns": "excluded from log-softmax and entropy"},
                "rope_positions": "0..T-1 per row (GPTModel ignores position_ids for RoPE); "
                                  "left padding shifts every real token of a row by the same "
                                  "offset, which RoPE's relative form cancels",
                "process_groups": "explicit pg_collection: tp = the role's ranks, every other "
                                  "dimension this rank alone",
            },
        }
        if training is not None:
            out["engine_info"]["optimizer"] = training.get("optimizer")
            out["dtypes"] = training["dtypes"]
            out["replica_consistency"] = training["replica_consistency"]
            out["loss_agg_mode"] = training["loss_agg_mode"]
            out["lr"], out["lr_scheduler"] = training["lr"], training["lr_scheduler"]
            if training["behavior_weight"]:
                out["behavior_weight"] = training["behavior_weight"]
            if training.get("resume"):  # a resumed launch: the restore's state record
                out["resume"] = training["resume"]
        return out


MEGATRON_FUSIONS: Final = ("bias_activation_fusion", "masked_softmax_fusion",
                            "persist_layer_norm", "bias_dropout_fusion", "apply_rope_fusion",
                            "gradient_accumulation_fusion", "attention_softmax_in_fp32")
"""``TransformerConfig`` flags that switch Megatron's fused kernels (read off the built model)."""


def megatron_routes(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """The kernel routes of a built Megatron model, read back from the live objects.

    ``fusions``: :data:`MEGATRON_FUSIONS` from the ``config`` the model's layers hold (the
    one they branch on at run time); ``core_attention``: the classes of the modules named
    ``*.core_attention`` (``DotProductAttention`` for the local spec, TE's otherwise);
    ``optimizer``: :func:`qualify_harness.routes.optimizer_route` of the optimizer stepped.
    """
    config = next((m.config for m in model.modules() if hasattr(m, "config")
                   and hasattr(m.config, "masked_softmax_fusion")), None)
    attn = sorted({f"{type(m).__module__}.{type(m).__qualname__}"
                   for n, m in model.named_modules() if n.endswith("core_attention")})
    return {"fusions": {k: getattr(config, k, None) for k in MEGATRON_FUSIONS},
            "core_attention": attn,
            "optimizer": optimizer_route(optimizer)}


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
    active = faults.Faults(cell.faults)  # the resume faults only (test suite)
    inputs = common.read_inputs(Path(cell.inputs_dir))
    dirs = {"actor_dir": inputs.actor_dir, "critic_dir": inputs.critic_dir,
            "ref_dir": inputs.ref_dir}
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
                runner = RoleRun(cell=vcell, groups=groups, batch=inputs.batch,
                                 contract=inputs.contract, dirs=dirs, device=device,
                                 faults=active)
                with runner.timed("total_s"):
                    meta = runner.run()
                output_dir = Path(vcell.output_dir)
                if runner.writer:  # a resumed launch reports only the rounds it ran
                    common.write_part(ENGINE, output_dir, groups.role,
                                      ResumePlan.of(vcell).keep(runner.tensors), meta)
                if rank == 0:
                    head = common.outputs_head(
                        engine=ENGINE, cell=vcell.to_dict(), packages=PACKAGES, world=world,
                        backend=backend, device=device,
                        timings={"init_s": round(init_s, 4),
                                 "variant_s": round(time.perf_counter() - tv, 4),
                                 "rank0_total_s": round(time.perf_counter() - t0, 4)},
                        shims=shims, faults=list(vcell.faults))
                    common.merge_parts(ENGINE, common.roles(actor_tp, critic_tp),
                                       output_dir, head)
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
