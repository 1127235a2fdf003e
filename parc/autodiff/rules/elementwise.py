"""Gradients of elementwise ops: activations, trigonometry, Abs/Clip, variadic Max/Min/Sum/Mean.

At a kink (Abs and Relu-likes at 0, Clip at its bounds, ties of Max/Min) the rules pick one
one-sided derivative, as PyTorch does; ties of Max/Min share the gradient equally.
"""

from __future__ import annotations

from parc.autodiff.context import GradContext
from parc.autodiff.rules.base import grad
from parc.autodiff.rules.common import Grads, as_float, inp, mask
from parc.ir.graph import Node, Value


def _times(ctx: GradContext, dy: Value | None, d: Value) -> Value:
    return ctx.op("Mul", [dy, d])


def _sq(ctx: GradContext, x: Value) -> Value:
    return ctx.op("Mul", [x, x])


@grad("Abs")
def _abs(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    return [_times(ctx, dys[0], ctx.op("Sign", [inp(node, 0)]))]


@grad("Clip")
def _clip(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """y = min(max(x, lo), hi), differentiated as written (lo > hi gives hi everywhere)."""
    dy = dys[0]
    assert dy is not None
    x, lo, hi = inp(node, 0), node.input(1), node.input(2)
    m = ctx.op("Max", [x, lo]) if lo is not None else x
    below_hi = ctx.op("LessOrEqual", [m, hi]) if hi is not None else None
    through = dy if below_hi is None else mask(ctx, below_hi, dy)  # d y / d m
    dx = dlo = dhi = None
    if ctx.need(0):
        dx = mask(ctx, ctx.op("GreaterOrEqual", [x, lo]), through) if lo is not None else through
    if lo is not None and ctx.need(1):
        dlo = ctx.unbroadcast(mask(ctx, ctx.op("Less", [x, lo]), through), lo.shape)  # type: ignore[arg-type]
    if hi is not None and ctx.need(2):
        dhi = ctx.unbroadcast(mask(ctx, ctx.op("Greater", [m, hi]), dy), hi.shape)  # type: ignore[arg-type]
    return [dx, dlo, dhi]


@grad("LeakyRelu")
def _leaky_relu(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x, dy = inp(node, 0), dys[0]
    alpha = node.attr("alpha", 0.01)
    neg = ctx.op("Less", [x, ctx.scalar(0, x)])
    return [ctx.op("Where", [neg, ctx.op("Mul", [dy, ctx.scalar(alpha, x)]), dy])]


@grad("PRelu")
def _prelu(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """y = slope x for x < 0, else x; slope broadcasts to x."""
    x, slope, dy = inp(node, 0), inp(node, 1), dys[0]
    neg = ctx.op("Less", [x, ctx.scalar(0, x)])
    dx = dslope = None
    if ctx.need(0):
        dx = ctx.op("Where", [neg, ctx.op("Mul", [dy, slope]), dy])
    if ctx.need(1):
        dslope = ctx.unbroadcast(mask(ctx, neg, ctx.op("Mul", [dy, x])), slope.shape)  # type: ignore[arg-type]
    return [dx, dslope]


@grad("Elu")
def _elu(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """y = alpha (e^x - 1) for x < 0: dy/dx = y + alpha there."""
    x, y, dy = inp(node, 0), node.outputs[0], dys[0]
    alpha = node.attr("alpha", 1.0)
    neg = ctx.op("Less", [x, ctx.scalar(0, x)])
    return [ctx.op("Where", [neg, ctx.op("Mul", [dy, ctx.op("Add", [y, ctx.scalar(alpha, x)])]), dy])]


@grad("Selu")
def _selu(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x, dy = inp(node, 0), dys[0]
    alpha = node.attr("alpha", 1.67326319217681884765625)
    gamma = node.attr("gamma", 1.05070102214813232421875)
    neg = ctx.op("LessOrEqual", [x, ctx.scalar(0, x)])
    d = ctx.op("Where", [neg, ctx.op("Mul", [ctx.scalar(alpha * gamma, x), ctx.op("Exp", [x])]),
                         ctx.scalar(gamma, x)])
    return [_times(ctx, dy, d)]


@grad("Celu")
def _celu(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """y = max(0, x) + min(0, alpha (e^(x/alpha) - 1))."""
    x, dy = inp(node, 0), dys[0]
    alpha = node.attr("alpha", 1.0)
    neg = ctx.op("Less", [x, ctx.scalar(0, x)])
    e = ctx.op("Exp", [ctx.op("Div", [x, ctx.scalar(alpha, x)])])
    return [ctx.op("Where", [neg, ctx.op("Mul", [dy, e]), dy])]


@grad("Softplus")
def _softplus(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    return [_times(ctx, dys[0], ctx.op("Sigmoid", [inp(node, 0)]))]


@grad("Softsign")
def _softsign(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x = inp(node, 0)
    den = ctx.op("Add", [ctx.scalar(1, x), ctx.op("Abs", [x])])
    return [ctx.op("Div", [dys[0], _sq(ctx, den)])]


@grad("HardSigmoid")
def _hard_sigmoid(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x, dy = inp(node, 0), dys[0]
    alpha, beta = node.attr("alpha", 0.2), node.attr("beta", 0.5)
    z = ctx.op("Add", [ctx.op("Mul", [x, ctx.scalar(alpha, x)]), ctx.scalar(beta, x)])
    inside = ctx.op("And", [ctx.op("Greater", [z, ctx.scalar(0, x)]), ctx.op("Less", [z, ctx.scalar(1, x)])])
    return [mask(ctx, inside, ctx.op("Mul", [dy, ctx.scalar(alpha, x)]))]


@grad("HardSwish")
def _hard_swish(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """y = x hardsigmoid(x) with alpha 1/6, beta 1/2: x/3 + 1/2 on (-3, 3)."""
    x, dy = inp(node, 0), dys[0]
    mid = ctx.op("Add", [ctx.op("Div", [x, ctx.scalar(3, x)]), ctx.scalar(0.5, x)])
    d = ctx.op("Where", [ctx.op("Less", [x, ctx.scalar(-3, x)]), ctx.scalar(0, x),
                         ctx.op("Where", [ctx.op("Greater", [x, ctx.scalar(3, x)]), ctx.scalar(1, x), mid])])
    return [_times(ctx, dy, d)]


@grad("Mish")
def _mish(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """y = x tanh(softplus(x)): tanh(sp) + x (1 - tanh(sp)^2) sigmoid(x)."""
    x = inp(node, 0)
    t = ctx.op("Tanh", [ctx.op("Softplus", [x])])
    sech2 = ctx.op("Sub", [ctx.scalar(1, x), _sq(ctx, t)])
    d = ctx.op("Add", [t, ctx.op("Mul", [x, ctx.op("Mul", [sech2, ctx.op("Sigmoid", [x])])])])
    return [_times(ctx, dys[0], d)]


@grad("Shrink")
def _shrink(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x = inp(node, 0)
    lambd = node.attr("lambd", 0.5)
    outside = ctx.op("Or", [ctx.op("Less", [x, ctx.scalar(-lambd, x)]),
                            ctx.op("Greater", [x, ctx.scalar(lambd, x)])])
    return [mask(ctx, outside, dys[0])]  # type: ignore[arg-type]


@grad("ThresholdedRelu")
def _thresholded_relu(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x = inp(node, 0)
    return [mask(ctx, ctx.op("Greater", [x, ctx.scalar(node.attr("alpha", 1.0), x)]), dys[0])]  # type: ignore[arg-type]


# -- trigonometric and hyperbolic ------------------------------------------------------------

def _rsqrt_of(ctx: GradContext, x: Value, a: float, b: float) -> Value:
    """1 / sqrt(a + b x^2)."""
    return ctx.op("Reciprocal", [ctx.op("Sqrt", [ctx.op("Add", [ctx.scalar(a, x), ctx.op(
        "Mul", [ctx.scalar(b, x), _sq(ctx, x)])])])])


@grad("Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh")
def _trig(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x, y, op = inp(node, 0), node.outputs[0], node.op_type
    if op == "Sin":
        d = ctx.op("Cos", [x])
    elif op == "Cos":
        d = ctx.op("Neg", [ctx.op("Sin", [x])])
    elif op == "Tan":  # 1 + tan^2
        d = ctx.op("Add", [ctx.scalar(1, x), _sq(ctx, y)])
    elif op == "Asin":
        d = _rsqrt_of(ctx, x, 1, -1)
    elif op == "Acos":
        d = ctx.op("Neg", [_rsqrt_of(ctx, x, 1, -1)])
    elif op == "Atan":
        d = ctx.op("Reciprocal", [ctx.op("Add", [ctx.scalar(1, x), _sq(ctx, x)])])
    elif op == "Sinh":
        d = ctx.op("Cosh", [x])
    elif op == "Cosh":
        d = ctx.op("Sinh", [x])
    elif op == "Asinh":
        d = _rsqrt_of(ctx, x, 1, 1)
    elif op == "Acosh":
        d = _rsqrt_of(ctx, x, -1, 1)
    else:  # Atanh
        d = ctx.op("Reciprocal", [ctx.op("Sub", [ctx.scalar(1, x), _sq(ctx, x)])])
    return [_times(ctx, dys[0], d)]


# -- variadic --------------------------------------------------------------------------------

@grad("Sum", "Mean")
def _sum(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    if node.op_type == "Mean" and len(node.inputs) > 1:
        dy = ctx.op("Div", [dy, ctx.scalar(len(node.inputs), dy)])
    return [ctx.unbroadcast(dy, v.shape) if ctx.need(i) and v is not None else None  # type: ignore[arg-type]
            for i, v in enumerate(node.inputs)]


@grad("Max", "Min")
def _max(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """The gradient goes to the inputs equal to the result, shared equally among ties."""
    dy, y = dys[0], node.outputs[0]
    assert dy is not None
    if len(node.inputs) == 1:
        return [dy]
    hits = [as_float(ctx, ctx.op("Equal", [v, y]), y) for v in node.inputs]  # type: ignore[list-item]
    count = ctx.op("Sum", hits) if len(hits) > 2 else ctx.op("Add", hits)
    share = ctx.op("Div", [dy, count])
    return [ctx.unbroadcast(ctx.op("Mul", [share, h]), v.shape) if ctx.need(i) and v is not None else None  # type: ignore[arg-type]
            for i, (v, h) in enumerate(zip(node.inputs, hits))]


# -- others ----------------------------------------------------------------------------------

@grad("Trilu")
def _trilu(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    k = node.input(1)
    return [ctx.op("Trilu", [dys[0]] + ([k] if k is not None else []), upper=node.attr("upper", 1)), None]


@grad("CastLike")
def _cast_like(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    return [ctx.cast_like(dys[0], inp(node, 0)), None]  # type: ignore[arg-type]

