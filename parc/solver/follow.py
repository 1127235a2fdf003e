"""Follow coarsening: solve a problem whose nodes come in groups, each following a leader.

A training step's backward nodes usually want the layout their forward node has, and an
optimizer's nodes the layout of the state they update (Alpa and XLA's auto-sharding make the
backward "follow" the forward). Given a grouping (leader[i]: the node whose strategy decides
i's) and, per member, an affinity matrix A_i[s, t] (how well i's strategy t goes with its
leader's strategy s beyond the problem's own edges), `follow_maps` fixes one strategy map_i[s]
per member and leader strategy: the members' best joint choice under the group's own costs
(compute, internal edges, affinities), for every s at once by bucket elimination (dp.py). The
grouped problem has one node per group (its leader's strategies), costs summed exactly under
the maps, and the edges between groups as they are: a training step shrinks to about its
forward graph plus one node per parameter and per optimizer chain (docs/plan.md).

Its optimum is a feasible choice of the original problem, not its optimum. `solve_follow` then
polishes it by block coordinate descent on the original problem: each block of `Grouping.blocks`
free in turn with the rest fixed (a training step: its backward and optimizer side, then its
forward side), each block solved exactly (`condition` folds the fixed nodes into their
neighbours' costs), until a round gains nothing. The cost never rises, and ends near the exact
optimum; `refine` then makes large-neighbourhood steps on the whole problem, which close the
rest (docs/solver.md).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from parc.errors import InfeasiblePlanError
from parc.solver.coarsen import coarsen
from parc.solver.dp import eliminate_factors, elimination_order
from parc.solver.problem import Problem, Solution, ragged, relative_gap

log = logging.getLogger("parc.solver")


@dataclass(frozen=True, eq=False)
class Grouping:
    """Which node follows which: leader[i] == i for a leader (and for a node alone)."""

    leader: np.ndarray
    affinity: Mapping[int, np.ndarray] = field(default_factory=dict)  # member -> (s_leader, s_member)
    # the polish's blocks, each a mask of the nodes it frees (empty: the members, then the leaders)
    blocks: tuple[np.ndarray, ...] = ()

    @property
    def members(self) -> np.ndarray:
        return np.flatnonzero(self.leader != np.arange(len(self.leader)))


def follow_maps(p: Problem, g: Grouping, limit: int = 1 << 16) -> list[np.ndarray]:
    """map_i[s]: member i's strategy when its leader takes strategy s (a leader: s itself).

    Per group, the members' best joint choice for every leader strategy at once: the group's
    own costs (compute, its internal edges, the affinities as leader-member factors) by bucket
    elimination of the members (dp.py, exact), or, when a table would pass `limit` cells, member
    by member in breadth-first order from the leader."""
    maps: list[np.ndarray | None] = [None] * p.n
    intra: dict[int, list[tuple[int, int, bool]]] = defaultdict(list)  # node -> (edge, other, other is source)
    for e, (u, v) in enumerate(p.edges.tolist()):
        if g.leader[u] == g.leader[v]:
            intra[u].append((e, v, False))
            intra[v].append((e, u, True))
    groups: dict[int, list[int]] = defaultdict(list)
    for i in g.members.tolist():
        groups[int(g.leader[i])].append(i)
    for i in range(p.n):
        if g.leader[i] == i:
            maps[i] = np.arange(p.s[i])
    for lead, members in groups.items():
        exact = _eliminated(p, g, lead, members, intra, limit)
        if exact is not None:
            for i, m in exact.items():
                maps[i] = m
            continue
        for i in _bfs(lead, set(members), intra):
            c = np.broadcast_to(p.comp[i], (p.s[lead], p.s[i])).copy()
            if i in g.affinity:
                c += g.affinity[i]
            for e, j, j_is_source in intra[i]:
                if maps[j] is None:
                    continue
                c += p.comm[e][maps[j], :] if j_is_source else p.comm[e][:, maps[j]].T
            c[:, ~p.allowed(i)] = np.inf
            maps[i] = np.argmin(c, axis=1)
    return maps  # type: ignore[return-value]


def _eliminated(p: Problem, g: Grouping, lead: int, members: list[int],
                intra: Mapping[int, list[tuple[int, int, bool]]], limit: int) -> dict[int, np.ndarray] | None:
    """Each member's map from eliminating the members exactly (None: a table passes `limit`)."""
    factors: list = []
    adj: dict[int, set[int]] = {lead: set()}
    for i in members:
        adj.setdefault(i, set())
        factors.append(((i,), np.where(p.allowed(i), p.comp[i], np.inf)))
        if i in g.affinity:
            a = g.affinity[i]
            factors.append(((lead, i), a) if lead < i else ((i, lead), a.T))
            adj[i].add(lead)
            adj[lead].add(i)
    seen: set[int] = set()
    for i in [lead, *members]:
        for e, _, _ in intra[i]:
            if e in seen:
                continue
            seen.add(e)
            u, v = (int(w) for w in p.edges[e])
            m = p.comm[e]
            factors.append(((u, v), m) if u < v else ((v, u), m.T))
            adj[u].add(v)
            adj[v].add(u)
    size = {v: int(p.s[v]) for v in adj}
    order = elimination_order(adj, members, size, limit)
    if order is None:
        return None
    _, trace = eliminate_factors(factors, order)
    choice: dict[int, np.ndarray] = {lead: np.arange(p.s[lead])}
    for v, scope, table in reversed(trace):
        choice[v] = table[tuple(choice[u] for u in scope)] if scope else np.full(p.s[lead], int(table))
    del choice[lead]
    return choice


