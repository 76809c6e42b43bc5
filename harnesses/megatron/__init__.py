"""Megatron-Core engine harness (conversion, model, scoring, CUDA training).

Its engine spec (axes, options, distributions) is :data:`harnesses.megatron.spec.SPEC`.
"""
