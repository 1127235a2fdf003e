"""Lowering: a plan's per-rank local programs (DESIGN: --lower-->, --schedule-->).

Every rank runs the same SPMD program on its own shards. `lower_rank` walks the graph in order
and, for the rank at mesh coordinates `coords`, emits each node on local shapes:

- an input whose layout differs from what the node's strategy wants is resharded first, with
  the steps `parc.sharding.reshard` plans (the same steps the cost model priced). Local steps
  become ONNX nodes: `local_slice` a Slice (contiguous) or Gather (strided, uneven);
  `local_partial` an Identity, zeros (P(sum) on coordinates other than 0) or a fill with the
  reduction's identity around the rank's piece. Collectives become `Comm` records;
- shape-carrying inputs (the op rule's `shape_args` and `size_args`: Reshape's and Expand's
  shape, ConstantOfShape's input, Split's sizes) get the rank's local values;
- an output that is partial along a mesh axis whose label the rule reduces by mean is the local
  mean scaled by the rank's share (planned as P(sum) of pre-scaled shares, `sharding/labels.py`).

Graph outputs end in the layout of the input they feed next step (`parc.state` bindings: new
parameters and state keep their shards) or replicated (loss, other outputs).

`emit.build_modules` then cuts the local nodes into ONNX modules at communication: a node's
depth is the number of collectives on its longest path from the sources, and module d holds the
nodes of depth d. The rank runs module 0, the collectives that read depth-0 values, module 1, and so on;
every rank runs its collectives in the same order, so the static schedule cannot deadlock. Work
from sources alone moves to its first reader's module (`sink_source_work`).

Microbatches (`plan.json` micro_batches): the time axis is mesh axis 0 of the cost model. The
forward and backward nodes are lowered at time coordinate 0 (every microbatch has the same
shapes) and run once per microbatch; values they hand to the optimizer that are P(sum) along
time are accumulated; the optimizer nodes run once.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from parc.cluster.cost import GRAD_BUCKET_BYTES, bucket_member
from parc.errors import ParcError
from parc.ir.graph import Graph, Node, Value
from parc.ir.state import bindings as state_bindings
from parc.ir.state import is_gradient_sync, phase, step_state
from parc.ops import sharding_rule
from parc.plandir.taskgraph import MB_END, MB_FIRST, MB_START, WHOLE
from parc.sharding import ShardSpec
from parc.sharding.layout import local_shape, positions, shard_index, split
from parc.sharding.reshard import Collective, reshard
from parc.sharding.simulator import identity
from parc.sharding.spec import Partial, Replicated, Split

EMBED_MAX_BYTES = 4096  # constants up to this size are embedded in the modules that read them
MICRO, APPLY, SOURCE = "micro", "apply", "source"


class LoweringError(ParcError):
    """A plan cannot be lowered to local programs (names the node or value)."""


@dataclass
class Comm:
    """One collective of a rank's program: `src` (local name) resharded by `step` into `dst`."""

    step: Collective
    value: str  # the global value
    shape: tuple[int, ...]  # its global shape
    dtype: int  # ONNX element type
    src: str
    dst: str
    depth: int
    part: str = MICRO
    phase: str = ""  # pipelined programs: F, B or A (the pass the collective belongs to)
    gradient: bool = False  # a gradient handed to the optimizer (`fuse_gradients` may bucket it)


@dataclass
class Resident:
    """A source tensor the executor holds and feeds to modules: data, parameter, state, weight."""

    name: str  # local name (= the global name)
    kind: str  # "data" (graph input), "state" (initializer fed each step), "weight" (constant),
    # "recv" (a value another pipeline stage computes, received each microbatch)
    spec: ShardSpec
    shape: tuple[int, ...]  # global
    local: tuple[int, ...]
    dtype: int
    high: int | None = None  # integer data: the smallest table it indexes (synthetic data stays below)


