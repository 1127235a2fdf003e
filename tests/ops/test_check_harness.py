"""The property-check harness: splitting and merging arrays, and catching wrong rules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opcase import build

from parc.ops.base import ShardingRule
from parc.ops.check import combine_partial, compare, merge_arrays, split_array


def _rule(dims, sizes) -> ShardingRule:
    return ShardingRule((tuple(dims),), (tuple(dims),), tuple(sizes.items()))


def test_split_contiguous():
    a = np.arange(12).reshape(4, 3)
    rule = _rule([("m",), ("n",)], {"m": 4, "n": 3})
    dims = rule.inputs[0]
    assert split_array(a, dims, rule, "m", 2, 1).tolist() == [[6, 7, 8], [9, 10, 11]]
    assert split_array(a, dims, rule, "n", 3, 2).tolist() == [[2], [5], [8], [11]]


def test_split_inner_factor_is_strided():
    """(h d) with d split: each shard gets a strided piece of the merged dim (Rhino 4.1)."""
    a = np.arange(6)  # h=3 outer, d=2 inner
    rule = _rule([("h", "d")], {"h": 3, "d": 2})
    dims = rule.inputs[0]
    assert split_array(a, dims, rule, "d", 2, 0).tolist() == [0, 2, 4]
    assert split_array(a, dims, rule, "d", 2, 1).tolist() == [1, 3, 5]
    assert split_array(a, dims, rule, "h", 3, 1).tolist() == [2, 3]


def test_split_leaves_other_tensors_whole():
    a = np.arange(6).reshape(2, 3)
    rule = _rule([("m",), ("n",)], {"m": 2, "n": 3, "k": 4})
    assert split_array(a, rule.inputs[0], rule, "k", 2, 0) is a
    assert split_array(a, None, rule, "m", 2, 0) is a


def test_split_rejects_uneven_and_mismatched():
    rule = _rule([("m",)], {"m": 3})
    with pytest.raises(ValueError):
        split_array(np.arange(3), rule.inputs[0], rule, "m", 2, 0)
    with pytest.raises(ValueError):
        split_array(np.arange(4), rule.inputs[0], rule, "m", 3, 0)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_split_merge_round_trip(data):
    """merge(split(a)) == a for every label, including inner and middle factors of groups."""
    rank = data.draw(st.integers(1, 3))
    dims, sizes, n_label = [], {}, 0
    for _ in range(rank):
        factors = data.draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=0, max_size=3))
        dim = []
        for f in factors:
            name = f"l{n_label}"
            n_label += 1
            sizes[name] = f
            dim.append(name)
        dims.append(tuple(dim))
    rule = _rule(dims, sizes)
    shape = tuple(int(np.prod([sizes[lbl] for lbl in dim])) for dim in dims)
    a = np.arange(int(np.prod(shape))).reshape(shape)
    for label, size in sizes.items():
        for n in (d for d in (2, 3, 4) if size % d == 0):
            parts = [split_array(a, rule.inputs[0], rule, label, n, k) for k in range(n)]
            assert sum(p.size for p in parts) == a.size
            np.testing.assert_array_equal(merge_arrays(parts, rule.inputs[0], rule, label, n), a)


def test_combine_partial_kinds():
    parts = [np.array([1.0, 5.0]), np.array([3.0, 2.0])]
    assert combine_partial(parts, "sum").tolist() == [4.0, 7.0]
    assert combine_partial(parts, "max").tolist() == [3.0, 5.0]
    assert combine_partial(parts, "min").tolist() == [1.0, 2.0]
    assert combine_partial(parts, "prod").tolist() == [3.0, 10.0]
    assert combine_partial(parts, "mean").tolist() == [2.0, 3.5]


def test_compare_is_exact_for_integers():
    assert compare(np.array([1, 2]), np.array([1, 2]), 1e-4, 1e-5) is None
    assert compare(np.array([1, 3]), np.array([1, 2]), 1e-4, 1e-5)
    assert compare(np.array([1.0, np.nan]), np.array([1.0, np.nan]), 1e-4, 1e-5) is None
    assert compare(np.array([1.0]), np.array([1.1]), 1e-4, 1e-5)


def _softmax_case():
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    return build("Softmax", [x], opset=13, axis=-1)


def test_softmax_rule_holds():
    case = _softmax_case()
    assert case.rule().splittable() == ["d0"]
    assert case.check() == []


def test_wrong_rule_is_caught():
    """Softmax with its axis splittable is wrong, and check_rule says so."""
    case = _softmax_case()
    good = case.rule()
    wrong = ShardingRule(good.inputs, good.outputs, good.sizes)  # forgets unsplittable
    assert "d1" in wrong.splittable()
    failures = case.check(rule=wrong)
    assert failures and all("label d1" in f for f in failures)


def test_wrong_reduce_kind_is_caught():
    """ReduceMax combined by sum instead of max is caught."""
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    case = build("ReduceMax", [x], opset=13, axes=[1])
    good = case.rule()
    assert dict(good.reduce) == {"d1": "max"} and case.check() == []
    wrong = ShardingRule(good.inputs, good.outputs, good.sizes, (("d1", "sum"),))
    assert case.check(rule=wrong)


def test_wrong_strided_mapping_is_caught():
    """Reshape (6,) -> (2, 3) labelled with the group in the wrong order is caught."""
    x = np.arange(6, dtype=np.float32)
    from opcase import Arg

    case = build("Reshape", [x, Arg(np.array([2, 3], dtype=np.int64))], opset=13)
    good = case.rule()
    assert case.check() == []
    (a, b), = good.inputs[0]
    wrong = ShardingRule((((b, a),), None), good.outputs, good.sizes, shape_args=good.shape_args)
    assert case.check(rule=wrong)


def test_fused_qkv_split_is_strided_and_holds(tmp_path):
    """Rhino 4.1: splitting a fused QKV projection's per-part dim is a strided split of its input."""
    import numpy as np

    from parc.ir import load
    from parc.models import build_model
    from parc.ops import sharding_rule
    from parc.ops.check import check_rule

    graph = load(build_model("gpt-tiny", tmp_path / "g.onnx"))
    split = next(n for n in graph.nodes if n.op_type == "Split")
    rule = sharding_rule(split)
    x = split.inputs[0]
    q = rule.outputs[0][-1][0]
    assert rule.inputs[0][-1] == ("_p", q) and q in rule.splittable()
    data = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    assert check_rule(split, [data, split.inputs[1].const.numpy()], graph.opset, labels=[q]) == []
