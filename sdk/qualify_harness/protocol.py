"""The file and tensor names of the harness protocol and its per-parameter sampling.

Written once, here, for both sides: a harness imports them from the SDK (it needs no
``qualify`` import), and ``qualify.protocol`` (which the comparator and the reference read,
with the rest of the protocol) re-exports the same objects.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import numpy.typing as npt

ROLLOUT_FILE: Final = "rollout.safetensors"
TRAIN_INPUTS_FILE: Final = "train_inputs.safetensors"
CONTRACT_FILE: Final = "contract.json"
"""The contract in canonical JSON (its digest is the contract digest)."""
MODEL_FILE: Final = "model.json"
"""The model bundle record (``qualify.models.bundle.ModelBundle.to_dict``: the roles' model
directories); a reference and a run's ``inputs/`` hold one."""
CELL_FILE: Final = "cell.json"
OUTPUTS_FILE: Final = "outputs.safetensors"
OUTPUTS_META_FILE: Final = "outputs.json"

ROLLOUT_KEYS: Final = ("prompts", "responses", "attention_mask", "position_ids",
                       "response_mask", "behavior_logprobs", "eos_terminated", "group_index")
"""Tensors ``rollout.safetensors`` holds (every one is checked present)."""
TRAIN_INPUT_KEYS: Final = ("advantages", "returns")
"""Tensors of ``train_inputs.safetensors`` (``[B, R]`` FP32 each)."""
EXTRA_RIGHT_PADDING: Final = 3
"""Pad columns appended for the padding-invariance rerun (``<metric>_padded``)."""
PADDED_SUFFIX: Final = "_padded"

