"""Property tests: every gradient rule against float64 finite differences.

Each example builds a one-node model with random shapes and attributes (fd.check_op): the
differentiable inputs are float64 initializers (parameters), the loss is sum_i <y_i, R_i>
for fixed random R_i, and parc's gradients are compared with central differences along
random directions and, for small inputs, element by element (relative error < 1e-6). The
float32 gradient graph is also run in onnxruntime against the float64 gradients.

Runtimes: onnxruntime in float64 (ORT) where it has float64 kernels for the op and for every
op its gradient emits; otherwise ONNX's reference evaluator in float64 (REF), with fd.py's
float64 Erf/Gelu/Conv/ConvTranspose/MaxPool/GlobalMaxPool kernels where onnx's are imprecise
or wrong. Linear ops run by REF (Resize, AveragePool) are also differentiated by onnxruntime's
own float32 forward, to confirm both runtimes compute the same op. Celu and
MeanVarianceNormalization have no float64 form anywhere: float32 finite differences in
onnxruntime, with a looser tolerance (each test says which). Inputs keep away from kinks (Relu
and Abs at 0, Clip bounds, ties of Max/TopK/pools) by a margin wider than the step.
`test_every_rule_is_tested` fails when a registered rule has no test here.
"""

from __future__ import annotations

import numpy as np
import pytest
from fd import ORT, REF, Fed, P, check_op, op_loss_model, parc_gradients
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parc.autodiff.rules import GRADS
from parc.errors import UnsupportedOpError

COVERED: set[str] = set()
props = settings(max_examples=60, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
few = settings(props, max_examples=20)
SIZES = st.integers(1, 4)


def covers(*ops: str):
    """Record that the decorated test checks these ops' rules."""
    COVERED.update(ops)
    return lambda fn: fn


def rng_of(data) -> np.random.Generator:
    return np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))


def shape(data, lo: int = 1, hi: int = 3, sizes=SIZES) -> tuple[int, ...]:
    return tuple(data.draw(st.lists(sizes, min_size=lo, max_size=hi), label="shape"))


def randn(rng: np.random.Generator, shp) -> np.ndarray:
    return rng.standard_normal(shp)


def away(a: np.ndarray, points=(0.0,), margin: float = 0.1) -> np.ndarray:
    """a with entries within `margin` of any of `points` pushed to that distance."""
    a = np.array(a, dtype=np.float64)
    for p in points:
        close = np.abs(a - p) < margin
        a[close] = p + np.where(a[close] >= p, margin, -margin)
    return a


def distinct(rng: np.random.Generator, shp, gap: float = 0.05) -> np.ndarray:
    """Values at least `gap` apart (no ties, none within a step of each other)."""
    n = int(np.prod(shp))
    return (rng.permutation(n) * gap + rng.uniform(0, gap / 4, n) - n * gap / 2).reshape(shp)


