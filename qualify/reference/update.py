"""The independent reference update: Hugging Face models + ``torch.optim.AdamW``.

This is the reference path's own implementation of the update that :mod:`qualify.protocol`
specifies. It shares no numerical code with any candidate harness (a shared bug would
cancel out). One call runs ``rounds`` optimizer steps for the Actor and the Critic on the frozen
rollout and returns every metric under its protocol tensor name.

Precisions:

- ``fp32``: FP32 parameters, FP32 compute.
- ``bf16`` with ``bf16_mode="params"`` (the reference): each micro-batch runs on a BF16
  copy of the FP32 master weights; the BF16 gradients are cast to FP32 and accumulated
  into the master's ``.grad``; AdamW steps the FP32 master with FP32 state. The masters
  are the FP32 checkpoint.
- ``bf16`` with ``bf16_mode="castmasters"``: the same, with the masters born from the
  BF16-cast parameters: every trained parameter is rounded to BF16 (round to nearest even)
  and kept FP32 before the optimizer is built, as DeepSpeed's ``bf16`` engine and
  Megatron-Core's ``Float16OptimizerWithFloat16Params`` build their FP32 masters
  (:mod:`qualify.lanes`). The frozen reference policy is not rounded (its forward runs on
  a BF16 copy in both styles, the same numbers).
- ``bf16`` with ``bf16_mode="autocast"`` (a control): FP32 parameters under
  ``torch.autocast(dtype=torch.bfloat16)``; gradients land in FP32 directly.
- ``fp64`` (the ``fp64`` control of the FP32 class): the same code on FP64 copies of the
  FP32 checkpoint, FP64 compute, gradients and AdamW state; every reported tensor is
  rounded to FP32 at the end. Its distance to the FP32 reference is the reference's own
  rounding error, which the FP32 reorder controls cannot see (they share its formulas).

The optimizer: ``torch.optim.AdamW`` (``foreach=False, fused=False``) over the trained
parameters, its moments with them; or, when the placed stage keeps the state on the host
(:func:`qualify.reference.devices.optimizer_state` is ``host``), :class:`HostAdamW`: the same
AdamW per parameter on a host copy, the moments on the host (bitwise the former on host
parameters), and the sensitivity pass's copy of the parameters on the host too
(:meth:`~qualify.reference.sensitivity.LossSensitivity.grad_norm`). With the state on the
host the placed stage may also stream each parameter's gradient to the host as the backward
completes it (:func:`qualify.reference.devices.gradients` ``host``, :class:`_GradStream`;
not in runs with an ``on_round`` hook), and keep only the first gradient instead of the
moments between a parameter's first two steps (:func:`qualify.reference.devices.
round2_state` ``g1``, :class:`HostAdamW`). What a run reports is the same in all of them,
bitwise on host parameters.

Sources: PPO clipped surrogate and value clipping (Schulman et al. 2017, "Proximal Policy
Optimization Algorithms"; value clipping as in OpenAI baselines ``ppo2``), KL estimators (Schulman
2020, "Approximating KL divergence"), AdamW (Loshchilov & Hutter 2019; ``torch.optim.AdamW``),
global-norm clipping (``torch.nn.utils.clip_grad_norm_``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Literal

import torch
from torch import nn

from qualify import aggregation
from qualify.contract import Contract
from qualify.errors import ReferenceDivergedError
from qualify.lanes import Bf16Style
from qualify.protocol import param_sample_indices, tensor_name
from qualify.reference import devices as reference_devices
from qualify.reference import losses
from qualify.reference.bound_inputs import NORM_FP32_META
from qualify.reference.row_split import split_row_parallel
from qualify.reference.scoring import bf16_parameters_copy
from qualify.reference.sensitivity import LOSS_SENSITIVITY_META, LossSensitivity

Bf16Mode = Bf16Style
RoundHook = Callable[[int, nn.Module, nn.Module, "Batch", torch.Tensor], None]
"""``hook(round_, work, master, batch, old)``, called after a round's backward and before its
optimizer step: ``work`` is the module the round ran forward on (the master, or its BF16 copy),
``master`` holds the round's whole pre-clip gradient in ``.grad``, ``batch`` is the batch as the
run padded it, ``old`` the ``[B, R]`` round-1 logprobs (actor) or values (critic): clip centre."""
ProbeHook = Callable[[int, nn.Module, "Batch"], contextlib.AbstractContextManager[Any]]
"""``probe(round_, work, micro_batch)``: a context around one micro-batch's forward and backward
(``qualify diverge`` registers its module hooks on ``work`` there); it must not touch ``.grad``."""


Offsets = Mapping[int, torch.Tensor]
"""``{round: [B, R] offset}`` of the whole (unpadded) batch: added at that round to each
response token's target logit (actor) or value (critic), FP32 or FP64 (padding columns the
run adds get none). The perturbed updates of :mod:`qualify.reference.round_to_round`."""


def _offset_targets(logits: torch.Tensor, tokens: torch.Tensor,
                    offset: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[b, R, V]`` with ``offset[b, t]`` added at ``tokens[b, t]``, upcast first.

    The micro-batch's ``R`` may exceed the offset's (extra right padding): those columns
    get 0.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    full = torch.zeros(tokens.shape, dtype=z.dtype)
    full[:, :offset.shape[1]] = offset.to(z.dtype)
    return z.scatter_add(-1, tokens.unsqueeze(-1), full.unsqueeze(-1))


def _no_probe(_round: int, _work: nn.Module, _mb: Batch) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UpdateSettings:
    """How one reference (or control) update run executes.

    Attributes:
        precision: ``fp32``, ``bf16``, or ``fp64`` (the FP64 control; the caller passes
            FP64 models).
        bf16_mode: ``params`` (BF16 copy of the FP32 master, the master the checkpoint),
            ``castmasters`` (the same, the master born ``bf16(checkpoint)``) or
            ``autocast``; ignored unless bf16.
        micro_batch_size: sequences per micro-batch.
        extra_left_padding: pad columns prepended to the prompts (attention 0).
        extra_right_padding: pad columns appended to the responses (attention 0).
        row_split: compute every row-parallel projection (``o_proj``, ``down_proj``) as
            this many partial products over slices of its input features, each rounded to
            the compute dtype and summed in it (:func:`split_row_parallel`); 1: off.
        label: a name for logs (``hf-fp32``, ``attn_impl-bf16``...).
    """

    precision: Literal["fp32", "bf16", "fp64"]
    bf16_mode: Bf16Mode = "params"
    micro_batch_size: int
    extra_left_padding: int = 0
    extra_right_padding: int = 0
    row_split: int = 1
    label: str = ""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.extra_left_padding < 0 or self.extra_right_padding < 0:
            raise ValueError("extra padding must be >= 0")
        if self.row_split < 1:
            raise ValueError(f"row_split must be >= 1, got {self.row_split}")

    @property
    def accumulate_dtype(self) -> torch.dtype:
        """The dtype of per-token quantities: FP64 for the FP64 control, else FP32."""
        return torch.float64 if self.precision == "fp64" else torch.float32


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """The frozen rollout plus training inputs, as the update consumes them.

    Attributes:
        prompts: ``[B, P]`` int64, left-padded.
        responses: ``[B, R]`` int64, right-padded.
        attention_mask: ``[B, P + R]`` int64.
        response_mask: ``[B, R]`` int64.
        advantages: ``[B, R]`` float32.
        returns: ``[B, R]`` float32.
        pad_token_id: the pad id used for extra padding.
        behavior_logprobs: ``[B, R]`` float32, the sampler's logprobs (decoupled PPO's
            behavior policy); ``None`` when the algorithm does not read them.
    """

    prompts: torch.Tensor
    responses: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    pad_token_id: int
    behavior_logprobs: torch.Tensor | None = None

    def padded(self, left: int, right: int) -> Batch:
        """Return the batch with ``left`` extra prompt pad columns and ``right`` response ones."""
        if left == 0 and right == 0:
            return self
        b = self.prompts.shape[0]

        def cols(n: int, fill: int, like: torch.Tensor) -> torch.Tensor:
            return torch.full((b, n), fill, dtype=like.dtype)

        p_len, r_len = self.prompts.shape[1], self.responses.shape[1]
        am_prompt, am_resp = self.attention_mask[:, :p_len], self.attention_mask[:, p_len:]
        assert am_resp.shape[1] == r_len
        return dataclasses.replace(
            self,
            prompts=torch.cat([cols(left, self.pad_token_id, self.prompts), self.prompts], 1),
            responses=torch.cat([self.responses, cols(right, self.pad_token_id, self.responses)],
                                1),
            attention_mask=torch.cat(
                [cols(left, 0, am_prompt), am_prompt, am_resp, cols(right, 0, am_resp)], 1),
            response_mask=torch.cat([self.response_mask, cols(right, 0, self.response_mask)], 1),
            advantages=torch.cat([self.advantages, torch.zeros(b, right)], 1),
            returns=torch.cat([self.returns, torch.zeros(b, right)], 1),
            behavior_logprobs=None if self.behavior_logprobs is None else torch.cat(
                [self.behavior_logprobs, torch.zeros(b, right)], 1),
        )

    def micro_batches(self, size: int) -> Iterator[tuple[slice, Batch]]:
        """Yield ``(row slice, sub-batch)`` of at most ``size`` sequences, in order."""
        n = self.prompts.shape[0]
        for start in range(0, n, size):
            s = slice(start, min(start + size, n))
            yield s, dataclasses.replace(
                self,
                prompts=self.prompts[s],
                responses=self.responses[s],
                attention_mask=self.attention_mask[s],
                response_mask=self.response_mask[s],
                advantages=self.advantages[s],
                returns=self.returns[s],
                behavior_logprobs=None if self.behavior_logprobs is None
                else self.behavior_logprobs[s],
            )


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)


def _forward_response_outputs(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Model output at the positions that predict / evaluate each response token.

    Returns:
        ``[b, R, D]`` where ``D`` is the vocabulary (causal LM) or 1 (critic): the output at
        sequence position ``P - 1 + t`` for response position ``t`` (protocol convention).
    """
    input_ids = torch.cat([batch.prompts, batch.responses], dim=1)
    out = model(input_ids=input_ids, attention_mask=batch.attention_mask,
                position_ids=_positions(batch.attention_mask), use_cache=False)
    logits: torch.Tensor = out.logits
    p_len, r_len = batch.prompts.shape[1], batch.responses.shape[1]
    return logits[:, p_len - 1 : p_len - 1 + r_len]


