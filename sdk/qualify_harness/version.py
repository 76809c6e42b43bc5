"""The SDK's version: ``MAJOR.MINOR``.

MAJOR changes when what a harness writes changes meaning or shape (the comparator refuses
outputs of another major: ``qualify.protocol.HARNESS_SDK_MAJOR``); MINOR adds only.
"""

from __future__ import annotations

from typing import Final

SDK_VERSION: Final = "1.2"
SDK_MAJOR: Final = int(SDK_VERSION.split(".")[0])
