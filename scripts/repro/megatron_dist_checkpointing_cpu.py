"""Why the Megatron harness does not resume through ``megatron.core.dist_checkpointing``.

Measured with megatron-core 0.16.1, torch on CPU, gloo, one rank, a tiny Qwen3 ``GPTModel``
built as the harness builds it (explicit ``pg_collection``, the global ``parallel_state``
never initialised; ``harnesses.megatron.model``):

1. ``model.sharded_state_dict()`` stops in ``transformer/utils.py:202``
   ``ensure_metadata_has_dp_cp_group`` -> ``parallel_state.get_data_parallel_group``:
   ``AssertionError: data parallel group with context parallel combined is not initialized``.
   With ``metadata={"dp_cp_group": pg_collection.dp_cp}`` it builds.
2. ``dist_checkpointing.save`` then stops in
   ``dist_checkpointing/strategies/filesystem_async.py:230``
   (``FileSystemWriterAsync.preload_tensors``, ``non_blocking=True`` from line 207):
   ``torch.cuda.synchronize()`` -> ``AssertionError: Torch not compiled with CUDA enabled``.
3. With ``torch.cuda.synchronize`` a no-op (this script only), ``save`` and ``load`` run, and
   the loaded tensors equal the saved ones (the parameters are zeroed in between).

The deciding reason is not the CPU: ``dist_checkpointing.save`` (``serialization.py:314``)
takes no process group; it validates the sharding over the whole world
(``validation.py:517-518``, ``all_gather_object``), barriers on it (``serialization.py:426``)
and rank 0 alone writes the common state, while a qualify launch holds two independent
models (Actor ranks, then Critic ranks) in one world. The harness uses megatron-core's
non-distributed path instead (``harnesses/megatron/resume.py``, README "Resume").

Measured on this CPU (2026-12-02)::

    sharded_state_dict()                   AssertionError: data parallel group with context
                                           parallel combined is not in at
                                           megatron/core/parallel_state.py:1424
    sharded_state_dict(metadata=dp_cp)     27 keys
    dist_checkpointing.save                AssertionError: Torch not compiled with CUDA enabled
                                           at megatron/core/dist_checkpointing/strategies/
                                           filesystem_async.py:230
    save + load, synchronize a no-op       OK, 19/19 equal

(19: the model's tensors, zeroed between save and load; 27 sharded keys include extra
state.) 1 m 31 s wall on 2 loaded cores.

Usage (one process, gloo, CPU; about 30 s)::

    PYTHONPATH=. torchrun --nproc-per-node 1 scripts/repro/megatron_dist_checkpointing_cpu.py
"""

from __future__ import annotations

import tempfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import Qwen3Config

from harnesses.megatron import convert
from harnesses.megatron import model as mm

TINY: dict[str, Any] = {
    "vocab_size": 384, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 128, "tie_word_embeddings": False}
"""tests/harness_outputs.py's tiny Qwen3 (random weights: only the layout matters here)."""


def last_error(exc: BaseException) -> str:
    """``Type: message`` and the innermost megatron line of ``exc``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "megatron/core" in f.filename]
    where = ""
    if frames:
        f = frames[-1]
        where = f" at {f.filename[f.filename.rfind('megatron/core'):]}:{f.lineno}"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}{where}"


def main() -> None:
    """Print the table of the module docstring."""
    from megatron.core import dist_checkpointing

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    groups = mm.role_groups(1, 0, 0, 120.0)
    mm.apply_group_shims()
    mm.apply_cpu_shims()
    cfg = Qwen3Config(**TINY)
    torch.manual_seed(0)
    model: Any = mm.build_gpt(cfg, convert.Shape.from_hf_config(cfg), groups, bf16=False, cpu=True)
    meta = {"dp_cp_group": groups.pg_collection.dp_cp}
    rows: list[tuple[str, str]] = []
    try:
        model.sharded_state_dict()
        rows.append(("sharded_state_dict()", "OK"))
    except AssertionError as exc:
        rows.append(("sharded_state_dict()", last_error(exc)))
    sd = model.sharded_state_dict(metadata=meta)
    rows.append(("sharded_state_dict(metadata=dp_cp)", f"{len(sd)} keys"))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            (Path(tmp) / "a").mkdir()
            dist_checkpointing.save(sd, str(Path(tmp) / "a"))
            rows.append(("dist_checkpointing.save", "OK"))
        except AssertionError as exc:
            rows.append(("dist_checkpointing.save", last_error(exc)))
        sync = torch.cuda.synchronize
        torch.cuda.synchronize = lambda *a, **k: None
        try:
            (Path(tmp) / "b").mkdir()
            dist_checkpointing.save(model.sharded_state_dict(metadata=meta), str(Path(tmp) / "b"))
            want = {k: v.detach().clone() for k, v in model.state_dict().items()
                    if isinstance(v, torch.Tensor)}
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            got = dist_checkpointing.load(model.sharded_state_dict(metadata=meta),
                                          str(Path(tmp) / "b"))
            model.load_state_dict(got, strict=False)
            same = sum(torch.equal(model.state_dict()[k], v) for k, v in want.items())
            rows.append(("save + load, synchronize a no-op", f"OK, {same}/{len(want)} equal"))
        finally:
            torch.cuda.synchronize = sync
    for step, result in rows:
        print(f"{step:<38} {result}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
