"""A safetensors file read tensor by tensor: small tensors at once, large ones in chunks.

:func:`open_tensors` is the comparator's reader (``qualify compare`` and ``qualify verify``
step 9). It checks the whole file at open with safetensors' own parser (the same errors as
:func:`qualify.evidence.tensors.load_tensors`) and reads every tensor of at most
:data:`LAZY_BYTES` into memory through ``safetensors.safe_open`` (the same arrays as
``load_tensors``). A larger tensor stays on disk as a :class:`LazyTensor`: its bytes are
read with ``pread`` (no memory map, so nothing of it stays resident after a read) either
all at once (``np.asarray``) or as flat chunks (:meth:`LazyTensor.read_flat`), which is
how :func:`qualify.statistics.max_rel_l2` and the power check
(:mod:`qualify.compare.power`) stream it, one chunk of each side at a time. Peak memory
is then the small tensors plus a few chunks, whatever the size of the largest tensor.

The data offsets come from the header (8-byte little-endian length, then JSON; the
safetensors format), read here as :func:`qualify.evidence.tensor_index.tensor_digests`
reads it.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import safetensors

from qualify.errors import EvidenceIntegrityError

__all__ = ["LAZY_BYTES", "LazyTensor", "TensorFile", "in_memory", "open_tensors"]

LAZY_BYTES: Final = 2 << 20
"""A tensor of more bytes than this (2 MiB) is read from disk when used, in chunks."""
_MAX_HEADER: Final = 100 * 1024 * 1024
_NUMPY_DTYPES: Final[Mapping[str, str]] = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
    "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}


class LazyTensor:
    """One tensor of a safetensors file, read from disk each time it is used.

    Attributes:
        path: the file.
        name: the tensor's name.
        dtype: its numpy dtype (little endian, as stored).
        shape: its shape.
        size: its element count.
        nbytes: its data bytes.
    """

    __slots__ = ("_offset", "dtype", "name", "nbytes", "path", "shape", "size")

    def __init__(self, path: Path, name: str, dtype: np.dtype[Any], shape: tuple[int, ...],
                 offset: int) -> None:
        """A tensor of ``shape`` and ``dtype`` whose data start ``offset`` bytes in ``path``."""
        self.path, self.name, self.dtype, self.shape = path, name, dtype, shape
        self.size = int(np.prod(shape, dtype=np.int64))
        self.nbytes = self.size * dtype.itemsize
        self._offset = offset

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def read_flat(self, start: int, stop: int) -> npt.NDArray[Any]:
        """Elements ``[start, stop)`` of the row-major flattened tensor, as stored.

        Raises:
            EvidenceIntegrityError: the file is shorter than its header says.
        """
        start, stop = max(0, start), min(self.size, stop)
        n = max(0, stop - start)
        out = np.empty(n, dtype=self.dtype)
        want = n * self.dtype.itemsize
        view = memoryview(out.view(np.uint8).data)
        got = 0
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while got < want:
                k = os.preadv(fd, [view[got:]], self._offset + start * self.dtype.itemsize + got)
                if k <= 0:
                    raise EvidenceIntegrityError(f"{self.path}: tensor {self.name!r}: file "
                                                 "ends inside its data")
                got += k
        finally:
            os.close(fd)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> npt.NDArray[Any]:
        """The whole tensor in memory (``np.asarray(lazy)``)."""
        arr = self.read_flat(0, self.size).reshape(self.shape)
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __repr__(self) -> str:
        """``LazyTensor(path:name, dtype, shape)``."""
        return f"LazyTensor({self.path}:{self.name}, {self.dtype}, {self.shape})"


TensorFile = dict[str, "npt.NDArray[Any] | LazyTensor"]
"""What :func:`open_tensors` returns: name -> array, or a :class:`LazyTensor` if large."""


def _offsets(path: Path) -> tuple[dict[str, Any], int]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER:
            raise ValueError(f"header of {n} bytes")
        header: dict[str, Any] = json.loads(f.read(n))
    return header, 8 + n


def open_tensors(path: str | Path, *, lazy_bytes: int = LAZY_BYTES) -> TensorFile:
    """Open a safetensors file: arrays for small tensors, :class:`LazyTensor` for large.

    Args:
        path: the ``.safetensors`` file.
        lazy_bytes: tensors of more data bytes stay on disk.

    Returns:
        name -> array (dtype and shape as stored) or :class:`LazyTensor`.

    Raises:
        EvidenceIntegrityError: the file is missing, truncated or not safetensors, or
            holds a dtype numpy lacks (bfloat16), as :func:`~qualify.evidence.tensors
            .load_tensors` raises.
    """
    p = Path(path)
    out: TensorFile = {}
    try:
        with safetensors.safe_open(str(p), framework="np") as f:  # validates the header
            names = list(f.keys())
            header, base = _offsets(p) if names else ({}, 0)
            for name in names:
                e = header[name]
                if e["dtype"] not in _NUMPY_DTYPES:
                    f.get_tensor(name)  # raises safetensors' own error for the dtype
                start, end = (int(x) for x in e["data_offsets"])
                if end - start <= lazy_bytes:
                    out[name] = f.get_tensor(name)
                else:
                    out[name] = LazyTensor(p, name, np.dtype(_NUMPY_DTYPES[e["dtype"]]),
                                           tuple(int(d) for d in e["shape"]), base + start)
    except Exception as exc:  # safetensors raises its own error types and TypeError
        raise EvidenceIntegrityError(f"{p}: cannot read safetensors file: {exc}") from exc
    return out



def in_memory(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """``tensors`` with every :class:`LazyTensor` read into memory (for whole-array code)."""
    return {k: np.asarray(v) if isinstance(v, LazyTensor) else v for k, v in tensors.items()}
