"""The bound rule's inputs as a sealed reference holds them, read back without torch.

The reference stage applies :func:`qualify.bounds.compute_bounds` to these inputs, every one
sealed in the reference directory (:mod:`qualify.layout` names):

- the contract (``contract.json``): ``k``, the lane, the floors, the controls of each class;
- the control errors (``control_errors.json``, after the clip-branch adjustment):
  ``{lane: {control: {metric label: {"value", "where", "max_abs", "max_rel"}}}}``;
- the HF reference tensors of each lane (``reference/hf-<lane>.safetensors``): the scalar
  resolutions (:func:`qualify.bounds.scalar_resolutions`) and the BF16 quanta
  (:func:`qualify.bounds.bf16_quanta`) are functions of them;
- the round-to-round responses (``round_to_round.json``, ``{lane: {metric label:
  {"value", "where", "perturbation", "runs"}}}``, and the per-token
  ``round_to_round.safetensors``, ``<lane>/<metric label>`` ``[B, R]`` FP64; read when the
  JSON exists or the contract's ``[bounds] round_to_round`` is on, where a missing file is
  an error; else no term): every label of the JSON has its tensor and no other tensor is
  sealed, every tensor is finite, >= 0, 0 at padding, of the rollout's ``[B, R]``, and its
  largest entry is the JSON's ``value`` exactly (:func:`round_to_round_from_sealed`;
  :mod:`qualify.reference.round_to_round`);
- per lane, ``reference.json`` ``update_meta["hf-<lane>"][role]``: the FP32 evaluations of the
  pre-clip norms (:data:`NORM_FP32_META`, ``{"round<r>": norm}``) and the loss
  sensitivities (:data:`LOSS_SENSITIVITY_META`, ``{"round<r>": {term: {family: S}}}``).

:func:`recompute_bounds` reads exactly these and applies the rule again. Every operation of
the rule is an IEEE 754 operation in a fixed order (maxima, one ulp, products, a sum over a
sorted set of families, a square root; no BLAS reduction), and JSON keeps every float
exactly, so the recomputed bounds equal the sealed ones bit for bit on any machine.
"""

from __future__ import annotations

import dataclasses
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
    ROLLOUT_FILE,
    ROUND_TO_ROUND_FILE,
    ROUND_TO_ROUND_TENSORS_FILE,
    hf_tensors_file,
)
from qualify.statistics import FAMILY_STATISTIC, ErrorMeasure, MetricKey

__all__ = ["LOSS_SENSITIVITY_META", "NORM_FP32_META", "BoundsNotRecomputableError",
           "control_errors_from_document", "metric_key", "norm_evals", "read_sealed",
           "recompute_bounds", "round_to_round_from_document", "round_to_round_from_sealed",
           "sensitivities", "tensor_key", "with_token_responses"]

NORM_FP32_META: Final = "grad_norm_fp32"
"""Role meta key (``reference.json`` ``update_meta``) of each round's pre-clip norm evaluated
in FP32 (``qualify.reference.update._grad_norm_and_clip``): ``{"round<r>": norm}``."""

LOSS_SENSITIVITY_META: Final = "loss_sensitivity"
"""The role meta key (``reference.json`` ``update_meta``) of the sensitivities,
``{"round<r>": {term: {family: S}}}``, ``S = sum_t (d term / d x_t)^2``
(``qualify.reference.sensitivity.LossSensitivity``)."""

ROLES: Final = ("actor", "critic", "reward")
"""The roles a bound can belong to (``bounds.schema.json``)."""

RESPONDING_FAMILIES: Final = ("logprobs", "entropy", "values")
"""The per-token families a round-to-round response can belong to
(``qualify.reference.round_to_round.RESPONDING``)."""

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


def _sealed_key(label: str, where: str, *, families: Any = FAMILY_STATISTIC,
                min_round: int = 1) -> MetricKey:
    """The metric of a sealed document's label (control errors, round-to-round responses).

    Raises:
        BoundsNotRecomputableError: ``label`` is not a metric label, or names a role outside
            :data:`ROLES`, a family outside ``families`` or a round below ``min_round``.
    """
    try:
        key = metric_key(label)
    except ValueError as exc:
        raise BoundsNotRecomputableError(f"{where}: {exc}") from None
    if key.role not in ROLES or key.family not in families:
        raise BoundsNotRecomputableError(f"{where}: no such role or metric family")
    if key.round < min_round:
        raise BoundsNotRecomputableError(f"{where}: not a metric of a round >= {min_round}")
    return key


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
                key = _sealed_key(label, where)
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
            key = _sealed_key(label, where, families=RESPONDING_FAMILIES, min_round=2)
            if not isinstance(e, dict):
                raise BoundsNotRecomputableError(f"{where}: not a JSON object")
            out[lane][key] = _number(e.get("value"), f"{where}.value")
    return out


