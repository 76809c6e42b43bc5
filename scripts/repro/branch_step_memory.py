"""Where one clip-branch step's resident memory goes, token by token.

Usage: ``python scripts/repro/branch_step_memory.py CONTRACT DIR LANE ROLE OUT.json
[--factored] [--no-trim]``

Runs what ``scripts/repro/plan_branch_step.py`` runs (the lane's update rerun, one ``J_t``
backward per valid round-2 token, the Gram, through
:func:`qualify.reference.branches._rerun`) and after each token records: the process's
``VmRSS``; glibc's ``mallinfo2`` (``uordblks``: bytes malloc has handed out from its heaps,
``fordblks``: free bytes it keeps in them, ``hblkhd``: bytes in mmapped chunks); and the
bytes of every live torch tensor's storage (``gc``, each storage once). RSS growing while the
live storages stay flat and ``fordblks`` grows is memory the allocator keeps, not memory the
code holds. ``--factored`` forces the factored Gram (``gram.FULL_BUDGET_BYTES = 0``), the
path a model too large for the whole ``J_t`` takes; ``--no-trim`` disables the stage's
``malloc_trim`` (``qualify.memory.release_free_memory``) to show what it changes.
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from qualify.contract import load_contract
from qualify.models import bundle as models
from qualify.reference import branches, gram, rollout
from qualify.reference.branches import MAX_SEALED_TOKENS, _rerun
from qualify.reference.stage import _batch


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo() -> dict[str, int]:
    f = ctypes.CDLL(None).mallinfo2
    f.restype = _Mallinfo2
    m = f()
    return {"in_use": int(m.uordblks), "free_in_heap": int(m.fordblks), "mmapped": int(m.hblkhd)}


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _live_tensor_bytes() -> int:
    seen: set[int] = set()
    total = 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu" and not o.is_meta:
            try:
                st = o.untyped_storage()
            except RuntimeError:
                continue
            if st.data_ptr() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def main() -> int:
    """Run the passes, record, write ``OUT.json``."""
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    contract = load_contract(Path(args[0]))
    directory, lane, role, out = Path(args[1]), args[2], args[3], Path(args[4])
    if "--factored" in sys.argv:
        gram.FULL_BUDGET_BYTES = 0
    if "--no-trim" in sys.argv:
        branches.release_free_memory = lambda: False  # type: ignore[assignment]
    bundle = models.prepare_models(contract)
    roll = rollout.Rollout.load(directory)
    train = load_file(str(directory / "train_inputs.safetensors"))
    batch = _batch(roll, train, bundle.pad_token_id)
    run = load_file(str(directory / "reference" / f"hf-{lane}.safetensors"))
    toks = [(int(b), int(t)) for b, t in torch.nonzero(roll.response_mask)][:MAX_SEALED_TOKENS]
    series: list[dict[str, Any]] = []
    inner = branches.token_gradients

    def record(label: str) -> None:
        gc.collect()
        series.append({"at": label, "rss": _rss(), "live_tensors": _live_tensor_bytes(),
                       **_mallinfo()})

    def traced(*a: Any, **k: Any) -> Iterator[Any]:
        record("before tokens")
        for i, item in enumerate(inner(*a, **k)):
            yield item
            record(f"token {i + 1}")

    branches.token_gradients = traced  # type: ignore[assignment]
    rounds_doc: dict[str, Any] = {"round2": {"tokens": {}, "gram": {}, "tol_cur": 1e30}}
    tensors: dict[str, torch.Tensor] = {}
    record("start")
    _rerun(contract, bundle, batch, prec=lane, role=role, wanted={2: toks}, run=run,
           tensors=tensors, rounds_doc=rounds_doc, attn="sdpa")
    record("after gram")
    rd = rounds_doc["round2"]
    doc = {"tokens": len(toks), "gram": rd.get("gram_off_diagonal"),
           "sealed_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
           "trim": "--no-trim" not in sys.argv, "series": series}
    out.write_text(json.dumps(doc, indent=1))
    first, last = series[0], series[-1]
    print(f"{len(toks)} tokens, {doc['gram']}: rss {first['rss'] / 1e6:.1f} -> "
          f"{max(s['rss'] for s in series) / 1e6:.1f} MB peak sampled, live tensors "
          f"{first['live_tensors'] / 1e6:.1f} -> {max(s['live_tensors'] for s in series) / 1e6:.1f}"
          f" MB, free in heap {first['free_in_heap'] / 1e6:.1f} -> "
          f"{last['free_in_heap'] / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