EXACT_PARAM_ELEMENTS: Final = 32_768
"""Default: per-parameter tensors with at most this many elements are reported exactly."""
SAMPLED_PARAM_ELEMENTS: Final = 16_384
"""Default: elements reported for a larger parameter (a seeded sample of its flattened values)."""
VOCAB_PARAMS: Final = ("model.embed_tokens.weight", "lm_head.weight")
"""HF parameters indexed by token id (``[vocab, H]``): the rollout's rows are stored."""
FULL_DISTRIBUTION_MAX_VOCAB: Final = 4096
"""Largest vocabulary whose Actor next-token distributions are stored whole (``[B, R, V]``
per kind); above it the top-k path (:mod:`qualify_harness.distribution`). Equal to
``qualify.reference.distribution.MAX_VOCAB``, the reference side's switch."""
DEFAULT_DISTRIBUTION_TOPK: Final = 64
"""``k`` of the top-k path when ``contract.json`` has no ``bounds.distribution_topk``."""
DISTRIBUTION_KINDS: Final = ("raw", "tempered")
"""``raw``: ``log_softmax(logits)``; ``tempered``: ``log_softmax(logits / T)``."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ParamSampling:
    """How per-parameter families (grads, exp_avg, exp_avg_sq, updates, ``J_t``) are stored.

    Set by the contract's ``[evidence]`` section (``exact_param_elements``,
    ``sampled_param_elements``; the defaults when absent), carried to the harnesses in
    ``cell.json`` and used by the reference stage, so every side stores the same elements
    of the same parameters and every error is measured like for like.

    Attributes:
        exact_elements: a parameter with at most this many elements is stored whole.
        sample_elements: a larger one is stored as this many of its flattened values, at
            the seeded indices of :meth:`indices` (``1 <= sample_elements <=
            exact_elements``, so a sampled parameter always has more elements than its
            sample).
        rows: sorted distinct token ids of the rollout (every id of its ``prompts`` and
            ``responses``, pad columns included; :meth:`with_rows`). A sampled
            vocab-indexed parameter (:data:`VOCAB_PARAMS`, ``[vocab_size, H]``) also stores
            these whole rows, so a difference confined to one token's row (the pad id's
            embedding row, trained by one engine and frozen by another) is seen by the
            per-parameter rows and not only by the norm. Empty: the sample alone.
        vocab_size: ``V`` of those parameters (required with ``rows``).

    Raises:
        ValueError: the sizes are not integers with ``1 <= sample_elements <=
            exact_elements``; ``rows`` not sorted distinct ids in ``[0, vocab_size)``.
    """

    exact_elements: int = EXACT_PARAM_ELEMENTS
    sample_elements: int = SAMPLED_PARAM_ELEMENTS
    rows: tuple[int, ...] = ()
    vocab_size: int = 0

    def __post_init__(self) -> None:
        for field in ("exact_elements", "sample_elements", "vocab_size"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"param_sampling.{field}: {v!r} is not an integer")
        if not 1 <= self.sample_elements <= self.exact_elements:
            raise ValueError(f"param_sampling.sample_elements {self.sample_elements} must be "
                             f"in [1, exact_elements = {self.exact_elements}]")
        if self.rows and (list(self.rows) != sorted(set(self.rows))
                          or not 0 <= self.rows[0] <= self.rows[-1] < self.vocab_size):
            raise ValueError(f"param_sampling.rows: not sorted distinct token ids in "
                             f"[0, vocab_size = {self.vocab_size})")

    def with_rows(self, token_ids: npt.ArrayLike, vocab_size: int) -> ParamSampling:
        """This sampling with :attr:`rows` = the distinct ids of ``token_ids`` (any shape).

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        ids = np.unique(np.asarray(token_ids, dtype=np.int64).reshape(-1))
        return dataclasses.replace(self, rows=tuple(int(i) for i in ids),
                                   vocab_size=int(vocab_size))

    def indices(self, name: str, numel: int) -> npt.NDArray[np.int64] | None:
        """Which flattened elements of a per-parameter tensor are stored.

        Args:
            name: the HF parameter name.
            numel: its number of elements.

        Returns:
            ``None`` when the tensor is stored whole (``numel <= exact_elements``);
            otherwise ``sample_elements`` sorted distinct int64 indices in ``[0, numel)``
            drawn without replacement by ``numpy.random.default_rng`` seeded from the first 8
            bytes (little endian) of sha256(``name:numel``), so every harness and the
            reference store the same elements; for a :data:`VOCAB_PARAMS` name whose
            ``numel`` is a multiple of ``vocab_size``, united (sorted, distinct) with the
            flattened elements of its :attr:`rows` (row ``i`` of ``[V, H]``: ``i H ..
            i H + H - 1``).
        """
        if numel <= self.exact_elements:
            return None
        seed = int.from_bytes(hashlib.sha256(f"{name}:{numel}".encode()).digest()[:8],
                              "little")
        rng = np.random.default_rng(seed)
        idx = np.sort(rng.choice(numel, size=self.sample_elements, replace=False))
        if self.rows and name in VOCAB_PARAMS and numel % self.vocab_size == 0:
            width = numel // self.vocab_size
            rows = np.asarray(self.rows, dtype=np.int64)[:, None] * width + np.arange(width)
            idx = np.union1d(idx, rows.reshape(-1))
        return idx.astype(np.int64)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``cell.json`` ``param_sampling``; ``rows``, ``vocab_size`` when set)."""
        d: dict[str, Any] = {"exact_elements": self.exact_elements,
                             "sample_elements": self.sample_elements}
        if self.rows:
            d.update(rows=list(self.rows), vocab_size=self.vocab_size)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> ParamSampling:
        """Inverse of :meth:`to_dict`; ``None`` or a missing key gives the default.

        Raises:
            ValueError: invalid sizes (see the class).
        """
        d = d or {}
        return cls(exact_elements=int(d.get("exact_elements", EXACT_PARAM_ELEMENTS)),
                   sample_elements=int(d.get("sample_elements", SAMPLED_PARAM_ELEMENTS)),
                   rows=tuple(int(i) for i in d.get("rows", ())),
                   vocab_size=int(d.get("vocab_size", 0)))


def tensor_name(round_: int, role: str, metric: str, param: str | None = None) -> str:
    """Build an output tensor name, e.g. ``round2/actor/grads/model.norm.weight``.

    Args:
        round_: 1-based round.
        role: ``actor`` or ``critic``.
        metric: metric name (``logprobs``, ``loss/policy``, ``grads``...).
        param: HF parameter name for per-parameter metrics.
    """
    base = f"round{round_}/{role}/{metric}"
    return f"{base}/{param}" if param is not None else base
