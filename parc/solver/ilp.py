"""Rhino §4.2's ILP, in the marginal (local-polytope) form, solved with HiGHS through highspy.

Rhino linearises x_{u,j1} x_{v,j2} with A >= x_{u,j1} + x_{v,j2} - 1. Its LP relaxation is weak:
A = 0, x = 1/s_i is feasible, and on transformer-like instances the LP bound sits far below the
optimum (docs/solver.md), so branch and bound has to do all the work. We use instead, for each
edge e = (u, v), continuous y_{e,j1,j2} >= 0 with marginals

    sum_{j2} y_{e,j1,j2} = x_{u,j1}   (every j1),     sum_{j1} y_{e,j1,j2} = x_{v,j2}   (every j2)

which is exact for integral x (y is then the indicator of (x_u, x_v)) and whose LP relaxation is
the local polytope of the pairwise model: exact on trees and within a fraction of a percent on
transformer-like graphs. The model is built from numpy arrays in CSR form and handed to HiGHS in
one passModel call.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import highspy
import numpy as np

from parc.solver.problem import Problem, Solution, ragged, relative_gap, segment_argmin


@dataclass(frozen=True)
class IlpOptions:
    """How HiGHS is run."""

    time_limit: float = 60.0  # seconds for the whole solve, LP warm start included
    mip_gap: float = 1e-4  # relative gap at which HiGHS stops (mip_rel_gap); 0 asks for the optimum
    threads: int = 1  # HiGHS threads; its MIP search is serial, more only helps its LP
    presolve: bool = True  # HiGHS presolve
    warm_start: bool = True  # solve the LP relaxation, round x per node (argmax), pass as incumbent
    # Drop dominated strategies first (dee.py: exact; a smaller, faster LP: benchmarks/LOG.md,
    # 2026-11-25, issue 11). Off here, on in every exact ILP the planner runs
    # (parc/passes/spmd/mesh_search.py:pruned); O2's segment cores stay unpruned (small already).
    prune: bool = False
    seed: int = 0  # HiGHS random_seed, so the same problem gives the same plan
    verbose: bool = False  # HiGHS log on stdout


@dataclass(frozen=True, eq=False)
class Model:
    """The ILP as arrays: columns are x (flat node layout) then y (entries of non-folded edges)."""

    lp: highspy.HighsLp
    num_x: int
    y_edge: np.ndarray  # edge of each y column
    y_j1: np.ndarray
    y_j2: np.ndarray
    scale: float = 1.0  # objective = scale * C(x): lp's values divided by it are seconds


def _separable(p: Problem) -> tuple[np.ndarray, np.ndarray]:
    """Edges whose comm_e on the allowed strategies is a[j1] + b[j2], and the unary costs a + b.

    Such an edge needs no y (always so when s_u = 1 or s_v = 1, e.g. a pinned constant)."""
    u, v = p.edges[:, 0], p.edges[:, 1]
    e, j1, j2 = p.comm_entries
    off, sv = p.comm_offsets[:-1], p.s[v]
    # reference row r_u and column c_v: the first allowed strategy of each end
    first = segment_argmin(p, (~p.allowed_flat).astype(np.float64))
    r, c = first[u], first[v]
    ok = p.allowed_flat[p.offsets[u[e]] + j1] & p.allowed_flat[p.offsets[v[e]] + j2]
    C = p.comm_flat
    resid = (
        C - C[off[e] + j1 * sv[e] + c[e]] - C[off[e] + r[e] * sv[e] + j2] + C[off[e] + r[e] * sv[e] + c[e]]
    )
    scale = 1e-12 * max(1.0, float(np.abs(C).max(initial=0.0)))
    bad = np.zeros(p.num_edges, dtype=bool)
    np.logical_or.at(bad, e, ok & (np.abs(resid) > scale))
    sep = ~bad
    unary = np.zeros(len(p.comp_flat))
    # a[j1] = comm_e[j1, c_v] onto u;  b[j2] = comm_e[r_u, j2] - comm_e[r_u, c_v] onto v
    ta = sep[e] & (j2 == c[e])
    unary += np.bincount(p.offsets[u[e[ta]]] + j1[ta], C[ta], minlength=len(unary))
    tb = sep[e] & (j1 == r[e])
    b = C[tb] - C[off[e[tb]] + r[e[tb]] * sv[e[tb]] + c[e[tb]]]
    unary += np.bincount(p.offsets[v[e[tb]]] + j2[tb], b, minlength=len(unary))
    return sep, unary


def build_model(p: Problem) -> Model:
    """The ILP of Rhino §4.2 (marginal form) plus the memory row of §4.4, as one HighsLp."""
    n, X = p.n, int(p.offsets[-1])
    u, v = p.edges[:, 0], p.edges[:, 1]
    sep, folded = _separable(p)
    e, j1, j2 = p.comm_entries
    ycol = ~sep[e]
    ye, yj1, yj2 = e[ycol], j1[ycol], j2[ycol]
    Y = len(ye)

    # Objective (Rhino §4.2): sum comp_ij x_ij + sum comm_e,j1,j2 y_e,j1,j2
    cost = np.concatenate([p.comp_flat + folded, p.comm_flat[ycol]])
    scale = objective_scale(cost)
    cost = cost * scale
    lower = np.zeros(X + Y)
    upper = np.concatenate([p.allowed_flat.astype(np.float64), np.ones(Y)])  # pins: x_ij <= [j allowed]

    # Rows, built as COO then sorted into CSR.
    # (4.2a) one strategy per node: sum_j x_ij = 1
    rows, cols, vals = [np.repeat(np.arange(n), p.s)], [np.arange(X)], [np.ones(X)]
    lo, hi = [np.ones(n)], [np.ones(n)]
    # (4.2b) marginals of each kept edge e = (u, v): one row per j1 of u, then one per j2 of v
    kept = np.flatnonzero(~sep)
    su, sv = p.s[u[kept]], p.s[v[kept]]
    row0 = n + np.concatenate([[0], np.cumsum(su + sv)])[:-1].astype(np.int64)
    k_of = np.full(p.num_edges, -1)
    k_of[kept] = np.arange(len(kept))
    ky = k_of[ye]
    ycols = X + np.arange(Y)
    rows += [row0[ky] + yj1, row0[ky] + su[ky] + yj2]  # y_e,j1,j2 in row j1 and in row j2
    cols += [ycols, ycols]
    vals += [np.ones(Y), np.ones(Y)]
    k, j = ragged(su)  # -x_u,j1 in row j1
    rows.append(row0[k] + j)
    cols.append(p.offsets[u[kept[k]]] + j)
    k, j = ragged(sv)  # -x_v,j2 in row j2
    rows.append(row0[k] + su[k] + j)
    cols.append(p.offsets[v[kept[k]]] + j)
    vals += [-np.ones(int(su.sum())), -np.ones(int(sv.sum()))]
    num_rows = n + int((su + sv).sum())
    lo.append(np.zeros(num_rows - n))
    hi.append(np.zeros(num_rows - n))
    # (4.4) memory budget: sum_ij mem_ij x_ij <= M
    if p.budget is not None:
        nz = np.flatnonzero(p.mem_flat)
        rows.append(np.full(len(nz), num_rows))
        cols.append(nz)
        per = 1.0 / max(float(p.budget), 1.0)  # bytes as fractions of the budget: the row's scale
        vals.append(p.mem_flat[nz] * per)
        lo.append(np.array([-highspy.kHighsInf]))
        hi.append(np.array([p.budget * per]))
        num_rows += 1

    lp = rowwise_lp(cost, lower, upper, rows, cols, vals, lo, hi, num_rows)
    return Model(lp, X, ye, yj1, yj2, scale)


def objective_scale(cost: np.ndarray) -> float:
    """The factor that makes the median nonzero cost coefficient 1. Costs are seconds, often
    1e-6 to 1e-3 per node, where HiGHS's absolute tolerances (1e-7 dual feasibility, 1e-6
    mip_abs_gap) are a large part of a plan's cost: unscaled, a small model's step came back
    "optimal" above a plan the follow search had found (docs/solver.md)."""
    nz = np.abs(cost[cost != 0])
    return 1.0 / float(np.median(nz)) if len(nz) else 1.0


def rowwise_lp(cost, lower, upper, rows: list, cols: list, vals: list, row_lower: list, row_upper: list,
               num_rows: int) -> highspy.HighsLp:
    """A HighsLp from column arrays and the constraint entries as lists of (row, column, value)
    array chunks with per-row bound chunks (any order; sorted into HiGHS's row-wise CSR here)."""
    r, c, v = np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)
    order = np.argsort(r, kind="stable")
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(cost), num_rows
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, lower, upper
    lp.row_lower_, lp.row_upper_ = np.concatenate(row_lower), np.concatenate(row_upper)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = len(cost), num_rows
    lp.a_matrix_.start_ = np.concatenate([[0], np.cumsum(np.bincount(r, minlength=num_rows))]).astype(np.int32)
    lp.a_matrix_.index_ = c[order].astype(np.int32)
    lp.a_matrix_.value_ = v[order]
    return lp


