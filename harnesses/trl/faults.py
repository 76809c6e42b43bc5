"""Deliberate translation bugs for the test suite: each must be caught by the comparator.

Never active in a real run (``cell.faults`` is empty). The adapter's numerical path holds no
fault: a launch whose cell names faults calls :func:`install`, which replaces the translation
function the fault corrupts, in that process only. Names:

- ``completion_mask_shifted``: TRL's loss mask (``tool_mask``,
  :func:`harnesses.trl.harness.tool_mask`) is the rollout's response mask rolled right by
  one token, the off-by-one of a prompt / response boundary.
- ``temperature_not_passed``: ``GRPOConfig.temperature`` is left at TRL's default 1.0
  instead of the contract's sampling temperature
  (:func:`harnesses.trl.translate.sampling_kwargs`): the trainer's logprobs then refer to
  another distribution than the sampler's (TRL #4159).
- ``advantages_negated``: TRL's ``advantages`` input
  (:func:`harnesses.trl.harness.trl_advantages`) is the training inputs' advantages with the
  wrong sign, the sign-convention slip of a stack adapter (a reward taken as a cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from torch import Tensor

from harnesses import faults as shared
from qualify.contract import SamplingSpec

KNOWN: Final = ("completion_mask_shifted", "temperature_not_passed", "advantages_negated")


class Faults(shared.Faults):
    """The trl faults a cell asks for (:data:`KNOWN`; an unknown name is refused)."""

    ENGINE = "trl"
    KNOWN = KNOWN


def shifted_tool_mask(response_mask: Tensor, completion_attention: Tensor) -> Tensor:
    """FAULT ``completion_mask_shifted``: the response mask rolled right by one token."""
    del completion_attention
    return shared.shifted_response_mask(response_mask)


def default_temperature(sampling: SamplingSpec) -> dict[str, Any]:
    """FAULT ``temperature_not_passed``: TRL's default temperature, not the sampler's."""
    del sampling
    return {"temperature": 1.0}


def negated_advantages(advantages: Tensor) -> Tensor:
    """FAULT ``advantages_negated``: the advantages with the wrong sign."""
    return -advantages.float()


def install(names: Sequence[str], harness: Any) -> None:
    """Plant faults ``names`` (``cell.faults``) into ``harness`` (:mod:`harnesses.trl.harness`).

    Raises:
        HarnessError: an unknown fault name.
    """
    from harnesses.trl import translate

    shared.plant(Faults(names), {
        "completion_mask_shifted": (harness, "tool_mask", shifted_tool_mask),
        "advantages_negated": (harness, "trl_advantages", negated_advantages),
        "temperature_not_passed": (translate, "sampling_kwargs", default_temperature)})
