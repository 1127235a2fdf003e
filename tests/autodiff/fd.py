"""Finite-difference checks of parc's gradients, in float64.

`check_op` builds a one-node model whose differentiable inputs (`P`) are initializers, so the
importer makes them parameters, and appends the loss `sum_i ReduceSum(y_i * R_i)` with random
fixed R_i. parc's gradients (import, `differentiate`, export) are run and compared with central
finite differences of the same loss, computed by the same runtime: along random directions, and
element by element when the parameters are small. A float32 copy of the gradient graph is also
run in onnxruntime (what training runs), against the float64 gradients with a loose tolerance.

`to_float64` turns a float32 model (the zoo's) into a float64 one for whole-graph checks.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from parc.autodiff import differentiate
from parc.ir import from_model, to_onnx
from parc.ir.shapes import infer_types

ORT = "ort"  # onnxruntime, CPU
REF = "ref"  # onnx.reference.ReferenceEvaluator: for ops onnxruntime has no float64 kernel for


@dataclass
class P:
    """A parameter input: a float initializer whose gradient is checked."""

    value: np.ndarray


@dataclass
class Fed:
    """A data input fed at run time (indices that are no constant), not a parameter."""

    value: np.ndarray


Input = P | Fed | np.ndarray | None  # arrays are constants (shapes, indices, bounds); None: omitted


def feeds_of(inputs: Sequence[Input]) -> dict[str, np.ndarray]:
    return {f"f{i}": np.asarray(a.value) for i, a in enumerate(inputs) if isinstance(a, Fed)}


# -- running models ---------------------------------------------------------------------------

def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    ort.set_default_logger_severity(3)  # expected failures (unsupported forms) need no log
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


class Erf(OpRun):
    """onnx's reference Erf rounds to float32; finite differences need float64."""

    op_domain = ""

    def _run(self, x):
        return (np.vectorize(math.erf, otypes=[x.dtype])(x) if x.size else x.copy(),)


class Gelu(OpRun):
    """The reference Gelu's function body calls float32 Erf; this one is float64-exact."""

    op_domain = ""

    def _run(self, x, approximate="none"):
        if approximate == "tanh":
            c = math.sqrt(2 / math.pi)
            return (0.5 * x * (1 + np.tanh(c * (x + 0.044715 * x**3))),)
        return (0.5 * x * (1 + Erf._run(self, x / math.sqrt(2))[0]),)


