"""The round driver: the contract's rounds, once for every engine.

An engine harness supplies an :class:`Engine` (one role on one rank: the placed model, its
forward to per-token quantities, backward, gradient gathering, clip, optimizer step and what
it reports); :func:`run_actor` and :func:`run_critic` run the rounds, compute the losses
(:mod:`qualify_harness.losses`) and record every protocol tensor in a
:class:`~qualify_harness.outputs.Recorder`, in this order per round:

1. per micro-batch: forward, loss terms (each a masked sum over the micro-batch divided by
   the whole batch's denominator), backward of their sum;
2. per-token tensors and loss values; then :func:`update`: pre-clip gradients (full, HF
   names), clip (pre-clip norm and clip coefficient), the lr the step applies, optimizer
   step, scheduler step, optimizer state, per-parameter updates, the replica check.

Round 1's own log-probs (values) are the ``old`` of every later round; decoupled PPO's
behavior weights come from round 1's log-probs (the proximal policy). Before round 1 the
padding rerun (``<metric>_padded``, :data:`~qualify_harness.protocol.EXTRA_RIGHT_PADDING`
more pad columns) is scored without gradient, and the Actor's initial-weights next-token
distributions are recorded (:func:`record_distribution`, engines that implement
:meth:`Engine.response_logits`).

Every SDPA call of a role's forwards is counted by the backend torch selects for it
(:mod:`qualify_harness.routes`), and :meth:`Engine.routes` read back after the last round:
the role meta's ``routes``.
"""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, TypeVar, cast

import torch
from torch import Tensor

from qualify_harness import distribution as distmod
from qualify_harness import losses
from qualify_harness.inputs import Batch, Recipe, micro_slices
from qualify_harness.outputs import Recorder
from qualify_harness.protocol import EXTRA_RIGHT_PADDING
from qualify_harness.routes import sdpa_recorder

Restore = Callable[[], Mapping[str, Tensor]]
"""Restores a checkpoint (after the scoring pass) and returns the state later rounds need."""
RoundHook = Callable[[int, dict[str, Tensor]], None]
"""Called after round ``r``'s step with the state later rounds need (resume, export)."""
Capture = Callable[[int, Batch], contextlib.AbstractContextManager[Any]]
"""A context around one micro-batch's forward and backward (a layer probe)."""