@dataclass
class RankProgram:
    """A rank's local program, before it is cut into modules."""

    rank: int
    coords: tuple[int, ...]
    mesh: tuple[int, ...]  # the model's mesh (time axis first when microbatched)
    opset: dict[str, int]
    nodes: list[tuple[int, str, onnx.NodeProto]] = field(default_factory=list)  # (depth, part, node)
    comms: list[Comm] = field(default_factory=list)
    embedded: dict[str, onnx.TensorProto] = field(default_factory=dict)
    residents: dict[str, Resident] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)  # graph output -> local name
    # value of the apply part -> [micro value, "sum" | "last" | "concat", dim]
    accumulate: dict[str, list] = field(default_factory=dict)
    info: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)  # local -> (dtype, shape)
    depth: dict[str, int] = field(default_factory=dict)
    part: dict[str, str] = field(default_factory=dict)  # local name -> part that produced it
    # pipelined programs: the pass of each entry of `nodes` (F forward, B backward, A optimizer;
    # "" otherwise), and the values sent to other stages: name -> (pass, {layout: local name}),
    # layout the device-axes spec it travels in (`WHOLE`: replicated, the whole value)
    phases: list[str] = field(default_factory=list)
    sends: dict[str, tuple[str, dict[str, str]]] = field(default_factory=dict)


def index_limit(v: Value) -> int:
    """The smallest size an integer value indexes: a Gather's table, a loss's classes (2 when
    it indexes nothing: labels of a binary task, masks)."""
    found = _limits(v, frozenset())
    return int(min(found, default=2))


def _limits(v: Value, seen: frozenset) -> list[int]:
    limits: list[int] = []
    for node, i in v.uses:
        if node.op_type == "Gather" and i == 1:
            limits.append(node.inputs[0].shape[node.attr("axis", 0)])
        elif node.op_type in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss") and i == 1:
            limits.append(node.inputs[0].shape[1])
        elif node.op_type == "OneHot" and i == 0 and node.inputs[1] is not None and node.inputs[1].is_const:
            limits.append(int(np.asarray(node.inputs[1].const.numpy()).reshape(-1)[0]))
        elif id(node) not in seen and node.op_type in _INDEX_PRESERVING:
            for out in node.outputs:
                if out.dtype == v.dtype:
                    limits.extend(_limits(out, seen | {id(node)}))
    return limits


# Ops that pass integer values through unchanged (ids and labels keep their meaning).
_INDEX_PRESERVING = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Identity", "Slice",
                     "Gather", "Expand", "Concat", "Split", "Cast", "Tile"}


def bindings(graph: Graph) -> dict[str, str]:
    """Training step output -> the input it feeds next step (empty for other programs)."""
    return state_bindings(graph.metadata)


def loss_name(graph: Graph) -> str | None:
    """A training step's loss output (None for other programs)."""
    state = step_state(graph.metadata)
    return state.loss if state is not None else None


PASSES = {"forward": "F", "backward": "B", "optimizer": "A"}  # a pipeline stage's passes, in run order


