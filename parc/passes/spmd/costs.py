"""The cost model of one mesh as a solver Problem (Rhino 4.2): nodes, strategies, edge costs.

Problem nodes are the graph's sources (data inputs, parameters, optimizer state, other
constants a strategy may want split) followed by its op nodes. Compute cost is the roofline
time of a node's share of the work on the slowest device; an edge's cost is the time of the
collectives (`parc.sharding.reshard`) that turn the producer's output layout into the layout the
consumer's strategy needs, priced alpha-beta on the mesh axes' links. Memory per device is a
source's share of its bytes (parameters and optimizer state) plus the share of each value live
at the graph's peak (`peak_live`: saved activations and gradients in a training step).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import lru_cache
from typing import Any

import numpy as np

from parc.cluster import Cluster, Mesh
from parc.cluster.cost import NodeWork, bucket_axes, bucket_share, ring_time
from parc.cluster.links import LinkSpec
from parc.cluster.work import of_graph
from parc.errors import UsageError
from parc.ir.graph import Graph, Node, Value, const_key, node_signature
from parc.ir.liveness import graph_peak
from parc.ir.state import FORWARD, OPTIMIZER, bindings, is_gradient_sync, phase
from parc.passes.spmd.hetero import Balance, device_times, mesh_balance
from parc.passes.spmd.strategies import (
    MAX_STRATEGIES,
    PARTIAL,
    Strategy,
    node_strategies,
    replicated,
    tensor_specs,
    uneven_strategies,
)
from parc.sharding import R, S, ShardSpec, ShardSpecError, local_shape, reshard
from parc.sharding.spec import Partial, Replicated, Split
from parc.solver import Problem

# a layout change no sequential microbatch schedule can run costs FORBIDDEN_SCALE times the
# most any plan without one can cost (`_forbid`: a GPT-175B-like step priced on one device has
# single matmuls of 3,800 s, so no fixed price works); models without a time axis forbid
# nothing and keep FORBIDDEN as their (unused) price
FORBIDDEN = 1e3
FORBIDDEN_SCALE = 10.0


class Lazy(Enum):
    """A field found on first use (it pickles as itself, unlike a bare `object()`)."""

    NOT_FOUND = 0


NOT_FOUND = Lazy.NOT_FOUND


@dataclass
class CostModel:
    """A graph's strategies and costs on one mesh, and the Problem built from them."""

    graph: Graph
    mesh: Mesh
    sources: list[Value]
    source_specs: list[list[ShardSpec]]
    strategies: list[list[Strategy]]  # per op node, in graph order
    problem: Problem
    micro: Micro | None = None  # microbatching: mesh axis 0 is then the microbatch (time) axis
    balance: Balance | None = None  # mixed devices on this mesh: the axes' shares (hetero.py)
    forbidden: float = FORBIDDEN  # what a forbidden time-axis move costs in this model (_Pricer)
    buckets: tuple[bool, ...] = ()  # per mesh axis, whether gradient buckets pay (the lowering's too)
    # which nodes follow which (`follow.model_grouping`, found once and pickled with the model to the
    # search's jobs); not an init field, so `replace` (another graph) starts without it
    grouping: Any = field(default=NOT_FOUND, init=False, repr=False, compare=False)

    pool_blob = True  # sent to several jobs: pickled once (parc/passes/spmd/pool.py)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_pool_blob"}

    def node_index(self, node_position: int) -> int:
        return len(self.sources) + node_position


@dataclass(frozen=True)
class Micro:
    """Gradient accumulation over `count` microbatches, planned as a leading mesh axis of time.

    A training step run as M microbatches is the step sharded M ways along a virtual axis 0
    whose "devices" run one after another on the same hardware: data inputs split on their
    batch dim, parameters and optimizer state replicated, gradients P(sum) over it (their
    all-reduce along it is the accumulation, priced at memory bandwidth), optimizer nodes
    replicated (they run once). Forward and backward nodes run M times on 1/M of the batch:
    their compute and their collectives on the device axes are charged M times, their kept
    activations are one microbatch's. Any other collective on the time axis would need the
    values of several microbatches at once and is FORBIDDEN.

    `labels[pos]` fixes node pos's label on the time axis and `sources[k]` source k's layout
    on it (decided once per graph by `micro_layout`); None leaves them to the solver.
    """

    count: int
    labels: tuple[str | None, ...] | None = None
    sources: tuple[ShardSpec, ...] | None = None  # one-axis specs (the time axis)
    # every source's and node output's time-axis layout by name, as micro_layout decided them
    # (a pipeline stage plans its part of the graph with these: `Micro.restricted`)
    values: tuple[tuple[str, ShardSpec], ...] = ()

    def restricted(self, graph: Graph, positions: list[int]) -> Micro:
        """This layout for the subgraph `graph` made of the nodes at `positions` of the graph it
        was decided on: their labels, and each of its sources' layout (by name)."""
        assert self.labels is not None
        by_name = dict(self.values)
        labels = tuple(self.labels[pos] for pos in positions)
        seen: set[int] = set()
        sources = []
        for n in graph.nodes:
            for v in n.inputs:
                if v is not None and v.producer is None and id(v) not in seen:
                    seen.add(id(v))
                    sources.append(by_name[v.name])
        return Micro(self.count, labels, tuple(sources), self.values)


