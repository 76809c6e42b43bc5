"""Start each trainer launch one turn ahead: its launcher imports while the launch before runs.

The candidate stage's trainer launches run one after another, and a warm launcher
(:mod:`qualify.candidate.warm`) spends its first seconds on one core importing torch,
transformers and its engine before it forks any rank. So the stage starts launch ``i``'s
launcher as soon as launch ``i - 1`` has started, with ``--wait-stdin``: it imports, then
waits; its :class:`~qualify.candidate.gate.Gate` opens (one byte down the pipe that is its
stdin) as soon as launch ``i - 1``'s :func:`~qualify.candidate.launch.launch` has returned
(its launcher exited, what its process group left running ended,
:func:`qualify.procs.end_group`, its logs read), and only then does it fork its ranks.
While the sampler cells run (:mod:`qualify.candidate.beside`), one launch's ranks run at a
time, beside them and one importing interpreter. The sampler cells hold the second of the
two jobs (``QUALIFY_JOBS``); once they are done, :class:`SamplerSlot` gives it to the
waiting launch: its gate opens while launch ``i - 1`` still runs, if ``MemAvailable`` holds
the planned host peaks of both (:func:`room_beside`). So at most two launches' ranks run at
once, and launch ``i + 1`` starts only after launch ``i - 1`` ended (the stage finishes the
launches in order).

A launch's wall-clock limit, ``wall_s`` and ``started`` count from its gate
(:func:`qualify.procs.run`'s ``clock_from``, :func:`qualify.candidate.launch.launch`), so
what its launcher imported before the gate opened is outside them; ``result.json`` says
whether it ran ahead (``ahead``: its launcher started before its gate opened; the first
launch's gate opens before its launcher starts) and when its launcher started
(``launcher_started``). No rank exists before the gate
opens, so no cell's numbers can depend on this (each rank computes on frozen inputs with one
thread).
Where the launcher is not the warm one (torchrun, srun, a foreign interpreter: every CUDA
launch), a gated launch waits for its gate in this process and starts its launcher then:
nothing runs ahead.

When it runs ahead (:func:`qualify.candidate.beside.ahead`): on CPU under ``QUALIFY_JOBS``
2 (the default there, :func:`qualify.candidate.beside.jobs`); ``QUALIFY_AHEAD=0`` or
``QUALIFY_JOBS=1`` runs every launch strictly after the one before. A launch starts ahead
only while ``MemAvailable`` (``/proc/meminfo``) holds the planned host peak of the launch it
waits for plus one interpreter (:func:`room_ahead`,
:func:`qualify.candidate.plan.launch_host_peaks`); else it starts in its turn.

If the stage stops (an exception, Ctrl-C), every gate is shut: a launcher before its gate
reads end of file and exits before any rank (:data:`qualify.candidate.warm.GATE_SHUT_EXIT`),
and a launch past its gate is cancelled (its process tree ended, as on a timeout). A launch
whose worker raised shuts the next gate instead of opening it
(:meth:`~qualify.candidate.gate.Gate.open_after`).

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from qualify.candidate.beside import AHEAD_ENV
from qualify.candidate.gate import START_BYTE, Gate, raised
from qualify.hostmem import MEMINFO, meminfo_bytes

__all__ = ["AHEAD_ENV", "START_BYTE", "Gate", "SamplerSlot", "mem_available", "raised",
           "room_ahead", "room_beside"]


def mem_available(meminfo: Path = MEMINFO) -> int | None:
    """``MemAvailable`` in bytes; ``None`` where the kernel does not report it.

    :func:`qualify.hostmem.meminfo_bytes` of ``meminfo`` (default ``/proc/meminfo``).
    """
    return meminfo_bytes("MemAvailable", meminfo)


def room_ahead(planned_peak: int, interpreter: int, *, available: int | None) -> bool:
    """Whether a launcher may import beside a running launch.

    Args:
        planned_peak: host bytes the running launch is planned to peak at (its ranks, and
            the sampler cells beside it: :func:`qualify.candidate.plan.launch_host_peaks`).
        interpreter: host bytes of the importing launcher
            (:data:`qualify.reference.plan_core.INTERPRETER_BYTES`).
        available: ``MemAvailable`` now (:func:`mem_available`); ``None`` (unknown) is no.
    """
    return available is not None and available >= planned_peak + interpreter


def room_beside(running_peak: int, next_peak: int, *, available: int | None) -> bool:
    """Whether a launch's ranks may start while the launch before it still runs.

    Args:
        running_peak: host bytes the running launch is planned to peak at
            (:func:`qualify.candidate.plan.launch_host_peaks`).
        next_peak: host bytes the launch to start is planned to peak at.
        available: ``MemAvailable`` now (:func:`mem_available`); ``None`` (unknown) is no.
            What the running launch holds already is out of it, so asking for its whole
            planned peak again errs on the side of no.
    """
    return available is not None and available >= running_peak + next_peak


class SamplerSlot:
    """The sampler cells' job, given to a waiting trainer launch once they are done.

    :meth:`offer` a launch's gate with its room check; :meth:`release` (the sampler cells
    returned) opens every offered gate not yet decided whose check holds then. A gate
    offered after the release is opened at once where its check holds. A gate the check
    refuses keeps waiting for its turn (the launch before it ends,
    :meth:`Gate.open_after`). Safe from any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._released = False
        self._waiting: list[tuple[Gate, Callable[[], bool]]] = []

    @property
    def released(self) -> bool:
        """Whether the sampler cells are done."""
        with self._lock:
            return self._released

    def offer(self, gate: Gate, room: Callable[[], bool]) -> None:
        """Open ``gate`` once the sampler cells are done, if ``room()`` holds then."""
        with self._lock:
            if not self._released:
                self._waiting.append((gate, room))
                return
        if not gate.decided and room():
            gate.open()

    def release(self) -> None:
        """The sampler cells are done: open each waiting gate that has room now."""
        with self._lock:
            self._released = True
            waiting, self._waiting = self._waiting, []
        for gate, room in waiting:
            if not gate.decided and room():
                gate.open()
