"""The TRL stack adapter: TRL 1.16.0's own GRPO loss, backward and optimizer step.

The ``trl`` engine's harness (:mod:`harnesses.trl.spec`), ``python -m harnesses.trl.harness
CELL_JSON`` in TRL's own venv (``scripts/install_trl.sh``; the launcher starts it there under
``--launcher trl=.venv-trl/bin/python``, this checkout on ``PYTHONPATH``). One process, one
rank, CPU. It reads qualify's frozen
inputs (``cell.json``, ``inputs_dir``: rollout, training inputs, contract, model
directories; :func:`harnesses.common.read_inputs`) and runs, per round ``r = 1..rounds``,
what ``transformers.Trainer``'s inner loop runs around ``GRPOTrainer``:

1. per micro-batch of ``micro_batch_size`` rows: ``trainer.compute_loss(model, batch)``
   (TRL's ``_compute_loss``: its fused-LM-head logprobs at the contract's temperature, its
   ratio, clip, KL and ``loss_type`` normalisation, with ``current_gradient_accumulation_steps``
   = the number of micro-batches) and ``trainer.accelerator.backward(loss)``;
2. ``trainer.accelerator.clip_grad_norm_(params, max_grad_norm)`` (its pre-clip norm is the
   reported ``grad_norm``);
3. ``trainer.optimizer.step()`` (``create_optimizer_and_scheduler``: torch AdamW with the
   Trainer's parameter groups), ``trainer.lr_scheduler.step()``, ``zero_grad``.

The batch TRL gets: ``prompt_ids`` / ``prompt_mask`` (the rollout's left-padded prompts and
their attention), ``completion_ids`` / ``completion_mask`` (the responses and their attention;
``tool_mask`` = the rollout's ``response_mask`` where it differs, TRL's loss mask is their
product), ``advantages`` ``[B, R]``, ``old_per_token_logps`` (round ``r >= 2``: the logprobs
TRL itself computed in round 1; round 1: absent, TRL then uses its current ones, detached),
``ref_per_token_logps`` (``beta != 0``: TRL's ``_get_per_token_logps_and_entropies`` on its
own reference model) and ``num_items_in_batch`` (the batch's valid tokens, for ``dapo`` /
``cispo``). Reported: the logprobs and entropies TRL's loss used (captured from its own call,
masked to 0 off the response mask), ``grad_norm``, ``clip_coef`` (measured: the norm of the
clipped gradients over the norm of the unclipped ones), the pre-clip FP32 gradients, AdamW's
moments and the updates under HF names, the lr applied, round 1's padding rerun, the dtypes,
the SDPA backends of every forward, and the one-process replica record (one copy of each
parameter), all through the harness SDK's :class:`qualify_harness.Recorder` and
:func:`qualify_harness.role_meta`. TRL's loss per round, the sum of its micro-batch losses
(each already normalised over the whole batch by its ``loss_type``), is ``loss/total`` (also
``engine_info.loss_total``); the policy / KL / entropy terms and the ``rewards`` family are
declared not run (:data:`NOT_RUN`). Nothing of TRL's numbers is recomputed or corrected here.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import qualify_harness as sdk
import torch
from qualify_harness.routes import sdpa_recorder
from torch import Tensor, nn

from harnesses import common
from harnesses.trl import translate
from qualify.errors import HarnessError
from qualify.protocol import HarnessCell

ENGINE: Final = "trl"
PACKAGES: Final = ("torch", "trl", "transformers", "accelerate")
NOT_RUN: Final = (
    {"round": None, "family": "losses", "terms": ["policy", "kl", "entropy"],
     "reason": "GRPOTrainer.compute_loss returns one loss (policy + beta KL + entropy bonus, "
               "aggregated): no per-term split; its total is reported (loss/total)"},
    {"round": None, "family": "rewards",
     "reason": "the TRL adapter runs GRPOTrainer's update on the frozen rollout; it scores no "
               "reward model"},
)
"""What the adapter declares not run: the loss terms besides ``total``
(:func:`qualify.compare.rows.declared_terms`) and the ``rewards`` family
(:func:`qualify.compare.rows.declared_not_run`)."""
EXTRA_RIGHT_PADDING: Final = 3
"""Pad columns appended for the padding-invariance rerun (attention 0)."""


def _tokenizer(vocab_size: int, pad_id: int, eos_id: int) -> Any:
    """A word-level tokenizer over ids ``t0..t{V-1}``.

    GRPOTrainer needs a processing class; the frozen rollout is already token ids (nothing
    is tokenized).
    """
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")))
    tok.pad_token, tok.eos_token = f"t{pad_id}", f"t{eos_id}"
    return tok


def _reward(prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
    """GRPOTrainer's required reward function; never called (no generation here)."""
    raise HarnessError("the TRL adapter does not generate: the reward function was called")