def time_axis(mesh: Mesh | None, count: int, device) -> Mesh:
    """`mesh` with the microbatch axis in front: `count` steps over one device's memory."""
    traffic = 3 * count / (2 * (count - 1))  # M adds of (read, read, write) vs a ring all-reduce's volume
    link = LinkSpec("accumulate", device.memory_bandwidth * device.memory_efficiency / traffic,
                    device.launch_floor)
    inner = mesh.shape if mesh is not None else ()
    devices = tuple(range(count * (mesh.num_devices if mesh is not None else 1)))
    return Mesh((count, *inner), devices, (link, *(mesh.links if mesh is not None else ())),
                (False, *(mesh.spans_nodes if mesh is not None else ())))


def reshard_time(src: ShardSpec, dst: ShardSpec, shape: tuple[int, ...], itemsize: int, mesh: Mesh,
                 buckets: tuple[bool, ...] = ()) -> float:
    """Seconds to turn layout src into dst (alpha-beta per collective on its mesh axis).

    `buckets`: the tensor is a gradient synchronised before the optimizer, and per mesh axis
    whether gradient buckets pay along it (`parc.cluster.cost.bucket_axes`): there a collective
    the lowering fuses into a bucket pays its share of the bucket's latency
    (`parc.cluster.cost.bucket_share`) instead of a whole collective's."""
    return _reshard_time(src, dst, shape, itemsize, mesh, buckets)


@lru_cache(maxsize=1 << 16)
def _reshard_time(src: ShardSpec, dst: ShardSpec, shape: tuple[int, ...], itemsize: int, mesh: Mesh,
                  buckets: tuple[bool, ...] = ()) -> float:
    if src == dst:
        return 0.0
    total = 0.0
    for c in reshard(src, dst, shape, itemsize, mesh.shape):
        if c.is_local:
            continue
        share = bucket_share(c.kind, c.bytes_per_device) if buckets and buckets[c.axis] else 1.0
        total += ring_time(c.kind, mesh.links[c.axis], c.n, c.bytes_per_device, share)
    return total


# Strategy lists by (node signature, time-axis label, mesh shape), kept across builds in this
# process: the stages of a pipeline and the meshes of a search share most signatures (a deep
# model's layers), and a list depends on nothing else (`build` shares them the same way).
_STRATEGIES: dict[tuple, list[Strategy]] = {}
_STRATEGIES_MAX = 200_000


def warm_strategies(graph: Graph, mesh: Mesh, cluster: Cluster, micro: Micro | None = None) -> None:
    """Fill this process's strategy lists and node work for `graph` on `mesh` (as `build` would),
    so that builds in worker processes forked after it find them: a pipeline's stages share most."""
    slowest = min(cluster.devices, key=lambda d: d.peak("float32"))
    if micro is not None:
        mesh = time_axis(mesh, micro.count, slowest)
    _strategies(graph, mesh.shape, micro)
    for d in {d.name: d for d in (slowest, *cluster.devices)}.values():
        of_graph(graph, d)


def _strategies(graph: Graph, shape: tuple[int, ...], micro: Micro | None) -> list[list[Strategy]]:
    """Each node's strategy list; nodes of the same signature share one list (`_STRATEGIES`)."""
    by_signature: dict[tuple, list[Strategy]] = {}
    strategies = []
    if len(_STRATEGIES) > _STRATEGIES_MAX:
        _STRATEGIES.clear()
    for pos, n in enumerate(graph.nodes):
        first = None
        if micro is not None:
            first = ((None,) if phase(n) == OPTIMIZER else
                     (micro.labels[pos],) if micro.labels is not None else None)
        key = (node_signature(n), first)
        if key not in by_signature:
            known = _STRATEGIES.get((key, shape))
            by_signature[key] = known if known is not None else node_strategies(n, shape, first)
            _STRATEGIES[key, shape] = by_signature[key]
            if not by_signature[key]:
                raise UsageError(f"--micro-batches {micro.count}: node '{n.label}' cannot keep its "  # type: ignore[union-attr]
                                 f"microbatch split {first[0]} on this mesh")  # type: ignore[index]
        strategies.append(by_signature[key])
    return strategies


