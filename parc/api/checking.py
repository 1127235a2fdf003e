"""`parc.simulate` and `parc.verify`: what a plan's step costs, and whether it computes what the
source model computes."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parc.api.planning import Planned
from parc.errors import UsageError
from parc.exec.engine_choice import pick_engine, plan_engine
from parc.exec.stepsim import Simulation, simulate_graph, simulate_plan
from parc.exec.verify import compare, effective_rtol, plan_run, reference_run, source_precision
from parc.plandir.runnable import check_runnable
from parc.plandir.taskgraph import check_taskgraph


def simulate(plan: Planned | str | Path, *, keep_spans: bool = False) -> Simulation:
    """One step of the plan replayed on its task graph (`parc simulate`): step time, bubble, busy
    time and peak memory per rank. `plan`: a plan directory (every rank's tasks when it has its
    programs) or a `Planned` not yet written (one simulated rank per stage)."""
    if isinstance(plan, Planned):
        return simulate_graph(check_taskgraph(plan.taskgraph()), keep_spans)
    return simulate_plan(plan, keep_spans=keep_spans)


@dataclass(frozen=True)
class Verification:
    """`parc verify`'s answer: `ok`, the tolerances used (rtol widened for low-precision
    products), the steps and ranks run, and one row per compared tensor (`tensor`, `ok`,
    `max_rel_err`, `max_abs_err`)."""

    ok: bool
    rtol: float
    atol: float
    steps: int
    ranks: int
    tensors: list[dict[str, Any]]
    low_eps: float | None = None  # the products' epsilon when the step computes them in a low type

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "rtol": self.rtol, "atol": self.atol, "steps": self.steps, "tensors": self.tensors}


def verify(plan_dir: str | Path, *, steps: int | None = None, rtol: float = 1e-3, atol: float = 1e-5,
           data: str | None = None, engine: str = "auto", seed: int = 0, init: str = "source",
           timeout: float = 600.0, force: bool = False) -> Verification:
    """Run the source model on one device (onnxruntime) and the plan on its ranks (under MPI) from
    the same state and data; compare the outputs every step and the parameters at the end.
    `steps` defaults to 3 (1 for a step with low-precision products)."""
    if steps is not None and steps < 1:
        raise UsageError(f"--steps {steps}: expected a count >= 1")
    plan_dir = str(plan_dir)
    pick_engine(engine)
    plan, ranks = check_runnable(plan_dir, force)
    engine = plan_engine(engine, plan)
    if steps is None:  # Adam(W) separates low-precision runs after one step (docs/training.md)
        steps = 1 if source_precision(plan_dir, plan) else 3
    want = reference_run(plan_dir, plan, ranks, steps, seed, init, data)
    with tempfile.TemporaryDirectory(prefix="parc-verify-") as tmp:
        got = plan_run(plan_dir, ranks, steps, seed, engine, timeout, Path(tmp), init, data)
    rows, ok = compare(want, got, rtol, atol)
    return Verification(ok, effective_rtol(want, rtol), atol, steps, ranks, rows, want.get("low_eps"))
