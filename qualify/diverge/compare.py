"""Module-by-module comparison of ``qualify diverge``: which module diverges first.

For each probed module ``m`` and direction ``d`` (``forward``: the module's output;
``backward``: the gradient of the round's loss with respect to that output):

    error(m, d)         = max |engine - reference| over valid positions and features
    control_error(m, d) = max over the lane's controls of max |control - reference|,
                          measured the same way
    bound(m, d)         = k * control_error(m, d) + floor(d)

``k`` is the contract's ``bounds.k``; ``floor(forward)`` is the contract's floor of the
``logprobs`` family at the cell's precision (activations are judged as the forward
quantities the report compares), ``floor(backward)`` the ``grads`` floor. Valid positions:
``attention_mask == 1`` for sequence-shaped outputs ``[B, T, F]``, ``response_mask == 1``
for outputs on the response window ``[B, R, F]`` (an engine's head that sees only the
window; the reference's ``[B, T, F]`` head output is cut to ``T = P - 1 + t``, the
protocol's window). A control's extra padding is cut off first (left columns of the
prompt, right columns of the response). A row lacks power (``power = False``) when its bound
is at least the largest reference magnitude, so an all-zero output would pass.

The module named is the first one in forward order (embedding, layer 0's input norm,
attention, post-attention norm, MLP, layer 0's output, ..., final norm, head) whose forward
error exceeds its bound; failing that, the first one in backward order (the reverse).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any, Final

import torch

from qualify.diverge.capture import Capture
from qualify.jsonio import json_number

SCHEMA_VERSION: Final = 1
_LAYER = re.compile(r"\.layers\.(\d+)(?:\.(\w+))?$")


def layer_of(name: str) -> tuple[int | None, str]:
    """``model.layers.3.mlp`` -> ``(3, "mlp")``.

    ``(3, "layer")`` for the layer's own output; ``(None, name)`` outside the decoder
    layers (embedding, final norm, head).
    """
    m = _LAYER.search(name)
    if m is None:
        return None, name
    return int(m.group(1)), m.group(2) or "layer"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Frame:
    """Where the valid positions of the batch are.

    Attributes:
        attention_mask: ``[B, T]`` bool.
        response_mask: ``[B, R]`` bool.
        prompt_len: ``P``.
    """

    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_len: int

    @property
    def seq_len(self) -> int:
        """``T = P + R``."""
        return int(self.attention_mask.shape[1])

    @property
    def response_len(self) -> int:
        """``R``."""
        return int(self.response_mask.shape[1])


def _canonical(t: torch.Tensor, frame: Frame, *, left: int, right: int) -> tuple[torch.Tensor,
                                                                                   str]:
    """``t`` without extra padding, and its frame (``seq`` or ``window``).

    Raises:
        ValueError: the length is neither ``T`` nor ``R`` (with this run's padding).
    """
    length = int(t.shape[1])
    if length == frame.seq_len + left + right:
        return t[:, left:left + frame.seq_len], "seq"
    if length == frame.response_len + right:
        return t[:, :frame.response_len], "window"
    raise ValueError(f"output of length {length}: neither T = {frame.seq_len} nor R = "
                     f"{frame.response_len} (padding {left} + {right})")


def frame_of(fa: str, fb: str) -> str:
    """The frame two outputs are compared in: ``window`` when either is on it, else ``seq``."""
    return "window" if "window" in (fa, fb) else "seq"


def _window(t: torch.Tensor, frame: Frame) -> torch.Tensor:
    start = frame.prompt_len - 1
    return t[:, start:start + frame.response_len]


def _aligned(a: torch.Tensor, fa: str, b: torch.Tensor, fb: str,
             frame: Frame) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both tensors in one frame (:func:`frame_of`) and that frame's ``[B, L]`` valid mask."""
    if fa == "window" and fb == "seq":
        b = _window(b, frame)
    elif fa == "seq" and fb == "window":
        a = _window(a, frame)
    mask = frame.response_mask if frame_of(fa, fb) == "window" else frame.attention_mask
    return a, b, mask


def max_abs(a: torch.Tensor, fa: str, b: torch.Tensor, fb: str,
            frame: Frame) -> tuple[float, tuple[int, int], float]:
    """``(max |a - b| on valid positions, its (row, position), max |b| there)``, in FP64.

    The position counts sequence columns ``0..T-1``, or response tokens ``0..R-1`` when
    either tensor is on the response window (:func:`frame_of`).
    """
    a, b, mask = _aligned(a, fa, b, fb, frame)
    if a.shape != b.shape:
        raise ValueError(f"shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
    m = mask[..., None].expand(a.shape)
    zero = torch.zeros((), dtype=torch.float64)
    # where, not a product: a NaN / inf at a padded position must not reach the maximum, and
    # a non-finite value at a valid one is infinitely far (NaN would compare as in bound).
    d = torch.nan_to_num((a.double() - b.double()).abs(), nan=math.inf)
    diff = torch.where(m, d, zero).flatten(2).amax(-1)  # [B, L]
    mag = float(torch.where(m, torch.nan_to_num(b.double().abs(), nan=math.inf), zero).max())
    flat = int(torch.argmax(diff))
    where = (flat // diff.shape[1], flat % diff.shape[1])
    return float(diff.max()), where, mag


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """The bound rule's constants for one cell.

    Attributes:
        k: the contract's ``bounds.k``.
        floor_forward: ``bounds.floors.<precision>.logprobs``.
        floor_backward: ``bounds.floors.<precision>.grads``.
    """

    k: float
    floor_forward: float
    floor_backward: float


def compare(engine: Mapping[str, torch.Tensor], engine_modules: list[str], *,
            reference: Capture, control_runs: Mapping[str, Capture], frame: Frame,
            rule: Rule) -> list[dict[str, Any]]:
    """One row per (direction, module), forward order then backward (reverse) order.

    A module the reference captured and the engine's probe lists but did not capture is an
    error, never a silent pass (the culprit could be the module left out). A non-finite
    engine value at a valid position gives an infinite error (it exceeds any bound).

    Args:
        engine: the harness's ``probe.safetensors`` (``fwd/<name>``, ``bwd/<name>``).
        engine_modules: the module order the harness recorded.
        reference: the HF reference run of the lane.
        control_runs: the lane's controls.
        frame: masks and ``P`` of the frozen batch.
        rule: the bound constants.

    Raises:
        ValueError: a module the engine and the reference both hold has no comparable
            shape; a listed module has no engine tensor; no module is compared at all.
    """
    rows: list[dict[str, Any]] = []
    names = [n for n in reference.modules if n in set(engine_modules)]
    for direction, order in (("forward", names), ("backward", names[::-1])):
        key = "fwd" if direction == "forward" else "bwd"
        floor = rule.floor_forward if direction == "forward" else rule.floor_backward
        for name in order:
            e = engine.get(f"{key}/{name}")
            ref_t = getattr(reference, key).get(name)
            if ref_t is None:
                continue
            if e is None:
                raise ValueError(f"the engine's probe lists {name} but holds no {key}/{name}")
            ec, ef = _canonical(e, frame, left=0, right=0)
            rc, rf = _canonical(ref_t, frame, left=reference.left_padding,
                                right=reference.right_padding)
            err, where, mag = max_abs(ec, ef, rc, rf, frame)
            ctrl_err, ctrl_name = 0.0, None
            per_control: dict[str, float] = {}
            for cname, run in control_runs.items():
                ct = getattr(run, key).get(name)
                if ct is None:
                    continue
                cc, cf = _canonical(ct, frame, left=run.left_padding, right=run.right_padding)
                ce = max_abs(cc, cf, rc, rf, frame)[0]
                per_control[cname] = ce
                if ce > ctrl_err or ctrl_name is None:
                    ctrl_err, ctrl_name = max(ce, ctrl_err), cname
            bound = rule.k * ctrl_err + floor
            layer, sub = layer_of(name)
            rows.append({
                "direction": direction, "module": name, "layer": layer, "submodule": sub,
                "error": err, "bound": bound, "control_error": ctrl_err,
                "control": ctrl_name, "controls": per_control, "floor": floor,
                "margin": err / bound if bound > 0 else math.inf,
                "exceeds": not err <= bound, "where": list(where), "frame": frame_of(ef, rf),
                "reference_max_abs": mag, "power": bool(mag > bound)})
    if not rows:
        raise ValueError("no module of the reference's capture is in the engine's probe "
                         f"(engine modules: {len(engine_modules)})")
    return rows


def first_diverged(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The named row: first forward row over its bound, else first backward one."""
    for direction in ("forward", "backward"):
        for r in rows:
            if r["direction"] == direction and r["exceeds"]:
                return r
    return None


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table (pandas), the named row marked ``<==``."""
    import pandas as pd

    named = first_diverged(rows)
    df = pd.DataFrame([{
        "dir": r["direction"][:3], "module": r["module"], "error": f"{r['error']:.3g}",
        "bound": f"{r['bound']:.3g}", "margin": f"{r['margin']:.3g}",
        "control": r["control"] or "-", "power": "yes" if r["power"] else "NO",
        "": "<== first" if r is named else ("FAIL" if r["exceeds"] else "")}
        for r in rows])
    return str(df.to_string(index=False))


def document(*, cell: Mapping[str, Any], rows: list[dict[str, Any]], rule: Rule,
             controls: list[str], context: Mapping[str, Any]) -> dict[str, Any]:
    """The ``diverge.json`` document (``contracts/schema/diverge.schema.json``)."""
    named = first_diverged(rows)
    first = {d: next((r["module"] for r in rows if r["direction"] == d and r["exceeds"]), None)
             for d in ("forward", "backward")}
    return {
        "schema_version": SCHEMA_VERSION, **context, "cell": dict(cell),
        "rule": {"k": rule.k, "floor_forward": rule.floor_forward,
                 "floor_backward": rule.floor_backward, "controls": controls,
                 "metric": "max_abs over valid positions (attention_mask / response_mask)",
                 "text": "bound = k * max_control(max_abs(control - reference)) + floor"},
        "diverged": named is not None,
        "first": None if named is None else {
            "module": named["module"], "direction": named["direction"],
            "layer": named["layer"], "submodule": named["submodule"],
            "error": json_number(named["error"]), "bound": json_number(named["bound"]),
            "margin": json_number(named["margin"])},
        "first_forward": first["forward"], "first_backward": first["backward"],
        "rows": [_json_row(r) for r in rows],
    }


def _json_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row for JSON: an infinite error, margin or magnitude as the string ``"inf"``."""
    out = {k: json_number(v) if isinstance(v, float) else v for k, v in row.items()}
    out["controls"] = {k: json_number(v) for k, v in row["controls"].items()}
    return out
