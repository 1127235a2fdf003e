"""Bad input: one line on stderr naming the file/node/flag, exit code 2, no traceback."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from helpers import assert_one_line_error, inp, legacy_gpt_block_model, make_model, parc, tensor
from onnx import helper


@pytest.fixture
def gpt_block(tmp_path):
    path = tmp_path / "block.onnx"
    onnx.save(legacy_gpt_block_model(), path)
    return path


def test_truncated_file(tmp_path, gpt_block):
    data = gpt_block.read_bytes()
    bad = tmp_path / "truncated.onnx"
    bad.write_bytes(data[: len(data) // 2])
    assert_one_line_error(parc("inspect", str(bad)), "truncated.onnx")


@pytest.mark.parametrize("cmd", [["inspect"], ["grad"]])
@pytest.mark.parametrize("field", [b"MatMul", b"head_dim"])
def test_a_name_that_is_not_utf8_is_bad_input(tmp_path, gpt_block, cmd, field):
    """One flipped byte in a node's op type or a value's name: exit 2, naming the file."""
    data = bytearray(gpt_block.read_bytes())
    data[data.index(field) + 1] = 0xFF
    bad = tmp_path / "flipped.onnx"
    bad.write_bytes(bytes(data))
    args = [*cmd, str(bad)] + (["-o", str(tmp_path / "t.onnx")] if cmd == ["grad"] else [])
    assert_one_line_error(parc(*args), "flipped.onnx", "not valid UTF-8")


@pytest.mark.parametrize("field", [b"layer.weight", b"mm doc", b"EEval", b"test"])
def test_metadata_that_is_not_utf8_is_carried(tmp_path, field):
    """One flipped byte in text parc does not read (a node's metadata value, its doc string, the
    model's metadata, the graph's name): `grad` and `inspect` accept the file, and a node's or
    the model's metadata reaches the written step byte for byte."""
    n = helper.make_node
    mm = n("MatMul", ["x", "w"], ["h"], name="mm", doc_string="mm doc")
    mm.metadata_props.add(key="origin", value="layer.weight")
    nodes = [mm, n("ReduceSum", ["h"], ["loss"], name="sum", keepdims=0)]
    model = make_model(nodes, [inp("x", [2, 3])], [inp("loss", [])], [tensor("w", np.ones((3, 4), np.float32))])
    model.metadata_props.add(key="source", value="EEval")
    data = model.SerializeToString()
    assert data.count(field) == 1
    flipped = field[:2] + b"\xff" + field[3:]
    bad = tmp_path / "flipped.onnx"
    bad.write_bytes(data.replace(field, flipped))
    step = tmp_path / "step.onnx"
    for args in (["grad", str(bad), "-o", str(step)], ["inspect", str(bad)], ["inspect", str(step)]):
        res = parc(*args)
        assert res.returncode == 0, (args, res.stderr)
        assert "Traceback" not in res.stderr and "error" not in res.stderr
    if field in (b"layer.weight", b"EEval"):
        assert flipped in step.read_bytes()


def test_non_onnx_file(tmp_path):
    bad = tmp_path / "notes.onnx"
    bad.write_text("this is not a model\n" * 20)
    assert_one_line_error(parc("inspect", str(bad)), "notes.onnx", "not")


def test_missing_file(tmp_path):
    assert_one_line_error(parc("inspect", str(tmp_path / "nope.onnx")), "nope.onnx", "no such file")


def test_directory_instead_of_file(tmp_path):
    assert_one_line_error(parc("inspect", str(tmp_path)))


def test_cycle(tmp_path):
    model = make_model([helper.make_node("Add", ["x", "b"], ["a"], name="add"),
                        helper.make_node("Relu", ["a"], ["b"], name="relu")],
                       [inp("x", [2])], [inp("b", None)])
    path = tmp_path / "cycle.onnx"
    onnx.save(model, path)
    assert_one_line_error(parc("inspect", str(path)), "cycle")


def test_missing_input(tmp_path):
    model = make_model([helper.make_node("Relu", ["ghost"], ["y"], name="relu1")],
                       [inp("x", [2])], [inp("y", None)])
    path = tmp_path / "missing.onnx"
    onnx.save(model, path)
    assert_one_line_error(parc("inspect", str(path)), "relu1", "ghost")


@pytest.mark.parametrize("flag", ["batch", "batch=", "batch=abc", "batch=0", "batch=-3"])
def test_malformed_dim_flag(gpt_block, flag):
    assert_one_line_error(parc("inspect", str(gpt_block), "--dim", flag), "--dim")


def test_dim_that_does_not_exist(gpt_block):
    assert_one_line_error(parc("inspect", str(gpt_block), "--dim", "batch=2", "--dim", "seq=3",
                               "--dim", "heads=4"), "heads", "batch, seq")


def test_dim_that_cannot_be_bound(tmp_path):
    # n*6 elements cannot be reshaped to (-1, 4) for n=1
    model = make_model([helper.make_node("Reshape", ["x", "shape"], ["y"], name="split_heads")],
                       [inp("x", ["n", 6])], [inp("y", None)], [tensor("shape", np.array([-1, 4]))])
    path = tmp_path / "reshape.onnx"
    onnx.save(model, path)
    assert_one_line_error(parc("inspect", str(path), "--dim", "n=1"), "split_heads")


def test_unbound_dims_are_reported_not_fatal(gpt_block):
    res = parc("inspect", str(gpt_block), "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["unbound_dims"] == ["batch", "seq"]
    assert report["flops_forward"] is None
    assert report["shape_dependent_values"] > 0


def test_bound_report_keys(gpt_block):
    res = parc("inspect", str(gpt_block), "--dim", "batch=2", "--dim", "seq=4", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    for key in ("parameters", "parameter_bytes", "flops_forward", "flops_step", "activation_bytes_peak",
                "ops", "replicate_only_ops", "unbound_dims", "shape_dependent_values"):
        assert key in report
    assert report["parameters"] == 64 and report["parameter_bytes"] == 256
    assert report["unbound_dims"] == [] and report["shape_dependent_values"] == 0
    assert report["flops_step"] is None
    assert "Shape" not in report["ops"]


def test_bad_model_name_for_build(tmp_path):
    assert_one_line_error(parc("models", "build", "gpt-nonexistent", "-o", str(tmp_path / "x.onnx")),
                          "gpt-nonexistent")


def test_unknown_command_is_usage_error():
    res = parc("frobnicate")
    assert res.returncode == 2 and "Traceback" not in res.stderr
