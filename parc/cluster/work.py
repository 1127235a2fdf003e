"""What a sequence of nodes asks of a device as parc's lowering and engines run it: the one pricer.

`NodeWork.of(node)` (`parc.cluster.cost`) is one node's work alone. Run in a module, nodes are
not alone, and `graph_work` says what each costs there, for the search (over the whole training
graph, `parc.passes.spmd.costs`, the stage search and the heterogeneous balance) and for the task
times (over each emitted module, `parc.passes.timing`) alike:

- on a CPU (onnxruntime), a view op (`VIEW_OPS`) into or out of an output is the copy onnxruntime
  makes; what onnxruntime folds into a product (`fused_into_products`) costs nothing of its own;
- on a GPU (parc's array engine), the engine's fused groups (`parc.ops.fusion`: elementwise
  trees, softmax rows and their gradients) are one kernel each, priced on their leaves' reads
  and their root's write; a Transpose is a view;
- on a device with a `cold_bandwidth` (a calibrated CPU), the bytes a node reads or writes that
  the caches do not hold (`far_bytes`) are priced at the cold rate.

The repeated nodes and no-op Casts onnxruntime removes are not in the modules parc writes
(`parc.ir.simplify` runs at emit), so nothing here emulates those.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

import numpy as np

from parc.cluster.cost import NodeWork
from parc.cluster.devices import DeviceSpec
from parc.ir.graph import Graph, Node
from parc.ops.base import node_pieces, node_work, op_class
from parc.ops.fusion import (
    FLAT_MAX,
    cast_kind,
    flat_layout,
    fusible,
    last_columns,
    row_groups,
    softmax_columns,
    softmax_grad_groups,
    trees,
)

# ops that only reshape: onnxruntime hands the input's buffer on (other nodes may read it too),
# except where the input or the view is a module output, which has a buffer of its own and is
# priced as a copy (measured: benchmarks/LOG.md, "Figures moved out of code comments"). parc's
# array engine returns a view either way
VIEW_OPS = ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity")
# what onnxruntime's CPU graph optimizer folds into a product, run as part of it at no cost of its
# own (`fused_into_products`): a 2-D Transpose read only by a MatMul (MatmulTransposeFusion: the
# product packs its operand transposed), as `parc grad` writes a weight's gradient x^T dy. Batched
# products read transposed (attention's) and a bias Add folded into a Gemm cost about what the
# separate node costs, so those stay priced (measured: benchmarks/LOG.md)
FUSED_PRODUCT = "MatMul"
# (graph id, node count, device, spread) -> (the graph, its work): `of_graph`
_OF_GRAPH: dict[tuple[int, int, str, bool], tuple[Graph, list]] = {}
_OF_GRAPH_MAX = 16
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16))


def graph_work(nodes: Sequence[Node], device: DeviceSpec, outputs: Collection[str] = (),
               consts: Mapping[str, np.ndarray] | None = None, constants: Collection[str] = (),
               opset: int = 18, classes: Mapping[str, str] | None = None, spread: bool = False) -> list[NodeWork | None]:
    """Each of `nodes` (in the order they run) as it costs on `device` among the others (the
    module docstring): None where it costs nothing of its own (folded into a product, or run
    inside another node's kernel, which carries its work). `outputs`: the names of the values
    the nodes hand on (a module's or a graph's outputs); `consts`: small constants by name (a
    reduction's axes, a scalar scale); `constants`: the names of every constant (initializer);
    `classes`: an op class by node name where the node alone cannot tell it (a module's masked
    Softmax: `parc.ops.base.masked_classes`).

    `spread` (the search's view): a fused kernel's work is spread over the nodes it runs, each
    carrying its own FLOPs and its share of the kernel's bytes (in proportion to what it would
    move alone), and only the last node paying the launch (`NodeWork.alone`); the sum is the
    kernel's. So a node of a kernel still costs less split than whole, and the search keeps a
    kernel's nodes on one layout, as the engine needs them to fuse. A kernel the engine runs only
    on arrays of fewer than `FLAT_MAX` elements (a softmax row with its trees) is taken as fused
    there whatever its size, since a plan may split it that small; its nodes also say what they
    ask unfused (`NodeWork.unfused`), for the strategies that leave a device more."""
    outputs = set(outputs)
    consts = consts or {}
    work: list[tuple | None] = []
    for node in nodes:
        try:
            flops, nbytes, dtype = node_work(node)
        except (AssertionError, TypeError, ValueError, KeyError, IndexError):  # a shape it cannot see
            flops, nbytes, dtype = 0.0, 0.0, "float32"
        x = node.inputs[0] if node.inputs else None
        if not device.gpu and node.op_type in VIEW_OPS and x is not None and x.shape is not None \
                and x.dtype is not None and (x.name in outputs or any(o.name in outputs for o in node.outputs)):
            nbytes = 2 * x.nbytes  # onnxruntime copies a view into or out of an output
        work.append((flops, nbytes, dtype, (classes or {}).get(node.name) or op_class(node), node_pieces(node)))
    gone: set[int] = set()
    inside: set[int] = set()
    big: dict[int, int] = {}  # node -> the elements of its row, too many for the engine whole
    if device.gpu:
        alone, owner, flats = work, {}, {}
        limit = sys.maxsize if spread else FLAT_MAX  # the search's arrays are split later
        work = _on_the_array_engine(nodes, work, list(outputs), consts, opset, owner, limit, flats)
        if spread:
            work, inside = _spread(alone, work, owner), set(owner)
        big = {i: n for i, n in flats.items() if n >= FLAT_MAX}
        if big:  # what those nodes ask where the engine runs the row apart
            small_owner: dict[int, int] = {}
            small = _spread(alone, _on_the_array_engine(nodes, alone, list(outputs), consts, opset, small_owner),
                            small_owner)
    else:
        gone = fused_into_products(nodes, outputs, consts, constants)
        work = [None if i in gone else w for i, w in enumerate(work)]
    cold = far_bytes(nodes, device.cache_share, gone, outputs) if device.cold_cost() else [0.0] * len(nodes)
    out = [None if w is None else NodeWork(*w, cold=c, alone=i not in inside) for i, (w, c) in enumerate(zip(work, cold))]
    for i, n in big.items():
        out[i] = replace(out[i], flat=n, unfused=NodeWork(*small[i], cold=cold[i], alone=i not in small_owner))
    return out


def _spread(alone: list[tuple], fused: list[tuple | None], owner: Mapping[int, int]) -> list[tuple]:
    """`fused` (a kernel's work on its last node) with each kernel's spread over its nodes:
    their own FLOPs, and the kernel's bytes in proportion to the bytes each moves `alone`."""
    out = list(fused)
    members: dict[int, list[int]] = {}
    for i in owner:
        root = i
        while root in owner:
            root = owner[root]
        members.setdefault(root, []).append(i)
    for root, group in members.items():
        group = [*group, root]
        kernel = fused[root]
        moved = sum(alone[i][1] for i in group)
        for i in group:
            share = alone[i][1] / moved if moved else 1.0 / len(group)
            out[i] = (alone[i][0], kernel[1] * share, alone[i][2], kernel[3], kernel[4] if i == root else 0.0)
    return out


def _known_bytes(v) -> int | None:
    """A value's bytes, None where its type or a dim is unknown (it counts as no traffic)."""
    if v is None or v.dtype is None or v.shape is None or not all(isinstance(d, int | np.integer) for d in v.shape):
        return None
    return v.nbytes


def far_bytes(nodes: Sequence[Node], share: float, gone: Collection[int] = (),
              outputs: Collection[str] = ()) -> list[float]:
    """Per node of `nodes` (in the order they run), the bytes it moves between the cores and
    memory the caches do not hold: a value read first (an input or a constant, touched by an
    earlier task: a step's parameters and optimizer state, a gradient an earlier module made), a
    value read again after more than `share` bytes of other traffic since it was last touched
    (a forward activation that its gradient reads back), and each of `outputs` (by name), written
    into memory the step has not touched for a while: a step holds its modules' outputs (the
    activations the backward pass reads), so each is a new array. Traffic counts every read and
    write of the nodes that run (not those in `gone`, which onnxruntime removes). A module that
    writes new memory and reads evicted inputs runs measurably slower than the same module rerun
    on warm arrays (benchmarks/LOG.md)."""
    last: dict[str, float] = {}
    traffic = 0.0
    out = [0.0] * len(nodes)
    for i, node in enumerate(nodes):
        runs = i not in gone
        for v in node.inputs:
            nbytes = _known_bytes(v)
            if nbytes is None:
                continue
            if runs:
                if v.name not in last or traffic - last[v.name] > share:
                    out[i] += nbytes
                traffic += nbytes
            last[v.name] = traffic
        for v in node.outputs:
            nbytes = _known_bytes(v)
            if nbytes is not None:
                traffic += nbytes if runs else 0.0
                last[v.name] = traffic
                if runs and v.name in outputs:  # one node makes each value
                    out[i] += nbytes
    return out


def fused_into_products(nodes: Sequence[Node], outputs: Collection[str] = (),
                        consts: Mapping[str, np.ndarray] | None = None, constants: Collection[str] = ()) -> set[int]:
    """The indices of `nodes` that onnxruntime's CPU graph optimizer folds into a product, so
    that they cost nothing of their own: a 2-D Transpose whose one reader is a MatMul
    (`FUSED_PRODUCT`; MatmulTransposeFusion), unless its input is a Transpose's (onnxruntime
    merges the two into one that stays), and a Mul or Div by a scalar constant (`consts`) of a
    MatMul's result or of an operand that only MatMuls read, none of them followed by an Add
    alone (MatMulScaleFusion: the product scales as it goes; MatMulAddFusion has made that one a
    Gemm before). A node whose result is one of `outputs` stays; so does the scaling of a
    constant (one of `constants`)."""
    consts = consts or {}
    outputs = set(outputs)
    readers: dict[str, list[Node]] = {}
    for n in nodes:
        for v in n.inputs:
            if v is not None:
                readers.setdefault(v.name, []).append(n)
    producer = {o.name: n for n in nodes for o in n.outputs if o is not None}

    def scalar(name: str) -> bool:
        t = consts.get(name)
        return t is not None and np.size(t) == 1 and np.asarray(t).dtype in _FLOATS

    def to_gemm(product: Node) -> bool:  # MatMulAddFusion makes it a Gemm first, which takes no scale
        after = readers.get(product.outputs[0].name, [])
        return len(after) == 1 and after[0].op_type == "Add"

    out: set[int] = set()
    for i, n in enumerate(nodes):
        mine = [o.name for o in n.outputs if o is not None and o.name]
        if n.domain not in ("", "ai.onnx"):
            continue
        is_output = bool(outputs.intersection(mine))  # a folded Transpose keeps it
        names = [v.name if v is not None else "" for v in n.inputs]
        if n.op_type == "Transpose" and mine and not is_output:
            perm = n.attr("perm")
            only = readers.get(mine[0], [])
            after_transpose = names[0] in producer and producer[names[0]].op_type == "Transpose"
            if perm is not None and list(perm) == [1, 0] and not after_transpose and len(only) == 1 \
                    and only[0].op_type == FUSED_PRODUCT:
                out.add(i)
        elif n.op_type in ("Mul", "Div") and len(names) == 2 and mine:
            pairs = [(names[1], names[0])] if n.op_type == "Div" else [(names[1], names[0]), (names[0], names[1])]
            for s, x in pairs:  # (the scalar, the tensor it scales)
                if not scalar(s) or x in constants:
                    continue
                of_product = x in producer and producer[x].op_type == FUSED_PRODUCT and len(readers.get(x, [])) == 1 \
                    and x not in outputs
                into_products = all(r.op_type == FUSED_PRODUCT and not to_gemm(r) for r in readers.get(mine[0], [])) \
                    and bool(readers.get(mine[0])) and not is_output
                if of_product or into_products:
                    out.add(i)
                    break
    return out


def _on_the_array_engine(nodes: Sequence[Node], work: list[tuple | None], graph_outputs: list[str],
                         consts: Mapping[str, np.ndarray], opset: int = 13,
                         owner: dict[int, int] | None = None, limit: int = FLAT_MAX,
                         flats: dict[int, int] | None = None) -> list[tuple | None]:
    """`work` (FLOPs, bytes, dtype, class, pieces per node) as parc's array engine runs it on a GPU: a
    softmax's gradient as autodiff writes it (`fusion.softmax_grad_groups`) is one kernel reading
    dy and y and writing the result; a tree of two or more elementwise nodes (`fusion.trees`,
    the grouping the engine makes) is one kernel reading its leaves once and writing its root; a
    softmax or softmax gradient with the trees beside it (`fusion.row_groups`, where the engine's
    row kernel applies: the last axis, leaves the flat index reads) is one kernel too, neither the
    tree before's root nor the row's output going to memory; a Transpose returns a view (its
    reader takes the strides), moving nothing itself. `consts`: the small integer constants
    (ReduceSum's axes). The result is aligned with `nodes`: a group's work on its last node, None
    on the nodes it takes in, each of which `owner` (filled if given) maps to the node that took
    it in. A row is joined with its trees where it has fewer than `limit` elements (the engine's
    `FLAT_MAX`); `flats` (filled if given) maps each node of a joined row (a softmax gradient's
    nodes included) to the row's elements."""
    owner = owner if owner is not None else {}
    flats = flats if flats is not None else {}
    def reduce_axis(i: int) -> int | None:
        n = nodes[i]
        axes = consts.get(n.inputs[1].name) if len(n.inputs) > 1 and n.inputs[1] is not None else None
        if axes is None or n.attr("keepdims", 1) != 1 or np.size(axes) != 1:
            return None
        return int(np.ravel(axes)[0])

    names = [[v.name if v is not None else "" for v in n.inputs] for n in nodes]
    groups = softmax_grad_groups([n.op_type for n in nodes], names, [[v.name for v in n.outputs] for n in nodes],
                                 graph_outputs, reduce_axis)
    out = [(w[0], 0.0, w[2], w[3], 0.0) if n.op_type == "Transpose" else w for n, w in zip(nodes, work)]
    for d, (a, b, c, dy, y, _axis) in groups.items():
        read = {v.name: v for i in (a, c) for v in nodes[i].inputs if v is not None and v.name in (dy, y)}
        root = nodes[d].outputs[0]
        nbytes = sum(v.nbytes for v in read.values() if v.shape is not None) + (root.nbytes if root.shape else 0)
        out[d] = (sum(out[i][0] for i in (a, b, c, d)), nbytes, out[d][2], "", 0.0)
        out[a] = out[b] = out[c] = None
        owner.update({a: d, b: d, c: d})
    taken = {i for a, b, c, *_ in groups.values() for i in (a, b, c)}
    steps, index, kinds = [], [], {}
    for i, n in enumerate(nodes):
        if i in taken:
            continue
        inputs = list(groups[i][3:5]) if i in groups else names[i]  # a softmax gradient reads dy and y
        outputs = [(j, v.name) for j, v in enumerate(n.outputs)]
        low = [v is not None and v.dtype is not None and v.dtype.name == "bfloat16" for v in n.inputs]
        kind = kinds[i] = cast_kind(n.op_type, n.attr("to"), low)
        ok = n.domain in ("", "ai.onnx") and i not in groups and fusible(n.op_type, inputs, outputs, kind)
        steps.append((ok and ("root" if kind == "down" else True), inputs, outputs[0][1] if ok else None))
        index.append(i)
    found = trees(steps, graph_outputs)

    def leaves(tree: list[int]) -> dict:
        inner = {nodes[index[j]].outputs[0].name for j in tree}
        return {v.name: v for j in tree for v in nodes[index[j]].inputs if v.name not in inner}

    def applies(j: int, kind: str, tree: list[int]) -> bool:
        """Whether the engine's row kernel takes step j and a tree beside it (`RowGroup.launch`)."""
        n = nodes[index[j]]
        x = n.outputs[0]
        if x is None or x.shape is None or (kind == "before" and kinds.get(index[tree[-1]]) == "down"):
            return False  # (a row computes on one float type)
        if index[j] not in groups:  # a Softmax
            cols = softmax_columns(n.attr("axis", -1 if opset >= 13 else 1), opset)(x.shape)
        else:
            cols = last_columns(groups[index[j]][5])(x.shape)
        shapes = {k: v.shape for k, v in leaves(tree).items()}
        layout = flat_layout(list(shapes.values()), [True] * len(shapes), limit) \
            if None not in shapes.values() else None
        if not cols or layout is None or layout[0] != tuple(x.shape):
            return False
        # the tree after reads the row's output whole, at its own index (no broadcast of it)
        return kind == "before" or layout[1][list(shapes).index(x.name)] == "full"

    values = {v.name: v for n in nodes for v in (*n.inputs, *n.outputs) if v is not None}
    row_ops = ["SoftmaxGrad" if i in groups else nodes[i].op_type for i in index]
    rows = row_groups(row_ops, [s[1] for s in steps], [[v.name for v in nodes[i].outputs] for i in index],
                      found, graph_outputs, applies)
    joined = {t[-1] for pair in rows.values() for t in pair if t}
    for j, (before, after) in rows.items():  # one kernel: the trees' leaves and the row's inputs read
        step = index[j]
        row_inputs = list(groups[step][3:5] if step in groups else names[step][:1])
        output = nodes[step].outputs[0].name
        read = leaves(before) if before else {}
        read.update({k: values[k] for k in row_inputs[1 if before else 0:]})
        read.update({k: v for k, v in (leaves(after) if after else {}).items() if k != output})
        written = nodes[index[after[-1]]].outputs[0] if after else nodes[step].outputs[0]
        flops = out[step][0] + sum(out[index[t]][0] for t in (*(before or ()), *(after or ())))
        nbytes = sum(v.nbytes for v in read.values() if v.shape is not None)
        nbytes += written.nbytes if written.shape is not None else 0
        flats[step] = math.prod(nodes[step].outputs[0].shape)
        for m in groups[step][:3] if step in groups else ():  # the softmax gradient's own nodes
            flats[m] = flats[step]
        for t in (*(before or ()), *(after or ())):
            out[index[t]] = None
            owner[index[t]] = step
            flats[index[t]] = flats[step]
        out[step] = (flops, nbytes, work[step][2], "", 0.0)
    for tree in found:
        if len(tree) < 2 or tree[-1] in joined:
            continue
        target, flops = index[tree[-1]], sum(out[index[j]][0] for j in tree)
        written = nodes[target].outputs[0]
        nbytes = sum(v.nbytes for v in leaves(tree).values() if v.shape is not None)
        nbytes += written.nbytes if written.shape is not None else 0
        for j in tree[:-1]:
            out[index[j]] = None
            owner[index[j]] = target
        out[target] = (flops, nbytes, work[target][2], "", 0.0)
    return out


def of_graph(graph: Graph, device: DeviceSpec, spread: bool = True) -> list[NodeWork | None]:
    """`graph_work` of a whole IR graph's nodes (a training step, or a pipeline stage's part of
    one) on `device`: its outputs are what it hands on, its constants other than parameters are
    the initializers a module of it holds; a kernel's work `spread` over its nodes (the search's
    view) unless told. Kept per graph and device for the process (a search
    builds a cost model per mesh; warmed before its workers fork, they inherit it): a graph is
    not changed while it is planned."""
    key = (id(graph), len(graph.nodes), repr(device), spread)
    known = _OF_GRAPH.get(key)
    if known is not None and known[0] is graph:
        return known[1]
    if len(_OF_GRAPH) >= _OF_GRAPH_MAX:
        _OF_GRAPH.clear()
    work = _of_graph(graph, device, spread)
    _OF_GRAPH[key] = (graph, work)  # (the graph held, so its id is not reused while kept)
    return work


def _of_graph(graph: Graph, device: DeviceSpec, spread: bool) -> list[NodeWork | None]:
    consts, constants = {}, set()
    for n in graph.nodes:
        for v in n.inputs:
            if v is None or not v.is_const or v.is_param or v.name in constants:
                continue
            constants.add(v.name)
            if v.const.size <= 1 or (len(v.shape) == 1 and v.dtype.name == "int64" and v.const.size <= 16):
                consts[v.name] = v.const.numpy()
    return graph_work(graph.nodes, device, {v.name for v in graph.outputs}, consts, constants,
                      graph.opset.get("", graph.opset.get("ai.onnx", 18)), spread=spread)
