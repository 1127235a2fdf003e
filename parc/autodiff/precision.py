"""Mixed precision for a training step: matrix products in bfloat16 or float16, everything else
in float32 (`parc grad --precision`).

As PyTorch's autocast does for its "lower precision" list, each matrix product (MatMul, Gemm,
Conv, ConvTranspose, Einsum) reads its float32 inputs cast to the low type and computes in it;
its result is cast back to float32, so every other node (softmax, normalisation, the loss, the
optimizer) computes as before. Parameters stay float32: they are the master weights the
optimizer updates, and each is cast once, where first read, for the products that read it. The
step is a standard ONNX graph of Cast nodes and low-precision products: autodiff differentiates
it as any other (the gradient of a Cast is the Cast back), so a weight's gradient reaches the
optimizer in float32.

float16's range is narrow: gradients under 6e-8 vanish. `loss_scale` multiplies the loss's
gradient seed by a power of two and each parameter's gradient is divided by it again before the
optimizer (exact, both powers of two), as a static loss scale; bfloat16 has float32's range and
needs none.
"""

from __future__ import annotations

import onnx

from parc.errors import UsageError
from parc.ir.dtypes import DType
from parc.ir.graph import Graph, Node, Value

PRECISIONS = {"fp32": None, "bf16": onnx.TensorProto.BFLOAT16, "fp16": onnx.TensorProto.FLOAT16}
PRODUCTS = ("MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum")
CAST_OF = "parc.autocast"  # meta on the Cast nodes this pass adds: "input" or "output"


def low_type(precision: str) -> int | None:
    """The ONNX element type products compute in, or None for float32 throughout."""
    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision}: expected one of {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def unit_roundoff(precision: str | None) -> float | None:
    """Half the machine epsilon of the type products compute in (2^-8 bf16, 2^-11 fp16): the
    relative error of one rounding to it; None for float32 throughout."""
    low = low_type(precision) if precision else None
    if low is None:
        return None
    import ml_dtypes  # onnx's own dependency; its finfo knows bfloat16 and NumPy's types

    return float(ml_dtypes.finfo(onnx.helper.tensor_dtype_to_np_dtype(low)).eps) / 2


def autocast(graph: Graph, precision: str) -> int:
    """Cast the float32 inputs of every matrix product to the low type and its output back, in
    place; returns how many products now compute in it. A product whose op (at the graph's
    opset) does not take the low type, or with inputs that are not all float32, is left as is."""
    low = low_type(precision)
    if low is None:
        return 0
    opset = graph.opset.get("", 1)
    casts: dict[int, Value] = {}  # id(float32 value) -> its low-type cast
    out: list[Node] = []
    done = 0
    for node in graph.nodes:
        floats = [v for v in node.inputs if v is not None]
        if (node.op_type not in PRODUCTS or node.domain not in ("", "ai.onnx") or not floats
                or any(v.dtype is None or v.dtype.onnx_type != onnx.TensorProto.FLOAT for v in floats)
                or len(node.outputs) != 1 or not _takes(node.op_type, opset, low)):
            out.append(node)
            continue
        for i, v in enumerate(node.inputs):
            if v is None:
                continue
            if id(v) not in casts:
                cast = _cast(graph, v, low, f"{v.name}.{precision}", node, "input")
                out.append(cast)
                casts[id(v)] = cast.outputs[0]
            node.set_input(i, casts[id(v)])
        y = node.outputs[0]
        low_y = Value(graph.names.fresh(f"{y.name}.{precision}"))
        low_y.dtype, low_y.shape = DType(low), y.shape
        low_y.producer, low_y.index = node, 0
        node.outputs[0] = low_y
        back = Node("Cast", [low_y], [y], {"to": onnx.helper.make_attribute("to", onnx.TensorProto.FLOAT)},
                    graph.names.fresh(f"{node.name or y.name}.to_fp32"), "", dict(node.meta))
        back.meta[CAST_OF] = "output"
        out.extend([node, back])
        done += 1
    graph.nodes = out
    return done


def _cast(graph: Graph, v: Value, to: int, name: str, reader: Node, role: str) -> Node:
    low = Value(graph.names.fresh(name))
    low.dtype, low.shape = DType(to), v.shape
    node = Node("Cast", [v], [low], {"to": onnx.helper.make_attribute("to", to)},
                graph.names.fresh(f"{name}.cast"), "", dict(reader.meta))
    node.meta[CAST_OF] = role
    return node


def _takes(op: str, opset: int, elem: int) -> bool:
    """Whether `op`'s schema at `opset` allows element type `elem` for its float inputs."""
    try:
        schema = onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return False
    name = onnx.helper.tensor_dtype_to_string(elem).removeprefix("TensorProto.").lower()
    wanted = f"tensor({name})"
    return all(wanted in c.allowed_type_strs for c in schema.type_constraints
               if any("float" in t for t in c.allowed_type_strs))
