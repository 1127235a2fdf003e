"""A lower bound on a problem's optimum by min-sum diffusion: the proven gap of a heuristic plan.

For any messages lam_{e,i}(a) the reparametrised costs

    comp'_i(a) = comp_i(a) + sum_{e at i} lam_{e,i}(a)
    comm'_e(a, b) = comm_e(a, b) - lam_{e,u}(a) - lam_{e,v}(b)

give every choice the same total cost, so sum_i min comp'_i + sum_e min comm'_e bounds the
optimum from below, whatever the messages are: the bound is valid by construction, and the
algorithm only has to make it tight. Min-sum diffusion (Schlesinger; Werner 2007, "A linear
programming approach to max-sum problem") moves each node's cost evenly over itself and its
edges' minima,

    T_i(a) = comp'_i(a) + sum_{e at i} min_b comm'_e(a, b),   each of the deg_i + 1 parts -> T_i / (deg_i + 1)

here on every node at once (one pass is a few array reductions over the flat cost arrays). Its
fixed points can sit below the LP relaxation's bound, but on the training steps measured it
closes most of the gap the trivial bound (every node and edge at its own minimum) leaves: on
gpt-medium's AdamW step on a 2 x 4 mesh the trivial bound is 11% below the optimum, 100 passes
(1.9 s) 0.2% (docs/solver.md).

Under a memory budget M the bound is Lagrangian: for every price p >= 0,
min_x C(x) + p (mem(x) - M) <= C(x*) for the constrained optimum x*, and the diffusion bound of
comp + p mem minus p M bounds that. The price is searched (golden section over log p); the
messages carry over from one price to the next (a price only moves the nodes' own costs).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from parc.solver.coarsen import Coarse, coarsen
from parc.solver.dee import prune
from parc.solver.problem import Problem, ragged, relative_gap, segment_argmin

# diffusion stops when ten passes close under this fraction of the gap left (`_Diffusion.run`)
STALL = 0.01


@dataclass
class _Diffusion:
    """Index arrays of a problem's flat costs, and the reparametrised costs themselves."""

    p: Problem
    row_starts: np.ndarray  # start of each (edge, u-strategy) row in comm_flat
    row_node: np.ndarray  # the flat node-strategy each row belongs to
    row_of: np.ndarray  # per comm entry, its row
    perm: np.ndarray  # comm entries ordered by (edge, v-strategy, u-strategy)
    col_starts: np.ndarray  # start of each (edge, v-strategy) column in comm_flat[perm]
    col_node: np.ndarray
    col_of: np.ndarray  # per comm entry, its column
    deg: np.ndarray  # per flat node-strategy, its node's degree
    node: np.ndarray  # comp' (flat)
    edge: np.ndarray  # comm' (flat)
    passes: int = 0  # updates so far (steps and price moves): the rounding margin grows with them

    @classmethod
    def of(cls, p: Problem) -> _Diffusion:
        e, j1, j2 = p.comm_entries
        u, v = p.edges[:, 0], p.edges[:, 1]
        su, sv = p.s[u], p.s[v]
        re, rj = ragged(su)
        ce, cj = ragged(sv)
        perm = np.lexsort((j1, j2, e))
        col_of = np.empty(len(e), dtype=np.int64)
        col_of[perm] = np.repeat(np.arange(len(ce)), su[ce])
        deg = np.bincount(u, minlength=p.n) + np.bincount(v, minlength=p.n)
        return cls(p, p.comm_offsets[re] + rj * sv[re], p.offsets[u[re]] + rj, np.repeat(np.arange(len(re)), sv[re]),
                   perm, np.concatenate([[0], np.cumsum(su[ce])[:-1]]).astype(np.int64), p.offsets[v[ce]] + cj,
                   col_of, np.repeat(deg, p.s).astype(np.float64), p.comp_flat.copy(), p.comm_flat.copy())

    def bound(self) -> float:
        """sum of the minima, less what rounding can have moved it: each pass changes every cost
        by a few operations, each off by at most eps of the largest magnitude, so the sum of
        n + |E| minima is off by at most (n + |E|) (passes + 1) 8 eps max|cost| (a blow-up
        cannot prove a bound it does not have)."""
        b = float(np.minimum.reduceat(self.node, self.p.offsets[:-1]).sum())
        if len(self.edge):
            b += float(np.minimum.reduceat(self.edge, self.p.comm_offsets[:-1]).sum())
        size = max(float(np.abs(self.node).max()), float(np.abs(self.edge).max()) if len(self.edge) else 0.0)
        terms = self.p.n + self.p.num_edges
        return b - terms * (self.passes + 1) * 8 * np.finfo(np.float64).eps * size

    def step(self) -> None:
        self.passes += 1
        rows = np.minimum.reduceat(self.edge, self.row_starts)
        cols = np.minimum.reduceat(self.edge[self.perm], self.col_starts)
        size = len(self.node)
        minima = np.bincount(self.row_node, rows, size) + np.bincount(self.col_node, cols, size)
        share = (self.node + minima) / (self.deg + 1)
        self.edge += (share[self.row_node] - rows)[self.row_of] + (share[self.col_node] - cols)[self.col_of]
        self.node -= self.deg * share - minima

    def run(self, upper: float, gap: float, passes: int, deadline: float, offset: float = 0.0) -> float:
        """Diffusion passes until the bound plus `offset` is within `gap` of `upper`, stalls, or
        time is up; the bound (without the offset). Stalled: ten passes closed under STALL of
        the gap left (gpt-medium's step on 4 x 2 closes 1% of its 0.7% gap per ten passes after
        200, where halving the gap would take hundreds more), or under 1e-5 of the plan's cost."""
        best, last = self.bound(), -math.inf
        scale = max(abs(upper), 1e-300)
        for k in range(passes):
            if relative_gap(upper, best + offset) <= gap or time.perf_counter() > deadline:
                break
            self.step()
            best = max(best, self.bound())
            if k % 10 == 9:
                if best - last < max(1e-5 * scale, STALL * (upper - best - offset)):
                    break
                last = best
        return best


