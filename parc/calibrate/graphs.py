"""The ONNX models the benchmarks run (one op, copies of it, or a chain of tiny Adds), and what
the cost model counts of each: bytes moved, FLOPs, short pieces walked."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from parc.calibrate.catalogue import MASKED, PADDED, SPLIT
from parc.ir.dtypes import DType
from parc.ir.graph import Node, Value
from parc.ir.importer import from_model
from parc.ops.base import node_pieces, node_work


def _model(nodes, inputs: dict[str, tuple], output: str, inits=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s))
                                           for n, s in inputs.items()],
                          [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)], list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def chain(length: int) -> onnx.ModelProto:
    """`length` tiny Adds in a chain: the launch floor is the slope of its time over length."""
    nodes, prev = [], "x"
    for i in range(length):
        nodes.append(helper.make_node("Add", [prev, "x"], [f"y{i}"]))
        prev = f"y{i}"
    return _model(nodes, {"x": (1,)}, prev)


def memory_op(op: str, rows: int, cols: int = 256) -> tuple[onnx.ModelProto, int]:
    """(model, bytes read and written) of one memory-bound op (`MEMORY_OPS`, `PIECE_OPS`) on
    [rows, cols]."""
    x = {"x": (rows, cols)}
    n = rows * cols * 4
    if op == "Add":
        return _model([helper.make_node("Add", ["x", "z"], ["y"])], {**x, "z": (rows, cols)}, "y"), 3 * n
    if op == "MulBroadcast":
        w = numpy_helper.from_array(np.ones(cols, np.float32), "w")
        return _model([helper.make_node("Mul", ["x", "w"], ["y"])], x, "y", [w]), 2 * n
    if op == "Transpose":  # runs of cols / 4
        shape = (rows // 64, 64, 4, cols // 4)
        return _model([helper.make_node("Transpose", ["x"], ["y"], perm=[0, 2, 1, 3])], {"x": shape}, "y"), 2 * n
    if op == "TransposeLastAxis":  # rows of cols / 4 turned into columns
        shape = (rows // 64, 4, 64, cols // 4)
        return _model([helper.make_node("Transpose", ["x"], ["y"], perm=[0, 1, 3, 2])], {"x": shape}, "y"), 2 * n
    if op == "ReduceSumFirst":
        shape = (rows // 64, 64, cols)
        axes = numpy_helper.from_array(np.array([0, 1], np.int64), "axes")
        return _model([helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)], {"x": shape}, "y",
                      [axes]), n
    if op == "Div":
        return _model([helper.make_node("Div", ["x", "z"], ["y"])], {**x, "z": (rows, cols)}, "y"), 3 * n
    if op in ("Sqrt", "Tanh", "Erf"):
        return _model([helper.make_node(op, ["x"], ["y"])], x, "y"), 2 * n
    if op == "Pow":
        three = numpy_helper.from_array(np.array(3.0, np.float32), "three")
        return _model([helper.make_node("Pow", ["x", "three"], ["y"])], x, "y", [three]), 2 * n
    if op == "SubRows":  # a row's statistic taken from it: x - mean(x) over [rows, cols]
        return _model([helper.make_node("Sub", ["x", "m"], ["y"])], {**x, "m": (rows, 1)}, "y"), 2 * n + rows * 4
    if op == "ReduceMeanLast":
        return _model([helper.make_node("ReduceMean", ["x"], ["y"], axes=[-1])], x, "y"), n
    if op == "Softmax":
        return _model([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], x, "y"), 2 * n
    if op in ("SoftmaxMasked", "SoftmaxPadded"):  # over [cols, cols] scores with a causal mask's fill
        scores = MASKED if op == "SoftmaxMasked" else PADDED  # (half filled) or a padding mask's (`make_feeds`)
        return _model([helper.make_node("Softmax", [scores], ["y"], axis=-1)],
                      {scores: (rows // cols, cols, cols)}, "y"), 2 * n
    if op == "LayerNorm":
        w = numpy_helper.from_array(np.ones(cols, np.float32), "w")
        b = numpy_helper.from_array(np.zeros(cols, np.float32), "b")
        return _model([helper.make_node("LayerNormalization", ["x", "w", "b"], ["y"], axis=-1)], x, "y",
                      [w, b]), 2 * n
    if op == "Where":  # a ReLU's gradient: reads the mask (one byte an element) and the gradient
        mask = numpy_helper.from_array(np.random.default_rng(0).random((rows, cols), dtype=np.float32) > 0.5, "mask")
        zero = numpy_helper.from_array(np.zeros((), np.float32), "zero")
        return _model([helper.make_node("Where", ["mask", "x", "zero"], ["y"])], x, "y", [mask, zero]), 2 * n + n // 4
    if op == "Concat":  # two halves joined on the last axis (a fused QKV's gradient: runs of a head's width)
        half = (rows, cols // 2)
        return _model([helper.make_node("Concat", ["x", "z"], ["y"], axis=-1)], {"x": half, "z": half}, "y"), 2 * n
    if op == "Split":  # and parted again (a fused QKV projection's output)
        return _model([helper.make_node("Split", ["x"], ["y", "w"], axis=-1)], x, "y"), 2 * n
    if op == "ScatterAdd":  # an embedding's gradient: rows added into a table at int64 indices
        table = 512
        idx = numpy_helper.from_array(np.random.default_rng(0).integers(0, table, (rows, 1)), "idx")
        return _model([helper.make_node("ScatterND", ["table", "idx", "x"], ["y"], reduction="add")],
                      {"table": (table, cols), **x}, "y", [idx]), n + rows * 8 + 2 * table * cols * 4
    if op == "WhereMasked":  # attention's causal mask: one [64, cols] mask broadcast over the scores
        shape = (rows // 64, 64, cols)
        mask = numpy_helper.from_array(np.tri(64, cols, dtype=bool), "mask")
        fill = numpy_helper.from_array(np.array(-1e9, np.float32), "fill")
        return _model([helper.make_node("Where", ["mask", "x", "fill"], ["y"])], {"x": shape}, "y", [mask, fill]), \
            2 * n + 64 * cols
    raise ValueError(op)


def copies(model: onnx.ModelProto, k: int) -> onnx.ModelProto:
    """`model` (one node) with its node `k` times, each copy reading the same inputs and writing
    its own outputs, all of them graph outputs."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    node = graph.node[0]
    del graph.node[:]
    del graph.output[:]
    for i in range(k):
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.output[:] = [f"{o}.{i}" for o in node.output]
        graph.node.append(copy)
        graph.output.extend(helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in copy.output)
    return out


