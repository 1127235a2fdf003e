"""The planner's driver: which searches a plan takes, and which of their plans wins.

`PlanSearch.on(cluster)` runs the one-mesh SPMD search (`spmd.search.plan_graph`) and the
pipelines `--pipeline` asks for (`pipeline.plan.plan_pipeline`: the stage count given, one
stage per node under auto, more and smaller stages when nothing fits), keeps the fastest, and
searches the pipeline again on the uniform cut when its own `pipeline-uniform` baseline beats
it. `idle_slower` then tries, on a mixed cluster, the plan on the faster nodes alone (Whale's
hardware-aware placement taken one step further: a device that slows the step is left idle).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from parc.cluster import Cluster
from parc.errors import InfeasiblePlanError, UsageError
from parc.hints import Hints
from parc.ir.graph import Graph
from parc.passes.pipeline.plan import (
    PipelinePlan,
    fallback_counts,
    pipeline_candidates,
    pipeline_uniform,
    plan_pipeline,
)
from parc.passes.pipeline.stages import uniform_stages
from parc.passes.spmd.hetero import device_times
from parc.passes.spmd.search import Plan, plan_graph

log = logging.getLogger("parc.plan")

# Devices are left idle only for a predicted gain of at least this fraction of the step: the
# predictions are not exact, so a smaller gain is not worth giving up devices the user asked for.
# (`parc plan --all-devices`'s help quotes it.)
IDLE_MIN_GAIN = 0.05

Progress = Callable[[str, int, int], None]


@dataclass
class PlanSearch:
    """One search of the plan over a cluster: the one-mesh plan, the pipelines `--pipeline` asks
    for, and the pipeline on the uniform cut when its baseline beats the stage search."""

    graph: Graph
    level: str
    budget: float | None
    time_limit: float
    hints: Hints
    jobs: int | None
    micro_batches: int | None
    stages: int  # 0 off, -1 auto, else the count
    tolerance: float
    mesh_dims: int
    progress: Progress | None = None  # called as each mesh's job is done (`plan_graph`)

    def on(self, cluster: Cluster) -> tuple[Plan | PipelinePlan, int, list[dict]]:
        """(plan, its stage count or 0, the pipelines tried) on `cluster`."""
        graph, level, budget, time_limit, jobs = self.graph, self.level, self.budget, self.time_limit, self.jobs
        stages, micro_batches, mesh_dims, hints = self.stages, self.micro_batches, self.mesh_dims, self.hints
        counts = [stages] if stages > 0 else pipeline_candidates(cluster) if stages < 0 else []
        spmd, spmd_error = None, None
        if stages <= 0:  # with --pipeline S the user asked for that pipeline: no one-mesh search
            try:
                spmd = plan_graph(graph, cluster, level=level, memory_budget=budget, progress=self.progress,
                                  time_limit=time_limit, hints=None if hints.empty else hints, jobs=jobs,
                                  micro_batches=micro_batches or 1, max_mesh_dims=mesh_dims)
            except (InfeasiblePlanError, UsageError) as e:  # a pipeline may still fit (auto)
                if stages == 0 or isinstance(e, UsageError) and not counts:
                    raise
                spmd_error = e
        best, tried = None, []

        def attempt(count: int) -> None:
            nonlocal best
            try:
                pp = plan_pipeline(graph, cluster, count, micro_batches=micro_batches, level=level,
                                   memory_budget=budget, time_limit=time_limit, tolerance=self.tolerance,
                                   jobs=jobs, max_mesh_dims=mesh_dims, hints=None if hints.empty else hints)
            except (InfeasiblePlanError, UsageError) as e:
                if stages > 0:
                    raise
                tried.append({"stages": count, "feasible": False, "error": str(e)})
                return
            tried.append({"stages": count, "micro_batches": pp.micro_batches, "feasible": True,
                          "step_time_s": pp.step_s})
            if best is None or pp.step_s < best.step_s:
                best = pp

        for count in counts:
            attempt(count)
        if stages < 0 and spmd is None and best is None:  # nothing fits yet: more, smaller stages
            for count in fallback_counts(cluster, counts):
                log.warning(
                    "no one-mesh plan fits in memory: trying a pipeline of %d stages", count)
                attempt(count)
                if best is not None:
                    break
        if best is not None and (stages > 0 or spmd is None or best.step_s < spmd.best.solution.cost):
            uniform = pipeline_uniform(best, time_limit, mesh_dims)
            if uniform.get("feasible") and uniform["step_time_s"] < best.step_s and hints.empty:  # no stage pins
                best = on_uniform_stages(best, uniform, graph, cluster, level, budget, time_limit, self.tolerance,
                                          jobs, mesh_dims)
            best.baselines = dict(spmd.baselines) if spmd is not None else {}
            best.spmd = ({"step_time_s": spmd.best.solution.cost, "mesh": list(spmd.best.mesh.shape)}
                         if spmd is not None else {"searched": False} if stages > 0
                         else {"feasible": False, "error": str(spmd_error)})
            best.tried = tried
            best.baselines["pipeline-uniform"] = uniform
            best.baselines.pop("even-split", None)  # the one-mesh plan's; the pipeline's own follows
            if best.even_split is not None:
                best.baselines["even-split"] = best.even_split
            return best, len(best.stages), tried
        if spmd is not None:
            return spmd, 0, tried
        if tried and isinstance(spmd_error, InfeasiblePlanError):
            counts_text = ", ".join(str(t["stages"]) for t in tried)
            raise InfeasiblePlanError(f"{spmd_error}; pipelines of {counts_text} stages do not fit either "
                                      f"(first: {tried[0]['error']})") from None
        raise spmd_error  # type: ignore[misc]


def step_s(result: Plan | PipelinePlan, stages: int) -> float:
    """A plan's predicted step (a pipeline's, or the one-mesh plan's)."""
    return result.step_s if stages else result.best.solution.cost


