"""Mixed-precision training steps (`parc grad --precision`): where the casts go, the loss scale,
and that a bf16 / fp16 step computes what the float32 step does, to the low type's precision."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from parc.autodiff import OptimizerConfig, make_training_step
from parc.autodiff.precision import CAST_OF, PRODUCTS
from parc.errors import UsageError
from parc.ir import load, to_onnx
from parc.ir.state import step_state
from parc.models import build_model
from tests.helpers import assert_one_line_error, parc


def _step(tmp_path, precision, optimizer="sgd", loss_scale=None, name="gpt-tiny"):
    graph = load(build_model(name, tmp_path / f"{name}.onnx"))
    make_training_step(graph, OptimizerConfig(optimizer, lr=1e-3), precision=precision, loss_scale=loss_scale)
    return graph


@pytest.mark.parametrize(("precision", "elem"), [("bf16", onnx.TensorProto.BFLOAT16),
                                                 ("fp16", onnx.TensorProto.FLOAT16)])
def test_products_compute_in_the_low_type_with_float32_master_weights(tmp_path, precision, elem):
    graph = _step(tmp_path, precision)
    forward = [n for n in graph.nodes if n.op_type in PRODUCTS and n.meta.get("parc.phase") == "forward"]
    assert forward and all(v.dtype.onnx_type == elem for n in forward for v in n.inputs if v is not None)
    assert all(n.outputs[0].dtype.onnx_type == elem for n in forward)
    back = [n for n in graph.nodes if n.meta.get(CAST_OF) == "output"]
    assert len(back) == len(forward) and all(n.outputs[0].dtype.onnx_type == onnx.TensorProto.FLOAT for n in back)
    record = step_state(graph.metadata)
    assert record.precision["compute"] == precision and record.precision["products"] == len(forward)
    assert record.precision["loss_scale"] == (1024.0 if precision == "fp16" else 1.0)
    values = {v.name: v for v in graph.values()}
    for p in record.params:  # master weights and their gradients stay float32
        assert values[p].dtype.onnx_type == onnx.TensorProto.FLOAT
        assert values[record.grads[p]].dtype.onnx_type == onnx.TensorProto.FLOAT
    # a weight read by several products is cast once (the tied embedding: Gather reads it in float32)
    casts = [n for n in graph.nodes if n.meta.get(CAST_OF) == "input"]
    assert len({n.inputs[0].name for n in casts}) == len(casts)


def test_float32_step_is_unchanged(tmp_path):
    plain = _step(tmp_path, "fp32")
    assert not any(n.meta.get(CAST_OF) for n in plain.nodes)
    assert not step_state(plain.metadata).precision


@pytest.mark.parametrize(("precision", "tol"), [("bf16", 2e-2), ("fp16", 3e-3)])
def test_low_precision_step_equals_the_float32_step_to_its_precision(tmp_path, precision, tol):
    """One SGD step of gpt-tiny on parc's array engine (NumPy): the loss and every updated
    parameter against the float32 step, within the low type's rounding; the fp16 step's loss
    scale (1024) is undone exactly before the update."""
    from parc.exec.engines.array import ArrayEngine
    from tests.helpers import tiny_training_step

    _, feeds = tiny_training_step("gpt-tiny", tmp_path)
    fp32 = to_onnx(_step(tmp_path, "fp32"))
    before = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64) for t in fp32.graph.initializer}
    got = ArrayEngine(to_onnx(_step(tmp_path, precision))).run(feeds)
    want = ArrayEngine(fp32).run(feeds)
    assert set(got) == set(want) and "loss" in want
    updated = 0
    for k in want:
        assert np.asarray(got[k]).dtype == np.asarray(want[k]).dtype, k
        w, g = np.asarray(want[k], np.float64), np.asarray(got[k], np.float64)
        old = before.get(k.removesuffix(".new"))
        ulp = 0.0
        if old is not None:  # a new parameter: compare the updates, lr times the gradient, to
            w, g = w - old, g - old  # within the float32 parameter's own resolution
            ulp = 2 * float(np.max(np.spacing(np.abs(old).astype(np.float32))))
            updated += 1
        scale = float(np.max(np.abs(w)))
        assert scale > 0 and float(np.max(np.abs(g - w))) <= tol * scale + ulp, k
    assert updated == 28


def test_loss_scale_must_be_a_power_of_two(tmp_path):
    with pytest.raises(UsageError, match="power of two"):
        _step(tmp_path, "fp16", loss_scale=1000)
    with pytest.raises(UsageError, match="power of two"):
        _step(tmp_path, "bf16", loss_scale=0)


def test_cli_writes_and_reports_a_bf16_step(tmp_path):
    build = parc("models", "build", "gpt-tiny", "-o", str(tmp_path / "m.onnx"))
    assert build.returncode == 0, build.stderr
    res = parc("grad", str(tmp_path / "m.onnx"), "--precision", "bf16", "--optimizer", "adamw", "-o",
               str(tmp_path / "t.onnx"))
    assert res.returncode == 0, res.stderr
    assert "products in bf16 (loss scale 1)" in res.stdout
    bad = parc("grad", str(tmp_path / "m.onnx"), "--precision", "fp16", "--loss-scale", "3", "-o",
               str(tmp_path / "u.onnx"))
    assert_one_line_error(bad, "--loss-scale", "power of two")
