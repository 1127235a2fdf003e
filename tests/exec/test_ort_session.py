"""The executor's onnxruntime sessions: a reducing ScatterND (an embedding's gradient) gives the
same sum of its duplicate indices whatever thread count is asked for."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from parc.exec.runner import ort_session, racy_scatter

pytest.importorskip("onnxruntime")


def _scatter_add(rows: int, width: int, updates: int) -> bytes:
    node = helper.make_node("ScatterND", ["data", "idx", "upd"], ["out"], reduction="add")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [rows, width]),
                                        helper.make_tensor_value_info("idx", TensorProto.INT64, [updates, 1]),
                                        helper.make_tensor_value_info("upd", TensorProto.FLOAT, [updates, width])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [rows, width])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def test_scatter_add_with_duplicate_indices_is_the_exact_sum_on_several_threads():
    """onnxruntime 1.32's CPU ScatterND adds duplicates from several threads without atomics
    (off by about 4 on this case with 2 or 4 threads): the session runs it on one."""
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 50, (2048, 1)).astype(np.int64)
    upd = rng.standard_normal((2048, 256)).astype(np.float32)
    want = np.zeros((1000, 256))
    np.add.at(want, idx[:, 0], upd.astype(np.float64))
    for threads in (2, 4):
        sess = ort_session(_scatter_add(1000, 256, 2048), threads)
        for _ in range(3):
            got = sess.run(None, {"data": np.zeros((1000, 256), np.float32), "idx": idx, "upd": upd})[0]
            np.testing.assert_allclose(got, want, atol=1e-4)


def test_only_reducing_scatters_are_racy():
    import onnx

    assert racy_scatter(onnx.load_model_from_string(_scatter_add(4, 2, 3)).graph)
    plain = helper.make_node("ScatterND", ["data", "idx", "upd"], ["out"])
    g = helper.make_graph([plain], "g", [], [])
    assert not racy_scatter(g)
    loop = helper.make_node("If", ["c"], ["y"], then_branch=onnx.load_model_from_string(_scatter_add(4, 2, 3)).graph,
                            else_branch=g)
    assert racy_scatter(helper.make_graph([loop], "outer", [], []))
