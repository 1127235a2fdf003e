"""Elementwise fusion for the array engine: the engine's steps, with the groups run as one.

A training step is mostly elementwise nodes over large tensors (the optimizer's update, GELU and
layer normalisation and their gradients, the attention mask), and on a GPU each one reads its
inputs from memory and writes its output back. When the engine is built, `fuse` puts one step
(`Group`, `tree_kernel.py`) in the place of each elementwise tree the op layer finds
(`parc.ops.fusion.trees`), and `softmax_grads` one step (`SoftmaxGrad`) in the place of each
softmax gradient as autodiff writes it (`parc.ops.fusion.softmax_grad_groups`).

A softmax, or a softmax's gradient, takes in the trees beside it (`RowGroup`,
`parc.ops.fusion.row_groups`): the tree before a softmax is computed as the row kernel loads
each element, the tree after one is given each element as the row kernel stores it, so the value
between them never goes to memory. `PARC_CUPY_ROWS=0` runs them apart.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parc.exec.engines import gpu
from parc.exec.engines.gpu import CTYPES
from parc.exec.engines.tree_kernel import (
    BF16,
    BFLOAT16,
    INDEX,
    Group,
    Op,
    extent_args,
    extent_names,
    leaf_value,
    pointee,
    readable,
)
from parc.ops.fusion import (
    FLAT_MAX,
    fusible,
    last_columns,
    row_groups,
    softmax_columns,
    softmax_grad_groups,
    trees,
)

ENV_ROWS = "PARC_CUPY_ROWS"  # "0": the row kernels and the trees beside them run apart (for measuring)


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
    functions (`softmax_held`, `softmax_grad_held` of cuda/held.cu; `_loop` for rows over the held
    kernels' 8,192 elements, which compute the tree before at each of their passes), built with
    `--fmad=false`: each element is computed as the trees' and the row kernel's own kernels
    compute it, so the results are the same to the bit. Where it does not apply (NumPy; types
    other than the trees' kernels take; a leaf the flat kernel cannot read; a softmax over another
    axis) the tree before, the row kernel and the tree after run one after the other."""

    op: str  # "Softmax" or "SoftmaxGrad" (`parc.ops.fusion.ROW_OPS`)
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
            fields = " ".join([f"const {pointee(read.types[j])}* __restrict__ p{j};" for j in mine]
                              + [f"unsigned int {e};" for e in sizes])
            loads = " ".join(f"const {ctype if t == BF16 else t} in{j} = "
                             f"{'d' if j not in mine else leaf_value(t, f'p{j}[{INDEX[read.modes[j]].format(j)}]')};"
                             for j, t in enumerate(read.types))
            params.extend(f"const {pointee(read.types[j])}* __restrict__ {prefix}p{j}" for j in mine)
            extents.extend(f"unsigned int {prefix}{e}" for e in sizes)
            members = ", ".join([f"{prefix}p{j}" for j in mine] + [f"{prefix}{e}" for e in sizes])
            if name == "Load":
                head, tail = f"{ctype} operator()(long long at) const", "return out;"
            else:
                head, tail = f"void operator()(long long at, {ctype} d) const", \
                    f"o[i] = {'bf16_bits(out)' if out == BF16 else 'out'};"
                fields = f"{pointee(out or ctype)}* __restrict__ o; {fields}"
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
        params += [f"{pointee(out or ctype)}* __restrict__ o", "long long rows", "long long cols", *extents]
        call = f"softmax_{variant}({load}, {store}, r, cols, shared);" if self.op == "Softmax" \
            else f"softmax_grad_{variant}({load}, y, {store}, r, cols, shared);"
        prelude = gpu.cuda_source("bf16") if BF16 in (*(run.before.types if run.before else ()),
                                                      *(run.after.types if run.after else ()), out) else ""
        body = "\n".join(functors)
        return f"""{gpu.row_source()}{prelude}
{body}

extern "C" __global__ void parc_row({", ".join(params)}) {{
    __shared__ {ctype} shared[32];
    ROW
    {call}
}}
"""


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
