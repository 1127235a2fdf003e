"""Exact min-plus dynamic programming: chains, trees, cone folding, series and bucket elimination.

All of it works on a pairwise min-sum model (a FactorGraph): a unary cost vector phi_i per node
(comp_i, +inf where a pin forbids a strategy) and a matrix phi_uv per adjacent pair (the sum of
comm_e over the edges between u and v, in either direction). Eliminating a node v is one
min-plus product and is exact:

  degree 0:  offset  += min_j phi_v[j]
  degree 1:  phi_u[a] += min_j (phi_uv[a, j] + phi_v[j])                 a leaf / a cone (Rhino 4.3.2)
  degree 2:  phi_uw[a, b] += min_j (phi_uv[a, j] + phi_v[j] + phi_vw[j, b])   a series node

The argmin of each elimination is kept, so the choice of v is recovered from its neighbours'
once they are decided. Peeling degree-1 nodes repeatedly is the cone DP of Rhino's level 1
(4.3.2): a cone hanging off its root is solved for every strategy of the root and folded into
the root's cost vector. Peeling degree <= 2 solves every series-parallel graph (treewidth <= 2).
What survives (small cores of higher treewidth) is handled by bucket elimination over tables of
any arity (eliminate_factors), exact in any order, its cost the largest table it builds.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from parc.solver.problem import Problem, ProblemError, Solution


def chain_dp(unary: Sequence[np.ndarray], trans: Sequence[np.ndarray]) -> tuple[float, np.ndarray]:
    """min over x of sum_k unary[k][x_k] + sum_k trans[k][x_k, x_k+1], and the argmin x.

    Viterbi in the (min, +) semiring, vectorised over strategies: O(sum_k s_k s_k+1)."""
    assert len(trans) == len(unary) - 1
    acc, back = np.asarray(unary[0], dtype=np.float64), []
    for k, t in enumerate(trans):
        m = acc[:, None] + t  # m[a, b]: best prefix ending in x_k = a, then x_k+1 = b
        back.append(m.argmin(axis=0))
        acc = m.min(axis=0) + unary[k + 1]
    x = np.zeros(len(unary), dtype=np.int64)
    x[-1] = int(acc.argmin())
    for k in range(len(trans) - 1, -1, -1):
        x[k] = back[k][x[k + 1]]
    return float(acc.min()), x


class FactorGraph:
    """A pairwise min-sum model that supports exact elimination of low-degree nodes."""

    def __init__(self, unary: list[np.ndarray]) -> None:
        self.unary = unary  # phi_i, modified in place as cones are folded into i
        self.adj: list[set[int]] = [set() for _ in unary]
        self.pairs: dict[tuple[int, int], np.ndarray] = {}  # phi_uv for u < v, shape (s_u, s_v)
        self.alive = np.ones(len(unary), dtype=bool)
        self.offset = 0.0  # cost of components eliminated entirely
        self.trace: list[tuple[int, tuple[int, ...], np.ndarray]] = []  # (v, neighbours, argmin)

    @classmethod
    def from_problem(cls, p: Problem) -> FactorGraph:
        fg = cls([np.where(p.allowed(i), c, np.inf) for i, c in enumerate(p.comp)])
        for (u, v), c in zip(p.edges.tolist(), p.comm):
            fg.add_pair(u, v, c)
        return fg

    def pair(self, a: int, b: int) -> np.ndarray | None:
        """phi_ab oriented as (s_a, s_b), or None when a and b are not adjacent."""
        m = self.pairs.get((min(a, b), max(a, b)))
        return m if m is None or a < b else m.T

    def add_pair(self, a: int, b: int, m: np.ndarray) -> None:
        key, m = ((a, b), m) if a < b else ((b, a), m.T)
        self.pairs[key] = self.pairs[key] + m if key in self.pairs else np.array(m, dtype=np.float64)
        self.adj[a].add(b)
        self.adj[b].add(a)

    def degree(self, v: int) -> int:
        return len(self.adj[v])

    def eliminate(self, v: int) -> None:
        """Fold v into its (at most two) neighbours; exact (see the module docstring)."""
        nb = tuple(sorted(self.adj[v]))
        phi = self.unary[v]
        if len(nb) == 0:
            self.offset += float(phi.min())
            table = np.array(phi.argmin())
        elif len(nb) == 1:
            (u,) = nb
            m = self.pair(u, v) + phi[None, :]
            self.unary[u] = self.unary[u] + m.min(axis=1)
            table = m.argmin(axis=1)
        elif len(nb) == 2:
            u, w = nb
            t = self.pair(u, v)[:, :, None] + phi[None, :, None] + self.pair(v, w)[None, :, :]
            table = t.argmin(axis=1)
        else:
            raise AssertionError(f"eliminate: node {v} has degree {len(nb)} > 2")
        self._drop(v)
        if len(nb) == 2:
            self.add_pair(u, w, t.min(axis=1))
        self.alive[v] = False
        self.trace.append((v, nb, table))

    def _drop(self, v: int) -> None:
        for u in self.adj[v]:
            self.adj[u].discard(v)
            self.pairs.pop((min(u, v), max(u, v)), None)
        self.adj[v] = set()

    def reduce(self, candidates: Iterable[int], max_degree: int = 2) -> int:
        """Eliminate candidates of degree <= max_degree until none is left; return how many."""
        cand = {int(v) for v in candidates if self.alive[v]}
        queue = deque(sorted(cand))
        count = 0
        while queue:
            v = queue.popleft()
            if not self.alive[v] or self.degree(v) > max_degree:
                continue
            nb = list(self.adj[v])
            self.eliminate(v)
            count += 1
            queue.extend(
                sorted(u for u in nb if u in cand and self.alive[u] and self.degree(u) <= max_degree)
            )
        return count

    def backtrack(self, choice: np.ndarray) -> np.ndarray:
        """Fill in eliminated nodes, last eliminated first, from their neighbours' choices."""
        return backtrack(self.trace, choice)


