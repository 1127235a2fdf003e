"""Matrix kernels: MatMul, Gemm and Einsum through xp.matmul / xp.einsum (BLAS or cuBLAS)."""

from __future__ import annotations

import numpy as np

from parc.exec.engines import gpu
from parc.exec.engines.kernels import Kernel, Maker, NodeInfo


def make_matmul(n: NodeInfo) -> Kernel:
    xp = n.xp
    strided = n.on_gpu and gpu.kernels_enabled()  # stacks of matrices as one strided-batched call

    def matmul(a, b):
        if strided and (b.ndim > 2 or a.dtype.itemsize == 2):  # a stack of weights, or half types
            y = gpu.batched_matmul(xp, a, b)
            if y is not None:
                return (y,)
        if a.ndim > 2 and b.ndim == 2 and a.size:
            # activations [..., k] times a weight [k, n]: one 2-D product. numpy and CuPy would
            # otherwise loop over (or, CuPy, broadcast the weight into a pointer-array batched
            # gemm that ignores TF32) the leading dims.
            return (xp.matmul(a.reshape(-1, a.shape[-1]), b).reshape(*a.shape[:-1], b.shape[1]),)
        return (xp.matmul(a, b),)
    return matmul


def make_gemm(n: NodeInfo) -> Kernel:
    xp = n.xp
    alpha, beta = n.attr("alpha", 1.0), n.attr("beta", 1.0)
    trans_a, trans_b = n.attr("transA", 0), n.attr("transB", 0)

    strided = n.on_gpu and gpu.kernels_enabled()

    def gemm(a, b, c=None):
        y = None
        if strided and a.dtype.itemsize == 2:  # float16 / bfloat16: cuBLAS, accumulating in float32
            y = gpu.batched_matmul(xp, a.T if trans_a else a, b.T if trans_b else b)
        if y is None:
            y = xp.matmul(a.T if trans_a else a, b.T if trans_b else b)
        if alpha != 1:
            y = y * alpha
        if c is not None:
            y = y + (c if beta == 1 else c * beta)
        return (y.astype(a.dtype, copy=False),)
    return gemm


def make_einsum(n: NodeInfo) -> Kernel:
    xp, equation = n.xp, n.attr("equation").replace(" ", "")
    # NumPy contracts pairs through BLAS only when asked to optimize.
    options = {"optimize": True} if xp is np else {}

    def einsum(*xs):
        if any(x.dtype.name == "bfloat16" for x in xs):  # NumPy's einsum has no loop for it: float32
            xs = tuple(x.astype(np.float32) for x in xs)
        return (xp.einsum(equation, *xs, **options),)
    return einsum


def make_det(n: NodeInfo) -> Kernel:
    xp = n.xp
    return lambda x: (xp.linalg.det(x),)


KERNELS: dict[str, Maker] = {"MatMul": make_matmul, "Gemm": make_gemm, "Einsum": make_einsum,
                             "Det": make_det}
