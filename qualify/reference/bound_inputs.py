"""The bound rule's inputs as a sealed reference holds them, read back without torch.

The reference stage applies :func:`qualify.bounds.compute_bounds` to these inputs, every one
sealed in the reference directory (:mod:`qualify.layout` names):

- the contract (``contract.json``): ``k``, the lane, the floors, the controls of each class;
- the control errors (``control_errors.json``, after the clip-branch adjustment):
  ``{lane: {control: {metric label: {"value", "where", "max_abs", "max_rel"}}}}``;
- the HF reference tensors of each lane (``reference/hf-<lane>.safetensors``): the scalar
  resolutions (:func:`qualify.bounds.scalar_resolutions`) and the BF16 quanta
  (:func:`qualify.bounds.bf16_quanta`) are functions of them;
- the round-to-round responses (``round_to_round.json``, read when it exists or the
  contract's ``[bounds] round_to_round`` is on, where a missing file is an error; else no
  term),
  ``{lane: {metric label: {"value", ...}}}``
  (:mod:`qualify.reference.round_to_round`);
- per lane, ``reference.json`` ``update_meta["hf-<lane>"][role]``: the FP32 evaluations of the
  pre-clip norms (:data:`NORM_FP32_META`, ``{"round<r>": norm}``) and the loss
  sensitivities (:data:`LOSS_SENSITIVITY_META`, ``{"round<r>": {term: {family: S}}}``).

:func:`recompute_bounds` reads exactly these and applies the rule again. Every operation of
the rule is an IEEE 754 operation in a fixed order (maxima, one ulp, products, a sum over a
sorted set of families, a square root; no BLAS reduction), and JSON keeps every float
exactly, so the recomputed bounds equal the sealed ones bit for bit on any machine.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np

from qualify import jsonio
from qualify.bounds import (
    Bound,
    ControlErrors,
    Sensitivities,
    bf16_quanta,
    compute_bounds,
    scalar_resolutions,
)
from qualify.contract import Contract
from qualify.errors import EvidenceIntegrityError, QualifyError, ReferenceDataError
from qualify.layout import (
    CONTRACT_FILE,
    CONTROL_ERRORS_FILE,
    HF_REFERENCE_DIR,
    REFERENCE_FILE,
    ROUND_TO_ROUND_FILE,
    hf_tensors_file,
)
from qualify.statistics import FAMILY_STATISTIC, ErrorMeasure, MetricKey

__all__ = ["LOSS_SENSITIVITY_META", "NORM_FP32_META", "BoundsNotRecomputableError",
           "control_errors_from_document", "metric_key", "norm_evals", "read_sealed",
           "recompute_bounds", "round_to_round_from_document", "sensitivities"]

NORM_FP32_META: Final = "grad_norm_fp32"
"""Role meta key (``reference.json`` ``update_meta``) of each round's pre-clip norm evaluated
in FP32 (``qualify.reference.update._grad_norm_and_clip``): ``{"round<r>": norm}``."""

LOSS_SENSITIVITY_META: Final = "loss_sensitivity"
"""The role meta key (``reference.json`` ``update_meta``) of the sensitivities,
``{"round<r>": {term: {family: S}}}``, ``S = sum_t (d term / d x_t)^2``
(``qualify.reference.sensitivity.LossSensitivity``)."""

ROLES: Final = ("actor", "critic", "reward")
"""The roles a bound can belong to (``bounds.schema.json``)."""

_LABEL = re.compile(r"round([1-9][0-9]{0,5})/([a-z_]+)/([a-z_0-9]+)(?:\[([a-z_]+)\])?")


class BoundsNotRecomputableError(ReferenceDataError):
    """A sealed input of the bound rule is missing or malformed (named in the message)."""


def metric_key(label: str) -> MetricKey:
    """Inverse of :attr:`qualify.statistics.MetricKey.label`.

    Raises:
        ValueError: ``label`` is not ``round<r>/<role>/<family>[<variant>]``.
    """
    m = _LABEL.fullmatch(label)
    if m is None:
        raise ValueError(f"not a metric label: {label!r}")
    return MetricKey(round=int(m[1]), role=m[2], family=m[3], variant=m[4] or "")


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not math.isfinite(value) or value < 0:
        raise BoundsNotRecomputableError(f"{where}: not a finite number >= 0: {value!r:.40}")
    return float(value)


def control_errors_from_document(doc: Any, what: str = CONTROL_ERRORS_FILE) -> ControlErrors:
    """Inverse of :func:`qualify.reference.controls.control_errors_document`.

    Args:
        doc: the parsed ``control_errors.json``.
        what: where it was read (for messages).

    Returns:
        ``{lane: {control: {MetricKey: ErrorMeasure}}}`` (``mismatched`` and ``total``, which
        the document does not hold and the rule does not read, are 0).

    Raises:
        BoundsNotRecomputableError: not the document's shape, a label that is not a metric,
            or an error that is not a finite number >= 0.
    """
    if not isinstance(doc, dict):
        raise BoundsNotRecomputableError(f"{what}: not a JSON object")
    out: ControlErrors = {}
    for lane, by_control in doc.items():
        if not isinstance(by_control, dict):
            raise BoundsNotRecomputableError(f"{what}: {lane}: not a JSON object")
        out[lane] = {}
        for name, by_label in by_control.items():
            if not isinstance(by_label, dict):
                raise BoundsNotRecomputableError(f"{what}: {lane}.{name}: not a JSON object")
            errs: dict[MetricKey, ErrorMeasure] = {}
            for label, e in by_label.items():
                where = f"{what}: {lane}.{name}.{label}"
                try:
                    key = metric_key(label)
                except ValueError as exc:
                    raise BoundsNotRecomputableError(f"{where}: {exc}") from None
                if key.family not in FAMILY_STATISTIC or key.role not in ROLES:
                    raise BoundsNotRecomputableError(f"{where}: no such role or metric family")
                if not isinstance(e, dict):
                    raise BoundsNotRecomputableError(f"{where}: not a JSON object")
                errs[key] = ErrorMeasure(
                    value=_number(e.get("value"), f"{where}.value"), where=str(e.get("where")),
                    mismatched=0, total=0,
                    max_abs=_number(e.get("max_abs", 0.0), f"{where}.max_abs"),
                    max_rel=_number(e.get("max_rel", 0.0), f"{where}.max_rel"))
            out[lane][name] = errs
    return out


def round_to_round_from_document(doc: Any, what: str = ROUND_TO_ROUND_FILE,
                                 ) -> dict[str, dict[MetricKey, float]]:
    """``{lane: {metric: response}}`` of a sealed ``round_to_round.json``.

    Inverse of the ``value`` fields of
    :func:`qualify.reference.round_to_round.round_to_round_document`.

    Raises:
        BoundsNotRecomputableError: not the document's shape, a label that is not a
            per-token metric of round >= 2, or a value that is not a finite number >= 0.
    """
    if not isinstance(doc, dict):
        raise BoundsNotRecomputableError(f"{what}: not a JSON object")
    out: dict[str, dict[MetricKey, float]] = {}
    for lane, by_label in doc.items():
        if not isinstance(by_label, dict):
            raise BoundsNotRecomputableError(f"{what}: {lane}: not a JSON object")
        out[lane] = {}
        for label, e in by_label.items():
            where = f"{what}: {lane}.{label}"
            try:
                key = metric_key(label)
            except ValueError as exc:
                raise BoundsNotRecomputableError(f"{where}: {exc}") from None
            if key.round < 2 or key.family not in ("logprobs", "entropy", "values"):
                raise BoundsNotRecomputableError(f"{where}: not a per-token family of a "
                                                 "round >= 2")
            if not isinstance(e, dict):
                raise BoundsNotRecomputableError(f"{where}: not a JSON object")
            out[lane][key] = _number(e.get("value"), f"{where}.value")
    return out


def _round_number(label: object, where: str) -> int:
    text = str(label)
    if not re.fullmatch(r"round[1-9][0-9]{0,5}", text):
        raise BoundsNotRecomputableError(f"{where}: {text!r} is not round<r>")
    return int(text.removeprefix("round"))


def norm_evals(meta: Mapping[str, Any], where: str = "update_meta",
               ) -> dict[tuple[int, str], float]:
    """``{(round, role): norm}``: a reference run's FP32 evaluations of its pre-clip norms.

    Args:
        meta: the run's ``update_meta`` entry (``{role: {NORM_FP32_META: {"round<r>": x}}}``).
        where: its place (for messages).

    Raises:
        BoundsNotRecomputableError: a round label or a norm of the wrong form.
    """
    out: dict[tuple[int, str], float] = {}
    for role in ("actor", "critic"):
        evals = (meta.get(role) or {}).get(NORM_FP32_META, {})
        if not isinstance(evals, Mapping):
            raise BoundsNotRecomputableError(f"{where}.{role}.{NORM_FP32_META}: not an object")
        for label, value in evals.items():
            w = f"{where}.{role}.{NORM_FP32_META}.{label}"
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise BoundsNotRecomputableError(f"{w}: not a number: {value!r:.40}")
            out[(_round_number(label, w), role)] = float(value)
    return out


def sensitivities(meta: Mapping[str, Any], where: str = "update_meta") -> Sensitivities:
    """``{(round, role): {term: {family: S}}}``: a reference run's loss sensitivities.

    Args:
        meta: the run's ``update_meta`` entry (``{role: {LOSS_SENSITIVITY_META: ...}}``).
        where: its place (for messages).

    Raises:
        BoundsNotRecomputableError: a round label or a sensitivity of the wrong form.
    """
    out: dict[tuple[int, str], dict[str, dict[str, float]]] = {}
    for role in ("actor", "critic"):
        rounds = (meta.get(role) or {}).get(LOSS_SENSITIVITY_META, {})
        if not isinstance(rounds, Mapping):
            raise BoundsNotRecomputableError(
                f"{where}.{role}.{LOSS_SENSITIVITY_META}: not an object")
        for label, terms in rounds.items():
            w = f"{where}.{role}.{LOSS_SENSITIVITY_META}.{label}"
            if not isinstance(terms, Mapping) or \
                    not all(isinstance(v, Mapping) for v in terms.values()):
                raise BoundsNotRecomputableError(f"{w}: not {{term: {{family: S}}}}")
            out[(_round_number(label, w), role)] = {
                str(t): {str(f): _number(s, f"{w}.{t}.{f}") for f, s in by_family.items()}
                for t, by_family in terms.items()}
    return out


def read_sealed(path: Path) -> Any:
    """A sealed JSON input; missing or malformed: :class:`BoundsNotRecomputableError`."""
    if not os.path.lexists(path):
        raise BoundsNotRecomputableError(f"{path.name}: missing (the reference was sealed "
                                         "without it)")
    try:
        return jsonio.read_json(path)
    except (OSError, ValueError, EvidenceIntegrityError) as exc:
        raise BoundsNotRecomputableError(f"{path.name}: unreadable: {exc}") from None


def recompute_bounds(ref_dir: Path, contract: Contract | None = None) -> list[Bound]:
    """The bound rule applied again to a sealed reference's own inputs (module docstring).

    Args:
        ref_dir: the reference directory (its files are taken as they are: the caller
            checks them against the manifest first).
        contract: the reference's contract (default: its ``contract.json``).

    Returns:
        The bounds, in :func:`qualify.bounds.compute_bounds`'s order.

    Raises:
        BoundsNotRecomputableError: an input is missing or malformed, or the control errors
            are not those of the reference's lanes (``reference.json`` ``lanes``) and of the
            contract's controls (the message names which).
    """
    if contract is None:
        try:
            contract = Contract.from_dict(read_sealed(ref_dir / CONTRACT_FILE),
                                          path=ref_dir / CONTRACT_FILE)
        except QualifyError as exc:
            if isinstance(exc, BoundsNotRecomputableError):
                raise
            raise BoundsNotRecomputableError(f"{CONTRACT_FILE}: {exc}") from None
    errors = control_errors_from_document(read_sealed(ref_dir / CONTROL_ERRORS_FILE))
    r2r = (round_to_round_from_document(read_sealed(ref_dir / ROUND_TO_ROUND_FILE))
           if contract.bounds.round_to_round or os.path.lexists(ref_dir / ROUND_TO_ROUND_FILE)
           else None)
    ref_doc = read_sealed(ref_dir / REFERENCE_FILE)
    meta = ref_doc.get("update_meta") if isinstance(ref_doc, dict) else None
    if not isinstance(meta, dict):
        raise BoundsNotRecomputableError(f"{REFERENCE_FILE}: no update_meta object (the "
                                         "reference was sealed before the rule's inputs were)")
    lanes = ref_doc.get("lanes")
    want = sorted(str(x) for x in lanes) if isinstance(lanes, list) else None
    if want is None or sorted(errors) != want:
        raise BoundsNotRecomputableError(f"{CONTROL_ERRORS_FILE}: lanes {sorted(errors)}, "
                                         f"{REFERENCE_FILE} lanes {lanes!r:.80}")
    from qualify.evidence.tensors import load_tensors

    ref_np: dict[str, dict[str, np.ndarray]] = {}
    evals: dict[str, dict[tuple[int, str], float]] = {}
    sens: dict[str, Sensitivities] = {}
    for lane in want:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,31}", lane):
            raise BoundsNotRecomputableError(f"{REFERENCE_FILE}: lane {lane!r:.40} is not a "
                                             "lane name")
        rel = f"{HF_REFERENCE_DIR}/{hf_tensors_file(lane)}"
        try:
            ref_np[lane] = load_tensors(ref_dir / rel)
        except EvidenceIntegrityError as exc:
            raise BoundsNotRecomputableError(f"{rel}: {exc}") from None
        lane_meta = meta.get(f"hf-{lane}")
        if not isinstance(lane_meta, dict):
            raise BoundsNotRecomputableError(f"{REFERENCE_FILE}: update_meta has no hf-{lane} "
                                             "object")
        where = f"{REFERENCE_FILE}: update_meta.hf-{lane}"
        evals[lane] = norm_evals(lane_meta, where)
        sens[lane] = sensitivities(lane_meta, where)
    try:
        return compute_bounds(contract, errors, scalar_resolutions(ref_np, evals), sens,
                              bf16_quanta(ref_np), round_to_round=r2r)
    except KeyError as exc:  # a control the contract names was not measured
        raise BoundsNotRecomputableError(f"{CONTROL_ERRORS_FILE}: {exc.args[0]}") from None

