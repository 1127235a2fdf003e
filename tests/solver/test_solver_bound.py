"""The diffusion lower bound (bound.py): never above the optimum (exhaustive enumeration), never
below the trivial bound, exact reparametrisation, and tight where the LP relaxation is."""

from __future__ import annotations

import math

import numpy as np
import pytest
from solver_brute import brute_force

from parc.solver import random_problem
from parc.solver.bound import _decode, _Diffusion, dual_bound
from parc.solver.coarsen import coarsen
from parc.solver.dee import prune
from parc.solver.generate import KINDS
from parc.solver.problem import segment_argmin


@pytest.mark.parametrize("seed", range(40))
def test_bound_is_valid(seed):
    p = random_problem(seed, KINDS[seed % len(KINDS)], 9, (1, 4), costs=["spec", "uniform"][seed % 2],
                       budget=[None, 0.3, 0.7][seed % 3], pin_frac=0.2)
    best = brute_force(p)
    assert best is not None
    opt = best[0]
    b = dual_bound(p, upper=opt, gap=0.0, passes=200)
    assert b <= opt + 1e-9 * max(1.0, abs(opt))
    assert b >= p.trivial_bound() - 1e-12


@pytest.mark.parametrize("seed", range(8))
def test_reparametrisation_keeps_every_cost(seed):
    p = prune(random_problem(seed, "transformer", 14, (2, 5), costs="spec", pin_frac=0.2), sweeps=0).problem
    d = _Diffusion.of(p)
    for _ in range(7):
        d.step()
    rng = np.random.default_rng(seed)
    for _ in range(20):
        x = (rng.random(p.n) * p.s).astype(np.int64)
        u, v = p.edges[:, 0], p.edges[:, 1]
        idx = p.comm_offsets[:-1] + x[u] * p.s[v] + x[v]
        assert d.node[p.offsets[:-1] + x].sum() + d.edge[idx].sum() == pytest.approx(p.cost(x), rel=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_tight_on_chains_and_trees(seed):
    """The LP relaxation is exact on a tree; diffusion reaches it there on these problems."""
    p = random_problem(seed, ["chain", "tree"][seed % 2], 10, (2, 4), costs="spec")
    opt = brute_force(p)[0]
    b = _Diffusion.of(p).run(opt, 0.0, 2000, math.inf)  # diffusion alone (dual_bound would fold the tree)
    assert b == pytest.approx(opt, rel=1e-6, abs=1e-9)
    assert dual_bound(p, upper=opt, gap=0.0) == pytest.approx(opt, rel=1e-12, abs=1e-12)


def test_price_beats_the_free_bound_under_a_binding_budget():
    """Some seeded problem whose budget binds: the Lagrangian bound is above the budget-free one,
    and still below the constrained optimum."""
    gained = 0
    for seed in range(30):
        p = random_problem(seed, "transformer", 10, (2, 3), costs="spec", budget=0.1)
        opt = brute_force(p)[0]
        free = dual_bound(p.with_budget(None), upper=opt, gap=0.0, passes=400)
        priced = dual_bound(p, upper=opt, gap=0.0, passes=400)
        assert priced <= opt + 1e-9 * max(1.0, abs(opt))
        gained += priced > free + 1e-9
    assert gained >= 5


def test_rounding_cannot_prove_more_than_the_optimum():
    """Over-relaxed passes (each step's change scaled by 1.9: still a reparametrisation in
    arithmetic) blow the costs up until rounding breaks the invariant; the bound's rounding
    margin keeps it below the optimum anyway (on gpt-2.7b's step such a run claimed a bound
    far above the plan before the margin)."""
    for seed in range(10):
        p = random_problem(seed, "transformer", 30, (2, 5), costs="spec")
        cost = p.cost(p.min_memory_choice())  # a choice: at least the optimum
        d = _Diffusion.of(p)
        for _ in range(300):
            node, edge = d.node.copy(), d.edge.copy()
            d.step()
            d.node = node + 1.9 * (d.node - node)
            d.edge = edge + 1.9 * (d.edge - edge)
            assert d.bound() <= cost * (1 + 1e-9) + 1e-9


@pytest.mark.parametrize("seed", range(10))
def test_a_budget_that_does_not_bind_costs_no_passes(seed, monkeypatch):
    """A budget every choice meets: the relaxation's choice fits, so no price is searched (none
    can raise the bound): the passes all go to the coarsened diffusion, as without a budget."""
    p = random_problem(seed, "transformer", 40, (2, 5), costs="spec")
    loose = p.with_budget(p.memory(segment_argmin(p, -p.mem_flat)) * 2)
    upper = p.cost(p.min_memory_choice())
    steps = []
    step = _Diffusion.step
    monkeypatch.setattr(_Diffusion, "step", lambda d: (steps.append(d.p.n), step(d)))
    free = dual_bound(p, upper=upper, gap=1e-9, passes=30)
    n_free = len(steps)
    assert dual_bound(loose, upper=upper, gap=1e-9, passes=30) >= free - 1e-12 * abs(free)
    assert len(steps) - n_free <= 30
    c = coarsen(p)
    assert set(steps) <= {c.problem.n if c.problem else -1}


def test_decode_is_the_optimum_where_the_bound_is_tight():
    """Where diffusion closes the gap on a coarsened problem, each node's least reparametrised
    cost, with the folded nodes backtracked, is an optimal choice."""
    tight = 0
    for seed in range(30):
        p = random_problem(seed, "dag", 12, (2, 3), costs="spec")
        c = coarsen(p)
        if c.problem is None:
            continue
        opt = brute_force(p)[0]
        d = _Diffusion.of(c.problem)
        b = c.graph.offset + d.run(opt, 0.0, 3000, math.inf, c.graph.offset)
        if b < opt - 1e-7 * abs(opt):
            continue
        tight += 1
        assert p.cost(_decode(c, d)) == pytest.approx(opt, rel=1e-7)
    assert tight >= 3


@pytest.mark.parametrize("seed", range(3))
def test_diffusion_stops_when_the_gap_stops_closing(seed):
    """Against a poor plan (the least-memory choice) the gap cannot close: diffusion stops once
    ten passes close under STALL of it (under 1e-5 of the plan's cost it took 80-230 passes)."""
    p = random_problem(seed, "dag", 400, (2, 6), costs="spec")
    d = _Diffusion.of(p)
    d.run(p.cost(p.min_memory_choice()), 0.0, 5000, math.inf)
    assert d.passes <= 40
