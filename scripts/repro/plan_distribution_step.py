"""Run the reference stage's distribution step alone, for its peak memory (docs/scale.md).

Usage: ``python scripts/repro/plan_distribution_step.py CONTRACT DIR``

``DIR`` is a reference directory (sealed or interrupted) holding the rollout. Runs
:func:`qualify.reference.distribution.seal_distribution` as the stage's ``distribution``
step does (the prepared bundle's Actor, the frozen rollout, ``release_free_memory()``
first) into a temporary directory, and nothing else, so a process-level peak RSS
(``scripts/repro/rss_trace.py``) is that step's peak plus the interpreter, to set beside
``qualify plan``'s ``distribution: HF controls (host)`` row. Prints the RSS at the step's
start, its own peak (``VmHWM``, reset through ``/proc/self/clear_refs`` after the models are
prepared, where the kernel allows; the process's peak so far otherwise, marked) and its wall
time. Exit 2 with a usage line when the arguments are not two.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from qualify.contract import load_contract
from qualify.memory import release_free_memory
from qualify.models import bundle as models
from qualify.reference import rollout
from qualify.reference.distribution import seal_distribution

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_step import _reset_peak, _status_kib  # the sibling script's readers


def main() -> int:
    """Seal the distribution files of ``DIR``'s rollout into a temporary directory."""
    if len(sys.argv) != 3:
        print("usage: python scripts/repro/plan_distribution_step.py CONTRACT DIR",
              file=sys.stderr)
        return 2
    contract = load_contract(Path(sys.argv[1]))
    bundle = models.prepare_models(contract)
    roll = rollout.Rollout.load(Path(sys.argv[2]))
    with tempfile.TemporaryDirectory() as out:
        release_free_memory()  # the stage's step() does the same
        start = _status_kib()["VmRSS"]
        reset = _reset_peak()
        t0 = time.perf_counter()
        seal_distribution(contract, bundle.actor_dir, roll.to_tensors(), Path(out))
        wall = time.perf_counter() - t0
        status = _status_kib()
    peak = "its own" if reset else "the process's so far (clear_refs refused)"
    print(f"plan_distribution_step: RSS at start {start} KiB, peak (VmHWM, {peak}) "
          f"{status['VmHWM']} KiB, wall {wall:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
