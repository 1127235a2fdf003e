"""Helpers shared by the gradient rules: inputs, constant arguments, zeros, reductions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import numpy as np
from onnx import helper

from parc.autodiff.context import GradContext
from parc.errors import UnsupportedOpError
from parc.ir.graph import Node, Value
from parc.ops.base import axes_of, const_ints

Grads = list[Value | None]


def inp(node: Node, i: int) -> Value:
    v = node.input(i)
    assert v is not None, f"{node.label}: input {i} is absent"
    return v


def unsupported(node: Node, why: str) -> NoReturn:
    """A configuration a rule cannot differentiate correctly: say so rather than guess."""
    raise UnsupportedOpError(f"node '{node.label}' ({node.op_type}): no gradient rule for {why}")


def const_arg(node: Node, i: int, what: str) -> list[int] | None:
    """Input i as ints; None when absent; unsupported when computed at run time."""
    if node.input(i) is None:
        return None
    values = const_ints(node, i)
    if values is None:
        unsupported(node, f"a {what} computed at run time (input {i})")
    return values


def zeros(ctx: GradContext, shape: Sequence[int], like: Value) -> Value:
    """A zero tensor of `like`'s dtype (ConstantOfShape: nothing stored in the model)."""
    assert like.dtype is not None
    return ctx.op("ConstantOfShape", [ctx.ints(list(shape))],
                  value=helper.make_tensor("zero", like.dtype.onnx_type, [1], [0]))


def ones(ctx: GradContext, shape: Sequence[int], like: Value) -> Value:
    assert like.dtype is not None
    return ctx.op("ConstantOfShape", [ctx.ints(list(shape))],
                  value=helper.make_tensor("one", like.dtype.onnx_type, [1], [1]))


def mask(ctx: GradContext, cond: Value, g: Value) -> Value:
    """g where cond holds, else 0."""
    return ctx.op("Where", [cond, g, ctx.scalar(0, g)])


def as_float(ctx: GradContext, cond: Value, like: Value) -> Value:
    """A boolean tensor as 0/1 of `like`'s dtype."""
    return ctx.op("Cast", [cond], to=like.dtype.onnx_type)  # type: ignore[union-attr]


def reduce_axes(node: Node) -> list[int]:
    """The axes a Reduce* node reduces (sorted, non-negative); all of them when none are given.

    noop_with_empty_axes with no axes is left unsupported: what it computes differs between
    ReduceL1-style ops and runtimes."""
    x = inp(node, 0)
    axes = axes_of(node)
    if axes is None and node.input(1) is not None:
        unsupported(node, "axes computed at run time")
    if not axes:
        if node.attr("noop_with_empty_axes", 0):
            unsupported(node, "noop_with_empty_axes with no axes")
        return list(range(x.rank))
    return axes


def kept(shape: Sequence[int], axes: Sequence[int]) -> tuple[int, ...]:
    """The shape of a keepdims=1 reduction of `shape` over `axes`."""
    return tuple(1 if d in axes else int(s) for d, s in enumerate(shape))


def sum_over(ctx: GradContext, g: Value, axes: Sequence[int], keepdims: int = 0) -> Value:
    return ctx.op("ReduceSum", [g, ctx.ints(list(axes))], keepdims=keepdims) if axes else g


def channel_shape(x: Value) -> tuple[int, ...]:
    """[1, C, 1, ...]: a per-channel vector broadcast against NC... `x`."""
    assert x.shape is not None
    return (1, int(x.shape[1])) + (1,) * (x.rank - 2)


def expand_along(ctx: GradContext, idx: np.ndarray, axis: int, shape: Sequence[int]) -> Value:
    """Constant indices `idx` along `axis`, broadcast to `shape` (ScatterElements' index)."""
    view = [1] * len(shape)
    view[axis] = len(idx)
    small = ctx.const(np.asarray(idx, np.int64).reshape(view))
    if tuple(view) == tuple(shape):
        return small
    return ctx.op("Expand", [small, ctx.ints(list(shape))])


def scatter_axis(ctx: GradContext, g: Value, axis: int, idx: np.ndarray, dim: int,
                 add: bool = True) -> Value:
    """The adjoint of taking positions `idx` along `axis` of a length-`dim` axis: slice k of g
    goes to position idx[k] (summed where idx repeats, when `add`)."""
    assert g.shape is not None
    shape = list(g.shape)
    shape[axis] = dim
    if len(idx) == 0 or 0 in shape:
        return zeros(ctx, shape, g)
    if list(idx) == list(range(dim)):
        return g
    index = expand_along(ctx, idx, axis, g.shape)
    return ctx.op("ScatterElements", [zeros(ctx, shape, g), index, g], axis=axis,
                  reduction="add" if add else None)
