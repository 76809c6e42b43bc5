"""Timestamps of evidence: ISO-8601 UTC with a ``Z`` suffix, written and parsed here only.

Manifests (``created``), ``INCOMPLETE`` markers (``started``), statements (``sealed``,
``signed``) and gate decisions all carry :func:`utc_now_iso`; verification step 8 orders
them with :func:`parse_time`.
"""

from __future__ import annotations

import datetime as _dt
from typing import Final

from qualify.errors import EvidenceIntegrityError

__all__ = ["ISO_FORMAT", "parse_time", "utc_now", "utc_now_iso", "utc_stamp"]

ISO_FORMAT: Final = "%Y-%m-%dT%H:%M:%S.%fZ"
"""``strftime`` format of :func:`utc_now_iso` (microseconds, ``Z`` suffix)."""


def utc_now_iso() -> str:
    """Current time as ISO-8601 UTC with microseconds and a ``Z`` suffix."""
    now = _dt.datetime.now(_dt.UTC)
    return now.strftime(ISO_FORMAT)


def utc_now() -> str:
    """Alias of :func:`utc_now_iso` (ISO-8601 UTC, ``Z`` suffix)."""
    return utc_now_iso()


def utc_stamp() -> str:
    """Current UTC time for file names (no colons), e.g. ``20250131T120102.000001Z``."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S.%fZ")


def parse_time(value: object, what: str) -> _dt.datetime:
    """Parse an ISO-8601 UTC timestamp (``...Z``) into an aware datetime.

    Args:
        value: the timestamp as read from a document.
        what: where it was read (for the message).

    Returns:
        The aware datetime (UTC assumed when the text names no zone).

    Raises:
        EvidenceIntegrityError: not a string or not ISO-8601.
    """
    if not isinstance(value, str):
        raise EvidenceIntegrityError(f"{what}: timestamp missing or not a string: {value!r}")
    try:
        t = _dt.datetime.fromisoformat(value)
    except ValueError:
        raise EvidenceIntegrityError(f"{what}: not an ISO-8601 timestamp: {value!r}") from None
    return t if t.tzinfo is not None else t.replace(tzinfo=_dt.UTC)
