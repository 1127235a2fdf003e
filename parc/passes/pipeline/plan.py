"""Pipelined plans: stages on device groups, each stage an SPMD plan of its own (Rhino 3, 5).

A pipeline of S stages over N devices gives stage s the devices s*N/S .. (s+1)*N/S - 1 (rank
order, so when stages are bigger than a node the pipeline axis is the one between nodes, where
bandwidth is lowest). `assign_stages` splits the graph; every stage's subgraph is then planned
by the SPMD search on its own device group, with the microbatch layout decided once for the
whole graph (`costs.micro_layout`), so a value crossing stages has the same microbatch split on
both sides.

Predicted step (1F1B, Rhino 6.2, DAPPLE): with t_s stage s's time for one microbatch (forward,
backward and their collectives: its SPMD step less the optimizer, over M), p_s the transfers it
sends per microbatch, and a_s its optimizer,

    step = sum_s (t_s + p_s) + (M - 1) * max_s (t_s + p_s) + max_s a_s

and the bubble is step - M * max_s (t_s + p_s) - max_s a_s: the fill and drain. Stage s keeps
the activations of min(S - s, M) microbatches alive (Whale 3.3.2); its memory is its sources
plus that many times one microbatch's activations, and its SPMD search budgets exactly that
(`kept`), so it picks layouts that fit rather than failing after.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from parc.cluster import Cluster, enumerate_meshes, send_recv_time
from parc.cluster.cluster import Node as ClusterNode
from parc.cluster.links import LinkSpec
from parc.cluster.mesh import shared_link
from parc.errors import InfeasiblePlanError, UsageError
from parc.hints import Hints
from parc.hints.apply import stage_pins
from parc.ir.dtypes import DType
from parc.ir.graph import Graph
from parc.ir.state import OPTIMIZER
from parc.passes.pipeline.stages import (
    DEFAULT_TOLERANCE,
    Boundary,
    StageAssignment,
    assign_stages,
    balance,
    boundaries,
    stage_graph,
    uniform_stages,
)
from parc.passes.record import step_roles
from parc.passes.record import tensors as tensors_of
from parc.passes.schedule import SCHEDULES, StageTimes
from parc.passes.spmd.costs import (
    CostModel,
    Micro,
    micro_layout,
    renamed,
    sources_of,
    structure_key,
    warm_strategies,
)
from parc.passes.spmd.decision import source_specs
from parc.passes.spmd.hetero import device_times, stage_capacity, stage_order
from parc.passes.spmd.search import Plan, optimizer_time, plan_graph
from parc.plandir import plan as plan_format
from parc.sharding import ShardSpec
from parc.sharding.layout import local_shape
from parc.sharding.spec import Split

log = logging.getLogger("parc.plan")


def sub_cluster(cluster: Cluster, start: int, count: int) -> Cluster:
    """Devices start .. start+count-1 of `cluster` as a cluster of their own (a node split
    between two groups keeps its link and NICs on each side)."""
    nodes, rank = [], 0
    for node in cluster.nodes:
        lo, hi = max(start, rank), min(start + count, rank + len(node.devices))
        if lo < hi:
            nodes.append(ClusterNode(node.devices[lo - rank:hi - rank], node.intra_link, node.nics))
        rank += len(node.devices)
    return Cluster(tuple(nodes), cluster.inter_link)


def stage_link(cluster: Cluster, a: int, b: int) -> LinkSpec:
    """The link between two devices: inside a node its link, else the inter-node link."""
    na, nb = cluster.node_of(a), cluster.node_of(b)
    return cluster.nodes[na].intra_link if na == nb else cluster.inter_link


@dataclass
class StagePlan:
    """One stage: its device group (global ranks), subgraph and SPMD plan."""

    index: int
    ranks: tuple[int, ...]
    graph: Graph
    positions: list[int]  # the whole graph's node positions this stage computes
    plan: Plan
    per_micro_s: float = 0.0  # forward + backward (+ their collectives) of one microbatch
    apply_s: float = 0.0  # the optimizer
    send_s: float = 0.0  # transfers sent per microbatch
    memory_bytes: float = 0.0  # sources + the microbatches 1F1B keeps alive
    params: int = 0  # parameters the stage holds (elements)


@dataclass
class PipelinePlan:
    """What `parc plan --pipeline` decided; `to_json` is plan.json format 2."""

    graph: Graph
    cluster: Cluster
    assignment: StageAssignment
    crossing: list[Boundary]
    stages: list[StagePlan]
    micro_batches: int
    level: str
    budget: float
    step_s: float = 0.0
    bubble_s: float = 0.0
    time_s: float = 0.0
    baselines: dict[str, dict] = field(default_factory=dict)
    micro: Micro | None = None  # the whole graph's microbatch layout (None: one microbatch)
    spmd: dict | None = None  # the best SPMD-only plan's figures, when it was searched
    tried: list[dict] = field(default_factory=list)  # the stage counts searched
    micro_searched: list[dict] = field(default_factory=list)  # the microbatch counts searched
    even_split: dict | None = None  # a mixed cluster: the stages cut for equal compute (the baseline)

    @property
    def ranks(self) -> int:
        return sum(len(s.ranks) for s in self.stages)

    def stage_times(self) -> list[StageTimes]:
        """Each stage's figures per microbatch, for the stage-level schedule: its forward and
        backward split as the stage search's costs split them."""
        out = []
        for st in self.stages:
            fwd, bwd = float(self.assignment.fwd_cost[st.index]), float(self.assignment.bwd_cost[st.index])
            share = fwd / (fwd + bwd) if fwd + bwd > 0 else 0.5
            out.append(StageTimes(tuple(st.ranks), tuple(st.plan.best.mesh.shape), share * st.per_micro_s,
                                  (1 - share) * st.per_micro_s, st.apply_s, st.send_s))
        return out

    def to_json(self) -> dict:
        """plan.json's contents (`to_plan`'s document)."""
        return self.to_plan().to_json()

    def to_plan(self) -> plan_format.Plan:
        """The plan as plan.json records it (`parc.plandir.plan`): a stage per device group."""
        specs, strategies, communication = {}, {}, []
        stage_docs = []
        roles = step_roles(self.graph)
        for st in reversed(self.stages):  # a value on several stages: the first stage's layout
            doc = st.plan.to_plan()
            stage_docs.append(doc)
            specs.update(doc.specs)
            strategies.update(doc.strategies)
            communication = [dict(c, stage=st.index) for c in doc.communication or ()] + communication
        stage_docs.reverse()
        compute = sum(float(np.sum(st.plan.best.compute_s)) for st in self.stages)
        comm = sum(st.plan.best.comm_s for st in self.stages)
        memory = [st.memory_bytes for st in self.stages for _ in st.ranks]
        first = self.stages[0].plan
        first_mesh = first.best.mesh.to_json()
        link = stage_link(self.cluster, self.stages[0].ranks[0], self.stages[1].ranks[0])
        mesh = plan_format.MeshLayout(
            (len(self.stages), *first.best.mesh.shape), (link.to_json(), *first_mesh.get("links", [])),
            (self.cluster.node_of(self.stages[0].ranks[0]) != self.cluster.node_of(self.stages[1].ranks[0]),
             *first_mesh.get("spans_nodes", [])), pipeline=True)
        stages = tuple(plan_format.Stage(
            id=st.index, devices=st.ranks, mesh=st.plan.best.mesh.shape,
            device_types=sorted({self.cluster.devices[r].name for r in st.ranks}), nodes=len(st.positions),
            step_time_s=st.plan.best.solution.cost - _received_s(st.plan.best.model, st.plan.best.solution.choice),
            memory_bytes_per_device=st.memory_bytes, parameters=st.params, specs=doc.specs,
            forward_s=float(self.assignment.fwd_cost[st.index]), backward_s=float(self.assignment.bwd_cost[st.index]),
            per_micro_batch_s=st.per_micro_s, optimizer_s=st.apply_s, send_s=st.send_s,
            solver={"status": st.plan.best.solution.status, "gap": st.plan.best.solution.gap},
        ) for st, doc in zip(self.stages, stage_docs, strict=True))
        return plan_format.Plan(
            cluster=self.cluster, mesh=mesh, stages=stages,
            schedule=plan_format.Schedule(SCHEDULES[0], self.micro_batches, tuple(self.micro_searched)),
            specs=specs, strategies=strategies,
            phases={k: v for doc in stage_docs for k, v in doc.phases.items()},
            predicted=plan_format.Prediction(self.step_s, compute, comm, memory, self.budget, self.bubble_s),
            baselines={k: plan_format.Baseline.from_json(v) for k, v in self.baselines.items()},
            tensors=tensors_of(self.graph, [*sources_of(self.graph), *(v for n in self.graph.nodes for v in n.outputs)],
                               roles),
            step=roles,
            solver={"level": self.level, "time_s": self.time_s, "pipelines": self.tried,
                    "status": next((st.plan.best.solution.status for st in self.stages
                                    if st.plan.best.solution.status != "optimal"), "optimal"),
                    "gap": max((st.plan.best.solution.gap or 0.0 for st in self.stages), default=0.0),
                    "nodes": sum(st.plan.best.model.problem.n for st in self.stages),
                    "meshes": [dict(m, stage=st.index, chosen=list(m.get("shape", [])) == list(st.plan.best.mesh.shape))
                               for st in self.stages for m in st.plan.tried]},
            communication=tuple(communication),
            micro={"count": self.micro_batches} if self.micro_batches > 1 else None,
            transfers=tuple({"value": b.name, "from_stage": b.src, "to_stages": list(b.dst), "pass": b.phase,
                             "bytes": int(np.prod(b.shape)) * _itemsize(b.dtype)} for b in self.crossing),
            stage_search={"status": self.assignment.status, "tolerance": self.assignment.tolerance,
                          "cut_bytes": self.assignment.cut_bytes, "balance": balance(self.assignment),
                          "time_s": self.assignment.solve_s},
            spmd_only=self.spmd)