def _full_vector(p: Problem, m: Model, x: np.ndarray) -> np.ndarray:
    """(x, y) columns of an integral choice: y_e,j1,j2 = [j1 = x_u][j2 = x_v]."""
    xs = np.zeros(m.num_x)
    xs[p.offsets[:-1] + x] = 1.0
    y = (m.y_j1 == x[p.edges[m.y_edge, 0]]) & (m.y_j2 == x[p.edges[m.y_edge, 1]])
    return np.concatenate([xs, y.astype(np.float64)])


def _round(p: Problem, values: np.ndarray) -> np.ndarray:
    """Per node, the allowed strategy with the largest x_ij (Rhino's rounding of the relaxation)."""
    return segment_argmin(p, np.where(p.allowed_flat, -values[: len(p.comp_flat)], np.inf))


def new_highs() -> highspy.Highs:
    """A Highs instance without the banner HiGHS prints on stdout when the first one is made
    (its C++ side writes it before any option can turn output off)."""
    import os
    import sys

    global _BANNER_SHOWN
    if _BANNER_SHOWN:
        return highspy.Highs()
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    _BANNER_SHOWN = True
    return h


_BANNER_SHOWN = False


def _highs(options: IlpOptions) -> highspy.Highs:
    h = new_highs()
    h.setOptionValue("output_flag", options.verbose)
    h.setOptionValue("threads", options.threads)
    h.setOptionValue("presolve", "on" if options.presolve else "off")
    h.setOptionValue("mip_rel_gap", options.mip_gap)
    h.setOptionValue("random_seed", options.seed)
    h.setOptionValue("time_limit", options.time_limit)
    return h


