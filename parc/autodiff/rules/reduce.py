"""Gradients of reductions other than ReduceSum/ReduceMean, and of CumSum.

ReduceMax/ReduceMin share the gradient equally among the elements equal to the result (as
PyTorch's amax/amin do). ReduceL1 uses sign(x) (0 at 0); ReduceL2 gives 0 where the norm is 0.
"""

from __future__ import annotations

from parc.autodiff.context import GradContext
from parc.autodiff.rules.base import grad
from parc.autodiff.rules.common import Grads, as_float, inp, kept, mask, reduce_axes
from parc.ir.graph import Node, Value


def _back(ctx: GradContext, node: Node, v: Value | None) -> Value:
    """A reduction's output (or its gradient) with the reduced axes kept as size 1."""
    assert v is not None
    return ctx.reshape(v, kept(inp(node, 0).shape, reduce_axes(node)))  # type: ignore[arg-type]


def _rest(node: Node) -> list[None]:
    return [None] * (len(node.inputs) - 1)


@grad("ReduceMax", "ReduceMin")
def _reduce_max(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x, axes = inp(node, 0), reduce_axes(node)
    hit = as_float(ctx, ctx.op("Equal", [x, _back(ctx, node, node.outputs[0])]), x)
    count = ctx.reduce("ReduceSum", hit, axes)
    share = ctx.op("Div", [_back(ctx, node, dys[0]), count])
    return [ctx.op("Mul", [hit, share])] + _rest(node)


@grad("ReduceProd")
def _reduce_prod(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """d prod / d x_i = product of the others, exact where x has zeros: with no zero in the
    group it is prod / x_i; with one zero only that element gets the product of the others."""
    x, axes = inp(node, 0), reduce_axes(node)
    zero = ctx.op("Equal", [x, ctx.scalar(0, x)])
    nonzero = ctx.op("Where", [zero, ctx.scalar(1, x), x])
    prod = ctx.reduce("ReduceProd", nonzero, axes)  # of the nonzero elements
    zeros = ctx.reduce("ReduceSum", as_float(ctx, zero, x), axes)
    none = ctx.op("Less", [zeros, ctx.scalar(0.5, x)])
    one = ctx.op("And", [zero, ctx.op("Equal", [zeros, ctx.scalar(1, x)])])
    d = ctx.op("Where", [none, ctx.op("Div", [prod, nonzero]), mask(ctx, one, prod)])
    return [ctx.op("Mul", [d, _back(ctx, node, dys[0])])] + _rest(node)


@grad("ReduceL1")
def _reduce_l1(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x = inp(node, 0)
    return [ctx.op("Mul", [ctx.op("Sign", [x]), _back(ctx, node, dys[0])])] + _rest(node)


@grad("ReduceL2")
def _reduce_l2(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x = inp(node, 0)
    y = _back(ctx, node, node.outputs[0])
    ratio = ctx.op("Where", [ctx.op("Equal", [y, ctx.scalar(0, x)]), ctx.scalar(0, x), ctx.op("Div", [x, y])])
    return [ctx.op("Mul", [ratio, _back(ctx, node, dys[0])])] + _rest(node)


@grad("ReduceSumSquare")
def _reduce_sum_square(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x = inp(node, 0)
    twice = ctx.op("Mul", [x, ctx.scalar(2, x)])
    return [ctx.op("Mul", [twice, _back(ctx, node, dys[0])])] + _rest(node)


@grad("ReduceLogSumExp")
def _reduce_log_sum_exp(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x = inp(node, 0)
    p = ctx.op("Exp", [ctx.op("Sub", [x, _back(ctx, node, node.outputs[0])])])
    return [ctx.op("Mul", [p, _back(ctx, node, dys[0])])] + _rest(node)


@grad("CumSum")
def _cumsum(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """The adjoint of a prefix sum is the suffix sum (same exclusiveness, reversed)."""
    reverse = node.attr("reverse", 0)
    return [ctx.op("CumSum", [dys[0], inp(node, 1)], exclusive=node.attr("exclusive", 0),
                   reverse=1 - reverse), None]
