"""Decoupled PPO's behavior importance weights, gathered for the report (informational).

``w = exp(lp_prox - lp_behav)`` (Hilton et al. 2022, arXiv 2110.00641; :mod:`qualify.protocol`):
``lp_prox`` each side's own round-1 logprobs, ``lp_behav`` the rollout's behavior logprobs.
The reference records its statistics per round in ``reference.json`` (``update_meta``
``hf-<lane>`` -> ``actor`` -> ``behavior_weight``); each Actor cell's harness computes its own
(``behavior_weight`` of the cell attempt's ``outputs.json``). They are gathered once, by the
comparator, into ``report.json`` ``behavior_weights`` (so ``qualify verify`` recomputes them
from the evidence, and ``report.md`` renders them from the report alone). Never gated.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from qualify import jsonio
from qualify.errors import QualifyError
from qualify.layout import OUTPUTS_META_FILE, REFERENCE_FILE

__all__ = ["behavior_weight_rows"]

_STATS = ("mean", "min", "max", "fraction_capped", "tokens")


def _rows(source: str, stats: Any) -> list[dict[str, Any]]:
    if not isinstance(stats, Mapping):
        return []
    out = []
    for rnd, st in sorted(stats.items(), key=lambda kv: _round_number(str(kv[0]))):
        if isinstance(st, Mapping):
            out.append({"source": source, "round": str(rnd),
                        **{k: st.get(k) for k in _STATS}})
    return out


def _round_number(label: str) -> tuple[int, str]:
    """``round10`` after ``round2``: sort rounds by their number (labels kept as written)."""
    digits = label.removeprefix("round")
    return (int(digits), "") if digits.isdigit() else (1 << 30, label)


def _read(path: Path) -> Any:
    try:
        return jsonio.read_json(path)
    except (OSError, ValueError, QualifyError):
        return None


def behavior_weight_rows(ref_dir: Path, run_dir: Path,
                         actor_attempts: Iterable[tuple[str, str]]) -> tuple[dict[str, Any], ...]:
    """The behavior-weight statistics of the reference and of each Actor cell.

    Args:
        ref_dir: the sealed reference directory.
        run_dir: the run directory.
        actor_attempts: ``(cell id, attempt path relative to run_dir)`` of the Actor cells.

    Returns:
        Rows ``{source, round, mean, min, max, fraction_capped, tokens}`` (``source`` is
        ``reference hf-<lane>`` or a cell id), the reference's first; empty when the
        reference recorded none (a contract without the decoupled weight). Unreadable or
        absent files contribute no rows.
    """
    meta = _read(ref_dir / REFERENCE_FILE)
    update = meta.get("update_meta", {}) if isinstance(meta, Mapping) else {}
    rows: list[dict[str, Any]] = []
    for label, m in sorted(update.items()) if isinstance(update, Mapping) else ():
        if str(label).startswith("hf-") and isinstance(m, Mapping):
            rows += _rows(f"reference {label}", (m.get("actor") or {}).get("behavior_weight"))
    if not rows:
        return ()
    for cell, attempt in actor_attempts:
        for path in sorted((run_dir / attempt).rglob(OUTPUTS_META_FILE)):
            doc = _read(path)
            if not isinstance(doc, Mapping):
                continue
            # A cell's outputs.json holds its role's part at the top level (a launch's, under
            # roles.actor).
            rows += _rows(cell, doc.get("behavior_weight")
                          or ((doc.get("roles") or {}).get("actor") or {}).get("behavior_weight"))
    return tuple(rows)
