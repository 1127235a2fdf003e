"""Reductions, the softmax family and the classification losses."""

from __future__ import annotations

import functools
import math

import numpy as np

from parc.exec.engines import gpu
from parc.exec.engines.kernels import Kernel, Maker, NodeInfo, Unsupported, norm_axes, norm_axis

# Reduce op -> (the opset from which axes is an input, not an attribute; the empty-set value).
_REDUCE = {
    "ReduceSum": (13, 0.0), "ReduceMean": (18, math.nan), "ReduceMax": (18, -math.inf),
    "ReduceMin": (18, math.inf), "ReduceProd": (18, 1.0), "ReduceSumSquare": (18, 0.0),
    "ReduceL1": (18, 0.0), "ReduceL2": (18, 0.0), "ReduceLogSum": (18, -math.inf),
    "ReduceLogSumExp": (18, -math.inf),
}


def _reducer(op: str, xp):
    """op -> f(x, axes, keepdims) over a non-empty set, in x's dtype."""
    def logsumexp(x, axes, keepdims):
        m = xp.max(x, axis=axes, keepdims=True)
        m = xp.where(xp.isfinite(m), m, 0)
        y = xp.log(xp.sum(xp.exp(x - m), axis=axes, keepdims=True)) + m
        return y if keepdims else y.reshape([d for i, d in enumerate(x.shape) if i not in axes])

    return {
        "ReduceSum": lambda x, a, k: xp.sum(x, axis=a, keepdims=k, dtype=x.dtype),
        "ReduceMean": lambda x, a, k: xp.mean(x, axis=a, keepdims=k).astype(x.dtype, copy=False),
        "ReduceMax": lambda x, a, k: xp.max(x, axis=a, keepdims=k),
        "ReduceMin": lambda x, a, k: xp.min(x, axis=a, keepdims=k),
        "ReduceProd": lambda x, a, k: xp.prod(x, axis=a, keepdims=k, dtype=x.dtype),
        "ReduceSumSquare": lambda x, a, k: xp.sum(x * x, axis=a, keepdims=k, dtype=x.dtype),
        "ReduceL1": lambda x, a, k: xp.sum(xp.abs(x), axis=a, keepdims=k, dtype=x.dtype),
        "ReduceL2": lambda x, a, k: xp.sqrt(xp.sum(x * x, axis=a, keepdims=k, dtype=x.dtype)).astype(
            x.dtype, copy=False),
        "ReduceLogSum": lambda x, a, k: xp.log(xp.sum(x, axis=a, keepdims=k, dtype=x.dtype)),
        "ReduceLogSumExp": logsumexp,
    }[op]


def _make_reduce(op: str, n: NodeInfo) -> Kernel:
    xp = n.xp
    since, empty = _REDUCE[op]
    keepdims, noop = bool(n.attr("keepdims", 1)), n.attr("noop_with_empty_axes", 0)
    fn = _reducer(op, xp)
    leading = op in ("ReduceSum", "ReduceMean") and xp is not np and gpu.kernels_enabled()  # the column-sum kernel

    def reduce(x, axes=None):
        given = n.attr("axes") if n.opset < since else (None if axes is None else n.ints(axes))
        if given:
            ax = norm_axes(given, x.ndim)
        else:
            ax = () if noop else tuple(range(x.ndim))
        if any(x.shape[a] == 0 for a in ax):
            shape = [1 if i in ax else d for i, d in enumerate(x.shape) if keepdims or i not in ax]
            if x.dtype == bool:
                return (xp.full(shape, empty > 0, dtype=bool),)
            if x.dtype.kind in "iu" and not math.isfinite(empty):
                info = np.iinfo(x.dtype)
                return (xp.full(shape, info.min if empty < 0 else info.max, dtype=x.dtype),)
            return (xp.full(shape, empty, dtype=x.dtype),)
        if leading and tuple(sorted(ax)) == tuple(range(len(ax))):
            y = gpu.sum_leading(xp, x, len(ax))
            if y is not None:
                if op == "ReduceMean":
                    y = y / x.dtype.type(math.prod(x.shape[:len(ax)]))
                return (y.reshape((1,) * len(ax) + y.shape) if keepdims else y,)
        return (fn(x, ax, keepdims),)
    return reduce


def log_softmax(xp, x, axis: int):
    shifted = x - xp.max(x, axis=axis, keepdims=True)
    return shifted - xp.log(xp.sum(xp.exp(shifted), axis=axis, keepdims=True))


def softmax(xp, x, axis: int):
    e = xp.exp(x - xp.max(x, axis=axis, keepdims=True))
    return e / xp.sum(e, axis=axis, keepdims=True)


