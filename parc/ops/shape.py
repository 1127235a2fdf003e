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
    const_array,
    const_ints,
    labels,
    register,
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


@register("Reshape", flops=zero_flops,
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


@register("Flatten", flops=zero_flops, notes="output dims are groups of the input dims")
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


@register("Squeeze", flops=zero_flops)
def _squeeze(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    axes = node.attr("axes")
    if axes is None:
        if node.input(1) is not None:
            axes = const_ints(node, 1)
            if axes is None:
                return None
        else:
            axes = [d for d, e in enumerate(x.shape) if e == 1]
    if any(not -x.rank <= a < x.rank for a in axes):
        return None
    axes = {a % x.rank for a in axes}
    names = labels(x.rank)
    xs = " ".join("1" if d in axes else names[d] for d in range(x.rank))
    ys = " ".join(names[d] for d in range(x.rank) if d not in axes)
    return b.einsum(f"{xs}, - -> {ys}")


@register("Unsqueeze", flops=zero_flops)
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


def _axis(node: Node, rank: int, default: int = 0) -> int | None:
    axis = node.attr("axis", default)
    return axis % rank if -rank <= axis < rank else None


@register("Concat", flops=zero_flops, notes="the concatenated axis is whole")
def _concat(node: Node, b: RuleBuilder) -> ShardingRule | None:
    y = node.outputs[0]
    axis = _axis(node, y.rank)
    if axis is None:
        return None
    names = labels(y.rank)

    def spec() -> str:
        return " ".join("_" if d == axis else names[d] for d in range(y.rank))
    ins = [spec() if v is not None else "-" for v in node.inputs]
    return b.einsum(", ".join(ins) + " -> " + spec())


@register("Split", flops=zero_flops, notes="the split axis is whole")
def _split(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    axis = _axis(node, x.rank)
    if axis is None:
        return None
    names = labels(x.rank)

    def spec() -> str:
        return " ".join("_" if d == axis else names[d] for d in range(x.rank))
    return b.einsum(f"{spec()}, - -> " + ", ".join(spec() for _ in node.outputs))


def _whole_except(node: Node, b: RuleBuilder, fixed: set[int]) -> ShardingRule:
    """Input 0 and output 0 share labels except on `fixed` dims; other inputs replicated."""
    x = node.inputs[0]
    assert x is not None
    names = labels(x.rank)
    xs = " ".join("_" if d in fixed else names[d] for d in range(x.rank))
    ys = " ".join("_" if d in fixed else names[d] for d in range(x.rank))
    return b.einsum(f"{xs} -> {ys}")


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
                return _whole_except(node, b, set(range(x.rank)))
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
    return _whole_except(node, b, sliced)


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
        return _whole_except(node, b, set(range(x.rank)))
    if len(pads) != 2 * len(axes) or any(not -x.rank <= a < x.rank for a in axes):
        return None
    padded = {a % x.rank for i, a in enumerate(axes) if pads[i] or pads[i + len(axes)]}
    return _whole_except(node, b, padded)


@register("Gather", flops=zero_flops,
          notes="the gathered data axis is whole; indices dims and other data dims are loop dims")
def _gather(node: Node, b: RuleBuilder) -> ShardingRule | None:
    data, idx = node.inputs[0], node.inputs[1]
    assert data is not None and idx is not None
    axis = _axis(node, data.rank)
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
    axis = _axis(node, data.rank)
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
    data, idx, y = node.inputs[0], node.inputs[1], node.outputs[0]
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
          notes="trailing slice dims are loop dims of data, updates and output; indexed dims and "
                "the update index dims are whole")
def _scatter_nd(node: Node, b: RuleBuilder) -> ShardingRule | None:
    data, idx, upd = node.inputs[0], node.inputs[1], node.inputs[2]
    assert data is not None and idx is not None and upd is not None
    if idx.rank < 1:
        return None
    m = idx.shape[-1]
    if m > data.rank or upd.rank != idx.rank - 1 + data.rank - m:
        return None
    ts = labels(data.rank - m, "t")
    us = labels(idx.rank - 1, "_u")
    ds = " ".join(["_"] * m + ts)
    return b.einsum(f"{ds}, {' '.join(us + ['_'])}, {' '.join(us + ts)} -> {' '.join(['_'] * m + ts)}")


@register("ConstantOfShape", flops=zero_flops,
          notes="every output dim is a loop dim; the shape input is a shape argument")
def _constant_of_shape(node: Node, b: RuleBuilder) -> ShardingRule | None:
    y = node.outputs[0]
    return b.einsum(f"- -> {' '.join(labels(y.rank))}", shape_args={0: 0})


@register("Range", flops=zero_flops, notes="unsplittable")
def _range(node: Node, b: RuleBuilder) -> ShardingRule | None:
    return b.einsum("-, -, - -> _")


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


@register("Trilu", flops=zero_flops, notes="the last two dims are whole")
def _trilu(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    if x.rank < 2:
        return None
    return _whole_except(node, b, {x.rank - 2, x.rank - 1})


# Resize: coordinate modes under which a dim with scale 1 maps each output index to itself.
_IDENTITY_AT_SCALE_1 = {"half_pixel", "half_pixel_symmetric", "pytorch_half_pixel",
                        "align_corners", "asymmetric"}


@register("Resize", notes="resized dims are whole; a dim with scale exactly 1 (or outside `axes`) "
                          "is a loop dim, except under tf_crop_and_resize / tf_half_pixel_for_nn")
def _resize(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x, y = node.inputs[0], node.outputs[0]
    assert x is not None
    if x.rank != y.rank:
        return None
    axes = node.attr("axes")
    axes = list(range(x.rank)) if axes is None else [a % x.rank for a in axes]
    mode = node.attr("coordinate_transformation_mode", "half_pixel")
    scales = const_array(node, 2)
    if node.input(2) is not None and scales is None:
        scales_known = False  # computed at run time
    else:
        scales_known = scales is not None and scales.size > 0
    by_sizes = not scales_known and node.input(3) is not None and (node.input(2) is None or scales is not None)
    stretch = node.attr("keep_aspect_ratio_policy", "stretch") == "stretch"
    identity = set(range(x.rank)) - set(axes)
    if mode in _IDENTITY_AT_SCALE_1:
        for i, d in enumerate(axes):
            if scales_known and i < scales.size:  # type: ignore[union-attr]
                if float(scales.reshape(-1)[i]) == 1.0:  # type: ignore[union-attr]
                    identity.add(d)
            elif by_sizes and stretch and x.shape[d] == y.shape[d]:
                identity.add(d)  # sizes given: the scale is y/x = 1
    return _whole_except(node, b, set(range(x.rank)) - identity)


@register("DepthToSpace", "SpaceToDepth", flops=zero_flops, notes="batch is the only loop dim")
def _depth_space(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    if x.rank != 4:
        return None
    return b.einsum("n _ _ _ -> n _ _ _")


@register("GridSample", notes="batch and channel are loop dims; the grid's output positions too")
def _grid_sample(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x, grid = node.inputs[0], node.inputs[1]
    assert x is not None and grid is not None
    if x.rank < 3 or grid.rank != x.rank:
        return None
    sp = " ".join(["_"] * (x.rank - 2))
    outs = " ".join(labels(x.rank - 2, "o"))
    return b.einsum(f"n c {sp}, n {outs} _ -> n c {outs}")
