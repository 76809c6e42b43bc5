"""The ``routes`` rows: a cell whose kernel routes differ from its pins or its reference.

A cell's routes are what its harness read back at run time (``report.json`` ``routes``,
:func:`qualify.compare.distribution.cell_routes`): a trainer cell ``{"sdpa_backends":
{"<backend> <device> <dtype>": calls}, ...}`` (its role's; ``{role: ...}`` of each role for
a launch's ``outputs.json``), a vLLM sampler cell ``{"vllm": [per worker
{"attention_backends": [...], ...}], ...}``. :func:`route_row` checks, for one COMPLETE cell:

- the contract's pins (``[routes]``, :class:`qualify.contract.RoutePins`): ``sdpa`` against
  every SDPA backend each role's forwards dispatched to (a role that made no SDPA call does
  not satisfy it), ``vllm_attention`` against every worker's attention backends;
- a trainer cell's SDPA backends against those the reference's controls were measured with
  (``distribution.json`` ``routes.sdpa_backends``, union over the controls; by backend name,
  not device or dtype): the sealed bounds were derived from those kernels, so a cell that
  dispatched to another one is judged by bounds measured on a different route. A reference
  that recorded no routes, or no SDPA call, is not a constraint; sampler cells are not checked
  against it (the reference runs HF, not vLLM).

A difference is a ``FAIL`` row (class and family ``routes``, statistic ``route``), like a
``dtypes`` row: the cell ran, its numbers exist, and it ran a configuration other than the
one the contract qualifies (``ERROR`` and ``NOT_RUN`` mean that nothing could be judged).
A gate policy that accepts the route lists the row as an expected failure. A pin the cell's
harness cannot show (it records no routes) is a ``FAIL`` too: it is not shown to hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final

from qualify_harness.routes import NO_SDPA

from qualify.compare.verdicts import FailureDetail, Row
from qualify.contract import RoutePins

__all__ = ["ROUTES_CLASS", "reference_backends", "route_row", "sdpa_backends"]

ROUTES_CLASS: Final = "routes"
DETAIL_ROWS: Final = 5


def sdpa_backends(seen: Any) -> set[str]:
    """Backend names of an ``sdpa_backends`` map (``"MATH cpu float32"`` -> ``MATH``)."""
    if not isinstance(seen, Mapping):
        return set()
    return {str(label).split(" ")[0] for label, n in seen.items()
            if not str(label).startswith("no SDPA") and n}


def reference_backends(ref_doc: Mapping[str, Any] | None) -> set[str]:
    """The SDPA backends the reference's controls dispatched to (``distribution.json``)."""
    routes = ref_doc.get("routes") if isinstance(ref_doc, Mapping) else None
    per = routes.get("sdpa_backends") if isinstance(routes, Mapping) else None
    if not isinstance(per, Mapping):
        return set()
    return set().union(*(sdpa_backends(v) for v in per.values()))


def _show(names: set[str]) -> str:
    return ", ".join(sorted(names)) if names else NO_SDPA


def route_row(cell: str, role: str, kind: str, routes: Any, *, pins: RoutePins | None,
              reference: set[str]) -> Row | None:
    """The cell's ``routes`` row, or ``None`` when nothing constrains its routes.

    Args:
        cell: the cell id.
        role: the cell's role (``actor``, ``critic``, ``sampler``).
        kind: ``trainer`` or ``sampler``.
        routes: the cell's entry of ``report.json`` ``routes``: its role's routes (a cell's
            ``outputs.json``), ``{role: routes}`` (a launch's), or a string when its harness
            records none.
        pins: the contract's ``[routes]`` (``None``: none).
        reference: :func:`reference_backends` (empty: not a constraint).

    Returns:
        ``PASS``, or ``FAIL`` naming the first difference (``item is obtained, expected
        expected``) with every difference in its detail table.
    """
    problems: list[tuple[str, str, str]] = []
    checked = 0
    recorded = isinstance(routes, Mapping)
    if recorded and kind == "trainer" and "sdpa_backends" in routes:
        routes = {role: routes}  # a cell's own outputs.json: its role's routes
    if kind == "trainer":
        if pins is not None and pins.sdpa is not None:
            if not recorded:
                problems.append(("sdpa_backends", f"not recorded ({routes})", pins.sdpa))
                checked += 1
            for r, got in sorted(routes.items()) if recorded else ():
                names = sdpa_backends(got.get("sdpa_backends") if isinstance(got, Mapping)
                                      else None)
                checked += 1
                if names != {pins.sdpa}:
                    problems.append((f"{r}.sdpa_backends", _show(names), f"{pins.sdpa} (pin)"))
        if reference and recorded:
            for r, got in sorted(routes.items()):
                names = sdpa_backends(got.get("sdpa_backends") if isinstance(got, Mapping)
                                      else None)
                if not names:
                    continue
                checked += 1
                if not names <= reference:
                    problems.append((f"{r}.sdpa_backends", _show(names),
                                     f"{_show(reference)} (the reference controls')"))
    elif pins is not None and pins.vllm_attention is not None:
        workers = routes.get("vllm") if recorded else None
        if not isinstance(workers, list) or not workers:
            problems.append(("attention_backends", f"not recorded ({routes})",
                             pins.vllm_attention))
            checked += 1
        for w in workers or ():
            got = w.get("attention_backends") if isinstance(w, Mapping) else None
            names = {str(x) for x in got} if isinstance(got, list) else set()
            rank = w.get("rank", "?") if isinstance(w, Mapping) else "?"
            checked += 1
            if names != {pins.vllm_attention}:
                problems.append((f"vllm[rank {rank}].attention_backends",
                                 ", ".join(sorted(names)) or "none",
                                 f"{pins.vllm_attention} (pin)"))
    if not checked and not problems:
        return None
    row = Row(cell=cell, klass=ROUTES_CLASS, bound_class=None, round=None, role=role,
              family=ROUTES_CLASS, statistic="route", error=None, bound=None, margin=None,
              verdict="PASS", reason=None, where="")
    if not problems:
        return row
    item, obtained, expected = problems[0]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    detail = FailureDetail(mismatched=len(problems), total=max(checked, len(problems)),
                           max_abs=None, max_rel=None, columns=("item", "obtained", "expected"),
                           table=tuple(problems[:DETAIL_ROWS]))
    return dataclasses.replace(row, verdict="FAIL", where=item, detail=detail,
                               reason=f"routes: {item} is {obtained}, expected {expected}{more}")
