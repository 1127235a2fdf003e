"""`parc plan` writes every rank's modules with their reducing ScatterNDs (gpt-tiny's embedding
gradients) as ScatterElements (`parc.ir.scatter`), so a plan directory's modules are exact on
plain onnxruntime at any thread count, in a plan of one stage and in a pipeline."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import helper

from parc.ir.scatter import racy_scatter
from tests.helpers import parc


@pytest.fixture(scope="module")
def step(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("emit_scatter")
    assert parc("models", "build", "gpt-tiny", "--set", "batch=4", "-o", str(d / "m.onnx")).returncode == 0
    res = parc("grad", str(d / "m.onnx"), "--optimizer", "sgd", "--lr", "0.05", "-o", str(d / "t.onnx"))
    assert res.returncode == 0, res.stderr
    (d / "dp.yaml").write_text("default: replicate\n")
    return d


@pytest.mark.parametrize("name, args", [("one-stage", ("--hints", "dp.yaml")),
                                        ("pipeline", ("--pipeline", "2", "--micro-batches", "2"))])
def test_no_rank_module_holds_a_reducing_scatter_nd(step, name, args):
    """The source step holds one (its ScatterND adds into the token embedding); the plan's
    modules hold it as a ScatterElements that adds."""
    assert racy_scatter(onnx.load(str(step / "t.onnx"), load_external_data=False).graph)
    args = tuple(str(step / a) if a.endswith(".yaml") else a for a in args)
    res = parc("plan", str(step / "t.onnx"), "--devices", "2xa100-80g", "--jobs", "1", "-o", str(step / name),
               *args)
    assert res.returncode == 0, res.stderr
    modules = sorted((step / name).glob("rank_*/m*.onnx"))
    assert modules
    adds = 0
    for path in modules:
        model = onnx.load(str(path))
        assert not racy_scatter(model.graph), path
        adds += sum(n.op_type == "ScatterElements" and helper.get_node_attr_value(n, "reduction") == b"add"
                    for n in model.graph.node)
    assert adds
