"""The model zoo: every tiny model runs, every named config has the paper's size, builds are
deterministic and sparse, and bad names or --set keys are usage errors."""

from __future__ import annotations

import math
import os
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from parc.errors import UsageError
from parc.models import build_model, count_params, list_models, resolve_config

INFOS = {i.name: i for i in list_models()}
TINY = [n for n, i in INFOS.items() if i.params_paper is None]
NAMED = [n for n, i in INFOS.items() if i.params_paper is not None]
LM_FAMILIES = {"gpt", "moe", "bert", "t5", "dnabert"}
ALLOWED_OPS = set(
    "MatMul Gemm Add Mul Div Sub Pow Sqrt Erf Tanh Relu Sigmoid Softmax LayerNormalization BatchNormalization "
    "Conv ConvTranspose MaxPool AveragePool GlobalAveragePool Gather Reshape Transpose Concat Split Slice "
    "Squeeze Unsqueeze Where Expand Einsum TopK OneHot ReduceSum ReduceMean ReduceMax Cast "
    "SoftmaxCrossEntropyLoss Flatten Resize Identity".split()
)
SHAPE_INPUTS = {"Reshape": 1, "Expand": 1, "Slice": 1, "Split": 1, "Unsqueeze": 1, "Squeeze": 1, "TopK": 1}

# Named configs whose paper count no faithful architecture reaches within 2% (docs/models.md
# explains each); pinned to our exact count so any change is noticed.
OUTSIDE_2PCT = {
    "moe-8e-380m": 384_299_522,  # table says 350M, name says 380M; its blocks alone are 359M
    "moe-8e-760m": 743_235_074,  # -2.2% with Alpa's vocabulary 32000
    "moe-16e-1.3b": 1_347_706_370,  # Alpa's "1.3B" config is 1.35B
    "wr-1.3b": 1_005_653_184,  # Alpa's WideResNet: its own suite calls this "1B"
    "wr-2.6b": 1_965_011_008,  # Alpa "2B"
    "wr-6b": 4_000_937_344,  # Alpa "4B"
    "wr-12b": 9_550_002_624,
}


def _build(tmp_path, name, overrides=None):
    return build_model(name, tmp_path / f"{name}.onnx", overrides)


def _feeds(sess: ort.InferenceSession, high: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for i in sess.get_inputs():
        if i.type == "tensor(float)":
            feeds[i.name] = rng.standard_normal(i.shape).astype(np.float32)
        else:
            feeds[i.name] = rng.integers(0, high, size=i.shape).astype(np.int64)
    return feeds


def _check_format(model: onnx.ModelProto) -> None:
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 18)]
    assert model.ir_version == 10 and not model.functions
    g = model.graph
    assert [o.name for o in g.output][:2] == ["loss", "logits"]
    assert g.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert len(g.output[0].type.tensor_type.shape.dim) == 0
    for vi in list(g.input) + list(g.output):
        assert all(d.HasField("dim_value") for d in vi.type.tensor_type.shape.dim), vi.name
    inits = {t.name: t for t in g.initializer}
    names = [n.name for n in g.node]
    assert len(set(names)) == len(names) and all(names)
    for node in g.node:
        assert node.domain == "" and node.op_type in ALLOWED_OPS, node.op_type
        if node.op_type in SHAPE_INPUTS and len(node.input) > 1:
            shape = inits.get(node.input[SHAPE_INPUTS[node.op_type]])
            assert shape is not None and shape.data_type == TensorProto.INT64, node.name


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_checks_and_runs(tmp_path, name):
    info = INFOS[name]
    path = _build(tmp_path, name)
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    _check_format(model)
    assert not os.path.exists(f"{path}.data")  # random weights are inline
    cfg = resolve_config(name)
    classes = cfg.get("vocab") or cfg["classes"]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    loss, logits = sess.run(None, _feeds(sess, classes))
    assert loss.shape == () and np.isfinite(loss) and np.all(np.isfinite(logits))
    if info.family in LM_FAMILIES:
        assert abs(float(loss) - math.log(classes)) < 0.2 * math.log(classes)


@pytest.mark.parametrize("name", NAMED)
def test_named_config_matches_paper_size(tmp_path, name):
    path = _build(tmp_path, name)
    onnx.checker.check_model(str(path), full_check=True)  # path form: resolves the external data
    model = onnx.load(path, load_external_data=False)
    _check_format(model)
    n = count_params(model)
    if name in OUTSIDE_2PCT:
        assert n == OUTSIDE_2PCT[name]
    else:
        assert abs(n / INFOS[name].params_paper - 1) <= 0.02, n