def pieces(model: onnx.ModelProto) -> float:
    """`parc.ops.node_pieces` of a one-node benchmark model, as the importer reads it."""
    return node_pieces(from_model(model, source="benchmark").nodes[0])


def matmul(batch: tuple, m: int, k: int, n: int) -> onnx.ModelProto:
    """A product of [*batch, m, k] by [*batch, k, n]."""
    return _model([helper.make_node("MatMul", ["a", "b"], ["y"])], {"a": (*batch, m, k), "b": (*batch, k, n)}, "y")


def case(cls: str, x: tuple, w: tuple, attrs: dict) -> tuple[onnx.ModelProto, float]:
    """(model, FLOPs) of one product or convolution of class `cls` (`op_class`: ConvWeightGrad is a
    Conv, BatchMatMul a MatMul) on operands of shapes `x` and `w`, the FLOPs as the cost model counts
    them (`parc.ops.base.node_work` on the inferred output shape)."""
    kind = {"ConvWeightGrad": "Conv", "BatchMatMul": "MatMul"}.get(cls, cls)
    onnx_attrs = {a: v for a, v in attrs.items() if a != SPLIT}
    proto = helper.make_node(kind, ["x", "w"], ["y"], **onnx_attrs)
    model = _model([proto], {"x": x, "w": w}, "y")
    out = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph.output[0]
    y = tuple(d.dim_value for d in out.type.tensor_type.shape.dim)
    if not y or min(y) <= 0:
        raise ValueError(f"its output would be {list(y)}")
    if kind in ("Conv", "ConvTranspose"):
        channels = w[0] if kind == "ConvTranspose" else attrs.get("group", 1) * w[1]
        if x[1] != channels:
            raise ValueError(f"its input has {x[1]} channels, the weight expects {channels}")
    f32 = DType.from_numpy(np.float32)
    node = Node(kind, [Value("x", f32, tuple(x)), Value("w", f32, tuple(w))], [Value("y", f32, y)],
                {a.name: a for a in proto.attribute})
    return model, node_work(node)[0]
