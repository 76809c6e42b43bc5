"""The SDK's errors: one base, one class per phase."""

from __future__ import annotations


class HarnessSDKError(RuntimeError):
    """Base of every error the SDK raises."""


class InputError(HarnessSDKError):
    """A frozen input (``cell.json``, rollout, train inputs, contract, model) is unusable."""


class OutputError(HarnessSDKError):
    """What a harness reports is incomplete or mis-typed (named in the message)."""
