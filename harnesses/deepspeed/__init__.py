"""DeepSpeed harness: the Actor and the Critic trained by ``deepspeed.initialize`` engines.

Run as ``python -m harnesses.deepspeed.harness CELL_JSON`` under torchrun (see README.md).

Its engine spec (axes, options, distributions) is :data:`harnesses.deepspeed.spec.SPEC`.
"""
