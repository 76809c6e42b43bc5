"""DeepSpeed harness: the Actor and the Critic trained by ``deepspeed.initialize`` engines.

Run as ``python -m harnesses.deepspeed.harness CELL_JSON`` under torchrun (see README.md).
"""
