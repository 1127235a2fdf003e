"""`parc.ir.simplify`: repeated nodes and no-op Casts removed from hand-built modules by
onnxruntime's rules; each rewritten module is valid ONNX and computes what the original does on
onnxruntime, and the original is left as it was."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from parc.ir.simplify import Removed, eliminate_common_subexpressions, eliminate_noop_casts, simplify

ort = pytest.importorskip("onnxruntime")

F, D = TensorProto.FLOAT, TensorProto.DOUBLE
SHAPE = [4, 8]


def _model(nodes, outputs, inits=(), inputs=("x",), domains=()) -> onnx.ModelProto:
    io = [helper.make_tensor_value_info(n, F, [8, 8] if n == "w" else SHAPE) for n in inputs]
    outs = [helper.make_tensor_value_info(n, t, SHAPE) for n, t in
            ((o, F) if isinstance(o, str) else o for o in outputs)]
    opsets = [helper.make_opsetid("", 17), *(helper.make_opsetid(d, 1) for d in domains)]
    return helper.make_model(helper.make_graph(nodes, "m", io, outs, list(inits)), opset_imports=opsets, ir_version=8)


def _same_results(model: onnx.ModelProto, rewritten: onnx.ModelProto) -> None:
    """The rewrite is valid ONNX and gives the original's outputs on random inputs."""
    onnx.checker.check_model(rewritten, full_check=True)
    rng = np.random.default_rng(0)
    feeds = {v.name: rng.standard_normal([d.dim_value for d in v.type.tensor_type.shape.dim]).astype(np.float32)
             for v in model.graph.input}

    def run(m):
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # our rewrite, not onnxruntime's
        return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)

    for want, got in zip(run(model), run(rewritten), strict=True):
        np.testing.assert_array_equal(got, want)


def _unchanged(fn, model: onnx.ModelProto, *args):
    """fn(model, *args), checking that it left `model` as it was."""
    before = model.SerializeToString(deterministic=True)
    out = fn(model, *args)
    assert model.SerializeToString(deterministic=True) == before
    return out


def test_a_repeated_matmul_is_merged_and_its_reader_rewired():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="first"),
             helper.make_node("MatMul", ["x", "w"], ["b"], name="again"),
             helper.make_node("Sub", ["a", "b"], ["y"], name="sub")]
    model = _model(nodes, ["y"], inputs=("x", "w"))
    out, removed = _unchanged(eliminate_common_subexpressions, model)
    assert removed == 1
    assert [n.name for n in out.graph.node] == ["first", "sub"]
    assert list(out.graph.node[1].input) == ["a", "a"]
    _same_results(model, out)


def test_a_chain_of_repeats_merges_whole():
    """A repeat's reader repeats too once it reads the kept value (recomputation repeats cones)."""
    nodes = [helper.make_node("Mul", ["x", "x"], ["a"]), helper.make_node("Tanh", ["a"], ["t"]),
             helper.make_node("Mul", ["x", "x"], ["b"]), helper.make_node("Tanh", ["b"], ["u"]),
             helper.make_node("Add", ["t", "u"], ["y"])]
    model = _model(nodes, ["y"])
    out, removed = eliminate_common_subexpressions(model)
    assert removed == 2 and [n.op_type for n in out.graph.node] == ["Mul", "Tanh", "Add"]
    assert list(out.graph.node[2].input) == ["t", "t"]
    _same_results(model, out)


def test_repeats_whose_results_are_module_outputs_stay():
    """A module output keeps its own node (it is handed on by name); so does a repeat of it."""
    nodes = [helper.make_node("Relu", ["x"], ["r1"]), helper.make_node("Relu", ["x"], ["r2"]),
             helper.make_node("Relu", ["x"], ["r3"]), helper.make_node("Relu", ["x"], ["r4"]),
             helper.make_node("Add", ["r3", "r4"], ["y"])]
    both = _model(nodes[:2], ["r1", "r2"])
    assert eliminate_common_subexpressions(both) == (both, 0)
    one = _model(nodes[2:], ["r4", "y"])  # r3 is an inner value, r4 an output
    assert eliminate_common_subexpressions(one) == (one, 0)


