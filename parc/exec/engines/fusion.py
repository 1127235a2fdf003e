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

A softmax, or a softmax's gradient, takes in the tree beside it (`RowGroup`): the tree before a
softmax is computed as the row kernel loads each element, the tree after one is given each
element as the row kernel stores it, so the value between them never goes to memory.
`PARC_CUPY_ROWS=0` runs them apart. Casts between float32 and bfloat16 (mixed precision) join
trees at their edges (`cast_kind`): a bfloat16 leaf is read as its float value, a root cast to
bfloat16 is stored rounded; a tree computes in one float type.
"""

from __future__ import annotations

import math
import os
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from onnx import TensorProto

from parc.exec.engines import gpu
from parc.exec.engines.elementwise import DTYPES
from parc.exec.engines.gpu import CTYPES
from parc.exec.engines.kernels import norm_axis

# op -> (inputs, C body with {0}, {1}, {2} for the inputs and T for the float type)
OPS: dict[str, tuple[int, str]] = {
    "Add": (2, "{0} + {1}"), "Sub": (2, "{0} - {1}"), "Mul": (2, "{0} * {1}"), "Div": (2, "{0} / {1}"),
    "Pow": (2, "pow({0}, {1})"), "Neg": (1, "-{0}"), "Exp": (1, "exp({0})"), "Log": (1, "log({0})"),
    "Sqrt": (1, "sqrt({0})"), "Reciprocal": (1, "(T)1 / {0}"), "Tanh": (1, "tanh({0})"),
    "Erf": (1, "erf({0})"), "Abs": (1, "fabs({0})"), "Identity": (1, "{0}"),
    "Relu": (1, "({0} > (T)0 || {0} != {0}) ? {0} : (T)0"),  # NumPy's maximum(x, 0) keeps a NaN
    "Sigmoid": (1, "(T)1 / ((T)1 + exp(-{0}))"),
    "Where": (3, "{0} ? {1} : {2}"),  # the condition is bool, the others the float type
    # float32 <-> bfloat16 only (`cast_kind`): a bfloat16 leaf is read as its float value, a root
    # cast to bfloat16 stored as bfloat16's bits, rounded (`gpu.BF16_BITS`); the tree computes in float
    "Cast": (1, "{0}"),
}
BF16 = "bf16"  # a leaf's or an output's type in the kernels' sources: bfloat16's bits, computed in float
BFLOAT16 = DTYPES[TensorProto.BFLOAT16]


def cast_kind(op: str, to: int | None, low: Sequence[bool]) -> str:
    """How fusion treats a node, from its op, a Cast's `to` (ONNX's type) and which inputs are
    bfloat16: "up" (a Cast of a bfloat16 value to float32: the tree reads the value as float),
    "down" (a Cast of a float value to bfloat16: only a tree's root), "bf16" (another node on
    bfloat16 values: never fused, a tree computes in one float type), "" otherwise (a Cast
    between other types is not fused)."""
    if op == "Cast":
        if to == TensorProto.FLOAT and low[:1] == [True]:
            return "up"
        return "down" if to == TensorProto.BFLOAT16 and low[:1] == [False] else "other"
    return "bf16" if any(low) else ""


def _pointee(t: str) -> str:
    """A leaf's or an output's element type in C."""
    return "unsigned short" if t == BF16 else t


def _value(t: str, expr: str) -> str:
    """The value of a leaf's element `expr` in the kernels' float type."""
    return f"bf16_value({expr})" if t == BF16 else expr


@dataclass
class Op:
    """One node of a group: its kernel (for the unfused run), input keys, output key and type."""

    kernel: Any
    op: str
    inputs: tuple[str, ...]
    output: str
    label: str
    cast: str = ""  # a Cast's `cast_kind`: "up" or "down"


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
        plan = self.flat([getattr(a, "dtype", None) for a in leaves], [a.shape for a in leaves], readable(leaves))
        if plan is None:
            kernel = self._kernel(leaves)  # None for a group with casts, or types it cannot take
            return kernel if kernel is not None else lambda *xs: self.unfused(xs)
        dtype, types, shape, modes, extents = plan
        out = self.out_dtype(dtype)
        flat = self._flats.get((types, modes))
        if flat is None:
            flat = self._flats[(types, modes)] = self.xp.RawKernel(
                self.flat_source(types, modes, CTYPES[dtype], BF16 if out == BFLOAT16 else ""), "parc_flat",
                options=("--fmad=false",))
        n = math.prod(shape)
        grid = (min(-(-n // (FLAT_THREADS * FLAT_PER)), FLAT_MAX_BLOCKS),)
        args = (np.uint32(n), *(np.uint32(v) for mode, e in zip(modes, extents) for v in extent_args(mode, e)))
        xp = self.xp
        copy = [i for i, a in enumerate(leaves) if not a.flags.c_contiguous]  # small views (`readable`)

        def launch(*xs: Any) -> Any:
            if copy:
                xs = tuple(xp.ascontiguousarray(a) if i in copy else a for i, a in enumerate(xs))
            y = xp.empty(shape, out)
            flat(grid, (FLAT_THREADS,), (*xs, y, *args))
            return y
        return launch

    def flat_source(self, types: Sequence[str], modes: Sequence[str], ctype: str, out: str = "") -> str:
        """The flat kernel: each thread loads FLAT_PER elements of every leaf (strided by the block,
        so loads coalesce, and all issued before any is used), then runs the group's body on each.
        `out`: BF16 where the root is a cast to bfloat16, else the output is of `ctype`."""
        params = ", ".join([f"const {_pointee(t)}* __restrict__ p{i}" for i, t in enumerate(types)]
                           + [f"{_pointee(out or ctype)}* __restrict__ o", "unsigned int n"]
                           + [f"unsigned int {e}" for i, m in enumerate(modes) for e in extent_names(i, m)])
        held = " ".join(f"{_pointee(t)} a{i}[{FLAT_PER}];" for i, t in enumerate(types))
        loads = " ".join(f"a{i}[j] = p{i}[{INDEX[m].format(i)}];" for i, m in enumerate(modes))
        names = " ".join(f"const {ctype if t == BF16 else t} in{i} = {_value(t, f'a{i}[j]')};" for i, t in enumerate(types))
        prelude = gpu.BF16_BITS if BF16 in (*types, out) else ""
        return f"""{prelude}typedef {ctype} T;
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
                o[i] = {"bf16_bits(out)" if out == BF16 else "out"};
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

    def types(self, dtypes: Sequence[Any]) -> tuple[np.dtype, tuple[str, ...]] | None:
        """(the group's float type, each leaf's C type or BF16) for leaves of `dtypes`, or None
        where a kernel of the group cannot take them: Where's conditions must be bool leaves, the
        leaves of casts up bfloat16 leaves read by those casts only, the others of one float type
        of CTYPES (float32 where the group casts)."""
        conditions = {o.inputs[0] for o in self.ops if o.op == "Where"}
        low = {o.inputs[0] for o in self.ops if o.cast == "up"}
        floats = {t for k, t in zip(self.leaves, dtypes) if k not in conditions | low}
        casts = low or self.ops[-1].cast == "down"
        dtype = next(iter(floats)) if floats else np.dtype(np.float32)
        if len(floats) > 1 or dtype not in CTYPES or (casts and dtype != np.float32):
            return None
        if any(t != np.dtype(np.bool_) for k, t in zip(self.leaves, dtypes) if k in conditions):
            return None
        if any(t != BFLOAT16 for k, t in zip(self.leaves, dtypes) if k in low):
            return None
        if any(k in low for o in self.ops if o.cast != "up" for k in o.inputs):
            return None  # a bfloat16 leaf read as it is
        if conditions & ({o.output for o in self.ops} | low):
            return None  # a condition computed inside the group (the ops here make floats only)
        return dtype, tuple("bool" if k in conditions else BF16 if k in low else CTYPES[dtype] for k in self.leaves)

    def flat(self, dtypes: Sequence[Any], shapes: Sequence[tuple[int, ...]], contiguous: Sequence[bool]) -> tuple | None:
        """(float type, each leaf's C type, output shape, each leaf's mode and extent) where a
        flat kernel of the group takes leaves of these types and layouts (`types`,
        `flat_layout`), else None."""
        found = self.types(dtypes)
        layout = flat_layout(shapes, contiguous) if found is not None else None
        return None if layout is None else (*found, *layout)

    def out_dtype(self, dtype: np.dtype) -> np.dtype:
        """The root's type, for a group computing in `dtype`."""
        return BFLOAT16 if self.ops[-1].cast == "down" else dtype

    def _compile(self, types: tuple) -> Any:
        found = self.types(types)
        if found is None or any(o.cast for o in self.ops):  # CuPy's kernels and bfloat16: flat kernels only
            return None
        dtype, ctypes = found  # parameters take NumPy's type names ("float" would be float64)
        params = ", ".join(f"{'bool' if c == 'bool' else dtype.name} in{i}" for i, c in enumerate(ctypes))
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
# each `flat_layout` mode's index of a leaf's element for the output's element i (C, 32-bit)
INDEX = {"full": "i", "one": "0", "tail": "i % m{0}", "head": "i / m{0}", "split": "i / m{0} * q{0} + i % q{0}"}


