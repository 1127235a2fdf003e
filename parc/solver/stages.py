"""Rhino 5.1-5.2's stage ILP with bound tightening: which of S pipeline stages each node takes.

Over a DAG of n nodes in topological order with costs c_i, edges (i, j) carrying bytes(i, j),
A_i and D_i the ancestors and descendants of i, and T = sum_i c_i / S the balanced stage load.
Stage s of x_is (0-1, node-major) is node i's stage when x_is = 1, so B_i = sum_s s x_is; a
0-1 F_ij per edge marks the edges that cross stages; L is the largest stage load.

    min   sum_{(i,j)} bytes(i, j) F_ij  +  tau L                      (the volume crossing stages)
    (a)   sum_s x_is = 1                                  every i     one stage per node
    (b)   F_ij <= B_j - B_i <= (S - 1) F_ij               every (i,j) no edge goes back; F_ij = 1 if cut
    (c)   r_s sum_i c_i x_is <= L <= 1 + eps              every s     stage loads, in units of T
    (d)   lo_i <= B_i <= hi_i                             every i     Rhino 5.2's bound tightening

(d) keeps a node near its balanced position (h = BOUND_SLACK, see its comment):

    lo_i = floor(sum_{A_i} c / T - eps - h),     hi_i = S - 1 - floor((c_i + sum_{D_i} c) / T - eps - h)

The paper prints the upper bound as ceil((c_i + sum_{D_i} c) / T + eps), which bounds the stage
by the work after the node rather than by the stages that work needs; hi_i here is the mirror of
lo_i: a node whose descendants need k stages' worth of time starts at stage S - k at the latest.
On a non-linear graph ancestor sums say little about parallel branches, so the load rows (c),
which Rhino does not have, keep the balance; eps doubles until the problem is feasible. With
per-stage capacities (stages on faster or slower devices) stage s's balanced load is
T_s = share_s sum c, r_s = 1 / (S share_s), and the bounds count the stages the work before
(after) a node fills. tau, a tenth of the smallest edge over L's whole range, breaks ties between
equal cuts (a chain of equal layers cuts the same anywhere) towards the most even split without
ever trading cut volume for balance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import highspy
import numpy as np

from parc.errors import InfeasiblePlanError
from parc.solver.ilp import new_highs, rowwise_lp

# Stages of slack h on the tightened bounds beyond eps. With none (the bounds as Rhino prints
# them) ancestor sums count a parallel branch's work as if it came first, and on branched graphs
# (a UNet, T5, a mixture of experts) the bounds exclude the best cut; half a stage keeps the zoo's
# cuts equal to the untightened ILP's while the bounds still shrink the search (docs/pipeline.md,
# benchmarks/LOG.md).
BOUND_SLACK = 0.5


@dataclass(frozen=True)
class StageCut:
    """The stage of each node, how HiGHS ended, and the eps that was feasible."""

    stage: np.ndarray  # B_i, int per node
    status: str  # "optimal", else HiGHS's model status (a time limit with a feasible point)
    eps: float


def solve_stages(cost: np.ndarray, anc: np.ndarray, edges: Sequence[tuple[int, int]], volume: Sequence[float],
                 count: int, tolerance: float, pins: Mapping[int, int] | None = None, time_limit: float = 60.0,
                 tighten: bool = True, capacity: Sequence[float] | None = None) -> StageCut:
    """The stages of `count` (S) for nodes of cost c_i = `cost[i]` (module docstring). `anc`:
    `ancestors(n, edges)`; `volume`: bytes per edge; `tolerance`: the first eps; `pins`: node ->
    fixed stage; `tighten=False` leaves out the bounds (d) (every node may take any stage);
    `capacity`: each stage's share of the compute (default equal). Raises InfeasiblePlanError
    when eps has doubled 8 times and no split fits."""
    c = np.asarray(cost, dtype=np.float64)
    total = float(c.sum()) or 1.0
    T = total / count
    share = np.full(count, 1.0 / count) if capacity is None else np.asarray(capacity, dtype=np.float64)
    before = anc @ c  # sum_{A_i} c
    after = c @ anc + c  # c_i + sum_{D_i} c
    # HiGHS works to absolute tolerances (1e-7 on rows, 1e-6 on the objective): loads in units of
    # T and volumes in units of the largest edge keep both well scaled.
    vscale = float(max(volume, default=1.0)) or 1.0
    eps = tolerance
    for _ in range(8):
        h = BOUND_SLACK if tighten else count  # `count` stages of slack: no bounds
        lo, hi = stage_bounds(before, after, share * total, (eps + h) * T)
        for i, s in (pins or {}).items():
            lo[i] = hi[i] = s
        got = stage_ilp(c / T, edges, np.asarray(volume, dtype=np.float64) / vscale, count, lo, hi,
                        1 + eps, time_limit, 1.0 / (share * count))
        if got is not None:
            return StageCut(got[0], got[1], eps)
        eps *= 2
    raise InfeasiblePlanError(f"no balanced split into {count} stages (tolerance up to {eps:g}); "
                              f"the pinned stages may contradict the graph's order")


def stage_bounds(before: np.ndarray, after: np.ndarray, loads: np.ndarray,
                 slack: float) -> tuple[np.ndarray, np.ndarray]:
    """Each node's first and last stage (d): with stage s balanced at loads[s], the first is the
    number of stages the work before it (`before`, less `slack`) fills, the last is the mirror
    from the end with the node's own and later work (`after`). With equal loads T these are
    Rhino's floor(before / T - slack / T) and S - 1 - floor(after / T - slack / T)."""
    count = len(loads)
    lo = np.searchsorted(np.cumsum(loads), before - slack, side="right").clip(0, count - 1).astype(int)
    hi = (count - 1 - np.searchsorted(np.cumsum(loads[::-1]), after - slack, side="right")).clip(0, count - 1)
    return lo, np.maximum(hi.astype(int), lo)


