"""`parc profile`: measure what the cost model needs on this machine, write a calibration file.

For each count k of ranks sharing this host (1, 2, 4, ... up to `--ranks`), one MPI job of k
ranks runs the same microbenchmarks on every rank at once, with the engine and the threads per
rank `parc run` gives a plan of k ranks (`runner.rank_threads`), so each figure is what a rank
gets while its neighbours work too. Each benchmark is one op in a session of the engine `parc run
--engine` would use (onnxruntime by default; `--engine cupy` measures one GPU through parc's
array engine, with sizes a GPU's training step has, `GPU_SIZES`), run for `--seconds` (on a CPU
with one set of inputs, warm as a step's just-written tensors; on a GPU rotating through more
memory than its L2: `POOL_BYTES`); the mean is kept:

- the launch floor (the slope of a chain of tiny Adds over its length) and the task overhead
  (what one `session.run` costs beyond its node);
- memory bandwidth: the memory-bound ops as training graphs have them (`MEMORY_OPS`), 1-16 MiB,
  and on a CPU an Add at more sizes, to tell the caches' rate from memory's (`fit_cache`): the
  rates written are memory's, which a step's tensors stream at;
- on a CPU, short pieces and small nodes: the ops that walk short pieces (`PIECE_OPS`: a
  Transpose's runs, a row, a broadcast's span; `parc.ops.node_pieces`) again on narrow tensors,
  each class's rate and cost per piece fitted together (`fit_pieces`); then every memory-bound op
  on 16 KiB and two small products, as `COPIES` copies of the node in one session: what such a
  node takes beyond its launch floor, rate and pieces is its class's floor;
- float32 FLOP/s: matmuls of training shapes (`MATMULS`) and convolutions by class (`CONVS`);
  the fastest class's rate is the peak, the others fractions of it (`compute_efficiency`,
  `op_efficiency`). Each class's figure is the geometric mean of its sizes' rates, the value that
  minimises the squared log error of the roofline over them. With `--model FILE`, the model's own
  products and convolutions (`model_cases`, the shapes holding 95% of each class's FLOPs) replace
  the built-in cases of the classes it has, at each rank count's share of the batch, and such a
  class's figure is the model's FLOPs over its time;
- collectives (k >= 2): all-reduces of 64 B to 4 MiB through parc's communicator, over the whole
  job and (even k > 2) over pairs while the other pairs compute, `ARRIVALS` rounds of a first
  one after compute then a burst: the burst fits `call + 2(n-1) alpha + 2(n-1)/n B / beta`
  (`fit_collectives`: least squares on the relative error; the call cost needs two group
  sizes), the first's excess at the smallest size (64 B, where no bandwidth term is mixed in) is
  the link's handoff; then reduce-scatters, all-gathers and all-to-alls in bursts, each kind's
  own alpha and beta (`fit_kind`);
- on CPUs, for each count of ranks with a core each, a traced tensor-parallel reference step
  (`link_ratios`): the link's `step_ratio` and its handoff in a step's terms (`fit_link_ratio`).

On CPUs the profile ends with reference training steps (`reference_steps`: the `--model` files,
else a convolutional net and an encoder-decoder from the zoo, planned on k ranks with the figures
just written and run with `parc run`); per k, what their simulated compute must be multiplied by to take their
measured time is the device's `step_ratio` (`fit_step_ratio`), which multiplies every node's time.
The benchmarks price each node warm and alone; a step's nodes run on tensors other nodes wrote,
and its ranks wait at each collective for the last of them.

A fixed product (`host_probe`) is timed before each rank count and at the end: the file's header
lists the host's speed at each against the first, and a spread above 15% is warned about. It is
timed again before each reference step, whose measured time is taken at the speed its count's
figures saw (`reference_steps`' `host_speed`).

The file (docs/cluster.md, "Calibration") holds one rank's device figures and the smallest
multi-rank count's link figures at the top, and k ranks' figures under `sharing."k"`, which
`parc plan --calibration` applies to nodes of k devices. The raw timings are written as comments.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from parc.errors import UsageError
from parc.exec.data import padding

BUDGET = 0.6  # default seconds each benchmark runs (per rank, all ranks at once)
CHAIN = 16  # nodes in a chain of tiny Adds (and 1): the slope is the per-node floor
# A CPU benchmark feeds the same inputs every run: they stay in the caches where they fit, and
# larger tensors leave them by themselves. `fit_cache` finds where the caches end (SWEEP_ROWS),
# and every rate written is memory's: a step's memory-bound nodes streamed at it whatever their
# size (docs/benchmarks.md, 2026-11-28). A GPU's benchmarks rotate through GPU_SIZES' pool (its
# tensors are larger than an L2).
POOL_BYTES = 0
# memory-bound ops as training graphs have them, on [rows, 256] float32 tensors: plain and
# broadcast elementwise; a transpose that keeps the last axis (whole rows move) and one that moves
# it (attention's K^T: element by element, on 64 x 64 matrices); reductions over the leading axis
# (bias gradients) and the last one; softmax and layer normalisation; a division and a square root
# (an optimizer's: onnxruntime computes them, on this project's host at a third to a half of an
# Add's rate); Where as a ReLU's gradient (a mask, the gradient, a scalar zero) and as attention's
# mask (a mask broadcast over the scores): onnxruntime's CPU kernel runs the first at a tenth of an
# Add's rate and the second at about a fifth; Pow (x ** 3.0, a tanh GELU's), Tanh and Erf (the two
# GELUs') compute per element: on this project's host onnxruntime's Pow ran a GPT-2 export's
# [8, 16, 128] at a third of an Add's rate; an embedding's gradient (a ScatterND adding rows into
# a table), as the executor runs it (`runner.scatter_as_elements`: element by element, int64
# indices expanded to the rows' size): a GPT-style step's embedding gradient took 2-4 ms of 65-76
# ms on this project's host, priced at about nothing as a stream; Concat and Split on the last
# axis (a fused QKV projection's parts and their gradients joined again), which onnxruntime copies
# run by run: gpt-tiny's took 2.3 ms of a 62 ms two-rank module against 0.9 ms priced as Adds
MEMORY_OPS = ("Add", "MulBroadcast", "Transpose", "TransposeLastAxis", "ReduceSumFirst", "ReduceMeanLast", "Softmax",
              "SoftmaxMasked", "SoftmaxPadded", "LayerNorm", "Div", "Sqrt", "Where", "WhereMasked", "Pow", "Tanh", "Erf", "ScatterAdd",
              "Concat", "Split")
# a benchmark input of this name holds attention's scores after a causal mask's fill (`_feeds`):
# onnxruntime's Softmax takes a slow path where exp underflows, 7-8x its time on [32, 4, 64, 64]
# on this project's host (random scores 102 us, a -1e4, -1e9 or -inf fill above the diagonal
# 801-813 us, on 2 threads); a fill of -30 runs as fast as random scores
MASKED = "scores"
# and this one attention's scores after a padding mask's fill, the padding drawn as `parc run`'s
# synthetic data draws it (`parc.exec.data.padding`): the slow path is taken by every block of a
# row that holds a hidden score, so one padded score at a row's end costs the row about 4x
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
# onnxruntime on 2 threads hands a small Transpose to its thread pool and waits for it (3.8 us for
# 16 KiB, against 0.9 us on one thread, on this project's host). Tensors of 64 KiB gave floors too
# large for smaller ones: its ReduceSum over 64 rows of 256 took 16 us, one over 128 rows of 32 took
# 3.2 us (onnxruntime reduces few rows element by element)
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
# 48): where its rate falls from the caches' to memory's (`fit_cache`). On this project's 2-core
# host one rank's Add streamed 144 GB/s at 3 MiB and 52-55 GB/s at 12 and 48 MiB; a single rate
# fitted over both (94 GB/s) priced a GPT-2 export's elementwise nodes on 8 MiB activations at
# half the time they took in its step. Pricing the nodes that fit the caches at the caches' rate
# instead predicted steps lower still (gpt-tiny on 4 ranks: 49 ms, against 60 ms and 77 measured):
# in a step, the caches hold other tensors
SWEEP_ROWS = (256, 512, 2048, 8192)
# a rate counts as the caches' where it is at least this many times memory's
CACHE_RATIO = 1.5
# a weight's gradient as `parc grad` writes it: Gemm(x, dy, transA=1), the rows contracted (x^T dy:
# [256, 768] and [768, 256] from 2048 rows). On this project's host onnxruntime's CPU Gemm took 1.3x
# the MatMul rate's price in gpt-tiny's step (1.1x a MatMul of the same FLOPs alone); `Gemm` is
# its own class
GEMMS = (((2048, 256), (2048, 768), {"transA": 1}), ((2048, 768), (2048, 256), {"transA": 1}))
# reads of data the caches no longer hold (`fit_cold`): an Add of COLD_ROWS x 256 right after the
# rank wrote each of COLD_TOUCH bytes (a module's traffic between a value's uses), on a CPU
COLD_ROWS = 4096
COLD_TOUCH = (0, 32 << 20, 128 << 20, 512 << 20)
COLD_REPEATS = 8
COLD_RATIO = 1.2  # the least warm / cold rate worth pricing
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
STEADY = 1.15  # a profile whose probes differ by more than this factor warns that the host moved
# rounds per size, seconds between arrivals, all-reduces per round. With 12 rounds, five profiles
# of this project's 4-rank host put the handoff at 0.49-0.90 ms and split the small all-reduce's
# cost between a call and alpha in three different ways (moe-tiny's pipeline, whose stages' 2-rank
# collectives pay both, was predicted -2% and +62% off its runs); with 36, two profiles in a row
# gave 0.47 and 0.49 ms, calls of 0.16 and 0.12 ms, for 4 s more a profile
ARRIVALS, ARRIVAL_STEP, BURST = 36, 1e-3, 6
# the reference training steps (`reference_steps`): zoo models, `parc models build NAME --set ...
# --train momentum`, a convolutional net and an encoder-decoder, each step 20-50 ms on this
# project's 2-core VM so that the median of a few steps is steady (the zoo's default t5-tiny steps
# take 2-3 ms, and on 4 ranks sharing 2 cores their ratio moved between 1.05 and 1.23 run to run)
REFERENCE_STEPS = (("unet-tiny", ("batch=16",)),
                   ("t5-tiny", ("batch=16", "d_model=128", "d_ff=512", "enc_seq=64", "dec_seq=32")))
REFERENCE_RUNS, REFERENCE_WARMUP = 20, 5  # steps each reference runs; the median is of those after the warm-up
STEP_RATIO_RANGE = (0.5, 4.0)  # a ratio outside says the reference went wrong, not the benchmarks
# the tensor-parallel references (`link_ratios`): every reference step with every parameter
# split over all ranks (Whale's split), so that a collective runs between most of its modules;
# each traced this many times (the trace is of a run's last step), each run this many steps
SPLIT_HINTS, SPLIT_TRACES, SPLIT_STEPS = "default: split\n", 3, 6


def _model(nodes, inputs: dict[str, tuple], output: str, inits=()):
    from onnx import TensorProto, helper

    g = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s))
                                           for n, s in inputs.items()],
                          [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)], list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _chain(length: int):
    """`length` tiny Adds in a chain: the launch floor is the slope of its time over length."""
    from onnx import helper

    nodes, prev = [], "x"
    for i in range(length):
        nodes.append(helper.make_node("Add", [prev, "x"], [f"y{i}"]))
        prev = f"y{i}"
    return _model(nodes, {"x": (1,)}, prev)


def _memory_op(op: str, rows: int, cols: int = 256):
    """(model, input shapes, bytes read and written) of one memory-bound op on [rows, cols]."""
    from onnx import helper, numpy_helper

    x = {"x": (rows, cols)}
    n = rows * cols * 4
    if op == "Add":
        return _model([helper.make_node("Add", ["x", "z"], ["y"])], {**x, "z": (rows, cols)}, "y"), 3 * n
    if op == "MulBroadcast":
        w = numpy_helper.from_array(np.ones(cols, np.float32), "w")
        return _model([helper.make_node("Mul", ["x", "w"], ["y"])], x, "y", [w]), 2 * n
    if op == "Transpose":  # runs of cols / 4
        shape = (rows // 64, 64, 4, cols // 4)
        return _model([helper.make_node("Transpose", ["x"], ["y"], perm=[0, 2, 1, 3])], {"x": shape}, "y"), 2 * n
    if op == "TransposeLastAxis":  # rows of cols / 4 turned into columns
        shape = (rows // 64, 4, 64, cols // 4)
        return _model([helper.make_node("Transpose", ["x"], ["y"], perm=[0, 1, 3, 2])], {"x": shape}, "y"), 2 * n
    if op == "ReduceSumFirst":
        shape = (rows // 64, 64, cols)
        axes = numpy_helper.from_array(np.array([0, 1], np.int64), "axes")
        return _model([helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)], {"x": shape}, "y",
                      [axes]), n
    if op == "Div":
        return _model([helper.make_node("Div", ["x", "z"], ["y"])], {**x, "z": (rows, cols)}, "y"), 3 * n
    if op in ("Sqrt", "Tanh", "Erf"):
        return _model([helper.make_node(op, ["x"], ["y"])], x, "y"), 2 * n
    if op == "Pow":
        three = numpy_helper.from_array(np.array(3.0, np.float32), "three")
        return _model([helper.make_node("Pow", ["x", "three"], ["y"])], x, "y", [three]), 2 * n
    if op == "SubRows":  # a row's statistic taken from it: x - mean(x) over [rows, cols]
        return _model([helper.make_node("Sub", ["x", "m"], ["y"])], {**x, "m": (rows, 1)}, "y"), 2 * n + rows * 4
    if op == "ReduceMeanLast":
        return _model([helper.make_node("ReduceMean", ["x"], ["y"], axes=[-1])], x, "y"), n
    if op == "Softmax":
        return _model([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], x, "y"), 2 * n
    if op in ("SoftmaxMasked", "SoftmaxPadded"):  # over [cols, cols] scores with a causal mask's fill
        scores = MASKED if op == "SoftmaxMasked" else PADDED  # (half filled) or a padding mask's (`_feeds`)
        return _model([helper.make_node("Softmax", [scores], ["y"], axis=-1)],
                      {scores: (rows // cols, cols, cols)}, "y"), 2 * n
    if op == "LayerNorm":
        w = numpy_helper.from_array(np.ones(cols, np.float32), "w")
        b = numpy_helper.from_array(np.zeros(cols, np.float32), "b")
        return _model([helper.make_node("LayerNormalization", ["x", "w", "b"], ["y"], axis=-1)], x, "y",
                      [w, b]), 2 * n
    if op == "Where":  # a ReLU's gradient: reads the mask (one byte an element) and the gradient
        mask = numpy_helper.from_array(np.random.default_rng(0).random((rows, cols), dtype=np.float32) > 0.5, "mask")
        zero = numpy_helper.from_array(np.zeros((), np.float32), "zero")
        return _model([helper.make_node("Where", ["mask", "x", "zero"], ["y"])], x, "y", [mask, zero]), 2 * n + n // 4
    if op == "Concat":  # two halves joined on the last axis (a fused QKV's gradient: runs of a head's width)
        half = (rows, cols // 2)
        return _model([helper.make_node("Concat", ["x", "z"], ["y"], axis=-1)], {"x": half, "z": half}, "y"), 2 * n
    if op == "Split":  # and parted again (a fused QKV projection's output)
        return _model([helper.make_node("Split", ["x"], ["y", "w"], axis=-1)], x, "y"), 2 * n
    if op == "ScatterAdd":  # an embedding's gradient: rows added into a table at int64 indices
        table = 512
        idx = numpy_helper.from_array(np.random.default_rng(0).integers(0, table, (rows, 1)), "idx")
        return _model([helper.make_node("ScatterND", ["table", "idx", "x"], ["y"], reduction="add")],
                      {"table": (table, cols), **x}, "y", [idx]), n + rows * 8 + 2 * table * cols * 4
    if op == "WhereMasked":  # attention's causal mask: one [64, cols] mask broadcast over the scores
        shape = (rows // 64, 64, cols)
        mask = numpy_helper.from_array(np.tri(64, cols, dtype=bool), "mask")
        fill = numpy_helper.from_array(np.array(-1e9, np.float32), "fill")
        return _model([helper.make_node("Where", ["mask", "x", "fill"], ["y"])], {"x": shape}, "y", [mask, fill]), \
            2 * n + 64 * cols
    raise ValueError(op)


COPIES = 16  # copies of a small case's node in one session (`_copies`)


def _copies(model, k: int):
    """`model` (one node) with its node `k` times, each copy reading the same inputs and writing
    its own outputs, all of them graph outputs."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    node = graph.node[0]
    del graph.node[:]
    del graph.output[:]
    for i in range(k):
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.output[:] = [f"{o}.{i}" for o in node.output]
        graph.node.append(copy)
        graph.output.extend(onnx.helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None)
                            for o in copy.output)
    return out