def hardmax(xp, x, axis: int):
    classes = xp.arange(x.shape[axis]).reshape([-1 if i == axis else 1 for i in range(x.ndim)])
    return (xp.expand_dims(xp.argmax(x, axis=axis), axis) == classes).astype(x.dtype)


def _gpu_softmax(xp, x, axis: int):
    """softmax, over the last axis by parc's own kernel (`gpu.softmax_last`) when it takes `x`."""
    y = gpu.softmax_last(xp, x) if axis == x.ndim - 1 else None
    return softmax(xp, x, axis) if y is None else y


def _make_softmax(fn, n: NodeInfo) -> Kernel:
    xp = n.xp
    if fn is softmax and xp is not np and gpu.kernels_enabled():  # decided once, not every call
        fn = _gpu_softmax
    if n.opset >= 13:
        axis = n.attr("axis", -1)
        return lambda x: (fn(xp, x, norm_axis(axis, x.ndim)),)
    axis = n.attr("axis", 1)

    def coerced(x):
        # Before opset 13 the input is seen as 2-D: [prod(dims before axis), prod(the rest)].
        a = norm_axis(axis, x.ndim)
        flat = x.reshape(math.prod(x.shape[:a]), math.prod(x.shape[a:]))
        return (fn(xp, flat, 1).reshape(x.shape),)
    return coerced


def nll(xp, logp, target, weight, reduction: str, ignore_index: int | None):
    """-logp[n, target[n, ...], ...] weighted and reduced as NegativeLogLikelihoodLoss says."""
    return _weighed(xp, lambda safe: -xp.take_along_axis(logp, xp.expand_dims(safe, 1), axis=1)[:, 0], logp.dtype,
                    target, weight, reduction, ignore_index)


def _weighed(xp, picked, dtype, target, weight, reduction: str, ignore_index: int | None):
    """Each sample's loss, `picked(safe)` (safe: the targets, class 0 where ignored), weighted and
    reduced as NegativeLogLikelihoodLoss says."""
    ignored = None if ignore_index is None else target == ignore_index
    safe = target if ignored is None else xp.where(ignored, 0, target)
    loss = picked(safe)
    w = None
    if weight is not None:
        w = weight[safe]
        if ignored is not None:
            w = xp.where(ignored, 0, w).astype(dtype, copy=False)
    elif ignored is not None:
        w = xp.logical_not(ignored).astype(dtype)
    if w is not None:
        loss = loss * w
    if reduction == "none":
        return loss
    if reduction == "sum":
        return xp.sum(loss)
    return xp.sum(loss) / xp.sum(w) if w is not None else xp.mean(loss)


def _loss_attrs(n: NodeInfo) -> tuple[str, int | None]:
    reduction = n.attr("reduction", "mean")
    if reduction not in ("none", "sum", "mean"):
        raise Unsupported(f"reduction={reduction!r}")
    return reduction, n.attr("ignore_index")


def make_softmax_cross_entropy(n: NodeInfo) -> Kernel:
    xp, want_log_prob = n.xp, n.wants_output(1)
    reduction, ignore_index = _loss_attrs(n)
    one_pass = xp is not np and gpu.kernels_enabled()

    def sce(scores, labels, weights=None):
        # [samples, classes] on a GPU: -log p[n, label] = logsumexp(scores[n]) - scores[n, label], one
        # pass over the scores (a vocabulary's are the step's largest tensor) instead of CuPy's eight.
        lse = gpu.logsumexp_last(xp, scores) if one_pass and scores.ndim == 2 else None
        if lse is not None:
            loss = _weighed(xp, lambda safe: lse - xp.take_along_axis(scores, safe[:, None], axis=1)[:, 0],
                            scores.dtype, labels, weights, reduction, ignore_index)
            return (loss.astype(scores.dtype, copy=False), scores - lse[:, None] if want_log_prob else None)
        logp = log_softmax(xp, scores, 1)
        loss = nll(xp, logp, labels, weights, reduction, ignore_index).astype(scores.dtype, copy=False)
        return (loss, logp if want_log_prob else None)
    return sce


def make_nll(n: NodeInfo) -> Kernel:
    xp = n.xp
    reduction, ignore_index = _loss_attrs(n)

    def nll_loss(logp, target, weight=None):
        return (nll(xp, logp, target, weight, reduction, ignore_index).astype(logp.dtype, copy=False),)
    return nll_loss


KERNELS: dict[str, Maker] = {
    **{op: functools.partial(_make_reduce, op) for op in _REDUCE},
    "Softmax": functools.partial(_make_softmax, softmax),
    "LogSoftmax": functools.partial(_make_softmax, log_softmax),
    "Hardmax": functools.partial(_make_softmax, hardmax),
    "SoftmaxCrossEntropyLoss": make_softmax_cross_entropy,
    "NegativeLogLikelihoodLoss": make_nll,
}
