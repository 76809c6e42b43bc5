"""Teacher-forced Hugging Face scoring of a fixed rollout: the reference's scores.

The reference stage's second step (docs/concepts.md). Every function here runs a plain HF model on
``cat(prompts, responses)`` of a :class:`~qualify.reference.rollout.Rollout` under
``torch.no_grad()`` and returns per-token quantities at the response positions, with
the position convention of :mod:`qualify.protocol`: the quantity at response position
``t`` comes from the model output at sequence position ``P - 1 + t``.

Precision (the contract's ``fp32`` / ``bf16``; the model passed in always holds FP32
parameters, the master copy):

- ``fp32``: the FP32 parameters, no autocast.
- ``bf16`` + ``bf16_mode="params"``: a BF16 copy of the parameters
  (:func:`bf16_parameters_copy`: parameters BF16, buffers such as the rotary ``inv_freq``
  kept FP32, as Hugging Face's ``from_pretrained(torch_dtype=torch.bfloat16)`` holds them;
  the FP32 master stays in the caller's model), no autocast.
- ``bf16`` + ``bf16_mode="autocast"``: the FP32 parameters under
  ``torch.autocast(device_type, dtype=torch.bfloat16)``.
- ``fp64`` (the reference's ``fp64`` control only, never a contract precision): an FP64
  copy of the parameters, FP64 compute; scores are rounded to FP32 when stored.

The two BF16 modes are the ``bf16_mode`` control of docs/bound-rule.md. Each pass
records what really ran (parameter dtypes, the autocast state seen by the output head,
the dtype of the logits / values the head produced) in a :class:`ScoreRecord`, which is
checked against the request before anything is returned.

Micro-batching and padding are the other controls: rows are scored
``micro_batch_size`` at a time, each micro-batch cut to its own longest sequence
(columns that are padding in every row are dropped, as dynamic-batching engines do),
then ``extra_left_padding`` pad columns are prepended and ``extra_right_padding``
appended, all with attention 0. Position ids are recomputed from the attention mask
(``clamp(cumsum - 1, min=0)``), so valid tokens keep their positions. The attention
implementation (``eager`` / ``sdpa``) is the model's, chosen by the caller at load time.

Log-probabilities and entropies are computed in FP32 from the logits upcast to FP32
(``logits.float() / temperature``, then ``log_softmax``): HF-style practice (HF's
``ForCausalLMLoss`` upcasts logits with ``logits.float()`` before the cross entropy; TRL's
``selective_log_softmax`` and verl's ``logprobs_from_logits`` also work on FP32 logits),
so BF16 only affects the network, not the softmax. This module shares no code with the
harnesses: it is the independent side of every comparison.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import torch

from qualify.errors import ContractError, PrecisionMismatchError
from qualify.reference.rollout import Rollout

Precision = Literal["fp32", "bf16", "fp64"]
Bf16Mode = Literal["params", "autocast"]
Role = Literal["policy", "critic", "reward"]

def bf16_parameters_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` with BF16 parameters and every buffer as it was.

    ``nn.Module.to(torch.bfloat16)`` rounds floating-point buffers too: the rotary
    ``inv_freq`` of Qwen3 / Llama becomes BF16 (3 significant digits), and every cos/sin
    table built from it is off by ``position * inv_freq * 2^-9`` radians (transformers
    #25681, EleutherAI/gpt-neox #1003, NVIDIA-NeMo/Automodel #2549). Hugging Face's own BF16
    model, ``from_pretrained(torch_dtype=torch.bfloat16)``, casts parameters only and keeps
    buffers FP32 (transformers #30709), as FSDP2's ``MixedPrecisionPolicy`` and Megatron's
    ``RotaryEmbedding`` do; the reference's BF16-parameter lane is that model. Tied
    parameters stay tied (each shared ``Parameter`` is converted once, in place).

    Args:
        model: a module with FP32 (or any float) parameters; not modified.

    Returns:
        The copy: parameters ``torch.bfloat16``, buffers unchanged in dtype and value.
    """
    work = copy.deepcopy(model)
    for p in work.parameters():
        p.data = p.data.to(torch.bfloat16)
    return work



