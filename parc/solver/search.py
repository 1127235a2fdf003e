"""Strategy search at Rhino's two optimisation levels, and the memory-constrained search of 4.4.

O3: one ILP over the whole problem (Rhino 4.2; ilp.py) after exact coarsening (coarsen.py: cones
and series nodes folded by min-plus DP). Its memory constraint is the ILP's memory row, exact.

O2: three-level merging (Rhino 4.3.2). Level 1 folds cones, and with them every series node, into
the nodes they hang off (exact min-plus DP, dp.py). The top level cuts the graph at its critical
nodes c_0 < ... < c_K (graph.py). The middle level solves each segment for every pair (strategy
a of its entry, strategy b of its exit): what is left of it after level 1 is a small core, solved
for all (a, b) at once by bucket elimination when its tables stay under `dp_limit` cells, and
otherwise by one ILP per pair. This gives a matrix M_k[a, b] per segment; the chain DP
min_x sum_k phi_{c_k}[x_k] + M_k[x_k, x_k+1] stitches them (the part before c_0 and after c_K
fold into phi_{c_0} and phi_{c_K}). Every step is exact, so O2 equals O3 unless a core ILP stops
early or `segment_pairs="entry"` (one ILP per entry strategy with the exit left free: ~s times
fewer ILPs, no optimality guarantee).

O2 cannot carry a memory row across segments; under a budget M it prices memory (a Lagrangian
relaxation of the row, `search_price`: free solves of C(x) + lam mem(x), lam bisected, with a
proven lower bound). Rhino 4.4's heuristic stays as `memory="restrict"`: restrict the k nodes
with the most memory to save to their lowest-memory strategies, and binary-search the smallest k
whose (unconstrained) solution fits M.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from parc.errors import InfeasiblePlanError, UsageError
from parc.solver.coarsen import solve_coarse
from parc.solver.dp import FactorGraph, backtrack, chain_dp, eliminate_factors, elimination_order
from parc.solver.graph import Segment, critical_nodes, segments
from parc.solver.ilp import IlpOptions, solve_ilp
from parc.solver.problem import Problem, Solution, relative_gap

Restrict = Callable[[Problem, int], Problem]


def memory_order(p: Problem) -> np.ndarray:
    """Nodes by how much memory their lowest-memory strategy saves, most first (Rhino 4.4 sorts
    parameters by size; for a parameter the saving is its replicated minus its sharded size)."""
    mem = [m[p.allowed(i)] for i, m in enumerate(p.mem)]
    saving = np.array([m.max() - m.min() for m in mem])
    order = np.lexsort((np.arange(p.n), -saving))
    return order[saving[order] > 0]


def restrict_largest(p: Problem, k: int) -> Problem:
    """The default restrict hook: the first k of memory_order keep only their lowest-memory
    strategies (Rhino 4.4: 'remove sharding candidates that replicate these tensors')."""
    allowed = {}
    for i in memory_order(p)[:k].tolist():
        m = np.where(p.allowed(i), p.mem[i], np.inf)
        allowed[i] = np.flatnonzero(m <= m.min()).tolist()
    return p.restricted(allowed)


@dataclass(frozen=True)
class SearchOptions:
    """How solve() searches."""

    ilp: IlpOptions = field(default_factory=IlpOptions)  # every ILP: O3's, and O2's segment cores
    segment_pairs: str = "all"  # O2: "all" solves cores per (entry, exit) pair; "entry" per entry only
    dp_limit: int = 1 << 20  # O2: largest DP table (cells) for a segment core; beyond, ILP per pair
    memory: str = "auto"  # "row" (ILP memory row, O3 only), "restrict" (Rhino 4.4), "price" (a
    # Lagrangian price on memory: search_price) or "auto" (row for O3, price for O2)
    restrict: Restrict = restrict_largest  # k -> the problem with k nodes restricted to save memory
    # the price search's last step (search_price's `mix`): an exact ILP, memory row included, over
    # its two plans around the budget, run with these options; None: no such step
    mix: IlpOptions | None = None

    def __post_init__(self) -> None:
        if self.segment_pairs not in ("all", "entry"):
            raise UsageError(f"segment_pairs: expected 'all' or 'entry', found {self.segment_pairs!r}")
        if self.memory not in ("auto", "row", "restrict", "price"):
            raise UsageError(f"memory: expected 'auto', 'row', 'restrict' or 'price', found {self.memory!r}")


def solve(p: Problem, level: str = "O3", options: SearchOptions = SearchOptions(),
          start: np.ndarray | None = None) -> Solution:
    """The best choice for p at optimisation level O3 (one ILP) or O2 (segments + DP).

    `start` (O3): a known choice, the ILP's incumbent (a heuristic's plan: see solve_ilp).

    Raises MemoryBudgetError (an InfeasiblePlanError) when no choice fits the budget."""
    if level not in ("O2", "O3"):
        raise UsageError(f"level: expected 'O2' or 'O3', found {level!r}")
    memory = options.memory
    if memory == "auto":
        memory = "row" if level == "O3" else "price"
    if memory == "row" and level == "O2" and p.budget is not None:
        raise UsageError("memory='row' needs level O3: O2's segments cannot share one memory row")
    p.check_budget()

    def unconstrained(q: Problem) -> Solution:
        return solve_coarse(q, options.ilp, start=start) if level == "O3" else solve_o2(q, options)

    if p.budget is None or memory == "row":
        return unconstrained(p)
    if memory == "price":
        return search_price(p, unconstrained, mix=mixer(options))
    return search_memory(p, unconstrained, options.restrict)


def mixer(options: SearchOptions) -> Callable[[Problem, np.ndarray], Solution] | None:
    """search_price's `mix` under `options`: O3 from a start with `options.mix`, or None."""
    if options.mix is None:
        return None
    exact = replace(options, ilp=options.mix, memory="row", mix=None)  # the budget as a row: no price again
    return lambda q, start: solve(q, "O3", exact, start=start)


