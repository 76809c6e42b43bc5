"""Print one planned step's device peak per phase, unstreamed and streamed (docs/scale.md).

Usage: ``python scripts/repro/plan_phases.py CONTRACT STEP DEVICES DEVICE_GB``

For ``STEP`` (an update or control step of ``qualify plan``, e.g. ``control fp64-fp32``,
whose phases are ``load``, ``backward``, ``sensitivity`` and ``step``) on ``DEVICES``
GPUs of ``DEVICE_GB`` each, with the AdamW state on the host: the fullest device's bytes in
each phase of the step (:func:`qualify.reference.plan.plan_reference`'s own reduction,
recorded as it computes them), with the gradients on the devices and streamed to the host.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from qualify.contract import load_contract
from qualify.reference import plan, plan_core


def main() -> int:
    """Print the two lines."""
    contract = load_contract(Path(sys.argv[1]))
    name, n, gb = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    machine = plan_core.Machine(devices=n, device_bytes=int(gb * 1e9), host_bytes=10**15, cores=2)
    peaks: list[int] = []
    marks: list[tuple[str, int]] = []
    device_peak, step = plan._device_peak, plan.Step

    def spy_peak(*a: Any, **k: Any) -> int:
        peaks.append(device_peak(*a, **k))
        return peaks[-1]

    def spy_step(*a: Any, **k: Any) -> plan_core.Step:
        marks.append((k["name"], len(peaks)))
        return step(*a, **k)

    # the names plan_reference looks up in qualify.reference.plan
    plan._device_peak, plan.Step = spy_peak, spy_step  # type: ignore[assignment,misc]
    for gradients in ("device", "host"):
        peaks.clear()
        marks.clear()
        steps = plan.plan_reference(contract, machine, optimizer_state="host",
                                    gradients=gradients)
        start = 0
        for (step_name, end), s in zip(marks, steps, strict=False):
            if step_name == name:
                phases = ["load", "backward", "sensitivity", "step"]
                print(f"{name} gradients={gradients}: device GB per phase "
                      + ", ".join(f"{p} {v / 1e9:.2f}" for p, v in
                                  zip(phases, peaks[start:end], strict=False))
                      + f"; peak {s.device_peak / 1e9:.2f} at {s.device_phase}")
            start = end
    return 0


if __name__ == "__main__":
    sys.exit(main())
