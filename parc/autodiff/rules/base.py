"""The gradient-rule registry.

A rule receives the GradContext, the forward node and the gradients of the node's outputs
(None for an output nothing downstream differentiates) and returns one gradient per input
(None where the input needs none: `ctx.need(i)` says which are wanted). Rules emit standard
ONNX ops only.
"""

from __future__ import annotations

from collections.abc import Callable

from parc.autodiff.context import GradContext
from parc.ir.graph import Node, Value

GradFn = Callable[[GradContext, Node, list[Value | None]], list[Value | None]]
GRADS: dict[str, GradFn] = {}

# Ops whose outputs carry no gradient (comparisons, integer results, shape queries): the
# engine stops there instead of asking for a rule.
NON_DIFFERENTIABLE = {
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf", "Shape", "Size", "ArgMax", "ArgMin", "NonZero", "OneHot", "Range",
    "ConstantOfShape", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot",
    "Sign", "Floor", "Ceil", "Round", "RandomNormal", "RandomUniform", "RandomNormalLike",
    "RandomUniformLike", "Bernoulli", "Multinomial", "EyeLike", "Hardmax",
}


def grad(*op_types: str) -> Callable[[GradFn], GradFn]:
    """Decorator: register a gradient rule for ONNX op types."""

    def wrap(fn: GradFn) -> GradFn:
        for op in op_types:
            if op in GRADS:
                raise ValueError(f"gradient of {op} registered twice")
            GRADS[op] = fn
        return fn

    return wrap
