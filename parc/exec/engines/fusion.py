"""Elementwise fusion for the array engine: a chain of elementwise nodes becomes one kernel.

A training step is mostly elementwise nodes over large tensors (the optimizer's update, GELU and
layer normalisation and their gradients, the attention mask), and on a GPU each one reads its
inputs from memory and writes its output back. When the engine is built, `fuse` groups them:
an elementwise node takes in the node producing one of its inputs when that value has no other
reader and is not a graph output, so each group is a tree whose intermediates nobody else sees.
A group of two or more nodes runs as one CuPy `ElementwiseKernel` whose body is the group's
nodes as C statements, one local variable per intermediate: each input is read once and only the
root's value is written. CuPy's kernels broadcast their inputs as ONNX does, so the tree's leaves
may have any shapes that broadcast.

The kernel is compiled for the float type of the group's inputs at its first run; it is built
with `--fmad=false`, so that each operation rounds as CuPy's own kernel for it would (no fused
multiply-add), and the fused and unfused runs agree to the bit. A group whose inputs have other
types than the one it was made for (float16, integers, mixed float types) runs its nodes one by
one, as does every group on NumPy, where there is nothing to gain but the tests run the same
grouping. `PARC_CUPY_KERNELS=0` turns fusion off.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parc.exec.engines import gpu
from parc.exec.engines.gpu import CTYPES

# op -> (inputs, C body with {0}, {1}, {2} for the inputs and T for the float type)
OPS: dict[str, tuple[int, str]] = {
    "Add": (2, "{0} + {1}"), "Sub": (2, "{0} - {1}"), "Mul": (2, "{0} * {1}"), "Div": (2, "{0} / {1}"),
    "Pow": (2, "pow({0}, {1})"), "Neg": (1, "-{0}"), "Exp": (1, "exp({0})"), "Log": (1, "log({0})"),
    "Sqrt": (1, "sqrt({0})"), "Reciprocal": (1, "(T)1 / {0}"), "Tanh": (1, "tanh({0})"),
    "Erf": (1, "erf({0})"), "Abs": (1, "fabs({0})"), "Identity": (1, "{0}"),
    "Relu": (1, "({0} > (T)0 || {0} != {0}) ? {0} : (T)0"),  # NumPy's maximum(x, 0) keeps a NaN
    "Sigmoid": (1, "(T)1 / ((T)1 + exp(-{0}))"),
    "Where": (3, "{0} ? {1} : {2}"),  # the condition is bool, the others the float type
}


@dataclass
class Op:
    """One node of a group: its kernel (for the unfused run), input keys, output key and type."""

    kernel: Any
    op: str
    inputs: tuple[str, ...]
    output: str
    label: str


@dataclass
class Group:
    """A tree of elementwise nodes run as one step; `ops` in the graph's order, the root last."""

    ops: list[Op]
    xp: Any
    leaves: tuple[str, ...] = ()
    _kernels: dict[tuple, Any] = field(default_factory=dict)
    _flats: dict[tuple, Any] = field(default_factory=dict)
    _launches: dict[tuple, Any] = field(default_factory=dict)
    _failed: bool = False

    def __post_init__(self) -> None:
        made = {o.output for o in self.ops}
        self.leaves = tuple(dict.fromkeys(k for o in self.ops for k in o.inputs if k not in made))

    @property
    def output(self) -> str:
        return self.ops[-1].output

    @property
    def label(self) -> str:
        if len(self.ops) == 1:  # one node, run by the flat kernel: it keeps its own label
            return self.ops[0].label
        return f"{self.ops[-1].label.rpartition(' (')[0]} and {len(self.ops) - 1} more (Fused)"

    def __call__(self, *leaves: Any) -> tuple[Any]:
        if self._failed or self.xp is np:
            return (self.unfused(leaves),)
        try:
            key = tuple((a.dtype, a.shape, a.flags.c_contiguous) for a in leaves)
        except AttributeError:  # not all device arrays
            key = None
        launch = self._launches.get(key) if key is not None else None
        if launch is None:
            launch = self._prepare(leaves)
            if key is not None:
                self._launches[key] = launch
        try:
            return (launch(*leaves),)
        except Exception as e:  # CuPy compiles at the first call
            if type(e).__name__ != "CompileException":
                raise
            self._refuse(e)
            return (self.unfused(leaves),)

    def _prepare(self, leaves: Sequence[Any]) -> Any:
        """How leaves of these types and layouts run: the flat kernel where every leaf is read by
        a flat index (`flat_layout`), else CuPy's ElementwiseKernel (which broadcasts anything),
        else the nodes one by one."""
        kernel = self._kernel(leaves)
        if kernel is None:
            return lambda *xs: self.unfused(xs)
        layout = flat_layout([a.shape for a in leaves], [a.flags.c_contiguous for a in leaves])
        if layout is None:
            return kernel
        shape, modes, extents = layout
        conditions = {o.inputs[0] for o in self.ops if o.op == "Where"}
        dtype = next(a.dtype for k, a in zip(self.leaves, leaves) if k not in conditions)
        types = tuple("bool" if k in conditions else CTYPES[dtype] for k in self.leaves)
        flat = self._flats.get((types, modes))
        if flat is None:
            flat = self._flats[(types, modes)] = self.xp.RawKernel(
                self.flat_source(types, modes, CTYPES[dtype]), "parc_flat", options=("--fmad=false",))
        n = math.prod(shape)
        grid = (min(-(-n // (FLAT_THREADS * FLAT_PER)), FLAT_MAX_BLOCKS),)
        args = (np.uint32(n), *(np.uint32(m) for m in extents))
        xp = self.xp

        def launch(*xs: Any) -> Any:
            out = xp.empty(shape, dtype)
            flat(grid, (FLAT_THREADS,), (*xs, out, *args))
            return out
        return launch

    def flat_source(self, types: Sequence[str], modes: Sequence[str], ctype: str) -> str:
        """The flat kernel: each thread loads FLAT_PER elements of every leaf (strided by the block,
        so loads coalesce, and all issued before any is used), then runs the group's body on each."""
        index = {"full": "i", "one": "0", "tail": "i % m{0}", "head": "i / m{0}"}
        params = ", ".join([f"const {t}* __restrict__ p{i}" for i, t in enumerate(types)]
                           + [f"{ctype}* __restrict__ o", "unsigned int n"] + [f"unsigned int m{i}" for i in range(len(types))])
        held = " ".join(f"{t} a{i}[{FLAT_PER}];" for i, t in enumerate(types))
        loads = " ".join(f"a{i}[j] = p{i}[{index[m].format(i)}];" for i, m in enumerate(modes))
        names = " ".join(f"const {t} in{i} = a{i}[j];" for i, t in enumerate(types))
        return f"""typedef {ctype} T;
extern "C" __global__ void parc_flat({params}) {{
    for (unsigned int at = blockIdx.x * blockDim.x * {FLAT_PER}u + threadIdx.x; at < n;
         at += gridDim.x * blockDim.x * {FLAT_PER}u) {{
        {held}
        #pragma unroll
        for (int j = 0; j < {FLAT_PER}; ++j) {{
            const unsigned int i = at + j * blockDim.x;
            if (i < n) {{ {loads} }}
        }}
        #pragma unroll
        for (int j = 0; j < {FLAT_PER}; ++j) {{
            const unsigned int i = at + j * blockDim.x;
            if (i < n) {{
                {names}
                T out;
                {{
{self.body(ctype)}
                }}
                o[i] = out;
            }}
        }}
    }}
}}
"""

    def _refuse(self, e: Exception) -> None:
        """A compiler's refusal is parc's bug, said once; the nodes still run, one by one."""
        self._failed = True
        print(f"parc: could not fuse {self.label}: {type(e).__name__}: {' '.join(str(e).split())[:300]}",
              file=sys.stderr)

    def unfused(self, leaves: Sequence[Any]) -> Any:
        """The group's nodes one by one (NumPy, or types the kernel was not made for)."""
        env = dict(zip(self.leaves, leaves))
        for o in self.ops:
            env[o.output] = o.kernel(*[env[k] for k in o.inputs])[0]
        return env[self.output]

    def _kernel(self, leaves: Sequence[Any]) -> Any:
        types = tuple(getattr(a, "dtype", None) for a in leaves)
        if types not in self._kernels:
            self._kernels[types] = self._compile(types)
        return self._kernels[types]

    def _compile(self, types: tuple) -> Any:
        conditions = {o.inputs[0] for o in self.ops if o.op == "Where"}
        floats = {t for k, t in zip(self.leaves, types) if k not in conditions}
        if len(floats) != 1 or next(iter(floats)) not in CTYPES:
            return None
        if any(t != np.dtype(np.bool_) for k, t in zip(self.leaves, types) if k in conditions):
            return None
        if any(o.inputs[0] in {p.output for p in self.ops} for o in self.ops if o.op == "Where"):
            return None  # a condition computed inside the group (the ops here make floats only)
        dtype = next(iter(floats))  # parameters take NumPy's type names ("float" would be float64)
        params = ", ".join(f"{'bool' if k in conditions else dtype.name} in{i}" for i, k in enumerate(self.leaves))
        try:
            return self.xp.ElementwiseKernel(params, f"{dtype.name} out", self.body(CTYPES[dtype]),
                                             f"parc_fused_{len(self.ops)}", options=("--fmad=false",))
        except Exception as e:
            self._refuse(e)
            return None

    def body(self, ctype: str) -> str:
        """The kernel's C body: one local per node, the root's value stored."""
        names = {k: f"in{i}" for i, k in enumerate(self.leaves)}
        lines = [f"typedef {ctype} T;"]
        for j, o in enumerate(self.ops):
            names[o.output] = f"t{j}"
            lines.append(f"T t{j} = {OPS[o.op][1].format(*(names[k] for k in o.inputs))};")
        lines.append(f"out = t{len(self.ops) - 1};")
        return "\n".join(lines)


FLAT_THREADS, FLAT_PER = 256, 4  # the flat kernel's block, and the elements each thread loads ahead
FLAT_MAX_BLOCKS = 1 << 16  # blocks loop over the rest
FLAT_MAX = 1 << 30  # elements: 32-bit indices, with room for the loop's last step


def flat_layout(shapes: Sequence[tuple[int, ...]], contiguous: Sequence[bool]) -> tuple | None:
    """(output shape, each leaf's mode, each leaf's extent) where every leaf of a group can be read
    by the output's flat index i: "full" (its own index i: contiguous, the output's size), "one"
    (a single value), "tail" (contiguous, broadcast over leading dims: i % extent, a bias or a
    mask) or "head" (contiguous, broadcast over trailing dims: i / extent, a row's statistic).
    None for anything else (a transposed view, a broadcast in the middle): CuPy's kernel reads
    those."""
    shape = tuple(np.broadcast_shapes(*shapes))
    n = math.prod(shape)
    if not 0 < n < FLAT_MAX:
        return None
    reads = []  # (mode, extent) per leaf
    for s, c in zip(shapes, contiguous, strict=True):
        size = math.prod(s)
        pad = (1,) * (len(shape) - len(s)) + tuple(s)
        lead = next((k for k, d in enumerate(pad) if d != 1), len(pad))
        trail = next((k for k in range(len(pad), 0, -1) if pad[k - 1] != 1), 0)
        if size == 1:
            reads.append(("one", 1))
        elif not c:
            return None
        elif size == n:
            reads.append(("full", n))
        elif pad[lead:] == shape[lead:]:
            reads.append(("tail", size))
        elif pad[:trail] == shape[:trail]:
            reads.append(("head", n // size))
        else:
            return None
    modes, extents = zip(*reads, strict=True)
    return shape, tuple(modes), tuple(extents)


def fusible(op: str, inputs: Sequence[str], outputs: Sequence[tuple[int, str]]) -> bool:
    arity = OPS.get(op, (None,))[0]
    return (arity == len(inputs) and all(inputs) and len(outputs) == 1 and outputs[0][0] == 0
            and "\0" not in "".join(inputs))


def trees(steps: Sequence[tuple[bool, Sequence[str], str | None]], graph_outputs: Sequence[str]) -> list[list[int]]:
    """The elementwise trees fusion makes, as step indices in the graph's order, the root last:
    `steps` are (fusible, input keys, output key) in the graph's order. A fusible step takes in
    the tree producing one of its inputs when that value has no other reader and is not a graph
    output. Every fusible step is in one tree (alone, if nothing joins it). The engine runs each
    tree of two or more as one kernel; the cost model (`parc.passes.timing`) prices it so."""
    readers = Counter(k for _, inputs, _ in steps for k in inputs)
    keep = set(graph_outputs)
    pending: dict[str, list[int]] = {}  # a fusible step's output -> its tree
    for i, (ok, inputs, output) in enumerate(steps):
        if not ok or output is None:
            continue
        tree: list[int] = []
        for k in dict.fromkeys(inputs):
            if k in pending and readers[k] == 1 and k not in keep:
                tree.extend(pending.pop(k))
        tree.append(i)
        pending[output] = sorted(tree)
    return list(pending.values())


def fuse(steps: list[tuple], ops: list[str], graph_outputs: Sequence[str], xp: Any) -> list[tuple]:
    """The engine's steps (kernel, input keys, outputs, label) with elementwise trees fused, each
    at its root's place. `ops` is each step's op type."""
    flags = [fusible(op, inputs, outputs) for (_, inputs, outputs, _), op in zip(steps, ops)]
    groups = trees([(ok, inputs, outputs[0][1] if ok else None)
                    for ok, (_, inputs, outputs, _) in zip(flags, steps)], graph_outputs)
    # on a GPU a lone elementwise node runs as a group of one too: the flat kernel reads ahead,
    # CuPy's own kernel for it does not
    root = {tree[-1]: tree for tree in groups if len(tree) > 1 or xp is not np}
    taken = {i for tree in root.values() for i in tree[:-1]}
    out: list[tuple] = []
    for i, step in enumerate(steps):
        if i in taken:
            continue
        if i not in root:
            out.append(step)
            continue
        group = Group([Op(steps[j][0], ops[j], tuple(steps[j][1]), steps[j][2][0][1], steps[j][3])
                       for j in root[i]], xp)
        out.append((group, group.leaves, ((0, group.output),), group.label))
    return out


def softmax_grad_groups(ops: Sequence[str], inputs: Sequence[Sequence[str]], outputs: Sequence[Sequence[str]],
                        graph_outputs: Sequence[str], reduce_axis) -> dict[int, tuple[int, int, int, str, str, int]]:
    """Where a softmax's gradient, as autodiff writes it, `y * (dy - ReduceSum(dy * y, axis,
    keepdims=1))`, is four steps whose intermediates nobody else reads: final Mul's step ->
    (the first Mul's, the ReduceSum's and the Sub's steps, dy, y, axis). `reduce_axis(i)` is
    ReduceSum step i's one axis when it keeps dims, else None. The engine runs each as one step
    (`softmax_grads`); the cost model prices it so (`parc.passes.timing`)."""
    readers = Counter(k for ins in inputs for k in ins)
    keep = set(graph_outputs)
    producer = {k: i for i, outs in enumerate(outputs) for k in outs if k}

    def once(k: str) -> int | None:
        i = producer.get(k)
        return i if i is not None and readers[k] == 1 and k not in keep else None

    found: dict[int, tuple[int, int, int, str, str, int]] = {}
    for d, ins in enumerate(inputs):
        if ops[d] != "Mul" or len(ins) != 2:
            continue
        for y, c_out in (tuple(ins), tuple(ins)[::-1]):
            c = once(c_out)
            if c is None or ops[c] != "Sub" or len(inputs[c]) != 2:
                continue
            dy, b_out = inputs[c]
            b = once(b_out)
            axis = reduce_axis(b) if b is not None and ops[b] == "ReduceSum" else None
            if axis is None:
                continue
            a = once(inputs[b][0])
            if a is None or ops[a] != "Mul" or sorted(inputs[a]) != sorted((dy, y)) or dy == y:
                continue
            found[d] = (a, b, c, dy, y, axis)
            break
    return found


def softmax_grads(steps: list[tuple], ops: list[str], nodes: list, consts: dict, graph_outputs: Sequence[str],
                  xp: Any) -> tuple[list[tuple], list[str]]:
    """The engine's steps with each softmax gradient (`softmax_grad_groups`) as one step:
    `gpu.softmax_grad_last` reads dy and y once per row where the axis is the last, CuPy's
    operations otherwise. `nodes` are the steps' ONNX nodes (for ReduceSum's axes and keepdims).
    Returns the steps and op types."""
    def reduce_axis(i: int) -> int | None:
        node = nodes[i]
        keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
        if len(node.input) < 2 or node.input[1] not in consts or keepdims != 1:
            return None
        axes = np.ravel(consts[node.input[1]])
        return int(axes[0]) if axes.size == 1 else None

    found = softmax_grad_groups(ops, [s[1] for s in steps], [[k for _, k in s[2]] for s in steps],
                                graph_outputs, reduce_axis)
    if not found:
        return steps, ops
    taken = {i for a, b, c, *_ in found.values() for i in (a, b, c)}

    def make(axis: int):
        def softmax_grad(dy, y):
            if xp is not np and axis % y.ndim == y.ndim - 1:
                dx = gpu.softmax_grad_last(xp, dy, y)
                if dx is not None:
                    return (dx,)
            return (y * (dy - xp.sum(dy * y, axis=axis, keepdims=True)),)
        return softmax_grad

    out, out_ops = [], []
    for i, step in enumerate(steps):
        if i in taken:
            continue
        if i in found:
            *_, dy, y, axis = found[i]
            out.append((make(axis), (dy, y), step[2], f"{step[3].rpartition(' (')[0]} and 3 more (SoftmaxGrad)"))
            out_ops.append("SoftmaxGrad")
        else:
            out.append(step)
            out_ops.append(ops[i])
    return out, out_ops