def build(graph: Graph, mesh: Mesh | None, cluster: Cluster, micro: Micro | None = None,
          layouts: dict[str, list[ShardSpec]] | None = None,
          arrivals: Mapping[str, float] | None = None, kept: int = 1, even: bool = False) -> CostModel:
    """Strategies and cost arrays for `graph` on `mesh` (devices of `cluster`).

    With `micro`, the model's mesh is `time_axis(mesh, micro.count)` (mesh None: the time axis
    alone). Repeated structure (a transformer's layers) is priced once: nodes with the same
    signature (op, attributes, input and output shapes, small constant inputs) share one strategy
    list, and edges between shared lists share one cost matrix. `layouts` adds layouts a source
    may take beyond the usual ones (a hint's pin, uneven splits included). `arrivals` prices
    sources another pipeline stage sends: seconds per byte of the shard a device receives (one
    microbatch's piece when split along time, all of it otherwise), in every microbatch (the
    sender sends the layout the receiver holds). `kept`: how many
    microbatches' activations are alive at once (a pipeline stage under 1F1B keeps several), so
    the memory of every node's outputs counts that many times. On a mesh of mixed devices
    (`graph_balance`) splits along an axis of unlike slices are uneven, in proportion to the
    slices' speeds, and every cost is per device; `even=True` keeps them even (the `even-split`
    baseline: the same costs, equal shares)."""
    slowest = min(cluster.devices, key=lambda d: d.peak("float32"))
    if micro is not None:
        mesh = time_axis(mesh, micro.count, slowest)
    assert mesh is not None
    shape = mesh.shape
    strategies = _strategies(graph, shape, micro)
    live = peak_live(graph)
    balance = graph_balance(graph, mesh, cluster, live) if micro is None else None
    if balance is not None and even:
        balance = replace(balance, shares=tuple(tuple([1.0 / n] * n) for n in shape))
    elif balance is not None:
        strategies = _uneven(graph, strategies, shape, balance)

    sources = sources_of(graph)
    wanted: dict[int, list[tuple[int, int]]] = {}  # source -> (id of a consumer's list, input)
    wanted_specs: dict[int, list[ShardSpec]] = {}
    for n, strats in zip(graph.nodes, strategies):
        for i, v in enumerate(n.inputs):
            if v is None or v.producer is not None:
                continue
            if (id(strats), i) not in wanted.setdefault(id(v), []):
                wanted[id(v)].append((id(strats), i))
                wanted_specs.setdefault(id(v), []).extend(s.inputs[i] for s in strats if s.inputs[i] is not None)
    spec_lists: dict[tuple, list[ShardSpec]] = {}
    source_specs = []
    for k, v in enumerate(sources):
        splittable = _splittable_source(v)
        fixed = None if micro is None else _time_spec(v, micro, k)
        extra = tuple(s for s in (layouts or {}).get(v.name, ()) if micro is None and _fits(s, v, shape))
        key = (v.shape, v.dtype, splittable, tuple(wanted.get(id(v), ())), fixed, extra)
        if key not in spec_lists:
            specs = (tensor_specs(v, shape, wanted_specs.get(id(v), [])) if splittable
                     else [replicated(shape)])
            specs = specs + [s for s in extra if s not in specs]
            if fixed is not None:
                specs = list(dict.fromkeys(s for f in fixed
                                           for s in _on_time_axis(v, f, specs, shape, wanted_specs.get(id(v), []))))
            spec_lists[key] = specs
        source_specs.append(spec_lists[key])

    index = {id(v): k for k, v in enumerate(sources)}
    comp: list[np.ndarray] = []
    mem: list[np.ndarray] = []
    for v, specs in zip(sources, source_specs):
        per_byte = (arrivals or {}).get(v.name)
        if per_byte is None:
            comp.append(np.zeros(len(specs)))
        else:
            runs = micro.count if micro is not None else 1  # it arrives in every microbatch
            comp.append(np.array([runs * per_byte * _local_bytes(v, s, shape) for s in specs]))
        if micro is not None and not v.is_const:
            # a data input whole along time is copied in every microbatch, then sliced
            copy = micro.count / (slowest.memory_bandwidth * slowest.memory_efficiency)
            comp[-1] = comp[-1] + np.array([copy * _local_bytes(v, s, shape) if s.axes and isinstance(s[0], Replicated)
                                            else 0.0 for s in specs])
        mem.append(np.array([(_local_bytes(v, s, shape) if balance is None else _device_bytes(v, s, shape, balance))
                             if v.is_const else 0.0 for s in specs]))
    producer: dict[int, tuple[int, int]] = {}  # value id -> (problem node, output index)
    node_costs: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    works = {d.name: of_graph(graph, d) for d in ((slowest,) if balance is None else set(balance.devices))}
    for pos, (n, strats) in enumerate(zip(graph.nodes, strategies)):
        held = tuple(id(v) in live for v in n.outputs)
        runs = micro.count if micro is not None and phase(n) != OPTIMIZER else 1
        work = tuple(w[pos] for w in works.values())
        key = (id(strats), held, runs, work)
        if key not in node_costs:
            c, m = (_node_costs(n, works[slowest.name][pos], strats, held, shape, slowest) if balance is None
                    else _device_costs(n, {d: w[pos] for d, w in works.items()}, strats, held, shape, balance))
            node_costs[key] = (c * runs, m)
        c, m = node_costs[key]
        comp.append(c)
        mem.append(m * kept if kept != 1 else m)
        for k, v in enumerate(n.outputs):
            producer[id(v)] = (len(sources) + pos, k)

    # only a microbatch model forbids anything (_Pricer's rules 1 and 2): priced as inf first,
    # then as FORBIDDEN_SCALE times the most any choice without them can cost (`_forbid`)
    # per axis, whether gradient buckets pay: the lowering reads the same (`CostModel.buckets`).
    # The time axis keeps the share: accumulating microbatches' gradients is priced by its bytes
    # (its all-reduce is no collective, so the lowering has nothing to fuse there)
    buckets = bucket_axes(mesh.shape, mesh.links, slowest)
    if micro is not None:
        buckets = (True, *buckets[1:])
    pricer = _Pricer(mesh, math.inf if micro is not None else FORBIDDEN, buckets)
    pair_cost: dict[tuple[int, int], np.ndarray] = {}
    for pos, (n, strats) in enumerate(zip(graph.nodes, strategies)):
        vi = len(sources) + pos
        for i, v in enumerate(n.inputs):
            if v is None:
                continue
            if id(v) in producer:
                ui, k = producer[id(v)]
                u_list, k_out = strategies[ui - len(sources)], k
            else:
                ui = index[id(v)]
                u_list, k_out = source_specs[ui], None
            rule = 0 if micro is None else 2 if phase(n) == OPTIMIZER else 1
            m = pricer.matrix(u_list, k_out, strats, i, v.shape, v.dtype.itemsize,  # type: ignore[union-attr]
                              rule, is_gradient_sync(v, n))
            if rule == 1:
                m = m * micro.count  # type: ignore[union-attr]
            key = (ui, vi)
            pair_cost[key] = pair_cost[key] + m if key in pair_cost else m
    _tie_state_updates(graph, sources, source_specs, strategies, producer, mesh, pair_cost)
    forbidden = _forbid(comp, pair_cost) if micro is not None else FORBIDDEN

    edges = np.array(sorted(pair_cost), dtype=np.int64).reshape(-1, 2)
    problem = Problem(tuple(comp), edges, tuple(pair_cost[tuple(e)] for e in edges.tolist()),
                      tuple(mem), None, (),
                      tuple([f"source:{v.name}" for v in sources] + [n.name for n in graph.nodes]))
    return CostModel(graph, mesh, sources, source_specs, strategies, problem, micro, balance, forbidden, buckets)