def readable(leaves: Sequence[Any], n: int | None = None) -> list[bool]:
    """Which leaves the flat index may read (`flat_layout`'s `contiguous`): a contiguous array, or
    a view of at most half the output's `n` elements (the broadcast of T5's relative position
    bias, a transposed [1, H, S, S]), which the kernel's launch copies first: the copy is small
    beside the kernel's own traffic. None stands for an array the kernel is handed."""
    if n is None:
        n = math.prod(np.broadcast_shapes(*[a.shape for a in leaves if a is not None]))
    return [a is None or a.flags.c_contiguous or 2 * a.size <= n for a in leaves]


def extent_args(mode: str, extent) -> tuple[int, ...]:
    """A leaf's extent as its kernel arguments: m, and q for "split" (`flat_layout`)."""
    return tuple(extent) if mode == "split" else (extent,)


def extent_names(j: int, mode: str, prefix: str = "") -> list[str]:
    """The names of a leaf's extent arguments, in `extent_args`' order."""
    return [f"{prefix}m{j}", *([f"{prefix}q{j}"] if mode == "split" else [])]


def flat_layout(shapes: Sequence[tuple[int, ...]], contiguous: Sequence[bool]) -> tuple | None:
    """(output shape, each leaf's mode, each leaf's extent) where every leaf of a group can be read
    by the output's flat index i: "full" (its own index i: contiguous, the output's size), "one"
    (a single value), "tail" (contiguous, broadcast over leading dims: i % extent, a bias or a
    mask), "head" (contiguous, broadcast over trailing dims: i / extent, a row's statistic) or
    "split" (contiguous, broadcast over one run of middle dims: a padding mask [B, 1, 1, S] of
    scores [B, H, S, S]; its extent (m, q), the output's elements from the run on and the leaf's
    after it: i / m * q + i % q). None for anything else (a transposed view, two runs broadcast):
    CuPy's kernel reads those. `INDEX` is each mode's C text, `extent_args` its arguments."""
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
            wide = [d for d in range(len(shape)) if pad[d] != shape[d]]  # broadcast dims (pad[d] is 1)
            a, c = wide[0], wide[-1] + 1
            if any(pad[d] != 1 for d in range(a, c)):
                return None
            reads.append(("split", (math.prod(shape[a:]), math.prod(shape[c:]))))
    modes, extents = zip(*reads, strict=True)
    return shape, tuple(modes), tuple(extents)