def _pieces(model) -> float:
    """`parc.ops.node_pieces` of a one-node benchmark model, as the importer reads it."""
    from parc.ir.importer import from_model
    from parc.ops.base import node_pieces

    return node_pieces(from_model(model, source="benchmark").nodes[0])


def _matmul(batch: tuple, m: int, k: int, n: int):
    from onnx import helper

    return _model([helper.make_node("MatMul", ["a", "b"], ["y"])], {"a": (*batch, m, k), "b": (*batch, k, n)}, "y")


PRODUCTS = ("MatMul", "BatchMatMul", "Gemm")  # the product classes (`op_class`) a model's own cases may have
GEMM_ATTRS = ("transA", "transB")  # a Gemm's attributes that shape its work (alpha and beta do not)
# a convolution's attributes that shape its work (what `model_cases` tells cases apart by)
CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "output_padding", "output_shape", "pads", "strides")
SPLIT = "split"  # a product case's dims of its two operands that hold the batch (`rank_cases`): not an ONNX attribute


def _case(cls: str, x: tuple, w: tuple, attrs: dict):
    """(model, FLOPs) of one product or convolution of class `cls` (`op_class`: ConvWeightGrad is a
    Conv, BatchMatMul a MatMul) on operands of shapes `x` and `w`, the FLOPs as the cost model counts
    them (`parc.ops.base.node_work` on the inferred output shape)."""
    import onnx
    from onnx import helper

    from parc.ir.dtypes import DType
    from parc.ir.graph import Node, Value
    from parc.ops.base import node_work

    kind = {"ConvWeightGrad": "Conv", "BatchMatMul": "MatMul"}.get(cls, cls)
    onnx_attrs = {a: v for a, v in attrs.items() if a != SPLIT}
    proto = helper.make_node(kind, ["x", "w"], ["y"], **onnx_attrs)
    model = _model([proto], {"x": x, "w": w}, "y")
    out = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph.output[0]
    y = tuple(d.dim_value for d in out.type.tensor_type.shape.dim)
    if not y or min(y) <= 0:
        raise ValueError(f"its output would be {list(y)}")
    if kind in ("Conv", "ConvTranspose"):
        channels = w[0] if kind == "ConvTranspose" else attrs.get("group", 1) * w[1]
        if x[1] != channels:
            raise ValueError(f"its input has {x[1]} channels, the weight expects {channels}")
    f32 = DType.from_numpy(np.float32)
    node = Node(kind, [Value("x", f32, tuple(x)), Value("w", f32, tuple(w))], [Value("y", f32, y)],
                {a.name: a for a in proto.attribute})
    return model, node_work(node)[0]


def _batch_sizes(graph) -> set[int]:
    """The sizes a step's batch takes in its tensors: the products of each leading run of dims of
    the graph's integer inputs (token ids, labels: [B, S] gives B and B x S), or of its first
    input's where it has none."""
    ints = [v for v in graph.inputs if v.shape and v.dtype is not None and v.dtype.numpy.kind in "iu"]
    sizes = set()
    for v in ints or graph.inputs[:1]:
        prod = 1
        for d in v.shape or ():
            prod *= d
            sizes.add(prod)
    return sizes


def _product_split(a: tuple, b: tuple, attrs: dict, batch: set[int]) -> list[list[int]] | None:
    """The dims of a product's operands that hold the batch, [dims of a, dims of b], where the
    batch is: a leading dim of both (attention's [B, heads, S, d]) or of `a` alone (a projection
    of [B, S, h] by a weight), the rows of `a` ([B x S, h] by a weight), or the contracted dim (a
    weight's gradient, [B x S, h] transposed times [B x S, o]); None where no dim is a batch size."""
    if len(a) < 2 or len(b) < 2:
        return None
    if len(a) > 2 and a[0] in batch:
        return [[0], [0] if len(b) == len(a) and b[0] == a[0] else []]
    ta, tb = attrs.get("transA", 0), attrs.get("transB", 0)
    rows, inner = (len(a) - 1, len(a) - 2) if ta else (len(a) - 2, len(a) - 1)
    b_inner = len(b) - 1 if tb else len(b) - 2
    if len(a) == 2 and a[rows] in batch:
        return [[rows], []]
    if a[inner] in batch and b[b_inner] == a[inner]:
        return [[inner], [b_inner]]
    return None