def broadcastable(data, shp: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to shp (a suffix, with some dims 1)."""
    k = data.draw(st.integers(0, len(shp)), label="rank")
    return tuple(d if data.draw(st.booleans()) else 1 for d in shp[len(shp) - k:])


def i64(*a) -> np.ndarray:
    return np.array(a, dtype=np.int64)


def maybe_fed(data, index: np.ndarray):
    """Indices as a constant or as a graph input (computed at run time: no constant folding)."""
    return Fed(index) if data.draw(st.booleans(), label="fed") else index


# -- core: arithmetic and activations ------------------------------------------------------------

@covers("Add", "Sub", "Mul", "Div", "Pow")
@props
@given(st.data(), st.sampled_from(["Add", "Sub", "Mul", "Div", "Pow"]))
def test_binary_broadcasting(data, op):
    rng = rng_of(data)
    big = shape(data, 1, 3)
    small = broadcastable(data, big)
    a, b = (big, small) if data.draw(st.booleans()) else (small, big)
    if not a and not b:
        a = (2,)
    x, y = randn(rng, a), randn(rng, b)
    if op == "Div":
        y = away(y, margin=0.5)
    if op == "Pow":
        x = rng.uniform(0.5, 2.0, a)
    inputs = [P(x), P(y)] if a and b else ([P(x), y] if a else [x, P(y)])
    check_op(op, inputs)


@pytest.mark.parametrize("c", [1.0, 2.0, 3.0, 1.5, 2.5, -1.0, 0.5])
def test_pow_by_a_constant_exponent(c):
    """A constant exponent's gradient is written without a Pow where c - 1 is 1, 2 or 0.5; every
    one matches finite differences, on a scalar exponent and on one broadcast as [1, 1]."""
    rng = np.random.default_rng(int(c * 10) + 100)
    x = rng.uniform(0.5, 2.0, (3, 4))
    check_op("Pow", [P(x), np.array(c)])
    check_op("Pow", [P(x), np.array([[c]])])


def test_the_gradient_of_a_square_has_no_pow():
    from onnx import TensorProto, helper, numpy_helper

    from parc.autodiff import differentiate
    from parc.ir.importer import from_model

    x = numpy_helper.from_array(np.ones((4, 8), np.float32), "x")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    nodes = [helper.make_node("Pow", ["x", "two"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [x, two])
    g = from_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    differentiate(g, g.outputs[0], [g.constants["x"]])
    assert [n.op_type for n in g.nodes].count("Pow") == 1  # the forward's only


UNARY = {  # op: (input sampler, runtime)
    "Neg": (lambda rng, s: randn(rng, s), ORT),
    "Sqrt": (lambda rng, s: rng.uniform(0.2, 3, s), ORT),
    "Reciprocal": (lambda rng, s: away(randn(rng, s), margin=0.3), ORT),
    "Exp": (lambda rng, s: randn(rng, s), ORT),
    "Log": (lambda rng, s: rng.uniform(0.2, 3, s), ORT),
    "Tanh": (lambda rng, s: randn(rng, s), ORT),
    "Sigmoid": (lambda rng, s: randn(rng, s), ORT),
    "Relu": (lambda rng, s: away(randn(rng, s)), ORT),
    "Erf": (lambda rng, s: randn(rng, s), REF),
    "Abs": (lambda rng, s: away(randn(rng, s)), ORT),
    "Softplus": (lambda rng, s: 2 * randn(rng, s), ORT),
    "Softsign": (lambda rng, s: 2 * randn(rng, s), ORT),
    "Mish": (lambda rng, s: 2 * randn(rng, s), ORT),
    "HardSwish": (lambda rng, s: away(4 * randn(rng, s), (-3.0, 3.0)), ORT),
    "Sin": (lambda rng, s: 2 * randn(rng, s), ORT),
    "Cos": (lambda rng, s: 2 * randn(rng, s), ORT),
    "Tan": (lambda rng, s: rng.uniform(-1.2, 1.2, s), REF),
    "Asin": (lambda rng, s: rng.uniform(-0.9, 0.9, s), REF),
    "Acos": (lambda rng, s: rng.uniform(-0.9, 0.9, s), REF),
    "Atan": (lambda rng, s: 2 * randn(rng, s), REF),
    "Sinh": (lambda rng, s: randn(rng, s), REF),
    "Cosh": (lambda rng, s: randn(rng, s), REF),
    "Asinh": (lambda rng, s: 2 * randn(rng, s), REF),
    "Acosh": (lambda rng, s: rng.uniform(1.2, 3, s), REF),
    "Atanh": (lambda rng, s: rng.uniform(-0.9, 0.9, s), REF),
}


@covers(*UNARY)
@settings(props, max_examples=240)
@given(st.data(), st.sampled_from(sorted(UNARY)))
def test_unary(data, op):
    rng = rng_of(data)
    sample, runtime = UNARY[op]
    check_op(op, [P(sample(rng, shape(data)))], runtime=runtime)


@covers("Gelu")
@few
@given(st.data(), st.sampled_from(["none", "tanh"]))
def test_gelu(data, approximate):
    rng = rng_of(data)
    check_op("Gelu", [P(2 * randn(rng, shape(data)))], opset=20, runtime=REF, approximate=approximate)


ACTIVATIONS = {  # op: (attributes, kinks, runtime)
    "LeakyRelu": ({"alpha": 0.1}, (0.0,), ORT),
    "Elu": ({"alpha": 0.7}, (0.0,), ORT),
    "Selu": ({}, (0.0,), ORT),
    "HardSigmoid": ({"alpha": 0.3, "beta": 0.4}, (-0.4 / 0.3, 0.6 / 0.3), ORT),
    "Shrink": ({"lambd": 0.6, "bias": 0.2}, (-0.6, 0.6), REF),  # onnxruntime's float64 Shrink rounds to float32
    "ThresholdedRelu": ({"alpha": 0.5}, (0.5,), ORT),
}


@covers(*ACTIVATIONS)
@settings(props, max_examples=120)
@given(st.data(), st.sampled_from(sorted(ACTIVATIONS)))
def test_activation_with_attributes(data, op):
    rng = rng_of(data)
    attrs, kinks, runtime = ACTIVATIONS[op]
    check_op(op, [P(away(2 * randn(rng, shape(data)), kinks))], runtime=runtime, **attrs)


@covers("Celu")
@few
@given(st.data())
def test_celu(data):
    """Celu's schema is float32 only: finite differences in float32 (onnxruntime), with a
    larger step and a looser tolerance."""
    rng = rng_of(data)
    x = away(2 * randn(rng, shape(data)), margin=0.2).astype(np.float32)
    check_op("Celu", [P(x)], h=2e-2, rtol=2e-3, f32=False, alpha=0.8)


@covers("Clip")
@props
@given(st.data(), st.sampled_from(["both", "min", "max", "none"]))
def test_clip(data, bounds):
    rng = rng_of(data)
    lo, hi = -0.5, 0.6
    x = away(2 * randn(rng, shape(data)), (lo, hi))
    inputs = [P(x), P(np.array(lo)) if bounds in ("both", "min") else None,
              P(np.array(hi)) if bounds in ("both", "max") else None]
    while inputs[-1] is None:
        inputs.pop()
    check_op("Clip", inputs)


@covers("PRelu")
@props
@given(st.data())
def test_prelu(data):
    rng = rng_of(data)
    shp = shape(data, 1, 4)
    check_op("PRelu", [P(away(randn(rng, shp))), P(randn(rng, broadcastable(data, shp) or (1,)))])


@covers("Where")
@props
@given(st.data())
def test_where(data):
    rng = rng_of(data)
    shp = shape(data)
    cond = rng.random(broadcastable(data, shp)) > 0.5
    a, b = broadcastable(data, shp) or (1,), broadcastable(data, shp) or (1,)
    check_op("Where", [np.broadcast_to(cond, shp).copy(), P(randn(rng, a)), P(randn(rng, b))])


@covers("Sum", "Mean", "Max", "Min")
@props
@given(st.data(), st.sampled_from(["Sum", "Mean", "Max", "Min"]), st.integers(1, 4))
def test_variadic(data, op, n):
    rng = rng_of(data)
    big = shape(data)
    shapes = [big] + [broadcastable(data, big) or (1,) for _ in range(n - 1)]
    values = distinct(rng, (sum(int(np.prod(s)) for s in shapes),), gap=0.05)
    inputs, start = [], 0
    for s in shapes:
        size = int(np.prod(s))
        inputs.append(P(values[start:start + size].reshape(s)))
        start += size
    check_op(op, inputs, runtime=REF if op == "Mean" else ORT)


def test_max_ties_share_the_gradient():
    """Max(x, x): each input gets half of dy (what the rule documents for ties)."""
    rng = np.random.default_rng(0)
    x = randn(rng, (3,))
    model, names, R = op_loss_model("Max", [P(x), P(x.copy())], {}, 1, 18, rng)
    _, grads = parc_gradients(model, names)
    np.testing.assert_allclose(grads["p0"], R[0][1] / 2)
    np.testing.assert_allclose(grads["p1"], R[0][1] / 2)


@pytest.mark.parametrize("op,make,attrs", [
    ("Mul", lambda x: [x, x], {}),
    ("MatMul", lambda x: [x, x], {}),
    ("Concat", lambda x: [x, x, x], {"axis": 1}),
    ("Einsum", lambda x: [x, x], {"equation": "ij,jk->ik"}),
    ("Sum", lambda x: [x, x, x], {}),
])
def test_one_parameter_read_twice(op, make, attrs):
    """The engine sums a node's contributions to a value it reads in several positions."""
    x = P(np.random.default_rng(1).standard_normal((3, 3)))
    check_op(op, make(x), **attrs)


# -- core: matmul, layout ------------------------------------------------------------------------

@covers("MatMul")
@props
@given(st.data())
def test_matmul(data):
    rng = rng_of(data)
    batch = shape(data, 0, 2)
    m, k, n = (data.draw(SIZES) for _ in range(3))
    a_vec, b_vec = data.draw(st.booleans()), data.draw(st.booleans())
    a_batch = tuple(d if data.draw(st.booleans()) else 1 for d in batch)
    b_batch = batch[data.draw(st.integers(0, len(batch))):]
    a = (k,) if a_vec else (*a_batch, m, k)
    b = (k,) if b_vec else (*b_batch, k, n)
    check_op("MatMul", [P(randn(rng, a)), P(randn(rng, b))])


@covers("Gemm")
@props
@given(st.data())
def test_gemm(data):
    rng = rng_of(data)
    m, k, n = (data.draw(SIZES) for _ in range(3))
    ta, tb = data.draw(st.integers(0, 1)), data.draw(st.integers(0, 1))
    c = data.draw(st.sampled_from([None, (m, n), (n,), (1, n), (m, 1), (1,)]))
    inputs = [P(randn(rng, (k, m) if ta else (m, k))), P(randn(rng, (n, k) if tb else (k, n)))]
    if c is not None:
        inputs.append(P(randn(rng, c)))
    check_op("Gemm", inputs, transA=ta, transB=tb, alpha=data.draw(st.sampled_from([1.0, 0.5])),
             beta=data.draw(st.sampled_from([1.0, -2.0])))


@covers("Transpose")
@props
@given(st.data())
def test_transpose(data):
    rng = rng_of(data)
    shp = shape(data, 1, 4)
    perm = data.draw(st.permutations(range(len(shp))))
    attrs = {"perm": list(perm)} if data.draw(st.booleans()) else {}
    check_op("Transpose", [P(randn(rng, shp))], **attrs)


@covers("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")
@props
@given(st.data(), st.sampled_from(["Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"]))
def test_reshapes(data, op):
    rng = rng_of(data)
    shp = shape(data, 1, 4, st.integers(1, 3))
    x = P(randn(rng, shp))
    if op == "Reshape":
        check_op(op, [x, i64(*(list(rng.permutation(shp)) + [1]))])
    elif op == "Flatten":
        check_op(op, [x], axis=data.draw(st.integers(-len(shp), len(shp))))
    elif op == "Squeeze":
        ones = [i for i, d in enumerate(shp) if d == 1]
        check_op(op, [x, i64(*ones)] if ones and data.draw(st.booleans()) else [x])
    elif op == "Unsqueeze":
        check_op(op, [x, i64(data.draw(st.integers(-len(shp) - 1, len(shp))))])
    else:
        check_op(op, [x])


@covers("Dropout")
@few
@given(st.data(), st.sampled_from(["inference", "ratio0", "no-mode"]))
def test_dropout_deterministic(data, form):
    """Dropout forms without randomness: no training_mode, training_mode off, ratio 0."""
    rng = rng_of(data)
    x = P(randn(rng, shape(data)))
    if form == "inference":
        check_op("Dropout", [x, np.array(0.3), np.array(False)], n_outputs=2, loss_outputs=[0])
    elif form == "ratio0":
        check_op("Dropout", [x, np.array(0.0), np.array(True)], n_outputs=2, loss_outputs=[0])
    else:
        check_op("Dropout", [x])


def test_dropout_training_uses_the_mask():
    """Training-mode Dropout: the gradient is R * mask / (1 - ratio) for the mask drawn in the
    same run (random, so not checked by finite differences)."""
    import onnx
    from onnx import helper, numpy_helper

    from parc.autodiff import differentiate
    from parc.ir import from_model, to_onnx
    rng = np.random.default_rng(0)
    x, r = randn(rng, (4, 5)), randn(rng, (4, 5))
    nodes = [helper.make_node("Dropout", ["x", "ratio", "train"], ["y", "mask"]),
             helper.make_node("Mul", ["y", "r"], ["m"]), helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(a, n) for n, a in
             (("x", x), ("r", r), ("ratio", np.array(0.25)), ("train", np.array(True)))]
    g = helper.make_graph(nodes, "d", [], [helper.make_tensor_value_info("loss", onnx.TensorProto.DOUBLE, [])],
                          initializer=inits)
    graph = from_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8))
    grads = differentiate(graph, graph.outputs[0], [graph.constants["x"]])
    mask = next(n for n in graph.nodes if n.op_type == "Dropout").outputs[1]
    graph.outputs = [graph.outputs[0], grads["x"], mask]
    import onnxruntime as ort
    _, gx, m = ort.InferenceSession(to_onnx(graph).SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, {})
    np.testing.assert_allclose(gx, r * m / 0.75)