def fusible(op: str, inputs: Sequence[str], outputs: Sequence[tuple[int, str]], kind: str = "") -> bool:
    """Whether a node may join a tree: an op of OPS on its inputs, one output; `kind` is its
    `cast_kind` (a Cast only "up" or "down", no node on bfloat16 values)."""
    if kind == "bf16" or (op == "Cast") != (kind in ("up", "down")):
        return False
    arity = OPS.get(op, (None,))[0]
    return (arity == len(inputs) and all(inputs) and len(outputs) == 1 and outputs[0][0] == 0
            and "\0" not in "".join(inputs))


def trees(steps: Sequence[tuple[bool | str, Sequence[str], str | None]], graph_outputs: Sequence[str]) -> list[list[int]]:
    """The elementwise trees fusion makes, as step indices in the graph's order, the root last:
    `steps` are (fusible, input keys, output key) in the graph's order; fusible "root" for a
    step that nothing takes in (a cast to bfloat16). A fusible step takes in the tree producing
    one of its inputs when that value has no other reader and is not a graph output. Every
    fusible step is in one tree (alone, if nothing joins it). The engine runs each tree of two or
    more as one kernel; the cost model (`parc.passes.timing`) prices it so."""
    readers = Counter(k for _, inputs, _ in steps for k in inputs)
    keep = set(graph_outputs)
    pending: dict[str, list[int]] = {}  # a fusible step's output -> its tree
    ended: list[list[int]] = []  # trees whose root nothing takes in
    for i, (ok, inputs, output) in enumerate(steps):
        if not ok or output is None:
            continue
        tree: list[int] = []
        for k in dict.fromkeys(inputs):
            if k in pending and readers[k] == 1 and k not in keep:
                tree.extend(pending.pop(k))
        tree.append(i)
        if ok == "root":
            ended.append(sorted(tree))
        else:
            pending[output] = sorted(tree)
    return sorted([*ended, *pending.values()], key=lambda t: t[-1])


