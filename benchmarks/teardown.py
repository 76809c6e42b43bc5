"""A harness rank's interpreter teardown after its outputs are durable: exit vs ``os._exit``.

``python -m benchmarks.teardown [--reps N]`` starts a child that imports what the heaviest
trainer harness imports (torch, transformers, deepspeed), runs one forward and backward of
the default contract's tiny Qwen3, prints a timestamp and exits either normally
(``sys.exit``: module finalizers, garbage collection of every engine object) or at once
(``os._exit``, :func:`harnesses.common.exit_now`). The figure is the time from that
timestamp to the parent seeing the child gone, interleaved ``--reps`` times so both modes
see the same machine load; the table reports median and range per mode and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import textwrap
import time

import pandas as pd

CHILD = textwrap.dedent("""
    import os, sys, time
    import torch, transformers, deepspeed  # noqa: F401
    from transformers import Qwen3Config, Qwen3ForCausalLM
    m = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32))
    m(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    print(time.time(), flush=True)
    if sys.argv[1] == "exit_now":
        sys.stdout.flush()
        os._exit(0)
    sys.exit(0)
""")


def teardown_s(mode: str) -> float:
    """Seconds from the child's last output to its exit, for ``mode`` ``sys_exit``/``exit_now``."""
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                          check=True)
    end = time.time()
    return end - float(proc.stdout.strip().splitlines()[-1])


def table(reps: int = 3) -> pd.DataFrame:
    """``mode``, ``median_s``, ``min_s``, ``max_s`` of ``reps`` children per mode."""
    samples: dict[str, list[float]] = {"sys_exit": [], "exit_now": []}
    for _ in range(reps):
        for mode, values in samples.items():
            values.append(teardown_s(mode))
    return pd.DataFrame([{"mode": m, "median_s": statistics.median(v), "min_s": min(v),
                          "max_s": max(v)} for m, v in samples.items()])


def main(argv: list[str] | None = None) -> int:
    """Print the teardown table; returns 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    t = table(args.reps)
    print(t.to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    med = dict(zip(t["mode"], t["median_s"], strict=True))
    print(f"teardown sys_exit / exit_now: {med['sys_exit'] / med['exit_now']:.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
