"""Gradients of indexing ops: gathers scatter-add back, scatters gather back, TopK scatters."""

from __future__ import annotations

import numpy as np

from parc.autodiff.context import GradContext
from parc.autodiff.rules.base import grad
from parc.autodiff.rules.common import Grads, inp, unsupported, zeros
from parc.ir.graph import Node, Value


@grad("GatherElements")
def _gather_elements(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    data, idx = inp(node, 0), inp(node, 1)
    axis = node.attr("axis", 0) % data.rank
    return [ctx.op("ScatterElements", [zeros(ctx, data.shape, data), idx, dys[0]], axis=axis,  # type: ignore[arg-type]
                   reduction="add"), None]


def _nonnegative(ctx: GradContext, idx: Value, dims: tuple[int, ...]) -> Value:
    """GatherND indices (last axis: coordinates into `dims`) with negative entries wrapped."""
    if idx.const is not None:
        a = np.asarray(idx.const.numpy())
        if (a >= 0).all():
            return idx
        return ctx.const(np.where(a < 0, a + np.asarray(dims, a.dtype), a))
    limits = ctx.const(np.asarray(dims, idx.dtype.numpy))  # type: ignore[union-attr]
    return ctx.op("Where", [ctx.op("Less", [idx, ctx.const(np.array(0, idx.dtype.numpy))]),  # type: ignore[union-attr]
                            ctx.op("Add", [idx, limits]), idx])


def _with_batch_coords(ctx: GradContext, idx: Value, batch: tuple[int, ...]) -> Value:
    """GatherND indices with batch_dims = len(batch) made explicit: prepend each batch
    coordinate, so ScatterND (which has no batch_dims) can take them."""
    if not batch:
        return idx
    lead = tuple(idx.shape[:-1])  # type: ignore[index]
    coords = []
    for d, size in enumerate(batch):
        view = [1] * len(lead) + [1]
        view[d] = size
        iota = ctx.const(np.arange(size, dtype=np.int64).reshape(view))
        coords.append(ctx.op("Expand", [iota, ctx.ints(lead + (1,))]))
    return ctx.op("Concat", coords + [idx], axis=-1)


@grad("GatherND")
def _gather_nd(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    data, idx = inp(node, 0), inp(node, 1)
    b = node.attr("batch_dims", 0)
    k = idx.shape[-1]  # type: ignore[index]
    full = _with_batch_coords(ctx, _nonnegative(ctx, idx, data.shape[b:b + k]), tuple(data.shape[:b]))  # type: ignore[index]
    return [ctx.op("ScatterND", [zeros(ctx, data.shape, data), full, dys[0]], reduction="add"), None]  # type: ignore[arg-type]


def _scatter_reduction(node: Node) -> str:
    reduction = node.attr("reduction", "none")
    if reduction not in ("none", "add"):
        unsupported(node, f"reduction={reduction!r}")
    return reduction


@grad("ScatterND")
def _scatter_nd(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """none: the overwritten positions of data get nothing; add: data passes dy through.
    updates read dy at their positions (duplicate indices under `none` are undefined in ONNX)."""
    data, idx, upd = inp(node, 0), inp(node, 1), inp(node, 2)
    dy = dys[0]
    assert dy is not None
    add = _scatter_reduction(node) == "add"
    ddata = dupd = None
    if ctx.need(0):
        ddata = dy if add else ctx.op("ScatterND", [dy, idx, zeros(ctx, upd.shape, upd)])
    if ctx.need(2):
        dupd = ctx.op("GatherND", [dy, _nonnegative(ctx, idx, data.shape[:idx.shape[-1]])])  # type: ignore[index]
    return [ddata, None, dupd]


@grad("ScatterElements")
def _scatter_elements(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    data, idx, upd = inp(node, 0), inp(node, 1), inp(node, 2)
    dy = dys[0]
    assert dy is not None
    axis = node.attr("axis", 0) % data.rank
    add = _scatter_reduction(node) == "add"
    ddata = dupd = None
    if ctx.need(0):
        ddata = dy if add else ctx.op("ScatterElements", [dy, idx, zeros(ctx, upd.shape, upd)], axis=axis)
    if ctx.need(2):
        dupd = ctx.op("GatherElements", [dy, idx], axis=axis)
    return [ddata, None, dupd]


@grad("TopK")
def _topk(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """Values' gradient goes to the positions the indices name (distinct along the axis)."""
    x = inp(node, 0)
    axis = node.attr("axis", -1) % x.rank
    dvalues = dys[0]
    if dvalues is None:
        return [None, None]
    return [ctx.op("ScatterElements", [zeros(ctx, x.shape, x), node.outputs[1], dvalues], axis=axis), None]
