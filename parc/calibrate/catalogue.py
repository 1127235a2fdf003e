"""The built-in benchmarks of `parc profile`: which ops, products and collectives run, at which
sizes, for how long, and the class (`parc.ops.op_class`) each calibrates."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

BUDGET = 0.6  # default seconds each benchmark runs (per rank, all ranks at once)
CHAIN = 16  # nodes in a chain of tiny Adds (and 1): the slope is the per-node floor
# A CPU benchmark feeds the same inputs every run: they stay in the caches where they fit, and
# larger tensors leave them by themselves. `fit_cache` finds where the caches end (SWEEP_ROWS),
# and every rate written is memory's: a step's memory-bound nodes stream at it whatever their
# size (docs/benchmarks.md, 2026-11-28). A GPU's benchmarks rotate through GPU_SIZES' pool (its
# tensors are larger than an L2).
POOL_BYTES = 0
# memory-bound ops as training graphs have them, on [rows, 256] float32 tensors: plain and
# broadcast elementwise; a transpose that keeps the last axis (whole rows move) and one that moves
# it (attention's K^T: element by element, on 64 x 64 matrices); reductions over the leading axis
# (bias gradients) and the last one; softmax and layer normalisation; a division and a square root
# (an optimizer's: onnxruntime computes them, slower than an Add); Where as a ReLU's gradient (a
# mask, the gradient, a scalar zero) and as attention's mask (a mask broadcast over the scores),
# which onnxruntime's CPU kernel runs well under an Add's rate; Pow (x ** 3.0, a tanh GELU's), Tanh
# and Erf (the two GELUs') compute per element; an embedding's gradient (a ScatterND adding rows
# into a table), as the executor runs it (`parc.ir.scatter.scatter_as_elements`: element by
# element, int64 indices expanded to the rows' size), which a stream's price misses; Concat and
# Split on the last axis (a fused QKV projection's parts and their gradients joined again), which
# onnxruntime copies run by run, above an Add's price
MEMORY_OPS = ("Add", "MulBroadcast", "Transpose", "TransposeLastAxis", "ReduceSumFirst", "ReduceMeanLast", "Softmax",
              "SoftmaxMasked", "SoftmaxPadded", "LayerNorm", "Div", "Sqrt", "Where", "WhereMasked", "Pow", "Tanh", "Erf", "ScatterAdd",
              "Concat", "Split")
# a benchmark input of this name holds attention's scores after a causal mask's fill
# (`session.make_feeds`): onnxruntime's Softmax takes a slow path where exp underflows (a -1e4,
# -1e9 or -inf fill above the diagonal; a fill of -30 runs as fast as random scores)
MASKED = "scores"
# and this one attention's scores after a padding mask's fill, the padding drawn as `parc run`'s
# synthetic data draws it (`parc.exec.data.padding`): the slow path is taken by every block of a
# row that holds a hidden score, so one padded score at a row's end slows the whole row
PADDED = "padded_scores"
MEMORY_ROWS = (1024, 4096, 16384)  # x 256 columns: 1, 4 and 16 MiB per tensor
# matmuls as training graphs have them: ([batch...], m, k, n)
MATMULS = (((), 2048, 256, 768), ((), 2048, 768, 256), ((), 256, 2048, 768), ((8, 4), 64, 64, 64),
           ((), 4096, 1024, 1024), ((16,), 128, 64, 256))
# convolutions as training graphs have them, by op class (`parc.ops.op_class`): (input shape,
# weight shape, attributes); a weight's gradient convolves the input with the output's gradient,
# the batch contracted (kernels larger than the output)
CONVS = {
    "Conv": (((16, 16, 32, 32), (16, 16, 3, 3), {"pads": [1, 1, 1, 1]}),
             ((16, 32, 16, 16), (32, 32, 3, 3), {"pads": [1, 1, 1, 1]}),
             ((16, 64, 8, 8), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}),
             ((16, 32, 16, 16), (64, 32, 1, 1), {})),
    "ConvWeightGrad": (((8, 16, 32, 32), (8, 16, 32, 32), {"pads": [1, 1, 1, 1]}),
                       ((16, 16, 16, 16), (16, 16, 16, 16), {"pads": [1, 1, 1, 1]}),
                       ((32, 16, 8, 8), (32, 16, 8, 8), {"pads": [1, 1, 1, 1]}),
                       ((16, 16, 32, 32), (8, 16, 32, 32), {})),
    "ConvTranspose": (((16, 32, 16, 16), (32, 16, 2, 2), {"strides": [2, 2]}),
                      ((16, 64, 8, 8), (64, 32, 2, 2), {"strides": [2, 2]})),
}
# on a CPU, the same classes again with few channels (8 of them in or out) and as an input's
# gradient (a 3x3 ConvTranspose), so that each class's rate and piece cost can be fitted together
# (`fit_conv_pieces`): the time of a product with few rows goes with its lowering's elements
NARROW_CONVS = {
    "Conv": (((16, 8, 32, 32), (8, 8, 3, 3), {"pads": [1, 1, 1, 1]}),
             ((16, 32, 16, 16), (8, 32, 3, 3), {"pads": [1, 1, 1, 1]})),
    "ConvTranspose": (((16, 8, 32, 32), (8, 8, 3, 3), {"pads": [1, 1, 1, 1]}),
                      ((16, 32, 8, 8), (32, 32, 3, 3), {"pads": [1, 1, 1, 1]}),
                      ((16, 16, 16, 16), (16, 32, 3, 3), {"pads": [1, 1, 1, 1]})),
}
ALL_REDUCE_BYTES = (64, 65536, 1 << 20, 4 << 20)


@dataclass(frozen=True)
class Sizes:
    """The benchmarks' shapes for one kind of device."""

    memory_rows: tuple[int, ...]  # x 256 columns
    matmuls: tuple
    convs: dict
    pool_bytes: int  # inputs rotate through this many bytes (0: one set of inputs, run after run)
    small: tuple[int, int] | None = None  # [rows, cols] of the memory-bound ops again, for their floors
    small_matmuls: tuple = ()  # products of a small model's sizes, for their classes' floors
    piece_cols: int = 0  # columns of the memory-bound ops again on short pieces (`PIECE_OPS`), 0: none
    sweep_rows: tuple[int, ...] = ()  # x 256 columns: an Add again at these sizes, for the caches' reach (`fit_cache`)
    gemms: tuple = ()  # (a, b, attributes) of Gemms as a weight's gradient has them (the `Gemm` class)
    conv_pieces: bool = False  # fit each convolution class's piece cost with its rate (`fit_conv_pieces`)


