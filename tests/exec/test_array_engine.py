"""The array engine ("cupy" engine, parc/exec/engines/array.py) against onnxruntime and ONNX's
own node tests.

1. Each tiny zoo model's training step (forward, backward, AdamW), two steps with the first's
   parameters and moments fed back, matches onnxruntime on the CPU within rtol 1e-4 / atol 1e-5.
2. ONNX's backend node test cases (the models and data sets `onnx.backend.test.case.node`
   generates, which the wheel's data/node folders would hold) whose ops all have kernels match
   their expected outputs at the suite's own tolerances (rtol 1e-3, atol 1e-7), dtypes and shapes
   exactly. The cases data/array_engine_refused.txt lists (dtypes and semantics the engine does
   not implement) must be refused when it is built (EngineError); any other refusal fails.
3. Refusals and run-time failures are one-line EngineErrors naming the node and its op.
4. On a GPU (CuPy), gpt-tiny's step matches onnxruntime too.

`PARC_TEST_ENGINE_DEVICE=gpu` runs 1 and 2 on the GPU (CuPy) instead of NumPy: `scripts/gpu.sh`
does, so every kernel the node cases reach is checked on the device too.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import inp, make_model, tensor, tiny_training_step
from onnx import TensorProto, helper, numpy_helper

from parc.autodiff import OptimizerConfig
from parc.exec.engines.array import ArrayEngine, EngineError, supported_ops
from parc.exec.runner import to_host
from parc.models import list_models

ort = pytest.importorskip("onnxruntime")

TINY = [m.name for m in list_models() if m.params_paper is None]
# At Adam's first step a parameter moves by lr * g / (|g| + eps): its derivative, lr / eps,
# multiplies float32 rounding in gradient entries near zero (gpt-tiny: a 2.1e-9 entry that
# onnxruntime and numpy sum to 2.07e-9 and 2.74e-9 moves the weight by 4e-5 at eps 1e-8).
# eps 1e-5 bounds that gain by 100, so every output can be held to rtol 1e-4 / atol 1e-5.
OPTIMIZER = OptimizerConfig("adamw", lr=1e-3, weight_decay=0.01, eps=1e-5)
RTOL, ATOL = 1e-4, 1e-5
# ONNX node cases that ran (not refused) with onnx 1.23.2: 1251 of 1428 whose ops have kernels.
MIN_NODE_CASES_RUN = 1200
DEVICE = os.environ.get("PARC_TEST_ENGINE_DEVICE", "cpu")  # where tests 1 and 2 run the engine
REFUSED_FILE = Path(__file__).parent / "data" / "array_engine_refused.txt"
# ONNX's expected float16 outputs come from NumPy, whose float16 matmul and sums round every
# partial result to float16; cuBLAS and CuPy accumulate in float32 and round once, so chained
# float16 cases (the expanded attentions) differ by up to 4 units in the last place on a GPU.
FLOAT16_GPU_RTOL = 2.0**-8


# ---------------------------------------------------------------- zoo training steps

@pytest.fixture(scope="module", params=TINY)
def step(request, tmp_path_factory) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """(a tiny model's AdamW training step, seeded feeds for its data inputs)."""
    name = request.param
    return tiny_training_step(name, tmp_path_factory.mktemp(name), OPTIMIZER)


@functools.cache
def _ort_options():
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return opts


def _ort_session(model: onnx.ModelProto):
    return ort.InferenceSession(model.SerializeToString(), _ort_options(), providers=["CPUExecutionProvider"])


def _ort_run(session, feeds) -> dict[str, np.ndarray]:
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _assert_matches(got: dict, want: dict, to_host=np.asarray, rtol=RTOL, atol=ATOL) -> None:
    assert set(got) == set(want)
    bad = []
    for k, ref in want.items():
        a = to_host(got[k])
        if a.dtype != ref.dtype or a.shape != ref.shape:
            bad.append(f"{k}: {a.dtype}{list(a.shape)}, expected {ref.dtype}{list(ref.shape)}")
            continue
        try:
            np.testing.assert_allclose(a, ref, rtol=rtol, atol=atol)
        except AssertionError as e:
            bad.append(f"{k}: {' '.join(str(e).split())[:300]}")
    assert not bad, "\n".join(bad[:5])


def test_zoo_training_step_matches_onnxruntime(step):
    """Two steps: the second is fed the first's parameters, moments and step count."""
    model, feeds = step
    bindings = json.loads({p.key: p.value for p in model.metadata_props}["parc.state"])["bindings"]
    engine, session = ArrayEngine(model, device=DEVICE), _ort_session(model)
    for _ in range(2):
        got, want = engine.run(feeds), _ort_run(session, feeds)
        _assert_matches(got, want, to_host=to_host)
        feeds = {**feeds, **{bindings[k]: v for k, v in want.items() if k in bindings}}


@pytest.mark.gpu
def test_gpu_training_step_matches_onnxruntime(tmp_path):
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    model, feeds = tiny_training_step("gpt-tiny", tmp_path, OPTIMIZER)
    engine = ArrayEngine(model, device="gpu")
    assert engine.xp is cupy
    got = engine.run(feeds)
    assert all(isinstance(v, cupy.ndarray) for v in got.values())
    _assert_matches(got, _ort_run(_ort_session(model), feeds), to_host=cupy.asnumpy)


# ---------------------------------------------------------------- ONNX's node test cases

@functools.cache
def _node_cases() -> dict[str, object]:
    """ONNX's backend node cases whose ops all have kernels, by name."""
    from onnx.backend.test.case import node as node_cases

    supported = set(supported_ops())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = node_cases.collect_testcases(None)
    return {c.name: c for c in cases if not c.model.functions and all(
        n.domain in ("", "ai.onnx") and n.op_type in supported for n in c.model.graph.node)}


def _array(a) -> np.ndarray:
    return numpy_helper.to_array(a) if isinstance(a, onnx.TensorProto) else a


@functools.cache
def _refused(device: str) -> dict[str, str]:
    """Case -> op of the node cases the engine refuses on `device` (REFUSED_FILE)."""
    out = {}
    for line in REFUSED_FILE.read_text().splitlines():
        if line and not line.startswith("#"):
            op, name, *only = line.split()
            if not only or only == [device]:
                out[name] = op
    return out


def _run_node_case(case, engine: ArrayEngine) -> None:
    """Run the case's data sets on `engine` and compare with the expected outputs."""
    names = [vi.name for vi in case.model.graph.input]
    for inputs, outputs in case.data_sets:
        got = engine.run(dict(zip(names, map(_array, inputs))))
        want = {vi.name: _array(o) for vi, o in zip(case.model.graph.output, outputs)}
        rtol = case.rtol
        if DEVICE == "gpu" and any(w.dtype == np.float16 for w in want.values()):
            rtol = max(rtol, FLOAT16_GPU_RTOL)
        _assert_matches(got, want, to_host=to_host, rtol=rtol, atol=case.atol)


@pytest.mark.parametrize("name", sorted(_node_cases()))
def test_onnx_node_case(name):
    """A listed case is refused when the engine is built; any other builds, runs and matches."""
    case = _node_cases()[name]
    op = _refused(DEVICE).get(name)
    if op is not None:
        assert op in {n.op_type for n in case.model.graph.node}, f"{REFUSED_FILE.name}: {name} has no {op}"
        with pytest.raises(EngineError):
            ArrayEngine(case.model, device=DEVICE)
        return
    try:
        engine = ArrayEngine(case.model, device=DEVICE)
    except EngineError as e:
        pytest.fail(f"{name} is refused ({e}): a regression, or a refusal to list in {REFUSED_FILE.name}")
    _run_node_case(case, engine)


def test_onnx_node_cases_mostly_run():
    """Refusals stay refusals of what is genuinely missing (float8, int4, strings, random masks)."""
    ran = 0
    for case in _node_cases().values():
        try:
            ArrayEngine(case.model)
            ran += 1
        except EngineError:
            continue
    assert ran >= MIN_NODE_CASES_RUN, f"only {ran} of {len(_node_cases())} node cases run"


# ---------------------------------------------------------------- errors and feeds

def _one_line(e: pytest.ExceptionInfo, *needles: str) -> None:
    message = str(e.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message


def test_unsupported_op_is_refused_when_built():
    n = helper.make_node
    model = make_model([n("Relu", ["x"], ["h"], name="act"),
                        n("Resize", ["h", "", "scales"], ["y"], name="up")],
                       [inp("x", [1, 1, 2, 2])], [inp("y", None)],
                       [tensor("scales", np.array([1, 1, 2, 2], np.float32))])
    with pytest.raises(EngineError) as e:
        ArrayEngine(model)
    _one_line(e, "node 'up'", "op Resize is not supported by the cupy engine", "supported: Abs")
    custom = make_model([n("FusedMatMul", ["x", "x"], ["y"], domain="com.microsoft", name="fused")],
                        [inp("x", [2, 2])], [inp("y", None)])
    custom.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    with pytest.raises(EngineError) as e:
        ArrayEngine(custom)
    _one_line(e, "node 'fused'", "op com.microsoft.FusedMatMul is not supported")


def test_unsupported_semantics_are_refused_when_built():
    n = helper.make_node
    pad = make_model([n("Pad", ["x", "pads"], ["y"], mode="reflect_twice", name="p")],
                     [inp("x", [2, 2])], [inp("y", None)], [tensor("pads", np.array([1, 1, 1, 1]))])
    with pytest.raises(EngineError) as e:
        ArrayEngine(pad)
    _one_line(e, "node 'p'", "op Pad with mode='reflect_twice' is not supported")
    dropout = make_model([n("Dropout", ["x", "ratio", "train"], ["y"], name="drop")],
                         [inp("x", [2, 2]), inp("train", [], TensorProto.BOOL)], [inp("y", None)],
                         [tensor("ratio", np.array(0.1, np.float32))])
    with pytest.raises(EngineError) as e:
        ArrayEngine(dropout)
    _one_line(e, "node 'drop'", "random masks")
    fp8 = make_model([n("Relu", ["x"], ["y"])], [inp("x", [2], TensorProto.FLOAT8E4M3FN)],
                     [inp("y", None)])
    with pytest.raises(EngineError) as e:
        ArrayEngine(fp8)
    _one_line(e, "input 'x'", "FLOAT8E4M3FN")
    # bfloat16 computes (mixed-precision steps hold it), and stays bfloat16
    bf16 = make_model([n("Relu", ["x"], ["y"])], [inp("x", [2], TensorProto.BFLOAT16)], [inp("y", None)])
    x = np.array([-1.5, 2.25], np.float32).astype(helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16))
    y = ArrayEngine(bf16).run({"x": x})["y"]
    assert y.dtype == x.dtype and y.astype(np.float32).tolist() == [0.0, 2.25]


def test_runtime_failure_names_node_and_op():
    n = helper.make_node
    model = make_model([n("Reshape", ["x", "shape"], ["y"], name="fold")],
                       [inp("x", [2, 3]), inp("shape", [2], TensorProto.INT64)], [inp("y", None)])
    engine = ArrayEngine(model)
    with pytest.raises(EngineError) as e:
        engine.run({"x": np.zeros((2, 3), np.float32), "shape": np.array([4, 4])})
    _one_line(e, "node 'fold' (Reshape) failed")


def test_feeds_are_checked_and_initializers_are_defaults():
    n = helper.make_node
    model = make_model([n("Add", ["x", "b"], ["s"]), n("Mul", ["s", "s"], ["y"])],
                       [inp("x", [2]), inp("b", [2])], [inp("y", None)],
                       [tensor("b", np.array([1.0, 2.0], np.float32))])
    engine = ArrayEngine(model)
    x = np.array([1.0, -1.0], np.float32)
    np.testing.assert_array_equal(engine.run({"x": x})["y"], [4.0, 1.0])
    np.testing.assert_array_equal(engine.run({"x": x, "b": np.zeros(2, np.float32)})["y"], [1.0, 1.0])
    with pytest.raises(EngineError) as e:
        engine.run({"b": x})
    _one_line(e, "missing input 'x'")
    with pytest.raises(EngineError) as e:
        engine.run({"x": x.astype(np.float64)})
    _one_line(e, "input 'x': expected float32, got float64")
    with pytest.raises(EngineError) as e:
        engine.run({"x": x, "z": x})
    _one_line(e, "feed 'z' is not an input")


def test_constant_subgraphs_are_folded_and_intermediates_freed():
    """Shape arithmetic on constants runs once, when the engine is built; a value is dropped
    after its last use, and graph outputs are kept even when later nodes use them."""
    n = helper.make_node
    model = make_model(
        [n("Concat", ["two", "minus_one"], ["shape"], axis=0),
         n("Reshape", ["x", "shape"], ["x2"]),
         n("Neg", ["x2"], ["a"]), n("Exp", ["a"], ["b"]), n("Add", ["a", "b"], ["y"])],
        [inp("x", [2, 3])], [inp("y", None), inp("a", None)],
        [tensor("two", np.array([2])), tensor("minus_one", np.array([-1]))])
    engine = ArrayEngine(model)
    assert [label for *_, label in engine._steps] == [
        "node '#1 (x2)' (Reshape)", "node '#2 (a)' (Neg)", "node '#3 (b)' (Exp)", "node '#4 (y)' (Add)"]
    frees = {label.split("'")[1]: {k.split("\0")[0] for k in f} for _, _, _, f, label in engine._steps}
    assert frees == {"#1 (x2)": {"x", "shape"}, "#2 (a)": {"x2"}, "#3 (b)": set(), "#4 (y)": {"b"}}
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    got = engine.run({"x": x})
    np.testing.assert_allclose(got["y"], -x.reshape(2, 3) + np.exp(-x.reshape(2, 3)), rtol=1e-6)
    np.testing.assert_array_equal(got["a"], -x.reshape(2, 3))


def test_cpu_engine_is_numpy():
    engine = ArrayEngine(make_model([helper.make_node("Relu", ["x"], ["y"])], [inp("x", [2])],
                                    [inp("y", None)]))
    assert engine.xp is np and engine.name == "cupy"
    with pytest.raises(EngineError) as e:
        ArrayEngine(make_model([], [inp("x", [1])], [inp("x", None)]), device="tpu")
    _one_line(e, "device 'tpu'")
