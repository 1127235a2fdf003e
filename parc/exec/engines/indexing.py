"""Kernels that select by index or rank: gathers, scatters, OneHot, TopK, ArgMax, CumSum, Trilu."""

from __future__ import annotations

import math

import numpy as np

from parc.exec.engines.kernels import (
    Kernel,
    Maker,
    NodeInfo,
    check_reduction,
    fix_negative,
    norm_axis,
    scatter_reduce,
)


def make_gather(n: NodeInfo) -> Kernel:
    xp, axis = n.xp, n.attr("axis", 0)

    def gather(x, idx):
        a = norm_axis(axis, x.ndim)
        return (xp.take(x, fix_negative(xp, idx, x.shape[a]), axis=a),)
    return gather


def make_gather_elements(n: NodeInfo) -> Kernel:
    xp, axis = n.xp, n.attr("axis", 0)

    def gather_elements(x, idx):
        a = norm_axis(axis, x.ndim)
        return (xp.take_along_axis(x, fix_negative(xp, idx, x.shape[a]), axis=a),)
    return gather_elements


def make_gather_nd(n: NodeInfo) -> Kernel:
    xp, b = n.xp, n.attr("batch_dims", 0)

    def gather_nd(x, idx):
        k = idx.shape[-1]
        batch = math.prod(x.shape[:b])
        xr = x.reshape((batch, *x.shape[b:]))
        ir = idx.reshape(batch, -1, k)
        index = (xp.arange(batch)[:, None],
                 *(fix_negative(xp, ir[..., j], x.shape[b + j]) for j in range(k)))
        return (xr[index].reshape(*idx.shape[:-1], *x.shape[b + k:]),)
    return gather_nd


def make_scatter_nd(n: NodeInfo) -> Kernel:
    xp, reduction = n.xp, check_reduction(n)

    def scatter_nd(data, idx, updates):
        out = data.copy()
        index = tuple(fix_negative(xp, idx[..., j], data.shape[j]) for j in range(idx.shape[-1]))
        scatter_reduce(xp, out, index, updates, reduction)
        return (out,)
    return scatter_nd


def make_scatter_elements(n: NodeInfo) -> Kernel:
    xp, axis, reduction = n.xp, n.attr("axis", 0), check_reduction(n)

    def scatter_elements(data, idx, updates):
        a = norm_axis(axis, data.ndim)
        out = data.copy()
        index = [xp.broadcast_to(xp.arange(s).reshape([-1 if i == d else 1 for i in range(idx.ndim)]),
                                 idx.shape) for d, s in enumerate(idx.shape)]
        index[a] = fix_negative(xp, idx, data.shape[a])
        scatter_reduce(xp, out, tuple(index), updates, reduction)
        return (out,)
    return scatter_elements


def make_onehot(n: NodeInfo) -> Kernel:
    xp, axis = n.xp, n.attr("axis", -1)

    def onehot(indices, depth, values):
        d = int(n.host(depth).reshape(-1)[0])
        idx = fix_negative(xp, indices.astype(xp.int64, copy=False), d)
        a = norm_axis(axis, indices.ndim + 1)
        classes = xp.arange(d).reshape([-1 if i == a else 1 for i in range(indices.ndim + 1)])
        hot = xp.expand_dims(idx, a) == classes
        return (xp.where(hot, values[1], values[0]),)
    return onehot


def make_topk(n: NodeInfo) -> Kernel:
    xp, axis = n.xp, n.attr("axis", -1)
    largest = n.attr("largest", 1)
    stable = {"kind": "stable"} if xp is np else {}  # CuPy's sorts are always stable

    def topk(x, k=None):
        kk = n.attr("k") if n.opset < 10 else n.ints(k)[0]
        a = norm_axis(axis, x.ndim)
        if largest:
            # Descending, equal values in index order: a stable ascending sort of the reversed
            # axis, read backwards.
            order = xp.flip(xp.argsort(xp.flip(x, a), axis=a, **stable), a)
            order = (x.shape[a] - 1) - order
        else:
            order = xp.argsort(x, axis=a, **stable)
        idx = order[(slice(None),) * a + (slice(0, kk),)]
        return (xp.take_along_axis(x, idx, axis=a), idx.astype(xp.int64, copy=False))
    return topk


def _make_arg(n: NodeInfo, find) -> Kernel:
    xp, axis = n.xp, n.attr("axis", 0)
    keepdims, last = n.attr("keepdims", 1), n.attr("select_last_index", 0)

    def arg(x):
        a = norm_axis(axis, x.ndim)
        r = (x.shape[a] - 1) - find(xp.flip(x, a), axis=a) if last else find(x, axis=a)
        if keepdims:
            r = xp.expand_dims(r, a)
        return (xp.asarray(r, dtype=xp.int64),)
    return arg


def make_argmax(n: NodeInfo) -> Kernel:
    return _make_arg(n, n.xp.argmax)


def make_argmin(n: NodeInfo) -> Kernel:
    return _make_arg(n, n.xp.argmin)


def _make_cumulative(n: NodeInfo, name: str, identity: int) -> Kernel:
    xp, exclusive, reverse = n.xp, n.attr("exclusive", 0), n.attr("reverse", 0)
    fn = getattr(xp, name)

    def cumulative(x, axis):
        a = norm_axis(n.ints(axis)[0], x.ndim)
        if reverse:
            x = xp.flip(x, a)
        y = fn(x, axis=a, dtype=x.dtype)
        if exclusive:
            first = xp.full(x.shape[:a] + (1,) + x.shape[a + 1:], identity, dtype=x.dtype)
            y = xp.concatenate([first, y[(slice(None),) * a + (slice(0, -1),)]], axis=a)
        return (xp.flip(y, a) if reverse else y,)
    return cumulative


def make_cumsum(n: NodeInfo) -> Kernel:
    return _make_cumulative(n, "cumsum", 0)


def make_cumprod(n: NodeInfo) -> Kernel:
    return _make_cumulative(n, "cumprod", 1)


def make_trilu(n: NodeInfo) -> Kernel:
    fn = n.xp.triu if n.attr("upper", 1) else n.xp.tril
    return lambda x, k=None: (fn(x, 0 if k is None else n.ints(k)[0]),)


def make_nonzero(n: NodeInfo) -> Kernel:
    xp = n.xp
    return lambda x: (xp.stack(xp.nonzero(x)).astype(xp.int64).reshape(x.ndim, -1),)


def make_compress(n: NodeInfo) -> Kernel:
    xp, axis = n.xp, n.attr("axis")
    return lambda x, cond: (xp.compress(cond, x, axis=axis),)


KERNELS: dict[str, Maker] = {
    "Gather": make_gather, "GatherElements": make_gather_elements, "GatherND": make_gather_nd,
    "ScatterND": make_scatter_nd, "ScatterElements": make_scatter_elements,
    "Scatter": make_scatter_elements, "OneHot": make_onehot, "TopK": make_topk,
    "ArgMax": make_argmax, "ArgMin": make_argmin, "CumSum": make_cumsum, "CumProd": make_cumprod,
    "Trilu": make_trilu, "NonZero": make_nonzero, "Compress": make_compress,
}
