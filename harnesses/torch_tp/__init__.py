"""PyTorch-native tensor parallelism (DTensor + ``parallelize_module``) as an RL training engine.

The program is :mod:`harnesses.torch_tp.harness`; see ``README.md`` in this folder for the
sharding plan, the vocab-parallel log-softmax and the BF16 mechanism.

Its engine spec (axes, options, distributions) is :data:`harnesses.torch_tp.spec.SPEC`.
"""