class _Lowerer:
    def __init__(self, graph: Graph, mesh: tuple[int, ...], coords: tuple[int, ...], strategies: list,
                 rules: list, source_specs: dict[str, ShardSpec], micro: int, rank: int,
                 received: frozenset[str] = frozenset(), pipelined: bool = False) -> None:
        self.g = graph
        self.rules = rules
        self.fed = {x.name for x in (*graph.inputs, *graph.input_constants)}  # graph inputs, fed each step
        self.mesh = mesh
        self.coords = coords
        self.strategies = strategies
        self.source_specs = source_specs
        self.micro = micro  # microbatch count (1: none); the time axis is mesh axis 0 when > 1
        self.p = RankProgram(rank, coords, mesh, dict(graph.opset))
        self.where: dict[str, list[tuple[ShardSpec, str]]] = {}  # global value -> (spec, local name)
        self.count = 0
        self.aux_count = 0
        self.received = received
        self.pipelined = pipelined
        self.phase = ""  # the pass being lowered (pipelined programs)
        self.reader: Node | None = None  # the node whose inputs are being resharded

    def append(self, depth: int, part: str, proto: onnx.NodeProto) -> None:
        self.p.nodes.append((depth, part, proto))
        self.p.phases.append(self.phase)

    # -- names and bookkeeping ----------------------------------------------------------------
    def fresh(self, base: str) -> str:
        """A new value name; the same sequence on every rank (collectives match by name)."""
        self.count += 1
        return f"{base}~{self.count}"

    def aux(self, base: str) -> str:
        """A new name for a node or constant, which may differ between ranks."""
        self.aux_count += 1
        return f"{base}#{self.aux_count}"

    def local(self, shape: tuple[int, ...], spec: ShardSpec) -> tuple[int, ...]:
        return local_shape(shape, spec, self.mesh, self.coords)

    def define(self, name: str, dtype: int, shape: tuple[int, ...], depth: int, part: str) -> None:
        self.p.info[name] = (dtype, tuple(int(d) for d in shape))
        self.p.depth[name] = depth
        self.p.part[name] = part

    def emit(self, proto: onnx.NodeProto, part: str, at_least: int = 0) -> int:
        """Append a node at the depth of its deepest input (or `at_least`): the same on every rank."""
        depth = max([at_least, *(self.p.depth.get(i, 0) for i in proto.input if i)])
        self.append(depth, part, proto)
        return depth

    def const(self, base: str, array: np.ndarray) -> str:
        name = self.aux(base)
        self.p.embedded[name] = numpy_helper.from_array(np.asarray(array), name)
        self.define(name, self.p.embedded[name].data_type, array.shape, 0, MICRO)
        return name

    # -- sources ---------------------------------------------------------------------------------
    def source(self, v: Value) -> None:
        spec = self.source_specs[v.name]
        shape = tuple(v.shape)
        loc = self.local(shape, spec)
        dtype = v.dtype.onnx_type
        if v.is_const and v.name not in self.fed and v.const.nbytes <= EMBED_MAX_BYTES:
            array = np.asarray(v.const.numpy())[np.ix_(*shard_index(shape, spec, self.mesh, self.coords))] \
                if shape else np.asarray(v.const.numpy())
            self.p.embedded[v.name] = numpy_helper.from_array(np.asarray(array, order="C"), v.name)
        else:
            kind = ("weight" if v.name not in self.fed else "state" if v.is_const else
                    "recv" if v.name in self.received else "data")
            high = index_limit(v) if kind == "data" and not v.dtype.is_float else None
            self.p.residents[v.name] = Resident(v.name, kind, spec, shape, loc, dtype, high)
        self.define(v.name, dtype, loc, 0, SOURCE)
        self.where[v.name] = [(spec, v.name)]

    # -- resharding ------------------------------------------------------------------------------
    def get(self, v: Value, want: ShardSpec, part: str) -> str:
        """The local name of `v` in layout `want`, resharding (and recording how) if needed."""
        held = self.where[v.name]
        for spec, name in held:
            if spec == want:
                return name
        spec, name = held[0]
        shape = tuple(v.shape)
        if v.is_const and v.name in self.p.embedded:
            # A small constant is embedded again in the wanted layout on the device axes. Along
            # the microbatch axis the module serves every microbatch, so the steps there (a
            # per-microbatch slice, the first-microbatch flag) are left to the executor's feeds.
            target = want if self.micro == 1 else want.replace(0, spec[0])
            if target != spec:
                out = self.fresh(v.name)
                piece = split(np.asarray(v.const.numpy()), target, self.mesh)[self.coords]
                self.p.embedded[out] = numpy_helper.from_array(np.asarray(piece, order="C"), out)
                self.define(out, v.dtype.onnx_type, piece.shape, 0, SOURCE)
                held.append((target, out))
                spec, name = target, out
            if spec == want:
                return name
        if self.micro > 1 and part == APPLY and self.p.part.get(name) == MICRO:
            name, spec = self._cross(v, name, spec, want)
        steps = reshard(spec, want, shape, v.dtype.itemsize, self.mesh)
        if name in self.p.embedded and not all(step.is_local for step in steps):
            # a collective reads values that modules compute: an embedded piece is copied out first
            out = self.fresh(v.name)
            self.emit(helper.make_node("Identity", [name], [out], name=self.aux("embedded_out")), part)
            self.define(out, v.dtype.onnx_type, self.p.info[name][1], 0, part)
            name = out
        for step in steps:
            if self.micro > 1 and step.axis == 0 and part == MICRO and step.kind == "local_slice" \
                    and step.dst.is_even:  # type: ignore[union-attr]
                out = self.fresh(v.name)
                self._micro_slice(step, name, out, shape, v.dtype.onnx_type)
                name, spec = out, step.after
                continue
            if self.micro > 1 and step.axis == 0 and part == MICRO and step.kind == "local_partial" \
                    and isinstance(step.src, Replicated) and step.dst.op == "sum":
                out = self.fresh(v.name)
                self._micro_first(name, out, shape, v.dtype.onnx_type)
                name, spec = out, step.after
                continue
            if self.micro > 1 and step.axis == 0:
                raise LoweringError(f"value '{v.name}': {step.kind} across microbatches "
                                    f"({step.before} -> {step.after}) has no sequential schedule")
            out = self.fresh(v.name)
            dtype = v.dtype.onnx_type
            if step.is_local:
                self._local_step(step, name, out, shape, dtype, part)
            else:
                depth = self.p.depth[name]
                gradient = self.reader is not None and is_gradient_sync(v, self.reader)
                self.p.comms.append(Comm(step, v.name, shape, dtype, name, out, depth, part, self.phase, gradient))
                self.define(out, dtype, self.local(shape, step.after), depth + 1, part)
            name, spec = out, step.after
        held.append((want, name))
        return name

    def _cross(self, v: Value, name: str, spec: ShardSpec, want: ShardSpec) -> tuple[str, ShardSpec]:
        """A value of the microbatch part read once after the last microbatch: partial sums
        accumulate, replicated values are the same in every microbatch, splits (outputs such as
        logits) are concatenated."""
        t = spec[0]
        if not isinstance(want[0], Replicated):
            raise LoweringError(f"value '{v.name}': read after the microbatches as {want[0]} along "
                                f"the microbatch axis; only whole values are")
        if isinstance(t, Partial):
            if t.op != "sum":
                raise LoweringError(f"value '{v.name}': P({t.op}) across microbatches is not accumulated")
            how = ["sum"]
        elif isinstance(t, Split):
            how = ["concat", t.dim]
        else:
            how = ["last"]
        acc = self.fresh(f"{v.name}.acc")
        spec = spec.replace(0, Replicated())
        dtype = v.dtype.onnx_type
        self.p.accumulate[acc] = [name, *how]
        self.define(acc, dtype, self.local(tuple(v.shape), spec), 0, APPLY)
        return acc, spec

    def _micro_slice(self, step: Collective, src: str, out: str, shape: tuple[int, ...], dtype: int) -> None:
        """Microbatch t's piece of a value whole along time: a Slice whose bounds the executor
        feeds per microbatch (`MB_START`/`MB_END` inputs of the piece's size)."""
        before = self.p.info[src][1]
        ax: Split = step.dst  # type: ignore[assignment]
        size = before[ax.dim] // step.n
        bounds = []
        for key in (MB_START, MB_END):
            name = f"{key}.{size}"
            self.define(name, onnx.TensorProto.INT64, (1,), 0, SOURCE)
            bounds.append(name)
        node = helper.make_node("Slice", [src, *bounds, self.const("axes", np.array([ax.dim], np.int64))], [out],
                                name=self.aux("microbatch_slice"))
        depth = self.emit(node, MICRO, self.p.depth[src])
        self.define(out, dtype, self.local(shape, step.after), depth, MICRO)

    def _micro_first(self, src: str, out: str, shape: tuple[int, ...], dtype: int) -> None:
        """A value whole along time made P(sum) over microbatches: kept by microbatch 0, zero in
        the others (times a flag the executor feeds: 1 for microbatch 0, else 0)."""
        flag = f"{MB_FIRST}.{dtype}"
        self.define(flag, dtype, (), 0, SOURCE)
        node = helper.make_node("Mul", [src, flag], [out], name=self.aux("microbatch_first"))
        depth = self.emit(node, MICRO, self.p.depth[src])
        self.define(out, dtype, self.p.info[src][1], depth, MICRO)

    def _local_step(self, step: Collective, src: str, out: str, shape: tuple[int, ...], dtype: int,
                    part: str) -> None:
        before = self.p.info[src][1]
        after = self.local(shape, step.after)
        c = self.coords[step.axis]
        if step.kind == "local_slice":
            ax: Split = step.dst  # type: ignore[assignment]
            pos = positions(before[ax.dim], ax, step.n, c)
            if np.array_equal(pos, np.arange(pos[0], pos[0] + len(pos))):
                ins = [src, self.const("starts", np.array([pos[0]], np.int64)),
                       self.const("ends", np.array([pos[0] + len(pos)], np.int64)),
                       self.const("axes", np.array([ax.dim], np.int64))]
                node = helper.make_node("Slice", ins, [out], name=self.aux("reshard_slice"))
            else:
                node = helper.make_node("Gather", [src, self.const("index", pos.astype(np.int64))], [out],
                                        axis=ax.dim, name=self.aux("reshard_gather"))
        else:  # local_partial
            op = step.dst.op  # type: ignore[union-attr]
            np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
            if isinstance(step.src, Replicated):
                if op == "sum" and c != 0:
                    value = numpy_helper.from_array(np.zeros(1, np_dtype), "value")
                    node = helper.make_node("ConstantOfShape", [self.const("shape", np.array(after, np.int64))],
                                            [out], value=value, name=self.aux("reshard_zeros"))
                else:
                    node = helper.make_node("Identity", [src], [out], name=self.aux("reshard_keep"))
            else:  # own piece at its positions, the op's identity elsewhere
                ax = step.src  # type: ignore[assignment]
                extent = after[ax.dim]
                pos = positions(extent, ax, step.n, c)
                fill_shape = list(before)
                fill_shape[ax.dim] = 1
                value = numpy_helper.from_array(np.array([identity(op, np_dtype)], np_dtype), "value")
                fill = self.aux("fill")
                self.append(self.p.depth[src], part, helper.make_node(
                    "ConstantOfShape", [self.const("shape", np.array(fill_shape, np.int64))], [fill],
                    value=value, name=self.aux("reshard_fill")))
                self.define(fill, dtype, tuple(fill_shape), self.p.depth[src], part)
                cat = self.aux("cat")
                self.append(self.p.depth[src], part, helper.make_node(
                    "Concat", [src, fill], [cat], axis=ax.dim, name=self.aux("reshard_cat")))
                self.define(cat, dtype, tuple(before[:ax.dim]) + (before[ax.dim] + 1,) + tuple(before[ax.dim + 1:]),
                            self.p.depth[src], part)
                index = np.full(extent, len(pos), np.int64)
                index[pos] = np.arange(len(pos))
                node = helper.make_node("Gather", [cat, self.const("index", index)], [out], axis=ax.dim,
                                        name=self.aux("reshard_place"))
        depth = self.emit(node, part, self.p.depth[src])
        self.define(out, dtype, after, depth, part)

    # -- nodes -----------------------------------------------------------------------------------
    def node(self, pos: int, n: Node) -> None:
        s = self.strategies[pos]
        part = APPLY if self.micro > 1 and phase(n) == "optimizer" else MICRO
        if self.pipelined:
            self.phase = PASSES[phase(n)]
        rule = self.rules[pos]
        shape_args = dict(rule.shape_args) if rule is not None else {}
        size_args = dict(rule.size_args) if rule is not None else {}
        self.reader = n
        ins: list[str] = []
        for i, v in enumerate(n.inputs):
            if v is None:
                ins.append("")
            elif i in shape_args:
                j = shape_args[i]
                ins.append(self._shape_input(n, v, i, self.local(tuple(n.outputs[j].shape), s.outputs[j])))
            elif i in size_args:
                axis = size_args[i]
                sizes = [self.local(tuple(o.shape), so)[axis] for o, so in zip(n.outputs, s.outputs)]
                ins.append(self._shape_input(n, v, i, tuple(sizes)))
            else:
                ins.append(self.get(v, s.inputs[i], part))
        self.reader = None
        scales = self._mean_scales(n, s, rule)
        outs = []
        for j, v in enumerate(n.outputs):
            if not v.name:
                outs.append("")
                continue
            outs.append(self.fresh(v.name) if scales[j] != 1.0 else v.name)
        proto = helper.make_node(n.op_type, ins, outs, name=n.name, domain=n.domain or None)
        proto.attribute.extend(n.attrs[k] for k in sorted(n.attrs))
        depth = self.emit(proto, part)
        for j, v in enumerate(n.outputs):
            if not v.name:
                continue
            dtype = v.dtype.onnx_type
            loc = self.local(tuple(v.shape), s.outputs[j])
            self.define(outs[j], dtype, loc, depth, part)
            if scales[j] != 1.0:
                np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
                k = self.const("share", np.array(scales[j], np_dtype))
                self.append(depth, part, helper.make_node("Mul", [outs[j], k], [v.name],
                                                          name=self.aux(f"{n.name}_share")))
                self.define(v.name, dtype, loc, depth, part)
            self.where[v.name] = [(s.outputs[j], v.name)]

    def _shape_input(self, n: Node, v: Value, i: int, local: tuple[int, ...]) -> str:
        if v.is_const:
            return self.const(f"{n.name}_shape", np.array(local, np.int64))
        raise LoweringError(f"node '{n.label}': input {i} ('{v.name}') carries a shape but is computed "
                            f"at run time; parc needs it constant to give each rank its local shape")

    def _mean_scales(self, n: Node, s, rule) -> list[float]:
        """Per output, the factor that turns a rank's local mean into its share of the mean: 1/n
        of an even split, its piece over the whole of an uneven one."""
        scales = [1.0] * len(n.outputs)
        if rule is None:
            return scales
        reduce = dict(rule.reduce)
        for k, label in enumerate(s.labels):
            if label is None or reduce.get(label) != "mean":
                continue  # outputs that keep the label (SoftmaxCrossEntropyLoss's log_prob) are split, not partial
            share = 1.0 / self.mesh[k]
            for spec in s.inputs:  # an uneven split of the label: this rank's piece of the mean
                ax = spec[k] if spec is not None else None
                if isinstance(ax, Split) and ax.sizes is not None:
                    share = ax.sizes[self.coords[k]] / sum(ax.sizes)
                    break
            for j in range(len(n.outputs)):
                if isinstance(s.outputs[j][k], Partial):
                    scales[j] *= share
        return scales