def _token_logprobs_entropy(logits: torch.Tensor, tokens: torch.Tensor,
                            temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(logits / T)`` of ``tokens`` and the entropy, both ``[b, R]``.

    The logits are upcast to FP32 first (the reference's choice, as HF's loss does); FP64
    logits (the FP64 control) stay FP64.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = torch.gather(logp_all, -1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _policy_loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                 mask: torch.Tensor, contract: Contract) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, R] per-token policy loss, [B, R] clipped)`` of the contract's ``policy_loss``.

    :mod:`qualify.reference.losses`; ``clipped`` marks the tokens whose clip is active
    (the clipped surrogate strictly wins, or CISPO's weight differs from the ratio).
    """
    alg = contract.algorithm
    if alg.policy_loss == "cispo":
        ratio = torch.exp(logp - old).detach()
        clipped = (ratio < 1 - alg.clip_low) | (ratio > 1 + alg.clip_high)
        return losses.cispo(logp, old, adv, clip_low=alg.clip_low,
                            clip_high=alg.clip_high), clipped
    if alg.policy_loss == "gspo":
        m = mask.to(logp.dtype)
        s = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None].detach()
        clipped = (-adv * torch.clamp(s, 1 - alg.clip_low, 1 + alg.clip_high)) > -adv * s
        return losses.gspo(logp, old, adv, mask, clip_low=alg.clip_low,
                           clip_high=alg.clip_high), clipped
    ratio = torch.exp(logp - old).detach()
    clipped = (-adv * torch.clamp(ratio, 1 - alg.clip_low, 1 + alg.clip_high)) > -adv * ratio
    return losses.ppo_clip(logp, old, adv, clip_low=alg.clip_low, clip_high=alg.clip_high,
                           clip_c=alg.clip_ratio_c), clipped


def _aggregation(batch: Batch, contract: Contract,
                 dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """``([B] row weight, denominator)`` of the contract's ``loss_agg_mode`` on ``batch``.

    :func:`qualify.aggregation.aggregation_terms` of the whole (padded) batch's mask: a
    micro-batch's term is ``Σ m x row_weight[b] / denominator``, global denominators.
    """
    row, denom = aggregation.aggregation_terms(batch.response_mask.numpy(),
                                               contract.algorithm.loss_agg_mode,
                                               contract.algorithm.loss_scale_factor)
    return torch.from_numpy(row).to(dtype), denom


class _Precision:
    """Forward/backward at the requested precision around an FP32 master model."""

    def __init__(self, master: nn.Module, settings: UpdateSettings) -> None:
        self.master = master
        self.settings = settings
        self.work: nn.Module | None = None
        if settings.row_split > 1:
            split_row_parallel(master, settings.row_split)

    @property
    def bf16_params(self) -> bool:
        return self.settings.precision == "bf16" and self.settings.bf16_mode != "autocast"

    def birth_masters(self) -> None:
        """Round the trained master to BF16 in place (``castmasters``; else nothing).

        The FP32 masters of the ``castmasters`` style are born from the BF16-cast
        parameters: ``p.bfloat16().float()`` of every parameter, buffers untouched.
        """
        if self.settings.precision == "bf16" and self.settings.bf16_mode == "castmasters":
            with torch.no_grad():
                for p in self.master.parameters():
                    p.copy_(p.to(torch.bfloat16).to(p.dtype))

    def refresh(self) -> nn.Module:
        """The module to run forward on: the master, or a BF16 copy of its current values.

        The copy has BF16 parameters and FP32 buffers
        (:func:`qualify.reference.scoring.bf16_parameters_copy`: the rotary ``inv_freq`` is
        not rounded, as in Hugging Face's own BF16 model). It is made once per run; each
        later refresh rounds the master's current parameters into it (the same values a new
        copy would hold; its gradients were moved to the master by :meth:`collect_grads`).
        """
        if not self.bf16_params:
            return self.master
        if self.work is None:
            self.work = bf16_parameters_copy(self.master)
        else:  # the same copy, its parameters re-rounded from the master (no module copy)
            with torch.no_grad():
                for p_work, p_master in zip(self.work.parameters(), self.master.parameters(),
                                            strict=True):
                    p_work.data = p_master.data.to(torch.bfloat16)
        return self.work

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """BF16 autocast on the master's device type in the ``autocast`` style, else none."""
        if self.settings.precision == "bf16" and self.settings.bf16_mode == "autocast":
            device = next(self.master.parameters()).device.type
            return torch.autocast(device_type=device, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def collect_grads(self) -> None:
        """Accumulate the BF16 working copy's gradients into the master's FP32 ``.grad``."""
        if not self.bf16_params:
            return
        assert self.work is not None
        for (name, p_master), (name_w, p_work) in zip(
            self.master.named_parameters(), self.work.named_parameters(), strict=True
        ):
            assert name == name_w
            if p_work.grad is None:
                continue
            g = p_work.grad.to(torch.float32)
            p_master.grad = g if p_master.grad is None else p_master.grad + g
            p_work.grad = None


class _GradStream:
    """Each parameter's gradient moved to the host as the backward completes it.

    A ``register_post_accumulate_grad_hook`` on every trained parameter of the module the
    run's backward goes through (the master, or the BF16 working copy of the ``bf16`` lanes)
    copies the gradient autograd has just accumulated into ``.grad`` to the host, casts it to
    the master's dtype there (BF16 to FP32: exact), adds it to the host accumulator of that
    parameter (the first micro-batch's gradient is taken as is) and drops ``.grad``. So the
    devices hold at most the gradient being accumulated (one parameter's, in the backward's
    dtype) and the host the round's whole gradient, in the master's dtype. The accumulation
    is the same elementwise IEEE sum of the same micro-batch gradients in the same order as
    autograd's own ``.grad`` accumulation (FP32 / FP64 lanes) or
    :meth:`_Precision.collect_grads` (BF16 copy): bitwise the unstreamed gradient. Autograd
    calls the hook once per parameter and backward (a tied weight's two uses are summed
    before it). The readers of the round's gradient then run where it is, on the host: on
    ``cpu`` devices the same arithmetic as unstreamed; on CUDA the norm's reductions run on
    the host instead of the devices (as in the unplaced stage), so its last bits may differ
    from an unstreamed CUDA run's.

    Attributes:
        grads: ``{parameter name: host gradient}`` of the round so far (a name absent: no
            gradient reached that parameter yet).
        calls: the hooks run so far (a test's proof that the streaming was taken).
    """

    def __init__(self, master: nn.Module) -> None:
        self._dtypes = {n: p.dtype for n, p in master.named_parameters() if p.requires_grad}
        self._names = {p: n for n, p in master.named_parameters()}
        self.grads: dict[str, torch.Tensor] = {}
        self.calls = 0
        self._attached: nn.Module | None = None
        self._handles: list[Any] = []

    def attach(self, module: nn.Module) -> None:
        """Hook ``module``'s trained parameters (named as the master's); once per module."""
        if module is self._attached:
            return
        self.close()
        for n, p in module.named_parameters():
            if n in self._dtypes and p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(n)))
        self._attached = module

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        dtype = self._dtypes[name]

        def hook(p: torch.Tensor) -> None:
            assert p.grad is not None
            g = p.grad.detach().to("cpu", copy=True).to(dtype)
            p.grad = None
            prev = self.grads.get(name)
            self.grads[name] = g if prev is None else prev + g
            self.calls += 1

        return hook

    def grad_of(self, p: nn.Parameter) -> torch.Tensor | None:
        """The master parameter ``p``'s host gradient of the round (``None``: none yet)."""
        return self.grads.get(self._names[p])

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._attached = None


