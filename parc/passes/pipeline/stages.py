"""Pipeline stages: which stage computes each node (Rhino 5.1-5.2), and each stage's subgraph.

**The stage ILP** (Rhino 5.1-5.2, `parc/solver/stages.py`) runs on the forward graph: a stage
per forward node, minimising the bytes that cross stages on forward edges, with Rhino's bound
tightening and a per-stage load row. A node's cost c_i counts its forward and its backward
compute (the backward nodes whose `parc.forward` names it). Pins (the loss's producer on the
last stage, hints' `stage:` scopes) fix a node's stage.

**The other nodes follow:** a backward node goes to the stage of the forward node it came from;
an optimizer node to the stage of its parameter (the first stage whose forward nodes read it);
a backward node without a forward node (the sum of a tied weight's gradients) to the earliest
stage that reads its output. Nodes computed from state alone and tied to no parameter (Adam's
bias corrections, the step counter) are computed by every stage that needs them. The loss is
on the last stage. Nothing is linearised: skip connections, an encoder output read by every
decoder layer and a tied embedding read by the first and last stage are cross-stage edges.

`stage_graph` cuts stage s out of the training graph: its nodes, the sources they read, the
values other stages produce as inputs (received), and as outputs the graph outputs it owns plus
what other stages read from it (sent).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import numpy as np

from parc.cluster import Cluster
from parc.cluster.work import of_graph
from parc.errors import UsageError
from parc.ir.graph import Graph, Node, Value
from parc.ir.state import (
    BACKWARD,
    FORWARD,
    FORWARD_OF,
    OPTIMIZER,
    PARAM_OF,
    bindings,
    phase,
    step_state,
    write_step_state,
)
from parc.ops import node_work
from parc.solver.stages import ancestors, solve_stages

DEFAULT_TOLERANCE = 0.1  # eps of the bound tightening and the load rows (docs/pipeline.md)


@dataclass
class StageAssignment:
    """The stages of a graph's nodes and what crosses between them."""

    count: int
    stages_of: list[tuple[int, ...]]  # per node position: the stages computing it (several: replicated)
    fwd_cost: np.ndarray  # per stage: forward compute seconds (one device, whole batch)
    bwd_cost: np.ndarray  # per stage: backward compute seconds
    cut_bytes: float  # bytes crossing stages per step, forward edges (the ILP's objective)
    status: str = "optimal"
    tolerance: float = DEFAULT_TOLERANCE
    solve_s: float = 0.0
    owner: dict[str, int] = field(default_factory=dict)  # value name -> the stage that produces it for others

    def nodes_of(self, stage: int) -> list[int]:
        return [pos for pos, ss in enumerate(self.stages_of) if stage in ss]


def node_costs(graph: Graph, cluster: Cluster) -> np.ndarray:
    """Each node's time on one device of the slowest type, whole batch, among the graph's other
    nodes (`parc.cluster.work.graph_work`)."""
    slowest = min(cluster.devices, key=lambda d: d.peak("float32"))
    return np.array([w.seconds(slowest) if w is not None else 0.0 for w in of_graph(graph, slowest)])


