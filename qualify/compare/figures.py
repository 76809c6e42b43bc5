"""The figures of one ``report.html``, drawn in parallel worker processes.

A page is built in two passes: its sections call :meth:`Figures.add` with a drawing function
of :mod:`qualify.compare.plots` and its arguments, and put the placeholder it returns where
the ``<svg>`` goes; :meth:`Figures.fill` then draws every figure and puts each SVG text in
its place. Each figure is a pure function of its arguments (the same data gives the same
bytes, :func:`qualify.compare.plots.svg`), so the page is the same text whether its figures
were drawn one after another or in parallel; ``tests/test_html_report.py`` compares the two.

Parallel drawing forks the rendering process (the drawing modules are imported already, so
a worker starts at once): on a platform with ``fork``, with more than one CPU and one
figure, and only while the process has a single Python thread (a lock another thread held
at the fork would stay held in the child). Otherwise every figure is drawn here, in order.
A worker's exception is raised here, as the drawing function would raise it.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Final

__all__ = ["Figures", "default_workers"]

_PLACEHOLDER: Final = "\x00qualify-figure-{}\x00"
"""Where a figure goes in the page text until :meth:`Figures.fill`: NUL never survives
:func:`qualify.display.printable` nor HTML escaping, so no text of the page looks like it."""
_FOUND: Final = re.compile("\x00qualify-figure-([0-9]+)\x00")

Draw = Callable[..., str]
"""A drawing function: arguments to the figure's SVG text (module-level, so picklable)."""


def _draw(job: tuple[Draw, tuple[Any, ...], dict[str, Any]]) -> str:
    fn, args, kwargs = job
    return fn(*args, **kwargs)


def default_workers(figures: int) -> int:
    """Worker processes for ``figures`` figures: one per usable CPU, at most one per figure.

    1 (draw in this process) on a platform without ``fork`` or while this process runs
    other Python threads.
    """
    if "fork" not in multiprocessing.get_all_start_methods() or threading.active_count() > 1:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(figures, cpus or 1))


class Figures:
    """The figure calls of one page, drawn when the page's text is complete."""

    def __init__(self) -> None:
        self._jobs: list[tuple[Draw, tuple[Any, ...], dict[str, Any]]] = []

    def add(self, draw: Draw, /, *args: Any, **kwargs: Any) -> str:
        """Record ``draw(*args, **kwargs)``; the placeholder to put where its SVG goes."""
        self._jobs.append((draw, args, kwargs))
        return _PLACEHOLDER.format(len(self._jobs) - 1)

    def fill(self, text: str, *, workers: int | None = None) -> str:
        """``text`` with each placeholder replaced by its figure's SVG text.

        Args:
            text: the page holding the placeholders :meth:`add` returned.
            workers: processes that draw (default :func:`default_workers`); 1 draws here.

        Raises:
            Exception: what a drawing function raised; ``BrokenProcessPool`` when a worker
                died.
        """
        n = workers if workers is not None else default_workers(len(self._jobs))
        if n <= 1 or len(self._jobs) <= 1:
            svgs = [_draw(job) for job in self._jobs]
        else:
            with ProcessPoolExecutor(max_workers=n,
                                     mp_context=multiprocessing.get_context("fork")) as pool:
                svgs = list(pool.map(_draw, self._jobs))
        return _FOUND.sub(lambda m: svgs[int(m.group(1))], text)