def _bfs(lead: int, members: set[int], intra: Mapping[int, list[tuple[int, int, bool]]]) -> list[int]:
    """The members in breadth-first order from the leader over the group's edges, then the
    ones no edge reaches (in index order)."""
    order, seen, queue = [], {lead}, deque([lead])
    while queue:
        u = queue.popleft()
        for _, v, _ in sorted(intra.get(u, ()), key=lambda t: t[1]):
            if v in members and v not in seen:
                seen.add(v)
                order.append(v)
                queue.append(v)
    return order + sorted(members - seen)


@dataclass(frozen=True, eq=False)
class Grouped:
    """The grouped problem and how to expand its choice back."""

    problem: Problem
    leaders: np.ndarray  # original index of each grouped node
    group: np.ndarray  # grouped node of each original node
    maps: list[np.ndarray]

    def expand(self, y: np.ndarray) -> np.ndarray:
        return np.array([m[y[k]] for m, k in zip(self.maps, self.group.tolist())], dtype=np.int64)


def grouped(p: Problem, g: Grouping) -> Grouped:
    """One node per group with its leader's strategies, its members following by their maps
    (`follow_maps`); every cost summed exactly under the maps.

    (Offering the greedy maps as well, as more joint choices per group, gave the same plans on
    gpt-medium's step, flat and 2-D, for more time: docs/solver.md.)"""
    maps = follow_maps(p, g)
    leaders = np.flatnonzero(g.leader == np.arange(p.n))
    where = np.full(p.n, -1, dtype=np.int64)
    where[leaders] = np.arange(len(leaders))
    group = where[g.leader]
    sizes = [int(p.s[i]) for i in leaders.tolist()]
    comp = [np.zeros(c) for c in sizes]
    mem = [np.zeros(c) for c in sizes]
    ok = [np.ones(c, dtype=bool) for c in sizes]
    for i in range(p.n):
        k = group[i]
        comp[k] += p.comp[i][maps[i]]
        mem[k] += p.mem[i][maps[i]]
        ok[k] &= p.allowed(i)[maps[i]]
    pairs: dict[tuple[int, int], np.ndarray] = {}
    for e, (u, v) in enumerate(p.edges.tolist()):
        a, b = int(group[u]), int(group[v])
        if a == b:
            comp[a] += p.comm[e][maps[u], maps[v]]
            continue
        m = p.comm[e][np.ix_(maps[u], maps[v])]
        if a > b:  # oriented by index: the grouped graph may have both directions (backward mirrors forward)
            a, b, m = b, a, m.T
        pairs[a, b] = pairs[a, b] + m if (a, b) in pairs else m
    pins = {}
    for k, allowed in enumerate(ok):
        if not allowed.all():
            pins[k] = np.flatnonzero(allowed).tolist()
    edges = sorted(pairs)
    names = tuple(p.names[i] for i in leaders.tolist()) if p.names else ()
    q = Problem(tuple(comp), np.array(edges, dtype=np.int64).reshape(-1, 2), tuple(pairs[e] for e in edges),
                tuple(mem), p.budget, pins, names)
    return Grouped(q, leaders, group, maps)