def _explicit_pads(auto_pad, pads, spatial, kernel, strides, dilations):
    """Conv's pads with auto_pad resolved as the ONNX spec says (SAME: ceil(in / stride) out)."""
    r = len(spatial)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for i in range(r):
            out = -(-spatial[i] // strides[i])
            total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - spatial[i])
            begin.append(total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
            end.append(total - begin[-1])
        return begin + end
    if auto_pad == "VALID" or pads is None:
        return [0] * (2 * r)
    return list(pads)


class Conv(OpRun):
    """float64 Conv for the reference runtime (any group, stride, dilation, padding)."""

    op_domain = ""

    def _run(self, x, w, b=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
             pads=None, strides=None):
        r = x.ndim - 2
        kernel = w.shape[2:]
        strides, dilations = strides or [1] * r, dilations or [1] * r
        pads = _explicit_pads(auto_pad, pads, x.shape[2:], kernel, strides, dilations)
        xp = np.pad(x, [(0, 0), (0, 0)] + [(pads[i], pads[i + r]) for i in range(r)])
        out = [(xp.shape[2 + i] - (kernel[i] - 1) * dilations[i] - 1) // strides[i] + 1 for i in range(r)]
        n, c, m = x.shape[0], x.shape[1], w.shape[0]
        cg, mg = c // group, m // group
        y = np.zeros((n, m, *out), dtype=x.dtype)
        for k in np.ndindex(*kernel):
            sl = tuple(slice(k[i] * dilations[i], k[i] * dilations[i] + (out[i] - 1) * strides[i] + 1, strides[i])
                       for i in range(r))
            patch = xp[(slice(None), slice(None), *sl)]
            for g in range(group):
                y[:, g * mg:(g + 1) * mg] += np.einsum("nc...,mc->nm...", patch[:, g * cg:(g + 1) * cg],
                                                       w[(slice(g * mg, (g + 1) * mg), slice(None), *k)])
        if b is not None:
            y += b.reshape((1, m) + (1,) * r)
        return (y,)


class ConvTranspose(OpRun):
    """float64 ConvTranspose for the reference runtime (onnx 1.23's fails with groups and
    mis-sizes some dilated outputs); explicit pads or VALID only."""

    op_domain = ""

    def _run(self, x, w, b=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
             output_padding=None, output_shape=None, pads=None, strides=None):
        assert auto_pad in ("NOTSET", "VALID") and output_shape is None
        r = x.ndim - 2
        kernel = w.shape[2:]
        strides, dilations = strides or [1] * r, dilations or [1] * r
        pads = pads if pads is not None and auto_pad == "NOTSET" else [0] * (2 * r)
        output_padding = output_padding or [0] * r
        n, c, mg = x.shape[0], x.shape[1], w.shape[1]
        cg = c // group
        full = [strides[i] * (x.shape[2 + i] - 1) + output_padding[i] + (kernel[i] - 1) * dilations[i] + 1
                for i in range(r)]
        y = np.zeros((n, mg * group, *full), dtype=x.dtype)
        for k in np.ndindex(*kernel):
            sl = tuple(slice(k[i] * dilations[i], k[i] * dilations[i] + (x.shape[2 + i] - 1) * strides[i] + 1,
                             strides[i]) for i in range(r))
            for g in range(group):
                y[(slice(None), slice(g * mg, (g + 1) * mg), *sl)] += np.einsum(
                    "nc...,cm->nm...", x[:, g * cg:(g + 1) * cg], w[(slice(g * cg, (g + 1) * cg), slice(None), *k)])
        y = y[(slice(None), slice(None), *(slice(pads[i], full[i] - pads[i + r]) for i in range(r)))]
        if b is not None:
            y = y + b.reshape((1, -1) + (1,) * r)
        return (y,)


class MaxPool(OpRun):
    """onnx 1.23's reference MaxPool gives wrong Indices for stride 1: run onnxruntime's
    (it has a float64 kernel) on this one node instead."""

    op_domain = ""

    def _run(self, x, **attrs):
        key = (x.dtype.str, x.shape)
        cache = self.__dict__.setdefault("_sessions", {})
        if key not in cache:
            node = copy.deepcopy(self.onnx_node)
            del node.input[1:]
            g = helper.make_graph([node], "maxpool", [helper.make_tensor_value_info(
                node.input[0], helper.np_dtype_to_tensor_dtype(x.dtype), list(x.shape))],
                [onnx.ValueInfoProto(name=o) for o in node.output if o])
            m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
            cache[key] = _session(m)
        outs = cache[key].run(None, {self.onnx_node.input[0]: x})
        return tuple(outs) if len(self.onnx_node.output) > 1 else (outs[0],)


class GlobalMaxPool(OpRun):
    """onnx 1.23's reference GlobalMaxPool reduces the wrong axes of 3-D inputs."""

    op_domain = ""

    def _run(self, x):
        return (x.max(axis=tuple(range(2, x.ndim)), keepdims=True),)


# float64 kernels replacing onnx 1.23's reference ones (imprecise or wrong for these cases)
REF_KERNELS = [Erf, Gelu, Conv, ConvTranspose, MaxPool, GlobalMaxPool]


class Runner:
    """A model prepared once, run many times with different feeds."""

    def __init__(self, model: onnx.ModelProto, runtime: str) -> None:
        self.runtime = runtime
        self.impl = _session(model) if runtime == ORT else ReferenceEvaluator(model, new_ops=REF_KERNELS)

    def __call__(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self.runtime == ORT:
            return self.impl.run(None, feeds)
        with np.errstate(all="ignore"):
            return [np.asarray(a) for a in self.impl.run(None, feeds)]


def params_as_inputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """The model with the named initializers turned into graph inputs (to feed perturbed values)."""
    m = copy.deepcopy(model)
    keep, moved = [], []
    for t in m.graph.initializer:
        (moved if t.name in names else keep).append(t)
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    m.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in moved)
    return m


def parc_gradients(model: onnx.ModelProto, names: Sequence[str], runtime: str = ORT,
                   loss: str | None = None, feeds: dict[str, np.ndarray] | None = None,
                   check: bool = True) -> tuple[float, dict[str, np.ndarray]]:
    """Import `model`, differentiate its loss (the first output, or `loss`) w.r.t. the named
    initializers, export, run; returns the loss and the gradients."""
    graph = from_model(model)
    loss_v = next(v for v in graph.outputs if v.name == loss) if loss else graph.outputs[0]
    params = [graph.constants[n] for n in names]
    grads = differentiate(graph, loss_v, params)
    missing = [n for n in names if n not in grads]
    assert not missing, f"no gradient for {missing}"
    outs = [loss_v]
    for n in names:  # an Identity per gradient: outputs may not repeat or be initializers
        node = graph.add_node("Identity", [grads[n]], name=graph.names.fresh("grad_out"),
                              output_names=[graph.names.fresh(f"{n}.grad")])
        infer_types(node, graph.opset)
        outs.append(node.outputs[0])
    graph.outputs = outs
    graph.dead_code_elimination()
    exported = to_onnx(graph)
    if check:
        onnx.checker.check_model(exported, full_check=True)
    results = Runner(exported, runtime)(feeds or {})
    for n, v, r in zip(names, outs[1:], results[1:]):
        assert r.shape == tuple(v.shape), (n, r.shape, v.shape)
    return float(results[0]), dict(zip(names, results[1:]))


class LossFn:
    """The loss of a model as a function of some of its initializers (by name)."""

    def __init__(self, model: onnx.ModelProto, names: Sequence[str], runtime: str = ORT,
                 loss: str | None = None, feeds: dict[str, np.ndarray] | None = None) -> None:
        m = params_as_inputs(model, names)
        if loss is not None:
            keep = [o for o in m.graph.output if o.name == loss]
            del m.graph.output[:]
            m.graph.output.extend(keep)
        self.run = Runner(m, runtime)
        self.feeds = dict(feeds or {})
        self.dtypes = {i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in m.graph.input}
        self.loss_dtype = helper.tensor_dtype_to_np_dtype(m.graph.output[0].type.tensor_type.elem_type)

    def __call__(self, values: dict[str, np.ndarray]) -> float:
        values = {k: np.asarray(a, self.dtypes[k]) for k, a in values.items()}
        return float(np.asarray(self.run({**self.feeds, **values})[0]).reshape(-1)[0])


def fd_directional(f: LossFn, x: dict[str, np.ndarray], v: dict[str, np.ndarray], h: float,
                   noise: list[float] | None = None) -> float:
    """d/dt f(x + t v) at 0: central differences with one Richardson step (error O(h^4)).
    Appends to `noise` the rounding error to expect (what the loss's last bits can change)."""
    magnitude = []

    def central(s: float) -> float:
        plus = f({k: x[k] + s * v[k] for k in x})
        minus = f({k: x[k] - s * v[k] for k in x})
        magnitude.append(max(abs(plus), abs(minus)) / s)
        return (plus - minus) / (2 * s)

    value = (4 * central(h / 2) - central(h)) / 3
    if noise is not None:
        eps = float(np.finfo(f.loss_dtype).eps)
        noise.append(8 * eps * max(magnitude))
    return value


def fd_full(f: LossFn, x: dict[str, np.ndarray], h: float) -> tuple[dict[str, np.ndarray], float]:
    """Every partial derivative by central differences (small tensors only), and the norm of
    their expected rounding errors."""
    out, noise = {}, []
    for k, a in x.items():
        g = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            e = np.zeros_like(a)
            e[i] = 1
            g[i] = fd_directional(f, x, {kk: (e if kk == k else np.zeros_like(vv)) for kk, vv in x.items()}, h,
                                  noise)
        out[k] = g
    return out, float(np.linalg.norm(noise))


def random_directions(rng: np.random.Generator, x: dict[str, np.ndarray], n: int) -> list[dict[str, np.ndarray]]:
    """Unit directions over all of `x` at once."""
    out = []
    for _ in range(n):
        v = {k: rng.standard_normal(a.shape) for k, a in x.items()}
        norm = np.sqrt(sum(float(np.sum(d * d)) for d in v.values())) or 1.0
        out.append({k: d / norm for k, d in v.items()})
    return out


def assert_directional(grads: dict[str, np.ndarray], f: LossFn, x: dict[str, np.ndarray],
                       rng: np.random.Generator, *, n: int, h: float, rtol: float) -> None:
    gnorm = np.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in grads.values()))
    for v in random_directions(rng, x, n):
        analytic = sum(float(np.sum(grads[k] * v[k])) for k in x)
        noise: list[float] = []
        numeric = fd_directional(f, x, v, h, noise)
        scale = max(abs(analytic), abs(numeric), 1e-2 * gnorm)
        assert abs(analytic - numeric) <= rtol * scale + noise[0], (
            f"directional derivative: parc {analytic:.12g}, finite differences {numeric:.12g} "
            f"(relative error {abs(analytic - numeric) / scale:.3g}, |grad| {gnorm:.3g})")


def assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], rtol: float, what: str,
                 atol: float = 1e-12) -> None:
    for k in want:
        g, w = np.asarray(got[k], np.float64), np.asarray(want[k], np.float64)
        scale = max(float(np.linalg.norm(w)), 1e-8)
        err = float(np.linalg.norm(g - w))
        assert err <= rtol * scale + atol, (
            f"{what} of '{k}': relative error {err / scale:.3g} > {rtol}\n got {g.ravel()[:8]}\nwant {w.ravel()[:8]}")


# -- one-node cases ---------------------------------------------------------------------------

def _tensor(name: str, a: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(a), name)


def op_loss_model(op: str, inputs: Sequence[Input], attrs: dict, n_outputs: int, opset: int,
                  rng: np.random.Generator, float_type=np.float64,
                  loss_outputs: Sequence[int] | None = None, R: list | None = None
                  ) -> tuple[onnx.ModelProto, list[str], list[tuple[int, np.ndarray]]]:
    """`op(inputs)` and the loss sum_i <y_i, R_i> over its float outputs (or `loss_outputs`).

    Returns the model, the parameter names and the R_i (drawn from `rng` unless given)."""
    def cast(a: np.ndarray) -> np.ndarray:
        a = np.asarray(a)
        return a.astype(float_type) if a.dtype == np.float64 else a

    names, inits, params, graph_inputs = [], [], [], []
    first: dict[int, str] = {}  # one P passed twice is one parameter read twice
    for i, a in enumerate(inputs):
        if a is None:
            names.append("")
        elif isinstance(a, Fed):
            names.append(f"f{i}")
            value = np.asarray(a.value)
            graph_inputs.append(helper.make_tensor_value_info(
                f"f{i}", helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)))
        elif isinstance(a, P) and id(a) in first:
            names.append(first[id(a)])
        elif isinstance(a, P):
            first[id(a)] = f"p{i}"
            names.append(f"p{i}")
            params.append(f"p{i}")
            inits.append(_tensor(f"p{i}", cast(a.value)))
        else:
            names.append(f"c{i}")
            inits.append(_tensor(f"c{i}", cast(a)))
    outs = [f"y{j}" for j in range(n_outputs)]
    node = helper.make_node(op, names, outs, **attrs)
    opsets = [helper.make_opsetid("", opset)]

    def model(nodes, outputs, extra=()) -> onnx.ModelProto:
        g = helper.make_graph(nodes, "case", graph_inputs, outputs, initializer=inits + list(extra))
        m = helper.make_model(g, opset_imports=opsets)
        m.ir_version = max(8, helper.find_min_ir_version_for(opsets))
        return m

    if R is None:
        probe = model([node], [onnx.ValueInfoProto(name=o) for o in outs])
        try:
            ys = Runner(probe, ORT)(feeds_of(inputs))
        except Exception:  # no float64 kernel
            ys = Runner(probe, REF)(feeds_of(inputs))
        chosen = loss_outputs if loss_outputs is not None else [
            j for j, y in enumerate(ys) if np.issubdtype(y.dtype, np.floating)]
        R = [(j, rng.standard_normal(ys[j].shape).astype(ys[j].dtype)) for j in chosen]
    nodes, extra, terms = [node], [], []
    loss_type = np.dtype(float_type)
    for j, r in R:
        r = np.asarray(r)
        r = r.astype(float_type) if r.dtype == np.float64 else r  # outputs already float32 stay so
        loss_type = r.dtype
        extra.append(_tensor(f"r{j}", r))
        nodes.append(helper.make_node("Mul", [f"y{j}", f"r{j}"], [f"m{j}"]))
        nodes.append(helper.make_node("ReduceSum", [f"m{j}"], [f"s{j}"], keepdims=0))
        terms.append(f"s{j}")
    nodes.append(helper.make_node("Sum", terms, ["loss"]) if len(terms) > 1
                 else helper.make_node("Identity", terms, ["loss"]))
    out = helper.make_tensor_value_info("loss", helper.np_dtype_to_tensor_dtype(loss_type), [])
    return model(nodes, [out], extra), params, R


