"""The frozen inputs of a harness: the rollout, the training inputs, the contract and models.

A harness reads ``cell.json`` and, from its ``inputs_dir``, ``rollout.safetensors``,
``train_inputs.safetensors``, ``contract.json`` and ``model.json``; never reference scores.
:func:`read_inputs` reads them all; :class:`Recipe` is the part of the contract the round
driver runs (algorithm, optimizer, sampling temperature), with the contract's defaults.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from qualify_harness.errors import InputError
from qualify_harness.protocol import (
    CONTRACT_FILE,
    DEFAULT_DISTRIBUTION_TOPK,
    MODEL_FILE,
    ROLLOUT_FILE,
    ROLLOUT_KEYS,
    TRAIN_INPUT_KEYS,
    TRAIN_INPUTS_FILE,
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """Rollout rows as an engine consumes them (``b`` rows, ``T = P + R`` columns).

    Attributes:
        input_ids: ``[b, T]`` int64, prompt (left-padded) then response (right-padded).
        attention_mask: ``[b, T]`` int64.
        position_ids: ``[b, T]`` int64.
        responses: ``[b, R]`` int64 target tokens.
        mask: ``[b, R]`` bool, response tokens that count in losses.
        advantages: ``[b, R]`` FP32.
        returns: ``[b, R]`` FP32.
        prompt_len: ``P``.
        behavior_logprobs: ``[b, R]`` FP32, the sampler's logprobs (decoupled PPO's
            behavior policy); ``None`` only in tests that build a batch by hand.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    responses: Tensor
    mask: Tensor
    advantages: Tensor
    returns: Tensor
    prompt_len: int
    behavior_logprobs: Tensor | None = None

    @property
    def response_len(self) -> int:
        """``R``."""
        return int(self.responses.shape[1])

    def _map(self, fn: Callable[[Tensor], Tensor]) -> Batch:
        tensors: dict[str, Any] = {f.name: fn(getattr(self, f.name))
                                   for f in dataclasses.fields(self)
                                   if f.name != "prompt_len" and getattr(self, f.name) is not None}
        return dataclasses.replace(self, **tensors)

    def rows(self, s: slice) -> Batch:
        """The sub-batch of rows ``s``."""
        return self._map(lambda t: t[s])

    def to(self, device: torch.device) -> Batch:
        """The batch on ``device``."""
        return self._map(lambda t: t.to(device))

    def right_padded(self, extra: int, pad_token_id: int) -> Batch:
        """``extra`` more pad columns on the right (attention 0), for padding invariance.

        The response window (``responses``, ``mask``...) is unchanged: only the sequence
        the model sees grows. Positions follow ``clamp(cumsum(attention_mask) - 1, min=0)``
        (as the rollout's own ``position_ids``).
        """
        b = self.input_ids.shape[0]
        ids = torch.cat([self.input_ids, self.input_ids.new_full((b, extra), pad_token_id)], 1)
        am = torch.cat([self.attention_mask, self.attention_mask.new_zeros((b, extra))], 1)
        pos = torch.clamp(torch.cumsum(am, dim=1) - 1, min=0)
        return dataclasses.replace(self, input_ids=ids, attention_mask=am, position_ids=pos)

    def window(self) -> Tensor:
        """``[R]`` int64 sequence positions ``P - 1 + t`` whose outputs score token ``t``."""
        start = self.prompt_len - 1
        return torch.arange(start, start + self.response_len, device=self.input_ids.device)