def tool_mask(response_mask: Tensor, completion_attention: Tensor) -> Tensor | None:
    """TRL's ``tool_mask`` for a batch: the response mask where it differs from attention.

    TRL's loss mask is ``completion_mask * tool_mask``; ``completion_mask`` is the responses'
    attention.

    Args:
        response_mask: the rollout's ``response_mask`` rows, ``[B, R]`` bool.
        completion_attention: the same rows' attention over the responses, ``[B, R]``.

    Returns:
        ``response_mask`` as int64 ``[B, R]``, or ``None`` where it equals the attention.
    """
    mask = response_mask.long()
    return None if torch.equal(mask, completion_attention.long()) else mask


def trl_advantages(advantages: Tensor) -> Tensor:
    """TRL's ``advantages`` input: the rollout's per-token advantages, ``[B, R]`` FP32.

    ``GRPOTrainer._compute_loss`` uses a ``[B, T]`` tensor per token as given (a ``[B]`` one
    it unsqueezes to one value per sequence); GRPO's are constant along a response, already
    group-normalised in qualify's training inputs, and passed as they are.
    """
    return advantages.float()


class _Capture:
    """Wraps ``trainer._get_per_token_logps_and_entropies`` to keep what TRL's loss used."""

    def __init__(self, trainer: Any) -> None:
        self.inner = trainer._get_per_token_logps_and_entropies
        self.logps: list[Tensor] = []
        self.entropies: list[Tensor] = []
        trainer._get_per_token_logps_and_entropies = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        self.logps.append(out[0].detach())
        if out[1] is not None:
            self.entropies.append(out[1].detach())
        return out

    @contextlib.contextmanager
    def fresh(self) -> Iterator[None]:
        self.logps.clear()
        self.entropies.clear()
        yield


def run(cell: HarnessCell) -> None:
    """Run ``cell`` in this process (TRL venv, one CPU rank).

    Raises:
        HarnessError: a topology or precision TRL does not run, a variant it does not
            implement (:func:`harnesses.trl.translate.unsupported`), bad inputs.
    """
    t0 = time.perf_counter()
    inputs = common.stack_inputs(  # cell.faults: harnesses/trl/faults.py, patched in
        cell, stack="TRL", faults="harnesses.trl.faults", harness=__name__,
        lacking=lambda c: translate.unsupported(c.algorithm, tuple(c.matrix.roles)))
    if (cell.actor_tp, cell.critic_tp) != (1, 0) or cell.precision not in ("fp32", "bf16"):
        raise HarnessError(f"cell {cell.actor_tp=} {cell.critic_tp=} {cell.precision=}: the TRL "
                           "adapter runs the actor alone, TP 1, fp32 or bf16")
    torch.manual_seed(cell.seed)
    runner = _ActorRun(cell=cell, inputs=inputs)
    with runner.rec.timed("total_s"):
        meta = runner.run()
    sdk.write_part(ENGINE, Path(cell.output_dir), "actor", runner.rec.tensors, meta)
    common.merge_stack_outputs(cell, engine=ENGINE, packages=PACKAGES, world=1, backend="none",
                               shims=(), t0=t0)


