"""`parc plan MODEL --devices SPEC -o PLAN_DIR`: search an SPMD plan (Rhino) and write plan.json."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from parc.errors import UsageError
from parc.report.units import fmt_bytes

# Devices are left idle only for a predicted gain of at least this fraction of the step: the
# predictions are within about 10% of measured steps (docs/benchmarks.md), so a smaller gain
# is not worth giving up devices the user asked for.
IDLE_MIN_GAIN = 0.05


@contextmanager
def _progress() -> Iterator[Callable[[str, int, int], None] | None]:
    """A progress bar on stderr when it is a terminal (nothing otherwise)."""
    import sys

    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("planning {task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("", total=1)

        def report(what: str, done: int, total: int) -> None:
            bar.update(task, description=what, completed=done, total=total)

        yield report


@click.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--devices", help="Devices, e.g. 8xv100-32g, 2x8xa100-80g, 4xv100-32g+4xp100-16g.")
@click.option("--cluster", "cluster_file", type=click.Path(dir_okay=False), help="Cluster YAML file.")
@click.option("--calibration", "calibration_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Calibration YAML (`parc profile -o FILE`): measured constants over the catalogue's.")
@click.option("-O2", "level", flag_value="O2", help="Segments between critical nodes, stitched by DP.")
@click.option("-O3", "level", flag_value="O3", default=True, help="One ILP over the whole graph (default).")
@click.option("--mem-limit", type=float, metavar="GIB", help="Memory per device (default: the device's).")
@click.option("--time-limit", default=60.0, type=float, show_default=True, metavar="SECONDS",
              help="Per solve; on time-out the best plan found is kept with its proven gap.")
@click.option("--hints", "hints_file", type=click.Path(dir_okay=False),
              help="Hints YAML: Whale replicate/split scopes and pinned layouts (docs/hints.md).")
@click.option("--jobs", type=int, metavar="N",
              help="Search the meshes in N processes (default: one per CPU; 1: in-process).")
@click.option("--micro-batches", type=int, metavar="M",
              help="Plan the step as M microbatches with gradient accumulation and one optimizer step "
                   "(default 1; a pipeline of S stages searches it among divisors of the batch).")
@click.option("--pipeline", default="auto", show_default=True, metavar="off|auto|S",
              help="Pipeline the step over S stages of equal device groups (1F1B), each stage an SPMD "
                   "plan of its own; off: one mesh; auto: on 2 or more nodes also try one stage per node "
                   "and keep the faster plan, and when nothing fits in memory try 2, 4, ... stages.")
@click.option("--pipeline-tolerance", type=float, default=0.1, show_default=True, metavar="EPS",
              help="Stage imbalance the stage search tolerates (Rhino 5.2's epsilon).")
@click.option("--all-devices", is_flag=True,
              help="Use every device given. By default, on a mixed cluster, parc also plans on the nodes "
                   "of the faster types alone and leaves the slower idle when that is predicted at least "
                   f"{IDLE_MIN_GAIN:.0%} faster.")
@click.option("--mesh-dims", type=int, default=2, show_default=True, metavar="N",
              help="Search device meshes of up to N axes (3 adds meshes like 2x2x2; slow to price).")
@click.option("--dim", "dims", multiple=True, metavar="NAME=VALUE", help="Bind a symbolic dim.")
@click.option("--programs/--no-programs", default=True, show_default=True,
              help="Write the per-rank programs and taskgraph.json (what `parc run` needs).")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="Plan directory.")
def plan(model: str, devices: str | None, cluster_file: str | None, calibration_file: str | None, level: str,
         mem_limit: float | None, time_limit: float, hints_file: str | None, jobs: int | None,
         micro_batches: int | None, pipeline: str, pipeline_tolerance: float, all_devices: bool, mesh_dims: int,
         dims: tuple[str, ...], programs: bool, output: str) -> None:
    """Search how to split MODEL over the devices; write PLAN_DIR/plan.json."""
    from parc.cluster import resolve_cluster
    from parc.ir import importer

    if not time_limit > 0:
        raise UsageError(f"--time-limit {time_limit}: expected a positive number of seconds")
    if mem_limit is not None and not mem_limit > 0:
        raise UsageError(f"--mem-limit {mem_limit}: expected a positive number of GiB")
    if micro_batches is not None and micro_batches < 1:
        raise UsageError(f"--micro-batches {micro_batches}: expected a count >= 1")
    stages = _stages(pipeline)
    from parc.passes.pipeline.stages import tolerance_ok

    tolerance_ok(pipeline_tolerance)
    if mesh_dims not in (1, 2, 3):
        raise UsageError(f"--mesh-dims {mesh_dims}: expected 1, 2 or 3")
    if jobs is not None and jobs < 1:
        raise UsageError(f"--jobs {jobs}: expected a number of processes >= 1")
    from parc.hints import Hints, load_hints, read_annotations, write_sharded_model
    from parc.plandir import write_plan
    from parc.plandir.manifest import sha256_file, write_manifest

    _check_output(Path(output))
    hints = load_hints(hints_file) if hints_file else Hints()
    proto = importer.read_model(model)  # parsed once: read for its annotations, imported, annotated
    hints = hints.merged(read_annotations(proto, source=model))  # the model's own ONNX multi-device annotations
    cluster = resolve_cluster(devices, cluster_file)
    model_sha = None
    if calibration_file is not None:
        from parc.cluster.clusterfile import load_constants

        if not Path(calibration_file).is_file():
            raise UsageError(f"--calibration {calibration_file}: no such file")
        calibration = load_constants(calibration_file)
        cluster = calibration.apply(cluster)
        if calibration.fitted_on:
            model_sha = sha256_file(Path(model))  # plan.json's `model.sha256` reuses it
            if model_sha not in {sha for _, sha in calibration.fitted_on}:
                names = ", ".join(name for name, _ in calibration.fitted_on)
                click.echo(f"warning: --calibration {calibration_file} was measured on the shapes of {names} "
                           f"(parc profile --model), not on {Path(model).name}: its figures for their classes "
                           f"are that model's (profile without --model, or with --model {Path(model).name})",
                           err=True)
    graph = importer.from_model(proto, importer.parse_dims(dims), base_dir=Path(model).parent, source=model)
    budget = mem_limit * 2**30 if mem_limit is not None else None
    if stages > 0 and (stages > cluster.num_devices or cluster.num_devices % stages):
        raise UsageError(f"--pipeline {stages}: expected a stage count that divides the "
                         f"{cluster.num_devices} devices")
    import time

    t0 = time.perf_counter()
    search = _Search(graph, level, budget, time_limit, hints, jobs, micro_batches, stages, pipeline_tolerance,
                     mesh_dims)
    result, stages, tried = search.on(cluster)
    given = None
    if not all_devices and hints.empty:  # pins name the given cluster's meshes and stages
        result, stages, tried, given = _idle_slower(search, cluster, result, stages, tried)
    result.time_s = time.perf_counter() - t0  # the whole search: one mesh and pipelines
    out = Path(output)
    stage = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        doc = result.to_json()
        if not stages:
            doc["solver"]["pipelines"] = tried  # what --pipeline auto tried, and why it lost
        if given is not None:
            doc["devices_given"] = given
        doc["model"] = {"path": str(Path(model).resolve()), "sha256": model_sha or sha256_file(Path(model))}
        if programs and stages:
            from parc.passes.pipeline.emit import write_pipeline_programs

            taskgraph = write_pipeline_programs(result, stage)  # type: ignore[arg-type]
        elif programs:
            from parc.passes.emit import write_programs

            taskgraph = write_programs(result, stage)
        else:  # the stages' figures only: enough to simulate, not to run
            from parc.passes.emit import write_taskgraph
            from parc.passes.timing import stage_taskgraph

            taskgraph = write_taskgraph(stage_taskgraph(result), stage)
        doc["simulation"] = _simulated(taskgraph, stage if programs else None)
        write_plan(stage, doc)
        if not stages:  # the annotated model of a one-mesh plan (a pipeline's stages have a mesh each)
            write_sharded_model(model, doc["specs"], tuple(doc["mesh"]["shape"]), stage / "model.sharded.onnx",
                                shapes={v.name: v.shape for v in graph.values() if v.shape is not None}, model=proto)
        write_manifest(stage)  # last: the sha256 of every file written above
        _replace_dir(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    p = doc["predicted"]
    if given is not None and given["idle"]:
        idle = ", ".join(f"{n} {name}" for name, n in given["idle"].items())
        click.echo(f"{idle} left idle: the plan on {result.cluster.spec} alone is predicted faster than on "
                   f"every device given ({given['devices']}); --all-devices uses them all")
    if stages:
        shapes = " | ".join(f"stage {st['id']}: {len(st['devices'])} devices {tuple(st['mesh'])}, {st['nodes']} nodes"
                            for st in doc["stages"])
        click.echo(f"wrote {out / 'plan.json'}: pipeline of {len(doc['stages'])} stages x "
                   f"{doc['schedule']['micro_batches']} microbatches (1F1B), predicted step "
                   f"{p['step_time_s'] * 1e3:.3f} ms (bubble {p['bubble_s'] * 1e3:.3f}; simulated "
                   f"{doc['simulation']['step_time_s'] * 1e3:.3f}), "
                   f"{max(p['memory_bytes_per_device']) / 2**30:.2f} GiB/device max; {shapes}; baselines: "
                   + _baselines_text(doc["baselines"]))
        return
    base = _baselines_text(doc["baselines"])
    click.echo(f"wrote {out / 'plan.json'}: mesh {tuple(doc['mesh']['shape'])}, predicted step "
               f"{p['step_time_s'] * 1e3:.3f} ms (compute {p['compute_s'] * 1e3:.3f}, comm "
               f"{p['comm_s'] * 1e3:.3f}; simulated {doc['simulation']['step_time_s'] * 1e3:.3f}), "
               f"{p['memory_bytes_per_device'][0] / 2**30:.2f} GiB/device; "
               f"baselines: {base}")


@dataclass
class _Search:
    """One search of the plan over a cluster: the one-mesh plan, the pipelines `--pipeline` asks
    for, and the pipeline on the uniform cut when its baseline beats the stage search."""

    graph: Any
    level: str
    budget: float | None
    time_limit: float
    hints: Any
    jobs: int | None
    micro_batches: int | None
    stages: int  # 0 off, -1 auto, else the count
    tolerance: float
    mesh_dims: int

    def on(self, cluster):
        """(plan, its stage count or 0, the pipelines tried) on `cluster`."""
        from parc.errors import InfeasiblePlanError
        from parc.passes.pipeline.plan import (
            fallback_counts,
            pipeline_candidates,
            pipeline_uniform,
            plan_pipeline,
        )
        from parc.passes.spmd.search import plan_graph

        graph, level, budget, time_limit, jobs = self.graph, self.level, self.budget, self.time_limit, self.jobs
        stages, micro_batches, mesh_dims, hints = self.stages, self.micro_batches, self.mesh_dims, self.hints
        counts = [stages] if stages > 0 else pipeline_candidates(cluster) if stages < 0 else []
        spmd, spmd_error = None, None
        if stages <= 0:  # with --pipeline S the user asked for that pipeline: no one-mesh search
            try:
                with _progress() as report:
                    spmd = plan_graph(graph, cluster, level=level, memory_budget=budget, progress=report,
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
                logging.getLogger("parc.plan").warning(
                    "no one-mesh plan fits in memory: trying a pipeline of %d stages", count)
                attempt(count)
                if best is not None:
                    break
        if best is not None and (stages > 0 or spmd is None or best.step_s < spmd.best.solution.cost):
            uniform = pipeline_uniform(best, time_limit, mesh_dims)
            if uniform.get("feasible") and uniform["step_time_s"] < best.step_s and hints.empty:  # no stage pins
                best = _on_uniform_stages(best, uniform, graph, cluster, level, budget, time_limit, self.tolerance,
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


def _step_s(result, stages: int) -> float:
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


def _idle_slower(search: _Search, cluster, result, stages: int, tried: list):
    """On a mixed cluster, the plan on each set of whole nodes that leaves the slower device types
    idle (`Cluster.without_slower`, ranked by the graph's time on each type); it replaces the
    plan on every device when predicted at least `IDLE_MIN_GAIN` faster. Returns the plan, its
    stage count, its pipelines tried, and the `devices_given` record of plan.json (None when
    there was nothing to leave idle)."""
    from parc.errors import InfeasiblePlanError
    from parc.passes.spmd.hetero import device_times

    if len(cluster.device_types) < 2:
        return result, stages, tried, None
    # the graph's own time on each type (launch floors included), not a catalogue figure: a
    # memory-bound or launch-bound step ranks devices by bandwidth or floors
    subsets = cluster.without_slower(device_times(search.graph, cluster.devices, floors=True))
    if not subsets:
        return result, stages, tried, None
    log = logging.getLogger("parc.plan")
    every = _step_s(result, stages)
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
        step = _step_s(other, other_stages)
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


def _on_uniform_stages(best, uniform: dict, graph, cluster, level: str, budget, time_limit: float,
                       tolerance: float, jobs, mesh_dims: int):
    """The pipeline searched on the uniform cut when the `pipeline-uniform` baseline (a recipe on
    that cut) beats the plan: a plan must not lose to a baseline parc computed (the stage
    search balances its per-node estimate, which on small stages misses what the stages' own
    plans cost). The faster of the two, with the first's even-split record."""
    from parc.errors import InfeasiblePlanError
    from parc.passes.pipeline.plan import plan_pipeline
    from parc.passes.pipeline.stages import uniform_stages

    logging.getLogger("parc.plan").info(
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


def _simulated(graph, programs_dir: Path | None) -> dict:
    """plan.json's `simulation`: one step of the (checked) task graph replayed
    (`parc.exec.stepsim`), with the memory each rank holds when the programs are written in
    `programs_dir`."""
    from parc.exec.stepsim import simulate_graph
    from parc.plandir import load_program

    programs = {r: load_program(programs_dir, r) for r in range(graph.ranks)} if programs_dir else None
    return simulate_graph(graph, programs=programs).to_json()


def _baselines_text(baselines: dict) -> str:
    """Each baseline's predicted step, or why it is not an option (no layout, or over memory)."""
    out = []
    for k, v in baselines.items():
        if v.get("step_time_s") is None:
            out.append(f"{k} infeasible")
        elif v.get("feasible") is False:
            need = v.get("memory_bytes_per_device")
            out.append(f"{k} infeasible (needs {fmt_bytes(need)}/device)" if need else f"{k} infeasible")
        else:
            out.append(f"{k} {v['step_time_s'] * 1e3:.3f} ms")
    return ", ".join(out)


def _stages(value: str) -> int:
    """--pipeline: 0 for off, -1 for auto, else the stage count."""
    text = value.strip().lower()
    if text == "off":
        return 0
    if text == "auto":
        return -1
    try:
        n = int(text)
    except ValueError:
        raise UsageError(f"--pipeline {value}: expected off or a stage count") from None
    if n < 2:
        raise UsageError(f"--pipeline {value}: a pipeline needs 2 or more stages (off: none)")
    return n


def _check_output(out: Path) -> None:
    """-o may name a new directory, an empty one, or a plan directory parc wrote (replaced whole,
    only once the new plan is complete); nothing else is overwritten."""
    from parc.plandir.manifest import MANIFEST, plan_files

    if not out.exists():
        if not out.parent.resolve().is_dir():
            raise UsageError(f"-o {out}: directory {out.parent} does not exist")
        return
    if not out.is_dir():
        raise UsageError(f"-o {out}: exists and is not a directory; refusing to overwrite it")
    if not any(out.iterdir()):
        return
    manifest = out / MANIFEST
    if not manifest.is_file():
        raise UsageError(f"-o {out}: exists and is not a plan directory (no {MANIFEST}); refusing to overwrite it")
    listed = set(json.loads(manifest.read_text()).get("files", {}))
    extra = [p.relative_to(out).as_posix() for p in plan_files(out) if p.relative_to(out).as_posix() not in listed]
    if extra:
        raise UsageError(f"-o {out}: the plan directory holds {extra[0]}, which parc did not write; "
                         f"move it or plan into another directory")


def _replace_dir(new: Path, out: Path) -> None:
    """Put the finished plan directory `new` at `out` (the old plan is removed after the swap)."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    new.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