def _stream(master: nn.Module, on_round: RoundHook | None) -> _GradStream | None:
    """The run's :class:`_GradStream` when the active devices stream the gradients.

    :func:`qualify.reference.devices.gradients` ``host`` (which implies the AdamW state on
    the host) and no ``on_round`` hook: the clip-branch reruns' hook reads the round's
    gradient beside each token's ``J_t`` on the parameters' devices, so those runs keep
    ``.grad`` there. ``None``: the gradients accumulate in ``.grad``.
    """
    if on_round is not None or reference_devices.gradients() != "host":
        return None
    return _GradStream(master)


def _grad_norm_and_clip(params: list[tuple[str, nn.Parameter]], max_norm: float,
                        grads: Mapping[str, torch.Tensor] | None = None,
                        ) -> tuple[float, float, float]:
    """Pre-clip global L2 norm (accumulated in FP64) and the clip coefficient; scales grads.

    The gradients are each parameter's ``.grad`` or, when ``grads`` is given, ``grads[name]``
    (the host copies of a streamed run, :class:`_GradStream`), scaled in place either way.

    ``clip_coef = min(1, max_norm / (norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_``.

    Returns:
        ``(norm, clip_coef, norm_fp32)``: ``norm_fp32`` is the same pre-clip norm evaluated
        in FP32 the way ``torch.nn.utils.clip_grad_norm_`` (``foreach=False``) does, an
        FP32 ``vector_norm`` per gradient and then of the stacked per-tensor norms
        (``torch/nn/utils/clip_grad.py`` ``_get_total_norm``). Its distance to ``norm`` is
        the FP32 evaluation error of a norm over these gradients, which the FP64-accumulated
        ``norm`` (and every control built on it) does not have and an engine's FP32 norm
        does (:func:`qualify.bounds.scalar_resolutions`).
    """
    given = [p.grad if grads is None else grads.get(n) for n, p in params]
    total = 0.0
    per_tensor: list[torch.Tensor] = []
    for grad in given:
        if grad is not None:
            g = grad.detach()
            total += float(g.double().square().sum())
            per_tensor.append(torch.linalg.vector_norm(g.float(), 2.0))
    norm = total**0.5
    # on the first gradient's device, as torch's _get_total_norm stacks them (placed models)
    norm_fp32 = float(torch.linalg.vector_norm(torch.stack(
        [t.to(per_tensor[0].device) for t in per_tensor]), 2.0)) if per_tensor else 0.0
    coef = min(1.0, max_norm / (norm + 1e-6))
    for grad in given:
        if grad is not None:
            grad.mul_(coef)
    return norm, coef, norm_fp32


