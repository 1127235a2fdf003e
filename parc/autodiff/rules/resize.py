"""Gradient of Resize: the transposed interpolation, one axis at a time.

Every Resize mode (nearest, linear, cubic; antialias) is separable: along axis a it is a fixed
matrix M_a (out_a x in_a) of interpolation weights, and the gradient applies M_a^T along each
resized axis. M_a is read off ONNX's reference Resize applied to an identity matrix (row j:
the resize of basis vector j), so it follows the spec for every mode.

Where onnxruntime computes something else than the spec the rule refuses rather than guess:
tf_crop_and_resize and half_pixel_symmetric; pytorch_half_pixel with cubic or antialias; and
align_corners or pytorch_half_pixel with scales that do not give a whole output length (found
by comparing the two on every mode; see tests/autodiff/test_grad_rules.py).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from parc.autodiff.context import GradContext
from parc.autodiff.rules.base import grad
from parc.autodiff.rules.common import Grads, inp, unsupported
from parc.ir.graph import Node, Value
from parc.ops.base import const_array

_COPIED = ("antialias", "coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside", "mode",
           "nearest_mode")


def _per_axis(node: Node, i: int, rank: int, axes: list[int], default: float, what: str) -> list[float] | None:
    """Resize's scales (i = 2) or sizes (i = 3) per axis of x; None when absent or empty."""
    if node.input(i) is None:
        return None
    values = const_array(node, i)
    if values is None:
        unsupported(node, f"{what} computed at run time")
    flat = [float(a) for a in np.asarray(values).reshape(-1)]
    if not flat:
        return None
    full = [default] * rank
    for j, a in enumerate(axes):
        full[a] = flat[j]
    return full


def interpolation_matrix(node: Node, size_in: int, size_out: int, scale: float | None, opset: int) -> np.ndarray:
    """M (size_out x size_in): the node's Resize along one axis, as a matrix (float64): the
    reference Resize of an identity matrix, its first axis left alone (scale 1)."""
    from onnx.reference import ReferenceEvaluator

    attrs = {k: node.attr(k) for k in _COPIED if node.attr(k) is not None}
    inits = [numpy_helper.from_array(np.eye(size_in), "x")]
    if scale is not None:
        inits.append(numpy_helper.from_array(np.array([1, scale], np.float32), "scales"))
        names = ["x", "", "scales"]
    else:
        inits.append(numpy_helper.from_array(np.array([size_in, size_out], np.int64), "sizes"))
        names = ["x", "", "", "sizes"]
    n = helper.make_node("Resize", names, ["y"], **attrs)
    g = helper.make_graph([n], "axis", [], [onnx.ValueInfoProto(name="y")], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", max(opset, 13))])
    with np.errstate(all="ignore"):
        y = np.asarray(ReferenceEvaluator(m).run(None, {})[0], np.float64)
    return y.T


def _apply_transposed(ctx: GradContext, g: Value, m: np.ndarray, axis: int, like: Value) -> Value:
    """g with axis `axis` (length out) replaced by M^T applied along it (length in)."""
    rank = g.rank
    mat = ctx.const(m.astype(like.dtype.numpy))  # type: ignore[union-attr]
    if axis == rank - 1:
        return ctx.op("MatMul", [g, mat])
    if axis == rank - 2:
        return ctx.op("MatMul", [ctx.const(np.ascontiguousarray(m.T).astype(like.dtype.numpy)), g])  # type: ignore[union-attr]
    perm = [d for d in range(rank) if d != axis] + [axis]
    moved = ctx.op("MatMul", [ctx.op("Transpose", [g], perm=perm), mat])
    return ctx.op("Transpose", [moved], perm=[int(p) for p in np.argsort(perm)])


def _disagreement(node: Node, scales: list[float] | None, shape: tuple[int, ...]) -> str | None:
    """Why onnxruntime's Resize differs from the spec's here, if it does (see module doc)."""
    transform = node.attr("coordinate_transformation_mode", "half_pixel")
    if transform in ("tf_crop_and_resize", "half_pixel_symmetric"):
        return f"coordinate_transformation_mode={transform}"
    if transform == "pytorch_half_pixel" and (node.attr("mode", "nearest") == "cubic" or node.attr("antialias", 0)):
        return "pytorch_half_pixel with cubic mode or antialias"
    if transform in ("align_corners", "pytorch_half_pixel") and scales is not None and any(
            abs(n * s - round(n * s)) > 1e-6 for n, s in zip(shape, scales)):
        return f"{transform} with scales that do not give whole output lengths"
    return None


@grad("Resize")
def _resize(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    x, y, dy = inp(node, 0), node.outputs[0], dys[0]
    assert dy is not None and x.shape is not None and y.shape is not None
    if node.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        unsupported(node, "keep_aspect_ratio_policy other than stretch")
    rank = x.rank
    axes = [a % rank for a in (node.attr("axes") or range(rank))]
    scales = _per_axis(node, 2, rank, axes, 1.0, "scales")
    sizes = _per_axis(node, 3, rank, axes, 0.0, "sizes")
    if scales is None and sizes is None:
        unsupported(node, "neither scales nor sizes")
    why = _disagreement(node, scales, tuple(x.shape))
    if why is not None:
        unsupported(node, f"{why} (onnxruntime and the ONNX spec disagree)")
    opset = ctx.graph.opset.get("", 18)
    g = dy
    for a in range(rank):
        n_in, n_out = x.shape[a], y.shape[a]
        scale = scales[a] if scales is not None else None
        if n_in == n_out and scale in (None, 1.0):
            continue  # an untouched axis
        m = interpolation_matrix(node, n_in, n_out, scale, opset)
        if m.shape != (n_out, n_in):
            unsupported(node, f"axis {a}: the reference Resize gives {m.shape[0]} positions, the node {n_out}")
        if n_in == n_out and np.array_equal(m, np.eye(n_in)):
            continue
        g = _apply_transposed(ctx, g, m, a, x)
    return [g] + [None] * (len(node.inputs) - 1)
