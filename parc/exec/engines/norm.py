"""Normalization kernels: layer, RMS, group, instance, batch, Lp, mean-variance, LRN."""

from __future__ import annotations

import numpy as np

from parc.exec.engines import gpu
from parc.exec.engines.kernels import Kernel, Maker, NodeInfo, Unsupported, norm_axis


def _stash(x):
    """float16 statistics are computed in float32 (stash_type 1, ONNX's default)."""
    return x.astype(np.float32) if x.dtype == np.float16 else x


def _channel(a, ndim: int):
    """A per-channel vector shaped to broadcast against [N, C, ...]."""
    return a.reshape([-1 if i == 1 else 1 for i in range(ndim)])


def make_layer_norm(n: NodeInfo) -> Kernel:
    xp, axis, eps = n.xp, n.attr("axis", -1), n.attr("epsilon", 1e-5)
    rows = xp is not np and gpu.kernels_enabled()  # parc's kernel, one thread block per row

    def layer_norm(x, scale, bias=None):
        if rows:
            out = gpu.layer_norm_last(xp, x, norm_axis(axis, x.ndim), eps, scale, bias)
            if out is not None:
                return out
        axes = tuple(range(norm_axis(axis, x.ndim), x.ndim))
        xs = _stash(x)
        mean = xp.mean(xs, axis=axes, keepdims=True)
        d = xs - mean
        inv = 1 / xp.sqrt(xp.mean(d * d, axis=axes, keepdims=True) + eps)
        y = (d * inv).astype(x.dtype, copy=False) * scale
        return (y if bias is None else y + bias, mean, inv)
    return layer_norm


def make_rms_norm(n: NodeInfo) -> Kernel:
    xp, axis, eps = n.xp, n.attr("axis", -1), n.attr("epsilon", 1e-5)

    def rms_norm(x, scale):
        axes = tuple(range(norm_axis(axis, x.ndim), x.ndim))
        xs = _stash(x)
        inv = 1 / xp.sqrt(xp.mean(xs * xs, axis=axes, keepdims=True) + eps)
        return ((xs * inv).astype(x.dtype, copy=False) * scale,)
    return rms_norm


def make_group_norm(n: NodeInfo) -> Kernel:
    xp, groups, eps = n.xp, n.attr("num_groups"), n.attr("epsilon", 1e-5)
    per_group = n.opset < 21  # opset 18 gives scale and bias per group, 21 per channel

    def group_norm(x, scale, bias):
        N, C = x.shape[:2]
        g = _stash(x).reshape(N, groups, -1)
        mean = xp.mean(g, axis=2, keepdims=True)
        var = xp.var(g, axis=2, keepdims=True)
        y = ((g - mean) / xp.sqrt(var + eps)).astype(x.dtype, copy=False).reshape(x.shape)
        if per_group:
            scale, bias = xp.repeat(scale, C // groups), xp.repeat(bias, C // groups)
        return (y * _channel(scale, x.ndim) + _channel(bias, x.ndim),)
    return group_norm


def make_instance_norm(n: NodeInfo) -> Kernel:
    xp, eps = n.xp, n.attr("epsilon", 1e-5)

    def instance_norm(x, scale, bias):
        axes = tuple(range(2, x.ndim))
        mean = xp.mean(x, axis=axes, keepdims=True)
        var = xp.var(x, axis=axes, keepdims=True)
        y = (x - mean) / xp.sqrt(var + eps)
        return (y * _channel(scale, x.ndim) + _channel(bias, x.ndim),)
    return instance_norm


def make_batch_norm(n: NodeInfo) -> Kernel:
    xp, eps, momentum = n.xp, n.attr("epsilon", 1e-5), n.attr("momentum", 0.9)
    training = n.opset >= 14 and bool(n.attr("training_mode", 0))
    if n.opset < 9 and not n.attr("spatial", 1):
        raise Unsupported("spatial=0")
    if n.opset < 14 and any(n.wants_output(i) for i in range(1, len(n.outputs))):
        raise Unsupported("statistics outputs before opset 14")
    if not training and any(n.wants_output(i) for i in (1, 2)):
        raise Unsupported("running statistics outputs with training_mode=0")

    def batch_norm(x, scale, bias, mean, var):
        if not training:
            mul = scale / xp.sqrt(var + eps)
            return ((x - _channel(mean, x.ndim)) * _channel(mul, x.ndim) + _channel(bias, x.ndim),)
        axes = (0, *range(2, x.ndim))
        m, v = xp.mean(x, axis=axes), xp.var(x, axis=axes)
        y = (x - _channel(m, x.ndim)) / _channel(xp.sqrt(v + eps), x.ndim)
        y = y * _channel(scale, x.ndim) + _channel(bias, x.ndim)
        return (y, mean * momentum + m * (1 - momentum), var * momentum + v * (1 - momentum))
    return batch_norm


def make_lp_norm(n: NodeInfo) -> Kernel:
    xp, axis, p = n.xp, n.attr("axis", -1), n.attr("p", 2)
    if p not in (1, 2):
        raise Unsupported(f"p={p}")

    def lp_norm(x):
        a = norm_axis(axis, x.ndim)
        norm = (xp.sum(xp.abs(x), axis=a, keepdims=True) if p == 1
                else xp.sqrt(xp.sum(x * x, axis=a, keepdims=True)))
        return (xp.where(norm == 0, 0, x / norm).astype(x.dtype, copy=False),)
    return lp_norm


def make_mvn(n: NodeInfo) -> Kernel:
    xp, axes = n.xp, tuple(n.attr("axes", [0, 2, 3]))

    def mvn(x):
        mean = xp.mean(x, axis=axes, keepdims=True)
        std = xp.sqrt(xp.mean(x * x, axis=axes, keepdims=True) - mean * mean)
        return ((x - mean) / (std + 1e-9),)
    return mvn


def make_lrn(n: NodeInfo) -> Kernel:
    xp, size = n.xp, n.attr("size")
    alpha, beta, bias = n.attr("alpha", 1e-4), n.attr("beta", 0.75), n.attr("bias", 1.0)

    def lrn(x):
        lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
        sq = xp.pad(x * x, [(0, 0), (lo, hi)] + [(0, 0)] * (x.ndim - 2))
        C = x.shape[1]
        total = sum(sq[:, i:i + C] for i in range(size))
        return (x / (bias + alpha / size * total) ** beta,)
    return lrn


KERNELS: dict[str, Maker] = {
    "LayerNormalization": make_layer_norm, "RMSNormalization": make_rms_norm,
    "GroupNormalization": make_group_norm, "InstanceNormalization": make_instance_norm,
    "BatchNormalization": make_batch_norm, "LpNormalization": make_lp_norm,
    "MeanVarianceNormalization": make_mvn, "LRN": make_lrn,
}