def _itemsize(onnx_type: int) -> int:
    return DType(int(onnx_type)).itemsize


def pipeline_candidates(cluster: Cluster) -> list[int]:
    """The stage counts `--pipeline auto` tries: one stage per node, so every hop over the slow
    links between nodes is on the pipeline axis and every stage's SPMD plan stays inside a node
    (Rhino fig. 9's setting). One candidate, because each costs a search per stage, longer than
    the one-mesh search (docs/pipeline.md); `--pipeline S` plans others.
    On one node the links are fast and only the one-mesh search runs, unless nothing fits in
    memory (`fallback_counts`)."""
    k = len(cluster.nodes)
    return [k] if k >= 2 and cluster.num_devices % k == 0 else []


def fallback_counts(cluster: Cluster, tried: list[int]) -> list[int]:
    """The stage counts `--pipeline auto` tries, fewest first, when neither one mesh nor the
    stage-per-node pipeline fits in memory: every count that divides the devices (2, 4, 8, ...
    inside a node too), since more stages hold fewer parameters and activations per device."""
    n = cluster.num_devices
    return [s for s in range(2, n + 1) if n % s == 0 and s not in tried]


def batch_size(graph: Graph) -> int | None:
    """The batch (dim 0 of the data inputs), when they agree."""
    dims = {v.shape[0] for v in graph.inputs if v.shape}
    return dims.pop() if len(dims) == 1 else None


