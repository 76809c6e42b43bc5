"""vLLM's CPU worker for one rank of an ``external_launcher`` engine (imports vllm).

:mod:`harnesses.vllm.engine` names :class:`RankCPUWorker`
(:data:`harnesses.vllm.engine.RANK_WORKER`) as the engine's ``worker_cls`` (vLLM's
own option, ``ParallelConfig.worker_cls``) under ``external_launcher`` on CPU; vLLM imports
this module when it builds the worker, nothing else does.

Why: vLLM's ``external_launcher`` executor gives its worker the init method ``env://``
(``ExecutorWithExternalLauncher._distributed_args``, ``vllm/v1/executor/uniproc_executor.py``),
and the CPU worker names its shared-memory all-reduce segments after the init method
(``VLLM_DIST_IDENT``: ``CPUWorker.init_device``, ``vllm/v1/worker/cpu_worker.py``;
``_CPUSHMDistributed.make_group_name``,
``vllm/distributed/device_communicators/cpu_communicator.py``), so every such engine on a
machine would open the same ``/dev/shm`` segments, and a second one fails (``create shm in
SHMManager failed. errno: 17``) while the first runs or after it left them behind.
:class:`RankCPUWorker` is vLLM's ``CPUWorker`` whose init method is
``tcp://MASTER_ADDR:MASTER_PORT`` instead, as vLLM's ``mp`` executor gives its workers a
per-engine init method: the segments are named after the engine's own port, the
``torch.distributed`` group is the same (rank and world size given explicitly, the
rendezvous at ``MASTER_ADDR:MASTER_PORT``), and everything else is vLLM's worker.
"""

from __future__ import annotations

import os

from vllm.v1.worker.cpu_worker import CPUWorker


class RankCPUWorker(CPUWorker):
    """vLLM's CPU worker, initialised at ``tcp://MASTER_ADDR:MASTER_PORT`` (module docstring)."""

    def init_device(self) -> None:
        """Set the init method from ``MASTER_ADDR`` / ``MASTER_PORT``, then vLLM's own."""
        self.distributed_init_method = (f"tcp://{os.environ['MASTER_ADDR']}:"
                                        f"{os.environ['MASTER_PORT']}")
        super().init_device()
