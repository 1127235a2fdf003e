"""`parc grad`: bad input is one line on stderr naming the output, node or flag, exit code 2 and
no traceback; a good run prints one summary line and writes a step `parc inspect` understands."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import assert_one_line_error, inp, make_model, parc, tensor
from onnx import TensorProto, helper

from parc.autodiff.rules import GRADS, NON_DIFFERENTIABLE
from parc.models import build_model

n = helper.make_node






def save(model: onnx.ModelProto, path: Path) -> str:
    onnx.save(model, path)
    return str(path)


def mlp(op: str = "Relu", domain: str = "", loss: str = "loss") -> onnx.ModelProto:
    """x @ w -> op -> ReduceSum: a scalar loss that depends on w through `op`."""
    nodes = [n("MatMul", ["x", "w"], ["h"], name="mm"), n(op, ["h"], ["y"], name="act", domain=domain),
             n("ReduceSum", ["y"], [loss], name="sum", keepdims=0)]
    w = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    model = make_model(nodes, [inp("x", [2, 3])], [inp(loss, [])], [tensor("w", w)])
    if domain:  # an op parc does not know: its output shape is declared
        model.opset_import.append(helper.make_opsetid(domain, 1))
        model.graph.value_info.append(inp("y", [2, 4]))
    return model


@pytest.fixture
def good(tmp_path) -> str:
    return save(mlp(), tmp_path / "mlp.onnx")


def test_no_scalar_loss(tmp_path):
    model = make_model([n("MatMul", ["x", "w"], ["y"], name="mm")], [inp("x", [2, 3])], [inp("y", [2, 4])],
                       [tensor("w", np.ones((3, 4), np.float32))])
    res = parc("grad", save(model, tmp_path / "noloss.onnx"), "-o", str(tmp_path / "out.onnx"))
    assert_one_line_error(res, "loss", "--loss")


def test_loss_names_a_missing_output(tmp_path, good):
    assert_one_line_error(parc("grad", good, "-o", str(tmp_path / "out.onnx"), "--loss", "nope"),
                          "--loss nope", "loss")


def test_loss_not_scalar(tmp_path):
    nodes = [n("MatMul", ["x", "w"], ["y"], name="mm"), n("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0)]
    model = make_model(nodes, [inp("x", [2, 3])], [inp("y", [2, 4]), inp("loss", [])],
                       [tensor("w", np.ones((3, 4), np.float32))])
    res = parc("grad", save(model, tmp_path / "m.onnx"), "-o", str(tmp_path / "out.onnx"), "--loss", "y")
    assert_one_line_error(res, "'y'", "scalar")


def test_loss_independent_of_parameters(tmp_path):
    nodes = [n("MatMul", ["x", "w"], ["y"], name="mm"), n("ReduceSum", ["x"], ["loss"], name="sum", keepdims=0)]
    model = make_model(nodes, [inp("x", [2, 3])], [inp("loss", []), inp("y", [2, 4])],
                       [tensor("w", np.ones((3, 4), np.float32))])
    res = parc("grad", save(model, tmp_path / "m.onnx"), "-o", str(tmp_path / "out.onnx"))
    assert_one_line_error(res, "'loss'", "does not depend on any parameter")


def test_custom_domain_op_on_the_loss_path(tmp_path):
    res = parc("grad", save(mlp("Foo", "com.example"), tmp_path / "m.onnx"), "-o", str(tmp_path / "out.onnx"))
    assert_one_line_error(res, "'act'", "Foo", "no gradient rule")


def test_standard_op_without_gradient_rule(tmp_path):
    """Det (a standard op, differentiable in ONNX's schema) has no gradient rule: one line naming
    the node and op. If Det gets a rule, pick another op without one here."""
    assert "Det" not in GRADS and "Det" not in NON_DIFFERENTIABLE
    nodes = [n("MatMul", ["x", "w"], ["h"], name="mm"), n("Det", ["h"], ["loss"], name="act")]
    w = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    model = make_model(nodes, [inp("x", [4, 3])], [inp("loss", [])], [tensor("w", w)])
    res = parc("grad", save(model, tmp_path / "m.onnx"), "-o", str(tmp_path / "out.onnx"))
    assert_one_line_error(res, "'act'", "Det", "no gradient rule")


def test_params_matching_an_integer_initializer(tmp_path):
    nodes = [n("Gather", ["w", "idx"], ["e"], name="embed", axis=0),
             n("ReduceSum", ["e"], ["loss"], name="sum", keepdims=0)]
    model = make_model(nodes, [inp("x", [2])], [inp("loss", [])],
                       [tensor("w", np.ones((5, 4), np.float32)), tensor("idx", np.array([0, 3], np.int64))])
    res = parc("grad", save(model, tmp_path / "m.onnx"), "-o", str(tmp_path / "out.onnx"), "--params", "idx")
    assert_one_line_error(res, "--params", "'idx'", "int64")


@pytest.mark.parametrize("flag, value, needle", [
    ("--params", "(", "--params '('"),
    ("--frozen", "[a", "--frozen '[a'"),
    ("--params", "^nothing$", "no parameters"),
    ("--frozen", ".", "no parameters"),
    ("--betas", "0.9", "--betas '0.9'"),
    ("--betas", "0.9,0.99,0.5", "--betas"),
    ("--betas", "1.5,0.9", "--betas 1.5,0.9"),
    ("--lr", "-1", "--lr -1"),
    ("--lr", "0", "--lr 0"),
    ("--eps", "0", "--eps 0"),
    ("--weight-decay", "-0.1", "--weight-decay -0.1"),
    ("--momentum", "-0.5", "--momentum -0.5"),
    ("--optimizer", "lamb", "--optimizer"),
    ("--dim", "batch", "--dim"),
])
def test_bad_flag(tmp_path, good, flag, value, needle):
    assert_one_line_error(parc("grad", good, "-o", str(tmp_path / "out.onnx"), flag, value), needle)
    assert not (tmp_path / "out.onnx").exists()


def test_output_equal_to_input(tmp_path, good):
    before = Path(good).read_bytes()
    assert_one_line_error(parc("grad", good, "-o", good), "-o", "overwrite")
    assert_one_line_error(parc("grad", good, "-o", str(tmp_path / "." / "mlp.onnx")), "-o", "overwrite")
    assert Path(good).read_bytes() == before


def test_an_output_that_is_not_a_file_is_refused_and_kept(tmp_path, good):
    """`-o /dev/null` used to replace the device node with the step (the write is a rename)."""
    import os
    import stat

    pipe = tmp_path / "pipe.onnx"
    os.mkfifo(pipe)
    assert_one_line_error(parc("grad", good, "-o", str(pipe)), "-o", "not a regular file")
    assert stat.S_ISFIFO(pipe.stat().st_mode)
    (tmp_path / "dir.onnx").mkdir()
    assert_one_line_error(parc("grad", good, "-o", str(tmp_path / "dir.onnx")), "-o")
    assert (tmp_path / "dir.onnx").is_dir()


def test_missing_input_file(tmp_path):
    assert_one_line_error(parc("grad", str(tmp_path / "nope.onnx"), "-o", str(tmp_path / "out.onnx")), "nope.onnx")


def test_good_run_writes_a_step_inspect_understands(tmp_path):
    model = build_model("gpt-tiny", tmp_path / "gpt-tiny.onnx")
    out = tmp_path / "step.onnx"
    res = parc("grad", str(model), "-o", str(out), "--optimizer", "adamw", "--lr", "1e-4", "--weight-decay", "0.01")
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"wrote {out}"), res.stdout
    assert "'loss'" in lines[0] and "adamw" in lines[0]
    res = parc("inspect", str(out), "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["training"] is True
    assert set(report["phases"]) == {"forward", "backward", "optimizer"} and all(report["phases"].values())
    assert report["nodes"] == sum(report["phases"].values())
    assert report["flops_step"] > report["flops_forward"] > 0
    assert report["gradient_bytes"] == report["parameter_bytes"] > 0
    assert report["optimizer_state_bytes"] == 2 * report["parameter_bytes"] + 8  # exp_avg, exp_avg_sq, step
    assert report["optimizer"]["name"] == "adamw" and report["optimizer"]["lr"] == 1e-4
    forward = json.loads(parc("inspect", str(model), "--json").stdout)
    assert report["parameters"] == forward["parameters"]
    assert report["training"] is not forward["training"]


def test_good_run_is_deterministic(tmp_path, good):
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    for out in (a, b):
        assert parc("grad", good, "-o", str(out), "--optimizer", "momentum").returncode == 0
    assert a.read_bytes() == b.read_bytes()
    step = onnx.load(str(a))
    assert {i.name for i in step.graph.input} == {"x", "w", "w.momentum"}
    assert [o.name for o in step.graph.output] == ["loss", "w.new", "w.momentum.new"]
    assert onnx.helper.tensor_dtype_to_np_dtype(step.graph.output[0].type.tensor_type.elem_type) == np.float32
    assert TensorProto.FLOAT == step.graph.output[1].type.tensor_type.elem_type