@pytest.mark.parametrize(
    ("name", "overrides", "expected"),
    [  # the same networks as the well-known reference implementations, counted exactly
        ("gpt-medium", {"vocab": "50257"}, 354_823_168),  # HF gpt2-medium
        ("bert-large", None, 335_174_458),  # HF BertForMaskedLM, bert-large-uncased
        ("t5-large", {"tie_embeddings": "true"}, 737_668_096),  # HF t5-large
        ("resnet50-100k", {"classes": "1000"}, 25_557_032),  # torchvision resnet50
        ("vgg19", {"classes": "1000"}, 143_667_240),  # torchvision vgg19
    ],
)
def test_reference_architecture_counts(tmp_path, name, overrides, expected):
    assert count_params(_build(tmp_path, name, overrides)) == expected


def test_build_is_deterministic(tmp_path):
    a = build_model("gpt-tiny", tmp_path / "a.onnx")
    b = build_model("gpt-tiny", tmp_path / "b.onnx")
    assert a.read_bytes() == b.read_bytes()
    c = build_model("moe-8e-380m", tmp_path / "c" / "m.onnx")
    d = build_model("moe-8e-380m", tmp_path / "d" / "m.onnx")
    assert c.read_bytes() == d.read_bytes()


def test_sparse_data_file_is_a_hole(tmp_path):
    out = tmp_path / "gpt.onnx"
    stale = tmp_path / "gpt.onnx.data"
    stale.write_bytes(b"x" * 10_000_000)  # a previous build's file must be replaced, not appended to
    build_model("gpt-medium", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt.onnx", "gpt.onnx.data"]
    st = os.stat(stale)
    assert st.st_size > 1_400_000_000
    assert st.st_blocks * 512 < st.st_size / 1000
    model = onnx.load(out, load_external_data=False)
    end = 0
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            ext = {e.key: e.value for e in t.external_data}
            assert ext["location"] == "gpt.onnx.data"
            offset, length = int(ext["offset"]), int(ext["length"])
            assert offset % 64 == 0 and length == 4 * math.prod(t.dims)
            end = max(end, offset + length)
    assert end == st.st_size


def test_overrides_are_converted(tmp_path):
    cfg = resolve_config("gpt-tiny", {"layers": "3", "hidden": "32", "weights": "random", "seed": "7"})
    assert cfg["layers"] == 3 and cfg["hidden"] == 32 and cfg["seed"] == 7
    assert resolve_config("vgg19", {"classes": "1e6"})["classes"] == 1_000_000
    assert resolve_config("unet", {"mults": "1,2,4"})["mults"] == (1, 2, 4)
    assert resolve_config("t5-large", {"tie_embeddings": "yes"})["tie_embeddings"] is True
    small = count_params(_build(tmp_path, "gpt-tiny", {"layers": "1"}))
    assert small < count_params(_build(tmp_path, "gpt-tiny"))
    big = build_model("gpt-tiny", tmp_path / "s.onnx", {"weights": "sparse"})
    assert os.path.exists(f"{big}.data")


@pytest.mark.parametrize(
    ("name", "overrides", "words"),
    [
        ("gpt-huge", None, ["gpt-huge", "gpt-medium", "unet-tiny"]),
        ("gpt-tiny", {"layer": "2"}, ["'layer'", "layers", "hidden"]),
        ("gpt-tiny", {"layers": "two"}, ["layers", "'two'"]),
        ("gpt-tiny", {"layers": "0"}, ["layers=0"]),
        ("gpt-tiny", {"hidden": "65"}, ["hidden=65", "heads=4"]),
        ("gpt-tiny", {"weights": "dense"}, ["weights", "random", "sparse"]),
        ("t5-tiny", {"tie_embeddings": "maybe"}, ["tie_embeddings"]),
        ("vgg-tiny", {"image": "40"}, ["image=40"]),
        ("gpt-medium", {"weights": "random"}, ["weights=sparse"]),
    ],
)
def test_bad_names_and_keys_are_usage_errors(tmp_path, name, overrides, words):
    out = tmp_path / "m.onnx"
    with pytest.raises(UsageError) as err:
        build_model(name, out, overrides)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert not out.exists()


def test_catalogue():
    infos = list_models()
    assert [i.name for i in infos] == [i.name for i in list_models()]
    for i in infos:
        assert i.name == i.name.lower() and " " not in i.name and i.family and i.description
        with pytest.raises(TypeError):
            i.defaults["batch"] = 1  # type: ignore[index]
    families = {i.family for i in infos}
    assert families == {i.family for i in infos if i.params_paper is None}  # a tiny model per family
    assert {"gpt-6.7b", "moe-32e-10b", "bert-large", "t5-large", "vgg19", "resnet50-1m", "wr-12b", "unet",
            "dnabert"} <= set(INFOS)


@pytest.mark.slow
def test_gpt_6_7b_builds_fast_and_small(tmp_path):
    start = time.perf_counter()
    out = build_model("gpt-6.7b", tmp_path / "gpt.onnx")
    assert time.perf_counter() - start < 60
    onnx.checker.check_model(str(out))
    data = os.stat(f"{out}.data")
    assert data.st_size > 26e9 and data.st_blocks * 512 < 1 << 20
    assert abs(count_params(out) / 6.7e9 - 1) < 0.02