def assign_stages(graph: Graph, cluster: Cluster, count: int, tolerance: float = DEFAULT_TOLERANCE,
                  fixed: dict[str, tuple[int, str]] | None = None, time_limit: float = 60.0,
                  tighten: bool = True, capacity: list[float] | None = None) -> StageAssignment:
    """Split `graph` into `count` stages (see the module docstring). `fixed` pins forward nodes
    (by name) to stages, with where the pin comes from (hints' `stage:` scopes). `tighten=False`
    leaves out Rhino's bounds (every node may take any stage; the load rows stay): the ILP the
    bounds are measured against (benchmarks/pipeline.py). `capacity`: each stage's share of the
    compute (a mixed cluster's stages on faster or slower device groups, Whale 3.3.2; default
    equal shares): the load rows and the bounds balance against it."""
    if count < 2:
        raise UsageError(f"--pipeline {count}: a pipeline needs 2 or more stages")
    nodes = graph.nodes
    fwd = [pos for pos, n in enumerate(nodes) if phase(n) == FORWARD]
    if len(fwd) < count:
        raise UsageError(f"--pipeline {count}: the graph has {len(fwd)} forward nodes, fewer than the stages")
    index = {id(nodes[pos]): k for k, pos in enumerate(fwd)}
    by_name = {nodes[pos].name: k for k, pos in enumerate(fwd)}
    costs = node_costs(graph, cluster)
    weight = costs[fwd].copy()
    for pos, n in enumerate(nodes):
        if phase(n) == BACKWARD and n.meta.get(FORWARD_OF) in by_name:
            weight[by_name[n.meta[FORWARD_OF]]] += costs[pos]
    edges, volume = _forward_edges(fwd, nodes, index)
    anc = ancestors(len(fwd), edges)
    pins = _pins(graph, fwd, nodes, by_name, fixed or {}, count)
    _check_pins(pins, fwd, nodes, anc, fixed or {})
    t0 = time.perf_counter()
    plan = solve_stages(weight, anc, edges, volume, count, tolerance, pins, time_limit, tighten, capacity)
    return _assignment(graph, costs, count, fwd, plan.stage, edges, volume, plan.status, plan.eps,
                       time.perf_counter() - t0)


def _assignment(graph: Graph, costs: np.ndarray, count: int, fwd: list[int], x, edges, volume, status: str,
                eps: float, seconds: float) -> StageAssignment:
    """The assignment from the forward nodes' stages `x` (the other nodes follow); `costs` per node."""
    nodes = graph.nodes
    stage_f = {fwd[k]: int(x[k]) for k in range(len(fwd))}
    stages_of = _follow(graph, stage_f, count)
    by_phase = {FORWARD: np.zeros(count), BACKWARD: np.zeros(count), OPTIMIZER: np.zeros(count)}
    for pos, ss in enumerate(stages_of):
        for s in ss:
            by_phase[phase(nodes[pos])][s] += costs[pos]
    cut = float(sum(v for (i, j), v in zip(edges, volume) if x[i] != x[j]))
    a = StageAssignment(count, stages_of, by_phase[FORWARD], by_phase[BACKWARD], cut, status, eps, seconds)
    a.owner = _owners(graph, stages_of)
    check_order(graph, a)
    return a


def uniform_stages(graph: Graph, cluster: Cluster, count: int) -> StageAssignment:
    """The hand recipe (GPipe, DeepSpeed's uniform partition): the forward nodes in graph order
    cut into `count` pieces of equal forward FLOPs; the other nodes follow as in assign_stages."""
    nodes = graph.nodes
    fwd = [pos for pos, n in enumerate(nodes) if phase(n) == FORWARD]
    flops = np.array([float(node_work(nodes[pos])[0]) for pos in fwd])
    total = float(flops.sum()) or 1.0
    middle = np.cumsum(flops) - flops / 2
    x = np.minimum((middle / (total / count)).astype(int), count - 1)
    x = np.maximum.accumulate(x)  # graph order is topological: stages never go back
    index = {id(nodes[pos]): k for k, pos in enumerate(fwd)}
    edges, volume = _forward_edges(fwd, nodes, index)
    return _assignment(graph, node_costs(graph, cluster), count, fwd, x, edges, volume, "uniform", 0.0, 0.0)


def _forward_edges(fwd: list[int], nodes: list[Node], index: dict[int, int]) -> tuple[list, list]:
    pairs: dict[tuple[int, int], float] = {}
    for k, pos in enumerate(fwd):
        for v in nodes[pos].outputs:
            for user, _ in v.uses:
                j = index.get(id(user))
                if j is not None and j != k:
                    pairs[k, j] = max(pairs.get((k, j), 0.0), float(v.nbytes))
    return list(pairs), list(pairs.values())


