"""solve(): O2 and O3 against brute force and each other; the memory-constrained search."""

from __future__ import annotations

import numpy as np
import pytest
from solver_brute import brute_force

from parc.errors import InfeasiblePlanError, UsageError
from parc.solver import (
    IlpOptions,
    MemoryBudgetError,
    Problem,
    SearchOptions,
    random_problem,
    restrict_largest,
    solve,
    solve_o2,
)
from parc.solver.generate import KINDS
from parc.solver.search import memory_order

EXACT = IlpOptions(mip_gap=0.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(10))
def test_o2_equals_brute_force(kind, seed):
    """O2 is exact: cones and series nodes by DP, cores by DP (default) or by an ILP per pair."""
    n = 8 if kind != "transformer" else 16
    p = random_problem(
        seed,
        kind,
        n,
        (1, 4) if kind != "transformer" else (1, 2),
        costs="uniform" if seed % 2 else "spec",
        pin_frac=0.25,
    )
    opt = brute_force(p)[0]
    for opts in (SearchOptions(ilp=EXACT), SearchOptions(ilp=EXACT, dp_limit=0)):
        sol = solve(p, "O2", opts)
        assert sol.cost == pytest.approx(opt) and sol.status == "optimal" and sol.gap == 0.0
        assert sol.cost == p.cost(sol.choice)


@pytest.mark.parametrize("seed", range(10))
def test_o2_entry_mode_is_feasible_and_no_better_than_optimal(seed):
    p = random_problem(seed, "transformer", 16, (1, 3), pin_frac=0.2)
    sol = solve(p, "O2", SearchOptions(ilp=EXACT, dp_limit=0, segment_pairs="entry"))
    assert sol.cost >= brute_force(p)[0] - 1e-9 and sol.cost == p.cost(sol.choice)


@pytest.mark.parametrize("seed", range(3))
def test_o2_matches_o3_on_transformer_instances(seed):
    """Measured: O2 (exact DP over segments) equals O3; O2 with one ILP per entry strategy stays
    within a few percent (measured 0.00-0.32% on these seeds; see docs/solver.md)."""
    p = random_problem(seed, "transformer", 150, (4, 8), costs="spec")
    o3 = solve(p, "O3")
    o2 = solve(p, "O2")
    entry = solve(p, "O2", SearchOptions(dp_limit=0, segment_pairs="entry"))
    assert o2.cost == pytest.approx(o3.cost, rel=1e-4)
    assert o2.status == "optimal"
    gap = entry.cost / o3.cost - 1
    print(
        f"seed {seed}: O3 {o3.cost:.4f} in {o3.time_s:.2f}s, O2 {o2.cost:.4f} in {o2.time_s:.3f}s, "
        f"O2-entry {entry.cost:.4f} (+{100 * gap:.2f}%)"
    )
    assert -1e-4 <= gap <= 0.05


def test_no_critical_nodes_is_one_segment():
    """Two disconnected chains: no node is on every path; O2 solves the one segment."""
    p = random_problem(0, "chain", 4, (2, 3))
    q = Problem(comp=p.comp * 2, edges=np.concatenate([p.edges, p.edges + 4]), comm=p.comm * 2)
    for opts in (SearchOptions(), SearchOptions(dp_limit=0)):
        assert solve(q, "O2", opts).cost == pytest.approx(2 * brute_force(p)[0])


@pytest.mark.parametrize("seed", range(12))
def test_memory_search(seed):
    """O3 with the memory row is exact; O2 (memory priced) fits and is bounded; Rhino 4.4's
    restriction gives the same plan at O2 and O3."""
    p = random_problem(
        seed,
        ["dag", "transformer"][seed % 2],
        8 if seed % 2 == 0 else 16,
        (1, 4) if seed % 2 == 0 else (1, 2),
        costs="spec",
        budget=[0.0, 0.1, 0.4][seed % 3],
    )
    opt = brute_force(p)[0]
    o3 = solve(p, "O3", SearchOptions(ilp=EXACT))
    assert o3.cost == pytest.approx(opt)
    o2 = solve(p, "O2")
    assert p.fits(o2.choice) and o2.cost >= opt - 1e-9
    assert o2.lower_bound <= opt + 1e-9
    o2r = solve(p, "O2", SearchOptions(ilp=EXACT, memory="restrict"))
    o3r = solve(p, "O3", SearchOptions(ilp=EXACT, memory="restrict"))
    assert p.fits(o3r.choice) and o3r.cost == pytest.approx(o2r.cost)


