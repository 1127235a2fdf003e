"""Gradients of normalizations: BatchNormalization (inference and training forms),
InstanceNormalization, GroupNormalization, RMSNormalization, LpNormalization and
MeanVarianceNormalization.

With statistics taken over axes A (training-mode batch norm: N and spatial; instance norm:
spatial; group norm: a group's channels and spatial), y = g xhat + b with
xhat = (x - mean_A) istd_A gives dx = istd (u - mean_A(u) - xhat mean_A(u xhat)), u = g dy. With
given statistics (inference-mode batch norm) dx = g istd dy, and the mean and variance inputs
get their exact gradients too. RMS norm drops the mean terms.
"""

from __future__ import annotations

from parc.autodiff.context import GradContext
from parc.autodiff.rules.base import grad
from parc.autodiff.rules.common import Grads, channel_shape, inp, sum_over, unsupported
from parc.ir.graph import Node, Value


def _per_channel(ctx: GradContext, v: Value, x: Value) -> Value:
    return ctx.reshape(v, channel_shape(x))


def _istd(ctx: GradContext, var: Value, eps: float) -> Value:
    return ctx.op("Reciprocal", [ctx.op("Sqrt", [ctx.op("Add", [var, ctx.scalar(eps, var)])])])


def _batch_stats_grad(ctx: GradContext, x: Value, dy: Value, gain: Value, axes: list[int],
                      eps: float) -> tuple[Value, Value]:
    """(xhat, dx) for y = gain * xhat + bias with mean and variance taken over `axes` of x
    (gain may vary along them: group norm's per-channel scale)."""
    mean = ctx.reduce("ReduceMean", x, axes)
    xc = ctx.op("Sub", [x, mean])
    istd = _istd(ctx, ctx.reduce("ReduceMean", ctx.op("Mul", [xc, xc]), axes), eps)
    xhat = ctx.op("Mul", [xc, istd])
    g = ctx.op("Mul", [dy, gain])
    m_g = ctx.reduce("ReduceMean", g, axes)
    m_gx = ctx.reduce("ReduceMean", ctx.op("Mul", [g, xhat]), axes)
    inner = ctx.op("Sub", [ctx.op("Sub", [g, m_g]), ctx.op("Mul", [xhat, m_gx])])
    return xhat, ctx.op("Mul", [istd, inner])


