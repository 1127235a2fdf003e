"""Elementwise kernels: arithmetic, comparisons, logic, activations, Cast, Clip, Where."""

from __future__ import annotations

import functools
import math

import numpy as np
from onnx import TensorProto, helper

from parc.exec.engines import gpu
from parc.exec.engines.kernels import Kernel, Maker, NodeInfo, Unsupported, special

# ONNX element types the engine computes with (no strings, float8 or packed ints). bfloat16 is
# ml_dtypes' type (onnx's own dependency; CuPy reads it too): mixed-precision steps hold it.
DTYPES: dict[int, np.dtype] = {t: np.dtype(helper.tensor_dtype_to_np_dtype(t)) for t in (
    TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.BOOL,
    TensorProto.INT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
    TensorProto.UINT8, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64)}


def dtype_of(elem_type: int, what: str) -> np.dtype:
    if elem_type not in DTYPES:
        raise Unsupported(f"{what} of type {helper.tensor_dtype_to_string(elem_type)}")
    return DTYPES[elem_type]


def _is_int(a) -> bool:
    return a.dtype.kind in "iu"


# Unary ops that need nothing but xp: op -> (xp, x) -> y.
_UNARY = {
    "Abs": lambda xp, x: xp.abs(x),
    "Neg": lambda xp, x: xp.negative(x),
    "Exp": lambda xp, x: xp.exp(x),
    "Log": lambda xp, x: xp.log(x),
    "Sqrt": lambda xp, x: xp.sqrt(x),
    "Reciprocal": lambda xp, x: xp.reciprocal(x),
    "Floor": lambda xp, x: xp.floor(x),
    "Ceil": lambda xp, x: xp.ceil(x),
    "Round": lambda xp, x: xp.round(x),  # half to even, as ONNX
    "Sign": lambda xp, x: xp.sign(x),
    "Sin": lambda xp, x: xp.sin(x),
    "Cos": lambda xp, x: xp.cos(x),
    "Tan": lambda xp, x: xp.tan(x),
    "Asin": lambda xp, x: xp.arcsin(x),
    "Acos": lambda xp, x: xp.arccos(x),
    "Atan": lambda xp, x: xp.arctan(x),
    "Sinh": lambda xp, x: xp.sinh(x),
    "Cosh": lambda xp, x: xp.cosh(x),
    "Asinh": lambda xp, x: xp.arcsinh(x),
    "Acosh": lambda xp, x: xp.arccosh(x),
    "Atanh": lambda xp, x: xp.arctanh(x),
    "Tanh": lambda xp, x: xp.tanh(x),
    "Relu": lambda xp, x: xp.maximum(x, 0),
    "Softsign": lambda xp, x: x / (1 + xp.abs(x)),
    "Softplus": lambda xp, x: xp.logaddexp(x, 0).astype(x.dtype, copy=False),
    "Mish": lambda xp, x: x * xp.tanh(xp.logaddexp(x, 0).astype(x.dtype, copy=False)),
    "HardSwish": lambda xp, x: x * xp.clip(x / 6 + 0.5, 0, 1),
    "IsNaN": lambda xp, x: xp.isnan(x),
    "Not": lambda xp, x: xp.logical_not(x),
    "BitwiseNot": lambda xp, x: xp.invert(x),
    "Identity": lambda xp, x: x,
}

# Binary ops with ONNX's (numpy's) multidirectional broadcasting.
_BINARY = {
    "Add": lambda xp, a, b: xp.add(a, b),
    "Sub": lambda xp, a, b: xp.subtract(a, b),
    "Mul": lambda xp, a, b: xp.multiply(a, b),
    "Equal": lambda xp, a, b: xp.equal(a, b),
    "Less": lambda xp, a, b: xp.less(a, b),
    "LessOrEqual": lambda xp, a, b: xp.less_equal(a, b),
    "Greater": lambda xp, a, b: xp.greater(a, b),
    "GreaterOrEqual": lambda xp, a, b: xp.greater_equal(a, b),
    "And": lambda xp, a, b: xp.logical_and(a, b),
    "Or": lambda xp, a, b: xp.logical_or(a, b),
    "Xor": lambda xp, a, b: xp.logical_xor(a, b),
    "BitwiseAnd": lambda xp, a, b: xp.bitwise_and(a, b),
    "BitwiseOr": lambda xp, a, b: xp.bitwise_or(a, b),
    "BitwiseXor": lambda xp, a, b: xp.bitwise_xor(a, b),
}