@covers("Cast", "CastLike")
@props
@given(st.data(), st.sampled_from(["Cast", "CastLike"]), st.booleans())
def test_casts(data, op, from32):
    """float32 -> float64 and float64 -> float64. The op is linear: a large step is exact but
    for the float32 rounding of the perturbed parameters."""
    rng = rng_of(data)
    x = randn(rng, shape(data)).astype(np.float32 if from32 else np.float64)
    inputs = [P(x)] + ([np.zeros(1)] if op == "CastLike" else [])
    attrs = {"to": 11} if op == "Cast" else {}
    check_op(op, inputs, h=4.0, f32=False, rtol=1e-5 if from32 else 1e-6, **attrs)


@covers("Expand")
@props
@given(st.data())
def test_expand(data):
    rng = rng_of(data)
    big = shape(data, 1, 4)
    small = broadcastable(data, big) or (1,)
    check_op("Expand", [P(randn(rng, small)), i64(*big)])


@covers("Split")
@props
@given(st.data())
def test_split(data):
    """Some outputs left out of the loss: their gradient is zeros."""
    rng = rng_of(data)
    shp = shape(data, 1, 3, st.integers(2, 5))
    axis = data.draw(st.integers(0, len(shp) - 1))
    n = shp[axis]
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=2)))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    used = sorted(data.draw(st.sets(st.integers(0, len(sizes) - 1), min_size=1)))
    check_op("Split", [P(randn(rng, shp)), i64(*sizes)], n_outputs=len(sizes), axis=axis, loss_outputs=used)