@grad("BatchNormalization")
def _batch_norm(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x, scale, bias, mean, var = (inp(node, i) for i in range(5))
    dy = dys[0]
    eps = node.attr("epsilon", 1e-5)
    if any(d is not None for d in dys[1:]):
        unsupported(node, "gradients flowing into the running mean/variance outputs")
    if dy is None:
        return [None] * 5
    if node.attr("spatial", 1) != 1:
        unsupported(node, "spatial=0 (opset < 9)")
    stat_axes = [0] + list(range(2, x.rank))
    gain = _per_channel(ctx, scale, x)
    result: Grads = [None] * 5
    if node.attr("training_mode", 0):
        xhat, dx = _batch_stats_grad(ctx, x, dy, gain, stat_axes, eps)
        result[0] = dx if ctx.need(0) else None
    else:
        istd = _per_channel(ctx, _istd(ctx, var, eps), x)
        xc = ctx.op("Sub", [x, _per_channel(ctx, mean, x)])
        xhat = ctx.op("Mul", [xc, istd])
        gi = ctx.op("Mul", [gain, istd])
        if ctx.need(0):
            result[0] = ctx.op("Mul", [dy, gi])
        if ctx.need(3):  # d/dmean = -sum(dy) g istd
            result[3] = ctx.reshape(ctx.op("Neg", [ctx.op("Mul", [sum_over(ctx, dy, stat_axes, 1), gi])]), mean.shape)  # type: ignore[arg-type]
        if ctx.need(4):  # d/dvar = -1/2 sum(dy xhat) g istd^2
            s = sum_over(ctx, ctx.op("Mul", [dy, xhat]), stat_axes, 1)
            d = ctx.op("Mul", [ctx.op("Mul", [s, gi]), ctx.op("Mul", [istd, ctx.scalar(-0.5, x)])])
            result[4] = ctx.reshape(d, var.shape)  # type: ignore[arg-type]
    if ctx.need(1):
        result[1] = sum_over(ctx, ctx.op("Mul", [dy, xhat]), stat_axes)
    if ctx.need(2):
        result[2] = sum_over(ctx, dy, stat_axes)
    return result


@grad("InstanceNormalization")
def _instance_norm(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x, scale, dy = inp(node, 0), inp(node, 1), dys[0]
    assert dy is not None
    eps = node.attr("epsilon", 1e-5)
    spatial = list(range(2, x.rank))
    xhat, dx = _batch_stats_grad(ctx, x, dy, _per_channel(ctx, scale, x), spatial, eps)
    others = [0] + spatial
    return [dx if ctx.need(0) else None,
            sum_over(ctx, ctx.op("Mul", [dy, xhat]), others) if ctx.need(1) else None,
            sum_over(ctx, dy, others) if ctx.need(2) else None]


@grad("GroupNormalization")
def _group_norm(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """Channels split into num_groups groups, statistics per sample and group; scale and bias
    per channel (opset 21; the deprecated opset-18 form, per group, is refused)."""
    x, scale, dy = inp(node, 0), inp(node, 1), dys[0]
    assert dy is not None and x.shape is not None
    if ctx.graph.opset.get("", 18) < 21:
        unsupported(node, "the deprecated opset-18 form (scale and bias per group)")
    groups = node.attr("num_groups")
    n, c, spatial = x.shape[0], x.shape[1], tuple(x.shape[2:])
    grouped = (n, groups, c // groups) + spatial
    view = (1, groups, c // groups) + (1,) * len(spatial)
    stat_axes = list(range(2, len(grouped)))
    xr, dyr = ctx.reshape(x, grouped), ctx.reshape(dy, grouped)
    xhat, dx = _batch_stats_grad(ctx, xr, dyr, ctx.reshape(scale, view), stat_axes, node.attr("epsilon", 1e-5))
    param_axes = [0] + list(range(3, len(grouped)))
    result: Grads = [ctx.reshape(dx, x.shape) if ctx.need(0) else None, None, None]
    if ctx.need(1):
        result[1] = ctx.reshape(sum_over(ctx, ctx.op("Mul", [dyr, xhat]), param_axes), scale.shape)  # type: ignore[arg-type]
    if ctx.need(2):
        result[2] = ctx.reshape(sum_over(ctx, dyr, param_axes), inp(node, 2).shape)  # type: ignore[arg-type]
    return result


@grad("RMSNormalization")
def _rms_norm(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """y = scale x istd, istd = 1 / sqrt(mean(x^2) + eps) over axes [axis, rank):
    dx = istd (g - xhat mean(g xhat)) with g = dy scale, xhat = x istd."""
    x, scale, dy = inp(node, 0), inp(node, 1), dys[0]
    assert dy is not None
    axes = list(range(node.attr("axis", -1) % x.rank, x.rank))
    istd = _istd(ctx, ctx.reduce("ReduceMean", ctx.op("Mul", [x, x]), axes), node.attr("epsilon", 1e-5))
    xhat = ctx.op("Mul", [x, istd])
    dx = dscale = None
    if ctx.need(0):
        g = ctx.op("Mul", [dy, scale])
        m = ctx.reduce("ReduceMean", ctx.op("Mul", [g, xhat]), axes)
        dx = ctx.op("Mul", [istd, ctx.op("Sub", [g, ctx.op("Mul", [xhat, m])])])
    if ctx.need(1):
        dscale = ctx.unbroadcast(ctx.op("Mul", [dy, xhat]), scale.shape)  # type: ignore[arg-type]
    return [dx, dscale]


@grad("LpNormalization")
def _lp_norm(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """y = x / |x|_p along axis: dx = (dy - d|x|_p/dx * sum(dy y)) / |x|_p, with
    d|x|_p/dx = y for p = 2 and sign(x) for p = 1."""
    x, y, dy = inp(node, 0), node.outputs[0], dys[0]
    assert dy is not None
    axis = node.attr("axis", -1) % x.rank
    p = node.attr("p", 2)
    if p not in (1, 2):
        unsupported(node, f"p={p}")
    norm = ctx.reduce("ReduceL2" if p == 2 else "ReduceL1", x, [axis])
    direction = y if p == 2 else ctx.op("Sign", [x])
    s = ctx.reduce("ReduceSum", ctx.op("Mul", [dy, y]), [axis])
    return [ctx.op("Div", [ctx.op("Sub", [dy, ctx.op("Mul", [direction, s])]), norm])]


@grad("MeanVarianceNormalization")
def _mean_variance_norm(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """ONNX's function: y = xc / (std + 1e-9), xc = x - mean, std = sqrt(mean(xc^2)):
    dx = (dy - mean(dy) - xc mean(dy xc) / (std (std + 1e-9))) / (std + 1e-9)."""
    x, dy = inp(node, 0), dys[0]
    assert dy is not None
    axes = [a % x.rank for a in (node.attr("axes") or [0, 2, 3])]
    xc = ctx.op("Sub", [x, ctx.reduce("ReduceMean", x, axes)])
    std = ctx.op("Sqrt", [ctx.reduce("ReduceMean", ctx.op("Mul", [xc, xc]), axes)])
    den = ctx.op("Add", [std, ctx.scalar(1e-9, x)])
    m_dyx = ctx.reduce("ReduceMean", ctx.op("Mul", [dy, xc]), axes)
    inner = ctx.op("Sub", [ctx.op("Sub", [dy, ctx.reduce("ReduceMean", dy, axes)]),
                           ctx.op("Div", [ctx.op("Mul", [xc, m_dyx]), ctx.op("Mul", [std, den])])])
    return [ctx.op("Div", [inner, den])]
