"""plan: search every device mesh (Rhino 3) and keep the cheapest SPMD plan, with baselines.

For each mesh of `enumerate_meshes` (1-D to 3-D) the graph's cost model (`costs.build`) becomes
a solver Problem with the per-device memory budget, solved at O2 or O3; the mesh with the
lowest predicted step time wins. The meshes are searched in parallel processes (`pool.run_jobs`).
Baselines are solved in the same cost model with their layouts pinned: `data-parallel` (data
inputs split on their first dim over the whole device set, parameters and optimizer state
replicated), `zero-3` (the same with parameters and state split on their largest divisible
dim) and `megatron-tpN` on each 2-D (dp, N) mesh, N in 2/4/8 (every parameter-reading node
splits a parameter over the tp axis), so every plan says how it compares.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from parc.cluster import Cluster, Mesh, enumerate_meshes
from parc.cluster.work import of_graph
from parc.errors import InfeasiblePlanError, UsageError
from parc.hints import Hints, IneligibleMeshError, check_mesh, warn_once
from parc.ir.graph import Graph
from parc.ir.state import FORWARD, OPTIMIZER, bindings, phase
from parc.passes.record import step_roles, tensors
from parc.passes.schedule import SCHEDULES
from parc.passes.spmd.costs import CostModel, Micro, build, even_choice, micro_layout, per_device
from parc.passes.spmd.decision import Decision
from parc.passes.spmd.follow import model_grouping
from parc.passes.spmd.mesh_search import (
    from_baseline,
    needs_polish,
    needs_second,
    pruned,
    raced,
    search_plan,
    second_plan,
)
from parc.passes.spmd.pins import hint_pins
from parc.passes.spmd.pool import SharedMinimum, run_jobs
from parc.plandir import plan as plan_format
from parc.report.units import fmt_bytes
from parc.sharding import R, S, ShardSpec
from parc.solver import IlpOptions, Problem, SearchOptions, Solution
from parc.solver.problem import MemoryBudgetError, relative_gap

log = logging.getLogger("parc.plan")


@dataclass
class MeshResult:
    """The best plan on one mesh."""

    mesh: Mesh
    model: CostModel
    solution: Solution

    @property
    def compute_s(self) -> float:
        p, x = self.model.problem, self.solution.choice
        return float(sum(p.comp[i][x[i]] for i in range(p.n)))

    @property
    def comm_s(self) -> float:
        # the cost less its compute: round-off of a plan without communication is not -1e-18 s
        return max(0.0, self.solution.cost - self.compute_s)

    @property
    def memory_bytes(self) -> float:
        p, x = self.model.problem, self.solution.choice
        return float(sum(p.mem[i][x[i]] for i in range(p.n))) if p.mem else 0.0


@dataclass
class Plan:
    """What `parc plan` decided; `to_json` is plan.json (keys in docs/plan.md)."""

    best: MeshResult
    level: str
    cluster: Cluster
    budget: float
    tried: list[dict] = field(default_factory=list)
    baselines: dict[str, dict] = field(default_factory=dict)
    time_s: float = 0.0
    hints: Hints | None = None

    @property
    def decision(self) -> Decision:
        """What was chosen on the best mesh, apart from the cost model (`Decision`)."""
        return Decision.of(self.best.model, self.best.solution.choice)

    def communication(self) -> list[dict]:
        return _edge_collectives(self.best.model, self.best.solution.choice)

    def to_json(self) -> dict:
        """plan.json's contents (`to_plan`'s document)."""
        return self.to_plan().to_json()

    def to_plan(self) -> plan_format.Plan:
        """The plan as plan.json records it (`parc.plandir.plan`): one stage on the best mesh."""
        m = self.best.model
        x = self.best.solution.choice
        d = self.decision
        cut = 1 if m.micro is not None else 0  # the microbatch axis is reported apart
        specs, time_specs = {}, {}
        for name, spec in d.specs.items():
            specs[name], time_specs[name] = _device_part(spec, cut), str(spec[0])
        strategies, time_labels = {}, {}
        for n, s in zip(m.graph.nodes, d.strategies, strict=True):
            strategies[n.name] = "x".join(label or "-" for label in s.labels[cut:])
            time_labels[n.name] = s.labels[0] or "-"
            for v, spec in zip(n.outputs, s.outputs):
                if v.name:
                    specs[v.name], time_specs[v.name] = _device_part(spec, cut), str(spec[0])
        mem = [self.best.memory_bytes] * self.best.mesh.num_devices
        devices = {}
        if m.balance is not None:
            compute, mem = per_device(m, x)
            devices = {"devices": [d.name for d in m.balance.devices], "compute_s_per_device": compute,
                       "memory_budget_bytes_per_device": list(m.balance.budgets)}
        micro = None if m.micro is None else {
            "count": m.micro.count, "specs": time_specs, "strategies": time_labels}
        roles = step_roles(m.graph)
        mesh = self.best.mesh
        solver = {"status": self.best.solution.status, "gap": self.best.solution.gap}
        stage = plan_format.Stage(
            id=0, devices=mesh.devices, mesh=mesh.shape, device_types=sorted({self.cluster.devices[r].name
                                                                             for r in mesh.devices}),
            nodes=len(m.graph.nodes), step_time_s=self.best.solution.cost, memory_bytes_per_device=max(mem),
            parameters=sum(v.size for v in m.sources if v.is_param), specs=specs, solver=solver)
        return plan_format.Plan(
            cluster=self.cluster, mesh=plan_format.MeshLayout.from_json(mesh.to_json()), stages=(stage,),
            schedule=plan_format.Schedule(SCHEDULES[0], m.micro.count if m.micro is not None else 1),
            specs=specs, strategies=strategies,
            phases={n.name: phase(n) for n in m.graph.nodes if phase(n) != FORWARD},
            predicted=plan_format.Prediction(self.best.solution.cost, self.best.compute_s, self.best.comm_s, mem,
                                             self.budget, per_device=devices),
            baselines={k: plan_format.Baseline.from_json(v) for k, v in self.baselines.items()},
            tensors=tensors(m.graph, m.sources + [v for n in m.graph.nodes for v in n.outputs], roles),
            step=roles,
            solver={"level": self.level, "time_s": self.time_s, "gap": self.best.solution.gap,
                    "gap_over_meshes": gap_over_meshes(self.best.solution.cost, self.tried),
                    "status": self.best.solution.status, "nodes": m.problem.n, "meshes": self.tried},
            communication=tuple(self.communication()), micro=micro,
            balance=m.balance.report if m.balance is not None else None,
            hints=self.hints.to_json() if self.hints is not None else None)


def gap_over_meshes(cost: float, tried: list[dict]) -> float | None:
    """How much faster than `cost` any plan on any mesh tried can be, relative: (cost - the
    least lower bound over the meshes) / cost. A mesh whose bound is above the plan adds
    nothing, however far its own plan is from its optimum, and neither does one skipped by the
    hints or whose least-memory choice does not fit. None when a mesh has no bound (a search
    that found no plan without proving that none fits, or a plan without a proven bound)."""
    lower = cost
    for t in tried:
        if t.get("skipped") or (not t.get("feasible") and t.get("proven")):
            continue
        if t.get("lower_bound_s") is None:
            return None
        lower = min(lower, t["lower_bound_s"])
    return relative_gap(cost, lower)


def _device_part(spec: ShardSpec, cut: int) -> str:
    return str(ShardSpec(tuple(spec)[cut:])) if cut else str(spec)


def _edge_collectives(model: CostModel, x: np.ndarray) -> list[dict]:
    """The resharding each chosen edge needs: value, layouts, collectives, bytes, seconds."""
    out = []
    g = model.graph
    src_of = {id(v): model.source_specs[k][x[k]] for k, v in enumerate(model.sources)}
    for pos, n in enumerate(g.nodes):
        s = model.strategies[pos][x[model.node_index(pos)]]
        for v, spec in zip(n.outputs, s.outputs):
            src_of[id(v)] = spec
    for pos, n in enumerate(g.nodes):
        s = model.strategies[pos][x[model.node_index(pos)]]
        for i, v in enumerate(n.inputs):
            if v is None or s.inputs[i] is None or id(v) not in src_of:
                continue
            entry = _entry(model, v, v.name, n.name, src_of[id(v)], s.inputs[i], n)
            if entry:
                out.append(entry)
    out.extend(_binding_collectives(model, x, src_of))
    return out


def _binding_collectives(model: CostModel, x: np.ndarray, layout: dict[int, ShardSpec]) -> list[dict]:
    """A training step's new parameters and state, resharded back to their inputs' layout."""

    binds = bindings(model.graph.metadata)
    if not binds:
        return []
    outputs = {v.name: v for v in model.graph.outputs}
    sources = {v.name: k for k, v in enumerate(model.sources)}
    out = []
    for out_name, in_name in sorted(binds.items()):
        v = outputs.get(out_name)
        if v is None or id(v) not in layout or in_name not in sources:
            continue
        entry = _entry(model, v, out_name, f"next step: {in_name}", layout[id(v)],
                       model.source_specs[sources[in_name]][x[sources[in_name]]])
        if entry:
            out.append(entry)
    return out


def _entry(model: CostModel, v, value: str, consumer: str, a: ShardSpec, b: ShardSpec,
           node=None) -> dict | None:
    """One communication record: the collectives turning layout a of v into b, and their time
    as the cost model charges it (gradient syncs bucketed; per-microbatch moves M times).

    With microbatches, mesh axis 0 is time: its all-reduce is the local accumulation of the
    microbatches' gradients ("accumulate", axis "microbatch"); the device axes count from 0."""
    from parc.ir.state import is_gradient_sync
    from parc.passes.spmd.costs import reshard_time
    from parc.sharding import reshard

    if a == b:
        return None
    steps = [c for c in reshard(a, b, v.shape, v.dtype.itemsize, model.mesh.shape) if not c.is_local]
    if not steps:
        return None
    cut = 1 if model.micro is not None else 0
    runs = model.micro.count if cut and node is not None and phase(node) != OPTIMIZER else 1
    buckets = model.buckets if node is not None and is_gradient_sync(v, node) else ()
    return {"value": value, "consumer": consumer, "from": _device_part(a, cut), "to": _device_part(b, cut),
            "collectives": [{"kind": "accumulate" if cut and c.axis == 0 else c.kind,
                             "axis": "microbatch" if cut and c.axis == 0 else c.axis - cut,
                             "bytes_per_device": c.bytes_per_device} for c in steps],
            "runs": runs,
            "time_s": runs * reshard_time(a, b, v.shape, v.dtype.itemsize, model.mesh, buckets)}