@pytest.mark.parametrize("op, attrs", [("Dropout", {}), ("RandomNormalLike", {"seed": 1.0}), ("Bernoulli", {})])
def test_random_ops_are_never_merged(op, attrs):
    """Each run of a random op draws anew: two draws are two values (the list is the IR's
    `NONDETERMINISTIC`, which shape folding also leaves alone)."""
    nodes = [helper.make_node(op, ["x"], ["d1"], **attrs), helper.make_node(op, ["x"], ["d2"], **attrs),
             helper.make_node("Add", ["d1", "d2"], ["y"])]
    model = _model(nodes, ["y"])
    assert eliminate_common_subexpressions(model) == (model, 0)


def test_equal_scalar_initializers_count_as_one_value_and_larger_ones_do_not():
    """As onnxruntime's ConstantSharing makes them one: Mul(x, two) and Mul(x, two_b) are one
    computation, and the initializer only the repeat read goes; equal two-element rows under
    two names and unequal scalars stay apart."""
    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
              (("two", 2.0), ("two_b", 2.0), ("three", 3.0), ("row", [2.0] * 8), ("row_b", [2.0] * 8))]
    nodes = [helper.make_node("Mul", ["x", "two"], ["a"], name="mul"),
             helper.make_node("Mul", ["x", "two_b"], ["b"], name="mul_again"),
             helper.make_node("Mul", ["x", "three"], ["c"], name="mul_by_three"),
             helper.make_node("Mul", ["x", "row"], ["d"], name="mul_by_row"),
             helper.make_node("Mul", ["x", "row_b"], ["e"], name="mul_by_row_b"),
             helper.make_node("Sum", ["a", "b", "c", "d", "e"], ["y"], name="sum")]
    model = _model(nodes, ["y"], consts)
    out, removed = _unchanged(eliminate_common_subexpressions, model)
    assert removed == 1
    assert [n.name for n in out.graph.node] == ["mul", "mul_by_three", "mul_by_row", "mul_by_row_b", "sum"]
    assert list(out.graph.node[-1].input) == ["a", "a", "c", "d", "e"]
    assert {t.name for t in out.graph.initializer} == {"two", "three", "row", "row_b"}
    _same_results(model, out)


def test_other_domains_and_nodes_with_subgraphs_are_left_alone():
    """Nodes of another domain and nodes holding a subgraph are never merged, and a value a
    subgraph reads keeps its node."""
    custom = [helper.make_node("Op", ["x"], ["a"], domain="test.custom"),
              helper.make_node("Op", ["x"], ["b"], domain="test.custom"),
              helper.make_node("Add", ["a", "b"], ["y"])]
    model = _model(custom, ["y"], domains=("test.custom",))
    assert eliminate_common_subexpressions(model) == (model, 0)

    def branch(name: str, value: str) -> onnx.GraphProto:
        return helper.make_graph([helper.make_node("Identity", [value], [f"{name}.out"])], name, [],
                                 [helper.make_tensor_value_info(f"{name}.out", F, SHAPE)])

    cond = numpy_helper.from_array(np.array(True), "cond")
    nodes = [helper.make_node("Relu", ["x"], ["r1"]), helper.make_node("Relu", ["x"], ["r2"]),
             helper.make_node("If", ["cond"], ["i1"], then_branch=branch("t1", "r2"), else_branch=branch("e1", "x")),
             helper.make_node("If", ["cond"], ["i2"], then_branch=branch("t1", "r2"), else_branch=branch("e1", "x")),
             helper.make_node("Add", ["i1", "i2"], ["y"])]
    model = _model(nodes, ["y"], [cond])
    out, removed = eliminate_common_subexpressions(model)
    assert removed == 0 and out is model  # r2 is read inside the Ifs; the Ifs hold subgraphs


def test_a_cast_to_its_inputs_type_goes_and_a_real_cast_or_an_outputs_stays():
    nodes = [helper.make_node("Cast", ["x"], ["same"], to=F, name="cast_same"),
             helper.make_node("Relu", ["same"], ["r"], name="relu"),
             helper.make_node("Cast", ["x"], ["wide"], to=D, name="cast_up"),
             helper.make_node("Cast", ["r"], ["out"], to=F, name="cast_as_output")]
    model = _model(nodes, ["r", ("wide", D), "out"])
    out, removed = _unchanged(eliminate_noop_casts, model, {"r": F})
    assert removed == 1
    assert [n.name for n in out.graph.node] == ["relu", "cast_up", "cast_as_output"]
    assert list(out.graph.node[0].input) == ["x"]
    _same_results(model, out)


