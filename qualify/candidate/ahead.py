"""Start each trainer launch one turn ahead: its launcher imports while the launch before runs.

The candidate stage's trainer launches run one after another, and a warm launcher
(:mod:`qualify.candidate.warm`) spends its first seconds on one core importing torch,
transformers and its engine before it forks any rank. So the stage starts launch ``i``'s
launcher as soon as launch ``i - 1`` has started, with ``--wait-stdin``: it imports, then
waits; its :class:`~qualify.candidate.gate.Gate` opens (one byte down the pipe that is its
stdin) as soon as launch ``i - 1``'s :func:`~qualify.candidate.launch.launch` has returned
(its launcher exited, what its process group left running ended,
:func:`qualify.procs.end_group`, its logs read), and only then does it fork its ranks. At
most one launch's ranks run at a time, as before; beside them run the sampler cells
(:mod:`qualify.candidate.beside`) and one importing interpreter.

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

from pathlib import Path

from qualify.candidate.beside import AHEAD_ENV
from qualify.candidate.gate import START_BYTE, Gate, raised
from qualify.hostmem import MEMINFO, meminfo_bytes

__all__ = ["AHEAD_ENV", "START_BYTE", "Gate", "mem_available", "raised", "room_ahead"]


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