def fuse(steps: list[tuple], ops: list[str], nodes: list, graph_outputs: Sequence[str], xp: Any,
         opset: int = 13, kinds: Sequence[str] | None = None) -> list[tuple]:
    """The engine's steps (kernel, input keys, outputs, label) with elementwise trees fused, each
    at its root's place, and a softmax or softmax gradient with the trees beside it
    (`row_groups`) as one step (`RowGroup`). `ops` is each step's op type, `nodes` its ONNX node
    (a Softmax's axis), `opset` the model's, `kinds` each step's `cast_kind` (all "" if not given)."""
    kinds = list(kinds) if kinds is not None else [""] * len(steps)
    flags = [fusible(op, inputs, outputs, kind) and ("root" if kind == "down" else True)
             for (_, inputs, outputs, _), op, kind in zip(steps, ops, kinds)]
    groups = trees([(ok, inputs, outputs[0][1] if ok else None)
                    for ok, (_, inputs, outputs, _) in zip(flags, steps)], graph_outputs)
    rows = row_groups(ops, [s[1] for s in steps], [[k for _, k in s[2]] for s in steps], groups, graph_outputs) \
        if os.environ.get(ENV_ROWS, "1") != "0" else {}

    def group(tree: list[int] | None) -> Group | None:
        if tree is None:
            return None
        return Group([Op(steps[j][0], ops[j], tuple(steps[j][1]), steps[j][2][0][1], steps[j][3],
                         kinds[j] if ops[j] == "Cast" else "") for j in tree], xp)

    at: dict[int, tuple] = {}  # step index -> the fused step that takes its place
    taken: set[int] = set()
    for i, (before, after) in rows.items():
        kernel, inputs, outputs, label = steps[i]
        name, more = label.rpartition(" (")[0], len(before or ()) + len(after or ())
        head, _, tail = name.rpartition(" and ")
        if tail.endswith(" more") and tail[:-5].isdigit():  # a softmax gradient's "and 3 more"
            name, more = head, more + int(tail[:-5])
        if ops[i] == "Softmax":
            node = nodes[i]
            columns = softmax_columns(next((a.i for a in node.attribute if a.name == "axis"), -1 if opset >= 13 else 1),
                                      opset)
        else:
            columns = last_columns(kernel.axis)
        row = RowGroup(ops[i], kernel, xp, columns, tuple(inputs), outputs[0][1], group(before), group(after))
        place = after[-1] if after else i
        at[place] = (row, row.leaves, ((0, row.after.output),) if row.after else outputs, f"{name} and {more} more ({ops[i]})")
        taken.update([i, *(before or ()), *(after or ())])
    # on a GPU a lone elementwise node runs as a group of one too: the flat kernel reads ahead,
    # CuPy's own kernel for it does not
    for tree in groups:
        if tree[-1] not in taken and (len(tree) > 1 or xp is not np):
            g = group(tree)
            at[tree[-1]] = (g, g.leaves, ((0, g.output),), g.label)
            taken.update(tree)
    return [at.get(i, step) for i, step in enumerate(steps) if i not in taken or i in at]


