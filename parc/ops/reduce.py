"""Reductions and scans: reduced axes combine by the op's kind, or stay whole."""

from __future__ import annotations

from parc.ir.graph import Node
from parc.ops.base import RuleBuilder, ShardingRule, axes_of, const_ints, labels, register

# How partial results over a split reduced axis combine; None: the axis stays whole.
KINDS: dict[str, str | None] = {
    "ReduceSum": "sum", "ReduceL1": "sum", "ReduceSumSquare": "sum", "ReduceMax": "max",
    "ReduceMin": "min", "ReduceProd": "prod", "ReduceMean": "mean",
    "ReduceL2": None, "ReduceLogSum": None, "ReduceLogSumExp": None,
}


def _input_elements(node: Node) -> int:
    x = node.inputs[0]
    assert x is not None
    return x.size


def reduced_axes(node: Node) -> list[int] | None:
    """The axes a Reduce* node reduces (all of them when none are given), or None if unknown."""
    x = node.inputs[0]
    assert x is not None
    if node.attr("axes") is None and node.input(1) is not None and node.input(1).const is None:
        return None  # axes computed at run time
    axes = axes_of(node)
    if not axes:
        return [] if node.attr("noop_with_empty_axes", 0) else list(range(x.rank))
    return axes


@register(*KINDS, flops=_input_elements,
          notes="reduced axes combine by sum (Sum, L1, SumSquare), max, min, prod or mean "
                "(float Mean only); L2, LogSum and LogSumExp keep them whole")
def _reduce(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    axes = reduced_axes(node)
    if axes is None:
        return None
    names = labels(x.rank)
    keep = node.attr("keepdims", 1)
    out = [("1" if keep else None) if d in axes else names[d] for d in range(x.rank)]
    kind = KINDS[node.op_type]
    if kind == "mean" and not (x.dtype is not None and x.dtype.is_float):
        kind = None  # integer means truncate per shard
    reduced = [names[d] for d in axes]
    spec = f"{' '.join(names)}, - -> {' '.join(o for o in out if o is not None)}"
    if kind is None:
        return b.einsum(spec, unsplittable=reduced)
    return b.einsum(spec, reduce={lbl: kind for lbl in reduced})


@register("ArgMax", "ArgMin", flops=_input_elements, notes="the axis is whole")
def _arg(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    axis = node.attr("axis", 0)
    if not -x.rank <= axis < x.rank:
        return None
    axis %= x.rank
    names = labels(x.rank)
    keep = node.attr("keepdims", 1)
    out = [("1" if keep else None) if d == axis else names[d] for d in range(x.rank)]
    return b.einsum(f"{' '.join(names)} -> {' '.join(o for o in out if o is not None)}",
                    unsplittable=[names[axis]])


@register("CumSum", flops=_input_elements, notes="the scanned axis is whole")
def _cumsum(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    axis = const_ints(node, 1)
    if axis is None or len(axis) != 1 or not -x.rank <= axis[0] < x.rank:
        return None
    names = labels(x.rank)
    spec = " ".join(names)
    return b.einsum(f"{spec}, - -> {spec}", unsplittable=[names[axis[0] % x.rank]])


@register("TopK", flops=_input_elements, notes="the axis is whole in both outputs")
def _topk(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    axis = node.attr("axis", -1)
    if not -x.rank <= axis < x.rank:
        return None
    axis %= x.rank
    names = labels(x.rank)
    outs = [names[d] if d != axis else "_k" for d in range(x.rank)]
    out = " ".join(outs)
    return b.einsum(f"{' '.join(names)}, - -> {out}, {out}", unsplittable=[names[axis]])