def plan_pipeline(graph: Graph, cluster: Cluster, stages: int, *, micro_batches: int | None = None,
                  level: str = "O3", memory_budget: float | None = None, time_limit: float = 60.0,
                  tolerance: float = DEFAULT_TOLERANCE, jobs: int | None = None, max_mesh_dims: int = 2,
                  hints: Hints | None = None, cut: StageAssignment | None = None) -> PipelinePlan:
    """The pipelined plan of `graph` in `stages` stages over the cluster (module docstring).
    `hints`: `stage:` scopes pin forward nodes to stages; the rest of the hints apply to every
    stage's SPMD search (pins to the tensors the stage holds). Without `micro_batches` the
    microbatch count is searched (`micro_batch_candidates`): the stages are found once (the
    stage ILP does not depend on it), then each count's stage plans, from the fewest
    microbatches up, until one predicts no faster than the one before; when none fits in
    memory, larger counts (about doubling, up to the batch) until one does. `cut`: these
    stages instead of the stage search's (and no even-split cut beside them)."""
    t0 = time.perf_counter()
    n = cluster.num_devices
    if stages < 2 or n % stages:
        raise UsageError(f"--pipeline {stages}: expected a stage count >= 2 that divides the "
                         f"{n} devices")
    batch = batch_size(graph)
    if micro_batches is not None and (micro_batches < 1 or (batch is not None and batch % micro_batches)):
        raise UsageError(f"--micro-batches {micro_batches}: expected a count that divides the batch ({batch})")
    budget = float(memory_budget if memory_budget is not None else min(d.memory_bytes for d in cluster.devices))
    fixed = stage_pins(graph, hints, stages) if hints is not None else None
    shares = stage_shares(graph, cluster, stages)
    a = cut if cut is not None else assign_stages(graph, cluster, stages, tolerance, fixed, time_limit,
                                                  capacity=shares)
    # a mixed cluster: the stages cut for equal compute too (Whale's even split), planned beside
    # the speed-balanced cut at every microbatch count; the faster is the plan, the even one its
    # `even-split` baseline
    even = (assign_stages(graph, cluster, stages, tolerance, fixed, time_limit)
            if shares is not None and cut is None else None)
    crossing = boundaries(graph, a)
    counts = [micro_batches] if micro_batches is not None else micro_batch_candidates(graph, stages)
    best: PipelinePlan | None = None
    searched: list[dict] = []
    error: Exception | None = None
    larger = _larger_counts(graph, counts[-1]) if micro_batches is None else []
    for m in counts + larger:
        if m in larger and best is not None:
            break  # larger counts only while none fits
        try:
            pp = _plan_at(graph, cluster, stages, m, a, crossing, level, budget, time_limit, jobs,
                          max_mesh_dims, hints, given=micro_batches is not None)
            if even is not None:
                pp = _with_even_split(pp, graph, cluster, stages, even, level, budget, time_limit, jobs,
                                      max_mesh_dims, hints, micro_batches is not None)
        except (InfeasiblePlanError, UsageError) as e:
            if micro_batches is not None:
                raise
            searched.append({"micro_batches": m, "feasible": False, "error": str(e)})
            error = e
            continue
        searched.append({"micro_batches": pp.micro_batches, "feasible": True, "step_time_s": pp.step_s})
        if best is not None and pp.step_s >= best.step_s:
            break
        best = pp
        if pp.micro_batches != m:  # the graph cannot be microbatched: one microbatch it is
            break
    if best is None:
        raise error  # type: ignore[misc]
    best.micro_searched = searched
    best.time_s = time.perf_counter() - t0
    return best


