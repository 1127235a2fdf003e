"""Elementwise fusion in the array engine (parc/exec/engines/fusion.py).

On NumPy a group runs its nodes one by one, so these tests pin the grouping (which nodes join,
which stay apart, where the group runs, what it frees) and the kernel text; `tests/exec/test_gpu.py`
runs the compiled kernels against the unfused engine on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import inp, make_model, tensor, tiny_training_step
from onnx import TensorProto, helper

from parc.exec.engines.array import ArrayEngine
from parc.exec.engines.fusion import Group

n = helper.make_node


def _groups(engine: ArrayEngine) -> list[Group]:
    return [s[0] for s in engine._steps if isinstance(s[0], Group)]


def _chain_model():
    """y = sqrt(x * x + 1) / (x + b); z = y * 2 read twice (Add and an output), w = Where(c, z, -z)."""
    nodes = [n("Mul", ["x", "x"], ["xx"]), n("Add", ["xx", "one"], ["s"]), n("Sqrt", ["s"], ["r"]),
             n("Add", ["x", "b"], ["d"]), n("Div", ["r", "d"], ["y"]), n("Mul", ["y", "two"], ["z"]),
             n("Neg", ["z"], ["nz"]), n("Where", ["c", "z", "nz"], ["w"]), n("ReduceSum", ["w"], ["total"]),
             n("Exp", ["total"], ["e"])]
    return make_model(nodes, [inp("x", [2, 3]), inp("b", [3]), inp("c", [2, 3], TensorProto.BOOL)],
                      [inp("w", None), inp("z", None), inp("e", None)],
                      [tensor("one", np.float32(1)), tensor("two", np.float32(2))])


def _feeds(rng):
    return {"x": rng.standard_normal((2, 3)).astype(np.float32), "b": np.float32([3, 4, 5]),
            "c": rng.standard_normal((2, 3)) > 0}


def test_groups_are_trees_of_single_reader_values():
    engine = ArrayEngine(_chain_model(), fuse=True)
    groups = _groups(engine)
    # x*x+1 -> sqrt -> / (x+b) -> *2 is one tree; z has two readers (Neg, Where) and is an output,
    # so Neg and Where start a new one; ReduceSum is not elementwise; Exp alone is no group
    assert [[o.op for o in g.ops] for g in groups] == [["Mul", "Add", "Sqrt", "Add", "Div", "Mul"], ["Neg", "Where"]]
    assert groups[0].leaves == ("x", "one", "b", "two")
    assert groups[1].leaves == ("z", "c")
    assert len(engine._steps) == 4  # two groups, ReduceSum, Exp
    got = engine.run(_feeds(np.random.default_rng(0)))
    want = ArrayEngine(_chain_model(), fuse=False).run(_feeds(np.random.default_rng(0)))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_kernel_body_is_one_local_per_node():
    group = _groups(ArrayEngine(_chain_model(), fuse=True))[0]
    assert group.body("float").splitlines() == [
        "typedef float T;", "T t0 = in0 * in0;", "T t1 = t0 + in1;", "T t2 = sqrt(t1);", "T t3 = in0 + in2;",
        "T t4 = t2 / t3;", "T t5 = t4 * in3;", "out = t5;"]
    where = _groups(ArrayEngine(_chain_model(), fuse=True))[1]
    assert where.body("double").splitlines()[-2:] == ["T t1 = in1 ? in0 : t0;", "out = t1;"]


def test_graph_outputs_and_shared_values_are_not_absorbed():
    nodes = [n("Add", ["x", "x"], ["a"]), n("Mul", ["a", "x"], ["m"]), n("Sub", ["m", "a"], ["s"])]
    model = make_model(nodes, [inp("x", [4])], [inp("s", None)])
    # a is read by Mul and Sub: Mul stays alone with its own tree, Sub takes Mul's
    groups = _groups(ArrayEngine(model, fuse=True))
    assert [[o.op for o in g.ops] for g in groups] == [["Mul", "Sub"]]
    model = make_model(nodes, [inp("x", [4])], [inp("s", None), inp("m", None)])
    assert _groups(ArrayEngine(model, fuse=True)) == []


def test_fusion_is_off_on_numpy_by_default():
    assert _groups(ArrayEngine(_chain_model())) == []


@pytest.mark.parametrize("name", ["gpt-tiny", "unet-tiny"])
def test_training_step_fused_equals_unfused(name, tmp_path):
    model, feeds = tiny_training_step(name, tmp_path)
    fused, plain = ArrayEngine(model, fuse=True), ArrayEngine(model, fuse=False)
    assert len(fused._steps) < 0.7 * len(plain._steps)
    got, want = fused.run(feeds), plain.run(feeds)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def _softmax_grad_model(axis: int):
    """dx = y * (dy - ReduceSum(dy * y, [axis], keepdims=1)), as autodiff writes a softmax's gradient."""
    nodes = [n("Softmax", ["x"], ["y"], axis=axis), n("Mul", ["dy", "y"], ["p"]),
             n("ReduceSum", ["p", "axes"], ["s"], keepdims=1), n("Sub", ["dy", "s"], ["d"]),
             n("Mul", ["y", "d"], ["dx"]), n("Mul", ["dx", "two"], ["out"])]
    return make_model(nodes, [inp("x", [2, 3, 5]), inp("dy", [2, 3, 5])], [inp("out", None)],
                      [tensor("axes", np.array([axis], np.int64)), tensor("two", np.float32(2))])


@pytest.mark.parametrize("axis", [-1, 2, 1])
def test_softmax_gradient_is_one_step(axis):
    """The four nodes of a softmax's gradient run as one step (on a GPU one pass per row over the
    last axis); the Mul after it still fuses with what follows."""
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, 5)).astype(np.float32),
             "dy": rng.standard_normal((2, 3, 5)).astype(np.float32)}
    fused = ArrayEngine(_softmax_grad_model(axis), fuse=True)
    labels = [s[4] for s in fused._steps]
    assert len(fused._steps) == 3 and labels[1].endswith("and 3 more (SoftmaxGrad)"), labels
    got, want = fused.run(feeds)["out"], ArrayEngine(_softmax_grad_model(axis), fuse=False).run(feeds)["out"]
    np.testing.assert_array_equal(got, want)


def test_a_softmax_gradient_whose_parts_are_read_elsewhere_is_left_alone():
    model = _softmax_grad_model(-1)
    model.graph.output.append(helper.make_empty_tensor_value_info("s"))  # the row sums are an output too
    assert not any("SoftmaxGrad" in s[4] for s in ArrayEngine(model, fuse=True)._steps)
