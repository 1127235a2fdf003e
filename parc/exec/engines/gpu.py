"""What the array engine does differently on a GPU: TF32 matmuls and hand-written CUDA kernels.

- `enable_tf32`: CuPy honours `CUPY_TF32` only where it calls `cublasGemmEx` (2-D products); its
  batched products call the legacy `cublasSgemm*Batched`, which follow the handle's math mode. So
  both are set: CuPy's float32 compute type and the cuBLAS handle's TF32 tensor-op math mode.
- `softmax_last`: softmax over a contiguous last axis, one thread block per row (one warp for
  rows of up to 32 elements), reading the row from memory once (CuPy's max/exp/sum/divide read
  and write the whole tensor four times).
- `logsumexp_last`: log(sum(exp(x))) over a contiguous last axis in one pass (a running max and
  sum): SoftmaxCrossEntropyLoss over a vocabulary without writing its log-probabilities.
- `sum_leading`: ReduceSum/ReduceMean over leading axes, a column sum in chunks of rows.
- `cast_bfloat16`: Cast between float32 and bfloat16, four elements a thread (CuPy's `astype`
  reaches a small part of the card's memory bandwidth, and a bf16 step's casts were a large part
  of its kernel time: benchmarks/LOG.md, 2026-11-27, bf16's casts).
- `batched_matmul`: MatMul of stacks of matrices as one strided-batched cuBLAS call that reads
  transposed views and broadcast batches in place (CuPy copies both to contiguous arrays first).
- elementwise fusion (`fusion.py`, `tree_kernel.py`).

The fixed kernels' CUDA C is package data, cuda/*.cu, read at its first use (`cuda_source`).

`PARC_CUPY_KERNELS=0` turns all of them off (the engine then uses CuPy's generic
operations), for measuring what they give and for telling a kernel's bug from the graph's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from importlib import resources
from types import ModuleType
from typing import Any

import numpy as np

OUT_OF_MEMORY_MARKS = ("cudaErrorMemoryAllocation", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
                      "CUSOLVER_STATUS_ALLOC_FAILED", "NCCL_ERROR_SYSTEM_ERROR: out of memory")


class DeviceOutOfMemory(MemoryError):
    """A node of the array engine ran out of device memory: its label and CuPy's message."""


def device_out_of_memory(e: BaseException) -> bool:
    """Whether an error is the device running out of memory: CuPy's pool (`OutOfMemoryError`,
    also under `CUPY_GPU_MEMORY_LIMIT`), a CUDA library that could not allocate its workspace, or
    the engine's report of either."""
    return (isinstance(e, DeviceOutOfMemory) or type(e).__name__ == "OutOfMemoryError"
            or any(m in str(e) for m in OUT_OF_MEMORY_MARKS))


CUBLAS_TF32_TENSOR_OP_MATH = 3  # cublasMath_t
ENV_KERNELS = "PARC_CUPY_KERNELS"


def kernels_enabled() -> bool:
    return os.environ.get(ENV_KERNELS, "1") != "0"


def tf32_requested() -> bool:
    return os.environ.get("CUPY_TF32", "0") not in ("", "0")


def enable_tf32(cupy: ModuleType) -> None:
    """float32 matmuls on TF32 tensor cores, for this thread's cuBLAS handle on the current device."""
    from cupy._core import _routines_linalg as linalg
    from cupy.cuda import cublas, device

    cupy._core.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32)
    cublas.setMathMode(device.get_cublas_handle(),
                       getattr(cublas, "CUBLAS_TF32_TENSOR_OP_MATH", CUBLAS_TF32_TENSOR_OP_MATH))


CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}  # the C types of the kernels


@functools.cache
def cuda_source(name: str) -> str:
    """A fixed kernel source, cuda/NAME.cu (package data), read at its first use."""
    return (resources.files(__package__) / "cuda" / f"{name}.cu").read_text(encoding="utf-8")


