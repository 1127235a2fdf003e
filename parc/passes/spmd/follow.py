"""Which nodes of a training step follow which (for `parc.solver.follow`), with affinities.

A backward node follows the forward node it differentiates (`parc.forward`); an optimizer node
follows the first optimizer node of its parameter (`parc.param`), and so does the optimizer state
read only by that parameter's update. Parameters, data and forward nodes lead.

A second grouping, `lead="param"`, puts each optimizer chain and its state under the parameter
itself, which makes the write-back into the parameter's layout a cost inside the group. Neither
is better everywhere: on gpt-2.7b over 25 GbE the parameter-led plan is the exact optimum and the
update-led one well above it, on the pinned megatron-tp4 baseline the other way round
(docs/solver.md; benchmarks/LOG.md, 2026-11-25, fourth session). The search tries the second
when the first is not proven close (`parc.passes.spmd.search.needs_second`).

A member's affinity to its leader's strategy s prices, on the mesh, what the problem's edges cannot see
inside a group: reading a value the leader reads (an input they share) in another layout, and
reading a gradient from outside the group, or producing one for outside, in a layout other
than the mirror of the leader's (a gradient of a value has the value's shape and wants its
layout; a partial sum's gradient is replicated).
"""

from __future__ import annotations

import numpy as np

from parc.ir.graph import Node
from parc.ir.state import BACKWARD, FORWARD, FORWARD_OF, OPTIMIZER, PARAM_OF, phase, step_state
from parc.passes.spmd.costs import NOT_FOUND, CostModel, _unique, reshard_time
from parc.sharding import R, ShardSpec
from parc.sharding.spec import Partial
from parc.solver.follow import Grouping


def model_grouping(model: CostModel) -> Grouping | None:
    """Which nodes follow which in `model`'s training step (`training_grouping`), found once per
    model and kept on it, so that it travels with the model to the search's jobs; None for a
    graph without a backward."""
    if model.grouping is NOT_FOUND:
        model.grouping = training_grouping(model)
    return model.grouping


def training_grouping(model: CostModel, lead: str = "update") -> Grouping | None:
    """The grouping of a training step's cost model (None for a graph without a backward).

    `lead="update"`: an optimizer chain and its state follow the parameter's first update node;
    `lead="param"`: they follow the parameter itself (the search's second candidate)."""
    g = model.graph
    state = step_state(g.metadata)
    if state is None:
        return None
    p = model.problem
    leader = np.arange(p.n)
    forward = {n.name: model.node_index(pos) for pos, n in enumerate(g.nodes) if phase(n) == FORWARD}
    first_update: dict[str, int] = {}
    for pos, n in enumerate(g.nodes):
        i = model.node_index(pos)
        if phase(n) == BACKWARD and n.meta.get(FORWARD_OF) in forward:
            leader[i] = forward[n.meta[FORWARD_OF]]
        elif phase(n) == OPTIMIZER and n.meta.get(PARAM_OF):
            leader[i] = first_update.setdefault(n.meta[PARAM_OF], i)
    if (leader == np.arange(p.n)).all():
        return None
    params = set(state.params)
    source = {v.name: k for k, v in enumerate(model.sources)}
    position = {id(n): pos for pos, n in enumerate(g.nodes)}
    updates = set(first_update.values())
    for k, v in enumerate(model.sources):  # optimizer state: read by one parameter's update only
        if v.name in params or len(model.source_specs[k]) < 2:
            continue
        owners = {int(leader[model.node_index(position[id(u)])]) for u, _ in v.uses if id(u) in position}
        if len(owners) == 1 and owners <= updates:
            leader[k] = owners.pop()
    if lead == "param":  # each optimizer group, its state included, led by the parameter it updates
        for name, first in first_update.items():
            if name in source:
                leader[leader == first] = source[name]
    affinity = _Affinity(model)
    out = {}
    for pos, n in enumerate(g.nodes):
        i = model.node_index(pos)
        lead = int(leader[i])
        if lead != i and lead >= len(model.sources) and phase(n) == BACKWARD:
            a = affinity.of(g.nodes[lead - len(model.sources)], lead - len(model.sources), n, pos, leader)
            if a is not None:
                out[i] = a
    # the polish frees the forward side (forward nodes, parameters, data), then the rest
    forward_side = np.ones(p.n, dtype=bool)
    for pos, n in enumerate(g.nodes):
        forward_side[model.node_index(pos)] = phase(n) == FORWARD
    forward_side[: len(model.sources)] = leader[: len(model.sources)] == np.arange(len(model.sources))
    return Grouping(leader, out, (~forward_side, forward_side))


