"""The O3 ILP (marginal form, HiGHS) against exhaustive enumeration, and its time-out behaviour."""

from __future__ import annotations

import math

import numpy as np
import pytest
from solver_brute import brute_force

from parc.errors import InfeasiblePlanError
from parc.solver import (
    IlpOptions,
    MemoryBudgetError,
    Problem,
    build_model,
    random_problem,
    solve_ilp,
    tree_dp,
)
from parc.solver.generate import KINDS
from parc.solver.ilp import lp_relaxation

EXACT = IlpOptions(mip_gap=0.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(12))
def test_o3_equals_brute_force(kind, seed):
    n = 8 if kind != "transformer" else 16
    strategies = (1, 4) if kind != "transformer" else (1, 2)
    costs = "uniform" if seed % 2 else "spec"
    budget = [None, 0.0, 0.3, 0.7][seed % 4]
    p = random_problem(seed, kind, n, strategies, costs=costs, budget=budget, pin_frac=0.25)
    best = brute_force(p)
    sol = solve_ilp(p, EXACT)
    assert sol.status == "optimal" and sol.gap == 0.0
    assert sol.cost == pytest.approx(best[0], rel=1e-9, abs=1e-9)
    assert p.fits(sol.choice) and sol.cost == p.cost(sol.choice)
    assert sol.lower_bound <= sol.cost


@pytest.mark.parametrize("seed", range(8))
def test_costs_of_microseconds_are_solved_exactly(seed):
    """Step times are seconds, a node often a microsecond: the objective is scaled so HiGHS's
    absolute tolerances (1e-6 mip_abs_gap, 1e-7 dual feasibility) do not swallow the plan."""
    base = random_problem(seed, "dag", 8, (2, 4), budget=[None, 0.4][seed % 2])
    p = Problem(tuple(c * 1e-7 for c in base.comp), base.edges, tuple(c * 1e-7 for c in base.comm),
                base.mem, base.budget, base.pins)
    best = brute_force(p)[0]
    sol = solve_ilp(p, EXACT)
    assert sol.cost == pytest.approx(best, rel=1e-9, abs=0)
    assert sol.lower_bound <= best * (1 + 1e-9)


def test_the_budget_binds_somewhere():
    """The memory row changes the answer on some of the seeded cases above."""
    changed = 0
    for seed in range(12):
        p = random_problem(seed, "dag", 8, (1, 4), budget=0.0, pin_frac=0.25)
        changed += brute_force(p)[0] > brute_force(p.with_budget(None))[0] + 1e-9
    assert changed >= 6


@pytest.mark.parametrize("seed", range(4))
def test_without_warm_start_or_presolve(seed):
    p = random_problem(seed, "dag", 8, (2, 4), budget=0.4)
    for opts in (IlpOptions(mip_gap=0, warm_start=False), IlpOptions(mip_gap=0, presolve=False)):
        assert solve_ilp(p, opts).cost == pytest.approx(brute_force(p)[0])


def test_infeasible_budget_carries_the_numbers():
    p = random_problem(0, "dag", 6, (2, 3))
    need = p.min_memory()
    with pytest.raises(MemoryBudgetError) as info:
        solve_ilp(p.with_budget(need * 0.9))
    err = info.value
    assert isinstance(err, InfeasiblePlanError)
    assert err.need == pytest.approx(need) and err.budget == pytest.approx(need * 0.9)
    assert f"{need:.6g}" in str(err) and "exceeds the budget" in str(err)


def test_separable_edges_need_no_y_columns():
    """Edges touching a 1-strategy (or pinned-to-one) node, and sums a[j1] + b[j2], are folded."""
    a = np.array([1.0, 4.0, 2.0])
    b = np.array([0.5, 3.0])
    p = Problem(
        comp=([0.0, 1.0, 2.0], [1.0, 0.0], [5.0], [0.0, 0.0]),
        edges=[(0, 1), (1, 2), (0, 3), (1, 3)],
        comm=(a[:, None] + b[None, :], [[1.0], [2.0]], [[0, 9], [9, 0], [4, 4]], [[3, 0], [0, 3]]),
        pins={3: [1]},
    )
    m = build_model(p)
    assert m.lp.num_col_ == 8 + 0  # (0,1) sums, (1,2) and (1,3)/(0,3) touch single-choice nodes
    assert solve_ilp(p, EXACT).cost == pytest.approx(brute_force(p)[0])


def test_lp_relaxation_is_exact_on_trees():
    """The marginal form's LP relaxation is the local polytope, integral on trees."""
    for seed in range(5):
        p = random_problem(seed, "tree", 30, (2, 5))
        assert lp_relaxation(p) == pytest.approx(tree_dp(p).cost, rel=1e-7)


def test_time_limit_returns_incumbent_and_proven_gap():
    p = random_problem(1, "dag", 120, (6, 8))  # uniform costs: LP not tight, B&B needs long
    sol = solve_ilp(p, IlpOptions(time_limit=0.5))
    assert sol.status == "time_limit"
    assert p.fits(sol.choice) and sol.cost == p.cost(sol.choice)
    assert math.isfinite(sol.lower_bound) and sol.lower_bound <= sol.cost
    assert 0.0 < sol.gap < 1.0
    assert sol.time_s < 3.0


def test_no_branch_and_bound_when_less_time_is_left_than_the_relaxation_took(monkeypatch):
    """HiGHS's MIP starts over from presolve and its root LP: with less time left than the LP
    relaxation took, it cannot improve the LP's bound, so the solve ends on the rounded LP and
    the LP bound. Here the LP is made to take 0.4 s of a 0.6 s limit."""
    import time

    import parc.solver.ilp as ilp

    runs = []
    make = ilp._highs

    def slow_lp(options):
        h = make(options)
        run = h.run

        def timed():
            runs.append(1)
            if len(runs) == 1:
                time.sleep(0.4)
            return run()

        h.run = timed
        return h

    monkeypatch.setattr(ilp, "_highs", slow_lp)
    p = random_problem(1, "dag", 120, (6, 8))  # the LP is not tight here: B&B would be needed
    sol = solve_ilp(p, IlpOptions(time_limit=0.6))
    assert runs == [1]  # the LP only
    assert sol.status == "time_limit" and sol.method == "ilp(lp-rounding)"
    assert sol.lower_bound == pytest.approx(lp_relaxation(p), rel=1e-9) and sol.lower_bound < sol.cost
    assert sol.cost == p.cost(sol.choice)
    runs.clear()
    sol = solve_ilp(p, IlpOptions(time_limit=3.0))  # time enough: branch and bound runs
    assert runs == [1, 1]


def test_model_build_is_vectorised():
    """600k-ish columns are built from numpy arrays in well under a few seconds."""
    import time

    p = random_problem(0, "transformer", 4000, (6, 8), costs="spec")
    t0 = time.perf_counter()
    m = build_model(p)
    elapsed = time.perf_counter() - t0
    assert m.lp.num_col_ > 250_000
    assert elapsed < 3.0