def search_price(p: Problem, solve_free: Callable[[Problem], Solution], steps: int = 6,
                 mix: Callable[[Problem, np.ndarray], Solution] | None = None) -> Solution:
    """Memory as a price (a Lagrangian relaxation of the budget row): solve min C(x) + lam mem(x)
    without the budget, raising lam geometrically until the choice fits M, then bisecting lam
    (`steps` solves) between the last price that did not fit and the first that did; the best
    fitting choice is kept. Every solve is a free one (O2's segments and DP stay exact), and
    C(x*) >= L(lam) = min_x C(x) + lam (mem(x) - M) for every lam >= 0 bounds the constrained
    optimum from below: the gap is proven (docs/solver.md has the measurements).

    Repeated structure makes the priced plans jump: a model's identical layers change layout at
    the same price, so the plan just under the price that fits can be far over the budget, and the
    one at it far under (docs/solver.md: gpt-2.7b over 25 GbE). `mix(q, start)` then solves q
    exactly with the memory row (an ILP that starts from the fitting plan), q the problem with each
    node restricted to its strategies in those two plans: some of the layers change, not all."""
    t0 = time.perf_counter()
    free = p.with_budget(None)
    base = solve_free(free)
    if p.fits(base.choice):
        return base
    budget = float(p.budget)  # type: ignore[arg-type]
    lower = base.lower_bound
    best: tuple[float, np.ndarray] | None = None
    over = base.choice  # the plan at the highest price that does not fit

    def priced(lam: float) -> bool:
        nonlocal lower, best, over
        sol = solve_free(replace(free, comp=tuple(c + lam * m for c, m in zip(p.comp, p.mem))))
        lower = max(lower, sol.lower_bound - lam * budget)
        if not p.fits(sol.choice):
            over = sol.choice
            return False
        cost = p.cost(sol.choice)
        if best is None or cost < best[0]:
            best = (cost, sol.choice)
        return True

    # seconds per byte: the free plan's cost per byte of its memory, then x4 until it fits
    lo, hi = 0.0, max(base.cost, 1e-12) / max(p.memory(base.choice), 1.0)
    for _ in range(64):
        if priced(hi):
            break
        lo, hi = hi, hi * 4
    else:
        raise InfeasiblePlanError(f"memory: no price made the plan fit M = {budget:.6g} per device")
    for _ in range(steps):
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 4
        if priced(mid):
            hi = mid
        else:
            lo = mid
    assert best is not None
    cost, x = best
    method = f"{base.method}+price"
    if mix is not None and (over != x).any():
        between = p.restricted({i: sorted({int(a), int(b)}) for i, (a, b) in enumerate(zip(x, over))})
        try:
            sol = mix(between, x)
        except InfeasiblePlanError:
            sol = None
        if sol is not None and p.fits(sol.choice) and sol.cost < cost * (1 - 1e-9):
            cost, x, method = p.cost(sol.choice), sol.choice, f"{method}+mix"
    lower = min(lower, cost)
    gap = relative_gap(cost, lower)
    return Solution(x, cost, lower, gap, "optimal" if gap <= 1e-9 else "heuristic", time.perf_counter() - t0,
                    method)


