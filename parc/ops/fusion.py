"""Which elementwise nodes run as one kernel: the fusion grouping, apart from the kernels.

The array engine (`parc.exec.engines.fusion`) runs each group found here as one kernel, and the
planner's cost model (`parc.passes.timing`) prices it so; both ask these functions, so the two
agree. A fusible node (`fusible`: an op of `OPS`) takes in the node producing one of its inputs
when that value has no other reader and is not a graph output, so each group is a tree whose
intermediates nobody else sees (`trees`): its leaves are read once and only its root is written.

A softmax, or a softmax's gradient as autodiff writes it (`softmax_grad_groups`), is a row step
that takes in the trees beside it (`row_groups`): the tree making its input and the tree reading
its output. Casts between float32 and bfloat16 (mixed precision) join trees at their edges
(`cast_kind`); a tree computes in one float type. `flat_layout` says how each leaf of a tree is
read by the output's flat index, which decides where the engine's kernels apply.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
from onnx import TensorProto

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
    # cast to bfloat16 stored as bfloat16's bits, rounded (the engine's cuda/bf16.cu); the tree
    # computes in float
    "Cast": (1, "{0}"),
}
ROW_OPS = ("Softmax", "SoftmaxGrad")  # the row steps that take in trees (`row_groups`)
FLAT_MAX = 1 << 30  # elements `flat_layout` takes: the kernels' 32-bit indices, with room for a loop's last step


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


def flat_layout(shapes: Sequence[tuple[int, ...]], contiguous: Sequence[bool], limit: int = FLAT_MAX) -> tuple | None:
    """(output shape, each leaf's mode, each leaf's extent) where every leaf of a group can be read
    by the output's flat index i: "full" (its own index i: contiguous, the output's size), "one"
    (a single value), "tail" (contiguous, broadcast over leading dims: i % extent, a bias or a
    mask), "head" (contiguous, broadcast over trailing dims: i / extent, a row's statistic) or
    "split" (contiguous, broadcast over one run of middle dims: a padding mask [B, 1, 1, S] of
    scores [B, H, S, S]; its extent (m, q), the output's elements from the run on and the leaf's
    after it: i / m * q + i % q). None for anything else (a transposed view, two runs broadcast):
    CuPy's kernel reads those; and for an output of `limit` elements or more (the cost model asks
    with a higher one about arrays that the plan splits before the engine sees them). The
    engine's `INDEX` is each mode's C text, `extent_args` its arguments."""
    shape = tuple(np.broadcast_shapes(*shapes))
    n = math.prod(shape)
    if not 0 < n < limit:
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


def softmax_grad_groups(ops: Sequence[str], inputs: Sequence[Sequence[str]], outputs: Sequence[Sequence[str]],
                        graph_outputs: Sequence[str], reduce_axis) -> dict[int, tuple[int, int, int, str, str, int]]:
    """Where a softmax's gradient, as autodiff writes it, `y * (dy - ReduceSum(dy * y, axis,
    keepdims=1))`, is four steps whose intermediates nobody else reads: final Mul's step ->
    (the first Mul's, the ReduceSum's and the Sub's steps, dy, y, axis). `reduce_axis(i)` is
    ReduceSum step i's one axis when it keeps dims, else None. The engine runs each as one step
    (its `softmax_grads`); the cost model prices it so (`parc.passes.timing`)."""
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
    one kernel (its `RowGroup`); the cost model prices it so (`parc.passes.timing`)."""
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
        a = axis + len(shape) if axis < 0 else axis
        if opset >= 13:
            return shape[-1] if a == len(shape) - 1 else None
        return math.prod(shape[a:])
    return columns


def last_columns(axis: int):
    """Elements a row of a softmax gradient over `axis`, or None where it is not the last."""
    return lambda shape: shape[-1] if shape and axis % len(shape) == len(shape) - 1 else None
