"""The figures of ``report.html`` as inline SVG text (matplotlib, deterministic).

Every figure is a :class:`matplotlib.figure.Figure` drawn without pyplot (no global
backend state) and written by :func:`svg`: ``svg.hashsalt`` fixed and the ``Date``
metadata removed, so the same data gives the same bytes; text stays text
(``svg.fonttype = none``), so a browser or an HTML parser reads the labels.

This module imports matplotlib at import time; only :mod:`qualify.compare.html` imports
it, and only when a page is rendered (``import qualify`` never imports matplotlib).
"""

from __future__ import annotations

import contextlib
import io
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import matplotlib as mpl
import numpy as np
import numpy.typing as npt
import pyparsing  # matplotlib's dependency: its deprecation category (quiet_pyparsing)
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullLocator

from qualify.compare.plotdata import ParamErrors, PositionDistribution, TokenErrors
from qualify.distmetrics import TOPK

__all__ = ["RC", "distribution_svg", "diverge_svg", "heatmap_svg", "param_svg",
           "power_label", "quiet_pyparsing", "rounds_svg", "svg", "token_svg"]

RC: Final[dict[str, Any]] = {
    "svg.hashsalt": "qualify-report",
    "svg.fonttype": "none",
    "font.family": "DejaVu Sans",
    "font.size": 8.0,
    "axes.titlesize": 9.0,
    "figure.dpi": 72.0,
}
"""rcParams of every figure (``svg.hashsalt``: the ids in the SVG do not change per run)."""
LOG_RANGE: Final = (-3.0, 2.0)
"""Colour range of the heat map in log10(margin): 1e-3 (green) .. 1 (white) .. 100 (red)."""
FAIL_COLOR: Final = "#c62828"
PASS_COLOR: Final = "#9e9e9e"
BOUND_COLOR: Final = "#000000"


@contextlib.contextmanager
def quiet_pyparsing() -> Iterator[None]:
    """Silence pyparsing's own deprecation warnings (nothing else) inside the block.

    matplotlib 3.9.2 builds its fontconfig and mathtext parsers with pyparsing names and
    arguments that pyparsing >= 3.3 deprecates (``PyparsingDeprecationWarning``); that is
    matplotlib's business, not a problem of the page.
    """
    with warnings.catch_warnings():
        category = getattr(pyparsing, "PyparsingDeprecationWarning", None)
        if isinstance(category, type) and issubclass(category, Warning):
            warnings.filterwarnings("ignore", category=category)
        yield


@contextlib.contextmanager
def _drawing() -> Iterator[None]:
    """:data:`RC` in force, pyparsing's deprecations of matplotlib's calls silenced."""
    with quiet_pyparsing(), mpl.rc_context(RC):
        yield


def svg(fig: Figure) -> str:
    """The figure as an ``<svg>`` element (no XML prolog, no DOCTYPE, no date).

    Args:
        fig: a figure drawn under :data:`RC`.

    Returns:
        The SVG text from its ``<svg`` tag on; the same figure gives the same text.
    """
    buf = io.StringIO()
    with _drawing():
        # bbox_inches="tight" draws the figure twice, but without it a long title is cut
        # off: the constrained layout (_figure) fits a title's height, never its width
        fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]


_SUPERSCRIPT: Final = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def power_label(x: float, _pos: int | None = None) -> str:
    """A log axis's tick label as plain text: ``10⁻³`` at a power of ten, else ``%.3g``.

    matplotlib's default (``LogFormatterSciNotation``) writes mathtext (``$10^{-3}$``),
    whose parser each drawing process builds on its first label; this label is the same
    text without it, and stays text in the SVG (``svg.fonttype = none``).
    """
    if not math.isfinite(x) or x <= 0:
        return ""
    e = round(math.log10(x))
    if math.isclose(x, 10.0 ** e, rel_tol=1e-9):
        return "1" if e == 0 else "10" + str(e).translate(_SUPERSCRIPT)
    return f"{x:.3g}"


def _decades(ax: Any) -> None:
    """A log y axis with decade ticks only, labelled by :func:`power_label`."""
    ax.set_yscale("log")
    # decades only: the log axis's minor ticks were most of the page's render time and
    # unreadable at this size
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(power_label))


def _figure(width: float, height: float) -> Figure:
    with _drawing():
        return Figure(figsize=(width, height), layout="constrained")


def _fmt(m: float) -> str:
    if math.isinf(m):
        return "inf"
    return f"{m:.2g}" if m < 100 else f"{m:.0f}"