def row_source() -> str:
    """The row kernels' module: softmax, log(sum(exp)), the softmax's gradient and LayerNormalization,
    looping and register-held; `fusion.RowGroup` builds on its device functions."""
    return cuda_source("softmax") + cuda_source("rows") + cuda_source("held")


def cast_source() -> str:
    """The casts between float32 and bfloat16 (`cast_bfloat16`)."""
    return cuda_source("bf16") + cuda_source("cast")


ROW_KERNELS = ("softmax_rows", "softmax_grad_rows", "layer_norm_rows")  # each has a `_held` variant
ONE_PASS = ("logsumexp_rows",)
HELD = (1, 2, 4, 8, 16, 32)  # elements a thread keeps in registers: the `_held` kernels' PER
WARP_ROWS = 32  # rows of up to this many elements take one warp each, 4 rows a block
BLOCK_THREADS = 128


@functools.cache
def _row_module(cupy: ModuleType, dtype: str) -> Any:
    names = ([f"{k}<{dtype}>" for k in ROW_KERNELS + ONE_PASS]
             + [f"{k}_held<{dtype}, {p}>" for k in ROW_KERNELS for p in HELD])
    return cupy.RawModule(code=row_source(), options=("--std=c++14", "--fmad=false"), name_expressions=names)


def row_shape(cols: int, held: bool) -> tuple[int, int | None, int]:
    """(threads a row, elements a thread holds or None for the looping kernel, rows a block) for
    rows of `cols` elements: a warp a row for rows of up to WARP_ROWS elements, 4 rows a block,
    else a block of 128 or 256 threads a row; the register-held variant (`held`) where the row
    fits (up to 32 elements a thread). (A warp a row for rows of 1,024, as PyTorch's softmax,
    ran slower with these kernels: benchmarks/LOG.md, 2026-11-27, issue 14, the loss in one
    pass.)"""
    threads = 32 if cols <= WARP_ROWS else 128 if cols <= 1024 else 256
    per = next((p for p in HELD if p * threads >= cols), None) if held else None
    return threads, per, BLOCK_THREADS // threads if threads == 32 else 1