class Engine(ABC):
    """One role of one engine on one rank: the parts the driver asks for.

    Tensors the driver receives are FP32 ``[b, R]`` plain tensors, equal on every rank of
    the role; full tensors (``full_*``) are keyed by Hugging Face parameter name.
    """

    device: torch.device
    pad_token_id: int = 0
    temperature: float
    """The contract's sampling temperature ``T``, the logits divisor of the default
    :meth:`logprobs_and_entropy` (an engine that overrides it need not set it)."""

    def logprobs_and_entropy(self, model: Any, batch: Batch) -> tuple[Tensor, Tensor]:
        """Actor: ``(logprobs, entropy)`` of ``batch.responses``, each ``[b, R]`` FP32.

        The default: :func:`qualify_harness.losses.logprobs_and_entropy` (the single-device
        log-softmax) of :meth:`response_logits` at :attr:`temperature`, for an engine whose
        logits arrive whole on the rank. An engine whose head is vocab-parallel, or that
        scores otherwise, overrides it.

        Raises:
            NotImplementedError: the engine implements neither this nor
                :meth:`response_logits`, or sets no :attr:`temperature`.
        """
        temperature = getattr(self, "temperature", None)
        if not isinstance(temperature, int | float):
            raise NotImplementedError(
                f"{type(self).__name__} sets no temperature: the default logprobs_and_entropy "
                f"divides the logits by it (set self.temperature, or override the method)")
        return losses.logprobs_and_entropy(self.response_logits(model, batch),
                                           batch.responses, float(temperature))

    def values(self, model: Any, batch: Batch) -> Tensor:
        """Critic: values ``V(s_t)`` on the response window, ``[b, R]`` FP32."""
        raise NotImplementedError(f"{type(self).__name__} runs no critic")

    def response_logits(self, model: Any, batch: Batch) -> Tensor:
        """Actor (optional): the logits of ``model`` on the response window, ``[b, R, V]``.

        The forward ``logprobs_and_entropy`` scores (same positions, the engine's compute
        dtype: BF16 cells return BF16 logits), with the whole vocabulary on every rank of
        the role: a vocab-parallel head's output gathered over the TP group, a padded
        vocabulary cut to ``V`` = the model's ``config.vocab_size``. The driver records the
        distributions of :mod:`qualify_harness.distribution` from it.

        Raises:
            NotImplementedError: the engine does not expose its logits (the default); the
                role meta's ``distribution`` then says ``not_recorded`` with this message.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement response_logits")

    def after_scoring(self, models: list[Any]) -> None:  # noqa: B027 - optional: nothing
        """Called once the no-gradient scoring pass is over (FSDP reshards there)."""

    def gather_rows(self, local: Tensor) -> Tensor:
        """This rank's rows ``[b_local, ...]`` -> the whole batch's ``[B, ...]`` (data parallel).

        Any trailing shape and dtype (``[b, R]`` per-token tensors, ``[b, R, V]`` / ``[b, R,
        k]`` distributions, int64 ids); every DP rank holds the same ``b_local``.
        """
        return local

    def sum_over_ranks(self, shares: dict[str, float]) -> dict[str, float]:
        """Each loss term's per-rank share summed over the data-parallel ranks."""
        return shares

    def backward(self, loss: Tensor) -> None:
        """Back-propagate ``loss`` (accumulating gradients over micro-batches)."""
        loss.backward()

    def prepare_grads(self) -> None:  # noqa: B027 - an optional part: nothing by default
        """Anything the engine does to its gradients before they are read (reductions)."""

    @abstractmethod
    def params(self) -> list[Tensor]:
        """The trained parameters as the optimizer holds them (their ``dtype`` and ``grad``)."""

    def engine_dtypes(self) -> tuple[dict[str, set[torch.dtype]], dict[str, set[torch.dtype]]]:
        """Dtypes gradients were reduced across ranks in, and accumulated in (name -> set)."""
        return {}, {}

    @abstractmethod
    def full_grads(self) -> dict[str, Tensor]:
        """Pre-clip FP32 gradients, full, by HF name (collective where sharded)."""

    @abstractmethod
    def clip(self, max_norm: float) -> Tensor:
        """Clip the gradients to ``max_norm``; returns the pre-clip global norm (0-d)."""

    @abstractmethod
    def full_params(self) -> dict[str, Tensor]:
        """The master weights, full, by HF name."""

    @abstractmethod
    def applied_lr(self) -> float:
        """The lr the next optimizer step applies (read from the optimizer)."""

    @abstractmethod
    def optimizer_step(self) -> None:
        """One optimizer step."""

    def scheduler_step(self) -> None:  # noqa: B027 - an optional part: nothing by default
        """Step the lr scheduler (after the optimizer step)."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Drop the gradients."""

    @abstractmethod
    def state_dtypes(self, key: str) -> set[torch.dtype]:
        """Dtypes of the optimizer state ``key`` (``exp_avg``, ``exp_avg_sq``)."""

    @abstractmethod
    def full_optimizer_state(self, key: str) -> dict[str, Tensor]:
        """The optimizer state ``key``, full, by HF name."""

    @abstractmethod
    def check_replicas(self) -> tuple[Mapping[str, bool], Mapping[str, float]]:
        """Replicated parameters bitwise equal on every rank: (name -> equal, name -> max diff)."""

    def routes(self) -> dict[str, Any]:
        """Kernel routes read back from the engine's live objects; ``{}`` by default.

        E.g. the optimizer class and its ``fused`` / ``foreach`` flags, fused kernels the
        engine enabled.
        """
        return {}

    def update(self, rec: Recorder, round_: int, max_norm: float) -> None:
        """The round's optimizer step and what it reports: :func:`update` from the parts.

        An engine whose clip and step are one call (DeepSpeed's ``engine.step()``)
        overrides this whole method and records the same families around that call.
        """
        update(self, rec, round_, max_norm)


