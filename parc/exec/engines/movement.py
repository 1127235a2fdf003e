"""Kernels that reshape, slice, join, pad or generate tensors, and pass-throughs (Dropout)."""

from __future__ import annotations

import math

import numpy as np

from parc.exec.engines.elementwise import DTYPES, dtype_of
from parc.exec.engines.kernels import Kernel, Maker, NodeInfo, Unsupported, norm_axes, norm_axis


def _arg_or_attr(n: NodeInfo, i: int, key: str, since: int):
    """Opset variants: an attribute before `since`, input i from then on (None when absent)."""
    if n.opset < since:
        return lambda args: n.attr(key)
    return lambda args: n.ints(args[i]) if i < len(args) and args[i] is not None else None


def make_reshape(n: NodeInfo) -> Kernel:
    if n.opset < 5:
        raise Unsupported("shape as an attribute (opset < 5)")
    allowzero = n.attr("allowzero", 0)
    fixed = n.const(1)
    fixed = None if fixed is None else [int(d) for d in fixed.reshape(-1)]

    def reshape(x, shape):
        dims = fixed if fixed is not None else n.ints(shape)
        if not allowzero:
            dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
        return (x.reshape(dims),)
    return reshape


def make_transpose(n: NodeInfo) -> Kernel:
    xp, perm = n.xp, n.attr("perm")
    return lambda x: (xp.transpose(x, perm),)


def make_expand(n: NodeInfo) -> Kernel:
    xp = n.xp

    def expand(x, shape):
        return (xp.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(n.ints(shape)))),)
    return expand


def make_concat(n: NodeInfo) -> Kernel:
    xp, axis = n.xp, n.attr("axis")
    return lambda *xs: (xp.concatenate(xs, axis=axis),)