# a small model's tensors ([64, 64] float32: 16 KiB, as a GPT-2 export's [128, 32] bias gradient)
# and products, whose time beyond what the rates above give is the class's floor (`fit`):
# onnxruntime on more than one thread hands a small Transpose to its thread pool and waits for it.
# Not larger: onnxruntime reduces few rows element by element, so a larger tensor's ReduceSum
# gives a floor too large for smaller ones
SMALL = (64, 64)
SMALL_MATMULS = (((), 128, 64, 64), ((8, 4), 16, 16, 16))
# the ops whose cost grows with the short pieces they walk (`parc.ops.node_pieces`), measured
# again on [4096, 32] tensors (512 KiB; the transposes' runs 8 wide, the rows 32): with the
# built-in sizes' pieces, each class's rate and piece cost are fitted together (`fit`)
PIECE_OPS = ("Transpose", "TransposeLastAxis", "Softmax", "SoftmaxPadded", "LayerNorm", "SubRows")
PIECE_ROWS, PIECE_COLS = 4096, 32
# memory-bound ops whose built-in rows already differ in pieces per byte (a Where over a random
# mask and over a causal triangle: `parc.ops.base._where_runs`), fitted like `PIECE_OPS`
RUN_OPS = ("Where", "WhereMasked")
# an Add again on [rows, 256] (0.75, 1.5, 6 and 24 MiB moved, between the memory rows' 3, 12 and
# 48): where its rate falls from the caches' to memory's (`fit_cache`). A single rate fitted over
# both prices a step's elementwise nodes on activations larger than the caches too fast, and the
# caches' rate for the nodes that fit them too fast as well: in a step, the caches hold other
# tensors, so every rate written is memory's
SWEEP_ROWS = (256, 512, 2048, 8192)
# a weight's gradient as `parc grad` writes it: Gemm(x, dy, transA=1), the rows contracted (x^T dy:
# [256, 768] and [768, 256] from 2048 rows). onnxruntime's CPU Gemm runs slower than a MatMul of
# the same FLOPs: `Gemm` is its own class
GEMMS = (((2048, 256), (2048, 768), {"transA": 1}), ((2048, 768), (2048, 256), {"transA": 1}))
# reads of data the caches no longer hold (`fit_cold`): an Add of COLD_ROWS x 256 right after the
# rank wrote each of COLD_TOUCH bytes (a module's traffic between a value's uses), on a CPU
COLD_ROWS = 4096
COLD_TOUCH = (0, 32 << 20, 128 << 20, 512 << 20)
COLD_REPEATS = 8
CPU_SIZES = Sizes(MEMORY_ROWS, MATMULS, {cls: cases + NARROW_CONVS.get(cls, ()) for cls, cases in CONVS.items()},
                  POOL_BYTES, SMALL, SMALL_MATMULS, PIECE_COLS, SWEEP_ROWS, GEMMS, conv_pieces=True)
