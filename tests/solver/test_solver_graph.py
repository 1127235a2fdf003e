"""Critical nodes and segments against the path-enumeration definition."""

from __future__ import annotations

import numpy as np
import pytest
from solver_brute import brute_critical

from parc.solver import Problem, ProblemError, critical_nodes, random_problem, segments


def random_dag(seed: int, n: int) -> Problem:
    """Random DAGs with several sources and sinks, sometimes isolated nodes, shuffled labels."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    edges = {(int(perm[a]), int(perm[b])) for a in range(n) for b in range(a + 1, n) if rng.random() < 0.3}
    edges = sorted(edges)
    return Problem(
        comp=tuple(np.zeros(1) for _ in range(n)),
        edges=np.array(edges, dtype=np.int64).reshape(-1, 2),
        comm=tuple(np.zeros((1, 1)) for _ in edges),
    )


@pytest.mark.parametrize("seed", range(60))
def test_critical_nodes_equal_path_enumeration(seed):
    p = random_dag(seed, 2 + seed % 9) if seed % 3 else random_problem(seed, "dag", 9, (1, 1))
    crit = critical_nodes(p)
    assert set(crit.tolist()) == brute_critical(p)
    pos = {v: k for k, v in enumerate(p.topo_order.tolist())}
    assert [pos[c] for c in crit] == sorted(pos[c] for c in crit)


def test_transformer_backbone_is_the_residual_stream():
    p = random_problem(0, "transformer", 57, (2, 2))  # embed + 4 blocks
    names = {p.names[c] for c in critical_nodes(p)}
    assert {"embed", "L0.add1", "L0.add2", "L3.add2"} <= names
    assert "L0.q" not in names


@pytest.mark.parametrize("seed", range(20))
def test_segments_partition_and_contain_every_edge(seed):
    p = random_problem(seed, "transformer" if seed % 2 else "dag", 40, (1, 1))
    crit = critical_nodes(p)
    keep = crit[:: 1 + seed % 3]  # any subset of the critical nodes is a valid cut
    segs = segments(p, keep)
    assert len(segs) == len(keep) + 1
    inner = np.concatenate([s.nodes for s in segs])
    assert sorted(inner.tolist() + keep.tolist()) == list(range(p.n))
    where = {}
    for k, s in enumerate(segs):
        where.update(dict.fromkeys(s.nodes.tolist(), k))
    ends = {}
    for k, s in enumerate(segs):
        for c in (s.entry, s.exit):
            if c is not None:
                ends.setdefault(c, set()).add(k)
    for u, v in p.edges.tolist():
        su = {where[u]} if u in where else ends[u]
        sv = {where[v]} if v in where else ends[v]
        assert su & sv, f"edge {u}->{v} crosses segments"
    for a, b in zip(segs, segs[1:]):
        assert a.exit == b.entry


def test_segments_refuse_a_non_critical_cut():
    p = random_problem(0, "transformer", 30, (1, 1))
    q = p.names.index("L0.q")
    with pytest.raises(ProblemError, match=r"node \d+ \('L0.q'\) is not a critical node"):
        segments(p, np.array([q]))
