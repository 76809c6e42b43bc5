"""Errors by phase, one base, and the process exit codes.

Modelled on ``tuf/api/exceptions.py`` (one base, narrow subclasses) and
pytest's ``ExitCode`` (an ``IntEnum`` so a failed qualification, a usage error
and a crash are told apart). A bound violation is a verdict, never an exception.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit status of every ``qualify`` subcommand."""

    OK = 0
    """Everything asked for ran and qualified."""
    QUALIFICATION_FAILED = 1
    """The evidence is sound but at least one required cell did not pass."""
    USAGE_ERROR = 2
    """Bad command line or bad input (contract, model files, paths)."""
    INTEGRITY_ERROR = 3
    """Evidence was edited, is incomplete, unsigned or signed by an untrusted key."""
    INTERNAL_ERROR = 4
    """A bug in qualify or an engine crash outside any cell."""
    INTERRUPTED = 130
    """Stopped by SIGINT (Ctrl-C): ``128 + SIGINT``, as a shell reports it. Whatever was
    written is left unsealed (an ``INCOMPLETE`` directory never passes); the same command
    again resumes it."""


class QualifyError(Exception):
    """Base of every error qualify raises on purpose.

    Attributes:
        exit_code: the :class:`ExitCode` the CLI exits with for this error.
    """

    exit_code: ExitCode = ExitCode.INTERNAL_ERROR


class UsageError(QualifyError):
    """A command-line argument or path the user gave is wrong."""

    exit_code = ExitCode.USAGE_ERROR


class ContractError(QualifyError):
    """A contract file is malformed, fails its schema, or names something unknown."""

    exit_code = ExitCode.USAGE_ERROR


class ReferenceDivergedError(ContractError):
    """The reference update's loss became NaN or infinite.

    The contract's settings (usually its learning rates) make the independent update
    diverge on its model, so there is no target to seal.
    """


class ModelSourceError(QualifyError):
    """A model file is missing or does not match its manifest (digest, config field)."""

    exit_code = ExitCode.USAGE_ERROR


class ReferenceDataError(QualifyError):
    """A reference directory is unsealed, incomplete, or from another contract."""

    exit_code = ExitCode.USAGE_ERROR


class HarnessError(QualifyError):
    """A harness could not be launched or broke the harness protocol."""

    exit_code = ExitCode.INTERNAL_ERROR


class EvidenceIntegrityError(QualifyError):
    """Evidence on disk does not match its manifest, or a sealed directory was touched."""

    exit_code = ExitCode.INTEGRITY_ERROR


class SignatureError(EvidenceIntegrityError):
    """An attestation envelope is malformed or its signature does not verify."""

    exit_code = ExitCode.INTEGRITY_ERROR


# --- evidence verification, one class per step of ``qualify verify`` (qualify.evidence.verify)


class EnvelopeFormatError(SignatureError):
    """An attestation is missing, not JSON, or not a DSSE envelope (verification step 1)."""


class SignatureVerificationError(SignatureError):
    """No signature, a duplicated, corrupted or untrusted one (verification step 2)."""


class StatementTypeError(SignatureError):
    """Wrong payloadType, ``_type`` or predicateType, or a statement off its schema (step 3)."""


class SubjectDigestError(EvidenceIntegrityError):
    """A subject, the manifest and the files on disk disagree (step 4)."""


class UnlistedFileError(EvidenceIntegrityError):
    """A file on disk is not in the manifest (step 5)."""


class ContractDigestError(EvidenceIntegrityError):
    """The evidence's contract digest is not the committed contract's (step 6)."""


class ReferenceBindingError(EvidenceIntegrityError):
    """The run's reference does not verify or is not the run's (step 7)."""


class SealOrderError(EvidenceIntegrityError):
    """The reference was sealed or attested after the run (step 8)."""


class VerdictMismatchError(EvidenceIntegrityError):
    """The report's verdicts do not follow from the raw evidence and sealed bounds (step 9)."""


class BoundsMismatchError(VerdictMismatchError):
    """A reference's sealed bounds are not the rule applied to its sealed inputs (step 9)."""


# --- the reference stage (qualify.reference)


class RolloutLayoutError(ReferenceDataError):
    """A rollout's tensors or metadata break the layout of :mod:`qualify.protocol`.

    Attributes:
        key: the offending tensor name or ``rollout.json`` field.
        file: the file that holds it (:data:`~qualify.protocol.ROLLOUT_FILE`, the default,
            or :data:`~qualify.protocol.ROLLOUT_META_FILE`).
        problem: what is wrong, without the file and key.
    """

    def __init__(self, key: str, problem: str, *, file: str | None = None) -> None:
        if file is None:
            from qualify.protocol import ROLLOUT_FILE

            file = ROLLOUT_FILE
        super().__init__(f"{file}: {key}: {problem}")
        self.key = key
        self.file = file
        self.problem = problem


class PrecisionMismatchError(QualifyError):
    """A scoring pass did not run at the precision it was asked for (a reference bug)."""


class DirtyTreeError(UsageError):
    """The source tree has modified tracked files and ``QUALIFY_ALLOW_DIRTY`` is not 1."""


class WriterBusyError(UsageError):
    """Another live process writes the directory (it holds its ``INCOMPLETE`` marker's lock)."""
