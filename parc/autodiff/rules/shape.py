"""Gradients of data-movement ops: Slice, Pad, Tile, DepthToSpace, SpaceToDepth.

Each is a fixed selection of input elements (by static shapes and constant arguments), so
its gradient puts every output gradient back where the element came from: Pad for unit-step
slices, ScatterElements along one axis for strided or reversed ones and for reflect/edge/wrap
padding (summing where an element was used twice).
"""

from __future__ import annotations

import numpy as np

from parc.autodiff.context import GradContext
from parc.autodiff.rules.base import grad
from parc.autodiff.rules.common import Grads, const_arg, inp, scatter_axis, sum_over, unsupported, zeros
from parc.ir.graph import Node, Value


def _rest(node: Node) -> list[None]:
    return [None] * (len(node.inputs) - 1)


def _picked(start: int, end: int, step: int, dim: int) -> range:
    """The positions Slice takes along one axis, clamped as ONNX says (unlike Python's slices,
    a backward slice starting before the axis starts at its first element)."""
    start, end = start + dim if start < 0 else start, end + dim if end < 0 else end
    if step > 0:
        return range(min(max(start, 0), dim), min(max(end, 0), dim), step)
    return range(min(max(start, 0), dim - 1), min(max(end, -1), dim - 1), step)


@grad("Slice")
def _slice(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x, dy = inp(node, 0), dys[0]
    assert dy is not None
    starts = const_arg(node, 1, "slice start")
    ends = const_arg(node, 2, "slice end")
    assert starts is not None and ends is not None
    axes = const_arg(node, 3, "slice axis") or list(range(len(starts)))
    steps = const_arg(node, 4, "slice step") or [1] * len(starts)
    picks = {a % x.rank: _picked(s, e, st, x.shape[a % x.rank]) for s, e, a, st in zip(starts, ends, axes, steps)}
    if any(len(r) == 0 for r in picks.values()):
        return [zeros(ctx, x.shape, x)] + _rest(node)
    g = dy
    pads = [0] * (2 * x.rank)
    for a, r in sorted(picks.items()):
        if r.step == 1:
            pads[a], pads[a + x.rank] = r.start, x.shape[a] - r.stop
        else:
            g = scatter_axis(ctx, g, a, np.array(r), x.shape[a], add=False)
    if any(pads):
        g = ctx.op("Pad", [g, ctx.ints(pads)], mode="constant")
    return [g] + _rest(node)


def _pads(node: Node, x: Value) -> list[tuple[int, int]]:
    """(before, after) per axis of x from Pad's pads and optional axes inputs."""
    pads = const_arg(node, 1, "pad amount")
    assert pads is not None
    axes = const_arg(node, 3, "pad axis")
    axes = [a % x.rank for a in axes] if axes is not None else list(range(x.rank))
    out = [(0, 0)] * x.rank
    for i, a in enumerate(axes):
        out[a] = (pads[i], pads[i + len(axes)])
    return out


@grad("Pad")
def _pad(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """constant: the adjoint is Pad by the negated amounts (a crop, or zeros where the forward
    cropped); constant_value gets what fell on padding. reflect/edge/wrap: scatter-add back."""
    x, dy = inp(node, 0), dys[0]
    assert dy is not None
    mode = node.attr("mode", "constant")
    per_axis = _pads(node, x)
    result: list[Value | None] = [None] * len(node.inputs)
    if mode == "constant":
        neg = [-b for b, _ in per_axis] + [-e for _, e in per_axis]
        dx = ctx.op("Pad", [dy, ctx.ints(neg)], mode="constant") if any(neg) else dy
        result[0] = dx if ctx.need(0) else None
        c = node.input(2)
        if c is not None and ctx.need(2):
            everything = sum_over(ctx, dy, list(range(dy.rank)))
            kept_x = sum_over(ctx, dx, list(range(x.rank)))
            result[2] = ctx.reshape(ctx.op("Sub", [everything, kept_x]), c.shape)  # type: ignore[arg-type]
        return result
    if mode not in ("reflect", "edge", "wrap"):
        unsupported(node, f"mode={mode!r}")
    g = dy
    for a, (b, e) in enumerate(per_axis):
        if b == 0 and e == 0:
            continue
        n = x.shape[a]
        src = np.pad(np.arange(n), (max(b, 0), max(e, 0)), mode=mode)
        src = src[max(-b, 0): len(src) - max(-e, 0)]
        g = scatter_axis(ctx, g, a, src, n)
    result[0] = g
    return result


@grad("Tile")
def _tile(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    """Sum the copies: dy viewed as [r0, d0, r1, d1, ...] summed over the r axes."""
    x, dy = inp(node, 0), dys[0]
    assert dy is not None
    repeats = const_arg(node, 1, "repeat count")
    assert repeats is not None
    if all(r == 1 for r in repeats):
        return [dy, None]
    view = [v for r, d in zip(repeats, x.shape) for v in (r, d)]
    g = ctx.op("ReduceSum", [ctx.reshape(dy, tuple(view)), ctx.ints(list(range(0, 2 * x.rank, 2)))], keepdims=0)
    return [ctx.reshape(g, x.shape), None]  # type: ignore[arg-type]


def _space_layout(node: Node, x: Value) -> tuple[list[int], list[int]]:
    """DepthToSpace / SpaceToDepth as reshape(view) -> transpose(perm) -> reshape(output)."""
    n, c, h, w = x.shape  # type: ignore[misc]
    b = node.attr("blocksize")
    if node.op_type == "SpaceToDepth":
        return [n, c, h // b, b, w // b, b], [0, 3, 5, 1, 2, 4]
    if node.attr("mode", "DCR") == "DCR":
        return [n, b, b, c // (b * b), h, w], [0, 3, 4, 1, 5, 2]
    return [n, c // (b * b), b, b, h, w], [0, 1, 4, 2, 5, 3]


@grad("DepthToSpace", "SpaceToDepth")
def _depth_to_space(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x, dy = inp(node, 0), dys[0]
    assert dy is not None
    view, perm = _space_layout(node, x)
    moved = tuple(view[p] for p in perm)
    g = ctx.op("Transpose", [ctx.reshape(dy, moved)], perm=[int(i) for i in np.argsort(perm)])
    return [ctx.reshape(g, x.shape)]  # type: ignore[arg-type]
