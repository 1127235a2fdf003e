"""Every zoo model imports with static shapes; every tiny one round-trips through the IR."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from parc.analysis.inspect import inspect_graph
from parc.ir import load, to_onnx
from parc.models import build_model, count_params, list_models
from parc.ops import verify

INFOS = {i.name: i for i in list_models()}
TINY = sorted(n for n, i in INFOS.items() if i.params_paper is None)
NAMED = sorted(n for n, i in INFOS.items() if i.params_paper is not None)


def _feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
        else:
            feeds[i.name] = rng.integers(0, 2, size=shape).astype(np.int64)  # ids and labels valid in every model
    return feeds


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_round_trips(tmp_path, name):
    path = build_model(name, tmp_path / f"{name}.onnx")
    original = onnx.load(path)
    graph = load(path)
    verify(graph)
    exported = to_onnx(graph)
    onnx.checker.check_model(exported, full_check=True)
    feeds = _feeds(original)
    want = ort.InferenceSession(original.SerializeToString()).run(None, feeds)
    got = ort.InferenceSession(exported.SerializeToString()).run(None, feeds)
    assert [o.name for o in exported.graph.output] == [o.name for o in original.graph.output]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMED)
def test_named_config_imports_without_reading_weights(tmp_path, name):
    path = build_model(name, tmp_path / f"{name}.onnx")
    graph = load(path)
    report = inspect_graph(graph)
    assert report["unbound_dims"] == [] and report["shape_dependent_values"] == 0
    # count_params reads names; parc reads how each tensor is used: they agree up to
    # MoE's OneHot on/off values, which are constants, not parameters.
    onehot_values = 2 if INFOS[name].family == "moe" else 0
    assert report["parameters"] == count_params(path) - onehot_values
    assert report["flops_forward"] > 2 * report["parameters"]  # at least one token per weight
    assert all(v.const._cache is None for v in graph.params())  # nothing was read
