"""qualify: numerical qualification of LLM RL training stacks.

``import qualify`` imports no engine (vllm, deepspeed, megatron, not even torch's
distributed stack): engines are found through :mod:`qualify.registry` by lazy strings.
"""

from __future__ import annotations

from qualify.errors import (
    ContractError,
    EvidenceIntegrityError,
    ExitCode,
    HarnessError,
    ModelSourceError,
    QualifyError,
    ReferenceDataError,
    SignatureError,
    UsageError,
)

__version__ = "0.1.0"

__all__ = [
    "ContractError",
    "EvidenceIntegrityError",
    "ExitCode",
    "HarnessError",
    "ModelSourceError",
    "QualifyError",
    "ReferenceDataError",
    "SignatureError",
    "UsageError",
    "__version__",
]
