"""Gradients of convolutions and pooling.

Conv: dX is a ConvTranspose of dY with the same weights (output_padding restores the input
length the strides rounded away); dW is a Conv of X with dY as the kernel (batch and channels
swapped, strides and dilations swapped, one group per group); dB sums dY. ConvTranspose is the
adjoint of a Conv, so its dX is that Conv and its dW the same weight gradient with X and dY in
each other's roles. MaxPool routes dY to the argmax (its Indices output, recomputed);
AveragePool spreads dY / divisor over each window with a ConvTranspose of ones, the divisor
read off the op itself (AveragePool of ones), so every count_include_pad/ceil_mode convention
is the runtime's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parc.autodiff.context import GradContext
from parc.autodiff.rules.base import grad
from parc.autodiff.rules.common import Grads, as_float, inp, ones, sum_over, unsupported, zeros
from parc.ir.graph import Node, Value


@dataclass(frozen=True)
class Window:
    """Per spatial axis: kernel, stride, dilation, padding before and after."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: tuple[int, ...]
    end: tuple[int, ...]

    def span(self, i: int) -> int:
        return (self.kernel[i] - 1) * self.dilations[i] + 1

    @property
    def pads(self) -> list[int]:
        return list(self.begin) + list(self.end)


def _window(node: Node, spatial: tuple[int, ...], kernel: tuple[int, ...], out: tuple[int, ...]) -> Window:
    """The node's window with auto_pad resolved to explicit pads (ONNX's SAME rule)."""
    n = len(spatial)
    strides = tuple(node.attr("strides") or [1] * n)
    dilations = tuple(node.attr("dilations") or [1] * n)
    auto = node.attr("auto_pad", "NOTSET")
    if auto in ("NOTSET", ""):
        pads = node.attr("pads") or [0] * (2 * n)
        return Window(kernel, strides, dilations, tuple(pads[:n]), tuple(pads[n:]))
    if auto == "VALID":
        return Window(kernel, strides, dilations, (0,) * n, (0,) * n)
    begin, end = [], []
    for i in range(n):
        total = max(0, (out[i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - spatial[i])
        small = total // 2
        begin.append(small if auto == "SAME_UPPER" else total - small)
        end.append(total - begin[-1])
    return Window(kernel, strides, dilations, tuple(begin), tuple(end))


def _fit(ctx: GradContext, v: Value, spatial: tuple[int, ...]) -> Value:
    """Crop trailing spatial positions of v beyond `spatial` (a strided adjoint can overshoot)."""
    assert v.shape is not None
    if tuple(v.shape[2:]) == tuple(spatial):
        return v
    assert all(a >= b for a, b in zip(v.shape[2:], spatial)), (v.shape, spatial)
    axes = list(range(2, v.rank))
    return ctx.op("Slice", [v, ctx.ints([0] * len(axes)), ctx.ints(list(spatial)), ctx.ints(axes)])


def _transpose_conv(ctx: GradContext, g: Value, w: Value, win: Window, group: int,
                    spatial: tuple[int, ...]) -> Value:
    """The adjoint of Conv(., w, win) applied to g, as a ConvTranspose of length `spatial`."""
    out_pad, end = [], []
    for i, d in enumerate(spatial):
        o = g.shape[2 + i]  # type: ignore[index]
        extra = (o - 1) * win.strides[i] + win.span(i) - win.begin[i] - d  # > 0: crop at the end
        end.append(max(extra, 0))
        out_pad.append(max(-extra, 0))
    return ctx.op("ConvTranspose", [g, w], strides=list(win.strides), dilations=list(win.dilations),
                  pads=list(win.begin) + end, output_padding=out_pad if any(out_pad) else None,
                  group=group if group != 1 else None, kernel_shape=list(win.kernel))


def _weight_grad(ctx: GradContext, x: Value, dy: Value, win: Window, group: int) -> Value:
    """dW[m, c, k] = sum_{n, o} dY[n, m, o] X_padded[n, g(m) C/g + c, o s + k d] for
    Y = Conv(X, W, win, group): a Conv with batch and channels swapped, dY as the kernel,
    stride and dilation exchanged. Returns [M, C/g, kernel...]."""
    n, c = x.shape[:2]  # type: ignore[index]
    m = dy.shape[1]  # type: ignore[index]
    sx, sy = tuple(x.shape[2:]), tuple(dy.shape[2:])  # type: ignore[index]
    r = len(sx)
    if group == 1:
        xr = ctx.op("Transpose", [x], perm=[1, 0] + list(range(2, r + 2)))  # [C, N, ...]
        wr = ctx.op("Transpose", [dy], perm=[1, 0] + list(range(2, r + 2)))  # [M, N, ...]
    else:
        cg, mg = c // group, m // group
        xr = ctx.reshape(ctx.op("Transpose", [ctx.reshape(x, (n, group, cg) + sx)],
                                perm=[2, 1, 0] + list(range(3, r + 3))), (cg, group * n) + sx)
        wr = ctx.reshape(ctx.op("Transpose", [ctx.reshape(dy, (n, group, mg) + sy)],
                                perm=[1, 2, 0] + list(range(3, r + 3))), (m, n) + sy)
    end = [max(0, (win.kernel[i] - 1) * win.dilations[i] + (sy[i] - 1) * win.strides[i] + 1 - sx[i] - win.begin[i])
           for i in range(r)]
    dw = ctx.op("Conv", [xr, wr], strides=list(win.dilations), dilations=list(win.strides),
                pads=list(win.begin) + end, group=group if group != 1 else None)  # [C/g, M, K...]
    dw = _fit(ctx, dw, win.kernel)
    return ctx.op("Transpose", [dw], perm=[1, 0] + list(range(2, r + 2)))


def _bias_grad(ctx: GradContext, dy: Value) -> Value:
    return sum_over(ctx, dy, [0] + list(range(2, dy.rank)))


@grad("Conv")
def _conv(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x, w, dy = inp(node, 0), inp(node, 1), dys[0]
    assert dy is not None and x.shape is not None and w.shape is not None
    group = node.attr("group", 1)
    spatial = tuple(x.shape[2:])
    win = _window(node, spatial, tuple(w.shape[2:]), tuple(node.outputs[0].shape[2:]))  # type: ignore[index]
    dx = _transpose_conv(ctx, dy, w, win, group, spatial) if ctx.need(0) else None
    dw = _weight_grad(ctx, x, dy, win, group) if ctx.need(1) else None
    db = _bias_grad(ctx, dy) if node.input(2) is not None and ctx.need(2) else None
    return [dx, dw, db]


@grad("ConvTranspose")
def _conv_transpose(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """Y = ConvTranspose(X, W) is the adjoint of Conv(., W) from Y's space to X's."""
    x, w, dy = inp(node, 0), inp(node, 1), dys[0]
    assert dy is not None and x.shape is not None and w.shape is not None
    if node.attr("output_shape") is not None or node.attr("auto_pad", "NOTSET") not in ("NOTSET", "", "VALID"):
        unsupported(node, "output_shape or auto_pad SAME_* (runtimes disagree on where the padding goes)")
    group = node.attr("group", 1)
    spatial = tuple(x.shape[2:])
    win = _window(node, tuple(dy.shape[2:]), tuple(w.shape[2:]), spatial)  # type: ignore[index]
    dx = dw = db = None
    if ctx.need(0):
        dx = ctx.op("Conv", [dy, w], strides=list(win.strides), dilations=list(win.dilations),
                    pads=win.pads, group=group if group != 1 else None, kernel_shape=list(win.kernel))
        dx = _fit(ctx, dx, spatial)
    if ctx.need(1):
        dw = _weight_grad(ctx, dy, x, win, group)
    if node.input(2) is not None and ctx.need(2):
        db = _bias_grad(ctx, dy)
    return [dx, dw, db]


# -- pooling ---------------------------------------------------------------------------------

_POOL_ATTRS = ("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "strides")


@grad("MaxPool")
def _max_pool(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """Scatter-add dY to the argmax of each window: MaxPool's flat row-major Indices (the
    forward's when it has them, else a MaxPool computing them)."""
    x, dy = inp(node, 0), dys[0]
    if dy is None:  # only Indices is used downstream
        return [None]
    if len(node.outputs) > 1 and node.outputs[1].name and node.attr("storage_order", 0) == 0:
        where = node.outputs[1]
    else:
        attrs = {k: node.attr(k) for k in _POOL_ATTRS}
        attrs["strides"] = attrs["strides"] or [1] * (x.rank - 2)  # explicit: onnx's reference needs it
        _, where = ctx.ops("MaxPool", [x], n_out=2, **attrs)
    scattered = ctx.op("ScatterElements", [zeros(ctx, (x.size,), x), ctx.reshape(where, (dy.size,)),
                                           ctx.reshape(dy, (dy.size,))], axis=0, reduction="add")
    return [ctx.reshape(scattered, x.shape)]  # type: ignore[arg-type]


def _valid_counts(spatial: tuple[int, ...], out: tuple[int, ...], win: Window) -> np.ndarray:
    """How many taps of each output window fall inside the input (not on padding)."""
    per_axis = []
    for i, d in enumerate(spatial):
        taps = np.arange(out[i])[:, None] * win.strides[i] - win.begin[i] + np.arange(win.kernel[i])[None, :] * win.dilations[i]
        per_axis.append(((taps >= 0) & (taps < d)).sum(axis=1))
    counts = per_axis[0]
    for a in per_axis[1:]:
        counts = np.multiply.outer(counts, a)
    return np.maximum(counts, 1).reshape((1, 1) + tuple(out))


@grad("AveragePool")
def _average_pool(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """Y(o) = sum of the window's in-input taps / divisor(o); divisor(o) = valid(o) /
    AveragePool(ones)(o). dX is a ConvTranspose of dY / divisor with a kernel of ones."""
    x, dy, y = inp(node, 0), dys[0], node.outputs[0]
    assert dy is not None and x.shape is not None and y.shape is not None
    n, c = x.shape[:2]
    spatial, out = tuple(x.shape[2:]), tuple(y.shape[2:])
    kernel = tuple(node.attr("kernel_shape"))
    win = _window(node, spatial, kernel, out)
    attrs = {k: node.attr(k) for k in (*_POOL_ATTRS, "count_include_pad")}
    avg_ones = ctx.op("AveragePool", [ones(ctx, (1, 1) + spatial, x)], **attrs)
    valid = ctx.const(_valid_counts(spatial, out, win).astype(x.dtype.numpy))  # type: ignore[union-attr]
    scaled = ctx.op("Mul", [dy, ctx.op("Div", [avg_ones, valid])])
    flat = ctx.reshape(scaled, (n * c, 1) + out)
    kernel_ones = ones(ctx, (1, 1) + kernel, x)
    dx = _transpose_conv(ctx, flat, kernel_ones, win, 1, spatial)
    return [ctx.reshape(dx, x.shape)]


@grad("GlobalAveragePool")
def _global_average_pool(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x, dy = inp(node, 0), dys[0]
    count = int(np.prod(x.shape[2:]))  # type: ignore[index]
    return [ctx.op("Expand", [ctx.op("Div", [dy, ctx.scalar(count, x)]), ctx.ints(x.shape)])]  # type: ignore[arg-type]


@grad("GlobalMaxPool")
def _global_max_pool(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """To the maxima of each channel, shared equally among ties."""
    x, dy, y = inp(node, 0), dys[0], node.outputs[0]
    hit = as_float(ctx, ctx.op("Equal", [x, y]), x)
    count = ctx.reduce("ReduceSum", hit, list(range(2, x.rank)))
    return [ctx.op("Mul", [hit, ctx.op("Div", [dy, count])])]

