"""The control errors of a sealed reference measured again from its own tensors.

``control_errors.json`` feeds every bound (:mod:`qualify.reference.bound_inputs`); a trusted
key proves who sealed it, not that its numbers are what the controls measured. The
reference stage seals every control run (``controls/<control>-<lane>.safetensors``) beside
the HF reference runs, so :func:`recompute_control_errors` applies the measurement again and
:func:`control_error_differences` says where ``control_errors.json`` differs from it
(``qualify verify`` step 9: :func:`qualify.evidence.bounds_check.verify_bounds`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Final

import numpy as np

from qualify.bounds import ControlErrors
from qualify.contract import Contract
from qualify.errors import EvidenceIntegrityError, QualifyError
from qualify.layout import HF_REFERENCE_DIR, REFERENCE_FILE, hf_tensors_file
from qualify.reference.bound_inputs import BoundsNotRecomputableError, read_sealed

__all__ = ["CONTROL_ERROR_REL_TOL", "control_error_differences", "recompute_control_errors"]

CONTROL_ERROR_REL_TOL: Final = 1e-9
"""Relative tolerance of a recomputed control error against its sealed value. The
measurement reduces arrays with numpy (sums, norms through BLAS), whose summation order can
differ between builds and CPUs by a few ulps (``~1e-15`` relative); a tampered error (a
bound widened through its control) moves by far more."""


def recompute_control_errors(ref_dir: Path, contract: Contract) -> ControlErrors:
    """The control errors measured again from a sealed reference's own tensors.

    The reference stage measures every control run against the HF reference run of its
    lane (:func:`qualify.bounds.measure_controls`), then moves the reference to a control's
    clip branches where the control flipped a sealed token
    (:func:`qualify.reference.branches.adjust_control_errors`); this applies both again to
    what is sealed: ``reference/hf-<lane>.safetensors``, ``controls/<control>-<lane>
    .safetensors``, the rollout's ``response_mask`` and ``behavior_logprobs``, the train
    inputs, ``branches.json`` and ``branches/``.

    Args:
        ref_dir: the reference directory (files taken as they are: the caller checks them
            against the manifest first).
        contract: the reference's contract.

    Returns:
        ``{lane: {control: {MetricKey: ErrorMeasure}}}``, as ``control_errors.json`` holds.

    Raises:
        BoundsNotRecomputableError: a sealed tensor file or ``branches.json`` is missing or
            unreadable, or the controls of a lane are not the contract's.
    """
    from qualify.bounds import measure_controls
    from qualify.evidence.tensors import load_tensors
    from qualify.layout import (
        BRANCHES_FILE,
        CONTROLS_DIR,
        ROLLOUT_FILE,
        TRAIN_INPUTS_FILE,
    )
    from qualify.reference.branches import adjust_control_errors
    from qualify.reference.controls import control_settings

    def tensors(rel: str) -> dict[str, np.ndarray]:
        try:
            return load_tensors(ref_dir / rel)
        except EvidenceIntegrityError as exc:
            raise BoundsNotRecomputableError(f"{rel}: {exc}") from None

    ref_doc = read_sealed(ref_dir / REFERENCE_FILE)
    lanes = ref_doc.get("lanes") if isinstance(ref_doc, dict) else None
    if not isinstance(lanes, list) or not all(
            isinstance(x, str) and re.fullmatch(r"[a-z0-9][a-z0-9-]{0,31}", x) for x in lanes):
        raise BoundsNotRecomputableError(f"{REFERENCE_FILE}: lanes {lanes!r:.80} are not lane "
                                         "names")
    ref_runs = {lane: tensors(f"{HF_REFERENCE_DIR}/{hf_tensors_file(lane)}") for lane in lanes}
    control_runs = {lane: {name: tensors(f"{CONTROLS_DIR}/{name}-{lane}.safetensors")
                           for name in control_settings(contract, lane)} for lane in lanes}
    roll = tensors(ROLLOUT_FILE)
    train = tensors(TRAIN_INPUTS_FILE)
    for name, have in (("response_mask", roll), ("behavior_logprobs", roll),
                       ("advantages", train), ("returns", train)):
        if name not in have:
            raise BoundsNotRecomputableError(f"no {name} tensor sealed")
    mask = roll["response_mask"]
    errors = measure_controls(ref_runs, control_runs, mask)
    doc = read_sealed(ref_dir / BRANCHES_FILE)
    if not isinstance(doc, dict):
        raise BoundsNotRecomputableError(f"{BRANCHES_FILE}: not a JSON object")
    try:
        adjust_control_errors(contract, errors, ref_runs=ref_runs, control_runs=control_runs,
                              doc=doc, out=ref_dir,
                              train={k: train[k] for k in ("advantages", "returns")},
                              mask=mask, behavior=roll["behavior_logprobs"].astype(np.float64))
    except (KeyError, ValueError, QualifyError) as exc:
        raise BoundsNotRecomputableError(f"{BRANCHES_FILE}: the clip-branch adjustment cannot "
                                         f"be applied again: {exc!r:.200}") from None
    return errors


def control_error_differences(sealed: ControlErrors, recomputed: ControlErrors) -> list[str]:
    """Where ``control_errors.json`` and the recomputed control errors differ.

    Args:
        sealed: :func:`control_errors_from_document` of ``control_errors.json``.
        recomputed: :func:`recompute_control_errors`.

    Returns:
        One line per differing entry: ``"<lane> <control> <metric>: value sealed <x>,
        recomputed <y>"`` (``value``, ``max_abs`` and ``max_rel`` compared within
        :data:`CONTROL_ERROR_REL_TOL`, ``where`` exactly), ``"...: sealed, not measured"``,
        ``"...: measured, not sealed"``.
    """
    out: list[str] = []
    for lane in sorted(set(sealed) | set(recomputed)):
        a, b = sealed.get(lane, {}), recomputed.get(lane, {})
        for control in sorted(set(a) | set(b)):
            x, y = a.get(control, {}), b.get(control, {})
            for key in sorted(set(x) | set(y), key=lambda k: k.label):
                name = f"{lane} {control} {key.label}"
                if key not in y:
                    out.append(f"{name}: sealed, not measured")
                    continue
                if key not in x:
                    out.append(f"{name}: measured, not sealed")
                    continue
                diffs = [f"{f} sealed {getattr(x[key], f)!r}, recomputed {getattr(y[key], f)!r}"
                         for f in ("value", "max_abs", "max_rel")
                         if not math.isclose(getattr(x[key], f), getattr(y[key], f),
                                             rel_tol=CONTROL_ERROR_REL_TOL, abs_tol=0.0)]
                if x[key].where != y[key].where:
                    diffs.append(f"where sealed {x[key].where!r:.60}, recomputed "
                                 f"{y[key].where!r:.60}")
                if diffs:
                    out.append(f"{name}: {', '.join(diffs)}")
    return out