def check_op(op: str, inputs: Sequence[Input], *, n_outputs: int = 1, opset: int = 18,
             runtime: str = ORT, rtol: float = 1e-6, f32: bool = True, f32_rtol: float = 1e-3,
             seed: int = 0x5EED, loss_outputs: Sequence[int] | None = None, directions: int = 2,
             full_fd_max: int = 40, h: float = 1e-3, linear: bool = False, check: bool = True,
             f64: bool = True, **attrs) -> dict[str, np.ndarray]:
    """Check parc's gradient of `op` against finite differences; returns the gradients.

    runtime: ORT for float64 in onnxruntime; REF where onnxruntime has no float64 kernel for
    the op or for an op its gradient uses. f32: also run the float32 gradient graph in
    onnxruntime and compare with the float64 gradients (relative `f32_rtol`). linear: the op
    is linear in its parameters, so onnxruntime's own float32 forward gives exact differences
    with a unit step; compared with the float64 gradient, this checks that the reference
    runtime and onnxruntime agree on the op (when `runtime` is REF). f64=False skips the float64
    stage (no runtime evaluates the op in float64): only a linear op can then be checked.
    """
    rng = np.random.default_rng(seed)
    model, names, R = op_loss_model(op, inputs, attrs, n_outputs, opset, rng, np.float64 if f64 else np.float32,
                                    loss_outputs=loss_outputs)
    assert names, "a case needs at least one parameter"
    x = {n: np.asarray(inputs[int(n[1:])].value, np.float64) for n in names}  # type: ignore[union-attr]
    grads: dict[str, np.ndarray] = {}
    feeds = feeds_of(inputs)
    if f64:
        _, grads = parc_gradients(model, names, runtime, check=check, feeds=feeds)
        f = LossFn(model, names, runtime, feeds=feeds)
        assert_directional(grads, f, x, rng, n=directions, h=h, rtol=rtol)
        if sum(a.size for a in x.values()) <= full_fd_max:
            numeric, noise = fd_full(f, x, h)
            assert_close(grads, numeric, rtol, "gradient vs elementwise finite differences", noise)
    else:
        assert linear and f32, "without float64, only linear ops can be checked (in float32)"
    if f32:
        m32, _, _ = op_loss_model(op, inputs, attrs, n_outputs, opset, rng, np.float32, R=R)
        _, g32 = parc_gradients(m32, names, ORT, check=check, feeds=feeds)
        if f64:
            assert_close(g32, grads, f32_rtol, "float32 onnxruntime gradient vs float64")
        else:
            grads = {k: g.astype(np.float64) for k, g in g32.items()}
        if linear:
            f32_loss = LossFn(m32, names, ORT, feeds=feeds)
            x32 = {k: a.astype(np.float32) for k, a in x.items()}
            for v in random_directions(rng, x, directions):
                v32 = {k: d.astype(np.float32) for k, d in v.items()}
                numeric = (f32_loss({k: x32[k] + v32[k] for k in x}) - f32_loss({k: x32[k] - v32[k] for k in x})) / 2
                analytic = sum(float(np.sum(grads[k] * v32[k])) for k in x)
                gnorm = np.sqrt(sum(float(np.sum(g ** 2)) for g in grads.values()))
                assert abs(numeric - analytic) <= f32_rtol * max(abs(analytic), 1e-2 * gnorm), (
                    f"float32 onnxruntime forward differences {numeric:.7g} vs parc {analytic:.7g}")
    return grads