def with_rollout_rows(contract: Contract, batch: Batch, vocab_size: int) -> Contract:
    """``contract`` whose sampling also stores the rows of every token id of ``batch``.

    The ids are every entry of ``batch.prompts`` and ``batch.responses`` before any extra
    padding (the rollout as staged, as :func:`qualify.sampling.rollout_sampling` reads it for
    the harnesses; :meth:`qualify.protocol.ParamSampling.with_rows`).

    Raises:
        ValueError: an id outside ``[0, vocab_size)``.
    """
    ids = torch.cat([batch.prompts.reshape(-1), batch.responses.reshape(-1)]).cpu().numpy()
    return dataclasses.replace(contract, evidence=contract.evidence.with_rows(ids, vocab_size))


def _step(role: str, round_: int, master: nn.Module, contract: Contract, *,
          optim: Optimizer, out: dict[str, torch.Tensor],
          grad_dtypes: set[str], norm_evals: dict[str, float],
          stream: _GradStream | None = None) -> float:
    """Record grads (and their dtype), clip, AdamW step, record state and updates.

    The gradients are the parameters' ``.grad`` or, with ``stream``, its host copies (the
    device holds none); a parameter without one steps with zeros, as before, and ``stream``
    is emptied after the step.

    The step's lr is the contract's schedule at optimizer step ``round_`` (1-based,
    :meth:`qualify.contract.OptimizerSpec.lr`, the formula of :mod:`qualify.schedule`), set
    on every param group before ``optim.step()``; it is returned so the run seals it.
    ``norm_evals[f"round{round_}"]`` receives the FP32 evaluation of the pre-clip norm
    (:func:`_grad_norm_and_clip`). After the step, before the gradients are dropped, the
    devices' memory is noted (:func:`qualify.reference.devices.note_step`).
    """
    params = [(n, p) for n, p in master.named_parameters() if p.requires_grad]
    grads = None if stream is None else stream.grads
    grad_dtypes.update(str(g.dtype) for g in ([p.grad for _, p in params] if grads is None
                                              else grads.values()) if g is not None)

    # The reported elements (exact, or the protocol's sample of a large parameter), found
    # once per parameter: of the grads and the moments, and of the pre-step weights, so that
    # the update is the same elementwise difference in the parameter's dtype without a second
    # copy of the model at the peak.
    picks = {n: param_sample_indices(n, p.numel(), contract.evidence) for n, p in params}

    def picked(n: str, t: torch.Tensor) -> torch.Tensor:
        idx = picks[n]
        return t.detach() if idx is None else t.detach().reshape(-1)[torch.from_numpy(idx)]

    def reported(n: str, t: torch.Tensor) -> torch.Tensor:
        # sealed on the host (a placed model's tensors live on its devices)
        return picked(n, t).float().cpu().clone()

    for n, p in params:
        if grads is not None:
            if n not in grads:
                grads[n] = torch.zeros_like(p, device="cpu")
            g = grads[n]
        else:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad
        out[tensor_name(round_, role, "grads", n)] = reported(n, g)
    norm, coef, norm_fp32 = _grad_norm_and_clip(params, contract.optimizer.max_grad_norm,
                                                grads)
    norm_evals[f"round{round_}"] = norm_fp32
    out[tensor_name(round_, role, "grad_norm")] = torch.tensor(norm, dtype=torch.float32)
    out[tensor_name(round_, role, "clip_coef")] = torch.tensor(coef, dtype=torch.float32)
    before = {n: picked(n, p).clone() for n, p in params}
    lr = contract.optimizer.lr(role, round_)
    for group in optim.param_groups:
        group["lr"] = lr
    if grads is not None:
        assert isinstance(optim, HostAdamW)  # streaming implies the host state
        optim.step([grads[n] for n, _ in params])
    else:
        optim.step()

    def held() -> list[tuple[str, int]]:  # what each parameter keeps on its device
        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        return [(n, size(p) + size(p.grad) + (0 if isinstance(optim, HostAdamW) else sum(
            size(v) for k, v in _moments(optim, p).items() if k != "step"))) for n, p in params]

    reference_devices.note_step(role, held)
    optim.zero_grad(set_to_none=True)
    if stream is not None:
        stream.grads.clear()
    for n, p in params:
        state = _moments(optim, p)
        out[tensor_name(round_, role, "exp_avg", n)] = reported(n, state["exp_avg"])
        out[tensor_name(round_, role, "exp_avg_sq", n)] = reported(n, state["exp_avg_sq"])
        out[tensor_name(round_, role, "updates", n)] = (picked(n, p) - before[n]).float().cpu()
    return lr


def _run_meta(master: nn.Module, optim: Optimizer, grad_dtypes: set[str],
              compute_dtypes: set[str], settings: UpdateSettings) -> dict[str, Any]:
    """Dtypes observed in one role's run (master weights, gradients, state, compute)."""
    return {
        "master_weights": str(next(master.parameters()).dtype),
        "grads": sorted(grad_dtypes)[0] if len(grad_dtypes) == 1 else sorted(grad_dtypes),
        "optimizer_state": _state_dtypes(optim),
        "compute": sorted(compute_dtypes),
        "bf16_mode": settings.bf16_mode if settings.precision == "bf16" else None,
    }


