"""Data movement: reshapes, transposes, slicing, gathers and scatters. They cost no FLOPs.

Dims that an op only carries along are loop dims; dims it cuts, pads, concatenates or indexes
stay whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from parc.ir.graph import Node
from parc.ops.base import (
    RuleBuilder,
    ShardingRule,
    axis_attr,
    const_ints,
    labels,
    register,
    same_dims_except,
    zero_flops,
)


def _dim(factors: Sequence[str]) -> str:
    """One dim in RuleBuilder notation: a label, a group, or 1."""
    if not factors:
        return "1"
    return factors[0] if len(factors) == 1 else f"({' '.join(factors)})"


# -- Reshape: the common factorisation of two shapes --------------------------------------------

def reshape_factors(src: Sequence[int], dst: Sequence[int]) -> tuple[list[list[str]], list[list[str]], dict[str, int]] | None:
    """Factor labels per dim of `src` and `dst` such that shared labels are the same loop dim.

    Both shapes are cut into segments whose products agree; inside a segment, factors common to
    the outer ends (gcds of leading extents) and to the inner ends are shared labels, and what is
    left in the middle, where no clean factorisation exists, gets unsplittable labels (``_``
    prefix). E.g. (b, s, h*d) -> (b, s, h, d) gives ``b s (h d) -> b s h d``; (4, 6) -> (6, 4)
    shares an outer 2 and an inner 2. Returns None for empty tensors.
    """
    if 0 in src or 0 in dst or math.prod(src) != math.prod(dst):
        return None
    src_f: list[list[str]] = [[] for _ in src]
    dst_f: list[list[str]] = [[] for _ in dst]
    sizes: dict[str, int] = {}
    a = [d for d, e in enumerate(src) if e != 1]
    b = [d for d, e in enumerate(dst) if e != 1]
    i = j = 0
    while i < len(a):
        seg_a, seg_b = [a[i]], [b[j]]
        pa, pb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                seg_a.append(a[i])
                pa *= src[a[i]]
                i += 1
            else:
                seg_b.append(b[j])
                pb *= dst[b[j]]
                j += 1
        _factor_segment(seg_a, seg_b, src, dst, src_f, dst_f, sizes)
    return src_f, dst_f, sizes


def _factor_segment(seg_a: list[int], seg_b: list[int], src: Sequence[int], dst: Sequence[int],
                    src_f: list[list[str]], dst_f: list[list[str]], sizes: dict[str, int]) -> None:
    ins = [[d, src[d]] for d in seg_a]  # pieces: [dim, extent not yet factored]
    outs = [[d, dst[d]] for d in seg_b]
    outer_a: dict[int, list[str]] = {d: [] for d in seg_a}
    inner_a: dict[int, list[str]] = {d: [] for d in seg_a}
    outer_b: dict[int, list[str]] = {d: [] for d in seg_b}
    inner_b: dict[int, list[str]] = {d: [] for d in seg_b}

    def new(size: int, fixed: bool = False) -> str:
        name = f"{'_' if fixed else ''}r{len(sizes)}"
        sizes[name] = size
        return name

    for end in (0, -1):  # outer ends first, then inner ends
        while ins and outs:
            pa, pb = ins[end], outs[end]
            g = math.gcd(pa[1], pb[1])
            if g == 1:
                break
            label = new(g)
            if end == 0:
                outer_a[pa[0]].append(label)
                outer_b[pb[0]].append(label)
            else:
                inner_a[pa[0]].insert(0, label)
                inner_b[pb[0]].insert(0, label)
            pa[1] //= g
            pb[1] //= g
            if pa[1] == 1:
                ins.pop(end)
            if pb[1] == 1:
                outs.pop(end)
    middle_a: dict[int, list[str]] = {d: [] for d in seg_a}
    middle_b: dict[int, list[str]] = {d: [] for d in seg_b}
    for d, extent in ins:
        middle_a[d].append(new(extent, fixed=True))
    for d, extent in outs:
        middle_b[d].append(new(extent, fixed=True))
    for d in seg_a:
        src_f[d] = outer_a[d] + middle_a[d] + inner_a[d]
    for d in seg_b:
        dst_f[d] = outer_b[d] + middle_b[d] + inner_b[d]


@register("Reshape", flops=zero_flops, view=True,
          notes="dims map through the common factorisation of the two shapes; what has none "
                "stays whole; the shape input is a shape argument (a shard gets its local shape)")
def _reshape(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    factored = reshape_factors(x.shape, y.shape)
    if factored is None:
        return None
    src_f, dst_f, sizes = factored
    spec = (" ".join(_dim(f) for f in src_f) + ", - -> " + " ".join(_dim(f) for f in dst_f))
    return b.einsum(spec, sizes=sizes, shape_args={1: 0})


@register("Flatten", flops=zero_flops, view=True, notes="output dims are groups of the input dims")
def _flatten(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    axis = node.attr("axis", 1)
    if not -x.rank <= axis <= x.rank:
        return None
    if axis < 0:
        axis += x.rank
    names = [f"d{d}" if e != 1 else None for d, e in enumerate(x.shape)]
    xs = " ".join(n or "1" for n in names)
    outer = [n for n in names[:axis] if n]
    inner = [n for n in names[axis:] if n]
    if 0 in x.shape:
        return None
    return b.einsum(f"{xs} -> {_dim(outer)} {_dim(inner)}")


@register("Squeeze", flops=zero_flops, view=True,
          notes="without axes nothing splits: a shard whose piece of a dim has size 1 would "
                "squeeze it too")
def _squeeze(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    axes = node.attr("axes")
    if axes is None and node.input(1) is not None:
        axes = const_ints(node, 1)
        if axes is None:
            return None
    implicit = axes is None
    if implicit:
        axes = [d for d, e in enumerate(x.shape) if e == 1]
    if any(not -x.rank <= a < x.rank for a in axes):
        return None
    axes = {a % x.rank for a in axes}
    names = labels(x.rank)
    xs = " ".join("1" if d in axes else names[d] for d in range(x.rank))
    ys = " ".join(names[d] for d in range(x.rank) if d not in axes)
    return b.einsum(f"{xs}, - -> {ys}", unsplittable=names if implicit else ())


@register("Unsqueeze", flops=zero_flops, view=True)
def _unsqueeze(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    axes = node.attr("axes")
    if axes is None:
        axes = const_ints(node, 1)
    if axes is None or any(not -y.rank <= a < y.rank for a in axes):
        return None
    axes = {a % y.rank for a in axes}
    names = iter(labels(x.rank))
    ys = " ".join("1" if d in axes else next(names) for d in range(y.rank))
    return b.einsum(f"{' '.join(labels(x.rank))}, - -> {ys}")


@register("Transpose", flops=zero_flops)
def _transpose(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    perm = node.attr("perm") or list(reversed(range(x.rank)))
    if sorted(perm) != list(range(x.rank)):
        return None
    names = labels(x.rank)
    return b.einsum(f"{' '.join(names)} -> {' '.join(names[p] for p in perm)}")


@register("Expand", flops=zero_flops,
          notes="broadcast dims are output-only loop dims; the shape input is a shape argument")
def _expand(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    if x.rank > y.rank:
        return None
    names = labels(y.rank)
    offset = y.rank - x.rank
    xs = " ".join(names[offset + d] if e == y.shape[offset + d] else "1" for d, e in enumerate(x.shape))
    return b.einsum(f"{xs}, - -> {' '.join(names)}", shape_args={1: 0})


@register("Tile", flops=zero_flops,
          notes="a tiled output dim is (repeats d), repeats outer and whole: splitting d splits the "
                "output strided; the repeats input is replicated")
def _tile(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    if x.rank != y.rank or 0 in x.shape:
        return None
    names = labels(x.rank)
    sizes, out = {}, []
    for d, (e, f) in enumerate(zip(x.shape, y.shape)):
        if f % e:
            return None
        if f == e:
            out.append(names[d])
        else:
            sizes[f"_t{d}"] = f // e
            out.append(f"(_t{d} {names[d]})")
    return b.einsum(f"{' '.join(names)}, - -> {' '.join(out)}", sizes=sizes)


@register("Concat", flops=zero_flops,
          notes="equal parts: the output axis is (parts q) and q splits, strided in the output "
                "(Rhino 4.1); unequal parts: the axis is whole")
def _concat(node: Node, b: RuleBuilder) -> ShardingRule | None:
    y = node.outputs[0]
    axis = axis_attr(node, y.rank)
    if axis is None:
        return None
    parts = [v for v in node.inputs if v is not None]
    names = labels(y.rank)
    if len(parts) > 1 and len({v.shape[axis] for v in parts}) == 1:
        q = names[axis]
        part = " ".join(names)
        whole = " ".join(f"(_p {q})" if d == axis else names[d] for d in range(y.rank))
        ins = [part if v is not None else "-" for v in node.inputs]
        return b.einsum(", ".join(ins) + " -> " + whole, sizes={"_p": len(parts)})

    def spec() -> str:
        return " ".join("_" if d == axis else names[d] for d in range(y.rank))
    ins = [spec() if v is not None else "-" for v in node.inputs]
    return b.einsum(", ".join(ins) + " -> " + spec())


@register("Split", flops=zero_flops,
          notes="equal parts: the input axis is (parts q) and q splits, strided in the input, so a "
                "fused QKV projection splits per head group (Rhino 4.1); unequal parts: whole")
def _split(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    axis = axis_attr(node, x.rank)
    if axis is None:
        return None
    names = labels(x.rank)
    outs = [v for v in node.outputs if v.name]
    if len(outs) == len(node.outputs) > 1 and len({v.shape[axis] for v in outs}) == 1:
        q = names[axis]
        whole = " ".join(f"(_p {q})" if d == axis else names[d] for d in range(x.rank))
        part = " ".join(names)
        return b.einsum(f"{whole}, - -> " + ", ".join(part for _ in outs), sizes={"_p": len(outs)},
                        size_args={1: axis} if node.input(1) is not None else None)

    def spec() -> str:
        return " ".join("_" if d == axis else names[d] for d in range(x.rank))
    return b.einsum(f"{spec()}, - -> " + ", ".join(spec() for _ in node.outputs))


@register("Slice", flops=zero_flops, notes="sliced axes are whole (an axis taken whole with step 1 "
                                           "is not sliced); starts/ends/axes/steps replicated")
def _slice(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    if x.rank != y.rank:
        return None
    if node.attr("starts") is not None:  # opset < 10: attributes
        axes = node.attr("axes") or list(range(len(node.attr("starts"))))
        steps: list[int] | None = [1] * len(axes)
    else:
        starts = node.input(1)
        assert starts is not None
        if node.input(3) is not None:
            axes = const_ints(node, 3)
            if axes is None:
                return same_dims_except(node, b, set(range(x.rank)))
        else:
            axes = list(range(starts.shape[0] if starts.rank else 1))
        steps = const_ints(node, 4) if node.input(4) is not None else [1] * len(axes)
    if any(not -x.rank <= a < x.rank for a in axes):
        return None
    sliced = set()
    for i, a in enumerate(axes):
        d = a % x.rank
        if steps is None or i >= len(steps) or steps[i] != 1 or x.shape[d] != y.shape[d]:
            sliced.add(d)
    return same_dims_except(node, b, sliced)


@register("Pad", flops=zero_flops, notes="padded axes are whole")
def _pad(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    pads = node.attr("pads")
    if pads is None:
        pads = const_ints(node, 1)
    if node.input(3) is not None:
        axes = const_ints(node, 3)
    else:
        axes = list(range(x.rank))
    if pads is None or axes is None:
        return same_dims_except(node, b, set(range(x.rank)))
    if len(pads) != 2 * len(axes) or any(not -x.rank <= a < x.rank for a in axes):
        return None
    padded = {a % x.rank for i, a in enumerate(axes) if pads[i] or pads[i + len(axes)]}
    return same_dims_except(node, b, padded)


@register("ConstantOfShape", flops=zero_flops,
          notes="every output dim is a loop dim; the shape input is a shape argument")
def _constant_of_shape(node: Node, b: RuleBuilder) -> ShardingRule | None:
    y = node.outputs[0]
    return b.einsum(f"- -> {' '.join(labels(y.rank))}", shape_args={0: 0})


@register("Range", flops=zero_flops, notes="unsplittable")
def _range(node: Node, b: RuleBuilder) -> ShardingRule | None:
    return b.einsum("-, -, - -> _")


@register("Trilu", flops=zero_flops, notes="the last two dims are whole")
def _trilu(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    if x.rank < 2:
        return None
    return same_dims_except(node, b, {x.rank - 2, x.rank - 1})
