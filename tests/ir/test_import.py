"""Import: shape folding, dim binding, opset upgrade, function inlining, lazy weights."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import inp, legacy_gpt_block_model, make_model, tensor
from onnx import TensorProto, helper

from parc.errors import OnnxImportError, UnboundDimError, UsageError
from parc.ir import from_model, load, to_onnx
from parc.ir.shapes import shape_dependent_values
from parc.ops import verify

SHAPE_ARGS = {"Reshape": 1, "Expand": 1, "Tile": 1, "ConstantOfShape": 0, "Pad": 1}


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString()).run(None, feeds)


def test_legacy_shape_chains_fold_to_constants():
    model = legacy_gpt_block_model()
    graph = from_model(model, {"batch": 3, "seq": 5})
    verify(graph)
    ops = [n.op_type for n in graph.nodes]
    assert "Shape" not in ops and "Gather" not in ops and "Concat" not in ops
    assert "Range" not in ops and "ConstantOfShape" not in ops  # fully constant: folded
    assert shape_dependent_values(graph) == 0
    for n in graph.nodes:
        if n.op_type in SHAPE_ARGS:
            assert n.inputs[SHAPE_ARGS[n.op_type]].is_const
    reshape = next(n for n in graph.nodes if n.op_type == "Reshape")
    assert reshape.inputs[1].const.numpy().tolist() == [3, 5, 2, 4]
    assert graph.outputs[0].shape == (3, 2, 5, 5)
    x = np.random.default_rng(1).standard_normal((3, 5, 8)).astype(np.float32)
    want = run(model, {"x": x})
    got = run(to_onnx(graph), {"x": x})
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_parameters_are_never_folded():
    # Transpose of a weight: constant-only, but the weight must stay a parameter.
    model = make_model([helper.make_node("Transpose", ["w"], ["wt"]),
                        helper.make_node("MatMul", ["x", "wt"], ["y"])],
                       [inp("x", [2, 3])], [inp("y", None)],
                       [tensor("w", np.ones((4, 3), np.float32))])
    graph = from_model(model)
    assert [n.op_type for n in graph.nodes] == ["Transpose", "MatMul"]
    assert [v.name for v in graph.params()] == ["w"]


def test_unbound_dims_are_named():
    with pytest.raises(UnboundDimError) as e:
        from_model(legacy_gpt_block_model(), {"batch": 2})
    assert e.value.dims == ["seq"] and "seq" in str(e.value)


def test_unknown_dim_name_is_a_usage_error():
    with pytest.raises(UsageError, match="no symbolic dim of that name.*batch, seq"):
        from_model(legacy_gpt_block_model(), {"batch": 2, "seq": 3, "sequence": 4})


def test_inconsistent_binding_is_a_clear_error():
    # seq is the reshape target's second dim only when 8 divides: bind x with a bad feature dim
    model = make_model([helper.make_node("Reshape", ["x", "shape"], ["y"])],
                       [inp("x", ["n", 6])], [inp("y", None)], [tensor("shape", np.array([-1, 4]))])
    from parc.errors import ShapeError
    with pytest.raises(ShapeError, match="Reshape"):
        from_model(model, {"n": 1})


def test_old_opset_is_upgraded():
    model = make_model([helper.make_node("Unsqueeze", ["x"], ["y"], axes=[0]),
                        helper.make_node("ReduceSum", ["y"], ["z"], axes=[2], keepdims=0)],
                       [inp("x", [2, 3])], [inp("z", None)], opset=11)
    graph = from_model(model)
    assert graph.opset[""] == 13
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(run(to_onnx(graph), {"x": x})[0], x.sum(1, keepdims=False)[None])


def test_local_functions_are_inlined():
    fn = helper.make_function("custom", "Gelu2", ["a"], ["b"],
                              [helper.make_node("Mul", ["a", "a"], ["b"])],
                              [helper.make_opsetid("", 18)])
    model = make_model([helper.make_node("Gelu2", ["x"], ["y"], domain="custom")],
                       [inp("x", [2])], [inp("y", None)], functions=[fn])
    model.opset_import.append(helper.make_opsetid("custom", 1))
    graph = from_model(model)
    assert [n.op_type for n in graph.nodes] == ["Mul"]


def test_external_weights_are_read_lazily(tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [inp("x", [2, 3])],
                       [inp("y", None)], [tensor("w", w)])
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.onnx.data", size_threshold=0)
    graph = load(tmp_path / "m.onnx")
    data = graph.constants["w"].const
    assert data.is_external and data._cache is None
    assert graph.params()[0].nbytes == 48  # shapes known without reading
    assert data._cache is None
    np.testing.assert_array_equal(data.numpy(), w)
    assert isinstance(data.numpy(), np.memmap)


def test_external_data_outside_model_dir_is_refused(tmp_path):
    model = make_model([helper.make_node("Relu", ["w"], ["y"])], [], [inp("y", None)],
                       [tensor("w", np.ones(4, np.float32))])
    t = model.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    t.external_data.add(key="location", value="../../etc/passwd")
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(OnnxImportError, match="leaves the model's directory"):
        load(tmp_path / "m.onnx")


def test_missing_input_and_cycle_are_reported():
    missing = make_model([helper.make_node("Relu", ["nope"], ["y"])], [inp("x", [2])], [inp("y", None)])
    with pytest.raises(OnnxImportError, match="reads 'nope'"):
        from_model(missing)
    cycle = make_model([helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Relu", ["a"], ["b"])],
                       [inp("x", [2])], [inp("b", None)])
    with pytest.raises(Exception, match="cycle"):
        from_model(cycle)


def test_round_trip_preserves_names_and_metadata():
    model = legacy_gpt_block_model()
    model.metadata_props.add(key="k", value="v")
    graph = from_model(model, {"batch": 1, "seq": 2})
    out = to_onnx(graph)
    onnx.checker.check_model(out, full_check=True)
    assert {p.key: p.value for p in out.metadata_props} == {"k": "v"}
    assert [o.name for o in out.graph.output] == ["probs", "pos_sum"]


def test_resize_scales_are_constants_not_parameters():
    model = make_model([helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest"),
                        helper.make_node("Mul", ["y", "gain"], ["z"])],
                       [inp("x", [1, 1, 2, 2])], [inp("z", None)],
                       [tensor("scales", np.array([1, 1, 2, 2], np.float32)),
                        tensor("gain", np.ones((1, 1, 4, 4), np.float32))])
    graph = from_model(model)
    assert [v.name for v in graph.params()] == ["gain"]
    assert graph.outputs[0].shape == (1, 1, 4, 4)


def test_save_with_external_data_round_trips(tmp_path):
    from parc.ir import save
    from parc.models import build_model

    src = build_model("gpt-tiny", tmp_path / "src.onnx")
    graph = load(src)
    out = save(graph, tmp_path / "out.onnx", external_min_bytes=1024, external_total_bytes=0)
    assert (tmp_path / "out.onnx.data").stat().st_size > 0
    reloaded = load(out)
    assert any(v.const.is_external for v in reloaded.params())
    feeds = {"input_ids": np.zeros((2, 16), np.int64), "labels": np.ones((2, 16), np.int64)}
    want = ort.InferenceSession(str(src)).run(None, feeds)
    got = ort.InferenceSession(str(out)).run(None, feeds)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert not list(tmp_path.glob("*.tmp"))


def test_gathernd_with_scalar_result_gets_its_shape():
    # ONNX's own inference leaves a rank-0 GatherND result unshaped.
    model = make_model([helper.make_node("GatherND", ["x", "idx"], ["y"])],
                       [inp("x", [2, 3]), inp("idx", [2], TensorProto.INT64)], [inp("y", None)])
    graph = from_model(model)
    assert graph.outputs[0].shape == () and str(graph.outputs[0].dtype) == "float"
    verify(graph)


def test_output_types_are_kept_by_signature_not_confused():
    """Typing is remembered by signature (op, attributes, input types and fed values): nodes
    alike but for a shape argument's value, an attribute or an input's shape get their own
    types; a repeated one reuses the answer."""
    from parc.ir import shapes as fold_shapes

    nodes = [helper.make_node("Reshape", ["x", "s1"], ["a"]), helper.make_node("Reshape", ["x", "s2"], ["b"]),
             helper.make_node("Reshape", ["x", "s1"], ["c"]),
             helper.make_node("Transpose", ["a"], ["ta"], perm=[1, 0]),
             helper.make_node("Transpose", ["b"], ["tb"], perm=[1, 0]),
             helper.make_node("Softmax", ["x"], ["s0"], axis=0), helper.make_node("Softmax", ["x"], ["s_1"], axis=1),
             helper.make_node("Concat", ["a", "c"], ["cat0"], axis=0),
             helper.make_node("Concat", ["a", "c"], ["cat1"], axis=1)]
    outs = ["ta", "tb", "s0", "s_1", "cat0", "cat1"]
    model = make_model(nodes, [inp("x", [4, 6])], [inp(o, None) for o in outs],
                       [tensor("s1", np.array([2, 12], np.int64)), tensor("s2", np.array([8, 3], np.int64))])
    fold_shapes._TYPES.clear()
    graph = from_model(model)
    shapes = {v.name: v.shape for v in graph.values()}
    assert (shapes["a"], shapes["b"], shapes["c"]) == ((2, 12), (8, 3), (2, 12))
    assert (shapes["ta"], shapes["tb"]) == ((12, 2), (3, 8))
    assert (shapes["cat0"], shapes["cat1"]) == ((4, 12), (2, 24))
    assert len(fold_shapes._TYPES) == 8  # the two alike Reshapes share one entry
