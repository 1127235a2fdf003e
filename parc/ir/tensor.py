"""Constant tensor data that is read only when a pass needs the bytes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from parc.errors import OnnxImportError
from parc.ir.dtypes import DType


@dataclass(eq=False)
class TensorData:
    """The value of a constant: in memory, in an ONNX TensorProto, or in an external file.

    Exactly one source is set. `numpy()` materialises (memory-mapping external data), so
    passes that only need shapes never touch the bytes of large weights.
    """

    dtype: DType
    shape: tuple[int, ...]
    array: np.ndarray | None = None
    proto: onnx.TensorProto | None = None
    path: Path | None = None
    offset: int = 0
    length: int | None = None
    zeros: bool = False
    _cache: np.ndarray | None = field(default=None, repr=False)

    @staticmethod
    def from_array(array: np.ndarray) -> TensorData:
        array = np.asarray(array)
        return TensorData(DType.from_numpy(array.dtype), tuple(array.shape), array=array)

    @staticmethod
    def zeros_of(dtype: DType, shape: tuple[int, ...]) -> TensorData:
        """A tensor of zeros that takes no memory until read (optimizer state of big models)."""
        return TensorData(dtype, tuple(shape), zeros=True)

    @staticmethod
    def from_proto(proto: onnx.TensorProto, base_dir: Path | None) -> TensorData:
        """Wrap an initializer; external data is referenced, not read."""
        dtype, shape = DType(proto.data_type), tuple(int(d) for d in proto.dims)
        if proto.data_location != onnx.TensorProto.EXTERNAL:
            return TensorData(dtype, shape, proto=proto)
        info = {e.key: e.value for e in proto.external_data}
        location = info.get("location", "")
        root = (base_dir or Path(".")).resolve()
        path = (root / location).resolve()
        if os.path.isabs(location) or root not in path.parents:
            raise OnnxImportError(
                f"initializer '{proto.name}': external data location '{location}' leaves the "
                f"model's directory {root}"
            )
        return TensorData(dtype, shape, path=path, offset=int(info.get("offset", 0)),
                          length=int(info["length"]) if "length" in info else None)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def is_external(self) -> bool:
        return self.path is not None

    def numpy(self) -> np.ndarray:
        """The values as a NumPy array (a read-only memory map for external data)."""
        if self.array is not None:
            return self.array
        if self._cache is None:
            self._cache = self._load()
        return self._cache

    def _load(self) -> np.ndarray:
        if self.zeros:
            return np.zeros(self.shape, self.dtype.numpy)
        if self.proto is not None:
            return numpy_helper.to_array(self.proto)
        assert self.path is not None
        if not self.path.is_file():
            raise OnnxImportError(f"external data file {self.path} is missing")
        need = self.nbytes
        if self.length is not None and self.length < need:
            raise OnnxImportError(f"external data in {self.path}: {self.length} bytes, need {need}")
        if self.path.stat().st_size < self.offset + need:
            raise OnnxImportError(f"external data file {self.path} is truncated")
        if need == 0:
            return np.zeros(self.shape, self.dtype.numpy)
        return np.memmap(self.path, dtype=self.dtype.numpy, mode="r", offset=self.offset,
                         shape=self.shape)
