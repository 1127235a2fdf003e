"""Element types of IR values, mapped to ONNX enums and NumPy dtypes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

# ONNX's element type enums (protobuf builds this list anew on every call, and it is asked at
# every value)
_KNOWN = frozenset(onnx.TensorProto.DataType.values())


@dataclass(frozen=True)
class DType:
    """An element type: its ONNX enum is the identity, the rest is derived."""

    onnx_type: int

    def __post_init__(self) -> None:
        if self.onnx_type not in _KNOWN:
            raise ValueError(f"unknown ONNX element type {self.onnx_type}")

    @property
    def name(self) -> str:
        return onnx.TensorProto.DataType.Name(self.onnx_type).lower()

    @property
    def numpy(self) -> np.dtype:
        return np.dtype(helper.tensor_dtype_to_np_dtype(self.onnx_type))

    @property
    def itemsize(self) -> int:
        if self.onnx_type in _SUBBYTE:
            return 1
        return self.numpy.itemsize

    @property
    def is_float(self) -> bool:
        return self.onnx_type in _FLOATS

    @property
    def is_integer(self) -> bool:
        return self.onnx_type in _INTEGERS

    @staticmethod
    def from_numpy(dtype: np.dtype | type) -> DType:
        return DType(helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))

    def __str__(self) -> str:
        return self.name


_T = onnx.TensorProto
_FLOATS = {_T.FLOAT, _T.DOUBLE, _T.FLOAT16, _T.BFLOAT16, _T.FLOAT8E4M3FN, _T.FLOAT8E4M3FNUZ,
           _T.FLOAT8E5M2, _T.FLOAT8E5M2FNUZ}
_INTEGERS = {_T.INT8, _T.INT16, _T.INT32, _T.INT64, _T.UINT8, _T.UINT16, _T.UINT32, _T.UINT64}
_SUBBYTE = {getattr(_T, n) for n in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2") if hasattr(_T, n)}

FLOAT = DType(_T.FLOAT)
DOUBLE = DType(_T.DOUBLE)
FLOAT16 = DType(_T.FLOAT16)
BFLOAT16 = DType(_T.BFLOAT16)
INT64 = DType(_T.INT64)
INT32 = DType(_T.INT32)
BOOL = DType(_T.BOOL)


def onnx_nbytes(shape, onnx_type: int) -> int:
    """Bytes of a tensor of `shape` and ONNX element type `onnx_type`."""
    return int(np.prod(shape, dtype=np.int64)) * DType(int(onnx_type)).itemsize
