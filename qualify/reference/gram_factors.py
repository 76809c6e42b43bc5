"""The clip-branch Gram ``<J_s, J_t>`` rebuilt from each token's backward factors.

Between the two ways of :mod:`qualify.reference.gram` (the whole ``J_t`` kept while they fit;
one forward-mode pass per token otherwise) lies a third, for models whose sealed tokens'
whole ``J_t`` do not fit in memory but whose weight matrices are the weights of
``nn.Linear`` and ``nn.Embedding`` modules (every weight matrix of Llama, Qwen3 and their
critics; the RMSNorm vectors are kept whole). A linear layer ``y_i = W x_i + b`` used at
positions ``i`` has the gradient ``sum_i delta_i x_i^T`` (``delta_i = d out / d y_i``), an
embedding the rows ``sum_{i: id_i = v} delta_i``: a token's gradient of a weight matrix is
fixed by the per-position inputs ``x_i`` (shared by every token of a sequence's forward)
and output gradients ``delta_i`` (zero after the token's position in a causal model; the
Actor's head has one nonzero row). :class:`FactorCapture` records them with module hooks
while :func:`qualify.reference.jacobian.token_gradients` runs its forward and backward
passes, keeping only the nonzero rows of each ``delta``; :meth:`FactorCapture.gram` then
rebuilds, parameter by parameter and a block of rows at a time, every token's ``J_t`` (FP32
products, as autograd computes them) and sums ``J J^T`` (FP32 products over at most
:data:`GEMM_COLUMNS` elements, those partial sums added in FP64). Bytes: the factors
(SmolLM2-135M: at most 30 MB per token against 538 MB for its whole ``J_t``); the reference
stage writes each token's output gradients to a temporary directory (``spill``, on disk for
the saving to hold: :func:`qualify.scratch.scratch_root` avoids a tmpfs; named as an atomic
write's temporary, so the next stage removes one a killed process left,
:func:`spill_directory`) and keeps in memory the inputs (once per forward), the uncovered
parameters' whole ``J_t`` (the RMSNorm vectors) and, while the Gram runs, one parameter's
factors and one block. An Embedding's padding row gets no gradient (autograd skips
``padding_idx``), and the rebuild skips it too.
Time: the Gram's ``N^2 P`` products in one matrix product per block, against one forward
with tangents per token (about ``3 P`` products per position) for the forward-mode rows. (A
linear layer's gradient as a sum of per-position outer products is what per-example
gradient methods build on: Goodfellow 2015, "Efficient Per-Example Gradient Computations";
Li et al. 2022, "Large Language Models Can Be Strong Differentially Private Learners",
section 4.)

Checked as the forward-mode Gram is: the rebuilt diagonal against the exact FP64 ``|J_t|^2``
of autograd's ``J_t``, and one more direction, the round's gradient ``g`` (rebuilt
``<g, J_t>`` against the exact FP64 one; ``g`` rides along as one more row of each
product). The largest discrepancy, relative to the Gram's scale ``max_u |J_u|^2`` (for
``<g, J_t>``: to ``|g| max_u |J_u|``), is sealed as ``gram_rel_error``, and one above
:data:`qualify.reference.gram.MAX_REL_ERROR` is refused: a weight that some other code also
reads (a use the hooks do not see) misses part of every ``J_t`` that reaches it
(``tests/test_gram_factors.py``).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from qualify import atomic, scratch
from qualify.errors import ReferenceDataError
from qualify.reference.gram import MAX_REL_ERROR

__all__ = ["BUDGET_BYTES", "SPILL_NAME", "FactorCapture", "factor_bytes", "spill_directory"]

SPILL_NAME = "qualify-gram-factors"
"""A spill directory is an atomic temporary of this name: ``.tmp-qualify-gram-factors.<host>.
<pid>.<random>.partial`` (:func:`qualify.atomic.temp_prefix`)."""

BUDGET_BYTES = 4 << 30
"""Use the factored Gram while the sealed tokens' factors, estimated by :func:`factor_bytes`,
fit this many bytes per precision, role and round, in memory and in the spill directory
together (SmolLM2-135M's Actor, 112 tokens in 8 sequences of 37 positions: 3.6 GB)."""
BLOCK_BYTES = 256 << 20
"""Rebuild at most this many bytes of ``J`` (all tokens, one block of a parameter's rows) at
a time."""
GEMM_COLUMNS = 1 << 16
"""Each matrix product of the Gram sums at most this many elements per entry; the partial
sums are added in FP64."""


@dataclass
class _Use:
    """One place a parameter enters the forward: a Linear's weight or bias, an Embedding."""

    module: str
    kind: str  # "weight" (Linear), "bias" (Linear), "embedding"
    padding_idx: int | None = None  # an Embedding's row autograd leaves without gradient


@dataclass
class _Token:
    """One token's factors: its forward, per module the nonzero ``delta`` rows (or spilled)."""

    forward: int
    rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    spill: Path | None = None
    spilled: set[str] = field(default_factory=set)

    def get(self, module: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(row indices [k] int64, delta rows [k, out] FP32)``, or None (no gradient)."""
        if self.spill is None:
            return self.rows.get(module)
        if module not in self.spilled:
            return None
        t = load_file(self.spill / f"{module}.safetensors")
        return t["idx"], t["delta"]


def _plain_embedding(mod: nn.Module) -> bool:
    """An ``nn.Embedding`` whose weight gradient is the index_add of its output gradients.

    Not one renormalised by ``max_norm``, scaled by frequency or with sparse gradients: their
    weights count as uncovered (kept whole per token, :func:`factor_bytes`).
    """
    return (type(mod) is nn.Embedding and mod.max_norm is None
            and not mod.scale_grad_by_freq and not mod.sparse)


def _factored_modules(model: nn.Module) -> Iterator[tuple[str, nn.Linear | nn.Embedding]]:
    """``(name, module)`` of every module whose weights the factors cover.

    Every ``nn.Linear`` and every plain ``nn.Embedding`` (:func:`_plain_embedding`).
    """
    for name, mod in model.named_modules():
        if type(mod) is nn.Linear or _plain_embedding(mod):
            assert isinstance(mod, (nn.Linear, nn.Embedding))
            yield name, mod


def _uses(model: nn.Module) -> dict[int, list[_Use]]:
    """``{id(parameter): its uses}`` by the Linear and plain Embedding modules of ``model``."""
    uses: dict[int, list[_Use]] = {}
    for name, mod in _factored_modules(model):
        if isinstance(mod, nn.Linear):
            uses.setdefault(id(mod.weight), []).append(_Use(name, "weight"))
            if mod.bias is not None:
                uses.setdefault(id(mod.bias), []).append(_Use(name, "bias"))
        else:
            uses.setdefault(id(mod.weight), []).append(
                _Use(name, "embedding", padding_idx=mod.padding_idx))
    return uses


def factor_bytes(model: nn.Module, n_tokens: int, n_sequences: int, positions: int) -> int:
    """An upper bound of the bytes :class:`FactorCapture` keeps for ``n_tokens`` tokens.

    :func:`qualify.reference.jacobian.token_gradients` runs one forward per sequence holding
    sealed tokens and one backward per token: the inputs are kept once per forward, the output
    gradients once per token (with an int64 row index each), and one token's output gradients
    are held whole until :meth:`FactorCapture.take` files them.

    Args:
        model: the model the tokens' ``J_t`` are taken of.
        n_tokens: sealed tokens (one backward each: the output gradients).
        n_sequences: sequences holding them (one forward each: the inputs).
        positions: the longest cut sequence (prompt plus response length).

    Returns:
        ``positions * (4 * n_sequences * sum of input widths + (4 * (n_tokens + 1) * sum of
        output widths + 8 * n_tokens * modules))`` over the Linear and plain Embedding modules
        (an Embedding's input is one int64 id per position: width 2), plus ``4 * n_tokens``
        times the trainable elements they do not cover (kept whole per token). Not counted:
        the safetensors headers of spilled files, and the Gram's one block
        (:data:`BLOCK_BYTES`).
    """
    width_in, width_out, modules = 0, 0, 0
    for _, mod in _factored_modules(model):
        if isinstance(mod, nn.Linear):
            width_in, width_out = width_in + mod.in_features, width_out + mod.out_features
        else:
            width_in, width_out = width_in + 2, width_out + mod.embedding_dim
        modules += 1
    covered = _uses(model)
    rest = sum(p.numel() for p in model.parameters() if p.requires_grad and id(p) not in covered)
    return (positions * (4 * n_sequences * width_in + 4 * (n_tokens + 1) * width_out
                         + 8 * n_tokens * modules) + 4 * n_tokens * rest)


class FactorCapture:
    """Record each token's backward factors and rebuild the Gram from them (module docstring).

    Use: ``with capture.hooks():`` around :func:`qualify.reference.jacobian.token_gradients`;
    after each token it yields, :meth:`take` (the factors of that backward); then
    :meth:`gram`.

    Args:
        model: the FP32 module the tokens' gradients are taken of (``work`` = ``master``).
        names: its trainable parameter names (the keys of each ``J_t``).
        spill: an empty directory the caller owns and removes: each token's output gradients
            are written there (one safetensors file per token and module) instead of held in
            memory, so the resident factors are the inputs (once per forward) and the
            uncovered parameters' whole ``J_t``; None keeps everything in memory.
    """

    def __init__(self, model: nn.Module, names: Sequence[str],
                 spill: Path | None = None) -> None:
        self._spill = spill
        self._model = model
        params = dict(model.named_parameters())
        by_id = _uses(model)
        self._names = list(names)
        self._params = {n: params[n] for n in self._names}
        self._uses = {n: by_id.get(id(p), []) for n, p in self._params.items()}
        self._inputs: dict[int, dict[str, torch.Tensor]] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._tokens: dict[str, _Token] = {}
        self._whole: dict[str, dict[str, torch.Tensor]] = {}  # uncovered parameters
        self._forward = -1

    @property
    def uncovered(self) -> list[str]:
        """Trainable parameters no Linear or Embedding uses (kept whole per token)."""
        return [n for n in self._names if not self._uses[n]]

    @contextmanager
    def hooks(self) -> Iterator[None]:
        """Module hooks: each forward's inputs, each backward's output gradients."""
        handles = [self._model.register_forward_pre_hook(self._new_forward)]
        for name, mod in _factored_modules(self._model):
            handles.append(mod.register_forward_hook(self._on_forward(name)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _new_forward(self, *_: Any) -> None:
        self._forward += 1
        self._inputs[self._forward] = {}

    def _on_forward(self, name: str) -> Any:
        def hook(mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            seen = self._inputs[self._forward]
            if name in seen:
                raise ReferenceDataError(f"factored Gram: module {name} runs twice in one "
                                         "forward; its per-position factors are ambiguous")
            x = args[0].detach().cpu()  # the factors live on the host (placed models)
            seen[name] = (x.reshape(-1).long() if isinstance(mod, nn.Embedding)
                          else x.reshape(-1, x.shape[-1]))
            if out.requires_grad:
                out.register_hook(self._on_grad(name))
        return hook

    def _on_grad(self, name: str) -> Any:
        def hook(g: torch.Tensor) -> None:
            if name in self._pending:  # one output, one gradient per backward
                raise ReferenceDataError(f"factored Gram: module {name}'s output gradient "
                                         "arrived twice before its token was filed")
            self._pending[name] = g.detach().reshape(-1, g.shape[-1]).cpu().clone()
        return hook

    def take(self, key: str, whole: Mapping[str, torch.Tensor]) -> None:
        """File the backward just run as token ``key``'s factors.

        Args:
            key: the token.
            whole: ``{parameter name: FP32 J_t}`` of that backward
                (:func:`qualify.reference.jacobian.token_gradients`); the parameters no
                Linear or Embedding uses are kept from it, whole.
        """
        tok = _Token(forward=self._forward,
                     spill=None if self._spill is None else self._spill / key)
        if tok.spill is not None:
            tok.spill.mkdir()
        for name, g in self._pending.items():
            idx = g.ne(0).any(dim=1).nonzero().reshape(-1)
            d = g[idx].to(torch.float32)
            if tok.spill is None:
                tok.rows[name] = (idx, d)
            else:
                save_file({"idx": idx, "delta": d.contiguous()},
                          tok.spill / f"{name}.safetensors")
                tok.spilled.add(name)
        self._pending = {}
        self._tokens[key] = tok
        self._whole[key] = {n: whole[n].detach().to(torch.float32).cpu().clone()
                            for n in self.uncovered}

    def _factors(self, keys: Sequence[str], name: str
                 ) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Per token of ``keys``: the ``(x, delta)`` rows of every module using ``name``."""
        out: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for key in keys:
            tok, here = self._tokens[key], {}
            for use in self._uses[name] if name not in self._whole[key] else []:
                rows = tok.get(use.module)
                if rows is not None:  # else no gradient reached the module: it adds zero
                    idx, d = rows
                    here[use.module] = (self._inputs[tok.forward][use.module][idx], d)
            out.append(here)
        return out

    def _rebuild(self, keys: Sequence[str], name: str, rows: tuple[int, int],
                 factors: Sequence[Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
                 grad: torch.Tensor) -> torch.Tensor:
        """Rows ``r0:r1`` of parameter ``name``'s ``J_t`` for every token, then of ``grad``.

        Returns: ``[len(keys) + 1, (r1 - r0) * row]`` FP32 (``grad``: ``[rows, row]``).
        """
        r0, r1 = rows
        p = self._params[name]
        row = math.prod(p.shape[1:])
        out = torch.zeros(len(keys) + 1, r1 - r0, row, dtype=torch.float32)
        out[-1] = grad[r0:r1]
        for k, key in enumerate(keys):
            if name in self._whole[key]:
                out[k] = self._whole[key][name].reshape(-1, row)[r0:r1]
                continue
            for use in self._uses[name]:
                if use.module not in factors[k]:
                    continue
                x, d = factors[k][use.module]
                if use.kind == "weight":
                    out[k] += d[:, r0:r1].T @ x
                elif use.kind == "bias":
                    out[k, :, 0] += d[:, r0:r1].sum(dim=0)
                else:  # autograd leaves the padding row without gradient
                    inside = (x >= r0) & (x < r1)
                    if use.padding_idx is not None:
                        inside &= x != use.padding_idx
                    out[k].index_add_(0, x[inside] - r0, d[inside])
        return out.reshape(len(keys) + 1, -1)

    def gram(self, norm_sq: Mapping[str, float], dot_grad: Mapping[str, float],
             grad: Mapping[str, torch.Tensor]) -> tuple[dict[str, dict[str, float]], float]:
        """The Gram of every filed token, and its checked error over the Gram's scale.

        Args:
            norm_sq: ``{key: |J_t|^2}`` exact in FP64 (the diagonal, taken as is).
            dot_grad: ``{key: <g, J_t>}`` exact in FP64.
            grad: ``{parameter name: g}``, the round's pre-clip gradient.

        Returns:
            ``(gram, rel_error)``: the off-diagonal entries from the rebuilt ``J``;
            ``rel_error`` the larger of ``max_t |rebuilt |J_t|^2 - norm_sq_t| / max_u
            |J_u|^2`` and ``max_t |rebuilt <g, J_t> - dot_grad_t| / (|g| max_u |J_u|)``
            (where every ``J_u`` is zero: 0 if the rebuilt value is zero too, else inf; NaN
            if any rebuilt entry is not finite).

        Raises:
            ReferenceDataError: ``rel_error`` exceeds
                :data:`qualify.reference.gram.MAX_REL_ERROR`, or a token was not filed.
        """
        keys = list(norm_sq)
        missing = [k for k in keys if k not in self._tokens]
        if missing:
            raise ReferenceDataError(f"factored Gram: tokens {missing} were not filed")
        n = len(keys)
        acc = torch.zeros(n + 1, n + 1, dtype=torch.float64)  # row n: g
        g_sq = 0.0
        for name in self._names:
            g = grad[name].detach().to(torch.float32).cpu()
            g_sq += float(g.double().square().sum())
            g = g.reshape(self._rows(name), -1)
            factors = self._factors(keys, name)
            for r0, r1 in self._blocks(name, n + 1):
                j = self._rebuild(keys, name, (r0, r1), factors, g)
                for c0 in range(0, j.shape[1], GEMM_COLUMNS):
                    part = j[:, c0:c0 + GEMM_COLUMNS]
                    acc += (part @ part.T).double()
        scale = max((float(norm_sq[k]) for k in keys), default=0.0)
        gram: dict[str, dict[str, float]] = {k: {} for k in keys}
        errors: list[float] = []
        for i, a in enumerate(keys):
            gram[a][a] = float(norm_sq[a])
            diag = abs(float(acc[i, i]) - gram[a][a])
            dot = abs(float(acc[n, i]) - float(dot_grad[a]))
            errors.append(diag / scale if scale > 0.0 else (0.0 if diag == 0.0 else math.inf))
            errors.append(dot / math.sqrt(g_sq * scale) if g_sq * scale > 0.0
                          else (0.0 if dot == 0.0 else math.inf))
            for j_, b in enumerate(keys[i + 1:], start=i + 1):
                gram[a][b] = gram[b][a] = float(acc[i, j_])
        # NaN anywhere (an entry or an error) is a discrepancy: max() would drop it
        worst = (math.nan if any(math.isnan(e) for e in errors)
                 or not bool(torch.isfinite(acc).all()) else max(errors, default=0.0))
        if not worst <= MAX_REL_ERROR:
            raise ReferenceDataError(
                f"factored clip-branch Gram: discrepancy {worst:.3g} of the Gram's scale "
                f"exceeds {MAX_REL_ERROR:g}; some weight is used outside the Linear and "
                "Embedding modules the factors see")
        return gram, worst

    def _rows(self, name: str) -> int:
        p = self._params[name]
        return p.shape[0] if p.dim() else 1

    def _blocks(self, name: str, n: int) -> Iterator[tuple[int, int]]:
        p = self._params[name]
        per = max(1, BLOCK_BYTES // max(1, 4 * n * math.prod(p.shape[1:])))
        for r0 in range(0, self._rows(name), per):
            yield r0, min(self._rows(name), r0 + per)


def spill_directory(root: Path | None = None) -> tempfile.TemporaryDirectory[str]:
    """A fresh spill directory under ``root``, removed by its context.

    ``root`` defaults to :func:`qualify.scratch.scratch_root`: ``$QUALIFY_SCRATCH_DIR``, else
    the temporary directory unless it keeps files in memory (a tmpfs), else ``/var/tmp``.

    The spills there of writers that are gone are removed first
    (:func:`qualify.atomic.remove_stale_temporaries`): a reference stage killed with SIGKILL
    or by the OOM killer runs no cleanup and leaves up to :data:`BUDGET_BYTES`. A live
    writer's spill and another host's (a shared scratch) are kept; a process that started
    after the spill was last written is not its writer (a recycled pid).
    """
    where = scratch.scratch_root() if root is None else root
    atomic.remove_stale_temporaries(where, name=SPILL_NAME)
    return tempfile.TemporaryDirectory(dir=where, prefix=atomic.temp_prefix(SPILL_NAME),
                                       suffix=atomic.TMP_SUFFIX)