def condition(p: Problem, free: np.ndarray, x: np.ndarray) -> Problem:
    """The problem over the nodes where `free` is True, the others fixed at x: their edges to
    free nodes become unary costs, their memory comes off the budget."""
    idx = np.flatnonzero(free)
    local = np.full(p.n, -1, dtype=np.int64)
    local[idx] = np.arange(len(idx))
    u, v = p.edges[:, 0], p.edges[:, 1]
    flat = _with_fixed_ends(p, x, np.flatnonzero(free[u] & ~free[v]), np.flatnonzero(free[v] & ~free[u]))
    comp = [flat[p.offsets[i]:p.offsets[i + 1]] for i in idx.tolist()]
    both = np.flatnonzero(free[u] & free[v])
    edges = np.stack([local[u[both]], local[v[both]]], axis=1)
    budget = None
    if p.budget is not None:
        fixed = np.flatnonzero(~free)
        budget = max(p.budget - float(p.mem_flat[p.offsets[fixed] + x[fixed]].sum()), 0.0)
    pins = {int(local[i]): a for i, a in p.pins if free[i]}
    names = tuple(p.names[i] for i in idx.tolist()) if p.names else ()
    return Problem(tuple(comp), edges, tuple(p.comm[e] for e in both.tolist()),
                   tuple(p.mem[i] for i in idx.tolist()), budget, pins, names)