def model_cases(paths: Sequence[str | Path], dims: Mapping[str, int] | None = None) -> dict[str, list[tuple]]:
    """The float32 products (MatMul, Gemm) and convolutions of the ONNX models at `paths` (a
    training step from `parc grad` has its gradients' too), by class (`parc.ops.op_class`): one
    case (first operand's shape, second's, attributes, how many nodes have it) per distinct shape.
    A convolution's speed depends on its shape far more than a matmul's (onnxruntime on a CPU: 3x3
    input gradients and weight gradients run at 0.05-0.5 of a forward one's rate), and a small
    model's products run faster than the built-in cases' larger ones, so a model's classes are
    best measured on its own shapes. A product's case says where its batch is (`SPLIT`, for
    `rank_cases`). `dims`: values of the models' symbolic dims (`--dim`)."""
    from parc.errors import ParcError
    from parc.ir.dtypes import DType
    from parc.ir.importer import from_model, read_model, symbolic_dims
    from parc.ops.base import op_class

    f32 = DType.from_numpy(np.float32)
    found: dict[tuple, list] = {}
    dims = dict(dims or {})
    bound: set[str] = set()
    for path in paths:
        try:
            model = read_model(path)
            names = set(symbolic_dims(model)) & set(dims)  # each model binds the dims it has
            graph = from_model(model, {name: dims[name] for name in names}, base_dir=Path(path).parent,
                               source=str(path))
        except ParcError as e:
            raise UsageError(f"--model: {e}") from None
        bound |= names
        batch = _batch_sizes(graph)
        for n in graph.nodes:
            if n.op_type not in ("Conv", "ConvTranspose", "MatMul", "Gemm") or len(n.inputs) < 2:
                continue
            x, w = n.inputs[0], n.inputs[1]
            if x is None or w is None or x.shape is None or w.shape is None or x.dtype != f32 or w.dtype != f32:
                continue
            if n.op_type in ("MatMul", "Gemm"):
                attrs = {a: n.attr(a) for a in GEMM_ATTRS if n.attr(a)} if n.op_type == "Gemm" else {}
                split = _product_split(tuple(x.shape), tuple(w.shape), attrs, batch)
                if split is not None:
                    attrs[SPLIT] = split
            else:
                attrs = {a: n.attr(a) for a in CONV_ATTRS if a in n.attrs}
            key = (op_class(n), tuple(x.shape), tuple(w.shape), repr(sorted(attrs.items())))
            found.setdefault(key, [key[0], key[1], key[2], attrs, 0])[4] += 1
    if set(dims) - bound:
        raise UsageError(f"--dim {', '.join(sorted(set(dims) - bound))}: no --model file has a symbolic dim of "
                         "that name")
    out: dict[str, list[tuple]] = {}
    for cls, x, w, attrs, count in found.values():
        out.setdefault(cls, []).append((x, w, attrs, count))
    return out


COVER = 0.95  # the share of a class's FLOPs whose shapes `parc profile --model` measures


def measurable_cases(cases: Mapping[str, list[tuple]], counts: Sequence[int]) -> tuple[dict[str, list[tuple]], str]:
    """(the cases of `cases` (`model_cases`) that hold `COVER` of each class's FLOPs, the largest
    first: the rest are small shapes that cost a benchmark each and little of a step; what was
    kept, for the file's header). Every kept case is built at every rank count's share
    (`rank_cases`) first, so that one onnxruntime cannot take is a one-line error before minutes
    of measuring, not a failure halfway."""
    def flops(cls: str, x: tuple, w: tuple, attrs: dict, k: int) -> float:
        try:
            return _case(cls, x, w, attrs)[1]
        except Exception as e:  # onnx's inference refuses it
            shown = {a: v for a, v in attrs.items() if a != SPLIT}
            raise UsageError(f"--model: cannot measure the {cls} of operands {list(x)} and {list(w)} "
                             f"({shown}) on {k} rank(s): {str(e).strip().splitlines()[0]}") from None

    kept: dict[str, list[tuple]] = {}
    said = []
    for cls, items in cases.items():
        work = [count * flops(cls, x, w, attrs, 1) for x, w, attrs, count in items]
        order = sorted(range(len(items)), key=lambda i: -work[i])
        total, running = sum(work), 0.0
        for i in order:
            if running >= COVER * total and kept.get(cls):
                break
            kept.setdefault(cls, []).append(items[i])
            running += work[i]
        said.append(f"{cls}: {sum(c for *_, c in items)} nodes, {len(items)} shapes, the {len(kept[cls])} largest "
                    f"measured ({running / max(total, 1e-30):.0%} of its FLOPs)")
    for k in counts:
        for cls, items in rank_cases(kept, k).items():
            for x, w, attrs, _ in items:
                flops(cls, x, w, attrs, k)
    return kept, "; ".join(said)


def write_cases(path: Path, cases: Mapping[str, list[tuple]]) -> None:
    """`cases` for the ranks of a profiling job (`read_cases`): the parent reads the models once."""
    path.write_text(json.dumps({cls: [[list(x), list(w), attrs, count] for x, w, attrs, count in items]
                                for cls, items in cases.items()}))


def read_cases(path: str | Path | None) -> dict[str, list[tuple]]:
    if path is None:
        return {}
    return {cls: [(tuple(x), tuple(w), attrs, count) for x, w, attrs, count in items]
            for cls, items in json.loads(Path(path).read_text()).items()}