def layout_key(layout: ShardSpec | None) -> str:
    """The name of a send layout (RankProgram.sends, the task graph's send/recv tasks)."""
    return WHOLE if layout is None else str(layout)


def rules_of(graph: Graph) -> list:
    """Each node's sharding rule (the same for every rank: compute once, pass to lower_rank)."""
    return [sharding_rule(n, graph.opset.get("", None)) for n in graph.nodes]


def lower_rank(graph: Graph, mesh: tuple[int, ...], rank: int, strategies: list,
               source_specs: dict[str, ShardSpec], micro: int = 1, rules: list | None = None,
               sends: dict[str, tuple[str, list[ShardSpec | None]]] | None = None,
               received: frozenset[str] = frozenset(),
               not_outputs: frozenset[str] = frozenset(), buckets: tuple[bool, ...] = ()) -> RankProgram:
    """Rank `rank`'s local program. `mesh` is the model's mesh (time axis first when `micro` > 1,
    where the rank's coordinates are taken at time 0); `strategies[pos]` is node pos's chosen
    Strategy and `source_specs` each source's layout.

    A pipeline stage's program (`sends` given: value -> (its producer's phase, the device-axes
    layouts it is sent in, None for whole)) tags every node and collective with its pass (F, B,
    A) and ends each sent value in each of those layouts on the stage's devices (split along
    time as computed: one microbatch's piece); `received` graph inputs come from other stages;
    `not_outputs` are graph outputs that only exist to be sent. `buckets`: per axis of `mesh`,
    whether gradient all-reduces along it run in buckets (`fuse_gradients`)."""
    device_mesh = mesh[1:] if micro > 1 else mesh
    coords = tuple(int(c) for c in np.unravel_index(rank, device_mesh))
    if micro > 1:
        coords = (0,) + coords
    low = _Lowerer(graph, mesh, coords, strategies, rules if rules is not None else rules_of(graph),
                   source_specs, micro, rank, received, sends is not None)
    for v in (*graph.inputs, *graph.input_constants, *graph.constants.values()):
        if v.name in source_specs and v.name not in low.where:
            low.source(v)
    for pos, n in enumerate(graph.nodes):
        low.node(pos, n)
    binds = bindings(graph)
    rep = ShardSpec((Replicated(),) * len(mesh))
    for o in graph.outputs:
        if o.name not in low.where:
            raise LoweringError(f"graph output '{o.name}' is not computed by any node")
        if sends and o.name in sends:
            sent_phase, layouts = sends[o.name]
            low.phase = PASSES[sent_phase]
            part = APPLY if micro > 1 and sent_phase == "optimizer" else MICRO
            spec = low.where[o.name][0][0]
            time = (spec[0],) if micro > 1 and part == MICRO else (Replicated(),) if micro > 1 else ()
            locals_ = {}
            for layout in layouts:
                axes = tuple(layout) if layout is not None else (Replicated(),) * (len(mesh) - len(time))
                locals_[layout_key(layout)] = low.get(o, ShardSpec(time + axes), part)
            low.p.sends[o.name] = (low.phase, locals_)
        if o.name in not_outputs:
            continue
        if sends is not None:
            low.phase = "A" if binds.get(o.name) is not None else PASSES.get(
                phase(o.producer) if o.producer is not None else "forward", "F")
        target = binds.get(o.name)
        want = source_specs.get(target, rep) if target is not None else rep
        low.p.outputs[o.name] = low.get(o, want, APPLY if micro > 1 else MICRO)
    fuse_gradients(low, buckets)
    sink_source_work(low.p)
    return low.p


