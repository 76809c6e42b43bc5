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
:class:`RankCPUWorker` is vLLM's ``CPUWorker`` whose init method is the one the caller gives
every rank of the engine in
:data:`harnesses.vllm.engine.INIT_METHOD_ENV`: the sampler harness makes it with
vLLM's own ``get_file_store_init_method()`` (``file://<tmp>/vllm_dist_<uuid4>``,
``vllm/utils/network_utils.py``), the init method vLLM's ``mp`` executor gives its CPU
workers (``MultiprocExecutor._init_executor``), so the segments are named after a fresh
uuid, as under ``mp``, and no port is chosen, released and bound again. The
``torch.distributed`` group is the same (rank and world size given explicitly, a file
store rendezvous), and everything else is vLLM's worker.
"""

from __future__ import annotations

import os

from vllm.v1.worker.cpu_worker import CPUWorker

from harnesses.vllm.engine import INIT_METHOD_ENV


class RankCPUWorker(CPUWorker):
    """vLLM's CPU worker, initialised at ``$QUALIFY_VLLM_INIT_METHOD`` (module docstring)."""

    def init_device(self) -> None:
        """Set the init method from the environment, then vLLM's own ``init_device``.

        Raises:
            KeyError: the variable is not set (a rank not started by the sampler harness).
        """
        self.distributed_init_method = os.environ[INIT_METHOD_ENV]
        super().init_device()
