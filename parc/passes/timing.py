"""Task times: what each task of a task graph costs, from the cost model (DESIGN: task times).

`parc plan` writes `time_s` on every compute, collective, send and recv task of taskgraph.json,
so that the step simulator (`parc.exec.stepsim`) needs nothing but the plan directory:

- a compute task: the roofline (`parc.cluster.cost.compute_time`) of every node of its ONNX
  module on its local shapes, on its rank's device, plus the device's `task_overhead` (what the
  executor spends per task: calibrated by `parc profile`), plus, where the device has a
  `cold_bandwidth`, the cost of its reads of values the caches no longer hold (`far_bytes`: its
  inputs, and a forward activation read back after more than the device's `cache_share` of
  traffic) and of its outputs' writes into memory they do not hold either. Modules of the same
  content (the ranks of an even mesh) are priced once.
- a collective: the ring formula of its step (`ring_time`) on its mesh axis's link, with a whole
  collective's latency (a gradient bucket is one collective of its members' bytes:
  `parc.passes.lower.fuse_gradients`);
- a send and its recv: one message of the received shard's bytes on the link between the two
  ranks (the pipeline planner's `p2p_link`);
- a collective on a link with a `handoff` carries it as `handoff_s`: what the first collective
  after compute costs more (the simulator charges it there, in the proportion its host was
  crowded; a recv pays none: `parc.exec.stepsim`).

A rank with microbatches also gets its `folds` entry: what it spends after each microbatch
adding that microbatch's values into the step's sums (`fold_seconds`).

A compute task also gets `out_bytes`: the bytes of each value it hands on (the module's
outputs), which the simulator needs for memory.

On a host whose ranks outnumber its cores (CPU ranks, a calibration that says its host's CPUs:
`Calibration.busy_counts`), `time_s` is what a task takes with every rank of the host computing,
as `parc profile` measured them all at once; a compute task also gets `shared_s`, its time when
only a of them compute (by a), and the task graph `hosts`, the ranks of each such host. A rank
waiting on a message or a collective there gives its core up (`parc.exec.comm`), so a pipeline stage
that computes while the other waits runs faster than its `time_s` (`parc.exec.stepsim`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from parc.cluster.cost import NodeWork, compute_time, ring_time, send_recv_time
from parc.cluster.devices import DeviceSpec
from parc.cluster.links import LinkSpec
from parc.ir.dtypes import DType, onnx_nbytes
from parc.ir.graph import Node, Value
from parc.ir.tensor import TensorData
from parc.ops.base import node_pieces, node_work, op_class
from parc.ops.fusion import (
    cast_kind,
    flat_layout,
    fusible,
    last_columns,
    row_groups,
    softmax_columns,
    softmax_grad_groups,
    trees,
)
from parc.sharding.reshard import Collective

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
# (module digest, device) -> seconds: the ranks of an even mesh (lowered in one process) share them
_MODULE_SECONDS: dict[tuple[str, str], float] = {}
_MODULE_SECONDS_MAX = 10_000


def _digest(model: onnx.ModelProto) -> str:
    """The module's content without its name (ranks of an even mesh differ only in the name)."""
    g = onnx.GraphProto()
    g.CopyFrom(model.graph)
    g.name = ""
    return hashlib.sha256(g.SerializeToString(deterministic=True)).hexdigest()