def update(engine: Engine, rec: Recorder, round_: int, max_norm: float) -> None:
    """Round ``round_``'s step: record pre-clip grads, clip, step, state, updates, replicas."""
    engine.prepare_grads()
    rec.engine_dtypes(*engine.engine_dtypes())
    params = engine.params()
    rec.grad_dtypes |= {p.grad.dtype for p in params if p.grad is not None}
    rec.master_dtypes |= {p.dtype for p in params}
    for name, g in engine.full_grads().items():
        rec.put(round_, "grads", g, name)
    norm = engine.clip(max_norm).reshape(())
    rec.put(round_, "grad_norm", norm)
    rec.put(round_, "clip_coef", torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    before = engine.full_params()
    rec.lrs[f"round{round_}"] = engine.applied_lr()
    engine.optimizer_step()
    engine.scheduler_step()
    engine.zero_grad()
    for key in ("exp_avg", "exp_avg_sq"):
        rec.state_dtypes[key] |= engine.state_dtypes(key)
        for name, t in engine.full_optimizer_state(key).items():
            rec.put(round_, key, t, name)
    for name, after in engine.full_params().items():
        rec.put(round_, "updates", after - before[name], name)
    rec.replicas(round_, *engine.check_replicas())


def actor_objective(policy: Tensor, kl: Tensor, entropy: Tensor) -> Tensor:
    """The Actor's loss to back-propagate: ``policy + kl + entropy`` (each already weighted)."""
    return policy + kl + entropy


RESUMED_WITHOUT_ROUND1: Final = ("a resumed launch: round 1 and its initial-weights "
                                 "scoring ran in the save launch")
"""The role meta's ``distribution.not_recorded`` of a launch whose rounds omit round 1."""


def record_distribution(engine: Engine, model: Any, batch: Batch, recipe: Recipe, *,
                        rec: Recorder, slices: list[slice]) -> dict[str, Any]:
    """Record round 1's Actor distributions (:mod:`qualify_harness.distribution`).

    Per micro-batch slice, :meth:`Engine.response_logits` of ``model`` (call it before any
    step: the initial weights), reduced to the protocol's tensors (top-k ``k`` =
    ``recipe.distribution_topk``), gathered over the DP ranks (:meth:`Engine.gather_rows`)
    and put under ``round1/actor/<name>``.

    Returns:
        The role meta's ``distribution``: ``{"path": "full" | "topk", "k": k | None,
        "vocab": V}``, or ``{"not_recorded": reason}`` when the engine raised
        ``NotImplementedError``.
    """
    b = batch.input_ids.shape[0]
    local: dict[str, Tensor] = {}
    vocab = 0
    topk = False
    for s in slices:
        mb = batch.rows(s)
        try:
            logits = engine.response_logits(model, mb)
        except NotImplementedError as exc:
            return {"not_recorded": str(exc) or f"{type(engine).__name__}: no response_logits"}
        vocab = int(logits.shape[-1])
        topk = distmod.use_topk(vocab)
        got = distmod.distribution_tensors(logits, mb.responses, mb.mask, topk=topk,
                                           temperature=recipe.temperature,
                                           k=recipe.distribution_topk)
        for name, t in got.items():
            if name not in local:
                local[name] = t.new_zeros((b, *t.shape[1:]))
            local[name][s] = t
    for name, t in local.items():
        rec.put(1, name, engine.gather_rows(t))
    return {"path": "topk" if topk else "full",
            "k": recipe.distribution_topk if topk else None, "vocab": vocab}


_F = TypeVar("_F", bound=Callable[..., dict[str, Any]])


def _recording_routes(fn: _F) -> _F:
    """Wrap a role's rounds: the SDPA calls counted, the engine's routes read back after.

    Every SDPA call of ``fn`` is counted into ``rec.sdpa``; then :meth:`Engine.routes` goes
    into ``rec.routes``: the routes the role's forwards and steps actually took.
    """

    @functools.wraps(fn)
    def wrapped(engine: Engine, *args: Any, rec: Recorder, **kwargs: Any) -> dict[str, Any]:
        with sdpa_recorder(rec.sdpa):
            out = fn(engine, *args, rec=rec, **kwargs)
        rec.routes.update(engine.routes())
        return out

    return cast(_F, wrapped)


def _no_capture(_round: int, _batch: Batch) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


@_recording_routes
def run_actor(engine: Engine, model: Any, ref: Any, batch: Batch, recipe: Recipe, *,
              rec: Recorder, rounds: Iterable[int], restore: Restore | None = None,
              after_round: RoundHook | None = None, capture: Capture = _no_capture,
              whole_mask: Tensor | None = None, rows: slice | None = None,
              ) -> dict[str, Any]:
    """The Actor's rounds (PPO / GRPO clipped surrogate, KL to the reference, entropy bonus).

    Args:
        engine: the role's engine parts.
        model: the placed Actor (what :meth:`Engine.logprobs_and_entropy` takes).
        ref: the placed reference policy.
        batch: this rank's rows of the batch (all of it without data parallelism), on the
            engine's device.
        recipe: the contract's algorithm and optimizer.
        rec: where the role's outputs go.
        rounds: the rounds to run (all, or those after a resumed checkpoint).
        restore: a resumed launch's checkpoint load, called after the padding rerun; it
            returns ``old_logprobs``, ``w_behav``, ``w_raw``.
        after_round: called after each round's step with that state.
        capture: context around each micro-batch's forward and backward.
        whole_mask: the whole batch's ``[B, R]`` mask (default ``batch.mask``): the loss
            denominators are the whole batch's.
        rows: this rank's rows of the whole batch (default all).

    Before the padding rerun's ``after_scoring``, when round 1 is among ``rounds``, the
    Actor's initial-weights distributions are recorded (:func:`record_distribution`); a
    resumed launch (``rounds`` without round 1) records none: its round-1 outputs are the
    save launch's.

    Returns:
        Role meta: ``loss_agg_mode``, ``valid_tokens``, ``micro_batches``,
        ``distribution`` (:func:`record_distribution`'s, or ``not_recorded``) and, for
        decoupled PPO, ``behavior_weight`` statistics per round.
    """
    dev = engine.device
    slices = micro_slices(batch.input_ids.shape[0], recipe.micro_batch_size)
    b, r_len = batch.responses.shape
    with rec.timed("scoring_s"), torch.no_grad():
        ref_lp = torch.zeros(b, r_len, device=dev)
        padded = torch.zeros(b, r_len, device=dev)
        for s in slices:
            ref_lp[s] = engine.logprobs_and_entropy(ref, batch.rows(s))[0]
            padded[s] = engine.logprobs_and_entropy(
                model, batch.rows(s).right_padded(EXTRA_RIGHT_PADDING, engine.pad_token_id))[0]
        rounds = list(rounds)
        distribution: dict[str, Any] = {"not_recorded": RESUMED_WITHOUT_ROUND1}
        if 1 in rounds:
            distribution = record_distribution(engine, model, batch, recipe, rec=rec,
                                               slices=slices)
        engine.after_scoring([ref, model])
        rec.put(1, "logprobs_padded", engine.gather_rows(torch.where(batch.mask, padded, 0.0)))
    mask = batch.mask if whole_mask is None else whole_mask
    full_w, denom = losses.aggregation_terms(mask, recipe.loss_agg_mode)
    row_w = full_w.to(dev)[slice(None) if rows is None else rows]
    decoupled = recipe.algorithm == "decoupled_ppo"
    old_lp = torch.zeros(b, r_len, device=dev)
    w_behav = torch.ones(b, r_len, device=dev)
    w_raw = torch.ones(b, r_len, device=dev)
    if restore is not None:
        state = restore()
        old_lp, w_behav, w_raw = state["old_logprobs"], state["w_behav"], state["w_raw"]
    for round_ in rounds:
        with rec.timed(f"round{round_}_s"):
            lp_r = torch.zeros(b, r_len, device=dev)
            ent_r = torch.zeros(b, r_len, device=dev)
            sums = {"policy": 0.0, "kl": 0.0, "entropy": 0.0}
            for s in slices:
                mb = batch.rows(s)
                with capture(round_, mb):
                    lp, ent = engine.logprobs_and_entropy(model, mb)
                    old = lp.detach() if round_ == 1 else old_lp[s]
                    if decoupled and round_ == 1:  # proximal = this engine's round 1
                        assert mb.behavior_logprobs is not None
                        w_behav[s], w_raw[s] = losses.behavior_weight(
                            lp, mb.behavior_logprobs, recipe.behavior_weight_cap,
                            recipe.behavior_weight_cap_mode)
                    rw = row_w[s][:, None]
                    weight = rw * w_behav[s] if decoupled else \
                        (None if recipe.loss_agg_mode == "token-mean" else rw)
                    policy = losses.policy_loss_sum(lp, old, mb.advantages, mb.mask,
                                                    recipe.clip_ratio, weight=weight) / denom
                    kl = recipe.kl_loss_coef * losses.masked_sum(
                        losses.kl_penalty(lp, ref_lp[s], recipe.kl_loss_estimator) * rw,  # type: ignore[arg-type]
                        mb.mask) / denom
                    entropy = -recipe.entropy_coef * losses.masked_sum(ent * rw, mb.mask) / denom
                    engine.backward(actor_objective(policy, kl, entropy))
                sums["policy"] += float(policy.detach())
                sums["kl"] += float(kl.detach())
                sums["entropy"] += float(entropy.detach())
                lp_r[s] = torch.where(mb.mask, lp.detach(), 0.0)
                ent_r[s] = torch.where(mb.mask, ent.detach(), 0.0)
            if round_ == 1:
                old_lp = lp_r.clone()
            rec.put(round_, "logprobs", engine.gather_rows(lp_r))
            rec.put(round_, "entropy", engine.gather_rows(ent_r))
            sums = engine.sum_over_ranks(sums)
            for term in ("policy", "kl", "entropy"):
                rec.put(round_, f"loss/{term}", torch.tensor(sums[term]))
            rec.put(round_, "loss/total", torch.tensor(sum(sums.values())))
            engine.update(rec, round_, recipe.max_grad_norm)
            if after_round is not None:
                after_round(round_, {"old_logprobs": old_lp, "w_behav": w_behav,
                                     "w_raw": w_raw})
    meta: dict[str, Any] = {"loss_agg_mode": recipe.loss_agg_mode,
                            "valid_tokens": int(float(mask.sum())),
                            "micro_batches": len(slices), "distribution": distribution}
    if decoupled:  # fixed by round 1 (the proximal policy), used in every round
        stats = losses.weight_stats(engine.gather_rows(w_raw), mask.to(dev),
                                    recipe.behavior_weight_cap)
        meta["behavior_weight"] = {f"round{r}": stats for r in range(1, recipe.rounds + 1)}
    return meta


@_recording_routes
def run_critic(engine: Engine, model: Any, batch: Batch, recipe: Recipe, *, rec: Recorder,
               rounds: Iterable[int], restore: Restore | None = None,
               after_round: RoundHook | None = None, capture: Capture = _no_capture,
               whole_mask: Tensor | None = None, rows: slice | None = None,
               ) -> dict[str, Any]:
    """The Critic's rounds (clipped value loss); arguments as :func:`run_actor`.

    ``restore`` returns ``old_values``. Returns ``valid_tokens`` and ``micro_batches``.
    """
    dev = engine.device
    slices = micro_slices(batch.input_ids.shape[0], recipe.micro_batch_size)
    b, r_len = batch.responses.shape
    with rec.timed("scoring_s"), torch.no_grad():
        padded = torch.zeros(b, r_len, device=dev)
        for s in slices:
            padded[s] = engine.values(
                model, batch.rows(s).right_padded(EXTRA_RIGHT_PADDING, engine.pad_token_id))
        engine.after_scoring([model])
        rec.put(1, "values_padded", engine.gather_rows(torch.where(batch.mask, padded, 0.0)))
    old_v = torch.zeros(b, r_len, device=dev)
    mask = batch.mask if whole_mask is None else whole_mask
    full_w, denom = losses.aggregation_terms(mask, recipe.loss_agg_mode)
    row_w = full_w.to(dev)[slice(None) if rows is None else rows]
    if restore is not None:
        old_v = restore()["old_values"]
    for round_ in rounds:
        with rec.timed(f"round{round_}_s"):
            v_r = torch.zeros(b, r_len, device=dev)
            total = 0.0
            for s in slices:
                mb = batch.rows(s)
                with capture(round_, mb):
                    values = engine.values(model, mb)
                    old = values.detach() if round_ == 1 else old_v[s]
                    vw = None if recipe.loss_agg_mode == "token-mean" else row_w[s][:, None]
                    loss = losses.value_loss_sum(values, old, mb.returns, mb.mask,
                                                 recipe.value_clip, weight=vw) / denom
                    engine.backward(loss)
                total += float(loss.detach())
                v_r[s] = torch.where(mb.mask, values.detach(), 0.0)
            if round_ == 1:
                old_v = v_r.clone()
            rec.put(round_, "values", engine.gather_rows(v_r))
            total = engine.sum_over_ranks({"value": total})["value"]
            rec.put(round_, "loss/value", torch.tensor(total))
            rec.put(round_, "loss/total", torch.tensor(total))
            engine.update(rec, round_, recipe.max_grad_norm)
            if after_round is not None:
                after_round(round_, {"old_values": old_v})
    return {"valid_tokens": int(float(mask.sum())), "micro_batches": len(slices)}
