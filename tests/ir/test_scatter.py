"""`parc.ir.scatter`: a reducing ScatterND rewritten as ScatterElements is the same scatter-add,
duplicate indices included, on plain onnxruntime at any thread count."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from parc.ir.scatter import racy_scatter, scatter_as_elements

ort = pytest.importorskip("onnxruntime")


def _embedding_grad(rows: int, width: int, ids: tuple[int, ...]) -> onnx.ModelProto:
    """out = data with upd's rows added at idx (an embedding's gradient), idx [B, S, 1]."""
    node = helper.make_node("ScatterND", ["data", "idx", "upd"], ["out"], reduction="add", name="grad")
    inputs = [helper.make_tensor_value_info("data", TensorProto.FLOAT, [rows, width]),
              helper.make_tensor_value_info("idx", TensorProto.INT64, [*ids, 1]),
              helper.make_tensor_value_info("upd", TensorProto.FLOAT, [*ids, width])]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [rows, width])
    g = helper.make_graph([node], "g", inputs, [out])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def test_the_rewrite_equals_numpys_scatter_add_with_duplicate_indices():
    model = _embedding_grad(1000, 256, (8, 256))
    rewritten = scatter_as_elements(model)
    onnx.checker.check_model(rewritten, full_check=True)
    assert not racy_scatter(rewritten.graph)
    assert "ScatterElements" in {n.op_type for n in rewritten.graph.node}
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 50, (8, 256, 1)).astype(np.int64)  # 2048 updates into 50 rows: many duplicates
    feeds = {"data": rng.standard_normal((1000, 256)).astype(np.float32), "idx": idx,
             "upd": rng.standard_normal((8, 256, 256)).astype(np.float32)}
    want = feeds["data"].astype(np.float64)
    np.add.at(want, idx.reshape(-1), feeds["upd"].reshape(-1, 256).astype(np.float64))
    for threads in (1, 2, 4):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        sess = ort.InferenceSession(rewritten.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        for _ in range(3):
            np.testing.assert_allclose(sess.run(None, feeds)[0], want, rtol=1e-5, atol=1e-4)


def test_the_model_given_is_left_as_it_was():
    model = _embedding_grad(6, 3, (4,))
    before = model.SerializeToString()
    rewritten = scatter_as_elements(model)
    assert rewritten is not model and model.SerializeToString() == before
    assert racy_scatter(model.graph)


def test_a_model_without_a_reducing_scatter_comes_back_as_it_is():
    plain = helper.make_node("ScatterND", ["data", "idx", "upd"], ["out"])
    g = helper.make_graph([plain], "g", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [6, 3]),
                                         helper.make_tensor_value_info("idx", TensorProto.INT64, [2, 1]),
                                         helper.make_tensor_value_info("upd", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [6, 3])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    assert scatter_as_elements(model) is model


def test_indices_of_two_dims_are_left_and_still_found():
    """indices [..., 2] index two leading dims: not an embedding's gradient, left as a ScatterND
    (the model then runs on one intra-op thread: `parc.exec.runner.ort_session`)."""
    node = helper.make_node("ScatterND", ["data", "idx", "upd"], ["out"], reduction="add")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [4, 5, 3]),
                                        helper.make_tensor_value_info("idx", TensorProto.INT64, [6, 2]),
                                        helper.make_tensor_value_info("upd", TensorProto.FLOAT, [6, 3])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4, 5, 3])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    rewritten = scatter_as_elements(model)
    assert [n.op_type for n in rewritten.graph.node] == ["ScatterND"]
    assert racy_scatter(rewritten.graph)