def row_grid(rows: int, threads: int, each: int) -> tuple[tuple[int], tuple[int, int]]:
    """The grid and block of a row kernel over `rows` rows (`row_shape`'s threads and rows a block)."""
    return ((rows + each - 1) // each,), (threads, each)


def _row_launch(cupy: ModuleType, name: str, dtype: str, rows: int, cols: int, args: tuple) -> None:
    """Run a row kernel (arguments `args`) over `rows` rows of `cols` elements (`row_shape`)."""
    threads, per, each = row_shape(cols, name in ROW_KERNELS)
    fn = f"{name}<{dtype}>" if per is None else f"{name}_held<{dtype}, {per}>"
    _row_module(cupy, dtype).get_function(fn)(*row_grid(rows, threads, each), args)


def _last_axis(cupy: ModuleType, x: Any) -> tuple[str, Any, int, int] | None:
    """(the kernels' C type, x contiguous, rows, elements a row) for a row kernel over x's last
    axis, or None where none applies (another dtype, an empty or zero-width tensor)."""
    ctype = CTYPES.get(x.dtype)
    if ctype is None or x.ndim == 0 or x.size == 0 or x.shape[-1] == 0:
        return None
    return ctype, cupy.ascontiguousarray(x), x.size // x.shape[-1], x.shape[-1]


def softmax_last(cupy: ModuleType, x: Any) -> Any | None:
    """Softmax over the last axis of a CuPy array, or None where the kernel does not apply
    (`_last_axis`)."""
    found = _last_axis(cupy, x)
    if found is None:
        return None
    ctype, x, rows, cols = found
    y = cupy.empty_like(x)
    _row_launch(cupy, "softmax_rows", ctype, rows, cols, (x, y, np.int64(rows), np.int64(cols)))
    return y


def logsumexp_last(cupy: ModuleType, x: Any) -> Any | None:
    """log(sum(exp(x))) over the last axis of a CuPy array (shape x.shape[:-1]), reading each row
    once; None where the kernel does not apply (`_last_axis`)."""
    found = _last_axis(cupy, x)
    if found is None:
        return None
    ctype, x, rows, cols = found
    out = cupy.empty(x.shape[:-1], x.dtype)
    _row_launch(cupy, "logsumexp_rows", ctype, rows, cols, (x, out, np.int64(rows), np.int64(cols)))
    return out


def softmax_grad_last(cupy: ModuleType, dy: Any, y: Any) -> Any | None:
    """y * (dy - sum(dy * y, last axis)): the gradient of a softmax over the last axis, from its
    output y and the output's gradient dy, in one pass over each row; None where the kernel does
    not apply (other dtypes or shapes: the caller computes it with CuPy's operations)."""
    ctype = CTYPES.get(y.dtype)
    if ctype is None or dy.dtype != y.dtype or dy.shape != y.shape or y.ndim == 0 or y.size == 0:
        return None
    dy, y = cupy.ascontiguousarray(dy), cupy.ascontiguousarray(y)
    cols = y.shape[-1]
    dx = cupy.empty_like(y)
    rows = y.size // cols
    _row_launch(cupy, "softmax_grad_rows", ctype, rows, cols, (dy, y, dx, np.int64(rows), np.int64(cols)))
    return dx


def layer_norm_last(cupy: ModuleType, x: Any, axis: int, eps: float, scale: Any, bias: Any = None) -> tuple | None:
    """ONNX's LayerNormalization of x over its axes from `axis` on, one thread block per row:
    (y, mean, inv_std_dev), the statistics shaped as ONNX's (the normalised axes kept as 1); None
    where the kernel does not apply (float16 and other types, a scale or bias that is not one
    value per normalised element)."""
    ctype = CTYPES.get(x.dtype)
    cols = math.prod(x.shape[axis:])
    if (ctype is None or x.size == 0 or cols == 0 or scale.dtype != x.dtype or scale.size != cols
            or (bias is not None and (bias.dtype != x.dtype or bias.size != cols))):
        return None
    x = cupy.ascontiguousarray(x)
    scale = cupy.ascontiguousarray(scale)
    bias = cupy.ascontiguousarray(bias) if bias is not None else None
    rows = x.size // cols
    y = cupy.empty_like(x)
    stats = x.shape[:axis] + (1,) * (x.ndim - axis)
    mean, inv = cupy.empty(stats, x.dtype), cupy.empty(stats, x.dtype)
    _row_launch(cupy, "layer_norm_rows", ctype, rows, cols,
                (x, scale, bias if bias is not None else scale, np.int32(bias is not None), y, mean, inv,
                 np.int64(rows), np.int64(cols), x.dtype.type(eps)))
    return y, mean, inv


CAST_THREADS = 256
CAST_LIMIT = 1 << 31  # elements: the kernels' 32-bit indices (x 4) stay in range below this


@functools.cache
def _cast_module(cupy: ModuleType) -> Any:
    return cupy.RawModule(code=cast_source(), options=("--std=c++14",))


def cast_bfloat16(cupy: ModuleType, x: Any, to: np.dtype) -> Any | None:
    """x (float32 or bfloat16) cast to `to` (the other of the two), or None where the kernels do
    not apply (other types, a view that is not contiguous, an empty or very large tensor: the
    caller casts with CuPy)."""
    pair = (x.dtype.name, np.dtype(to).name)
    if pair not in (("float32", "bfloat16"), ("bfloat16", "float32")) or not x.flags.c_contiguous \
            or x.size == 0 or x.size >= CAST_LIMIT:
        return None
    y = cupy.empty(x.shape, dtype=to)
    name = "float_to_bf16" if pair[0] == "float32" else "bf16_to_float"
    blocks = -(-x.size // (4 * CAST_THREADS))
    _cast_module(cupy).get_function(name)((blocks,), (CAST_THREADS,), (x, y, np.uint32(x.size)))
    return y


THREADS_WANTED = 1 << 18  # about what an H100/H200 keeps resident (132 SMs x 2,048)


@functools.cache
def _column_kernel(cupy: ModuleType, dtype: str) -> Any:
    module = cupy.RawModule(code=cuda_source("column_sums"), options=("--std=c++14",),
                            name_expressions=[f"column_sums<{dtype}>"])
    return module.get_function(f"column_sums<{dtype}>")


def sum_leading(cupy: ModuleType, x: Any, lead: int) -> Any | None:
    """The sum of a CuPy array over its first `lead` axes (shape x.shape[lead:]), or None where the
    kernel does not apply. CuPy's reductions over leading axes (a bias's or a broadcast weight's
    gradient) give each output few threads; here each thread sums a column of a chunk of rows
    (reads coalesced across the row), and the chunks' partial sums are summed the same way."""
    ctype = CTYPES.get(x.dtype)
    if ctype is None or not 0 < lead < x.ndim or x.size == 0:
        return None
    x = cupy.ascontiguousarray(x)
    shape = x.shape[lead:]
    cols = math.prod(shape)
    rows = x.size // cols
    kernel = _column_kernel(cupy, ctype)
    while True:
        chunks = max(1, min(rows // 8, -(-THREADS_WANTED // cols)))
        per_chunk = -(-rows // chunks)
        chunks = -(-rows // per_chunk)
        out = cupy.empty((chunks, cols), x.dtype)
        kernel((-(-cols // 256), chunks), (256,), (x, out, np.int64(rows), np.int64(cols), np.int64(per_chunk)))
        if chunks == 1:
            return out.reshape(shape)
        x, rows = out, chunks


ENV_POOL = "PARC_CUPY_POOL"


class TightPool:
    """CuPy's memory pool, made to give back its cached free blocks before it grows.

    CuPy's pool keeps every block it freed, by size, and splits a larger free block for a smaller
    request, but it cannot join blocks that came from separate allocations: when a training step
    asks for a block larger than any free one (the logits' 1.6 GB in gpt-medium at the loss,
    while the forward pass's freed pieces are 128-512 MiB), it allocates anew and keeps the
    pieces, and holds gigabytes more than the step's tensors (docs/training.md; benchmarks/LOG.md,
    2026-11-26, issue 14). Here the pool's limit is held at what it holds: at a request that no
    free block can serve, CuPy releases the pool's free blocks (every allocation whose blocks are
    all free goes back to the driver) and tries again under the limit; only if it still does not
    fit is the limit raised, and the pool grows. So the pool never holds more than the tensors
    need and the pieces it cannot join. Releasing synchronises the device; it happens while the
    pool finds its size (the first step), rarely after. A limit of the user's own
    (`CUPY_GPU_MEMORY_LIMIT`) stays the ceiling. `high` is the most the pool held at once.
    `PARC_CUPY_POOL=cupy` keeps CuPy's own behaviour."""

    def __init__(self, cupy: ModuleType) -> None:
        self.pool = cupy.get_default_memory_pool()
        self.out_of_memory = cupy.cuda.memory.OutOfMemoryError
        self.cap = int(self.pool.get_limit())  # the user's limit; 0: none
        self.high = int(self.pool.total_bytes())
        self._hold(self.high)

    @classmethod
    def install(cls, cupy: ModuleType) -> TightPool | None:
        """Route CuPy's allocations through a TightPool (None where switched off)."""
        if os.environ.get(ENV_POOL, "tight") == "cupy":
            return None
        tight = cls(cupy)
        cupy.cuda.set_allocator(tight.malloc)
        return tight

    def _hold(self, size: int) -> None:
        """Limit the pool to `size` bytes (at least 1: CuPy reads 0 as no limit), or the user's."""
        self.pool.set_limit(size=min(max(size, 1), self.cap) if self.cap else max(size, 1))

    def malloc(self, size: int) -> Any:
        pool = self.pool
        try:
            return pool.malloc(size)  # at the limit CuPy releases the free blocks and tries again
        except self.out_of_memory:
            pass
        pool.set_limit(size=self.cap)  # grow: the user's limit or none (a full device raises here)
        mem = pool.malloc(size)
        held = int(pool.total_bytes())
        self.high = max(self.high, held)
        self._hold(held)
        return mem


# ---- batched matmul ---------------------------------------------------------------------------
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE = {("float32", False): 68, ("float32", True): 77, ("float64", False): 70,
                  ("float16", False): 68, ("bfloat16", False): 68}  # cublasComputeType_t: 32F,
# 32F_FAST_TF32, 64F; half types accumulate in float32 (CuPy's wrapper takes values >= 64 as compute types)
CUDA_TYPES = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 14}  # cudaDataType_t
CUBLAS_GEMM_DEFAULT = -1
INT_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Operand:
    """How cuBLAS reads one operand of a strided-batched product: op (N or T), leading dimension
    and the stride between batches, in elements."""

    op: int
    ld: int
    stride: int


def gemm_operand(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int,
                 batch: tuple[int, ...]) -> Operand | None:
    """A row-major stack of matrices x[..., R, C] (strides in bytes, as NumPy and CuPy give them)
    as cuBLAS reads it: the column-major X^T [C, R] (op N: rows contiguous) or, for a transposed
    view (columns contiguous), the column-major X read with op T; its batch dims, broadcast to
    `batch`, must step by one stride (stride 0 where broadcast). None where cuBLAS cannot read it
    in place."""
    if any(st % itemsize for st in strides):
        return None
    el = [st // itemsize for st in strides]
    *lead, rows, cols = shape
    sr, sc = el[-2], el[-1]
    if (cols == 1 or sc == 1) and (rows == 1 or sr >= cols):
        op, ld = CUBLAS_OP_N, sr if rows > 1 else cols
    elif (rows == 1 or sr == 1) and (cols == 1 or sc >= rows):
        op, ld = CUBLAS_OP_T, sc if cols > 1 else rows
    else:
        return None
    lead_strides = el[:-2]
    eff = [0] * (len(batch) - len(lead)) + [st if n > 1 else 0 for n, st in zip(lead, lead_strides, strict=True)]
    step, inner = None, 1
    for n, st in zip(reversed(batch), reversed(eff), strict=True):
        if n > 1:
            if step is None:
                step = st // inner if st % inner == 0 else -1
            if step < 0 or st != step * inner:
                return None
        inner *= n
    return Operand(op, max(ld, 1), step or 0)


MAX_GEMM_CALLS = 4096  # calls of a batched product whose batch dims do not step by one stride


@dataclasses.dataclass(frozen=True)
class GemmCall:
    """One strided-batched call of a product: byte offsets of its first A, B and C matrices from
    the arrays' starts, the operands as cuBLAS reads them, and how many matrices it multiplies."""

    a_offset: int
    b_offset: int
    c_offset: int
    a: Operand
    b: Operand
    count: int


@functools.lru_cache(maxsize=4096)
def gemm_calls(a_shape: tuple[int, ...], a_strides: tuple[int, ...], b_shape: tuple[int, ...],
               b_strides: tuple[int, ...], itemsize: int) -> tuple[GemmCall, ...] | None:
    """The strided-batched calls computing a @ b into a contiguous result, each operand read in
    place: one call where the batch dims of each step by one stride, else one per index of the
    fewest leading batch dims that leave the rest so (attention's [B, H, S, D] views of a
    [B, S, H*D] tensor: B calls of H matrices). None where the shapes do not multiply, a size
    exceeds cuBLAS's int, or it takes over MAX_GEMM_CALLS. Cached: a step multiplies the same
    shapes every time."""
    try:
        batch = tuple(np.broadcast_shapes(a_shape[:-2], b_shape[:-2]))
    except ValueError:
        return None
    (m, k), (k2, n) = a_shape[-2:], b_shape[-2:]
    if k != k2 or max(m, n, k, math.prod(batch)) > INT_MAX:
        return None
    for cut in range(len(batch) + 1):
        outer, inner = batch[:cut], batch[cut:]
        if math.prod(outer) > MAX_GEMM_CALLS:
            return None
        oa = gemm_operand(*_inner(a_shape, a_strides, len(inner)), itemsize, inner)
        ob = gemm_operand(*_inner(b_shape, b_strides, len(inner)), itemsize, inner)
        if oa is None or ob is None:
            continue
        if max(oa.ld, ob.ld) > INT_MAX:
            return None
        count = math.prod(inner)
        steps_a, steps_b = _outer_strides(a_shape, a_strides, batch, cut), _outer_strides(b_shape, b_strides, batch, cut)
        return tuple(GemmCall(sum(i * st for i, st in zip(idx, steps_a)), sum(i * st for i, st in zip(idx, steps_b)),
                              j * count * m * n * itemsize, oa, ob, count)
                     for j, idx in enumerate(np.ndindex(*outer)))
    return None


def _inner(shape: tuple[int, ...], strides: tuple[int, ...], k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An operand's matrix dims and its last k batch dims (fewer where it has fewer)."""
    start = max(len(shape) - 2 - k, 0)
    return tuple(shape[start:]), tuple(strides[start:])


def _outer_strides(shape: tuple[int, ...], strides: tuple[int, ...], batch: tuple[int, ...], cut: int) -> list[int]:
    """Byte strides of an operand along the first `cut` dims of the broadcast batch (0 where broadcast)."""
    lead = len(shape) - 2
    pad = [(1, 0)] * (len(batch) - lead) + list(zip(shape[:lead], strides[:lead]))
    return [st if d > 1 else 0 for d, st in pad[:cut]]


def batched_matmul(cupy: ModuleType, a: Any, b: Any) -> Any | None:
    """a @ b for stacks of matrices (either of at least 3 dims, batch dims broadcast) as
    cublasGemmStridedBatchedEx calls (`gemm_calls`): C^T = B^T A^T in cuBLAS's column-major
    terms, each operand read in place (transposed views by op T, broadcast batches by stride 0);
    TF32 where asked (`CUPY_TF32`). None where it does not apply: other dtypes, 2-D products
    (CuPy's own call), empty products, shapes that do not match, or views cuBLAS cannot read as
    they are."""
    dtype = a.dtype
    half = dtype.name in ("float16", "bfloat16")  # 2-D products too: CuPy's own call upcasts them
    if (b.dtype != dtype or dtype.name not in CUDA_TYPES or a.ndim < 2 or b.ndim < 2
            or (max(a.ndim, b.ndim) < 3 and not half) or a.size == 0 or b.size == 0):
        return None
    calls = gemm_calls(a.shape, a.strides, b.shape, b.strides, dtype.itemsize)
    if calls is None:
        return None
    from cupy.cuda import cublas, device

    (m, k), n = a.shape[-2:], b.shape[-1]
    out = cupy.empty(tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2])) + (m, n), dtype)
    scalar = np.float32 if half else dtype  # alpha and beta in the compute type
    one, zero = np.ones((), scalar), np.zeros((), scalar)
    cuda_type = CUDA_TYPES[dtype.name]
    compute = CUBLAS_COMPUTE[(dtype.name, dtype == np.float32 and tf32_requested())]
    handle = device.get_cublas_handle()
    for c in calls:
        cublas.gemmStridedBatchedEx(
            handle, c.b.op, c.a.op, n, m, k, one.ctypes.data,
            b.data.ptr + c.b_offset, cuda_type, c.b.ld, c.b.stride, a.data.ptr + c.a_offset, cuda_type, c.a.ld,
            c.a.stride, zero.ctypes.data, out.data.ptr + c.c_offset, cuda_type, n, m * n, c.count, compute,
            CUBLAS_GEMM_DEFAULT)
    return out