def heatmap_svg(margins: npt.NDArray[np.float64], verdicts: Sequence[Sequence[str]],
                cells: Sequence[str], families: Sequence[str], *, title: str) -> str:
    """Cells x families coloured by log10(worst margin); margin 1 (the bound) is white.

    Args:
        margins: ``[cells, families]`` worst margins (``nan`` where none).
        verdicts: worst verdict per entry (``""`` where the cell has no such row).
        cells: row labels.
        families: column labels.
        title: the figure's title.

    Returns:
        The SVG text. Each entry shows its margin (``FAIL``/``PASS`` for a check without
        a margin, red when it fails, grey when it passes; ``NR`` for ``NOT_RUN``, ``ERR``
        for ``ERROR``); a failing entry's text is bold.
    """
    with _drawing():
        fig = _figure(1.6 + 0.62 * len(families), max(2.4, 1.2 + 0.2 * len(cells)))
        ax = fig.add_subplot()
        with np.errstate(divide="ignore"):
            logm = np.log10(np.where(np.isfinite(margins), margins, 10 ** LOG_RANGE[1]))
        logm = np.where(np.isnan(margins), np.nan, np.clip(logm, *LOG_RANGE))
        failed_check = np.array([[v == "FAIL" for v in row] for row in verdicts], dtype=bool)
        logm = np.where(np.isnan(margins) & failed_check, LOG_RANGE[1], logm)  # red
        norm = TwoSlopeNorm(vmin=LOG_RANGE[0], vcenter=0.0, vmax=LOG_RANGE[1])
        cmap = mpl.colormaps["RdYlGn_r"].copy()
        cmap.set_bad("#eeeeee")
        # vector quads (pcolormesh), not a raster image: each entry is an SVG path
        image = ax.pcolormesh(np.arange(len(families) + 1) - 0.5,
                              np.arange(len(cells) + 1) - 0.5, np.ma.masked_invalid(logm),
                              cmap=cmap, norm=norm, edgecolors="white", linewidth=0.4)
        ax.set_xlim(-0.5, len(families) - 0.5)
        ax.set_ylim(len(cells) - 0.5, -0.5)
        for i in range(len(cells)):
            for j in range(len(families)):
                v, m = verdicts[i][j], margins[i, j]
                if not v:
                    continue
                label = {"NOT_RUN": "NR", "ERROR": "ERR"}.get(v) if math.isnan(m) else _fmt(m)
                ax.text(j, i, label or v, ha="center", va="center", fontsize=6.5,
                        fontweight="bold" if v == "FAIL" else "normal")
        ax.set_xticks(range(len(families)), list(families), rotation=40, ha="right")
        ax.set_yticks(range(len(cells)), list(cells))
        ax.tick_params(length=0)
        if len(cells) > 12:  # a tall map: the family names on top too
            top = ax.secondary_xaxis("top")
            top.set_xticks(range(len(families)), list(families), rotation=40, ha="left")
            top.tick_params(length=0)
        ax.set_title(title, loc="left")
        bar = fig.colorbar(image, ax=ax, shrink=0.6, pad=0.01)
        bar.set_label("log10(error / bound); > 0 fails")
        if bar.solids is not None:  # matplotlib rasterizes a long colour bar; keep vectors
            bar.solids.set_rasterized(False)
        return svg(fig)


def token_svg(te: TokenErrors) -> str:
    """Per-token ``|obtained - expected|`` of the worst sequences, with the bound line.

    Args:
        te: the per-token errors of one row (:func:`qualify.compare.plotdata.token_errors`).

    Returns:
        The SVG text: one line per sequence over its valid response positions, the sealed
        bound as a dashed horizontal line.
    """
    r = te.row
    with _drawing():
        fig = _figure(6.2, 2.6)
        ax = fig.add_subplot()
        for b, pos, diff in te.sequences:
            ax.plot(pos, diff, marker="o", markersize=3, linewidth=1, label=f"sequence {b}")
        ax.axhline(te.bound, color=BOUND_COLOR, linestyle="--", linewidth=1,
                   label=f"bound {te.bound:.3g}")
        ax.set_xlabel("response position t")
        ax.set_ylabel(f"|Δ {r['family']}|")
        ax.set_title(f"{r['cell']} · {r['metric']} (candidate vs HF): "
                     f"{r['statistic']} {te.max_abs:.3g}, margin {float(r['margin']):.3g}",
                     loc="left")
        ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        return svg(fig)


KL_FLOOR: Final = 1e-20
"""Token KLs at or below this (0 included; an FP64 KL of equal rows may round below 0) are
drawn at it on the log axis."""
TOP1_MARKERS: Final = {"agree": ("o", PASS_COLOR, 2.0), "tie": ("D", "#ef6c00", 4.0),
                       "mismatch": ("x", FAIL_COLOR, 5.0)}
"""Marker, colour and size of each top-1 state (:data:`qualify.distmetrics.TOP1_STATES`)."""