def micro_batch_candidates(graph: Graph, stages: int) -> list[int]:
    """The microbatch counts searched for a pipeline of `stages` stages: the smallest divisor of
    the batch >= S, >= 2S and >= 4S (a 1F1B bubble of (S - 1) / (M + S - 1): about a half, a
    third, a fifth), fewer when the batch has fewer such divisors; the batch itself when it is
    smaller than S."""
    batch = batch_size(graph) or 1
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    out = []
    for want in (stages, 2 * stages, 4 * stages):
        d = next((d for d in divisors if d >= want), divisors[-1])
        if d not in out:
            out.append(d)
    return out


def _larger_counts(graph: Graph, m: int) -> list[int]:
    """Divisors of the batch above `m`, about doubling, the batch last: what the search tries
    when no count fits in memory (more microbatches keep fewer activations alive)."""
    batch = batch_size(graph) or 1
    out = []
    for d in range(m + 1, batch + 1):
        if batch % d == 0 and (d >= 2 * (out[-1] if out else m) or d == batch):
            out.append(d)
    return out


def _plan_at(graph: Graph, cluster: Cluster, stages: int, m: int, a: StageAssignment, crossing: list[Boundary],
             level: str, budget: float, time_limit: float, jobs: int | None, max_mesh_dims: int,
             hints: Hints | None, given: bool) -> PipelinePlan:
    """The pipelined plan with the stages `a` and `m` microbatches (`given`: the user's count,
    which must microbatch the graph; otherwise a graph that cannot be is planned whole)."""
    micro: Micro | None = None
    if m > 1:
        try:
            micro = micro_layout(graph, cluster, m)
        except UsageError as e:
            if given:
                raise
            log.warning("%s; the pipeline runs the batch whole (1 microbatch)", e)
            m = 1
    inputs = list(_stage_inputs(graph, cluster, a, crossing, micro, m))

    def search(st: _StageInput) -> Plan:
        for mesh in enumerate_meshes(st.cluster, max_dims=max_mesh_dims):  # the searches' workers inherit them
            warm_strategies(st.graph, mesh, st.cluster, st.micro)
        try:
            return plan_graph(st.graph, st.cluster, level=level, memory_budget=stage_budget(cluster, st.cluster, budget),
                              time_limit=time_limit,
                              jobs=jobs, micro_batches=m, micro=st.micro, with_baselines=False,
                              max_mesh_dims=max_mesh_dims, hints=_stage_hints(hints, st.graph),
                              arrivals=st.arrivals, kept=st.kept)
        except InfeasiblePlanError as e:
            raise InfeasiblePlanError(f"pipeline stage {st.index} of {a.count} ({len(st.positions)} "
                                      f"nodes, {st.kept} microbatches of activations kept by 1F1B): {e}") from None

    found: dict[int, Plan] = {}
    if hints is not None:  # hints match names: no reuse
        found = {st.index: search(st) for st in inputs}
    else:
        alike: dict[tuple, list[_StageInput]] = {}
        for st in inputs:
            alike.setdefault(st.shape_key, []).append(st)
        for group in alike.values():
            _settle(sorted(group, key=lambda st: (-st.kept, st.index)), search, found)
    plans = [StagePlan(st.index, st.ranks, st.graph, st.positions, found[st.index]) for st in inputs]
    out = PipelinePlan(graph, cluster, a, crossing, plans, m, level, budget, micro=micro)
    _predict(out)
    return out


