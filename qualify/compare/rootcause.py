"""Root cause first: each failing cell's earliest failing quantity in causal order.

A cell that fails usually fails at one quantity early in the update chain, and every
quantity computed from it fails after it. This module orders a cell's ``FAIL`` rows
causally and names the earliest as the cell's cause, with the other failing rows folded
under it. Pure functions over ``report.json`` rows (dicts with the keys of
:meth:`qualify.compare.verdicts.Row.to_dict`); it imports nothing of :mod:`qualify.compare`,
so :class:`~qualify.compare.verdicts.Report` can carry the result in ``report.json``
(``root_causes``) and the report writers and the terminal summary read it from there.

The causal order (:func:`causal_key`):

- trainer rows (role ``actor`` / ``critic``): round 1 before round 2; within a round the
  stages of :data:`TRAINER_CHAIN`: the forward (``logprobs``, ``values``, ``entropy``,
  ``rewards``; a ``*_padded`` rerun too; the Actor's own next-token distributions,
  ``prefill_*`` of class ``trainer_distribution``) -> ``losses`` -> ``grads`` (before clipping) ->
  ``grad_norm`` (pre-clip) -> ``clip_coef`` -> ``lr`` (the step's scheduled lr, an input of
  the step like the clipped gradients) -> ``exp_avg`` / ``exp_avg_sq`` -> ``updates``;
  round ``r + 1``'s forward comes after round ``r``'s update;
- a resume cell's state rows (class ``resume``, no round: the step counter, lr, scheduler,
  master weights, Adam moments and RNG measured right after the restore,
  :mod:`qualify.compare.resume`) come before every resumed round: a state the restore lost
  explains every resumed round that follows;
- sampler rows (role ``sampler``): their own chain, :data:`SAMPLER_CHAIN`: the weight
  ``install`` -> the GEMM ``kernels`` against the installed weights -> the
  ``prefix_cache`` after the update -> the sampler's ``logprobs`` against the Actor's;
- within one stage: comparison class by :data:`CLASS_ORDER` (against the HF reference
  first), then the larger margin, then the metric label (deterministic).

Rows outside both chains are *checks*: ``dtypes`` and ``replica`` (what the harness
declares about its buffers, not a number of the chain), the sampler's rejection probes
and any family this module does not know. A failing check is never folded under a chain
row, nor a chain row under it: it is listed with the cause as an independent failing
check, and it is the cause only of a cell whose chain rows all pass. (On the committed
default run, ``deepspeed-bf16-zero0-actor-tp1`` has the same failing ``dtypes`` check,
``grads is torch.bfloat16``, as ``actor-tp2`` and passes round 1: that check does not
explain ``actor-tp2``'s round-1 ``grad_norm``, so it is not placed before it.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from qualify.distmetrics import KINDS, family

__all__ = [
    "CLASS_ORDER",
    "RESTORE_FAMILIES",
    "RESUME_CLASS",
    "SAMPLER_CHAIN",
    "SAMPLER_ROLE",
    "TRAINER_CHAIN",
    "RootCause",
    "causal_key",
    "causal_order",
    "causes_of_report",
    "root_causes",
    "stage_of",
]

TRAINER_CHAIN: Final[tuple[tuple[str, ...], ...]] = (
    ("logprobs", "values", "entropy", "rewards",
     *(family("prefill", kind, topk=topk) for topk in (False, True) for kind in KINDS)),
    ("losses",),
    ("grads",),
    ("grad_norm",),
    ("clip_coef",),
    ("lr",),
    ("exp_avg", "exp_avg_sq"),
    ("updates",),
)
"""The stages of one trainer round, in causal order (families per stage)."""
SAMPLER_CHAIN: Final[tuple[tuple[str, ...], ...]] = (
    ("install",), ("kernels",), ("prefix_cache",), ("logprobs",))
"""The stages of a sampler cell, in causal order."""
CLASS_ORDER: Final = ("candidate_vs_hf", "tp_vs_tp1", "padding_invariance",
                      "trainer_distribution", "sampler_install", "sampler_cache",
                      "sampler_vs_actor")
"""Within one stage: rows of these classes first, in this order (others after, by name)."""
SAMPLER_ROLE: Final = "sampler"
RESUME_CLASS: Final = "resume"
RESTORE_FAMILIES: Final = frozenset({"step", "lr", "scheduler", "master_weights", "exp_avg",
                                     "exp_avg_sq", "rng_state"})
"""The families of a resume cell's state rows (:data:`qualify.compare.resume.STATE_QUANTITIES`):
the restore, stage 0 of the cell's chain, before its first resumed round."""


def _stage(chain: Sequence[Sequence[str]], family: str) -> int | None:
    return next((i for i, fams in enumerate(chain) if family in fams), None)