Factor = tuple[tuple[int, ...], np.ndarray]  # (sorted variables, table with one axis per variable)
# Variables in one table at most: NumPy arrays have at most 64 axes, and variables with one
# choice (a microbatch layout fixes many) keep a table small in cells but not in axes.
MAX_SCOPE = 48


def elimination_order(
    adj: dict[int, set[int]], candidates: Iterable[int], size: dict[int, int], limit: int
) -> list[int] | None:
    """A greedy order eliminating `candidates` (smallest new table first), or None when some
    step would build a table of more than `limit` cells or `MAX_SCOPE` variables. `adj` is the interaction graph."""
    adj = {v: set(nb) for v, nb in adj.items()}
    left, order = set(candidates), []

    def table(w: int) -> int:  # cells of the table eliminating w would build, capped past limit
        cells = 1
        for u in adj[w]:
            cells *= size[u]
            if cells > limit:
                return limit + 1
        return cells

    heap = [(table(w), w) for w in left]  # lazy: an entry is stale when its cost has changed
    heapq.heapify(heap)
    while left:
        cost, v = heapq.heappop(heap)
        if v not in left or cost != table(v):
            continue
        if cost * size[v] > limit or len(adj[v]) >= MAX_SCOPE:
            return None
        nb = adj.pop(v)
        for u in nb:
            adj[u] |= nb - {u}
            adj[u].discard(v)
        left.remove(v)
        order.append(v)
        for u in nb:
            if u in left:
                heapq.heappush(heap, (table(u), u))
    return order


def eliminate_factors(factors: list[Factor], order: Sequence[int]) -> tuple[list[Factor], list]:
    """Bucket elimination in the (min, +) semiring: exact for any order; the cost is the size of
    the largest table. Returns the factors left (over variables not eliminated) and a trace for
    FactorGraph.backtrack-style recovery: (v, scope, argmin table)."""
    trace = []
    table: dict[int, Factor] = dict(enumerate(factors))
    bucket: dict[int, set[int]] = {}  # variable -> ids of the live factors over it
    for k, (vs, _) in table.items():
        for w in vs:
            bucket.setdefault(w, set()).add(k)
    fresh = len(table)
    for v in order:
        ids = sorted(bucket.pop(v, ()))
        touching = [table.pop(k) for k in ids]
        for vs, _ in touching:
            for w in vs:
                if w != v:
                    bucket[w].difference_update(ids)
        scope = tuple(sorted(set().union(*(f[0] for f in touching))))
        dims = {}
        for vs, t in touching:
            dims.update(zip(vs, t.shape))
        total = np.zeros([dims[w] for w in scope])
        for vs, t in touching:
            total = total + t.reshape([dims[w] if w in vs else 1 for w in scope])
        ax = scope.index(v)
        rest = scope[:ax] + scope[ax + 1 :]
        table[fresh] = (rest, total.min(axis=ax))
        for w in rest:
            bucket.setdefault(w, set()).add(fresh)
        fresh += 1
        trace.append((v, rest, total.argmin(axis=ax)))
    return list(table.values()), trace


def backtrack(trace: Sequence[tuple[int, tuple[int, ...], np.ndarray]], choice: np.ndarray) -> np.ndarray:
    """Fill in eliminated variables, last eliminated first, from the choices of their scope."""
    for v, scope, table in reversed(trace):
        choice[v] = table[tuple(int(choice[u]) for u in scope)]
    return choice


def fold_cones(p: Problem, keep: Iterable[int] = ()) -> FactorGraph:
    """Rhino 4.3.2 level 1: fold every cone (a tree hanging off one node) into its root.

    Rhino's cone is a multi-input root with the single-input chains feeding it; folding is exact
    only while the folded part touches the rest through the root alone, so we fold exactly the
    subtrees attached by one node (in either edge direction), repeatedly."""
    fg = FactorGraph.from_problem(p)
    keep = set(keep)
    fg.reduce((i for i in range(p.n) if i not in keep), max_degree=1)
    return fg


def tree_dp(p: Problem) -> Solution:
    """Exact optimum of a problem whose undirected graph is a forest (chains included).

    Pins are honoured; a memory budget cannot be (use the ILP)."""
    t0 = time.perf_counter()
    if p.budget is not None:
        raise ProblemError("tree_dp: a memory budget makes the problem a knapsack; use the ILP")
    fg = fold_cones(p)
    if fg.alive.any():
        raise ProblemError(
            f"tree_dp: the graph is not a forest ({p.name(int(np.flatnonzero(fg.alive)[0]))} is on a cycle)"
        )
    x = fg.backtrack(np.zeros(p.n, dtype=np.int64))
    cost = p.cost(x)
    return Solution(x, cost, cost, 0.0, "optimal", time.perf_counter() - t0, "tree-dp")
