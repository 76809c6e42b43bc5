"""qualify.compare.figures: a page's figures drawn in parallel give the page drawn in order."""

from __future__ import annotations

import gc
import os
import re
import signal
import threading

import numpy as np
import pytest

from qualify.compare import figures
from qualify.compare.figures import Figures
from qualify.compare.html import _e, _plots


def _box(text: str, *, pid: bool = False) -> str:
    """A drawing function: module-level, so a forked worker finds it by name."""
    return f"<svg>{text}{os.getpid() if pid else ''}</svg>"


def _fails(text: str) -> str:
    raise ValueError(f"cannot draw {text}")


def _sigint_ignored() -> str:
    return f"<svg>{signal.getsignal(signal.SIGINT) == signal.SIG_IGN}</svg>"


def _page(figs: Figures, n: int) -> str:
    return "<body>" + "".join(f"<p>{i}</p>{figs.add(_box, str(i))}" for i in range(n)) \
        + "</body>"


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_each_placeholder_gets_its_own_figure_in_order(workers: int) -> None:
    figs = Figures()
    page = figs.fill(_page(figs, 5), workers=workers)
    assert page == "<body>" + "".join(f"<p>{i}</p><svg>{i}</svg>" for i in range(5)) \
        + "</body>"
    assert "\x00" not in page


def test_two_workers_draw_in_other_processes() -> None:
    figs = Figures()
    text = "".join(figs.add(_box, "x", pid=True) for _ in range(6))
    drawn_by = {int(s.removeprefix("x")) for s in
                figs.fill(text, workers=2).removeprefix("<svg>").removesuffix("</svg>")
                .split("</svg><svg>")}
    assert os.getpid() not in drawn_by
    assert 1 <= len(drawn_by) <= 2


def test_a_real_figure_is_the_same_bytes_drawn_in_a_worker() -> None:
    margins = np.array([[0.5, 2.0], [np.nan, 0.01]])
    verdicts = [["PASS", "FAIL"], ["", "PASS"]]
    args = (margins, verdicts, ["cell-a", "cell-b"], ["logprobs", "grads"])
    plots = _plots()  # matplotlib's pyparsing deprecations silenced, as the page does
    direct = plots.heatmap_svg(*args, title="t")
    figs = Figures()
    text = figs.add(plots.heatmap_svg, *args, title="t") + figs.add(plots.heatmap_svg, *args,
                                                                     title="t")
    assert figs.fill(text, workers=2) == direct + direct


@pytest.mark.parametrize("workers", [1, 2])
def test_a_drawing_error_is_raised_as_the_function_raised_it(workers: int) -> None:
    figs = Figures()
    text = figs.add(_box, "a") + figs.add(_fails, "b")
    with pytest.raises(ValueError, match="cannot draw b"):
        figs.fill(text, workers=workers)


def test_no_page_text_can_pose_as_a_placeholder() -> None:
    """A placeholder holds NUL, which the page's escaping never lets through, and a token
    drawn per page: another page's placeholder (or a guess) is left as it is."""
    figs = Figures()
    forged = _e("\x00figure-0\x00")
    assert "\x00" not in forged
    other = Figures().add(_box, "forged")
    assert figs.fill(forged + other + figs.add(_box, "real"), workers=1) == \
        forged + other + "<svg>real</svg>"


@pytest.mark.parametrize("times", [0, 2])
def test_a_page_without_each_placeholder_once_is_refused(times: int) -> None:
    figs = Figures()
    mark = figs.add(_fails, "never drawn")  # refused before anything is drawn
    with pytest.raises(ValueError, match=r"not each of its 1 figures once"):
        figs.fill("<body>" + mark * times + "</body>", workers=1)


def test_a_worker_ignores_ctrl_c_and_the_parent_heap_is_unfrozen_after() -> None:
    """Ctrl-C interrupts this process, whose handler stays; its workers ignore it. (A job
    started in the background of a non-interactive shell, as CI starts pytest, inherits
    SIGINT ignored: the default handler is put in place here first.)"""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        figs = Figures()
        text = figs.add(_sigint_ignored) + figs.add(_sigint_ignored)
        assert figs.fill(text, workers=2) == "<svg>True</svg><svg>True</svg>"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
    assert gc.get_freeze_count() == 0


def test_default_workers_draws_here_while_another_thread_runs() -> None:
    assert figures.default_workers(0) == 1
    assert 1 <= figures.default_workers(8) <= max(1, len(os.sched_getaffinity(0)))
    assert figures.default_workers(1000) <= figures.MAX_WORKERS
    assert figures.default_workers(1) == 1
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert figures.default_workers(8) == 1  # a fork now could copy a held lock
    finally:
        stop.set()
        other.join()


@pytest.mark.parametrize(("x", "label"), [
    (1e-4, "10⁻⁴"), (1e-20, "10⁻²⁰"), (1.0, "1"), (10.0, "10¹"), (1e3, "10³"),
    (0.5, "0.5"), (2e-7, "2e-07"), (0.0, ""), (-1.0, ""), (float("inf"), ""),
    (float("nan"), "")])
def test_a_log_axis_label_is_plain_text(x: float, label: str) -> None:
    assert _plots().power_label(x) == label


def test_log_axes_of_a_figure_carry_no_mathtext() -> None:
    """The rounds figure's log axis: its decade labels are text of the SVG, no ``$``."""
    svg = _plots().rounds_svg({"logprobs": {"cell-a": {1: 0.02, 2: 3.0}}}, failing={"cell-a"})
    assert "10⁻⁴" in svg
    assert "10³" in svg
    assert "$" not in svg
    assert "mathdefault" not in svg


def test_a_title_wider_than_its_figure_is_kept_whole() -> None:
    """The constrained layout fits a title's height, not its width: the saved SVG grows to
    hold a long title (``bbox_inches="tight"``), so its end (the margin) is never cut."""
    from qualify.compare.plotdata import TokenErrors

    cell = "deepspeed-bf16-zero0-actor-tp1-" + "x" * 40
    te = TokenErrors(row={"cell": cell, "metric": "round2/actor/logprobs", "family": "logprobs",
                          "statistic": "max_abs", "margin": 3.56},
                     sequences=((0, np.arange(4), np.array([0.1, 0.2, 0.05, 0.3])),),
                     bound=0.13, max_abs=0.3, reproduces=True)
    svg = _plots().token_svg(te)
    width = re.search(r'<svg[^>]* width="([0-9.]+)pt"', svg)
    assert width is not None
    assert float(width.group(1)) > 6.2 * 72  # wider than the 6.2 in figure it was drawn on
    assert "margin 3.56" in svg