def graph_balance(graph: Graph, mesh: Mesh, cluster: Cluster, live: set[int]) -> Balance | None:
    """The shares of a mesh over mixed devices (None when every device on it is alike). The
    balanced unit is a sample of the batch (the first dim of the first data input; 1,000ths of
    the work without one); a unit's time on a device is the graph's roofline time there over the
    units; Whale's memory model: the parameters and optimizer state whole on every device, the
    activations at the peak in proportion to the load."""
    if len({cluster.devices[r] for r in mesh.devices}) < 2:
        return None
    data = [v for v in sources_of(graph) if not v.is_const and v.shape]
    units = int(data[0].shape[0]) if data and data[0].shape[0] > 1 else 1000
    unit_time = {name: t / units for name, t in device_times(graph, [cluster.devices[r] for r in mesh.devices]).items()}
    activations = sum(float(v.nbytes) for n in graph.nodes for v in n.outputs if id(v) in live and v.shape is not None)
    fixed = sum(float(v.nbytes) for v in sources_of(graph) if v.is_const and v.shape is not None)
    return mesh_balance(mesh, cluster, unit_time, units, activations / units, fixed)


def _uneven(graph: Graph, strategies: list[list[Strategy]], shape: tuple[int, ...],
            balance: Balance) -> list[list[Strategy]]:
    """Each strategy list with its splits along the uneven axes cut by the balance's shares
    (lists shared by nodes of one signature stay shared)."""
    axes = {k for k in range(len(shape)) if balance.uneven(k)}
    done: dict[int, list[Strategy]] = {}
    out = []
    for n, strats in zip(graph.nodes, strategies):
        if id(strats) not in done:
            done[id(strats)] = uneven_strategies(n, strats, shape, balance.shares, axes, balance.cuts)
        out.append(done[id(strats)])
    return out


def _pieces(spec: ShardSpec | None, shape: tuple[int, ...], k: int) -> np.ndarray | None:
    """The fractions of an uneven split on mesh axis k of `spec` (None: not uneven there)."""
    if spec is None:
        return None
    ax = spec[k]
    if isinstance(ax, Split) and ax.sizes is not None:
        return np.asarray(ax.sizes, dtype=np.float64) / float(sum(ax.sizes))
    return None


def _device_costs(n: Node, work: Mapping[str, NodeWork | None], strats: list[Strategy], held: tuple[bool, ...],
                  shape: tuple[int, ...], balance: Balance) -> tuple[np.ndarray, np.ndarray]:
    """_node_costs on a mesh of mixed devices (`work`: the node's on each device type, by name): a
    strategy costs its slowest device's roofline time for that device's piece of the work, and
    its memory is the most any device holds, scaled to the smallest budget (`Balance.budgets`)."""
    comp, mem = [], []
    for s in strats:
        f = work_fractions(s, shape)
        comp.append(max((work[d.name].seconds(d, fr) if work[d.name] is not None else 0.0)
                        for fr, d in set(zip(f.tolist(), balance.devices))))
        mem.append(sum(_device_bytes(v, spec, shape, balance) for v, spec, h in zip(n.outputs, s.outputs, held) if h))
    return np.array(comp), np.array(mem)