class HostAdamW:
    """``torch.optim.AdamW`` with each parameter's moments on the host, one parameter a step.

    Each parameter has its own ``torch.optim.AdamW`` (``foreach=False, fused=False``, the
    settings of the reference's optimizer) over one host tensor, its *slot*. :meth:`step`
    takes the parameters in order: the parameter's value and its ``.grad`` are copied to the
    host into the slot, that optimizer steps it (torch's single-tensor AdamW arithmetic, on
    the host, with the moments and the step count it keeps for that parameter), the value is
    copied back into the parameter, and the slot is emptied. So the host holds the moments of
    every parameter (``2 x`` the model in the master's dtype) and one parameter's value and
    gradient at a time; the devices hold neither. ``torch.optim.AdamW`` over all the
    parameters runs the same per-parameter arithmetic in the same order (its single-tensor
    loop), so on host parameters the values are bitwise those of :func:`_adamw`'s optimizer.

    With ``keep="g1"`` a parameter's state between its first and second step is its first
    step's gradient ``g1`` alone (one copy of the parameter instead of two): after one step
    from zero state torch's moments are ``lerp_(g1, 1 - b1)`` and ``addcmul_(g1, g1, value=1 -
    b2)`` of zeros, so the second step rebuilds them with those operations (and the
    step count 1) for that parameter and steps: bitwise the kept moments
    (``tests/test_scale_plan.py`` proves the arithmetic; ``tests/test_round2_g1.py`` this
    class). From the second step on the moments are kept as with ``keep="moments"``.
    :meth:`moments` between the steps returns the rebuilt ones.

    Attributes:
        params: the trained parameters, in the order given.
        param_groups: one group per parameter (its optimizer's), ``lr`` settable as on a
            ``torch.optim.AdamW``.
        keep: ``moments`` or ``g1`` (what a parameter keeps between its first two steps).

    Raises:
        ValueError: ``keep`` is neither.
    """

    def __init__(self, params: list[nn.Parameter], *, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float,
                 keep: str = "moments") -> None:
        if keep not in reference_devices.ROUND2_STATES:
            raise ValueError(f"HostAdamW: keep {keep!r}, expected one of "
                             f"{reference_devices.ROUND2_STATES}")
        self.params = list(params)
        self.keep = keep
        self._betas = betas
        self._slots = [torch.empty(0, dtype=p.dtype) for p in self.params]
        self._optims = [torch.optim.AdamW([s], lr=lr, betas=betas, eps=eps,
                                          weight_decay=weight_decay, foreach=False, fused=False)
                        for s in self._slots]
        self._g1: list[torch.Tensor | None] = [None] * len(self.params)
        self.param_groups = [g for o in self._optims for g in o.param_groups]

    def _rebuilt(self, g1: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state torch's AdamW holds after one step from zero state with gradient ``g1``.

        Rebuilt with the very operations of torch's single-tensor AdamW on zero state
        (``exp_avg.lerp_(g, 1 - b1)``; ``exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)``),
        so it is bitwise that state, the sign of a zero included (``(1 - b1) * g1`` would
        keep a ``-0.0`` that ``lerp_`` from ``+0.0`` does not).
        """
        b1, b2 = self._betas
        exp_avg = torch.zeros_like(g1, memory_format=torch.preserve_format).lerp_(g1, 1 - b1)
        exp_avg_sq = torch.zeros_like(g1, memory_format=torch.preserve_format)
        exp_avg_sq.mul_(b2).addcmul_(g1, g1, value=1 - b2)
        return {"step": torch.tensor(1.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}

    def step(self, grads: list[torch.Tensor | None] | None = None) -> None:
        """One AdamW step of every parameter that has a gradient (torch skips the others).

        Args:
            grads: each parameter's gradient, in :attr:`params`' order (a streamed run's host
                copies, :class:`_GradStream`); ``None``: each parameter's ``.grad``.

        Raises:
            ValueError: ``grads`` is not one per parameter.
        """
        if grads is not None and len(grads) != len(self.params):
            raise ValueError(f"HostAdamW.step: {len(grads)} gradients for "
                             f"{len(self.params)} parameters")
        given = [p.grad for p in self.params] if grads is None else grads
        for i, (p, grad, slot, optim) in enumerate(zip(self.params, given, self._slots,
                                                       self._optims, strict=True)):
            if grad is None:
                continue
            slot.data = p.detach().to("cpu", copy=True)
            slot.grad = grad.detach().to("cpu", copy=True)
            g1 = self._g1[i]
            if g1 is not None:  # keep="g1", its second step: the moments from g1
                optim.state[slot] = self._rebuilt(g1)
                self._g1[i] = None
            first = slot not in optim.state
            optim.step()
            with torch.no_grad():
                p.copy_(slot)
            if first and self.keep == "g1":
                self._g1[i] = slot.grad
                del optim.state[slot]
            slot.grad = None
            slot.data = torch.empty(0, dtype=p.dtype)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (``set_to_none``) or zero every parameter's ``.grad``, as torch's optimizers."""
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def moments(self, p: nn.Parameter) -> dict[str, torch.Tensor]:
        """``p``'s AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``), host tensors.

        Raises:
            KeyError: ``p`` is not one of :attr:`params`, or has not been stepped.
        """
        for q, slot, optim, g1 in zip(self.params, self._slots, self._optims, self._g1,
                                      strict=True):
            if q is p:
                if g1 is not None:
                    return self._rebuilt(g1)
                if slot not in optim.state:  # not ``optim.state[slot]``: a defaultdict
                    raise KeyError("HostAdamW.moments: a parameter not stepped yet")
                return dict(optim.state[slot])
        raise KeyError("HostAdamW.moments: not one of its parameters")

    def state_dtypes(self) -> set[tuple[str, torch.dtype]]:
        """``(moment, dtype)`` of every parameter stepped so far, nothing rebuilt.

        A parameter that keeps ``g1`` reports ``g1``'s dtype (its rebuilt moments have it),
        so no moment is allocated to read a dtype.
        """
        out: set[tuple[str, torch.dtype]] = set()
        for s, o, g1 in zip(self._slots, self._optims, self._g1, strict=True):
            if g1 is not None:
                out |= {("exp_avg", g1.dtype), ("exp_avg_sq", g1.dtype)}
            elif s in o.state:
                out |= {(k, o.state[s][k].dtype) for k in ("exp_avg", "exp_avg_sq")}
        return out

    def states(self) -> list[dict[str, torch.Tensor]]:
        """The AdamW state of every parameter stepped so far (rebuilt from ``g1`` where kept)."""
        return [self._rebuilt(g1) if g1 is not None else dict(o.state[s])
                for s, o, g1 in zip(self._slots, self._optims, self._g1, strict=True)
                if g1 is not None or s in o.state]


Optimizer = torch.optim.Optimizer | HostAdamW
"""The update's optimizer: ``torch.optim.AdamW`` over the parameters, or :class:`HostAdamW`."""


def _adamw(master: nn.Module, lr: float, contract: Contract, *,
           host: bool = False) -> Optimizer:
    """The run's AdamW: over the parameters (``host`` false) or with its state on the host.

    ``host``: :class:`HostAdamW` (the placed stage's ``optimizer_state = "host"``,
    :func:`qualify.reference.devices.optimizer_state`), keeping ``g1`` instead of the
    moments between the first two steps when :func:`qualify.reference.devices.round2_state`
    says so.
    """
    o = contract.optimizer
    params = [p for p in master.parameters() if p.requires_grad]
    if host:
        return HostAdamW(params, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                         keep=reference_devices.round2_state())
    return torch.optim.AdamW(
        params, lr=lr, betas=o.betas, eps=o.eps,
        weight_decay=o.weight_decay, foreach=False, fused=False,
    )


def _moments(optim: Optimizer, p: nn.Parameter) -> dict[str, torch.Tensor]:
    """``p``'s AdamW state in ``optim``."""
    if isinstance(optim, HostAdamW):
        return optim.moments(p)
    return optim.state[p]


def _state_dtypes(optim: Optimizer) -> dict[str, str]:
    pairs = optim.state_dtypes() if isinstance(optim, HostAdamW) else {
        (key, state[key].dtype) for state in optim.state.values()
        for key in ("exp_avg", "exp_avg_sq")}
    dtypes = {f"{key}:{dtype}" for key, dtype in pairs}
    return {d.split(":")[0]: d.split(":")[1] for d in sorted(dtypes)}