def sink_source_work(p: RankProgram) -> None:
    """Move each node computed from sources alone (residents, embedded constants, and what such
    nodes make) to the module of its first reader, when its readers are nodes of later modules
    of its part and pass. A node's depth is the deepest of its inputs' (as soon as it can run),
    which puts such work in module 0: an optimizer's `beta1 * exp_avg` would be written out
    there, held through the forward and backward and read back by the update, where the search
    priced it inside the update's fused kernel; a weight's transpose would be held from the
    first module on. What such a node reads is held all step anyway, so moving it frees memory
    and no collective waits on it (values read by collectives, sent, accumulated or returned
    stay where they are)."""
    derived = set(p.residents) | set(p.embedded)
    readers: dict[str, list[int]] = defaultdict(list)
    for k, (_, _, node) in enumerate(p.nodes):
        if all(not i or i in derived for i in node.input):
            derived.update(o for o in node.output if o)
        for i in node.input:
            if i:
                readers[i].append(k)
    held = {c.src for c in p.comms} | set(p.outputs.values()) | {a[0] for a in p.accumulate.values()}
    held |= {local for _, layouts in p.sends.values() for local in layouts.values()}
    depth = [d for d, _, _ in p.nodes]
    phases = p.phases or [""] * len(p.nodes)
    for k in reversed(range(len(p.nodes))):
        _, part, node = p.nodes[k]
        outs = [o for o in node.output if o]
        if not outs or any(o not in derived or o in held or not readers[o] for o in outs):
            continue
        reading = [j for o in outs for j in readers[o]]
        if any(p.nodes[j][1] != part or phases[j] != phases[k] for j in reading):
            continue
        depth[k] = max(depth[k], min(depth[j] for j in reading))
        for o in outs:
            p.depth[o] = depth[k]
    p.nodes = [(depth[k], part, node) for k, (_, part, node) in enumerate(p.nodes)]


