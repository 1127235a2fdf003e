"""FLOP counts of the op families on hand-checked shapes."""

from __future__ import annotations

import numpy as np
from opcase import Arg, build

from parc.ops import get_rule

R = np.random.default_rng(0)


def f(*shape):
    return R.standard_normal(shape).astype(np.float32)


def flops(case) -> int:
    return get_rule(case.node).flops(case.node)


def test_contractions():
    assert flops(build("MatMul", [f(3, 4, 5), f(5, 6)])) == 2 * 3 * 4 * 6 * 5
    assert flops(build("Gemm", [f(4, 5), f(6, 5), f(6)], transB=1)) == 2 * 4 * 6 * 5 + 4 * 6
    assert flops(build("Einsum", [f(2, 3, 4), f(2, 4, 5)], equation="bij,bjk->bik")) == 2 * 2 * 3 * 4 * 5


def test_conv_and_pools():
    conv = build("Conv", [f(2, 4, 8, 8), f(6, 2, 3, 3), f(6)], group=2, pads=[1, 1, 1, 1])
    assert flops(conv) == 2 * 2 * 6 * 8 * 8 * 2 * 3 * 3 + 2 * 6 * 8 * 8
    assert flops(build("MaxPool", [f(2, 4, 8, 8)], kernel_shape=[2, 2], strides=[2, 2])) == 2 * 4 * 4 * 4 * 4
    assert flops(build("GlobalAveragePool", [f(2, 4, 8, 8)])) == 2 * 4 * 8 * 8


def test_norms_reductions_and_data_movement():
    assert flops(build("Softmax", [f(4, 8)])) == 5 * 32
    assert 5 * 32 <= flops(build("LayerNormalization", [f(4, 8), f(8), f(8)])) <= 8 * 32
    assert flops(build("ReduceSum", [f(4, 8), Arg(np.array([1]))])) == 32
    assert flops(build("Reshape", [f(4, 8), Arg(np.array([8, 4]))])) == 0
    assert flops(build("Transpose", [f(4, 8)])) == 0
    assert flops(build("Add", [f(4, 8), f(8)])) == 32
