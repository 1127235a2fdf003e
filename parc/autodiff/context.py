"""What a gradient rule sees: the forward node, and an emitter of typed backward nodes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from parc.ir.graph import Graph, Node, Value
from parc.ir.shapes import infer_types
from parc.ir.state import FORWARD_OF, PHASE
from parc.ir.tensor import TensorData


class GradContext:
    """Emits backward nodes for one forward node: each is tagged with its phase and the forward
    node it differentiates, and typed at once, so rules can read `v.shape` of what they made."""

    def __init__(self, graph: Graph, node: Node, needs: Sequence[bool]) -> None:
        self.graph = graph
        self.node = node
        self.needs = list(needs)  # needs[i]: input i wants a gradient

    def need(self, i: int) -> bool:
        return i < len(self.needs) and self.needs[i]

    def op(self, op_type: str, inputs: Sequence[Value | None], n_out: int = 1,
           **attrs: Any) -> Value:
        """Append `op_type(inputs)` and return its (first) output."""
        return self.ops(op_type, inputs, n_out, **attrs)[0]

    def ops(self, op_type: str, inputs: Sequence[Value | None], n_out: int = 1,
            **attrs: Any) -> list[Value]:
        g = self.graph
        base = f"{self.node.name}.grad"
        names = [g.names.fresh(f"{base}.{op_type.lower()}") for _ in range(n_out)]
        n = g.add_node(op_type, list(inputs), n_out, {k: v for k, v in attrs.items() if v is not None},
                       name=g.names.fresh(f"{base}.{op_type}"), output_names=names)
        n.meta[PHASE] = "backward"
        n.meta[FORWARD_OF] = self.node.name
        infer_types(n, g.opset)
        return n.outputs

    def const(self, array: Any, dtype: Any = None) -> Value:
        """A small constant (shapes, axes, scalars)."""
        a = np.asarray(array, dtype=dtype)
        return self.graph.add_constant(TensorData.from_array(a),
                                       self.graph.names.fresh(f"{self.node.name}.grad.const"))

    def ints(self, values: Sequence[int]) -> Value:
        return self.const(np.array(list(values), dtype=np.int64))

    def scalar(self, x: float, like: Value) -> Value:
        """A rank-0 constant of `like`'s dtype."""
        assert like.dtype is not None
        return self.const(np.array(x, dtype=like.dtype.numpy))

    def unbroadcast(self, g: Value, shape: tuple[int, ...]) -> Value:
        """Sum `g` over the axes along which a tensor of `shape` was broadcast to g's shape."""
        assert g.shape is not None
        if tuple(g.shape) == tuple(shape):
            return g
        lead = len(g.shape) - len(shape)
        axes = list(range(lead)) + [lead + i for i, d in enumerate(shape) if d == 1 and g.shape[lead + i] != 1]
        out = self.op("ReduceSum", [g, self.ints(axes)], keepdims=1) if axes else g
        if tuple(out.shape or ()) != tuple(shape):
            out = self.op("Reshape", [out, self.ints(shape)])
        return out

    def reshape(self, g: Value, shape: tuple[int, ...]) -> Value:
        if tuple(g.shape or ()) == tuple(shape):
            return g
        return self.op("Reshape", [g, self.ints(shape)])

    def cast_like(self, g: Value, like: Value) -> Value:
        if g.dtype == like.dtype:
            return g
        return self.op("Cast", [g], to=like.dtype.onnx_type)  # type: ignore[union-attr]

    def reduce(self, op_type: str, x: Value, axes: Sequence[int], keepdims: int = 1) -> Value:
        """A Reduce* node in the form the graph's opset takes (axes as input from opset 18,
        and always for ReduceSum from 13)."""
        opset = self.graph.opset.get("", self.graph.opset.get("ai.onnx", 13))
        if op_type == "ReduceSum" or opset >= 18:
            return self.op(op_type, [x, self.ints(axes)], keepdims=keepdims)
        return self.op(op_type, [x], axes=list(axes), keepdims=keepdims)
