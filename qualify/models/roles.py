"""Loading the four RL roles (actor, reference policy, critic, reward) and the tokenizer.

Every loader checks the role directory's ``qualify-manifest.json`` first
(:func:`qualify.models.manifest.verify_model_dir`), loads in eval mode with the requested
dtype and attention implementation, and sets ``requires_grad`` on every parameter.

Note on pooling: transformers' ``*ForSequenceClassification`` pools at the rightmost token
that is not ``pad_token_id`` and ignores ``attention_mask``; a sampled pad token or
``pad == eos`` moves that position. Reward scores pooled at the last valid token should be
gathered from the per-position scores with the attention mask.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Final

import torch

from qualify.errors import ModelSourceError
from qualify.models.bundle import ModelBundle
from qualify.models.manifest import verify_model_dir
from qualify.models.sources import quiet

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["ATTN_IMPLEMENTATIONS", "SUPPORTED_DTYPES", "load_actor", "load_critic",
           "load_reference", "load_reward", "load_tokenizer", "restore_model"]

SUPPORTED_DTYPES: Final = (torch.float32, torch.bfloat16)
ATTN_IMPLEMENTATIONS: Final = ("sdpa", "eager")


def _check_load_args(dtype: torch.dtype, attn_implementation: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype: {dtype} is not one of {list(SUPPORTED_DTYPES)}")
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation: {attn_implementation!r} is not one of "
                         f"{list(ATTN_IMPLEMENTATIONS)}")


def _load(role: str, path: str | Path, *, dtype: torch.dtype, attn_implementation: str,
          requires_grad: bool, verify: bool) -> PreTrainedModel:
    import transformers

    _check_load_args(dtype, attn_implementation)
    d = Path(path)
    if verify:
        verify_model_dir(d)
    elif not d.is_dir():
        raise ModelSourceError(f"{d}: model directory not found")
    auto = {
        "actor": transformers.AutoModelForCausalLM,
        "critic": transformers.AutoModelForTokenClassification,
        "reward": transformers.AutoModelForSequenceClassification,
    }[role]
    with quiet():
        model = auto.from_pretrained(d, dtype=dtype, attn_implementation=attn_implementation,
                                     local_files_only=True)
    if role != "actor" and int(model.config.num_labels) != 1:
        raise ModelSourceError(f"{d}/config.json: num_labels = {model.config.num_labels}, the "
                               f"{role} needs 1")
    model.eval()
    model.requires_grad_(requires_grad)
    result: PreTrainedModel = model
    return result


def load_actor(path: str | Path, *, dtype: torch.dtype, attn_implementation: str,
               requires_grad: bool = False, verify: bool = True) -> PreTrainedModel:
    """Load the policy (``*ForCausalLM``) in eval mode.

    Args:
        path: the actor directory (:attr:`ModelBundle.actor_dir`).
        dtype: ``torch.float32`` or ``torch.bfloat16`` (every parameter is cast to it).
        attn_implementation: ``"sdpa"`` or ``"eager"``.
        requires_grad: value of ``requires_grad`` of every parameter.
        verify: check the directory's ``qualify-manifest.json`` first.

    Returns:
        The model; ``model(input_ids [B, T], attention_mask [B, T]).logits`` is
        ``[B, T, vocab]`` in ``dtype``.

    Raises:
        ModelSourceError: the directory is missing or does not match its manifest.
        ValueError: unsupported ``dtype`` or ``attn_implementation``.
    """
    return _load("actor", path, dtype=dtype, attn_implementation=attn_implementation,
                 requires_grad=requires_grad, verify=verify)


def load_reference(path: str | Path, *, dtype: torch.dtype, attn_implementation: str,
                   verify: bool = True) -> PreTrainedModel:
    """Load the frozen reference policy (``actor_init``): :func:`load_actor`, no gradients."""
    return _load("actor", path, dtype=dtype, attn_implementation=attn_implementation,
                 requires_grad=False, verify=verify)


def load_critic(path: str | Path, *, dtype: torch.dtype, attn_implementation: str,
                requires_grad: bool = False, verify: bool = True) -> PreTrainedModel:
    """Load the critic (``*ForTokenClassification``, one label) in eval mode.

    Args:
        path: the critic directory (:attr:`ModelBundle.critic_dir`).
        dtype: ``torch.float32`` or ``torch.bfloat16``.
        attn_implementation: ``"sdpa"`` or ``"eager"``.
        requires_grad: value of ``requires_grad`` of every parameter.
        verify: check the directory's ``qualify-manifest.json`` first.

    Returns:
        The model; ``.logits`` is ``[B, T, 1]`` (the value of every position).

    Raises:
        ModelSourceError: missing directory, manifest mismatch, or ``num_labels != 1``.
        ValueError: unsupported ``dtype`` or ``attn_implementation``.
    """
    return _load("critic", path, dtype=dtype, attn_implementation=attn_implementation,
                 requires_grad=requires_grad, verify=verify)


def load_reward(path: str | Path, *, dtype: torch.dtype, attn_implementation: str,
                requires_grad: bool = False, verify: bool = True) -> PreTrainedModel:
    """Load the reward model (``*ForSequenceClassification``, one label) in eval mode.

    Args:
        path: the reward directory (:attr:`ModelBundle.reward_dir`).
        dtype: ``torch.float32`` or ``torch.bfloat16``.
        attn_implementation: ``"sdpa"`` or ``"eager"``.
        requires_grad: value of ``requires_grad`` of every parameter.
        verify: check the directory's ``qualify-manifest.json`` first.

    Returns:
        The model; its ``.logits`` ``[B, 1]`` pool at the last non-pad token (see the module
        note); per-position scores are ``model.score(model.model(...).last_hidden_state)``
        ``[B, T, 1]``.

    Raises:
        ModelSourceError: missing directory, manifest mismatch, or ``num_labels != 1``.
        ValueError: unsupported ``dtype`` or ``attn_implementation``.
    """
    return _load("reward", path, dtype=dtype, attn_implementation=attn_implementation,
                 requires_grad=requires_grad, verify=verify)


def load_tokenizer(bundle: ModelBundle) -> PreTrainedTokenizerBase | None:
    """Load the bundle's tokenizer with ``pad_token_id`` equal to the bundle's.

    Returns:
        The tokenizer, or ``None`` when the source has none (``tiny-qwen3``).

    Raises:
        ModelSourceError: the tokenizer directory is missing.
    """
    from transformers import AutoTokenizer

    if bundle.tokenizer_dir is None:
        return None
    if not bundle.tokenizer_dir.is_dir():
        raise ModelSourceError(f"{bundle.tokenizer_dir}: tokenizer directory not found")
    with quiet():
        tok = AutoTokenizer.from_pretrained(bundle.tokenizer_dir, local_files_only=True)
    if tok.pad_token_id != bundle.pad_token_id:
        tok.pad_token = tok.convert_ids_to_tokens(bundle.pad_token_id)
    result: PreTrainedTokenizerBase = tok
    return result


def restore_model(work: torch.nn.Module, template: torch.nn.Module) -> torch.nn.Module:
    """Put ``template``'s state back into ``work``, a ``copy.deepcopy`` of it, in place.

    Every parameter and every buffer (persistent or not, e.g. the rotary ``inv_freq``) is
    copied bit for bit, each parameter's ``requires_grad`` and the train/eval mode are
    restored and every ``.grad`` is dropped: what a new deep copy of ``template`` would be,
    for a caller that only trained ``work``'s values (no module added, removed or re-typed),
    without copying the module tree again.

    Args:
        work: a deep copy of ``template`` that has been trained or otherwise modified.
        template: the state to restore; not modified.

    Returns:
        ``work``.

    Raises:
        ValueError: the two do not have the same parameters and buffers (names, shapes,
            dtypes), or a module of one has hooks the other's has not (a hook registered on
            ``work`` since the copy, e.g. the ``row_split`` control's, would stay): ``work``
            is not a copy of ``template``.
    """
    pairs = [*zip(work.named_parameters(), template.named_parameters(), strict=False),
             *zip(work.named_buffers(), template.named_buffers(), strict=False)]
    n_work = len(list(work.parameters())) + len(list(work.buffers()))
    n_template = len(list(template.parameters())) + len(list(template.buffers()))
    if n_work != n_template or len(pairs) != n_template or any(
            nw != nt or w.shape != t.shape or w.dtype != t.dtype
            for (nw, w), (nt, t) in pairs):
        raise ValueError("restore_model: work is not a copy of template (its parameters or "
                         "buffers differ in name, shape or dtype)")
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
             "_backward_pre_hooks")
    if any(len(getattr(mw, h)) != len(getattr(mt, h)) for mw, mt in
           zip(work.modules(), template.modules(), strict=False) for h in hooks) or \
            len(list(work.modules())) != len(list(template.modules())):
        raise ValueError("restore_model: work is not a copy of template (its modules or their "
                         "hooks differ)")
    with torch.no_grad():
        for (_, w), (_, t) in pairs:
            w.copy_(t)
    for w, t in zip(work.parameters(), template.parameters(), strict=True):
        w.grad = None
        w.requires_grad_(t.requires_grad)
    for mw, mt in zip(work.modules(), template.modules(), strict=True):
        mw.training = mt.training
    return work
