"""The independent controls of the reference stage (docs/bound-rule.md).

A control is a second legitimate execution of the reference update at the same precision
that differs only in a way an engine may differ; its distance from the HF reference run is
the ``control_error`` of the bound rule (:mod:`qualify.bounds`). This module says which
controls run at a precision (:func:`control_settings`) and writes their measured errors
(:func:`control_errors_document`, ``control_errors.json``). The stage
(:mod:`qualify.reference.stage`) runs them; clip-branch adjustments live in
:mod:`qualify.reference.branches`.
"""

from __future__ import annotations

from typing import Any

from qualify.bounds import ControlErrors
from qualify.contract import Contract, Precision
from qualify.lanes import lane_bf16_mode, lane_precision
from qualify.reference.update import UpdateSettings

__all__ = ["control_errors_document", "control_settings"]


def control_settings(contract: Contract,
                     lane: str) -> dict[str, tuple[UpdateSettings, str]]:
    """The independent controls of docs/bound-rule.md in one reference lane.

    A lane is a precision and, at BF16, a BF16 style (:mod:`qualify.lanes`): every control
    of the ``bf16-autocast`` lane runs under autocast, every one of the ``bf16`` lane with
    BF16 parameters and FP32 masters from the checkpoint, every one of the
    ``bf16-castmasters`` lane with masters born ``bf16(checkpoint)``, so a lane's bounds
    measure the noise within its own style.

    - ``attn_impl``: eager attention instead of sdpa.
    - ``microbatch``: another micro-batch partition (half the size, at least 1, or 2 when the
      contract uses 1) with 2 extra left and 3 extra right padding columns.
    - ``row_split``: every row-parallel projection (``o_proj``, ``down_proj``) computed as
      ``max(matrix.tp_sizes)`` (at least 2) partial products over input-feature slices,
      each rounded to the compute dtype and summed in it, as a TP engine's row-parallel
      layer and its all-reduce do (:func:`qualify.reference.row_split.split_row_parallel`).
      At BF16 this double rounding is what separates Megatron-Core's TP 2 from its TP 1
      (``harnesses/megatron/README.md``, "BF16 TP 1 vs TP 2"); neither attention
      implementation nor micro-batching re-rounds those sums.
    - ``bf16_mode`` (the ``bf16`` lane only): autocast over FP32 parameters instead of BF16
      parameters with an FP32 master copy: the distance **between** the two BF16 styles.
      A contract that feeds it to a bound accepts either style at that bound's width
      (about 13 % on tiny-qwen3's round-2 gradients), too wide to see a 1 % gradient bug.
    - ``fp64`` (FP32 only): the same update and reward scoring in FP64 (models, compute,
      gradients, AdamW state), reported in FP32. Every FP32 control above runs the
      reference's own formulas (``log_softmax`` then ``-Σ p log p``, a global norm
      accumulated in FP64) in another order, so none of them sees the rounding error of
      those formulas; an engine that computes the same quantity another legitimate way
      (``lse - Σ p z`` in a vocab-parallel entropy) differs from the reference by up to
      its own rounding error plus the reference's. The FP64 run measures the reference's
      share: on smollm2-135m its FP32 entropy is 6.3e-5 from FP64 while torch_tp's
      ``lse - Σ p z`` is 8.1e-6 from it.

    Only the controls the contract's bounds name (``bounds.controls_candidate_vs_hf`` and
    ``bounds.controls_tp_vs_tp1``) are returned.

    Args:
        contract: the loaded contract.
        lane: ``fp32``, ``bf16``, ``bf16-castmasters`` or ``bf16-autocast``
            (:func:`qualify.lanes.lanes`).

    Returns:
        Control name -> (its update settings, its attention implementation), in the order
        ``attn_impl``, ``microbatch``, ``row_split``, ``fp64``, ``bf16_mode``; labels
        ``{control}-{lane}``.

    Raises:
        ValueError: an unknown lane.
    """
    mbs = contract.algorithm.micro_batch_size
    other_mbs = max(1, mbs // 2) if mbs > 1 else 2
    names = set(contract.bounds.controls_candidate_vs_hf) | set(contract.bounds.controls_tp_vs_tp1)
    precision = lane_precision(lane)
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"lane {lane!r}: precision must be fp32 or bf16")
    prec: Precision = "bf16" if precision == "bf16" else "fp32"
    mode = lane_bf16_mode(lane)
    out: dict[str, tuple[UpdateSettings, str]] = {}
    if "attn_impl" in names:
        out["attn_impl"] = (UpdateSettings(precision=prec, bf16_mode=mode, micro_batch_size=mbs,
                                           label=f"attn_impl-{lane}"), "eager")
    if "microbatch" in names:
        out["microbatch"] = (UpdateSettings(precision=prec, bf16_mode=mode,
                                            micro_batch_size=other_mbs,
                                            extra_left_padding=2, extra_right_padding=3,
                                            label=f"microbatch-{lane}"), "sdpa")
    if "row_split" in names:
        parts = max(2, *contract.matrix.tp_sizes)
        out["row_split"] = (UpdateSettings(precision=prec, bf16_mode=mode, micro_batch_size=mbs,
                                           row_split=parts, label=f"row_split-{lane}"), "sdpa")
    if "fp64" in names and lane == "fp32":
        out["fp64"] = (UpdateSettings(precision="fp64", micro_batch_size=mbs,
                                      label="fp64-fp32"), "sdpa")
    if "bf16_mode" in names and lane == "bf16":
        out["bf16_mode"] = (UpdateSettings(precision="bf16", bf16_mode="autocast",
                                           micro_batch_size=mbs, label="bf16_mode-bf16"), "sdpa")
    return out


def control_errors_document(errors: ControlErrors) -> dict[str, Any]:
    """The JSON document of ``control_errors.json``.

    Args:
        errors: precision -> control name -> measured errors
            (:func:`qualify.bounds.measure_controls`, after the clip-branch adjustment).

    Returns:
        precision -> control -> metric label -> ``{"value", "where", "max_abs", "max_rel"}``.
    """
    return {
        prec: {name: {key.label: {"value": e.value, "where": e.where,
                                  "max_abs": e.max_abs, "max_rel": e.max_rel}
                      for key, e in errs.items()}
               for name, errs in by_control.items()}
        for prec, by_control in errors.items()}
