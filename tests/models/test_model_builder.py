"""The graph builder and the small pieces the model families rely on."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from parc.models import count_params
from parc.models.layers import ModelBuilder
from parc.models.t5 import relative_buckets


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_constants_are_deduplicated_and_names_unique():
    b = ModelBuilder("g")
    assert b.ints([2, 3]) == b.ints([2, 3]) != b.ints([3, 2])
    assert b.scalar(0.5) == b.scalar(0.5)
    b.param("w", [2])
    with pytest.raises(ValueError):
        b.param("w", [3])
    b.op("Relu", ["w"], "r")
    with pytest.raises(ValueError):
        b.op("Relu", ["w"], "r")


def test_count_params_skips_constants_scalars_and_bn_statistics():
    b = ModelBuilder("g")
    x = b.input("x", TensorProto.FLOAT, [2, 3, 4, 4])
    y = b.conv_bn(x, 3, 5, 3, "c")  # conv 5*3*3*3 + bn scale/bias 2*5; running stats not counted
    b.op("Reshape", [y, b.ints([2, 80])], "flat", outputs=["logits"])
    b.const(np.ones((4, 4), dtype=bool))
    b.scalar(1.0)
    b.output("logits", TensorProto.FLOAT, [2, 80])
    model = b.model()
    assert count_params(model) == 5 * 27 + 10 == b.num_params
    onnx.checker.check_model(model, full_check=True)


def test_sparse_parameters_carry_no_bytes():
    b = ModelBuilder("g", weights="sparse", data_location="m.onnx.data")
    b.param("a", [3])
    b.param("big", [1 << 20, 1 << 10])  # 4 GiB: never allocated
    a, big = b.initializers
    assert a.data_location == big.data_location == TensorProto.EXTERNAL
    assert not a.raw_data and not big.raw_data
    ext = {e.key: e.value for e in big.external_data}
    assert ext == {"location": "m.onnx.data", "offset": "4096", "length": str(4 << 30)}
    assert b.external_bytes == 4096 + (4 << 30)


def test_gelu_layer_norm_and_rms_norm_match_numpy():
    b = ModelBuilder("g")
    x = b.input("x", TensorProto.FLOAT, [2, 8])
    b.op("Identity", [b.gelu(x, "gelu")], "o1", outputs=["gelu_out"])
    b.op("Identity", [b.layer_norm(x, 8, "ln")], "o2", outputs=["ln_out"])
    b.op("Identity", [b.rms_norm(x, 8, "rms")], "o3", outputs=["rms_out"])
    for name in ("gelu_out", "ln_out", "rms_out"):
        b.output(name, TensorProto.FLOAT, [2, 8])
    xv = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    gelu, ln, rms = _run(b.model(), {"x": xv})
    from math import erf

    ref_gelu = np.vectorize(lambda v: 0.5 * v * (1 + erf(v / np.sqrt(2))))(xv)
    np.testing.assert_allclose(gelu, ref_gelu, rtol=1e-5, atol=1e-6)
    ref_ln = (xv - xv.mean(-1, keepdims=True)) / np.sqrt(xv.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(ln, ref_ln, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rms, xv / np.sqrt((xv**2).mean(-1, keepdims=True) + 1e-6), rtol=1e-5)


def test_causal_attention_ignores_the_future():
    b = ModelBuilder("g")
    x = b.input("x", TensorProto.FLOAT, [1, 4, 8])
    y = b.attention(x, "attn", hidden=8, heads=2, batch=1, seq=4, mask=b.causal_mask(4))
    b.op("Identity", [y], "out", outputs=["y"])
    b.output("y", TensorProto.FLOAT, [1, 4, 8])
    model = b.model()
    xv = np.random.default_rng(1).standard_normal((1, 4, 8)).astype(np.float32)
    changed = xv.copy()
    changed[0, 3] += 1.0
    (y1,), (y2,) = _run(model, {"x": xv}), _run(model, {"x": changed})
    np.testing.assert_allclose(y1[0, :3], y2[0, :3], rtol=1e-6)
    assert not np.allclose(y1[0, 3], y2[0, 3])


def test_t5_relative_buckets():
    ids = relative_buckets(1, 300, True, 32, 128)[0]  # key position - query position = 0..299
    assert ids[0] == 0 and ids[1] == 17 and ids[7] == 23 and ids[8] == 24
    assert ids[128] == ids[299] == 31 and np.all(np.diff(ids[1:]) >= 0)
    back = relative_buckets(300, 1, True, 32, 128)[:, 0]  # negative distances use buckets 0..15
    assert back[1] == 1 and back[8] == 8 and back[299] == 15
    causal = relative_buckets(300, 1, False, 32, 128)[:, 0]  # decoder: only the past, 32 buckets
    assert causal[0] == 0 and causal[15] == 15 and causal[16] == 16 and causal[299] == 31
    assert np.all(relative_buckets(1, 5, False, 32, 128) == 0)  # future keys: bucket 0 (masked)