@dataclass
class _OnNodes:
    """A plan on some of the cluster's nodes: the plan, its stage count and pipelines tried, its
    step, its `devices_given.tried` record, the nodes kept and the cluster they form."""

    plan: Any
    stages: int
    tried: list
    step_s: float
    record: dict
    kept: tuple[int, ...]
    cluster: Any


def idle_slower(search: PlanSearch, cluster: Cluster, result, stages: int, tried: list):
    """On a mixed cluster, the plan on each set of whole nodes that leaves the slower device types
    idle (`Cluster.without_slower`, ranked by the graph's time on each type); it replaces the
    plan on every device when predicted at least `IDLE_MIN_GAIN` faster. Returns the plan, its
    stage count, its pipelines tried, and the `devices_given` record of plan.json (None when
    there was nothing to leave idle)."""
    if len(cluster.device_types) < 2:
        return result, stages, tried, None
    # the graph's own time on each type (launch floors included), not a catalogue figure: a
    # memory-bound or launch-bound step ranks devices by bandwidth or floors
    subsets = cluster.without_slower(device_times(search.graph, cluster.devices, floors=True))
    if not subsets:
        return result, stages, tried, None
    every = step_s(result, stages)
    everywhere = tuple(range(len(cluster.nodes)))
    records = [{"devices": cluster.spec, "nodes": list(everywhere), "feasible": True, "step_time_s": every,
                "chosen": True}]
    best = _OnNodes(result, stages, tried, every, records[0], everywhere, cluster)
    for sub, kept in subsets:
        record = {"devices": sub.spec, "nodes": list(kept), "feasible": False, "chosen": False}
        records.append(record)
        if search.stages > 0 and sub.num_devices % search.stages:
            record["error"] = f"--pipeline {search.stages} does not divide its {sub.num_devices} devices"
            continue
        log.info("trying the plan on %s alone (the slower devices idle)", sub.spec)
        try:
            other, other_stages, other_tried = search.on(sub)
        except (InfeasiblePlanError, UsageError) as e:
            record["error"] = str(e)
            continue
        step = step_s(other, other_stages)
        record.update(feasible=True, step_time_s=step)
        if step < best.step_s and step <= every * (1 - IDLE_MIN_GAIN):
            best.record["chosen"] = False
            record["chosen"] = True
            best = _OnNodes(other, other_stages, other_tried, step, record, kept, sub)
    idle: dict[str, int] = {}
    for i, node in enumerate(cluster.nodes):
        if i not in best.kept:
            for d in node.devices:
                idle[d.name] = idle.get(d.name, 0) + 1
    if idle:
        log.info("leaving %s idle: %.6g s on %s against %.6g s on every device", idle, best.step_s,
                 best.cluster.spec, every)
        full = result.baselines
        if "even-split" in full:  # the naive use of every device given stays the reference
            best.plan.baselines["even-split"] = {**full["even-split"], "devices": cluster.spec}
        best.plan.baselines["all-devices"] = {"step_time_s": every, "feasible": True, "devices": cluster.spec,
                                              "stages": stages}
    given = {"devices": cluster.spec, "num_devices": cluster.num_devices, "nodes_used": list(best.kept),
             "idle": idle, "min_gain": IDLE_MIN_GAIN, "tried": records}
    return best.plan, best.stages, best.tried, given


def on_uniform_stages(best, uniform: dict, graph, cluster, level: str, budget, time_limit: float,
                       tolerance: float, jobs, mesh_dims: int):
    """The pipeline searched on the uniform cut when the `pipeline-uniform` baseline (a recipe on
    that cut) beats the plan: a plan must not lose to a baseline parc computed (the stage
    search balances its per-node estimate, which on small stages misses what the stages' own
    plans cost). The faster of the two, with the first's even-split record."""
    log.info(
        "the pipeline-uniform baseline (%.6g s) beats the plan (%.6g s): searching its stages too",
        uniform["step_time_s"], best.step_s)
    try:
        other = plan_pipeline(graph, cluster, len(best.stages), micro_batches=best.micro_batches, level=level,
                              memory_budget=budget, time_limit=time_limit, tolerance=tolerance, jobs=jobs,
                              max_mesh_dims=mesh_dims, cut=uniform_stages(graph, cluster, len(best.stages)))
    except (InfeasiblePlanError, UsageError):
        return best
    if other.step_s >= best.step_s:
        return best
    other.even_split = best.even_split
    other.micro_searched = best.micro_searched
    return other
