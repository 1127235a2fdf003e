"""Gradient of NegativeLogLikelihoodLoss (PyTorch's cross entropy as LogSoftmax + NLL).

loss_i = -w[t_i] x[i, t_i] (0 where t_i == ignore_index); `mean` divides the sum by the sum
of the w[t_i] counted. So d x[i, c] = -[c == t_i] w[t_i] upstream_i.
"""

from __future__ import annotations

import numpy as np

from parc.autodiff.context import GradContext
from parc.autodiff.rules.base import grad
from parc.autodiff.rules.common import Grads, inp, ones
from parc.ir.graph import Node


@grad("NegativeLogLikelihoodLoss")
def _nll(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x, labels, dy = inp(node, 0), inp(node, 1), dys[0]
    weights = node.input(2)
    assert dy is not None and x.dtype is not None and labels.dtype is not None
    c = x.shape[1]  # type: ignore[index]
    safe, w = labels, None
    ignore = node.attr("ignore_index")
    if ignore is not None:
        valid = ctx.op("Not", [ctx.op("Equal", [labels, ctx.const(np.array(ignore, labels.dtype.numpy))])])
        safe = ctx.op("Where", [valid, labels, ctx.const(np.array(0, labels.dtype.numpy))])
        w = ctx.op("Cast", [valid], to=x.dtype.onnx_type)
    if weights is not None:
        picked = ctx.op("Gather", [weights, safe], axis=0)
        w = picked if w is None else ctx.op("Mul", [picked, w])
    if w is None:
        w = ones(ctx, labels.shape, x)  # type: ignore[arg-type]
    if node.attr("reduction", "mean") == "mean":
        upstream = ctx.op("Mul", [w, ctx.op("Div", [dy, ctx.reduce("ReduceSum", w, list(range(labels.rank)), 0)])])
    else:  # sum: a scalar dy; none: one per element
        upstream = ctx.op("Mul", [w, dy])
    classes = ctx.const(np.arange(c, dtype=labels.dtype.numpy).reshape((1, c) + (1,) * (labels.rank - 1)))
    hit = ctx.op("Cast", [ctx.op("Equal", [ctx.op("Unsqueeze", [safe, ctx.ints([1])]), classes])],
                 to=x.dtype.onnx_type)
    return [ctx.op("Neg", [ctx.op("Mul", [hit, ctx.op("Unsqueeze", [upstream, ctx.ints([1])])])]), None, None]