def _pins(graph: Graph, fwd: list[int], nodes: list[Node], by_name: dict[str, int],
          fixed: dict[str, tuple[int, str]], count: int) -> dict[int, int]:
    """Forward nodes whose stage is fixed: the loss's producer on the last stage, and hints."""
    pins: dict[int, int] = {}
    record = step_state(graph.metadata)
    loss = record.loss if record is not None else None
    for k, pos in enumerate(fwd):
        if loss is not None and any(v.name == loss for v in nodes[pos].outputs):
            pins[k] = count - 1
    for name, (s, where) in fixed.items():
        if not 0 <= s < count:
            raise UsageError(f"{where}.stage: stage {s} for node '{name}': expected 0..{count - 1}")
        if name in by_name:
            if by_name[name] in pins and pins[by_name[name]] != s:
                raise UsageError(f"{where}.stage: node '{name}' computes the loss, which is on the last "
                                 f"stage ({count - 1}), not {s}")
            pins[by_name[name]] = s
    return pins


def _check_pins(pins: dict[int, int], fwd: list[int], nodes: list[Node], anc: np.ndarray,
                fixed: dict[str, tuple[int, str]]) -> None:
    """A pinned node may not be on an earlier stage than a pinned node it depends on."""
    for j, sj in pins.items():
        for i, si in pins.items():
            if si > sj and anc[j, i]:
                name = nodes[fwd[j]].name
                where = fixed.get(name, (0, "the loss"))[1]
                raise UsageError(f"{where}.stage: node '{name}' on stage {sj} reads (through its inputs) "
                                 f"node '{nodes[fwd[i]].name}' on the later stage {si}")


def _follow(graph: Graph, stage_f: dict[int, int], count: int) -> list[tuple[int, ...]]:
    """Stages of the backward and optimizer nodes, from the forward nodes' (module docstring)."""
    nodes = graph.nodes
    pos_of = {id(n): pos for pos, n in enumerate(nodes)}
    by_name = {nodes[pos].name: s for pos, s in stage_f.items()}
    out: list[tuple[int, ...] | None] = [None] * len(nodes)
    for pos, s in stage_f.items():
        out[pos] = (s,)
    # a parameter's stage: the first stage whose forward nodes read it
    param_stage: dict[str, int] = {}
    for pos, s in stage_f.items():
        for v in nodes[pos].inputs:
            if v is not None and v.producer is None:
                param_stage[v.name] = min(param_stage.get(v.name, count), s)
    floating = _floating(graph)
    for pos, n in enumerate(nodes):
        if out[pos] is not None or pos in floating:
            continue
        if phase(n) == BACKWARD and n.meta.get(FORWARD_OF) in by_name:
            out[pos] = (by_name[n.meta[FORWARD_OF]],)
        elif phase(n) == OPTIMIZER and n.meta.get(PARAM_OF) in param_stage:
            out[pos] = (param_stage[n.meta[PARAM_OF]],)
    # the rest: the earliest stage that reads it, else the latest stage it reads from
    for pos in reversed(range(len(nodes))):
        if out[pos] is not None or pos in floating:
            continue
        users = [out[pos_of[id(u)]] for v in nodes[pos].outputs for u, _ in v.uses]
        users = [min(ss) for ss in users if ss]
        if users:
            out[pos] = (min(users),)
    for pos, n in enumerate(nodes):
        if out[pos] is not None or pos in floating:
            continue
        made = [max(out[pos_of[id(v.producer)]] or (0,)) for v in n.inputs
                if v is not None and v.producer is not None and id(v.producer) in pos_of]
        out[pos] = (max(made),) if made else (count - 1,)
    # replicated nodes: every stage that reads their outputs or holds the state they update
    bound = bindings(graph.metadata)
    readers: dict[str, set[int]] = {}
    for pos, n in enumerate(nodes):
        if out[pos] is None:
            continue
        for v in n.inputs:
            if v is not None and v.producer is None:
                readers.setdefault(v.name, set()).update(out[pos])
    for pos in sorted(floating, reverse=True):
        want: set[int] = set()
        for v in nodes[pos].outputs:
            for u, _ in v.uses:
                want.update(out[pos_of[id(u)]] or ())
            if v.name in bound:
                want.update(readers.get(bound[v.name], ()))
        out[pos] = tuple(sorted(want)) or (count - 1,)
        for v in nodes[pos].inputs:
            if v is not None and v.producer is None:
                readers.setdefault(v.name, set()).update(out[pos])
    return [ss if ss is not None else (count - 1,) for ss in out]