def _decode(c: Coarse, d: _Diffusion | None) -> np.ndarray:
    """A choice of the problem c coarsens: each kept node at its least reparametrised cost in d
    (the relaxation's choice where the bound is tight), the folded nodes at their best given it."""
    x = np.zeros(len(c.graph.alive), dtype=np.int64)
    if d is not None:
        x[c.kept] = segment_argmin(d.p, np.where(d.p.allowed_flat, d.node, np.inf))
    c.graph.backtrack(x)
    return x


def dual_bound(p: Problem, upper: float, gap: float = 5e-3, passes: int = 300, time_limit: float = 10.0) -> float:
    """A proven lower bound on p's optimum (module docstring), at least p's trivial bound.
    `upper` is a plan's cost: diffusion stops once the bound is within `gap` of it, when it
    stalls, after `passes` passes or `time_limit` seconds (a budget's price search shares them)."""
    deadline = time.perf_counter() + time_limit
    q = prune(p, sweeps=0).problem if p.pins else p  # a pin's forbidden strategies dropped
    trivial = q.trivial_bound()
    if not q.num_edges:
        return trivial
    # first without the budget (a relaxation), on the exactly coarsened problem (chains and
    # cones folded by min-plus products): the same optimum, and diffusion needs fewer passes
    # (gpt-medium's step on 2 x 4: 0.5% in 40 passes, 0.65 s, against 100 passes, 1.5 s)
    c = coarsen(q.with_budget(None))
    free = None if c.problem is None else _Diffusion.of(c.problem)
    if free is None:
        best = c.graph.offset  # folded whole: the budget-free optimum
    else:
        best = c.graph.offset + free.run(upper, gap, passes if q.budget is None else passes // 3, deadline,
                                         c.graph.offset)
    if q.budget is None or relative_gap(upper, best) <= gap:
        return max(trivial, best)
    if q.fits(_decode(c, free)):
        # the budget does not bind the relaxation's choice, so no price raises the bound (L's
        # supergradient at price 0 is mem - M <= 0): the remaining passes go to diffusion
        if free is not None:
            best = c.graph.offset + free.run(upper, gap, passes - passes // 3, deadline, c.graph.offset)
        return max(trivial, best)
    d = _Diffusion.of(q.with_budget(None))
    budget = float(q.budget)
    # a price above `top` cannot beat the price 0: the least-memory choice alone bounds L(p) by
    # C(x_min) + p (mem(x_min) - M)
    x_min = q.min_memory_choice()
    slack = budget - q.memory(x_min)
    mem = q.mem_flat
    price = 0.0
    each = max(passes // 10, 20)
    if slack <= 0:
        return max(trivial, best)
    best = max(best, d.run(upper, gap, passes // 3, deadline))  # L(0) again, its messages the price's start
    top = (q.cost(x_min) - best) / slack
    if not top > 0:
        return max(trivial, best)

    def at(p_new: float) -> float:
        nonlocal price
        d.node += (p_new - price) * mem
        d.passes += 1
        price = p_new
        return d.run(upper + price * budget, gap, each, deadline) - price * budget

    # golden section over log p on [top * 1e-6, top]; L is concave in p
    lo, hi = math.log(top * 1e-6), math.log(top)
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = at(math.exp(a)), at(math.exp(b))
    best = max(best, fa, fb)
    while hi - lo > 0.05 and time.perf_counter() < deadline and relative_gap(upper, best) > gap:
        if fa >= fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = at(math.exp(a))
            best = max(best, fa)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = at(math.exp(b))
            best = max(best, fb)
    return max(trivial, best)


__all__ = ["dual_bound"]
