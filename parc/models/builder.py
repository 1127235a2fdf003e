"""The graph builder the model generators share: names, parameters, constants, nodes, saving.

A `GraphBuilder` owns the node and initializer lists of one ONNX graph. Parameters come in two
kinds of storage, picked per build:

* ``random``: real seeded weights, stored inline (for the tiny variants that tests run);
* ``sparse``: no bytes at all. Each parameter is a TensorProto that points into one external
  data file (``OUT.onnx.data``) by offset and length; the file is created by ``truncate`` so it
  is a hole of the right size that reads as zeros. No array of the full size is ever allocated,
  so a 27 GB model builds in a second and uses no real disk.

Constants (shapes, axes, masks, bucket ids, scalars) are always inline and deduplicated by value.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

from parc.errors import UsageError
from parc.version import __version__

OPSET = 18
IR_VERSION = 10
DATA_ALIGN = 4096  # page-aligned offsets, so a runtime may mmap each tensor
RANDOM_LIMIT_BYTES = 1 << 30  # inline random weights beyond this would not fit a ModelProto well
WEIGHT_MODES = ("random", "sparse")
BUFFER_SUFFIXES = (".running_mean", ".running_var")  # BatchNorm statistics: not trained parameters

_FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
_INF_NAMES = {np.inf: "inf", -np.inf: "-inf"}


def data_path_for(out: Path) -> Path:
    """The external data file that belongs to model file `out` (its name plus ``.data``)."""
    return out.with_name(out.name + ".data")


def _const_suffix(values: np.ndarray) -> str:
    """A short, stable, readable name suffix for a small constant."""
    flat = values.reshape(-1).tolist()
    if values.size <= 8:
        text = "_".join(_INF_NAMES.get(v, repr(v)) if isinstance(v, float) else str(v) for v in flat)
        text = text.replace("-", "m").replace(".", "p").replace("True", "t").replace("False", "f")
        shape = "x".join(map(str, values.shape)) if values.ndim else "s"
        return f"{shape}.{text}"
    digest = zlib.crc32(values.tobytes()) & 0xFFFFFFFF
    return "x".join(map(str, values.shape)) + f".{digest:08x}"


class GraphBuilder:
    """Owns one graph under construction: hands out unique names and records nodes and tensors.

    weights: "random" (seeded inline values) or "sparse" (external zero-filled holes).
    data_location: file name of the external data, relative to the model (sparse mode only).
    """

    def __init__(self, name: str, *, weights: str = "random", seed: int = 0, data_location: str | None = None):
        if weights not in WEIGHT_MODES:
            raise UsageError(f"weights={weights!r} is not valid; choose one of {', '.join(WEIGHT_MODES)}")
        if weights == "sparse" and not data_location:
            raise ValueError("sparse weights need a data_location")
        self.name = name
        self.weights = weights
        self.seed = seed
        self.data_location = data_location
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._tensor_names: set[str] = set()
        self._node_names: set[str] = set()
        self._consts: dict[tuple[int, tuple[int, ...], bytes], str] = {}
        self.external_bytes = 0  # end of the last external tensor (sparse mode)
        self.inline_bytes = 0  # random weights to materialise
        self._pending: dict[str, tuple[tuple[int, ...], str, float]] = {}
        self.num_params = 0

    # ---- names -------------------------------------------------------------------------------
    def _claim_tensor(self, name: str) -> str:
        if name in self._tensor_names:
            raise ValueError(f"tensor name {name!r} used twice in graph {self.name!r}")
        self._tensor_names.add(name)
        return name

    # ---- graph inputs and outputs ------------------------------------------------------------
    def input(self, name: str, elem_type: int, shape: Sequence[int]) -> str:
        """Declare a graph input with a fully static shape; returns its name."""
        self.inputs.append(helper.make_tensor_value_info(self._claim_tensor(name), elem_type, list(shape)))
        return name

    def output(self, name: str, elem_type: int, shape: Sequence[int]) -> None:
        """Declare an already produced tensor as a graph output with its static shape."""
        if name not in self._tensor_names:
            raise ValueError(f"output {name!r} is not produced by graph {self.name!r}")
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))

    # ---- parameters --------------------------------------------------------------------------
    def param(self, name: str, shape: Sequence[int], init: str = "normal", *, std: float = 0.02,
              fan_in: int | None = None) -> str:
        """Create a float32 parameter (an initializer); returns its name.

        init: "normal" (N(0, std)), "he" (N(0, 2/fan_in), fan_in defaults to prod(shape[1:])),
        "ones" or "zeros". Sparse builds ignore `init`: their bytes are a hole that reads as zero.
        """
        shape = tuple(int(d) for d in shape)
        numel = math.prod(shape)
        nbytes = 4 * numel
        self._claim_tensor(name)
        if not name.endswith(BUFFER_SUFFIXES):
            self.num_params += numel
        if self.weights == "sparse":
            self.initializers.append(self._external_tensor(name, shape, nbytes))
            return name
        if init not in ("normal", "he", "ones", "zeros"):
            raise ValueError(f"unknown init {init!r}")
        if init == "he":
            std = math.sqrt(2.0 / (fan_in or math.prod(shape[1:]) or 1))
        # Recorded now, materialised in model() once the total is known to be affordable.
        self.inline_bytes += nbytes
        self._pending[name] = (shape, init, std)
        self.initializers.append(TensorProto(name=name))
        return name

    def _materialise(self, name: str) -> TensorProto:
        """Seeded values for a pending random parameter (seeded by its name, not its position)."""
        shape, init, std = self._pending[name]
        if init == "ones":
            arr = np.ones(shape, np.float32)
        elif init == "zeros":
            arr = np.zeros(shape, np.float32)
        else:
            rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
            arr = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        return numpy_helper.from_array(arr.astype(np.float32, copy=False), name)

    def _external_tensor(self, name: str, shape: tuple[int, ...], nbytes: int) -> TensorProto:
        """A TensorProto that points into the data file, built by hand so no data is allocated."""
        offset = -(-self.external_bytes // DATA_ALIGN) * DATA_ALIGN
        self.external_bytes = offset + nbytes
        t = TensorProto()
        t.name = name
        t.dims.extend(shape)
        t.data_type = TensorProto.FLOAT
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.data_location), ("offset", str(offset)), ("length", str(nbytes))):
            entry = t.external_data.add()
            entry.key = key
            entry.value = value
        return t

    # ---- constants ---------------------------------------------------------------------------
    def const(self, value: np.ndarray | float | int | bool | Sequence[float], dtype: npt.DTypeLike = None,
              name: str | None = None) -> str:
        """An inline constant initializer, deduplicated by dtype, shape and bytes; returns its name."""
        arr = np.asarray(value, dtype=dtype)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        key = (int(helper.np_dtype_to_tensor_dtype(arr.dtype)), arr.shape, arr.tobytes())
        if key in self._consts:
            return self._consts[key]
        tname = self._claim_tensor(name or f"const.{arr.dtype.name}.{_const_suffix(arr)}")
        self.initializers.append(numpy_helper.from_array(arr, tname))
        self._consts[key] = tname
        return tname

    def ints(self, values: Sequence[int]) -> str:
        """A 1-D int64 constant (shapes, axes, starts, split sizes)."""
        return self.const(np.asarray(list(values), dtype=np.int64))

    def scalar(self, value: float) -> str:
        """A rank-0 float32 constant."""
        return self.const(np.float32(value))

    # ---- nodes -------------------------------------------------------------------------------
    def op(self, op_type: str, inputs: Sequence[str], name: str, *, n_out: int = 1,
           outputs: Sequence[str] | None = None, **attrs: object) -> str | list[str]:
        """Add a node named `name`; its outputs are `name` (or `name.i`, or `outputs` if given).

        Returns the single output name, or the list of them when the node has several.
        """
        if name in self._node_names:
            raise ValueError(f"node name {name!r} used twice in graph {self.name!r}")
        self._node_names.add(name)
        if outputs is None:
            outputs = [name] if n_out == 1 else [f"{name}.{i}" for i in range(n_out)]
        for out in outputs:
            self._claim_tensor(out)
        self.nodes.append(helper.make_node(op_type, list(inputs), list(outputs), name=name, **attrs))
        return outputs[0] if len(outputs) == 1 else list(outputs)

    # ---- finishing ---------------------------------------------------------------------------
    def model(self, metadata: dict[str, str] | None = None, doc: str = "") -> onnx.ModelProto:
        """Assemble the ModelProto: opset 18, default domain only, fixed IR version."""
        if self.inline_bytes > RANDOM_LIMIT_BYTES:
            raise UsageError(
                f"model {self.name!r}: weights=random would materialise {self.inline_bytes / 2**30:.1f} GiB "
                f"inline (limit {RANDOM_LIMIT_BYTES >> 20} MiB); use --set weights=sparse"
            )
        inits = [self._materialise(t.name) if t.name in self._pending else t for t in self.initializers]
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, inits)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            ir_version=IR_VERSION,
            producer_name="parc.models",
            producer_version=__version__,
            doc_string=doc,
        )
        for key, value in sorted((metadata or {}).items()):
            entry = model.metadata_props.add()
            entry.key = key
            entry.value = value
        return model

    def save(self, model: onnx.ModelProto, out: Path) -> None:
        """Write `model` to `out`; in sparse mode first (re)create the data file as one hole."""
        if self.weights == "sparse":
            data = data_path_for(out)
            if data.exists() or data.is_symlink():
                data.unlink()  # onnx appends to an existing file; start from nothing
            with open(data, "wb") as f:
                f.truncate(self.external_bytes)
        onnx.save(model, os.fspath(out))


def count_params(model: onnx.ModelProto | str | Path) -> int:
    """Number of trained parameters: elements of float initializers of rank >= 1.

    Reads shapes only (external data is never loaded). Rank-0 scalars, integer and bool
    constants (shapes, masks, bucket ids) and BatchNorm running statistics are not counted.
    """
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(os.fspath(model), load_external_data=False)
    total = 0
    for t in model.graph.initializer:
        if t.data_type in _FLOAT_TYPES and len(t.dims) >= 1 and not t.name.endswith(BUFFER_SUFFIXES):
            total += math.prod(t.dims)
    return total