@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ScoreRecord:
    """What a scoring pass asked for and what it observed.

    Attributes:
        role: ``policy``, ``critic`` or ``reward``.
        precision: requested precision (``fp32`` or ``bf16``).
        bf16_mode: BF16 mode used (``params``, ``autocast``; ``None`` for ``fp32``).
        param_dtypes: dtypes of the parameters of the module that ran (sorted names).
        autocast_enabled: autocast was on when the output head ran.
        autocast_dtype: autocast's dtype then (``None`` when off).
        output_dtype: dtype of the tensor the output head produced (logits or values),
            before the FP32 upcast.
        attn_implementation: the model's attention implementation (``eager``, ``sdpa``).
        device: device the pass ran on.
        micro_batch_size: sequences per forward.
        micro_batches: number of forwards.
        extra_left_padding: pad columns prepended to every micro-batch.
        extra_right_padding: pad columns appended to every micro-batch.
        temperature: logits divisor (policy scoring only).
    """

    role: Role
    precision: Precision
    bf16_mode: Bf16Mode | None
    param_dtypes: tuple[str, ...]
    autocast_enabled: bool
    autocast_dtype: str | None
    output_dtype: str
    attn_implementation: str
    device: str
    micro_batch_size: int
    micro_batches: int
    extra_left_padding: int
    extra_right_padding: int
    temperature: float | None = None

    def expected(self) -> tuple[tuple[str, ...], bool, str | None, str]:
        """The ``(param_dtypes, autocast_enabled, autocast_dtype, output_dtype)`` requested."""
        if self.precision == "fp32":
            return ("float32",), False, None, "float32"
        if self.precision == "fp64":
            return ("float64",), False, None, "float64"
        if self.bf16_mode == "params":
            return ("bfloat16",), False, None, "bfloat16"
        return ("float32",), True, "bfloat16", "bfloat16"

    def check(self) -> None:
        """Raise if the observed dtypes disagree with the request.

        Raises:
            PrecisionMismatchError: the message lists each disagreeing item, requested
                vs observed.
        """
        names = ("param_dtypes", "autocast_enabled", "autocast_dtype", "output_dtype")
        observed = (self.param_dtypes, self.autocast_enabled, self.autocast_dtype,
                    self.output_dtype)
        bad = [
            f"{name}: expected {want!r}, observed {got!r}"
            for name, want, got in zip(names, self.expected(), observed, strict=True)
            if want != got
        ]
        if bad:
            mode = f"/{self.bf16_mode}" if self.bf16_mode else ""
            raise PrecisionMismatchError(
                f"{self.role} scoring at {self.precision}{mode} did not run as asked: "
                + "; ".join(bad)
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON form (for the reference's metadata)."""
        d = dataclasses.asdict(self)
        d["param_dtypes"] = list(self.param_dtypes)
        return d


class ScoreResult(NamedTuple):
    """What a scoring function returns; unpacks as ``tensors, record = score_...(...)``.

    Attributes:
        tensors: the scores by name (float32, CPU; shapes in each function's docstring).
        record: the checked :class:`ScoreRecord` of the pass.
    """

    tensors: dict[str, torch.Tensor]
    record: ScoreRecord


@dataclasses.dataclass(frozen=True, slots=True)
class _MicroBatch:
    rows: slice
    input_ids: torch.Tensor  # [b, T]
    attention_mask: torch.Tensor  # [b, T]
    position_ids: torch.Tensor  # [b, T]
    first_response: int  # column of response position 0
    responses_kept: int  # response columns present (R minus the common right padding)


def _micro_batches(
    rollout: Rollout, micro_batch_size: int, extra_left: int, extra_right: int
) -> Iterator[_MicroBatch]:
    """Split the rollout into padded micro-batches (see the module docstring)."""
    p, r = rollout.prompt_length, rollout.response_length
    ids, am = rollout.input_ids, rollout.attention_mask
    left_pad = p - am[:, :p].sum(dim=1)
    right_pad = r - rollout.response_lengths
    pad = rollout.pad_token_id
    for start in range(0, rollout.batch_size, micro_batch_size):
        rows = slice(start, min(start + micro_batch_size, rollout.batch_size))
        lt, rt = int(left_pad[rows].min()), int(right_pad[rows].min())
        x, a = ids[rows, lt : p + r - rt], am[rows, lt : p + r - rt]
        b = x.shape[0]
        x = torch.cat([x.new_full((b, extra_left), pad), x, x.new_full((b, extra_right), pad)], 1)
        a = torch.cat([a.new_zeros((b, extra_left)), a, a.new_zeros((b, extra_right))], 1)
        yield _MicroBatch(
            rows=rows,
            input_ids=x,
            attention_mask=a,
            position_ids=(a.cumsum(dim=1) - 1).clamp(min=0),
            first_response=extra_left + p - lt,
            responses_kept=r - rt,
        )


class _HeadProbe:
    """Forward hook on an output head: autocast state and output dtype of every call."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.seen: set[tuple[bool, str | None, str]] = set()

    def __call__(self, _module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        on = torch.is_autocast_enabled(self.device_type)
        ac = str(torch.get_autocast_dtype(self.device_type)).removeprefix("torch.") if on else None
        self.seen.add((on, ac, str(output.dtype).removeprefix("torch.")))



def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _scoring_pass(
    model: torch.nn.Module,
    rollout: Rollout,
    *,
    head: Callable[[Any], torch.nn.Module],
    forward: Callable[[Any, _MicroBatch], None],
    role: Role,
    precision: Precision,
    bf16_mode: Bf16Mode | None,
    micro_batch_size: int,
    extra_left_padding: int,
    extra_right_padding: int,
    temperature: float | None = None,
) -> ScoreRecord:
    """Run ``forward(module, micro_batch)`` over the rollout at the requested precision.

    Returns:
        The checked :class:`ScoreRecord`.

    Raises:
        ContractError: unknown precision, or ``bf16`` without a valid ``bf16_mode``.
        ValueError: the model does not hold FP32 parameters, or bad micro-batch / padding.
        PrecisionMismatchError: the pass did not run at the requested precision.
    """
    if precision not in ("fp32", "bf16", "fp64"):
        raise ContractError(f"precision: {precision!r} is not 'fp32', 'bf16' or 'fp64'")
    if precision == "bf16" and bf16_mode not in ("params", "autocast"):
        raise ContractError(f"bf16_mode: {bf16_mode!r}; bf16 needs 'params' or 'autocast'")
    if precision != "bf16":
        bf16_mode = None  # a BF16 mode means nothing at FP32 / FP64; recorded as None
    if micro_batch_size < 1 or extra_left_padding < 0 or extra_right_padding < 0:
        raise ValueError(
            f"micro_batch_size ({micro_batch_size}) must be >= 1 and extra padding "
            f"({extra_left_padding}, {extra_right_padding}) >= 0"
        )
    master = {prm.dtype for prm in model.parameters()}
    if master != {torch.float32}:
        names = sorted(_dtype_name(d) for d in master)
        raise ValueError(f"{role} model must hold FP32 parameters (the master copy), has {names}")
    device = next(model.parameters()).device
    run = (bf16_parameters_copy(model) if bf16_mode == "params"
           else copy.deepcopy(model).to(torch.float64) if precision == "fp64" else model)
    was_training = run.training
    run.eval()
    autocast: contextlib.AbstractContextManager[Any] = (
        torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        if bf16_mode == "autocast"
        else contextlib.nullcontext()
    )
    probe = _HeadProbe(device.type)
    handle = head(run).register_forward_hook(probe)
    batches = 0
    try:
        with torch.no_grad(), autocast:
            for mb in _micro_batches(rollout, micro_batch_size, extra_left_padding,
                                     extra_right_padding):
                forward(run, mb)
                batches += 1
    finally:
        handle.remove()
        run.train(was_training)
    if len(probe.seen) != 1:
        raise PrecisionMismatchError(
            f"{role} scoring: the output head ran with {len(probe.seen)} distinct "
            f"(autocast, autocast dtype, output dtype) states: {sorted(map(str, probe.seen))}"
        )
    ((on, ac_dtype, out_dtype),) = probe.seen
    record = ScoreRecord(
        role=role,
        precision=precision,
        bf16_mode=bf16_mode,
        param_dtypes=tuple(sorted({_dtype_name(prm.dtype) for prm in run.parameters()})),
        autocast_enabled=on,
        autocast_dtype=ac_dtype,
        output_dtype=out_dtype,
        attn_implementation=str(getattr(run.config, "_attn_implementation", None)),
        device=str(device),
        micro_batch_size=micro_batch_size,
        micro_batches=batches,
        extra_left_padding=extra_left_padding,
        extra_right_padding=extra_right_padding,
        temperature=temperature,
    )
    record.check()
    return record


def _to_device(mb: _MicroBatch, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        "input_ids": mb.input_ids.to(device),
        "attention_mask": mb.attention_mask.to(device),
        "position_ids": mb.position_ids.to(device),
    }


def _response_window(mb: _MicroBatch) -> slice:
    """Sequence positions ``P - 1 + t`` (in micro-batch columns) for the kept ``t``."""
    return slice(mb.first_response - 1, mb.first_response - 1 + mb.responses_kept)


def _last_valid(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[b]`` int64, column of the last attention-mask 1 of each row."""
    cols = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask * cols).argmax(dim=1)


def score_policy(
    model: torch.nn.Module,
    rollout: Rollout,
    *,
    temperature: float,
    micro_batch_size: int,
    extra_right_padding: int = 0,
    extra_left_padding: int = 0,
    precision: Precision = "fp32",
    bf16_mode: Bf16Mode | None = None,
) -> ScoreResult:
    """Teacher-forced logprobs and entropies of the rollout's responses under ``model``.

    With ``z = logits[:, P - 1 + t].float() / temperature`` (no top-k / top-p, as
    :mod:`qualify.protocol` says): ``logprobs[b, t] = log_softmax(z)[responses[b, t]]`` and
    ``entropy[b, t] = -sum(softmax(z) * log_softmax(z))`` (>= 0 term by term).

    Args:
        model: an HF ``*ForCausalLM`` with FP32 parameters (actor or reference policy).
        rollout: the fixed rollout.
        temperature: the contract's sampling temperature (> 0).
        micro_batch_size: sequences per forward (>= 1).
        extra_right_padding: pad columns appended to each micro-batch (attention 0).
        extra_left_padding: pad columns prepended to each micro-batch (attention 0).
        precision: ``fp32``, ``bf16``, or ``fp64`` (the reference's FP64 control).
        bf16_mode: ``params`` or ``autocast``, required with ``bf16``, ignored with ``fp32``.

    Returns:
        ``ScoreResult({"logprobs": [B, R], "entropy": [B, R]}, record)``: float32 CPU
        tensors, 0 where ``response_mask`` is 0; the checked :class:`ScoreRecord`.

    Raises:
        ContractError: unknown precision, or ``bf16`` without a valid ``bf16_mode``.
        ValueError: ``temperature <= 0``, a non-FP32 model, bad micro-batch or padding.
        PrecisionMismatchError: the pass did not run at the requested precision.
    """
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    b, r = rollout.batch_size, rollout.response_length
    logprobs = torch.zeros(b, r, dtype=torch.float32)
    entropy = torch.zeros(b, r, dtype=torch.float32)
    mask = rollout.response_mask.bool()

    def forward(run: Any, mb: _MicroBatch) -> None:
        device = next(run.parameters()).device
        logits = run(**_to_device(mb, device), use_cache=False).logits  # [b, T, V]
        z = logits[:, _response_window(mb)]
        z = z.to(torch.promote_types(z.dtype, torch.float32)) / temperature  # [b, R', V]
        logp = torch.log_softmax(z, dim=-1)
        tokens = mb.input_ids[:, mb.first_response : mb.first_response + mb.responses_kept]
        lp = logp.gather(-1, tokens.to(device).unsqueeze(-1)).squeeze(-1)  # [b, R']
        ent = -(logp.exp() * logp).sum(dim=-1)  # [b, R']
        valid = mask[mb.rows, : mb.responses_kept]
        logprobs[mb.rows, : mb.responses_kept] = torch.where(valid, lp.cpu(), 0.0)
        entropy[mb.rows, : mb.responses_kept] = torch.where(valid, ent.cpu(), 0.0)

    record = _scoring_pass(
        model,
        rollout,
        head=lambda m: m.get_output_embeddings(),
        forward=forward,
        role="policy",
        precision=precision,
        bf16_mode=bf16_mode,
        micro_batch_size=micro_batch_size,
        extra_left_padding=extra_left_padding,
        extra_right_padding=extra_right_padding,
        temperature=temperature,
    )
    return ScoreResult({"logprobs": logprobs, "entropy": entropy}, record)


def score_values(
    critic: torch.nn.Module,
    rollout: Rollout,
    *,
    micro_batch_size: int,
    extra_right_padding: int = 0,
    extra_left_padding: int = 0,
    precision: Precision = "fp32",
    bf16_mode: Bf16Mode | None = None,
) -> ScoreResult:
    """Critic values at the response positions and at the last valid token.

    ``values[b, t]`` is the critic output at sequence position ``P - 1 + t`` (``V(s_t)``,
    the state before response token ``t``). ``last_values[b]`` is the output at the last
    valid token (the final response token, EOS included): ``V`` of the state after the
    response, which GAE uses to bootstrap a length-truncated response (the reference
    stage's targets, :mod:`qualify.reference.targets`; an EOS-terminated response does not
    bootstrap).

    Args:
        critic: an HF ``*ForTokenClassification`` with ``num_labels=1`` (backbone + value
            head ``score``), FP32 parameters.
        rollout: the fixed rollout.
        micro_batch_size: sequences per forward (>= 1).
        extra_right_padding: pad columns appended to each micro-batch (attention 0).
        extra_left_padding: pad columns prepended to each micro-batch (attention 0).
        precision: ``fp32``, ``bf16``, or ``fp64`` (the reference's FP64 control).
        bf16_mode: ``params`` or ``autocast``, required with ``bf16``, ignored with ``fp32``.

    Returns:
        ``ScoreResult({"values": [B, R], "last_values": [B]}, record)``: float32 CPU tensors,
        ``values`` 0 where ``response_mask`` is 0; the checked :class:`ScoreRecord`.

    Raises:
        ContractError: unknown precision, or ``bf16`` without a valid ``bf16_mode``.
        ValueError: a non-FP32 model, a head with more than one output, bad micro-batch
            or padding.
        PrecisionMismatchError: the pass did not run at the requested precision.
    """
    b, r = rollout.batch_size, rollout.response_length
    values = torch.zeros(b, r, dtype=torch.float32)
    last_values = torch.zeros(b, dtype=torch.float32)
    mask = rollout.response_mask.bool()

    def forward(run: Any, mb: _MicroBatch) -> None:
        device = next(run.parameters()).device
        out = run(**_to_device(mb, device), use_cache=False).logits  # [b, T, 1]
        if out.shape[-1] != 1:
            raise ValueError(f"critic head has {out.shape[-1]} outputs; a value head has 1")
        v = out[..., 0].float().cpu()  # [b, T]
        valid = mask[mb.rows, : mb.responses_kept]
        values[mb.rows, : mb.responses_kept] = torch.where(valid, v[:, _response_window(mb)], 0.0)
        last = _last_valid(mb.attention_mask)
        last_values[mb.rows] = v.gather(1, last.unsqueeze(1)).squeeze(1)

    record = _scoring_pass(
        critic,
        rollout,
        head=lambda m: m.score,
        forward=forward,
        role="critic",
        precision=precision,
        bf16_mode=bf16_mode,
        micro_batch_size=micro_batch_size,
        extra_left_padding=extra_left_padding,
        extra_right_padding=extra_right_padding,
    )
    return ScoreResult({"values": values, "last_values": last_values}, record)


def score_rewards(
    reward_model: torch.nn.Module,
    rollout: Rollout,
    *,
    micro_batch_size: int,
    extra_right_padding: int = 0,
    extra_left_padding: int = 0,
    precision: Precision = "fp32",
    bf16_mode: Bf16Mode | None = None,
) -> ScoreResult:
    """Reward-model scores pooled at the last valid token of each sequence.

    Runs the backbone (``getattr(model, model.base_model_prefix)``) and the ``score``
    head of an HF ``*ForSequenceClassification`` and gathers the head output at the
    last position where ``attention_mask`` is 1 (the final response token). HF's own
    ``GenericForSequenceClassification.forward`` pools at "the rightmost token that is
    not ``pad_token_id``", found from the ids, not the mask: the pad id is an ordinary
    vocabulary entry that a sampler may emit (and some tokenizers set pad = EOS), so a
    response ending with a sampled pad id would be pooled one token too early, and extra
    right padding would be harmless only by accident. Pooling by the mask is exact.

    Args:
        reward_model: an HF ``*ForSequenceClassification`` with ``num_labels=1``, FP32
            parameters.
        rollout: the fixed rollout.
        micro_batch_size: sequences per forward (>= 1).
        extra_right_padding: pad columns appended to each micro-batch (attention 0).
        extra_left_padding: pad columns prepended to each micro-batch (attention 0).
        precision: ``fp32``, ``bf16``, or ``fp64`` (the reference's FP64 control).
        bf16_mode: ``params`` or ``autocast``, required with ``bf16``, ignored with ``fp32``.

    Returns:
        ``ScoreResult({"scores": [B]}, record)``: float32 CPU tensor; the checked
        :class:`ScoreRecord`.

    Raises:
        ContractError: unknown precision, or ``bf16`` without a valid ``bf16_mode``.
        ValueError: a non-FP32 model, a head with more than one output, bad micro-batch
            or padding.
        PrecisionMismatchError: the pass did not run at the requested precision.
    """
    scores = torch.zeros(rollout.batch_size, dtype=torch.float32)

    def forward(run: Any, mb: _MicroBatch) -> None:
        device = next(run.parameters()).device
        backbone = getattr(run, run.base_model_prefix)
        hidden = backbone(**_to_device(mb, device), use_cache=False).last_hidden_state
        out = run.score(hidden)  # [b, T, 1]
        if out.shape[-1] != 1:
            raise ValueError(f"reward head has {out.shape[-1]} outputs; a reward head has 1")
        last = _last_valid(mb.attention_mask).to(out.device)  # placed: the head's device
        pooled = out[..., 0].gather(1, last.unsqueeze(1)).squeeze(1)  # [b]
        scores[mb.rows] = pooled.float().cpu()

    record = _scoring_pass(
        reward_model,
        rollout,
        head=lambda m: m.score,
        forward=forward,
        role="reward",
        precision=precision,
        bf16_mode=bf16_mode,
        micro_batch_size=micro_batch_size,
        extra_left_padding=extra_left_padding,
        extra_right_padding=extra_right_padding,
    )
    return ScoreResult({"scores": scores}, record)


RULES = ("eos_bonus",)
"""Named reward rules (the contract's ``roles.reward = "rule:<name>"``)."""


def rule_rewards(rollout: Rollout, rule: str = "eos_bonus") -> torch.Tensor:
    """Rule-based sequence rewards.

    ``eos_bonus``: 1.0 if the response ended with EOS (``eos_terminated``), else 0.0.

    Args:
        rollout: the fixed rollout.
        rule: a name in :data:`RULES`.

    Returns:
        ``[B]`` float32 scores.

    Raises:
        ContractError: unknown rule (the message lists the known ones).
    """
    if rule == "eos_bonus":
        return rollout.eos_terminated.to(torch.float32)
    raise ContractError(f"roles.reward: unknown rule {rule!r}; known rules: {', '.join(RULES)}")