@covers("Concat")
@props
@given(st.data(), st.integers(1, 3))
def test_concat(data, n):
    rng = rng_of(data)
    shp = shape(data, 1, 3)
    axis = data.draw(st.integers(-len(shp), len(shp) - 1))
    inputs = []
    for i in range(n):
        s = list(shp)
        s[axis] = data.draw(SIZES)
        a = randn(rng, s)
        inputs.append(a if i and data.draw(st.booleans()) else P(a))
    check_op("Concat", inputs, axis=axis)


@covers("Gather")
@props
@given(st.data())
def test_gather(data):
    rng = rng_of(data)
    shp = shape(data, 1, 3, st.integers(2, 4))
    axis = data.draw(st.integers(-len(shp), len(shp) - 1))
    n = shp[axis]
    idx = rng.integers(-n, n, size=shape(data, 0, 2))
    check_op("Gather", [P(randn(rng, shp)), maybe_fed(data, idx.astype(np.int64))], axis=axis,
             runtime=data.draw(st.sampled_from([ORT, REF])))


# -- core: softmax, reductions, normalization, loss --------------------------------------------

@covers("Softmax", "LogSoftmax")
@props
@given(st.data(), st.sampled_from(["Softmax", "LogSoftmax"]))
def test_softmax(data, op):
    rng = rng_of(data)
    shp = shape(data, 1, 3)
    check_op(op, [P(randn(rng, shp))], axis=data.draw(st.integers(-len(shp), len(shp) - 1)))


def reduce_args(data, rank: int, opset: int, axes_input: bool) -> tuple[list, dict]:
    """Axes as an input (opset >= 18, ReduceSum >= 13) or an attribute; sometimes none."""
    axes = sorted(data.draw(st.sets(st.integers(-rank, rank - 1), max_size=rank), label="axes"))
    axes = sorted({a % rank for a in axes})
    attrs = {"keepdims": data.draw(st.integers(0, 1))}
    if not axes:
        return [], attrs
    if axes_input:
        return [i64(*axes)], attrs
    return [], {**attrs, "axes": axes}


@covers("ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceLogSumExp", "ReduceL2", "ReduceL1",
        "ReduceProd")
@settings(props, max_examples=240)
@given(st.data(), st.sampled_from(["ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceLogSumExp",
                                   "ReduceL2", "ReduceL1", "ReduceProd"]), st.sampled_from([17, 18]))
def test_smooth_reductions(data, op, opset):
    rng = rng_of(data)
    shp = shape(data, 1, 3)
    x = randn(rng, shp)
    if op == "ReduceL1":
        x = away(x)
    if op == "ReduceProd" and data.draw(st.booleans()):  # exact zeros: the rule's special cases
        x.reshape(-1)[rng.choice(x.size, size=min(x.size, data.draw(st.integers(1, 2))), replace=False)] = 0
    extra, attrs = reduce_args(data, len(shp), opset, op == "ReduceSum" or opset >= 18)
    check_op(op, [P(x)] + extra, opset=opset, **attrs)


@covers("ReduceMax", "ReduceMin")
@props
@given(st.data(), st.sampled_from(["ReduceMax", "ReduceMin"]), st.sampled_from([17, 18]))
def test_reduce_max(data, op, opset):
    rng = rng_of(data)
    shp = shape(data, 1, 3)
    extra, attrs = reduce_args(data, len(shp), opset, opset >= 18)
    check_op(op, [P(distinct(rng, shp))] + extra, opset=opset, **attrs)


def test_reduce_max_ties_share_the_gradient():
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]])
    model, names, R = op_loss_model("ReduceMax", [P(x), i64(1)], {"keepdims": 0}, 1, 18, np.random.default_rng(0))
    _, grads = parc_gradients(model, names)
    r = R[0][1]
    np.testing.assert_allclose(grads["p0"], [[0, r[0] / 2, r[0] / 2], [r[1] / 3] * 3])


@covers("LayerNormalization")
@props
@given(st.data(), st.booleans())
def test_layer_norm(data, with_bias):
    rng = rng_of(data)
    shp = shape(data, 1, 3, st.integers(2, 4))
    axis = data.draw(st.integers(-len(shp), len(shp) - 1))
    norm = shp[axis % len(shp):]
    inputs = [P(randn(rng, shp)), P(randn(rng, norm))] + ([P(randn(rng, norm))] if with_bias else [])
    check_op("LayerNormalization", inputs, axis=axis, epsilon=1e-3)


def _loss_case(data, reduction: str, weighted: bool, ignore: bool) -> tuple[list, dict]:
    """Scores [n, c, extra...] (a parameter), labels, optional class weights and the attributes
    of a loss op; with `ignore`, ignore_index is a label that occurs but not everywhere."""
    rng = rng_of(data)
    n, c = data.draw(SIZES), data.draw(st.integers(2, 4))
    extra = shape(data, 0, 1)
    labels = rng.integers(0, c, size=(n, *extra)).astype(np.int64)
    attrs = {"reduction": reduction}
    if ignore:
        attrs["ignore_index"] = int(labels.reshape(-1)[0])
        if (labels == attrs["ignore_index"]).all():
            labels.reshape(-1)[-1] = (attrs["ignore_index"] + 1) % c
    return [P(randn(rng, (n, c, *extra))), labels] + ([rng.uniform(0.5, 2, c)] if weighted else []), attrs


@covers("SoftmaxCrossEntropyLoss")
@props
@given(st.data(), st.sampled_from(["mean", "sum", "none"]), st.booleans(), st.booleans(),
       st.sampled_from([[0], [1], [0, 1]]))
def test_softmax_cross_entropy(data, reduction, weighted, ignore, outputs):
    inputs, attrs = _loss_case(data, reduction, weighted, ignore)
    check_op("SoftmaxCrossEntropyLoss", inputs, n_outputs=2, loss_outputs=outputs, **attrs)


# -- reductions along an axis, indexing ----------------------------------------------------------

