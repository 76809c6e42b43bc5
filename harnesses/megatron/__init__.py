"""Megatron-Core engine harness (conversion, model, scoring, CUDA training)."""
