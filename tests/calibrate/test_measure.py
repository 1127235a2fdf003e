"""The benchmarks one rank runs (`parc.calibrate.measure`), their models and inputs: short real
runs on this machine, checked for their structure (which rows, which classes), never for
this host's speed."""

from __future__ import annotations

import math

import numpy as np
import pytest

import parc.calibrate.graphs as graphs
import parc.calibrate.measure as measure
from parc.calibrate.catalogue import (
    COLD_TOUCH,
    CONVS,
    GEMMS,
    MASKED,
    MATMULS,
    MEMORY_CLASSES,
    MEMORY_OPS,
    MEMORY_ROWS,
    PADDED,
    PIECE_OPS,
    SMALL_MATMULS,
    SWEEP_ROWS,
)
from parc.calibrate.fit import fit
from parc.calibrate.measure import Solo, measure_rank
from parc.calibrate.session import ArrayBench, make_feeds
from parc.exec import data


@pytest.fixture(scope="module")
def ort_rows() -> dict:
    """One rank's benchmarks on onnxruntime, measured once for the tests that read them."""
    return measure_rank(Solo(), 1, budget=0.002)


@pytest.mark.parametrize("engine", [("ort", "cpu"), ("cupy", "cpu")], ids=["ort", "numpy"])
def test_a_rank_alone_measures_every_class_of_op(engine, ort_rows):
    rows = ort_rows if engine[0] == "ort" else measure_rank(Solo(), 1, budget=0.002, engine=engine)
    assert rows["launch_floor_s"] > 0 and rows["task_overhead_s"] >= 0
    assert {r["op"] for r in rows["memory"]} == set(MEMORY_OPS)
    assert len(rows["matmul"]) == len(MATMULS) + len(GEMMS) and all(r["flops_per_s"] > 0 for r in rows["matmul"])
    assert [r["class"] for r in rows["matmul"] if "class" in r] == ["Gemm"] * len(GEMMS)
    assert {r["class"] for r in rows["conv"]} == set(CONVS) and all(r["flops_per_s"] > 0 for r in rows["conv"])
    assert {r["op"] for r in rows["sweep"]} == {"Add"} and len(rows["sweep"]) == len(SWEEP_ROWS)
    assert "all_reduce" not in rows
    # the Gemm class is fitted as its own (a weight's gradient), a fraction of the fastest rate
    f = fit(rows, 1)
    assert 0 < f["op_efficiency"]["Gemm"] <= 1 and 0 < f["memory_op_efficiency"]["ScatterND"] <= 1


def _rate(fitted: dict, cls: str) -> float:
    """A memory-bound class's fitted rate in bytes/s."""
    return fitted["memory_op_efficiency"][cls] * fitted["memory_bandwidth"]


def _slowed(rows: dict, ops: set[str], factor: float) -> dict:
    """`rows` with the memory rows of `ops` taking `factor` times as long."""
    return {**rows, "memory": [{**r, "s": r["s"] * factor, "bytes_per_s": r["bytes_per_s"] / factor}
                               if r["op"] in ops else r for r in rows["memory"]]}


def test_where_is_measured_as_its_own_class(ort_rows):
    """Where (a ReLU's gradient and attention's mask) and Softmax after a causal and a padding
    mask's fill are measured on rows of their own and fitted as classes of their own, each from
    its own rows: slowing one class's rows moves its figure and no other's. The figures are not
    compared with each other: how fast each runs is this host's business."""
    rows = ort_rows
    where = [r for r in rows["memory"] if r["op"] in ("Where", "WhereMasked")]
    assert len(where) == 2 * len(MEMORY_ROWS) and all(r["s"] > 0 and r["pieces"] > 0 for r in where)
    # the masked softmaxes run on scores with a mask's fill (`make_feeds`), each in its own class
    assert [graphs.memory_op(op, 1024)[0].graph.input[0].name for op in ("SoftmaxMasked", "SoftmaxPadded")] == \
        [MASKED, PADDED]
    classes = ("Where", "Softmax", "SoftmaxMasked", "SoftmaxPadded", "Div", "Sqrt", "TransposeLastAxis")
    assert len({MEMORY_CLASSES[op] for op in ("Softmax", "SoftmaxMasked", "SoftmaxPadded")}) == 3
    f = fit(rows, 1)
    own = f["memory_op_efficiency"]
    assert all(0 < own[cls] <= 1 and math.isfinite(_rate(f, cls)) for cls in classes)
    # each class's figure comes from its own rows
    masked = fit(_slowed(rows, {"SoftmaxMasked"}, 10.0), 1)
    assert _rate(masked, "SoftmaxMasked") == pytest.approx(_rate(f, "SoftmaxMasked") / 10)
    slow_where = fit(_slowed(rows, {"Where", "WhereMasked"}, 10.0), 1)
    assert _rate(slow_where, "Where") < _rate(f, "Where")
    for g, moved in ((masked, "SoftmaxMasked"), (slow_where, "Where")):
        assert all(_rate(g, cls) == pytest.approx(_rate(f, cls)) for cls in classes if cls != moved)