ROW_OPS = ("Softmax", "SoftmaxGrad")  # the row kernels that take in trees (`RowGroup`)
ENV_ROWS = "PARC_CUPY_ROWS"  # "0": the row kernels and the trees beside them run apart (for measuring)


def row_groups(ops: Sequence[str], inputs: Sequence[Sequence[str]], outputs: Sequence[Sequence[str]],
               groups: Sequence[list[int]], graph_outputs: Sequence[str],
               applies=lambda i, kind, tree: True) -> dict[int, tuple[list[int] | None, list[int] | None]]:
    """Which row steps (a Softmax, or a SoftmaxGrad of `softmax_grad_groups`) take in the
    elementwise trees beside them (`trees`' `groups`): row step -> (the tree before, the tree
    after), either None. The tree before is the one whose root is the row's first input (a
    softmax's x, a gradient's dy) and read by nobody else; the tree after, the one in which one
    node reads the row's output, read by nobody else. Each tree joins one row step at most;
    `applies(i, kind, tree)` ("before" or "after") may refuse one (the cost model's, where it
    knows the engine's kernel will not take it). The engine runs each row step with its trees as
    one kernel (`RowGroup`); the cost model prices it so (`parc.passes.timing`)."""
    readers = Counter(k for ins in inputs for k in ins)
    keep = set(graph_outputs)
    root_of = {outputs[t[-1]][0]: t for t in groups}
    tree_of = {j: t for t in groups for j in t}
    reader_of = {k: j for j, ins in enumerate(inputs) for k in ins}
    found: dict[int, tuple[list[int] | None, list[int] | None]] = {}
    used: set[int] = set()  # trees (by root) already joined
    for i, op in enumerate(ops):
        if op not in ROW_OPS:
            continue
        pair: dict[str, list[int]] = {}
        for side, k in (("before", inputs[i][0] if inputs[i] else ""), ("after", outputs[i][0] if outputs[i] else "")):
            tree = root_of.get(k) if side == "before" else tree_of.get(reader_of.get(k, -1))
            if tree is not None and k and readers[k] == 1 and k not in keep and tree[-1] not in used \
                    and applies(i, side, tree):
                pair[side] = tree
                used.add(tree[-1])
        if pair:
            found[i] = (pair.get("before"), pair.get("after"))
    return found


def softmax_columns(axis: int, opset: int):
    """Elements a row of a Softmax over an input of a given shape, as the row kernels see it, or
    None where its axis is not the last (the kernels do not apply). Before opset 13 the input is
    seen as 2-D, [prod(dims before axis), prod(the rest)]: a row is the rest."""
    def columns(shape: tuple[int, ...]) -> int | None:
        if not shape:
            return None
        a = norm_axis(axis, len(shape))
        if opset >= 13:
            return shape[-1] if a == len(shape) - 1 else None
        return math.prod(shape[a:])
    return columns


def last_columns(axis: int):
    """Elements a row of a softmax gradient over `axis`, or None where it is not the last."""
    return lambda shape: shape[-1] if shape and axis % len(shape) == len(shape) - 1 else None


@dataclass(frozen=True)
class TreeRead:
    """How a row kernel reads a tree beside it: each leaf's C type (or BF16) and mode
    (`flat_layout`), and the leaves read from memory (all but the row's output, for the tree
    after) with their extents."""

    types: tuple[str, ...]
    modes: tuple[str, ...]
    reads: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class RowLaunch:
    """How a `RowGroup`'s kernel runs: the float type, the output's shape and its rows' length,
    `gpu.row_shape`'s threads, elements a thread holds (None: the looping kernels, which read the
    row from memory at each pass) and rows a block, the output's type (bfloat16 where the tree
    after ends in a cast), and how the trees before and after are read."""

    dtype: np.dtype
    shape: tuple[int, ...]
    cols: int
    threads: int
    per: int | None
    each: int
    out: np.dtype
    before: TreeRead | None
    after: TreeRead | None