@dataclass(frozen=True)
class _MeshJobs:
    """What every job of one search shares."""

    cluster: Cluster
    level: str
    budget: float
    options: SearchOptions
    hints: Hints | None
    micro: Micro | None = None
    arrivals: dict[str, float] | None = None  # a pipeline stage's received values (costs.build)
    kept: int = 1  # microbatches of activations alive at once (costs.build)
    # the cheapest plan found so far on any mesh (plans, and baselines when no hints pin): a mesh
    # whose proven bound is above it skips the work that could only improve its own plan
    best: SharedMinimum = field(default_factory=SharedMinimum)


@dataclass(frozen=True)
class _Job:
    """Build a mesh's cost model ("build"), or solve in it its plan ("plan"), its parameter-led
    plan ("second": `second_plan`), its plan polished from a baseline's ("polish":
    `from_baseline`, `start` the baseline's name and choice) or a baseline (the baseline's
    name; without a model the job builds one first)."""

    what: str
    mesh: Mesh
    model: CostModel | None = None
    pins: dict[int, tuple[int, ...]] = field(default_factory=dict)
    start: tuple[str, np.ndarray] | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        what = {"build": "the cost model", "plan": "the plan search", "second": "the parameter-led plan search",
                "polish": "the polish of a baseline's plan"}.get(self.what, f"the {self.what} baseline")
        return f"{what} of mesh {self.mesh.shape}"


