"""Partial sums passed through linear ops: a P(sum) strategy's outputs, summed over the devices,
equal the op on the summed inputs."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from ops.opcase import Arg, build

from parc.ir.exporter import to_onnx
from parc.passes.spmd.strategies import PARTIAL, node_strategies
from parc.sharding import Partial

CASES = {
    "Add": lambda r: [r.standard_normal((3, 4)), r.standard_normal((4,))],
    "Sub": lambda r: [r.standard_normal((2, 3)), r.standard_normal((2, 3))],
    "Mul": lambda r: [r.standard_normal((2, 3)), r.standard_normal((2, 3))],
    "Div": lambda r: [r.standard_normal((2, 3)), r.standard_normal((2, 3)) + 3],
    "MatMul": lambda r: [r.standard_normal((2, 3, 4)), r.standard_normal((4, 5))],
    "Transpose": lambda r: [r.standard_normal((2, 3, 4))],
    "Neg": lambda r: [r.standard_normal((4,))],
    "ReduceSum": lambda r: [r.standard_normal((2, 6)), Arg(np.array([1], np.int64))],
    "Reshape": lambda r: [r.standard_normal((2, 6)), Arg(np.array([3, 4], np.int64))],
    "Unsqueeze": lambda r: [r.standard_normal((2, 6)), Arg(np.array([0], np.int64))],
    "Expand": lambda r: [r.standard_normal((1, 6)), Arg(np.array([3, 6], np.int64))],
    # an embedding's gradient (Gather's): updates scattered at unique rows
    "ScatterND": lambda r: [r.standard_normal((5, 3)), Arg(np.array([[1], [3]], np.int64)),
                            r.standard_normal((2, 3))],
    "ScatterElements": lambda r: [r.standard_normal((4, 3)), Arg(np.array([[2, 0, 1]], np.int64)),
                                  r.standard_normal((1, 3))],
}


def _run(case, arrays):
    model = to_onnx(case.graph)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, dict(zip(names, [a for a in arrays if a is not None])))[0]


@pytest.mark.parametrize("op", sorted(CASES))
def test_partial_strategies_sum_to_the_whole(op):
    rng = np.random.default_rng(0)
    inputs = [a if isinstance(a, Arg) else a.astype(np.float32) for a in CASES[op](rng)]
    case = build(op, inputs, opset=18)
    variants = [s for s in node_strategies(case.node, (2,)) if s.labels == (PARTIAL,)]
    assert variants, f"{op} has no partial strategy"
    whole = _run(case, case.arrays)
    for s in variants:
        parts = [[], []]
        for a, spec in zip(case.arrays, s.inputs):
            if a is not None and spec is not None and isinstance(spec[0], Partial):
                share = rng.standard_normal(a.shape).astype(np.float32)
                parts[0].append(share)
                parts[1].append(a - share)
            else:
                parts[0].append(a)
                parts[1].append(a)
        assert all(isinstance(o[0], Partial) for o in s.outputs)
        got = _run(case, parts[0]) + _run(case, parts[1])
        np.testing.assert_allclose(got, whole, rtol=1e-4, atol=1e-4)


def test_nonlinear_ops_get_no_partial_strategy():
    case = build("Relu", [np.ones((2, 2), np.float32)], opset=18)
    assert not [s for s in node_strategies(case.node, (2,)) if PARTIAL in s.labels]


def test_a_multiplying_scatter_gets_no_partial_strategy():
    case = build("ScatterND", [np.ones((4, 3), np.float32), Arg(np.array([[1]], np.int64)),
                               np.ones((1, 3), np.float32)], opset=18, reduction="mul")
    assert not [s for s in node_strategies(case.node, (2,)) if PARTIAL in s.labels]


def test_partial_sums_pass_along_time_and_a_flat_device_axis_at_once():
    # a microbatch's bias gradient (partial along time and over the devices) through a Reshape:
    # summed over the microbatches first, reduced over the devices once
    case = build("Reshape", [np.ones((1, 1, 8), np.float32), Arg(np.array([8], np.int64))], opset=18)
    both = [s for s in node_strategies(case.node, (4, 2), first=(PARTIAL,)) if s.labels == (PARTIAL, PARTIAL)]
    assert both and all(isinstance(s.inputs[0][k], Partial) and isinstance(s.outputs[0][k], Partial)
                        for s in both for k in (0, 1))
    # on a 2-D device mesh behind the time axis, only time passes them (the ILP's size)
    assert not [s for s in node_strategies(case.node, (4, 2, 2), first=(PARTIAL,)) if s.labels.count(PARTIAL) > 1]
