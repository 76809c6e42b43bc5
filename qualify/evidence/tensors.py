"""Tensors on disk: safetensors files, written atomically and read back as numpy or torch.

Every tensor qualify stores (rollout, scores, targets, controls, candidate outputs) goes
through :func:`save_tensors`, which refuses a path under a sealed directory
(:func:`qualify.evidence.sealed.refuse_if_sealed`) and writes through
:func:`qualify.atomic.write_with`: the bytes are those of ``safetensors``' own
serialisation, so a reader sees the old file or the new one, never a part. Reading a
numpy-only file never imports torch. Public through :mod:`qualify.evidence.store`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import safetensors
import safetensors.numpy

from qualify import atomic
from qualify.errors import EvidenceIntegrityError
from qualify.evidence.sealed import refuse_if_sealed

if TYPE_CHECKING:
    import torch

__all__ = ["load_tensors", "load_tensors_torch", "read_tensor_metadata", "save_tensors"]


def _is_torch_tensor(value: object) -> bool:
    torch_mod = sys.modules.get("torch")
    return torch_mod is not None and isinstance(value, torch_mod.Tensor)


def _check_tensor_args(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None) -> None:
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if not (_is_torch_tensor(value) or isinstance(value, np.ndarray)):
            raise TypeError(f"tensor {name!r}: expected torch.Tensor or numpy.ndarray, "
                            f"got {type(value).__name__}")
    if metadata is not None:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"safetensors metadata must be dict[str, str]; got {k!r}: {v!r}")


def _torch_ready(tensors: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Make detached, contiguous, CPU tensors that own their storage.

    safetensors refuses tensors that share memory, so views and duplicates are cloned.
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, value in tensors.items():
        t = torch.from_numpy(np.require(value, requirements="C")) if isinstance(value, np.ndarray) \
            else value.detach().to("cpu")
        storage = t.untyped_storage()
        exclusive = (
            t.is_contiguous()
            and t.storage_offset() == 0
            and storage.nbytes() == t.numel() * t.element_size()
            and storage.data_ptr() not in seen
        )
        if not exclusive:
            t = t.clone(memory_format=torch.contiguous_format)
        if t.numel() > 0:
            seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def save_tensors(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor | np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write tensors to a safetensors file atomically.

    Torch tensors (any dtype safetensors supports, bfloat16 included) are detached,
    moved to CPU and made contiguous; numpy arrays are made contiguous. If every value
    is a numpy array the numpy API is used and torch is not imported.

    Args:
        path: destination ``.safetensors`` file.
        tensors: name -> tensor (any shape, 0-d included).
        metadata: free ``str -> str`` header metadata.

    Raises:
        TypeError: a name, value or metadata entry has the wrong type.
        EvidenceIntegrityError: ``path`` lies under a sealed directory.
        OSError: the write failed (no temporary file is left, the old file is untouched).
    """
    p = Path(path)
    _check_tensor_args(tensors, metadata)
    meta = dict(metadata) if metadata is not None else None
    refuse_if_sealed(p)
    if all(isinstance(v, np.ndarray) for v in tensors.values()):
        arrays = {k: np.require(v, requirements="C") for k, v in tensors.items()}
        atomic.write_with(p, lambda f: f.write(safetensors.numpy.save(arrays, metadata=meta)))
    else:
        from safetensors.torch import save

        ready = _torch_ready(tensors)
        atomic.write_with(p, lambda f: f.write(save(ready, metadata=meta)))


def _wrap_load_error(path: Path, exc: Exception) -> EvidenceIntegrityError:
    return EvidenceIntegrityError(f"{path}: cannot read safetensors file: {exc}")


def load_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Read a safetensors file into numpy arrays.

    Args:
        path: the ``.safetensors`` file.

    Returns:
        name -> array, dtypes and shapes as stored.

    Raises:
        EvidenceIntegrityError: the file is missing, truncated or not safetensors, or
            holds a dtype numpy lacks (bfloat16: use :func:`load_tensors_torch`).
    """
    p = Path(path)
    try:
        result: dict[str, np.ndarray] = safetensors.numpy.load_file(str(p))
    except Exception as exc:  # safetensors raises its own error types and TypeError
        raise _wrap_load_error(p, exc) from exc
    return result


def load_tensors_torch(path: str | Path, *, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Read a safetensors file into torch tensors (bfloat16 supported).

    Args:
        path: the ``.safetensors`` file.
        device: torch device to load onto.

    Returns:
        name -> tensor, dtypes and shapes as stored.

    Raises:
        EvidenceIntegrityError: the file is missing, truncated or not safetensors.
    """
    from safetensors.torch import load_file

    p = Path(path)
    try:
        result: dict[str, torch.Tensor] = load_file(str(p), device=device)
    except Exception as exc:  # safetensors raises its own error types
        raise _wrap_load_error(p, exc) from exc
    return result


def read_tensor_metadata(path: str | Path) -> dict[str, str]:
    """Return the ``str -> str`` header metadata of a safetensors file (empty if none).

    Raises:
        EvidenceIntegrityError: the file is missing or not safetensors.
    """
    p = Path(path)
    try:
        with safetensors.safe_open(str(p), framework="np") as f:
            meta = f.metadata()
    except Exception as exc:  # safetensors raises its own error types
        raise _wrap_load_error(p, exc) from exc
    return dict(meta or {})