@dataclass
class _Built:
    """A "build" job's outcome: the cost model and the hints' pins, or why the mesh is skipped."""

    model: CostModel | None
    pins: dict[int, tuple[int, ...]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    skipped: str | None = None


def _pinned_layouts(hints: Hints | None, mesh_shape: tuple[int, ...]) -> dict[str, list[ShardSpec]]:
    """Pinned layouts a source may then take (uneven splits are offered only when pinned)."""
    out: dict[str, list[ShardSpec]] = {}
    for pin in hints.pins if hints is not None else ():
        if len(pin.spec) == len(mesh_shape) and pin.mesh in (None, tuple(mesh_shape)):
            out.setdefault(pin.tensor, []).append(pin.spec)
    return out


@dataclass(frozen=True)
class _NoPlan:
    """Why a mesh's search found no plan under the budget; `proven` when no choice can fit (its
    least-memory choice exceeds the budget), so the mesh holds no better plan."""

    message: str
    proven: bool


def _run(search: _MeshJobs, graph: Graph, job: _Job) -> _Built | Solution | _NoPlan | dict:
    """One job: a _Built, a plan's Solution (or why none fits), or a baseline's record."""
    t0 = time.perf_counter()
    try:
        return _job(search, graph, job)
    finally:
        log.info("mesh %s: %s took %.1f s", job.mesh.shape, job.what, time.perf_counter() - t0)


def _job(search: _MeshJobs, graph: Graph, job: _Job) -> _Built | Solution | _NoPlan | dict:
    mesh, model = job.mesh, job.model
    if job.what == "build":
        try:
            if search.hints is not None:
                check_mesh(graph, search.hints, mesh.shape)  # before the (slow) cost model
            model = build(graph, mesh, search.cluster, search.micro, _pinned_layouts(search.hints, mesh.shape),
                          search.arrivals, search.kept)
            model_grouping(model)  # once here, not in each of the plan's and baselines' jobs (it travels with the model)
            if search.hints is None:
                return _Built(model)
            pins, warnings = hint_pins(model, search.hints)
            return _Built(model, pins, warnings)
        except IneligibleMeshError as e:
            return _Built(model, skipped=str(e))
    model = model if model is not None else build(graph, mesh, search.cluster, search.micro,
                                                  _pinned_layouts(search.hints, mesh.shape), search.arrivals,
                                                  search.kept)
    if job.what in ("plan", "second", "polish"):
        problem = (model.problem.restricted(job.pins) if job.pins else model.problem).with_budget(search.budget)
        if job.what == "second":
            return second_plan(model, problem, search.options)
        if job.what == "polish":
            name, start = job.start  # type: ignore[misc]
            return from_baseline(model, problem, start, search.options, name=name)
        try:
            sol = search_plan(model, problem, search.level, search.options, incumbent=search.best)
        except InfeasiblePlanError as e:
            return _NoPlan(f"mesh {mesh.shape}: {e}", proven=isinstance(e, MemoryBudgetError))
        search.best.offer(sol.cost)
        return sol
    if job.what.startswith("megatron"):
        record = megatron_baseline(model, search.budget, search.options)  # at O2 (its docstring)
    else:
        record = flat_baseline(job.what, model, search.budget, search.options, search.level)
    if search.hints is None and record["feasible"]:  # a plan of the search's own problem
        search.best.offer(record["step_time_s"])
    return record


def _baseline_names(mesh: Mesh) -> list[str]:
    """The baselines solved on `mesh`: data parallel and ZeRO-3 on the flat mesh, Megatron on a
    (dp, tp) mesh with tp in 2/4/8."""
    if mesh.ndim == 1:
        return ["data-parallel", "zero-3"]
    if mesh.ndim == 2 and mesh.shape[1] in (2, 4, 8):
        return [f"megatron-tp{mesh.shape[1]}"]
    return []


def plan_graph(graph: Graph, cluster: Cluster, *, level: str = "O3", memory_budget: float | None = None,
               max_mesh_dims: int = 2, progress: Callable[[str, int, int], None] | None = None,
               time_limit: float = 60.0, hints: Hints | None = None, jobs: int | None = None,
               micro_batches: int = 1, micro: Micro | None = None, with_baselines: bool = True,
               arrivals: dict[str, float] | None = None, kept: int = 1) -> Plan:
    """The cheapest plan over the cluster's meshes; raises InfeasiblePlanError if none fits.

    Jobs run in up to `jobs` processes (default: one per CPU, at most one per job; 1: in this
    process): per mesh, the cost model, then its plan and baselines side by side. The plan does
    not depend on `jobs`. `progress(what, done, total)` is called as each job is done.

    `micro_batches` M > 1 plans the step as M microbatches with gradient accumulation: the
    layout along time is decided once (`costs.micro_layout`), then every mesh is searched with
    it as a leading mesh axis (`costs.Micro`); `micro` gives that layout instead (a pipeline
    stage's part of the whole graph's). `with_baselines=False` solves no baselines. `arrivals`:
    a pipeline stage's received values and what receiving a byte of each costs; `kept`: the
    microbatches of activations it keeps alive at once (costs.build)."""
    t0 = time.perf_counter()
    budget = float(memory_budget if memory_budget is not None else min(d.memory_bytes for d in cluster.devices))
    if micro_batches < 1:
        raise UsageError(f"--micro-batches {micro_batches}: expected a count >= 1")
    if micro is None and micro_batches > 1:
        micro = micro_layout(graph, cluster, micro_batches)
    names = _baseline_names if with_baselines else (lambda mesh: [])
    search = _MeshJobs(cluster, level, budget, SearchOptions(ilp=IlpOptions(time_limit=time_limit)), hints, micro,
                     arrivals, kept)
    meshes = enumerate_meshes(cluster, max_dims=max_mesh_dims)
    total = sum(2 + len(names(m)) for m in meshes)  # jobs: build, plan, baselines
    if jobs is None:
        jobs = min(os.cpu_count() or 1, total)
    if jobs < 1:
        raise UsageError(f"jobs {jobs}: expected at least 1 process")
    outcome: dict[tuple[str, Mesh], Any] = {}
    races = _Races(meshes, outcome, names)

    def then(job: _Job, out: Any) -> list[_Job]:
        outcome[job.what, job.mesh] = out
        more: list[_Job] = []
        if job.what == "build" and out.model is not None and out.skipped is None:
            # The baselines run beside the plan, even if no mesh turns out to have one (then unused).
            more = [_Job("plan", job.mesh, out.model, out.pins)]
        if job.what == "build" and out.model is not None:
            more += [_Job(name, job.mesh, out.model) for name in names(job.mesh)]
        due = races.settle() if job.what not in ("second", "polish") else []
        if progress is not None:
            what = {"build": "cost model", "second": "parameter-led plan",
                    "polish": "polished baseline"}.get(job.what, job.what)
            progress(f"mesh {job.mesh}: {what} done", races.counted(), total + len(races.needed))
        return more + [d for d in due if (d.what, d.mesh) not in outcome]

    for device in {d.name: d for d in cluster.devices}.values():  # the workers inherit the nodes' work
        of_graph(graph, device)
    run_jobs(partial(_run, search), graph, [_Job("build", m) for m in meshes], jobs, then,
             spare=races.spare)
    for key, out in outcome.items():  # the bytes a model travelled in are not needed any more
        if key[0] == "build" and out.model is not None:
            out.model.__dict__.pop("_pool_blob", None)
    for what, mesh in races.needed:  # the first plan raced against the parameter-led one, a polished baseline
        first, alt = outcome["plan", mesh], outcome[what, mesh]
        how = "parameter-led" if what == "second" else f"from {races.jobs[what, mesh].start[0]}"  # type: ignore[index]
        log.info("mesh %s: %s plan %s against %.6g s", mesh.shape, how,
                 "none" if alt is None else f"{alt.cost:.6g} s", first.cost)
        outcome["plan", mesh] = raced(first, alt, how)
    results, tried, failures, skipped, warned = [], [], [], [], set()
    for mesh in meshes:  # in mesh order, as the serial loop logged
        built, sol = outcome["build", mesh], outcome.get(("plan", mesh))
        if built.skipped is not None:
            skipped.append(f"mesh {mesh}: {built.skipped}")
            tried.append({"shape": list(mesh.shape), "feasible": False, "skipped": built.skipped})
            log.info("mesh %s: skipped: %s", mesh.shape, built.skipped)
            continue
        warn_once(built.warnings, warned)
        sol = _no_worse_than_baselines(sol, built.pins, {name: outcome.get((name, mesh)) for name in names(mesh)})
        if isinstance(sol, _NoPlan):
            failures.append(sol.message)
            tried.append({"shape": list(mesh.shape), "feasible": False, "proven": sol.proven})
            continue
        results.append(MeshResult(mesh, built.model, sol))
        tried.append({"shape": list(mesh.shape), "feasible": True, "step_time_s": sol.cost, "gap": sol.gap,
                      "lower_bound_s": sol.lower_bound if math.isfinite(sol.lower_bound) else None})
        log.info("mesh %s: %.6g s (%s)", mesh.shape, sol.cost, sol.status)
    if not results:
        if skipped and not failures:
            raise UsageError("no mesh satisfies the hints: " + "; ".join(skipped))
        raise InfeasiblePlanError(_infeasible_message(graph, budget, failures + skipped, cluster))
    cheapest = min(r.solution.cost for r in results)
    # ties (within solver noise) go to the mesh with fewer axes, the first in mesh order
    best = next(r for r in sorted(results, key=lambda r: r.mesh.ndim)
                if r.solution.cost <= cheapest * (1 + 1e-6))
    plan = Plan(best, level, cluster, budget, tried, hints=hints)
    # Baselines of the meshes the hints skipped before building a cost model: build one now.
    late = [_Job(name, m) for m in meshes for name in names(m) if (name, m) not in outcome]
    for job, out in zip(late, run_jobs(partial(_run, search), graph, late, jobs)):
        outcome[job.what, job.mesh] = out
    plan.baselines = {name: {k: v for k, v in outcome[name, m].items() if k != "choice"}
                      for m in meshes for name in names(m)}
    if best.model.balance is not None and best.model.balance.any_uneven:
        record, even = even_split(graph, cluster, best, budget)
        plan.baselines["even-split"] = record
        if record["feasible"] and record["step_time_s"] < best.solution.cost:
            log.info("mesh %s: equal shares predict %.6g s against %.6g s balanced: the plan takes them",
                     best.mesh.shape, record["step_time_s"], best.solution.cost)
            plan.best = even
    plan.time_s = time.perf_counter() - t0
    return plan


class _Races:
    """Second chances for each mesh's first plan, raced against it: the parameter-led plan
    ("second", when `needs_second`) and the mesh's cheapest baseline polished ("polish", when
    `needs_polish`). Decided once every mesh's first plan and baselines are in, against the
    cheapest first plan: so the plan does not depend on which jobs finish first, nor on `jobs`.
    A worker with nothing else to do runs them before that (`spare`): neither depends on the
    first plan."""

    def __init__(self, meshes: list[Mesh], outcome: dict[tuple[str, Mesh], Any],
                 names: Callable[[Mesh], list[str]]) -> None:
        self.meshes = meshes
        self.outcome = outcome  # plan_graph's: the builds' models, the first plans, the baselines
        self.names = names
        self.jobs: dict[tuple[str, Mesh], _Job] = {}  # each race's job, once asked for
        self.needed: list[tuple[str, Mesh]] = []
        self.decided = False

    def settle(self) -> list[_Job]:
        """After a build, a first plan or a baseline: the races needed, once all of them are in."""
        if self.decided or not all(self._in(mesh) for mesh in self.meshes):
            return []
        self.decided = True
        firsts = {m: sol for (what, m), sol in self.outcome.items() if what == "plan" and isinstance(sol, Solution)}
        best = min((sol.cost for sol in firsts.values()), default=math.inf)
        for mesh, sol in firsts.items():
            if needs_second(sol, best) and model_grouping(self.outcome["build", mesh].model) is not None:
                self.needed.append(("second", mesh))
            if needs_polish(sol, best) and self._start(mesh) is not None:
                self.needed.append(("polish", mesh))
        return [self._job(*race) for race in self.needed]

    def spare(self) -> _Job | None:
        """A race for an idle worker, or None: of a mesh whose first plan is in and not proven
        close on its own (the decision against the other meshes may still drop it). A spare job
        occupies its worker until it ends, so none is guessed for a mesh still being searched:
        a needed job would wait behind it."""
        if self.decided:
            return None
        for (what, mesh), first in self.outcome.items():
            if what != "plan" or not isinstance(first, Solution):
                continue
            if ("polish", mesh) not in self.jobs and needs_polish(first) and self._in(mesh) \
                    and self._start(mesh) is not None:  # every baseline in: the start is the decision's
                return self._job("polish", mesh)
            if ("second", mesh) not in self.jobs and needs_second(first) \
                    and model_grouping(self.outcome["build", mesh].model) is not None:
                return self._job("second", mesh)
        return None

    def counted(self) -> int:
        """Jobs done, for the progress bar: the races only once needed."""
        return sum(1 for key in self.outcome if key[0] not in ("second", "polish") or key in self.needed)

    def _in(self, mesh: Mesh) -> bool:
        """The mesh's first plan and baselines are in (or it has none)."""
        built = self.outcome.get(("build", mesh))
        if built is None:
            return False
        if built.model is None:
            return True
        return (built.skipped is not None or ("plan", mesh) in self.outcome) and \
            all((name, mesh) in self.outcome for name in self.names(mesh))

    def _start(self, mesh: Mesh) -> tuple[str, np.ndarray] | None:
        """The mesh's cheapest feasible baseline obeying the hints' pins (`_cheapest_baseline`,
        as `_no_worse_than_baselines` takes it): its name and choice, among those in."""
        best = _cheapest_baseline(self.outcome["build", mesh].pins,
                                  {name: self.outcome.get((name, mesh)) for name in self.names(mesh)})
        return None if best is None else (best[1], best[2])

    def _job(self, what: str, mesh: Mesh) -> _Job:
        """The race's job: the same object each time, so that a spare run of it counts."""
        if (what, mesh) not in self.jobs:
            built = self.outcome["build", mesh]
            self.jobs[what, mesh] = _Job(what, mesh, built.model, built.pins,
                                         self._start(mesh) if what == "polish" else None)
        return self.jobs[what, mesh]


def even_split(graph: Graph, cluster: Cluster, best: MeshResult, budget: float) -> tuple[dict, MeshResult]:
    """The plan's own strategy with equal shares on its mixed mesh (Whale's even split): its
    baseline record, and it as a plan (kept when faster: small models, where launch floors and
    uneven collectives outweigh the balance). Costs per device as the plan's."""
    even = build(graph, best.mesh, cluster, even=True)
    x = even_choice(best.model, even, best.solution.choice)
    p = even.problem
    mem = p.memory(x) if p.mem else 0.0
    cost = p.cost(x)
    lower = min(best.solution.lower_bound, p.trivial_bound(), cost)  # a bound on the better of the two
    sol = Solution(x, cost, lower, relative_gap(cost, lower), "heuristic", 0.0, f"{best.solution.method}+even")
    record = {"step_time_s": cost, "memory_bytes_per_device": mem, "feasible": mem <= budget * (1 + 1e-9),
              "optimizer_s": optimizer_time(even, x)}
    return record, MeshResult(best.mesh, even, sol)


def _no_worse_than_baselines(sol: Solution | _NoPlan | None, pins: dict[int, tuple[int, ...]],
                             records: dict[str, dict | None]) -> Solution | _NoPlan | None:
    """A mesh's plan, or the cheapest baseline solved on the same mesh when that is cheaper.

    A baseline is a pinned instance of the mesh's problem, so a feasible one (within the budget,
    obeying the hints' pins) is a feasible point of the search: the search must never return
    worse. It can (an ILP stopped at its time limit with a large gap, O2's segments solved
    apart); then the baseline's choice is kept, with the search's lower bound."""
    best = _cheapest_baseline(pins, records)
    if best is None or (isinstance(sol, Solution) and sol.cost <= best[0]):
        return sol
    cost, name, choice = best
    lower = sol.lower_bound if isinstance(sol, Solution) else -math.inf
    gap = relative_gap(cost, min(lower, cost))
    log.info("the search's plan (%s) is worse than the %s baseline's (%.6g s): keeping the baseline's",
             f"{sol.cost:.6g} s" if isinstance(sol, Solution) else "none", name, cost)
    status = "optimal" if gap == 0 else "time_limit" if math.isfinite(lower) else "heuristic"
    return Solution(choice, cost, min(lower, cost), gap, status,
                    sol.time_s if isinstance(sol, Solution) else 0.0, f"baseline:{name}")


def _cheapest_baseline(pins: dict[int, tuple[int, ...]], records: dict[str, dict | None]
                       ) -> tuple[float, str, np.ndarray] | None:
    """(step seconds, name, choice) of the cheapest feasible baseline among `records` whose
    choice obeys the hints' `pins`; None if none (or none is in yet)."""
    best: tuple[float, str, np.ndarray] | None = None
    for name, rec in records.items():
        if not rec or not rec.get("feasible") or rec.get("choice") is None:
            continue
        choice = np.asarray(rec["choice"])
        if any(int(choice[i]) not in allowed for i, allowed in pins.items()):
            continue
        if best is None or rec["step_time_s"] < best[0]:
            best = (float(rec["step_time_s"]), name, choice)
    return best


def flat_baseline(name: str, model: CostModel, budget: float, options: SearchOptions | None = None,
                  level: str = "O3") -> dict:
    """`data-parallel` (data split on dim 0, parameters and state replicated) or `zero-3` (the
    same with parameters and state split on their largest divisible dim) on the flat mesh.
    The record holds the solution's `choice` (the plan search may keep it; plan.json does not).
    It is solved as the plan is at `level` (`search_plan`: at O2 a training step's backward
    follows its forward, as Megatron's and DDP's backward does by construction)."""
    param_spec = {"data-parallel": _replicate, "zero-3": _largest_split}[name]
    micro = model.micro
    devices = model.mesh if micro is None else _device_mesh(model.mesh)
    pins = {}
    for k, v in enumerate(model.sources):
        want = param_spec(v, devices) if v.is_const else _batch_split(v, devices, micro)
        if micro is not None:
            want = ShardSpec((micro.sources[k][0], *want))  # type: ignore[index]
        specs = model.source_specs[k]
        if want in specs:
            pins[k] = (specs.index(want),)
    if name == "data-parallel":  # the optimizer runs whole on every device
        for pos, n in enumerate(model.graph.nodes):
            if phase(n) == OPTIMIZER:
                whole = tuple(j for j, s in enumerate(model.strategies[pos]) if s.labels[-1] is None)
                if whole:
                    pins[model.node_index(pos)] = whole
    p: Problem = model.problem.restricted(pins)
    try:
        sol = search_plan(model, p, level, pruned(options or SearchOptions()), exact_columns=0, refine_steps=0,
                          prove=False)
    except InfeasiblePlanError:
        return {"step_time_s": None, "memory_bytes_per_device": None, "feasible": False}
    mem = float(sum(p.mem[i][sol.choice[i]] for i in range(p.n))) if p.mem else 0.0
    return {"step_time_s": sol.cost, "memory_bytes_per_device": mem, "feasible": mem <= budget, "gap": sol.gap,
            "optimizer_s": optimizer_time(model, sol.choice), "choice": sol.choice}


def optimizer_time(model: CostModel, choice) -> float:
    """The compute seconds of a solution's optimizer nodes (they run once per step)."""
    p = model.problem
    return float(sum(p.comp[model.node_index(pos)][choice[model.node_index(pos)]]
                     for pos, n in enumerate(model.graph.nodes) if phase(n) == OPTIMIZER))


def megatron_baseline(model: CostModel, budget: float, options: SearchOptions, level: str = "O2") -> dict:
    """Megatron TP x DP on a (dp, tp) mesh: every node that reads a parameter splits one over the
    tp axis (the solver then picks column- or row-parallel, as Megatron's recipe does), the
    rest is chosen freely (data parallel on the dp axis). The record holds `choice`, and is
    solved at `level`, as in flat_baseline: O2 unless asked, at every level of the plan. Its
    exact ILP on a 2-D mesh is a long LP, a large part of O3's work, for a reference barely
    lower (docs/plan.md; benchmarks/LOG.md, 2026-11-26, issues 11 and 12); the flat baselines'
    ILPs are short and are solved at the plan's level."""
    from parc.hints import Request, Scope

    tp = model.mesh.shape[-1]
    hints = Hints(scopes=(Scope(".", Request("split", tp), "<megatron baseline>"),))
    try:
        pins, _ = hint_pins(model, hints)
        p = model.problem.restricted(pins)
        sol = search_plan(model, p, level, pruned(options), exact_columns=0, refine_steps=0, prove=False)
    except (IneligibleMeshError, InfeasiblePlanError):
        return {"step_time_s": None, "memory_bytes_per_device": None, "feasible": False,
                "mesh": list(model.mesh.shape[1 if model.micro is not None else 0:])}
    mem = float(sum(p.mem[i][sol.choice[i]] for i in range(p.n))) if p.mem else 0.0
    return {"step_time_s": sol.cost, "memory_bytes_per_device": mem, "feasible": mem <= budget,
            "mesh": list(model.mesh.shape[1 if model.micro is not None else 0:]), "gap": sol.gap,
            "optimizer_s": optimizer_time(model, sol.choice), "choice": sol.choice}


def _replicate(v, mesh: Mesh) -> ShardSpec:
    return ShardSpec((R,) * len(mesh.shape))


def _largest_split(v, mesh: Mesh) -> ShardSpec:
    n = mesh.shape[0]
    dims = [d for d in np.argsort(v.shape)[::-1] if v.shape[d] % n == 0] if v.shape else []
    return ShardSpec((S(int(dims[0])),)) if dims and len(mesh.shape) == 1 else _replicate(v, mesh)


def _batch_split(v, mesh: Mesh, micro: Micro | None = None) -> ShardSpec:
    count = micro.count if micro is not None else 1  # the devices split one microbatch
    if v.shape and len(mesh.shape) == 1 and v.shape[0] % (mesh.shape[0] * count) == 0:
        return ShardSpec((S(0),))
    return _replicate(v, mesh)


def _device_mesh(mesh: Mesh) -> Mesh:
    """A microbatch model's mesh without its time axis."""
    n = int(np.prod(mesh.shape[1:]))
    return Mesh(mesh.shape[1:], tuple(range(n)), mesh.links[1:], mesh.spans_nodes[1:])


def _infeasible_message(graph: Graph, budget: float, failures: list[str], cluster: Cluster | None = None) -> str:
    params = sorted((v for v in graph.constants.values() if v.is_const), key=lambda v: -v.nbytes)[:3]
    largest = ", ".join(f"{v.name} ({fmt_bytes(v.nbytes)})" for v in params)
    where = f"{fmt_bytes(budget)} per device"
    if cluster is not None and not cluster.is_homogeneous:  # each type's own budget (even balanced)
        where = ", ".join(f"{fmt_bytes(budget * d.memory_bytes / cluster.min_memory)} per {d.name}"
                          for d in sorted(cluster.device_types, key=lambda d: d.memory_bytes))
        where += " (balanced by speed and memory)"
    return (f"no mesh fits {where}; largest tensors: {largest}; "
            f"{failures[0] if failures else ''}")
