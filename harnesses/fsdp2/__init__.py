"""The FSDP2 trainer harness (``torch.distributed.fsdp.fully_shard``) over a data-parallel axis.

``spec`` is light (imports neither torch nor the harness); ``harness`` is run under torchrun.
"""
