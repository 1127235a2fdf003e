"""Reverse-mode differentiation of an IR graph: d loss / d params as new backward nodes."""

from __future__ import annotations

import numpy as np

from parc.autodiff.context import GradContext
from parc.autodiff.rules import GRADS, NON_DIFFERENTIABLE
from parc.errors import UnsupportedOpError, UsageError
from parc.ir.graph import Graph, Node, Value
from parc.ir.state import FORWARD_OF, PHASE
from parc.ir.tensor import TensorData


def _on_path(graph: Graph, loss: Value, params: list[Value]) -> set[int]:
    """Values that depend on a parameter and that the loss depends on (ids)."""
    from_params = {id(p) for p in params}
    for n in graph.nodes:
        if n.op_type in NON_DIFFERENTIABLE:
            continue
        if any(v is not None and id(v) in from_params for v in n.inputs):
            from_params.update(id(v) for v in n.outputs if v.dtype is not None and v.dtype.is_float)
    to_loss = {id(loss)}
    for n in reversed(graph.nodes):
        if any(id(v) in to_loss for v in n.outputs):
            to_loss.update(id(v) for v in n.inputs if v is not None)
    return from_params & to_loss


def differentiate(graph: Graph, loss: Value, params: list[Value], seed_scale: float = 1.0) -> dict[str, Value]:
    """Append backward nodes computing d loss / d p for each parameter (times `seed_scale`, a
    loss scale: the gradient the loss itself starts with); returns name -> grad.

    Every backward node records `parc.phase = backward` and, in `parc.forward`, the forward
    node it differentiates. Contributions from several uses are summed.
    """
    if loss.shape is None or loss.size != 1 or loss.dtype is None or not loss.dtype.is_float:
        raise UsageError(f"loss '{loss.name}' must be a float scalar; it is {loss.dtype}{list(loss.shape or ())}")
    path = _on_path(graph, loss, params)
    unused = [p.name for p in params if id(p) not in path]
    if len(unused) == len(params):
        raise UsageError(f"loss '{loss.name}' does not depend on any parameter")
    forward = list(graph.nodes)
    contribs: dict[int, list[Value]] = {}
    seed = graph.add_constant(TensorData.from_array(np.full(loss.shape, seed_scale, loss.dtype.numpy)),
                              graph.names.fresh(f"{loss.name}.grad_seed"))
    contribs[id(loss)] = [seed]
    for node in reversed(forward):
        outs = [_total(graph, node, contribs.get(id(v), [])) for v in node.outputs]
        if all(g is None for g in outs):
            continue
        needs = [v is not None and id(v) in path for v in node.inputs]
        if not any(needs):
            continue
        rule = GRADS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if rule is None:
            raise UnsupportedOpError(
                f"node '{node.label}' ({node.op_type}) lies between the parameters and loss "
                f"'{loss.name}' but has no gradient rule")
        grads = rule(GradContext(graph, node, needs), node, outs)
        for v, need, g in zip(node.inputs, needs, grads):
            if need and g is not None and v is not None:
                if g.shape != v.shape:
                    raise AssertionError(f"gradient rule of {node.op_type} gave {g.shape} for {v.shape}")
                contribs.setdefault(id(v), []).append(g)
    result = {}
    order = {id(n): i for i, n in enumerate(forward)}
    for p in params:
        parts = contribs.get(id(p))
        if parts:  # the sum over a parameter's uses belongs where it is first read
            owner = min((n for n, _ in p.uses if id(n) in order), key=lambda n: order[id(n)], default=None)
            result[p.name] = _total(graph, owner, parts)  # type: ignore[assignment]
    return result


def _total(graph: Graph, node: Node | None, parts: list[Value]) -> Value | None:
    """The sum of gradient contributions (one Add or Sum node, tagged backward)."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    from parc.ir.shapes import infer_types

    op = "Add" if len(parts) == 2 else "Sum"
    n = graph.add_node(op, parts, name=graph.names.fresh("grad.accumulate"),
                       output_names=[graph.names.fresh("grad.sum")])
    n.meta[PHASE] = "backward"
    if node is not None:  # the sum of a forward node's output gradients belongs to its stage
        n.meta[FORWARD_OF] = node.name
    infer_types(n, graph.opset)
    return n.outputs[0]
