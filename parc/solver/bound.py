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

here on every node at once (one pass is a few array reductions: `_Diffusion`). Its
fixed points can sit below the LP relaxation's bound, but on the training steps measured it
closes most of the gap the trivial bound (every node and edge at its own minimum) leaves
(docs/solver.md).

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
from parc.solver.problem import Problem, relative_gap, segment_argmin

# diffusion stops when ten passes close under this fraction of the gap left (`_Diffusion.run`)
STALL = 0.01


@dataclass
class _Group:
    """The edges of one shape (s_u, s_v): their reparametrised costs as one [s_u, s_v, edges]
    block (a view into `_Diffusion.flat`; the edge innermost, so that a row's or a column's
    minimum is an elementwise minimum of contiguous planes), and each row's and column's flat
    node-strategy."""

    block: np.ndarray
    u: np.ndarray  # [s_u, edges]: the flat node-strategy of each row
    v: np.ndarray  # [s_v, edges]: of each column
    rows: np.ndarray  # [s_u, edges]: a view into `_Diffusion.rows`, each row's minimum (step)
    cols: np.ndarray  # [s_v, edges]: into `_Diffusion.cols`


@dataclass
class _Diffusion:
    """The reparametrised costs: comp' flat, comm' grouped by edge shape (row and column minima
    are then reductions along an axis of a contiguous block, and the updates broadcasts, where
    the flat layout needed a gather and segmented reductions per pass; a training step's entries
    fall in a few dozen shapes: benchmarks/LOG.md, 2026-11-27, third session)."""

    p: Problem
    groups: list[_Group]
    flat: np.ndarray  # every group's block, back to back
    order: np.ndarray  # per entry of `flat`, its index in the problem's comm_flat
    rows: np.ndarray  # every group's row minima, back to back (step's scratch)
    cols: np.ndarray
    row_node: np.ndarray  # the flat node-strategy of each entry of `rows`
    col_node: np.ndarray
    deg: np.ndarray  # per flat node-strategy, its node's degree
    node: np.ndarray  # comp' (flat)
    passes: int = 0  # updates so far (steps and price moves): the rounding margin grows with them

    @classmethod
    def of(cls, p: Problem) -> _Diffusion:
        u, v = p.edges[:, 0], p.edges[:, 1]
        su, sv = p.s[u], p.s[v]
        shapes = np.stack([su, sv], axis=1)
        kinds, which = np.unique(shapes, axis=0, return_inverse=True)
        which = which.reshape(-1)
        specs, orders, row_nodes, col_nodes = [], [], [], []
        at = rows_at = cols_at = 0
        for k, (a, b) in enumerate(kinds.tolist()):
            es = np.flatnonzero(which == k)
            orders.append((p.comm_offsets[es][None, :] + np.arange(a * b)[:, None]).reshape(-1))
            uu = p.offsets[u[es]][None, :] + np.arange(a)[:, None]
            vv = p.offsets[v[es]][None, :] + np.arange(b)[:, None]
            row_nodes.append(uu.reshape(-1))
            col_nodes.append(vv.reshape(-1))
            specs.append((len(es), a, b, at, rows_at, cols_at, uu, vv))
            at, rows_at, cols_at = at + len(es) * a * b, rows_at + len(es) * a, cols_at + len(es) * b
        order = np.concatenate(orders).astype(np.int64) if orders else np.zeros(0, dtype=np.int64)
        flat = p.comm_flat[order].copy()
        rows, cols = np.empty(rows_at), np.empty(cols_at)
        groups = [_Group(flat[at:at + e * a * b].reshape(a, b, e), uu, vv,
                         rows[r:r + e * a].reshape(a, e), cols[c:c + e * b].reshape(b, e))
                  for e, a, b, at, r, c, uu, vv in specs]
        empty = np.zeros(0, dtype=np.int64)
        deg = np.bincount(u, minlength=p.n) + np.bincount(v, minlength=p.n)
        return cls(p, groups, flat, order, rows, cols,
                   np.concatenate(row_nodes) if row_nodes else empty, np.concatenate(col_nodes) if col_nodes else empty,
                   np.repeat(deg, p.s).astype(np.float64), p.comp_flat.copy())

    @property
    def edge(self) -> np.ndarray:
        """comm' in the problem's comm_flat order (a copy)."""
        out = np.empty(len(self.flat))
        out[self.order] = self.flat
        return out

    @edge.setter
    def edge(self, value: np.ndarray) -> None:
        self.flat[:] = np.asarray(value)[self.order]

    def bound(self) -> float:
        """sum of the minima, less what rounding can have moved it: each pass changes every cost
        by a few operations, each off by at most eps of the largest magnitude, so the sum of
        n + |E| minima is off by at most (n + |E|) (passes + 1) 8 eps max|cost| (a blow-up
        cannot prove a bound it does not have)."""
        b = float(np.minimum.reduceat(self.node, self.p.offsets[:-1]).sum())
        size = float(np.abs(self.node).max())
        for g in self.groups:
            least = g.block.min(axis=(0, 1))
            b += float(least.sum())
            size = max(size, float(g.block.max()), -float(least.min()))
        terms = self.p.n + self.p.num_edges
        return b - terms * (self.passes + 1) * 8 * np.finfo(np.float64).eps * size

    def step(self) -> None:
        self.passes += 1
        for g in self.groups:
            np.min(g.block, axis=1, out=g.rows)
            np.min(g.block, axis=0, out=g.cols)
        size = len(self.node)
        minima = np.bincount(self.row_node, self.rows, size) + np.bincount(self.col_node, self.cols, size)
        share = (self.node + minima) / (self.deg + 1)
        for g in self.groups:  # two additions per entry, in place
            g.block += (share[g.u] - g.rows)[:, None, :]
            g.block += (share[g.v] - g.cols)[None, :, :]
        self.node -= self.deg * share - minima

    def run(self, upper: float, gap: float, passes: int, deadline: float, offset: float = 0.0) -> float:
        """Diffusion passes until the bound plus `offset` is within `gap` of `upper`, stalls, or
        time is up; the bound (without the offset). Stalled: ten passes closed under STALL of
        the gap left (late passes close little of it, and halving it would take hundreds more:
        benchmarks/LOG.md, 2026-11-26, fifth session), or under 1e-5 of the plan's cost."""
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
    # (benchmarks/LOG.md, 2026-11-25, third session)
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