def lp_relaxation(p: Problem, options: IlpOptions = IlpOptions()) -> float:
    """The optimum of the LP relaxation of the marginal form: a lower bound on C(x)."""
    h = _highs(options)
    m = build_model(p)
    h.passModel(m.lp)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return -math.inf
    return h.getInfo().objective_function_value / m.scale


def solve_ilp(p: Problem, options: IlpOptions = IlpOptions(), start: np.ndarray | None = None) -> Solution:
    """Minimise C(x) with one ILP over the whole problem (O3); pins and budget M respected.

    Returns the optimum, or on time-out the best incumbent with HiGHS's proven bound. Raises
    MemoryBudgetError when no choice fits M (checked exactly before the ILP is built). With
    `options.prune` the ILP is built over the strategies dead-end elimination keeps (dee.py):
    the same optimum from fewer columns. `start`: a known choice (say a heuristic's plan), the
    incumbent when it fits and beats the LP rounding; when the LP bound proves it within the
    gap, no branch and bound runs."""
    t0 = time.perf_counter()
    p.check_budget()
    if not options.prune:
        return _solve_ilp(p, options, t0, start)
    from parc.solver.dee import prune

    pruned = prune(p)
    sol = _solve_ilp(pruned.problem, options, t0, None if start is None else pruned.restrict(start))
    x = pruned.expand(sol.choice)
    cost = p.cost(x)
    lower = min(sol.lower_bound, cost)
    return Solution(x, cost, lower, relative_gap(cost, lower), sol.status, time.perf_counter() - t0,
                    f"{sol.method}+dee({int(p.allowed_flat.sum())}->{int(pruned.problem.s.sum())})")