def mirror(spec: ShardSpec) -> ShardSpec:
    """The layout a value's gradient wants: the value's, with partial sums replicated."""
    return ShardSpec(tuple(R if isinstance(ax, Partial) else ax for ax in spec))


class _Affinity:
    """Affinity matrices, one per distinct (leader list, member list, relation), as costs.build
    shares strategy lists between nodes of one signature."""

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self.cache: dict[tuple, np.ndarray | None] = {}
        self.position = {id(n): pos for pos, n in enumerate(model.graph.nodes)}

    def of(self, f: Node, f_pos: int, b: Node, b_pos: int, leader: np.ndarray) -> np.ndarray | None:
        m = self.model
        fs, bs = m.strategies[f_pos], m.strategies[b_pos]
        group = int(leader[m.node_index(b_pos)])

        def inside(v) -> bool:
            return v.producer is not None and int(leader[m.node_index(self.position[id(v.producer)])]) == group

        terms = []  # (kind, leader side, member side): "shared" input, "grad-in" / "grad-out" mirrors
        f_inputs = {id(v): j for j, v in enumerate(f.inputs) if v is not None}
        for k, v in enumerate(b.inputs):
            if v is None or inside(v):
                continue
            if id(v) in f_inputs:
                terms.append(("shared", f_inputs[id(v)], k))
            elif v.shape is not None:
                outs = tuple(o for o, w in enumerate(f.outputs) if w.shape == v.shape and w.dtype == v.dtype)
                if outs:
                    terms.append(("grad-in", outs, k))
        for k, w in enumerate(b.outputs):
            readers = [u for u, _ in w.uses if id(u) in self.position]
            if not w.name or (readers and all(
                    int(leader[m.node_index(self.position[id(u)])]) == group for u in readers)):
                continue  # read inside the group only: the problem's edges price it
            ins = tuple(j for j, v in enumerate(f.inputs) if v is not None and v.shape == w.shape
                        and v.dtype == w.dtype and fs[0].inputs[j] is not None)
            if ins:
                terms.append(("grad-out", ins, k))
        if not terms:
            return None
        key = (id(fs), id(bs), tuple(terms), tuple(v.shape if v is not None else None for v in b.inputs))
        if key not in self.cache:
            total = np.zeros((len(fs), len(bs)))
            for kind, where, k in terms:
                if kind == "shared":
                    v = b.inputs[k]
                    total += self._matrix([s.inputs[where] for s in fs], [t.inputs[k] for t in bs], v)
                elif kind == "grad-in":
                    v = b.inputs[k]
                    total += np.minimum.reduce([self._matrix([mirror(s.outputs[o]) for s in fs],
                                                             [t.inputs[k] for t in bs], v) for o in where])
                else:
                    w = b.outputs[k]
                    total += np.minimum.reduce([self._matrix([t.outputs[k] for t in bs],
                                                             [mirror(s.inputs[j]) for s in fs], w).T
                                                for j in where])
            self.cache[key] = total
        return self.cache[key]

    def _matrix(self, a: list, b: list, v) -> np.ndarray:
        """reshard_time from each of a's specs to each of b's (None: no cost)."""
        ua, ia = _unique(a)
        ub, ib = _unique(b)
        small = np.zeros((len(ua), len(ub)))
        for r, x in enumerate(ua):
            for c, y in enumerate(ub):
                if x is not None and y is not None:
                    small[r, c] = reshard_time(x, y, tuple(v.shape), v.dtype.itemsize, self.model.mesh)
        return small[np.ix_(ia, ib)]


