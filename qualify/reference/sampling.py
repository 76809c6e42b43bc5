"""Sampling a rollout: the backend registry, the HF sampler, the reference-stage capture.

The reference stage's first step (docs/concepts.md). A rollout backend turns prompts (token
id lists) and the contract's :class:`~qualify.contract.SamplingSpec` into a
:class:`~qualify.reference.rollout.Rollout` (the stored document, its layout checks and
:func:`~qualify.reference.rollout.build_rollout` live in :mod:`qualify.reference.rollout`).

Backends are found by name through the generic registry
(:data:`qualify.registry.ROLLOUT_BACKENDS`: lazy specs, entry-point group
``qualify.rollout_backends``), so ``import qualify.reference.sampling`` never imports
vllm. ``hf`` (:class:`HfRolloutBackend`) lives here; ``vllm`` lives in
``harnesses/vllm/rollout.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import transformers
from transformers import GenerationConfig

from qualify.contract import SamplingSpec
from qualify.errors import ContractError, HarnessError
from qualify.reference.rollout import Rollout, build_rollout
from qualify.registry import get_rollout_backend
from qualify.resources import import_repo_module

__all__ = ["HfRolloutBackend", "RolloutBackend", "capture_rollout",
           "get_backend", "rollout_backend"]

@runtime_checkable
class RolloutBackend(Protocol):
    """A sampler that produces a :class:`Rollout` (the seam between qualify and an engine).

    Attributes:
        name: backend name in :data:`qualify.registry.ROLLOUT_BACKENDS` (``hf``, ``vllm``).
        version: version of the library that samples (``transformers``, ``vllm``).
    """

    @property
    def name(self) -> str:
        """Backend name (``hf``, ``vllm``)."""
        ...

    @property
    def version(self) -> str:
        """Version of the sampling library."""
        ...

    def sample(
        self,
        prompts: list[list[int]],
        sampling: SamplingSpec,
        *,
        pad_token_id: int,
        eos_token_id: int,
        model: Any = None,
    ) -> Rollout:
        """Sample ``sampling.samples_per_prompt`` responses per prompt.

        Args:
            prompts: prompt token ids, one list per prompt (unpadded).
            sampling: the contract's sampling settings.
            pad_token_id: id used for padding (it may also be sampled as a real token).
            eos_token_id: the id that ends a response.
            model: the engine's model handle for this call (``hf``: the model object;
                ``vllm``: a model directory), if not given to the backend's constructor.

        Returns:
            The rollout, sequences ordered prompt by prompt (``group_index = i // n``).
        """
        ...


def rollout_backend(name: str) -> Callable[..., RolloutBackend]:
    """Import and return the rollout backend class registered under ``name``.

    Args:
        name: a rollout backend of :data:`qualify.registry.ROLLOUT_BACKENDS` (the
            contract's ``sampling.engine``).

    Returns:
        The backend class (call it with the backend's own constructor arguments).

    Raises:
        ContractError: ``name`` is not registered (the message suggests the closest
            names and lists all of them).
        HarnessError: the backend's module cannot be imported (engine not installed) or
            the registered attribute is missing or not a class.
    """
    target = get_rollout_backend(name).entry
    module_name, _, attr = target.partition(":")
    try:
        module = import_repo_module(module_name)
    except ImportError as exc:
        raise HarnessError(
            f"rollout backend {name!r}: cannot import {module_name} ({exc}); "
            f"install the engine's extra (pip install 'qualify[{name}]')"
        ) from exc
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise HarnessError(f"rollout backend {name!r}: {target} is not a class")
    result: Callable[..., RolloutBackend] = cls
    return result


def get_backend(name: str, **kwargs: Any) -> RolloutBackend:
    """Build the rollout backend registered under ``name``.

    Args:
        name: a rollout backend of :data:`qualify.registry.ROLLOUT_BACKENDS` (the
            contract's ``sampling.engine``).
        **kwargs: the backend's constructor arguments (``hf``: ``model``, optional when
            the model is passed to :meth:`RolloutBackend.sample` instead).

    Returns:
        The backend instance.

    Raises:
        ContractError: ``name`` is not registered.
        HarnessError: the backend cannot be imported (see :func:`rollout_backend`).
    """
    return rollout_backend(name)(**kwargs)


def capture_rollout(
    sampling: SamplingSpec,
    prompts: list[list[int]],
    *,
    actor_dir: str | Path,
    pad_token_id: int,
    eos_token_id: int,
    backend_options: Mapping[str, Any] | None = None,
) -> Rollout:
    """Capture the reference-stage rollout with the contract's rollout engine.

    ``sampling.engine == "vllm"`` (the default engine of every committed contract):
    :class:`harnesses.vllm.rollout.VllmRolloutBackend` samples in a child process from the
    model directory (this process never imports vllm). ``hf`` (the independent fallback):
    :class:`HfRolloutBackend` samples with the actor loaded here at FP32 with ``sdpa``
    attention.

    Args:
        sampling: the contract's sampling settings (``engine``, ``tp``, ...).
        prompts: prompt token ids, one unpadded list per prompt.
        actor_dir: the actor's HF model directory (the policy that samples).
        pad_token_id: padding id.
        eos_token_id: end-of-sequence id.
        backend_options: constructor arguments of the backend (``vllm``: ``dtype``,
            ``kv_cache_memory_bytes``, ``threads_bind``, ``timeout_s``).

    Returns:
        The rollout (not yet saved).

    Raises:
        ContractError: unknown engine or a sampling setting out of range.
        HarnessError: the backend cannot be imported or its sampler failed.
    """
    options = dict(backend_options or {})
    if sampling.engine == "hf":
        from qualify.models import roles

        actor = roles.load_actor(Path(actor_dir), dtype=torch.float32,
                                  attn_implementation="sdpa", requires_grad=False)
        return get_backend("hf", model=actor, **options).sample(
            prompts, sampling, pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    return get_backend(sampling.engine, **options).sample(
        prompts, sampling, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
        model=Path(actor_dir))


class HfRolloutBackend:
    """Sample with Hugging Face ``generate`` (the reference sampler).

    Each prompt is generated on its own (``input_ids [1, L]``, no padding, so batch
    padding cannot change any number) with ``num_return_sequences = samples_per_prompt``
    after ``transformers.set_seed(seed + prompt_index)``; ``do_sample=True``,
    ``output_scores=True``, ``output_logits=True``, ``return_dict_in_generate=True``.
    The model must hold FP32 parameters; its attention implementation (``sdpa`` by
    default, or ``eager``) is the caller's choice at load time and is recorded.

    The model's own ``generation_config`` is replaced, for the duration of the call, by
    a bare one holding only the special token ids, so that nothing a checkpoint ships
    (repetition penalty, ``min_p``, suppressed tokens...) reaches the sampler: HF fills
    every generation option left unset from ``model.generation_config``. With every other
    option at its neutral default, transformers 5.19's ``GenerationMixin._get_logits_processor``
    builds exactly this chain, in this order (sampling warpers, ``generation/utils.py``):

    1. ``TemperatureLogitsWarper`` (``scores / temperature``; added only if temperature != 1),
    2. ``TopKLogitsWarper`` (keep the ``top_k`` largest, others to ``-inf``; if top_k != 0),
    3. ``TopPLogitsWarper`` (sort ascending, drop tokens whose cumulative softmax mass is
       ``<= 1 - top_p``, keep at least one; others to ``-inf``; if top_p < 1).

    ``scores`` (``output_scores``) are the logits after this chain, i.e. the exact
    sampling distribution (``softmax(scores)`` is what ``torch.multinomial`` draws from):
    tokens outside the top-k / nucleus are ``-inf``, the sampled token never is.
    ``logits`` (``output_logits``) are the raw FP32 logits. Behavior logprobs:
    ``processed`` = ``log_softmax(scores)``, ``raw`` = ``log_softmax(logits)``, gathered at
    the sampled ids. After every call the backend checks that the chain was the one above
    (kept scores equal ``logits / temperature`` bitwise, at most ``top_k`` kept, sampled
    token kept) and raises otherwise.

    A response ends at the first EOS (finish reason ``eos``) or after ``max_new_tokens``
    (``length``); HF writes ``pad_token_id`` after EOS, and the layout marks it padding.
    ``min_new_tokens`` is not set (EOS may be the first token).

    Args:
        model: an HF ``*ForCausalLM`` with FP32 parameters (put in eval mode during the
            call), or ``None`` to pass it to :meth:`sample` instead.
    """

    def __init__(self, model: Any = None) -> None:
        self.model = model

    @property
    def name(self) -> str:
        """``hf``."""
        return "hf"

    @property
    def version(self) -> str:
        """The installed transformers version."""
        return str(transformers.__version__)

    def sample(
        self,
        prompts: list[list[int]],
        sampling: SamplingSpec,
        *,
        pad_token_id: int,
        eos_token_id: int,
        model: Any = None,
    ) -> Rollout:
        """Sample ``samples_per_prompt`` responses per prompt (see the class docstring).

        Args:
            prompts: prompt token ids, one unpadded list per prompt.
            sampling: the contract's sampling settings (``tp`` must be 1).
            pad_token_id: padding id.
            eos_token_id: end-of-sequence id.
            model: the HF model for this call (overrides the constructor's).

        Returns:
            The rollout (CPU tensors, ``R = max_new_tokens``).

        Raises:
            ContractError: ``sampling.tp != 1`` (HF samples on one device) or a setting
                out of range.
            ValueError: no model, empty prompts, ids outside the vocabulary, or a non-FP32
                model.
            HarnessError: ``generate`` applied a logits processor other than the
                documented chain, or sampled a token its own distribution excluded.
        """
        _check_sampling(sampling)
        if sampling.tp != 1:
            raise ContractError(f"sampling.tp: the hf rollout backend has no TP; got {sampling.tp}")
        model = model if model is not None else self.model
        if model is None:
            raise ValueError("HfRolloutBackend: no model (give it to the constructor or sample)")
        dtypes = {prm.dtype for prm in model.parameters()}
        if dtypes != {torch.float32}:
            names = sorted(map(str, dtypes))
            raise ValueError(f"HfRolloutBackend samples in FP32; the model has {names}")
        vocab = int(model.get_output_embeddings().weight.shape[0])
        if not prompts or any(not q for q in prompts):
            raise ValueError("prompts: need at least one prompt and no empty prompt")
        if any(not 0 <= x < vocab for q in prompts for x in q):
            raise ValueError(f"prompts: token id outside the vocabulary [0, {vocab})")
        device = next(model.parameters()).device
        temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
        n = sampling.samples_per_prompt

        generated: list[list[int]] = []
        logprobs: list[torch.Tensor] = []
        saved_config, was_training = model.generation_config, model.training
        model.generation_config = GenerationConfig(
            pad_token_id=pad_token_id, eos_token_id=eos_token_id,
            bos_token_id=getattr(saved_config, "bos_token_id", None),
        )
        model.eval()
        try:
            for i, prompt in enumerate(prompts):
                transformers.set_seed(sampling.seed + i)
                input_ids = torch.tensor([prompt], dtype=torch.int64, device=device)
                with torch.no_grad():
                    out = model.generate(
                        input_ids=input_ids,
                        attention_mask=torch.ones_like(input_ids),
                        do_sample=True,
                        temperature=temperature,
                        top_k=top_k,
                        top_p=top_p,
                        max_new_tokens=sampling.max_new_tokens,
                        num_return_sequences=n,
                        output_scores=True,
                        output_logits=True,
                        return_dict_in_generate=True,
                        pad_token_id=pad_token_id,
                        eos_token_id=eos_token_id,
                    )
                tokens = out.sequences[:, len(prompt):].cpu()  # [n, r_gen]
                scores = torch.stack(out.scores, dim=1).float().cpu()  # [n, r_gen, V]
                raw = torch.stack(out.logits, dim=1).float().cpu()  # [n, r_gen, V]
                valid = _valid_until_eos(tokens, eos_token_id)  # [n, r_gen] bool
                _check_chain(scores, raw, tokens, valid, temperature=temperature, top_k=top_k,
                             prompt_index=i)
                dist = scores if sampling.logprobs_mode == "processed" else raw
                lp = torch.log_softmax(dist, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
                for j in range(n):
                    length = int(valid[j].sum())
                    generated.append(tokens[j, :length].tolist())
                    logprobs.append(lp[j, :length])
        finally:
            model.generation_config = saved_config
            model.train(was_training)

        warpers = [
            name
            for name, active in (
                ("TemperatureLogitsWarper", temperature != 1.0),
                ("TopKLogitsWarper", top_k != 0),
                ("TopPLogitsWarper", top_p < 1.0),
            )
            if active
        ]
        details = {
            "torch_version": torch.__version__,
            "dtype": "float32",
            "attn_implementation": str(getattr(model.config, "_attn_implementation", None)),
            "device": str(device),
            "warpers": warpers,
            "batching": "one generate call per prompt (no padding), num_return_sequences samples",
            "seed_policy": "transformers.set_seed(seed + prompt_index) before each call",
            "model_generation_config": "ignored (bare GenerationConfig during sampling)",
        }
        return build_rollout(
            prompts=prompts,
            generated=generated,
            logprobs=logprobs,
            sampling=sampling,
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            sampler=self.name,
            sampler_version=self.version,
            sampler_details=details,
        )


def _check_sampling(s: SamplingSpec) -> None:
    if not s.temperature > 0:
        raise ContractError(f"sampling.temperature: must be > 0, got {s.temperature}")
    if not 0 < s.top_p <= 1:
        raise ContractError(f"sampling.top_p: must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise ContractError(f"sampling.top_k: must be >= 0, got {s.top_k}")
    if s.max_new_tokens < 1 or s.samples_per_prompt < 1:
        raise ContractError(
            f"sampling: max_new_tokens ({s.max_new_tokens}) and samples_per_prompt "
            f"({s.samples_per_prompt}) must be >= 1"
        )
    if s.logprobs_mode not in ("processed", "raw"):
        raise ContractError(f"sampling.logprobs_mode: {s.logprobs_mode!r} is not processed/raw")


def _valid_until_eos(tokens: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """``[n, r]`` bool: True up to and including the first EOS of each row."""
    is_eos = (tokens == eos_token_id).long()
    before = is_eos.cumsum(dim=1) - is_eos  # EOS count strictly before each position
    return before == 0


def _check_chain(
    scores: torch.Tensor,
    raw: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    prompt_index: int,
) -> None:
    """Check that HF's processed scores came from the documented warper chain only."""
    kept = torch.isfinite(scores)
    where = f"rollout backend 'hf', prompt {prompt_index}"
    expect = raw / temperature if temperature != 1.0 else raw
    if not torch.equal(scores[kept], expect[kept]):
        raise HarnessError(
            f"{where}: processed scores differ from logits / temperature on kept tokens; a "
            "logits processor other than temperature/top-k/top-p ran"
        )
    if (scores[~kept] != float("-inf")).any():
        raise HarnessError(f"{where}: processed scores hold NaN or +inf")
    if top_k and (kept.sum(dim=-1) > top_k).any():
        raise HarnessError(f"{where}: more than top_k={top_k} tokens kept")
    hit = kept.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if (valid & ~hit).any():
        raise HarnessError(f"{where}: a sampled token is outside its own sampling distribution")