def _floating(graph: Graph) -> set[int]:
    """Positions of the nodes every stage may compute for itself: not forward, tied to no
    forward node and no parameter, and reading only constants, state and other such nodes."""
    data = {v.name for v in graph.inputs}
    params = {v.name for v in graph.params()}
    out: set[int] = set()
    made: set[int] = set()
    for pos, n in enumerate(graph.nodes):
        if phase(n) == FORWARD or n.meta.get(FORWARD_OF) or n.meta.get(PARAM_OF):
            continue
        ok = all(v is None or (v.producer is None and v.name not in data and v.name not in params)
                 or id(v) in made for v in n.inputs)
        if ok:
            out.add(pos)
            made.update(id(v) for v in n.outputs)
    return out


def _owners(graph: Graph, stages_of: list[tuple[int, ...]]) -> dict[str, int]:
    """The stage each node output is sent from: the first stage computing it."""
    return {v.name: min(ss) for n, ss in zip(graph.nodes, stages_of) for v in n.outputs if v.name}


def check_order(graph: Graph, a: StageAssignment) -> None:
    """Forward values only flow to later stages; a 1F1B schedule cannot run anything else."""
    pos_of = {id(n): pos for pos, n in enumerate(graph.nodes)}
    for pos, n in enumerate(graph.nodes):
        if phase(n) != FORWARD:
            continue
        for v in n.inputs:
            if v is not None and v.producer is not None and phase(v.producer) == FORWARD:
                if min(a.stages_of[pos_of[id(v.producer)]]) > min(a.stages_of[pos]):
                    raise UsageError(f"node '{n.label}' on stage {min(a.stages_of[pos])} reads "
                                     f"'{v.name}' from the later stage {min(a.stages_of[pos_of[id(v.producer)]])}")


# ---- a stage's subgraph -------------------------------------------------------------------------
@dataclass
class Boundary:
    """A value computed on one stage and read on another."""

    name: str
    src: int  # producing stage
    dst: tuple[int, ...]  # reading stages
    phase: str  # the producer's phase (forward, backward, optimizer)
    shape: tuple[int, ...]
    dtype: int  # ONNX element type


def boundaries(graph: Graph, a: StageAssignment) -> list[Boundary]:
    """Every value that crosses stages, in graph order, with the state updates that another stage
    holds (a tied weight's new value goes to every stage that reads the weight)."""
    pos_of = {id(n): pos for pos, n in enumerate(graph.nodes)}
    out: dict[str, Boundary] = {}
    for pos, n in enumerate(graph.nodes):
        for v in n.inputs:
            if v is None or v.producer is None:
                continue
            src_stages = a.stages_of[pos_of[id(v.producer)]]
            for s in a.stages_of[pos]:
                if s in src_stages:
                    continue
                b = out.setdefault(v.name, Boundary(v.name, min(src_stages), (), phase(v.producer),
                                                    tuple(v.shape), v.dtype.onnx_type))
                if s not in b.dst:
                    b.dst = tuple(sorted((*b.dst, s)))
    # new state read by a stage that does not compute it
    readers: dict[str, set[int]] = {}
    for pos, n in enumerate(graph.nodes):
        for v in n.inputs:
            if v is not None and v.producer is None:
                readers.setdefault(v.name, set()).update(a.stages_of[pos])
    outputs = {v.name: v for v in graph.outputs}
    for new, old in bindings(graph.metadata).items():
        v = outputs.get(new)
        if v is None or v.producer is None:
            continue
        made = a.stages_of[pos_of[id(v.producer)]]
        need = tuple(sorted(s for s in readers.get(old, ()) if s not in made))
        if need:
            b = out.setdefault(new, Boundary(new, min(made), (), phase(v.producer), tuple(v.shape),
                                             v.dtype.onnx_type))
            b.dst = tuple(sorted(set(b.dst) | set(need)))
    return list(out.values())


