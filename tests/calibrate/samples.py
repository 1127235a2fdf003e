"""Made-up measurements and models the calibration tests share."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from parc.calibrate.catalogue import ALL_REDUCE_BYTES


def machine_rows(alpha: float, beta: float, handoff: float, k: int, call: float = 0.0) -> dict:
    """Rows a machine with these figures would measure (the ring formula exactly)."""
    reduces = []
    for n in sorted({k, 2}):
        for b in ALL_REDUCE_BYTES:
            t = call + 2 * (n - 1) * alpha + 2 * (n - 1) / n * b / beta
            reduces.append({"n": n, "bytes": b, "s": t, "first_s": t + handoff})
    return {"launch_floor_s": 1e-6, "task_overhead_s": 4e-6,
            "memory": [{"op": "Add", "bytes": 1 << 20, "s": 1e-4, "bytes_per_s": 10e9},
                       {"op": "Softmax", "bytes": 1 << 20, "s": 1e-4, "bytes_per_s": 40e9}],
            "matmul": [{"shape": [8, 8, 8], "s": 1e-3, "flops_per_s": 1e11}],
            "all_reduce": reduces}


def conv_model(path):
    """A one-Conv model whose batch is symbolic (N): input [N, 3, 8, 8], weight [4, 3, 3, 3]."""
    conv = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    graph = helper.make_graph([conv], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path