def module_seconds(model: onnx.ModelProto, device: DeviceSpec, info: Mapping[str, tuple[int, tuple]],
                   masked: Mapping[str, str] | None = None) -> float:
    """Roofline seconds of every node of an ONNX module on `device` (on a CPU, a view op into or
    out of a module output priced as the copy onnxruntime makes: `VIEW_OPS`, and what
    onnxruntime folds into a product not at all: `fused_into_products`); `info`: each value's (ONNX
    type, local shape), as the lowering knows them (a module's slices of microbatches have
    shapes that depend on data, which shape inference cannot see); `masked`: the class of each of
    the graph's Softmax nodes over masked scores, by name (`parc.ops.base.masked_classes`:
    telling needs the graph's constants and data inputs, which a module may not hold)."""
    names = {n.name for n in model.graph.node}
    mine = {k: v for k, v in (masked or {}).items() if k in names}
    key = (_digest(model), repr(device), tuple(sorted(mine.items())))
    if len(_MODULE_SECONDS) > _MODULE_SECONDS_MAX:
        _MODULE_SECONDS.clear()
    if key not in _MODULE_SECONDS:
        shapes = dict(info)
        for init in model.graph.initializer:
            shapes[init.name] = (init.data_type, tuple(init.dims))
        values: dict[str, Value] = {}
        # boolean constants (a Where's mask): the runs of a condition are its pieces (`node_pieces`)
        for init in model.graph.initializer:
            if init.data_type == onnx.TensorProto.BOOL:
                values[init.name] = Value(init.name, const=TensorData.from_array(numpy_helper.to_array(init)))

        def value(name: str) -> Value | None:
            if not name:
                return None
            if name not in values:
                dtype, shape = shapes.get(name, (None, None))
                values[name] = Value(name, DType.from_numpy(helper.tensor_dtype_to_np_dtype(dtype))
                                     if dtype else None, tuple(shape) if shape is not None else None)
            return values[name]

        outputs = {v.name for v in model.graph.output}
        nodes, work = [], []
        for proto in model.graph.node:
            node = Node(proto.op_type, [value(i) for i in proto.input], [value(o) for o in proto.output],
                        {a.name: a for a in proto.attribute}, proto.name, proto.domain)
            try:
                flops, nbytes, dtype = node_work(node)
            except (AssertionError, TypeError, ValueError, KeyError, IndexError):  # a shape it cannot see
                flops, nbytes, dtype = 0.0, 0.0, "float32"
            if not device.gpu and proto.op_type in VIEW_OPS and proto.input and node.inputs[0] is not None \
                    and node.inputs[0].shape is not None and node.inputs[0].dtype is not None \
                    and (proto.input[0] in outputs or any(o in outputs for o in proto.output)):
                nbytes = 2 * node.inputs[0].nbytes  # onnxruntime copies a view into or out of an output
            nodes.append(node)
            work.append((flops, nbytes, dtype, mine.get(proto.name) or op_class(node),
                         node_pieces(node)))
        gone: set[int] = set()
        if device.gpu:
            consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
                      if t.data_type == onnx.TensorProto.INT64 and len(t.dims) <= 1}
            opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
            work = _on_the_array_engine(nodes, work, [o.name for o in model.graph.output], consts, opset)
        else:
            gone = fused_into_products(model)
            work = [w for i, w in enumerate(work) if i not in gone]
        total = sum(NodeWork(*w).seconds(device, queued=True) for w in work)
        if device.cold_cost():
            total += device.step_ratio * device.cold_cost() * far_bytes(nodes, device.cache_share, gone, outputs)
        _MODULE_SECONDS[key] = total
    return _MODULE_SECONDS[key]


def far_bytes(nodes: Sequence, share: float, gone: Collection[int] = (), outputs: Collection[str] = ()) -> float:
    """The bytes a module's `nodes` (in the order they run) move between the cores and memory the
    caches do not hold: a value the module reads first (an input or an initializer, touched by
    an earlier task: a step's parameters and optimizer state, a gradient an earlier module
    made), a value read again after more than `share` bytes of other traffic since it was last
    touched (a forward activation that its gradient reads back), and each of the module's
    `outputs` (by name), written into memory the step has not touched for a while: a step
    holds its modules' outputs (the activations the backward pass reads), so each is a new
    array. Traffic counts every read and write of the nodes that run (not those in `gone`,
    which onnxruntime removes). A module that writes new memory and reads evicted inputs runs
    measurably slower than the same module rerun on warm arrays (benchmarks/LOG.md)."""
    last: dict[str, float] = {}
    traffic = far = 0.0
    for i, node in enumerate(nodes):
        runs = i not in gone
        for v in node.inputs:
            nbytes = _known_bytes(v)
            if nbytes is None:
                continue
            if runs:
                if v.name not in last or traffic - last[v.name] > share:
                    far += nbytes
                traffic += nbytes
            last[v.name] = traffic
        for v in node.outputs:
            nbytes = _known_bytes(v)
            if nbytes is not None:
                traffic += nbytes if runs else 0.0
                last[v.name] = traffic
                if runs and v.name in outputs:  # one node makes each value
                    far += nbytes
    return far


def _known_bytes(v) -> int | None:
    """A value's bytes, None where its type or a dim is unknown (it counts as no traffic)."""
    if v is None or v.dtype is None or v.shape is None or not all(isinstance(d, int | np.integer) for d in v.shape):
        return None
    return v.nbytes