def micro_slices(n: int, size: int) -> list[slice]:
    """Row slices of at most ``size`` sequences, in order: ``[0:size], [size:2 size], ...``."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Recipe:
    """What the round driver runs, from ``contract.json`` (its defaults where a key is absent).

    Attributes:
        algorithm: ``ppo``, ``grpo`` or ``decoupled_ppo``.
        rounds: optimizer steps per role.
        micro_batch_size: rows per forward/backward.
        loss_agg_mode: ``token-mean``, ``seq-mean-token-sum`` or ``seq-mean-token-mean``.
        clip_ratio: PPO ε.
        value_clip: the value loss's δ.
        kl_loss_coef: weight of the KL-to-reference loss (0: none).
        kl_loss_estimator: ``k1``, ``k2`` or ``k3``.
        entropy_coef: weight of the entropy bonus.
        behavior_weight_cap: decoupled PPO's cap (``None``: uncapped).
        behavior_weight_cap_mode: ``truncate`` or ``filter``.
        actor_lr, critic_lr: base learning rates.
        betas, eps, weight_decay: AdamW's settings.
        max_grad_norm: the clip threshold.
        temperature: the sampling temperature (logits divisor).
        distribution_topk: ``k`` of the Actor distributions' top-k path
            (``bounds.distribution_topk``; :mod:`qualify_harness.distribution`).
    """

    algorithm: str
    rounds: int
    micro_batch_size: int
    loss_agg_mode: str = "token-mean"
    clip_ratio: float
    value_clip: float = 0.2
    kl_loss_coef: float = 0.0
    kl_loss_estimator: str = "k3"
    entropy_coef: float = 0.0
    behavior_weight_cap: float | None = None
    behavior_weight_cap_mode: str = "truncate"
    actor_lr: float
    critic_lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    max_grad_norm: float
    temperature: float
    distribution_topk: int = DEFAULT_DISTRIBUTION_TOPK

    @classmethod
    def from_contract(cls, doc: Mapping[str, Any]) -> Recipe:
        """From the ``contract.json`` document.

        Raises:
            InputError: a section or a required key is missing (named).
        """
        try:
            alg, opt, smp = doc["algorithm"], doc["optimizer"], doc["sampling"]
            kw: dict[str, Any] = {"algorithm": str(alg["name"]), "rounds": int(alg["rounds"]),
                                  "micro_batch_size": int(alg["micro_batch_size"]),
                                  "clip_ratio": float(alg["clip_ratio"]),
                                  "actor_lr": float(opt["actor_lr"]),
                                  "critic_lr": float(opt["critic_lr"]),
                                  "betas": (float(opt["betas"][0]), float(opt["betas"][1])),
                                  "eps": float(opt["eps"]),
                                  "weight_decay": float(opt["weight_decay"]),
                                  "max_grad_norm": float(opt["max_grad_norm"]),
                                  "temperature": float(smp["temperature"])}
        except (KeyError, IndexError, TypeError) as exc:
            raise InputError(f"{CONTRACT_FILE}: missing or bad field {exc}") from None
        for key, conv in (("loss_agg_mode", str), ("value_clip", float),
                          ("kl_loss_coef", float), ("kl_loss_estimator", str),
                          ("entropy_coef", float), ("behavior_weight_cap_mode", str)):
            if key in alg:
                kw[key] = conv(alg[key])
        bounds = doc.get("bounds")
        if isinstance(bounds, Mapping) and "distribution_topk" in bounds:
            kw["distribution_topk"] = int(bounds["distribution_topk"])
        cap = alg.get("behavior_weight_cap")
        kw["behavior_weight_cap"] = None if cap is None else float(cap)
        return cls(**kw)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Inputs:
    """What a harness reads from ``inputs_dir`` (and nothing else).

    Attributes:
        batch: the rollout with the training inputs.
        recipe: the driver's view of the contract.
        contract: the ``contract.json`` document itself.
        actor_dir, critic_dir, ref_dir: HF model directories (``model.json``; ``ref_dir``
            defaults to ``actor_dir``).
    """

    batch: Batch
    recipe: Recipe
    contract: Mapping[str, Any]
    actor_dir: Path
    critic_dir: Path
    ref_dir: Path


def read_inputs(inputs_dir: Path) -> Inputs:
    """Load the frozen rollout, training inputs, contract and model paths.

    Raises:
        InputError: a file, tensor, contract field or model path is missing, or shapes
            disagree (the message names the file and the field).
    """
    for name in (ROLLOUT_FILE, TRAIN_INPUTS_FILE, CONTRACT_FILE, MODEL_FILE):
        if not (inputs_dir / name).is_file():
            raise InputError(f"{inputs_dir / name}: missing harness input")
    rollout = load_file(str(inputs_dir / ROLLOUT_FILE))
    train = load_file(str(inputs_dir / TRAIN_INPUTS_FILE))
    for file, tensors, keys in ((ROLLOUT_FILE, rollout, ROLLOUT_KEYS),
                                (TRAIN_INPUTS_FILE, train, TRAIN_INPUT_KEYS)):
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise InputError(f"{inputs_dir / file}: missing tensors {missing}")
    contract = json.loads((inputs_dir / CONTRACT_FILE).read_text("utf-8"))
    models = json.loads((inputs_dir / MODEL_FILE).read_text("utf-8"))
    prompts, responses = rollout["prompts"], rollout["responses"]
    b, p = prompts.shape
    r = responses.shape[1]
    for key, shape in (("attention_mask", (b, p + r)), ("position_ids", (b, p + r)),
                       ("response_mask", (b, r))):
        if tuple(rollout[key].shape) != shape:
            raise InputError(f"{ROLLOUT_FILE}: {key} has shape {tuple(rollout[key].shape)}, "
                             f"expected {shape}")
    for key in TRAIN_INPUT_KEYS:
        if tuple(train[key].shape) != (b, r):
            raise InputError(f"{TRAIN_INPUTS_FILE}: {key} has shape "
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
        behavior_logprobs=rollout["behavior_logprobs"].float(),
    )
    try:
        dirs = {k: Path(models[k]) for k in ("actor_dir", "critic_dir")}
    except KeyError as exc:
        raise InputError(f"{inputs_dir / MODEL_FILE}: missing {exc.args[0]!r}") from None
    return Inputs(batch=batch, recipe=Recipe.from_contract(contract), contract=contract,
                  actor_dir=dirs["actor_dir"], critic_dir=dirs["critic_dir"],
                  ref_dir=Path(models.get("ref_dir", models["actor_dir"])))