def distribution_svg(pd_: PositionDistribution) -> str:
    """Per-position token KL, top-k agreement and top-1 state of the worst sequences.

    Args:
        pd_: one cell and family (:func:`qualify.compare.plotdata.position_distributions`).

    Returns:
        The SVG text: three panels sharing the response position axis; top, ``KL(p || q)``
        (solid) and ``KL(q || p)`` (dotted), one colour per sequence, log scale (values at or
        below :data:`KL_FLOOR` drawn at it), the sealed ``kl_ref_cand_max`` and
        ``kl_cand_ref_max`` bounds as horizontal lines (dashed, dash-dotted); middle, the
        top-:data:`~qualify.distmetrics.TOPK` set agreement in ``[0, 1]``; bottom, one strip
        per sequence with each position's top-1 state (agree, tie, mismatch).
    """
    lumped = pd_.k is not None
    with _drawing():
        fig = _figure(6.6, 4.0 + 0.18 * len(pd_.sequences))
        ax_kl, ax_k, ax_1 = fig.subplots(
            3, 1, sharex=True, gridspec_kw={"height_ratios": [3.0, 1.6,
                                                               0.5 + 0.3 * len(pd_.sequences)]})
        palette = mpl.colormaps["tab10"]
        for i, q in enumerate(pd_.sequences):
            c = palette(i % palette.N)
            for vals, style, label in ((q.kl_ref_cand, "-", f"sequence {q.b}: KL(p‖q)"),
                                       (q.kl_cand_ref, ":", f"sequence {q.b}: KL(q‖p)")):
                shown = np.where(np.isnan(vals) | (vals > KL_FLOOR), vals, KL_FLOOR)
                ax_kl.plot(q.t, shown, linestyle=style, marker="o", markersize=2.5,
                           linewidth=1, color=c, label=label)
            ax_k.plot(q.t, q.topk_agreement, marker="o", markersize=2.5, linewidth=1, color=c)
            for state, (marker, color, size) in TOP1_MARKERS.items():
                at = [t for t, s in zip(q.t, q.top1, strict=True) if s == state]
                if at:
                    ax_1.scatter(at, [i] * len(at), marker=marker, color=color, s=size * 6,
                                 label=state)
        for bound, style, name in ((pd_.bound, "--", "kl_ref_cand_max"),
                                   (pd_.bound_cand_ref, "-.", "kl_cand_ref_max")):
            if math.isfinite(bound):
                ax_kl.axhline(max(bound, KL_FLOOR), color=BOUND_COLOR, linestyle=style,
                              linewidth=1, label=f"bound {name} {bound:.3g}")
        _decades(ax_kl)
        ax_kl.set_ylabel("lumped token KL\n(lower bound)" if lumped else "token KL")
        ax_k.set_ylim(-0.05, 1.05)
        ax_k.set_ylabel(f"top-{TOPK} agreement")
        ax_1.set_yticks(range(len(pd_.sequences)), [f"seq {q.b}" for q in pd_.sequences])
        ax_1.set_ylim(len(pd_.sequences) - 0.5, -0.5)
        ax_1.set_ylabel("top-1")
        ax_1.set_xlabel("response position t")
        handles, labels = ax_1.get_legend_handles_labels()
        seen = dict(zip(labels, handles, strict=True))
        if seen:
            ax_1.legend(seen.values(), seen.keys(), fontsize=6.5, loc="upper left",
                        bbox_to_anchor=(1.0, 1.0))
        path = f"top-k path, k = {pd_.k}" if lumped else "full vocabulary"
        ax_kl.set_title(f"{pd_.cell} · {pd_.family} (sampler vs HF, {path}): "
                        f"max token KL {pd_.kl_max:.3g}", loc="left")
        ax_kl.legend(fontsize=6.0, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        return svg(fig)


def param_svg(panels: Sequence[ParamErrors], *, title: str, top: int = 12) -> str:
    """Per-parameter relative L2 error against the bound, one panel per family.

    Args:
        panels: one :class:`~qualify.compare.plotdata.ParamErrors` per family.
        title: the figure's title.
        top: parameters per panel (the largest errors).

    Returns:
        The SVG text: horizontal bars (red above the bound), the bound as a dashed line.
    """
    with _drawing():
        fig = _figure(7.4, 0.6 + 0.17 * top * len(panels))
        axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
        for ax, p in zip(axes, panels, strict=True):
            shown = list(p.params[:top])[::-1]
            vals = [e for _, e in shown]
            colors = [FAIL_COLOR if e > p.bound else PASS_COLOR for e in vals]
            ax.barh(range(len(shown)), vals, color=colors)
            ax.set_yticks(range(len(shown)), [n for n, _ in shown], fontsize=6.5)
            ax.axvline(p.bound, color=BOUND_COLOR, linestyle="--", linewidth=1)
            r = p.row
            note = " (unadjusted expected run)" if p.adjusted else ""
            ax.set_title(f"{r['metric']}: bound {p.bound:.3g}, margin "
                         f"{float(r['margin']):.3g}{note}", loc="left")
            ax.set_xlabel("||Δ|| / ||expected|| (relative L2)")
        fig.suptitle(title, x=0.0, ha="left", fontsize=9)
        return svg(fig)


def rounds_svg(per_family: Mapping[str, Mapping[str, Mapping[int, float]]],
               failing: set[str]) -> str:
    """Error / bound per round, one panel per family, one line per cell.

    Args:
        per_family: family -> cell -> round -> margin
            (:func:`qualify.compare.plotdata.round_margins`).
        failing: cells drawn in colour with a label (the others thin and grey).

    Returns:
        The SVG text; the bound is the dashed line at 1 (log scale; ``inf`` drawn at the
        top of the axis, a margin of 0 at the bottom).
    """
    fams = [f for f in per_family if per_family[f]]
    ncol = 4
    nrow = max(1, math.ceil(len(fams) / ncol))
    with _drawing():
        fig = _figure(9.0, 2.0 * nrow + 0.8)
        axes = fig.subplots(nrow, ncol, squeeze=False).ravel()
        colors = [mpl.colormaps["tab20"](i) for i in range(20)]
        labelled = sorted(failing)
        for ax, fam in zip(axes, fams, strict=False):
            for cell, by_round in per_family[fam].items():
                rounds = sorted(by_round)
                ys = [min(max(by_round[k], 1e-4), 1e3) for k in rounds]
                if cell in failing:
                    c = colors[labelled.index(cell) % len(colors)]
                    ax.plot(rounds, ys, color=c, marker="o", markersize=3, linewidth=1.2,
                            label=cell)
                else:
                    ax.plot(rounds, ys, color="#bbbbbb", linewidth=0.6, zorder=0)
            ax.axhline(1.0, color=BOUND_COLOR, linestyle="--", linewidth=1)
            _decades(ax)
            ax.set_ylim(1e-4, 1e3)
            ax.set_xticks(sorted({k for d in per_family[fam].values() for k in d}))
            ax.set_title(fam, loc="left")
            ax.set_xlabel("round")
        for ax in axes[len(fams):]:
            ax.set_visible(False)
        axes[0].set_ylabel("error / bound")
        handles: dict[str, Any] = {}
        for ax in axes[:len(fams)]:
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
        if handles:
            fig.legend(list(handles.values()), list(handles), loc="outside lower center",
                       ncol=3, fontsize=6.5)
        return svg(fig)


def diverge_svg(rows: Sequence[Mapping[str, Any]], *, title: str,
                named: str | None) -> str:
    """``qualify diverge``: error / bound per probed module, forward and backward.

    Args:
        rows: ``diverge.json`` rows (``direction``, ``module``, ``margin``, ``exceeds``).
        title: the figure title (the cell and round).
        named: the module named as the first to diverge (marked), or ``None``.

    Returns:
        The SVG text: modules in forward order on x, margin on a log y axis (the bound
        is the dashed line at 1; forward and backward as two lines; a module over its
        bound as a red marker).
    """
    modules = [str(r["module"]) for r in rows if r["direction"] == "forward"]
    with _drawing():
        fig = _figure(9.0, 3.2)
        ax = fig.subplots()
        for direction, style in (("forward", "-"), ("backward", ":")):
            by = {str(r["module"]): r for r in rows if r["direction"] == direction}
            xs = [i for i, m in enumerate(modules) if m in by]
            ys = [min(max(float(by[modules[i]]["margin"]), 1e-4), 1e3) for i in xs]
            ax.plot(xs, ys, linestyle=style, marker="o", markersize=3, linewidth=1.0,
                    color=PASS_COLOR if direction == "backward" else "#1565c0",
                    label=direction)
            bad = [(x, y) for x, y in zip(xs, ys, strict=True)
                   if by[modules[x]]["exceeds"]]
            if bad:
                ax.scatter([b[0] for b in bad], [b[1] for b in bad], color=FAIL_COLOR, s=18,
                           zorder=3)
        if named in modules:
            ax.axvline(modules.index(named), color=FAIL_COLOR, linewidth=0.8, alpha=0.6)
        ax.axhline(1.0, color=BOUND_COLOR, linestyle="--", linewidth=1)
        _decades(ax)
        ax.set_ylim(1e-4, 1e3)
        ax.set_xticks(range(len(modules)))
        ax.set_xticklabels([m.removeprefix("model.") for m in modules], rotation=60,
                           ha="right", fontsize=6)
        ax.set_ylabel("error / bound")
        ax.set_title(title, loc="left")
        ax.legend(fontsize=7)
        return svg(fig)
