"""Dead-end elimination: strategies that can be dropped without losing every optimum.

Strategy j of node i is dominated by strategy k (Goldstein's criterion, from protein design's
side-chain placement, the same pairwise problem) when, whatever its neighbours choose, j costs
at least as much as k:

    comp_i[j] - comp_i[k] + sum_{e = (i, o)} min_b (comm_e[j, b] - comm_e[k, b])  >=  0

with b over o's strategies still alive, and, under a memory budget, mem_i[j] >= mem_i[k] (so
swapping j for k keeps a choice within the budget). Replacing j by k in any choice then costs
no more, so some optimum avoids j: dropping it keeps the optimum and every lower bound on it.
Pins are applied first (a strategy a pin forbids is dropped). Sweeps repeat while they drop
something, up to `sweeps`.

On a coarsened training step it drops a part of the strategies, and the ILP and its LP shrink
with them (benchmarks/LOG.md, 2026-11-25, issue 11; `IlpOptions.prune` says why it is not on by
default yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parc.solver.problem import Problem


@dataclass(frozen=True, eq=False)
class Pruned:
    """A problem without its dominated strategies, and where its strategies came from."""

    problem: Problem  # no pins: only allowed, undominated strategies are left
    keep: tuple[np.ndarray, ...]  # per node, the original index of each strategy left

    def expand(self, x: np.ndarray) -> np.ndarray:
        """A choice of the pruned problem as a choice of the original."""
        return np.array([int(k[j]) for k, j in zip(self.keep, np.asarray(x).tolist())], dtype=np.int64)

    def restrict(self, x: np.ndarray) -> np.ndarray | None:
        """A choice of the original as a choice of the pruned problem (None: it uses a dropped strategy)."""
        out = np.empty(len(self.keep), dtype=np.int64)
        for i, (k, j) in enumerate(zip(self.keep, np.asarray(x).tolist())):
            where = np.flatnonzero(k == j)
            if not len(where):
                return None
            out[i] = where[0]
        return out


def prune(p: Problem, sweeps: int = 4) -> Pruned:
    """`p` without the strategies that pins forbid or that another strategy dominates."""
    n = p.n
    alive = [p.allowed(i).copy() for i in range(n)]
    incident: list[list[tuple[np.ndarray, int]]] = [[] for _ in range(n)]  # (comm oriented [s_i, s_o], o)
    for e, (u, v) in enumerate(p.edges.tolist()):
        incident[u].append((p.comm[e], v))
        incident[v].append((p.comm[e].T, u))
    scale = max(float(np.abs(p.comp_flat).max(initial=0.0)), float(np.abs(p.comm_flat).max(initial=0.0)), 1e-300)
    tol = 1e-12 * scale
    budgeted = p.budget is not None
    for _ in range(sweeps):
        dropped = 0
        for i in range(n):
            idx = np.flatnonzero(alive[i])
            if len(idx) <= 1:
                continue
            c = p.comp[i][idx]
            delta = c[:, None] - c[None, :]  # delta[j, k]: the least j costs more than k
            for m, o in incident[i]:
                sub = m[np.ix_(idx, np.flatnonzero(alive[o]))]
                delta += (sub[:, None, :] - sub[None, :, :]).min(axis=2)
            dominated = delta >= -tol
            if budgeted:
                mem = p.mem[i][idx]
                dominated &= mem[:, None] >= mem[None, :]
            np.fill_diagonal(dominated, False)
            # j goes if a strategy still alive dominates it (and, of two that dominate each other,
            # the same in every context, the later one goes); checking the dominator is alive keeps
            # one of any cycle the tolerance might make
            beats = dominated & ~(dominated.T & np.triu(np.ones_like(dominated), 1))
            dead = np.zeros(len(idx), dtype=bool)
            for j in np.flatnonzero(beats.any(axis=1)):
                if (beats[j] & ~dead).any():
                    dead[j] = True
            if dead.any():
                alive[i][idx[dead]] = False
                dropped += int(dead.sum())
        if not dropped:
            break
    keep = tuple(np.flatnonzero(a) for a in alive)
    comm = tuple(p.comm[e][np.ix_(keep[u], keep[v])] for e, (u, v) in enumerate(p.edges.tolist()))
    q = Problem(tuple(p.comp[i][keep[i]] for i in range(n)), p.edges, comm,
                tuple(p.mem[i][keep[i]] for i in range(n)) if p.mem else (), p.budget, (), p.names)
    return Pruned(q, keep)