def fused_into_products(model: onnx.ModelProto) -> set[int]:
    """The indices of a module's nodes that onnxruntime's CPU graph optimizer folds into a
    product, so that they cost nothing of their own: a 2-D Transpose whose one reader is a MatMul
    (`FUSED_PRODUCT`; MatmulTransposeFusion), unless its input is a Transpose's (onnxruntime
    merges the two into one that stays), and a Mul or Div by a scalar constant of a MatMul's
    result or of an operand that only MatMuls read, none of them followed by an Add alone
    (MatMulScaleFusion: the product scales as it goes; MatMulAddFusion has made that one a Gemm
    before). A node whose result is a module output stays. (The repeated nodes and no-op Casts
    onnxruntime removes as well are not in the modules parc writes: `parc.ir.simplify`.)"""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    inits = {t.name: t for t in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for name in n.input:
            if name:
                readers.setdefault(name, []).append(n)
    producer = {o: n for n in graph.node for o in n.output}

    def scalar(name: str) -> bool:
        t = inits.get(name)
        return t is not None and int(np.prod(t.dims)) == 1 and t.data_type in (
            onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)

    def to_gemm(product: onnx.NodeProto) -> bool:  # MatMulAddFusion makes it a Gemm first, which takes no scale
        after = readers.get(product.output[0], [])
        return len(after) == 1 and after[0].op_type == "Add"

    out: set[int] = set()
    for i, n in enumerate(graph.node):
        mine = [o for o in n.output if o]
        if n.domain not in ("", "ai.onnx"):
            continue
        is_output = bool(set(mine) & outputs)  # a folded Transpose keeps it
        if n.op_type == "Transpose" and mine and not is_output:
            perm = next((list(a.ints) for a in n.attribute if a.name == "perm"), None)
            only = readers.get(mine[0], [])
            after_transpose = n.input[0] in producer and producer[n.input[0]].op_type == "Transpose"
            if perm == [1, 0] and not after_transpose and len(only) == 1 and only[0].op_type == FUSED_PRODUCT:
                out.add(i)
        elif n.op_type in ("Mul", "Div") and len(n.input) == 2 and mine:
            pairs = [(n.input[1], n.input[0])] if n.op_type == "Div" else \
                [(n.input[1], n.input[0]), (n.input[0], n.input[1])]
            for s, x in pairs:  # (the scalar, the tensor it scales)
                if not scalar(s) or x in inits:
                    continue
                of_product = x in producer and producer[x].op_type == FUSED_PRODUCT and len(readers.get(x, [])) == 1 \
                    and x not in outputs
                into_products = all(r.op_type == FUSED_PRODUCT and not to_gemm(r) for r in readers.get(mine[0], [])) \
                    and bool(readers.get(mine[0])) and not is_output
                if of_product or into_products:
                    out.add(i)
                    break
    return out


def _on_the_array_engine(nodes: list, work: list[tuple], graph_outputs: list[str],
                         consts: Mapping[str, np.ndarray], opset: int = 13) -> list[tuple]:
    """`work` (FLOPs, bytes, dtype, class, pieces per node) as parc's array engine runs it on a GPU: a
    softmax's gradient as autodiff writes it (`fusion.softmax_grad_groups`) is one kernel reading
    dy and y and writing the result; a tree of two or more elementwise nodes (`fusion.trees`,
    the grouping the engine makes) is one kernel reading its leaves once and writing its root; a
    softmax or softmax gradient with the trees beside it (`fusion.row_groups`, where the engine's
    row kernel applies: the last axis, leaves the flat index reads) is one kernel too, neither the
    tree before's root nor the row's output going to memory; a Transpose returns a view (its
    reader takes the strides), moving nothing itself. `consts`: the module's small integer
    initializers (ReduceSum's axes)."""
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
        layout = flat_layout(list(shapes.values()), [True] * len(shapes)) if None not in shapes.values() else None
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
        for t in (*(before or ()), *(after or ())):
            out[index[t]] = None
        out[step] = (flops, nbytes, work[step][2], "", 0.0)
    for tree in found:
        if len(tree) < 2 or tree[-1] in joined:
            continue
        target, flops = index[tree[-1]], sum(out[index[j]][0] for j in tree)
        written = nodes[target].outputs[0]
        nbytes = sum(v.nbytes for v in leaves(tree).values() if v.shape is not None)
        nbytes += written.nbytes if written.shape is not None else 0
        for j in tree:
            out[index[j]] = None
        out[target] = (flops, nbytes, work[target][2], "", 0.0)
    return [w for w in out if w is not None]


def fold_seconds(accumulate: Mapping[str, list], info: Mapping[str, tuple[int, tuple]], device: DeviceSpec) -> float:
    """What a rank spends after each microbatch folding it into the step's sums (the executor's
    `fold`): one Add per `sum` value on its local shape (read twice, written once: the first
    microbatch's copy is priced as an add too); a `last` keeps the value and a `concat` the
    list. Unpriced, these sums were a few percent of a pipelined step (benchmarks/LOG.md)."""
    total = 0.0
    for src, how, *_dim in accumulate.values():
        if how != "sum" or src not in info:
            continue
        onnx_type, shape = info[src]
        elements = float(np.prod(shape)) if shape is not None else 0.0
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(onnx_type))
        total += compute_time(elements, 3 * elements * dtype.itemsize, device, dtype.name, "Add", queued=True)
    return total