# -- whole models -----------------------------------------------------------------------------

_F, _D = TensorProto.FLOAT, TensorProto.DOUBLE


def _double_tensor(t: onnx.TensorProto) -> onnx.TensorProto:
    if t.data_type != _F:
        return t
    out = numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name)
    return out


def _double_type(tp: onnx.TypeProto) -> None:
    if tp.HasField("tensor_type") and tp.tensor_type.elem_type == _F:
        tp.tensor_type.elem_type = _D


def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model computing in float64: float32 initializers, inputs, outputs, value_info, Cast
    targets, and tensor attributes (Constant, ConstantOfShape values) become float64."""
    m = copy.deepcopy(model)
    g = m.graph
    for i, t in enumerate(g.initializer):
        g.initializer[i].CopyFrom(_double_tensor(t))
    for vi in (*g.input, *g.output, *g.value_info):
        _double_type(vi.type)
    for n in g.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                a.t.CopyFrom(_double_tensor(a.t))
            elif a.type == onnx.AttributeProto.TENSORS:
                for j, t in enumerate(a.tensors):
                    a.tensors[j].CopyFrom(_double_tensor(t))
            elif n.op_type in ("Cast", "RandomNormal", "RandomUniform", "EyeLike") and a.name in ("to", "dtype") \
                    and a.i == _F:
                a.i = _D
    return m


def with_initializers(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The model with the named initializers replaced (same dtype)."""
    m = copy.deepcopy(model)
    for t in m.graph.initializer:
        if t.name in values:
            old = numpy_helper.to_array(t)
            t.CopyFrom(numpy_helper.from_array(np.asarray(values[t.name], old.dtype), t.name))
    return m


def uses_op_without_float64_kernel(model: onnx.ModelProto) -> bool:
    """Whether onnxruntime cannot run this float64 model on CPU (Conv, Erf, pools...)."""
    try:
        _session(model)
    except Exception:
        return True
    return False