def search_memory(p: Problem, solve_free: Callable[[Problem], Solution], restrict: Restrict) -> Solution:
    """Rhino 4.4: the smallest k (binary search) for which solving restrict(p, k) without the
    budget yields a choice that fits M. The k = 0 solve is a relaxation, so its lower bound
    bounds the constrained optimum too."""
    t0 = time.perf_counter()
    free = p.with_budget(None)
    base = solve_free(free)
    if p.fits(base.choice):
        return base
    hi = p.n
    best = solve_free(restrict(free, hi))
    if not p.fits(best.choice):
        raise InfeasiblePlanError(
            f"memory: restricting all {p.n} nodes still needs {p.memory(best.choice):.6g} per device, "
            f"over the budget M = {p.budget:.6g}; the restrict hook cannot reach the minimum {p.min_memory():.6g}"
        )
    lo = 0  # invariant: k = lo does not fit, k = hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        sol = solve_free(restrict(free, mid))
        if p.fits(sol.choice):
            hi, best = mid, sol
        else:
            lo = mid
    lower = min(base.lower_bound, best.cost)
    gap = relative_gap(best.cost, lower)
    return Solution(
        best.choice,
        best.cost,
        lower,
        gap,
        "optimal" if gap == 0 else "heuristic",
        time.perf_counter() - t0,
        f"{best.method}+restrict(k={hi})",
    )


@dataclass(frozen=True, eq=False)
class SegmentResult:
    """A segment solved for every (entry a, exit b): its cost and lower bound matrices, and how
    to decide its core once a and b are known."""

    cost: np.ndarray  # M_k[a, b] (an axis of size 1 for a missing entry or exit)
    lower: np.ndarray  # a lower bound on M_k[a, b] (-inf where unknown)
    decide: Callable[[np.ndarray], None]  # fills in the core's strategies in x, given x[entry], x[exit]
    status: str  # "optimal", "time_limit" or "heuristic"


def _size(fg: FactorGraph, v: int | None) -> int:
    return 1 if v is None else len(fg.unary[v])


def _core_problem(
    fg: FactorGraph, nodes: list[int], entry: int | None, a: int, exit_: int | None, b: int | None
) -> Problem:
    """The core with the entry fixed to a (and the exit to b, when b is given) as a Problem."""
    local = {v: k for k, v in enumerate(nodes)}
    comp = []
    for v in nodes:
        phi = fg.unary[v].copy()
        if entry is not None and fg.pair(entry, v) is not None:
            phi += fg.pair(entry, v)[a]
        if b is not None and fg.pair(v, exit_) is not None:
            phi += fg.pair(v, exit_)[:, b]
        comp.append(phi)
    edges, comm = [], []
    for (u, v), m in fg.pairs.items():
        if u in local and v in local:
            edges.append((local[u], local[v]))
            comm.append(m)
    pins = {
        k: np.flatnonzero(np.isfinite(c)).tolist() for k, c in enumerate(comp) if not np.isfinite(c).all()
    }
    comp = [np.where(np.isfinite(c), c, 0.0) for c in comp]
    return Problem(
        comp=tuple(comp), edges=np.array(edges, dtype=np.int64).reshape(-1, 2), comm=tuple(comm), pins=pins
    )


def _eliminate_segment(fg: FactorGraph, seg: Segment, core: list[int], limit: int) -> SegmentResult | None:
    """Exact DP over the core for all (a, b) at once by bucket elimination, or None when the
    core's treewidth would need a table of more than `limit` cells."""
    ends = [v for v in (seg.entry, seg.exit) if v is not None]
    scope = set(core) | set(ends)
    adj = {v: {u for u in fg.adj[v] if u in scope} for v in scope}
    order = elimination_order(adj, core, {v: len(fg.unary[v]) for v in scope}, limit)
    if order is None:
        return None
    factors = [((v,), fg.unary[v]) for v in core]
    factors += [((u, v), m) for (u, v), m in fg.pairs.items() if u in scope and v in scope]
    left, trace = eliminate_factors(factors, order)
    A, B = _size(fg, seg.entry), _size(fg, seg.exit)
    cost = np.zeros((A, B))
    for vs, t in left:  # factors over the entry and/or the exit only
        if len(vs) == 2 and vs[0] == seg.exit:  # scopes are sorted by node index
            t = t.T
        cost = cost + t.reshape(A if seg.entry in vs else 1, B if seg.exit in vs else 1)
    return SegmentResult(cost, cost, lambda x: backtrack(trace, x), "optimal")