def test_a_cast_is_kept_where_its_inputs_type_is_unknown():
    """A module declares only its inputs' and outputs' types: an inner value's comes in `dtypes`."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Cast", ["r"], ["c"], to=F),
             helper.make_node("Cast", ["c"], ["c2"], to=F), helper.make_node("Tanh", ["c2"], ["y"])]
    model = _model(nodes, ["y"])
    assert eliminate_noop_casts(model) == (model, 0)
    out, removed = eliminate_noop_casts(model, {"r": F})  # both: c is r's type too
    assert removed == 2 and list(out.graph.node[-1].input) == ["r"]
    _same_results(model, out)


def test_simplify_merges_the_repeats_a_removed_cast_uncovers():
    """Relu(Cast(x)) and Relu(x) are one computation once the no-op Cast goes."""
    nodes = [helper.make_node("Cast", ["x"], ["c"], to=F), helper.make_node("Relu", ["c"], ["a"]),
             helper.make_node("Relu", ["x"], ["b"]), helper.make_node("Sub", ["a", "b"], ["y"])]
    model = _model(nodes, ["y"])
    out, removed = _unchanged(simplify, model)
    assert removed == Removed(common=1, casts=1)
    assert [n.op_type for n in out.graph.node] == ["Relu", "Sub"]
    _same_results(model, out)
    plain = _model([helper.make_node("Relu", ["x"], ["y"])], ["y"])
    assert simplify(plain) == (plain, Removed(0, 0))


def test_onnxruntime_removes_every_node_simplify_removes(tmp_path):
    """What the passes remove is what onnxruntime's CPU optimizer removes by the same rules: no
    node they remove is in the graph onnxruntime writes, for a module of each case and for
    gpt-tiny's training step (its recomputation repeats forward nodes), and the near misses
    stay in both."""
    import subprocess
    import sys

    def optimized_names(model: onnx.ModelProto, name: str) -> set[str]:
        opts = ort.SessionOptions()
        opts.optimized_model_filepath = str(tmp_path / name)
        opts.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        return {n.name for n in onnx.load(str(tmp_path / name)).graph.node}

    def removed_names(model: onnx.ModelProto, dtypes=None) -> set[str]:
        out, _ = simplify(model, dtypes)
        return {n.name for n in model.graph.node} - {n.name for n in out.graph.node}

    consts = [helper.make_tensor(n, F, [], [v]) for n, v in (("two", 2.0), ("two_b", 2.0), ("three", 3.0))]
    nodes = [helper.make_node("Tanh", ["x"], ["t1"], name="tanh"),
             helper.make_node("Tanh", ["x"], ["t2"], name="tanh_again"),  # computes what tanh did
             helper.make_node("Mul", ["t1", "two"], ["m1"], name="mul"),
             helper.make_node("Mul", ["t2", "two_b"], ["m2"], name="mul_again"),  # t2 is t1, two_b equals two
             helper.make_node("Mul", ["t1", "three"], ["m3"], name="mul_by_three"),  # another constant
             helper.make_node("Cast", ["m1"], ["c1"], to=F, name="cast_same"),
             helper.make_node("Cast", ["m2"], ["c2"], to=D, name="cast_other"),
             helper.make_node("Add", ["c1", "m3"], ["a"], name="add"),
             helper.make_node("Tanh", ["x"], ["out_dup"], name="tanh_as_output"),  # a module output stays
             helper.make_node("RandomNormalLike", ["x"], ["d1"], name="draw"),
             helper.make_node("RandomNormalLike", ["x"], ["d2"], name="draw_again"),  # random: not merged
             helper.make_node("Sub", ["d1", "d2"], ["d"], name="sub")]
    model = _model(nodes, [("c2", D), "a", "out_dup", "d"], consts)
    removed = removed_names(model, {n: F for n in ("t1", "t2", "m1", "m2", "m3")})
    assert removed == {"tanh_again", "mul_again", "cast_same"}
    left = optimized_names(model, "module.onnx")
    assert not removed & left
    assert {"mul_by_three", "cast_other", "tanh_as_output", "draw", "draw_again"} <= left

    step = tmp_path / "g.train.onnx"
    subprocess.run([sys.executable, "-m", "parc.cli.main", "models", "build", "gpt-tiny", "--train", "momentum",
                    "-o", str(step)], check=True, capture_output=True)
    model = onnx.load(str(step))
    typed = onnx.shape_inference.infer_shapes(model).graph
    dtypes = {v.name: v.type.tensor_type.elem_type for v in (*typed.value_info, *typed.input, *typed.output)}
    removed = removed_names(model, dtypes)
    assert len(removed) > 10 and not removed & optimized_names(model, "step.onnx")
