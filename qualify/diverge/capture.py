"""The reference side of ``qualify diverge``: HF module outputs on the frozen inputs.

Runs the reference's own update (:func:`qualify.reference.update.run_actor` /
:func:`~qualify.reference.update.run_critic`, the code that sealed the reference) on the
run's frozen inputs (``RUN_DIR/inputs``: the rollout and training inputs the engine read),
in the lane of the cell (:mod:`qualify.lanes`: ``fp32``, ``bf16`` = BF16 parameters with an
FP32 master, ``bf16-castmasters`` = the same with the master born ``bf16(checkpoint)``,
``bf16-autocast``), and once per control of that lane
(:func:`qualify.reference.controls.control_settings`, the ones the contract's
``bounds.controls.candidate_vs_hf`` names: eager-vs-sdpa attention, another micro-batch
partition with extra padding, FP64 for the FP32 lane). Rounds before the probed round run
as the reference does (its own forward, loss, backward, clip and AdamW step), so round
``r``'s weights are the reference's. In round ``r`` every micro-batch's forward and
backward runs under a :data:`qualify.reference.update.ProbeHook` that records each probed
HF module's output and the gradient of the round's loss with respect to it.

This code shares nothing with the harnesses' probe (``harnesses/layer_probe.py``): the
module list is the same HF names, written here again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import torch
from safetensors.torch import load_file
from torch import nn

from qualify.contract import Contract
from qualify.lanes import lane_bf16_mode, lane_precision
from qualify.models import roles
from qualify.protocol import TRAIN_INPUTS_FILE
from qualify.reference import controls, rollout
from qualify.reference.update import Batch, UpdateSettings, run_actor, run_critic

SUBMODULES: Final = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def probe_names(model: nn.Module) -> list[str]:
    """HF names probed, in forward order.

    The embedding, per layer its four sub-modules then the layer, the final norm, the
    head (``lm_head`` or ``score``).
    """
    prefix = str(getattr(model, "base_model_prefix", "model"))
    present = {n for n, _ in model.named_modules()}
    n_layers = len(getattr(model, prefix).layers)
    order = [f"{prefix}.embed_tokens"]
    for i in range(n_layers):
        order += [f"{prefix}.layers.{i}.{s}" for s in SUBMODULES] + [f"{prefix}.layers.{i}"]
    order += [f"{prefix}.norm", "lm_head", "score"]
    return [n for n in order if n in present]


@dataclasses.dataclass(kw_only=True)
class Capture:
    """Module outputs and output gradients of one run's probed round.

    Attributes:
        modules: HF names in forward order.
        fwd, bwd: name -> ``[B, T', F]`` FP32 (rows in batch order; ``T'`` includes this
            run's extra padding).
        left_padding, right_padding: this run's extra pad columns.
        prompt_len: ``P'`` of this run's batch (extra left padding included).
    """

    modules: list[str]
    fwd: dict[str, torch.Tensor]
    bwd: dict[str, torch.Tensor]
    left_padding: int = 0
    right_padding: int = 0
    prompt_len: int = 0


class _Recorder:
    """A :data:`~qualify.reference.update.ProbeHook` recording round ``round_`` only."""

    def __init__(self, round_: int) -> None:
        self.round = round_
        self.modules: list[str] = []
        self.fwd: dict[str, list[torch.Tensor]] = {}
        self.bwd: dict[str, list[torch.Tensor]] = {}
        self.prompt_len = 0

    @contextlib.contextmanager
    def __call__(self, round_: int, work: nn.Module, mb: Batch) -> Iterator[None]:
        if round_ != self.round:
            yield
            return
        self.prompt_len = int(mb.prompts.shape[1])
        named = dict(work.named_modules())
        self.modules = probe_names(work)
        handles = []
        for name in self.modules:
            self.fwd.setdefault(name, [])
            self.bwd.setdefault(name, [])

            def hook(_m: nn.Module, _i: Any, out: Any, name: str = name) -> None:
                t = out if isinstance(out, torch.Tensor) else (
                    out[0] if isinstance(out, (tuple, list)) else None)
                if not isinstance(t, torch.Tensor):
                    return
                self.fwd[name].append(t.detach().float().clone())
                if t.requires_grad:
                    t.register_hook(
                        lambda g, name=name: self.bwd[name].append(g.detach().float().clone()))

            handles.append(named[name].register_forward_hook(hook))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def result(self, settings: UpdateSettings) -> Capture:
        def cat(store: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
            return {n: torch.cat(v, 0) for n, v in store.items() if v}

        return Capture(modules=self.modules, fwd=cat(self.fwd), bwd=cat(self.bwd),
                       left_padding=settings.extra_left_padding,
                       right_padding=settings.extra_right_padding, prompt_len=self.prompt_len)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FrozenInputs:
    """What the engine read from ``RUN_DIR/inputs``, as the reference update consumes it.

    Attributes:
        batch: rollout + training inputs.
        contract: the run's contract (``inputs/contract.json``).
        actor_dir, critic_dir, ref_dir: HF model directories (``inputs/model.json``).
    """

    batch: Batch
    contract: Contract
    actor_dir: Path
    critic_dir: Path
    ref_dir: Path


def read_frozen_inputs(inputs_dir: Path, contract: Contract) -> FrozenInputs:
    """Load the run's frozen inputs.

    Raises:
        ReferenceDataError: the rollout fails its checks.
        OSError, KeyError, ValueError: a file or field is missing (the CLI turns them into
            one line).
    """
    roll = rollout.Rollout.load(inputs_dir)
    train = load_file(str(inputs_dir / TRAIN_INPUTS_FILE))
    model = json.loads((inputs_dir / "model.json").read_text(encoding="utf-8"))
    batch = Batch(prompts=roll.prompts, responses=roll.responses,
                  attention_mask=roll.attention_mask, response_mask=roll.response_mask,
                  advantages=train["advantages"], returns=train["returns"],
                  pad_token_id=int(roll.pad_token_id),
                  behavior_logprobs=roll.behavior_logprobs.float())
    actor = Path(model["actor_dir"])
    return FrozenInputs(batch=batch, contract=contract, actor_dir=actor,
                        critic_dir=Path(model["critic_dir"]),
                        ref_dir=Path(model.get("ref_dir") or actor))


def run_capture(inputs: FrozenInputs, *, role: str, settings: UpdateSettings, attn: str,
                round_: int) -> Capture:
    """One reference (or control) update run of ``role`` with round ``round_`` recorded.

    Fresh FP32 models from the frozen checkpoints (FP64 copies for the ``fp64`` control),
    ``torch.manual_seed(0)`` first, as :func:`qualify.reference.stage._update_run`; the
    update runs rounds ``1..round_`` only (later rounds cannot change round ``round_``).
    """
    torch.manual_seed(0)
    rec = _Recorder(round_)
    fp64 = settings.precision == "fp64"
    # Rounds after the probed one cannot change it: stop there.
    contract = dataclasses.replace(inputs.contract, algorithm=dataclasses.replace(
        inputs.contract.algorithm, rounds=round_))
    if role == "actor":
        actor = roles.load_actor(inputs.actor_dir, dtype=torch.float32,
                                 attn_implementation=attn, requires_grad=True)
        ref = roles.load_actor(inputs.ref_dir, dtype=torch.float32, attn_implementation=attn,
                               requires_grad=False)
        if fp64:
            actor, ref = actor.double(), ref.double()
        run_actor(actor, ref, inputs.batch, contract, settings, probe=rec)
    else:
        critic = roles.load_critic(inputs.critic_dir, dtype=torch.float32,
                                   attn_implementation=attn, requires_grad=True)
        if fp64:
            critic = critic.double()
        run_critic(critic, inputs.batch, contract, settings, probe=rec)
    return rec.result(settings)


def reference_captures(inputs: FrozenInputs, *, lane: str, role: str,
                       round_: int) -> tuple[Capture, dict[str, Capture]]:
    """The HF reference of ``lane`` and each of its ``candidate_vs_hf`` controls.

    Returns:
        ``(reference, {control name: capture})``.
    """
    c = inputs.contract
    prec = lane_precision(lane)
    main = UpdateSettings(precision="bf16" if prec == "bf16" else "fp32",
                          bf16_mode=lane_bf16_mode(lane),
                          micro_batch_size=c.algorithm.micro_batch_size, label=f"hf-{lane}")
    ref = run_capture(inputs, role=role, settings=main, attn="sdpa", round_=round_)
    wanted = set(c.bounds.controls_candidate_vs_hf)
    ctrl = {name: run_capture(inputs, role=role, settings=s, attn=attn, round_=round_)
            for name, (s, attn) in controls.control_settings(c, lane).items()
            if name in wanted}
    return ref, ctrl
