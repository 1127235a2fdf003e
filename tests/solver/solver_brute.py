"""Exhaustive references for the solver tests: every choice, every path."""

from __future__ import annotations

import itertools

import numpy as np

from parc.solver.problem import Problem


def all_choices(p: Problem) -> np.ndarray:
    """Every choice allowed by the pins, one per row."""
    axes = [np.flatnonzero(p.allowed(i)) for i in range(p.n)]
    grid = np.meshgrid(*axes, indexing="ij")
    return np.stack([g.reshape(-1) for g in grid], axis=1)


def brute_force(p: Problem) -> tuple[float, np.ndarray] | None:
    """(optimum, an optimal choice) by enumeration, memory budget included; None if infeasible."""
    x = all_choices(p)
    cost = p.comp_flat[p.offsets[:-1] + x].sum(axis=1)
    if p.num_edges:
        u, v = p.edges[:, 0], p.edges[:, 1]
        cost = cost + p.comm_flat[p.comm_offsets[:-1] + x[:, u] * p.s[v] + x[:, v]].sum(axis=1)
    if p.budget is not None:
        mem = p.mem_flat[p.offsets[:-1] + x].sum(axis=1)
        cost = np.where(mem <= p.budget * (1 + 1e-9) + 1e-9, cost, np.inf)
    k = int(cost.argmin())
    return None if not np.isfinite(cost[k]) else (float(cost[k]), x[k])


def brute_critical(p: Problem) -> set[int]:
    """Nodes on every path from a virtual source (before all sources) to a virtual sink."""
    succ = {i: [] for i in range(p.n)}
    for u, v in p.edges.tolist():
        succ[u].append(v)
    indeg = np.bincount(p.edges[:, 1], minlength=p.n)
    on_all = set(range(p.n))

    def walk(v: int, path: list[int]) -> None:
        nonlocal on_all
        path.append(v)
        if not succ[v]:
            on_all &= set(path)
        for w in succ[v]:
            walk(w, path)
        path.pop()

    for s in np.flatnonzero(indeg == 0).tolist():
        walk(s, [])
    return on_all


def brute_chain(unary, trans) -> float:
    best = np.inf
    for x in itertools.product(*[range(len(u)) for u in unary]):
        c = sum(u[j] for u, j in zip(unary, x)) + sum(t[x[k], x[k + 1]] for k, t in enumerate(trans))
        best = min(best, c)
    return float(best)
