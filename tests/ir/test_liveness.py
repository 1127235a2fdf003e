"""`parc.ir.liveness`: live ranges and the peak of hand-built graphs, and the interval sweep
against a brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from parc.ir import Graph, from_model
from parc.ir.liveness import graph_liveness, graph_peak, interval_peak
from parc.ir.state import STATE_KEY, StepState

F = TensorProto.FLOAT


def _graph(nodes, inputs, outputs, inits=()) -> Graph:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, F, None) for n in outputs],
                          [numpy_helper.from_array(a, n) for n, a in inits])
    return from_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))


def _ranges(graph: Graph, **options) -> dict[str, tuple[int, int]]:
    return {r.value.name: (r.first, r.last) for r in graph_liveness(graph, **options)}


def _names(peak) -> list[str]:
    return [v.name for v in peak.values]


def skip_graph() -> Graph:
    """a = relu(x); b = -a; c = |b|; y = c + a: `a` is read again three nodes later."""
    return _graph([helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"]),
                   helper.make_node("Abs", ["b"], ["c"]), helper.make_node("Add", ["c", "a"], ["y"])],
                  [("x", [1, 16])], ["y"])


def test_a_skip_connection_keeps_its_value_live_to_its_last_reader():
    g = skip_graph()
    assert _ranges(g) == {"a": (0, 3), "b": (1, 2), "c": (2, 3), "y": (3, 4)}
    peak = graph_peak(g)
    # 64 bytes each: a, b, c at node 2 and a, c, y at node 3 tie; the earlier wins
    assert (peak.position, peak.nbytes, _names(peak)) == (2, 192, ["a", "b", "c"])


def test_inputs_count_from_the_first_node_to_their_last_reader_when_asked():
    g = skip_graph()
    assert _ranges(g, inputs=True)["x"] == (0, 0)
    assert "x" not in _ranges(g)
    assert graph_peak(g, inputs=True).nbytes == 192  # x is freed after node 0


def output_graph() -> Graph:
    """big = x @ W is a graph output no node reads; s = x @ V; s2 = relu(s); out = relu(s2)."""
    x = np.ones((4, 64), np.float32)
    return _graph([helper.make_node("MatMul", ["x", "W"], ["big"]), helper.make_node("MatMul", ["x", "V"], ["s"]),
                   helper.make_node("Relu", ["s"], ["s2"]), helper.make_node("Relu", ["s2"], ["out"])],
                  [("x", [1, 4])], ["big", "out"], inits=[("W", x), ("V", x[:, :1])])


def test_a_graph_output_stays_live_to_the_end():
    g = output_graph()
    assert _ranges(g) == {"big": (0, 4), "s": (1, 2), "s2": (2, 3), "out": (3, 4)}
    peak = graph_peak(g)
    assert (peak.position, peak.nbytes, _names(peak)) == (2, 264, ["big", "s", "s2"])
    assert "W" not in _ranges(g, inputs=True)  # constants never count


def test_an_unread_node_output_lives_at_its_producer_or_not_at_all():
    g = _graph([helper.make_node("Relu", ["x"], ["a"]),
                helper.make_node("Split", ["a"], ["p", "dead"], axis=1, num_outputs=2),
                helper.make_node("Abs", ["p"], ["y"])], [("x", [1, 16])], ["y"])
    assert _ranges(g) == {"a": (0, 1), "p": (1, 2), "dead": (1, 1), "y": (2, 3)}
    assert graph_peak(g).nbytes == 128  # a, p and dead at node 1
    assert "dead" not in _ranges(g, unread_outputs=False)
    assert graph_peak(g, unread_outputs=False).nbytes == 96


def step_graph() -> Graph:
    """A training step: loss = sum(x @ w), g = x^T h, w_new = w - g (bound to w), then
    m = expand(x^T) as another output."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("ReduceSum", ["h"], ["loss"]),
             helper.make_node("Transpose", ["x"], ["xt"]), helper.make_node("MatMul", ["xt", "h"], ["g"]),
             helper.make_node("Sub", ["w", "g"], ["w_new"]), helper.make_node("Expand", ["xt", "shape"], ["m"])]
    g = helper.make_graph(nodes, "step", [helper.make_tensor_value_info("x", F, [1, 4]),
                                          helper.make_tensor_value_info("w", F, [4, 4])],
                          [helper.make_tensor_value_info(n, F, None) for n in ("loss", "w_new", "m")],
                          [numpy_helper.from_array(np.ones((4, 4), np.float32), "w"),
                           numpy_helper.from_array(np.array([4, 16], np.int64), "shape")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    helper.set_model_props(model, {STATE_KEY: StepState(bindings={"w_new": "w"}, params=("w",)).to_json()})
    return from_model(model)


def test_a_training_steps_bound_output_replaces_its_input_in_place():
    g = step_graph()
    assert [v.name for v in g.inputs] == ["x"]
    assert _ranges(g) == {"h": (0, 3), "loss": (1, 6), "xt": (2, 5), "g": (3, 4), "w_new": (4, 4),
                          "m": (5, 6)}
    peak = graph_peak(g)
    assert (peak.position, peak.nbytes, _names(peak)) == (5, 276, ["loss", "xt", "m"])


def test_without_in_place_a_bound_output_stays_to_the_end_like_any_output():
    g = step_graph()
    assert _ranges(g, bound_in_place=False)["w_new"] == (4, 6)
    peak = graph_peak(g, bound_in_place=False)
    assert (peak.position, peak.nbytes, _names(peak)) == (5, 340, ["loss", "xt", "w_new", "m"])
    assert graph_peak(g, inputs=True, unread_outputs=False, bound_in_place=False).nbytes == 340


def test_an_empty_graph_has_no_peak():
    peak = graph_peak(Graph("empty"))
    assert (peak.position, peak.nbytes, peak.values) == (None, 0, ())


def test_interval_peak_edge_cases():
    assert interval_peak([], [], []).position is None
    empty = interval_peak([5], [3], [2])  # last before first: never live
    assert (empty.position, empty.nbytes, empty.live) == (None, 0, ())
    tie = interval_peak([4, 4], [1, 3], [1, 3])
    assert (tie.position, tie.nbytes, tie.live) == (1, 4, (0,))
    with pytest.raises(ValueError, match="negative"):
        interval_peak([1], [-1], [0])
    with pytest.raises(ValueError, match="2 sizes"):
        interval_peak([1, 2], [0], [0])


intervals = st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 20), st.integers(-3, 8)), max_size=30)


@settings(max_examples=300, deadline=None)
@given(intervals)
def test_interval_peak_is_the_brute_force_sweep(spans):
    sizes = [s for s, _, _ in spans]
    firsts = [f for _, f, _ in spans]
    lasts = [f + d for _, f, d in spans]  # d < 0: an interval never live
    peak = interval_peak(sizes, firsts, lasts)
    real = [i for i in range(len(spans)) if firsts[i] <= lasts[i]]
    if not real:
        assert (peak.position, peak.nbytes, peak.live) == (None, 0, ())
        return
    at = [sum(sizes[i] for i in real if firsts[i] <= t <= lasts[i]) for t in range(max(lasts) + 1)]
    best = max(at)
    assert peak.nbytes == best
    assert peak.position == at.index(best)
    assert peak.live == tuple(i for i in real if firsts[i] <= peak.position <= lasts[i])