@dataclass
class _StageInput:
    """What one stage's SPMD search (or the uniform baseline's) is given."""

    index: int
    ranks: tuple[int, ...]
    graph: Graph
    positions: list[int]
    cluster: Cluster  # the stage's device group
    micro: Micro | None  # its part of the microbatch layout
    arrivals: dict[str, float]  # what receiving a byte of each value from another stage costs
    kept: int  # microbatches of activations 1F1B keeps alive on it

    @cached_property
    def shape_key(self) -> tuple:
        """Equal keys, equal problems but for `kept`: the structure (names aside) and the group."""
        return structure_key(self.graph, self.micro, self.arrivals), repr(self.cluster.to_json())

    @property
    def key(self) -> tuple:
        """Equal keys, equal problems: the shape key and `kept`."""
        return self.shape_key, self.kept


def _settle(group: list[_StageInput], search, found: dict[int, Plan]) -> None:
    """The plans of stages of one structure (`shape_key`), `group` sorted by `kept` falling.

    Their problems differ only in the activations 1F1B keeps (`kept` multiplies them in the
    memory row; the costs do not depend on it), so a stage keeping fewer has every plan of one
    keeping more, and more: its best cost is at most the other's. When the stages keeping the
    most and the least have the same best cost, every stage between has it too, and the plan of
    the first fits them all: it is reused, its memory rescaled to each stage's `kept`. Otherwise
    the group is halved and each half settled so. A deep model's middle stages (all alike,
    keeping S - 1 down to 2 microbatches) are searched twice instead of S - 2 times."""
    first, last = group[0], group[-1]
    if first.index not in found:
        found[first.index] = search(first)
    top = found[first.index]
    if last.index not in found:
        found[last.index] = _reused(top, first, last) if last.kept == first.kept else search(last)
    low = found[last.index].best.solution.cost
    if low >= top.best.solution.cost * (1 - 1e-9):
        for st in group[1:-1]:
            found[st.index] = _reused(top, first, st)
        if low > top.best.solution.cost:  # its own search found a dearer plan (a heuristic's)
            found[last.index] = _reused(top, first, last)
        return
    if len(group) <= 2:
        return
    mid = len(group) // 2
    _settle(group[:mid + 1], search, found)
    _settle(group[mid:], search, found)


def stage_shares(graph: Graph, cluster: Cluster, stages: int) -> list[float] | None:
    """Each stage's share of the compute on a mixed cluster (`hetero.stage_capacity`, in
    `stage_order`); None on a homogeneous one (equal shares)."""
    if cluster.is_homogeneous:
        return None
    times = device_times(graph, cluster.device_types, floors=True)
    return stage_capacity(cluster, stages, stage_order(cluster, stages), times)


