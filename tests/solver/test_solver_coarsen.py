"""O3's coarsening: folding degree <= 2 nodes before the ILP keeps the optimum exact."""

from __future__ import annotations

import numpy as np
import pytest
from solver_brute import brute_force

from parc.solver import IlpOptions, coarsen, random_problem, solve_coarse, solve_ilp
from parc.solver.generate import KINDS

EXACT = IlpOptions(mip_gap=0.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(8))
def test_coarse_o3_equals_brute_force(kind, seed):
    n = 9 if kind != "transformer" else 16
    p = random_problem(seed, kind, n, (1, 4) if kind != "transformer" else (1, 2),
                       costs="uniform" if seed % 2 else "spec", pin_frac=0.25)
    sol = solve_coarse(p, EXACT)
    assert sol.cost == pytest.approx(brute_force(p)[0])
    assert sol.cost == p.cost(sol.choice) and sol.status == "optimal"


@pytest.mark.parametrize("seed", range(8))
def test_coarse_o3_with_budget_equals_brute_force(seed):
    """Under a budget that binds, nodes whose memory varies stay in the ILP's memory row."""
    p = random_problem(seed, "dag", 9, (2, 3), costs="spec", pin_frac=0.1)
    mem = tuple(np.random.default_rng(seed).integers(1, 10, size=len(c)).astype(float) for c in p.comp)
    free = p.__class__(p.comp, p.edges, p.comm, mem, None, p.pins, p.names)
    unconstrained = brute_force(free)[1]
    budget = (free.memory(unconstrained) + free.min_memory()) / 2
    q = free.with_budget(budget)
    best = brute_force(q)
    sol = solve_coarse(q, EXACT)
    assert q.fits(sol.choice)
    assert sol.cost == pytest.approx(best[0])


@pytest.mark.parametrize("kind", ["transformer", "dag"])
@pytest.mark.parametrize("seed", range(3))
def test_coarsening_shrinks_instances_and_matches_the_plain_ilp(kind, seed):
    p = random_problem(seed, kind, 200 if kind == "transformer" else 60, (2, 6), costs="spec")
    c = coarsen(p)
    left = 0 if c.problem is None else c.problem.n
    assert left < p.n / 2 if kind == "transformer" else left < p.n
    assert solve_coarse(p, EXACT).cost == pytest.approx(solve_ilp(p, EXACT).cost)
