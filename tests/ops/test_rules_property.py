"""Property tests: every op family's rule holds on random shapes and attributes.

Each example builds a one-node model, imports it, takes the op's rule and checks with
`check_rule` that splitting every splittable label (2, 3 or 4 ways) computes what the whole node
computes; it also checks that the rule is not trivially empty.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opcase import Arg, assert_rule_holds, build

from parc.ops.check import check_rule

OPSET = 21
SIZES = st.sampled_from([1, 2, 3, 4, 6])
BIG = st.sampled_from([2, 4, 6])
props = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def shapes(min_rank: int, max_rank: int, sizes=SIZES):
    return st.lists(sizes, min_size=min_rank, max_size=max_rank).map(tuple)


def randn(rng: np.random.Generator, shape, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def rng_of(data) -> np.random.Generator:
    return np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))


def loop_labels(rule) -> set[str]:
    """Labels of size > 1 that are not marked unsplittable by name (``_`` prefix)."""
    return {lbl for lbl, size in rule.sizes if size > 1 and not lbl.startswith("_")}


# -- contractions -------------------------------------------------------------------------------

@props
@given(st.data())
def test_matmul(data):
    rng = rng_of(data)
    batch = data.draw(shapes(0, 2))
    m, k, n = data.draw(BIG), data.draw(BIG), data.draw(BIG)
    a_vec, b_vec = data.draw(st.booleans()), data.draw(st.booleans())
    a_batch = tuple(d if data.draw(st.booleans()) else 1 for d in batch)
    b_batch = batch[data.draw(st.integers(0, len(batch))):]
    a_shape = (k,) if a_vec else (*a_batch, m, k)
    b_shape = (k,) if b_vec else (*b_batch, k, n)
    rule = assert_rule_holds(build("MatMul", [randn(rng, a_shape), randn(rng, b_shape)], opset=OPSET))
    assert set(rule.splittable()) == loop_labels(rule)
    if not a_vec and not b_vec:
        assert {"m", "k", "n"} <= set(rule.splittable())


@props
@given(st.data())
def test_gemm(data):
    rng = rng_of(data)
    m, k, n = data.draw(BIG), data.draw(BIG), data.draw(BIG)
    ta, tb = data.draw(st.integers(0, 1)), data.draw(st.integers(0, 1))
    c_shape = data.draw(st.sampled_from([None, (), (1,), (n,), (1, n), (m, 1), (m, n)]))
    beta = data.draw(st.sampled_from([1.0, 0.5, 0.0]))
    inputs = [randn(rng, (k, m) if ta else (m, k)), randn(rng, (n, k) if tb else (k, n))]
    if c_shape is not None:
        inputs.append(randn(rng, c_shape))
    rule = assert_rule_holds(build("Gemm", inputs, opset=OPSET, transA=ta, transB=tb,
                                   alpha=data.draw(st.sampled_from([1.0, 2.0])), beta=beta),
                             min_splittable=2)
    assert ("k" in rule.splittable()) == (c_shape is None or beta == 0.0)


def test_gemm_k_split_with_bias_is_wrong():
    """Why k is unsplittable with C: forcing it adds C once per shard."""
    rng = np.random.default_rng(0)
    case = build("Gemm", [randn(rng, (4, 6)), randn(rng, (6, 4)), randn(rng, (4,))], opset=OPSET)
    assert "k" not in case.rule().splittable()
    assert case.check(labels=["k"], ns=(2,))


EINSUMS = ["bij,bjk->bik", "ij,jk", "...ij,...jk->...ik", "bhqd,bhkd->bhqk", "ii->i", "ij->",
           "i,i->", "ijk->kji", "bij,jk->bik", "ij,ij->ij", "i,j->ij", "...i->...", "bii->bi",
           "abc,cd,de->abe", "ij->ji", "Ab,bC->AC"]


@props
@given(st.data())
def test_einsum(data):
    rng = rng_of(data)
    eq = data.draw(st.sampled_from(EINSUMS))
    letters = {ch: data.draw(SIZES) for ch in sorted(set(eq) - set(",->."))}
    ell = data.draw(shapes(0, 2))
    inputs = []
    for term in eq.split("->")[0].split(","):
        head, dots, tail = term.partition("...")
        shape = [letters[c] for c in head] + (list(ell) if dots else []) + [letters[c] for c in tail]
        inputs.append(randn(rng, shape))
    rule = assert_rule_holds(build("Einsum", inputs, opset=OPSET, equation=eq))
    diagonal = any(len(set(t)) != len(t) for t in eq.split("->")[0].replace("...", "").split(","))
    if not diagonal:
        assert set(rule.splittable()) == loop_labels(rule)


# -- convolutions and pools ---------------------------------------------------------------------

def _spatial(data, dims: int, kernel: list[int]) -> dict:
    attrs = {}
    if data.draw(st.booleans()):
        attrs["strides"] = [data.draw(st.integers(1, 2)) for _ in range(dims)]
    if data.draw(st.booleans()):
        attrs["pads"] = [data.draw(st.integers(0, k - 1)) for k in kernel] * 2
    return attrs


@props
@given(st.data())
def test_conv(data):
    rng = rng_of(data)
    dims = data.draw(st.integers(1, 2))
    g = data.draw(st.sampled_from([1, 2, 3]))
    cg, mg, nb = data.draw(SIZES), data.draw(SIZES), data.draw(SIZES)
    kernel = [data.draw(st.integers(1, 3)) for _ in range(dims)]
    spatial = [data.draw(st.integers(3, 5)) for _ in range(dims)]
    attrs = _spatial(data, dims, kernel)
    if data.draw(st.booleans()):
        attrs["dilations"] = [1] * dims
    inputs = [randn(rng, (nb, g * cg, *spatial)), randn(rng, (g * mg, cg, *kernel))]
    bias = data.draw(st.booleans())
    if bias:
        inputs.append(randn(rng, (g * mg,)))
    rule = assert_rule_holds(build("Conv", inputs, opset=OPSET, group=g, kernel_shape=kernel, **attrs))
    want = {lbl for lbl, size in (("n", nb), ("mg", mg), ("cg", cg)) if size > 1 and not (bias and lbl == "cg")}
    assert set(rule.splittable()) == want


@props
@given(st.data())
def test_conv_transpose(data):
    rng = rng_of(data)
    dims = data.draw(st.integers(1, 2))
    g = data.draw(st.sampled_from([1, 2]))
    cg, mg, nb = data.draw(SIZES), data.draw(SIZES), data.draw(SIZES)
    kernel = [data.draw(st.integers(1, 3)) for _ in range(dims)]
    spatial = [data.draw(st.integers(2, 4)) for _ in range(dims)]
    attrs = {}
    if data.draw(st.booleans()):
        attrs["strides"] = [2] * dims
        attrs["output_padding"] = [data.draw(st.integers(0, 1)) for _ in range(dims)]
    inputs = [randn(rng, (nb, g * cg, *spatial)), randn(rng, (g * cg, mg, *kernel))]
    if data.draw(st.booleans()):
        inputs.append(randn(rng, (g * mg,)))
    rule = assert_rule_holds(build("ConvTranspose", inputs, opset=OPSET, group=g, **attrs))
    assert {lbl for lbl, s in (("n", nb), ("mg", mg)) if s > 1} <= set(rule.splittable())


@props
@given(st.data())
def test_pools(data):
    rng = rng_of(data)
    op = data.draw(st.sampled_from(["MaxPool", "AveragePool", "LpPool"]))
    dims = data.draw(st.integers(1, 2))
    kernel = [data.draw(st.integers(1, 3)) for _ in range(dims)]
    nb, c = data.draw(SIZES), data.draw(SIZES)
    x = randn(rng, (nb, c, *[data.draw(st.integers(3, 5)) for _ in range(dims)]))
    attrs = _spatial(data, dims, kernel)
    outputs = 1
    if op == "MaxPool":
        outputs = data.draw(st.integers(1, 2))
    if op == "AveragePool":
        attrs["count_include_pad"] = data.draw(st.integers(0, 1))
    rule = assert_rule_holds(build(op, [x], outputs, opset=OPSET, kernel_shape=kernel, **attrs))
    want = set() if outputs == 2 else {lbl for lbl, s in (("n", nb), ("c", c)) if s > 1}
    assert set(rule.splittable()) == want


@props
@given(st.data())
def test_global_pools(data):
    rng = rng_of(data)
    op = data.draw(st.sampled_from(["GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"]))
    x = randn(rng, data.draw(shapes(3, 4)))
    attrs = {"p": data.draw(st.sampled_from([1, 2]))} if op == "GlobalLpPool" else {}
    rule = assert_rule_holds(build(op, [x], opset=OPSET, **attrs))
    if op != "GlobalLpPool" or attrs["p"] == 1:
        assert set(rule.splittable()) == loop_labels(rule)


# -- normalisations, softmax, losses ------------------------------------------------------------

@props
@given(st.data())
def test_layer_norm(data):
    rng = rng_of(data)
    shape = data.draw(shapes(1, 4))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    normed = shape[axis:]
    inputs = [randn(rng, shape), randn(rng, normed)]
    if data.draw(st.booleans()):
        inputs.append(randn(rng, normed))
    op = data.draw(st.sampled_from(["LayerNormalization", "RMSNormalization"]))
    outputs = data.draw(st.integers(1, 3)) if op == "LayerNormalization" else 1
    rule = assert_rule_holds(build(op, inputs[:2] if op == "RMSNormalization" else inputs, outputs,
                                   opset=23 if op == "RMSNormalization" else OPSET, axis=axis))
    assert len(rule.splittable()) == sum(1 for e in shape[: axis % len(shape)] if e > 1)


def test_omitted_optional_outputs():
    """LayerNormalization(Y, "", InvStdDev): the omitted output carries no labels.

    (BatchNormalization(Y, "", running_var) in training mode would do too, but onnxruntime
    1.31 crashes running it.)
    """
    rng = np.random.default_rng(0)
    case = build("LayerNormalization", [randn(rng, (4, 6)), randn(rng, (6,))], 3, omit=[1], opset=OPSET)
    assert not case.node.outputs[1].name
    rule = assert_rule_holds(case, min_splittable=1)
    assert rule.outputs[1] is None


@props
@given(st.data())
def test_batch_norm(data):
    rng = rng_of(data)
    shape = data.draw(shapes(2, 4))
    c = shape[1]
    training = data.draw(st.booleans())
    inputs = [randn(rng, shape), randn(rng, (c,)), randn(rng, (c,)), randn(rng, (c,)),
              np.abs(randn(rng, (c,))) + 0.5]
    rule = assert_rule_holds(build("BatchNormalization", inputs, 3 if training else 1, opset=OPSET,
                                   training_mode=int(training)))
    want = {"c"} if training else loop_labels(rule)
    assert set(rule.splittable()) == {lbl for lbl in want if rule.size(lbl) > 1}


@props
@given(st.data())
def test_instance_and_group_norm(data):
    rng = rng_of(data)
    op = data.draw(st.sampled_from(["InstanceNormalization", "GroupNormalization"]))
    groups = data.draw(st.sampled_from([1, 2, 3]))
    shape = (data.draw(SIZES), groups * data.draw(SIZES), *data.draw(shapes(1, 2, BIG)))
    c = shape[1]
    attrs = {"num_groups": groups} if op == "GroupNormalization" else {}
    rule = assert_rule_holds(build(op, [randn(rng, shape), randn(rng, (c,)), randn(rng, (c,))],
                                   opset=OPSET, **attrs))
    assert "n" in rule.splittable() or shape[0] == 1


@props
@given(st.data())
def test_axis_norms(data):
    rng = rng_of(data)
    op = data.draw(st.sampled_from(["Softmax", "LogSoftmax", "Hardmax", "LpNormalization"]))
    shape = data.draw(shapes(1, 4))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    attrs = {"axis": axis}
    if op == "LpNormalization":
        attrs["p"] = data.draw(st.sampled_from([1, 2]))
    rule = assert_rule_holds(build(op, [randn(rng, shape)], opset=OPSET, **attrs))
    assert len(rule.splittable()) == sum(1 for d, e in enumerate(shape) if e > 1 and d != axis % len(shape))


@props
@given(st.data())
def test_softmax_before_opset_13(data):
    """Opset 11 coerces the input to 2-D at axis: every dim from axis on stays whole."""
    rng = rng_of(data)
    shape = data.draw(shapes(2, 4, BIG))
    axis = data.draw(st.integers(0, len(shape) - 1))
    op = data.draw(st.sampled_from(["Softmax", "LogSoftmax", "Hardmax"]))
    case = build(op, [randn(rng, shape)], opset=13, axis=axis)
    from parc.ops import sharding_rule

    rule = sharding_rule(case.node, 11)
    assert len(rule.splittable()) == axis
    assert not check_rule(case.node, case.arrays, {"": 11}, rule=rule)
    if axis < len(shape) - 1:  # the opset-13 rule would be wrong under opset 11
        assert check_rule(case.node, case.arrays, {"": 11}, rule=sharding_rule(case.node, 13))


@props
@given(st.data())
def test_losses(data):
    rng = rng_of(data)
    op = data.draw(st.sampled_from(["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"]))
    nb, c = data.draw(BIG), data.draw(st.integers(2, 5))
    extra = data.draw(shapes(0, 2, BIG))
    reduction = data.draw(st.sampled_from(["none", "sum", "mean"]))
    scores = randn(rng, (nb, c, *extra))
    if op == "NegativeLogLikelihoodLoss":
        scores = np.log(np.abs(scores) + 0.1)
    labels = rng.integers(0, c, (nb, *extra)).astype(np.int64)
    inputs = [scores, labels]
    weighted = data.draw(st.booleans())
    if weighted:
        inputs.append(np.abs(randn(rng, (c,))) + 0.1)
    attrs = {"reduction": reduction}
    if data.draw(st.booleans()):
        attrs["ignore_index"] = int(labels.reshape(-1)[0])
    outputs = data.draw(st.integers(1, 2)) if op == "SoftmaxCrossEntropyLoss" else 1
    rule = assert_rule_holds(build(op, inputs, outputs, opset=OPSET, **attrs))
    decomposable = reduction == "sum" or (reduction == "mean" and not weighted and "ignore_index" not in attrs)
    if reduction == "none" or decomposable:  # log_prob splits on n beside the partial loss
        assert "n" in rule.splittable()
    else:
        assert not rule.splittable()


# -- reductions ---------------------------------------------------------------------------------

REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
              "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"]


@props
@given(st.data())
def test_reduce(data):
    rng = rng_of(data)
    op = data.draw(st.sampled_from(REDUCE_OPS))
    shape = data.draw(shapes(1, 4))
    axes = data.draw(st.lists(st.integers(-len(shape), len(shape) - 1), max_size=len(shape),
                              unique_by=lambda a: a % len(shape)))
    dtype = data.draw(st.sampled_from([np.float32, np.float32, np.int64])) \
        if op in ("ReduceSum", "ReduceMax", "ReduceMin", "ReduceMean") else np.float32
    x = randn(rng, shape)
    if op in ("ReduceProd",):
        x = (1 + 0.1 * x).astype(np.float32)
    if op == "ReduceLogSum":
        x = np.abs(x) + 0.1
    if dtype == np.int64:
        x = rng.integers(-50, 50, shape).astype(np.int64)
    attrs = {"keepdims": data.draw(st.integers(0, 1))}
    if not axes and data.draw(st.booleans()):
        attrs["noop_with_empty_axes"] = 1
    inputs = [x] + ([Arg(np.array(axes, dtype=np.int64))] if axes or data.draw(st.booleans()) else [])
    rule = assert_rule_holds(build(op, inputs, opset=18, **attrs))
    assert {lbl for lbl in loop_labels(rule) if lbl not in rule.unsplittable} <= set(rule.splittable())
    reduced = {a % len(shape) for a in axes} if axes or "noop_with_empty_axes" in attrs else set(range(len(shape)))
    kept = {f"d{d}" for d, e in enumerate(shape) if e > 1 and d not in reduced}
    assert kept <= set(rule.splittable())


@props
@given(st.data())
def test_arg_cumsum_topk(data):
    rng = rng_of(data)
    op = data.draw(st.sampled_from(["ArgMax", "ArgMin", "CumSum", "TopK"]))
    shape = data.draw(shapes(1, 3, BIG))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = randn(rng, shape)
    if op in ("ArgMax", "ArgMin"):
        case = build(op, [x], opset=OPSET, axis=axis, keepdims=data.draw(st.integers(0, 1)),
                     select_last_index=data.draw(st.integers(0, 1)))
    elif op == "CumSum":
        case = build(op, [x, Arg(np.array(axis, dtype=np.int64))], opset=OPSET,
                     exclusive=data.draw(st.integers(0, 1)), reverse=data.draw(st.integers(0, 1)))
    else:
        k = data.draw(st.integers(1, shape[axis]))
        case = build(op, [x, Arg(np.array([k], dtype=np.int64))], 2, opset=OPSET, axis=axis,
                     largest=data.draw(st.integers(0, 1)))
    rule = assert_rule_holds(case)
    assert len(rule.splittable()) == len(shape) - 1


# -- data movement ------------------------------------------------------------------------------

def _factorisations(data, total_factors: list[int]) -> tuple[int, ...]:
    """Group a list of prime factors (shuffled) into dims, with some 1s sprinkled in."""
    order = data.draw(st.permutations(total_factors))
    dims, cur = [], 1
    for f in order:
        cur *= f
        if data.draw(st.booleans()):
            dims.append(cur)
            cur = 1
    if cur > 1 or not dims:
        dims.append(cur)
    for _ in range(data.draw(st.integers(0, 1))):
        dims.insert(data.draw(st.integers(0, len(dims))), 1)
    return tuple(dims)


@props
@given(st.data())
def test_reshape(data):
    rng = rng_of(data)
    primes = data.draw(st.lists(st.sampled_from([2, 2, 3]), min_size=1, max_size=5))
    src = _factorisations(data, primes)
    dst = list(_factorisations(data, sorted(primes)) if data.draw(st.booleans())
               else _factorisations(data, primes))
    if data.draw(st.booleans()):
        dst[data.draw(st.integers(0, len(dst) - 1))] = -1
    rule = assert_rule_holds(build("Reshape", [randn(rng, src), Arg(np.array(dst, dtype=np.int64))],
                                   opset=OPSET))
    # Both leading dims divisible by p: the first 1/p of the elements is the first 1/p of either
    # shape, so the rule must offer a split there (a strided spec is not needed for it).
    whole = [e if e != -1 else int(np.prod(src)) // int(np.prod([f for f in dst if f != -1])) for e in dst]
    if math.gcd(src[0], whole[0]) > 1:
        assert rule.splittable(), (src, dst)


def test_reshape_factorisations():
    from parc.ops.shape import reshape_factors

    src_f, dst_f, sizes = reshape_factors((2, 5, 12), (2, 5, 3, 4))
    assert [len(f) for f in src_f] == [1, 1, 2] and [len(f) for f in dst_f] == [1, 1, 1, 1]
    assert src_f[2] == dst_f[2] + dst_f[3]
    src_f, dst_f, sizes = reshape_factors((4, 6), (6, 4))  # outer 2 and inner 2 shared
    assert src_f[0][0] == dst_f[0][0] and src_f[1][-1] == dst_f[1][-1]
    assert sizes[src_f[0][0]] == 2 and sizes[src_f[1][-1]] == 2


@props
@given(st.data())
def test_flatten_squeeze_unsqueeze_transpose(data):
    rng = rng_of(data)
    op = data.draw(st.sampled_from(["Flatten", "Squeeze", "Unsqueeze", "Transpose"]))
    shape = data.draw(shapes(1, 4))
    x = randn(rng, shape)
    if op == "Flatten":
        case = build(op, [x], opset=OPSET, axis=data.draw(st.integers(-len(shape), len(shape))))
    elif op == "Squeeze":
        ones = [d for d, e in enumerate(shape) if e == 1]
        axes = data.draw(st.lists(st.sampled_from(ones), unique=True)) if ones else []
        case = build(op, [x] + ([Arg(np.array(axes, dtype=np.int64))] if axes else []), opset=OPSET)
    elif op == "Unsqueeze":
        rank = len(shape) + data.draw(st.integers(1, 2))
        axes = data.draw(st.lists(st.integers(0, rank - 1), min_size=rank - len(shape),
                                  max_size=rank - len(shape), unique=True))
        case = build(op, [x, Arg(np.array(axes, dtype=np.int64))], opset=OPSET)
    else:
        case = build(op, [x], opset=OPSET, perm=list(data.draw(st.permutations(range(len(shape))))))
    rule = assert_rule_holds(case)
    if op == "Squeeze" and not axes:  # without axes a shard could squeeze a split dim
        assert not rule.splittable()
        return
    assert set(rule.splittable()) == loop_labels(rule)
    assert len(rule.splittable()) == sum(1 for e in shape if e > 1)


@props
@given(st.data())
def test_expand_tile(data):
    rng = rng_of(data)
    shape = data.draw(shapes(1, 3))
    if data.draw(st.booleans()):
        out = [e if e > 1 or data.draw(st.booleans()) else data.draw(BIG) for e in shape]
        out = list(data.draw(shapes(0, 1))) + out
        case = build("Expand", [randn(rng, shape), Arg(np.array(out, dtype=np.int64))], opset=OPSET)
    else:
        reps = [data.draw(st.integers(1, 3)) for _ in shape]
        case = build("Tile", [randn(rng, shape), Arg(np.array(reps, dtype=np.int64))], opset=OPSET)
    rule = assert_rule_holds(case)
    assert set(rule.splittable()) == loop_labels(rule)


@props
@given(st.data())
def test_concat_split(data):
    rng = rng_of(data)
    shape = list(data.draw(shapes(1, 3)))
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    if data.draw(st.booleans()):
        parts = []
        for _ in range(data.draw(st.integers(1, 3))):
            s = list(shape)
            s[axis] = data.draw(st.integers(1, 3))
            parts.append(randn(rng, s))
        case = build("Concat", parts, opset=OPSET, axis=axis)
    else:
        shape[axis] = 6
        sizes = data.draw(st.sampled_from([[6], [3, 3], [2, 4], [1, 2, 3], [2, 2, 2]]))
        if data.draw(st.booleans()):
            case = build("Split", [randn(rng, shape), Arg(np.array(sizes, dtype=np.int64))],
                         len(sizes), opset=OPSET, axis=axis)
        else:
            case = build("Split", [randn(rng, shape)], len(sizes), opset=18, axis=axis,
                         num_outputs=len(sizes))
    rule = assert_rule_holds(case)
    # Equal parts (Rhino's strided case: a fused QKV split) also split the part dim q.
    node, ax = case.node, axis % len(shape)
    pieces = [v for v in (node.inputs if node.op_type == "Concat" else node.outputs) if v is not None]
    q = {v.shape[ax] for v in pieces}
    strided = int(len(pieces) > 1 and len(q) == 1 and q.pop() > 1)
    assert len(rule.splittable()) == strided + sum(1 for d, e in enumerate(shape) if e > 1 and d != ax)


@props
@given(st.data())
def test_slice(data):
    rng = rng_of(data)
    shape = data.draw(shapes(1, 3, st.sampled_from([2, 3, 4, 6])))
    axes = data.draw(st.lists(st.integers(-len(shape), len(shape) - 1), min_size=1,
                              max_size=len(shape), unique_by=lambda a: a % len(shape)))
    starts, ends, steps = [], [], []
    for a in axes:
        n = shape[a]
        step = data.draw(st.sampled_from([1, 1, 2, -1]))
        if step > 0:
            s = data.draw(st.integers(-n, n - 1))
            starts.append(s)
            ends.append(data.draw(st.sampled_from([n, n + 5, -1, 2**62])))
        else:
            starts.append(data.draw(st.sampled_from([-1, n - 1])))
            ends.append(data.draw(st.sampled_from([-n - 1, 0])))
        steps.append(step)
    ints = lambda v: Arg(np.array(v, dtype=np.int64))  # noqa: E731
    inputs = [randn(rng, shape), ints(starts), ints(ends), ints(axes)]
    if data.draw(st.booleans()) or any(s != 1 for s in steps):
        inputs.append(ints(steps))
    rule = assert_rule_holds(build("Slice", inputs, opset=OPSET))
    untouched = [d for d in range(len(shape)) if d not in {a % len(shape) for a in axes}]
    assert {f"d{d}" for d in untouched} <= set(rule.splittable())


@props
@given(st.data())
def test_pad(data):
    rng = rng_of(data)
    shape = data.draw(shapes(1, 3, BIG))
    mode = data.draw(st.sampled_from(["constant", "reflect", "edge", "wrap"]))
    pads = [data.draw(st.integers(0, 1)) for _ in range(2 * len(shape))]
    inputs = [randn(rng, shape), Arg(np.array(pads, dtype=np.int64))]
    if mode == "constant" and data.draw(st.booleans()):
        inputs.append(Arg(np.array(1.5, dtype=np.float32)))
    rule = assert_rule_holds(build("Pad", inputs, opset=OPSET, mode=mode))
    unpadded = {f"d{d}" for d in range(len(shape)) if not pads[d] and not pads[d + len(shape)]}
    assert set(rule.splittable()) == unpadded


@props
@given(st.data())
def test_gathers(data):
    rng = rng_of(data)
    op = data.draw(st.sampled_from(["Gather", "GatherElements", "GatherND"]))
    shape = data.draw(shapes(1, 3, BIG))
    x = randn(rng, shape)
    if op == "Gather":
        axis = data.draw(st.integers(-len(shape), len(shape) - 1))
        idx = rng.integers(-shape[axis], shape[axis], data.draw(shapes(0, 2))).astype(np.int64)
        case = build(op, [x, idx], opset=OPSET, axis=axis)
    elif op == "GatherElements":
        axis = data.draw(st.integers(-len(shape), len(shape) - 1))
        ishape = [e if data.draw(st.booleans()) else data.draw(st.integers(1, e)) for e in shape]
        idx = rng.integers(-shape[axis], shape[axis], ishape).astype(np.int64)
        case = build(op, [x, idx], opset=OPSET, axis=axis)
    else:
        nb = data.draw(st.integers(0, len(shape) - 1))
        m = data.draw(st.integers(1, len(shape) - nb))
        lead = data.draw(shapes(1, 2))  # onnx infers no shape for a rank-0 GatherND output
        idx = np.stack([rng.integers(0, shape[nb + j], (*shape[:nb], *lead)) for j in range(m)], -1)
        case = build(op, [x, idx.astype(np.int64)], opset=OPSET, batch_dims=nb)
    rule = assert_rule_holds(case)
    assert loop_labels(rule) - rule.unsplittable <= set(rule.splittable())


def test_gather_rule_shape():
    rng = np.random.default_rng(0)
    case = build("Gather", [randn(rng, (4, 6, 2)), rng.integers(0, 6, (3, 2)).astype(np.int64)],
                 opset=OPSET, axis=1)
    rule = assert_rule_holds(case, min_splittable=4)
    assert str(rule) == "d0 _1 d2, i0 i1 -> d0 i0 i1 d2 [fixed:_1]"


@props
@given(st.data())
def test_scatters(data):
    rng = rng_of(data)
    op = data.draw(st.sampled_from(["ScatterND", "ScatterElements"]))
    shape = data.draw(shapes(1, 3, BIG))
    x = randn(rng, shape)
    reduction = data.draw(st.sampled_from(["none", "add", "mul", "max", "min"]))
    if op == "ScatterND":
        m = data.draw(st.integers(1, len(shape)))
        cells = list(itertools.product(*[range(e) for e in shape[:m]]))
        count = data.draw(st.integers(1, min(4, len(cells))))
        chosen = rng.choice(len(cells), count, replace=False)
        idx = np.array([cells[i] for i in chosen], dtype=np.int64)
        upd = randn(rng, (count, *shape[m:]))
        case = build(op, [x, idx, upd], opset=18, reduction=reduction)
    else:
        axis = data.draw(st.integers(-len(shape), len(shape) - 1))
        ishape = [e if data.draw(st.booleans()) else data.draw(st.integers(1, e)) for e in shape]
        ishape[axis] = 1  # one update per position: no duplicate indices
        idx = rng.integers(0, shape[axis], ishape).astype(np.int64)
        case = build(op, [x, idx, randn(rng, ishape)], opset=18, axis=axis, reduction=reduction)
    assert_rule_holds(case)


@given(st.data())
def test_scatter_nd_adding_into_zeros_splits_its_updates(data):
    """An embedding's gradient: ScatterND(add) into zeros; the updates' index dims reduce by sum
    (duplicate indices included)."""
    rng = rng_of(data)
    vocab, width = data.draw(st.integers(2, 6)), data.draw(st.integers(1, 4))
    batch = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))
    idx = rng.integers(0, vocab, (*batch, 1)).astype(np.int64)
    upd = randn(rng, (*batch, width))
    rule = assert_rule_holds(build("ScatterND", [Arg(np.zeros((vocab, width), np.float32)), idx, upd],
                                   opset=18, reduction="add"))
    assert dict(rule.reduce) == {f"u{k}": "sum" for k in range(len(batch))}



def test_scatter_nd_adding_into_a_folded_zeros_table_of_any_foldable_size():
    """A mid-size embedding's gradient table (300 x 256, past 65,536 elements), folded into an
    initializer by `parc grad`: still known to be zeros, so the updates still split (this is
    what lets the step run as microbatches)."""
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 300, (2, 3, 1)).astype(np.int64)
    rule = assert_rule_holds(build("ScatterND", [Arg(np.zeros((300, 256), np.float32)), idx,
                                                 randn(rng, (2, 3, 256))], opset=18, reduction="add"))
    assert dict(rule.reduce) == {"u0": "sum", "u1": "sum"}

@props
@given(st.data())
def test_generators_and_misc(data):
    rng = rng_of(data)
    op = data.draw(st.sampled_from(["ConstantOfShape", "Range", "OneHot", "Trilu", "DepthToSpace",
                                    "SpaceToDepth"]))
    if op == "ConstantOfShape":
        shape = data.draw(shapes(1, 3))
        case = build(op, [Arg(np.array(shape, dtype=np.int64))], opset=OPSET,
                     value=onnx.helper.make_tensor("v", onnx.TensorProto.FLOAT, [1], [2.5]))
        rule = assert_rule_holds(case)
        assert len(rule.splittable()) == sum(1 for e in shape if e > 1)
    elif op == "Range":
        args = [Arg(np.array(v, np.float32)) for v in (1.0, data.draw(st.sampled_from([7.0, -3.0])), 1.5)]
        assert_rule_holds(build(op, args, opset=OPSET))
    elif op == "OneHot":
        shape = data.draw(shapes(1, 2))
        idx = rng.integers(-4, 4, shape).astype(np.int64)
        axis = data.draw(st.integers(-len(shape) - 1, len(shape)))
        rule = assert_rule_holds(build(op, [idx, Arg(np.array(4, np.int64)),
                                            Arg(np.array([0.0, 1.0], np.float32))], opset=OPSET,
                                       axis=axis))
        assert len(rule.splittable()) == sum(1 for e in shape if e > 1)
    elif op == "Trilu":
        shape = data.draw(shapes(2, 4))
        inputs = [randn(rng, shape)]
        if data.draw(st.booleans()):
            inputs.append(Arg(np.array(data.draw(st.integers(-2, 2)), np.int64)))
        rule = assert_rule_holds(build(op, inputs, opset=OPSET, upper=data.draw(st.integers(0, 1))))
        assert len(rule.splittable()) == sum(1 for e in shape[:-2] if e > 1)
    else:
        bs = 2
        n, c = data.draw(SIZES), data.draw(SIZES)
        shape = (n, c * bs * bs, 2, 3) if op == "DepthToSpace" else (n, c, 2 * bs, 2 * bs)
        attrs = {"mode": data.draw(st.sampled_from(["DCR", "CRD"]))} if op == "DepthToSpace" else {}
        rule = assert_rule_holds(build(op, [randn(rng, shape)], opset=OPSET, blocksize=bs, **attrs))
        assert len(rule.splittable()) == (n > 1)


@props
@given(st.data())
def test_resize(data):
    rng = rng_of(data)
    n, c = data.draw(SIZES), data.draw(SIZES)
    h, w = data.draw(st.integers(2, 4)), data.draw(st.integers(2, 4))
    mode = data.draw(st.sampled_from(["nearest", "linear", "cubic"]))
    ctm = data.draw(st.sampled_from(["half_pixel", "asymmetric", "align_corners",
                                     "pytorch_half_pixel", "tf_half_pixel_for_nn"]))
    if ctm == "tf_half_pixel_for_nn":
        mode = "nearest"
    sh, sw = data.draw(st.sampled_from([1.0, 2.0, 0.5])), data.draw(st.sampled_from([1.0, 2.0, 1.5]))
    if data.draw(st.booleans()):
        inputs = [randn(rng, (n, c, h, w)), None, Arg(np.array([1, 1, sh, sw], np.float32))]
    else:
        inputs = [randn(rng, (n, c, h, w)), None, None,
                  Arg(np.array([n, c, max(1, int(h * sh)), max(1, int(w * sw))], np.int64))]
    nearest = data.draw(st.sampled_from(["round_prefer_floor", "ceil"]))
    rule = assert_rule_holds(build("Resize", inputs, opset=OPSET, mode=mode,
                                   coordinate_transformation_mode=ctm, nearest_mode=nearest))
    if ctm != "tf_half_pixel_for_nn" or nearest != "ceil":  # ceil samples x + 1 even at scale 1
        assert {lbl for lbl, s in (("d0", n), ("d1", c)) if s > 1} <= set(rule.splittable())


@props
@given(st.data())
def test_grid_sample(data):
    rng = rng_of(data)
    n, c = data.draw(SIZES), data.draw(SIZES)
    ho, wo = data.draw(SIZES), data.draw(SIZES)
    grid = rng.uniform(-1.1, 1.1, (n, ho, wo, 2)).astype(np.float32)
    rule = assert_rule_holds(build("GridSample", [randn(rng, (n, c, 3, 4)), grid], opset=OPSET,
                                   align_corners=data.draw(st.integers(0, 1))))
    assert len(rule.splittable()) == sum(1 for e in (n, c, ho, wo) if e > 1)


# -- elementwise --------------------------------------------------------------------------------

UNARY = ["Erf", "Gelu", "Tanh", "Sqrt", "Reciprocal", "IsNaN", "Relu", "Sigmoid", "Exp", "Log",
         "Neg", "Abs", "Softplus", "HardSwish", "Shrink", "Identity"]
BINARY = ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "PRelu"]


@props
@given(st.data())
def test_elementwise(data):
    rng = rng_of(data)
    shape = data.draw(shapes(0, 4))
    kind = data.draw(st.sampled_from(["unary", "binary", "compare", "where", "clip", "cast", "dropout"]))
    x = randn(rng, shape)
    bshape = tuple(e if data.draw(st.booleans()) else 1 for e in shape)[data.draw(st.integers(0, len(shape))):]
    if kind == "unary":
        op = data.draw(st.sampled_from(UNARY))
        if op in ("Sqrt", "Log"):
            x = np.abs(x) + 0.1
        case = build(op, [x], opset=OPSET)
    elif kind == "binary":
        op = data.draw(st.sampled_from(BINARY))
        if op == "Pow":
            x = np.abs(x) + 0.1
        pair = [x, randn(rng, bshape)]
        if op != "PRelu" and data.draw(st.booleans()):
            pair.reverse()
        case = build(op, pair, opset=OPSET)
    elif kind == "compare":
        op = data.draw(st.sampled_from(["Equal", "Less", "And"]))
        if op == "And":
            case = build(op, [x > 0, randn(rng, bshape) > 0], opset=OPSET)
        else:
            case = build(op, [np.round(x), np.round(randn(rng, bshape))], opset=OPSET)
    elif kind == "where":
        case = build("Where", [randn(rng, bshape) > 0, x, randn(rng, shape[1:])], opset=OPSET)
    elif kind == "clip":
        case = build("Clip", [x, np.array(-0.5, np.float32), np.array(0.5, np.float32)], opset=OPSET)
    elif kind == "cast":
        case = build("Cast", [x * 10], opset=OPSET, to=data.draw(st.sampled_from([6, 7, 11, 10])))
    else:
        case = build("Dropout", [x, Arg(np.array(0.3, np.float32))], data.draw(st.integers(1, 2)),
                     opset=OPSET)
    rule = assert_rule_holds(case)
    assert set(rule.splittable()) == loop_labels(rule)
    assert len(rule.splittable()) == sum(1 for e in case.node.outputs[0].shape if e > 1)


def test_not_and_sum_variadic():
    rng = np.random.default_rng(1)
    assert_rule_holds(build("Not", [randn(rng, (2, 3)) > 0], opset=OPSET), min_splittable=2)
    assert_rule_holds(build("Sum", [randn(rng, (2, 3)), randn(rng, (3,)), randn(rng, (2, 1))],
                            opset=OPSET), min_splittable=2)
