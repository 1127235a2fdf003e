"""The ONNX backend node tests (shipped in the onnx package) through import, fold, verify, export.

Each case's integer inputs become initializers, as shape arguments are in real models, so the
shape-folding pass is exercised too; the exported model must compute what onnxruntime computes
on the original.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx.reference import ReferenceEvaluator

from parc.errors import ParcError
from parc.ir import from_model, to_onnx
from parc.ops import verify

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from onnx.backend.test.case import node as _node_cases

    CASES = {c.name: c for c in _node_cases.collect_testcases(None) if c.data_sets}

# Ops parc cannot give static shapes or does not import, by design (see docs/ir.md).
UNSUPPORTED = {
    "If", "Loop", "Scan",  # control flow with subgraphs
    "NonZero", "NonMaxSuppression", "Unique", "Compress", "MaxUnpool", "StringSplit",
    "StringNormalizer", "SplitToSequence", "STFT",  # output shapes depend on data
    "FlexAttention",  # a subgraph attribute
    "ImageDecoder", "OptionalHasElement", "OptionalGetElement",  # bytes and optional types
}
RANDOM = {"Bernoulli", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
          "Multinomial"}
KNOWN = {"test_range_bfloat16_type_positive_delta": "ONNX's reference evaluator cannot fold bfloat16 Range"}
_SO = ort.SessionOptions()
_SO.log_severity_level = 4


def _static_model(model: onnx.ModelProto, inputs: list, constant_max: int) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    keep = []
    for vi, arr in zip(list(m.graph.input), inputs):
        small = arr.size <= constant_max
        if arr.dtype.kind in "iu" or small:
            m.graph.initializer.append(onnx.numpy_helper.from_array(arr, vi.name))
            continue
        vi.type.tensor_type.ClearField("shape")
        for d in arr.shape:
            vi.type.tensor_type.shape.dim.add().dim_value = d
        keep.append(vi)
    del m.graph.input[:]
    m.graph.input.extend(keep)
    return m


def _outputs_close(got: list, want: list, atol: float) -> bool:
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False
        if a.dtype.kind in "fc":
            if not np.allclose(a, b, rtol=1e-4, atol=atol, equal_nan=True):
                return False
        elif a.dtype != object and not np.array_equal(a, b):
            return False
    return True


@pytest.mark.parametrize("name", sorted(CASES))
def test_node_case_round_trip(name: str) -> None:
    case = CASES[name]
    if name in KNOWN:
        pytest.skip(KNOWN[name])
    inputs, expected = case.data_sets[0]
    if not all(isinstance(a, np.ndarray) and a.dtype != object for a in inputs):
        pytest.skip("sequence, optional or string inputs")
    try:
        want = ort.InferenceSession(case.model.SerializeToString(), _SO).run(
            None, {i.name: a for i, a in zip(case.model.graph.input, inputs)})
        runner = "ort"
    except Exception:  # opsets newer than onnxruntime knows: ONNX's reference evaluator
        if not all(isinstance(a, np.ndarray) for a in expected):
            pytest.skip("onnxruntime cannot run it and the outputs are not tensors")
        want, runner = expected, "reference"
    ops = {n.op_type for n in case.model.graph.node}
    if ops & RANDOM or ("Dropout" in ops and "training" in name):
        pytest.skip("random outputs")
    graph = None
    for constant_max in (0, 64):  # second try: small float inputs as constants (scales, roi)
        try:
            graph = from_model(_static_model(case.model, inputs, constant_max), source=name)
            break
        except ParcError as e:
            if any(f"({op})" in str(e) for op in ops & UNSUPPORTED):  # the refusal names that op
                pytest.skip(f"unsupported by design: {e}")
            if "depends on data" not in str(e) or constant_max:
                raise
    assert graph is not None
    verify(graph)
    exported = to_onnx(graph)
    onnx.checker.check_model(exported)
    feeds = {v.name: a for v, a in zip(case.model.graph.input, inputs)
             if v.name in {i.name for i in exported.graph.input}}
    if runner == "ort":
        got = ort.InferenceSession(exported.SerializeToString(), _SO).run(None, feeds)
    else:  # onnxruntime cannot run the opset: the reference evaluator must run parc's export
        got = ReferenceEvaluator(exported).run(None, feeds)
    assert _outputs_close(got, want, atol=1e-5 if runner == "ort" else 1e-4)