def work_fractions(s: Strategy, shape: tuple[int, ...]) -> np.ndarray:
    """Per mesh position (row-major), the fraction of a node's work a strategy gives it."""
    f = np.ones(shape)
    for k, (label, n) in enumerate(zip(s.labels, shape)):
        if label is None or label == PARTIAL:
            continue
        part = next((p for p in (_pieces(spec, shape, k) for spec in (*s.outputs, *s.inputs)) if p is not None),
                    np.full(n, 1.0 / n))
        view = [1] * len(shape)
        view[k] = n
        f = f * part.reshape(view)
    return f.ravel()


def _device_bytes(v: Value, spec: ShardSpec, shape: tuple[int, ...], balance: Balance) -> float:
    """The most bytes of v any device of the mesh holds under spec, each device's bytes scaled by
    the smallest budget over its own (so one budget row checks every device)."""
    if v.shape is None or v.dtype is None:
        return 0.0
    if not any(isinstance(ax, Split) and ax.sizes is not None for ax in spec):
        return _local_bytes(v, spec, shape)  # the same bytes on every device, the smallest budget binds
    floor = min(balance.budgets)
    best = 0.0
    for pos, budget in enumerate(balance.budgets):
        coords = tuple(int(c) for c in np.unravel_index(pos, shape))
        try:
            local = local_shape(v.shape, spec, shape, coords)
        except Exception:
            return float(v.nbytes)
        best = max(best, math.prod(local) * v.dtype.itemsize * floor / budget)
    return best


def sources_of(graph: Graph) -> list[Value]:
    """A cost model's sources: what a node reads that no node produces, in first-read order."""
    seen: dict[int, Value] = {}
    for n in graph.nodes:
        for v in n.inputs:
            if v is not None and v.producer is None:
                seen.setdefault(id(v), v)
    return list(seen.values())


def structure_key(graph: Graph, micro: Micro | None = None, arrivals: Mapping[str, float] | None = None) -> tuple:
    """What `build` depends on, with the names left out: two graphs with equal keys (a deep
    model's middle pipeline stages) get the same strategies, costs and Problem on a mesh, up
    to names, so one's plan is the other's (`renamed`). Per node its signature, phase and
    time-axis label and where each input comes from (a node's output, or the k-th source with
    its shape, dtype, kind and small constant value, and its arrival price); then the graph
    outputs and the state bindings among them."""

    where: dict[int, tuple] = {}
    sources: dict[int, int] = {}
    source_of: dict[str, int] = {}
    nodes = []
    for pos, n in enumerate(graph.nodes):
        ins = []
        for v in n.inputs:
            if v is None:
                ins.append(None)
            elif id(v) in where:
                ins.append(where[id(v)])
            else:
                k = sources.setdefault(id(v), len(sources))
                source_of[v.name] = k
                ins.append(("s", k, v.shape, v.dtype, v.is_const, v.is_param, const_key(v),
                            (arrivals or {}).get(v.name)))
        label = micro.labels[pos] if micro is not None and micro.labels is not None else None
        nodes.append((node_signature(n), phase(n), label, tuple(ins)))
        for k, v in enumerate(n.outputs):
            where[id(v)] = ("n", pos, k)
    outputs = tuple(where.get(id(v)) for v in graph.outputs)
    index = {v.name: where.get(id(v)) for v in graph.outputs}
    binds = tuple(sorted((index[o], source_of[i]) for o, i in bindings(graph.metadata).items()
                         if o in index and i in source_of))
    timed = (micro.count, micro.sources) if micro is not None else None
    return (tuple(nodes), outputs, binds, timed)


def renamed(model: CostModel, graph: Graph, micro: Micro | None = None) -> CostModel:
    """`model` for `graph`, whose `structure_key` equals that of `model.graph`."""
    sources = sources_of(graph)
    names = tuple([f"source:{v.name}" for v in sources] + [n.name for n in graph.nodes])
    return CostModel(graph, model.mesh, sources, model.source_specs, model.strategies,
                     replace(model.problem, names=names), micro, model.balance, model.forbidden, model.buckets)


def _fits(spec: ShardSpec, v: Value, mesh_shape: tuple[int, ...]) -> bool:
    try:
        spec.check(tuple(v.shape), mesh_shape)  # type: ignore[arg-type]
    except ShardSpecError:
        return False
    return True


