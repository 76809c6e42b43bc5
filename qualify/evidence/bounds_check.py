"""Verification step 9 of a reference: every sealed bound recomputed from the sealed inputs.

A signature proves who sealed ``bounds.json``, not that its numbers follow the contract's
rule: with a trusted key, a bound widened 1000x would verify. :func:`verify_bounds` applies
the rule again (:func:`qualify.reference.bound_inputs.recompute_bounds`: the sealed control
errors, the contract's floors, k and lane, the resolutions, quanta and propagated terms from
the sealed HF reference tensors and update records) and requires every row of
``bounds.json`` to equal the recomputed one, field for field and bit for bit (the rule is
exact IEEE 754 arithmetic in a fixed order: no tolerance is needed or given). The control
errors are not taken as stored either: the sealed control runs (``controls/``) are measured
again against the sealed HF reference, with the clip-branch adjustment
(:func:`qualify.reference.control_recompute.recompute_control_errors`), and every entry of
``control_errors.json`` must equal its measurement within
:data:`~qualify.reference.control_recompute.CONTROL_ERROR_REL_TOL` (numpy reductions may differ
by a few ulps between builds).
:mod:`qualify.evidence.verify` runs it as step 9 of a reference; a run's reference passes
it within step 7.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from qualify import jsonio
from qualify.bounds import Bound
from qualify.contract import Contract
from qualify.errors import BoundsMismatchError, EvidenceIntegrityError, QualifyError
from qualify.evidence.steps import listing
from qualify.layout import BOUNDS_FILE, CONTRACT_FILE, CONTROL_ERRORS_FILE
from qualify.schema import first_error

__all__ = ["COMPARED_FIELDS", "TERMS", "bounds_differences", "verify_bounds"]

TERMS: Final = ("resolution", "propagated", "quantum", "round_to_round")
"""Row fields of terms added to the rule after the first references were sealed: a row
without one was sealed by a rule without that term."""

COMPARED_FIELDS: Final = ("bound", "control_error", "control", "floor", "k", "statistic",
                          *TERMS)
"""Every field of a ``bounds.json`` row beyond its identity, compared exactly."""

NUMERIC_FIELDS: Final = ("bound", "control_error", "floor", "k", *TERMS)

Identity = tuple[str, str, int, str, str]
"""``(lane, class, round, role, family)``: what a row bounds."""


def _identity(row: Mapping[str, Any]) -> Identity:
    return (str(row["precision"]), str(row["class"]), int(row["round"]), str(row["role"]),
            str(row["family"]))


def _name(ident: Identity) -> str:
    lane, klass, rnd, role, family = ident
    return f"round{rnd}/{role}/{family} {lane} {klass}"


def bounds_differences(sealed: list[Mapping[str, Any]], recomputed: list[Bound],
                       ) -> list[str]:
    """Where sealed ``bounds.json`` rows and the recomputed bounds differ.

    Args:
        sealed: the rows of ``bounds.json`` (schema-valid).
        recomputed: :func:`qualify.reference.bound_inputs.recompute_bounds`.

    Returns:
        One line per differing row, in the recomputed order then the sealed rows the rule
        does not produce: ``"<metric> <lane> <class>: bound sealed <x>, recomputed <y>"``
        (then each other differing field), ``"...: sealed twice"``, ``"...: no sealed
        bound, the rule gives <y>"``, ``"...: sealed, but the rule gives no bound here"``. A
        row without a term of :data:`TERMS` whose recomputed term is not 0 says so: it was
        sealed before the term existed and cannot be recomputed.
    """
    rows: dict[Identity, Mapping[str, Any]] = {}
    out: list[str] = []
    for one in sealed:
        ident = _identity(one)
        if ident in rows:
            out.append(f"{_name(ident)}: sealed twice")
        rows[ident] = one
    done: set[Identity] = set()
    for b in recomputed:
        want = b.to_dict()
        ident = _identity(want)
        done.add(ident)
        row = rows.get(ident)
        if row is None:
            out.append(f"{_name(ident)}: no sealed bound, the rule gives {b.bound!r}")
            continue
        diffs: list[str] = []
        for f in COMPARED_FIELDS:
            if f not in row:  # schema: only a term may be absent
                if want[f] != 0.0:
                    diffs.append(f"{f} absent (sealed before the term existed: not "
                                 f"recomputable from sealed data), recomputed {want[f]!r}")
            elif (type(row[f]) is str) != (type(want[f]) is str) or row[f] != want[f]:
                diffs.append(f"{f} sealed {row[f]!r:.40}, recomputed {want[f]!r}")
        if diffs:
            out.append(f"{_name(ident)}: {', '.join(diffs)}")
    out += [f"{_name(i)}: sealed, but the rule gives no bound here"
            for i in rows if i not in done]
    return out


def _row_problems(rows: list[Mapping[str, Any]]) -> list[str]:
    """Non-finite or negative numbers of schema-valid rows (JSON reads ``1e999`` as inf)."""
    out: list[str] = []
    for row in rows:
        for f in NUMERIC_FIELDS:
            x = row.get(f)
            if isinstance(x, int | float) and not (math.isfinite(x) and x >= 0):
                out.append(f"{_name(_identity(row))}: {f} {x!r} is not a finite number >= 0")
    return out


def verify_bounds(ref_dir: Path) -> str:
    """Step 9 of a reference: ``bounds.json`` is the rule applied to the sealed inputs.

    Checks, in order: ``bounds.json`` is a JSON object valid against
    ``bounds.schema.json``; its ``contract_digest``, ``k``, ``lane`` and controls are
    ``contract.json``'s; every number of every row is finite and >= 0; the rule can be
    applied again to what is sealed (:func:`qualify.reference.bound_inputs.recompute_bounds`);
    and every row equals its recomputation exactly, with no row missing, added or sealed
    twice (:func:`bounds_differences`); then the control errors measured again from the
    sealed control and reference tensors equal ``control_errors.json``
    (:func:`qualify.reference.control_recompute.control_error_differences`).

    Args:
        ref_dir: a reference directory whose steps 1-8 passed (files match the manifest).

    Returns:
        The step's detail line.

    Raises:
        BoundsMismatchError: any check fails. One line: the count of bad rows among the
            sealed ones and the first few, each naming the metric, lane, class and the
            sealed and recomputed values; or the input that is missing or malformed
            ("not recomputable from sealed data: ...").
    """
    from qualify.reference.bound_inputs import control_errors_from_document, recompute_bounds
    from qualify.reference.control_recompute import (
        control_error_differences,
        recompute_control_errors,
    )

    try:
        doc = jsonio.read_json(ref_dir / BOUNDS_FILE)
    except (OSError, ValueError, EvidenceIntegrityError) as exc:
        raise BoundsMismatchError(f"{BOUNDS_FILE}: unreadable: {exc}") from None
    if not isinstance(doc, dict):
        raise BoundsMismatchError(f"{BOUNDS_FILE}: not a JSON object (a JSON "
                                  f"{type(doc).__name__})")
    problem = first_error(doc, "bounds")
    if problem is not None:
        raise BoundsMismatchError(f"{BOUNDS_FILE}: {problem} (schema bounds.schema.json)")
    rows: list[Mapping[str, Any]] = doc["bounds"]
    try:
        contract = Contract.from_dict(jsonio.read_json(ref_dir / CONTRACT_FILE),
                                      path=ref_dir / CONTRACT_FILE)
    except (OSError, ValueError, QualifyError) as exc:
        raise BoundsMismatchError(f"{CONTRACT_FILE}: {exc}") from None
    b = contract.bounds
    head = [("contract_digest", doc["contract_digest"], contract.digest),
            ("k", doc["k"], b.k), ("lane", doc["lane"], b.lane),
            ("controls", doc["controls"],
             {"candidate_vs_hf": list(b.controls_candidate_vs_hf),
              "tp_vs_tp1": list(b.controls_tp_vs_tp1)})]
    bad = [f"{f} {got!r:.60}, {CONTRACT_FILE} says {want!r:.60}"
           for f, got, want in head if got != want]
    if bad:
        raise BoundsMismatchError(f"{BOUNDS_FILE}: {listing(bad)}")
    bad = _row_problems(rows)
    if bad:
        raise BoundsMismatchError(f"{BOUNDS_FILE}: {len(bad)} of {len(rows)} sealed bounds "
                                  f"refused: {listing(bad)}")
    try:
        again = recompute_bounds(ref_dir, contract)
    except QualifyError as exc:
        raise BoundsMismatchError(f"{BOUNDS_FILE}: {len(rows)} sealed bounds not recomputable "
                                  f"from sealed data: {exc}") from None
    bad = bounds_differences(rows, again)
    if bad:
        raise BoundsMismatchError(
            f"{BOUNDS_FILE}: {len(bad)} of {len(rows)} sealed bounds are not the rule applied "
            f"to the sealed control errors: {listing(bad)}")
    try:
        sealed = control_errors_from_document(jsonio.read_json(ref_dir / CONTROL_ERRORS_FILE))
        measured = recompute_control_errors(ref_dir, contract)
    except (OSError, ValueError, QualifyError) as exc:
        raise BoundsMismatchError(f"{CONTROL_ERRORS_FILE}: not recomputable from the sealed "
                                  f"control and reference tensors: {exc}") from None
    bad = control_error_differences(sealed, measured)
    if bad:
        n = sum(len(e) for by_control in sealed.values() for e in by_control.values())
        raise BoundsMismatchError(
            f"{CONTROL_ERRORS_FILE}: {len(bad)} of {n} sealed control errors are not what the "
            f"sealed control runs measure against the sealed reference: {listing(bad)}")
    return f"{len(rows)} bounds of {BOUNDS_FILE} recomputed from the sealed control errors, " \
           f"floors and k: equal; the control errors measured again from the sealed " \
           f"control and reference tensors: equal"
