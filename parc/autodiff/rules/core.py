"""Gradients of arithmetic, matmul, layout and transformer ops (what GPT/BERT/T5 use)."""

from __future__ import annotations

import math

import numpy as np

from parc.autodiff.context import GradContext
from parc.autodiff.rules.base import grad
from parc.errors import UnsupportedOpError
from parc.ir.graph import Node, Value
from parc.ops.base import axes_of

Grads = list[Value | None]


def _in(node: Node, i: int) -> Value:
    v = node.inputs[i]
    assert v is not None
    return v


@grad("Identity", "Dropout")
def _identity(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    # Dropout passes gradients through in inference form (training_mode absent or off, or
    # ratio 0); in training mode they go through its mask.
    if node.op_type == "Dropout" and _dropout_active(node):
        return [_dropout(ctx, node, dys[0])] + [None] * (len(node.inputs) - 1)
    return [dys[0]] + [None] * (len(node.inputs) - 1)


def _dropout_active(node: Node) -> bool:
    """Whether a Dropout drops: training_mode (input 2) on and ratio (input 1) not 0."""
    mode, ratio = node.input(2), node.input(1)
    if mode is None:
        return False
    if mode.const is None or (ratio is not None and ratio.const is None):
        raise UnsupportedOpError(f"node '{node.label}' (Dropout): ratio or training_mode computed at "
                                 f"run time; parc differentiates constant ones only")
    p = float(ratio.const.numpy()) if ratio is not None else 0.5  # type: ignore[union-attr]
    return bool(mode.const.numpy()) and p != 0.0


def _dropout(ctx: GradContext, node: Node, dy: Value | None) -> Value:
    """Training-mode Dropout: y = x mask / (1 - ratio), so dx = dy mask / (1 - ratio)."""
    mask = node.outputs[1] if len(node.outputs) > 1 and node.outputs[1].name else None
    if mask is None:
        raise UnsupportedOpError(f"node '{node.label}' (Dropout): training mode without the mask "
                                 f"output; its gradient needs the mask")
    ratio = node.input(1)
    p = float(ratio.const.numpy()) if ratio is not None else 0.5  # type: ignore[union-attr]
    x = _in(node, 0)
    kept = ctx.op("Cast", [mask], to=x.dtype.onnx_type)  # type: ignore[union-attr]
    return ctx.op("Mul", [ctx.op("Mul", [dy, kept]), ctx.scalar(1 / (1 - p), x)])


@grad("Cast")
def _cast(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    return [ctx.cast_like(dys[0], _in(node, 0))]  # type: ignore[arg-type]


@grad("Add", "Sub")
def _add(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    a, b = _in(node, 0), _in(node, 1)
    da = ctx.unbroadcast(dy, a.shape) if ctx.need(0) else None
    db = None
    if ctx.need(1):
        db = ctx.unbroadcast(dy if node.op_type == "Add" else ctx.op("Neg", [dy]), b.shape)
    return [da, db]


@grad("Mul")
def _mul(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    dy = dys[0]
    a, b = _in(node, 0), _in(node, 1)
    da = ctx.unbroadcast(ctx.op("Mul", [dy, b]), a.shape) if ctx.need(0) else None
    db = ctx.unbroadcast(ctx.op("Mul", [dy, a]), b.shape) if ctx.need(1) else None
    return [da, db]


@grad("Div")
def _div(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    dy, y = dys[0], node.outputs[0]
    a, b = _in(node, 0), _in(node, 1)
    da = db = None
    if ctx.need(0):
        da = ctx.unbroadcast(ctx.op("Div", [dy, b]), a.shape)
    if ctx.need(1):  # d(a/b)/db = -y/b
        db = ctx.unbroadcast(ctx.op("Neg", [ctx.op("Div", [ctx.op("Mul", [dy, y]), b])]), b.shape)
    return [da, db]


@grad("Neg")
def _neg(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    return [ctx.op("Neg", [dys[0]])]


@grad("Pow")
def _pow(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    dy, y = dys[0], node.outputs[0]
    a, b = _in(node, 0), _in(node, 1)
    da = db = None
    if ctx.need(0):  # b * a^(b-1), with b cast to a's type
        c = _constant_exponent(b)
        if c is not None:
            da = ctx.op("Mul", [dy, _pow_factor(ctx, a, c)]) if c != 1 else dy
        else:
            bb = ctx.cast_like(b, a)
            da = ctx.op("Mul", [dy, ctx.op("Mul", [bb, ctx.op("Pow", [a, ctx.op("Sub", [bb, ctx.scalar(1, a)])])])])
        da = ctx.unbroadcast(da, a.shape)
    if ctx.need(1):  # y * log(a)
        db = ctx.unbroadcast(ctx.op("Mul", [dy, ctx.op("Mul", [y, ctx.op("Log", [a])])]), b.shape)
    return [da, db]


def _constant_exponent(b: Value) -> float | None:
    """A Pow's exponent where it is a constant of one element (RMSNorm's 2, a tanh GELU's 3)."""
    if b.const is None or b.shape is None or int(np.prod(b.shape)) != 1:
        return None
    c = float(np.asarray(b.const.numpy()).reshape(()))
    return c if np.isfinite(c) else None


def _pow_factor(ctx: GradContext, a: Value, c: float) -> Value:
    """c * a^(c-1) for a constant exponent c, with no Pow where c - 1 is 1, 2 or 0.5 (a, a * a,
    Sqrt(a)): onnxruntime's CPU Pow takes an exponent other than 2 or 3 element by element
    through pow(), many times a square's time (docs/training.md; benchmarks/LOG.md, 2026-11-28,
    third session), and RMSNorm's and T5's x^2 had a gradient of 2 * x^1.0 that ran that way."""
    e = c - 1.0
    if e == 1:
        power = a
    elif e == 2:
        power = ctx.op("Mul", [a, a])
    elif e == 0.5:
        power = ctx.op("Sqrt", [a])
    else:
        power = ctx.op("Pow", [a, ctx.scalar(e, a)])
    return ctx.op("Mul", [power, ctx.scalar(c, a)])


@grad("Sqrt")
def _sqrt(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    y = node.outputs[0]
    return [ctx.op("Div", [dys[0], ctx.op("Mul", [ctx.scalar(2, y), y])])]


@grad("Reciprocal")
def _reciprocal(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    y = node.outputs[0]
    return [ctx.op("Neg", [ctx.op("Mul", [dys[0], ctx.op("Mul", [y, y])])])]


@grad("Exp")
def _exp(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    return [ctx.op("Mul", [dys[0], node.outputs[0]])]


@grad("Log")
def _log(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    return [ctx.op("Div", [dys[0], _in(node, 0)])]


@grad("Tanh")
def _tanh(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    y = node.outputs[0]
    return [ctx.op("Mul", [dys[0], ctx.op("Sub", [ctx.scalar(1, y), ctx.op("Mul", [y, y])])])]


@grad("Sigmoid")
def _sigmoid(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    y = node.outputs[0]
    return [ctx.op("Mul", [dys[0], ctx.op("Mul", [y, ctx.op("Sub", [ctx.scalar(1, y), y])])])]


@grad("Relu")
def _relu(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x = _in(node, 0)
    positive = ctx.op("Greater", [x, ctx.scalar(0, x)])
    return [ctx.op("Where", [positive, dys[0], ctx.scalar(0, x)])]


@grad("Erf")
def _erf(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x = _in(node, 0)
    bell = ctx.op("Exp", [ctx.op("Neg", [ctx.op("Mul", [x, x])])])
    return [ctx.op("Mul", [dys[0], ctx.op("Mul", [bell, ctx.scalar(2 / math.sqrt(math.pi), x)])])]


@grad("Gelu")
def _gelu(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x = _in(node, 0)
    if node.attr("approximate", "none") == "tanh":  # y = 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3)
        c = math.sqrt(2 / math.pi)
        x2 = ctx.op("Mul", [x, x])
        u = ctx.op("Mul", [ctx.scalar(c, x), ctx.op("Add", [x, ctx.op("Mul", [ctx.scalar(0.044715, x),
                                                                             ctx.op("Mul", [x2, x])])])])
        t = ctx.op("Tanh", [u])
        du = ctx.op("Mul", [ctx.scalar(c, x), ctx.op("Add", [ctx.scalar(1, x),
                                                             ctx.op("Mul", [ctx.scalar(3 * 0.044715, x), x2])])])
        sech2 = ctx.op("Sub", [ctx.scalar(1, x), ctx.op("Mul", [t, t])])
        d = ctx.op("Add", [ctx.op("Mul", [ctx.scalar(0.5, x), ctx.op("Add", [ctx.scalar(1, x), t])]),
                           ctx.op("Mul", [ctx.op("Mul", [ctx.scalar(0.5, x), x]), ctx.op("Mul", [sech2, du])])])
    else:  # Phi(x) + x phi(x)
        cdf = ctx.op("Mul", [ctx.scalar(0.5, x), ctx.op("Add", [ctx.scalar(1, x), ctx.op(
            "Erf", [ctx.op("Mul", [x, ctx.scalar(1 / math.sqrt(2), x)])])])])
        pdf = ctx.op("Mul", [ctx.scalar(1 / math.sqrt(2 * math.pi), x), ctx.op(
            "Exp", [ctx.op("Mul", [ctx.scalar(-0.5, x), ctx.op("Mul", [x, x])])])])
        d = ctx.op("Add", [cdf, ctx.op("Mul", [x, pdf])])
    return [ctx.op("Mul", [dys[0], d])]


@grad("Where")
def _where(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    cond, x, y = _in(node, 0), _in(node, 1), _in(node, 2)
    zero = ctx.scalar(0, dy)
    dx = ctx.unbroadcast(ctx.op("Where", [cond, dy, zero]), x.shape) if ctx.need(1) else None
    dyy = ctx.unbroadcast(ctx.op("Where", [cond, zero, dy]), y.shape) if ctx.need(2) else None
    return [None, dx, dyy]


def _swap_last(ctx: GradContext, v: Value) -> Value:
    perm = list(range(v.rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    return ctx.op("Transpose", [v], perm=perm)


@grad("MatMul")
def _matmul(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """numpy matmul semantics: 1-D operands are promoted, batch dims broadcast."""
    dy = dys[0]
    assert dy is not None
    a, b = _in(node, 0), _in(node, 1)
    a2 = ctx.reshape(a, (1, a.shape[0])) if a.rank == 1 else a
    b2 = ctx.reshape(b, (b.shape[0], 1)) if b.rank == 1 else b
    out_shape = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]) + (a2.shape[-2], b2.shape[-1])
    dy2 = ctx.reshape(dy, tuple(int(d) for d in out_shape))
    da = db = None
    if ctx.need(0):
        da = ctx.reshape(ctx.unbroadcast(ctx.op("MatMul", [dy2, _swap_last(ctx, b2)]), a2.shape), a.shape)
    if ctx.need(1):
        if b2.rank == 2 and a2.rank > 2 and all(isinstance(d, int) for d in a2.shape):
            # a weight applied over batch dims: one 2-D product over the flattened rows,
            # a2^T @ dy2 as [rows, K]^T @ [rows, N], instead of a batched product and a sum
            rows = int(np.prod(a2.shape[:-1]))
            db = ctx.op("Gemm", [ctx.reshape(a2, (rows, a2.shape[-1])), ctx.reshape(dy2, (rows, dy2.shape[-1]))],
                        transA=1)
            db = ctx.reshape(db, b.shape)
        else:
            db = ctx.reshape(ctx.unbroadcast(ctx.op("MatMul", [_swap_last(ctx, a2), dy2]), b2.shape), b.shape)
    return [da, db]


@grad("Gemm")
def _gemm(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """Y = alpha op(A) op(B) + beta C."""
    dy = dys[0]
    a, b = _in(node, 0), _in(node, 1)
    alpha, beta = node.attr("alpha", 1.0), node.attr("beta", 1.0)
    ta, tb = node.attr("transA", 0), node.attr("transB", 0)
    da = db = dc = None
    if ctx.need(0):
        da = (ctx.op("Gemm", [b, dy], alpha=alpha, transA=tb, transB=1) if ta
              else ctx.op("Gemm", [dy, b], alpha=alpha, transB=1 - tb))
    if ctx.need(1):
        db = (ctx.op("Gemm", [dy, a], alpha=alpha, transA=1, transB=ta) if tb
              else ctx.op("Gemm", [a, dy], alpha=alpha, transA=1 - ta))
    if len(node.inputs) > 2 and node.inputs[2] is not None and ctx.need(2):
        c = _in(node, 2)
        scaled = dy if beta == 1.0 else ctx.op("Mul", [dy, ctx.scalar(beta, c)])
        dc = ctx.unbroadcast(scaled, c.shape)
    return [da, db, dc]


@grad("Transpose")
def _transpose(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x = _in(node, 0)
    perm = node.attr("perm") or list(reversed(range(x.rank)))
    return [ctx.op("Transpose", [dys[0]], perm=[int(i) for i in np.argsort(perm)])]


@grad("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x = _in(node, 0)
    return [ctx.reshape(dys[0], x.shape)] + [None] * (len(node.inputs) - 1)  # type: ignore[arg-type]


@grad("Expand")
def _expand(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    return [ctx.unbroadcast(dys[0], _in(node, 0).shape), None]  # type: ignore[arg-type]


def _zeros(ctx: GradContext, like: Value) -> Value:
    from onnx import helper

    assert like.dtype is not None
    return ctx.op("ConstantOfShape", [ctx.ints(like.shape)],
                  value=helper.make_tensor("zero", like.dtype.onnx_type, [1], [0]))


@grad("Split")
def _split(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x = _in(node, 0)
    axis = node.attr("axis", 0) % x.rank
    parts = [dy if dy is not None else _zeros(ctx, v) for dy, v in zip(dys, node.outputs)]
    return [ctx.op("Concat", parts, axis=axis)] + [None] * (len(node.inputs) - 1)


@grad("Concat")
def _concat(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    y = node.outputs[0]
    axis = node.attr("axis") % y.rank
    sizes = [v.shape[axis] for v in node.inputs if v is not None]
    parts = ctx.ops("Split", [dys[0], ctx.ints(sizes)], n_out=len(sizes), axis=axis)
    return list(parts)


@grad("Gather")
def _gather(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """Scatter-add the output gradient back into a zero tensor shaped like data."""
    dy = dys[0]
    data, idx = _in(node, 0), _in(node, 1)
    a = node.attr("axis", 0) % data.rank
    r = idx.rank
    # dy: data[:a] + idx + data[a+1:]  ->  idx + data[:a] + data[a+1:]
    perm = list(range(a, a + r)) + list(range(a)) + list(range(a + r, dy.rank))  # type: ignore[union-attr]
    upd = dy if perm == list(range(len(perm))) else ctx.op("Transpose", [dy], perm=perm)
    front = (data.shape[a],) + data.shape[:a] + data.shape[a + 1:]
    index = ctx.op("Unsqueeze", [idx, ctx.ints([r])])
    scattered = ctx.op("ScatterND", [_zeros_shape(ctx, front, data), index, upd], reduction="add")
    back = list(range(1, a + 1)) + [0] + list(range(a + 1, data.rank))
    out = scattered if a == 0 else ctx.op("Transpose", [scattered], perm=back)
    return [out, None]


def _zeros_shape(ctx: GradContext, shape: tuple[int, ...], like: Value) -> Value:
    from onnx import helper

    assert like.dtype is not None
    return ctx.op("ConstantOfShape", [ctx.ints(shape)],
                  value=helper.make_tensor("zero", like.dtype.onnx_type, [1], [0]))


@grad("Softmax")
def _softmax(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    y, dy = node.outputs[0], dys[0]
    axis = node.attr("axis", -1) % y.rank
    s = ctx.reduce("ReduceSum", ctx.op("Mul", [dy, y]), [axis])
    return [ctx.op("Mul", [y, ctx.op("Sub", [dy, s])])]


@grad("LogSoftmax")
def _log_softmax(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    y, dy = node.outputs[0], dys[0]
    axis = node.attr("axis", -1) % y.rank
    s = ctx.reduce("ReduceSum", dy, [axis])  # type: ignore[arg-type]
    return [ctx.op("Sub", [dy, ctx.op("Mul", [ctx.op("Exp", [y]), s])])]


@grad("ReduceSum", "ReduceMean")
def _reduce_sum(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x, dy = _in(node, 0), dys[0]
    axes = axes_of(node)
    if axes is None:  # no axes input: reduce over all (unless noop_with_empty_axes)
        if node.input(1) is not None:
            raise UnsupportedOpError(f"node '{node.label}' ({node.op_type}): axes are computed at "
                                     f"run time; parc differentiates constant axes only")
        axes = []
    if not axes and not node.attr("noop_with_empty_axes", 0):
        axes = list(range(x.rank))
    kept = tuple(1 if d in axes else s for d, s in enumerate(x.shape))
    g = ctx.op("Expand", [ctx.reshape(dy, kept), ctx.ints(x.shape)])  # type: ignore[arg-type]
    if node.op_type == "ReduceMean":
        count = int(np.prod([x.shape[d] for d in axes])) if axes else 1
        g = ctx.op("Div", [g, ctx.scalar(count, x)])
    return [g] + [None] * (len(node.inputs) - 1)


def _statistics(ctx: GradContext, node: Node) -> tuple[Value, Value]:
    """A LayerNormalization's Mean and InvStdDev outputs, given to the node where it has none."""
    from parc.ir.shapes import infer_types

    while len(node.outputs) < 3:
        v = Value(ctx.graph.names.fresh(f"{node.name}.{('mean', 'inv_std_dev')[len(node.outputs) - 1]}"))
        v.producer, v.index = node, len(node.outputs)
        node.outputs.append(v)
    for i, what in ((1, "mean"), (2, "inv_std_dev")):
        if not node.outputs[i].name:  # an omitted optional output
            node.outputs[i].name = ctx.graph.names.fresh(f"{node.name}.{what}")
    infer_types(node, ctx.graph.opset)
    return node.outputs[1], node.outputs[2]


@grad("LayerNormalization")
def _layer_norm(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """dx = istd * (g - mean(g) - xhat mean(g xhat)), g = dy scale, xhat = (x - mean) istd, with
    the forward node's own Mean and InvStdDev (outputs it is given when it lacks them: one value
    per normalised row, where recomputing them read x twice more and wrote x - mean and its
    square) when it computes them in x's type (`stash_type`), else recomputed in x's type."""
    x, scale = _in(node, 0), _in(node, 1)
    bias = node.input(2)
    dy = dys[0]
    if any(d is not None for d in dys[1:]):
        raise UnsupportedOpError(f"node '{node.label}' (LayerNormalization): gradients flowing into its "
                                 f"Mean or InvStdDev outputs")
    axis = node.attr("axis", -1) % x.rank
    norm_axes = list(range(axis, x.rank))
    if x.dtype is not None and x.dtype.onnx_type == node.attr("stash_type", 1):  # the node's own statistics
        mean, istd = _statistics(ctx, node)
        xc = ctx.op("Sub", [x, mean])
    else:  # computed in another type (float32 for a float64 or float16 x): recomputed in x's
        xc = ctx.op("Sub", [x, ctx.reduce("ReduceMean", x, norm_axes)])
        var = ctx.reduce("ReduceMean", ctx.op("Mul", [xc, xc]), norm_axes)
        istd = ctx.op("Reciprocal", [ctx.op("Sqrt", [ctx.op("Add", [var, ctx.scalar(node.attr("epsilon", 1e-5), x)])])])
    xhat = ctx.op("Mul", [xc, istd])
    lead = list(range(axis))
    dscale = dbias = dx = None
    if ctx.need(1):
        dscale = ctx.reshape(ctx.reduce("ReduceSum", ctx.op("Mul", [dy, xhat]), lead, 0) if lead
                             else ctx.op("Mul", [dy, xhat]), scale.shape)
    if bias is not None and ctx.need(2):
        dbias = ctx.reshape(ctx.reduce("ReduceSum", dy, lead, 0) if lead else dy, bias.shape)  # type: ignore[arg-type]
    if ctx.need(0):
        g = ctx.op("Mul", [dy, scale])
        mg = ctx.reduce("ReduceMean", g, norm_axes)
        mgx = ctx.reduce("ReduceMean", ctx.op("Mul", [g, xhat]), norm_axes)
        dx = ctx.op("Mul", [istd, ctx.op("Sub", [ctx.op("Sub", [g, mg]), ctx.op("Mul", [xhat, mgx])])])
    return [dx, dscale, dbias]


@grad("SoftmaxCrossEntropyLoss")
def _softmax_cross_entropy(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """d scores = (softmax(scores) - onehot(label)) * w * upstream, w = weight[label] or 1,
    zero where label == ignore_index; `mean` divides by the sum of w."""
    scores, labels = _in(node, 0), _in(node, 1)
    weights = node.input(2)
    dy = dys[0]
    if dy is None:  # only log_prob is used downstream
        dlog = dys[1]
        assert dlog is not None
        s = ctx.reduce("ReduceSum", dlog, [1])
        prob = ctx.op("Softmax", [scores], axis=1)
        return [ctx.op("Sub", [dlog, ctx.op("Mul", [prob, s])]), None, None]
    reduction = node.attr("reduction", "mean")
    c = scores.shape[1]
    ignore = node.attr("ignore_index")
    safe = labels
    valid = None
    if ignore is not None:
        valid = ctx.op("Not", [ctx.op("Equal", [labels, ctx.const(np.array(ignore, dtype=labels.dtype.numpy))])])
        safe = ctx.op("Where", [valid, labels, ctx.const(np.array(0, dtype=labels.dtype.numpy))])
    w = ctx.op("Gather", [weights, safe], axis=0) if weights is not None else None
    if valid is not None:
        vf = ctx.op("Cast", [valid], to=scores.dtype.onnx_type)  # type: ignore[union-attr]
        w = vf if w is None else ctx.op("Mul", [w, vf])
    if w is None:
        w = ctx.op("ConstantOfShape", [ctx.ints(labels.shape)],
                   value=_one_tensor(scores.dtype.onnx_type))  # type: ignore[union-attr]
    if reduction == "mean":
        total = ctx.reduce("ReduceSum", w, list(range(labels.rank)), 0)
        upstream = ctx.op("Mul", [w, ctx.op("Div", [dy, total])])
    elif reduction == "sum":
        upstream = ctx.op("Mul", [w, dy])
    else:
        upstream = ctx.op("Mul", [w, dy])
    # Equal against the class ids, not OneHot: onnxruntime's OneHot has no float64/float16 kernel.
    classes = ctx.const(np.arange(c, dtype=labels.dtype.numpy).reshape((1, c) + (1,) * (labels.rank - 1)))  # type: ignore[union-attr]
    onehot = ctx.op("Cast", [ctx.op("Equal", [ctx.op("Unsqueeze", [safe, ctx.ints([1])]), classes])],
                    to=scores.dtype.onnx_type)  # type: ignore[union-attr]
    prob = ctx.op("Softmax", [scores], axis=1)
    d = ctx.op("Mul", [ctx.op("Sub", [prob, onehot]), ctx.op("Unsqueeze", [upstream, ctx.ints([1])])])
    if len(dys) > 1 and dys[1] is not None:  # log_prob is also used downstream
        s = ctx.reduce("ReduceSum", dys[1], [1])
        d = ctx.op("Add", [d, ctx.op("Sub", [dys[1], ctx.op("Mul", [prob, s])])])
    return [d, None, None]


def _one_tensor(onnx_type: int):
    from onnx import helper

    return helper.make_tensor("one", onnx_type, [1], [1])