def ancestors(n: int, edges: Sequence[tuple[int, int]]) -> np.ndarray:
    """anc[j, i]: i is an ancestor of j (bool [n, n]), for a DAG whose nodes are in topological
    order; its transpose is the descendant relation."""
    preds: list[list[int]] = [[] for _ in range(n)]
    for i, j in edges:
        preds[j].append(i)
    anc = np.zeros((n, n), dtype=bool)
    for j in range(n):
        for i in preds[j]:
            anc[j] |= anc[i]
            anc[j, i] = True
    return anc


def stage_ilp(cost, edges, volume, count: int, lo: np.ndarray, hi: np.ndarray, cap: float, time_limit: float,
              per_stage: np.ndarray | None = None) -> tuple[np.ndarray, str] | None:
    """One solve of the ILP (module docstring) for bounds lo_i <= B_i <= hi_i and L <= `cap`
    (1 + eps), `per_stage` the factors r_s (default 1): each node's stage and HiGHS's status, or
    None when infeasible. Columns: x_is (n * S, node-major), then F_ij per edge, then L."""
    n, m = len(cost), len(edges)
    X = n * count
    vol = np.asarray(volume, dtype=np.float64)
    positive = vol[vol > 0]
    tau = 0.1 * float(positive.min()) / max(float(cap), 1e-300) if len(positive) else 1.0
    lower = np.zeros(X + m + 1)
    upper = np.ones(X + m + 1)
    upper[-1] = cap
    # (d): x_is = 0 outside [lo_i, hi_i]
    s_of = np.tile(np.arange(count), n)
    node_of = np.repeat(np.arange(n), count)
    upper[:X][(s_of < lo[node_of]) | (s_of > hi[node_of])] = 0.0
    objective = np.concatenate([np.zeros(X), vol, [tau]])
    rows, cols, vals, rlo, rhi = [], [], [], [], []
    r = 0
    # (a) sum_s x_is = 1
    rows.append(np.repeat(np.arange(n), count))
    cols.append(np.arange(X))
    vals.append(np.ones(X))
    rlo.append(np.ones(n))
    rhi.append(np.ones(n))
    r += n
    # (b) B_j - B_i - F_ij >= 0 and B_j - B_i - (S - 1) F_ij <= 0, with B_i = sum_s s x_is
    inf = highspy.kHighsInf
    for k, (i, j) in enumerate(edges):
        for scale, lo_b, hi_b in ((1.0, 0.0, inf), (count - 1.0, -inf, 0.0)):
            rows.append(np.full(2 * count + 1, r))
            cols.append(np.concatenate([j * count + np.arange(count), i * count + np.arange(count), [X + k]]))
            vals.append(np.concatenate([np.arange(count, dtype=float), -np.arange(count, dtype=float), [-scale]]))
            rlo.append(np.array([lo_b]))
            rhi.append(np.array([hi_b]))
            r += 1
    # (c) r_s sum_i c_i x_is - L <= 0 (and L <= cap, its column bound)
    for s in range(count):
        rows.append(np.full(n + 1, r))
        cols.append(np.concatenate([np.arange(n) * count + s, [X + m]]))
        vals.append(np.concatenate([np.asarray(cost, dtype=np.float64) * (1.0 if per_stage is None else per_stage[s]),
                                    [-1.0]]))
        rlo.append(np.array([-inf]))
        rhi.append(np.array([0.0]))
        r += 1
    lp = rowwise_lp(objective, lower, upper, rows, cols, vals, rlo, rhi, r)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * (X + m) + [highspy.HighsVarType.kContinuous]
    h = new_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("mip_rel_gap", 1e-4)
    h.setOptionValue("time_limit", time_limit)
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    if h.getInfo().primal_solution_status != highspy.SolutionStatus.kSolutionStatusFeasible.value:
        return None
    x = np.asarray(h.getSolution().col_value)[:X].reshape(n, count)
    name = "optimal" if status == highspy.HighsModelStatus.kOptimal else h.modelStatusToString(status)
    return x.argmax(axis=1), name


__all__ = ["BOUND_SLACK", "StageCut", "ancestors", "solve_stages", "stage_bounds", "stage_ilp"]
