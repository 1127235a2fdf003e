"""`parc.plan`: search a plan for a model on a cluster, and write its plan directory.

    import parc
    planned = parc.plan("model.onnx", "8xa100-80g", parc.PlanOptions(pipeline="off"))
    planned.step_time_s              # predicted seconds per step
    planned.write("plan/")           # plan.json, taskgraph.json, each rank's programs

`parc plan` is this, then a summary line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from parc.api.options import PlanOptions
from parc.cluster import Cluster, parse_devices
from parc.cluster.clusterfile import load_cluster, load_constants
from parc.errors import UsageError
from parc.exec.stepsim import simulate_graph
from parc.hints import Hints, load_hints, read_annotations, write_sharded_model
from parc.ir import importer
from parc.ir.graph import Graph
from parc.passes.emit import write_programs, write_taskgraph
from parc.passes.pipeline.emit import write_pipeline_programs
from parc.passes.pipeline.plan import PipelinePlan
from parc.passes.planner import PlanSearch, idle_slower
from parc.passes.schedule import one_mesh_taskgraph, stage_taskgraph
from parc.passes.spmd.search import Plan
from parc.plandir import load_program, write_plan
from parc.plandir.manifest import sha256_file, write_manifest
from parc.plandir.output import check_output, staged
from parc.plandir.plan import ModelRef, Prediction
from parc.plandir.plan import Plan as PlanFile
from parc.plandir.taskgraph import TaskGraph

log = logging.getLogger("parc.plan")


@dataclass
class Planned:
    """A searched plan, not yet written: the planner's result (one mesh, or a pipeline of
    `stages` stages), the graph it is for, and the plan as plan.json records it (`plan`)."""

    result: Plan | PipelinePlan
    stages: int  # 0: one mesh
    graph: Graph
    model: onnx.ModelProto
    model_path: Path | None
    plan: PlanFile  # without its `simulation` until written

    @property
    def cluster(self) -> Cluster:
        """The devices the plan uses (a mixed cluster's faster nodes, when the rest are left idle)."""
        return self.plan.cluster

    @property
    def doc(self) -> dict[str, Any]:
        """plan.json's contents."""
        return self.plan.to_json()

    @property
    def predicted(self) -> Prediction:
        """The planner's figures: step, compute, communication (and bubble) seconds, memory."""
        return self.plan.predicted

    @property
    def step_time_s(self) -> float:
        return self.plan.predicted.step_time_s

    def taskgraph(self) -> dict[str, Any]:
        """The stage-level task graph (one simulated rank per stage): enough to simulate, not to run."""
        if self.stages:
            return stage_taskgraph(self.result.stage_times(), self.result.micro_batches)  # type: ignore[union-attr]
        best = self.result.best  # type: ignore[union-attr]
        return one_mesh_taskgraph(best.mesh.devices, best.mesh.shape, best.compute_s, best.comm_s)

    def write(self, out: str | Path, *, programs: bool = True) -> Path:
        """Write the plan directory `out` (replacing a plan directory parc wrote there, never anything
        else): plan.json with the simulated step, taskgraph.json and, with `programs`, every rank's
        programs (what `parc run` needs). Returns plan.json's path."""
        out = Path(out)
        check_output(out)
        with staged(out) as stage:
            if programs and self.stages:
                graph = write_pipeline_programs(self.result, stage)  # type: ignore[arg-type]
            elif programs:
                graph = write_programs(self.result, stage)
            else:
                graph = write_taskgraph(self.taskgraph(), stage)
            plan = self.plan.replace(simulation=_simulated(graph, stage if programs else None))
            write_plan(stage, plan)
            if not self.stages:  # the annotated model of a one-mesh plan (a pipeline's stages have a mesh each)
                write_sharded_model(self.model_path or "model", plan.specs, plan.mesh.shape,
                                    stage / "model.sharded.onnx",
                                    shapes={v.name: v.shape for v in self.graph.values() if v.shape is not None},
                                    model=self.model)
            write_manifest(stage)  # last: the sha256 of every file written above
        self.plan = plan
        return out / "plan.json"


def plan(model: str | Path | onnx.ModelProto, cluster: str | Path | Cluster,
         options: PlanOptions | None = None, *, progress: Callable[[str, int, int], None] | None = None) -> Planned:
    """Search the plan of `model` (an ONNX file or ModelProto; a training step from `parc grad`
    or any inference graph) on `cluster` (a device spec such as "2x8xa100-80g", a cluster YAML
    file, or a Cluster). Raises InfeasiblePlanError when nothing fits, UsageError on bad input."""
    options = options or PlanOptions()
    path = None if isinstance(model, onnx.ModelProto) else Path(model)
    proto = model if path is None else importer.read_model(path)
    hints = _hints(options.hints).merged(read_annotations(proto, source=str(path or "model")))
    cluster, model_sha = _cluster(cluster, options.calibration, path)
    graph = importer.from_model(proto, dict(options.dims), base_dir=path.parent if path else None,
                                source=str(path or "model"))
    stages = options.stages
    if stages > 0 and (stages > cluster.num_devices or cluster.num_devices % stages):
        raise UsageError(f"--pipeline {stages}: expected a stage count that divides the "
                         f"{cluster.num_devices} devices")
    t0 = time.perf_counter()
    search = PlanSearch(graph, options.level, options.memory_budget, options.time_limit, hints, options.jobs,
                        options.micro_batches, stages, options.pipeline_tolerance, options.mesh_dims, progress)
    result, stages, tried = search.on(cluster)
    given = None
    if not options.all_devices and hints.empty:  # pins name the given cluster's meshes and stages
        result, stages, tried, given = idle_slower(search, cluster, result, stages, tried)
    result.time_s = time.perf_counter() - t0  # the whole search: one mesh and pipelines
    recorded = result.to_plan()
    if not stages:  # what --pipeline auto tried, and why it lost
        recorded = recorded.replace(solver={**recorded.solver, "pipelines": tried})
    recorded = recorded.replace(devices_given=given, model=ModelRef(str(path.resolve()), model_sha or sha256_file(path))
                                if path is not None else None)
    return Planned(result, stages, graph, proto, path, recorded)


def _hints(hints: Hints | str | Path | None) -> Hints:
    if hints is None:
        return Hints()
    return hints if isinstance(hints, Hints) else load_hints(hints)


def _cluster(cluster: str | Path | Cluster, calibration: str | Path | None,
             model: Path | None) -> tuple[Cluster, str | None]:
    """The cluster (with the calibration's measured constants) and the model's sha256 when the
    calibration had to read it."""
    if not isinstance(cluster, Cluster):
        text = str(cluster)
        cluster = load_cluster(text) if text.endswith((".yaml", ".yml")) else parse_devices(text)
    if calibration is None:
        return cluster, None
    if not Path(calibration).is_file():
        raise UsageError(f"--calibration {calibration}: no such file")
    constants = load_constants(calibration)
    cluster = constants.apply(cluster)
    model_sha = None
    if constants.fitted_on and model is not None:
        model_sha = sha256_file(model)  # plan.json's `model.sha256` reuses it
        if model_sha not in {sha for _, sha in constants.fitted_on}:
            names = ", ".join(name for name, _ in constants.fitted_on)
            log.warning("--calibration %s was measured on the shapes of %s (parc profile --model), not on %s: "
                        "its figures for their classes are that model's (profile without --model, or with "
                        "--model %s)", calibration, names, model.name, model.name)
    return cluster, model_sha


def _simulated(graph: TaskGraph, programs_dir: Path | None) -> dict:
    """plan.json's `simulation`: one step of the (checked) task graph replayed (`parc.exec.stepsim`),
    with the memory each rank holds when the programs are written in `programs_dir`."""
    programs = {r: load_program(programs_dir, r) for r in range(graph.ranks)} if programs_dir else None
    return simulate_graph(graph, programs=programs).to_json()
