"""Deliberate translation bugs for the test suite: each must be caught by the comparator.

Never active in a real run (``cell.faults`` is empty). The adapter's numerical path holds no
fault: a launch whose cell names faults calls :func:`install`, which replaces the translation
function the fault corrupts, in that process only. Names:

- ``response_mask_shifted``: the ``response_mask`` verl gets (its loss mask,
  :func:`harnesses.verl.harness.response_loss_mask`) rolled right by one token, the
  off-by-one of a prompt / response boundary.
- ``advantages_unnormalised``: the advantages verl gets
  (:func:`harnesses.verl.harness.advantages_in`) scaled by 4, as advantages passed before a
  whitening that divides by their spread would be.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import torch
from torch import Tensor

from qualify.errors import HarnessError

KNOWN: Final = ("response_mask_shifted", "advantages_unnormalised")


def shifted_mask(response_mask: Tensor) -> Tensor:
    """FAULT ``response_mask_shifted``: the response mask rolled right by one token."""
    return torch.roll(response_mask.long(), 1, dims=1)


def unnormalised(advantages: Tensor) -> Tensor:
    """FAULT ``advantages_unnormalised``: the advantages times 4."""
    return advantages.float() * 4.0


def install(names: Sequence[str], harness: Any) -> None:
    """Patch the named faults into this process's adapter (a test-only plugin).

    Args:
        names: ``cell.faults``.
        harness: the running harness module (:mod:`harnesses.verl.harness`).

    Raises:
        HarnessError: an unknown fault name.
    """
    unknown = sorted(set(names) - set(KNOWN))
    if unknown:
        raise HarnessError(f"unknown fault(s) {unknown}; verl knows {list(KNOWN)}")
    if "response_mask_shifted" in names:
        harness.response_loss_mask = shifted_mask
    if "advantages_unnormalised" in names:
        harness.advantages_in = unnormalised
