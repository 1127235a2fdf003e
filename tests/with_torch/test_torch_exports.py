"""PyTorch's ONNX exporters (legacy TorchScript and dynamo) on tiny `transformers` models: import,
fold, verify, inspect, export back and run, against onnxruntime on the original and torch.

The models are built from configs with random weights by `scripts/export_torch_models.py`, once
per session; the whole module runs in about a minute on two cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("transformers")

from parc.cli.main import cli  # noqa: E402
from parc.errors import UnboundDimError  # noqa: E402
from parc.ir import load, to_onnx  # noqa: E402
from parc.ir.shapes import shape_dependent_values  # noqa: E402
from parc.ops import verify  # noqa: E402

pytestmark = pytest.mark.torch

MODELS = ("gpt2", "bert", "t5", "llama", "vit", "resnet")
EXPORTERS = ("legacy", "dynamo")
CASES = [f"{m}-{e}" for m in MODELS for e in EXPORTERS]
# Inputs of these ops that are shapes, indices or sizes: constants after import.
SHAPE_ARGS = {"Reshape": (1,), "Expand": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2),
              "Slice": (1, 2, 3, 4), "Pad": (1, 3)}
RTOL, ATOL = 1e-4, 1e-5
OTHER_DIMS = {"batch": 3, "seq": 13, "tgt": 5}  # not the traced sizes: nothing may be baked in


def _path(case: dict) -> Path:
    return case["dir"] / case["onnx"]


def _feeds(case: dict, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    samples = np.load(case["dir"] / case["inputs"])
    return {i.name: samples[i.name] for i in model.graph.input}


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _inspect(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, ["inspect", *args])
    return res.exit_code, res.output


cases = pytest.mark.parametrize("case", CASES, indirect=True)


@cases
def test_import_folds_every_shape(case):
    graph = load(_path(case), case["dims"])
    verify(graph)
    assert shape_dependent_values(graph) == 0
    assert not any(n.op_type == "Shape" for n in graph.nodes)
    for n in graph.nodes:
        for i in SHAPE_ARGS.get(n.op_type, ()):
            v = n.input(i)
            assert v is None or v.const is not None, f"{n.label} ({n.op_type}) input {i} '{v.name}' is computed"
    assert [v.name for v in graph.outputs] == ["loss", "logits"]
    assert graph.outputs[0].shape == ()
    for v in graph.values():
        assert v.shape is not None and v.dtype is not None, v.name


@cases
def test_inspect_reports_torch_parameter_count(case):
    args = [str(_path(case)), "--json", *[f"--dim={k}={v}" for k, v in case["dims"].items()]]
    code, out = _inspect(*args)
    assert code == 0, out
    report = json.loads(out)
    assert report["unbound_dims"] == []
    assert report["shape_dependent_values"] == 0
    # The file's parameters are torch's plus what the exporters change, each difference
    # explained by the export script (tied embeddings copied, BatchNorm folded into Conv).
    expected = case["torch_parameters"] + sum(d["delta"] for d in case["parameter_differences"])
    assert report["parameters"] == expected, case["parameter_differences"]


@cases
def test_round_trip_matches_onnxruntime_and_torch(case):
    original = onnx.load(str(_path(case)))
    graph = load(_path(case), case["dims"])
    exported = to_onnx(graph)
    onnx.checker.check_model(exported)
    feeds = _feeds(case, original)
    want = _run(original, feeds)
    got = _run(exported, feeds)
    assert sorted(got) == ["logits", "loss"]
    for name in ("loss", "logits"):
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
    torch_out = np.load(case["dir"] / case["torch_outputs"])
    np.testing.assert_allclose(got["loss"], torch_out["loss"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["logits"], torch_out["logits"], rtol=RTOL, atol=ATOL * 10)


@cases
def test_other_dims_match_onnxruntime_and_torch(case, script):
    if not case["dims"]:
        pytest.skip("exported with static shapes")
    dims = {k: OTHER_DIMS[k] for k in case["dims"]}
    spec = script.build(case["model"])
    inputs = script.sample_inputs(spec, dims)
    feeds = {k: v.numpy() for k, v in inputs.items()}
    graph = load(_path(case), dims)
    verify(graph)
    got = _run(to_onnx(graph), feeds)
    want = _run(onnx.load(str(_path(case))), feeds)
    loss, logits = script.run_torch(spec, inputs)
    assert got["logits"].shape == logits.shape
    for name in ("loss", "logits"):
        np.testing.assert_allclose(got[name], want[name], rtol=RTOL, atol=ATOL, err_msg=name)
    np.testing.assert_allclose(got["loss"], loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["logits"], logits, rtol=RTOL, atol=ATOL * 10)


@cases
def test_import_is_deterministic(case):
    first = to_onnx(load(_path(case), case["dims"])).SerializeToString()
    assert to_onnx(load(_path(case), case["dims"])).SerializeToString() == first


@cases
def test_unbound_dims_are_reported_and_named(case):
    if not case["dims"]:
        pytest.skip("exported with static shapes")
    code, out = _inspect(str(_path(case)), "--json")
    assert code == 0, out
    assert json.loads(out)["unbound_dims"] == list(case["dims"])
    with pytest.raises(UnboundDimError) as e:
        load(_path(case))
    assert e.value.dims == list(case["dims"])
    for name in case["dims"]:
        assert name in str(e.value)
