"""The TRL stack adapter (``harnesses/trl/README.md``): TRL's own GRPO update."""
