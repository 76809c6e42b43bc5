"""Layer probes for ``qualify diverge``: capture module outputs and their gradients.

Not numerical: it records what the engine's own modules compute. A harness given a cell
with ``probe`` (:attr:`qualify.protocol.HarnessCell.probe`: ``{"round": r, "dir": path}``)
builds one :class:`LayerProbe` per role and wraps each micro-batch's forward and backward
of round ``r`` in :meth:`LayerProbe.capture`. Forward hooks record every probed module's
output, and a tensor hook on that output records the gradient of the round's loss with
respect to it (the module's output gradient), both as FP32 CPU tensors in the HF layout:
the harness passes ``to_full``, its own layout code that turns a sharded output (a
vocab-parallel ``DTensor`` logit, Megatron's ``[S, B, H]``) into the full ``[B, T, F]``
(or ``[B, R, F]`` on the response window) tensor of the HF model.

Probed modules (HF names, :func:`hf_probe_names`): ``{prefix}.embed_tokens``, for every
decoder layer ``i`` ``{prefix}.layers.{i}.input_layernorm``, ``.self_attn``,
``.post_attention_layernorm``, ``.mlp`` and the layer itself, ``{prefix}.norm``, and the
head (``lm_head`` or ``score``). Micro-batches are concatenated along rows in batch order,
so ``fwd/<name>`` is ``[B, T or R, F]``. The writer rank saves ``probe.safetensors`` and
``probe.json`` (module order, shapes, the sequence frame) into ``dir/<role>/``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import torch
from torch import Tensor, nn

from harnesses import common

PROBE_FILE: Final = "probe.safetensors"
PROBE_META: Final = "probe.json"
SUBMODULES: Final = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
"""Sub-modules of a decoder layer probed, in forward order (the layer itself last)."""

ToFull = Callable[[str, Tensor], Tensor]


def hf_probe_names(module_names: list[str], prefix: str, n_layers: int) -> list[str]:
    """HF module names to probe, in forward order, those present in ``module_names``.

    Args:
        module_names: ``[n for n, _ in model.named_modules()]`` (HF names).
        prefix: the backbone attribute (``model.base_model_prefix``, ``model``).
        n_layers: decoder layers.
    """
    present = set(module_names)
    order = [f"{prefix}.embed_tokens"]
    for i in range(n_layers):
        order += [f"{prefix}.layers.{i}.{s}" for s in SUBMODULES] + [f"{prefix}.layers.{i}"]
    order += [f"{prefix}.norm", "lm_head", "score"]
    return [n for n in order if n in present]


def _first_tensor(out: Any) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    last = getattr(out, "last_hidden_state", None)
    return last if isinstance(last, Tensor) else None


class LayerProbe:
    """Hooks on named modules for one round; the captures of the writer rank.

    Args:
        spec: the cell's ``probe`` (``{"round": r, "dir": str}``) or ``None`` (inactive).
        role: ``actor`` or ``critic``.
        writer: this rank keeps and saves the captures.
        modules: HF name -> module, in forward order (:func:`hf_probe_names`).
        to_full: the harness's layout code: ``(name, local output or grad) -> full HF
            tensor`` (may be collective: every rank of the role calls it in the same order).
    """

    def __init__(self, spec: Mapping[str, Any] | None, *, role: str, writer: bool,
                 modules: Mapping[str, nn.Module], to_full: ToFull) -> None:
        self.round = int(spec["round"]) if spec else 0
        self.dir = Path(str(spec["dir"])) / role if spec else None
        self.role, self.writer = role, writer
        self.modules = dict(modules)
        self.to_full = to_full
        self.fwd: dict[str, list[Tensor]] = {n: [] for n in self.modules}
        self.bwd: dict[str, list[Tensor]] = {n: [] for n in self.modules}
        self.frame: dict[str, Any] = {}

    @property
    def active(self) -> bool:
        """A probe was asked for."""
        return self.dir is not None

    def _keep(self, store: dict[str, list[Tensor]], name: str, t: Tensor) -> None:
        full = self.to_full(name, t.detach())
        if self.writer:
            store[name].append(full.to("cpu", torch.float32).clone())

    @contextlib.contextmanager
    def capture(self, round_: int, prompt_len: int, seq_len: int) -> Iterator[None]:
        """Record outputs and output gradients of every probed module in this block.

        A no-op unless the probe is active and ``round_`` is its round. The block must run
        one micro-batch's forward and backward.

        Args:
            round_: the current round.
            prompt_len: ``P`` of the batch (its prompt columns).
            seq_len: ``T = P + R`` of the batch.
        """
        if not self.active or round_ != self.round:
            yield
            return
        self.frame = {"prompt_len": prompt_len, "seq_len": seq_len, "left_padding": 0}
        handles = []
        for name, mod in self.modules.items():
            def fwd_hook(_m: nn.Module, _i: Any, out: Any, name: str = name) -> None:
                t = _first_tensor(out)
                if t is None:
                    return
                self._keep(self.fwd, name, t)
                if t.requires_grad:
                    t.register_hook(lambda g, name=name: self._keep(self.bwd, name, g))

            handles.append(mod.register_forward_hook(fwd_hook))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def save(self, engine: str) -> None:
        """Write ``probe.safetensors`` / ``probe.json`` (writer rank, active probe only).

        Each micro-batch's backward runs after its forward and before the next one's, so
        both lists are in row order and concatenate to ``[B, ...]``.
        """
        if not self.active or not self.writer:
            return
        assert self.dir is not None
        tensors: dict[str, Tensor] = {}
        shapes: dict[str, Any] = {}
        for kind, store in (("fwd", self.fwd), ("bwd", self.bwd)):
            for name, parts in store.items():
                if parts:
                    t = torch.cat(parts, 0).contiguous()
                    tensors[f"{kind}/{name}"] = t
                    shapes[f"{kind}/{name}"] = list(t.shape)
        self.dir.mkdir(parents=True, exist_ok=True)
        common.atomic_tensors(self.dir / PROBE_FILE, tensors,
                              {"engine": engine, "role": self.role})
        common.atomic_json(self.dir / PROBE_META, {
            "engine": engine, "role": self.role, "round": self.round,
            "modules": list(self.modules), "shapes": shapes, "frame": self.frame})


def hf_modules(model: nn.Module) -> dict[str, nn.Module]:
    """HF name -> module of :func:`hf_probe_names` in a HF ``*ForCausalLM`` / critic."""
    prefix = str(getattr(model, "base_model_prefix", "model"))
    backbone = getattr(model, prefix)
    named = dict(model.named_modules())
    names = hf_probe_names(list(named), prefix, len(backbone.layers))
    return {n: named[n] for n in names}



def for_model(spec: Mapping[str, Any] | None, role: str, writer: bool, model: nn.Module,
              to_full: ToFull | None = None) -> LayerProbe:
    """A :class:`LayerProbe` over a HF model's :func:`hf_modules`.

    ``to_full`` defaults to the identity (an engine whose probed outputs are already full
    HF tensors: DeepSpeed AutoTP's all-reduced row-parallel outputs and gathered head).
    """
    return LayerProbe(spec, role=role, writer=writer, modules=hf_modules(model),
                      to_full=to_full or (lambda _name, t: t))