def stage_of(row: Mapping[str, Any]) -> int | None:
    """The row's stage in its chain, ``None`` for a check (outside every chain).

    Args:
        row: a ``report.json`` row (``role``, ``family``, ``round``).

    Returns:
        The index into :data:`SAMPLER_CHAIN` for a ``sampler`` row, else into
        :data:`TRAINER_CHAIN` for a row with a round; ``-1`` for a resume cell's state row
        (the restore, :data:`RESTORE_FAMILIES`); ``None`` otherwise (``dtypes``,
        ``replica``, sampler probes, unknown families, trainer rows without a round).
    """
    family = str(row.get("family"))
    if row.get("role") == SAMPLER_ROLE:
        return _stage(SAMPLER_CHAIN, family)
    if not isinstance(row.get("round"), int):
        if row.get("class") == RESUME_CLASS and family in RESTORE_FAMILIES:
            return -1
        return None
    return _stage(TRAINER_CHAIN, family)


def _margin(row: Mapping[str, Any]) -> float:
    """The row's margin as a float; ``inf`` when it is ``None`` or ``"inf"`` (worst)."""
    m = row.get("margin")
    if isinstance(m, int | float) and not isinstance(m, bool):
        return float(m) if not math.isnan(float(m)) else math.inf
    if m == "-inf":
        return -math.inf
    return math.inf


def _class_rank(klass: str) -> int:
    return CLASS_ORDER.index(klass) if klass in CLASS_ORDER else len(CLASS_ORDER)


