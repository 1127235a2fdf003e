"""Seeded random Problems for tests and benchmarks: chains, trees, DAGs, transformer-like stacks.

Two cost models. "uniform": every comp, comm and mem entry drawn independently (hardest for the
LP relaxation, good for brute-force checks). "spec": each strategy carries a latent layout label
(0 = replicate, 1..7 = some sharding); sharded strategies compute ~1/4 and store 1/4 of the
parameters, and an edge costs nothing when both ends use the same layout and a label-pair cost
otherwise, the shape of real resharding costs.
"""

from __future__ import annotations

import numpy as np

from parc.solver.problem import Problem

KINDS = ("chain", "tree", "dag", "transformer")
LABELS = 8

# One transformer block over its input x (index -1): ln1, q, k, v, scores, softmax, attn, out,
# add1, ln2, fc1, gelu, fc2, add2 -- the residual adds are the block's backbone.
_BLOCK = (
    ("ln1", (-1,)),
    ("q", (0,)),
    ("k", (0,)),
    ("v", (0,)),
    ("scores", (1, 2)),
    ("softmax", (4,)),
    ("attn", (5, 3)),
    ("out", (6,)),
    ("add1", (7, -1)),
    ("ln2", (8,)),
    ("fc1", (9,)),
    ("gelu", (10,)),
    ("fc2", (11,)),
    ("add2", (12, 8)),
)


def _chain(rng, n):
    return [(i, i + 1) for i in range(n - 1)], None


def _tree(rng, n):
    edges = []
    for i in range(1, n):
        p = int(rng.integers(0, i))
        edges.append((p, i) if rng.random() < 0.7 else (i, p))
    return edges, None


def _dag(rng, n, p_skip=0.25):
    edges = {(i, i + 1) for i in range(n - 1)}
    for v in range(2, n):
        for _ in range(2):
            if rng.random() < p_skip:
                edges.add((int(rng.integers(0, v - 1)), v))
    return sorted(edges), None


def _transformer(rng, n, p_extra=0.3):
    """Embedding, then blocks of _BLOCK while they fit, then a chain head up to n nodes; a block
    gets an extra skip edge inside it with probability p_extra (some attention variants)."""
    edges, names = [], ["embed"]
    x, layer = 0, 0
    while len(names) + len(_BLOCK) <= n:
        base = len(names)
        ref = [x if k == -1 else base + k for k in range(-1, len(_BLOCK))]
        for k, (op, inputs) in enumerate(_BLOCK):
            names.append(f"L{layer}.{op}")
            edges += [(ref[a + 1], base + k) for a in inputs]
        if rng.random() < p_extra:
            a = int(rng.integers(0, len(_BLOCK) - 2))
            b = int(rng.integers(a + 2, len(_BLOCK)))
            edges.append((ref[a], base + b))
        x, layer = base + len(_BLOCK) - 1, layer + 1
    while len(names) < n:
        names.append(f"head{len(names)}")
        edges.append((len(names) - 2, len(names) - 1))
    return sorted(set(edges)), names


def _uniform_costs(rng, s, edges):
    comp = [np.round(rng.uniform(0, 10, k), 2) for k in s]
    mem = [np.round(rng.uniform(0, 10, k), 2) for k in s]
    comm = [np.round(rng.uniform(0, 10, (s[u], s[v])), 2) for u, v in edges]
    return comp, comm, mem


def _spec_costs(rng, s, edges):
    labels = [np.concatenate([[0], rng.choice(np.arange(1, LABELS), k - 1, replace=False)]) for k in s]
    pair = rng.uniform(0.5, 2.0, (LABELS, LABELS))
    pair[0, :] = 0.1  # replicate -> any sharding is a local slice
    np.fill_diagonal(pair, 0.0)
    work = rng.lognormal(0.0, 1.0, len(s))
    params = np.where(rng.random(len(s)) < 0.4, rng.lognormal(2.0, 1.0, len(s)), 0.0)
    comp, mem = [], []
    for i, lab in enumerate(labels):
        shard = np.where(lab == 0, 1.0, rng.uniform(0.25, 0.4, lab.size))
        comp.append(np.round(work[i] * shard, 4))
        mem.append(np.round(params[i] * np.where(lab == 0, 1.0, 0.25), 4))
    volume = rng.lognormal(-0.5, 1.0, len(edges))
    comm = [np.round(volume[e] * pair[np.ix_(labels[u], labels[v])], 4) for e, (u, v) in enumerate(edges)]
    return comp, comm, mem


def random_problem(
    seed: int,
    kind: str = "dag",
    n: int = 8,
    strategies: tuple[int, int] = (1, 4),
    *,
    costs: str = "uniform",
    budget: float | None = None,
    pin_frac: float = 0.0,
) -> Problem:
    """A seeded random Problem.

    kind: one of KINDS. strategies: (lo, hi), each s_i drawn uniformly from [lo, hi].
    costs: "uniform" or "spec" (see the module docstring). budget: None for no memory
    constraint, else a fraction t in [0, 1] placing M at min_memory + t * (max_memory -
    min_memory). pin_frac: share of nodes pinned to a random non-empty subset of strategies.
    """
    rng = np.random.default_rng(seed)
    topology = {"chain": _chain, "tree": _tree, "dag": _dag, "transformer": _transformer}
    if kind not in topology:
        raise ValueError(f"kind: expected one of {KINDS}, found {kind!r}")
    edges, names = topology[kind](rng, n)
    s = rng.integers(strategies[0], strategies[1] + 1, n)
    comp, comm, mem = (_uniform_costs if costs == "uniform" else _spec_costs)(rng, s, edges)
    pins = {}
    for i in np.flatnonzero(rng.random(n) < pin_frac):
        k = int(rng.integers(1, s[i] + 1))
        pins[int(i)] = tuple(int(j) for j in rng.choice(s[i], k, replace=False))
    problem = Problem(
        comp=tuple(comp),
        edges=np.array(edges, dtype=np.int64).reshape(-1, 2),
        comm=tuple(comm),
        mem=tuple(mem),
        pins=pins,
        names=tuple(names or ()),
    )
    if budget is not None:
        lo = problem.min_memory()
        hi = sum(float(m[problem.allowed(i)].max()) for i, m in enumerate(problem.mem))
        problem = problem.with_budget(round(lo + budget * (hi - lo), 4))
    return problem