def fuse_gradients(low: _Lowerer, buckets: tuple[bool, ...]) -> None:
    """Gradient buckets: along the mesh axes where `buckets` says they pay
    (`parc.cluster.cost.bucket_axes`), the all-reduces of gradients that run at the same place
    (part, pass, depth), along the same axis, in the same type and reduction, and send at most
    BUCKET_MEMBER_BYTES per device each, are run as one collective per bucket of up to
    GRAD_BUCKET_BYTES, in program order (PyTorch DDP's buckets; the cost model charges each
    member its share of the bucket's latency, `parc.cluster.cost.bucket_share`).

    A bucket's members are flattened and concatenated (`Reshape`, `Concat`; a member already
    1-D, as biases and norm scales are, goes in as it is) in the module of the place they are
    synchronised at (the backward's, or the optimizer part's in microbatched and pipelined
    programs); the bucket is all-reduced once; the module after it splits it into the members
    under their own names (`Split`, and a `Reshape` for those not 1-D), so their readers are
    unchanged.
    Which collectives join depends only on the program's order and the global shapes, never on
    a rank's local ones (an uneven layout may leave a rank an empty piece), so every rank makes
    the same buckets and names, and the collectives still match by name. Within the group of an
    axis every member has the same local shape on every rank (a P(sum) value is not split along
    the axis it is reduced over), so the pieces line up."""
    p = low.p
    if not any(buckets):
        return
    open_: dict[tuple, list[int]] = {}
    filled: dict[tuple, float] = {}
    runs: list[list[int]] = []  # the buckets, as indexes into p.comms
    for j, c in enumerate(p.comms):
        step = c.step
        if not (c.gradient and buckets[step.axis] and bucket_member(step.kind, step.bytes_per_device)) \
                or step.n < 2 or not math.prod(c.shape):
            continue
        key = (c.part, c.phase, c.depth, step.axis, c.dtype, step.op)
        if key not in open_ or filled[key] + step.bytes_per_device > GRAD_BUCKET_BYTES:
            open_[key] = []
            filled[key] = 0.0
            runs.append(open_[key])
        open_[key].append(j)
        filled[key] += step.bytes_per_device
    runs = [b for b in runs if len(b) > 1]
    if not runs:
        return
    added: list[tuple] = []  # (depth, part, pass, node), placed by `_topological`
    fused: dict[int, Comm | None] = {}
    flat_shape = low.const("bucket_flat", np.array([-1], np.int64))  # every member's Reshape reads it
    for b in runs:
        members = [p.comms[j] for j in b]
        head = members[0]
        here, there = (head.depth, head.part, head.phase), (head.depth + 1, head.part, head.phase)
        flats, sizes = [], []
        for c in members:
            size = math.prod(p.info[c.src][1])
            sizes.append(size)
            if len(p.info[c.src][1]) == 1:  # already flat (a bias, a norm's scale): no view to make
                flats.append(c.src)
                continue
            flat = low.fresh(f"{c.value}.flat")
            added.append((*here, helper.make_node("Reshape", [c.src, flat_shape], [flat], name=low.aux("bucket_flat"))))
            low.define(flat, c.dtype, (size,), head.depth, head.part)
            flats.append(flat)
        total = int(sum(sizes))
        src, dst = low.fresh("grad_bucket"), low.fresh("grad_bucket.reduced")
        added.append((*here, helper.make_node("Concat", flats, [src], axis=0, name=low.aux("bucket_concat"))))
        low.define(src, head.dtype, (total,), head.depth, head.part)
        low.define(dst, head.dtype, (total,), head.depth + 1, head.part)
        axis = head.step.axis
        reduced = ShardSpec(tuple(head.step.src if k == axis else Replicated() for k in range(len(p.mesh))))
        whole = ShardSpec(tuple(Replicated() for _ in p.mesh))
        volume = float(sum(c.step.bytes_per_device for c in members))
        tensor = "grad bucket: " + ", ".join(c.value for c in members)
        fused[b[0]] = Comm(Collective("all_reduce", axis, volume, head.step.n, reduced, whole), tensor, (total,),
                           head.dtype, src, dst, head.depth, head.part, head.phase, True)
        fused.update((j, None) for j in b[1:])
        pieces = [c.dst if len(p.info[c.dst][1]) == 1 else low.fresh(f"{c.value}.piece") for c in members]
        if p.opset.get("", 13) >= 13:
            split = helper.make_node("Split", [dst, low.const("bucket_sizes", np.array(sizes, np.int64))], pieces,
                                     axis=0, name=low.aux("bucket_split"))
        else:
            split = helper.make_node("Split", [dst], pieces, axis=0, split=sizes, name=low.aux("bucket_split"))
        added.append((*there, split))
        for c, piece, size in zip(members, pieces, sizes):
            if piece == c.dst:
                continue
            shape = low.const("bucket_shape", np.array(p.info[c.dst][1], np.int64))
            added.append((*there, helper.make_node("Reshape", [piece, shape], [c.dst], name=low.aux("bucket_unflat"))))
            low.define(piece, c.dtype, (size,), head.depth + 1, head.part)
    p.comms = [fused.get(j, c) for j, c in enumerate(p.comms) if fused.get(j, c) is not None]
    merged = _topological([(depth, part, ph, node) for (depth, part, node), ph in zip(p.nodes, p.phases, strict=True)]
                          + added)
    p.nodes = [(depth, part, node) for depth, part, _, node in merged]
    p.phases = [ph for _, _, ph, _ in merged]


def _topological(entries: list[tuple]) -> list[tuple]:
    """entries (..., node) in an order where every node comes after the nodes making its inputs,
    keeping the given order wherever it already is one: nodes appended at the end move to just
    before their first reader (a bucket's pieces before the optimizer reads them, or before the
    next bucket of the same gradients along another mesh axis) and the rest stay at the end
    (modules are cut by depth, so only the order inside a module matters)."""
    maker = {o: k for k, e in enumerate(entries) for o in e[-1].output if o}
    done: set[int] = set()
    out: list[tuple] = []

    def visit(k: int) -> None:
        stack = [(k, False)]
        while stack:
            j, expanded = stack.pop()
            if j in done:
                continue
            if expanded:
                done.add(j)
                out.append(entries[j])
                continue
            stack.append((j, True))
            stack.extend((maker[i], False) for i in reversed(entries[j][-1].input) if i in maker and maker[i] not in done)

    for k in range(len(entries)):
        visit(k)
    return out