def _time_spec(v: Value, micro: Micro, k: int) -> tuple[ShardSpec, ...]:
    """Source k's layouts on the time axis: as decided, else a data input split on the batch dim,
    or for integer data (labels, token ids, masks) also whole. Every microbatch's data is at
    hand when the step starts, so a value that needs the whole batch of such an input (a masked
    mean's count of the labels not ignored) is computed from all of it in each microbatch
    instead of across them; the nodes that read it whole are charged the whole batch every
    microbatch, and the copy is charged too (the data's split is free), so the split wins
    wherever it can. Float data is what the model computes on: a float input needed whole
    means the step cannot be microbatched."""
    if micro.sources is not None:
        return (micro.sources[k],)
    if v.is_const or not v.shape:
        return (ShardSpec((R,)),)
    if v.shape[0] % micro.count:
        raise UsageError(f"--micro-batches {micro.count}: input '{v.name}' has batch dim {v.shape[0]}, "
                         f"not divisible into {micro.count} microbatches")
    if v.dtype is None or v.dtype.is_float:
        return (ShardSpec((S(0),)),)
    return ShardSpec((S(0),)), ShardSpec((R,))


def _on_time_axis(v: Value, fixed: ShardSpec, specs: list[ShardSpec], shape: tuple[int, ...],
                  wanted: list[ShardSpec] = ()) -> list[ShardSpec]:
    """The specs whose time axis is `fixed`, plus `fixed` alone (replicated on device axes). A
    partial sum along time (a gradient another pipeline stage sends every microbatch) may take
    every device layout its consumers ask for, and each offered one with `fixed`'s time axis
    (`specs` has none partial)."""
    out = {ShardSpec((fixed[0],) + (R,) * (len(shape) - 1)): None}
    for spec in specs:
        if spec[0] == fixed[0]:
            out[spec] = None
        elif isinstance(fixed[0], Partial) and not any(isinstance(ax, Partial) for ax in spec):
            out[ShardSpec((fixed[0],) + tuple(spec)[1:])] = None
    if isinstance(fixed[0], Partial):
        for spec in wanted:
            if spec is not None and spec[0] == fixed[0] and not any(isinstance(ax, Partial) for ax in tuple(spec)[1:]):
                out[spec] = None
    return list(out)[:MAX_STRATEGIES]


def _node_costs(n: Node, work: NodeWork | None, strats: list[Strategy], held: tuple[bool, ...],
                shape: tuple[int, ...], slowest) -> tuple[np.ndarray, np.ndarray]:
    """(compute seconds, bytes of its outputs live at the peak) per strategy of node n, whose
    work among the graph's other nodes is `work` (`parc.cluster.work.graph_work`; None: it runs
    inside another node's kernel, or is folded away)."""
    comp = np.array([work.seconds(slowest, split=s.split) if work is not None else 0.0 for s in strats])
    mem = np.array([sum(_local_bytes(v, spec, shape) for v, spec, h in zip(n.outputs, s.outputs, held) if h)
                    for s in strats])
    return comp, mem


def peak_live(graph: Graph) -> set[int]:
    """Ids of the node outputs live when the graph, run in its order, holds the most bytes.

    `parc.ir.liveness.graph_peak` with its planner rules: node outputs only (the sources are
    priced on their own), a value no node reads live at its producer, graph outputs to the end
    except a training step's new parameters and state, which replace their inputs in place. The
    peak is found with every value at its full size; a plan's memory per device is then its
    sources' shares plus the shares of the values live at that point: in a training step, the
    activations saved for the backward pass and the gradients computed so far (Rhino 4.4)."""
    peak = graph_peak(graph, inputs=False, unread_outputs=True, bound_in_place=True)
    return {id(v) for v in peak.values}


class _Pricer:
    """Resharding cost matrices, computed once per (producer list, consumer list, tensor type)
    and, inside a matrix, once per distinct (source spec, target spec) object pair. Keys are the
    ids of strategy and spec lists the cost model holds for the whole build."""

    def __init__(self, mesh: Mesh, forbidden: float = FORBIDDEN, buckets: tuple[bool, ...] = ()) -> None:
        self.mesh = mesh
        self.forbidden = forbidden
        self.buckets = buckets  # per mesh axis, whether gradient buckets pay (`reshard_time`)
        self.matrices: dict[tuple, np.ndarray] = {}
        self.pairs: dict[tuple, float] = {}

    def matrix(self, u_list: list, k_out: int | None, v_list: list[Strategy], i: int,
               shape: tuple[int, ...], itemsize: int, rule: int = 0, bucketed: bool = False) -> np.ndarray:
        """The edge matrix from output `k_out` of u's strategies (`k_out` None: `u_list` is a
        source's specs) to input `i` of v's strategies. rule (microbatching): 0 none; 1 the
        consumer runs per microbatch, so nothing may move along the time axis; 2 it runs once,
        after the microbatches: only their sum may."""
        key = (id(u_list), k_out, id(v_list), i, shape, itemsize, rule, bucketed)
        m = self.matrices.get(key)
        if m is None:
            u_specs = u_list if k_out is None else [s.outputs[k_out] for s in u_list]
            ua, ui = _unique(u_specs)
            va, vi = _unique([s.inputs[i] for s in v_list])
            small = np.empty((len(ua), len(va)))
            for r, a in enumerate(ua):
                for c, b in enumerate(va):
                    pk = (id(a), id(b), shape, itemsize, rule, bucketed)
                    t = self.pairs.get(pk)
                    if t is None:
                        t = reshard_time(a, b, shape, itemsize, self.mesh, self.buckets if bucketed else ())
                        if rule and a != b and _moves_in_time(a, b, shape, itemsize, self.mesh, rule):
                            t = self.forbidden
                        self.pairs[pk] = t
                    small[r, c] = t
            m = self.matrices[key] = small[np.ix_(ui, vi)]
        return m


