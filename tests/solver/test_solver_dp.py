"""The min-plus DPs against exhaustive enumeration on seeded random costs."""

from __future__ import annotations

import numpy as np
import pytest
from solver_brute import brute_chain, brute_force

from parc.solver import FactorGraph, ProblemError, chain_dp, fold_cones, random_problem, tree_dp
from parc.solver.dp import backtrack, eliminate_factors, elimination_order


@pytest.mark.parametrize("seed", range(20))
def test_chain_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    s = rng.integers(1, 5, rng.integers(1, 7))
    unary = [rng.uniform(-5, 5, k) for k in s]
    trans = [rng.uniform(0, 5, (s[k], s[k + 1])) for k in range(len(s) - 1)]
    cost, x = chain_dp(unary, trans)
    assert cost == pytest.approx(brute_chain(unary, trans))
    again = sum(u[j] for u, j in zip(unary, x)) + sum(t[x[k], x[k + 1]] for k, t in enumerate(trans))
    assert again == pytest.approx(cost)


@pytest.mark.parametrize("kind", ["chain", "tree"])
@pytest.mark.parametrize("seed", range(15))
def test_tree_dp_equals_brute_force(kind, seed):
    p = random_problem(seed, kind, 8, (1, 4), costs="uniform" if seed % 2 else "spec", pin_frac=0.25)
    sol = tree_dp(p)
    assert sol.cost == pytest.approx(brute_force(p)[0]) and sol.status == "optimal"


def test_tree_dp_refuses_cycles_and_budgets():
    with pytest.raises(ProblemError, match="not a forest"):
        tree_dp(random_problem(0, "transformer", 20, (2, 2)))
    with pytest.raises(ProblemError, match="knapsack"):
        tree_dp(random_problem(0, "tree", 5, (2, 2), budget=0.5))


@pytest.mark.parametrize("seed", range(15))
def test_cone_folding_and_series_elimination_are_exact(seed):
    """Fold cones (degree 1), then series nodes (degree 2), brute-force what is left, expand."""
    p = random_problem(seed, "dag", 8, (1, 4), pin_frac=0.2)
    fg = fold_cones(p, keep=[0])
    fg.reduce(range(1, p.n))
    left = np.flatnonzero(fg.alive).tolist()
    # brute force over the survivors, with their unary and pairwise factors
    best, best_x = np.inf, None
    for combo in np.ndindex(*[len(fg.unary[v]) for v in left]):
        c = fg.offset + sum(fg.unary[v][j] for v, j in zip(left, combo))
        c += sum(m[combo[left.index(a)], combo[left.index(b)]] for (a, b), m in fg.pairs.items())
        if c < best:
            best, best_x = c, combo
    x = np.zeros(p.n, dtype=np.int64)
    x[left] = best_x
    fg.backtrack(x)
    opt = brute_force(p)[0]
    assert best == pytest.approx(opt) and p.cost(x) == pytest.approx(opt)


def test_a_hanging_cone_becomes_a_cost_vector_of_its_root():
    """Rhino 4.3.1: the cone is solved for every strategy of its root."""
    p = random_problem(4, "tree", 6, (3, 3))
    root = 0
    fg = fold_cones(p, keep=[root])
    assert fg.alive.tolist() == [True] + [False] * 5
    for a in range(3):  # the folded vector is the optimum with the root pinned to a
        pinned = p.restricted({root: [a]})
        assert fg.unary[root][a] == pytest.approx(brute_force(pinned)[0])


@pytest.mark.parametrize("seed", range(10))
def test_bucket_elimination_is_exact_in_any_order(seed):
    rng = np.random.default_rng(seed)
    p = random_problem(seed, "dag", 7, (1, 3), pin_frac=0.2)
    fg = FactorGraph.from_problem(p)
    factors = [((v,), fg.unary[v]) for v in range(p.n)] + list(fg.pairs.items())
    order = rng.permutation(p.n).tolist()
    left, trace = eliminate_factors(factors, order)
    assert all(vs == () for vs, _ in left)
    x = backtrack(trace, np.zeros(p.n, dtype=np.int64))
    total = sum(float(t) for _, t in left)
    assert total == pytest.approx(brute_force(p)[0]) and p.cost(x) == pytest.approx(total)


def test_elimination_order_respects_the_table_limit():
    # a 4-clique of 3-strategy nodes: eliminating any node builds a 3**4 table
    adj = {v: {u for u in range(4) if u != v} for v in range(4)}
    size = dict.fromkeys(range(4), 3)
    assert elimination_order(adj, range(4), size, 80) is None
    assert len(elimination_order(adj, range(4), size, 81)) == 4
