"""Convolutions, pools and resampling: batch and channels are loop dims, spatial dims stay whole."""

from __future__ import annotations

import math
from dataclasses import replace

from parc.ir.graph import Node
from parc.ops.base import (
    RuleBuilder,
    ShardingRule,
    const_array,
    labels,
    register,
    same_dims_except,
    zero_flops,
)


def _spatial(rank: int) -> str:
    return " ".join(["_"] * (rank - 2))


def _conv_flops(node: Node) -> int:
    w, y = node.inputs[1], node.outputs[0]
    assert w is not None
    per_output = 2 * math.prod(w.shape[1:])  # (C/g) * kernel, multiply-add
    return y.size * per_output + (y.size if node.input(2) is not None else 0)


@register("Conv", flops=_conv_flops,
          notes="channels are (g cg) in X and (g mg) in W and Y; cg is reduced by sum, but is "
                "unsplittable when a bias is added (it would be added once per shard); g stays "
                "whole because a shard would need group=g/n")
def _conv(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x, w, bias = node.input(0), node.input(1), node.input(2)
    assert x is not None and w is not None
    if x.rank < 3 or w.rank != x.rank:
        return None
    g = int(node.attr("group", 1))
    if g < 1 or x.shape[1] % g or w.shape[0] % g:
        return None
    sp = _spatial(x.rank)
    chan_x = "(_g cg)" if g > 1 else "cg"
    chan_y = "(_g mg)" if g > 1 else "mg"
    spec = f"n {chan_x} {sp}, {chan_y} cg {_spatial(w.rank)}, {chan_y if bias is not None else '-'} -> n {chan_y} {sp}"
    return b.einsum(spec, reduce={"cg": "sum"}, sizes={"_g": g} if g > 1 else None,
                    unsplittable=["cg"] if bias is not None else [])


def _conv_transpose_flops(node: Node) -> int:
    x, w = node.inputs[0], node.inputs[1]
    assert x is not None and w is not None
    return 2 * x.size * math.prod(w.shape[1:]) + (node.outputs[0].size if node.input(2) is not None else 0)


@register("ConvTranspose", flops=_conv_transpose_flops,
          notes="X is n (g cg) ..., W is (g cg) mg ..., Y is n (g mg) ...; cg reduced by sum "
                "(unsplittable with a bias), g whole (a shard would need group=g/n)")
def _conv_transpose(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x, w, bias = node.input(0), node.input(1), node.input(2)
    assert x is not None and w is not None
    if x.rank < 3 or w.rank != x.rank:
        return None
    g = int(node.attr("group", 1))
    if g < 1 or x.shape[1] % g or w.shape[0] != x.shape[1]:
        return None
    out_shape = node.attr("output_shape")
    if out_shape is not None and len(out_shape) != x.rank - 2:
        return None  # a full-rank output_shape would pin N and M
    sp = _spatial(x.rank)
    chan_x = "(_g cg)" if g > 1 else "cg"
    chan_y = "(_g mg)" if g > 1 else "mg"
    spec = f"n {chan_x} {sp}, {chan_x} mg {_spatial(w.rank)}, {chan_y if bias is not None else '-'} -> n {chan_y} {sp}"
    return b.einsum(spec, reduce={"cg": "sum"}, sizes={"_g": g} if g > 1 else None,
                    unsplittable=["cg"] if bias is not None else [])


def _window_flops(node: Node) -> int:
    kernel = node.attr("kernel_shape") or []
    return node.outputs[0].size * max(1, math.prod(kernel))


@register("MaxPool", flops=_window_flops,
          notes="with the Indices output, nothing splits: indices are flat offsets into the whole "
                "input (batch and channel included)")
def _max_pool(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    if x.rank < 3:
        return None
    sp = _spatial(x.rank)
    if len(node.outputs) > 1:
        return b.einsum(f"_ _ {sp} -> _ _ {sp}, _ _ {sp}")
    return b.einsum(f"n c {sp} -> n c {sp}")


@register("AveragePool", "LpPool", flops=_window_flops)
def _pool(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    if x.rank < 3:
        return None
    sp = _spatial(x.rank)
    return b.einsum(f"n c {sp} -> n c {sp}")


def _global_flops(node: Node) -> int:
    x = node.inputs[0]
    assert x is not None
    return x.size


def _global(kind: str | None):
    def rule(node: Node, b: RuleBuilder) -> ShardingRule | None:
        x = node.inputs[0]
        assert x is not None
        if x.rank < 3:
            return None
        sp = [f"s{i}" for i in range(x.rank - 2)]
        ones = " ".join(["1"] * len(sp))
        if kind is None:
            return b.einsum(f"n c {' '.join(sp)} -> n c {ones}", unsplittable=sp)
        return b.einsum(f"n c {' '.join(sp)} -> n c {ones}", reduce={s: kind for s in sp})
    return rule


register("GlobalAveragePool", flops=_global_flops,
         notes="spatial dims reduced by mean (shards hold equal pieces)")(_global("mean"))
register("GlobalMaxPool", flops=_global_flops, notes="spatial dims reduced by max")(_global("max"))


@register("GlobalLpPool", flops=_global_flops, notes="spatial dims whole, except p=1 (a sum)")
def _global_lp(node: Node, b: RuleBuilder) -> ShardingRule | None:
    return _global("sum" if node.attr("p", 2) == 1 else None)(node, b)


# Resize: coordinate modes under which a dim with scale 1 maps each output index to itself.
_IDENTITY_AT_SCALE_1 = {"half_pixel", "half_pixel_symmetric", "pytorch_half_pixel",
                        "align_corners", "asymmetric"}


@register("Resize", notes="resized dims are whole; a dim with scale exactly 1 (or outside `axes`) "
                          "is a loop dim, except under tf_crop_and_resize / tf_half_pixel_for_nn; "
                          "`sizes` (without `axes`) is a shape argument")
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
    # tf_half_pixel_for_nn samples x + 0.5 at scale 1: nearest rounding down keeps x.
    shifted = mode == "tf_half_pixel_for_nn" and node.attr("mode", "nearest") == "nearest" and \
        node.attr("nearest_mode", "round_prefer_floor") in ("round_prefer_floor", "floor")
    if mode in _IDENTITY_AT_SCALE_1 or shifted:
        for i, d in enumerate(axes):
            if scales_known and i < scales.size:  # type: ignore[union-attr]
                if float(scales.reshape(-1)[i]) == 1.0:  # type: ignore[union-attr]
                    identity.add(d)
            elif by_sizes and stretch and x.shape[d] == y.shape[d]:
                identity.add(d)  # sizes given: the scale is y/x = 1
    rule = same_dims_except(node, b, set(range(x.rank)) - identity)
    if node.input(3) is not None and node.attr("axes") is None:
        # `sizes` is the output shape: a shard needs its local one (scale 1 on split dims).
        rule = replace(rule, shape_args=((3, 0),))
    return rule


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
