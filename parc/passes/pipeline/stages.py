"""Pipeline stages: which stage computes each node (Rhino 5.1-5.2), and each stage's subgraph.

**The stage ILP** runs on the forward graph. Integer B_i (the stage of forward node i, here
sum_s s * x_is over 0-1 columns x_is), a 0-1 F_ij per forward edge with
F_ij <= B_j - B_i <= (S - 1) F_ij, and the objective sum F_ij * bytes(i, j): the volume that
crosses stages. Rhino's bound tightening keeps each node near its balanced position: with A_i
and D_i its ancestors and descendants, c its cost and T = sum c / S,

    floor(sum_{A_i} c / T - eps - h)  <=  B_i  <=  S - 1 - floor((c_i + sum_{D_i} c) / T - eps - h)

(the upper bound as the mirror of the lower one: a node whose descendants need k stages' worth
of time starts at stage S - k at the latest; h = BOUND_SLACK, half a stage: see its comment). On a non-linear graph ancestor sums say little about
parallel branches, so a per-stage load row sum_i c_i x_is <= (1 + eps) T is added as well; eps
doubles until the problem is feasible. A node's cost c_i counts its forward and its backward
compute (the backward nodes whose `parc.forward` names it). Among equal cuts the most even split wins (a
tie-break on the largest stage load).

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

import highspy
import numpy as np

from parc.autodiff.context import FORWARD_OF
from parc.cluster import Cluster, compute_time
from parc.errors import InfeasiblePlanError, UsageError
from parc.ir.graph import Graph, Node, Value
from parc.ir.state import BACKWARD, FORWARD, OPTIMIZER, bindings, phase, step_state, write_step_state
from parc.ops import node_pieces, node_work, op_class
from parc.solver.ilp import new_highs, rowwise_lp

DEFAULT_TOLERANCE = 0.1  # eps of the bound tightening and the load rows (docs/pipeline.md)
# Stages of slack on the tightened bounds beyond eps. With none (the bounds as Rhino prints them)
# the 4-stage cut came out 13-30% above the untightened ILP's on branched graphs (unet, t5-large,
# moe-tiny, unet-tiny): ancestor sums count a parallel branch's work as if it came first. With
# half a stage every zoo model's cut equals the untightened one's, and the solve stays under
# 8 s where the untightened one took up to 31 s (docs/benchmarks.md); the load rows keep the balance.
BOUND_SLACK = 0.5


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
    """Each node's time on one device of the slowest type, whole batch (the cost model's roofline)."""
    slowest = min(cluster.devices, key=lambda d: d.peak("float32"))
    out = np.empty(len(graph.nodes))
    for pos, n in enumerate(graph.nodes):
        flops, nbytes, dtype = node_work(n)
        out[pos] = compute_time(flops, nbytes, slowest, dtype, op_class(n), pieces=node_pieces(n))
    return out


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
    anc = _ancestors(len(fwd), edges)
    pins = _pins(graph, fwd, nodes, by_name, fixed or {}, count)
    _check_pins(pins, fwd, nodes, anc, fixed or {})
    t0 = time.perf_counter()
    x, status, eps = _solve(weight, anc, edges, volume, count, tolerance, pins, time_limit, tighten, capacity)
    return _assignment(graph, costs, count, fwd, x, edges, volume, status, eps, time.perf_counter() - t0)


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


def _solve(weight: np.ndarray, anc: np.ndarray, edges: list, volume: list, count: int, tolerance: float,
           pins: dict[int, int], time_limit: float, tighten: bool = True,
           capacity: list[float] | None = None) -> tuple[np.ndarray, str, float]:
    """The stage of each forward node, the solver status and the tolerance that was feasible.
    With `capacity` (per-stage shares) stage s's balanced load is T_s = total * share_s, and a
    node's bounds count the stages the work before (after) it fills: the first stage it may
    take is the number of stages whose cumulative capacity its ancestors' work exceeds (less the
    slack, in mean stages)."""
    total = float(weight.sum()) or 1.0
    per = total / count
    share = np.full(count, 1.0 / count) if capacity is None else np.asarray(capacity, dtype=np.float64)
    a_cost = anc @ weight  # ancestors' compute
    d_cost = weight @ anc + weight  # its own and its descendants' compute
    # HiGHS works to absolute tolerances (1e-7 on rows, 1e-6 on the objective): loads in units of
    # the balanced stage T and volumes in units of the largest edge keep both well scaled.
    vscale = float(max(volume, default=1.0)) or 1.0
    eps = tolerance
    for _ in range(8):
        slack = eps + (BOUND_SLACK if tighten else count)  # `count` stages of slack: no bounds
        lo, hi = stage_bounds(a_cost, d_cost, share * total, slack * per)
        for k, s in pins.items():
            lo[k] = hi[k] = s
        got = _stage_ilp(weight / per, edges, np.asarray(volume, dtype=np.float64) / vscale, count, lo, hi,
                         1 + eps, time_limit, 1.0 / (share * count))
        if got is not None:
            return got[0], got[1], eps
        eps *= 2
    raise InfeasiblePlanError(f"no balanced split into {count} stages (tolerance up to {eps:g}); "
                              f"the pinned stages may contradict the graph's order")


def stage_bounds(before: np.ndarray, after: np.ndarray, loads: np.ndarray,
                 slack: float) -> tuple[np.ndarray, np.ndarray]:
    """Each node's first and last stage: with stage s balanced at loads[s], the first is the
    number of stages the work before it (`before`, less `slack`) fills, the last is the mirror
    from the end with the node's own and later work (`after`). With equal loads T these are
    Rhino's floor(before / T - slack / T) and S - 1 - floor(after / T - slack / T)."""
    count = len(loads)
    lo = np.searchsorted(np.cumsum(loads), before - slack, side="right").clip(0, count - 1).astype(int)
    hi = (count - 1 - np.searchsorted(np.cumsum(loads[::-1]), after - slack, side="right")).clip(0, count - 1)
    return lo, np.maximum(hi.astype(int), lo)


