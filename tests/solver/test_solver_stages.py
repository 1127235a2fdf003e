"""The stage ILP of Rhino 5.1-5.2 (parc/solver/stages.py) against brute force on small DAGs,
with and without per-stage capacities, and Rhino's bounds."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from parc.solver.stages import ancestors, solve_stages, stage_bounds, stage_ilp


def _brute(weight, edges, volume, count, lo, hi, cap):
    best = None
    for x in itertools.product(range(count), repeat=len(weight)):
        if any(not lo[i] <= x[i] <= hi[i] for i in range(len(x))):
            continue
        if any(x[j] < x[i] for i, j in edges):
            continue
        load = np.zeros(count)
        for i, s in enumerate(x):
            load[s] += weight[i]
        if (load > cap + 1e-12).any():
            continue
        cut = sum(v for (i, j), v in zip(edges, volume) if x[i] != x[j])
        best = cut if best is None else min(best, cut)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_stage_ilp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 8))
    count = int(rng.integers(2, 4))
    edges = sorted({(int(i), int(j)) for j in range(1, n) for i in rng.choice(j, size=min(j, 2), replace=False)})
    volume = [float(v) for v in rng.integers(1, 100, size=len(edges))]
    weight = rng.uniform(0.5, 2.0, size=n)
    per = weight.sum() / count
    cap = 1.6 * per
    lo = np.zeros(n, dtype=int)
    hi = np.full(n, count - 1)
    got = stage_ilp(weight, edges, volume, count, lo, hi, cap, 10.0)
    want = _brute(weight, edges, volume, count, lo, hi, cap)
    if want is None:
        assert got is None
        return
    x, status = got
    assert status == "optimal"
    assert all(x[j] >= x[i] for i, j in edges)
    cut = sum(v for (i, j), v in zip(edges, volume) if x[i] != x[j])
    assert cut == pytest.approx(want)


@pytest.mark.parametrize("seed", range(8))
def test_stage_ilp_with_capacities_equals_brute_force(seed):
    """Per-stage capacities (a mixed cluster's stages): stage s's load at most cap * its share."""
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(4, 8))
    count = int(rng.integers(2, 4))
    edges = sorted({(int(i), int(j)) for j in range(1, n) for i in rng.choice(j, size=min(j, 2), replace=False)})
    volume = [float(v) for v in rng.integers(1, 100, size=len(edges))]
    weight = rng.uniform(0.5, 2.0, size=n)
    share = rng.uniform(0.5, 1.5, size=count)
    share /= share.sum()
    per = weight.sum() / count
    cap = 1.4
    lo, hi = np.zeros(n, dtype=int), np.full(n, count - 1)
    got = stage_ilp(weight / per, edges, volume, count, lo, hi, cap, 10.0, 1.0 / (share * count))
    caps = cap * per * share * count  # stage s's own bound, in the weights' units
    best = None
    for x in itertools.product(range(count), repeat=n):
        if any(x[j] < x[i] for i, j in edges):
            continue
        load = np.bincount(x, weights=weight, minlength=count)
        if (load > caps + 1e-9).any():
            continue
        cut = sum(v for (i, j), v in zip(edges, volume) if x[i] != x[j])
        best = cut if best is None else min(best, cut)
    if best is None:
        assert got is None
        return
    x = got[0]
    assert (np.bincount(x, weights=weight, minlength=count) <= caps + 1e-6).all()
    assert sum(v for (i, j), v in zip(edges, volume) if x[i] != x[j]) == pytest.approx(best)


def test_bounds_with_equal_capacities_are_rhinos():
    """Equal loads give Rhino's floor bounds exactly; a faster first stage lets later nodes in."""
    rng = np.random.default_rng(0)
    n, count = 40, 4
    weight = rng.uniform(0.5, 2.0, size=n)
    edges = [(i, i + 1) for i in range(n - 1)]
    anc = ancestors(n, edges)
    a, d = anc @ weight, weight @ anc + weight
    per = weight.sum() / count
    for slack in (0.0, 0.6, 1.3):
        lo, hi = stage_bounds(a, d, np.full(count, per), slack * per)
        want_lo = np.maximum(np.floor(a / per - slack), 0)
        want_hi = np.minimum(count - 1 - np.floor(d / per - slack), count - 1)
        assert (lo == want_lo).all() and (hi == np.maximum(want_hi, want_lo)).all()
    fast_lo, _ = stage_bounds(a, d, np.array([0.55, 0.15, 0.15, 0.15]) * weight.sum(), 0.0)
    even_lo, _ = stage_bounds(a, d, np.full(count, per), 0.0)
    assert (fast_lo <= even_lo).all() and (fast_lo < even_lo).any()
    fast = solve_stages(weight, anc, edges, [1.0] * len(edges), count, 0.1, {}, 10.0, True, [0.55, 0.15, 0.15, 0.15]).stage
    even = solve_stages(weight, anc, edges, [1.0] * len(edges), count, 0.1, {}, 10.0, True, None).stage
    assert weight[fast == 0].sum() > weight[even == 0].sum()  # the fast stage takes more layers


def test_pins_fix_a_stage_and_contradicting_pins_raise():
    """A pinned node takes its stage, even where balance alone puts it elsewhere (without pins the
    chain splits [0 0 1 1] at eps 0.1); pins against the edges' order leave no split at any eps."""
    from parc.errors import InfeasiblePlanError

    weight = np.ones(4)
    edges = [(0, 1), (1, 2), (2, 3)]
    anc = ancestors(4, edges)
    free = solve_stages(weight, anc, edges, [1.0, 1.0, 1.0], 2, 0.1, {}, 10.0)
    assert list(free.stage) == [0, 0, 1, 1] and free.eps == pytest.approx(0.1)
    plan = solve_stages(weight, anc, edges, [1.0, 1.0, 1.0], 2, 0.1, {1: 1}, 10.0)
    assert list(plan.stage) == [0, 1, 1, 1] and plan.eps > 0.1 and plan.status == "optimal"
    with pytest.raises(InfeasiblePlanError, match="2 stages"):
        solve_stages(weight, anc, edges, [1.0, 1.0, 1.0], 2, 0.1, {0: 1, 3: 0}, 10.0)