def rank_cases(cases: Mapping[str, list[tuple]], k: int) -> dict[str, list[tuple]]:
    """`cases` (`model_cases`) as each of `k` ranks runs them when the plan splits the batch: a
    product's batch dims (`SPLIT`; one without runs whole), a forward or input-gradient
    convolution's input rows (dim 0), a weight gradient's contracted batch (dim 1 of both operands:
    N, and g x N for the input of a grouped one, whose g groups each contract the batch). The class
    is `op_class`'s (a kernel larger than its output): a forward convolution whose kernel covers
    more than its output (a 4x4 kernel on a 4x4 input) is split as a weight gradient, and a weight
    gradient of a 1x1 output as a forward one; both are rare, and only this calibration's split is
    off for them."""
    def part(n: int) -> int:
        return max(1, -(-n // k))

    def divided(shape: tuple, at: list[int]) -> tuple:
        return tuple(part(d) if i in at else d for i, d in enumerate(shape))

    out: dict[str, list[tuple]] = {}
    for cls, items in cases.items():
        for x, w, attrs, count in items:
            group = attrs.get("group", 1)
            if cls in PRODUCTS:
                at_x, at_w = attrs.get(SPLIT) or ([], [])
                x, w = divided(x, at_x), divided(w, at_w)
            elif cls == "ConvWeightGrad" and len(x) > 2 and x[1] == group * w[1]:
                x, w = (x[0], group * part(w[1]), *x[2:]), (w[0], part(w[1]), *w[2:])
            elif cls != "ConvWeightGrad":
                x = (part(x[0]), *x[1:])
            out.setdefault(cls, []).append((x, w, attrs, count))
    return out


class _OrtBench:
    """One benchmark model in an onnxruntime session."""

    def __init__(self, model, threads: int) -> None:
        from parc.exec.runner import ort_session

        self.session = ort_session(model.SerializeToString(), threads)
        self.shapes = {i.name: tuple(i.shape) for i in self.session.get_inputs()}

    def place(self, array: np.ndarray):
        return array

    def run(self, feeds: dict) -> None:
        self.session.run(None, feeds)


class _ArrayBench:
    """One benchmark model in parc's array engine (numpy on the CPU or CuPy on a GPU), timed to
    the end of its kernels (the GPU is synchronised after each run). Outputs are made contiguous:
    a Transpose is a view in the engine, and its copy is paid by whichever kernel reads it."""

    def __init__(self, model, device: str, fuse: bool | None = None) -> None:
        from parc.exec.engines.array import ArrayEngine

        self.engine = ArrayEngine(model, device=device, fuse=fuse)
        self.shapes = {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in model.graph.input}
        self.sync = self.engine.xp.cuda.get_current_stream().synchronize if device == "gpu" else (lambda: None)

    def place(self, array: np.ndarray):
        return self.engine.xp.asarray(array)

    def run(self, feeds: dict) -> None:
        for value in self.engine.run(feeds).values():
            self.engine.xp.ascontiguousarray(value)
        self.sync()


def _session(model, threads: int, engine: tuple[str, str] = ("ort", "cpu"), fuse: bool | None = None):
    """A benchmark of `model` on `engine` (`runner.pick_engine`'s (kind, device))."""
    kind, device = engine
    return _OrtBench(model, threads) if kind == "ort" else _ArrayBench(model, device, fuse)


def _seconds(session, feeds: list[dict], budget: float = BUDGET, least: int = 5) -> float:
    """Mean seconds of one run over about `budget` seconds, the feeds taken in turn (so that
    inputs come from memory, not from a cache warmed by the run before). The mean, not the
    median: ranks sharing cores are descheduled for whole time slices, and a short run either
    escapes that or takes all of it; the mean charges each run its share, as a step sees it."""
    session.run(feeds[0])
    times: list[float] = []
    spent = 0.0
    while len(times) < least or spent < budget:
        f = feeds[len(times) % len(feeds)]
        t0 = time.perf_counter()
        session.run(f)
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
        if len(times) >= 2000:
            break
    return statistics.fmean(times)


def _feeds(session, pool_bytes: int = POOL_BYTES) -> list[dict]:
    rng = np.random.default_rng(0)
    one = sum(int(np.prod(s)) * 4 for s in session.shapes.values())
    copies = max(1, min(64, pool_bytes // max(one, 1)))

    def values(name: str, shape: tuple) -> np.ndarray:
        x = rng.standard_normal(shape, dtype=np.float32)
        if name == MASKED:  # above the diagonal of its last two dims: a causal mask's fill
            x[..., ~np.tri(shape[-2], shape[-1], dtype=bool)] = -1e9
        if name == PADDED:  # the keys a sequence's padding hides, for every query of it
            x[~padding(rng, (*shape[:-2], shape[-1])).astype(bool)[..., None, :].repeat(shape[-2], -2)] = -1e9
        return x

    return [{n: session.place(values(n, s)) for n, s in session.shapes.items()} for _ in range(copies)]


def host_probe(threads: int, engine: tuple[str, str] = ("ort", "cpu"), budget: float = 0.3) -> float:
    """Seconds of one fixed product (`PROBE`) on `engine`, the mean over about `budget` seconds:
    how fast this host runs now. `parc profile` probes before each rank count and at the end
    (a shared host's speed moves by tens of percent over minutes, and a calibration measured in a
    slow spell predicts every step slow); `benchmarks/predict.py` probes before each run."""
    s = _session(_matmul(*PROBE), threads, engine)
    return _seconds(s, _feeds(s, _sizes(engine).pool_bytes), budget)


def _sizes(engine: tuple[str, str]) -> Sizes:
    """The benchmarks' shapes for `engine`'s device."""
    return GPU_SIZES if engine[1] == "gpu" else CPU_SIZES


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def measure_rank(comm, threads: int, budget: float = BUDGET, engine: tuple[str, str] = ("ort", "cpu"),
                 cases: Mapping[str, list[tuple]] | None = None) -> dict:
    """This rank's figures (every rank of the job runs it at the same time), each benchmark run
    for about `budget` seconds on `engine` (`runner.pick_engine`'s (kind, device)). `cases`: a
    model's products and convolutions (`model_cases`), measured at this job's share of their batch
    instead of the built-in cases of the classes they have."""
    barrier = comm.barrier if comm.size > 1 else (lambda: None)
    sizes = _sizes(engine)

    def timed(model, fuse: bool | None = None) -> float:
        s = _session(model, threads, engine, fuse)
        feeds = _feeds(s, sizes.pool_bytes)
        barrier()  # every rank measures at once
        t = _seconds(s, feeds, budget)
        del s, feeds  # a GPU's memory back to the pool before the next benchmark
        return t

    # the chain unfused: the floor is what each node's kernel costs (fusion is the engine's gain)
    one, many = timed(_chain(1), fuse=False), timed(_chain(CHAIN), fuse=False)
    floor = max((many - one) / (CHAIN - 1), 1e-9)
    overhead = max(one - floor, 0.0)

    def stream(op: str, r: int) -> dict:
        model, nbytes = _memory_op(op, r)
        t = timed(model) - overhead
        return {"op": op, "bytes": nbytes, "s": t, "bytes_per_s": nbytes / max(t - floor, 1e-9), "pieces": _pieces(model)}

    rows = {"launch_floor_s": floor, "task_overhead_s": overhead, "matmul": [],
            "memory": [stream(op, r) for op in MEMORY_OPS for r in sizes.memory_rows],
            "sweep": [stream("Add", r) for r in sizes.sweep_rows]}
    rows["pieces"] = []
    for op in PIECE_OPS if sizes.piece_cols else ():
        model, nbytes = _memory_op(op, PIECE_ROWS, sizes.piece_cols)
        rows["pieces"].append({"op": op, "bytes": nbytes, "pieces": _pieces(model), "s": timed(model) - overhead})
    # a small case runs COPIES times in one session, so that the run's overhead (as long as the
    # node itself) is a sixteenth of the figure's error, not all of it
    rows["small"] = []
    for op in MEMORY_OPS if sizes.small else ():
        model, nbytes = _memory_op(op, *sizes.small)
        rows["small"].append({"op": op, "bytes": nbytes, "pieces": _pieces(model),
                              "s": (timed(_copies(model, COPIES)) - overhead) / COPIES})
    for batch, m, k, n in sizes.small_matmuls:
        flops = 2 * int(np.prod(batch, dtype=np.int64)) * m * k * n
        rows["small"].append({"shape": [*batch, m, k, n], "flops": flops,
                              "s": (timed(_copies(_matmul(batch, m, k, n), COPIES)) - overhead) / COPIES})
    own = rank_cases(cases or {}, comm.size)
    for batch, m, k, n in sizes.matmuls:
        if matmul_class([*batch, m, k, n]) in own:
            continue
        t = timed(_matmul(batch, m, k, n)) - overhead
        flops = 2 * int(np.prod(batch, dtype=np.int64)) * m * k * n
        rows["matmul"].append({"shape": [*batch, m, k, n], "s": t, "flops_per_s": flops / max(t - floor, 1e-9)})
    rows["conv"] = []
    runs = [(cls, x, w, attrs, None) for cls, items in (*sizes.convs.items(), ("Gemm", sizes.gemms))
            if cls not in own for x, w, attrs in items]
    runs += [(cls, x, w, attrs, count) for cls, items in own.items() for x, w, attrs, count in items]
    for cls, x, w, attrs, count in runs:
        model, flops = _case(cls, x, w, attrs)
        t = timed(model) - overhead
        row = {"class": cls, "input": list(x), "weight": list(w), "s": t, "flops": flops,
               "flops_per_s": flops / max(t - floor, 1e-9)}
        if count is not None:  # a model's own: its nodes of this shape
            row["count"] = count
        elif sizes.conv_pieces and cls not in PRODUCTS:
            row["pieces"] = _pieces(model)
        rows["matmul" if cls in PRODUCTS else "conv"].append(row)
    if engine[1] == "cpu":
        rows["cold"] = _cold_reads(threads, engine, barrier)
    if comm.size > 1:
        rows["all_reduce"] = _all_reduces(comm, threads, engine)
        rows["collectives"] = _other_collectives(comm)
    return rows


def _other_collectives(comm) -> list[dict]:
    """Seconds of a reduce-scatter, an all-gather and an all-to-all over the whole job, of tensors
    of ALL_REDUCE_BYTES (the reduce-scatter's input, the all-gather's output, the all-to-all's
    whole tensor: each rank holds its share), in bursts as the all-reduces' (the mean over the
    calls after each burst's first), through the calls the executor makes (`parc.exec.comm`: its
    copies included; an all-to-all split along one dim and concatenated along another, as a
    resharding S(i) -> S(j) runs it). Every rank gets the rows."""
    k = comm.size
    rows = []
    for kind in ("reduce_scatter", "all_gather", "all_to_all"):
        for nbytes in ALL_REDUCE_BYTES:
            x = np.ones(max(nbytes // 4 // k, 1) * k, np.float32)
            piece = x[: x.size // k]
            mine = np.ones((k, max(nbytes // 4 // k // k, 1)), np.float32)  # this rank's share, k pieces
            times = []
            for _ in range(ARRIVALS // 3):
                comm.barrier()
                for i in range(BURST):
                    t0 = time.perf_counter()
                    if kind == "reduce_scatter":
                        comm.reduce_scatter(x, 0)
                    elif kind == "all_gather":
                        comm.all_gather(piece, 0)
                    else:
                        comm.all_to_all(mine, split_dim=0, concat_dim=1)
                    if i:
                        times.append(time.perf_counter() - t0)
            whole = mine.nbytes * k if kind == "all_to_all" else x.nbytes
            rows.append({"kind": kind, "n": k, "bytes": whole, "s": statistics.fmean(times)})
    return comm.comm.bcast(rows, root=k - 1)


def _cold_reads(threads: int, engine: tuple[str, str], barrier: Callable[[], None]) -> list[dict]:
    """An Add's seconds right after this rank wrote each of COLD_TOUCH bytes elsewhere (every
    rank at once): from 0 (its inputs as the run before left them) to more than the host's
    caches keep for it. The median of COLD_REPEATS, each after its own writing."""
    model, nbytes = _memory_op("Add", COLD_ROWS)
    session = _session(model, threads, engine)
    feed = _feeds(session)[0]
    other = np.zeros(max(COLD_TOUCH) // 4, np.float32)
    out = []
    for touch in COLD_TOUCH:
        part = other[:touch // 4]
        barrier()
        times = []
        for _ in range(COLD_REPEATS):
            session.run(feed)
            part += 1.0  # reads and writes `touch` bytes
            t0 = time.perf_counter()
            session.run(feed)
            times.append(time.perf_counter() - t0)
        out.append({"touched": touch, "bytes": nbytes, "s": statistics.median(times)})
    return out


def fit_cold(rows: list[dict]) -> tuple[float, float]:
    """(cold_bandwidth, cache_share) from `_cold_reads`' rows: the Add's rate after the most
    writing, and the traffic (each written byte read and written: twice the bytes) at which its
    rate falls to the geometric mean of that and its rate after none, interpolated on a log
    scale between the rows around it. (0, 0) where the rate does not fall by COLD_RATIO (the
    caches hold it all, or none of it: every read at memory's rates)."""
    rates = [(r["touched"], r["bytes"] / r["s"]) for r in sorted(rows, key=lambda r: r["touched"])]
    warm, cold = rates[0][1], rates[-1][1]
    if warm < COLD_RATIO * cold:
        return 0.0, 0.0
    mid = math.sqrt(warm * cold)
    for (x0, r0), (x1, r1) in zip(rates, rates[1:]):
        if r1 <= mid:
            if x0 == 0 or r0 <= r1:
                return cold, 2.0 * x1
            share = math.exp(math.log(x0) + (math.log(x1) - math.log(x0)) * (r0 - mid) / (r0 - r1))
            return cold, 2.0 * share
    return cold, 2.0 * rates[-1][0]


def _all_reduces(comm, threads: int, engine: tuple[str, str] = ("ort", "cpu")) -> list[dict]:
    """Seconds of all-reduces as the last member to arrive sees them: the first after compute
    (an onnxruntime matmul, the members arriving 1 ms apart, as in a step), then a burst of them
    back to back (as a step's gradients are); over the whole job, and over pairs of ranks while
    the other pairs compute. On a host whose ranks outnumber its cores these are mostly waits for
    a core (the first: the link's handoff). Every rank gets the rows (from the last rank)."""
    busy = _session(_matmul((), 128, 128, 128), threads, engine)
    feed = _feeds(busy)[0]

    def compute(seconds: float) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            busy.run(feed)

    r, k = comm.rank, comm.size
    pair = comm.for_ranks((r - r % 2, r - r % 2 + 1)) if k > 2 and k % 2 == 0 else None  # odd k: no pairs
    rows = []
    # the whole job (everyone communicates), then pairs while the other ranks compute (a
    # pipeline stage's collectives run while the other stages work)
    for group, turns in ((comm, 1), (pair, 2)) if pair is not None else ((comm, 1),):
        for nbytes in ALL_REDUCE_BYTES:
            x = np.ones(nbytes // 4, np.float32)
            first, burst = [], []
            for _ in range(ARRIVALS):
                for turn in range(turns):  # pairs take turns: half of them communicate, half compute
                    comm.barrier()
                    if turns > 1 and (r // 2) % 2 != turn:
                        compute(ARRIVAL_STEP * (BURST + 2))
                        continue
                    compute(ARRIVAL_STEP * (group.rank + 1))
                    for i in range(BURST):
                        t0 = time.perf_counter()
                        group.all_reduce(x)
                        (burst if i else first).append(time.perf_counter() - t0)
            rows.append({"n": group.size, "bytes": nbytes, "first_s": statistics.fmean(first),
                         "s": statistics.fmean(burst)})
    return comm.comm.bcast(rows, root=k - 1)


def matmul_class(shape: Sequence[int]) -> str:
    """The class (`op_class`) of a built-in product [batch..., m, k, n]: `BatchMatMul` where
    its batch has more than one matrix, else `MatMul`."""
    return "BatchMatMul" if len(shape) > 3 and math.prod(shape[:-3]) > 1 else "MatMul"


# a memory benchmark's op -> the class it calibrates (`parc.ops.op_class`); None: the default
# (every elementwise op, and a fused tree of them)
MEMORY_CLASSES = {"Add": None, "MulBroadcast": None, "Transpose": "Transpose", "TransposeLastAxis": "TransposeLastAxis",
                  "ReduceSumFirst": "ReduceSum", "Div": "Div", "Sqrt": "Sqrt",
                  "ReduceMeanLast": "ReduceMean", "Softmax": "Softmax", "SoftmaxMasked": "SoftmaxMasked",
                  "SoftmaxPadded": "SoftmaxPadded",
                  "LayerNorm": "LayerNormalization",
                  "Where": "Where", "WhereMasked": "Where", "Pow": "Pow", "Tanh": "Tanh", "Erf": "Erf",
                  "SubRows": None, "ScatterAdd": "ScatterND", "Concat": "Concat", "Split": "Split"}


def fit_collectives(measured: list[dict]) -> dict:
    """A link's `call`, `latency` and `bandwidth` from all-reduce bursts: t = call + alpha *
    steps + volume / beta, the all-reduce's ring steps and volume (`parc.cluster.cost.STEPS`,
    `_VOLUME`: 2(n-1) and 2(n-1)/n B), least squares on the relative
    error with every coefficient >= 0 (the best of the column subsets that keep them so). The
    call cost needs rows of two group sizes to tell it from alpha; with one it is 0. On this VM,
    4 ranks on 2 cores, a 64 B all-reduce costs about 0.29 ms among all 4 ranks and among 2 while
    the other 2 compute: the cost is waiting for the members to run, one per call, not per ring
    step (alpha alone priced the pairs' at 0.13 ms and a pipeline stage's small collectives 7x
    under their measured time)."""
    from parc.cluster.cost import _VOLUME, STEPS

    t = np.array([r["s"] for r in measured])
    cols = {"call": np.ones(len(t)), "latency": np.array([STEPS["all_reduce"](r["n"]) for r in measured], float),
            "inv_beta": np.array([_VOLUME["all_reduce"](r["n"]) * r["bytes"] for r in measured])}
    subsets = [("latency", "inv_beta")]
    if len({r["n"] for r in measured}) > 1:
        subsets += [("call", "inv_beta"), ("call", "latency", "inv_beta")]
    best: tuple[float, dict] | None = None
    for names in subsets:
        a = np.stack([cols[c] / t for c in names], 1)
        coef, *_ = np.linalg.lstsq(a, np.ones(len(t)), rcond=None)
        if "call" in names and (coef <= 0).any():
            continue  # a subset with a call cost counts only where every coefficient is positive
        coef = np.maximum(coef, [1e-7 if c == "latency" else 1e-12 for c in names])  # as before
        resid = float(np.sum((a @ coef - 1) ** 2))
        if best is None or resid < best[0]:
            best = (resid, dict(zip(names, map(float, coef))))
    assert best is not None  # the first subset always counts
    c = best[1]
    return {"call": c.get("call", 0.0), "latency": c.get("latency", 1e-7), "bandwidth": 1.0 / c["inv_beta"]}


def fit_kind(measured: list[dict], kind: str, call: float) -> tuple[float, float]:
    """(latency, bandwidth) of one collective kind from its bursts: t = call + alpha * steps +
    volume / beta with the kind's ring steps and volume (`parc.cluster.cost.STEPS`, `_VOLUME`)
    and the link's call cost, least squares on the relative error, alpha >= 0."""
    from parc.cluster.cost import _VOLUME, STEPS

    t = np.array([r["s"] for r in measured])
    a = np.stack([np.array([STEPS[kind](r["n"]) for r in measured], float) / t,
                  np.array([_VOLUME[kind](r["n"]) * r["bytes"] for r in measured]) / t], 1)
    rhs = 1.0 - call / t
    coef, *_ = np.linalg.lstsq(a, rhs, rcond=None)
    if coef[0] < 0:  # no latency: the bandwidth alone
        coef = np.array([0.0, float(np.linalg.lstsq(a[:, 1:], rhs, rcond=None)[0][0])])
    return max(float(coef[0]), 0.0), 1.0 / max(float(coef[1]), 1e-15)


def fit_cache(rows: dict) -> tuple[float, float]:
    """(cache_bytes, cache_speedup) from one rank count's Adds (the memory rows' and the
    sweep's): the largest size up to which every Add streamed at least `CACHE_RATIO` times the
    rate of the two largest (memory's), and the geometric mean of those Adds' rates over memory's.
    A plain stream: the other classes' rows mix in their pieces and floors, which `fit_pieces` and
    the floors take apart. (0, 1) where no sweep was measured (a GPU's inputs rotate through more
    than its caches) or the smallest Add is not that much faster."""
    if not rows.get("sweep"):
        return 0.0, 1.0
    adds = sorted((r["bytes"], r["bytes_per_s"]) for r in rows["memory"] + rows["sweep"] if r["op"] == "Add")
    slow = _geomean([rate for _, rate in adds[-2:]])
    within = []
    for nbytes, rate in adds[:-2]:
        if rate < CACHE_RATIO * slow:
            break
        within.append((nbytes, rate))
    if not within:
        return 0.0, 1.0
    return float(within[-1][0]), _geomean([rate for _, rate in within]) / slow


def _from_memory(nbytes: float, cache: tuple[float, float]) -> float:
    """The share of a row's rate that is memory's: 1 / cache_speedup within the cache, else 1."""
    return 1.0 / cache[1] if 0 < nbytes <= cache[0] else 1.0


def fit_pieces(rows: dict, streams: dict, cache: tuple[float, float]) -> dict[str, float]:
    """Per class with piece cases (`PIECE_OPS`): seconds per piece, fitted with the class's rate
    to its rows (the built-in sizes' and the piece case: t - launch floor = bytes / rate + pieces *
    cost, least squares on the relative error; a row within the cache, `fit_cache`, streams
    cache_speedup times the rate). `streams` (bytes/s per class) takes the fitted
    rates. A class whose fit needs a negative coefficient keeps its rate and has a piece cost of 0
    (not none: a k-rank section of the file laid over one rank's would inherit that one's)."""
    out: dict[str, float] = {}
    floor = rows["launch_floor_s"]
    classes = {MEMORY_CLASSES.get(r["op"]) for r in rows.get("pieces", [])}
    if rows.get("pieces"):
        classes |= {MEMORY_CLASSES.get(op) for op in RUN_OPS}  # their memory rows differ in runs
    for cls in classes:
        measured = [r for r in rows["memory"] + rows.get("pieces", []) if MEMORY_CLASSES.get(r["op"]) == cls]
        if not measured:
            continue
        t = np.array([max(r["s"] - floor, 1e-9) for r in measured])
        a = np.array([[r["bytes"] * _from_memory(r["bytes"], cache), r.get("pieces", 0.0)]
                      for r in measured]) / t[:, None]
        (inv_rate, cost), *_ = np.linalg.lstsq(a, np.ones(len(t)), rcond=None)
        out[cls] = 0.0  # written as 0: a k-rank section must not inherit one rank's cost
        if inv_rate > 0 and cost > 0:
            streams[cls], out[cls] = float(1.0 / inv_rate), float(cost)
    return out


def fit_conv_pieces(convs: list[dict], rates: dict, cap: float, floor: float) -> dict[str, float]:
    """Per convolution class whose built-in rows carry pieces (`parc.ops.node_pieces`: the elements
    of the lowering): seconds per piece, fitted with the class's rate (t - launch floor = FLOPs /
    rate + pieces * cost, least squares on the relative error), the rate going into `rates`. A rate
    above `cap` (the 2-D product's: a convolution is one) is held at it and the cost fitted alone; a
    class whose cost comes out negative keeps its mean rate and a cost of 0, as does a class
    measured at a model's own shapes (rows with a `count`: their total rate is the model's step)."""
    out: dict[str, float] = {}
    for cls in {r["class"] for r in convs}:
        out[cls] = 0.0  # written as 0: a k-rank section must not inherit one rank's cost
        measured = [r for r in convs if r["class"] == cls and "pieces" in r]
        if len(measured) < 2 or any("count" in r for r in convs if r["class"] == cls):
            continue
        t = np.array([max(r["s"] - floor, 1e-9) for r in measured])
        a = np.array([[r["flops"], r["pieces"]] for r in measured]) / t[:, None]
        (inv_rate, cost), *_ = np.linalg.lstsq(a, np.ones(len(t)), rcond=None)
        if inv_rate < 1.0 / cap:
            inv_rate = 1.0 / cap
            rest = 1.0 - a[:, 0] * inv_rate
            cost = float(a[:, 1] @ rest / (a[:, 1] @ a[:, 1]))
        if cost > 0:
            rates[cls], out[cls] = float(1.0 / inv_rate), float(cost)
    return out


def fit(rows: dict, k: int) -> dict:
    """Calibration fields (SI) from one rank's measured rows. Each class's rate is the geometric
    mean of its sizes' (a model's own products and convolutions, rows with a `count`: its FLOPs
    over its time); the fastest class's is the peak (FLOP/s, bytes/s) and the others are fractions of it: matmuls
    are `MatMul` (a 2-D product) or `BatchMatMul`, convolutions their classes; memory-bound ops the
    elementwise default or their own class (`MEMORY_CLASSES`)."""
    def by_class(items) -> dict:
        groups: dict = {}
        for cls, rate in items:
            groups.setdefault(cls, []).append(rate)
        return {cls: _geomean(rates) for cls, rates in groups.items()}

    rates = by_class((r["class"] if "class" in r else matmul_class(r["shape"]), r["flops_per_s"])
                     for r in rows["matmul"] if "count" not in r)
    convs = rows.get("conv", [])
    rates.update(by_class((r["class"], r["flops_per_s"]) for r in convs if "count" not in r))
    # a model's own products and convolutions: its total FLOPs over its total time, each shape as
    # often as the model has it (what a step of it costs, not a typical size's rate)
    own: dict[str, list[float]] = {}
    for r in rows["matmul"] + convs:
        if "count" in r:
            acc = own.setdefault(r["class"], [0.0, 0.0])
            acc[0] += r["count"] * r["flops"]
            acc[1] += r["count"] * r["flops"] / r["flops_per_s"]
    rates.update({cls: flops / seconds for cls, (flops, seconds) in own.items()})
    conv_piece = fit_conv_pieces(convs, rates, rates.get("MatMul", max(rates.values())), rows["launch_floor_s"])
    peak = max(rates.values())  # efficiencies are fractions of the fastest class's rate
    main = rates.get("MatMul", peak)
    cache = fit_cache(rows)  # a row within the caches gives memory's rate as its own / cache_speedup
    streams = by_class((MEMORY_CLASSES.get(r["op"]), r["bytes_per_s"] * _from_memory(r.get("bytes", 0), cache))
                       for r in rows["memory"])
    piece = {**fit_pieces(rows, streams, cache), **conv_piece}
    bandwidth = max(streams.values())
    default = streams.get(None, bandwidth)
    # each class's floor: what its small cases take beyond the launch floor and what its rate
    # and piece cost give them (the mean over its cases; none below 0)
    floors: dict = {}
    for r in rows.get("small", []):
        if "op" in r:
            cls = MEMORY_CLASSES.get(r["op"])
            work = r["bytes"] * _from_memory(r["bytes"], cache) / streams.get(cls, default) + \
                r.get("pieces", 0.0) * piece.get(cls, piece.get(None, 0.0))
        else:
            cls = matmul_class(r["shape"])
            work = r["flops"] / rates.get(cls, main)
        floors.setdefault(cls, []).append(max(0.0, r["s"] - rows["launch_floor_s"] - work))
    floor = {cls: statistics.fmean(v) for cls, v in floors.items()}
    if "MatMul" in floor:
        floor.setdefault("Gemm", floor["MatMul"])  # a Gemm is a 2-D product with a bias
    out = {"peak_float32": peak, "compute_efficiency": main / peak,
           "op_efficiency": {cls: rate / peak for cls, rate in rates.items() if cls != "MatMul"},
           "memory_bandwidth": bandwidth, "memory_efficiency": default / bandwidth,
           "memory_op_efficiency": {cls: rate / bandwidth for cls, rate in streams.items() if cls is not None},
           "launch_floor": rows["launch_floor_s"], "task_overhead": rows["task_overhead_s"],
           "node_floor": floor.pop(None, 0.0), "op_floor": floor, "node_piece": piece.pop(None, 0.0),
           "op_piece": piece, "cache_bytes": cache[0], "cache_speedup": cache[1]}
    if rows.get("cold"):
        out["cold_bandwidth"], out["cache_share"] = fit_cold(rows["cold"])
    if k > 1 and rows.get("all_reduce"):
        measured = rows["all_reduce"]
        out.update(fit_collectives(measured))
        # the handoff: the first's excess where the message is only latency (the smallest size);
        # larger firsts also move their bytes through caches the compute evicted while other
        # ranks contend for memory, a cost of the size the burst does not see, and averaging them
        # in (as before) charged moe-tiny's 2-stage pipeline +118% (each of its small messages
        # after compute paid 1.76 ms on 4 ranks, against 0.74 ms from the 64 B rows)
        smallest = min(r["bytes"] for r in measured)
        out["handoff"] = max(0.0, statistics.fmean(r["first_s"] - r["s"] for r in measured if r["bytes"] == smallest))
        if rows.get("collectives"):  # reduce-scatters, all-gathers and all-to-alls at figures of their own
            out["kinds"] = {kind: fit_kind([r for r in rows["collectives"] if r["kind"] == kind], kind, out["call"])
                            for kind in sorted({r["kind"] for r in rows["collectives"]})}
    return out


def worker(out: str, budget: float, engine: str = "ort", cases: str | None = None) -> None:
    """One rank of a profiling job (run under mpiexec by `profile`): rank 0 writes the rows.
    `cases`: the file of a model's products and convolutions the parent wrote (`write_cases`)."""
    from parc.exec.comm import MpiComm
    from parc.exec.runner import keep_freed_memory, pick_engine, rank_threads

    keep_freed_memory()  # as `parc run` runs a rank
    comm = MpiComm(timeout=600.0)
    rows = measure_rank(comm, rank_threads(comm.size), budget, pick_engine(engine), read_cases(cases))
    if comm.rank == 0:
        Path(out).write_text(json.dumps(rows))


def gpu_device_type(cupy=None) -> str:
    """The catalogue's name for the GPU this process sees (its family in the name CUDA reports,
    the member whose memory is nearest the card's), e.g. 'NVIDIA H100 80GB HBM3' -> h100-80g."""
    from parc.cluster.devices import DEVICES

    name, memory = _gpu_card(cupy)
    words = name.lower().replace("-", " ").split()
    family = [spec for spec in DEVICES.values() if spec.name.split("-")[0] in words]
    if not family:
        raise UsageError(f"the GPU '{name}' is not in parc's device catalogue: name its type with --device "
                         f"(known: {', '.join(DEVICES)}, or one a cluster file defines)")
    return min(family, key=lambda spec: abs(spec.memory_bytes - memory)).name


def _gpu_card(cupy=None) -> tuple[str, int]:
    """The name CUDA reports for the current GPU and its memory in bytes."""
    if cupy is None:
        import cupy
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return (name.decode() if isinstance(name, bytes) else str(name)), int(props["totalGlobalMem"])


def profile(output: Path, max_ranks: int | None, budget: float = BUDGET, device: str | None = None, link: str = "shm",
            echo=print, engine: str = "ort", models: Sequence[str] = (),
            dims: Mapping[str, int] | None = None, reference: bool = True) -> dict[int, dict]:
    """Measure with 1, 2, 4, ... ranks (up to `max_ranks`; None: 1 on a GPU, else 4) on `engine`
    (`parc run --engine`'s names) and write the calibration file for device type `device` (by default `cpu`, or the
    catalogue's name of the GPU that `--engine cupy` measures). `models`: ONNX files whose own
    products and convolutions calibrate the classes they have (`model_cases`; `dims` binds their
    symbolic dims). `reference` (on CPUs): then run the reference steps (`reference_steps`) with
    the calibration written and write it again with each rank count's `step_ratio`."""
    import tempfile

    from parc.exec.launch import launch
    from parc.exec.runner import RunError, pick_engine, rank_threads

    kind = pick_engine(engine)  # refuses cupy without a usable GPU, in one line
    if max_ranks is None:
        max_ranks = 1 if kind[1] == "gpu" else 4
    if kind[1] == "gpu" and max_ranks != 1:
        raise UsageError(f"--ranks {max_ranks}: --engine cupy measures one GPU (--ranks 1); links between GPUs "
                         "are not measured yet (the catalogue's or a cluster file's figures are used)")
    if device is None:
        device = gpu_device_type() if kind[1] == "gpu" else "cpu"
    counts = [1]
    while counts[-1] * 2 <= max_ranks:
        counts.append(counts[-1] * 2)
    if max_ranks not in counts:
        counts.append(max_ranks)
    cases, own = measurable_cases(model_cases(models, dims), counts)
    measured: dict[int, dict] = {}
    probes: list[float] = []
    with tempfile.TemporaryDirectory(prefix="parc-profile-") as tmp:
        cases_file = Path(tmp) / "cases.json"
        write_cases(cases_file, cases)
        for k in counts:
            probes.append(host_probe(rank_threads(1), kind))
            path = Path(tmp) / f"rows.{k}.json"
            where = "on the GPU" if kind[1] == "gpu" else (
                f"({rank_threads(k)} thread{'s' if rank_threads(k) > 1 else ''} each)")
            echo(f"measuring {k} rank{'s' if k > 1 else ''} {where} ...")
            if k == 1:
                measured[k] = measure_rank(_Solo(), rank_threads(1), budget, kind, cases)
            else:
                rc = launch(k, ["profile", "--worker", str(path), "--seconds", str(budget), "--engine", engine,
                                "--cases", str(cases_file)])
                if rc:
                    raise RunError(f"the profiling job of {k} ranks failed (exit {rc})")
                measured[k] = json.loads(path.read_text())
    probes.append(host_probe(rank_threads(1), kind))
    speeds = [probes[0] / t for t in probes]  # the host's speed against the first probe's
    if max(probes) > STEADY * min(probes):
        echo(f"warning: this host's speed moved by {max(probes) / min(probes) - 1:.0%} while profiling (a fixed "
             f"product ran at {', '.join(f'{v:.2f}' for v in speeds)} of its first speed): the figures are of a "
             f"mix of its speeds; profile again when it is quieter, or with a longer --seconds")
    fitted = {k: fit(rows, k) for k, rows in measured.items()}
    text = (f"{', '.join(map(str, models))} ({own or 'no float32 products or convolutions'})" if models else "",
            speeds, (os.cpu_count() or 0) if kind[1] == "cpu" else 0, models)
    write_calibration(output, fitted, measured, device, link, _engine_text(kind), *text)
    if reference and kind[1] == "cpu":
        try:
            with tempfile.TemporaryDirectory(prefix="parc-profile-") as tmp:
                refs = reference_models(Path(tmp), models, dims)
                try:
                    links = link_ratios(output, counts, text[2], device, engine, Path(tmp), echo, refs)
                except RunError as e:  # a model that cannot be split evenly, say: the links keep their figures
                    echo(f"warning: {e}; the links are written without step_ratio")
                    links = {}
                for k, rows in links.items():
                    fitted[k]["link_step_ratio"], handoff = fit_link_ratio(rows)
                    if handoff is not None:  # in a step's terms, as the ratio is (the bursts' stays in "handoff")
                        fitted[k]["link_handoff"] = handoff
                    measured[k]["split"] = rows
                if links:  # the compute's ratio is fitted with the collectives' in place
                    write_calibration(output, fitted, measured, device, link, _engine_text(kind), *text)
                steps = reference_steps(output, counts, device, engine, Path(tmp), echo, refs=refs,
                                        probes=dict(zip(counts, probes)))
        except RunError as e:  # the benchmarks' figures are written and stand without the ratios
            for k in fitted:
                fitted[k].pop("link_step_ratio", None)
                fitted[k].pop("link_handoff", None)
                measured[k].pop("split", None)
            write_calibration(output, fitted, measured, device, link, _engine_text(kind), *text)
            echo(f"warning: {e}; {output} is written without step_ratio (node times as the benchmarks price them)")
            return measured
        for k, rows in steps.items():
            fitted[k]["step_ratio"] = fit_step_ratio(rows)
            measured[k]["steps"] = rows
        write_calibration(output, fitted, measured, device, link, _engine_text(kind), *text)
    return measured


def _parc(*argv: object) -> str:
    """`parc ARGV`'s stdout, run as a user runs it; a failure is a RunError naming the command."""
    import subprocess
    import sys

    from parc.exec.runner import RunError

    cmd = [sys.executable, "-m", "parc.cli.main", *map(str, argv)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        last = (res.stderr.strip().splitlines() or ["no message"])[-1]
        raise RunError(f"parc profile's reference step `parc {' '.join(map(str, argv[:2]))} ...` failed: {last}")
    return res.stdout


def reference_models(tmp: Path, models: Sequence[str | Path] = (),
                     dims: Mapping[str, int] | None = None) -> tuple[list[str], list[tuple[str, Path]]]:
    """The reference training steps: `models` (`dims` bound by the `--dim` arguments returned)
    where given, else the zoo's `REFERENCE_STEPS`, built into `tmp`: (arguments, [(name, file)])."""
    if models:
        return ([x for name, value in (dims or {}).items() for x in ("--dim", f"{name}={value}")],
                [(Path(m).name, Path(m)) for m in models])
    steps = []
    for name, sets in REFERENCE_STEPS:
        steps.append((name, tmp / f"{name}.train.onnx"))
        _parc("models", "build", name, *(x for s in sets for x in ("--set", s)), "--train", "momentum",
              "-o", steps[-1][1])
    return [], steps


def link_ratios(calibration: Path, counts: Sequence[int], cpus: int, device: str, engine: str, tmp: Path,
                echo=print, refs: tuple[list[str], list[tuple[str, Path]]] = ([], [])) -> dict[int, list[dict]]:
    """Per rank count k whose ranks have a core each (2 <= k <= `cpus`): every reference step
    planned on k ranks with every parameter split (`SPLIT_HINTS`) and `calibration`, run with
    `parc run --trace` `SPLIT_TRACES` times: per run, the seconds its collectives took from their
    last member's arrival to their end (what the simulation holds them for), the handoff the
    simulation charged them on top of their figures, and their figures' seconds (`time_s`).

    The burst benchmarks time collectives back to back on one buffer; in a step each runs after
    modules that filled the caches with their own tensors. Where ranks outnumber the cores the
    collectives' time is mostly waiting for a core (the handoff, priced as the host was crowded),
    and no ratio is fitted: on 4 ranks sharing 2 cores the traced tensor-parallel step's
    collectives ran 3x their figures while a data-parallel step's gradient all-reduce took its
    figure and handoff. A reference that cannot be planned split (a model whose dims the ranks
    do not divide, say) is left out with a warning; the links are fitted on the others."""
    from parc.exec.runner import RunError

    bound, steps = refs
    if not steps:
        return {}
    hints = tmp / "split.yaml"
    hints.write_text(SPLIT_HINTS)
    rows: dict[int, list[dict]] = {}
    for k in counts:
        if not 2 <= k <= cpus:
            continue
        rows[k], failed = [], []
        for j, (name, model) in enumerate(steps):
            echo(f"running the reference step {name}, every parameter split, on {k} ranks ...")
            plan = tmp / f"split.{k}.{j}"
            try:
                _parc("plan", model, "--devices", f"{k}x{device}", "--calibration", calibration, "--hints", hints,
                      *bound, "-o", plan)
                rows[k].extend(_traced_collectives(plan, name, engine, tmp / f"split.{k}.{j}"))
            except RunError as e:
                failed.append((name, e))
        if not rows[k]:
            raise failed[0][1]
        for name, e in failed:
            echo(f"warning: {e}; the links are fitted without {name}")
    return rows


def _traced_collectives(plan: Path, name: str, engine: str, stem: Path) -> list[dict]:
    """`link_ratios`' rows of one split plan: it is run `SPLIT_TRACES` times with `--trace`."""
    from parc.exec.stepsim import COMM
    from parc.exec.trace import collective_seconds
    from parc.plandir import load_plan
    from parc.plandir.taskgraph import load_taskgraph

    graph = load_taskgraph(plan / "taskgraph.json")
    collectives = {tid for tid, t in graph.tasks.items() if t["kind"] == "collective" and len(t["group"]) > 1}
    held: dict[str, float] = {}  # from the replay `parc plan` wrote (every rank is in every collective)
    for spans in load_plan(plan)["simulation"]["timeline"].values():
        for a, b, kind, label in spans:
            if kind == COMM and label in collectives:
                held[label] = b - a
    figures = sum(graph.tasks[tid]["time_s"] for tid in collectives)
    charged = {tid: max(0.0, held.get(tid, 0.0) - graph.tasks[tid]["time_s"]) for tid in collectives}
    # the share of the link's handoff each was charged: 0 after another collective, up to 1
    # after compute on a crowded host (`stepsim.handoff_share`)
    shares = {tid: min(1.0, charged[tid] / graph.tasks[tid]["handoff_s"]) if graph.tasks[tid].get("handoff_s")
              else 0.0 for tid in collectives}
    rows = []
    for i in range(SPLIT_TRACES):
        trace = stem.with_name(f"{stem.name}.{i}.json")
        _parc("run", plan, "--steps", SPLIT_STEPS, "--trace", trace, "--engine", engine)
        took = collective_seconds(trace)
        rows.append({"model": name, "collectives": len(collectives), "figures_s": figures,
                     "handoff_s": sum(charged.values()), "measured_s": sum(took.get(tid, 0.0) for tid in collectives),
                     "points": [(graph.tasks[tid]["time_s"], took.get(tid, 0.0), shares[tid])
                                for tid in sorted(collectives)]})
    return rows


def fit_link_ratio(rows: Sequence[dict]) -> tuple[float, float | None]:
    """(the link's `step_ratio`, its handoff) for one rank count from its traced runs
    (`link_ratios`): each collective took t = ratio x its figure + handoff x the share of the
    handoff the simulation charged it (1 after compute with every rank computing, 0 after another
    collective), t the median of its runs' (`_typical_points`). The two are fitted by least squares
    over the collectives of every reference, constrained to give their total (what a step's
    prediction adds up), the ratio within `STEP_RATIO_RANGE`
    and the handoff >= 0. The burst benchmarks time collectives back to back on one buffer, and
    their handoff is a 64 B all-reduce's after one product; in a step a collective moves tensors
    the modules just wrote, and the first after a module waits for the ranks to let go of their
    engines. On this project's 2-core VM, unet-tiny's 65 tensor-parallel collectives on 2 ranks
    fitted x1.91 and 73 us (one ratio: x2.68 with the bursts' 35 us), which priced moe-tiny's 30
    gradient all-reduces, back to back after its step's compute, at 0.76 ms against 0.70 traced
    (one ratio: 0.99 ms). No collective with a figure: (1, None), the bursts' handoff kept."""
    points = [p for p in _typical_points(rows) if p[0] > 0]
    if not points:
        return 1.0, None
    low, high = STEP_RATIO_RANGE
    f, t, share = (np.array(column, float) for column in zip(*points))
    total_f, total_s, total_t = f.sum(), share.sum(), t.sum()
    # on the line ratio x total_f + handoff x total_s = total_t: the handoff that fits best
    u, v = share - total_s * f / total_f, total_t / total_f * f - t
    handoff = max(0.0, -float(v @ u) / float(u @ u)) if total_s > 0 and u @ u > 0 else 0.0
    ratio = (total_t - handoff * total_s) / total_f
    if not low <= ratio <= high:  # held at the range, the handoff taking the rest
        ratio = min(high, max(low, ratio))
        handoff = max(0.0, (total_t - ratio * total_f) / total_s) if total_s > 0 else 0.0
    return float(ratio), float(handoff)


def _typical_points(rows: Sequence[dict]) -> list[tuple[float, float, float]]:
    """Each traced collective once: (its figure, the median of its runs' times, its share of the
    handoff). A run traces one step, and a shared host's slow spell can fall on it: in one
    profile on this project's 2-core VM, gpt-tiny's 57 split collectives took 67 ms in one run
    and 22 ms in the next, and a fit over both runs' collectives priced moe-tiny's split step 24%
    over its measured median."""
    runs: dict[str, list[list]] = {}
    for r in rows:
        runs.setdefault(r["model"], []).append(r["points"])
    return [(same[0][0], statistics.median(p[1] for p in same), same[0][2])
            for each in runs.values() for same in zip(*each)]


def reference_steps(calibration: Path, counts: Sequence[int], device: str, engine: str, tmp: Path,
                    echo=print, models: Sequence[str | Path] = (),
                    dims: Mapping[str, int] | None = None,
                    refs: tuple[list[str], list[tuple[str, Path]]] | None = None,
                    probes: Mapping[int, float] | None = None) -> dict[int, list[dict]]:
    """Per rank count k, each reference training step planned on k ranks with `calibration` and
    run with `parc run`, as a user would: its simulated step, the compute of its busiest rank in
    that simulation, and the measured median step. With `probes` (k -> `host_probe`'s seconds
    when k's figures were measured), also `host_speed`: how fast the host ran the probe just
    before the run against then (0.84: the run had 84% of the speed k's figures saw), which
    `fit_step_ratio` takes out of the measured step: a shared VM's speed moves by tens of
    percent over the minutes a profile takes, and a reference run in a slow spell otherwise
    makes every step of k ranks look slow (this project's VM: 1-rank steps predicted 18-22% long,
    the probe at 0.84 when their references ran). The references are `models` (training steps;
    `dims` binds their symbolic dims) where given, else the zoo's `REFERENCE_STEPS`: a calibration
    from `--model` prices the classes the model has at its own shapes, a figure meant for that
    model, which another model's step would be measured against. The benchmarks price each node
    warm and alone; in a step the nodes run one after another on tensors other nodes wrote, the
    ranks' modules finish apart and each collective waits for the last (on this project's 2-core VM
    the steps of two ranks ran 15-28% over their simulation)."""
    from parc.exec.runner import pick_engine, rank_threads
    from parc.plandir import load_plan

    bound, steps = refs if refs is not None else reference_models(tmp, models, dims)
    rows: dict[int, list[dict]] = {k: [] for k in counts}
    for i, (name, model) in enumerate(steps):
        for k in counts:
            echo(f"running the reference step {name} on {k} rank{'s' if k > 1 else ''} ...")
            plan = tmp / f"ref{i}.{k}"
            _parc("plan", model, "--devices", f"{k}x{device}", "--calibration", calibration, *bound, "-o", plan)
            sim = load_plan(plan)["simulation"]  # the replay `parc simulate` gives, written by `parc plan`
            speed = probes[k] / host_probe(rank_threads(1), pick_engine(engine)) if probes and k in probes else None
            out = _parc("run", plan, "--steps", REFERENCE_RUNS, "--json", "--engine", engine)
            times = [json.loads(line)["step_time_s"] for line in out.splitlines() if line.startswith("{")]
            rows[k].append({"model": name, "simulated_s": sim["step_time_s"],
                            "compute_s": max(r["compute_s"] for r in sim["ranks"]),
                            "measured_s": statistics.median(times[REFERENCE_WARMUP:]),
                            **({"host_speed": speed} if speed is not None else {})})
    return rows


def fit_step_ratio(rows: Sequence[dict]) -> float:
    """The `step_ratio` of one rank count from its reference steps: each step's ratio is what its
    simulated compute must be multiplied by for the simulation to take the measured time (1 +
    (measured - simulated) / compute, the compute on the simulation's critical path taken as the
    busiest rank's; the measured time at the speed the host had when the figures were measured:
    times its `host_speed` where the row has one), and the figure is their geometric mean, within
    `STEP_RATIO_RANGE`."""
    ratios = [1.0 + (r["measured_s"] * r.get("host_speed", 1.0) - r["simulated_s"]) / r["compute_s"]
              for r in rows if r["compute_s"] > 0]
    if not ratios:
        return 1.0
    low, high = STEP_RATIO_RANGE
    return _geomean([min(high, max(low, x)) for x in ratios])  # a mean of values in the range stays in it


def _engine_text(kind: tuple[str, str]) -> str:
    """What measured, for the file's first line: the engine, its library and (a GPU) the card."""
    if kind[0] == "ort":
        import onnxruntime

        return f"onnxruntime {onnxruntime.__version__}"
    if kind[1] == "cpu":
        return f"parc's array engine on numpy {np.__version__}"
    import cupy

    from parc.exec.engines import gpu

    name, _ = _gpu_card(cupy)
    runtime, driver = cupy.cuda.runtime.runtimeGetVersion(), cupy.cuda.runtime.driverGetVersion()
    return (f"parc's array engine on CuPy {cupy.__version__}, {name}, CUDA runtime {runtime // 1000}."
            f"{runtime % 1000 // 10}, driver API {driver // 1000}.{driver % 1000 // 10}, float32 matmuls "
            f"{'in TF32 (CUPY_TF32=1)' if gpu.tf32_requested() else 'in full fp32'}")


class _Solo:
    """The communicator of a one-rank measurement (nothing to wait for)."""

    size, rank = 1, 0

    def barrier(self) -> None:
        pass


def _device_yaml(f: dict) -> dict:
    return {"fp32_tflops": f["peak_float32"] / 1e12, "bandwidth_gbs": f["memory_bandwidth"] / 1e9,
            "launch_floor_us": f["launch_floor"] * 1e6, "task_overhead_us": f["task_overhead"] * 1e6,
            "compute_efficiency": f["compute_efficiency"], "memory_efficiency": f.get("memory_efficiency", 1.0),
            **({"op_efficiency": f["op_efficiency"]} if f["op_efficiency"] else {}),
            **({"memory_op_efficiency": f["memory_op_efficiency"]} if f.get("memory_op_efficiency") else {}),
            # 0 is written too: a k-rank section laid over one rank's must not inherit its figures
            **({"node_floor_us": f["node_floor"] * 1e6} if "node_floor" in f else {}),
            **({"op_floor_us": {cls: v * 1e6 for cls, v in f["op_floor"].items()}} if f.get("op_floor") else {}),
            **({"node_piece_ns": f["node_piece"] * 1e9} if "node_piece" in f else {}),
            **({"op_piece_ns": {cls: v * 1e9 for cls, v in f["op_piece"].items()}} if f.get("op_piece") else {}),
            **({"cold_bandwidth_gbs": f["cold_bandwidth"] / 1e9, "cache_share_mib": f["cache_share"] / 2**20}
               if f.get("cold_bandwidth") else {}),
            **({"step_ratio": f["step_ratio"]} if "step_ratio" in f else {})}


def _link_yaml(f: dict) -> dict:
    return {"latency_us": f["latency"] * 1e6, "bandwidth_gbs": f["bandwidth"] / 1e9,
            "handoff_us": f.get("link_handoff", f["handoff"]) * 1e6,  # a traced step's, else the bursts'
            "call_us": f.get("call", 0.0) * 1e6,
            **{kind: {"latency_us": lat * 1e6, "bandwidth_gbs": bw / 1e9} for kind, (lat, bw) in f.get("kinds", {}).items()},
            **({"step_ratio": f["link_step_ratio"]} if "link_step_ratio" in f else {})}


def _case_text(r: dict) -> str:
    """One measured product or convolution case for the file's comments: class, shapes, seconds."""
    return f"{r['class']} {'x'.join(map(str, r['input']))} * {'x'.join(map(str, r['weight']))}: {r['s']:.3g}"


def write_calibration(output: Path, fitted: dict[int, dict], measured: dict[int, dict], device: str,
                      link: str, engine: str = "", models: str = "", speeds: Sequence[float] = (),
                      cpus: int = 0, fitted_on: Sequence[str | Path] = ()) -> None:
    """The calibration YAML (`parc.cluster.clusterfile` reads it), atomically; `cpus`: the host's
    CPUs when its ranks ran on them (what tells `parc simulate` which counts of ranks share its
    cores: `Calibration.busy_counts`), 0 on a GPU; `fitted_on`: the `--model` files whose shapes
    the figures were measured on (their names and sha256, `fitted_on`)."""
    import yaml

    from parc.plandir.manifest import sha256_file

    if any("link_step_ratio" in f for f in fitted.values()):  # a count without one must not inherit another's
        fitted = {k: {"link_step_ratio": 1.0, **f} if k > 1 and "latency" in f else f for k, f in fitted.items()}
    body: dict = {**({"cpus": cpus} if cpus else {}),
                  **({"fitted_on": [{"file": Path(m).name, "sha256": sha256_file(Path(m))} for m in fitted_on]}
                     if fitted_on else {}),
                  "devices": {device: _device_yaml(fitted[1])}}
    pair = min((k for k in fitted if k > 1 and "latency" in fitted[k]), default=None)
    if pair is not None:
        body["links"] = {link: _link_yaml(fitted[pair])}
    sharing = {}
    for k, f in sorted(fitted.items()):
        if k > 1:
            sharing[str(k)] = {"devices": {device: _device_yaml(f)},
                               **({"links": {link: _link_yaml(f)}} if "latency" in f else {})}
    if sharing:
        body["sharing"] = sharing
    head = [f"# parc profile: {platform.node()}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
            f"{engine or 'onnxruntime'}, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
            "# one rank alone (devices), two ranks' links (links), and per rank when k share this host (sharing)",
            *([f"# classes measured on the models' own shapes: {models}"] if models else []),
            *([f"# the host's speed before each rank count and at the end (a fixed product, the first = 1): "
               f"{', '.join(f'{v:.2f}' for v in speeds)}"] if speeds else []),
            "# measured (seconds per node; all-reduce seconds per call):"]
    for k, rows in sorted(measured.items()):
        mem = ", ".join(f"{r['op']} {r['bytes'] >> 20} MiB: {r['s']:.3g}" for r in rows["memory"])
        mm = ", ".join(f"{'x'.join(map(str, r['shape']))}: {r['s']:.3g}" if "shape" in r else _case_text(r)
                       for r in rows["matmul"])
        head.append(f"#  {k} rank(s): floor {rows['launch_floor_s']:.3g}, run overhead {rows['task_overhead_s']:.3g}")
        head.append(f"#    memory-bound {mem}")
        head.append(f"#    MatMul {mm}")
        if rows.get("sweep"):
            head.append("#    sweep " + ", ".join(f"{r['op']} {r['bytes'] / 2**20:g} MiB: {r['s']:.3g}" for r in rows["sweep"]))
            f = fitted.get(k, {})
            if f.get("cache_bytes"):
                head.append(f"#    from the caches up to {f['cache_bytes'] / 2**20:g} MiB, {f['cache_speedup']:.2f}x memory's "
                            "rate; the rates below are memory's (`fit_cache`)")
        if rows.get("pieces"):
            head.append("#    short pieces " + ", ".join(f"{r['op']} {r['bytes'] >> 10} KiB, {r['pieces']:.0f} pieces: "
                                                        f"{r['s']:.3g}" for r in rows["pieces"]))
        if rows.get("small"):
            head.append("#    small " + ", ".join(
                f"{r['op']} {r['bytes'] >> 10} KiB: {r['s']:.3g}" if "op" in r else
                f"{'x'.join(map(str, r['shape']))}: {r['s']:.3g}" for r in rows["small"]))
        if rows.get("conv"):
            head.append("#    " + ", ".join(_case_text(r) for r in rows["conv"]))
        if rows.get("cold"):
            head.append("#    cold Add " + ", ".join(f"after writing {r['touched'] >> 20} MiB: {r['s']:.3g}"
                                                     for r in rows["cold"]))
        if "all_reduce" in rows:
            head.append("#    all_reduce (first after compute / in a burst) " + ", ".join(
                f"{r['n']} ranks {r['bytes']} B: {r['first_s']:.3g} / {r['s']:.3g}" for r in rows["all_reduce"]))
        if rows.get("split"):
            head.append("#    collectives of the reference step, every parameter split, traced (from their last arrival / "
                        "handoff charged / their figures): " + ", ".join(
                            f"{r['model']} {r['collectives']} collectives {r['measured_s']:.3g} / {r['handoff_s']:.3g} / "
                            f"{r['figures_s']:.3g}" for r in rows["split"]))
            f = fitted.get(k, {})
            if "link_handoff" in f:
                head.append(f"#    fitted on them (`fit_link_ratio`): the link's step_ratio x{f.get('link_step_ratio', 1.0):.3g} "
                            f"and handoff {f['link_handoff'] * 1e6:.3g} us (the bursts' first all-reduce: "
                            f"{f['handoff'] * 1e6:.3g} us)")
        if rows.get("steps"):
            head.append("#    reference steps (simulated / its busiest rank's compute / measured median, the host's speed "
                        "then against when these figures were measured): " + ", ".join(
                            f"{r['model']} {r['simulated_s']:.3g} / {r['compute_s']:.3g} / {r['measured_s']:.3g}"
                            + (f" at {r['host_speed']:.2f}" if "host_speed" in r else "") for r in rows["steps"]))
        if rows.get("collectives"):
            head.append("#    in a burst " + ", ".join(f"{r['kind']} {r['n']} ranks {r['bytes']} B: {r['s']:.3g}"
                                                   for r in rows["collectives"]))
    text = "\n".join(head) + "\n" + yaml.safe_dump(body, sort_keys=False)
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(output)
