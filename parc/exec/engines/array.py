"""parc's own ONNX interpreter, the "cupy" engine: one array kernel per node over NumPy or CuPy.

Everything that does not depend on the data is done once, when the engine is built: each
node's kernel is made (attributes parsed, opset variants chosen, unsupported semantics refused),
nodes whose inputs are all constants are evaluated (Constant, shape arithmetic on initializers),
and the values each node frees after running are listed. `run` is then a loop of kernel calls.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from parc.errors import ParcError
from parc.exec.engines import conv, elementwise, fusion, gpu, indexing, linalg, movement, norm, reduce
from parc.exec.engines.elementwise import DTYPES
from parc.exec.engines.kernels import HOST_INPUTS, Maker, NodeInfo, Unsupported
from parc.ops.fusion import cast_kind

KERNELS: dict[str, Maker] = {op: make
                             for module in (elementwise, movement, indexing, reduce, norm, linalg, conv)
                             for op, make in module.KERNELS.items()}

# Constant nodes whose outputs hold at most this many elements are evaluated when the engine is
# built; larger ones (a zero-filled buffer of a computed shape) are left to run each step.
FOLD_LIMIT = 1 << 16
# Constants this small also keep a host copy, which kernels read for shapes, axes and pads.
HOST_LIMIT = 1 << 10


class EngineError(ParcError):
    """The model cannot run on this engine, or a node failed while running."""


def supported_ops() -> list[str]:
    """The default-domain op types the engine has kernels for."""
    return sorted(KERNELS)


def _array_module(device: str) -> ModuleType:
    if device == "cpu":
        return np
    if device != "gpu":
        raise EngineError(f"device {device!r}: expected 'cpu' or 'gpu'")
    try:
        return importlib.import_module("cupy")
    except ImportError as e:
        raise EngineError(f"device 'gpu' needs CuPy, which cannot be imported ({e}); "
                          "install the cuda12 or cuda13 extra") from None


def _attributes(node: onnx.NodeProto, label: str) -> dict[str, Any]:
    attrs = {}
    for a in node.attribute:
        if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
            raise EngineError(f"{label}: op {node.op_type} with a subgraph attribute ({a.name}) "
                              "is not supported by the cupy engine")
        value = helper.get_attribute_value(a)
        if isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [v.decode() for v in value]
        elif isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        attrs[a.name] = value
    return attrs


def _check_tensor_type(vi: onnx.ValueInfoProto, what: str) -> np.dtype | None:
    """The numpy dtype of a graph input or output (None when its type is not declared)."""
    kind = vi.type.WhichOneof("value")
    if kind is None:
        return None
    if kind != "tensor_type":
        raise EngineError(f"{what} {vi.name!r} is a {kind.replace('_type', '')}, not a tensor; "
                          "the cupy engine runs tensors only")
    elem = vi.type.tensor_type.elem_type
    if elem == onnx.TensorProto.UNDEFINED:
        return None
    if elem not in DTYPES:
        raise EngineError(f"{what} {vi.name!r} has type {helper.tensor_dtype_to_string(elem)}, "
                          "which the cupy engine does not compute with")
    return DTYPES[elem]


class ArrayEngine:
    """Runs an ONNX model node by node with array kernels, on the CPU (NumPy) or a GPU (CuPy)."""

    name = "cupy"

    def __init__(self, model: onnx.ModelProto, device: str = "cpu", fuse: bool | None = None) -> None:
        """`fuse`: run elementwise trees as one kernel each (`fusion`); by default on a GPU
        unless PARC_CUPY_KERNELS=0 (on NumPy the groups run node by node: tests only)."""
        self._xp = xp = _array_module(device)
        if xp is not np and gpu.tf32_requested():
            gpu.enable_tf32(xp)
        self._host = (lambda a: a) if xp is np else xp.asnumpy
        graph = model.graph
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
        if graph.sparse_initializer:
            raise EngineError(f"sparse initializer {graph.sparse_initializer[0].values.name!r}: "
                              "the cupy engine needs dense tensors")
        self._inputs = {vi.name: _check_tensor_type(vi, "input") for vi in graph.input}
        for vi in graph.output:
            _check_tensor_type(vi, "output")
        self._outputs = [vi.name for vi in graph.output]
        self._values: dict[str, Any] = {}  # initializers and folded constants, as xp arrays
        consts: dict[str, np.ndarray] = {}  # host copies of small values that no feed can change
        for t in graph.initializer:
            if t.data_type not in DTYPES:
                raise EngineError(f"initializer {t.name!r} has type "
                                  f"{helper.tensor_dtype_to_string(t.data_type)}, which the cupy "
                                  "engine does not compute with")
            array = numpy_helper.to_array(t)
            self._values[t.name] = xp.asarray(array)
            if t.name not in self._inputs and array.size <= HOST_LIMIT:
                consts[t.name] = array
        self._required = [k for k in self._inputs if k not in self._values]

        steps, ops, nodes, defined = [], [], [], {"", *self._inputs, *self._values}
        bf16 = {vi.name for vi in graph.input if vi.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16}
        bf16 |= {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.BFLOAT16}
        for i, node in enumerate(graph.node):
            label = f"node {node.name or f'#{i} ({node.output[0] if node.output else node.op_type})'!r}"
            kernel = self._make(node, label, opset, consts)
            if node.op_type in ("Cast", "CastLike"):
                if _cast_to(node, graph) == onnx.TensorProto.BFLOAT16:
                    bf16.update(node.output)
            elif any(k in bf16 for k in node.input):
                kernel = _in_bfloat16(kernel)
                bf16.update(node.output)
            undefined = [k for k in node.input if k not in defined]
            if undefined:
                raise EngineError(f"{label}: input {undefined[0]!r} is not a graph input, an "
                                  "initializer or the output of an earlier node")
            defined.update(node.output)
            if all(k in consts or k == "" for k in node.input) and self._fold(node, kernel, label, consts):
                continue
            steps.append((kernel, self._input_keys(node, consts),
                          tuple((j, k) for j, k in enumerate(node.output) if k), f"{label} ({node.op_type})"))
            ops.append(node.op_type)
            nodes.append(node)
        if fuse if fuse is not None else (xp is not np and gpu.kernels_enabled()):
            steps, ops, nodes = fusion.softmax_grads(steps, ops, nodes, consts, self._outputs, xp)
            kinds = [cast_kind(n.op_type, _cast_to(n, graph) if n.op_type == "Cast" else None,
                               [k in bf16 for k in n.input]) for n in nodes]
            steps = fusion.fuse(steps, ops, nodes, self._outputs, xp, opset, kinds)
        self._steps = self._with_frees(steps)
        # op type -> [calls, seconds]; filled by run() while not None (CUDA events on a GPU)
        self.profile: dict[str, list] | None = None

    @property
    def xp(self) -> ModuleType:
        return self._xp

    def _make(self, node: onnx.NodeProto, label: str, opset: int, consts: dict[str, np.ndarray]):
        if node.domain not in ("", "ai.onnx") or node.op_type not in KERNELS:
            op = f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
            raise EngineError(f"{label}: op {op} is not supported by the cupy engine "
                              f"(supported: {', '.join(supported_ops())})")
        info = NodeInfo(name=node.name, op=node.op_type, attrs=_attributes(node, label), opset=opset,
                        inputs=tuple(node.input), outputs=tuple(node.output), xp=self._xp,
                        consts=consts)
        try:
            return KERNELS[node.op_type](info)
        except Unsupported as e:
            raise EngineError(f"{label}: op {node.op_type} with {e} is not supported by the cupy "
                              "engine") from None

    def _input_keys(self, node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> tuple[str, ...]:
        """The env keys a step reads: host copies for the constant inputs in HOST_INPUTS."""
        keys = list(node.input)
        for i in HOST_INPUTS.get(node.op_type, ()):
            if i < len(keys) and keys[i] in consts:
                keys[i] = f"{keys[i]}\0host"
                self._values[keys[i]] = consts[node.input[i]]
        return tuple(keys)

    def _fold(self, node: onnx.NodeProto, kernel, label: str, consts: dict[str, np.ndarray]) -> bool:
        """Evaluate a node whose inputs are all constants now; False when its outputs are too big."""
        try:
            with _quiet(self._xp):
                results = kernel(*[self._values[k] if k else None for k in node.input])
        except Exception as e:
            raise EngineError(f"{label} ({node.op_type}) on constants: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}") from None
        named = [(k, self._xp.asarray(v)) for k, v in zip(node.output, results) if k]
        if node.op_type != "Constant" and sum(v.size for _, v in named) > FOLD_LIMIT:
            return False
        for k, v in named:
            self._values[k] = v
            if v.size <= HOST_LIMIT:
                consts[k] = self._host(v)
        return True

    def _with_frees(self, steps: list) -> list:
        """Each step with the values it is the last to use (or produces unused), to free after it."""
        keep = set(self._outputs)
        last: dict[str, int] = {}
        for i, (_, inputs, outputs, _) in enumerate(steps):
            for k in inputs:
                last[k] = i
            for _, k in outputs:
                last.setdefault(k, i)
        frees: list[list[str]] = [[] for _ in steps]
        for k, i in last.items():
            if k and k not in keep:
                frees[i].append(k)
        return [(kernel, inputs, outputs, tuple(f), label)
                for (kernel, inputs, outputs, label), f in zip(steps, frees)]

    def _feed(self, name: str, value: Any) -> Any:
        if name not in self._inputs:
            raise EngineError(f"feed {name!r} is not an input of the graph "
                              f"(inputs: {', '.join(self._inputs)})")
        array = self._xp.asarray(value)
        want = self._inputs[name]
        if want is not None and array.dtype != want:
            raise EngineError(f"input {name!r}: expected {want}, got {array.dtype}")
        return array

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """Run the graph once: graph input name -> array in, graph output name -> xp array out."""
        env = dict(self._values)
        env.update({k: self._feed(k, v) for k, v in feeds.items()})
        missing = [k for k in self._required if k not in env]
        if missing:
            raise EngineError(f"missing input {missing[0]!r} (the graph needs {', '.join(self._required)})")
        env[""] = None
        label = "graph"
        timer = _Timer(self._xp) if self.profile is not None else None
        try:
            with _quiet(self._xp):
                for kernel, inputs, outputs, frees, label in self._steps:  # noqa: B007 (read below)
                    if timer:
                        timer.start()
                    args = [env[k] for k in inputs]
                    results = kernel(*args)
                    if timer:
                        timer.stop(label.rpartition("(")[2].rstrip(")"), args)
                    for j, k in outputs:
                        env[k] = results[j]
                    for k in frees:
                        del env[k]
        except Exception as e:
            message = str(e).splitlines()[0] if str(e) else ""
            if gpu.device_out_of_memory(e):  # the launcher's own line: step, task, what to do
                raise gpu.DeviceOutOfMemory(f"{label}: {message}") from e
            raise EngineError(f"{label} failed: {type(e).__name__}: {message}") from e
        if timer:
            timer.add_to(self.profile)
        return {k: self._xp.asarray(env[k]) for k in self._outputs}


def _cast_to(node: onnx.NodeProto, graph: onnx.GraphProto) -> int | None:
    """The element type a Cast writes (CastLike's: its `like` input's, where the graph says)."""
    if node.op_type == "Cast":
        return next((a.i for a in node.attribute if a.name == "to"), None)
    like = node.input[1] if len(node.input) > 1 else ""
    for t in graph.initializer:
        if t.name == like:
            return t.data_type
    return next((vi.type.tensor_type.elem_type for vi in [*graph.input, *graph.value_info] if vi.name == like), None)


def _in_bfloat16(kernel):
    """A node reading bfloat16 values: NumPy (ml_dtypes) computes some of its operations on them
    in float32 (matmul, exp, ...); ONNX's result is bfloat16, so float32 results are rounded to it
    (a float32 accumulation, rounded once, as a GPU's bfloat16 product)."""
    def run(*xs):
        return tuple(r.astype(BFLOAT16) if r is not None and getattr(r, "dtype", None) == np.float32 else r
                     for r in kernel(*xs))
    return run


BFLOAT16 = DTYPES[onnx.TensorProto.BFLOAT16]


class _Timer:
    """Per-kernel times of one run: CUDA events on a GPU (read once, after the run), else the
    host clock."""

    def __init__(self, xp: ModuleType) -> None:
        self.gpu = xp is not np
        self.xp = xp
        self.marks: list[tuple[str, Any, Any]] = []

    def start(self) -> None:
        if self.gpu:
            self._t0 = self.xp.cuda.Event()
            self._t0.record()
        else:
            import time

            self._t0 = time.perf_counter()

    def stop(self, op: str, args: list) -> None:
        if self.gpu:
            end = self.xp.cuda.Event()
            end.record()
        else:
            import time

            end = time.perf_counter()
        shapes = ",".join("x".join(map(str, a.shape)) if hasattr(a, "shape") else "-" for a in args)
        self.marks.append((op, shapes, self._t0, end))

    def add_to(self, profile: dict[str, list]) -> None:
        """Calls and seconds per op type, and per op type and input shapes under "op [shapes]"."""
        if self.gpu and self.marks:
            self.marks[-1][3].synchronize()
        for op, shapes, t0, t1 in self.marks:
            dt = self.xp.cuda.get_elapsed_time(t0, t1) / 1e3 if self.gpu else t1 - t0
            for key in (op, f"{op} [{shapes}]"):
                entry = profile.setdefault(key, [0, 0.0])
                entry[0] += 1
                entry[1] += dt


def _quiet(xp: ModuleType):
    """ONNX semantics give inf and nan silently (log(0), 0/0); NumPy would warn."""
    return np.errstate(all="ignore") if xp is np else contextlib.nullcontext()
