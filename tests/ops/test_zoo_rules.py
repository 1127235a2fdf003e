"""Every node of the tiny zoo models: its rule holds on the values the model computes."""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest

from parc.ir.exporter import to_onnx, value_info
from parc.ir.importer import load
from parc.models import build_model
from parc.ops import get_rule, sharding_rule
from parc.ops.check import check_rule

MODELS = ["gpt-tiny", "moe-tiny", "bert-tiny", "t5-tiny", "vgg-tiny", "resnet-tiny", "unet-tiny"]


def _all_values(graph) -> dict[str, np.ndarray]:
    """Run the model once with every node output as a graph output."""
    model = to_onnx(graph)
    names = {o.name for o in model.graph.output}
    for node in graph.nodes:
        for v in node.outputs:
            if v.name and v.name not in names:
                model.graph.output.append(value_info(v))
                names.add(v.name)
    rng = np.random.default_rng(0)
    feeds = {}
    for v in graph.inputs:
        dtype = v.dtype.numpy
        feeds[v.name] = (rng.integers(0, 2, v.shape) if np.issubdtype(dtype, np.integer)
                         else rng.standard_normal(v.shape)).astype(dtype)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    values = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    return {**values, **feeds}


@pytest.mark.parametrize("name", MODELS)
def test_zoo_node_rules_hold(name: str, tmp_path) -> None:
    path = tmp_path / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_model(name, path, [])
        graph = load(path)
    values = _all_values(graph)
    failures = []
    for node in graph.nodes:
        assert get_rule(node) is not None, f"{name}: {node.op_type} has no rule"
        assert sharding_rule(node, graph.opset.get("")) is not None, f"{name}: {node.label} declined"
        arrays = [None if v is None or v.const is not None else values[v.name] for v in node.inputs]
        failures += check_rule(node, arrays, graph.opset, ns=(2,))
    assert not failures, "\n".join(failures[:5])