class _ActorRun:
    """The actor's rounds through GRPOTrainer (module docstring).

    Attributes:
        cell: the launch.
        inputs: the frozen inputs.
        rec: what the role reports (:class:`qualify_harness.Recorder`: tensors, dtypes,
            replicas, lrs, SDPA calls, timings).
    """

    def __init__(self, *, cell: HarnessCell, inputs: common.Inputs) -> None:
        self.cell = cell
        self.inputs = inputs
        self.rec = sdk.Recorder(role="actor", writer=True,
                                sampling=sdk.ParamSampling.from_dict(
                                    cell.param_sampling.to_dict()))

    def trainer(self, workdir: Path) -> Any:
        """GRPOTrainer on the actor directory, its config from the contract."""
        from datasets import Dataset  # type: ignore[import-not-found]
        from transformers import AutoConfig
        from trl import GRPOConfig, GRPOTrainer  # type: ignore[import-not-found]

        c, batch = self.inputs.contract, self.inputs.batch
        opt, alg = c.optimizer, c.algorithm
        n = int(batch.input_ids.shape[0])
        mbs = alg.micro_batch_size
        if n % mbs:
            raise HarnessError(f"micro_batch_size {mbs} does not divide the batch ({n} rows): "
                               "TRL's accumulation steps are equal micro-batches")
        steps = n // mbs
        hf = AutoConfig.from_pretrained(str(self.inputs.actor_dir))
        args = GRPOConfig(
            output_dir=str(workdir), use_cpu=True, bf16=self.cell.precision == "bf16",
            report_to="none", save_strategy="no", logging_strategy="no", seed=self.cell.seed,
            per_device_train_batch_size=mbs, gradient_accumulation_steps=steps,
            steps_per_generation=steps, num_generations=c.sampling.samples_per_prompt,
            num_iterations=alg.rounds,
            **translate.sampling_kwargs(c.sampling),
            learning_rate=opt.actor_lr, adam_beta1=opt.betas[0], adam_beta2=opt.betas[1],
            adam_epsilon=opt.eps, weight_decay=opt.weight_decay, max_grad_norm=opt.max_grad_norm,
            lr_scheduler_type=opt.lr_schedule if opt.lr_schedule != "constant" else
            "constant_with_warmup", warmup_steps=opt.warmup_steps, max_steps=alg.rounds,
            entropy_coef=alg.entropy_coef,
            model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
            **translate.grpo_config_kwargs(alg, response_len=batch.response_len))
        dataset = Dataset.from_dict({"prompt": ["t1"] * n})
        tok = _tokenizer(int(hf.vocab_size), int(hf.pad_token_id or 0), int(hf.eos_token_id))
        trainer = GRPOTrainer(model=str(self.inputs.actor_dir), reward_funcs=_reward, args=args,
                              train_dataset=dataset, processing_class=tok)
        trainer.current_gradient_accumulation_steps = steps
        total = opt.total_steps if opt.total_steps is not None else alg.rounds
        trainer.create_optimizer_and_scheduler(num_training_steps=total)
        return trainer

    def trl_batch(self, rows: slice, old: Tensor | None, ref: Tensor | None,
                  n_valid: int) -> dict[str, Tensor]:
        """The rows' frozen rollout in GRPOTrainer's batch keys (module docstring)."""
        b = self.inputs.batch.rows(rows)
        p = b.prompt_len
        out = {"prompt_ids": b.input_ids[:, :p], "prompt_mask": b.attention_mask[:, :p],
               "completion_ids": b.responses, "completion_mask": b.attention_mask[:, p:],
               "advantages": trl_advantages(b.advantages),
               "num_items_in_batch": torch.tensor(float(n_valid))}
        loss_mask = tool_mask(b.mask, b.attention_mask[:, p:])
        if loss_mask is not None:
            out["tool_mask"] = loss_mask
        if old is not None:
            out["old_per_token_logps"] = old[rows]
        if ref is not None:
            out["ref_per_token_logps"] = ref[rows]
        return out

    def scores(self, trainer: Any, model: nn.Module, extra: int = 0) -> Tensor:
        """TRL's own logprobs of the whole batch, ``[B, R]``.

        No gradient; as TRL scores its reference model, without entropies.
        """
        b = self.inputs.batch
        pad = common.pad_token_id(model)
        p, r = b.prompt_len, b.response_len
        comp = torch.cat([b.responses, b.responses.new_full((b.responses.shape[0], extra), pad)], 1)
        cmask = torch.cat([b.attention_mask[:, p:],
                           b.attention_mask.new_zeros((b.responses.shape[0], extra))], 1)
        ids = torch.cat([b.input_ids[:, :p], comp], 1)
        am = torch.cat([b.attention_mask[:, :p], cmask], 1)
        with torch.no_grad():
            lp, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, am, r + extra)
        return lp[:, :r].float()

    def run(self) -> dict[str, Any]:
        """Every round (module docstring); returns the role's ``outputs.json`` part.

        Raises:
            HarnessError: a parameter without a gradient after TRL's backward or clip.
            OutputError: a dtype, lr or replica record that no round filled.
        """
        c, b, rec = self.inputs.contract, self.inputs.batch, self.rec
        alg = c.algorithm
        mask = b.mask
        n_valid = int(mask.sum())
        with tempfile.TemporaryDirectory(prefix="qualify-trl-") as work:
            with rec.timed("load_s"):
                trainer = self.trainer(Path(work))
            model = trainer.model
            model.train()  # TRL's training mode (its normalisers read model.training)
            params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            rec.master_dtypes.update(p.dtype for _, p in params)
            hooks = common.compute_dtype_hooks(model, rec.compute_dtypes)
            loss_totals: dict[str, float] = {}
            with sdpa_recorder(rec.sdpa):
                ref = None
                if alg.kl_loss_coef != 0:
                    ref = self.scores(trainer, trainer.ref_model)
                padded = self.scores(trainer, model, EXTRA_RIGHT_PADDING)
                rec.put(1, "logprobs_padded", torch.where(mask, padded, 0.0))
                capture = _Capture(trainer)
                slices = common.micro_slices(int(b.input_ids.shape[0]), alg.micro_batch_size)
                old: Tensor | None = None
                for round_ in range(1, alg.rounds + 1):
                    with rec.timed(f"round{round_}_s"), capture.fresh():
                        total = 0.0
                        for s in slices:
                            loss = trainer.compute_loss(model,
                                                        self.trl_batch(s, old, ref, n_valid))
                            trainer.accelerator.backward(loss)
                            total += float(loss.detach())
                        lp = torch.cat(capture.logps).float()
                        ent = torch.cat(capture.entropies).float()
                        rec.put(round_, "logprobs", torch.where(mask, lp, 0.0))
                        rec.put(round_, "entropy", torch.where(mask, ent, 0.0))
                        rec.put(round_, "loss/total", torch.tensor(total))
                        loss_totals[f"round{round_}"] = total
                        if round_ == 1:
                            old = lp.detach()
                        rec.lrs[f"round{round_}"] = self.step(trainer, round_, params)
                        rec.replicas(round_, {}, {})  # one process: a single copy of each
            for h in hooks:
                h.remove()
        grads = set(rec.grad_dtypes)  # one process: param.grad is reduced and summed nowhere else
        rec.engine_dtypes({"one_process_no_reduction:param.grad": grads},
                          {"AccumulateGrad:param.grad": grads})
        return sdk.role_meta(
            rec, tp=1, global_ranks=[0], precision=self.cell.precision,
            model_class=type(model).__name__, loss_agg_mode=alg.loss_agg_mode,
            not_run=list(NOT_RUN),
            engine_info={"trainer": "trl.GRPOTrainer", "loss_total": loss_totals,
                         **translate.grpo_config_kwargs(alg, response_len=b.response_len),
                         **translate.sampling_kwargs(c.sampling)})

    def step(self, trainer: Any, round_: int, params: list[tuple[str, nn.Parameter]]) -> float:
        """Record grads, TRL's clip, AdamW step and scheduler step; return the lr applied."""
        rec = self.rec
        before = {n: p.detach().clone() for n, p in params}
        pre = {}
        for n, p in params:
            if p.grad is None:
                raise HarnessError(f"{n}: no gradient after TRL's backward")
            rec.grad_dtypes.add(p.grad.dtype)
            pre[n] = p.grad.detach().clone()
            rec.put(round_, "grads", pre[n], n)
        norm = trainer.accelerator.clip_grad_norm_([p for _, p in params],
                                                   trainer.args.max_grad_norm)
        rec.put(round_, "grad_norm", torch.as_tensor(float(norm)))
        clipped = []
        for n, p in params:
            if p.grad is None:
                raise HarnessError(f"{n}: the gradient disappeared in TRL's clip")
            clipped.append(p.grad)
        rec.put(round_, "clip_coef", common.measured_clip_coef(clipped, pre.values()))
        lr = float(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        state = trainer.optimizer.state
        for n, p in params:
            st = state[p]
            rec.state_dtypes["exp_avg"].add(st["exp_avg"].dtype)
            rec.state_dtypes["exp_avg_sq"].add(st["exp_avg_sq"].dtype)
            rec.put(round_, "exp_avg", st["exp_avg"].clone(), n)
            rec.put(round_, "exp_avg_sq", st["exp_avg_sq"].clone(), n)
            rec.put(round_, "updates", p.detach() - before[n], n)
        return lr


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m harnesses.trl CELL_JSON``.

    Returns:
        0 on success, 2 on a usage error.
    """
    return common.harness_main(argv, engine=ENGINE, module="harnesses.trl", run=run)


if __name__ == "__main__":
    sys.exit(main())
