"""The verification steps as data: their numbers, names and errors, outcomes, the result.

:data:`STEPS` numbers the nine steps of :func:`qualify.evidence.verify.verify`; each has
exactly one error type (:data:`STEP_ERRORS`, all in :mod:`qualify.errors`, exit code 3).
A step's :class:`StepOutcome` and the whole :class:`VerificationResult` (python-tuf style:
``bool()``, the steps that passed, the problems) are what ``verify``, ``gate`` and
``audit`` report; :class:`StepRunner` runs steps and records their outcomes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, Literal

from qualify.errors import (
    ContractDigestError,
    EnvelopeFormatError,
    EvidenceIntegrityError,
    ExitCode,
    QualifyError,
    ReferenceBindingError,
    SealOrderError,
    SignatureVerificationError,
    StatementTypeError,
    SubjectDigestError,
    UnlistedFileError,
    VerdictMismatchError,
)

__all__ = ["STEPS", "STEP_ERRORS", "StepOutcome", "StepRunner", "StepStatus",
           "VerificationResult"]

STEPS: Final[tuple[tuple[int, str], ...]] = (
    (1, "envelope format"),
    (2, "signature by a trusted key"),
    (3, "payload, statement and predicate types"),
    (4, "subject digests match manifest and disk"),
    (5, "no file outside the manifest"),
    (6, "contract digest equals the committed contract"),
    (7, "bounds and reference bound to the run"),
    (8, "reference sealed before the run"),
    (9, "verdicts recomputed from raw evidence"),
)
"""The verification steps, in order: ``(number, name)``."""

STEP_ERRORS: Final[dict[int, type[EvidenceIntegrityError]]] = {
    1: EnvelopeFormatError, 2: SignatureVerificationError, 3: StatementTypeError,
    4: SubjectDigestError, 5: UnlistedFileError, 6: ContractDigestError,
    7: ReferenceBindingError, 8: SealOrderError, 9: VerdictMismatchError,
}
"""The one error type of each step."""

StepStatus = Literal["passed", "failed", "skipped", "not-applicable"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepOutcome:
    """What one verification step found.

    Attributes:
        number: 1..9 (:data:`STEPS`).
        name: the step's name.
        status: ``passed``, ``failed``, ``skipped`` (an earlier step failed) or
            ``not-applicable`` (steps 7-9 of a reference).
        detail: one line: what was verified, the problem, or why it was skipped.
        error: the step's error when ``failed``.
    """

    number: int
    name: str
    status: StepStatus
    detail: str
    error: EvidenceIntegrityError | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"step": self.number, "name": self.name, "status": self.status,
                "detail": self.detail,
                "error": type(self.error).__name__ if self.error is not None else None}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class VerificationResult:
    """The outcome of :func:`verify` (``bool(result)`` is :attr:`passed`).

    Attributes:
        path: the verified directory.
        kind: ``reference`` or ``candidate-run`` (from the statement; ``None`` if unread).
        steps: one outcome per step of :data:`STEPS`, in order.
        keyids: the trusted key ids that signed.
        statement: the verified-signature statement (``None`` before step 3 passes).
        reference: for a run, the reference directory used in steps 7-9.
        extra_files: files on disk outside the manifest (step 5).
        other_attestations: further top-level ``*.dsse.json`` files (not verified).
    """

    path: Path
    kind: str | None
    steps: tuple[StepOutcome, ...]
    keyids: tuple[str, ...] = ()
    statement: Mapping[str, Any] | None = None
    reference: Path | None = None
    extra_files: tuple[str, ...] = ()
    other_attestations: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """No step failed and the signature and statement were verified."""
        return all(s.status != "failed" for s in self.steps) and \
            all(s.status == "passed" for s in self.steps[:6])

    def __bool__(self) -> bool:
        return self.passed

    @property
    def verified(self) -> tuple[str, ...]:
        """``"<n> <name>"`` of each step that passed."""
        return tuple(f"{s.number} {s.name}" for s in self.steps if s.status == "passed")

    @property
    def failed_steps(self) -> tuple[StepOutcome, ...]:
        """The steps that failed, in order."""
        return tuple(s for s in self.steps if s.status == "failed")

    @property
    def problems(self) -> tuple[str, ...]:
        """``step <n> (<name>): <detail>`` of each failed step."""
        return tuple(f"step {s.number} ({s.name}): {s.detail}" for s in self.failed_steps)

    @property
    def first_error(self) -> EvidenceIntegrityError | None:
        """The error of the first failed step (``None`` if none failed)."""
        failed = self.failed_steps
        return failed[0].error if failed else None

    @property
    def exit_code(self) -> ExitCode:
        """``OK`` or ``INTEGRITY_ERROR``."""
        return ExitCode.OK if self.passed else ExitCode.INTEGRITY_ERROR

    def raise_for_problems(self) -> None:
        """Raise the first failed step's error.

        Raises:
            EvidenceIntegrityError: a step failed (the step's own subclass).
        """
        err = self.first_error
        if err is not None:
            raise err
        if not self.passed:
            raise EvidenceIntegrityError(f"{self.path}: verification incomplete")

    def summary_lines(self) -> list[str]:
        """The numbered steps for a human, one line each."""
        mark = {"passed": "ok  ", "failed": "FAIL", "skipped": "skip", "not-applicable": "n/a "}
        head = f"{self.path}: {'VERIFIED' if self.passed else 'NOT VERIFIED'}" + (
            f" ({self.kind})" if self.kind else "")
        if self.keyids:
            head += f", signed by keyid {', '.join(k[:16] for k in self.keyids)}"
        out = [head]
        out += [f"  [{mark[s.status]}] {s.number}. {s.name}: {s.detail}" for s in self.steps]
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"path": str(self.path), "kind": self.kind, "passed": self.passed,
                "exit_code": int(self.exit_code), "keyids": list(self.keyids),
                "reference": str(self.reference) if self.reference else None,
                "steps": [s.to_dict() for s in self.steps], "problems": list(self.problems),
                "extra_files": list(self.extra_files),
                "other_attestations": list(self.other_attestations)}


class StepRunner:
    """Runs numbered steps, turning any error into the step's own error type.

    :meth:`run` calls a step and records its outcome (a malformed document, an ``OSError``
    or any :class:`~qualify.errors.QualifyError` becomes the step's own error);
    :meth:`mark` records a step that did not run; :meth:`done` returns every outcome in
    order, marking the steps not reached as skipped.
    """

    def __init__(self) -> None:
        self.outcomes: dict[int, StepOutcome] = {}

    def run(self, number: int, fn: Callable[[], str]) -> bool:
        """Run step ``number`` (``fn`` returns its detail line); True if it passed."""
        name = dict(STEPS)[number]
        kind = STEP_ERRORS[number]
        try:
            detail = fn()
        except kind as exc:
            err: EvidenceIntegrityError = exc
        except (QualifyError, OSError, ValueError, KeyError, TypeError, AttributeError,
                IndexError) as exc:  # malformed documents: the step's own error
            err = kind(f"{type(exc).__name__}: {exc}")
        else:
            self.outcomes[number] = StepOutcome(number=number, name=name, status="passed",
                                                detail=detail)
            return True
        self.outcomes[number] = StepOutcome(number=number, name=name, status="failed",
                                            detail=str(err), error=err)
        return False

    def mark(self, number: int, status: StepStatus, detail: str) -> None:
        """Record a step that did not run (unless it already has an outcome)."""
        self.outcomes.setdefault(number, StepOutcome(number=number, name=dict(STEPS)[number],
                                                     status=status, detail=detail))

    def done(self) -> tuple[StepOutcome, ...]:
        """Every step's outcome in order; the steps not reached are ``skipped``."""
        for n, _ in STEPS:
            self.mark(n, "skipped", "not reached")
        return tuple(self.outcomes[n] for n, _ in STEPS)