# a GPU's training step: gpt-medium's products at batch 8 x 1024 tokens (QKV, attention output,
# MLP down, a weight gradient, attention scores and context over 8 x 16 heads), tensors of 16-256
# MiB (an H100's L2 holds 50 MiB: the rotation leaves it), convolutions of a ResNet's middle stages
GPU_SIZES = Sizes(
    (16384, 65536, 262144),
    (((), 8192, 1024, 3072), ((), 8192, 1024, 1024), ((), 8192, 4096, 1024), ((), 1024, 8192, 4096),
     ((128,), 1024, 64, 1024), ((128,), 1024, 1024, 64)),
    {"Conv": (((32, 64, 56, 56), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}),
              ((32, 128, 28, 28), (128, 128, 3, 3), {"pads": [1, 1, 1, 1]}),
              ((32, 256, 56, 56), (64, 256, 1, 1), {})),
     "ConvWeightGrad": (((64, 32, 16, 16), (64, 32, 16, 16), {"pads": [1, 1, 1, 1]}),
                        ((128, 32, 8, 8), (128, 32, 8, 8), {"pads": [1, 1, 1, 1]})),
     "ConvTranspose": (((32, 128, 28, 28), (128, 64, 2, 2), {"strides": [2, 2]}),)},
    512 << 20)
PROBE = ((), 2048, 256, 768)  # the product whose time says how fast the host runs now (`host_probe`)
# rounds per size, seconds between arrivals, all-reduces per round: enough rounds that profiles in
# a row agree on the handoff and on how a small all-reduce's cost splits between a call and alpha
# (with a third of them they did not, and a pipeline whose stages' 2-rank collectives pay both
# was predicted far off its runs)
ARRIVALS, ARRIVAL_STEP, BURST = 36, 1e-3, 6
COPIES = 16  # copies of a small case's node in one session (`graphs.copies`)

PRODUCTS = ("MatMul", "BatchMatMul", "Gemm")  # the product classes (`op_class`) a model's own cases may have
SPLIT = "split"  # a product case's dims of its two operands that hold the batch (`rank_cases`): not an ONNX attribute

# a memory benchmark's op -> the class it calibrates (`parc.ops.op_class`); None: the default
# (every elementwise op, and a fused tree of them)
MEMORY_CLASSES = {"Add": None, "MulBroadcast": None, "Transpose": "Transpose", "TransposeLastAxis": "TransposeLastAxis",
                  "ReduceSumFirst": "ReduceSum", "Div": "Div", "Sqrt": "Sqrt",
                  "ReduceMeanLast": "ReduceMean", "Softmax": "Softmax", "SoftmaxMasked": "SoftmaxMasked",
                  "SoftmaxPadded": "SoftmaxPadded",
                  "LayerNorm": "LayerNormalization",
                  "Where": "Where", "WhereMasked": "Where", "Pow": "Pow", "Tanh": "Tanh", "Erf": "Erf",
                  "SubRows": None, "ScatterAdd": "ScatterND", "Concat": "Concat", "Split": "Split"}


def sizes_for(engine: tuple[str, str]) -> Sizes:
    """The benchmarks' shapes for `engine`'s device (`runner.pick_engine`'s (kind, device))."""
    return GPU_SIZES if engine[1] == "gpu" else CPU_SIZES


def matmul_class(shape: Sequence[int]) -> str:
    """The class (`op_class`) of a built-in product [batch..., m, k, n]: `BatchMatMul` where
    its batch has more than one matrix, else `MatMul`."""
    return "BatchMatMul" if len(shape) > 3 and math.prod(shape[:-3]) > 1 else "MatMul"
