"""Elementwise ops, unary and broadcasting n-ary: every output dim is a loop dim."""

from __future__ import annotations

from parc.ir.graph import Node
from parc.ops.base import RuleBuilder, ShardingRule, labels, register, zero_flops

UNARY = (
    "Abs Acos Acosh Asin Asinh Atan Atanh Ceil Cos Cosh Elu Erf Exp Floor Gelu HardSigmoid "
    "HardSwish IsInf IsNaN LeakyRelu Log Mish Neg Not Reciprocal Relu Round Selu Sigmoid Sign Sin "
    "Sinh Softplus Softsign Sqrt Tan Tanh ThresholdedRelu Celu BitwiseNot Shrink"
).split()
BINARY = (
    "Add Sub Mul Div Pow Mod Equal Less LessOrEqual Greater GreaterOrEqual And Or Xor BitShift "
    "BitwiseAnd BitwiseOr BitwiseXor PRelu Where Max Min Sum Mean"
).split()
MOVES = ("Cast", "CastLike", "Identity")


def broadcast_rule(node: Node, b: RuleBuilder, tensors: list[int] | None = None) -> ShardingRule:
    """Numpy broadcasting: inputs align right; a size-1 dim against a larger one stays whole."""
    out = node.outputs[0].shape
    assert out is not None
    names = labels(len(out))
    specs = []
    for i, v in enumerate(node.inputs):
        if v is None or (tensors is not None and i not in tensors):
            specs.append("-")
            continue
        offset = len(out) - v.rank
        dims = [names[offset + d] if v.shape[d] == out[offset + d] else "1" for d in range(v.rank)]
        specs.append(" ".join(dims))
    outs = ", ".join([" ".join(names)] * len(node.outputs))
    return b.einsum(", ".join(specs) + " -> " + outs)


@register(*UNARY, *BINARY)
def _elementwise(node: Node, b: RuleBuilder) -> ShardingRule:
    return broadcast_rule(node, b)


@register(*MOVES, flops=zero_flops)
def _moves(node: Node, b: RuleBuilder) -> ShardingRule:
    return broadcast_rule(node, b, tensors=[0])


@register("Clip")
def _clip(node: Node, b: RuleBuilder) -> ShardingRule:
    return broadcast_rule(node, b, tensors=[0])


@register("Dropout", flops=zero_flops, notes="inference form; training-mode masks are per shard")
def _dropout(node: Node, b: RuleBuilder) -> ShardingRule:
    names = " ".join(labels(node.outputs[0].rank))
    return b.einsum(f"{names} -> " + ", ".join([names] * len(node.outputs)))