def shared_hosts(cluster, device_ids) -> dict:
    """The task graph's `hosts` entry: the ranks (each on device `device_ids[rank]` of `cluster`)
    of every host whose ranks share its cores (`Cluster.shared_devices`), or {} if none do."""
    if cluster is None:
        return {}
    hosts: dict[int, list[int]] = {}
    for rank, d in enumerate(device_ids):
        if cluster.shared_devices(int(d)):
            hosts.setdefault(cluster.node_of(int(d)), []).append(rank)
    return {"hosts": [ranks for _, ranks in sorted(hosts.items())]} if hosts else {}


def output_bytes(model: onnx.ModelProto) -> dict[str, int]:
    """Bytes of each output of a module (its declared shape and type)."""
    return {vi.name: onnx_nbytes([d.dim_value for d in vi.type.tensor_type.shape.dim], vi.type.tensor_type.elem_type)
            for vi in model.graph.output}


def collective_seconds(step: Mapping, link: LinkSpec) -> float:
    """One collective task's seconds: its ring time (local steps are ONNX nodes, not tasks)."""
    c = Collective.from_json(dict(step))
    return ring_time(c.kind, link, c.n, c.bytes_per_device)


def module_times(models: Mapping[str, onnx.ModelProto], device: DeviceSpec,
                 info: Mapping[str, tuple[int, tuple]], masked: Mapping[str, str] | None = None) -> dict[str, dict]:
    """Per module name: its `time_s` on `device` (its nodes and the executor's task overhead) and
    its outputs' bytes (`out_bytes`, by name); `masked` as `module_seconds` takes it."""
    return {name: {"time_s": module_seconds(model, device, info, masked) + device.task_overhead,
                   "out_bytes": output_bytes(model)}
            for name, model in models.items()}


def annotate(doc: dict, axis_link: Callable[[dict], LinkSpec], p2p_link: Callable[[int, int], LinkSpec]) -> dict:
    """Write `time_s` on every communication, source and sink task of task graph `doc` (compute
    tasks have theirs from `module_times`).

    `axis_link(collective task)`: the link of its mesh axis;
    `p2p_link(src, dst)`: the link a message from rank src to rank dst takes."""
    recv_bytes: dict[tuple[int, int, str, object], int] = {}
    for t in doc["tasks"]:
        if t["kind"] == "recv":
            recv_bytes[t["peer"], t["rank"], t["tensor"], t.get("micro_batch")] = onnx_nbytes(t["shape"], t["dtype"])
    for t in doc["tasks"]:
        kind = t["kind"]
        if kind == "compute":
            assert "time_s" in t, t["id"]
        elif kind == "collective":
            link = axis_link(t)
            t["time_s"] = collective_seconds(t["step"], link)
            if link.handoff and len(t["group"]) > 1:
                t["handoff_s"] = link.handoff
        elif kind in ("send", "recv"):
            src, dst = (t["rank"], t["peer"]) if kind == "send" else (t["peer"], t["rank"])
            nbytes = recv_bytes.get((src, dst, t["tensor"], t.get("micro_batch")), 0)
            link = p2p_link(src, dst)
            t["bytes"] = nbytes
            t["time_s"] = send_recv_time(link, 2, nbytes)
        else:
            t["time_s"] = 0.0
    return doc
