"""Progress bars (rich) for steps longer than a few seconds."""

from __future__ import annotations

import sys
import time
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.progress import Progress as _RichProgress


class Progress:
    """A step counter with a rich progress bar on stderr (plain lines when not a TTY).

    Args:
        total: number of steps.
        description: what is running.
        quiet: print nothing.
    """

    def __init__(self, *, total: int, description: str, quiet: bool = False) -> None:
        self.total = total
        self.description = description
        self.quiet = quiet
        self._done = -1
        self._t0 = time.perf_counter()
        self._console = Console(stderr=True)
        self._rich: _RichProgress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> Progress:
        if not self.quiet and self._console.is_terminal:
            self._rich = _RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[step]}"), TimeElapsedColumn(), console=self._console)
            self._rich.__enter__()
            self._task = self._rich.add_task(self.description, total=self.total, step="")
        return self

    def advance(self, step: str) -> None:
        """Mark the previous step done and announce ``step``."""
        self._done += 1
        if self.quiet:
            return
        if self._rich is not None and self._task is not None:
            self._rich.update(self._task, completed=self._done, step=step)
        else:
            elapsed = time.perf_counter() - self._t0
            print(f"[{self.description}] {self._done + 1}/{self.total} {step} "
                  f"(+{elapsed:.1f}s)", file=sys.stderr, flush=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._rich is not None and self._task is not None:
            if exc is None:
                self._rich.update(self._task, completed=self.total, step="done")
            self._rich.__exit__(exc_type, exc, tb)
