"""Every op parc's models and exporters commonly produce has a rule; replicate-only ops have none."""

from __future__ import annotations

import pytest

from parc.ops import RULES

REQUIRED = (
    "Gemm MatMul Einsum Conv MaxPool AveragePool GlobalAveragePool BatchNormalization "
    "LayerNormalization Softmax LogSoftmax SoftmaxCrossEntropyLoss Gather GatherElements ScatterND "
    "Where Expand Pad Slice Split Concat ReduceSum ReduceMean ReduceMax Erf Gelu Tanh Pow Sqrt "
    "Reciprocal IsNaN Cast Transpose Squeeze Unsqueeze TopK OneHot Reshape Flatten Add Sub Mul Div "
    "Relu Sigmoid Exp Log Neg Equal Less Not Identity Dropout ConstantOfShape Range Tile CumSum "
    "Trilu Resize ConvTranspose"
).split()

REPLICATE_ONLY = ["NonZero", "Unique", "Compress", "Shape", "Size", "Loop", "If"]


@pytest.mark.parametrize("op", REQUIRED)
def test_op_has_rule(op: str) -> None:
    assert op in RULES, f"{op} has no sharding rule"


@pytest.mark.parametrize("op", REPLICATE_ONLY)
def test_replicate_only_op_has_no_rule(op: str) -> None:
    assert op not in RULES


def test_rules_have_notes_where_they_restrict() -> None:
    for op in ("Gemm", "Conv", "MaxPool", "Squeeze", "Resize", "SoftmaxCrossEntropyLoss"):
        assert RULES[op].notes, f"{op}: its restrictions are not documented in notes"