def make_split(n: NodeInfo) -> Kernel:
    axis, k = n.attr("axis", 0), len(n.outputs)
    given = _arg_or_attr(n, 1, "split", 13)
    count = n.attr("num_outputs")

    def split(*args):
        x = args[0]
        a = norm_axis(axis, x.ndim)
        dim = x.shape[a]
        sizes = given(args)
        if sizes is None and count is not None:
            chunk = -(-dim // count)  # ONNX 18: the last chunk is the smaller one
            sizes = [chunk] * (count - 1) + [dim - chunk * (count - 1)]
        elif sizes is None:
            if dim % k:
                raise ValueError(f"dim {dim} does not split evenly into {k} outputs")
            sizes = [dim // k] * k
        if sum(sizes) != dim:
            raise ValueError(f"split sizes {sizes} do not add up to dim {dim}")
        lead, start, parts = (slice(None),) * a, 0, []
        for s in sizes:
            parts.append(x[(*lead, slice(start, start + s))])
            start += s
        return parts
    return split


def make_slice(n: NodeInfo) -> Kernel:
    def slice_(x, starts=None, ends=None, axes=None, steps=None):
        if n.opset < 10:
            st, en, ax, sp = n.attr("starts"), n.attr("ends"), n.attr("axes"), None
        else:
            st, en = n.ints(starts), n.ints(ends)
            ax = None if axes is None else n.ints(axes)
            sp = None if steps is None else n.ints(steps)
        ax = range(len(st)) if ax is None else ax
        sp = [1] * len(st) if sp is None else sp
        index = [slice(None)] * x.ndim
        for a, s, e, p in zip(ax, st, en, sp):
            index[norm_axis(a, x.ndim)] = slice(s, e, p)  # Python's clamping is ONNX's
        return (x[tuple(index)],)
    return slice_


def make_squeeze(n: NodeInfo) -> Kernel:
    axes_of = _arg_or_attr(n, 1, "axes", 13)

    def squeeze(*args):
        x, axes = args[0], axes_of(args)
        drop = (set(norm_axes(axes, x.ndim)) if axes is not None
                else {i for i, d in enumerate(x.shape) if d == 1})
        return (x.reshape([d for i, d in enumerate(x.shape) if i not in drop]),)
    return squeeze


def make_unsqueeze(n: NodeInfo) -> Kernel:
    axes_of = _arg_or_attr(n, 1, "axes", 13)

    def unsqueeze(*args):
        x, axes = args[0], axes_of(args)
        rank = x.ndim + len(axes)
        new = set(norm_axes(axes, rank))
        dims = iter(x.shape)
        return (x.reshape([1 if i in new else next(dims) for i in range(rank)]),)
    return unsqueeze


def make_flatten(n: NodeInfo) -> Kernel:
    axis = n.attr("axis", 1)

    def flatten(x):
        a = norm_axis(axis, x.ndim)
        return (x.reshape(math.prod(x.shape[:a]), math.prod(x.shape[a:])),)
    return flatten


def make_shape(n: NodeInfo) -> Kernel:
    xp, start, end = n.xp, n.attr("start", 0), n.attr("end")
    return lambda x: (xp.asarray(x.shape[start:end], dtype=xp.int64),)


def make_size(n: NodeInfo) -> Kernel:
    xp = n.xp
    return lambda x: (xp.asarray(x.size, dtype=xp.int64),)


def make_constant(n: NodeInfo) -> Kernel:
    (key, value), = n.attrs.items()
    if key in ("value_string", "value_strings", "sparse_value"):
        raise Unsupported(f"attribute {key}")
    if key == "value":
        _check_dtype(value, "value")
    dtype = {"value_float": np.float32, "value_floats": np.float32,
             "value_int": np.int64, "value_ints": np.int64}.get(key)
    array = n.xp.asarray(np.asarray(value, dtype=dtype))
    return lambda: (array,)


def _check_dtype(value: np.ndarray, what: str) -> None:
    if value.dtype not in DTYPES.values():
        raise Unsupported(f"{what} of dtype {value.dtype}")


def make_constant_of_shape(n: NodeInfo) -> Kernel:
    xp, value = n.xp, n.attr("value", np.zeros(1, np.float32))
    _check_dtype(value, "value")
    fill = value.reshape(-1)[0].item()
    return lambda shape: (xp.full(n.ints(shape), fill, dtype=value.dtype),)


def make_range(n: NodeInfo) -> Kernel:
    xp = n.xp

    def range_(start, limit, delta):
        s, l_, d = (n.host(v).reshape(-1)[0].item() for v in (start, limit, delta))
        return (xp.arange(s, l_, d, dtype=start.dtype),)
    return range_


def make_tile(n: NodeInfo) -> Kernel:
    xp = n.xp
    return lambda x, repeats: (xp.tile(x, n.ints(repeats)),)


def make_pad(n: NodeInfo) -> Kernel:
    xp, mode = n.xp, n.attr("mode", "constant")
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise Unsupported(f"mode={mode!r}")

    def pad(x, pads=None, value=None, axes=None):
        if n.opset < 11:
            p, fill, ax = n.attr("pads"), n.attr("value", 0.0), None
        else:
            p = n.ints(pads)
            fill = 0 if value is None or value.size == 0 else n.host(value).reshape(-1)[0].item()
            ax = None if axes is None else [norm_axis(a, x.ndim) for a in n.ints(axes)]
        ax = list(range(x.ndim)) if ax is None else ax
        width = [[0, 0] for _ in range(x.ndim)]
        for i, a in enumerate(ax):
            width[a] = [p[i], p[i + len(ax)]]
        # Negative pads remove elements.
        x = x[tuple(slice(max(-b, 0), x.shape[d] - max(-e, 0)) for d, (b, e) in enumerate(width))]
        width = [(max(b, 0), max(e, 0)) for b, e in width]
        if mode == "constant":
            return (xp.pad(x, width, mode="constant", constant_values=fill),)
        return (xp.pad(x, width, mode=mode),)
    return pad


def make_eyelike(n: NodeInfo) -> Kernel:
    xp, k, to = n.xp, n.attr("k", 0), n.attr("dtype")
    dtype = None if to is None else dtype_of(to, "EyeLike dtype")
    return lambda x: (xp.eye(x.shape[0], x.shape[1], k, dtype=dtype or x.dtype),)


def make_depth_to_space(n: NodeInfo) -> Kernel:
    b, crd = n.attr("blocksize"), n.attr("mode", "DCR") == "CRD"

    def depth_to_space(x):
        N, C, H, W = x.shape
        if crd:
            y = x.reshape(N, C // (b * b), b, b, H, W).transpose(0, 1, 4, 2, 5, 3)
        else:
            y = x.reshape(N, b, b, C // (b * b), H, W).transpose(0, 3, 4, 1, 5, 2)
        return (y.reshape(N, C // (b * b), H * b, W * b),)
    return depth_to_space


def make_space_to_depth(n: NodeInfo) -> Kernel:
    b, crd = n.attr("blocksize"), n.attr("mode", "DCR") == "CRD"
    order = (0, 1, 3, 5, 2, 4) if crd else (0, 3, 5, 1, 2, 4)

    def space_to_depth(x):
        N, C, H, W = x.shape
        y = x.reshape(N, C, H // b, b, W // b, b).transpose(order)
        return (y.reshape(N, C * b * b, H // b, W // b),)
    return space_to_depth


def make_dropout(n: NodeInfo) -> Kernel:
    xp, want_mask = n.xp, n.wants_output(1)
    # Training mode with a nonzero ratio draws random masks: refused unless the inputs are
    # constants that rule it out (training_mode absent or false, or ratio 0).
    training, ratio = n.const(2), n.const(1)
    may_train = n.has_input(2) and (training is None or training.any())
    may_drop = n.has_input(1) and (ratio is None or ratio.any()) or not n.has_input(1)
    if n.opset >= 12 and may_train and may_drop:
        raise Unsupported("training_mode not constant false and ratio not constant 0 (random masks)")

    def dropout(x, ratio=None, training_mode=None):
        return (x, xp.ones(x.shape, dtype=bool) if want_mask else None)
    return dropout


KERNELS: dict[str, Maker] = {
    "Reshape": make_reshape, "Transpose": make_transpose, "Expand": make_expand,
    "Concat": make_concat, "Split": make_split, "Slice": make_slice, "Squeeze": make_squeeze,
    "Unsqueeze": make_unsqueeze, "Flatten": make_flatten, "Shape": make_shape, "Size": make_size,
    "Constant": make_constant, "ConstantOfShape": make_constant_of_shape, "Range": make_range,
    "Tile": make_tile, "Pad": make_pad, "EyeLike": make_eyelike,
    "DepthToSpace": make_depth_to_space, "SpaceToDepth": make_space_to_depth,
    "Dropout": make_dropout,
}
