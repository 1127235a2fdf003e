"""O3 on a coarsened problem: fold cones and series nodes exactly, then one ILP over the rest.

Rhino 4.3 coarsens the graph before its ILP: ops that follow their input, cones hanging off
one node, chains between two nodes. All of these are degree <= 2 nodes of the pairwise model,
and eliminating them is an exact min-plus product (dp.py), so the ILP over what survives has the
same optimum as the ILP over the whole problem, at a fraction of its size (benchmarks/LOG.md,
2026-11-25, issue 11).

Under a memory budget only nodes whose memory does not depend on their strategy are eliminated
(their bytes are a constant taken off the budget); the others keep their column in the ILP's
memory row, so the constrained optimum is exact too.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from parc.solver.dp import FactorGraph
from parc.solver.ilp import IlpOptions, solve_ilp
from parc.solver.problem import Problem, Solution, relative_gap


@dataclass(frozen=True, eq=False)
class Coarse:
    """A problem with its degree <= 2 nodes folded away, and how to expand a choice back."""

    graph: FactorGraph  # the elimination trace; its offset is the cost of vanished components
    kept: np.ndarray  # original indices of the nodes left, ascending
    problem: Problem | None  # over `kept` (None when nothing is left)


def coarsen(p: Problem) -> Coarse:
    """Eliminate every node of degree <= 2 (repeatedly), except, under a budget, nodes whose
    memory depends on their strategy."""
    fg = FactorGraph.from_problem(p)
    frozen = np.zeros(p.n, dtype=bool)
    fixed_mem = 0.0
    if p.budget is not None and p.mem:
        for i in range(p.n):
            m = p.mem[i][p.allowed(i)]
            frozen[i] = m.size > 0 and m.max() > m.min()
    fg.reduce(np.flatnonzero(~frozen), max_degree=2)
    kept = np.flatnonzero(fg.alive)
    if p.budget is not None and p.mem:
        fixed_mem = float(sum(p.mem[i][p.allowed(i)].min() for i in np.flatnonzero(~fg.alive)))
    if len(kept) == 0:
        return Coarse(fg, kept, None)
    local = {int(v): k for k, v in enumerate(kept)}
    comp, pins = [], {}
    for k, v in enumerate(kept.tolist()):
        phi = fg.unary[v]
        ok = np.isfinite(phi)
        if not ok.all():
            pins[k] = np.flatnonzero(ok).tolist()
        comp.append(np.where(ok, phi, 0.0))
    edges, comm = [], []
    for (u, v), m in sorted(fg.pairs.items()):
        edges.append((local[u], local[v]))
        comm.append(m)
    mem: tuple = ()
    budget = None
    if p.budget is not None:
        mem = tuple(p.mem[v] for v in kept.tolist()) if p.mem else ()
        budget = p.budget - fixed_mem
    names = tuple(p.name(int(v)) for v in kept) if p.names else ()
    q = Problem(tuple(comp), np.array(edges, dtype=np.int64).reshape(-1, 2), tuple(comm), mem, budget,
                pins, names)
    return Coarse(fg, kept, q)


def solve_coarse(p: Problem, options: IlpOptions | None = None, free_first: bool = True,
                 start: np.ndarray | None = None) -> Solution:
    """O3: the exact optimum of p (or, on time-out, the best found with its proven gap), solving
    one ILP over the coarsened problem. Under a budget, the unconstrained coarse optimum is
    tried first (unless `free_first` is False: the caller has): when it fits, it is also the
    constrained optimum. `start`: a known choice of p, the ILP's incumbent (solve_ilp)."""
    t0 = time.perf_counter()
    options = options or IlpOptions()
    p.check_budget()
    if p.budget is not None and free_first:
        free = _solve(p.with_budget(None), options, t0, start)
        if p.fits(free.choice):
            return free
    return _solve(p, options, t0, start)


def _solve(p: Problem, options: IlpOptions, t0: float, start: np.ndarray | None = None) -> Solution:
    c = coarsen(p)
    x = np.zeros(p.n, dtype=np.int64)
    if c.problem is None:
        c.graph.backtrack(x)
        cost = p.cost(x)
        return Solution(x, cost, cost, 0.0, "optimal", time.perf_counter() - t0,
                        f"coarse-ilp({p.n}->0)")
    left = max(options.time_limit - (time.perf_counter() - t0), 1e-3)
    sol = solve_ilp(c.problem, replace(options, time_limit=left), None if start is None else start[c.kept])
    x[c.kept] = sol.choice
    c.graph.backtrack(x)
    cost = p.cost(x)
    lower = min(sol.lower_bound + c.graph.offset if math.isfinite(sol.lower_bound) else -math.inf, cost)
    return Solution(x, cost, lower, relative_gap(cost, lower), sol.status, time.perf_counter() - t0,
                    f"coarse-ilp({p.n}->{c.problem.n})")