@covers("CumSum")
@props
@given(st.data(), st.integers(0, 1), st.integers(0, 1), st.sampled_from([np.int32, np.int64]))
def test_cumsum(data, exclusive, reverse, axis_type):
    rng = rng_of(data)
    shp = shape(data, 1, 3)
    axis = np.array(data.draw(st.integers(-len(shp), len(shp) - 1)), dtype=axis_type)
    check_op("CumSum", [P(randn(rng, shp)), axis], exclusive=exclusive, reverse=reverse)


@covers("TopK")
@props
@given(st.data(), st.integers(0, 1), st.integers(0, 1))
def test_topk(data, largest, sort):
    rng = rng_of(data)
    shp = shape(data, 1, 3)
    axis = data.draw(st.integers(-len(shp), len(shp) - 1))
    k = data.draw(st.integers(1, shp[axis]))
    check_op("TopK", [P(distinct(rng, shp)), i64(k)], n_outputs=2, axis=axis, largest=largest, sorted=sort)


@covers("GatherElements")
@props
@given(st.data())
def test_gather_elements(data):
    """Indices may be shorter than data off the axis, and repeat (the gradient sums)."""
    rng = rng_of(data)
    shp = shape(data, 1, 3, st.integers(1, 4))
    axis = data.draw(st.integers(0, len(shp) - 1))
    idx_shape = tuple(data.draw(st.integers(1, 4)) if d == axis else data.draw(st.integers(1, s))
                      for d, s in enumerate(shp))
    idx = rng.integers(-shp[axis], shp[axis], size=idx_shape)
    check_op("GatherElements", [P(randn(rng, shp)), maybe_fed(data, idx.astype(np.int64))], axis=axis)


@covers("GatherND")
@props
@given(st.data())
def test_gather_nd(data):
    rng = rng_of(data)
    shp = shape(data, 1, 4, st.integers(1, 3))
    b = data.draw(st.integers(0, len(shp) - 1))
    k = data.draw(st.integers(1, len(shp) - b))
    lead = shape(data, 0, 2)
    dims = np.array(shp[b:b + k])
    coords = rng.integers(0, 1 << 30, size=(*shp[:b], *lead, k)) % dims
    if data.draw(st.booleans()):
        coords = coords - dims * rng.integers(0, 2, size=coords.shape)  # negative indices
    check_op("GatherND", [P(randn(rng, shp)), maybe_fed(data, coords.astype(np.int64))], batch_dims=b)


@covers("ScatterND")
@props
@given(st.data(), st.sampled_from(["none", "add"]))
def test_scatter_nd(data, reduction):
    """none: distinct positions (duplicates are undefined); add: repeats allowed."""
    rng = rng_of(data)
    shp = shape(data, 1, 3, st.integers(1, 3))
    k = data.draw(st.integers(1, len(shp)))
    cells = list(np.ndindex(*shp[:k]))
    count = data.draw(st.integers(1, len(cells) if reduction == "none" else 2 * len(cells)))
    picks = rng.choice(len(cells), size=count, replace=reduction == "add")
    idx = np.array([cells[i] for i in picks], dtype=np.int64).reshape(count, k)
    if data.draw(st.booleans()):  # negative indices
        idx = idx - np.array(shp[:k]) * rng.integers(0, 2, size=idx.shape)
    upd = randn(rng, (count, *shp[k:]))
    check_op("ScatterND", [P(randn(rng, shp)), maybe_fed(data, idx), P(upd)], reduction=reduction)


@covers("ScatterElements")
@props
@given(st.data(), st.sampled_from(["none", "add"]))
def test_scatter_elements(data, reduction):
    rng = rng_of(data)
    shp = shape(data, 1, 3, st.integers(1, 4))
    axis = data.draw(st.integers(0, len(shp) - 1))
    n = shp[axis]
    upd_shape = tuple(data.draw(st.integers(1, n)) if d == axis else data.draw(st.integers(1, s))
                      for d, s in enumerate(shp))
    if reduction == "none":  # distinct targets along the axis at every position
        idx = np.argsort(rng.random(upd_shape[:axis] + (n,) + upd_shape[axis + 1:]), axis=axis)
        idx = np.take(idx, range(upd_shape[axis]), axis=axis)
    else:
        idx = rng.integers(0, n, size=upd_shape)
    idx = np.where(rng.random(idx.shape) < 0.3, idx - n, idx).astype(np.int64)
    check_op("ScatterElements", [P(randn(rng, shp)), maybe_fed(data, idx), P(randn(rng, upd_shape))], axis=axis,
             reduction=reduction)


# -- data movement -------------------------------------------------------------------------------

@covers("Slice")
@settings(props, max_examples=180)
@given(st.data())
def test_slice(data):
    """Any steps (negative too), clamped and negative bounds, some axes left out."""
    rng = rng_of(data)
    shp = shape(data, 1, 3, st.integers(1, 5))
    axes = data.draw(st.lists(st.integers(0, len(shp) - 1), unique=True, min_size=1))
    bound = st.integers(-7, 7) | st.sampled_from([2**62, -(2**62)])
    starts = [data.draw(bound) for _ in axes]
    ends = [data.draw(bound) for _ in axes]
    steps = [data.draw(st.sampled_from([1, 1, 2, 3, -1, -2])) for _ in axes]
    neg = [a - len(shp) if data.draw(st.booleans()) else a for a in axes]
    inputs = [P(randn(rng, shp)), i64(*starts), i64(*ends), i64(*neg)]
    if any(s != 1 for s in steps) or data.draw(st.booleans()):
        inputs.append(i64(*steps))
    check_op("Slice", inputs)


@covers("Pad")
@settings(props, max_examples=180)
@given(st.data(), st.sampled_from(["constant", "reflect", "edge", "wrap"]), st.sampled_from([18, 19]))
def test_pad(data, mode, opset):
    """constant pads may be negative (a crop) and the constant a parameter; opset 18 takes axes."""
    rng = rng_of(data)
    if mode == "wrap":
        opset = 19
    shp = shape(data, 1, 3, st.integers(2, 4))
    axes = list(range(len(shp)))
    if data.draw(st.booleans()):
        axes = data.draw(st.lists(st.integers(0, len(shp) - 1), unique=True, min_size=1))
    lo = -1 if mode == "constant" else 0
    before = [data.draw(st.integers(lo, shp[a] - 1 if mode == "reflect" else 3)) for a in axes]
    after = [max(data.draw(st.integers(lo, shp[a] - 1 if mode == "reflect" else 3)), 1 - shp[a] - b)
             for a, b in zip(axes, before)]  # at least one element left
    value = P(np.array(0.7)) if mode == "constant" and data.draw(st.booleans()) else None
    inputs = [P(randn(rng, shp)), i64(*before, *after), value]
    if axes != list(range(len(shp))):
        inputs.append(i64(*axes))
    while inputs[-1] is None:
        inputs.pop()
    check_op("Pad", inputs, opset=opset, mode=mode)


