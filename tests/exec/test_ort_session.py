"""The executor's onnxruntime sessions: a reducing ScatterND (an embedding's gradient) gives the
same sum of its duplicate indices whatever thread count is asked for; a rank keeps the memory it
frees (`keep_freed_memory`)."""

from __future__ import annotations

import platform
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper

from parc.exec.runner import ort_session
from parc.ir.scatter import racy_scatter

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


def test_scatter_as_elements_keeps_the_threads_and_the_sum():
    """An embedding's gradient as parc grad writes it (indices unsqueezed inside the module, no
    shape listed for them) becomes a ScatterElements, equal to the ScatterND on any data."""
    import onnx
    import onnxruntime as ort

    from parc.ir.scatter import scatter_as_elements

    nodes = [helper.make_node("Unsqueeze", ["ids", "axes"], ["idx"]),
             helper.make_node("ScatterND", ["data", "idx", "upd"], ["out"], reduction="add", name="grad")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [30, 4, 3]),
                                       helper.make_tensor_value_info("ids", TensorProto.INT64, [5, 7]),
                                       helper.make_tensor_value_info("upd", TensorProto.FLOAT, [5, 7, 4, 3])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [30, 4, 3])],
                          initializer=[helper.make_tensor("axes", TensorProto.INT64, [1], [2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    rewritten = scatter_as_elements(model)
    assert not racy_scatter(rewritten.graph) and "ScatterElements" in {n.op_type for n in rewritten.graph.node}
    onnx.checker.check_model(rewritten, full_check=True)
    rng = np.random.default_rng(1)
    feeds = {"data": rng.standard_normal((30, 4, 3)).astype(np.float32),
             "ids": rng.integers(-30, 30, (5, 7)).astype(np.int64),
             "upd": rng.standard_normal((5, 7, 4, 3)).astype(np.float32)}
    one = ort.SessionOptions()
    one.intra_op_num_threads = 1
    want = ort.InferenceSession(model.SerializeToString(), one, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    session = ort_session(model.SerializeToString(), 2)  # rewritten inside: it keeps its two threads
    assert session.get_session_options().intra_op_num_threads == 2
    got = session.run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_constant_indices_are_rewritten_too():
    """A folded index tensor (GPT-2's position ids: an initializer [1, seq, 1], no value_info) is
    rewritten like one computed in the module; before, it was left as a ScatterND and the whole
    module ran on one thread (a one-rank GPT-2 export step took twice its two-thread time)."""

    from parc.ir.scatter import scatter_as_elements

    node = helper.make_node("ScatterND", ["data", "pos", "upd"], ["out"], reduction="add", name="grad")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [16, 3]),
                                        helper.make_tensor_value_info("upd", TensorProto.FLOAT, [1, 6, 3])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [16, 3])],
                          initializer=[helper.make_tensor("pos", TensorProto.INT64, [1, 6, 1], [0, 1, 2, 2, 5, 1])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    rewritten = scatter_as_elements(model)
    assert not racy_scatter(rewritten.graph)
    rng = np.random.default_rng(2)
    feeds = {"data": rng.standard_normal((16, 3)).astype(np.float32),
             "upd": rng.standard_normal((1, 6, 3)).astype(np.float32)}
    want = feeds["data"].astype(np.float64)
    np.add.at(want, np.array([0, 1, 2, 2, 5, 1]), feeds["upd"][0].astype(np.float64))
    got = ort_session(model, 2).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_microbatch_slice_of_the_indices_is_rewritten_by_the_ranks():
    """A pipeline stage slices the indices per microbatch with starts and ends fed at run time:
    shape inference then knows their rank, not their dims. updates = indices[:-1] + data[k:]
    gives k = 1 from the ranks, so the node is still rewritten (BERT's token-type embedding)."""

    from parc.ir.scatter import scatter_as_elements

    nodes = [helper.make_node("Slice", ["ids", "start", "end", "axes"], ["idx"]),
             helper.make_node("ScatterND", ["data", "idx", "upd"], ["out"], reduction="add", name="grad")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("data", TensorProto.FLOAT, [2, 5]),
                                       helper.make_tensor_value_info("ids", TensorProto.INT64, [8, 3, 1]),
                                       helper.make_tensor_value_info("start", TensorProto.INT64, [1]),
                                       helper.make_tensor_value_info("end", TensorProto.INT64, [1]),
                                       helper.make_tensor_value_info("upd", TensorProto.FLOAT, [4, 3, 5])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 5])],
                          initializer=[helper.make_tensor("axes", TensorProto.INT64, [1], [0])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    rewritten = scatter_as_elements(model)
    assert not racy_scatter(rewritten.graph)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 2, (8, 3, 1)).astype(np.int64)
    feeds = {"data": np.zeros((2, 5), np.float32), "ids": ids, "start": np.array([4], np.int64),
             "end": np.array([8], np.int64), "upd": rng.standard_normal((4, 3, 5)).astype(np.float32)}
    want = np.zeros((2, 5))
    np.add.at(want, ids[4:, :, 0].ravel(), feeds["upd"].reshape(12, 5).astype(np.float64))
    got = ort_session(model, 2).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


_FAULTS = """
import resource, sys
import numpy as np
from parc.exec.engine_choice import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
np.ones(1 << 24, np.float32)  # 64 MiB (over glibc's largest mmap threshold), faulted in once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    np.ones(1 << 24, np.float32)  # allocated, written, freed, as a step's arrays are
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="the allocator's options are glibc's")
def test_a_rank_reuses_the_pages_it_frees():
    """`keep_freed_memory`: a 64 MiB array allocated and freed 20 times faults its pages in each
    time by default (16,384 pages, or 32 huge ones), and only once with the memory kept."""
    runs = {how: subprocess.run([sys.executable, "-c", _FAULTS, how], capture_output=True, text=True, check=True)
            .stdout.split() for how in ("keep", "default")}
    assert runs["keep"][0] == "True"
    assert int(runs["default"][1]) >= 20 * 16, runs
    assert int(runs["keep"][1]) < 16, runs