@dataclass
class RowGroup:
    """A row kernel with the elementwise trees beside it, as one step. The tree before makes the
    row's first input (a Softmax's x: attention's scale and mask; a softmax gradient's dy: in a
    bf16 step, the product's output cast up): the kernel computes the tree's value of each element
    as it loads it. The tree after reads the row's output (the mask's and the scale's gradients
    after attention's softmax gradient, cast down for the products in a bf16 step; the one-hot
    labels subtracted from a loss's softmax, then scaled): each element goes through it as the
    kernel stores it. Neither the tree's root nor the row's output goes to memory: on gpt-medium's
    attention each is a 512 MiB write and read a layer.

    The kernel is generated from the trees' C text (`Group.body`) and the row kernels' device
    functions (`gpu.softmax_held`, `gpu.softmax_grad_held`; `_loop` for rows over the held
    kernels' 8,192 elements, which compute the tree before at each of their passes), built with
    `--fmad=false`: each element is computed as the trees' and the row kernel's own kernels
    compute it, so the results are the same to the bit. Where it does not apply (NumPy; types
    other than the trees' kernels take; a leaf the flat kernel cannot read; a softmax over another
    axis) the tree before, the row kernel and the tree after run one after the other."""

    op: str  # "Softmax" or "SoftmaxGrad" (ROW_OPS)
    row: Any  # the row step's own kernel: softmax(x) -> (y,), or softmax_grad(dy, y) -> (dx,)
    xp: Any
    columns: Any  # elements a row from the output's shape, or None (`softmax_columns`)
    row_inputs: tuple[str, ...]  # (x,) or (dy, y)
    output: str  # the row's output
    before: Group | None = None  # makes row_inputs[0]
    after: Group | None = None  # reads `output`
    leaves: tuple[str, ...] = ()
    _kernels: dict[tuple, Any] = field(default_factory=dict)
    _launches: dict[tuple, Any] = field(default_factory=dict)
    _failed: bool = False

    def __post_init__(self) -> None:
        first = self.before.leaves if self.before else self.row_inputs[:1]
        rest = tuple(k for k in self.after.leaves if k != self.output) if self.after else ()
        self.leaves = tuple(dict.fromkeys((*first, *self.row_inputs[1:], *rest)))

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        if self.xp is not np and not self._failed:
            try:
                out = self._fused(args)
            except Exception as e:  # CuPy compiles at the first call
                if type(e).__name__ != "CompileException":
                    raise
                self._failed = True  # parc's bug, said once; the parts still run, one after the other
                print(f"parc: could not fuse the {self.op} row step with its trees: {type(e).__name__}: "
                      f"{' '.join(str(e).split())[:300]}", file=sys.stderr)
                out = None
            if out is not None:
                return (out,)
        env = dict(zip(self.leaves, args))
        if self.before:
            env[self.row_inputs[0]] = self.before(*[env[k] for k in self.before.leaves])[0]
        y = self.row(*[env[k] for k in self.row_inputs])
        if not self.after:
            return y
        env[self.output] = y[0]
        return self.after(*[env[k] for k in self.after.leaves])

    def launch(self, env: dict[str, Any]) -> RowLaunch | None:
        """How the one kernel runs on these leaves (arrays by key: CuPy's, or NumPy's in tests), or
        None where it does not apply."""
        before = after = None
        if self.before:
            leaves = [env[k] for k in self.before.leaves]
            plan = self.before.flat([a.dtype for a in leaves], [a.shape for a in leaves], readable(leaves))
            if plan is None or self.before.out_dtype(plan[0]) != plan[0]:
                return None  # a row computes on one float type
            dtype, types, shape, modes, extents = plan
            before = TreeRead(types, modes, tuple((k, extent_args(m, e)) for k, m, e in
                                                  zip(self.before.leaves, modes, extents)))
        else:
            dtype, shape = env[self.row_inputs[0]].dtype, env[self.row_inputs[0]].shape
        if dtype not in CTYPES or any(env[k].shape != shape or env[k].dtype != dtype for k in self.row_inputs[1:]):
            return None
        out = dtype
        if self.after:
            leaves = [None if k == self.output else env[k] for k in self.after.leaves]  # None: the row's output
            plan = self.after.flat([dtype if a is None else a.dtype for a in leaves],
                                   [shape if a is None else a.shape for a in leaves], readable(leaves, math.prod(shape)))
            if plan is None or plan[0] != dtype or plan[2] != shape \
                    or plan[3][self.after.leaves.index(self.output)] != "full":
                return None  # another type, or the tree broadcasts the row's output
            out = self.after.out_dtype(dtype)
            after = TreeRead(plan[1], plan[3], tuple((k, extent_args(m, e)) for k, m, e in
                                                     zip(self.after.leaves, plan[3], plan[4]) if k != self.output))
        cols = self.columns(shape)
        if not cols or not 0 < math.prod(shape) < FLAT_MAX:
            return None
        threads, per, each = gpu.row_shape(cols, True)
        return RowLaunch(dtype, shape, cols, threads, per, each, out, before, after)

    def _fused(self, args: Sequence[Any]) -> Any | None:
        """The one kernel's result, or None where it does not apply; how it runs is found once
        for each set of leaf types and layouts (`_prepare`)."""
        try:
            key = tuple((a.dtype, a.shape, a.flags.c_contiguous) for a in args)
        except AttributeError:  # not all device arrays
            return None
        if key not in self._launches:
            self._launches[key] = self._prepare(dict(zip(self.leaves, args)))
        launch = self._launches[key]
        return None if launch is None else launch(args)

    def _prepare(self, env: dict[str, Any]) -> Any | None:
        """The kernel's launch for leaves like these (a function of the step's leaves, in
        `leaves`' order), or None where it does not apply (`launch`)."""
        run = self.launch(env)
        if run is None:
            return None
        xp = self.xp
        key = (run.dtype, run.per, run.out, *[(t.types, t.modes) if t else None for t in (run.before, run.after)])
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = xp.RawKernel(self.source(run), "parc_row", options=("--std=c++14", "--fmad=false"))
        first = run.before.reads if run.before else ()
        last = run.after.reads if run.after else ()
        # the kernel's arrays, in its parameters' order: the tree before's leaves (or the row's
        # first input), the gradient's y, the tree after's leaves; as positions among `leaves`
        order = [self.leaves.index(k) for k in (*(k for k, _ in first), *self.row_inputs[bool(self.before):],
                                                *(k for k, _ in last))]
        copy = {i for i in order if not env[self.leaves[i]].flags.c_contiguous}  # views (`readable`)
        rows = math.prod(run.shape) // run.cols
        grid = gpu.row_grid(rows, run.threads, run.each)
        tail = (np.int64(rows), np.int64(run.cols), *[np.uint32(v) for _, e in (*first, *last) for v in e])

        def launch(args: Sequence[Any]) -> Any:
            out = xp.empty(run.shape, run.out)
            kernel(*grid, (*(xp.ascontiguousarray(args[i]) if i in copy else args[i] for i in order), out, *tail))
            return out
        return launch

    def source(self, run: RowLaunch) -> str:
        """The kernel's CUDA C: `Load`, computing the tree before for element i, `Store`, giving
        element i of the row to the tree after (as its leaf `output`) and storing the root, and
        `parc_row`, which runs the row kernel over one row through them (`Plain` and `Write` where
        there is no tree): the register-held variant holding `run.per` elements a thread, or the
        looping one for longer rows."""
        ctype = CTYPES[run.dtype]
        out = BF16 if run.out == BFLOAT16 else ""
        variant = f"loop<{ctype}>" if run.per is None else f"held<{ctype}, {run.per}>"
        params: list[str] = []
        extents: list[str] = []
        functors: list[str] = []

        def functor(name: str, group: Group, read: TreeRead, prefix: str, given: str) -> str:
            """A struct computing `group` at element i: its leaves from memory, `given` (the leaf
            the row hands it) from the argument `d`."""
            mine = [j for j, k in enumerate(group.leaves) if k != given]
            sizes = [e for j in mine for e in extent_names(j, read.modes[j])]
            fields = " ".join([f"const {_pointee(read.types[j])}* __restrict__ p{j};" for j in mine]
                              + [f"unsigned int {e};" for e in sizes])
            loads = " ".join(f"const {ctype if t == BF16 else t} in{j} = "
                             f"{'d' if j not in mine else _value(t, f'p{j}[{INDEX[read.modes[j]].format(j)}]')};"
                             for j, t in enumerate(read.types))
            params.extend(f"const {_pointee(read.types[j])}* __restrict__ {prefix}p{j}" for j in mine)
            extents.extend(f"unsigned int {prefix}{e}" for e in sizes)
            members = ", ".join([f"{prefix}p{j}" for j in mine] + [f"{prefix}{e}" for e in sizes])
            if name == "Load":
                head, tail = f"{ctype} operator()(long long at) const", "return out;"
            else:
                head, tail = f"void operator()(long long at, {ctype} d) const", \
                    f"o[i] = {'bf16_bits(out)' if out == BF16 else 'out'};"
                fields = f"{_pointee(out or ctype)}* __restrict__ o; {fields}"
                members = f"o, {members}" if members else "o"
            functors.append(f"""struct {name} {{
    {fields}
    __device__ {head} {{
        const unsigned int i = (unsigned int)at;
        {loads}
        {ctype} out;
        {{
{group.body(ctype)}
        }}
        {tail}
    }}
}};""")
            return f"{name}{{{members}}}"

        if self.before:
            load = functor("Load", self.before, run.before, "b", "")
        else:
            params.append(f"const {ctype}* __restrict__ {'x' if self.op == 'Softmax' else 'dy'}")
            load = f"Plain<{ctype}>{{{'x' if self.op == 'Softmax' else 'dy'}}}"
        if self.op == "SoftmaxGrad":
            params.append(f"const {ctype}* __restrict__ y")
        store = functor("Store", self.after, run.after, "a", self.output) if self.after else f"Write<{ctype}>{{o}}"
        params += [f"{_pointee(out or ctype)}* __restrict__ o", "long long rows", "long long cols", *extents]
        call = f"softmax_{variant}({load}, {store}, r, cols, shared);" if self.op == "Softmax" \
            else f"softmax_grad_{variant}({load}, y, {store}, r, cols, shared);"
        prelude = gpu.BF16_BITS if BF16 in (*(run.before.types if run.before else ()),
                                             *(run.after.types if run.after else ()), out) else ""
        body = "\n".join(functors)
        return f"""{gpu.ROW_SOURCE}{prelude}
{body}

extern "C" __global__ void parc_row({", ".join(params)}) {{
    __shared__ {ctype} shared[32];
    ROW
    {call}
}}
"""


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
                  xp: Any) -> tuple[list[tuple], list[str], list]:
    """The engine's steps with each softmax gradient (`softmax_grad_groups`) as one step
    (`SoftmaxGrad`). `nodes` are the steps' ONNX nodes (for ReduceSum's axes and keepdims).
    Returns the steps, op types and nodes (the final Mul's for a gradient)."""
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
        return steps, ops, nodes
    taken = {i for a, b, c, *_ in found.values() for i in (a, b, c)}
    out, out_ops, out_nodes = [], [], []
    for i, step in enumerate(steps):
        if i in taken:
            continue
        if i in found:
            *_, dy, y, axis = found[i]
            out.append((SoftmaxGrad(axis, xp), (dy, y), step[2], f"{step[3].rpartition(' (')[0]} and 3 more (SoftmaxGrad)"))
            out_ops.append("SoftmaxGrad")
        else:
            out.append(step)
            out_ops.append(ops[i])
        out_nodes.append(nodes[i])
    return out, out_ops, out_nodes


@dataclass
class SoftmaxGrad:
    """y * (dy - sum(dy * y, axis, keepdims)): `gpu.softmax_grad_last` reads dy and y once per
    row where the axis is the last, CuPy's (or NumPy's) operations otherwise."""

    axis: int
    xp: Any

    def __call__(self, dy: Any, y: Any) -> tuple[Any]:
        xp = self.xp
        if xp is not np and self.axis % y.ndim == y.ndim - 1:
            dx = gpu.softmax_grad_last(xp, dy, y)
            if dx is not None:
                return (dx,)
        return (y * (dy - xp.sum(dy * y, axis=self.axis, keepdims=True)),)
