"""Liveness: which values are alive at once, and when that costs the most bytes.

Two levels. `interval_peak` is the sweep every peak-memory figure in parc uses: values with a
size, a first and a last position, in, the position where the live bytes peak, those bytes and
which values are live there, out. `graph_liveness` gives an IR graph's values their positions
(the rules, written down once, are in its docstring) and `graph_peak` sweeps them. The planner's
memory model (`passes.spmd.costs.peak_live`) and `parc inspect`'s activation peak are
`graph_peak` with different options; the step simulator (`exec.stepsim.held_peak`) finds its
arrays' first and last tasks itself and sweeps them with `interval_peak`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from parc.ir.graph import Graph, Value
from parc.ir.state import bindings


@dataclass(frozen=True)
class IntervalPeak:
    """The peak of a set of intervals: where, how many bytes, and which intervals (their
    indices, ascending) are live there. `position` is None when no interval is ever live."""

    position: int | None
    nbytes: int
    live: tuple[int, ...]


def interval_peak(sizes: Sequence[int], firsts: Sequence[int], lasts: Sequence[int]) -> IntervalPeak:
    """The position where the most bytes are live, interval i being live at the positions
    `firsts[i]..lasts[i]` (both included; positions are >= 0; `lasts[i] < firsts[i]`: never live)
    with `sizes[i]` bytes. Ties go to the earliest position, counted from 0."""
    size = np.asarray(sizes, dtype=np.int64).reshape(-1)
    first = np.asarray(firsts, dtype=np.int64).reshape(-1)
    last = np.asarray(lasts, dtype=np.int64).reshape(-1)
    if not len(size) == len(first) == len(last):
        raise ValueError(f"interval_peak: {len(size)} sizes, {len(first)} firsts and {len(last)} lasts")
    if len(first) and first.min() < 0:
        raise ValueError(f"interval_peak: position {int(first.min())} is negative")
    real = first <= last
    if not real.any():
        return IntervalPeak(None, 0, ())
    delta = np.zeros(int(last[real].max()) + 2, dtype=np.int64)
    np.add.at(delta, first[real], size[real])
    np.subtract.at(delta, last[real] + 1, size[real])
    live = np.cumsum(delta)
    t = int(np.argmax(live))
    return IntervalPeak(t, int(live[t]), tuple(int(i) for i in np.flatnonzero(real & (first <= t) & (t <= last))))


@dataclass(frozen=True)
class LiveRange:
    """A value live from node `first` to node `last` (both included; `len(graph.nodes)`: the
    end, after the last node)."""

    value: Value
    first: int
    last: int


@dataclass(frozen=True)
class GraphPeak:
    """The peak of a graph run in its node order: at node `position` (`len(graph.nodes)`: the end;
    None: nothing is live), `nbytes` are live in `values` (in `graph_liveness` order)."""

    position: int | None
    nbytes: int
    values: tuple[Value, ...]


def graph_liveness(graph: Graph, *, inputs: bool = False, unread_outputs: bool = True,
                   bound_in_place: bool = True) -> list[LiveRange]:
    """The live range of each value of `graph` when its nodes run in order, one node a position.

    The rules:
    - what counts: node outputs, each at its full size; a value without a name, a shape or a
      dtype does not count, and constants (initializers, a training step's parameters and state
      as the graph holds them) never do;
    - a node output is live from its producer to its last reader;
    - a graph output stays live to the end (position `len(graph.nodes)`), except, with
      `bound_in_place`, a training step's bound outputs (its new parameters and optimizer state,
      `parc.ir.state.bindings`), which replace their inputs in place and so end at their last
      reader like any other value;
    - a node output that no node reads and that is not a graph output is live at its producer
      only, or, without `unread_outputs`, does not count;
    - with `inputs`, the graph's (non-constant) inputs count too, live from the first node to
      their last reader, or to the end when they are graph outputs or nothing reads them.

    Ranges come inputs first, then node outputs in node order."""
    bound = set(bindings(graph.metadata)) if bound_in_place else set()
    to_end = {id(v) for v in graph.outputs if v.name not in bound}
    position = {id(n): k for k, n in enumerate(graph.nodes)}
    end = len(graph.nodes)

    def last_reader(v: Value) -> int | None:
        return max((position[id(u)] for u, _ in v.uses if id(u) in position), default=None)

    def counts(v: Value) -> bool:
        return bool(v.name) and v.shape is not None and v.dtype is not None and not v.is_const

    ranges = []
    if inputs:
        for v in graph.inputs:
            if counts(v):
                last = last_reader(v)
                ranges.append(LiveRange(v, 0, end if id(v) in to_end or last is None else last))
    for k, n in enumerate(graph.nodes):
        for v in n.outputs:
            if not counts(v):
                continue
            last = end if id(v) in to_end else last_reader(v)
            if last is None and not unread_outputs:
                continue
            ranges.append(LiveRange(v, k, k if last is None else last))
    return ranges


def graph_peak(graph: Graph, *, inputs: bool = False, unread_outputs: bool = True,
               bound_in_place: bool = True) -> GraphPeak:
    """Where the bytes live in `graph` (run in node order) peak, and which values are live there:
    `interval_peak` over `graph_liveness` (the options are its)."""
    ranges = graph_liveness(graph, inputs=inputs, unread_outputs=unread_outputs, bound_in_place=bound_in_place)
    peak = interval_peak([r.value.nbytes for r in ranges], [r.first for r in ranges], [r.last for r in ranges])
    return GraphPeak(peak.position, peak.nbytes, tuple(ranges[i].value for i in peak.live))
