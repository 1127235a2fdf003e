"""Follow coarsening (follow.py) against exhaustive enumeration: conditioning and grouping keep
every cost exact, the maps are each group's optimum, and solve_follow returns a fitting choice
between the exact optimum and the grouped one."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from solver_brute import all_choices, brute_force

from parc.solver import IlpOptions, Problem, SearchOptions, random_problem, solve
from parc.solver.follow import Grouping, _folding_fixed, condition, follow_maps, grouped, solve_follow
from parc.solver.generate import KINDS

EXACT = SearchOptions(ilp=IlpOptions(mip_gap=0.0))


def _grouping(p: Problem, seed: int, affinity: bool = True) -> Grouping:
    """Leaders: every third node; each other node follows a random earlier leader."""
    rng = np.random.default_rng(seed)
    leader = np.arange(p.n)
    heads = list(range(0, p.n, 3))
    for i in range(p.n):
        if i % 3:
            leader[i] = heads[rng.integers(len(heads))]
    aff = {int(i): rng.uniform(0, 1, (p.s[leader[i]], p.s[i])) for i in range(p.n)
           if leader[i] != i and affinity and rng.random() < 0.5}
    return Grouping(leader, aff)


@pytest.mark.parametrize("seed", range(12))
def test_condition_is_exact(seed):
    p = random_problem(seed, KINDS[seed % len(KINDS)], 9, (1, 4), costs="spec", budget=[None, 0.6][seed % 2],
                       pin_frac=0.2)
    rng = np.random.default_rng(seed)
    x = all_choices(p)[0]
    free = rng.random(p.n) < 0.5
    free[0] = True
    q = condition(p, free, x)
    assert q.n == free.sum()
    const = p.cost(x) - q.cost(x[free])
    for y in all_choices(q)[:: max(1, len(all_choices(q)) // 50)]:
        z = x.copy()
        z[free] = y
        assert p.cost(z) == pytest.approx(q.cost(y) + const, abs=1e-12)
        if p.budget is not None:
            assert p.memory(z) - p.budget == pytest.approx(q.memory(y) - q.budget, abs=1e-12) or q.budget == 0.0


@pytest.mark.parametrize("seed", range(12))
def test_grouped_costs_are_exact(seed):
    p = random_problem(seed, KINDS[seed % len(KINDS)], 10, (1, 4), costs="spec", budget=0.5, pin_frac=0.2)
    gp = grouped(p, _grouping(p, seed))
    assert gp.problem.n == len(set(gp.group.tolist())) < p.n
    for y in all_choices(gp.problem):
        x = gp.expand(y)
        assert p.cost(x) == pytest.approx(gp.problem.cost(y), abs=1e-12)
        assert p.memory(x) == pytest.approx(gp.problem.memory(y), abs=1e-12)
        assert all(p.allowed(i)[x[i]] for i in range(p.n))


@pytest.mark.parametrize("seed", range(10))
def test_maps_are_each_groups_optimum(seed):
    """For every leader strategy, the members' choice minimises the group's own cost: compute,
    the edges inside the group and the affinities (checked by enumerating the members)."""
    p = random_problem(seed, KINDS[seed % len(KINDS)], 8, (1, 3), costs="spec", pin_frac=0.2)
    g = _grouping(p, seed)
    maps = follow_maps(p, g)
    for lead in set(g.leader.tolist()):
        members = [i for i in range(p.n) if g.leader[i] == lead and i != lead]
        if not members:
            continue
        options = [np.flatnonzero(p.allowed(i)).tolist() for i in members]
        for s in np.flatnonzero(p.allowed(lead)).tolist():
            best = min(_group_cost(p, g, {lead: s, **dict(zip(members, ts))}) for ts in itertools.product(*options))
            got = _group_cost(p, g, {lead: s, **{i: int(maps[i][s]) for i in members}})
            assert got == pytest.approx(best, abs=1e-12)


def _group_cost(p: Problem, g: Grouping, choice: dict[int, int]) -> float:
    """A group's own cost (`choice` holds its leader and members): its members' compute and
    affinities and the edges inside it."""
    lead = next(i for i in choice if g.leader[i] == i)
    members = [i for i in choice if i != lead]
    c = sum(p.comp[i][choice[i]] for i in members)
    c += sum(g.affinity[i][choice[lead], choice[i]] for i in members if i in g.affinity)
    return c + sum(p.comm[e][choice[u], choice[v]] for e, (u, v) in enumerate(p.edges.tolist())
                   if u in choice and v in choice)


@pytest.mark.parametrize("seed", range(16))
def test_solve_follow_lies_between_the_optimum_and_the_grouped_optimum(seed):
    budget = [None, 0.5, 0.8, None][seed % 4]
    p = random_problem(seed, KINDS[seed % len(KINDS)], 10, (1, 4), costs="spec", budget=budget)
    g = _grouping(p, seed)
    opt = brute_force(p)
    gopt = brute_force(grouped(p, g).problem)
    if gopt is None:  # the maps leave nothing within the budget: the caller solves p itself
        with pytest.raises(Exception, match="does not fit"):
            solve_follow(p, g, lambda q: solve(q, "O2", EXACT))
        return
    sol = solve_follow(p, g, lambda q: solve(q, "O2", EXACT))
    assert p.fits(sol.choice) and sol.cost == pytest.approx(p.cost(sol.choice))
    assert opt[0] - 1e-9 <= sol.cost <= gopt[0] + 1e-9
    assert sol.lower_bound <= opt[0] + 1e-9  # a valid bound (LP or trivial), never the grouped optimum


def test_without_members_follow_is_the_exact_solve():
    p = random_problem(3, "transformer", 16, (1, 3), costs="spec")
    sol = solve_follow(p, Grouping(np.arange(p.n)), lambda q: solve(q, "O2", EXACT))
    assert sol.cost == pytest.approx(brute_force(p)[0])
    assert sol.lower_bound <= sol.cost  # the trivial bound: the grouped optimum bounds nothing


@pytest.mark.parametrize("seed", range(8))
def test_greedy_maps_when_the_elimination_is_too_big(seed):
    """With no table allowed (limit 1) the maps are made member by member: allowed strategies,
    never cheaper for their group than the exact maps (which are its optimum)."""
    p = random_problem(seed, KINDS[seed % len(KINDS)], 10, (1, 4), costs="spec", pin_frac=0.3)
    g = _grouping(p, seed)
    greedy, exact = follow_maps(p, g, limit=1), follow_maps(p, g)
    for i in g.members.tolist():
        assert p.allowed(i)[greedy[i]].all() and len(greedy[i]) == p.s[g.leader[i]]
    for lead in set(g.leader[g.members].tolist()):
        group = [i for i in range(p.n) if g.leader[i] == lead]
        for s in np.flatnonzero(p.allowed(lead)).tolist():
            mine = _group_cost(p, g, {i: int(greedy[i][s]) for i in group})
            assert mine >= _group_cost(p, g, {i: int(exact[i][s]) for i in group}) - 1e-12


@pytest.mark.parametrize("seed", range(8))
def test_folding_fixed_nodes_keeps_the_optimum(seed):
    """A node with one allowed strategy tied to everything (an optimizer's shared scalar) is
    folded into its neighbours' costs; the optimum and its bound are unchanged."""
    p = random_problem(seed, KINDS[seed % len(KINDS)], 9, (1, 4), costs="spec", pin_frac=0.2)
    n = p.n
    hub = Problem((*p.comp, np.array([0.5])), np.concatenate([p.edges, [[n, i] for i in range(n)]]),
                  (*p.comm, *(np.full((1, p.s[i]), 0.1) + np.arange(p.s[i]) * 0.01 for i in range(n))))
    sol = _folding_fixed(hub, lambda q: solve(q, "O2", EXACT))
    assert sol.cost == pytest.approx(brute_force(hub)[0]) == pytest.approx(hub.cost(sol.choice))
    assert sol.lower_bound <= sol.cost + 1e-12


@pytest.mark.parametrize("seed", range(10))
def test_refine_from_a_poor_start_never_gets_worse(seed):
    """Large-neighbourhood steps: every node limited to its two best with the neighbours at x,
    and x's own; each step solved exactly, so the cost never rises and the plan fits."""
    from parc.solver.follow import neighbourhood, refine

    budget = [None, 0.6][seed % 2]
    p = random_problem(seed, KINDS[seed % len(KINDS)], 10, (2, 4), costs="spec", budget=budget, pin_frac=0.2)
    opt = brute_force(p)
    if opt is None:
        return
    x = p.min_memory_choice()  # fits whenever anything does
    cand = neighbourhood(p, x, 2)
    assert all(x[i] in c and len(c) <= 3 and p.allowed(i)[c].all() for i, c in cand.items())
    y, cost = refine(p, x, lambda q, start: solve(q, "O3", EXACT, start=start))
    assert p.fits(y) and cost == pytest.approx(p.cost(y))
    assert opt[0] - 1e-9 <= cost <= p.cost(x) + 1e-12
