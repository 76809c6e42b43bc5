"""The bound rule, computed once in the reference stage and sealed.

``bound(m, c, p) = k * max(control_error(m, c, p), resolution(m), propagated(m, c, p))
+ quantum(m, p) + floor(m, p)`` (docs/bound-rule.md), and for each token ``t`` of a
round ``r >= 2`` per-token family with a measured round-to-round response ``response_t``
(:mod:`qualify.reference.round_to_round`) its own bound ``k * max(control_error(m, c, p),
resolution(m), propagated(m, c, p), response_t) + quantum(m, p) + floor(m, p)``
(:meth:`Bound.token_bounds`), with
``control_error(m, c, p)`` the largest error of the controls that the contract assigns to
class ``c`` (``candidate_vs_hf``: a candidate at precision ``p`` against the HF reference at ``p``;
``tp_vs_tp1``: TP = n against TP = 1 of the same engine and precision). A control that
only a TP > 1 execution takes (:data:`TP_ONLY_CONTROLS`: ``row_split``, the row-parallel
re-partition) feeds ``candidate_vs_hf`` through its own bound class
:data:`TP_CANDIDATE_CLASS`, the bound of the cells at TP > 1, so a TP 1 cell keeps the
tighter bound of the executions it can take.
``resolution(m)`` is non-zero for the scalar families only (:data:`RESOLVED_FAMILIES`):
the FP32 spacing (one unit in the last place) of the reference
value, the smallest non-zero difference two FP32 results near it can have. A control error of
0 on a scalar says that the control rounded exactly like the reference, not that a conforming
execution summing in another order agrees to better than one ulp; without the term, a 2-ulp
difference of an FP32 grad norm (|Δ| = 1.9e-6 at 8.4, sum of squares over TP shards in another
order) failed a bound that was the floor alone (1e-6). The grad norm's resolution is also at
least its own FP32 evaluation error on the reference's gradients (:func:`scalar_resolutions`):
the reference sums the squares in FP64, an engine in FP32.

``quantum(m, p)`` is the grid spacing of a per-token family that a BF16 lane's model emits in
BF16 (:data:`BF16_EMITTED`, :func:`bf16_quanta`): two conforming engines whose exact values
differ by ``d`` emit values at most ``|d| + u`` apart, so the spacing ``u`` is added once, not
multiplied by ``k`` (a rounding step is a known quantity, not a measured noise to cover).

``propagated(m, c, p)`` (:func:`propagated_error`) is non-zero for the losses and the grad norm
(:data:`PROPAGATED_FROM`): a loss is a weighted sum over tokens of logprobs, entropies or
values, and the gradient a sum of per-token gradients weighted by the loss derivatives. A
control measures a loss once, as one realisation of how its per-token errors combine, which
depends on the few tokens that carry the weight; the per-token families take the largest error
over every token. ``propagated = sqrt(sum_x sum_t (dL/dx_t)^2 e_x^2)`` is the loss's
uncertainty propagated from the per-token control errors ``e_x`` (first order, uncorrelated
tokens; JCGM 100:2008 eq. 10, ``k`` its coverage factor; :mod:`qualify.reference.sensitivity`).
Without it, on tiny-qwen3 seed offset 3 the round-2 KL loss (60.17, 80 % of it at one token
with ``e^r = 6.9e4``) of Megatron FP32 TP 2 and TP 1 differed by 3.5e-4 > 2.8e-4, from a
logprob difference of 4.8e-6 at that token, inside the logprob bound (2.5e-5); the controls'
logprob errors there were 0, 0 and 9.5e-7, their largest over tokens 3.8e-6. The same token
moved the round-2 grad norm (14178) by 8.8e-2 > 5.9e-2 through the k3 weight of its gradient.

In the ``deterministic`` lane every bound is 0 (bitwise equality). The comparator reads bounds
only from the sealed ``bounds.json``; a metric without a bound is an error, never a pass.
:func:`judge` is the verdict half of the rule: ``PASS`` iff the error is finite and
``error <= bound``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from qualify.contract import Contract
from qualify.lanes import lane_precision
from qualify.protocol import Verdict
from qualify.statistics import (
    FAMILY_STATISTIC,
    ErrorMeasure,
    MetricKey,
    compare_sets,
    group_tensors,
)

CLASSES = ("candidate_vs_hf", "tp_vs_tp1")

TP_ONLY_CONTROLS: Final = frozenset({"row_split"})
"""Controls of an execution only a TP > 1 engine takes: ``row_split`` re-rounds each
row-parallel partial sum as TP ranks and their all-reduce do. A TP 1 engine computes those
sums whole, so its ``candidate_vs_hf`` bound leaves them out."""
TP_CANDIDATE_CLASS: Final = "candidate_vs_hf_tp"
"""The bound class of ``candidate_vs_hf`` rows of cells at TP > 1: the contract's
``candidate_vs_hf`` controls with :data:`TP_ONLY_CONTROLS`; sealed only when the contract
names one of them (else those cells take the ``candidate_vs_hf`` bound)."""

RESOLVED_FAMILIES = ("grad_norm", "clip_coef", "losses")
"""Scalar families whose control error is taken no smaller than the FP32 resolution of the
reference value (:func:`scalar_resolutions`). Every such value is an FP32 scalar in every
engine and lane (norms and losses are accumulated in FP32; protocol)."""

BF16_EMITTED = ("values", "rewards")
"""Per-token families that a BF16 lane's model emits in BF16 (the output of a BF16 value or
reward head, upcast): the reference's are on the BF16 grid, and so are the BF16 cells' (both
measured on tiny-qwen3, seed offsets 0-4). Two conforming engines whose exact values differ by
any ``0 < |d| < u`` (``u`` one BF16 ulp at that magnitude) emit values that are equal or one
``u`` apart, since ``|round(a) - round(b)| <= |a - b| + u`` and both lie on the grid; a bound
below ``u`` demands bitwise equality at every token of that magnitude
(:func:`bf16_quanta`). Logprobs and entropy take no such term: every engine and lane
computes them in FP32 from upcast logits (protocol; the reference's are not on the BF16 grid),
so their noise is continuous and the controls' largest error over tokens measures it."""

PROPAGATED_FROM = {"losses": ("logprobs", "entropy", "values"),
                   "grad_norm": ("logprobs", "values")}
"""Scalar family -> the per-token families whose control errors it inherits
(:func:`propagated_error`). ``grad_norm`` through the loss weights: a per-token error moves
``dL/dx_t`` by ``d^2L/dx_t^2 d_t`` and the norm by its projection on ``ĝ``
(:meth:`qualify.reference.sensitivity.LossSensitivity.grad_norm`). Not the worst case
``e_grads |g|`` (``e_grads`` the largest relative L2 gradient error over parameters): 10x the
measured norm errors in BF16, it made 6 of the 16 known BF16 failures of the default contract
pass (their round-2 Critic grad norm, margins 1.1-1.3)."""

ONLY_AT = {"bf16_mode": "bf16", "fp64": "fp32"}
"""Controls that exist in one lane only (:mod:`qualify.lanes`): the distance between the
two BF16 styles (measured from the ``bf16`` lane, BF16 parameters), and the FP64 run whose
distance to the FP32 reference is the reference's own FP32 rounding error."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Bound:
    """One sealed bound.

    Attributes:
        precision: the reference lane (``fp32``, ``bf16``, ``bf16-castmasters``,
            ``bf16-autocast``; :mod:`qualify.lanes`).
        klass: bound class (``candidate_vs_hf``, ``tp_vs_tp1`` or
            :data:`TP_CANDIDATE_CLASS`).
        key: the metric.
        statistic: the family's declared statistic.
        control_error: the largest control error feeding this class.
        control: the control that gave it.
        floor: the contract's floor for the family at this precision.
        k: the multiplier.
        bound: ``k * max(control_error, resolution, propagated) + quantum + floor`` (0 in
            the deterministic lane): the bound of the row, and of each token whose
            round-to-round response does not exceed that max.
        resolution: FP32 spacing of the largest reference value of the metric (scalar
            families, :data:`RESOLVED_FAMILIES`), else 0; 0 in references sealed before it
            existed (their bounds are read as sealed). References sealed before ``quantum``
            existed hold the BF16 spacing of a BF16-emitted family here (multiplied by k).
        quantum: the BF16 spacing of the largest reference value of a BF16-emitted per-token
            family in a BF16 lane (:data:`BF16_EMITTED`, :func:`bf16_quanta`), added once;
            else 0 (and 0 in references sealed before it existed).
        propagated: the class's per-token control errors carried into a loss
            (:func:`propagated_error`), else 0; 0 in references sealed before it existed.
        round_to_round: the largest round-to-round response of a round-``r >= 2`` per-token
            family over its tokens (:attr:`tokens`; each token's value moved by its own
            round-``r - 1`` value perturbed by the lane's largest control error,
            :mod:`qualify.reference.round_to_round`), else 0; 0 in references sealed
            before it existed. Not in ``bound``: it sets the widest token bound
            (:attr:`widest`).
        tokens: ``[B, R]`` FP64 round-to-round responses of each token (non-finite entries
            taken as 0), from the sealed ``round_to_round.safetensors``; ``None`` when the
            row has none (``round_to_round == 0``). Not a ``bounds.json`` field.
    """

    precision: str
    klass: str
    key: MetricKey
    statistic: str
    control_error: float
    control: str
    floor: float
    k: float
    bound: float
    resolution: float = 0.0
    propagated: float = 0.0
    quantum: float = 0.0
    round_to_round: float = 0.0
    tokens: npt.NDArray[np.float64] | None = dataclasses.field(default=None, compare=False,
                                                               repr=False)

    def token_bounds(self) -> npt.NDArray[np.float64] | None:
        """Each token's bound, ``[B, R]`` FP64.

        ``k * max(control_error, resolution, propagated, tokens[b, t]) + quantum + floor``
        (IEEE 754, in the order of ``bound``: a token whose response is at most that max
        gets ``bound`` bit for bit); ``None`` without :attr:`tokens` or in the
        deterministic lane (``bound`` 0).
        """
        if self.tokens is None or self.bound == 0.0:
            return None
        base = max(self.control_error, self.resolution, self.propagated)
        return self.k * np.maximum(base, self.tokens) + self.quantum + self.floor

    @property
    def widest(self) -> float:
        """The largest token bound: ``bound`` widened by :attr:`round_to_round`.

        ``bound`` when the row has no response or is of the deterministic lane.
        """
        if self.round_to_round == 0.0 or self.bound == 0.0:
            return self.bound
        return self.k * max(self.control_error, self.resolution, self.propagated,
                            self.round_to_round) + self.quantum + self.floor

    def to_dict(self) -> dict[str, Any]:
        """JSON form (one row of ``bounds.json``)."""
        return {
            "precision": self.precision,
            "class": self.klass,
            "round": self.key.round,
            "role": self.key.role,
            "family": self.key.family,
            "statistic": self.statistic,
            "control_error": self.control_error,
            "control": self.control,
            "floor": self.floor,
            "k": self.k,
            "bound": self.bound,
            "resolution": self.resolution,
            "propagated": self.propagated,
            "quantum": self.quantum,
            "round_to_round": self.round_to_round,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Bound:
        """Inverse of :meth:`to_dict`."""
        return cls(
            precision=d["precision"], klass=d["class"],
            key=MetricKey(round=int(d["round"]), role=d["role"], family=d["family"]),
            statistic=d["statistic"], control_error=float(d["control_error"]),
            control=d["control"], floor=float(d["floor"]), k=float(d["k"]),
            bound=float(d["bound"]), resolution=float(d.get("resolution", 0.0)),
            propagated=float(d.get("propagated", 0.0)),
            quantum=float(d.get("quantum", 0.0)),
            round_to_round=float(d.get("round_to_round", 0.0)),
        )


ControlErrors = dict[str, dict[str, dict[MetricKey, ErrorMeasure]]]
"""``{lane: {control: {metric: error}}}`` (lanes: :mod:`qualify.lanes`)."""


def measure_controls(
    reference: Mapping[str, Mapping[str, npt.ArrayLike]],
    controls: Mapping[str, Mapping[str, Mapping[str, npt.ArrayLike]]],
    response_mask: npt.ArrayLike,
) -> ControlErrors:
    """Measure each control against the reference at the same precision.

    Args:
        reference: ``{precision: protocol tensors of the HF reference run}``.
        controls: ``{precision: {control name: protocol tensors of the control run}}``.
        response_mask: ``[B, R]`` valid-token mask.

    Returns:
        ``{precision: {control: {metric: ErrorMeasure}}}``.
    """
    out: ControlErrors = {}
    for prec, runs in controls.items():
        out[prec] = {name: compare_sets(run, reference[prec], response_mask)
                     for name, run in runs.items()}
    return out


def scalar_resolutions(reference: Mapping[str, Mapping[str, npt.ArrayLike]],
                       norm_fp32: Mapping[str, Mapping[tuple[int, str], float]] | None = None,
                       ) -> dict[str, dict[MetricKey, float]]:
    """FP32 resolution of each scalar metric of the reference, per lane.

    Args:
        reference: ``{lane: protocol tensors of the HF reference run}``.
        norm_fp32: ``{lane: {(round, role): norm}}``, the reference's pre-clip gradient norm
            evaluated in FP32 as ``torch.nn.utils.clip_grad_norm_`` does
            (``qualify.reference.update._grad_norm_and_clip``); ``None`` or a missing entry:
            the ulp term alone.

    Returns:
        ``{lane: {key: resolution}}`` for the metrics of :data:`RESOLVED_FAMILIES`: one FP32
        ulp of the largest value, ``numpy.spacing(float32(max |value|))`` over the metric's
        members (the loss terms for ``losses``; IEEE 754 binary32). For ``grad_norm`` it is
        at least the FP32 evaluation error ``e = |norm_fp32 - norm|`` of the norm itself:
        the reference accumulates the norm in FP64, so no control sees the rounding of a
        sum of squares over every gradient element in FP32, which every engine's norm has
        (``O(log2 N)`` ulps for N elements in a pairwise / blocked reduction, Higham 2002,
        section 4.2: 6 ulps at N = 4.2 M on tiny-qwen3-vocab32k). For ``clip_coef`` when it
        clips (``c = max_norm / (norm + 1e-6) < 1``) at least the same error carried
        through ``c``: ``c * e / (norm + 1e-6)``. A non-finite reference value gives 0 (no
        resolution: its comparison fails anyway).
    """
    out: dict[str, dict[MetricKey, float]] = {}
    for lane, tensors in reference.items():
        res: dict[MetricKey, float] = {}
        groups = group_tensors(tensors)
        evals = (norm_fp32 or {}).get(lane, {})
        for key, members in groups.items():
            if key.family not in RESOLVED_FAMILIES:
                continue
            top = max((float(np.max(np.abs(np.asarray(v, dtype=np.float64))))
                       for v in members.values()), default=0.0)
            if not math.isfinite(top):
                res[key] = 0.0
                continue
            r = float(np.spacing(np.float32(top)))
            e, norm = _norm_eval_error(groups, evals, key)
            if key.family == "grad_norm":
                r = max(r, e)
            elif key.family == "clip_coef" and top < 1.0:  # it clips: c = max_norm / (n + 1e-6)
                r = max(r, top * e / (norm + 1e-6))
            res[key] = r
        out[lane] = res
    return out


def bf16_quanta(reference: Mapping[str, Mapping[str, npt.ArrayLike]],
                ) -> dict[str, dict[MetricKey, float]]:
    """One BF16 ulp of the largest reference value of each BF16-emitted per-token family.

    Args:
        reference: ``{lane: protocol tensors of the HF reference run}``; only BF16 lanes
            (:func:`qualify.lanes.lane_precision`) give entries.

    Returns:
        ``{lane: {key: 2^(floor(log2 max|v|) - 7)}}`` (bfloat16: 8 significand bits) for the
        metrics of :data:`BF16_EMITTED` whose reference values all lie on the BF16 grid (the
        low 16 bits of every FP32 value are 0); a family that is not on the grid, all zero or
        non-finite gives no entry. The spacing is that of the largest magnitude, the largest
        one-rounding difference any token can show (the bound is one number per family).
    """
    out: dict[str, dict[MetricKey, float]] = {}
    for lane, tensors in reference.items():
        if lane_precision(lane) != "bf16":
            continue
        res: dict[MetricKey, float] = {}
        for key, members in group_tensors(tensors).items():
            if key.family not in BF16_EMITTED:
                continue
            arrays = [np.ascontiguousarray(np.asarray(v, dtype=np.float32)).reshape(-1)
                      for v in members.values()]
            if not arrays or any((a.view(np.uint32) & 0xFFFF).any() for a in arrays):
                continue
            top = max(float(np.max(np.abs(a))) if a.size else 0.0 for a in arrays)
            if top > 0.0 and math.isfinite(top):
                res[key] = 2.0 ** (math.frexp(top)[1] - 1 - 7)
        out[lane] = res
    return out


def _norm_eval_error(groups: Mapping[MetricKey, Mapping[str, Any]],
                     evals: Mapping[tuple[int, str], float], key: MetricKey,
                     ) -> tuple[float, float]:
    """``(|norm_fp32 - norm|, norm)`` of ``key``'s round and role; ``(0, 0)`` if unknown."""
    member = groups.get(MetricKey(round=key.round, role=key.role, family="grad_norm"), {})
    if (key.round, key.role) not in evals or "" not in member:
        return 0.0, 0.0
    norm = float(np.asarray(member[""], dtype=np.float64))
    e = abs(float(evals[(key.round, key.role)]) - norm)
    return (e, norm) if math.isfinite(e) and math.isfinite(norm) else (0.0, 0.0)


Sensitivities = Mapping[tuple[int, str], Mapping[str, Mapping[str, float]]]
"""One lane's ``{(round, role): {term: {family: S}}}``, ``S = sum_t (dL/dx_t)^2`` of each loss
term (:mod:`qualify.reference.sensitivity`, the reference run's ``update_meta``)."""


def propagated_error(key: MetricKey, errors: Mapping[str, Mapping[MetricKey, ErrorMeasure]],
                     controls: list[str], sensitivities: Sensitivities | None) -> float:
    """The propagated uncertainty of a loss from the controls' per-token errors (first order).

    Args:
        key: the metric (a family of :data:`PROPAGATED_FROM`; any other gives 0).
        errors: ``{control: {metric: error}}`` of one lane.
        controls: the controls feeding the class; ``e_x`` is the largest of their errors of
            family ``x`` at ``key``'s round and role (0 where none measured it).
        sensitivities: the lane's :data:`Sensitivities` (``None``: 0).

    Returns:
        ``losses``: ``max over terms of sqrt(sum_x S[term][x] * e_x^2)`` (the statistic is
        the largest over its terms); ``grad_norm``: ``sqrt(sum_x G_x e_x^2)`` with ``G`` the
        ``"grad_norm"`` entry; each token's error of standard uncertainty ``e_x``,
        uncorrelated across tokens (JCGM 100:2008 eq. 10; :mod:`qualify.reference.sensitivity`).
        A non-finite value gives 0 (a non-finite control error already sets the bound).
        The sum runs over the families in sorted order, so the value does not depend on
        the order a document lists them in (``qualify verify`` recomputes it bit for bit).
    """
    if sensitivities is None or key.family not in PROPAGATED_FROM:
        return 0.0

    def e(family: str) -> float:
        k = MetricKey(round=key.round, role=key.role, family=family)
        return max((errors[n][k].value for n in controls if k in errors.get(n, {})),
                   default=0.0)

    terms = sensitivities.get((key.round, key.role), {})
    wanted = [v for t, v in terms.items() if (t == "grad_norm") == (key.family == "grad_norm")]
    out = max((math.sqrt(sum(s * e(f) ** 2 for f, s in sorted(by_family.items())
                             if f in PROPAGATED_FROM[key.family]))
               for by_family in wanted), default=0.0)
    return out if math.isfinite(out) else 0.0


def compute_bounds(contract: Contract, errors: ControlErrors,
                   resolutions: Mapping[str, Mapping[MetricKey, float]] | None = None,
                   sensitivities: Mapping[str, Sensitivities] | None = None,
                   quanta: Mapping[str, Mapping[MetricKey, float]] | None = None,
                   *, round_to_round: Mapping[str, Mapping[MetricKey, npt.ArrayLike]]
                   | None = None,
                   ) -> list[Bound]:
    """Apply the contract's bound rule to the measured control errors.

    Args:
        contract: supplies k, lane, floors and which controls feed which class.
        errors: output of :func:`measure_controls`, keyed by reference lane
            (:mod:`qualify.lanes`: ``fp32``, ``bf16``, ``bf16-castmasters``,
            ``bf16-autocast``); a lane takes the floors of its precision.
        resolutions: output of :func:`scalar_resolutions` (``None``: no resolution term).
        sensitivities: ``{lane: Sensitivities}`` (``None``: no propagated term).
        quanta: output of :func:`bf16_quanta` (``None``: no quantum term).
        round_to_round: ``{lane: {metric: [B, R] per-token responses}}``
            (:func:`qualify.reference.round_to_round.terms`; ``None``: no such term), the
            same for every class of the lane; a non-finite response is taken as 0 here
            (the perturbed update is a reference run, not a candidate). A metric with a
            response > 0 gets it as :attr:`Bound.tokens` and its largest as
            :attr:`Bound.round_to_round`; ``bound`` does not take it (the per-token bounds
            do, :meth:`Bound.token_bounds`).

    Returns:
        One :class:`Bound` per lane x class x metric measured by the controls (its
        ``precision`` field is the lane); the classes ``candidate_vs_hf`` (without
        :data:`TP_ONLY_CONTROLS`), ``tp_vs_tp1`` and, when the contract's
        ``candidate_vs_hf`` names a TP-only control, :data:`TP_CANDIDATE_CLASS`.

    Raises:
        KeyError: a control the contract names was not measured at a precision.
    """
    b = contract.bounds
    cand = b.controls_candidate_vs_hf
    classes = {"candidate_vs_hf": tuple(n for n in cand if n not in TP_ONLY_CONTROLS),
               "tp_vs_tp1": b.controls_tp_vs_tp1}
    if TP_ONLY_CONTROLS & set(cand):
        classes[TP_CANDIDATE_CLASS] = cand
    out: list[Bound] = []
    for prec in sorted(errors):
        for klass, names in classes.items():
            usable = [n for n in names if n in errors[prec]]
            expected = [n for n in names if n not in ONLY_AT or ONLY_AT[n] == prec]
            missing = sorted(set(expected) - set(usable))
            if missing:
                raise KeyError(f"controls {missing} not measured at {prec}")
            keys = sorted({k for n in usable for k in errors[prec][n]}, key=lambda k: k.label)
            for key in keys:
                worst, worst_name = 0.0, "none"
                for n in usable:
                    e = errors[prec][n].get(key)
                    if e is not None and (e.value > worst or worst_name == "none"):
                        worst, worst_name = e.value, n
                floor = float(b.floors[lane_precision(prec)][key.family])
                res = float((resolutions or {}).get(prec, {}).get(key, 0.0))
                prop = propagated_error(key, errors[prec], usable,
                                        (sensitivities or {}).get(prec))
                quantum = float((quanta or {}).get(prec, {}).get(key, 0.0))
                tokens = _responses((round_to_round or {}).get(prec, {}).get(key))
                r2r = float(tokens.max()) if tokens is not None else 0.0
                bound = (0.0 if b.lane == "deterministic"
                         else b.k * max(worst, res, prop) + quantum + floor)
                out.append(Bound(precision=prec, klass=klass, key=key,
                                 statistic=FAMILY_STATISTIC[key.family], control_error=worst,
                                 control=worst_name, floor=floor, k=b.k, bound=bound,
                                 resolution=res, propagated=prop, quantum=quantum,
                                 round_to_round=r2r,
                                 tokens=tokens if r2r > 0.0 and bound > 0.0 else None))
    return out


def _responses(x: npt.ArrayLike | None) -> npt.NDArray[np.float64] | None:
    """Per-token responses as FP64 (non-finite entries 0); ``None`` if none or empty."""
    if x is None:
        return None
    a = np.asarray(x, dtype=np.float64)
    if a.size == 0:
        return None
    return np.where(np.isfinite(a), a, 0.0)


def bounds_document(contract: Contract, bounds: list[Bound]) -> dict[str, Any]:
    """The ``bounds.json`` document (rule, provenance, rows)."""
    return {
        "schema_version": 1,
        "contract": contract.name,
        "contract_digest": contract.digest,
        "rule": "bound = k * max(control_error, resolution, propagated, round_to_round)"
                " + quantum + floor",
        "k": contract.bounds.k,
        "lane": contract.bounds.lane,
        "controls": {"candidate_vs_hf": list(contract.bounds.controls_candidate_vs_hf),
                     "tp_vs_tp1": list(contract.bounds.controls_tp_vs_tp1)},
        "bounds": [x.to_dict() for x in bounds],
    }


def lookup(bounds: list[Bound], *, precision: str, klass: str, key: MetricKey) -> Bound | None:
    """Find the bound of ``key`` (variant ignored) in a class at a precision, or ``None``."""
    want = dataclasses.replace(key, variant="")
    for x in bounds:
        if x.precision == precision and x.klass == klass and x.key == want:
            return x
    return None


def judge(error: float, bound: float) -> tuple[Verdict, float]:
    """Verdict and margin of one measured error against its bound.

    Args:
        error: the measured statistic (>= 0, may be ``inf``).
        bound: the sealed bound (>= 0).

    Returns:
        ``("PASS", margin)`` iff ``error`` is finite and ``error <= bound``, else
        ``("FAIL", margin)``; ``margin = error / bound``, ``inf`` when ``bound == 0`` and
        ``error > 0`` (or ``error`` is not finite), 0 when both are 0.
    """
    if not math.isfinite(error):
        return "FAIL", math.inf
    margin = error / bound if bound > 0 else (0.0 if error == 0 else math.inf)
    return ("PASS" if error <= bound else "FAIL"), margin
