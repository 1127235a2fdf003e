"""`gpu.gemm_operand`: how one strided-batched cuBLAS call reads stacks of matrices in place
(transposed views, broadcast and sliced batches). Checked on the CPU by running the call's
arithmetic as cuBLAS defines it (column-major, op N/T, leading dimension, batch stride) over
NumPy views with the same strides, against np.matmul; the call itself is `gpu`-tested."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parc.exec.engines.gpu import CUBLAS_OP_N, Operand, gemm_calls, gemm_operand


def _cublas_view(x: np.ndarray, o: Operand, rows: int, cols: int, count: int) -> np.ndarray:
    """op(X) of cuBLAS, [count, rows, cols], read from x's memory as cuBLAS would."""
    item = x.itemsize
    el = (o.stride * item, item, o.ld * item) if o.op == CUBLAS_OP_N else (o.stride * item, o.ld * item, item)
    return np.lib.stride_tricks.as_strided(x, shape=(count, rows, cols), strides=el)


def emulate(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """a @ b as gpu.batched_matmul asks cuBLAS for it: per call, C^T [n, m] = op(B) op(A),
    column-major, from the arrays' memory at the call's offsets."""
    (m, k), n = a.shape[-2:], b.shape[-1]
    batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    calls = gemm_calls(a.shape, a.strides, b.shape, b.strides, a.itemsize)
    if calls is None:
        return None
    out = np.empty(batch + (m, n))
    flat = out.reshape(-1)
    for c in calls:
        A = _cublas_view(_at(b, c.b_offset), c.b, n, k, c.count)  # cuBLAS's A: B^T, n x k
        B = _cublas_view(_at(a, c.a_offset), c.a, k, m, c.count)  # cuBLAS's B: A^T, k x m
        ct = A @ B  # [count, n, m]: C column-major with ldc = n, so row-major [m, n]
        start = c.c_offset // out.itemsize
        flat[start:start + c.count * m * n] = ct.transpose(0, 2, 1).reshape(-1)
    return out


def _at(x: np.ndarray, offset: int) -> np.ndarray:
    """x's memory from `offset` bytes on (as a pointer plus offset)."""
    return x if offset == 0 else np.lib.stride_tricks.as_strided(x, shape=(2,) + x.shape, strides=(offset,) + x.strides)[1]


def _stack(rng, lead, rows, cols, transposed, sliced):
    """A [*lead, rows, cols] array, as a transposed view and/or a slice of a larger batch."""
    full = tuple(lead)
    if sliced and lead:
        full = (lead[0] * 2,) + tuple(lead[1:])
    x = rng.standard_normal(full + ((cols, rows) if transposed else (rows, cols)))
    if transposed:
        x = np.swapaxes(x, -1, -2)
    if sliced and lead:
        x = x[::2]
    return x


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_emulated_call_equals_matmul(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    m, k, n = (data.draw(st.integers(1, 5)) for _ in range(3))
    nd = data.draw(st.integers(0, 3))
    batch = [data.draw(st.integers(1, 3)) for _ in range(nd)]
    lead_a = [d if data.draw(st.booleans()) else 1 for d in batch][data.draw(st.integers(0, nd)):]
    lead_b = [d if data.draw(st.booleans()) else 1 for d in batch][data.draw(st.integers(0, nd)):]
    a = _stack(rng, lead_a, m, k, data.draw(st.booleans()), data.draw(st.booleans()))
    b = _stack(rng, lead_b, k, n, data.draw(st.booleans()), data.draw(st.booleans()))
    got = emulate(a, b)
    assert got is not None  # these batches (at most 27 matrices) always fit in calls
    np.testing.assert_allclose(got, np.matmul(a, b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("transposed", [False, True])
def test_attention_shapes_are_read_in_place(transposed):
    """The products of attention and its gradient: [B, H, S, S] @ [B, H, S, D] with either side a
    transposed view of a contiguous tensor (P^T, K^T) takes no copy."""
    rng = np.random.default_rng(0)
    p = rng.standard_normal((2, 3, 8, 8))
    v = rng.standard_normal((2, 3, 8, 4))
    lhs = np.swapaxes(p, -1, -2) if transposed else p
    batch = (2, 3)
    o = gemm_operand(lhs.shape, lhs.strides, 8, batch)
    assert o is not None and o.op == (1 if transposed else 0) and o.stride == 64 and o.ld == 8
    np.testing.assert_allclose(emulate(lhs, v), lhs @ v)
    q = rng.standard_normal((2, 3, 8, 4))
    kt = np.swapaxes(rng.standard_normal((2, 3, 8, 4)), -1, -2)  # K^T [B, H, D, S]: a view
    assert gemm_operand(kt.shape, kt.strides, 8, batch).op == 1
    np.testing.assert_allclose(emulate(q, kt), q @ kt)


def test_heads_split_from_a_hidden_dim_step_unevenly():
    """[B, S, H, D] viewed as [B, H, S, D]: the batch dims B and H do not step by one stride, so
    the product is B calls of H matrices, still read in place."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 8, 3, 4)).transpose(0, 2, 1, 3)
    assert gemm_operand(x.shape, x.strides, 8, (2, 3)) is None
    kt = rng.standard_normal((2, 8, 3, 4)).transpose(0, 2, 3, 1)  # K^T [B, H, D, S] of [B, S, H, D]
    calls = gemm_calls(x.shape, x.strides, kt.shape, kt.strides, 8)
    assert len(calls) == 2 and [c.count for c in calls] == [3, 3] and calls[1].a_offset == 8 * 8 * 3 * 4
    np.testing.assert_allclose(emulate(x, kt), x @ kt)
    y = np.zeros((2, 3, 8, 4))
    assert gemm_operand(y.shape, y.strides, 8, (2, 3)) == Operand(0, 4, 32)
    assert gemm_operand(y[:, :1].shape, y[:, :1].strides, 8, (2, 3)) is None  # broadcast in one dim only
    w = np.zeros((4, 5))
    assert gemm_operand(w.shape, w.strides, 8, (2, 3)) == Operand(0, 5, 0)  # one matrix for every batch
