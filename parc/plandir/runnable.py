"""Whether a plan directory can run: checked by whatever launches the ranks (`parc run`,
`parc verify`, a user's own mpiexec or srun, each rank then checking for itself) before any rank
starts work."""

from __future__ import annotations

from pathlib import Path

from parc.errors import PlanFormatError, UsageError
from parc.plandir import TASKGRAPH_FILE, Plan, load_plan, load_program
from parc.plandir.manifest import check_manifest
from parc.plandir.taskgraph import load_taskgraph


def check_runnable(plan_dir: str | Path, force: bool = False) -> tuple[Plan, int]:
    """Refuse a plan directory that was changed, is incomplete, of an unknown format, or whose
    predicted memory exceeds its devices (unless `force`); (plan.json, rank count)."""
    root = Path(plan_dir)
    if not root.is_dir():
        raise UsageError(f"{plan_dir}: no such plan directory")
    check_manifest(root, extra_ok=True)
    plan = load_plan(root)
    if not (root / TASKGRAPH_FILE).is_file():
        raise PlanFormatError(f"{root}: no {TASKGRAPH_FILE} (planned with --no-programs? plan again without it)")
    graph = load_taskgraph(root / TASKGRAPH_FILE)
    if graph.represents():
        raise PlanFormatError(f"{root}: planned with --no-programs (its task graph is per stage, for "
                              "`parc simulate`): plan again without --no-programs to run it")
    for r in range(graph.ranks):
        load_program(root, r)
    cap = min(d.memory_bytes for d in plan.cluster.device_types)
    need = plan.predicted.max_memory_bytes
    if need > cap and not force:
        raise UsageError(f"{root}: the plan needs {need / 2**30:.2f} GiB per device, the devices have "
                         f"{cap / 2**30:.2f} GiB (--force runs it anyway)")
    return plan, graph.ranks