@covers("Tile")
@props
@given(st.data())
def test_tile(data):
    rng = rng_of(data)
    shp = shape(data, 1, 3)
    reps = [data.draw(st.integers(1, 3)) for _ in shp]
    check_op("Tile", [P(randn(rng, shp)), i64(*reps)])


@covers("DepthToSpace", "SpaceToDepth")
@props
@given(st.data(), st.sampled_from(["DCR", "CRD", "S2D"]))
def test_depth_space(data, mode):
    rng = rng_of(data)
    b = data.draw(st.integers(1, 3))
    n, c, h, w = data.draw(SIZES), data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    if mode == "S2D":
        check_op("SpaceToDepth", [P(randn(rng, (n, c, h * b, w * b)))], blocksize=b)
    else:
        check_op("DepthToSpace", [P(randn(rng, (n, c * b * b, h, w)))], blocksize=b, mode=mode)


@covers("Trilu")
@props
@given(st.data(), st.integers(0, 1), st.booleans())
def test_trilu(data, upper, with_k):
    rng = rng_of(data)
    shp = shape(data, 2, 3)
    inputs = [P(randn(rng, shp))] + ([i64(data.draw(st.integers(-3, 3)))] if with_k else [])
    check_op("Trilu", inputs, upper=upper)


# -- convolution and pooling ---------------------------------------------------------------------

def window(data, r: int, pads: bool = True, dilate: bool = True):
    kernel = [data.draw(st.integers(1, 3)) for _ in range(r)]
    strides = [data.draw(st.integers(1, 3)) for _ in range(r)]
    dil = [data.draw(st.integers(1, 2)) if dilate else 1 for _ in range(r)]
    p = [data.draw(st.integers(0, k - 1)) if pads else 0 for k in kernel for _ in (0, 1)]
    return kernel, strides, dil, p[0::2] + p[1::2]