def _solve_ilp(p: Problem, options: IlpOptions, t0: float, start: np.ndarray | None = None) -> Solution:
    m = build_model(p)
    h = _highs(options)
    h.passModel(m.lp)

    def remaining() -> float:
        return max(options.time_limit - (time.perf_counter() - t0), 1e-3)

    # A fall-back incumbent that always fits: the lowest-memory choice under a budget, else the
    # cheapest compute per node. The LP rounding replaces it when it fits and costs less.
    fallback = (
        p.min_memory_choice()
        if p.budget is not None
        else segment_argmin(p, np.where(p.allowed_flat, p.comp_flat, np.inf))
    )
    if start is not None:
        start = np.asarray(start, dtype=np.int64)
        if p.allowed_flat[p.offsets[:-1] + start].all() and p.fits(start) and p.cost(start) < p.cost(fallback):
            fallback = start
    lp_bound = -math.inf
    if options.warm_start:
        h.setOptionValue("time_limit", remaining())
        t_lp = time.perf_counter()
        h.run()
        t_lp = time.perf_counter() - t_lp
        if h.getModelStatus() == highspy.HighsModelStatus.kOptimal:
            lp_bound = h.getInfo().objective_function_value / m.scale
            rounded = _round(p, np.asarray(h.getSolution().col_value))
            if p.fits(rounded) and p.cost(rounded) < p.cost(fallback):
                fallback = rounded
            cost = p.cost(fallback)
            if p.fits(fallback) and relative_gap(cost, min(lp_bound, cost)) <= options.mip_gap:
                # the rounded relaxation is optimal within the gap: no branch and bound needed
                lower = min(lp_bound, cost)
                return Solution(fallback, cost, lower, relative_gap(cost, lower), "optimal",
                                time.perf_counter() - t0, "ilp(lp-rounding)")
            if p.fits(fallback) and remaining() < t_lp:
                # HiGHS's branch and bound starts over (presolve, then the root LP, without this
                # LP's basis): with less time left than the relaxation took, its root cannot end
                # and its bound stays below the LP's (docs/solver.md). The LP bound is the proof.
                lower = min(lp_bound, cost)
                return Solution(fallback, cost, lower, relative_gap(cost, lower), "time_limit",
                                time.perf_counter() - t0, "ilp(lp-rounding)")
    h.changeColsIntegrality(
        m.num_x,
        np.arange(m.num_x, dtype=np.int32),
        np.full(m.num_x, highspy.HighsVarType.kInteger.value, dtype=np.uint8),
    )
    if options.warm_start:
        full = _full_vector(p, m, fallback)
        h.setSolution(len(full), np.arange(len(full), dtype=np.int32), full)
    h.setOptionValue("time_limit", remaining())
    h.run()

    status, info = h.getModelStatus(), h.getInfo()
    if status == highspy.HighsModelStatus.kInfeasible:
        raise AssertionError("the ILP is infeasible although check_budget passed")
    choice = fallback
    if info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible.value:
        x = _round(p, np.asarray(h.getSolution().col_value))
        if p.cost(x) <= p.cost(fallback):
            choice = x
    bound = max(
        info.mip_dual_bound / m.scale if math.isfinite(info.mip_dual_bound) else -math.inf, lp_bound,
        p.trivial_bound()
    )
    cost = p.cost(choice)
    lower = min(bound, cost)
    name = {
        highspy.HighsModelStatus.kOptimal: "optimal",
        highspy.HighsModelStatus.kTimeLimit: "time_limit",
    }.get(status, h.modelStatusToString(status))
    return Solution(choice, cost, lower, relative_gap(cost, lower), name, time.perf_counter() - t0, "ilp")