def _stage_inputs(graph: Graph, cluster: Cluster, a: StageAssignment, crossing: list[Boundary],
                  micro: Micro | None, m: int) -> Iterator[_StageInput]:
    """Each stage's subgraph, device group (stage s: the block `stage_order` gives it, devices
    b*N/S .. (b+1)*N/S - 1), microbatch layout, arrival prices and kept microbatches."""
    stages = a.count
    group = cluster.num_devices // stages
    blocks = stage_order(cluster, stages)
    ranks = [tuple(range(b * group, (b + 1) * group)) for b in blocks]
    for s in range(stages):
        g = stage_graph(graph, a, s, crossing)
        positions = a.nodes_of(s)
        yield _StageInput(s, ranks[s], g, positions, sub_cluster(cluster, blocks[s] * group, group),
                          micro.restricted(g, positions) if micro is not None else None,
                          _arrivals(cluster, crossing, ranks, s), min(stages - s, m))


def _reused(p: Plan, of: _StageInput, st: _StageInput) -> Plan:
    """Plan `p` of stage `of` for stage `st`, of the same structure (`_StageInput.shape_key`),
    with the memory of its node outputs rescaled to the microbatches `st` keeps."""
    model = renamed(p.best.model, st.graph, st.micro)
    if st.kept != of.kept:
        problem, sources = model.problem, len(model.sources)
        scale = st.kept / of.kept
        mem = tuple(m if i < sources else m * scale for i, m in enumerate(problem.mem))
        model = replace(model, problem=replace(problem, mem=mem))
    return replace(p, best=replace(p.best, model=model), time_s=0.0)


def _stage_hints(hints: Hints | None, g: Graph) -> Hints | None:
    """The hints a stage's SPMD search gets: scopes with a request, pins of its own tensors."""
    if hints is None:
        return None
    names = {v.name for v in g.values()}
    scopes = tuple(s for s in hints.scopes if s.request is not None)
    out = Hints(scopes, tuple(p for p in hints.pins if p.tensor in names), hints.default, hints.default_where,
                hints.source)
    return None if out.empty else out


def _predict(pp: PipelinePlan) -> None:
    """Per-stage times and memory, the 1F1B step and its bubble (module docstring)."""
    m, count = pp.micro_batches, len(pp.stages)
    routes, meshes = transfer_routes(pp), [tuple(st.plan.best.mesh.shape) for st in pp.stages]
    pieces = _pieces(pp.micro)
    for st in pp.stages:
        best = st.plan.best
        st.apply_s = optimizer_time(best.model, best.solution.choice)
        st.per_micro_s = max(best.solution.cost - _received_s(best.model, best.solution.choice) - st.apply_s, 0.0) / m
        st.send_s = _send_time(pp.cluster, pp.crossing, [s.ranks for s in pp.stages], st.index, m, routes, meshes,
                               pieces)
        st.memory_bytes = best.memory_bytes  # its search counted the microbatches 1F1B keeps (`kept`)
        st.params = int(sum(v.size for v in st.graph.input_constants if v.is_param))
        budget = stage_budget(pp.cluster, st.plan.cluster, pp.budget)
        if st.memory_bytes > budget * (1 + 1e-9):
            raise InfeasiblePlanError(
                f"pipeline stage {st.index} of {count} needs {st.memory_bytes / 2**30:.2f} GiB per device "
                f"({min(count - st.index, m)} microbatches of activations kept by 1F1B), the budget is "
                f"{budget / 2**30:.2f} GiB")
    pp.step_s, pp.bubble_s = one_f_one_b_time([st.per_micro_s + st.send_s for st in pp.stages],
                                              [st.apply_s for st in pp.stages], m)


def stage_budget(cluster: Cluster, group: Cluster, budget: float) -> float:
    """A stage's budget per device: the cluster's (the smallest device's, or --mem-limit of it)
    scaled to the group's smallest device."""
    return budget * group.min_memory / cluster.min_memory


def one_f_one_b_time(per_micro: list[float], apply_s: list[float], m: int) -> tuple[float, float]:
    """(step, bubble) of 1F1B over stages taking per_micro[s] per microbatch (sends included)
    and apply_s[s] for the optimizer (module docstring)."""
    slowest = max(per_micro)
    step = sum(per_micro) + (m - 1) * slowest + max(apply_s)
    return step, step - m * slowest - max(apply_s)


@dataclass(frozen=True)
class Route:
    """How a crossing value reaches one reading stage. `layout`: the reading stage's layout of
    it on its device axes (None: unknown, it travels whole). `shared`: the two stages' device
    meshes have the same shape, so the sending stage reshards to `layout` over its own links if
    it must and rank j sends rank j its shard; otherwise the sending stage holds the value whole
    and rank j mod |sender group| cuts receiver j's shard out of it and sends that."""

    layout: ShardSpec | None
    shared: bool