def _ancestors(n: int, edges: list) -> np.ndarray:
    """anc[j, i]: i is an ancestor of j (bool [n, n]), for a DAG whose nodes are in topological
    order; its transpose is the descendant relation."""
    preds: list[list[int]] = [[] for _ in range(n)]
    for i, j in edges:
        preds[j].append(i)
    anc = np.zeros((n, n), dtype=bool)
    for j in range(n):
        for i in preds[j]:
            anc[j] |= anc[i]
            anc[j, i] = True
    return anc


def _stage_ilp(weight, edges, volume, count, lo, hi, cap, time_limit,
               per_stage: np.ndarray | None = None) -> tuple[np.ndarray, str] | None:
    """x_is (n * count columns, node-major), then F_e, then L, the largest stage load (stage s's
    load times per_stage[s]: its load against its capacity); None when infeasible. The objective is the cut, then (as a tie-break worth a tenth of the smallest edge
    over the whole range of L) the largest load: among splits that cut the same volume (a chain
    of equal layers cuts the same anywhere) the most even one."""
    n, m = len(weight), len(edges)
    X = n * count
    vol = np.asarray(volume, dtype=np.float64)
    positive = vol[vol > 0]
    tie = 0.1 * float(positive.min()) / max(float(cap), 1e-300) if len(positive) else 1.0
    lower = np.zeros(X + m + 1)
    upper = np.ones(X + m + 1)
    upper[-1] = cap
    s_of = np.tile(np.arange(count), n)
    node_of = np.repeat(np.arange(n), count)
    upper[:X][(s_of < lo[node_of]) | (s_of > hi[node_of])] = 0.0
    cost = np.concatenate([np.zeros(X), vol, [tie]])
    rows, cols, vals, rlo, rhi = [], [], [], [], []
    r = 0
    # one stage per node
    rows.append(np.repeat(np.arange(n), count))
    cols.append(np.arange(X))
    vals.append(np.ones(X))
    rlo.append(np.ones(n))
    rhi.append(np.ones(n))
    r += n
    # F_e <= B_j - B_i <= (count - 1) F_e, as two rows per edge
    for k, (i, j) in enumerate(edges):
        for scale, lo_b, hi_b in ((1.0, 0.0, highspy.kHighsInf), (count - 1.0, -highspy.kHighsInf, 0.0)):
            rows.append(np.full(2 * count + 1, r))
            cols.append(np.concatenate([j * count + np.arange(count), i * count + np.arange(count), [X + k]]))
            vals.append(np.concatenate([np.arange(count, dtype=float), -np.arange(count, dtype=float), [-scale]]))
            rlo.append(np.array([lo_b]))
            rhi.append(np.array([hi_b]))
            r += 1
    # stage loads: each at most L (and L at most cap)
    for s in range(count):
        rows.append(np.full(n + 1, r))
        cols.append(np.concatenate([np.arange(n) * count + s, [X + m]]))
        vals.append(np.concatenate([np.asarray(weight, dtype=np.float64) * (1.0 if per_stage is None else per_stage[s]),
                                    [-1.0]]))
        rlo.append(np.array([-highspy.kHighsInf]))
        rhi.append(np.array([0.0]))
        r += 1
    lp = rowwise_lp(cost, lower, upper, rows, cols, vals, rlo, rhi, r)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * (X + m) + [highspy.HighsVarType.kContinuous]
    h = new_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("mip_rel_gap", 1e-4)
    h.setOptionValue("time_limit", time_limit)
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    if info.primal_solution_status != highspy.SolutionStatus.kSolutionStatusFeasible.value:
        return None
    col = np.asarray(h.getSolution().col_value)[:X].reshape(n, count)
    name = "optimal" if status == highspy.HighsModelStatus.kOptimal else h.modelStatusToString(status)
    return col.argmax(axis=1), name


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
        elif phase(n) == OPTIMIZER and n.meta.get("parc.param") in param_stage:
            out[pos] = (param_stage[n.meta["parc.param"]],)
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
    bound = _bound_sources(graph)
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
        if phase(n) == FORWARD or n.meta.get(FORWARD_OF) or n.meta.get("parc.param"):
            continue
        ok = all(v is None or (v.producer is None and v.name not in data and v.name not in params)
                 or id(v) in made for v in n.inputs)
        if ok:
            out.add(pos)
            made.update(id(v) for v in n.outputs)
    return out


def _bound_sources(graph: Graph) -> dict[str, str]:
    return bindings(graph.metadata)


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
    for new, old in _bound_sources(graph).items():
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
    received = {b.name for b in crossing if stage in b.dst and b.name not in _bound_sources(graph)}
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
    binds = _bound_sources(graph)
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
