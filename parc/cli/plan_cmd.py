"""`parc plan MODEL --devices SPEC -o PLAN_DIR`: search an SPMD plan (Rhino) and write plan.json."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import click

from parc.report.units import fmt_bytes


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
                   "5% faster (plan.json's devices_given.min_gain).")
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
    from parc.api import PlanOptions
    from parc.api import plan as plan_model
    from parc.cluster import resolve_cluster
    from parc.ir.importer import parse_dims
    from parc.plandir.output import check_output

    options = PlanOptions(level=level, memory_limit_gib=mem_limit, time_limit=time_limit, hints=hints_file,
                          jobs=jobs, micro_batches=micro_batches, pipeline=pipeline,
                          pipeline_tolerance=pipeline_tolerance, all_devices=all_devices, mesh_dims=mesh_dims,
                          dims=parse_dims(dims), calibration=calibration_file)
    out = Path(output)
    check_output(out)  # before the search: a refused -o must not cost a search
    cluster = resolve_cluster(devices, cluster_file)
    with _progress() as report:
        planned = plan_model(model, cluster, options, progress=report)
    planned.write(out, programs=programs)
    click.echo(summary(planned.plan, out / "plan.json"))


def summary(plan, path: Path) -> str:
    """`parc plan`'s closing lines: what was written and what it predicts (a `plandir.Plan`)."""
    p, given, lines = plan.predicted, plan.devices_given, []
    if given is not None and given["idle"]:
        idle = ", ".join(f"{n} {name}" for name, n in given["idle"].items())
        lines.append(f"{idle} left idle: the plan on {plan.cluster.spec} alone is predicted faster than on "
                     f"every device given ({given['devices']}); --all-devices uses them all")
    if len(plan.cluster.nodes) > 1:  # the links the plan assumed: the defaults unless a cluster file said
        lines.append(f"cluster {plan.cluster.spec}: {plan.cluster.links_text()} (--cluster FILE gives others)")
    simulated = plan.simulation["step_time_s"] * 1e3 if plan.simulation else float("nan")
    base = _baselines_text(plan.baselines)
    if plan.pipelined:
        shapes = " | ".join(f"stage {st.id}: {len(st.devices)} devices {st.mesh}, {st.nodes} nodes"
                            for st in plan.stages)
        lines.append(f"wrote {path}: pipeline of {len(plan.stages)} stages x {plan.micro_batches} microbatches "
                     f"({plan.schedule.kind.upper()}), predicted step {p.step_time_s * 1e3:.3f} ms (bubble "
                     f"{p.bubble_s * 1e3:.3f}; simulated {simulated:.3f}), {p.max_memory_bytes / 2**30:.2f} "
                     f"GiB/device max; {shapes}; baselines: {base}")
    else:
        lines.append(f"wrote {path}: mesh {plan.mesh.shape}, predicted step {p.step_time_s * 1e3:.3f} ms (compute "
                     f"{p.compute_s * 1e3:.3f}, comm {p.comm_s * 1e3:.3f}; simulated {simulated:.3f}), "
                     f"{p.memory_bytes_per_device[0] / 2**30:.2f} GiB/device; baselines: {base}")
    return "\n".join(lines)


def _baselines_text(baselines: Mapping) -> str:
    """Each baseline's predicted step, or why it is not an option (no layout, or over memory)."""
    out = []
    for k, v in baselines.items():
        if v.step_time_s is None:
            out.append(f"{k} infeasible")
        elif not v.feasible:
            need = v.memory_bytes_per_device
            out.append(f"{k} infeasible (needs {fmt_bytes(need)}/device)" if need else f"{k} infeasible")
        else:
            out.append(f"{k} {v.step_time_s * 1e3:.3f} ms")
    return ", ".join(out)
