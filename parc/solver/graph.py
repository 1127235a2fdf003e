"""Critical nodes and segments (Rhino 4.3.1-4.3.2), exactly, on the problem's DAG.

Add a virtual source S before every source and a virtual sink T after every sink. A node is
critical when every S-T path passes through it: a separator of the backbone. Rhino finds the
backbone as the zero-slack nodes of a unit-time schedule and keeps the compute-heavy ones; every
separator has zero slack, but not every zero-slack node separates, and only separators let the
segments be solved independently and stitched exactly, so we compute the separators.

In any topological order, v is critical iff no edge (S and T's included) jumps over it: an edge
(a, b) with pos(a) < pos(v) < pos(b) gives the path S ~> a -> b ~> T, whose first part lies
before v and whose last part lies after it; conversely, with no edge over v, every path from a
node before v to one after it must pass through v. One difference-array sweep, O(n + |E|).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parc.solver.problem import Problem, ProblemError


def critical_nodes(p: Problem) -> np.ndarray:
    """The nodes on every source-sink path, in topological order."""
    n, order = p.n, p.topo_order
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    indeg = np.bincount(p.edges[:, 1], minlength=n)
    outdeg = np.bincount(p.edges[:, 0], minlength=n)
    src, snk = np.flatnonzero(indeg == 0), np.flatnonzero(outdeg == 0)
    # jumps (a, b) over the positions strictly between a and b; S sits at -1 and T at n
    a = np.concatenate([pos[p.edges[:, 0]], np.full(len(src), -1), pos[snk]])
    b = np.concatenate([pos[p.edges[:, 1]], pos[src], np.full(len(snk), n)])
    cover = np.zeros(n + 2, dtype=np.int64)
    np.add.at(cover, a + 2, 1)  # +1 from position a + 1 on (index shifted by one for S)
    np.add.at(cover, b + 1, -1)  # back to 0 from position b on
    covered = np.cumsum(cover)[1 : n + 1] > 0
    return order[~covered]


@dataclass(frozen=True, eq=False)
class Segment:
    """The nodes strictly between two consecutive critical nodes (Rhino 4.3.2, top level)."""

    entry: int | None  # critical node before it (None: the part before the first critical node)
    exit: int | None  # critical node after it (None: the part after the last one)
    nodes: np.ndarray  # its inner nodes, in topological order


def segments(p: Problem, critical: np.ndarray) -> list[Segment]:
    """Cut the graph at `critical` (any subset of critical_nodes(p)) into len(critical) + 1
    segments; every edge lies inside one segment or joins it to its entry or exit."""
    all_critical = set(critical_nodes(p).tolist())
    bad = [int(c) for c in critical if int(c) not in all_critical]
    if bad:
        raise ProblemError(f"segments: {p.name(bad[0])} is not a critical node (an edge jumps over it)")
    order = p.topo_order
    pos = np.empty(p.n, dtype=np.int64)
    pos[order] = np.arange(p.n)
    cut = np.sort(pos[np.asarray(critical, dtype=np.int64)])
    bounds = [-1, *cut.tolist(), p.n]
    ends = [None, *order[cut].tolist(), None]
    return [
        Segment(ends[k], ends[k + 1], order[bounds[k] + 1 : bounds[k + 1]]) for k in range(len(bounds) - 1)
    ]
