"""Task times: what each task of a task graph costs, from the cost model (DESIGN: task times).

`parc plan` writes `time_s` on every compute, collective, send and recv task of taskgraph.json,
so that the step simulator (`parc.exec.stepsim`) needs nothing but the plan directory:

- a compute task: the roofline (`parc.cluster.cost.compute_time`) of every node of its ONNX
  module on its local shapes, on its rank's device, each node as it runs among the module's
  others (`parc.cluster.work.graph_work`, the pricer the search calls too: fused kernels, views,
  what onnxruntime folds into a product and, where the device has a `cold_bandwidth`, the reads
  and writes the caches do not hold), plus the device's `task_overhead` (what the executor
  spends per task: calibrated by `parc profile`). Modules of the same content (the ranks of an
  even mesh) are priced once.
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
from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from parc.cluster.cost import compute_time, ring_time, send_recv_time
from parc.cluster.devices import DeviceSpec
from parc.cluster.links import LinkSpec
from parc.cluster.work import graph_work
from parc.ir.dtypes import DType, onnx_nbytes
from parc.ir.graph import Node, Value
from parc.ir.tensor import TensorData
from parc.sharding.reshard import Collective

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
    """Roofline seconds of every node of an ONNX module on `device`, each as it costs among the
    module's others (`parc.cluster.work.graph_work`: views, what onnxruntime folds into a
    product, the array engine's fused kernels, cold reads); `info`: each value's (ONNX type,
    local shape), as the lowering knows them (a module's slices of microbatches have shapes that
    depend on data, which shape inference cannot see); `masked`: the class of each of the
    graph's Softmax nodes over masked scores, by name (`parc.ops.base.masked_classes`: telling
    needs the graph's constants and data inputs, which a module may not hold)."""
    names = {n.name for n in model.graph.node}
    mine = {k: v for k, v in (masked or {}).items() if k in names}
    key = (_digest(model), repr(device), tuple(sorted(mine.items())))
    if len(_MODULE_SECONDS) > _MODULE_SECONDS_MAX:
        _MODULE_SECONDS.clear()
    if key not in _MODULE_SECONDS:
        nodes, consts = module_nodes(model, info)
        work = graph_work(nodes, device, {v.name for v in model.graph.output}, consts,
                          {t.name for t in model.graph.initializer}, _opset(model), mine)
        _MODULE_SECONDS[key] = sum(w.seconds(device, queued=True) for w in work if w is not None)
    return _MODULE_SECONDS[key]


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def module_nodes(model: onnx.ModelProto, info: Mapping[str, tuple[int, tuple]] | None = None
                 ) -> tuple[list[Node], dict[str, np.ndarray]]:
    """An ONNX module's nodes as IR nodes on the values' (ONNX type, shape) of `info` (else of
    the module's declared types), boolean initializers (a Where's mask: its runs are the node's
    pieces, `node_pieces`) holding their data; and its small initializers (up to one element,
    or a 1-D integer list) as arrays, by name."""
    shapes = dict(info) if info is not None else {
        vi.name: (vi.type.tensor_type.elem_type, tuple(d.dim_value for d in vi.type.tensor_type.shape.dim))
        for vi in (*model.graph.input, *model.graph.output, *model.graph.value_info)}
    for init in model.graph.initializer:
        shapes[init.name] = (init.data_type, tuple(init.dims))
    values: dict[str, Value] = {}
    consts: dict[str, np.ndarray] = {}
    for init in model.graph.initializer:
        small = int(np.prod(init.dims)) <= 1 or (len(init.dims) == 1 and init.data_type == onnx.TensorProto.INT64)
        if init.data_type == onnx.TensorProto.BOOL or small:
            array = numpy_helper.to_array(init)
            if small:
                consts[init.name] = array
            if init.data_type == onnx.TensorProto.BOOL:
                values[init.name] = Value(init.name, const=TensorData.from_array(array))

    def value(name: str) -> Value | None:
        if not name:
            return None
        if name not in values:
            dtype, shape = shapes.get(name, (None, None))
            values[name] = Value(name, DType.from_numpy(helper.tensor_dtype_to_np_dtype(dtype))
                                 if dtype else None, tuple(shape) if shape is not None else None)
        return values[name]

    nodes = [Node(p.op_type, [value(i) for i in p.input], [value(o) for o in p.output],
                  {a.name: a for a in p.attribute}, p.name, p.domain) for p in model.graph.node]
    return nodes, consts


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