def _moves_in_time(a: ShardSpec, b: ShardSpec, shape: tuple[int, ...], itemsize: int, mesh: Mesh,
                   rule: int) -> bool:
    """Whether turning a into b moves data between microbatches: a collective on the time axis
    (only the sum of a value read once after them may), or, for a consumer run per microbatch,
    a local step the sequential schedule cannot take (a microbatch's piece placed among zeros
    needs its position; only even slices and a replicated value made P(sum) have one)."""
    for c in reshard(a, b, shape, itemsize, mesh.shape):
        if c.axis != 0:
            continue
        if not c.is_local:
            if rule == 1 or c.kind != "all_reduce":
                return True
        elif rule == 1 and not _sequential(c):
            return True
    return False


def _sequential(step) -> bool:
    """A local step along time the lowering runs per microbatch (`lower._micro_slice`,
    `lower._micro_first`)."""
    from parc.sharding.spec import Partial, Replicated, Split

    if step.kind == "local_slice":
        return isinstance(step.dst, Split) and step.dst.is_even
    return (step.kind == "local_partial" and isinstance(step.src, Replicated) and isinstance(step.dst, Partial)
            and step.dst.op == "sum")


def _unique(specs: list[ShardSpec]) -> tuple[list[ShardSpec], np.ndarray]:
    """Distinct objects of `specs` (by identity) and each entry's index among them."""
    first: dict[int, int] = {}
    out: list[ShardSpec] = []
    where = np.empty(len(specs), dtype=np.int64)
    for k, s in enumerate(specs):
        j = first.get(id(s))
        if j is None:
            j = first[id(s)] = len(out)
            out.append(s)
        where[k] = j
    return out, where


def _forbid(comp: list[np.ndarray], pair_cost: dict[tuple[int, int], np.ndarray]) -> float:
    """Replace the forbidden (inf) entries of `pair_cost` by FORBIDDEN_SCALE times the most a
    choice using none of them can cost (every node's and edge's dearest allowed entry), and
    return that price: above every allowed plan, so a solution that pays it has no allowed
    alternative, yet within the range of the other coefficients. A fixed large price (it was
    at least 1e3 s) is a coefficient 1e9 times the median one on a small model, where the LP's
    1e-7 tolerances let the relaxation's bound rise above a plan it had not found."""
    top = sum(float(c.max()) for c in comp if len(c))
    for m in pair_cost.values():
        finite = m[np.isfinite(m)]
        top += float(finite.max()) if finite.size else 0.0
    price = FORBIDDEN_SCALE * max(top, 1e-9)
    for key, m in pair_cost.items():
        if not np.isfinite(m).all():
            pair_cost[key] = np.where(np.isfinite(m), m, price)
    return price


def _tie_state_updates(graph, sources, source_specs, strategies, producer, mesh, pair_cost) -> None:
    """A training step's new parameters and state must come back in their inputs' layout next
    step: charge the resharding from each bound output's layout to its input's layout."""
    by_name = {v.name: k for k, v in enumerate(sources)}
    outputs = {v.name: v for v in graph.outputs}
    for out_name, in_name in bindings(graph.metadata).items():
        v = outputs.get(out_name)
        if v is None or id(v) not in producer or in_name not in by_name:
            continue
        ui = by_name[in_name]
        vi, k = producer[id(v)]
        m = np.array([[reshard_time(s.outputs[k], a, v.shape, v.dtype.itemsize, mesh)
                       for s in strategies[vi - len(sources)]] for a in source_specs[ui]])
        key = (ui, vi)
        pair_cost[key] = pair_cost[key] + m if key in pair_cost else m


def _splittable_source(v: Value) -> bool:
    return v.shape is not None and len(v.shape) > 0 and v.size > 1


def _local_bytes(v: Value, spec: ShardSpec, mesh_shape: tuple[int, ...]) -> float:
    if v.shape is None or v.dtype is None:
        return 0.0
    try:
        local = local_shape(v.shape, spec, mesh_shape, (0,) * len(mesh_shape))
    except Exception:
        return float(v.nbytes)
    return float(math.prod(local) * v.dtype.itemsize)