def transfer_routes(pp: PipelinePlan) -> dict[tuple[str, int], Route]:
    """(crossing value, reading stage) -> its Route (`_routes`)."""
    return _routes(pp.graph, pp.crossing, [tuple(st.plan.best.mesh.shape) for st in pp.stages],
                   [st.plan.decision.specs for st in pp.stages], pp.micro_batches > 1)


def _routes(graph: Graph, crossing: list[Boundary], meshes: list[tuple[int, ...]], specs: list[dict],
            timed: bool) -> dict[tuple[str, int], Route]:
    """Each crossing value's Route to each reading stage, from the reading stage's layout of it
    (`specs[stage]`: source name -> spec, time axis first when `timed`; for a tied weight's new
    value, the layout of the weight it replaces)."""
    from parc.passes.lower import bindings

    binds = bindings(graph)
    out: dict[tuple[str, int], Route] = {}
    for b in crossing:
        for d in b.dst:
            spec = specs[d].get(binds.get(b.name, b.name))
            layout = ShardSpec(tuple(spec)[1 if timed else 0:]) if spec is not None else None
            out[b.name, d] = Route(layout, layout is not None and meshes[d] == meshes[b.src])
    return out


def _pieces(micro: Micro | None) -> frozenset[str]:
    """The values split along the microbatches (each microbatch carries its piece; any other value
    is whole in every microbatch: a partial sum of an accumulated gradient, a replicated value)."""
    return frozenset(name for name, spec in micro.values if isinstance(spec[0], Split)) if micro else frozenset()