def test_a_padded_benchmark_input_hides_each_sequences_padding_from_every_query():
    class Session:
        shapes = {PADDED: (64, 16, 16)}

        @staticmethod
        def place(x):
            return x

    x = make_feeds(Session(), pool_bytes=1)[0][PADDED]
    hidden = x <= -1e9
    assert (hidden == hidden[:, :1, :]).all()  # the same keys for every query of a sequence
    kept = (~hidden[:, 0, :]).sum(-1)
    assert kept.min() >= 16 - 16 // data.PADDED and kept.max() == 16 and (kept < 16).any()
    assert all(((~hidden[i, 0, :k]).all() and hidden[i, 0, k:].all()) for i, k in enumerate(kept))  # at the end


def test_a_masked_benchmark_input_holds_a_causal_fill_above_its_diagonal():
    class Session:
        shapes = {MASKED: (2, 4, 4), "x": (2, 4, 4)}

        @staticmethod
        def place(x):
            return x

    feeds = make_feeds(Session(), pool_bytes=1)[0]
    upper = ~np.tri(4, 4, dtype=bool)
    assert (feeds[MASKED][:, upper] == -1e9).all() and (feeds[MASKED][:, ~upper] > -1e3).all()
    assert (feeds["x"] > -1e3).all()


def test_the_array_engine_pays_for_a_transpose_it_returns_as_a_view(monkeypatch):
    """The engine returns a Transpose as a view of its input; the benchmark's run makes it
    contiguous, the copy whichever kernel reads it would pay."""
    model, _ = graphs.memory_op("Transpose", 1024)
    bench = ArrayBench(model, "cpu")
    feeds = make_feeds(bench)[0]
    (view,) = bench.engine.run(feeds).values()
    assert not view.flags.c_contiguous
    made = []
    contiguous = np.ascontiguousarray
    monkeypatch.setattr(np, "ascontiguousarray", lambda a, *args, **kw: made.append(a) or contiguous(a, *args, **kw))
    bench.run(feeds)
    assert made and made[-1].shape == view.shape and not made[-1].flags.c_contiguous


def test_a_small_case_is_measured_as_copies_of_its_node(ort_rows):
    model, _ = graphs.memory_op("Softmax", 64)
    copies = graphs.copies(model, 4)
    assert [n.op_type for n in copies.graph.node] == ["Softmax"] * 4 and len(copies.graph.output) == 4
    assert len({n.output[0] for n in copies.graph.node}) == 4 and len(model.graph.node) == 1
    assert graphs.pieces(model) == 64 / 16  # 64 rows of 1 KiB: a sixteenth of a piece each
    rows = ort_rows
    assert {r["op"] for r in rows["pieces"]} == set(PIECE_OPS)
    assert len(rows["small"]) == len(MEMORY_OPS) + len(SMALL_MATMULS)
    assert all(r["pieces"] > 0 for r in rows["pieces"])


def test_the_cold_benchmark_runs_on_this_machine():
    """`_cold_reads` on one thread: a row per amount written, each a positive time."""
    rows = measure._cold_reads(1, ("ort", "cpu"), lambda: None)
    assert [r["touched"] for r in rows] == list(COLD_TOUCH)
    assert all(r["s"] > 0 and r["bytes"] == 12 << 20 for r in rows)