def _kl_reference_logprobs(ref: nn.Module, batch: Batch, temperature: float,
                           settings: UpdateSettings) -> torch.Tensor:
    """The KL reference policy's response logprobs on the (already padded) ``batch``.

    Returns:
        ``[B, R]`` in ``settings.accumulate_dtype``: each micro-batch's forward at the run's
        precision (:class:`_Precision` of ``ref``, no master rounding), no gradient.
    """
    b, r_len = batch.responses.shape
    out = torch.zeros(b, r_len, dtype=settings.accumulate_dtype)
    ref_prec = _Precision(ref, settings)
    with torch.no_grad():
        ref_model = ref_prec.refresh()
        for s, mb in batch.micro_batches(settings.micro_batch_size):
            with ref_prec.autocast():
                lg = _forward_response_outputs(ref_model, mb)
            out[s] = _token_logprobs_entropy(lg, mb.responses, temperature)[0]
    return out


def kl_reference_logprobs(ref: nn.Module, batch: Batch, contract: Contract,
                          settings: UpdateSettings) -> torch.Tensor:
    """The KL reference logprobs :func:`run_actor` computes from ``ref`` before round 1.

    For callers that run several actor updates on one batch and settings (the perturbed
    updates of :mod:`qualify.reference.round_to_round`): passed back as ``ref_logprobs``,
    they spare each run the reference policy's forward, bit for bit.

    Args:
        ref: the frozen reference policy, as :func:`run_actor` takes it; its values are not
            modified (with ``settings.row_split > 1`` its row-parallel projections are split,
            as :func:`run_actor` splits them).
        batch: the unpadded batch :func:`run_actor` is given.
        contract: supplies the sampling temperature.
        settings: the run's settings (precision, micro-batching, padding).

    Returns:
        ``[B, R + extra_right_padding]`` (left padding goes before the prompt),
        ``settings.accumulate_dtype``.
    """
    padded = batch.padded(settings.extra_left_padding, settings.extra_right_padding)
    return _kl_reference_logprobs(ref, padded, contract.sampling.temperature, settings)


def reference_policy(actor_dir: Path, attn: str, *, fp64: bool = False) -> nn.Module:
    """The frozen reference policy: the Actor's checkpoint in ``actor_dir``.

    FP32 (FP64 for the FP64 control), attention ``attn``, no gradients, placed as the stage
    places models (:func:`qualify.reference.devices.load_role`).
    """
    ref = reference_devices.load_role("actor", actor_dir, dtype=torch.float32,
                                      attn_implementation=attn, requires_grad=False)
    return ref.double() if fp64 else ref


KL_REFERENCE_SOURCE: Final[dict[str, str]] = {
    "source": "reference_policy_forward", "taken": "before_actor_load",
    "settings": "the_run_own"}
"""Where each update run's KL reference logprobs came from (the reference document's
``update_meta[run]["kl_reference"]``): a forward of the frozen reference policy under that
run's own settings and attention (:func:`kl_reference_before_load`), taken before its Actor
is loaded and freed before the update; not reused from scoring."""


def kl_reference_before_load(contract: Contract, actor_dir: Path, batch: Batch,
                             settings: UpdateSettings, attn: str) -> torch.Tensor:
    """The KL reference logprobs of one Actor update run, with no trained model loaded.

    Loads the frozen reference policy (:func:`reference_policy`, FP64 in the ``fp64``
    control), takes :func:`kl_reference_logprobs` of ``batch`` under ``settings``
    (precision and BF16 style, micro-batches, extra padding, ``row_split``) with attention
    ``attn``, and drops the policy before returning: the ``ref_logprobs``
    :func:`run_actor` computes from that policy itself, bit for bit, so the update that
    follows holds no second model. Used by every Actor update of the stage (lanes,
    controls, round-to-round runs) and by the clip-branch reruns
    (:mod:`qualify.reference.branches`).

    Returns:
        ``[B, R + extra_right_padding]`` in ``settings.accumulate_dtype``.
    """
    ref = reference_policy(actor_dir, attn, fp64=settings.precision == "fp64")
    return kl_reference_logprobs(ref, batch, contract, settings)


