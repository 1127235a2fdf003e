"""Indexing ops: gathers, scatters and OneHot. Indexed axes stay whole; the rest are loop dims."""

from __future__ import annotations

import numpy as np

from parc.ir.graph import Node
from parc.ir.shapes import MAX_FOLD_BYTES
from parc.ops.base import RuleBuilder, ShardingRule, axis_attr, labels, register, zero_flops


@register("Gather", flops=zero_flops,
          notes="the gathered data axis is whole; indices dims and other data dims are loop dims")
def _gather(node: Node, b: RuleBuilder) -> ShardingRule | None:
    data, idx = node.inputs[0], node.inputs[1]
    assert data is not None and idx is not None
    axis = axis_attr(node, data.rank)
    if axis is None:
        return None
    d = labels(data.rank, "d")
    i = labels(idx.rank, "i")
    ds = " ".join("_" if k == axis else d[k] for k in range(data.rank))
    ys = " ".join(d[:axis] + i + d[axis + 1:])
    return b.einsum(f"{ds}, {' '.join(i)} -> {ys}")


def _elements_rule(node: Node, b: RuleBuilder, scatter: bool) -> ShardingRule | None:
    """GatherElements / ScatterElements: dims other than axis are shared where the data and
    indices extents agree, else whole; the axis is whole."""
    data, idx = node.inputs[0], node.inputs[1]
    assert data is not None and idx is not None
    if data.rank != idx.rank or data.rank == 0:
        return None
    axis = axis_attr(node, data.rank)
    if axis is None:
        return None
    ds, js = [], []
    for k in range(data.rank):
        if k != axis and data.shape[k] == idx.shape[k]:
            ds.append(f"d{k}")
            js.append(f"d{k}")
        else:
            ds.append(f"_d{k}")
            js.append(f"_i{k}")
    dspec, ispec = " ".join(ds), " ".join(js)
    if scatter:
        return b.einsum(f"{dspec}, {ispec}, {ispec} -> {dspec}")
    return b.einsum(f"{dspec}, {ispec} -> {ispec}")


@register("GatherElements", flops=zero_flops,
          notes="axis whole; other dims loop only where data and indices extents agree")
def _gather_elements(node: Node, b: RuleBuilder) -> ShardingRule | None:
    return _elements_rule(node, b, scatter=False)


@register("ScatterElements", flops=zero_flops,
          notes="axis whole; other dims loop only where data and indices extents agree")
def _scatter_elements(node: Node, b: RuleBuilder) -> ShardingRule | None:
    return _elements_rule(node, b, scatter=True)


@register("GatherND", flops=zero_flops,
          notes="batch dims and trailing slice dims are loop dims; indexed data dims are whole")
def _gather_nd(node: Node, b: RuleBuilder) -> ShardingRule | None:
    data, idx = node.inputs[0], node.inputs[1]
    assert data is not None and idx is not None
    nb = node.attr("batch_dims", 0)
    if idx.rank < 1 or not 0 <= nb < min(data.rank, idx.rank):
        return None
    m = idx.shape[-1]
    if nb + m > data.rank or data.shape[:nb] != idx.shape[:nb]:
        return None
    bs = labels(nb, "b")
    ts = labels(data.rank - nb - m, "t")
    ls = labels(idx.rank - nb - 1, "l")
    ds = " ".join(bs + ["_"] * m + ts)
    js = " ".join(bs + ls + ["_"])
    return b.einsum(f"{ds}, {js} -> {' '.join(bs + ls + ts)}")


@register("ScatterND", flops=zero_flops,
          notes="trailing slice dims are loop dims of data, updates and output; indexed dims are "
                "whole; the update index dims are whole, or reduced by sum when adding into zeros")
def _scatter_nd(node: Node, b: RuleBuilder) -> ShardingRule | None:
    data, idx, upd = node.inputs[0], node.inputs[1], node.inputs[2]
    assert data is not None and idx is not None and upd is not None
    if idx.rank < 1:
        return None
    m = idx.shape[-1]
    if m > data.rank or upd.rank != idx.rank - 1 + data.rank - m:
        return None
    ts = labels(data.rank - m, "t")
    summed = node.attr("reduction", "none") == "add" and _zeros(data)
    us = labels(idx.rank - 1, "u" if summed else "_u")
    ds = " ".join(["_"] * m + ts)
    spec = f"{ds}, {' '.join(us + ['_'])}, {' '.join(us + ts)} -> {' '.join(['_'] * m + ts)}"
    if summed:
        # scatter-adding into zeros (an embedding's gradient): each shard of the updates adds
        # its part, and the shards' results sum to the whole
        return b.einsum(spec, reduce={u: "sum" for u in us})
    return b.einsum(spec)


def _zeros(v) -> bool:
    """Whether v is known to be all zeros: a ConstantOfShape of 0 or a zero constant."""
    n = v.producer
    if n is not None:
        if n.op_type != "ConstantOfShape":
            return False
        value = n.attr("value")
        return value is None or not np.asarray(value).any()
    if v.const is None:
        return False
    # a folded ConstantOfShape (at most fold_shapes' MAX_FOLD_BYTES, written inline) is read
    return bool(v.const.zeros) or (v.nbytes <= MAX_FOLD_BYTES and not v.const.is_external
                                   and not np.asarray(v.const.numpy()).any())


@register("OneHot", flops=zero_flops, notes="the depth dim is whole; indices dims are loop dims")
def _one_hot(node: Node, b: RuleBuilder) -> ShardingRule | None:
    idx, y = node.inputs[0], node.outputs[0]
    assert idx is not None
    axis = node.attr("axis", -1)
    if not -y.rank <= axis < y.rank:
        return None
    axis %= y.rank
    names = labels(idx.rank)
    ys = names[:axis] + ["_"] + names[axis:]
    return b.einsum(f"{' '.join(names)}, -, - -> {' '.join(ys)}")
