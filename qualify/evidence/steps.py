"""The verification steps as data: their numbers, names and errors, outcomes, the result.

:data:`STEPS` numbers the nine steps of :func:`qualify.evidence.verify.verify`; each has
exactly one error type (:data:`STEP_ERRORS`, all in :mod:`qualify.errors`, exit code 3).
A step's :class:`StepOutcome` and the whole :class:`VerificationResult` (python-tuf style:
``bool()``, the steps that passed, the problems) are what ``verify``, ``gate`` and
``audit`` report; :class:`StepRunner` runs steps and records their outcomes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

from qualify.display import printable_lines
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

__all__ = ["MAX_LISTED", "RECOMPUTE_REL_TOLERANCE", "STEPS", "STEP_ERRORS", "StepOutcome",
           "StepRunner", "StepStatus", "VerificationResult", "document_differences",
           "first_line_difference", "listing", "predicate"]

STEPS: Final[tuple[tuple[int, str], ...]] = (
    (1, "envelope format"),
    (2, "signature by a trusted key"),
    (3, "payload, statement and predicate types"),
    (4, "subject digests match manifest and disk"),
    (5, "no file outside the manifest"),
    (6, "contract digest equals the committed contract"),
    (7, "bounds and reference bound to the run"),
    (8, "sealed before attested, reference before the run"),
    (9, "bounds and verdicts recomputed from sealed evidence"),
)
"""The verification steps, in order: ``(number, name)``."""

STEP_ERRORS: Final[dict[int, type[EvidenceIntegrityError]]] = {
    1: EnvelopeFormatError, 2: SignatureVerificationError, 3: StatementTypeError,
    4: SubjectDigestError, 5: UnlistedFileError, 6: ContractDigestError,
    7: ReferenceBindingError, 8: SealOrderError, 9: VerdictMismatchError,
}
"""The one error type of each step."""

RECOMPUTE_REL_TOLERANCE: Final = 1e-9
"""Step 9: how far a recomputed number may be from ``report.json``'s, relative.

JSON formatting loses nothing (qualify writes ``repr`` floats, which read back exactly), so
on the machine that compared, the recomputation is bit-identical. The tolerance is for
verifying on another CPU: errors are float64 reductions (``np.linalg.norm`` through
OpenBLAS, whose kernels are chosen per instruction set), which may differ in the last ulps
(~1e-16 relative). 1e-9 is seven orders above that and far below any rewrite that matters
(a bound is a few significant digits). Non-numbers (verdicts, ``"inf"``, ``None``, text)
must be equal exactly; an exact zero must stay zero."""

StepStatus = Literal["passed", "failed", "skipped", "not-applicable"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepOutcome:
    """What one verification step found.

    Attributes:
        number: 1..9 (:data:`STEPS`).
        name: the step's name.
        status: ``passed``, ``failed``, ``skipped`` (an earlier step failed) or
            ``not-applicable`` (step 7 of a reference).
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
        other_attestations: ``*.dsse.json`` files beside the directory's own
            ``attestation.dsse.json`` (never verified: step 5 fails on each).
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
        """The numbered steps for a human, one line each.

        Every line is :func:`~qualify.display.printable`: a file name holding a newline or an
        escape cannot add or rewrite a line.
        """
        mark = {"passed": "ok  ", "failed": "FAIL", "skipped": "skip", "not-applicable": "n/a "}
        head = f"{self.path}: {'VERIFIED' if self.passed else 'NOT VERIFIED'}" + (
            f" ({self.kind})" if self.kind else "")
        if self.keyids:
            head += f", signed by keyid {', '.join(k[:16] for k in self.keyids)}"
        out = [head]
        out += [f"  [{mark[s.status]}] {s.number}. {s.name}: {s.detail}" for s in self.steps]
        return printable_lines(out)

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


def _num_equal(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= RECOMPUTE_REL_TOLERANCE * max(abs(a), abs(b))


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def document_differences(stored: Any, recomputed: Any, where: str = "") -> list[str]:
    """Where two JSON documents differ, numbers within :data:`RECOMPUTE_REL_TOLERANCE`.

    Args:
        stored: the document on disk (``report.json``).
        recomputed: the same document recomputed.
        where: the path so far (``rows[3]...``).

    Returns:
        ``"<path>: report.json <value>, recomputed <value>"`` per difference, in document
        order; a row is named by its ``cell/class/metric`` (``rows[3] <cell> <class>
        <metric>.margin``).
    """
    if _is_num(stored) and _is_num(recomputed):
        return [] if _num_equal(float(stored), float(recomputed)) else \
            [f"{where}: report.json {stored!r}, recomputed {recomputed!r}"]
    if isinstance(stored, dict) and isinstance(recomputed, dict):
        out: list[str] = []
        for k in sorted(set(stored) | set(recomputed)):
            sub = f"{where}.{k}" if where else str(k)
            if k not in stored or k not in recomputed:
                out.append(f"{sub}: only in {'report.json' if k in stored else 'recomputed'}")
                continue
            out += document_differences(stored[k], recomputed[k], sub)
        return out
    if isinstance(stored, list) and isinstance(recomputed, list):
        out = []
        if len(stored) != len(recomputed):
            out.append(f"{where}: {len(stored)} entries in report.json, {len(recomputed)} "
                       "recomputed")
        for i, (a, b) in enumerate(zip(stored, recomputed, strict=False)):
            label = f"{where}[{i}]"
            if isinstance(b, dict) and {"cell", "class", "metric"} <= set(b):
                label += f" {b['cell']} {b['class']} {b['metric']}"
            elif isinstance(b, dict) and "cell" in b:
                label += f" {b['cell']}"
            out += document_differences(a, b, label)
        return out
    if type(stored) is not type(recomputed) or stored != recomputed:
        return [f"{where}: report.json {stored!r:.80}, recomputed {recomputed!r:.80}"]
    return []


def first_line_difference(a: bytes, b: bytes) -> str:
    """The first line where ``a`` (a file) and ``b`` (its expected rendering) differ."""
    la, lb = a.splitlines(), b.splitlines()
    for i, (x, y) in enumerate(zip(la, lb, strict=False), 1):
        if x != y:
            return f"line {i}: file {x[:60]!r}, rendered {y[:60]!r}"
    return f"file has {len(la)} lines, rendered {len(lb)}"


MAX_LISTED: Final = 8
"""Problems named in one message before "(and N more)"."""


def listing(items: Sequence[str]) -> str:
    """``a; b; c (and N more)``: at most :data:`MAX_LISTED` items of a problem list."""
    more = f" (and {len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else ""
    return "; ".join(items[:MAX_LISTED]) + more


def predicate(statement: Mapping[str, Any]) -> Mapping[str, Any]:
    """The statement's ``predicate`` object.

    Raises:
        EvidenceIntegrityError: the statement has none.
    """
    pred = statement.get("predicate")
    if not isinstance(pred, Mapping):
        raise EvidenceIntegrityError("statement has no predicate object")
    return pred