# Variadic ops folded pairwise with broadcasting.
_VARIADIC = {"Max": "maximum", "Min": "minimum", "Sum": "add", "Mean": "add"}


def _unary(fn) -> Maker:
    def make(n: NodeInfo) -> Kernel:
        xp = n.xp
        return lambda x: (fn(xp, x),)
    return make


def _binary(fn) -> Maker:
    def make(n: NodeInfo) -> Kernel:
        xp = n.xp
        return lambda a, b: (fn(xp, a, b),)
    return make


def _variadic(op: str) -> Maker:
    def make(n: NodeInfo) -> Kernel:
        ufunc = getattr(n.xp, _VARIADIC[op])
        if op == "Mean":
            return lambda *xs: (functools.reduce(ufunc, xs) / len(xs),)
        return lambda *xs: (functools.reduce(ufunc, xs),)
    return make


def make_div(n: NodeInfo) -> Kernel:
    xp = n.xp

    def div(a, b):
        if not _is_int(a):
            return (xp.divide(a, b),)
        # Integer division truncates toward zero (C), not toward -inf (Python).
        q = xp.floor_divide(a, b)
        fix = (xp.remainder(a, b) != 0) & ((a < 0) ^ (b < 0))
        return (q + fix.astype(q.dtype),)
    return div


def make_pow(n: NodeInfo) -> Kernel:
    xp = n.xp

    def pow_(a, b):
        if _is_int(a) and not _is_int(b):
            return (xp.power(a.astype(b.dtype), b).astype(a.dtype),)
        return (xp.power(a, b).astype(a.dtype, copy=False),)  # the exponent's type never wins
    return pow_


def make_mod(n: NodeInfo) -> Kernel:
    xp = n.xp
    if n.attr("fmod", 0):
        return lambda a, b: (xp.fmod(a, b),)

    def mod(a, b):
        if not xp.issubdtype(xp.result_type(a, b), xp.floating):
            return (xp.mod(a, b),)
        # Python's float modulo, the sign of the divisor's, from fmod: CuPy's mod gives NaN for a
        # finite dividend over an infinite divisor (3 mod inf is 3, -1 mod inf is inf).
        r = xp.fmod(a, b)
        r = xp.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)
        return (xp.where(r == 0, xp.copysign(xp.zeros_like(r), b), r).astype(r.dtype, copy=False),)
    return mod


def make_bitshift(n: NodeInfo) -> Kernel:
    direction = n.attr("direction")
    if direction not in ("LEFT", "RIGHT"):
        raise Unsupported(f"direction={direction!r}")
    fn = n.xp.left_shift if direction == "LEFT" else n.xp.right_shift
    return lambda a, b: (fn(a, b),)


def make_where(n: NodeInfo) -> Kernel:
    xp = n.xp
    return lambda c, a, b: (xp.where(c, a, b),)


def make_cast(n: NodeInfo) -> Kernel:
    to = dtype_of(n.attr("to"), "Cast to")
    if n.xp is not np and gpu.kernels_enabled() and to.name in ("float32", "bfloat16"):
        def cast(x):  # float32 <-> bfloat16 by parc's kernel (`gpu.cast_bfloat16`) where it applies
            if x.dtype == to:
                return (x,)
            y = gpu.cast_bfloat16(n.xp, x, to)
            return (x.astype(to, copy=False) if y is None else y,)
        return cast
    return lambda x: (x.astype(to, copy=False),)


def make_castlike(n: NodeInfo) -> Kernel:
    return lambda x, like: (x.astype(like.dtype, copy=False),)


def make_clip(n: NodeInfo) -> Kernel:
    xp = n.xp
    if n.opset < 11:
        lo, hi = n.attr("min", -math.inf), n.attr("max", math.inf)
        return lambda x: (xp.minimum(xp.maximum(x, lo), hi).astype(x.dtype, copy=False),)

    def clip(x, lo=None, hi=None):
        if lo is not None:
            x = xp.maximum(x, lo)
        if hi is not None:
            x = xp.minimum(x, hi)  # min > max gives max, as ONNX says
        return (x,)
    return clip


