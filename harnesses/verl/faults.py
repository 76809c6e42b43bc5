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

from torch import Tensor

from harnesses import faults as shared

KNOWN: Final = ("response_mask_shifted", "advantages_unnormalised")


class Faults(shared.Faults):
    """The verl faults a cell asks for (:data:`KNOWN`; an unknown name is refused)."""

    ENGINE = "verl"
    KNOWN = KNOWN


def unnormalised(advantages: Tensor) -> Tensor:
    """FAULT ``advantages_unnormalised``: the advantages times 4."""
    return advantages.float() * 4.0


def install(names: Sequence[str], harness: Any) -> None:
    """Plant faults ``names`` (``cell.faults``) into ``harness`` (:mod:`harnesses.verl.harness`).

    Raises:
        HarnessError: an unknown fault name.
    """
    shared.plant(Faults(names), {
        "response_mask_shifted": (harness, "response_loss_mask", shared.shifted_response_mask),
        "advantages_unnormalised": (harness, "advantages_in", unnormalised)})