def run_actor(actor: nn.Module, ref: nn.Module | None, batch: Batch, contract: Contract,
              settings: UpdateSettings, *, on_round: RoundHook | None = None,
              probe: ProbeHook = _no_probe, offsets: Offsets | None = None,
              last_forward: int | None = None, ref_logprobs: torch.Tensor | None = None,
              ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Run ``rounds`` PPO actor steps on ``batch`` (protocol semantics).

    Args:
        actor: FP32 ``*ForCausalLM`` (the master; updated in place, and first rounded to
            BF16 in place under ``bf16_mode="castmasters"``).
        ref: FP32 frozen reference policy (same architecture). Used only for the KL
            reference logprobs before round 1; the function drops its references to it (and
            to its BF16 copy) then, so a caller that passes it without keeping one frees
            its memory for the rounds (:mod:`qualify.reference.stage` does). ``None`` when
            ``ref_logprobs`` is given.
        batch: the rollout and training inputs.
        contract: supplies temperature, clip ratio, KL/entropy coefficients, AdamW settings.
        settings: precision, micro-batching and padding of this run.
        on_round: optional :data:`RoundHook` (the sealed clip-branch contributions of
            :mod:`qualify.reference.branches` use it); it must not touch ``.grad``.
        probe: a :data:`ProbeHook` around each micro-batch's forward and backward.
        offsets: :data:`Offsets`: at the rounds it names, ``offsets[r][b, t]`` is added to
            the logit of response token ``t`` of row ``b`` (its target) before the logprob
            and the entropy are taken (:mod:`qualify.reference.round_to_round`).
        last_forward: stop after this round's forward: its per-token tensors and losses
            are returned, its backward and step are not run, and no round records the
            sensitivities (the perturbed updates of :mod:`qualify.reference.round_to_round`
            need only those tensors); ``None``: every round in full.
        ref_logprobs: the KL reference logprobs of this batch and settings
            (:func:`kl_reference_logprobs`); ``None``: computed from ``ref``. When given,
            ``ref`` is not run (pass ``None``).

    Returns:
        ``(tensors, meta)``: tensors under protocol names (``round{r}/actor/...``), FP32 CPU;
        meta with the observed dtypes (master weights, gradients, optimizer state, compute).

    Raises:
        ValueError: neither ``ref`` nor ``ref_logprobs``; ``ref_logprobs`` of another shape
            or dtype than this batch's; a decoupled PPO or rollout-corrected run whose batch
            has no behavior logprobs.
    """
    alg, temp = contract.algorithm, contract.sampling.temperature
    config: Any = actor.config
    contract = with_rollout_rows(contract, batch, int(config.vocab_size))
    batch = batch.padded(settings.extra_left_padding, settings.extra_right_padding)
    n_valid = float(batch.response_mask.sum())
    out: dict[str, torch.Tensor] = {}
    prec = _Precision(actor, settings)
    prec.birth_masters()
    host_state = reference_devices.optimizer_state() == "host"
    optim = _adamw(actor, contract.optimizer.actor_lr, contract, host=host_state)
    stream = _stream(actor, on_round)
    b, r_len = batch.responses.shape
    acc = settings.accumulate_dtype
    row_w, denom = _aggregation(batch, contract, acc)
    decoupled = alg.name == "decoupled_ppo"
    if (decoupled or alg.rollout_is is not None) and batch.behavior_logprobs is None:
        raise ValueError(f"{alg.name} with rollout correction: the batch has no "
                         "behavior_logprobs")
    weights, raw_weights = torch.ones(2, b, r_len, dtype=acc).unbind(0)
    old_logp = torch.zeros(b, r_len, dtype=acc)
    compute_dtypes: set[str] = set()
    grad_dtypes: set[str] = set()
    norm_evals: dict[str, float] = {}
    clip_fraction: dict[str, float] = {}
    lrs: dict[str, float] = {}
    sens = LossSensitivity()
    if ref_logprobs is None:
        if ref is None:
            raise ValueError("run_actor: give the reference policy (ref) or its KL "
                             "reference logprobs (ref_logprobs)")
        ref_logp = _kl_reference_logprobs(ref, batch, temp, settings)
    elif ref_logprobs.shape != (b, r_len) or ref_logprobs.dtype != acc:
        raise ValueError(f"ref_logprobs: {tuple(ref_logprobs.shape)} {ref_logprobs.dtype}, "
                         f"expected {(b, r_len)} {acc} (kl_reference_logprobs of this batch)")
    else:
        ref_logp = ref_logprobs
    del ref  # freed here unless the caller holds the reference policy
    for round_ in range(1, alg.rounds + 1):
        model = prec.refresh()
        model.eval()  # dropout off (protocol); autograd works in eval mode
        if stream is not None:
            stream.attach(model)
        logp_r, ent_r = torch.zeros(b, r_len, dtype=acc), torch.zeros(b, r_len, dtype=acc)
        sums = {"policy": 0.0, "kl": 0.0, "entropy": 0.0}
        clipped_tokens = 0.0
        for s, mb in batch.micro_batches(settings.micro_batch_size):
            mask = mb.response_mask.float()
            with probe(round_, model, mb):
                with prec.autocast():
                    lg = _forward_response_outputs(model, mb)
                compute_dtypes.add(str(lg.dtype))
                if offsets is not None and round_ in offsets:
                    lg = _offset_targets(lg, mb.responses, offsets[round_][s])
                logp, ent = _token_logprobs_entropy(lg, mb.responses, temp)
                old = logp.detach() if round_ == 1 else old_logp[s]
                if decoupled and round_ == 1:  # proximal policy = this run's own round 1
                    assert mb.behavior_logprobs is not None
                    prox = logp.detach().double().numpy()
                    weights[s] = torch.from_numpy(aggregation.behavior_weights(
                        prox, mb.behavior_logprobs.numpy(), mb.response_mask.numpy(),
                        cap=alg.behavior_weight_cap, cap_mode=alg.behavior_weight_cap_mode)).to(acc)
                    raw_weights[s] = torch.exp(torch.from_numpy(prox) - mb.behavior_logprobs
                                               .double()).to(acc) * mb.response_mask
                if alg.rollout_is is not None and round_ == 1:  # fixed by round 1, as decoupled
                    assert mb.behavior_logprobs is not None
                    weights[s] = losses.rollout_correction_weights(
                        logp.detach(), mb.behavior_logprobs.to(logp.dtype), mb.response_mask,
                        level=alg.rollout_is, mode=alg.rollout_is_mode,
                        threshold=float(alg.rollout_is_threshold or 0.0),
                        threshold_low=alg.rollout_is_threshold_low).to(acc)
                adv = mb.advantages.float()
                pg, clipped = _policy_loss(logp, old, adv, mb.response_mask, contract)
                if decoupled or alg.rollout_is is not None:
                    pg = weights[s] * pg
                clipped_tokens += float((clipped.float() * mask).sum())
                agg = mask * row_w[s, None]  # [b, R]: 1 on valid tokens for token-mean
                policy = (pg * agg).sum() / denom
                kl_tok = losses.kl_estimate(logp, ref_logp[s], alg.kl_loss_form)
                if alg.kl_loss_bias_correction:
                    kl_tok = losses.ratio_weighted_kl(
                        kl_tok, logp, old, mb.response_mask,
                        level="sequence" if alg.policy_loss == "gspo" else "token")
                kl = alg.kl_loss_coef * (kl_tok * agg).sum()
                kl = kl / denom
                ent_loss = -alg.entropy_coef * (ent * agg).sum() / denom
                if last_forward is None:
                    sens.add(round_, {"policy": policy, "kl": kl, "entropy": ent_loss, "total":
                                      policy + kl + ent_loss}, {"logprobs": logp, "entropy": ent},
                             s)
                if round_ != last_forward:
                    (policy + kl + ent_loss).backward()
            if round_ != last_forward:
                prec.collect_grads()
            for name, part in (("policy", policy), ("kl", kl), ("entropy", ent_loss)):
                sums[name] += float(part.detach())
            logp_r[s] = (logp.detach() * mask)
            ent_r[s] = (ent.detach() * mask)
        if round_ == 1:
            old_logp = logp_r.clone()
        if offsets is None:  # a perturbed run's non-finite response is its measurement
            _require_finite("actor", round_, sums, settings, contract.optimizer.actor_lr,
                            moved=float((logp_r - old_logp).abs().max()),
                            unit="nats of logprob")
        clip_fraction[f"round{round_}"] = clipped_tokens / n_valid
        out[tensor_name(round_, "actor", "logprobs")] = logp_r.float()
        out[tensor_name(round_, "actor", "entropy")] = ent_r.float()
        for term, v in sums.items():
            out[tensor_name(round_, "actor", f"loss/{term}")] = torch.tensor(v)
        out[tensor_name(round_, "actor", "loss/total")] = torch.tensor(sum(sums.values()))
        if round_ == last_forward:
            break
        if last_forward is None:
            sens.grad_norm(round_, actor, batch, settings.micro_batch_size, lambda m, mb:
                           _token_logprobs_entropy(_forward_response_outputs(m, mb),
                                                   mb.responses, temp)[0],
                           saved_on_host=host_state,
                           grad_of=None if stream is None else stream.grad_of)
        if on_round is not None:
            on_round(round_, model, actor, batch, old_logp)
        lrs[f"round{round_}"] = _step("actor", round_, actor, contract, optim=optim, out=out,
                                      grad_dtypes=grad_dtypes, norm_evals=norm_evals,
                                      stream=stream)
    if stream is not None:
        stream.close()
    meta = _run_meta(actor, optim, grad_dtypes, compute_dtypes, settings)
    meta["lr"] = lrs
    meta[NORM_FP32_META], meta[LOSS_SENSITIVITY_META] = norm_evals, sens.rounds
    meta["policy_clip_fraction"] = clip_fraction
    meta["loss_agg_mode"] = alg.loss_agg_mode
    if decoupled:
        # The weight is fixed by round 1 (the proximal policy) and reused in every round.
        stats = aggregation.weight_stats(raw_weights.double().numpy(),
                                         batch.response_mask.numpy(), alg.behavior_weight_cap)
        meta["behavior_weight"] = {f"round{r}": stats for r in range(1, alg.rounds + 1)}
    return out, meta


def _require_finite(role: str, round_: int, losses_: Mapping[str, float],
                    settings: UpdateSettings, lr: float, *, moved: float, unit: str) -> None:
    """Stop a reference update whose round's loss is not finite: it diverged.

    A non-finite reference loss would be sealed as the target and found only when the bounds
    are computed; raised at the round that shows it instead, with how far round 1's update
    moved the role's per-token outputs on valid tokens (``moved``, largest absolute change;
    a NaN output makes it NaN). Not called for the round-to-round runs, whose perturbed
    outputs (``offsets``) may overflow: :func:`qualify.reference.round_to_round.measure`
    records a non-finite response as such.

    Raises:
        ReferenceDivergedError: a term of ``losses_`` is NaN or infinite.
    """
    bad = {t: v for t, v in losses_.items() if not math.isfinite(v)}
    if not bad:
        return
    terms = ", ".join(f"{t} {v}" for t, v in bad.items())
    why = (f"; round 1's update moved them by up to {moved:.4g} {unit}: "
           f"optimizer.{role}_lr {lr:g} is too large a step for this model (Adam's first step "
           "moves every parameter by about lr)" if round_ > 1 else "")
    raise ReferenceDivergedError(
        f"{settings.label}: the {role}'s round {round_} loss is not finite ({terms}): the "
        f"reference update diverged{why}")


def run_critic(critic: nn.Module, batch: Batch, contract: Contract,
               settings: UpdateSettings, *, on_round: RoundHook | None = None,
               probe: ProbeHook = _no_probe, offsets: Offsets | None = None,
               last_forward: int | None = None,
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Run ``rounds`` clipped-value-loss critic steps on ``batch`` (protocol semantics).

    Args:
        critic: FP32 ``*ForTokenClassification`` with one label (backbone + value head);
            updated in place (first rounded to BF16 in place under ``castmasters``).
        batch: the rollout and training inputs (``returns`` are the value targets).
        contract: supplies value clip range and AdamW settings.
        settings: precision, micro-batching and padding of this run.
        on_round: optional :data:`RoundHook`, as in :func:`run_actor`.
        probe: a :data:`ProbeHook`, as in :func:`run_actor`.
        offsets: :data:`Offsets`: at the rounds it names, ``offsets[r][b, t]`` is added to
            the value of response token ``t`` of row ``b``.
        last_forward: as in :func:`run_actor`.

    Returns:
        ``(tensors, meta)`` as :func:`run_actor`, under ``round{r}/critic/...``.
    """
    alg = contract.algorithm
    config: Any = critic.config
    contract = with_rollout_rows(contract, batch, int(config.vocab_size))
    batch = batch.padded(settings.extra_left_padding, settings.extra_right_padding)
    n_valid = float(batch.response_mask.sum())
    out: dict[str, torch.Tensor] = {}
    prec = _Precision(critic, settings)
    prec.birth_masters()
    host_state = reference_devices.optimizer_state() == "host"
    optim = _adamw(critic, contract.optimizer.critic_lr, contract, host=host_state)
    stream = _stream(critic, on_round)
    b, r_len = batch.responses.shape
    acc = settings.accumulate_dtype
    row_w, denom = _aggregation(batch, contract, acc)
    old_values = torch.zeros(b, r_len, dtype=acc)
    compute_dtypes: set[str] = set()
    grad_dtypes: set[str] = set()
    norm_evals: dict[str, float] = {}
    clip_fraction: dict[str, float] = {}
    lrs: dict[str, float] = {}
    sens = LossSensitivity()
    for round_ in range(1, alg.rounds + 1):
        model = prec.refresh()
        model.eval()  # dropout off (protocol); autograd works in eval mode
        if stream is not None:
            stream.attach(model)
        values_r = torch.zeros(b, r_len, dtype=acc)
        total = 0.0
        clipped_tokens = 0.0
        for s, mb in batch.micro_batches(settings.micro_batch_size):
            mask = mb.response_mask.float()
            with probe(round_, model, mb):
                with prec.autocast():
                    v = _forward_response_outputs(model, mb)
                compute_dtypes.add(str(v.dtype))
                values = v.to(torch.promote_types(v.dtype, torch.float32)).squeeze(-1)
                if offsets is not None and round_ in offsets:
                    values = values + offsets[round_][s].to(values.dtype)
                old = values.detach() if round_ == 1 else old_values[s]
                ret = mb.returns.float()
                clipped = old + torch.clamp(values - old, -alg.value_clip, alg.value_clip)
                vloss = torch.maximum((values - ret).square(), (clipped - ret).square())
                clipped_tokens += float((((clipped - ret).square() > (values - ret).square())
                                         .float() * mask).sum())
                loss = 0.5 * (vloss * (mask * row_w[s, None])).sum() / denom
                if last_forward is None:
                    sens.add(round_, {"value": loss, "total": loss}, {"values": values}, s)
                if round_ != last_forward:
                    loss.backward()
            if round_ != last_forward:
                prec.collect_grads()
            total += float(loss.detach())
            values_r[s] = values.detach() * mask
        if round_ == 1:
            old_values = values_r.clone()
        if offsets is None:
            _require_finite("critic", round_, {"value": total}, settings,
                            contract.optimizer.critic_lr,
                            moved=float((values_r - old_values).abs().max()), unit="in value")
        clip_fraction[f"round{round_}"] = clipped_tokens / n_valid
        out[tensor_name(round_, "critic", "values")] = values_r.float()
        out[tensor_name(round_, "critic", "loss/value")] = torch.tensor(total)
        out[tensor_name(round_, "critic", "loss/total")] = torch.tensor(total)
        if round_ == last_forward:
            break
        if last_forward is None:
            sens.grad_norm(round_, critic, batch, settings.micro_batch_size, lambda m, mb:
                           _forward_response_outputs(m, mb).float().squeeze(-1),
                           saved_on_host=host_state,
                           grad_of=None if stream is None else stream.grad_of)
        if on_round is not None:
            on_round(round_, model, critic, batch, old_values)
        lrs[f"round{round_}"] = _step("critic", round_, critic, contract, optim=optim,
                                      out=out, grad_dtypes=grad_dtypes, norm_evals=norm_evals,
                                      stream=stream)
    if stream is not None:
        stream.close()
    meta = _run_meta(critic, optim, grad_dtypes, compute_dtypes, settings)
    meta["lr"] = lrs
    meta[NORM_FP32_META], meta[LOSS_SENSITIVITY_META] = norm_evals, sens.rounds
    meta["value_clip_fraction"] = clip_fraction
    return out, meta