def make_sigmoid(n: NodeInfo) -> Kernel:
    expit = special(n.xp).expit
    return lambda x: (expit(x).astype(x.dtype, copy=False),)


def make_erf(n: NodeInfo) -> Kernel:
    erf = special(n.xp).erf
    return lambda x: (erf(x).astype(x.dtype, copy=False),)


def make_gelu(n: NodeInfo) -> Kernel:
    xp, approximate = n.xp, n.attr("approximate", "none")
    if approximate == "tanh":
        c = math.sqrt(2 / math.pi)
        return lambda x: (0.5 * x * (1 + xp.tanh(c * (x + 0.044715 * x ** 3))),)
    if approximate != "none":
        raise Unsupported(f"approximate={approximate!r}")
    erf = special(xp).erf
    return lambda x: (0.5 * x * (1 + erf(x / math.sqrt(2)).astype(x.dtype, copy=False)),)


def make_isinf(n: NodeInfo) -> Kernel:
    xp, neg, pos = n.xp, n.attr("detect_negative", 1), n.attr("detect_positive", 1)

    def isinf(x):
        found = xp.isinf(x)
        if not neg:
            found &= x > 0
        if not pos:
            found &= x < 0
        return (found,)
    return isinf


def _activation(op: str, n: NodeInfo) -> Kernel:
    """The activations with float attributes (defaults as the ONNX spec gives them)."""
    xp, a = n.xp, n.attrs
    if op == "LeakyRelu":
        alpha = a.get("alpha", 0.01)
        return lambda x: (xp.where(x < 0, x * alpha, x),)
    if op == "Elu":
        alpha = a.get("alpha", 1.0)
        return lambda x: (xp.where(x < 0, alpha * xp.expm1(x), x),)
    if op == "Selu":
        alpha, gamma = a.get("alpha", 1.67326319217681884765625), a.get("gamma", 1.05070102214813232421875)
        return lambda x: (gamma * xp.where(x <= 0, alpha * xp.expm1(x), x),)
    if op == "Celu":
        alpha = a.get("alpha", 1.0)
        return lambda x: (xp.maximum(x, 0) + xp.minimum(0, alpha * xp.expm1(x / alpha)),)
    if op == "ThresholdedRelu":
        alpha = a.get("alpha", 1.0)
        return lambda x: (xp.where(x > alpha, x, 0).astype(x.dtype, copy=False),)
    if op == "HardSigmoid":
        alpha, beta = a.get("alpha", 0.2), a.get("beta", 0.5)
        return lambda x: (xp.clip(x * alpha + beta, 0, 1),)
    if op == "Shrink":
        bias, lambd = a.get("bias", 0.0), a.get("lambd", 0.5)
        return lambda x: (xp.where(x < -lambd, x + bias, xp.where(x > lambd, x - bias, 0)).astype(
            x.dtype, copy=False),)
    assert op == "Swish"
    alpha, expit = a.get("alpha", 1.0), special(xp).expit
    return lambda x: (x * expit(x * alpha).astype(x.dtype, copy=False),)


def make_prelu(n: NodeInfo) -> Kernel:
    xp = n.xp
    return lambda x, slope: (xp.where(x < 0, x * slope, x),)


KERNELS: dict[str, Maker] = {
    **{op: _unary(fn) for op, fn in _UNARY.items()},
    **{op: _binary(fn) for op, fn in _BINARY.items()},
    **{op: _variadic(op) for op in _VARIADIC},
    **{op: functools.partial(_activation, op) for op in
       ("LeakyRelu", "Elu", "Selu", "Celu", "ThresholdedRelu", "HardSigmoid", "Shrink", "Swish")},
    "Div": make_div, "Pow": make_pow, "Mod": make_mod, "BitShift": make_bitshift,
    "Where": make_where, "Cast": make_cast, "CastLike": make_castlike, "Clip": make_clip,
    "Sigmoid": make_sigmoid, "Erf": make_erf, "Gelu": make_gelu, "IsInf": make_isinf,
    "PRelu": make_prelu,
}