@covers("Conv")
@settings(props, max_examples=150)
@given(st.data(), st.sampled_from(["NOTSET", "NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"]))
def test_conv(data, auto_pad):
    """Any group, stride, dilation, padding; onnxruntime has no float64 Conv (reference runtime,
    plus the float32 graph in onnxruntime). onnxruntime refuses SAME padding with dilation."""
    rng = rng_of(data)
    r = data.draw(st.sampled_from([1, 2, 2, 3]))
    kernel, strides, dil, pads = window(data, r, dilate=not auto_pad.startswith("SAME"))
    g = data.draw(st.integers(1, 2))
    cin, cout = g * data.draw(st.integers(1, 2)), g * data.draw(st.integers(1, 2))
    spatial = [(k - 1) * d + 1 + data.draw(st.integers(0, 4)) for k, d in zip(kernel, dil)]
    x = randn(rng, (data.draw(st.integers(1, 2)), cin, *spatial))
    inputs = [P(x), P(randn(rng, (cout, cin // g, *kernel)))]
    if data.draw(st.booleans()):
        inputs.append(P(randn(rng, (cout,))))
    attrs = {"strides": strides, "dilations": dil, "group": g, "auto_pad": auto_pad}
    if auto_pad == "NOTSET":
        attrs["pads"] = pads
    check_op("Conv", inputs, runtime=REF, **attrs)


@covers("ConvTranspose")
@settings(props, max_examples=150)
@given(st.data())
def test_conv_transpose(data):
    """Explicit pads and output_padding (below the stride, as onnxruntime requires)."""
    rng = rng_of(data)
    r = data.draw(st.sampled_from([1, 2, 2, 3]))
    kernel, strides, dil, pads = window(data, r)
    out_pad = [data.draw(st.integers(0, s - 1)) for s in strides]
    g = data.draw(st.integers(1, 2))
    cin, cout = g * data.draw(st.integers(1, 2)), g * data.draw(st.integers(1, 2))
    spatial = [data.draw(st.integers(1, 4)) for _ in range(r)]
    full = [s * (i - 1) + o + (k - 1) * d + 1 for s, i, o, k, d in zip(strides, spatial, out_pad, kernel, dil)]
    pads = [min(p, (f - 1) // 2) for p, f in zip(pads, full + full)]  # leave a non-empty output
    inputs = [P(randn(rng, (data.draw(st.integers(1, 2)), cin, *spatial))), P(randn(rng, (cin, cout // g, *kernel)))]
    if data.draw(st.booleans()):
        inputs.append(P(randn(rng, (cout,))))
    check_op("ConvTranspose", inputs, runtime=REF, strides=strides, dilations=dil, group=g, pads=pads,
             output_padding=out_pad)


def ceil_agrees(spatial, kernel, strides, pads, dilations) -> bool:
    """Whether ceil_mode's extra window starts inside the input or its left padding: otherwise
    onnxruntime drops it (as PyTorch does) and ONNX shape inference does not."""
    r = len(spatial)
    for i in range(r):
        span = (kernel[i] - 1) * dilations[i] + 1
        out = -(-(spatial[i] + pads[i] + pads[i + r] - span) // strides[i]) + 1
        if (out - 1) * strides[i] >= spatial[i] + pads[i]:
            return False
    return True


@covers("MaxPool")
@settings(props, max_examples=150)
@given(st.data(), st.integers(0, 1), st.integers(1, 2))
def test_max_pool(data, ceil_mode, n_outputs):
    """Distinct values: no ties within a window. Sometimes the forward has an Indices output (the
    rule reuses it when row-major) and strides left to their default."""
    rng = rng_of(data)
    r = data.draw(st.integers(1, 2))
    kernel, strides, dil, pads = window(data, r)
    pads = [min(p, k // 2) for p, k in zip(pads, kernel + kernel)]
    spatial = [(k - 1) * d + 1 + data.draw(st.integers(0, 4)) for k, d in zip(kernel, dil)]
    x = distinct(rng, (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)), *spatial))
    explicit = data.draw(st.booleans())
    if not explicit:
        strides = [1] * r
    ceil_mode = ceil_mode if ceil_agrees(spatial, kernel, strides, pads, dil) else 0
    attrs = {"kernel_shape": kernel, "dilations": dil, "pads": pads, "ceil_mode": ceil_mode,
             "storage_order": data.draw(st.integers(0, 1))}
    if explicit:
        attrs["strides"] = strides
    check_op("MaxPool", [P(x)], n_outputs=n_outputs, loss_outputs=[0], **attrs)


@covers("AveragePool")
@settings(props, max_examples=150)
@given(st.data(), st.integers(0, 1), st.integers(0, 1),
       st.sampled_from(["NOTSET", "NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"]))
def test_average_pool(data, ceil_mode, count_include_pad, auto_pad):
    """No float64 AveragePool in onnxruntime: the reference runtime, and onnxruntime's own
    float32 forward by exact differences (the op is linear) for its conventions. onnx's
    reference AveragePool fails on SAME padding and divides partial ceil_mode windows unlike
    onnxruntime: those cases are checked in float32 only (onnxruntime forward and gradient)."""
    rng = rng_of(data)
    r = data.draw(st.integers(1, 2))
    kernel, strides, dil, pads = window(data, r, dilate=auto_pad == "NOTSET")
    pads = [min(p, k // 2) for p, k in zip(pads, kernel + kernel)]
    if auto_pad.startswith("SAME"):  # onnxruntime fails where SAME would need negative padding
        strides = [min(s, k) for s, k in zip(strides, kernel)]
    spatial = [(k - 1) * d + 1 + data.draw(st.integers(0, 4)) for k, d in zip(kernel, dil)]
    x = randn(rng, (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)), *spatial))
    attrs = {"kernel_shape": kernel, "strides": strides, "count_include_pad": count_include_pad,
             "auto_pad": auto_pad}
    ceil_mode = ceil_mode if ceil_agrees(spatial, kernel, strides, pads, dil) else 0
    if auto_pad == "NOTSET":
        attrs.update(pads=pads, ceil_mode=ceil_mode, dilations=dil)
    # The reference and onnxruntime divide partial ceil_mode windows differently: float32 only.
    f64 = not auto_pad.startswith("SAME") and not attrs.get("ceil_mode")
    check_op("AveragePool", [P(x)], runtime=REF, linear=True, f64=f64, opset=19, **attrs)


@covers("GlobalAveragePool", "GlobalMaxPool")
@props
@given(st.data(), st.sampled_from(["GlobalAveragePool", "GlobalMaxPool"]))
def test_global_pool(data, op):
    rng = rng_of(data)
    shp = (data.draw(SIZES), data.draw(SIZES), *shape(data, 1, 2))
    check_op(op, [P(distinct(rng, shp))], runtime=REF)


# -- normalization -------------------------------------------------------------------------------

@covers("BatchNormalization")
@props
@given(st.data(), st.integers(0, 1))
def test_batch_norm(data, training):
    """Inference form: all five inputs differentiated; training form: x, scale, bias."""
    rng = rng_of(data)
    shp = (data.draw(st.integers(2, 3)), data.draw(SIZES), *shape(data, 0, 2))
    c = shp[1]
    stats = [randn(rng, c), rng.uniform(0.5, 2, c)]
    inputs = [P(randn(rng, shp)), P(randn(rng, c)), P(randn(rng, c))]
    inputs += stats if training else [P(s) for s in stats]
    check_op("BatchNormalization", inputs, n_outputs=3 if training else 1, loss_outputs=[0],
             training_mode=training, epsilon=1e-3, opset=15)


@covers("InstanceNormalization")
@props
@given(st.data())
def test_instance_norm(data):
    rng = rng_of(data)
    shp = (data.draw(SIZES), data.draw(SIZES), *shape(data, 1, 2, st.integers(2, 4)))
    c = shp[1]
    check_op("InstanceNormalization", [P(randn(rng, shp)), P(randn(rng, c)), P(randn(rng, c))],
             runtime=REF, epsilon=1e-3)


@covers("GroupNormalization")
@props
@given(st.data())
def test_group_norm(data):
    """Opset 21 (onnx deprecates the opset-18 form); stash_type=11 makes onnxruntime keep its
    statistics in float64."""
    rng = rng_of(data)
    groups = data.draw(st.integers(1, 3))
    shp = (data.draw(SIZES), groups * data.draw(st.integers(1, 2)), *shape(data, 1, 2, st.integers(2, 3)))
    c = shp[1]
    check_op("GroupNormalization", [P(randn(rng, shp)), P(randn(rng, c)), P(randn(rng, c))], opset=21,
             num_groups=groups, epsilon=1e-3, stash_type=11)


@covers("RMSNormalization")
@props
@given(st.data())
def test_rms_norm(data):
    rng = rng_of(data)
    shp = shape(data, 1, 3, st.integers(2, 4))
    axis = data.draw(st.integers(-len(shp), len(shp) - 1))
    scale = broadcastable(data, shp[axis % len(shp):]) or (1,)
    check_op("RMSNormalization", [P(randn(rng, shp)), P(randn(rng, scale))], opset=23, axis=axis, epsilon=1e-3)


@covers("LpNormalization")
@props
@given(st.data(), st.sampled_from([1, 2]))
def test_lp_norm(data, p):
    rng = rng_of(data)
    shp = shape(data, 1, 3, st.integers(2, 4))
    x = away(randn(rng, shp)) if p == 1 else randn(rng, shp)
    check_op("LpNormalization", [P(x)], axis=data.draw(st.integers(-len(shp), len(shp) - 1)), p=p)


@covers("MeanVarianceNormalization")
@props
@given(st.data())
def test_mean_variance_norm(data):
    """ONNX's MVN function adds a float32 epsilon, so no runtime runs it in float64: finite
    differences in float32 (onnxruntime), with a larger step and a looser tolerance."""
    rng = rng_of(data)
    shp = shape(data, 2, 4, st.integers(3, 4))  # groups of 2 normalize to exactly +-1
    axes = sorted(data.draw(st.sets(st.integers(0, len(shp) - 1), min_size=1)))
    check_op("MeanVarianceNormalization", [P(randn(rng, shp).astype(np.float32))], h=2e-2, rtol=3e-3,
             f32=False, axes=axes)


@covers("NegativeLogLikelihoodLoss")
@props
@given(st.data(), st.sampled_from(["mean", "sum", "none"]), st.booleans(), st.booleans())
def test_nll_loss(data, reduction, weighted, ignore):
    inputs, attrs = _loss_case(data, reduction, weighted, ignore)
    check_op("NegativeLogLikelihoodLoss", inputs, **attrs)


# -- Einsum, Resize ------------------------------------------------------------------------------

@covers("Einsum")
@settings(props, max_examples=240)
@given(st.data())
def test_einsum(data):
    """Random equations: 1-3 operands, repeated labels (diagonals), labels summed in one
    operand only, implicit output, broadcast ellipsis."""
    rng = rng_of(data)
    sizes = {c: data.draw(st.integers(1, 3)) for c in "abcd"}
    n = data.draw(st.integers(1, 3))
    ellipsis = data.draw(st.booleans())
    ell = shape(data, 1, 2, st.integers(1, 3)) if ellipsis else ()
    terms, shapes = [], []
    for _ in range(n):
        labels = data.draw(st.lists(st.sampled_from("abcd"), min_size=0 if ellipsis else 1, max_size=3))
        shp = [sizes[c] for c in labels]
        term = "".join(labels)
        if ellipsis:
            at = data.draw(st.integers(0, len(labels)))
            own = tuple(d if data.draw(st.booleans()) else 1 for d in ell)
            term = term[:at] + "..." + term[at:]
            shp = shp[:at] + list(own) + shp[at:]
        terms.append(term)
        shapes.append(tuple(shp))
    used = sorted({c for t in terms for c in t if c.isalpha()})
    if data.draw(st.booleans()):
        out = "".join(data.draw(st.permutations(used))[:data.draw(st.integers(0, len(used)))])
        equation = ",".join(terms) + "->" + ("..." if ellipsis else "") + out
    else:
        equation = ",".join(terms)
    check_op("Einsum", [P(randn(rng, s)) for s in shapes], equation=equation)


def resize_refused(attrs: dict, shp: tuple[int, ...], scales) -> bool:
    """The forms the Resize rule refuses: where onnxruntime and ONNX's reference disagree."""
    transform = attrs["coordinate_transformation_mode"]
    if transform in ("tf_crop_and_resize", "half_pixel_symmetric"):
        return True
    if transform == "pytorch_half_pixel" and (attrs["mode"] == "cubic" or attrs.get("antialias")):
        return True
    return transform in ("align_corners", "pytorch_half_pixel") and scales is not None and any(
        n * s != round(n * s) for n, s in zip(shp, scales))


@covers("Resize")
@settings(props, max_examples=240)
@given(st.data(), st.sampled_from(["nearest", "linear", "cubic"]),
       st.sampled_from(["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize",
                        "half_pixel_symmetric"]),
       st.sampled_from(["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]))
def test_resize(data, mode, transform, nearest_mode):
    """No float64 Resize in onnxruntime: the reference runtime, and onnxruntime's float32
    forward by exact differences (Resize is linear) to confirm both agree. Forms where they
    disagree must be refused."""
    rng = rng_of(data)
    spatial_rank = 2 if mode == "cubic" else data.draw(st.integers(1, 2))  # onnxruntime: bicubic only
    shp = (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)),
           *shape(data, spatial_rank, spatial_rank, st.integers(2, 5)))
    attrs = {"mode": mode, "coordinate_transformation_mode": transform}
    if mode == "nearest":
        attrs["nearest_mode"] = nearest_mode
    if mode != "nearest" and data.draw(st.booleans()):
        attrs["antialias"] = 1
    roi = np.array([0, 0] + [0.1] * spatial_rank + [1, 1] + [0.9] * spatial_rank) \
        if transform == "tf_crop_and_resize" else None
    scales = None
    if data.draw(st.booleans()):
        scales = np.array([1, 1] + [data.draw(st.sampled_from([0.5, 0.75, 1.5, 2.0, 3.0])) for _ in shp[2:]],
                          dtype=np.float32)
        inputs = [P(randn(rng, shp)), roi, scales]
    else:
        sizes = i64(*shp[:2], *[data.draw(st.integers(1, 7)) for _ in shp[2:]])
        inputs = [P(randn(rng, shp)), roi, None, sizes]
    if resize_refused(attrs, shp, scales):
        with pytest.raises(UnsupportedOpError, match="disagree"):
            check_op("Resize", inputs, opset=19, runtime=REF, **attrs)
    else:
        check_op("Resize", inputs, opset=19, runtime=REF, linear=True, **attrs)


# -- what has no gradient -----------------------------------------------------------------------

@pytest.mark.parametrize("op,inputs,attrs,n_outputs", [
    ("ScatterND", [np.zeros((3, 2)), i64([0]), np.ones((1, 2))], {"reduction": "mul"}, 1),
    ("Resize", [np.zeros((1, 1, 2, 2)), None, None, i64(1, 1, 4, 3)], {"keep_aspect_ratio_policy": "not_larger"}, 1),
    ("ConvTranspose", [np.zeros((1, 1, 3)), np.ones((1, 1, 2))], {"auto_pad": "SAME_UPPER"}, 1),
    ("Dropout", [np.ones((2, 3)), np.array(0.5), np.array(True)], {}, 1),  # training mode, no mask output
    ("LayerNormalization", [np.ones((2, 3)), np.ones(3)], {}, 2),  # its Mean output in the loss
])
def test_unsupported_forms_are_reported(op, inputs, attrs, n_outputs):
    """Forms a rule cannot differentiate raise UnsupportedOpError naming the node."""
    inputs = [P(a) if i == 0 else a for i, a in enumerate(inputs)]
    model, names, _ = op_loss_model(op, inputs, attrs, n_outputs, 19, np.random.default_rng(0), np.float32)
    with pytest.raises(UnsupportedOpError, match=op):
        parc_gradients(model, names)


def test_every_rule_is_tested():
    missing = sorted(set(GRADS) - COVERED)
    assert not missing, f"gradient rules without a finite-difference test: {missing}"
