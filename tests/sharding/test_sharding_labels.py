"""Specs from op-rule labels agree with `parc.ops.check.split_array` (Rhino's strided splits)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parc.ir import Graph, TensorData
from parc.ir.dtypes import FLOAT
from parc.ops import sharding_rule
from parc.ops.base import ShardingRule
from parc.ops.check import split_array
from parc.sharding import (
    P,
    R,
    S,
    ShardSpec,
    ShardSpecError,
    Split,
    axis_spec_for_label,
    devices,
    shard_index,
    shard_spec_for_labels,
    split,
    split_label,
)

props = settings(max_examples=60, deadline=None)
FACTOR = st.sampled_from([1, 2, 3, 4, 6])


@st.composite
def grouped_tensor(draw):
    """Tensor dims as groups of labels (outer to inner), the rule holding them, and an array."""
    rank = draw(st.integers(1, 3))
    names = iter("abcdefghij")
    dims = tuple(tuple(next(names) for _ in range(draw(st.integers(1, 3)))) for _ in range(rank))
    sizes = {lbl: draw(FACTOR) for dim in dims for lbl in dim}
    rule = ShardingRule(inputs=(dims,), outputs=(dims,), sizes=tuple(sizes.items()))
    shape = tuple(int(np.prod([sizes[lbl] for lbl in dim])) for dim in dims)
    seed = draw(st.integers(0, 2**32 - 1))
    return dims, rule, np.random.default_rng(seed).integers(-1000, 1000, size=shape)


def divisors(m: int) -> list[int]:
    return [n for n in range(1, min(m, 4) + 1) if m % n == 0]


@props
@given(grouped_tensor(), st.data())
def test_one_axis_matches_split_array(tensor, data):
    dims, rule, x = tensor
    label = data.draw(st.sampled_from([lbl for dim in dims for lbl in dim]))
    n = data.draw(st.sampled_from(divisors(rule.size(label))))
    spec = ShardSpec((axis_spec_for_label(dims, rule, label, n),))
    shards = split(x, spec, (n,))
    for k in range(n):
        np.testing.assert_array_equal(shards[(k,)], split_array(x, dims, rule, label, n, k))


@props
@given(grouped_tensor(), st.data())
def test_two_axes_match_nested_split_array(tensor, data):
    dims, rule, x = tensor
    all_labels = [lbl for dim in dims for lbl in dim]
    l0 = data.draw(st.sampled_from(all_labels))
    n0 = data.draw(st.sampled_from(divisors(rule.size(l0))))
    inner = split_label(rule, l0, n0)
    l1 = data.draw(st.sampled_from(all_labels))  # may be l0 again: a nested split of one label
    n1 = data.draw(st.sampled_from(divisors(inner.size(l1))))
    spec = shard_spec_for_labels(dims, rule, [l0, l1], (n0, n1))
    shards = split(x, spec, (n0, n1))
    for c0, c1 in devices((n0, n1)):
        want = split_array(split_array(x, dims, rule, l0, n0, c0), dims, inner, l1, n1, c1)
        np.testing.assert_array_equal(shards[(c0, c1)], want)


def test_stride_is_inner_factors_times_piece():
    # dim (o l i) with sizes (2, 6, 5) split 3 ways on l: chunks of 6/3*5 = 10, 2 per device
    rule = ShardingRule(inputs=((("o", "l", "i"),),), outputs=((("o", "l", "i"),),),
                        sizes=(("o", 2), ("l", 6), ("i", 5)))
    dims = (("o", "l", "i"),)
    assert axis_spec_for_label(dims, rule, "l", 3) == S(0, 10)
    assert axis_spec_for_label(dims, rule, "o", 2) == S(0)  # the outermost factor: contiguous
    assert axis_spec_for_label(dims, rule, "i", 5) == S(0, 1)
    assert axis_spec_for_label(dims, rule, "l", 1) == R


def test_fused_qkv_column_split_keeps_q_k_v_together():
    hidden, n = 8, 4
    rule = ShardingRule(inputs=((("k",), ("t", "h")),), outputs=((("k",), ("t", "h")),),
                        sizes=(("k", hidden), ("t", 3), ("h", hidden)))
    dims = (("k",), ("t", "h"))
    ax = axis_spec_for_label(dims, rule, "h", n)
    assert ax == S(1, hidden // n)
    # docs/sharding.md: the 24 columns viewed as (3, 4, 2)
    assert shard_index(w_shape := (hidden, 3 * hidden), ShardSpec((ax,)), (n,), (0,))[1].tolist() == [0, 1, 8, 9, 16, 17]
    assert shard_index(w_shape, ShardSpec((ax,)), (n,), (3,))[1].tolist() == [6, 7, 14, 15, 22, 23]
    w = np.arange(hidden * 3 * hidden).reshape(hidden, 3 * hidden)
    q, k, v = np.split(w, 3, axis=1)
    for (c,), shard in split(w, ShardSpec((ax,)), (n,)).items():
        cols = slice(c * hidden // n, (c + 1) * hidden // n)
        np.testing.assert_array_equal(shard, np.concatenate([q[:, cols], k[:, cols], v[:, cols]], axis=1))


def test_partial_outputs_and_replicated_tensors():
    # MatMul m k, k n -> m n [k:sum]
    rule = ShardingRule(inputs=((("m",), ("k",)), (("k",), ("n",))), outputs=((("m",), ("n",)),),
                        sizes=(("m", 4), ("k", 6), ("n", 2)), reduce=(("k", "sum"),))
    a, b = rule.inputs
    (c,) = rule.outputs
    assert axis_spec_for_label(c, rule, "k", 2, output=True) == P("sum")
    assert axis_spec_for_label(c, rule, "m", 2, output=True) == S(0)
    assert axis_spec_for_label(b, rule, "m", 2) == R
    assert axis_spec_for_label(a, rule, "k", 3) == S(1)
    assert shard_spec_for_labels(c, rule, ["m", "k"], (2, 3), output=True) == ShardSpec("S(0)P(sum)")
    assert shard_spec_for_labels(c, rule, [None, "n"], (2, 2), output=True) == ShardSpec("RS(1)")


def test_label_errors_say_what_is_wrong():
    rule = ShardingRule(inputs=((("m",), ("k",)),), outputs=((("m",),),),
                        sizes=(("m", 4), ("k", 6)), reduce=(("k", "prod"),))
    with pytest.raises(ShardSpecError, match=r"label k \(size 6\) split 2 ways: outputs would be partial by prod"):
        axis_spec_for_label(rule.outputs[0], rule, "k", 2, output=True)
    mean = ShardingRule(inputs=((("m",), ("k",)),), outputs=((("m",),),),
                        sizes=(("m", 4), ("k", 6)), reduce=(("k", "mean"),))
    assert axis_spec_for_label(mean.outputs[0], mean, "k", 2, output=True) == P("sum")  # pre-scaled shares
    with pytest.raises(ShardSpecError, match="6 is not divisible by 4"):
        axis_spec_for_label(rule.inputs[0], rule, "k", 4)
    diag = ShardingRule(inputs=((("m",), ("m",)),), outputs=((("m",),),), sizes=(("m", 4),))
    with pytest.raises(ShardSpecError, match="one axis spec splits one dim"):
        axis_spec_for_label((("m",), ("m",)), diag, "m", 2)


def reshape_node(src: tuple[int, ...], dst: tuple[int, ...]):
    g = Graph("g", {"": 18})
    x = g.add_input("x", FLOAT, src)
    shape = g.add_constant(TensorData.from_array(np.array(dst, dtype=np.int64)), "shape")
    node = g.add_node("Reshape", [x, shape], output_names=["y"])
    node.outputs[0].dtype, node.outputs[0].shape = FLOAT, dst
    return node


@pytest.mark.parametrize("src, dst", [((2, 3, 12), (2, 3, 4, 3)), ((4, 6), (2, 2, 6)), ((6, 4), (4, 6))])
def test_reshape_rule_specs_make_reshape_local(src, dst):
    """Rhino 4.1: with the strides from the Reshape rule, each device's input shard reshapes to
    its output shard; no resharding is needed around the Reshape."""
    node = reshape_node(src, dst)
    rule = sharding_rule(node)
    assert rule is not None
    x = np.arange(int(np.prod(src))).reshape(src)
    y = x.reshape(dst)
    in_dims, out_dims = rule.inputs[0], rule.outputs[0]
    checked, strided = 0, False
    for label in rule.splittable():
        for n in divisors(rule.size(label))[1:]:
            in_spec = ShardSpec((axis_spec_for_label(in_dims, rule, label, n),))
            out_spec = ShardSpec((axis_spec_for_label(out_dims, rule, label, n, output=True),))
            xs, ys = split(x, in_spec, (n,)), split(y, out_spec, (n,))
            for k in range(n):
                np.testing.assert_array_equal(xs[(k,)], split_array(x, in_dims, rule, label, n, k))
                np.testing.assert_array_equal(ys[(k,)], split_array(y, out_dims, rule, label, n, k))
                np.testing.assert_array_equal(xs[(k,)].reshape(ys[(k,)].shape), ys[(k,)])
            checked += 1
            strided |= any(isinstance(a, Split) and a.stride is not None for a in (*in_spec, *out_spec))
    assert checked and strided
