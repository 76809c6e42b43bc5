"""Start a run's trainer zygotes at the start of ``qualify run``, before torch is imported.

With a sealed reference reused, ``qualify run`` spends its first seconds on one core:
importing torch and transformers (about 2 s here), staging the run's inputs (1.6 s). The
candidate stage's :func:`qualify.candidate.launch.prestart` used to start the first
launch's zygote only after that, and the first launch waited for its imports (4 s of the
torch_tp launch's wall). Started here, the zygotes import on the other core meanwhile; the
stage's prestart and launches find them by their key (:func:`qualify.candidate.zygote.launch_key`:
the same harness, preload modules, environment and sources), so nothing a launch computes
changes. A zygote started here imports the model classes of the contract's models-cache
bundle (:mod:`qualify.models.cache`) when it exists, else at its first launch. Where a key
still differs (an environment variable this process's imports changed otherwise), the
stage's prestart starts that zygote again, as without this module; the one started here
then idles until the run ends.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from qualify.candidate.launch import prestart
from qualify.contract import Contract, cells_matching
from qualify.errors import ContractError
from qualify.models.cache import default_cache_dir
from qualify.registry import get_engine

__all__ = ["AHEAD_ENV", "GPU_DEVICES", "prestart_run"]

AHEAD_ENV: Final = "QUALIFY_AHEAD"
"""``0`` turns :func:`prestart_run` off (the stage's own prestart still runs)."""

GPU_DEVICES: Final = ("nvidia[0-9]*", "kfd", "dxg")
"""Device nodes under ``/dev`` of a GPU torch may use (NVIDIA, ROCm, WSL2): where one exists
nothing is started here (without torch the CUDA probe cannot be made; the stage decides, and
on CUDA launches through torchrun, with no zygote)."""


def prestart_run(contract: Contract, cells: Sequence[str] | None, *,
                 dev: Path = Path("/dev")) -> threading.Thread | None:
    """Start the zygotes of ``contract``'s trainer launches, in the stage's launch order.

    The order: the launch exporting the sampler's weights first (``sampler.weights_from``),
    then the engines in contract order, as the stage launches them. Everything else is
    :func:`qualify.candidate.launch.prestart`'s (``QUALIFY_PRESTART=0``,
    ``QUALIFY_AHEAD=0`` here alone,
    ``QUALIFY_ZYGOTE=0``, multi-node, an engine not installed: nothing started).

    Args:
        contract: the contract about to run.
        cells: its ``--cells`` globs (``None``: every cell).
        dev: the device directory probed for GPUs (tests).

    Returns:
        The prestart thread, or ``None`` when nothing is started (a GPU's device node, a
        ``--cells`` glob matching nothing: the stage then reports it).
    """
    if os.environ.get(AHEAD_ENV, "1") == "0" or any(any(dev.glob(p)) for p in GPU_DEVICES):
        return None
    try:
        wanted = cells_matching(contract, cells)
    except ContractError:
        return None
    source = contract.sampler.weights_from if contract.sampler is not None else ""
    first = sorted(wanted, key=lambda c: c.cell_id != source)  # stable: contract order
    engines = [get_engine(name) for name in dict.fromkeys(c.engine for c in first)]
    bundle = default_cache_dir() / contract.digest12
    return prestart(engines, inputs=bundle if bundle.is_dir() else None, cuda=False)