def _with_fixed_ends(p: Problem, x: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """comp in p's flat strategy layout plus, for each edge (u, v) in `rows`, u's costs with v
    at x[v], and for each edge in `cols`, v's costs with u at x[u]."""
    flat = p.comp_flat.copy()
    u, v = p.edges[:, 0], p.edges[:, 1]
    start, sv = p.comm_offsets[:-1], p.s[v]
    for into, chosen, is_row in ((u, rows, True), (v, cols, False)):
        k, j = ragged(p.s[into[chosen]])
        e = chosen[k]
        src = start[e] + (j * sv[e] + x[v[e]] if is_row else x[u[e]] * sv[e] + j)
        np.add.at(flat, p.offsets[into[e]] + j, p.comm_flat[src])
    return flat


def solve_follow(p: Problem, g: Grouping, solve: Callable[[Problem], Solution], rounds: int = 3) -> Solution:
    """The grouped problem's optimum, polished by block coordinate descent (module docstring).
    Raises InfeasiblePlanError when the grouped problem has no choice within the budget (the
    caller then solves p itself). The grouped optimum bounds nothing below: the lower bound is
    p's trivial bound (the planner proves small plans with the exact ILP from this one).

    (Solving the grouped problem again around the polished choice, with it and the members'
    best responses to it among the joint choices, gained nothing on gpt-medium's step, flat or
    2-D, for more time: not done; docs/solver.md.)"""
    t0 = time.perf_counter()
    gp = grouped(p, g)
    first = _folding_fixed(gp.problem, solve)
    x = gp.expand(first.choice)
    if not p.fits(x):
        raise InfeasiblePlanError("follow coarsening: the grouped optimum does not fit the budget")
    sol = polish(p, g, x, solve, rounds, method=f"follow({p.n}->{gp.problem.n})+{first.method}")
    log.debug("follow: grouped %.6g, polished %.6g", p.cost(x), sol.cost)
    return replace(sol, time_s=time.perf_counter() - t0)


def polish(p: Problem, g: Grouping, x: np.ndarray, solve: Callable[[Problem], Solution], rounds: int = 3,
           method: str = "polish") -> Solution:
    """A fitting choice x of p improved by block coordinate descent (g's blocks, up to `rounds`
    rounds, while one gains): solve_follow's polish of the grouped optimum, or the same from
    another start, such as a baseline's plan (a different local optimum). Lower bound: p's
    trivial bound; `method` names the result."""
    t0 = time.perf_counter()
    if not p.fits(x):
        raise InfeasiblePlanError("polish: the start does not fit the budget")
    x, cost = _polish(p, _blocks(p, g), np.asarray(x, dtype=np.int64).copy(), p.cost(x),
                      partial(_folding_fixed, solve=solve), rounds)
    lower = min(p.trivial_bound(), cost)
    gap = relative_gap(cost, lower)
    return Solution(x, cost, lower, gap, "optimal" if gap <= 1e-9 else "heuristic", time.perf_counter() - t0,
                    method)


def _blocks(p: Problem, g: Grouping) -> tuple[np.ndarray, ...]:
    """The polish's blocks: g's own, or its members apart from its leaders."""
    if g.blocks:
        return g.blocks
    member = np.zeros(p.n, dtype=bool)
    member[g.members] = True
    return member, ~member


def lp_columns(p: Problem) -> int:
    """The edge columns of p's ILP after exact coarsening: what its LP costs (a 2-D mesh's are
    many times a flat mesh's: benchmarks/LOG.md, 2026-11-25, issue 11)."""
    c = coarsen(p)
    return 0 if c.problem is None else int(c.problem.comm_offsets[-1])


def _folding_fixed(p: Problem, solve: Callable[[Problem], Solution]) -> Solution:
    """solve(p) with p's nodes of one allowed strategy folded into their neighbours' costs
    (exact): a constant every group reads (an optimizer's scalar) would otherwise tie the whole
    grouped graph into one segment for O2 (docs/solver.md)."""
    fixed = np.add.reduceat(p.allowed_flat, p.offsets[:-1]) == 1
    if not fixed.any() or fixed.all() or not p.num_edges:
        return solve(p)
    x = np.zeros(p.n, dtype=np.int64)
    x[fixed] = [int(np.flatnonzero(p.allowed(i))[0]) for i in np.flatnonzero(fixed).tolist()]
    sol = solve(condition(p, ~fixed, x))
    x[~fixed] = sol.choice
    cost = p.cost(x)
    lower = min(sol.lower_bound + cost - sol.cost, cost)
    return Solution(x, cost, lower, relative_gap(cost, lower), sol.status, sol.time_s, sol.method)


def _polish(p: Problem, blocks: tuple[np.ndarray, ...], x: np.ndarray, cost: float, solve: Callable[[Problem], Solution],
            rounds: int) -> tuple[np.ndarray, float]:
    """Block coordinate descent: each block free in turn, the rest fixed."""
    for _ in range(rounds):
        gained = False
        for free in blocks:
            if not free.any():
                continue
            try:
                sol = solve(condition(p, free, x))
            except InfeasiblePlanError:
                continue
            y = x.copy()
            y[free] = sol.choice
            c = p.cost(y)
            if p.fits(y) and c < cost * (1 - 1e-9):
                x, cost, gained = y, c, True
        if not gained:
            break
    return x, cost


def neighbourhood(p: Problem, x: np.ndarray, k: int) -> dict[int, list[int]]:
    """Per node, the k strategies that cost least with every neighbour at x (its compute plus
    its edges), and x's own: the candidates of a large-neighbourhood step around x."""
    every = np.arange(p.num_edges)
    flat = _with_fixed_ends(p, x, every, every)
    flat = np.where(p.allowed_flat, flat, np.inf)
    out = {}
    for i in range(p.n):
        c = flat[p.offsets[i]:p.offsets[i + 1]]
        keep = [int(t) for t in np.argsort(c, kind="stable")[:k] if np.isfinite(c[t])]
        out[i] = sorted(set(keep) | {int(x[i])})
    return out


def refine(p: Problem, x: np.ndarray, solve: Callable[[Problem, np.ndarray], Solution], k: int = 2,
           rounds: int = 3) -> tuple[np.ndarray, float]:
    """Large-neighbourhood steps around x: the whole problem with every node restricted to its
    `neighbourhood` (its k best with the neighbours at x, and x's own), solved exactly
    (`solve(problem, start)`, an ILP that starts from x), while a round gains. Joint moves of
    many groups that the polish's blocks cannot make: on gpt-medium's step, k = 2 takes the
    follow plan to the exact optimum in a fraction of the exact LP's time (docs/solver.md)."""
    cost = p.cost(x)
    for _ in range(rounds):
        sol = solve(p.restricted(neighbourhood(p, x, k)), x)
        if not p.fits(sol.choice) or sol.cost >= cost * (1 - 1e-9):
            break
        x, cost = sol.choice, sol.cost
    return x, cost
