"""The figures of one ``report.html``, drawn in parallel worker processes where it can.

A page is built in two passes: its sections call :meth:`Figures.add` with a drawing function
of :mod:`qualify.compare.plots` and its arguments, and put the placeholder it returns where
the ``<svg>`` goes; :meth:`Figures.fill` then draws every figure and puts each SVG text in
its place. Each figure is a pure function of its arguments (the same data gives the same
bytes, :func:`qualify.compare.plots.svg`), so the page is the same text whether its figures
were drawn one after another or in parallel; ``tests/test_html_report.py`` compares the two.

A placeholder holds a random token drawn per page, so no text of the page (a cell id, a
module name from an unsigned ``diverge.json``) can pose as one, and :meth:`Figures.fill`
refuses a page whose placeholders are not each of its figures exactly once.

The figures are drawn by :func:`qualify.forkmap.fork_map`: in forked workers where it
can (the drawing modules are imported already, so a worker starts at once), else here, in
order.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any

from qualify.forkmap import fork_map

__all__ = ["Figures"]

Draw = Callable[..., str]
"""A drawing function: arguments to the figure's SVG text (module-level, so picklable)."""


def _draw(job: tuple[Draw, tuple[Any, ...], dict[str, Any]]) -> str:
    fn, args, kwargs = job
    return fn(*args, **kwargs)


class Figures:
    """The figure calls of one page, drawn when the page's text is complete."""

    def __init__(self) -> None:
        self._jobs: list[tuple[Draw, tuple[Any, ...], dict[str, Any]]] = []
        self._token = secrets.token_hex(16)
        self._found = re.compile(f"\x00figure-{self._token}-([0-9]+)\x00")

    def add(self, draw: Draw, /, *args: Any, **kwargs: Any) -> str:
        """Record ``draw(*args, **kwargs)``; the placeholder to put where its SVG goes."""
        self._jobs.append((draw, args, kwargs))
        return f"\x00figure-{self._token}-{len(self._jobs) - 1}\x00"

    def fill(self, text: str, *, workers: int | None = None) -> str:
        """``text`` with each placeholder replaced by its figure's SVG text.

        Args:
            text: the page holding each placeholder :meth:`add` returned, once.
            workers: processes that draw (default
                :func:`qualify.forkmap.default_workers`); 1 draws here.

        Returns:
            The page with every figure in place.

        Raises:
            ValueError: ``text`` does not hold each placeholder exactly once (before
                anything is drawn).
            Exception: what a drawing function raised; ``BrokenProcessPool`` when a worker
                died.
        """
        found = [int(m.group(1)) for m in self._found.finditer(text)]
        if sorted(found) != list(range(len(self._jobs))):
            raise ValueError(f"the page holds figure placeholders {sorted(found)}, not each "
                             f"of its {len(self._jobs)} figures once")
        svgs = fork_map(_draw, self._jobs, workers=workers)
        return self._found.sub(lambda m: svgs[int(m.group(1))], text)