def _solve_segment(fg: FactorGraph, seg: Segment, options: SearchOptions) -> SegmentResult:
    """The middle level of Rhino 4.3.2 for one segment: M_k[a, b] for every (a, b)."""
    A, B = _size(fg, seg.entry), _size(fg, seg.exit)
    core = [int(v) for v in seg.nodes if fg.alive[v]]
    exact = _eliminate_segment(fg, seg, core, options.dp_limit)
    if exact is not None:
        return exact
    direct = fg.pair(seg.entry, seg.exit) if seg.entry is not None and seg.exit is not None else None
    direct = np.zeros((A, B)) if direct is None else direct
    cost, lower = np.full((A, B), np.inf), np.full((A, B), -np.inf)
    choice = np.zeros((A, B, len(core)), dtype=np.int64)
    statuses = set()
    if options.segment_pairs == "entry" and seg.exit is not None:
        for a in range(A):  # exit free: solved with the core, its unary taken back out for the stitch
            q = _core_problem(fg, [*core, seg.exit], seg.entry, a, seg.exit, None)
            sol = solve_ilp(q, options.ilp)
            b = int(sol.choice[-1])
            cost[a, b] = sol.cost - fg.unary[seg.exit][b]
            choice[a, b] = sol.choice[:-1]
        statuses.add("heuristic")
    else:
        for a in range(A):
            for b in range(B):
                q = _core_problem(fg, core, seg.entry, a, seg.exit, b if seg.exit is not None else None)
                sol = solve_ilp(q, options.ilp)
                cost[a, b] = sol.cost + direct[a, b]
                lower[a, b] = sol.lower_bound + direct[a, b]
                choice[a, b] = sol.choice
                statuses.add(sol.status)
    status = (
        "optimal" if statuses == {"optimal"} else "heuristic" if "heuristic" in statuses else "time_limit"
    )

    def decide(x: np.ndarray) -> None:
        x[core] = choice[0 if seg.entry is None else x[seg.entry], 0 if seg.exit is None else x[seg.exit]]

    return SegmentResult(cost, lower, decide, status)


def solve_o2(p: Problem, options: SearchOptions = SearchOptions()) -> Solution:
    """O2 without a memory budget: cones, segments, one solve per segment, chain DP."""
    t0 = time.perf_counter()
    if p.budget is not None:
        raise UsageError(
            "solve_o2 cannot honour a memory budget; call solve(problem, 'O2') for Rhino 4.4's search"
        )
    crit = critical_nodes(p)
    segs = segments(p, crit)
    fg = FactorGraph.from_problem(p)
    keep = np.zeros(p.n, dtype=bool)
    keep[crit] = True
    fg.reduce(np.flatnonzero(~keep))  # level 1: cones and series nodes, exact
    parts = [_solve_segment(fg, seg, options) for seg in segs]  # middle level, per segment

    x = np.zeros(p.n, dtype=np.int64)
    if len(crit) == 0:  # one segment without boundaries
        lower = float(parts[0].lower[0, 0]) + fg.offset
    else:  # top level: chain DP over c_0 .. c_K

        def stitch(field_name: str) -> tuple[float, np.ndarray]:
            mats = [getattr(r, field_name) for r in parts]
            unary = [fg.unary[c].copy() for c in crit.tolist()]
            unary[0] = unary[0] + mats[0][0, :]
            unary[-1] = unary[-1] + mats[-1][:, 0]
            return chain_dp(unary, mats[1:-1])

        _, x[crit] = stitch("cost")
        exact = all(r.status != "heuristic" for r in parts)
        lower = stitch("lower")[0] + fg.offset if exact else -math.inf
    for r in parts:
        r.decide(x)
    fg.backtrack(x)
    cost = p.cost(x)
    lower = min(lower, cost)
    gap = relative_gap(cost, lower)
    statuses = {r.status for r in parts}
    status = "optimal" if gap == 0 else "heuristic" if "heuristic" in statuses else "time_limit"
    return Solution(x, cost, lower, gap, status, time.perf_counter() - t0, "O2")
