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


def evaluate(node: Node, inputs: list[np.ndarray | None], opset: dict[str, int]) -> list[np.ndarray]:
    """Run `node` on NumPy inputs; raises ShapeError naming the node if ONNX's evaluator fails."""
    from parc.ir.exporter import node_proto

    proto = node_proto(node)
    del proto.metadata_props[:]
    names = [v.name if v is not None else "" for v in node.inputs]
    feeds = {n: a for n, a in zip(names, inputs) if n and a is not None}
    try:
        opsets = {d: v for d, v in opset.items()}
        evaluator = ReferenceEvaluator(_single_node_model(proto, node, opsets))
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
