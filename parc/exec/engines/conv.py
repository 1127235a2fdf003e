"""Convolution and pooling kernels over any number of spatial dims.

A convolution is im2col and one batched matmul: for each kernel offset, the strided slice of
the padded input that offset sees is one column block. ConvTranspose is the reverse: one matmul
to columns, then each kernel offset's block is added into the output at its strided positions.
Pools reduce the same per-offset slices. Every step is an xp slice, stack, matmul or add.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from parc.exec.engines.kernels import Kernel, Maker, NodeInfo, Unsupported

_AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def _window(offset, dilations, strides, out) -> tuple[slice, ...]:
    """The slice of the padded input seen by kernel offset `offset` at every output position."""
    return (slice(None), slice(None), *(
        slice(k * d, k * d + s * (o - 1) + 1, s) for k, d, s, o in zip(offset, dilations, strides, out)))


def _same_pads(total: int, auto_pad: str) -> tuple[int, int]:
    begin = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
    return begin, total - begin


class _Geometry:
    """Spatial attributes of a conv or pool node, with their defaults."""

    def __init__(self, n: NodeInfo) -> None:
        self.auto_pad = n.attr("auto_pad", "NOTSET")
        if self.auto_pad not in _AUTO_PADS:
            raise Unsupported(f"auto_pad={self.auto_pad!r}")
        self.kernel = n.attr("kernel_shape")
        self.n = n
        self.ceil_mode = n.attr("ceil_mode", 0)

    def resolve(self, in_sp: tuple[int, ...], kernel: tuple[int, ...]):
        """(output sizes, pads at the start, at the end, the overhang ceil_mode adds at the end,
        strides, dilations)."""
        r = len(in_sp)
        strides = self.n.attr("strides") or [1] * r
        dilations = self.n.attr("dilations") or [1] * r
        span = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
        if self.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out = [-(-i // s) for i, s in zip(in_sp, strides)]
            begin, end = zip(*(_same_pads(max((o - 1) * s + w - i, 0), self.auto_pad)
                               for o, s, w, i in zip(out, strides, span, in_sp)))
        else:
            pads = [0] * 2 * r if self.auto_pad == "VALID" else (self.n.attr("pads") or [0] * 2 * r)
            begin, end = pads[:r], pads[r:]
            out = []
            for i, b, e, w, s in zip(in_sp, begin, end, span, strides):
                size = i + b + e - w
                o = (-(-size // s) if self.ceil_mode else size // s) + 1
                if self.ceil_mode and (o - 1) * s >= i + b:
                    o -= 1  # the last window must start inside the input or its start padding
                out.append(o)
        extra = [max((o - 1) * s + w - (i + b + e), 0)
                 for o, s, w, i, b, e in zip(out, strides, span, in_sp, begin, end)]
        return out, list(begin), list(end), extra, strides, dilations


def _pad(xp, x, begin, end, fill=0):
    if not any(begin) and not any(end):
        return x
    return xp.pad(x, [(0, 0), (0, 0), *zip(begin, end)], mode="constant", constant_values=fill)


def make_conv(n: NodeInfo) -> Kernel:
    xp, group, geo = n.xp, n.attr("group", 1), _Geometry(n)

    def conv(x, w, b=None):
        N, C, M, kernel = x.shape[0], x.shape[1], w.shape[0], w.shape[2:]
        out, begin, end, _, strides, dilations = geo.resolve(x.shape[2:], kernel)
        L, K = math.prod(out), math.prod(kernel)
        if K == 1 and not any(begin) and not any(end) and all(s == 1 for s in strides):
            cols = x
        else:
            xpad = _pad(xp, x, begin, end)
            cols = xp.stack([xpad[_window(k, dilations, strides, out)]
                             for k in itertools.product(*map(range, kernel))], axis=2)
        cols = cols.reshape(N, group, (C // group) * K, L)
        y = xp.matmul(w.reshape(group, M // group, (C // group) * K), cols).reshape(N, M, *out)
        return (y if b is None else y + b.reshape(M, *[1] * len(out)),)
    return conv


def make_conv_transpose(n: NodeInfo) -> Kernel:
    xp, group, geo = n.xp, n.attr("group", 1), _Geometry(n)
    output_shape, output_padding = n.attr("output_shape"), n.attr("output_padding")

    def conv_transpose(x, w, b=None):
        N, C, in_sp, kernel = x.shape[0], x.shape[1], x.shape[2:], w.shape[2:]
        r, M = len(in_sp), w.shape[1] * group
        strides = n.attr("strides") or [1] * r
        dilations = n.attr("dilations") or [1] * r
        extra = output_padding or [0] * r
        full = [(i - 1) * s + (k - 1) * d + 1 + p
                for i, s, k, d, p in zip(in_sp, strides, kernel, dilations, extra)]
        if output_shape is not None or geo.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            want = output_shape[-r:] if output_shape is not None else [i * s for i, s in zip(in_sp, strides)]
            totals = [f - o for f, o in zip(full, want)]
            if geo.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
                begin, end = zip(*(_same_pads(t, geo.auto_pad) for t in totals))
            else:
                begin = [int(t / 2) for t in totals]  # as onnxruntime: the odd one at the end
                end = [t - b for t, b in zip(totals, begin)]
        else:
            pads = n.attr("pads") or [0] * 2 * r
            begin, end = pads[:r], pads[r:]
        K, L = math.prod(kernel), math.prod(in_sp)
        wt = w.reshape(group, C // group, (M // group) * K).transpose(0, 2, 1)
        cols = xp.matmul(wt, x.reshape(N, group, C // group, L)).reshape(N, M, K, *in_sp)
        y = xp.zeros((N, M, *full), dtype=x.dtype)
        for j, k in enumerate(itertools.product(*map(range, kernel))):
            y[_window(k, dilations, strides, in_sp)] += cols[:, :, j]
        # Negative pads (an output_shape larger than the full result) add zeros.
        y = _pad(xp, y, [max(-p, 0) for p in begin], [max(-p, 0) for p in end])
        y = y[(slice(None), slice(None), *(slice(max(p, 0), y.shape[2 + i] - max(q, 0))
                                           for i, (p, q) in enumerate(zip(begin, end))))]
        return (y if b is None else y + b.reshape(M, *[1] * r),)
    return conv_transpose


def _views(xpad, kernel, dilations, strides, out):
    return [xpad[_window(k, dilations, strides, out)] for k in itertools.product(*map(range, kernel))]


def make_max_pool(n: NodeInfo) -> Kernel:
    xp, geo, want_indices = n.xp, _Geometry(n), n.wants_output(1)
    column_major = n.attr("storage_order", 0) == 1
    index_cache: dict[tuple, object] = {}

    def spatial_indices(in_sp, kernel, out, begin, strides, dilations):
        """Flat input position (within one channel) per kernel offset and output position."""
        key = (in_sp, tuple(out))
        if key not in index_cache:
            if column_major:
                place = [math.prod(in_sp[:i]) for i in range(len(in_sp))]
            else:
                place = [math.prod(in_sp[i + 1:]) for i in range(len(in_sp))]
            grids = []
            for k in itertools.product(*map(range, kernel)):
                coords = np.meshgrid(*(np.arange(o) * s - b + kk * d for o, s, b, kk, d in
                                       zip(out, strides, begin, k, dilations)), indexing="ij")
                grids.append(sum(c * p for c, p in zip(coords, place)))
            index_cache[key] = xp.asarray(np.stack(grids).astype(np.int64))
        return index_cache[key]

    def max_pool(x):
        kernel = tuple(geo.kernel)
        out, begin, end, extra, strides, dilations = geo.resolve(x.shape[2:], kernel)
        fill = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
        xpad = _pad(xp, x, begin, [e + x_ for e, x_ in zip(end, extra)], fill)
        views = _views(xpad, kernel, dilations, strides, out)
        if not want_indices:
            return (functools.reduce(xp.maximum, views), None)
        stack = xp.stack(views)
        arg = xp.argmax(stack, axis=0)[None]  # the first maximum, as onnxruntime
        y = xp.take_along_axis(stack, arg, axis=0)[0]
        sp = spatial_indices(x.shape[2:], kernel, out, begin, strides, dilations)
        sp = xp.broadcast_to(sp.reshape(sp.shape[0], 1, 1, *out), stack.shape)
        plane = xp.arange(x.shape[0] * x.shape[1], dtype=xp.int64).reshape(
            x.shape[0], x.shape[1], *[1] * len(out)) * math.prod(x.shape[2:])
        return (y, xp.take_along_axis(sp, arg, axis=0)[0] + plane)
    return max_pool


def make_average_pool(n: NodeInfo) -> Kernel:
    xp, geo, include_pad = n.xp, _Geometry(n), n.attr("count_include_pad", 0)
    count_cache: dict[tuple, object] = {}

    def average_pool(x):
        kernel = tuple(geo.kernel)
        in_sp = x.shape[2:]
        out, begin, end, extra, strides, dilations = geo.resolve(in_sp, kernel)
        end_all = [e + x_ for e, x_ in zip(end, extra)]
        key = in_sp
        if key not in count_cache:
            # How many elements each window averages: the input's, and the pads' if counted,
            # never the overhang that ceil_mode adds.
            ones = np.ones((1, 1, *in_sp))
            if include_pad:
                ones = np.pad(ones, [(0, 0), (0, 0), *zip(begin, end)], constant_values=1)
                ones = np.pad(ones, [(0, 0), (0, 0), *[(0, e) for e in extra]])
            else:
                ones = np.pad(ones, [(0, 0), (0, 0), *zip(begin, end_all)])
            count = sum(_views(ones, kernel, dilations, strides, out))
            count_cache[key] = xp.asarray(count.astype(x.dtype))
        total = sum(_views(_pad(xp, x, begin, end_all), kernel, dilations, strides, out))
        return (total / count_cache[key],)
    return average_pool


def make_lp_pool(n: NodeInfo) -> Kernel:
    xp, geo, p = n.xp, _Geometry(n), n.attr("p", 2)

    def lp_pool(x):
        kernel = tuple(geo.kernel)
        out, begin, end, extra, strides, dilations = geo.resolve(x.shape[2:], kernel)
        xpad = _pad(xp, xp.abs(x) ** p, begin, [e + x_ for e, x_ in zip(end, extra)])
        return ((sum(_views(xpad, kernel, dilations, strides, out)) ** (1.0 / p)).astype(x.dtype),)
    return lp_pool


def make_global_pool(reduce: str) -> Maker:
    def make(n: NodeInfo) -> Kernel:
        fn = getattr(n.xp, reduce)
        return lambda x: (fn(x, axis=tuple(range(2, x.ndim)), keepdims=True),)
    return make


KERNELS: dict[str, Maker] = {
    "Conv": make_conv, "ConvTranspose": make_conv_transpose, "MaxPool": make_max_pool,
    "AveragePool": make_average_pool, "LpPool": make_lp_pool,
    "GlobalAveragePool": make_global_pool("mean"), "GlobalMaxPool": make_global_pool("max"),
}