@pytest.mark.parametrize("seed", range(24))
def test_priced_memory_fits_with_a_valid_bound(seed):
    """O2 under a binding budget prices memory: the plan fits, its lower bound (the Lagrangian
    dual) bounds the optimum, and on these problems it stays within 10% of it."""
    kind = ["tree", "dag", "transformer"][seed % 3]
    p = random_problem(seed, kind, 8 if kind != "transformer" else 14, (1, 4) if kind != "transformer" else (1, 3),
                       costs="spec", budget=[0.2, 0.4, 0.6][seed % 3])
    found = brute_force(p)
    if found is None:
        with pytest.raises(InfeasiblePlanError):
            solve(p, "O2", SearchOptions(ilp=EXACT))
        return
    opt, free = found[0], brute_force(p.with_budget(None))[0]
    o2 = solve(p, "O2", SearchOptions(ilp=EXACT))
    assert p.fits(o2.choice) and opt - 1e-9 <= o2.cost <= 1.10 * opt + 1e-12
    assert free - 1e-9 <= o2.lower_bound <= opt + 1e-9
    if opt > free + 1e-9:
        assert o2.method.endswith("+price")


def _identical_layers(n: int) -> Problem:
    """n identical layers in a chain, each fast and large (strategy 0: 1 s, 10 bytes) or slow and
    small (strategy 1: 3 s, 1 byte), free to mix (no resharding cost): the budget fits half."""
    comp = tuple(np.array([1.0, 3.0]) for _ in range(n))
    mem = tuple(np.array([10.0, 1.0]) for _ in range(n))
    edges = np.array([(i, i + 1) for i in range(n - 1)], dtype=np.int64).reshape(-1, 2)
    comm = tuple(np.zeros((2, 2)) for _ in range(n - 1))
    return Problem(comp, edges, comm, mem, budget=n // 2 * 10.0 + (n - n // 2) * 1.0)


def test_priced_plans_jump_over_identical_layers_and_the_mix_lands_between():
    """Identical layers change layout at one price, so every priced plan either keeps all of them
    fast (over the budget) or makes all of them small: the price search alone returns the slow
    plan. Its mix (an exact ILP over the two plans, memory row included) makes half of them small,
    the optimum; the Lagrangian bound stays a bound."""
    p = _identical_layers(8)
    alone = solve(p, "O2", SearchOptions(ilp=EXACT))
    assert alone.cost == pytest.approx(24.0) and alone.method.endswith("+price")
    mixed = solve(p, "O2", SearchOptions(ilp=EXACT, mix=EXACT))
    assert p.fits(mixed.choice) and mixed.cost == pytest.approx(16.0) and mixed.method.endswith("+price+mix")
    assert mixed.lower_bound <= 16.0 + 1e-9 and alone.lower_bound <= 16.0 + 1e-9
    # O3 pricing memory mixes with the row, not with another price search
    o3 = solve(p, "O3", SearchOptions(ilp=EXACT, memory="price", mix=EXACT))
    assert o3.cost == pytest.approx(16.0) and o3.method.endswith("+price+mix")


def _copies(q: Problem, k: int) -> Problem:
    """k copies of q in a chain (the last node of each feeds the first of the next, for free):
    a model's identical layers."""
    n = q.n
    edges = [e + j * n for j in range(k) for e in q.edges] + [np.array([j * n + n - 1, (j + 1) * n])
                                                            for j in range(k - 1)]
    comm = [c for _ in range(k) for c in q.comm] + [np.zeros((len(q.comp[-1]), len(q.comp[0])))] * (k - 1)
    return Problem(q.comp * k, np.array(edges, dtype=np.int64), tuple(comm), q.mem * k)


# seeds whose 4-node trees trade memory for time (the others have one least-memory plan that is
# also the fastest, so no budget between them binds)
@pytest.mark.parametrize("seed", [2, 3, 9, 10, 11, 12, 14])
def test_the_mix_finds_what_the_price_search_jumps_over(seed):
    """Six identical random layers under a budget halfway between their least memory and their
    fastest plan's: the price search alone lands above the optimum, the mix below it and within
    1% of it (the exact ILP with the memory row), and both bounds stay bounds."""
    p = _copies(random_problem(seed, "tree", 4, (2, 3), costs="spec"), 6)
    free = solve(p, "O3", SearchOptions(ilp=EXACT))
    least = p.min_memory()
    assert p.memory(free.choice) > least * 1.001  # the seed has room for a budget that binds
    p = p.with_budget(least + 0.5 * (p.memory(free.choice) - least))
    opt = solve(p, "O3", SearchOptions(ilp=EXACT)).cost
    alone = solve(p, "O2", SearchOptions(ilp=EXACT))
    mixed = solve(p, "O2", SearchOptions(ilp=EXACT, mix=EXACT))
    assert p.fits(mixed.choice) and mixed.cost == pytest.approx(p.cost(mixed.choice))
    assert opt - 1e-9 <= mixed.cost <= opt * 1.01 < alone.cost
    assert mixed.lower_bound <= opt + 1e-9 and alone.lower_bound <= opt + 1e-9


def test_memory_search_finds_the_smallest_k():
    p = random_problem(5, "transformer", 58, (4, 6), costs="spec")
    free = solve(p, "O2")
    p = p.with_budget(0.5 * (p.memory(free.choice) + p.min_memory()))
    sol = solve(p, "O2", SearchOptions(memory="restrict"))
    k = int(sol.method.split("k=")[1].rstrip(")"))
    assert 0 < k <= p.n and p.fits(sol.choice)
    assert not p.fits(solve(restrict_largest(p.with_budget(None), k - 1), "O2").choice)
    assert sol.lower_bound == pytest.approx(free.cost)
    assert 0 <= sol.gap < 1


def test_restrict_largest_and_a_custom_hook():
    p = random_problem(2, "dag", 10, (2, 4), costs="spec")
    order = memory_order(p)
    r = restrict_largest(p, 2)
    for i in order[:2]:
        kept = np.flatnonzero(r.allowed(i))
        assert np.all(p.mem[i][kept] == p.mem[i].min())
    assert all(r.allowed(i).all() for i in order[2:])
    calls = []

    def hook(q, k):
        calls.append(k)
        return restrict_largest(q, k)

    p = p.with_budget(p.min_memory())
    sol = solve(p, "O2", SearchOptions(memory="restrict", restrict=hook))
    assert calls and p.fits(sol.choice)


def test_a_hook_that_cannot_reach_the_budget_is_reported():
    p = random_problem(2, "dag", 10, (2, 4), costs="spec")
    p = p.with_budget(p.min_memory())
    with pytest.raises(InfeasiblePlanError, match="restrict hook cannot reach"):
        solve(p, "O2", SearchOptions(memory="restrict", restrict=lambda q, k: q))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_infeasible_budget(level):
    p = random_problem(1, "transformer", 30, (2, 4), costs="spec")
    p = p.with_budget(p.min_memory() * 0.99)
    with pytest.raises(MemoryBudgetError, match="exceeds the budget") as info:
        solve(p, level)
    assert info.value.need > info.value.budget


def test_usage_errors():
    p = random_problem(0, "dag", 5, (2, 2), budget=0.5)
    with pytest.raises(UsageError, match="level"):
        solve(p, "O1")
    with pytest.raises(UsageError, match="needs level O3"):
        solve(p, "O2", SearchOptions(memory="row"))
    with pytest.raises(UsageError, match="segment_pairs"):
        SearchOptions(segment_pairs="some")
    with pytest.raises(UsageError, match="memory"):
        SearchOptions(memory="rows")
    with pytest.raises(UsageError, match="cannot honour a memory budget"):
        solve_o2(p)


def test_deterministic():
    p = random_problem(7, "transformer", 100, (3, 6), costs="uniform")
    for level in ("O2", "O3"):
        assert solve(p, level).choice.tolist() == solve(p, level).choice.tolist()
