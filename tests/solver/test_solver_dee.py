"""Dead-end elimination (dee.py) against exhaustive enumeration: the pruned problem keeps the
optimum (memory budget and pins included) and the strategies it drops are really dominated."""

from __future__ import annotations

import numpy as np
import pytest
from solver_brute import brute_force

from parc.solver import IlpOptions, Problem, random_problem, solve_ilp
from parc.solver.dee import prune
from parc.solver.generate import KINDS


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(10))
def test_pruning_keeps_the_optimum(kind, seed):
    n = 8 if kind != "transformer" else 14
    strategies = (1, 5) if kind != "transformer" else (1, 3)
    budget = [None, 0.0, 0.3, 0.7, None][seed % 5]
    p = random_problem(seed, kind, n, strategies, costs="uniform" if seed % 2 else "spec", budget=budget,
                       pin_frac=0.25)
    want = brute_force(p)
    pruned = prune(p)
    got = brute_force(pruned.problem)
    assert (want is None) == (got is None)
    if want is None:
        return
    assert got[0] == pytest.approx(want[0], rel=1e-9, abs=1e-12)
    x = pruned.expand(got[1])
    assert p.cost(x) == pytest.approx(want[0], rel=1e-9, abs=1e-12) and p.fits(x)
    assert all(p.allowed(i)[x[i]] for i in range(p.n))  # pins hold in the original's indices


def test_a_dominated_strategy_goes_and_a_tie_keeps_one():
    """Node 0's strategy 1 costs more than 0 whatever node 1 does; 2 equals 0 in every context."""
    comp = (np.array([1.0, 2.0, 1.0]), np.array([0.0, 0.5]))
    comm = (np.array([[0.0, 1.0], [0.5, 1.5], [0.0, 1.0]]),)
    p = Problem(comp, np.array([[0, 1]]), comm)
    pruned = prune(p)
    assert pruned.keep[0].tolist() == [0]
    assert pruned.keep[1].tolist() == [0]  # then node 1's 1 costs more too


def test_under_a_budget_a_cheaper_but_larger_strategy_stays():
    """Strategy 0 is cheaper everywhere but needs more memory: it cannot replace strategy 1."""
    p = Problem((np.array([1.0, 2.0]),), np.zeros((0, 2), dtype=np.int64), (), (np.array([5.0, 1.0]),))
    assert prune(p).keep[0].tolist() == [0]  # no budget: memory does not matter
    assert prune(p.with_budget(2.0)).keep[0].tolist() == [0, 1]


def test_the_ilp_prunes_and_answers_in_the_original_indices():
    p = random_problem(3, "dag", 10, (2, 6), budget=0.5, pin_frac=0.3)
    a = solve_ilp(p, IlpOptions(mip_gap=0.0, prune=True))
    b = solve_ilp(p, IlpOptions(mip_gap=0.0, prune=False))
    assert a.cost == pytest.approx(b.cost, rel=1e-9) == pytest.approx(brute_force(p)[0], rel=1e-9)
    assert "+dee(" in a.method and p.fits(a.choice) and p.cost(a.choice) == a.cost
