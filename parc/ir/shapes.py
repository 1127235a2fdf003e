"""fold-shapes: give every value a static shape and dtype, and fold constant computation.

Walks the graph in topological order. `Shape`/`Size` of a statically shaped value become
constants; a node whose inputs are all constants is evaluated (ONNX's reference evaluator) and
replaced by its results, so PyTorch's Shape -> Gather -> Unsqueeze -> Concat -> Reshape chains,
ConstantOfShape, Range and Expand of computed shapes all end as constants. Nodes reading a
parameter or a constant that is also a graph input (a training step's state) are never folded,
nor are random ops, nor results
larger than `max_fold_bytes` unless their shape can only be learnt by evaluating them. Every
other node gets its output types from the op's ONNX schema, fed the constant inputs.
"""

from __future__ import annotations

import numpy as np
from onnx import defs, helper, numpy_helper, shape_inference

from parc.errors import ShapeError
from parc.ir.dtypes import DType
from parc.ir.evaluate import NONDETERMINISTIC, evaluate
from parc.ir.graph import Graph, Node, Shape, node_signature
from parc.ir.passresult import PassResult
from parc.ir.tensor import TensorData

MAX_FOLD_BYTES = 4 << 20  # results larger than this stay computed (masks, big constants)
MAX_DATA_ELEMS = 1 << 16  # constant inputs handed to ONNX shape inference


def fold_shapes(graph: Graph, max_fold_bytes: int = MAX_FOLD_BYTES, *, typed: bool = False) -> PassResult:
    """The pass. With `typed` (every value already has its type, as after autodiff) only
    constant-only nodes are visited, to fold them."""
    folded = inferred = 0
    fed = {id(v) for v in graph.input_constants}
    for node in list(graph.nodes):
        if typed and not _foldable(node, fed):
            continue
        if node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx"):
            _make_const(graph, node, [_shape_of(node)])
            folded += 1
            continue
        known = infer_types(node, graph.opset, required=False)
        if _foldable(node, fed) and (not known or _small(node, max_fold_bytes)):
            arrays = [v.const.numpy() if v is not None else None for v in node.inputs]  # type: ignore[union-attr]
            _make_const(graph, node, evaluate(node, arrays, graph.opset))
            folded += 1
            continue
        if not known:
            infer_types(node, graph.opset, required=True)
        if node.op_type == "Reshape":
            _explicit_reshape(graph, node)
        inferred += 1
    removed = graph.dead_code_elimination()
    return PassResult("fold-shapes", graph, bool(folded or removed),
                      f"folded {folded} nodes, typed {inferred}, removed {removed} dead")


def _explicit_reshape(graph: Graph, node: Node) -> None:
    """Write a Reshape's 0/-1 target as the explicit output shape (local shapes are then easy)."""
    shape, out = node.input(1), node.outputs[0].shape
    if shape is None or shape.const is None or out is None or 0 in out:
        return
    target = [int(x) for x in shape.const.numpy().reshape(-1)]
    if target != list(out):
        explicit = graph.add_constant(TensorData.from_array(np.array(out, dtype=np.int64)),
                                      graph.names.fresh(f"{node.name}_shape"))
        node.set_input(1, explicit)


