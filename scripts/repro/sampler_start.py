"""Start a vLLM sampler cell's engine on a reference directory's rollout (repro scripts).

:func:`start_sampler` is what ``sampler_distribution_rows.py`` and
``vllm_fp32_token_logprobs.py`` share: a reference directory (sealed or interrupted) names
the prepared bundle's directories relative to the bundle in ``model.json``, so a temporary
inputs directory gets the contract, the rollout and a ``model.json`` with the absolute Actor
directory of :func:`qualify.models.bundle.prepare_models`; then the sampler harness's own
``_read_inputs`` and ``_start`` (FP32, the initial weights, the forced-trace round-1 decode
passes) run on it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harnesses.vllm import harness
from qualify.contract import Contract
from qualify.layout import CONTRACT_FILE, MODEL_FILE
from qualify.models import bundle
from qualify.protocol import HarnessCell


def start_sampler(src: Path, *, tp: int = 1, faults: Sequence[str] = (),
                  output_dir: Path | None = None) -> tuple[Any, Any]:
    """``(the cell's inputs, the started engine)`` for the rollout of ``src``.

    Args:
        src: a reference directory holding ``contract.json``, ``model.json`` and
            ``rollout.safetensors``.
        tp: the engine's TP size.
        faults: the cell's planted faults (test-only names of :mod:`harnesses.vllm.decode`).
        output_dir: the cell's output directory (default: the temporary inputs directory).
    """
    work = Path(tempfile.mkdtemp(prefix="sampler-start-"))
    contract = Contract.from_dict(json.loads((src / CONTRACT_FILE).read_text("utf-8")))
    model = json.loads((src / MODEL_FILE).read_text("utf-8"))
    model["actor_dir"] = str(bundle.prepare_models(contract).actor_dir)
    (work / MODEL_FILE).write_text(json.dumps(model), "utf-8")
    for name in (CONTRACT_FILE, "rollout.safetensors"):
        shutil.copy(src / name, work / name)
    ins = harness._read_inputs(work)
    cell = HarnessCell(engine="vllm", precision="fp32", options={"rollout_tp": tp},
                       actor_tp=0, critic_tp=0, rounds=2, seed=ins.contract.sampling.seed,
                       inputs_dir=str(work), output_dir=str(output_dir or work),
                       faults=tuple(faults))
    return ins, harness._start(cell, tp, ins)