def causal_key(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """Sort key of a row in causal order (see the module docstring); checks sort last.

    Args:
        row: a ``report.json`` row.

    Returns:
        ``(is_check, round, stage, class rank, class, -margin, metric)``; a sampler row's
        round counts as 0 (its chain has its own stages).
    """
    stage = stage_of(row)
    klass = str(row.get("class"))
    rnd = row.get("round") if isinstance(row.get("round"), int) else 0
    if row.get("role") == SAMPLER_ROLE:
        rnd = 0
    return (stage is None, rnd, stage if stage is not None else 0, _class_rank(klass), klass,
            -_margin(row), str(row.get("metric")))


def causal_order(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """``rows`` sorted by :func:`causal_key` (a stable sort: equal keys keep their order)."""
    return sorted(rows, key=causal_key)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RootCause:
    """The earliest failing quantity of one failing cell, with what it folds.

    Attributes:
        cell: cell id.
        kind: ``chain`` (a quantity of the trainer or sampler chain) or ``check`` (only
            checks fail: ``dtypes``, ``replica``, a sampler probe).
        klass: the cause row's comparison class (``candidate_vs_hf``...).
        role: ``actor``, ``critic`` or ``sampler``.
        round: its round (``None`` for a check or a sampler install row).
        family: its family (``grad_norm``...).
        metric: its label (``round1/actor/grad_norm``).
        statistic: its statistic (``abs``, ``max_abs``, ``max_rel_l2``...).
        error: the measured error as in ``report.json`` (a number, ``"inf"``, or ``None``).
        bound: the sealed bound, same form.
        margin: error / bound, same form (dimensionless; > 1 fails).
        where: the worst element (token ``(b, t)``, parameter, loss term, item).
        reason: the row's reason.
        also_classes: other comparison classes in which the same metric fails.
        folded: the cell's other failing chain rows (same stage and later).
        folded_families: ``[family, count]`` of the folded rows, in causal order.
        checks: the cell's failing checks other than the cause, ``"metric: reason"``.
    """

    cell: str
    kind: str
    klass: str
    role: str
    round: int | None
    family: str
    metric: str
    statistic: str
    error: float | str | None
    bound: float | str | None
    margin: float | str | None
    where: str
    reason: str
    also_classes: tuple[str, ...]
    folded: int
    folded_families: tuple[tuple[str, int], ...]
    checks: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON form (one element of ``root_causes`` in ``report.json``)."""
        return {"cell": self.cell, "kind": self.kind, "class": self.klass, "role": self.role,
                "round": self.round, "family": self.family, "metric": self.metric,
                "statistic": self.statistic, "error": self.error, "bound": self.bound,
                "margin": self.margin, "where": self.where, "reason": self.reason,
                "also_classes": list(self.also_classes), "folded": self.folded,
                "folded_families": [[f, n] for f, n in self.folded_families],
                "checks": list(self.checks)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RootCause:
        """Inverse of :meth:`to_dict` (a ``report.json`` ``root_causes`` entry).

        Raises:
            KeyError: a field is missing.
        """
        return cls(cell=str(d["cell"]), kind=str(d["kind"]), klass=str(d["class"]),
                   role=str(d["role"]), round=d["round"], family=str(d["family"]),
                   metric=str(d["metric"]), statistic=str(d["statistic"]), error=d["error"],
                   bound=d["bound"], margin=d["margin"], where=str(d["where"]),
                   reason=str(d["reason"]), also_classes=tuple(d["also_classes"]),
                   folded=int(d["folded"]),
                   folded_families=tuple((str(f), int(n)) for f, n in d["folded_families"]),
                   checks=tuple(d["checks"]))

    def line(self) -> str:
        """One line for a person: the cause, its numbers, what it folds.

        E.g. ``deepspeed-bf16-zero0-actor-tp2: round 1 actor grad_norm (candidate_vs_hf;
        also tp_vs_tp1): abs 2.6 > bound 0.17, margin 15.2; folds 20 other failing rows
        (clip_coef 3, ...); also failing check: actor/dtypes: ...``.
        """
        what = (f"round {self.round} {self.role} {self.family}" if self.round is not None
                else f"{self.role} {self.family}")
        classes = self.klass + (f"; also {', '.join(self.also_classes)}"
                                if self.also_classes else "")
        out = f"{self.cell}: {what} ({classes})"
        if self.kind == "chain" and self.error is not None and self.bound is not None:
            out += (f": {self.statistic} {_fmt(self.error)} > bound {_fmt(self.bound)}, "
                    f"margin {_fmt(self.margin)} at {self.where}")
        else:
            out += f": {self.reason}"
        if self.folded:
            fams = ", ".join(f"{f} {n}" for f, n in self.folded_families)
            out += f"; folds {self.folded} other failing row{'s' * (self.folded != 1)} ({fams})"
        if self.checks:
            out += f"; also failing check{'s' * (len(self.checks) != 1)}: " + \
                "; ".join(self.checks)
        return out


def _fmt(x: float | str | None) -> str:
    if isinstance(x, int | float) and not isinstance(x, bool):
        return format(float(x), ".3g")
    return "-" if x is None else str(x)


def _check_text(row: Mapping[str, Any]) -> str:
    return f"{row.get('metric')}: {row.get('reason') or 'FAIL'}"


def _cause(cell: str, failing: Sequence[Mapping[str, Any]]) -> RootCause:
    ordered = causal_order(failing)
    chain = [r for r in ordered if stage_of(r) is not None]
    checks = [r for r in ordered if stage_of(r) is None]
    head = chain[0] if chain else checks[0]
    rest = chain[1:] if chain else []
    other_checks = checks if chain else checks[1:]
    fams: dict[str, int] = {}
    for r in rest:
        fams[str(r.get("family"))] = fams.get(str(r.get("family")), 0) + 1
    also = sorted({str(r.get("class")) for r in rest if r.get("metric") == head.get("metric")
                   and r.get("class") != head.get("class")},
                  key=lambda k: (_class_rank(k), k))
    rnd = head.get("round")
    return RootCause(
        cell=cell, kind="chain" if chain else "check", klass=str(head.get("class")),
        role=str(head.get("role")), round=rnd if isinstance(rnd, int) else None,
        family=str(head.get("family")), metric=str(head.get("metric")),
        statistic=str(head.get("statistic")), error=head.get("error"),
        bound=head.get("bound"), margin=head.get("margin"), where=str(head.get("where") or ""),
        reason=str(head.get("reason") or ""), also_classes=tuple(also), folded=len(rest),
        folded_families=tuple(fams.items()), checks=tuple(_check_text(r) for r in other_checks))


def root_causes(rows: Sequence[Mapping[str, Any]],
                cells: Sequence[str] | None = None) -> list[RootCause]:
    """The root cause of every cell with at least one ``FAIL`` row.

    ``ERROR`` and ``NOT_RUN`` rows are not failures of a quantity (nothing was judged) and
    are never a cause; a cell without ``FAIL`` rows has no root cause.

    Args:
        rows: ``report.json`` rows (any order).
        cells: cell ids in the order to report them (``report.json`` ``cells``); cells
            with failing rows that it lacks follow in order of first appearance.

    Returns:
        One :class:`RootCause` per failing cell, in ``cells`` order.
    """
    failing: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        if r.get("verdict") == "FAIL":
            failing.setdefault(str(r.get("cell")), []).append(r)
    order = [c for c in (cells or ()) if c in failing]
    order += [c for c in failing if c not in order]
    return [_cause(c, failing[c]) for c in order]


def causes_of_report(doc: Mapping[str, Any]) -> list[RootCause]:
    """A ``report.json`` document's ``root_causes``, or the same computed from its rows.

    A report written before ``root_causes`` existed lacks the field; its rows hold what
    :func:`root_causes` computes it from.

    Args:
        doc: a ``report.json`` document (schema-valid).

    Returns:
        One :class:`RootCause` per failing cell, in the report's cell order.

    Raises:
        KeyError: a stored entry lacks a field (a document that skipped its schema).
    """
    stored = doc.get("root_causes")
    if isinstance(stored, list):
        return [RootCause.from_dict(d) for d in stored]
    cells = [str(c.get("cell")) for c in doc.get("cells", []) if isinstance(c, Mapping)]
    rows = [r for r in doc.get("rows", []) if isinstance(r, Mapping)]
    return root_causes(rows, cells)
