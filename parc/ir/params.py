"""Which constants are trainable parameters."""

from __future__ import annotations

from onnx import defs

from parc.ir.graph import Graph, Node
from parc.ir.state import step_state

_NON_DIFFERENTIABLE = defs.OpSchema.DifferentiationCategory.NonDifferentiable
# Inputs that are running statistics (buffers), though ONNX calls them differentiable.
_BUFFERS = {("BatchNormalization", 3), ("BatchNormalization", 4)}


def _differentiable_input(node: Node, i: int, opset: dict[str, int]) -> bool:
    """Whether input i of node is a differentiable position (unknown ops: assume yes)."""
    if (node.op_type, i) in _BUFFERS:
        return False
    try:
        schema = defs.get_schema(node.op_type, max_inclusive_version=opset.get(node.domain or "", 1),
                                 domain=node.domain or "")
    except defs.SchemaError:
        return True
    formals = schema.inputs
    if not formals:
        return True
    formal = formals[min(i, len(formals) - 1)]  # variadic inputs repeat the last formal
    return formal.differentiation_category != _NON_DIFFERENTIABLE


def mark_params(graph: Graph) -> int:
    """Mark float initializers of rank >= 1 read in a differentiable position as parameters.

    Float constants used only as Resize scales, Clip bounds, OneHot values and the like are not
    parameters, nor are BatchNormalization's running mean and variance. In a training step
    (parc.state metadata) the parameters are the ones it lists.
    Returns the number of parameters.
    """
    state = step_state(graph.metadata)
    if state is not None:  # a training step names its parameters
        names = set(state.params)
        for v in graph.constants.values():
            v.is_param = v.name in names
        return len(names)
    count = 0
    for v in graph.constants.values():
        if not v.is_param:
            continue
        v.is_param = any(_differentiable_input(n, i, graph.opset) for n, i in v.uses)
        count += v.is_param
    return count
