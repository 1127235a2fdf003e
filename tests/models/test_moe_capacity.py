"""GShard capacity dispatch in the MoE family: equal to dense dispatch when nothing is dropped."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from parc.models import build_model


def _run(path):
    sess = ort.InferenceSession(str(path))
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.integers(0, 128, size=i.shape).astype(np.int64) for i in sess.get_inputs()}
    return sess.run(None, feeds)


def test_capacity_dispatch_without_drops_equals_dense(tmp_path):
    dense = _run(build_model("moe-tiny", tmp_path / "d.onnx", {}))
    roomy = _run(build_model("moe-tiny", tmp_path / "c.onnx", {"capacity_factor": "2"}))  # E/k: C = seq
    tight = _run(build_model("moe-tiny", tmp_path / "t.onnx", {"capacity_factor": "1"}))
    np.testing.assert_allclose(roomy[1], dense[1], atol=1e-5)
    assert np.abs(tight[1] - dense[1]).max() > 1e-3  # some second choices dropped
