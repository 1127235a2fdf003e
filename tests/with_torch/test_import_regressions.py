"""Import bugs found on PyTorch exports, each as a tiny hand-built graph (no torch needed)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
from helpers import inp, make_model, tensor
from onnx import TensorProto, helper

from parc.ir import from_model, to_onnx
from parc.ir.importer import TORCH_INPUT_KIND
from parc.ops import verify


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_gather_elements_folds_with_index_narrower_than_data():
    # BERT's embeddings gather token_type_ids [1, max_pos] with position ids [1, seq]: onnx's
    # reference GatherElements fails when the index is smaller than the data off the gather axis.
    data = np.arange(12, dtype=np.int64).reshape(2, 6) * 10
    index = np.array([[0, 5, -1]], dtype=np.int64)  # negative indices count from the end
    model = make_model([helper.make_node("GatherElements", ["data", "index"], ["g"], axis=1),
                        helper.make_node("Add", ["x", "g"], ["y"])],
                       [inp("x", [1, 3], TensorProto.INT64)], [inp("y", None, TensorProto.INT64)],
                       [tensor("data", data), tensor("index", index)], opset=17)
    graph = from_model(model)
    verify(graph)
    assert [n.op_type for n in graph.nodes] == ["Add"]
    assert graph.nodes[0].inputs[1].const.numpy().tolist() == [[0, 50, 50]]
    x = np.array([[1, 2, 3]], dtype=np.int64)
    np.testing.assert_array_equal(run(to_onnx(graph), {"x": x})[0], run(model, {"x": x})[0])


def _kind(name: str, kind: str) -> onnx.ValueInfoProto:
    vi = helper.make_tensor_value_info(name, TensorProto.FLOAT, [4])
    vi.metadata_props.add(key=TORCH_INPUT_KIND, value=kind)
    return vi


def test_torch_buffers_are_not_parameters():
    # The dynamo exporter records torch.export's kind of each initializer in value_info
    # metadata; a buffer (Llama's rotary inv_freq) is read like a weight but is not trained.
    n = helper.make_node
    model = make_model([n("Mul", ["x", "w"], ["a"]), n("Mul", ["inv_freq", "two"], ["f"]),
                        n("Mul", ["a", "f"], ["b"]), n("Add", ["b", "lifted"], ["c"]),
                        n("Add", ["c", "plain"], ["y"])],
                       [inp("x", [2, 4])], [inp("y", None)],
                       [tensor(name, np.arange(4, dtype=np.float32) + i)
                        for i, name in enumerate(["w", "inv_freq", "lifted", "plain"])]
                       + [tensor("two", np.float32(2))])
    model.graph.value_info.extend([_kind("w", "PARAMETER"), _kind("inv_freq", "BUFFER"),
                                   _kind("lifted", "CONSTANT_TENSOR")])
    graph = from_model(model)
    verify(graph)
    assert sorted(v.name for v in graph.params()) == ["plain", "w"]  # no metadata: a parameter
    assert [n.op_type for n in graph.nodes] == ["Mul", "Mul", "Add", "Add"]  # buffer * 2 folded
    x = np.ones((2, 4), np.float32)
    np.testing.assert_allclose(run(to_onnx(graph), {"x": x})[0], run(model, {"x": x})[0])


def test_folding_log_of_zero_is_silent():
    # T5's relative position buckets: Log(0) = -inf, Cast to int64, discarded by a Where.
    n = helper.make_node
    c = helper.make_tensor("c", TensorProto.FLOAT, [2], [0.0, 4.0])
    model = make_model([n("Constant", [], ["c"], value=c), n("Log", ["c"], ["l"]),
                        n("Cast", ["l"], ["i"], to=TensorProto.INT64),
                        n("Where", ["small", "pos", "i"], ["bucket"]),
                        n("Cast", ["bucket"], ["fb"], to=TensorProto.FLOAT), n("Add", ["x", "fb"], ["y"])],
                       [inp("x", [2])], [inp("y", None)],
                       [tensor("small", np.array([True, False])), tensor("pos", np.array([0, 7], np.int64))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph = from_model(model)
    assert [n.op_type for n in graph.nodes] == ["Add"]
    assert graph.nodes[0].inputs[1].const.numpy().tolist() == [0.0, 1.0]