def stage_graph(graph: Graph, a: StageAssignment, stage: int, crossing: list[Boundary]) -> Graph:
    """Stage `stage`'s program as a Graph of its own (module docstring). Received values are
    graph inputs; sent values and the graph outputs this stage owns are graph outputs."""
    g = Graph(f"{graph.name}.stage{stage}", dict(graph.opset))
    g.metadata = dict(graph.metadata)
    copies: dict[int, Value] = {}
    bound = bindings(graph.metadata)
    received = {b.name for b in crossing if stage in b.dst and b.name not in bound}
    input_consts = {v.name for v in graph.input_constants}

    def value(v: Value) -> Value:
        if id(v) in copies:
            return copies[id(v)]
        if v.producer is None or v.name in received:
            if v.is_const:
                c = g.add_constant(v.const, v.name, is_param=v.is_param)
                if v.name in input_consts:
                    g.input_constants.append(c)
            else:
                c = g.add_input(v.name, v.dtype, v.shape)  # type: ignore[arg-type]
            copies[id(v)] = c
            return c
        raise AssertionError(f"value {v.name} read before it is made on stage {stage}")

    positions = a.nodes_of(stage)
    for pos in positions:
        n = graph.nodes[pos]
        ins = [value(v) if v is not None else None for v in n.inputs]
        outs = []
        for v in n.outputs:
            c = Value(v.name, v.dtype, v.shape)
            if v.name:
                g.names.claim(v.name)
            copies[id(v)] = c
            outs.append(c)
        node = Node(n.op_type, ins, outs, dict(n.attrs), n.name, n.domain, dict(n.meta))
        g.nodes.append(node)
    sent = {b.name for b in crossing if b.src == stage}
    owned = stage_outputs(graph, a, stage)
    g.outputs = [copies[id(v)] for v in graph.outputs if v.name in owned]
    extra = [copies[id(v)] for pos in positions for v in graph.nodes[pos].outputs
             if v.name in sent and v.name not in owned]
    g.outputs += extra
    rec = step_state(graph.metadata)
    if rec is not None:
        outs = {v.name for v in g.outputs}
        holds = {v.name for v in g.input_constants}
        binds = {o: i for o, i in rec.bindings.items() if o in outs and i in holds}
        params = tuple(p for p in rec.params if p in holds and p in set(binds.values()))
        write_step_state(g.metadata, rec.replace(
            bindings=binds, params=params, grads={p: gname for p, gname in rec.grads.items() if p in params},
            loss=rec.loss if rec.loss in outs else None))
    g.metadata["parc.stage"] = json.dumps({"stage": stage, "received": sorted(received), "sent": sorted(sent)})
    return g


def stage_outputs(graph: Graph, a: StageAssignment, stage: int) -> set[str]:
    """The graph outputs stage `stage` gives: those it owns, and the new values of state it
    holds that it computes itself (a replicated step counter)."""
    pos_of = {id(n): pos for pos, n in enumerate(graph.nodes)}
    held = {v.name for pos in a.nodes_of(stage) for v in graph.nodes[pos].inputs
            if v is not None and v.producer is None}
    binds = bindings(graph.metadata)
    out = set()
    for v in graph.outputs:
        if v.producer is None or stage not in a.stages_of[pos_of[id(v.producer)]]:
            continue
        if a.owner.get(v.name) == stage or binds.get(v.name) in held:
            out.add(v.name)
    return out


def balance(a: StageAssignment) -> float:
    """The slowest stage's forward + backward compute over the mean (1.0: perfectly even)."""
    load = a.fwd_cost + a.bwd_cost
    return float(load.max() / load.mean()) if load.mean() > 0 else 1.0


def tolerance_ok(value: float) -> float:
    if not (value >= 0 and math.isfinite(value)):
        raise UsageError(f"--pipeline-tolerance {value}: expected a number >= 0")
    return value