def _shape_of(node: Node) -> np.ndarray:
    v = node.inputs[0]
    assert v is not None and v.shape is not None
    if node.op_type == "Size":
        return np.array(v.size, dtype=np.int64)
    rank = len(v.shape)
    start, end = node.attr("start", 0), node.attr("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return np.array(v.shape[start:end], dtype=np.int64)


def _foldable(node: Node, fed: set[int]) -> bool:
    """Constant inputs only, none a parameter or a constant fed as an input (training state)."""
    if node.domain not in ("", "ai.onnx") or node.op_type in NONDETERMINISTIC:
        return False
    ins = [v for v in node.inputs if v is not None]
    return all(v.is_const and not v.is_param and id(v) not in fed for v in ins) and all(
        v.const.nbytes <= MAX_FOLD_BYTES or not v.const.is_external for v in ins)  # type: ignore[union-attr]


def _small(node: Node, limit: int) -> bool:
    return sum(v.nbytes for v in node.outputs) <= limit


def _make_const(graph: Graph, node: Node, arrays: list[np.ndarray]) -> None:
    """Turn the node's outputs into constants in place (names and uses kept)."""
    for v, a in zip(node.outputs, arrays):
        if v.dtype is not None and np.dtype(a.dtype) != v.dtype.numpy:
            a = a.astype(v.dtype.numpy)
        v.const = TensorData.from_array(np.asarray(a, order="C"))
        v.dtype, v.shape, v.producer = v.const.dtype, v.const.shape, None
        graph.constants[v.name] = v
    graph.remove_nodes([node])


# signature -> output types: a model's repeated layers give the same answer, which ONNX's
# inference, node by node, would work out again for every layer (docs/benchmarks.md)
_TYPES: dict[tuple, list[tuple[DType | None, Shape | None]] | None] = {}
_TYPES_MAX = 100_000


def output_types(node: Node, opset: dict[str, int]) -> list[tuple[DType | None, Shape | None]] | None:
    """Output (dtype, static shape or None) per output from the op's ONNX schema; None if the
    op has no schema. Constant inputs are fed to inference, so shape arguments resolve. Answers
    are kept by the node's signature (`graph.node_signature`) and the opset."""
    key = (node_signature(node, MAX_DATA_ELEMS), tuple(sorted(opset.items())))
    if key in _TYPES:
        found = _TYPES[key]
        return None if found is None else list(found)
    types = _output_types(node, opset)  # raises on an input without a type: nothing kept
    if len(_TYPES) >= _TYPES_MAX:
        _TYPES.clear()
    _TYPES[key] = None if types is None else list(types)
    return types


def _output_types(node: Node, opset: dict[str, int]) -> list[tuple[DType | None, Shape | None]] | None:
    from parc.ir.exporter import node_proto

    domain = node.domain or ""
    version = opset.get(domain, opset.get("ai.onnx", 0)) if domain in ("", "ai.onnx") else opset.get(domain, 1)
    try:
        schema = defs.get_schema(node.op_type, max_inclusive_version=version, domain=domain)
    except defs.SchemaError:
        return None
    types, data = {}, {}
    for v in node.inputs:
        if v is None:
            continue
        if v.dtype is None or v.shape is None:
            raise ShapeError(f"node '{node.label}' ({node.op_type}): input '{v.name}' has no type")
        types[v.name] = helper.make_tensor_type_proto(v.dtype.onnx_type, list(v.shape))
        if v.const is not None and not v.is_param and v.const.size <= MAX_DATA_ELEMS:
            data[v.name] = numpy_helper.from_array(np.asarray(v.const.numpy()), v.name)
    proto = node_proto(node)
    del proto.metadata_props[:]
    try:
        out = shape_inference.infer_node_outputs(
            schema, proto, types, data,
            opset_imports=[helper.make_opsetid(d, ver) for d, ver in opset.items()])
    except Exception as e:  # onnx raises InferenceError, ValidationError, RuntimeError
        msg = str(e).replace("\n", " ").strip()
        raise ShapeError(f"node '{node.label}' ({node.op_type}): {msg[:300]}") from None
    result: list[tuple[DType | None, Shape | None]] = []
    for v in node.outputs:
        t = out.get(v.name)
        if t is None or not t.HasField("tensor_type"):
            result.append((None, None))
            continue
        tt = t.tensor_type
        dtype = DType(tt.elem_type) if tt.elem_type else None
        static = tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim)
        result.append((dtype, tuple(int(d.dim_value) for d in tt.shape.dim) if static else None))
    return result


def infer_types(node: Node, opset: dict[str, int], required: bool = True) -> bool:
    """Set the node's output dtypes and static shapes from its ONNX schema.

    Returns False when some output shape stays unknown and `required` is False.
    """
    types = output_types(node, opset)
    if types is None:
        if all(v.shape is not None and v.dtype is not None for v in node.outputs):
            return True  # declared in the model's value_info
        if not required:
            return False
        raise ShapeError(f"node '{node.label}' ({node.domain + '.' if node.domain else ''}"
                         f"{node.op_type}): unknown op and the model declares no static output shapes")
    if any(s is None for v, (_, s) in zip(node.outputs, types) if v.name) and (
            node.op_type in SHAPE_FROM_SHAPES or _is_function_op(node, opset)):
        types = _types_by_evaluation(node, opset) or types
    complete = True
    for v, (dtype, shape) in zip(node.outputs, types):
        if not v.name:
            continue  # an omitted optional output
        v.dtype = dtype or v.dtype
        if shape is None:
            complete = False
        else:
            v.shape = shape
    if not complete and required:
        bad = next(v for v, (_, s) in zip(node.outputs, types) if s is None and v.name)
        raise ShapeError(f"node '{node.label}' ({node.op_type}): the shape of '{bad.name}' depends "
                         f"on data; parc needs static shapes")
    return complete


MAX_EVAL_ELEMS = 1 << 24
# Ops whose output shape follows from input shapes alone but whose ONNX inference can leave it
# unknown (GatherND with a scalar result): typed by running them on zeros.
SHAPE_FROM_SHAPES = {"GatherND"}


def _is_function_op(node: Node, opset: dict[str, int]) -> bool:
    try:
        schema = defs.get_schema(node.op_type, max_inclusive_version=opset.get(node.domain or "", 1),
                                 domain=node.domain or "")
    except defs.SchemaError:
        return False
    return bool(schema.has_function or schema.has_context_dependent_function)


def _types_by_evaluation(node: Node, opset: dict[str, int]) -> list[tuple[DType | None, Shape | None]] | None:
    """Output types of a function-defined op (GroupNormalization, MVN, ...) or one in
    SHAPE_FROM_SHAPES whose schema inference gives no shape: run it on zeros (constants as they
    are); such ops' shapes follow from their input shapes, not values."""
    ins = [v for v in node.inputs if v is not None]
    if sum(v.size for v in ins) > MAX_EVAL_ELEMS:
        return None
    arrays = [None if v is None else (v.const.numpy() if v.const is not None
                                      else np.zeros(v.shape, v.dtype.numpy))  # type: ignore[union-attr]
              for v in node.inputs]
    outs = evaluate(node, arrays, opset)
    return [(DType.from_numpy(a.dtype), tuple(a.shape)) for a in outs]


def shape_dependent_values(graph: Graph) -> int:
    """How many values are still computed from a `Shape` op (0 after fold-shapes)."""
    tainted: set[int] = set()
    for n in graph.nodes:
        if n.op_type == "Shape" or any(v is not None and id(v) in tainted for v in n.inputs):
            tainted.update(id(v) for v in n.outputs)
    return len(tainted)