def _send_time(cluster: Cluster, crossing: list[Boundary], ranks: list[tuple[int, ...]], stage: int, m: int,
               layouts: dict[tuple[str, int], Route], meshes: list[tuple[int, ...]], pieces: frozenset[str]) -> float:
    """Seconds stage `stage` spends sending one microbatch's crossing values (their `Route`s):
    every receiver gets its shard, all senders at once (shared meshes: from its peer; else from
    sender j mod |group|, in ceil(|receivers| / |senders|) rounds). Streams that leave a node
    share its NICs."""
    total = 0.0
    src = ranks[stage]
    for b in crossing:
        if b.src != stage or b.phase == OPTIMIZER:
            continue
        piece = m if b.name in pieces else 1  # `_pieces`
        whole = int(np.prod(b.shape)) * _itemsize(b.dtype) / piece
        for d in b.dst:
            route, dst = layouts[b.name, d], ranks[d]
            per = whole if route.layout is None else int(np.prod(local_shape(
                b.shape, route.layout, meshes[d], (0,) * len(route.layout)))) * _itemsize(b.dtype) / piece
            rounds, streams = (1, len(src)) if route.shared else (-(-len(dst) // len(src)), min(len(src), len(dst)))
            link = p2p_link(cluster, src, dst, streams)
            total += rounds * send_recv_time(link, 2, per)
    return total


def p2p_link(cluster: Cluster, src: tuple[int, ...], dst: tuple[int, ...], streams: int) -> LinkSpec:
    """The link one of `streams` concurrent sends from group `src` to group `dst` sees: inside a
    node its link; between nodes the inter-node link, the node's NICs shared by its streams."""
    link = stage_link(cluster, src[0], dst[0])
    if cluster.node_of(src[0]) == cluster.node_of(dst[0]):
        return link
    node = cluster.nodes[cluster.node_of(src[0])]
    return shared_link(link, min(streams, len(node.devices)), node.nics)


def _arrivals(cluster: Cluster, crossing: list[Boundary], ranks: list[tuple[int, ...]], stage: int
              ) -> dict[str, float]:
    """Seconds per byte of receiving each value stage `stage` reads from another stage, every
    device of the sending group sending its peer at once (the SPMD search's `arrivals`: it then
    prefers layouts cheap to send; the prediction charges the transfer to the sender)."""
    return {b.name: 1.0 / p2p_link(cluster, ranks[b.src], ranks[stage], len(ranks[b.src])).bandwidth
            for b in crossing if stage in b.dst}


def _received_s(model: CostModel, choice) -> float:
    """The `arrivals` part of a solution's cost: its sources' (received values') costs."""
    return float(sum(model.problem.comp[k][choice[k]] for k in range(len(model.sources))))


def _with_even_split(pp: PipelinePlan, graph: Graph, cluster: Cluster, stages: int, even: StageAssignment,
                     level: str, budget: float, time_limit: float, jobs: int | None, max_mesh_dims: int,
                     hints: Hints | None, given: bool) -> PipelinePlan:
    """The faster of `pp` (stages cut by the groups' speeds) and the same pipeline with the
    stages cut for equal compute, with the other's figures as its `even-split` record."""
    try:
        other = _plan_at(graph, cluster, stages, pp.micro_batches, even, boundaries(graph, even), level, budget,
                         time_limit, jobs, max_mesh_dims, hints, given=True)
    except (InfeasiblePlanError, UsageError) as e:
        pp.even_split = {"step_time_s": None, "feasible": False, "stages": stages, "error": str(e),
                         "memory_bytes_per_device": None}
        return pp
    record = {"step_time_s": other.step_s, "feasible": True, "stages": stages, "micro_batches": other.micro_batches,
              "bubble_s": other.bubble_s, "memory_bytes_per_device": None}
    if other.step_s < pp.step_s:  # equal stages are faster here: the plan is the even split
        other.even_split = {**record, "step_time_s": other.step_s, "chosen": True}
        return other
    pp.even_split = record
    return pp


def pipeline_uniform(pp: PipelinePlan, time_limit: float = 60.0, max_mesh_dims: int = 2) -> dict:
    """The `pipeline-uniform` baseline of a pipelined plan, in the same cost model and with its
    stage count, microbatches and microbatch layout: `uniform_stages`, and on each stage's group
    the best of data parallel and Megatron TP x DP over its (dp, tp) grids."""
    from parc.passes.spmd.costs import build
    from parc.passes.spmd.search import flat_baseline, megatron_baseline
    from parc.solver import IlpOptions, SearchOptions

    graph, cluster, stages, m, budget = pp.graph, pp.cluster, len(pp.stages), pp.micro_batches, pp.budget
    options = SearchOptions(ilp=IlpOptions(time_limit=time_limit))
    a = uniform_stages(graph, cluster, stages)
    crossing = boundaries(graph, a)
    inputs = list(_stage_inputs(graph, cluster, a, crossing, pp.micro, m))
    chosen: list[tuple[dict, CostModel]] = []  # per stage: the recipe's best record and its model
    solved: dict[tuple, tuple[dict, CostModel] | None] = {}  # as plan_pipeline: equal stages once
    for st in inputs:
        if st.key not in solved:
            best = None
            for mesh in enumerate_meshes(st.cluster, max_dims=max_mesh_dims):
                if mesh.ndim == 2 and mesh.shape[1] not in (2, 4, 8) or mesh.ndim > 2:
                    continue
                model = build(st.graph, mesh, st.cluster, st.micro, arrivals=st.arrivals, kept=st.kept)
                r = (flat_baseline("data-parallel", model, budget, options) if mesh.ndim == 1
                     else megatron_baseline(model, budget, options))
                if r.get("feasible") and (best is None or r["step_time_s"] < best[0]["step_time_s"]):
                    best = (r, model)
            solved[st.key] = best
        if solved[st.key] is None:
            return {"step_time_s": None, "memory_bytes_per_device": None, "feasible": False, "stages": stages}
        r, model = solved[st.key]  # type: ignore[misc]
        chosen.append((r, model if model.graph is st.graph else renamed(model, st.graph, st.micro)))
    ranks = [st.ranks for st in inputs]
    meshes = [tuple(model.mesh.shape[1 if model.micro is not None else 0:]) for _, model in chosen]
    specs = [source_specs(model, r["choice"]) for r, model in chosen]
    routes, pieces = _routes(graph, crossing, meshes, specs, m > 1), _pieces(pp.micro)
    per = [max(r["step_time_s"] - _received_s(model, r["choice"]) - r["optimizer_s"], 0.0) / m
           + _send_time(cluster, crossing, ranks, s, m, routes, meshes, pieces) for s, (r, model) in enumerate(chosen)]
    apply_s = [r["optimizer_s"] for r, _ in chosen]
    step, bubble = one_f_one_b_time(per, apply_s, m)
    return {"step_time_s": step, "feasible": True, "stages": stages, "micro_batches": m, "bubble_s": bubble,
            "stage_meshes": [list(x) for x in meshes], "memory_bytes_per_device": None}
