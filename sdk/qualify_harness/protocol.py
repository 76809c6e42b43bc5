"""The file and tensor names of the harness protocol, as the SDK writes and reads them.

The harness side of ``qualify.protocol`` (which the comparator reads): the same names and
the same seeded per-parameter sampling, kept here so a harness needs no ``qualify`` import.
``tests/test_harness_sdk.py`` checks every name and the sampling against ``qualify.protocol``.
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
MODEL_FILE: Final = "model.json"
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
SAMPLED_PARAM_ELEMENTS: Final = 16_384
VOCAB_PARAMS: Final = ("model.embed_tokens.weight", "lm_head.weight")
"""HF parameters indexed by token id (``[vocab, H]``)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ParamSampling:
    """Which elements of a per-parameter tensor are reported (``cell.json`` ``param_sampling``).

    Attributes:
        exact_elements: a parameter of at most this many elements is reported whole.
        sample_elements: a larger one as this many seeded elements of its flattened values.
        rows: sorted distinct token ids of the rollout; a sampled :data:`VOCAB_PARAMS`
            parameter (``[vocab_size, H]``) also keeps these whole rows.
        vocab_size: ``V`` of those parameters (required with ``rows``).

    Raises:
        ValueError: sizes that are not integers with ``1 <= sample_elements <= exact_elements``;
            ``rows`` not sorted distinct ids in ``[0, vocab_size)``.
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

    def indices(self, name: str, numel: int) -> npt.NDArray[np.int64] | None:
        """``None`` (whole) or ``sample_elements`` sorted distinct int64 indices in ``[0, numel)``.

        Drawn without replacement by ``numpy.random.default_rng`` seeded from the first 8
        bytes (little endian) of sha256(``name:numel``); for a :data:`VOCAB_PARAMS` name whose
        ``numel`` is a multiple of ``vocab_size``, united with the elements of its
        :attr:`rows` (row ``i`` of ``[V, H]``: ``i H .. i H + H - 1``).
        """
        if numel <= self.exact_elements:
            return None
        seed = int.from_bytes(hashlib.sha256(f"{name}:{numel}".encode()).digest()[:8],
                              "little")
        idx = np.sort(np.random.default_rng(seed).choice(numel, size=self.sample_elements,
                                                         replace=False))
        if self.rows and name in VOCAB_PARAMS and numel % self.vocab_size == 0:
            width = numel // self.vocab_size
            rows = np.asarray(self.rows, dtype=np.int64)[:, None] * width + np.arange(width)
            idx = np.union1d(idx, rows.reshape(-1))
        return idx.astype(np.int64)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> ParamSampling:
        """From ``cell.json`` ``param_sampling`` (``None`` or a missing key: the default)."""
        d = d or {}
        return cls(exact_elements=int(d.get("exact_elements", EXACT_PARAM_ELEMENTS)),
                   sample_elements=int(d.get("sample_elements", SAMPLED_PARAM_ELEMENTS)),
                   rows=tuple(int(i) for i in d.get("rows", ())),
                   vocab_size=int(d.get("vocab_size", 0)))


def tensor_name(round_: int, role: str, metric: str, param: str | None = None) -> str:
    """``round{r}/{role}/{metric}`` (``/{param}`` for a per-parameter metric)."""
    base = f"round{round_}/{role}/{metric}"
    return f"{base}/{param}" if param is not None else base
