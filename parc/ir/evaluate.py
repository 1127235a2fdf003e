"""Evaluate one node on constant inputs (for folding), with ONNX's reference implementation."""

from __future__ import annotations

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator

from parc.errors import ShapeError
from parc.ir.graph import Node

# Ops whose result is not a function of their inputs: never folded.
NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                    "Multinomial", "Bernoulli", "Dropout"}


def _gather_elements(node: Node, data: np.ndarray, indices: np.ndarray) -> list[np.ndarray]:
    axis = node.attr("axis", 0) % data.ndim
    # The output has the index's shape: off the axis, the index may be smaller than the data.
    data = data[tuple(slice(None) if d == axis else slice(0, n) for d, n in enumerate(indices.shape))]
    indices = np.where(indices < 0, indices + data.shape[axis], indices)
    return [np.take_along_axis(data, indices, axis=axis)]


# NumPy kernels for ops whose ONNX reference implementation is wrong (onnx 1.23's GatherElements
# fails when the index is smaller than the data along a non-gathered axis: PyTorch's BERT
# gathers token_type_ids [1, max_pos] with position ids [1, seq]).
KERNELS = {"GatherElements": _gather_elements}


def evaluate(node: Node, inputs: list[np.ndarray | None], opset: dict[str, int]) -> list[np.ndarray]:
    """Run `node` on NumPy inputs; raises ShapeError naming the node if ONNX's evaluator fails."""
    from parc.ir.exporter import node_proto

    kernel = KERNELS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    proto = node_proto(node)
    del proto.metadata_props[:]
    names = [v.name if v is not None else "" for v in node.inputs]
    feeds = {n: a for n, a in zip(names, inputs) if n and a is not None}
    try:
        # IEEE results are ONNX's semantics (T5's relative buckets take Log(0) = -inf and Cast it
        # to int64, then discard it with a Where): no NumPy warnings on the user's terminal.
        with np.errstate(all="ignore"):
            if kernel is not None:
                return kernel(node, *inputs)
            evaluator = ReferenceEvaluator(_single_node_model(proto, node, dict(opset)))
            out = evaluator.run(None, feeds)
    except Exception as e:  # the reference evaluator raises many types
        raise ShapeError(f"node '{node.label}' ({node.op_type}): cannot evaluate on constants: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return [np.asarray(a) for a in out]


def _single_node_model(proto: onnx.NodeProto, node: Node, opset: dict[str, int]) -> onnx.ModelProto:
    from onnx import helper

    inputs = []
    seen = set()
    for v in node.inputs:
        if v is not None and v.name not in seen:
            seen.add(v.name)
            inputs.append(helper.make_tensor_value_info(v.name, v.dtype.onnx_type, None))  # type: ignore[union-attr]
    outputs = [helper.make_tensor_value_info(v.name, 0, None) for v in node.outputs]
    graph = helper.make_graph([proto], "fold", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opset.items()])