def micro_layout(graph: Graph, cluster: Cluster, count: int) -> Micro:
    """Where the time axis of `count` microbatches splits each node and source: the cheapest
    layout on the time axis alone (data split on the batch dim, parameters and state whole,
    optimizer nodes once), which every device mesh then keeps. UsageError when the graph
    cannot run as microbatches (a value needs several microbatches at once)."""
    from parc.solver import solve

    if count < 2:
        raise UsageError(f"--micro-batches {count}: expected 2 or more (1 means no microbatching)")
    model = build(graph, None, cluster, Micro(count))
    sol = solve(model.problem, "O2")
    if sol.cost >= model.forbidden:
        x, p = sol.choice, model.problem
        bad = [(v, u) for e, (u, v) in enumerate(p.edges.tolist()) if p.comm[e][x[u], x[v]] >= model.forbidden]
        whole = _whole_batch_nodes(graph, model)
        if whole:  # the cause, rather than the first edge it forbids (often far upstream)
            n = graph.nodes[whole[0]]
            raise UsageError(f"--micro-batches {count}: node '{n.label}' ({n.op_type}) cannot run on part of "
                             f"the batch (no sharding rule splits it there), so the values it reads need "
                             f"every microbatch at once; this graph cannot be split into microbatches")
        if bad:
            v, u = min(bad)  # the first consumer in graph order
            n = graph.nodes[v - len(model.sources)]
            raise UsageError(f"--micro-batches {count}: node '{n.label}' needs values of several "
                             f"microbatches at once (its input from {p.name(u)}); "
                             f"this graph cannot be split into microbatches")
        raise UsageError(f"--micro-batches {count}: this graph cannot be split into microbatches")
    labels = tuple(model.strategies[pos][sol.choice[model.node_index(pos)]].labels[0]
                   for pos in range(len(graph.nodes)))
    sources = tuple(model.source_specs[k][sol.choice[k]] for k in range(len(model.sources)))
    values = [(v.name, spec) for v, spec in zip(model.sources, sources)]
    for pos, n in enumerate(graph.nodes):
        strategy = model.strategies[pos][sol.choice[model.node_index(pos)]]
        values += [(v.name, spec) for v, spec in zip(n.outputs, strategy.outputs) if v.name]
    return Micro(count, labels, sources, tuple(values))


def _whole_batch_nodes(graph: Graph, model: CostModel) -> list[int]:
    """Positions of forward nodes with no strategy that splits them on the time axis although a
    value they read can be (its producer, or a data input, splits there): they need every
    microbatch at once. A SoftmaxCrossEntropyLoss with ignore_index is one (its mean is over the
    labels not ignored, not equal shares)."""
    def splits(strats) -> bool:
        return any(s.labels[0] is not None for s in strats)  # a partial sum runs per microbatch too

    producer = {id(v): pos for pos, n in enumerate(graph.nodes) for v in n.outputs}
    out = []
    for pos, n in enumerate(graph.nodes):
        if phase(n) != FORWARD or splits(model.strategies[pos]):
            continue
        if any(v is not None and ((id(v) in producer and splits(model.strategies[producer[id(v)]]))
                                  or (id(v) not in producer and not v.is_const)) for v in n.inputs):
            out.append(pos)
    return out


def per_device(model: CostModel, choice) -> tuple[list[float], list[float]]:
    """Per mesh position of a mixed mesh (`model.balance`): the compute seconds of its pieces of
    every node under `choice` and the bytes it holds (parameters, state and the values live at
    the peak), each against its own device, unscaled."""
    assert model.balance is not None
    shape, devices = model.mesh.shape, model.balance.devices
    compute = np.zeros(len(devices))
    memory = np.zeros(len(devices))
    coords = [tuple(int(c) for c in np.unravel_index(pos, shape)) for pos in range(len(devices))]

    def held(v: Value, spec: ShardSpec) -> np.ndarray:
        if v.shape is None or v.dtype is None:
            return np.zeros(len(devices))
        return np.array([math.prod(local_shape(v.shape, spec, shape, c)) * v.dtype.itemsize for c in coords],
                        dtype=np.float64)

    for k, v in enumerate(model.sources):
        if v.is_const:
            memory += held(v, model.source_specs[k][choice[k]])
    live = peak_live(model.graph)
    works = {d.name: of_graph(model.graph, d) for d in set(devices)}
    for pos, n in enumerate(model.graph.nodes):
        s = model.strategies[pos][choice[model.node_index(pos)]]
        f = work_fractions(s, shape)
        compute += [works[d.name][pos].seconds(d, fr) if works[d.name][pos] is not None else 0.0
                    for fr, d in zip(f.tolist(), devices)]
        for v, spec in zip(n.outputs, s.outputs):
            if id(v) in live:
                memory += held(v, spec)
    return compute.tolist(), memory.tolist()


def even_choice(model: CostModel, even: CostModel, choice) -> np.ndarray:
    """`choice` (in the balanced `model`) in the `even` model of the same mesh: the same
    strategy per node (the lists correspond one to one), each source at its layout with the
    uneven splits made even."""
    out = np.asarray(choice).copy()
    for k in range(len(model.sources)):
        spec = model.source_specs[k][choice[k]]
        plain = ShardSpec(tuple(S(ax.dim) if isinstance(ax, Split) and ax.sizes is not None else ax for ax in spec))
        specs = even.source_specs[k]
        out[k] = specs.index(plain) if plain in specs else specs.index(replicated(model.mesh.shape))
    return out