def tensor_key(lane: str, key: MetricKey) -> str:
    """The name of one response tensor in ``round_to_round.safetensors``: ``<lane>/<label>``."""
    return f"{lane}/{key.label}"


def round_to_round_from_sealed(ref_dir: Path, mask: Any | None = None,
                               ) -> dict[str, dict[MetricKey, np.ndarray]]:
    """``{lane: {metric: [B, R] FP64 responses}}`` of a sealed reference (module docstring).

    Args:
        ref_dir: the reference directory (files taken as they are).
        mask: ``[B, R]`` response mask (default: the sealed rollout's ``response_mask``).

    Raises:
        BoundsNotRecomputableError: either file missing or malformed, a label of the JSON
            without its tensor or a tensor without its label, a tensor not of the mask's
            shape, not finite, negative, non-zero at padding, or whose largest entry is not
            the JSON's ``value``.
    """
    from qualify.evidence.tensors import load_tensors

    values = round_to_round_from_document(read_sealed(ref_dir / ROUND_TO_ROUND_FILE))
    what = ROUND_TO_ROUND_TENSORS_FILE
    if not os.path.lexists(ref_dir / what):
        raise BoundsNotRecomputableError(f"{what}: missing (the reference was sealed without "
                                         "it)")
    try:
        tensors = load_tensors(ref_dir / what)
        if mask is None:
            mask = load_tensors(ref_dir / ROLLOUT_FILE).get("response_mask")
    except EvidenceIntegrityError as exc:
        raise BoundsNotRecomputableError(f"{what}: {exc}") from None
    if mask is None:
        raise BoundsNotRecomputableError(f"{ROLLOUT_FILE}: no response_mask tensor")
    valid = np.asarray(mask).astype(bool)
    names = {tensor_key(lane, key): (lane, key) for lane, by in values.items() for key in by}
    extra = sorted(set(tensors) - set(names))
    if extra:
        raise BoundsNotRecomputableError(f"{what}: {extra[0]}: no such entry in "
                                         f"{ROUND_TO_ROUND_FILE}")
    out: dict[str, dict[MetricKey, np.ndarray]] = {lane: {} for lane in values}
    for name, (lane, key) in sorted(names.items()):
        if name not in tensors:
            raise BoundsNotRecomputableError(f"{what}: no tensor {name} (sealed in "
                                             f"{ROUND_TO_ROUND_FILE})")
        t = np.asarray(tensors[name], dtype=np.float64)
        if t.shape != valid.shape:
            raise BoundsNotRecomputableError(f"{what}: {name}: shape {t.shape}, the response "
                                             f"mask's is {valid.shape}")
        if not (np.all(np.isfinite(t)) and np.all(t >= 0)) or np.any(t[~valid] != 0):
            raise BoundsNotRecomputableError(f"{what}: {name}: not finite numbers >= 0 that "
                                             "are 0 at padding")
        top = float(t.max()) if t.size else 0.0
        if top != values[lane][key]:
            raise BoundsNotRecomputableError(
                f"{what}: {name}: largest response {top!r}, {ROUND_TO_ROUND_FILE} says "
                f"{values[lane][key]!r}")
        out[lane][key] = t
    return out


def with_token_responses(bounds: list[Bound], ref_dir: Path, mask: Any | None = None,
                         ) -> list[Bound]:
    """``bounds`` (``bounds.json``'s rows) with each row's sealed per-token responses.

    A row with ``round_to_round > 0`` takes the tensor of its lane and metric from
    ``round_to_round.safetensors`` as :attr:`qualify.bounds.Bound.tokens`; without such a
    row nothing is read.

    Raises:
        BoundsNotRecomputableError: a row's responses are not sealed, or their largest
            entry is not the row's ``round_to_round`` (and what
            :func:`round_to_round_from_sealed` raises).
    """
    if not any(b.round_to_round > 0.0 for b in bounds):
        return bounds
    sealed = round_to_round_from_sealed(ref_dir, mask)
    out = []
    for b in bounds:
        if b.round_to_round == 0.0:
            out.append(b)
            continue
        t = sealed.get(b.precision, {}).get(b.key)
        if t is None or float(t.max()) != b.round_to_round:
            raise BoundsNotRecomputableError(
                f"{ROUND_TO_ROUND_TENSORS_FILE}: no responses of {b.key.label} at "
                f"{b.precision} whose largest is the bound's round_to_round "
                f"{b.round_to_round!r}")
        out.append(dataclasses.replace(b, tokens=t if b.bound > 0.0 else None))
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
    r2r = (round_to_round_from_sealed(ref_dir)
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

